"""Bounded branch memory (``branch_chunk_size``): each chunk of the B*K branch rows is checkpointed as
a whole, so what a train forward keeps for the backward does not grow with K, and every gradient equals
the unchunked path (1e-5): all six reconstruction terms, the KL, the posterior entropy, the
inter-latent divergence (non-linear across branches) and the router's batch-level terms.

Shape legend: B examples, K branches (or Gaussian samples), N supervised span.
"""

from __future__ import annotations

import pytest
import torch

from zcvae.core.losses import ReconstructionLossConfig
from zcvae.model.config import ModelConfig
from zcvae.core.objective import AuxiliaryWeights, marginal_router_terms, per_example_objective

ATOL = 1e-5
X_LENGTHS, Y_LENGTHS = (1, 7, 3, 5), (6, 2, 9, 1)
RECON = ReconstructionLossConfig(
    reconstruction_weight=1.0, distribution_normalized_reconstruction_weight=0.5,
    example_inverse_surprisal_weighted_reconstruction_weight=0.3, token_weighted_reconstruction_weight=0.7,
    normalized_concentration_corrected_token_weighted_reconstruction_weight=0.4,
    normalized_inverse_surprisal_token_weighted_reconstruction_weight=0.2,
    token_weight_alpha=0.5,
)
AUX = AuxiliaryWeights(posterior_entropy=0.1, router_support=0.2, router_marginal_kl=0.3, inter_latent_divergence=0.5, posterior_variance=0.1)


@pytest.fixture
def build(hf_backbone, perturbed_model):
    """``build(**model_config) -> (model, batch)``: a perturbed model on the tiny Llama and the ragged batch above."""
    return lambda **cfg: perturbed_model(hf_backbone("llama"), ModelConfig(**cfg), lengths=zip(X_LENGTHS, Y_LENGTHS))


def step(model, batch, *, chunk, checkpointing: bool = False, **kw):
    """The trainer's objective for one micro-batch -> (loss, terms, grads)."""
    model.config.branch_chunk_size = chunk
    hf = model.peft_model.get_base_model()
    if checkpointing:
        hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    else:
        hf.gradient_checkpointing_disable()
    model.zero_grad(set_to_none=True)
    with torch.no_grad():
        ref = model.reference(batch)[0]
    out = model.train_forward(batch, **kw)
    terms = per_example_objective(out, ref_nll_BN=ref, c_base=0.8, recon_config=RECON, kl_weight=0.7, aux=AUX)
    loss = terms["loss"].sum() / len(batch)
    if out.posterior is not None:
        local_q = (out.posterior * terms["valid"][:, None]).sum(0)
        term, _ = marginal_router_terms(local_sum_q_K=local_q, global_sum_q_K=local_q.detach(), global_count=terms["valid"].sum(), aux=AUX)
        loss = loss + term
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    return loss.detach(), {k: v.detach() for k, v in terms.items()}, grads


def assert_same(a, b):
    torch.testing.assert_close(a[0], b[0], atol=ATOL, rtol=ATOL)
    for name in a[1]:
        torch.testing.assert_close(a[1][name], b[1][name], atol=ATOL, rtol=ATOL, msg=name)
    assert a[2].keys() == b[2].keys()
    for name, g in b[2].items():
        assert g.abs().sum() > 0, f"{name}: zero gradient, the comparison would be vacuous"
        torch.testing.assert_close(a[2][name], g, atol=ATOL, rtol=ATOL, msg=name)


@pytest.mark.parametrize("share", [True, False])
@pytest.mark.parametrize("latent", ["discrete", "continuous"])
def test_chunked_branches_give_the_unchunked_gradients(build, latent, share):
    cfg = dict(num_latents=3) if latent == "discrete" else dict(latent_type="continuous", latent_dim=4, num_latent_samples=3)
    model, batch = build(share_x_prefix=share, **cfg)
    kw = {"latent_noise": torch.randn(len(batch), 3, 4, generator=torch.Generator().manual_seed(2))} if latent == "continuous" else {}
    full = step(model, batch, chunk=None, **kw)
    assert full[1]["inter_latent_divergence"].abs().sum() > 0
    for chunk in (1, 5):  # 5 splits an example's branches over two chunks
        assert_same(step(model, batch, chunk=chunk, **kw), full)
    # checkpointing on, no chunk size: one chunk (layer checkpoints bound memory), still exact
    model.config.branch_chunk_size = None
    ckpt = step(model, batch, chunk=None, checkpointing=True, **kw)
    assert model.branch_chunk_rows() is None
    assert_same(ckpt, full)
    assert_same(step(model, batch, chunk=2, checkpointing=True, **kw), full)


def saved_bytes(model, batch) -> int:
    """Bytes of the tensors a train forward keeps for its backward (outside checkpointed regions)."""
    seen: dict[int, int] = {}

    def pack(t):
        seen[id(t)] = t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model.train_forward(batch)
    del out
    return sum(seen.values())


def test_kept_activations_do_not_grow_with_k(build):
    """K = 8 with chunks of B rows keeps about what K = 1 keeps; unchunked it keeps ~K times more."""
    kept = {}
    for K, chunk in ((1, None), (8, None), (8, len(X_LENGTHS))):
        model, batch = build(num_latents=K, branch_chunk_size=chunk)
        kept[(K, chunk)] = saved_bytes(model, batch)
    one, unchunked, chunked = kept[(1, None)], kept[(8, None)], kept[(8, len(X_LENGTHS))]
    assert unchunked > 3 * one, kept
    assert chunked < 1.3 * one, kept
