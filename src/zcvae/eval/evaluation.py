"""Validation metrics: losses, latent usage (MI, support, NMI/ARI), controllability, information gain.

    metrics = evaluate(engine=engine, model=model, cfg=cfg, val=val_enc, reference=reference,
                       task=splits.task, run_dir=run_dir, step=step)       # collective: every rank
    zcvae evaluate RUN_DIR                                                   # -> evaluate_run(RUN_DIR)

Exact under data parallelism. Example i of the validation set goes to rank ``i % W`` (rank r takes
r, r+W, ...); each rank's shard is padded to ``ceil(N / W)`` with repeats of example 0 whose results
are discarded, so every rank runs the same number of forwards of the same batch sizes (ZeRO-3 and
FSDP hang otherwise). The per-example records of every rank are exchanged with
``all_gather_object`` and ordered by example index, and every metric is computed once, over the
whole set, on every rank: MI over a per-rank mean of q would be a different, biased quantity. A set
whose size is not divisible by W therefore gives the single-process values, up to the float noise
of a different batch composition.

What is measured (one pass over the validation set, then greedy decoding of a prefix of it):

* Losses: the example mean of the six reconstruction terms, ``kl``, the objective ``loss`` (with the
  final KL weight ``cfg.effective_kl_weight``, the auxiliary weights of the run, and the router's marginal
  terms evaluated on the mean q of the whole set), every diagnostic of ``core.losses.reconstruction_terms``
  reduced as in training (mean, or min/max for ``num_tokens_min``/``num_tokens_max``), and ``c_base``.
  Gaussian latents: the S branch samples use noise drawn from a generator seeded by
  ``(cfg.seed, example index)``, so the estimate is deterministic and does not depend on the sharding.
* Discrete latents: ``eval.metrics.discrete_latent_metrics`` on q(z|x,y) and p(z|x) of every example.
  Gaussian: ``eval.metrics.gaussian_latent_metrics`` on the posterior means (active units with
  ``delta = ACTIVE_UNITS_DELTA``, KL to N(0, I), NMI/ARI of k-means of the means vs the strategy).
* Decoding, on the first ``cfg.num_eval_decode_examples`` validation x: greedy, a fixed number of
  steps (``cfg.max_new_tokens``, or the longest validation y + 2) in lock-step on every rank, each row
  stopping at ``</y>`` (a stopped row still runs the forwards, so no rank leaves the loop early).
  Discrete latent: every latent k is decoded for every x, with or without a parser.
  ``control/distinct_outputs`` is the fraction of those x whose decodes differ across the latents
  (``eval.metrics.distinct_outputs``; no parser needed). With a task parser, controllability:
  per-latent purity, best one-to-one latent->strategy matching accuracy, parse rate, answer
  accuracy. ``exact_match`` is the fraction of x whose decode under the posterior's argmax latent
  equals the gold y token for token (and closes with ``</y>``).
  ``closure_rate`` is the share of all decodes (every latent row) that emit ``</y>`` within the steps:
  a decoder whose ``</y>`` row never trained (a backbone without the markers) never closes y.
  Gaussian latent: controllability over latents is undefined, so each x is decoded once with z = the
  posterior mean mu(x, y): ``exact_match`` (reconstruction), and with a parser the parse rate, answer
  accuracy and agreement with the gold strategy of those decodes.
* Information gain per y position, g_t = log p(y_t|x,z) - log p(y_t|x) = b_t - l_t with b the frozen
  z-free reference: discrete z = the posterior's argmax latent (the z that decoding uses; the
  expectation under q would blur a sharp latent with its unused alternatives), Gaussian the mean of
  l_t over the S samples.

* Reachable NMI (with gold strategies, user JSONL included): ``nmi_reachable`` is the NMI against
  the gold strategy of the best function of (x, y), the majority strategy of each identical (x, y)
  token pair (``eval.metrics.reachable_nmi``); it is below 1 when two strategies produce the same y. For
  a built-in family the strategies that render a row's y from its x all count for it, so an
  ambiguous (x, y) is caught even when it occurs once (as in ``mul`` with b = 1); for user data only
  repeated (x, y) pairs reveal ambiguity.
  ``nmi_ratio`` = ``nmi`` / ``nmi_reachable`` (1.0 when ``nmi_reachable`` is 0: nothing to reach).
* Stratified (``stratified_metrics``; the aggregation pilot's confound "does sum only upweight long examples?"):
  ``by_strategy/<strategy>/...`` per gold strategy and ``by_length/t1|t2|t3/...`` per tercile of
  the supervised length n_i (t1 shortest, ties kept together), each with ``num_examples``, the six
  reconstruction terms (``by_strategy/forward/reconstruction_loss``, ...), ``nmi`` (by strategy:
  one-vs-rest, [gold == s] against the assigned latent over all labelled rows; by length: within
  the tercile), ``latent_usage/<k>``, ``num_used_latents`` and ``mi`` (discrete) or
  ``active_units`` (Gaussian), and ``min_length``/``max_length`` for the terciles; kappa
  (``token_concentration_factor``) per stratum too. Decoding by stratum
  (``stratified_decoding_metrics``; the aggregation pilot's confound "length correlates with parse and answer
  correctness"): ``P/exact_match``, ``P/answer_accuracy``, ``P/control/parse_rate`` and
  ``P/decode/num_examples`` over the decoded examples of each stratum P, the same strata.

Outputs: a flat dict of floats, the same on every rank (the trainer's logger prefixes ``eval/``);
on rank 0 ``eval_step{step}.json`` (everything non-scalar: confusion matrix, per-position gain,
per-latent purity, a few decoded samples, the decision positions) and ``latents_step{step}.png`` plus
its copy ``latents.png``, and ``information_gain_step{step}.png`` plus ``information_gain.png`` (mean
b_t - l_t per y position with the task family's decision positions marked; unmarked for user data)
in the run directory.

Shape legend: B examples of a batch, N supervised span positions (y + ``</y>``), K latents,
D Gaussian latent dimension, S Gaussian samples per example, R decode rows, L decode buffer width,
V vocabulary.
"""

from __future__ import annotations

import dataclasses
import math
import os
import shutil
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from zcvae.core.losses import DIAGNOSTIC_REDUCTIONS, RECONSTRUCTION_TERMS
from zcvae.core.objective import AuxiliaryWeights, marginal_router_terms, per_example_objective
from zcvae.eval.metrics import (
    cluster_scores,
    controllability_metrics,
    discrete_latent_metrics,
    distinct_outputs,
    gaussian_latent_metrics,
    information_gain_by_position,
    length_terciles,
    nmi_ratio,
    plot_information_gain,
    plot_latent_figure,
    reachable_nmi,
)
from zcvae.runs.rundir import RUN_CONFIG, LATENTS_FIGURE, atomic_write, atomic_write_json, eval_step_file, read_run_record
from zcvae.model.decoding import greedy_decode
from zcvae.templates import EncodedExample, TemplateLayout, TemplateTokens, collate

__all__ = [
    "ACTIVE_UNITS_DELTA",
    "EVAL_METRICS",
    "decode_length",
    "evaluate",
    "evaluate_run",
    "gather_records",
    "greedy_decode",
    "shard_indices",
    "stratified_decoding_metrics",
    "stratified_metrics",
    "summarize",
]

EVAL_METRICS = "eval_metrics.json"
# Optimus' threshold for an active unit (DELLA uses 0.2); reported as eval/active_units_delta.
ACTIVE_UNITS_DELTA = 0.01
# Decoded samples kept in eval_step{step}.json for a person to read.
NUM_JSON_SAMPLES = 8
# Salt of the Gaussian evaluation noise, so it never coincides with the training sampler's seeds.
_NOISE_SALT = 0x5EED_E7A1


# ----------------------------------------------------------------------------------------------
# Sharding and gathering (pure, or one collective)
# ----------------------------------------------------------------------------------------------


def shard_indices(num_items: int, *, rank: int, world_size: int) -> tuple[list[int], list[bool]]:
    """This rank's items ``rank, rank + W, ...``, padded with item 0 to ``ceil(num_items / W)``.

    Returns ``(indices, keep)``; ``keep`` is False on the padding, whose results must be discarded.
    Every rank gets the same length, so every rank runs the same number of forwards.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
    if num_items < 1:
        raise ValueError(f"num_items must be >= 1, got {num_items}")
    mine = list(range(rank, num_items, world_size))
    per_rank = -(-num_items // world_size)
    pad = per_rank - len(mine)
    return mine + [0] * pad, [True] * len(mine) + [False] * pad


def gather_records(
    records: list[dict], *, world_size: int, all_gather_object: Callable[[list, Any], None] | None = None
) -> list[dict]:
    """Every rank's records, on every rank, sorted by ``(index, latent)``.

    ``all_gather_object(output_list, obj)`` defaults to ``torch.distributed.all_gather_object`` (works on
    gloo and nccl); it is not called at world size 1.
    """
    if world_size > 1:
        gather = all_gather_object or torch.distributed.all_gather_object
        parts: list[Any] = [None] * world_size
        gather(parts, records)
        records = [r for part in parts for r in part]
    return sorted(records, key=lambda r: (r["index"], -1 if r.get("latent") is None else r["latent"]))


def _check_complete(records: list[dict], num_items: int, what: str) -> None:
    seen = [r["index"] for r in records]
    if seen != list(range(num_items)):
        # An invariant of the sharding: every index once. A failure means ranks disagree on the data.
        raise RuntimeError(f"evaluation: gathered {what} records cover {len(set(seen))} distinct of "
                           f"{num_items} examples ({len(seen)} records); do all ranks hold the same validation set?")


# ----------------------------------------------------------------------------------------------
# Greedy decoding in lock-step
# ----------------------------------------------------------------------------------------------


def decode_length(cfg, val: Sequence[EncodedExample]) -> int:
    """Decoding steps: ``cfg.max_new_tokens``, or the longest validation y + 2 (y, ``</y>``, one spare)."""
    if cfg.max_new_tokens is not None:
        if cfg.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {cfg.max_new_tokens}")
        return int(cfg.max_new_tokens)
    return max(len(ex.y_ids) for ex in val) + 2


# ----------------------------------------------------------------------------------------------
# Per-rank passes
# ----------------------------------------------------------------------------------------------


def _example_noise(indices: Sequence[int], *, seed: int, num_samples: int, latent_dim: int) -> torch.Tensor:
    """Standard-normal noise (B, S, D) that depends only on each example's index and the run seed."""
    rows = []
    for i in indices:
        g = torch.Generator().manual_seed((seed * 1_000_003 + i) ^ _NOISE_SALT)
        rows.append(torch.randn(num_samples, latent_dim, generator=g))
    return torch.stack(rows)


def _to_list(t: torch.Tensor) -> list[float]:
    return t.detach().to("cpu", torch.float64).tolist()


def _example_pass(*, engine, model, cfg, val, reference, indices, keep) -> list[dict]:
    """Losses, router outputs and span NLLs of this rank's examples (padding rows dropped)."""

    recon_cfg = cfg.reconstruction_config()
    aux = AuxiliaryWeights.from_train_config(cfg)
    c_base = reference.c_base.value
    # the `token` mode's n_bar over the whole validation set (every rank holds all of val), so that the
    # example mean of the terms over the set is its global token mean, whatever the sharding
    mean_num_tokens = sum(ex.num_supervised for ex in val) / max(len(val), 1)
    gaussian = cfg.latent_type != "discrete"
    batch_size = cfg.micro_batch_size
    records: list[dict] = []
    for start in range(0, len(indices), batch_size):
        idx = indices[start : start + batch_size]
        kept = keep[start : start + batch_size]
        batch = collate([val[i] for i in idx], model.tokens, num_z_slots=cfg.slot_tokens).to(engine.device)
        n_span = int(batch.num_supervised.max())
        ref_nll_BN = reference.ref_nll(engine, batch)  # before the CVAE forward, as in training
        extra = {}
        if gaussian:
            noise = _example_noise(idx, seed=cfg.seed, num_samples=cfg.num_latent_samples, latent_dim=cfg.latent_dim)
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
            rec: dict[str, Any] = {
                "index": i,
                "strategy": val[i].strategy,
                "terms": {name: float(v[j]) for name, v in terms_cpu.items()},
                "cond_nll": _to_list(cond_BN[j, :n]),
                "ref_nll": _to_list(ref_cpu_BN[j, :n]),
            }
            if gaussian:
                rec["mu"] = _to_list(out.mu[j])
                rec["logvar"] = _to_list(out.logvar[j])
            else:
                rec["q"] = posterior[j].tolist()
                rec["p"] = prior[j].tolist()
            records.append(rec)
    return records


def _decode_pass(*, engine, model, cfg, val, examples, indices, keep, num_steps) -> list[dict]:
    """Greedy decodes of this rank's share of the decode examples (padding rows dropped).

    ``examples`` maps a validation index to ``{"latents": [k, ...]}`` (discrete) or ``{"z": [..]}``
    (Gaussian, the posterior mean). Every example of one run asks for the same number of rows, so the
    padded shards give every rank the same batch shapes and forward count.
    """
    tokens: TemplateTokens = model.tokens
    layout = TemplateLayout(cfg.slot_tokens)
    gaussian = cfg.latent_type != "discrete"
    records: list[dict] = []
    for start in range(0, len(indices), cfg.micro_batch_size):
        idx = indices[start : start + cfg.micro_batch_size]
        kept = keep[start : start + cfg.micro_batch_size]
        prompts, slot_start, latents, zs, owners = [], [], [], [], []
        for i, k in zip(idx, kept):
            ex = val[i]
            spec = examples[i]
            for latent in spec.get("latents", [None]):
                prompts.append(layout.zcond_prompt(ex.x_ids, tokens))
                slot_start.append(layout.z_slot_start(len(ex.x_ids)))
                latents.append(latent)
                if gaussian:
                    zs.append(spec["z"])
                owners.append((i, latent, k))
        slot_R = torch.tensor(slot_start, dtype=torch.long, device=engine.device)
        kwargs: dict[str, Any] = {"slot_start": slot_R}
        if gaussian:
            kwargs["z"] = torch.tensor(zs, dtype=torch.float32, device=engine.device)
        else:
            kwargs["latent_index"] = torch.tensor(latents, dtype=torch.long, device=engine.device)

        def next_logits(ids_RL, mask_RL):
            return engine.module(None, mode="decode", input_ids=ids_RL, attention_mask=mask_RL, **kwargs)

        generated, closed, _ = greedy_decode(
            next_logits, prompts, num_steps=num_steps, stop_id=tokens.y_close, pad_id=tokens.pad, device=engine.device
        )
        for (i, latent, k), gen, ok in zip(owners, generated, closed):
            if k:
                records.append({"index": i, "latent": latent, "generated": gen, "closed": ok})
    return records


# ----------------------------------------------------------------------------------------------
# Metrics over the gathered records (pure)
# ----------------------------------------------------------------------------------------------


def _reduce_terms(records: list[dict]) -> dict[str, float]:
    """Example-set reductions of every per-example term, as the trainer reduces them."""
    valid = [r for r in records if r["terms"].get("valid", 1.0) > 0]
    out: dict[str, float] = {}
    for name in records[0]["terms"]:
        if name == "valid":
            continue
        how = DIAGNOSTIC_REDUCTIONS.get(name, "mean")
        if how == "sum":
            out[name] = float(sum(r["terms"][name] for r in records))
            continue
        values = [r["terms"][name] for r in valid]
        if not values:
            out[name] = float("nan")
        elif how == "min":
            out[name] = float(min(values))
        elif how == "max":
            out[name] = float(max(values))
        else:
            out[name] = float(np.mean(values))
    out["num_examples"] = float(len(records))
    out["num_valid_examples"] = float(len(valid))
    return out


def _decoded_text(tokenizer, ids: Sequence[int]) -> str:
    return tokenizer.decode(list(ids))


def _control_records(decodes, *, val, tokenizer, task, map_latent) -> list[dict]:
    """Parse each decode; ``exact_match`` only on the decode under the posterior's argmax latent."""
    out = []
    answers: dict[int, str | None] = {}
    for d in decodes:
        i = d["index"]
        ex = val[i]
        rec: dict[str, Any] = {"index": i, "latent": 0 if d["latent"] is None else d["latent"], "gold_strategy": ex.strategy}
        if map_latent is None or d["latent"] == map_latent[i]:
            rec["exact_match"] = bool(d["closed"] and list(d["generated"]) == list(ex.y_ids))
        if task is not None:
            parsed = task.parse(_decoded_text(tokenizer, d["generated"]))
            if i not in answers:
                try:
                    answers[i] = task.answer(_decoded_text(tokenizer, ex.x_ids))
                except ValueError:
                    answers[i] = None  # x truncated or not of this task: no answer to compare with
            rec.update(
                parsed_strategy=parsed.strategy,
                parse_ok=bool(parsed.parse_ok and d["closed"]),
                answer_correct=bool(parsed.parse_ok and d["closed"] and answers[i] is not None and parsed.answer == answers[i]),
            )
        out.append(rec)
    return out


def _stratum_name(strategy: Any) -> str:
    # A metric name part: TensorBoard groups tags on "/", so a strategy must not contain one.
    return str(strategy).replace("/", "_").replace(" ", "_") or "_"


def _strata(records: list[dict], labels: Sequence[Any]) -> tuple[list[tuple[str, list[int], Any]], np.ndarray]:
    """The strata ``[(prefix, rows, strategy or None), ...]`` of the records, and every row's n_i.

    ``by_strategy/<s>`` per gold strategy (sorted), then ``by_length/t1..t3`` (terciles of n_i over
    every row, ``eval.metrics.length_terciles``; an empty tercile is left out). The one definition the
    loss, latent and decoding strata share, so ``by_length/t1`` names the same examples in all three.
    """
    num = len(records)
    lengths_N = np.asarray([len(r["cond_nll"]) for r in records])
    strata: list[tuple[str, list[int], Any]] = []
    for strategy in sorted({s for s in labels if s is not None}, key=str):
        strata.append((f"by_strategy/{_stratum_name(strategy)}", [n for n in range(num) if labels[n] == strategy], strategy))
    tercile_N = length_terciles(lengths_N)
    for j in range(3):
        rows = np.flatnonzero(tercile_N == j).tolist()
        if rows:
            strata.append((f"by_length/t{j + 1}", rows, None))
    return strata, lengths_N


def stratified_decoding_metrics(records: list[dict], labels: Sequence[Any], ctrl_records: list[dict]) -> dict[str, float]:
    """Exact match, answer accuracy and parse rate per stratum -> flat ``{name: value}``.

    The strata are those of :func:`stratified_metrics`, cut over the whole validation set (the
    terciles use every row's n_i), although only its first ``num_eval_decode_examples`` x are
    decoded: ``by_length/t1`` is the same set of examples for the losses and for decoding. Each
    metric is its whole-set definition restricted to the decodes of the stratum's examples:
      P/decode/num_examples    decoded examples in P (absent strata: no keys)
      P/exact_match            over the decode under each x's argmax latent (Gaussian: its mean)
      P/control/parse_rate     over every decode of P's x (every latent), as ``control/parse_rate``
      P/answer_accuracy        likewise, as ``answer_accuracy``; both only with a task parser
    ``ctrl_records`` are ``_control_records``' output (``index``, ``exact_match`` on the argmax decode,
    ``parse_ok``/``answer_correct`` with a parser). Pure: exact under sharding.
    """
    out: dict[str, float] = {}
    by_index: dict[int, list[dict]] = {}
    for rec in ctrl_records:
        by_index.setdefault(rec["index"], []).append(rec)
    strata, _ = _strata(records, labels)
    for prefix, rows, _ in strata:
        decoded = [rec for n in rows for rec in by_index.get(records[n]["index"], [])]
        if not decoded:
            continue
        out[f"{prefix}/decode/num_examples"] = float(len({rec["index"] for rec in decoded}))
        exact = [float(rec["exact_match"]) for rec in decoded if "exact_match" in rec]
        if exact:
            out[f"{prefix}/exact_match"] = float(np.mean(exact))
        if all("parse_ok" in rec for rec in decoded):
            out[f"{prefix}/control/parse_rate"] = float(np.mean([bool(rec["parse_ok"]) for rec in decoded]))
            out[f"{prefix}/answer_accuracy"] = float(np.mean([bool(rec["answer_correct"]) for rec in decoded]))
    return out


def stratified_metrics(
    records: list[dict], labels: Sequence[Any], assign: Sequence[int | None], *, discrete: bool
) -> dict[str, float]:
    """Per-stratum NMI, latent usage and the six reconstruction terms -> flat ``{name: value}``.

    Strata: ``by_strategy/<s>`` (rows whose gold strategy is s; "/" and spaces in s become "_") and
    ``by_length/t1..t3`` (terciles of the supervised length n_i = y + ``</y>`` tokens, t1 shortest,
    ``eval.metrics.length_terciles``; an empty tercile has no keys). For each stratum P:
      P/num_examples
      P/<term>             example mean of each of ``core.losses.RECONSTRUCTION_TERMS`` over its valid rows
      P/token_concentration_factor   kappa_i (``core.losses``), the same example mean
      P/latent_usage/<k>   mean q(z=k|x,y) over its rows (discrete)
      P/num_used_latents, P/mi   usage and I(x,y; z) within the stratum (discrete; within a strategy
                           an MI near 0 means z does not vary inside it)
      P/active_units       (Gaussian, strata of 2+ rows)
      P/nmi                by_strategy: one-vs-rest, NMI between [gold == s] and the assigned latent
                           over every labelled row (how well s is separated from the others);
                           by_length: NMI of the assigned latent vs gold within the tercile
      by_length/tj/min_length, by_length/tj/max_length
    ``assign[i]`` is the latent of row i (argmax q, or the k-means cluster; None: no NMI for it).
    Pure: computed from the gathered records, so exact under sharding.
    """
    out: dict[str, float] = {}
    num = len(records)
    strata, lengths_N = _strata(records, labels)
    scored = [n for n in range(num) if labels[n] is not None and assign[n] is not None]
    for prefix, rows, strategy in strata:
        out[f"{prefix}/num_examples"] = float(len(rows))
        valid = [n for n in rows if records[n]["terms"].get("valid", 1.0) > 0]
        for name in (*RECONSTRUCTION_TERMS, "token_concentration_factor"):
            if valid and name in records[rows[0]]["terms"]:
                out[f"{prefix}/{name}"] = float(np.mean([records[n]["terms"][name] for n in valid]))
        if discrete:
            lat = discrete_latent_metrics(np.asarray([records[n]["q"] for n in rows], dtype=np.float64))
            out[f"{prefix}/mi"] = float(lat["mi"])
            out[f"{prefix}/num_used_latents"] = float(lat["num_used_latents"])
            for k, usage in enumerate(lat["latent_usage"]):
                out[f"{prefix}/latent_usage/{k}"] = float(usage)
        elif len(rows) >= 2:
            lat = gaussian_latent_metrics(np.asarray([records[n]["mu"] for n in rows], dtype=np.float64), delta=ACTIVE_UNITS_DELTA)
            out[f"{prefix}/active_units"] = float(lat["active_units"])
        if strategy is not None:
            if scored:
                out[f"{prefix}/nmi"] = cluster_scores([labels[n] == strategy for n in scored], [assign[n] for n in scored])["nmi"]
        else:
            inside = [n for n in rows if labels[n] is not None and assign[n] is not None]
            if inside:
                out[f"{prefix}/nmi"] = cluster_scores([labels[n] for n in inside], [assign[n] for n in inside])["nmi"]
            out[f"{prefix}/min_length"] = float(lengths_N[rows].min())
            out[f"{prefix}/max_length"] = float(lengths_N[rows].max())
    return out


def _equivalent_strategies(rows, records, *, val, task, tokenizer) -> list[list[Any]] | None:
    """For each row, the strategies of a built-in family whose gold y for its x is the row's y.

    None without a family that can render (user JSONL: identical (x, y) pairs are all there is).
    A row whose x or y the family cannot reproduce (truncated) keeps its gold strategy alone.
    """
    if task is None or not hasattr(task, "render") or not hasattr(task, "strategies"):
        return None
    out = []
    for n in rows:
        ex = val[records[n]["index"]]
        x, y = _decoded_text(tokenizer, ex.x_ids), _decoded_text(tokenizer, ex.y_ids).split()
        try:
            same = [s for s in task.strategies if task.render(x, s).split() == y]
        except ValueError:
            same = []
        out.append(same if ex.strategy in same else [ex.strategy])
    return out


def _decision_positions(records, *, val, task, tokenizer) -> dict[int, int] | None:
    """{y token position: number of examples whose strategies part there}, or None without a family.

    Only task families that define ``decision_positions(x)`` (the built-in ones; user JSONL has none)
    give positions. They count y words; with a tokenizer that writes one token per word (the built-in
    word-level one) that is the token position, otherwise the word prefix is re-tokenised.
    """
    if task is None or not hasattr(task, "decision_positions"):
        return None
    counts: dict[int, int] = {}
    for r in records:
        ex = val[r["index"]]
        try:
            positions = task.decision_positions(_decoded_text(tokenizer, ex.x_ids))
        except ValueError:
            continue  # x truncated or not of this family
        words = _decoded_text(tokenizer, ex.y_ids).split()
        for p in positions:
            if len(words) != len(ex.y_ids) and p > 0:
                p = len(tokenizer(" ".join(words[:p]), add_special_tokens=False)["input_ids"])
            counts[int(p)] = counts.get(int(p), 0) + 1
    return counts


# Gold-strategy metrics need this many labelled validation examples, per strategy present and in all.
MIN_LABELLED_PER_STRATEGY = 2
MIN_LABELLED = 8


def gold_labels_problem(labels: Sequence[Any]) -> str | None:
    """Why the gold strategies ``labels`` (None = unlabelled) are too few to score a clustering against,
    or None when they suffice (or when there are none at all: then there is nothing to report)."""
    present = [s for s in labels if s is not None]
    if not present:
        return None
    counts: dict[Any, int] = {}
    for s in present:
        counts[s] = counts.get(s, 0) + 1
    thin = sorted((str(s) for s, c in counts.items() if c < MIN_LABELLED_PER_STRATEGY))
    if len(present) < MIN_LABELLED:
        return f"only {len(present)} labelled validation example(s), fewer than {MIN_LABELLED}"
    if thin:
        return (f"strategy {', '.join(thin[:3])}{' ...' if len(thin) > 3 else ''} has fewer than "
                f"{MIN_LABELLED_PER_STRATEGY} labelled validation examples")
    return None


def summarize(
    records: list[dict],
    decodes: list[dict],
    *,
    cfg,
    val: Sequence[EncodedExample],
    task,
    tokenizer,
    c_base: float,
    num_decode_steps: int | None,
) -> tuple[dict[str, float], dict[str, Any]]:
    """All metrics from the gathered records -> (flat scalars, non-scalar details for the JSON file)."""
    scalars = _reduce_terms(records)
    scalars["c_base"] = float(c_base)
    details: dict[str, Any] = {}
    labels = [r["strategy"] for r in records]
    if any(s is not None for s in labels):
        scalars["num_labelled_examples"] = float(sum(s is not None for s in labels))
    if (problem := gold_labels_problem(labels)) is not None:
        # an NMI of 1.000 from one labelled example says nothing: report it absent, not perfect
        print(f"[eval] gold-strategy metrics (nmi, ari, matching_accuracy, by_strategy/...) are absent: {problem}", file=sys.stderr)
        details["gold_metrics_absent"] = problem
        labels = [None] * len(labels)
    has_labels = any(s is not None for s in labels)
    # The latent each example is assigned to (discrete: argmax q; Gaussian: its k-means cluster, for
    # labelled rows only), for the stratified NMI.
    assign: list[int | None] = [None] * len(records)

    if cfg.latent_type == "discrete":
        q_NK = np.asarray([r["q"] for r in records], dtype=np.float64)
        p_NK = np.asarray([r["p"] for r in records], dtype=np.float64)
        lat = discrete_latent_metrics(q_NK, p_NK, labels=labels if has_labels else None)
        for key in ("mi", "router_support", "num_used_latents", "posterior_entropy", "prior_agreement",
                    "kl_posterior_prior", "nmi", "ari", "homogeneity", "completeness", "matching_accuracy",
                    "matching_soft_accuracy"):
            if key in lat:
                scalars[key] = float(lat[key])
        scalars["router_marginal_kl"] = float(lat["marginal_kl_uniform"])
        # The objective's batch-level router terms, on the marginal of q over the whole set, by the
        # trainer's own function (the whole set plays the global batch; no gradient is needed here).
        sum_q_K = torch.as_tensor(q_NK.sum(0))
        router_term, _ = marginal_router_terms(local_sum_q_K=sum_q_K, global_sum_q_K=sum_q_K,
                                               global_count=torch.tensor(float(len(q_NK))),
                                               aux=AuxiliaryWeights.from_train_config(cfg))
        scalars["loss"] += float(router_term)
        details["latent_usage"] = lat["latent_usage"]
        if "confusion" in lat:
            details.update(confusion=lat["confusion"], confusion_latent_labels=lat["confusion_latent_labels"],
                           confusion_strategy_labels=lat["confusion_strategy_labels"], matching=lat["matching"])
        else:
            counts_K1 = np.bincount(q_NK.argmax(1), minlength=q_NK.shape[1])[:, None]
            details.update(confusion=counts_K1, confusion_latent_labels=list(range(q_NK.shape[1])),
                           confusion_strategy_labels=["all"])
        map_latent = {r["index"]: int(np.argmax(r["q"])) for r in records}
        assign = [int(np.argmax(r["q"])) for r in records]
    else:
        mu_ND = np.asarray([r["mu"] for r in records], dtype=np.float64)
        logvar_ND = np.asarray([r["logvar"] for r in records], dtype=np.float64)
        map_latent = None
        if mu_ND.shape[0] >= 2:
            lat = gaussian_latent_metrics(mu_ND, logvar_ND, labels=labels if has_labels else None,
                                          delta=ACTIVE_UNITS_DELTA, seed=cfg.seed)
            for key in ("active_units", "active_units_delta", "kl_to_standard_normal", "nmi", "ari",
                        "homogeneity", "completeness", "num_clusters"):
                if key in lat:
                    scalars[key] = float(lat[key])
            details["mean_variance_per_dim"] = lat["mean_variance_per_dim"]
            if "num_clusters" in lat:
                keep = [i for i, s in enumerate(labels) if s is not None]
                clusters = lat["cluster_labels"]  # of the labelled rows, in order
                for c, i in zip(clusters, keep):
                    assign[i] = int(c)
                strategies = sorted({labels[i] for i in keep}, key=str)
                confusion = np.zeros((int(lat["num_clusters"]), len(strategies)), dtype=np.int64)
                for c, i in zip(clusters, keep):
                    confusion[c, strategies.index(labels[i])] += 1
                details.update(confusion=confusion, confusion_latent_labels=list(range(confusion.shape[0])),
                               confusion_strategy_labels=strategies,
                               latent_usage=confusion.sum(1) / max(1, confusion.sum()))

    if has_labels and "nmi" in scalars:
        # The best any encoder of (x, y) can do: identical (x, y) pairs cannot be told apart.
        labelled = [n for n, strategy in enumerate(labels) if strategy is not None]
        inputs = [(tuple(val[records[n]["index"]].x_ids), tuple(val[records[n]["index"]].y_ids)) for n in labelled]
        candidates = _equivalent_strategies(labelled, records, val=val, task=task, tokenizer=tokenizer)
        scalars["nmi_reachable"], _ = reachable_nmi(inputs, [labels[n] for n in labelled], candidates)
        scalars["nmi_ratio"] = nmi_ratio(scalars["nmi"], scalars["nmi_reachable"])
    scalars.update(stratified_metrics(records, labels, assign, discrete=cfg.latent_type == "discrete"))

    # information gain of z per y position
    T = max(len(r["cond_nll"]) for r in records)
    cond_NT = np.zeros((len(records), T))
    ref_NT = np.zeros((len(records), T))
    mask_NT = np.zeros((len(records), T), dtype=bool)
    for n, r in enumerate(records):
        m = len(r["cond_nll"])
        cond_NT[n, :m], ref_NT[n, :m], mask_NT[n, :m] = r["cond_nll"], r["ref_nll"], True
    gain = information_gain_by_position(cond_NT, ref_NT, mask_NT)
    if gain["mean"] is not None:
        scalars["info_gain/mean"] = gain["mean"]
        scalars["info_gain/first_token"] = gain["first_token_mean"]
    details["info_gain"] = {"mean_by_position": gain["mean_by_position"], "count_by_position": gain["count_by_position"],
                            "z": "posterior argmax" if cfg.latent_type == "discrete" else "mean over posterior samples",
                            "decision_positions": _decision_positions(records, val=val, task=task, tokenizer=tokenizer)}

    # decoding
    if decodes:
        scalars["decode/num_examples"] = float(len({d["index"] for d in decodes}))
        scalars["decode/max_new_tokens"] = float(num_decode_steps)
        ctrl_records = _control_records(decodes, val=val, tokenizer=tokenizer, task=task, map_latent=map_latent)
        exact = [float(r["exact_match"]) for r in ctrl_records if "exact_match" in r]
        scalars["exact_match"] = float(np.mean(exact))
        scalars.update(stratified_decoding_metrics(records, labels, ctrl_records))
        if cfg.latent_type == "discrete":
            scalars["control/distinct_outputs"] = distinct_outputs(decodes)
        # every decoded row (each latent of each x): a decoder that cannot emit </y> never stops
        scalars["closure_rate"] = float(np.mean([bool(d["closed"]) for d in decodes]))
        if task is not None:
            ctrl = controllability_metrics(ctrl_records)
            scalars["control/parse_rate"] = float(ctrl["parse_rate"])
            scalars["answer_accuracy"] = float(ctrl["answer_accuracy"])
            if "gold_agreement" in ctrl:
                scalars["control/gold_agreement"] = float(ctrl["gold_agreement"])
            if cfg.latent_type == "discrete":
                scalars["control/purity"] = float(ctrl["mean_purity"])
                scalars["control/matching_accuracy"] = float(ctrl["matching_accuracy"])
                details["control"] = {"purity_per_latent": ctrl["purity_per_latent"],
                                      "majority_strategy": ctrl["majority_strategy"], "matching": ctrl["matching"]}
        samples = []
        for d, r in zip(decodes, ctrl_records):
            if d["index"] >= NUM_JSON_SAMPLES:
                continue
            ex = val[d["index"]]
            samples.append({"index": d["index"], "id": ex.id, "latent": d["latent"], "x": _decoded_text(tokenizer, ex.x_ids),
                            "gold_y": _decoded_text(tokenizer, ex.y_ids), "decoded_y": _decoded_text(tokenizer, d["generated"]),
                            "closed": d["closed"],
                            **{k: r[k] for k in ("parsed_strategy", "parse_ok", "answer_correct", "exact_match") if k in r}})
        details["samples"] = samples
    return scalars, details


# ----------------------------------------------------------------------------------------------
# Files (rank 0)
# ----------------------------------------------------------------------------------------------


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, np.ndarray):
        return _jsonable(value.tolist())
    if isinstance(value, np.generic):
        return _jsonable(value.item())
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def _write_json(path: Path, data: Any) -> None:
    atomic_write_json(path, _jsonable(data))


def _publish_latest(figure: Path, latest: Path) -> None:
    atomic_write(latest, lambda tmp: shutil.copyfile(figure, tmp))  # a viewer never sees a half-written "latest" figure


def _write_outputs(run_dir: Path, step: int, scalars: dict[str, float], details: dict[str, Any]) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    _write_json(run_dir / eval_step_file(step), {"step": step, "metrics": scalars, **details})
    if "confusion" in details and "latent_usage" in details:
        figure = run_dir / f"latents_step{step}.png"
        plot_latent_figure(details["confusion"], details["confusion_latent_labels"], details["confusion_strategy_labels"],
                           details["latent_usage"], figure, title=f"step {step}")
        _publish_latest(figure, run_dir / LATENTS_FIGURE)
    if "info_gain" in details:
        figure = run_dir / f"information_gain_step{step}.png"
        plot_information_gain(details["info_gain"]["mean_by_position"], figure,
                              decision_positions=details["info_gain"].get("decision_positions"),
                              title=f"information gain b_t - l_t by y position, step {step}")
        _publish_latest(figure, run_dir / "information_gain.png")


# ----------------------------------------------------------------------------------------------
# Entry points
# ----------------------------------------------------------------------------------------------


def evaluate(
    *,
    engine,
    model,
    cfg,
    val: Sequence[EncodedExample],
    reference,
    task,
    run_dir: str | os.PathLike | None,
    step: int,
    all_gather_object: Callable[[list, Any], None] | None = None,
) -> dict[str, float]:
    """Evaluate on the validation set; collective (call on every rank). -> flat dict of floats.

    ``engine`` provides ``module`` (the wrapped module every forward goes through), ``rank``,
    ``world_size``, ``device`` and ``is_main``; ``model`` the ``tokens`` and ``tokenizer``; ``reference``
    ``ref_nll(engine, batch)`` and ``c_base.value``; ``task`` a parser (``parse``, ``answer``) or None.
    The module is put in eval mode and every submodule's mode is restored afterwards. ``run_dir``
    None writes no file. ``all_gather_object`` replaces ``torch.distributed.all_gather_object``.
    """
    if not val:
        raise ValueError("val: the validation set is empty")
    module = engine.module
    modes = [(m, m.training) for m in module.modules()]
    module.eval()
    try:
        with torch.no_grad():
            scalars, details = _evaluate(engine=engine, model=model, cfg=cfg, val=val, reference=reference, task=task,
                                         all_gather_object=all_gather_object)
    finally:
        for m, training in modes:
            m.training = training
    if run_dir is not None and engine.is_main:
        _write_outputs(Path(run_dir), step, scalars, details)
    return {k: float(v) for k, v in scalars.items() if v is not None}


def _evaluate(*, engine, model, cfg, val, reference, task, all_gather_object):
    rank, world = engine.rank, engine.world_size
    indices, keep = shard_indices(len(val), rank=rank, world_size=world)
    local = _example_pass(engine=engine, model=model, cfg=cfg, val=val, reference=reference, indices=indices, keep=keep)
    records = gather_records(local, world_size=world, all_gather_object=all_gather_object)
    _check_complete(records, len(val), "example")

    decodes: list[dict] = []
    num_steps = None
    num_decode = min(cfg.num_eval_decode_examples, len(val))
    if num_decode > 0:
        num_steps = decode_length(cfg, val)
        if cfg.latent_type == "discrete":
            # every latent, also without a parser: control/distinct_outputs compares the decodes across z
            specs = {r["index"]: {"latents": list(range(cfg.num_latents))} for r in records[:num_decode]}
        else:
            specs = {r["index"]: {"z": r["mu"]} for r in records[:num_decode]}
        d_indices, d_keep = shard_indices(num_decode, rank=rank, world_size=world)
        local_dec = _decode_pass(engine=engine, model=model, cfg=cfg, val=val, examples=specs,
                                    indices=d_indices, keep=d_keep, num_steps=num_steps)
        decodes = gather_records(local_dec, world_size=world, all_gather_object=all_gather_object)
        rows_per_example = len(next(iter(specs.values())).get("latents", [None]))
        _check_complete(decodes[::rows_per_example], num_decode, "decode")
    return summarize(records, decodes, cfg=cfg, val=val, task=task, tokenizer=model.tokenizer,
                     c_base=reference.c_base.value, num_decode_steps=num_steps)


def evaluate_run(
    run_dir: str | os.PathLike,
    output: str | os.PathLike | None = None,
    *,
    checkpoint: str | os.PathLike | None = None,
    backbone: str | None = None,
    device: str | torch.device | None = None,
    trust_remote_code: bool = False,
) -> dict[str, float]:
    """``zcvae evaluate RUN_DIR``: rebuild a finished run and evaluate it on one process.

    The config comes from ``RUN_DIR/run_config.json`` (key ``config``), the model from the backbone and
    the run's newest complete checkpoint (or ``checkpoint``) via ``zcvae.export.load.load_for_inference``,
    the validation set exactly as in training (``zcvae.data.dataset.load_splits``). Always fp32, one process
    (the local view of an engine, no optimizer); the reference is run online and c_base is the run's
    recorded value when its aggregation mode and validation fingerprint still match (else recomputed).
    Writes the metrics to ``output`` (default ``RUN_DIR/eval_metrics.json``) and the details and figure
    to ``evaluate/`` next to it, so the files the trainer wrote are never overwritten; the verdict of
    these metrics (``zcvae.eval.verdict``) goes to ``verdict.json`` next to ``output`` (by default
    replacing the trainer's, which it derives from the same checkpoint). A run trained
    with ``trust_remote_code`` needs ``trust_remote_code=True`` here too (the run directory alone
    never lets the backbone's code run).
    """
    from zcvae.runs.checkpoint import read_meta
    from zcvae.runs.rundir import check_writable
    from zcvae.config import TrainConfig
    from zcvae.data.dataset import load_splits
    from zcvae.export.load import load_for_inference, newest_checkpoint, resolve_backbone
    from zcvae.reference.c_base import CBase
    from zcvae.reference.provider import ReferenceProvider
    from zcvae.templates import encode_examples

    from zcvae.distributed import flush_denormals

    flush_denormals()
    run_dir = Path(run_dir)
    record_path = run_dir / RUN_CONFIG
    if not record_path.is_file():
        raise ValueError(f"run_dir: {str(run_dir)!r} has no {RUN_CONFIG} (not a run directory)")
    record = read_run_record(run_dir)
    # One process, no optimizer: whatever engine the run used, evaluation needs only its forward; and the
    # online reference, as a store would also compute b of every training example.
    cfg = dataclasses.replace(TrainConfig.from_dict(dict(record["config"]), source=str(record_path)),
                              engine="local", deepspeed_config=None, cpu_offload=False, precision="fp32", reference_policy="online")

    ckpt = newest_checkpoint(run_dir, checkpoint)
    step = int(read_meta(ckpt).get("step", cfg.max_steps))
    # before the evaluation, not after it: a read-only run directory must not cost the whole computation
    check_writable(Path(output) if output is not None else run_dir / EVAL_METRICS, what="evaluate output")
    backbone_dir = resolve_backbone(cfg, override=backbone, recorded=record.get("backbone"))
    model = load_for_inference(run_dir, backbone=backbone_dir, checkpoint=str(ckpt), trust_remote_code=trust_remote_code)
    target = torch.device(device) if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model.to(target)

    splits = load_splits(cfg)
    val, report = encode_examples(splits.val, model.tokenizer, model.tokens, max_length=cfg.max_length, num_z_slots=cfg.slot_tokens)
    if not val:
        raise ValueError(f"no usable validation example ({report.num_skipped} skipped, e.g. {report.skipped[:3]})")
    engine = _SingleProcess(module=model, device=target)
    stored = record.get("c_base")
    reference = ReferenceProvider.build(
        cfg, engine=engine, model=model, backbone=backbone_dir, train=val, val=val, passes=1.0, log=lambda *a: None,
        stored_c_base=CBase.from_dict(stored) if isinstance(stored, dict) else None,
    )
    output = Path(output) if output is not None else run_dir / EVAL_METRICS
    metrics = evaluate(engine=engine, model=model, cfg=cfg, val=val, reference=reference, task=splits.task,
                       run_dir=output.parent / "evaluate", step=step)
    output.parent.mkdir(parents=True, exist_ok=True)
    _write_json(output, {"step": step, "checkpoint": str(ckpt), "metrics": metrics})
    from zcvae.eval.verdict import report_verdict

    report_verdict(output.parent, metrics, record["config"], step=step, source="evaluate", log=None)  # verdict.json next to it
    return metrics


class _SingleProcess:
    """What ``evaluate`` and ``ReferenceProvider.build`` need of an engine, for one process."""

    def __init__(self, *, module: torch.nn.Module, device: torch.device):
        from zcvae.distributed import DistInfo

        self.module = self.model = module
        self.device = device
        self.rank, self.world_size, self.local_rank, self.is_main = 0, 1, 0, True
        self.info = DistInfo(rank=0, world_size=1, local_rank=0, device=device)

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        return tensor.detach().clone()

    def barrier(self) -> None:
        pass
