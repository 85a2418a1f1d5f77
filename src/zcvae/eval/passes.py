"""The per-rank passes of an evaluation: losses and latents of each example, then greedy decoding.

Each rank runs them on its share of the validation set (``eval.records.shard_indices``); every
forward goes through ``engine.module``, so ZeRO-3 and FSDP gather their shards, and the padded
shards give every rank the same batch shapes and number of forwards.

Shape legend: B examples of a batch, N supervised span positions (y + ``</y>``), K latents,
D Gaussian latent dimension, S Gaussian samples per example, R decode rows, L decode buffer width.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from zcvae.core.objective import AuxiliaryWeights, per_example_objective
from zcvae.eval.records import DecodeRecord, ExampleRecord
from zcvae.model.decoding import KVCache, greedy_decode
from zcvae.data.encoding import EncodedExample, TemplateLayout, TemplateTokens, collate

__all__ = ["decode_length", "decode_pass", "example_pass"]

# Salt of the Gaussian evaluation noise, so it never coincides with the training sampler's seeds.
_NOISE_SALT = 0x5EED_E7A1


def decode_length(cfg, val: Sequence[EncodedExample]) -> int:
    """Decoding steps: ``cfg.evaluation.max_new_tokens``, or the longest validation y + 2 (y, ``</y>``, one spare)."""
    if cfg.evaluation.max_new_tokens is not None:
        if cfg.evaluation.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {cfg.evaluation.max_new_tokens}")
        return int(cfg.evaluation.max_new_tokens)
    return max(len(ex.y_ids) for ex in val) + 2


def _example_noise(indices: Sequence[int], *, seed: int, num_samples: int, latent_dim: int) -> torch.Tensor:
    """Standard-normal noise (B, S, D) that depends only on each example's index and the run seed."""
    rows = []
    for i in indices:
        g = torch.Generator().manual_seed((seed * 1_000_003 + i) ^ _NOISE_SALT)
        rows.append(torch.randn(num_samples, latent_dim, generator=g))
    return torch.stack(rows)


def _to_list(t: torch.Tensor) -> list[float]:
    return t.detach().to("cpu", torch.float64).tolist()


def example_pass(*, engine, model, cfg, val, reference, indices, keep, on_batch=None) -> list[ExampleRecord]:
    """Losses, router outputs and span NLLs of this rank's examples (padding rows dropped)."""

    recon_cfg = cfg.reconstruction_config()
    aux = AuxiliaryWeights.from_train_config(cfg)  # the weights of the final steps
    c_base = reference.c_base.value
    # the `token` mode's n_bar over the whole validation set (every rank holds all of val), so that the
    # example mean of the terms over the set is its global token mean, whatever the sharding
    mean_num_tokens = sum(ex.num_supervised for ex in val) / max(len(val), 1)
    gaussian = cfg.model.latent_type != "discrete"
    batch_size = cfg.optimization.micro_batch_size
    records = []
    for start in range(0, len(indices), batch_size):
        idx = indices[start : start + batch_size]
        kept = keep[start : start + batch_size]
        batch = collate([val[i] for i in idx], model.tokens, num_z_slots=cfg.slot_tokens).to(engine.device)
        n_span = int(batch.num_supervised.max())
        ref_nll_BN = reference.ref_nll(engine, batch)  # before the CVAE forward, as in training
        extra = {}
        if gaussian:
            noise = _example_noise(idx, seed=cfg.optimization.seed, num_samples=cfg.model.num_latent_samples, latent_dim=cfg.model.latent_dim)
            extra["latent_noise"] = noise.to(engine.device)
        out = engine.module(batch, mode="train", n_span=n_span, **extra)
        ref_nll_BN = ref_nll_BN.to(out.mask.device, torch.float32)
        if ref_nll_BN.shape != out.mask.shape:
            raise RuntimeError(f"reference NLL has shape {tuple(ref_nll_BN.shape)}, the model's span mask {tuple(out.mask.shape)}")
        terms = per_example_objective(
            out, ref_nll_BN=ref_nll_BN, c_base=c_base, recon_config=recon_cfg, kl_weight=cfg.effective_kl_weight, aux=aux,
            mean_num_tokens=mean_num_tokens,
        )
        terms_cpu = {name: value.detach().to("cpu", torch.float64) for name, value in terms.items()}
        mask_BN = out.mask.to("cpu")
        token_nll_BKN = out.token_nll.detach().to("cpu", torch.float64)
        ref_cpu_BN = ref_nll_BN.to("cpu", torch.float64)
        if gaussian:
            cond_BN = (token_nll_BKN * out.branch_weights.detach().to("cpu", torch.float64)[:, :, None]).sum(1)
            posterior = prior = None
        else:
            posterior = out.posterior_logits.detach().float().softmax(-1).to("cpu", torch.float64)
            prior = out.prior_logits.detach().float().softmax(-1).to("cpu", torch.float64)
            best_B = posterior.argmax(-1)
            cond_BN = token_nll_BKN[torch.arange(len(idx)), best_B]
        for j, (i, k) in enumerate(zip(idx, kept)):
            if not k:
                continue
            n = int(mask_BN[j].sum())
            rec = ExampleRecord(
                index=i,
                strategy=val[i].strategy,
                terms={name: float(v[j]) for name, v in terms_cpu.items()},
                cond_nll_N=_to_list(cond_BN[j, :n]),
                ref_nll_N=_to_list(ref_cpu_BN[j, :n]),
            )
            if gaussian:
                rec.mu_D, rec.logvar_D = _to_list(out.mu[j]), _to_list(out.logvar[j])
            else:
                rec.posterior_K, rec.prior_K = posterior[j].tolist(), prior[j].tolist()
            records.append(rec)
        if on_batch is not None:
            on_batch()
    return records


def decode_pass(*, engine, model, cfg, val, latents, mu_by_index, indices, keep, num_steps, on_batch=None) -> list[DecodeRecord]:
    """Greedy decodes of this rank's share of the decode examples (padding rows dropped).

    Each x is decoded once per entry of ``latents``: the discrete latents ``[0, ..., K-1]``, or ``[None]``
    for a Gaussian latent, decoded with z = ``mu_by_index[i]`` (the posterior mean; None for discrete).
    Every x gets the same rows, so the padded shards give every rank the same batch shapes and forward count.
    """
    tokens: TemplateTokens = model.tokens
    layout = TemplateLayout(cfg.slot_tokens)
    gaussian = cfg.model.latent_type != "discrete"
    records = []
    for start in range(0, len(indices), cfg.optimization.micro_batch_size):
        idx = indices[start : start + cfg.optimization.micro_batch_size]
        kept = keep[start : start + cfg.optimization.micro_batch_size]
        prompts, slot_start, latent_R, zs, owners = [], [], [], [], []
        for i, k in zip(idx, kept):
            ex = val[i]
            for latent in latents:
                prompts.append(layout.zcond_prompt(ex.x_ids, tokens))
                slot_start.append(layout.z_slot_start(len(ex.x_ids)))
                latent_R.append(latent)
                if gaussian:
                    zs.append(mu_by_index[i])
                owners.append((i, latent, k))
        slot_R = torch.tensor(slot_start, dtype=torch.long, device=engine.device)
        kwargs: dict[str, Any] = {"slot_start": slot_R}
        if gaussian:
            kwargs["z"] = torch.tensor(zs, dtype=torch.float32, device=engine.device)
        else:
            kwargs["latent_index"] = torch.tensor(latent_R, dtype=torch.long, device=engine.device)

        cache = KVCache()  # the prompts once, then one token per row per forward

        def next_logits(ids_RL, mask_RL):
            return engine.module(None, mode="decode", input_ids=ids_RL, attention_mask=mask_RL, cache=cache, **kwargs)

        def all_stopped(here: bool) -> bool:
            flag = torch.tensor([1.0 if here else 0.0], device=engine.device)
            return bool(engine.all_reduce(flag, op="min").item() == 1.0)

        generated, closed, _ = greedy_decode(
            next_logits, prompts, num_steps=num_steps, stop_id=tokens.y_close, pad_id=tokens.pad, device=engine.device,
            all_stopped=all_stopped,
        )
        for (i, latent, k), gen, ok in zip(owners, generated, closed):
            if k:
                records.append(DecodeRecord(index=i, latent=latent, generated=gen, closed=ok))
        if on_batch is not None:
            on_batch()
    return records
