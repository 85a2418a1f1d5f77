"""Tiny models shared by the unit tests (through the fixtures of tests/conftest.py) and by the torchrun
workers of tests/distributed, which run outside pytest and import this file directly.

- ``save_hf_backbone(arch, directory)``: a random tiny Llama (grouped-query attention, as real Llama
  checkpoints have) or GPT-2 (output head tied to the input embedding) with the word-level tokenizer,
  saved as ``ZCVAE.from_pretrained`` reads it.
- ``perturbed_model(backbone, config, lengths=...)``: a ZCVAE on such a backbone with LoRA B, the new
  token rows and the router moved off their initialisation (LoRA B starts at 0, so an unperturbed model
  would hide any error in the adapter path), calibrated on a ragged batch of ordinary words.
- ``checkpointed_run(model, batch, cfg, ...)``: every trainable tensor moved, saved as a run directory
  with one complete checkpoint, as the trainer leaves it (for export, load and resume tests).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

import torch

HF_ARCHS = ("llama", "gpt2")
FIRST_WORD_ID = 11  # ids below are the tokenizer's specials and the template markers


def save_hf_backbone(arch: str, directory: Path, *, seed: int = 0) -> Path:
    """Save a seeded random 2-layer, 32-wide ``arch`` model and the word-level tokenizer into ``directory``."""
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    from zcvae.data import build_tokenizer

    tok = build_tokenizer()
    ids = dict(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(seed)
    if arch == "llama":
        # 2 kv heads for 4 query heads: the cache holds grouped keys, as in real Llama checkpoints
        model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                             num_key_value_heads=2, intermediate_size=64, max_position_embeddings=128, **ids))
    elif arch == "gpt2":
        # GPT-2 ties its output head to the input embedding; its dropout (0.1) must be switched off by ZCVAE.
        model = GPT2LMHeadModel(GPT2Config(vocab_size=len(tok), n_embd=32, n_layer=2, n_head=4, n_positions=128, **ids))
    else:
        raise ValueError(f"unknown arch {arch!r}; expected one of {HF_ARCHS}")
    model.save_pretrained(directory)
    tok.save_pretrained(directory)
    return directory


def ragged_batch(model, lengths: Iterable[tuple[int, int]], *, generator: torch.Generator):
    """One example per (len(x), len(y)) in ``lengths``, of random ordinary-word ids, collated for ``model``."""
    from zcvae.data import build_tokenizer
    from zcvae.data.encoding import EncodedExample, collate

    hi = len(build_tokenizer())  # the backbone's words, not the z rows the model adds
    examples = [
        EncodedExample(f"e{i}", tuple(torch.randint(FIRST_WORD_ID, hi, (nx,), generator=generator).tolist()),
                       tuple(torch.randint(FIRST_WORD_ID, hi, (ny,), generator=generator).tolist()))
        for i, (nx, ny) in enumerate(lengths)
    ]
    return collate(examples, model.tokens, num_z_slots=model.config.num_z_slots)


def perturbed_model(backbone: str | Path, config, *, lengths: Iterable[tuple[int, int]], seed: int = 0):
    """-> (ZCVAE, batch): the model of ``config`` on ``backbone`` (init seed 0), its batch drawn with ``seed``,
    LoRA B / new token rows / router / z-conditioned norms moved with ``seed + 1``, then calibrated on the batch.

    The same arguments give the same model and batch in every process (the distributed workers rely on it).
    """
    from zcvae.model.cvae import ZCVAE

    model = ZCVAE.from_pretrained(str(backbone), config, seed=0)
    batch = ragged_batch(model, lengths, generator=torch.Generator().manual_seed(seed))
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.requires_grad and ("lora_B" in name or "trainable_tokens_delta" in name or "router" in name or "z_norm" in name):
                # heads read standardised states of norm ~sqrt(H): keep the logits, mu and logvar O(1); the
                # z-conditioned norms' scales and shifts stay small next to the norms' own unit weights
                p.add_((0.1 if "router" in name or "z_norm" in name else 0.3) * torch.randn(p.shape, generator=g))
    model.calibrate(batch)  # after the change, so the standardised states are O(1)
    return model, batch


def checkpointed_run(model, batch, cfg, *, scale: float, step: int, c_base: dict) -> Path:
    """Calibrate the router on ``batch``, move every trainable tensor of ``model`` by ``scale`` * N(0, 1) (seed 1),
    and save it as the run directory ``cfg.run.output_dir``: a complete checkpoint of ``step`` (local engine) and
    run_config.json with ``c_base``. -> the run directory (it must not exist yet)."""
    from zcvae.engines import EngineConfig, build_engine
    from zcvae.runs.checkpoint import CheckpointManager

    with torch.no_grad():
        model.encode(batch)  # calibrates the router's standardisation buffers
        gen = torch.Generator().manual_seed(1)
        for p in model.parameters():
            if p.requires_grad:  # move every trainable tensor off its initial value (LoRA B starts at 0)
                p.add_(scale * torch.randn(p.shape, generator=gen))
    engine = build_engine(EngineConfig(engine="local"), model=model,
                          param_groups=model.param_groups(lora_lr=1e-3, latent_lr=1e-3, weight_decay=0.0), learning_rate=1e-3)
    run_dir = Path(cfg.run.output_dir)
    run_dir.mkdir()
    CheckpointManager(run_dir / "checkpoints", keep=1, is_main=True).save(engine, step=step, config=cfg, c_base=c_base)
    (run_dir / "run_config.json").write_text(json.dumps({"config": cfg.to_dict(), "c_base": c_base}))
    return run_dir


def greedy_reference(model, x_ids, z_ids, max_new_tokens: int) -> str:
    """Greedy decoding written directly against the peft model, with ``z_ids`` in the z section: the
    reference that the export tests hold ``zcvae.export.load`` to (independent of its code)."""
    t = model.tokens
    ids = [t.bos, t.x_open, *x_ids, t.x_close, t.z_open, *z_ids, t.z_close, t.y_open]
    out = []
    with torch.no_grad():
        for _ in range(max_new_tokens):
            nxt = int(model.peft_model(input_ids=torch.tensor([ids + out])).logits[0, -1].argmax())
            if nxt in (t.y_close, t.eos):
                break
            out.append(nxt)
    return model.tokenizer.decode(out)
