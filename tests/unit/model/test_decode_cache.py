"""The key/value cache of greedy decoding gives the logits and tokens of a full recompute.

ZCVAE.decode(cache=KVCache()) runs the right-padded prompts (with the latent) once, then one token per
row; rows of different prompt lengths leave pad holes in the cache, and rows that stop feed masked
slots. Checked against cache=None on tiny Llama (grouped-query attention) and GPT-2 backbones, for
the discrete latent with one and two z slots, in row chunks, and for the Gaussian soft prompt; and
for the backbone's pretraining report (``generate_y``) on a plain Hugging Face LM.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from zcvae.backbone.stage_eval import generate_y
from zcvae.data import make_examples
from zcvae.model.config import ModelConfig
from zcvae.model.decoding import KVCache, greedy_decode
from zcvae.data.encoding import TemplateLayout, encode_examples

NUM_STEPS = 6


def _decode(model, prompts, slot_R, latent_kw, *, cached: bool, stop_id: int):
    """greedy_decode through model.decode -> (generated, closed, the logits of every forward)."""
    seen = []
    cache = KVCache() if cached else None

    def next_logits(ids_RL, mask_RL):
        logits = model.decode(input_ids=ids_RL, attention_mask=mask_RL, slot_start=slot_R, cache=cache, **latent_kw)
        seen.append(logits)
        return logits

    generated, closed, _ = greedy_decode(next_logits, prompts, num_steps=NUM_STEPS, stop_id=stop_id, pad_id=model.tokens.pad)
    return generated, closed, seen


@pytest.mark.parametrize(
    ("arch", "cfg"),
    [
        ("llama", dict(num_latents=3)),
        ("llama", dict(num_latents=3, num_z_slots=2, branch_chunk_size=2)),
        ("gpt2", dict(num_latents=2)),
        ("llama", dict(latent_type="continuous", latent_dim=4, num_z_slots=2)),
        ("llama", dict(num_latents=3, z_conditioned_norm=True, branch_chunk_size=2)),
        ("gpt2", dict(latent_type="continuous", latent_dim=4, z_conditioned_norm=True)),
    ],
    ids=["llama-discrete", "llama-two-slots-chunked", "gpt2-discrete", "llama-gaussian", "llama-z-norm-chunked", "gpt2-gaussian-z-norm"],
)
def test_cached_decode_equals_a_full_recompute(hf_backbone, perturbed_model, arch, cfg):
    model, _ = perturbed_model(hf_backbone(arch), ModelConfig(**cfg), lengths=[(2, 2), (3, 3)])
    model.eval()
    examples = make_examples("copy", seed=3, split="val", num_examples=5)
    encoded, _ = encode_examples(examples, model.tokenizer, model.tokens, max_length=64, num_z_slots=model.config.num_z_slots)
    layout = TemplateLayout(model.config.num_z_slots)
    prompts, slots, latents = [], [], []
    for ex in encoded:
        for k in range(min(2, model.config.num_latents)):
            prompts.append(layout.zcond_prompt(ex.x_ids, model.tokens))
            slots.append(layout.z_slot_start(len(ex.x_ids)))
            latents.append(k)
    assert len({len(p) for p in prompts}) > 1, "the prompts must differ in length, so the cache has pad holes"
    slot_R = torch.tensor(slots)
    if model.config.latent_type == "discrete":
        latent_kw = {"latent_index": torch.tensor(latents)}
    else:
        latent_kw = {"z": torch.randn(len(prompts), model.config.latent_dim, generator=torch.Generator().manual_seed(0))}

    # stop on the token row 0 emits second, so that some rows stop early and feed masked slots after
    first, _, _ = _decode(model, prompts, slot_R, latent_kw, cached=False, stop_id=-1)
    stop_id = first[0][1]
    full = _decode(model, prompts, slot_R, latent_kw, cached=False, stop_id=stop_id)
    cached = _decode(model, prompts, slot_R, latent_kw, cached=True, stop_id=stop_id)
    assert any(full[1]) and not all(len(g) == len(full[0][0]) for g in full[0]), "some rows must stop before others"
    assert cached[:2] == full[:2]
    assert len(cached[2]) == len(full[2]) == NUM_STEPS
    for step, (a, b) in enumerate(zip(cached[2], full[2])):
        live = [r for r in range(len(prompts)) if step == 0 or len(full[0][r]) + int(full[1][r]) > step]
        torch.testing.assert_close(a[live], b[live], atol=1e-5, rtol=1e-5, msg=f"step {step}")


def test_a_cached_decode_refuses_rows_that_grow_by_more_than_one_token():
    cache = KVCache()
    with pytest.raises(ValueError, match="before the first forward"):
        cache.advance(torch.zeros(1, 3, dtype=torch.long), torch.ones(1, 3))
    cache.start(torch.tensor([[1, 1, 0, 0]]))
    with pytest.raises(ValueError, match="at most one token"):
        cache.advance(torch.zeros(1, 4, dtype=torch.long), torch.ones(1, 4))


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_the_pretraining_reports_cached_decode_equals_a_full_recompute(hf_backbone, perturbed_model, arch):
    model, _ = perturbed_model(hf_backbone(arch), ModelConfig(num_latents=2), lengths=[(2, 2), (3, 3)])
    lm = AutoModelForCausalLM.from_pretrained(hf_backbone(arch)).eval()
    examples = make_examples("copy", seed=4, split="val", num_examples=6)
    encoded, _ = encode_examples(examples, model.tokenizer, model.tokens, max_length=64, num_z_slots=1)
    layout = TemplateLayout(num_z_slots=1)
    got = generate_y(lm, encoded, model.tokens, template="zfree", max_length=64, max_new_tokens=NUM_STEPS)

    def recompute(ids_RL, mask_RL):
        logits = lm(input_ids=ids_RL, attention_mask=mask_RL, use_cache=False).logits
        return logits[torch.arange(ids_RL.shape[0]), mask_RL.sum(1) - 1]

    for ex, y in zip(encoded, got):
        want, _, _ = greedy_decode(recompute, [layout.zfree_prompt(ex.x_ids, model.tokens)], num_steps=NUM_STEPS,
                                   stop_id=model.tokens.y_close, pad_id=model.tokens.pad, lock_step=False)
        assert y == want[0]
