"""Token NLL at supervised positions only, in chunks (losses.supervised_token_nll and its use in the model)
equals the full-logits path (token_nll on (B, T, V) logits, then gather_span): values and gradients, 1e-5.

Shape legend: B rows, T positions, H hidden size, V vocabulary, N supervised span, n supervised tokens.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import zcvae.model.cvae as model_module
from zcvae.data import build_tokenizer
from zcvae.core.losses import IGNORE_INDEX, gather_span, supervised_token_nll, token_nll
from zcvae.model.config import ModelConfig

ATOL = 1e-5
B, T, H, V = 4, 11, 8, 37


def ragged_labels() -> torch.Tensor:
    """Spans of 5, 1, 0 and 8 supervised tokens at different columns (one row supervises nothing)."""
    labels = torch.full((B, T), IGNORE_INDEX)
    g = torch.Generator().manual_seed(3)
    for row, (start, length) in enumerate([(3, 5), (9, 1), (0, 0), (2, 8)]):
        labels[row, start : start + length] = torch.randint(0, V, (length,), generator=g)
    return labels


class CountingHead(nn.Linear):
    calls = 0

    def forward(self, x):
        CountingHead.calls += 1
        return super().forward(x)


def test_values_and_gradients_equal_full_logits_for_every_chunk_size():
    torch.manual_seed(0)
    head = CountingHead(H, V, bias=True)
    labels = ragged_labels()
    h0 = torch.randn(B, T, H)
    weight_BN = torch.rand(B, 8)  # an arbitrary downstream use of the span

    def run(fn):
        h = h0.clone().requires_grad_(True)
        head.zero_grad()
        span, mask = fn(h)
        (span * weight_BN * mask).sum().backward()
        return span.detach(), mask, h.grad, head.weight.grad.clone(), head.bias.grad.clone()

    full = run(lambda h: gather_span(token_nll(head(h), labels), labels, n_span=8))
    assert full[0].abs().sum() > 0 and full[2].abs().sum() > 0
    for chunk in (None, 1, 3, 13, 100):
        CountingHead.calls = 0
        mine = run(lambda h: supervised_token_nll(h, labels, head, n_span=8, chunk_tokens=chunk))
        assert torch.equal(mine[1], full[1])
        for a, b, name in zip(mine, full, ("nll", "mask", "grad h", "grad W", "grad b")):
            torch.testing.assert_close(a, b, atol=ATOL, rtol=ATOL, msg=f"chunk {chunk}: {name}")
        chunks = -(-14 // chunk) if chunk else 1  # 14 supervised tokens
        # more than one chunk: each chunk's logits are recomputed in the backward (checkpointed)
        assert CountingHead.calls == (2 * chunks if chunks > 1 else 1), (chunk, CountingHead.calls)


def test_no_tensor_of_more_than_a_chunk_of_logits_is_kept_for_backward():
    torch.manual_seed(0)
    head = nn.Linear(H, V)
    labels = ragged_labels()
    h = torch.randn(B, T, H, requires_grad=True)
    saved: list[torch.Size] = []

    def pack(t):
        saved.append(t.shape)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        span, _ = supervised_token_nll(h, labels, head, n_span=8, chunk_tokens=3)
    assert not [s for s in saved if s.numel() > 3 * V and s[-1] == V], saved
    span.sum().backward()
    saved.clear()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):  # the full path keeps (n, V) log-probs
        gather_span(token_nll(head(h), labels), labels, n_span=8)[0].sum()
    assert [s for s in saved if s.numel() >= 14 * V and s[-1] == V]


def test_bad_chunk_size():
    with pytest.raises(ValueError, match="chunk_tokens"):
        supervised_token_nll(torch.zeros(1, 3, H), torch.zeros(1, 3, dtype=torch.long), nn.Linear(H, V), chunk_tokens=0)


# ---------------------------------------------------------------------------------- in the model


@pytest.fixture
def build(hf_backbone, perturbed_model):
    """``build(arch, **model_config) -> (model, batch)``: a perturbed model on four ragged examples."""
    return lambda arch, **cfg: perturbed_model(hf_backbone(arch), ModelConfig(**cfg), lengths=[(1, 6), (7, 2), (3, 9), (5, 1)])


def run(model, batch, *, decoder: bool, **kw):
    model._decoder_ok = decoder  # False: the full-logits path (what a soft-capped LM takes)
    model.zero_grad(set_to_none=True)
    out = model.train_forward(batch, **kw)
    mask = out.mask.float()
    loss = ((out.branch_weights * (out.token_nll * mask[:, None]).sum(-1)).sum(-1) + out.kl + 0.3 * (out.zfree_nll * mask).sum(-1)).mean()
    loss.backward()
    ref = model.reference(batch)[0]
    return out, {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}, ref


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
@pytest.mark.parametrize("share", [False, True])
@pytest.mark.parametrize("latent", ["discrete", "continuous"])
def test_model_supervised_logits_equal_full_logits(build, arch, share, latent, monkeypatch):
    monkeypatch.setattr(model_module, "LOGIT_CHUNK_ELEMENTS", 5 * len(build_tokenizer()) + 60)  # chunks of ~5 tokens
    cfg = dict(num_latents=3) if latent == "discrete" else dict(latent_type="continuous", latent_dim=4, num_z_slots=2, num_latent_samples=2)
    model, batch = build(arch, share_x_prefix=share, **cfg)
    assert model._decoder() is not None, "the check must accept a plain Llama / GPT-2 head"
    kw = {"latent_noise": torch.randn(len(batch), 2, 4, generator=torch.Generator().manual_seed(2))} if latent == "continuous" else {}
    full, g_full, ref_full = run(model, batch, decoder=False, **kw)
    mine, g_mine, ref_mine = run(model, batch, decoder=True, **kw)
    for name in ("token_nll", "zfree_nll", "kl", "branch_weights", "inter_latent_divergence"):
        torch.testing.assert_close(getattr(mine, name), getattr(full, name), atol=ATOL, rtol=ATOL, msg=name)
    torch.testing.assert_close(ref_mine, ref_full, atol=ATOL, rtol=ATOL)
    assert any("lora_B" in n for n in g_full) and any("trainable_tokens_delta" in n or "projection" in n for n in g_full)
    for name, g in g_full.items():
        assert g.abs().sum() > 0, name
        torch.testing.assert_close(g_mine[name], g, atol=ATOL, rtol=ATOL, msg=name)


def test_capped_logits_keep_the_full_path(build):
    model, batch = build("llama", num_latents=2)
    assert model._decoder() is not None
    model._decoder_ok = None  # check again
    model.peft_model.get_base_model().config.final_logit_softcapping = 30.0
    assert model._decoder() is None
    model._decoder_ok = None  # check again
    model.peft_model.get_base_model().config.final_logit_softcapping = None
    hf = model.peft_model.get_base_model()
    plain = hf.forward

    def scaled(*args, **kwargs):  # a logit scale after the head that the config does not name
        out = plain(*args, **kwargs)
        out.logits = out.logits * 0.5
        return out

    hf.forward = scaled
    try:
        assert model._decoder() is None
    finally:
        del hf.forward
