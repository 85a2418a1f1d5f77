"""The shared x-prefix path (ModelConfig.share_x_prefix) equals the full-sequence path.

One model per case; the same batch runs with ``share_x_prefix`` off and on, and every output the
trainer uses (branch token NLL, posterior, prior, KL, z-free NLL, branch weights) and every trainable
gradient (LoRA A/B, z rows, router heads, soft-prompt projection) must agree within 1e-5 in fp32.
The batch is ragged in both x and y, so the prefix has padding holes and the suffixes have padding
at different columns; LoRA B, the z rows and the router heads are perturbed away from their zero or
near-zero initialisation so that every gradient is non-trivial.

Shape legend: B examples, K branches (or Gaussian samples), N supervised span, D latent dimension.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from zcvae.model.config import ModelConfig
from zcvae.model.cvae import ZCVAE

ATOL = 1e-5
X_LENGTHS = (1, 7, 3, 11, 5)  # ragged x: the prefix is right-padded with holes of 0..10 columns
Y_LENGTHS = (6, 2, 9, 4, 1)  # ragged y, uncorrelated with x


@pytest.fixture
def build(hf_backbone, perturbed_model):
    """``build(arch, **model_config) -> (model, batch)``: a perturbed model on the ragged batch above."""
    return lambda arch, **cfg: perturbed_model(hf_backbone(arch), ModelConfig(**cfg), lengths=zip(X_LENGTHS, Y_LENGTHS))


def loss_of(out) -> torch.Tensor:
    """A per-example mean, like the trainer's objective (mean aggregation), touching every output the
    trainer uses with unequal weights so that no term cancels another."""
    mask = out.mask.float()
    n_B = mask.sum(-1)
    recon_B = (out.branch_weights * (out.token_nll * mask[:, None]).sum(-1)).sum(-1) / n_B
    per_example = recon_B + 0.7 * out.kl + 0.3 * (out.zfree_nll * mask).sum(-1) / n_B + 0.1 * out.inter_latent_divergence
    if out.prior_logits is not None:
        per_example = per_example + 0.2 * (out.prior_logits.log_softmax(-1) * torch.arange(out.prior_logits.shape[1])).sum(-1)
    else:
        per_example = per_example + 0.2 * (out.mu * out.prior_mu).sum(-1) + 0.1 * out.logvar.sum(-1)
    return per_example.mean()


def run(model: ZCVAE, batch, *, share: bool, **kw):
    model.config.share_x_prefix = share
    model.zero_grad(set_to_none=True)
    out = model.train_forward(batch, **kw)
    loss_of(out).backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    return out, grads


def assert_same(model: ZCVAE, batch, **kw) -> None:
    plain, g_plain = run(model, batch, share=False, **kw)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # a silent fallback to the plain path would make this test vacuous
        shared, g_shared = run(model, batch, share=True, **kw)
        assert model.prefix_sharing_blocker(batch) is None
    fields = ["token_nll", "branch_weights", "kl", "posterior_entropy", "zfree_nll", "inter_latent_divergence", "mask"]
    fields += ["posterior_logits", "prior_logits"] if plain.posterior_logits is not None else ["mu", "logvar", "prior_mu", "prior_logvar", "z"]
    for name in fields:
        torch.testing.assert_close(getattr(shared, name), getattr(plain, name), atol=ATOL, rtol=ATOL, msg=name)
    assert g_plain.keys() == g_shared.keys()
    kinds = {"lora_A": 0, "lora_B": 0, "trainable_tokens_delta": 0, "router": 0, "projection": 0}
    # one discrete latent: q = p = 1 whatever the heads say, so their gradient is exactly zero
    constant_router = model.config.latent_type == "discrete" and model.config.num_latents == 1
    for name, g in g_plain.items():
        if not (constant_router and name.startswith("router.")):
            assert g.abs().sum() > 0, f"{name}: zero gradient, the comparison would be vacuous"
        torch.testing.assert_close(g_shared[name], g, atol=ATOL, rtol=ATOL, msg=name)
        for kind in kinds:
            kinds[kind] += kind in name
    assert kinds["lora_A"] and kinds["lora_B"] and kinds["router"], kinds
    assert kinds["trainable_tokens_delta" if model.config.latent_type == "discrete" else "projection"], kinds


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
@pytest.mark.parametrize("num_latents", [1, 3])
def test_discrete_shared_prefix_equals_full_path(build, arch, num_latents):
    model, batch = build(arch, num_latents=num_latents)
    assert model.config.share_x_prefix, "sharing is on by default"
    assert_same(model, batch)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_mean_pooled_posterior_shared_prefix_equals_full_path(build, arch):
    """posterior_pooling="mean" pools <y> .. </y>, which sit at other columns on the shared path."""
    model, batch = build(arch, num_latents=3, posterior_pooling="mean")
    assert_same(model, batch)
    last, _ = build(arch, num_latents=3)
    with torch.no_grad():
        # the same weights read a different state: the pooling is really in use
        assert not torch.allclose(model.encode(batch).posterior_logits, last.encode(batch).posterior_logits)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_discrete_multi_slot_shared_prefix_equals_full_path(build, arch):
    """--num-z-slots 2 for the discrete latent: the z section <z> z_k^1 z_k^2 </z> after the cache."""
    model, batch = build(arch, num_latents=3, num_z_slots=2)
    assert_same(model, batch)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
@pytest.mark.parametrize("latent", ["discrete", "continuous"])
def test_z_conditioned_norms_shared_prefix_equals_full_path(build, arch, latent):
    """--z-conditioned-norm: the full path conditions the columns from <z> on, the shared path its whole
    suffix (which starts at <z>); the same columns, so the same outputs and gradients, z_norm's included."""
    cfg = dict(num_latents=3) if latent == "discrete" else dict(latent_type="continuous", latent_dim=4, num_latent_samples=2)
    model, batch = build(arch, z_conditioned_norm=True, branch_chunk_size=4, **cfg)
    kw = {"latent_noise": torch.randn(len(batch), 2, 4, generator=torch.Generator().manual_seed(2))} if latent == "continuous" else {}
    assert_same(model, batch, **kw)
    assert any(n.startswith("z_norm.") for n, p in model.named_parameters() if p.requires_grad)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
@pytest.mark.parametrize("num_samples", [1, 3])
def test_gaussian_shared_prefix_equals_full_path(build, arch, num_samples):
    model, batch = build(arch, latent_type="continuous", latent_dim=4, num_z_slots=2, num_latent_samples=num_samples)
    noise = torch.randn(len(batch), num_samples, 4, generator=torch.Generator().manual_seed(2))
    assert_same(model, batch, latent_noise=noise)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
@pytest.mark.parametrize("latent", ["discrete", "continuous"])
def test_shared_prefix_under_gradient_checkpointing_equals_full_path(build, arch, latent):
    """Activation checkpointing on (non-reentrant, as the engines set it): the shared prefix's keys and
    values are made inside checkpointed layers and every layer is replayed in the backward; loss, q,
    p, KL and every gradient still equal the full path, which is checkpointed too."""
    cfg = dict(num_latents=3) if latent == "discrete" else dict(latent_type="continuous", latent_dim=4, num_z_slots=2, num_latent_samples=2)
    model, batch = build(arch, gradient_checkpointing=True, branch_chunk_size=4, **cfg)
    kw = {"latent_noise": torch.randn(len(batch), 2, 4, generator=torch.Generator().manual_seed(2))} if latent == "continuous" else {}
    assert_same(model, batch, **kw)
    # not vacuous: the attention modules (inside the checkpointed layers) run again in the backward
    calls = {"forward": 0, "backward": 0}
    phase = ["forward"]
    attention = [m for n, m in model.peft_model.named_modules() if n.endswith(("self_attn", "attn")) and not list(m.children()) == []]
    hooks = [m.register_forward_hook(lambda *a: calls.__setitem__(phase[0], calls[phase[0]] + 1)) for m in attention]
    try:
        model.config.share_x_prefix = True
        out = model.train_forward(batch, **kw)
        phase[0] = "backward"
        loss_of(out).backward()
    finally:
        for h in hooks:
            h.remove()
    assert attention and calls["backward"] == calls["forward"] > 0, calls
    # the flags that let the cache through are restored after each call
    from transformers.modeling_layers import GradientCheckpointingLayer

    layers = [m for m in model.peft_model.modules() if isinstance(m, GradientCheckpointingLayer)]
    assert layers and not any(m._can_checkpoint_with_cache for m in layers)
    assert all(m.gradient_checkpointing for m in model.peft_model.modules() if hasattr(m, "gradient_checkpointing"))


def test_shared_prefix_with_chunked_branches(build):
    """Chunks that split an example's K rows (chunk 2 with K = 3) select the right cached prefix."""
    model, batch = build("llama", num_latents=3, branch_chunk_size=2)
    assert_same(model, batch)


def test_positions_match_the_full_rows(build):
    """The suffix rows continue each example's own positions (RoPE sees P_i + j, not P + j), and the
    prefix hidden state at </x> equals the full row's."""
    model, batch = build("llama", num_latents=2)
    calls = []
    base = model._decoder()  # the passes run the decoder; the head is applied at supervised positions
    assert base is not None
    hook = base.register_forward_pre_hook(lambda m, args, kw: calls.append(kw.get("position_ids")), with_kwargs=True)
    try:
        with torch.no_grad():
            model.config.share_x_prefix = True
            model.train_forward(batch)
    finally:
        hook.remove()
    prefix_pos, router_pos, branch_pos = calls  # one prefix, one router suffix, one branch forward
    start_B = batch.x_close_pos + 1
    assert torch.equal(prefix_pos[0], torch.arange(int(start_B.max())))
    assert torch.equal(router_pos[:, 0], start_B)
    assert torch.equal(branch_pos[:, 0], start_B.repeat_interleave(2))
    # h at </x> from the prefix pass == the full z-free pass (the prior's input)
    with torch.no_grad():
        prefix = model._run_prefix(batch)
        h_full, *_ = model._router_states(batch, n_span=int(batch.num_supervised.max()))
    torch.testing.assert_close(prefix.h_prior_BH, h_full, atol=ATOL, rtol=ATOL)


def test_fallbacks_are_named_and_exact(build):
    model, batch = build("llama", num_latents=2)
    model.config.share_x_prefix = False
    assert model.prefix_sharing_blocker(batch) == "share_x_prefix=False"
    model.config.share_x_prefix = True
    model.peft_model.get_base_model().gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    assert model.prefix_sharing_blocker(batch) is None, "checkpointing no longer blocks sharing"
    out_ckpt = model.train_forward(batch)
    model.peft_model.get_base_model().gradient_checkpointing_disable()
    torch.testing.assert_close(model.train_forward(batch).token_nll, out_ckpt.token_nll, atol=ATOL, rtol=ATOL)
    hf = model.peft_model.get_base_model().config
    hf.sliding_window = 4
    assert "sliding-window" in model.prefix_sharing_blocker(batch)
    hf.sliding_window = 4096  # longer than the batch: the window never binds
    assert model.prefix_sharing_blocker(batch) is None
    with pytest.raises(ValueError, match="share_x_prefix"):
        ModelConfig(share_x_prefix="yes")
