"""ZCVAE around tiny Llama and GPT-2 backbones saved with save_pretrained and loaded from disk (``hf_backbone``)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from zcvae.data import make_examples
from zcvae.core.latent import gaussian_kl
from zcvae.core.losses import gather_span, token_nll
from zcvae.model.config import ModelConfig
from zcvae.model.cvae import ZCVAE
from zcvae.data.encoding import collate, encode_examples


def make_batch(model: ZCVAE, *, num_examples: int = 4, seed: int = 0):
    examples = make_examples("copy", seed=seed, split="train", num_examples=num_examples)
    encoded, report = encode_examples(examples, model.tokenizer, model.tokens, max_length=64, num_z_slots=model.config.num_z_slots)
    assert report.num_kept == num_examples
    return collate(encoded, model.tokens, num_z_slots=model.config.num_z_slots)


def load(hf_backbone, arch: str, *, calibrate: bool = True, **cfg) -> tuple[ZCVAE, object]:
    config = ModelConfig(**cfg)
    model = ZCVAE.from_pretrained(hf_backbone(arch), config)
    batch = make_batch(model)
    if calibrate:
        model.calibrate(batch)
    return model, batch


def objective(out) -> torch.Tensor:
    """A stand-in loss: expected mean token NLL + KL (touches every trainable part)."""
    mean_nll_BK = (out.token_nll * out.mask[:, None]).sum(-1) / out.mask.sum(-1, keepdim=True)
    return ((out.branch_weights * mean_nll_BK).sum(-1) + out.kl).mean()


def adamw(model: ZCVAE, *, weight_decay: float = 0.0, lr: float = 1e-2):
    groups = model.param_groups(lora_lr=lr, latent_lr=lr, weight_decay=weight_decay)
    return torch.optim.AdamW(groups), groups


def train_steps(model, batch, num_steps: int, *, weight_decay: float = 0.0, lr: float = 1e-2):
    opt, groups = adamw(model, weight_decay=weight_decay, lr=lr)
    model.check_trainable(groups)
    for _ in range(num_steps):
        opt.zero_grad()
        loss = objective(model.train_forward(batch))
        assert torch.isfinite(loss)
        loss.backward()
        opt.step()


def perturb_lora(model: ZCVAE, seed: int = 0) -> None:
    """Give LoRA B (zero at init) random values, so adapted and base models differ."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)


def explicit_nll(model: ZCVAE, batch, ids_BS) -> torch.Tensor:
    logits = model.peft_model(input_ids=ids_BS, attention_mask=batch.z_attention_mask).logits
    n = int(batch.num_supervised.max())
    return gather_span(token_nll(logits, batch.z_labels), batch.z_labels, n_span=n)[0]


# ------------------------------------------------------------------------------------------------


def _frozen(module):
    """The frozen matrix under a peft trainable-tokens wrapper (or the module's own weight)."""
    return getattr(module, "base_layer", module).weight


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_reference_equals_base_model_after_training(hf_backbone, arch):
    model, batch = load(hf_backbone, arch, num_latents=2)
    assert model.training and model.peft_model.training
    ref0, mask0 = model.reference(batch)
    # An independent copy of the backbone from disk; the rows that from_pretrained added are copied in
    # (they enter the softmax normaliser), every other weight comes from the file.
    base = AutoModelForCausalLM.from_pretrained(hf_backbone(arch), local_files_only=True)
    old = base.get_input_embeddings().weight.shape[0]
    base.resize_token_embeddings(len(model.tokenizer), mean_resizing=False)
    with torch.no_grad():
        base.get_input_embeddings().weight[old:] = _frozen(model.peft_model.get_input_embeddings())[old:]
        base.get_output_embeddings().weight[old:] = _frozen(model.peft_model.get_output_embeddings())[old:]
    train_steps(model, batch, 2, weight_decay=0.1)

    ref, mask = model.reference(batch)
    base.eval()
    base_logits = base(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    base_nll, base_mask = gather_span(token_nll(base_logits, batch.labels), batch.labels, n_span=ref.shape[1])
    assert torch.equal(mask, base_mask) and torch.equal(mask, mask0)
    torch.testing.assert_close(ref, base_nll, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ref, ref0, atol=1e-6, rtol=0)
    assert not ref.requires_grad
    adapted = model.encode(batch).zfree_nll
    assert (adapted - ref).abs().max() > 1e-3, "the trained (adapted) model should differ from the reference"


def test_gradients_and_frozen_rows_tied_gpt2(hf_backbone):
    model, batch = load(hf_backbone, "gpt2", num_latents=3)
    named = dict(model.named_parameters())
    frozen = {n: p.detach().clone() for n, p in named.items() if not p.requires_grad}
    assert any("wte" in n for n in frozen), "the embedding matrix must stay frozen"
    assert any("lm_head" in n or "wte" in n for n in frozen)
    emb = model.peft_model.get_input_embeddings()
    all_ids = torch.arange(len(model.tokenizer))
    rows0 = emb(all_ids).detach().clone()
    # z rows start as the <znull> row plus noise of norm z_init_noise (0.1) x its norm, each different
    z = torch.tensor(model.tokens.latents)
    offsets = rows0[z] - rows0[model.tokens.znull]
    torch.testing.assert_close(offsets.norm(dim=-1), 0.1 * rows0[model.tokens.znull].norm().expand(3), rtol=1e-4, atol=1e-6)
    assert torch.pdist(offsets).min() > 0

    objective(model.train_forward(batch)).backward()
    groups = {g["name"]: g["params"] for g in model.param_groups(lora_lr=1e-3, latent_lr=1e-2, weight_decay=0.1)}
    lora_b = [p for n, p in named.items() if "lora_B" in n]
    assert lora_b and all(p.grad is not None and p.grad.abs().sum() > 0 for p in lora_b)
    latent = dict(model._latent_named_parameters())
    for name in ("router.posterior_head.weight", "router.prior_head.weight"):
        assert latent[name].grad is not None and latent[name].grad.abs().sum() > 0, name
    delta = [p for n, p in latent.items() if "trainable_tokens_delta" in n]
    assert len(delta) == 1 and delta[0].shape == (3, 32) and delta[0].grad.abs().sum() > 0
    assert all(p.grad is None for n, p in named.items() if not p.requires_grad)
    assert {id(p) for p in groups["latent"]}.isdisjoint({id(p) for p in groups["lora"]})

    model.zero_grad()
    train_steps(model, batch, 3, weight_decay=0.1)
    for n, p in dict(model.named_parameters()).items():
        if n in frozen:
            assert torch.equal(p, frozen[n]), f"frozen parameter {n} changed"
    rows = emb(all_ids).detach()
    keep = torch.ones(len(all_ids), dtype=torch.bool)
    keep[z] = False
    assert torch.equal(rows[keep], rows0[keep]), "a non-z embedding row changed"
    assert (rows[z] - rows0[z]).abs().amax(-1).min() > 0, "every z row should have trained"
    # tied head: z rows of the output head follow the trained input rows
    h = torch.randn(1, 32)
    logits = model.peft_model.get_output_embeddings()(h)
    torch.testing.assert_close(logits[0, z], (h @ rows[z].T)[0])


def test_discrete_branches_equal_loop_chunks_and_decode(hf_backbone):
    model, batch = load(hf_backbone, "llama", num_latents=3)
    perturb_lora(model)
    with torch.no_grad():
        for n, p in model._latent_named_parameters():
            if "trainable_tokens_delta" in n:
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(1)))
        out = model.train_forward(batch)
        assert out.token_nll.shape == (4, 3, int(batch.num_supervised.max()))
        rows = torch.arange(len(batch))
        for k, latent_id in enumerate(model.tokens.latents):
            ids = batch.z_input_ids.clone()
            ids[rows, batch.z_slot_start] = latent_id
            torch.testing.assert_close(out.token_nll[:, k], explicit_nll(model, batch, ids), atol=1e-5, rtol=1e-5)
            # decode writes latent k into the <znull> slot and returns the logits at the last attended position
            logits = model.peft_model(input_ids=ids, attention_mask=batch.z_attention_mask).logits
            last = batch.z_attention_mask.sum(1) - 1
            dec = model.decode(input_ids=batch.z_input_ids, attention_mask=batch.z_attention_mask,
                        slot_start=batch.z_slot_start, latent_index=torch.full((len(batch),), k))
            torch.testing.assert_close(dec, logits[rows, last], atol=1e-5, rtol=1e-5)
        assert (out.inter_latent_divergence > 0).all()
        for chunk in (1, 5):
            model.config.branch_chunk_size = chunk
            torch.testing.assert_close(model.train_forward(batch).token_nll, out.token_nll, atol=1e-5, rtol=1e-5)


def test_discrete_multi_slot_branches_equal_loop_chunks_and_decode(hf_backbone):
    """--num-z-slots M for the discrete latent: value k writes its own M tokens into the M slots."""
    model, batch = load(hf_backbone, "llama", num_latents=3, num_z_slots=2)
    slots = model.tokens.latent_slots
    assert len(slots) == 3 and all(len(s) == 2 for s in slots) and len(set(model.tokens.latents)) == 6
    assert model.tokenizer.convert_ids_to_tokens(list(slots[1])) == ["<z_1_1>", "<z_1_2>"]
    perturb_lora(model)
    with torch.no_grad():
        for n, p in model._latent_named_parameters():
            if "trainable_tokens_delta" in n:
                assert p.shape == (6, 32)
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(1)))
        out = model.train_forward(batch)
        assert out.token_nll.shape == (4, 3, int(batch.num_supervised.max()))
        rows = torch.arange(len(batch))
        for k, ids_M in enumerate(slots):
            ids = batch.z_input_ids.clone()
            assert (ids[rows, batch.z_slot_start + 1] == model.tokens.znull).all()
            for m, latent_id in enumerate(ids_M):
                ids[rows, batch.z_slot_start + m] = latent_id
            assert (ids[rows, batch.z_slot_start + 2] == model.tokens.z_close).all()
            torch.testing.assert_close(out.token_nll[:, k], explicit_nll(model, batch, ids), atol=1e-5, rtol=1e-5)
            logits = model.peft_model(input_ids=ids, attention_mask=batch.z_attention_mask).logits
            last = batch.z_attention_mask.sum(1) - 1
            dec = model.decode(input_ids=batch.z_input_ids, attention_mask=batch.z_attention_mask,
                        slot_start=batch.z_slot_start, latent_index=torch.full((len(batch),), k))
            torch.testing.assert_close(dec, logits[rows, last], atol=1e-5, rtol=1e-5)
        # both slots matter: changing only the second token of value 0 changes its branch
        ids = batch.z_input_ids.clone()
        ids[rows, batch.z_slot_start] = slots[0][0]
        ids[rows, batch.z_slot_start + 1] = slots[1][1]
        assert (explicit_nll(model, batch, ids) - out.token_nll[:, 0]).abs().max() > 1e-4
        for chunk in (1, 5):
            model.config.branch_chunk_size = chunk
            torch.testing.assert_close(model.train_forward(batch).token_nll, out.token_nll, atol=1e-5, rtol=1e-5)


def test_discrete_multi_slot_trains_only_z_rows_tied_gpt2(hf_backbone):
    model, batch = load(hf_backbone, "gpt2", num_latents=2, num_z_slots=3)
    z = torch.tensor(model.tokens.latents)
    assert z.numel() == 6
    emb = model.peft_model.get_input_embeddings()
    all_ids = torch.arange(len(model.tokenizer))
    rows0 = emb(all_ids).detach().clone()
    assert torch.pdist(rows0[z]).min() > 0, "every one of the K*M rows starts different"
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    objective(model.train_forward(batch)).backward()
    delta = [p for n, p in model._latent_named_parameters() if "trainable_tokens_delta" in n]
    assert len(delta) == 1 and delta[0].shape == (6, 32)
    assert (delta[0].grad.abs().sum(-1) > 0).all(), "every slot row of every latent gets a gradient"
    model.zero_grad()
    train_steps(model, batch, 2)
    for n, p in model.named_parameters():
        if n in frozen:
            assert torch.equal(p, frozen[n]), f"frozen parameter {n} changed"
    rows = emb(all_ids).detach()
    keep = torch.ones(len(all_ids), dtype=torch.bool)
    keep[z] = False
    assert torch.equal(rows[keep], rows0[keep]), "a non-z embedding row changed"
    assert (rows[z] - rows0[z]).abs().amax(-1).min() > 0, "every z row should have trained"


def test_step0_router_is_uniform_and_batch_independent(hf_backbone):
    for calibrate in (True, False):  # False: lazy calibration at the first train forward
        model, batch = load(hf_backbone, "llama", calibrate=calibrate, num_latents=4)
        out = model.train_forward(batch)
        assert model.router.calibrated
        uniform = torch.full((len(batch), 4), 0.25)
        torch.testing.assert_close(out.posterior, uniform, atol=1e-6, rtol=0)
        torch.testing.assert_close(out.prior, uniform, atol=1e-6, rtol=0)
        torch.testing.assert_close(out.branch_weights, uniform, atol=1e-6, rtol=0)
        assert torch.allclose(out.kl, torch.zeros(len(batch)), atol=1e-6)
    # After training the heads, an example's q does not depend on its micro-batch neighbours.
    train_steps(model, batch, 2)
    with torch.no_grad():
        full = model.encode(batch).posterior_logits
        part = model(batch.select([2, 0]), mode="encode").posterior_logits
    assert (full.softmax(-1) - 0.25).abs().max() > 1e-4, "the posterior should have moved"
    torch.testing.assert_close(part, full[[2, 0]], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_gaussian_loads_trains_and_kl_matches_formula(hf_backbone, arch):
    model, batch = load(hf_backbone, arch, latent_type="continuous", latent_dim=4, num_z_slots=2, num_latent_samples=2)
    B = len(batch)
    noise = torch.randn(B, 2, 4, generator=torch.Generator().manual_seed(0))
    out = model.train_forward(batch, latent_noise=noise)
    assert out.token_nll.shape == (B, 2, int(batch.num_supervised.max()))
    torch.testing.assert_close(out.branch_weights, torch.full((B, 2), 0.5))
    assert torch.allclose(out.kl, torch.zeros(B), atol=1e-6), "KL starts at 0"
    # the soft prompt starts as <znull> + a small offset: close to the <znull> template's NLL
    with torch.no_grad():
        znull = explicit_nll(model, batch, batch.z_input_ids)
    assert (out.token_nll - znull[:, None]).abs().max() < 0.5
    train_steps(model, batch, 2)
    out = model.train_forward(batch, latent_noise=noise)
    mu, lv, pmu, plv = out.mu, out.logvar, out.prior_mu, out.prior_logvar
    hand = 0.5 * (plv - lv + (lv.exp() + (mu - pmu) ** 2) / plv.exp() - 1).sum(-1)
    assert out.kl.abs().max() > 0
    torch.testing.assert_close(out.kl, hand, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(out.posterior_variance, lv.exp().mean(-1))
    torch.testing.assert_close(out.z, mu[:, None] + (0.5 * lv).exp()[:, None] * noise)
    # the same noise gives the same branches (no hidden randomness), decode reproduces a branch row
    with torch.no_grad():
        again = model.train_forward(batch, latent_noise=noise)
        torch.testing.assert_close(again.token_nll, out.token_nll)
        z0 = out.z[:, 0]
        dec = model.decode(input_ids=batch.z_input_ids, attention_mask=batch.z_attention_mask,
                    slot_start=batch.z_slot_start, z=z0)
        assert dec.shape == (B, len(model.tokenizer)) and torch.isfinite(dec).all()


def test_gaussian_standard_normal_prior(hf_backbone):
    model, batch = load(hf_backbone, "llama", latent_type="continuous", latent_dim=3, learned_prior=False)
    assert not any("prior" in n for n, _ in model._latent_named_parameters())
    train_steps(model, batch, 2)
    out = model.encode(batch)
    torch.testing.assert_close(out.kl, gaussian_kl(out.mu, out.logvar))
    assert out.token_nll is None


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_discrete_loads_and_trains_a_step(hf_backbone, arch):
    model, batch = load(hf_backbone, arch, num_latents=2, gradient_checkpointing=True, branch_chunk_size=3)
    before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    train_steps(model, batch, 1)
    changed = [n for n, p in model.named_parameters() if p.requires_grad and not torch.equal(p, before[n])]
    assert any("trainable_tokens_delta" in n for n in changed) and any("lora_B" in n for n in changed)
    assert any("router.posterior_head" in n for n in changed)


def test_check_trainable_names_missing_parameter(hf_backbone):
    model, _ = load(hf_backbone, "llama", num_latents=2)
    groups = model.param_groups(lora_lr=1e-3, latent_lr=1e-2, weight_decay=0.0)
    assert [g["name"] for g in groups] == ["lora", "latent"]
    model.check_trainable(groups)
    head = model.router.prior_head.weight
    params = [p for g in groups for p in g["params"] if p is not head]
    with pytest.raises(RuntimeError, match=r"router\.prior_head\.weight \(not in the optimizer\)"):
        model.check_trainable(params)
    model.router.posterior_head.weight.requires_grad_(False)
    with pytest.raises(RuntimeError, match=r"router\.posterior_head\.weight \(requires_grad=False\)"):
        model.check_trainable([p for g in groups for p in g["params"]])


def test_bad_configuration(hf_backbone, tmp_path):
    with pytest.raises(ValueError, match="latent_type"):
        ModelConfig(latent_type="vq")
    with pytest.raises(ValueError, match="num_latents"):
        ModelConfig(num_latents=0)
    with pytest.raises(ValueError, match="num_z_slots"):
        ModelConfig(latent_type="discrete", num_z_slots=0)
    with pytest.raises(ValueError, match="branch_chunk_size"):
        ModelConfig(branch_chunk_size=0)
    with pytest.raises(ValueError, match="lora_dropout"):
        ModelConfig(lora_dropout=1.0)
    with pytest.raises(ValueError, match="bogus"):
        ModelConfig.from_dict({"num_latents": 2, "bogus": 1})
    assert ModelConfig.from_dict(ModelConfig(num_latents=5).to_dict()).num_latents == 5
    missing = tmp_path / "no_such_backbone"
    with pytest.raises(ValueError, match="no_such_backbone"):
        ZCVAE.from_pretrained(str(missing), ModelConfig())
    with pytest.raises(ValueError, match="lora_target_modules"):
        from zcvae.model.config import default_lora_targets

        default_lora_targets("mamba")
    model, batch = load(hf_backbone, "llama", calibrate=False, num_latents=2)
    with pytest.raises(ValueError, match="mode"):
        model(batch, mode="generate")
    with pytest.raises(ValueError, match="num_z_slots"):
        model(dataclasses.replace(batch, num_z_slots=2), mode="train")
    assert math.isfinite(float(model.reference(batch)[0].sum()))


def test_forward_dispatches_each_mode_to_its_method(hf_backbone):
    """Engines call the wrapped module; ``forward(mode=...)`` must give exactly what the method gives."""
    model, batch = load(hf_backbone, "llama", num_latents=2)
    model.eval()
    with torch.no_grad():
        for name, got in (("reference", model(batch, mode="reference")), ("encode", model(batch, mode="encode"))):
            want = getattr(model, name)(batch)
            want = want if name == "reference" else (want.posterior_logits, want.zfree_nll)
            got = got if name == "reference" else (got.posterior_logits, got.zfree_nll)
            for w, g in zip(want, got):
                torch.testing.assert_close(g, w, atol=0, rtol=0, msg=name)
        out = model(batch, mode="train")
        assert out.token_nll.shape == (len(batch), 2, out.mask.shape[1])
        torch.testing.assert_close(out.token_nll, model.train_forward(batch).token_nll, atol=0, rtol=0)
        rows = dict(input_ids=batch.z_input_ids, attention_mask=batch.z_attention_mask, slot_start=batch.z_slot_start,
                    latent_index=torch.ones(len(batch), dtype=torch.long))
        torch.testing.assert_close(model(mode="decode", **rows), model.decode(**rows), atol=0, rtol=0)
    with pytest.raises(ValueError, match="needs a batch"):
        model(None, mode="encode")


def test_posterior_state_pools_the_y_span_by_hand():
    from zcvae.model.cvae import posterior_state

    h_BTH = torch.arange(2 * 5 * 3, dtype=torch.float32).reshape(2, 5, 3)
    start_B, end_B = torch.tensor([1, 0]), torch.tensor([3, 4])
    torch.testing.assert_close(posterior_state(h_BTH, start_B, end_B, "last"), torch.stack([h_BTH[0, 3], h_BTH[1, 4]]))
    torch.testing.assert_close(posterior_state(h_BTH, start_B, end_B, "mean"), torch.stack([h_BTH[0, 1:4].mean(0), h_BTH[1, 0:5].mean(0)]))
    with pytest.raises(ValueError, match="posterior_pooling"):
        posterior_state(h_BTH, start_B, end_B, "max")
    with pytest.raises(ValueError, match="posterior_pooling"):
        ModelConfig(posterior_pooling="max")


@pytest.mark.parametrize("tie", [False, True])
def test_untied_head_is_seen_on_a_meta_skeleton(tie):
    """A sharded build makes the backbone on meta, where every tensor's data_ptr() is 0: tying must be
    read by identity, or an untied head loses its trainable marker rows (and their gradient)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from zcvae.engines.fsdp2 import parameters_on_meta
    from zcvae.model.build import head_is_tied, trainable_token_indices

    cfg = LlamaConfig(vocab_size=40, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=2, tie_word_embeddings=tie)
    with parameters_on_meta():
        model = LlamaForCausalLM(cfg)
    model.tie_weights()
    assert model.lm_head.weight.is_meta
    assert head_is_tied(model) is tie
    got = trainable_token_indices(model, latents=(30, 31), fresh_markers=[32, 33])
    assert got == ([30, 31, 32, 33] if tie else {"model.embed_tokens": [30, 31, 32, 33], "lm_head": [32, 33]})
