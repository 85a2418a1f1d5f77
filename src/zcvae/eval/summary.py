"""All metrics of an evaluation from its gathered records: one summariser per latent type, then the
parts every latent shares (losses, reachable NMI, strata, information gain, decoding).

Pure: computed once, over the whole validation set, from the records every rank holds after
``eval.records.gather_records``, so the values do not depend on the sharding. What each key means
is listed in ``eval.evaluation``'s docstring.

Shape legend: N examples (records), K discrete latents, D Gaussian latent dimensions, T y positions.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from zcvae.core.losses import DIAGNOSTIC_REDUCTIONS
from zcvae.core.objective import AuxiliaryWeights, marginal_router_terms
from zcvae.eval.metrics import (
    ACTIVE_UNITS_DELTA,
    controllability_metrics,
    discrete_latent_metrics,
    distinct_outputs,
    gaussian_latent_metrics,
    information_gain_by_position,
    nmi_ratio,
    reachable_nmi,
)
from zcvae.eval.records import ControlRecord, DecodeRecord, ExampleRecord
from zcvae.eval.strata import stratified_decoding_metrics, stratified_metrics
from zcvae.data.encoding import EncodedExample

logger = logging.getLogger(__name__)

__all__ = [
    "MIN_LABELLED",
    "MIN_LABELLED_PER_STRATEGY",
    "LatentSummary",
    "control_records",
    "gold_labels_problem",
    "summarize",
    "summarize_discrete",
    "summarize_gaussian",
]

# Decoded samples kept in eval_step{step}.json for a person to read.
NUM_JSON_SAMPLES = 8
# Gold-strategy metrics need this many labelled validation examples, per strategy present and in all.
MIN_LABELLED_PER_STRATEGY = 2
MIN_LABELLED = 8


def summarize(
    records: list[ExampleRecord],
    decodes: list[DecodeRecord],
    *,
    cfg,
    val: Sequence[EncodedExample],
    task,
    tokenizer,
    c_base: float,
    num_decode_steps: int | None,
) -> tuple[dict[str, float], dict[str, Any]]:
    """All metrics from the gathered records -> (flat scalars, non-scalar details for the JSON file)."""
    scalars = reduce_terms(records)
    scalars["c_base"] = float(c_base)
    details: dict[str, Any] = {}
    labels = [r.strategy for r in records]
    if any(s is not None for s in labels):
        scalars["num_labelled_examples"] = float(sum(s is not None for s in labels))
    if (problem := gold_labels_problem(labels)) is not None:
        # an NMI of 1.000 from one labelled example says nothing: report it absent, not perfect
        logger.warning(f"[eval] gold-strategy metrics (nmi, ari, matching_accuracy, by_strategy/...) are absent: {problem}")
        details["gold_metrics_absent"] = problem
        labels = [None] * len(labels)

    discrete = cfg.model.latent_type == "discrete"
    summarise_latent = summarize_discrete if discrete else summarize_gaussian
    latent = summarise_latent(records, labels, cfg=cfg)
    scalars.update(latent.scalars)
    if latent.router_loss is not None:
        scalars["loss"] += latent.router_loss
    details.update(latent.details)

    if any(s is not None for s in labels) and "nmi" in scalars:
        # The best any encoder of (x, y) can do: identical (x, y) pairs cannot be told apart.
        labelled = [n for n, strategy in enumerate(labels) if strategy is not None]
        inputs = [(tuple(val[records[n].index].x_ids), tuple(val[records[n].index].y_ids)) for n in labelled]
        candidates = _equivalent_strategies(labelled, records, val=val, task=task, tokenizer=tokenizer)
        scalars["nmi_reachable"], _ = reachable_nmi(inputs, [labels[n] for n in labelled], candidates)
        scalars["nmi_ratio"] = nmi_ratio(scalars["nmi"], scalars["nmi_reachable"])
    scalars.update(stratified_metrics(records, labels, latent.assign, discrete=discrete))
    gain_scalars, details["info_gain"] = information_gain(records, discrete=discrete, val=val, task=task, tokenizer=tokenizer)
    scalars.update(gain_scalars)
    if decodes:
        decode_scalars, decode_details = decoding_metrics(
            records, labels, decodes, discrete=discrete, val=val, task=task, tokenizer=tokenizer,
            map_latent=latent.map_latent, num_decode_steps=num_decode_steps,
        )
        scalars.update(decode_scalars)
        details.update(decode_details)
    return scalars, details


# ----------------------------------------------------------------------------------------------
# One summariser per latent type
# ----------------------------------------------------------------------------------------------


@dataclass
class LatentSummary:
    """What a latent type contributes to the summary."""

    scalars: dict[str, float]
    details: dict[str, Any]
    """For eval_step{step}.json and the latent figure (``confusion``, ``latent_usage``, ...)."""
    assign: list[int | None]
    """The latent each example is assigned to (discrete: argmax q; Gaussian: its k-means cluster, for
    labelled rows only; None: no stratified NMI for it)."""
    map_latent: dict[int, int] | None
    """Discrete: example index -> argmax latent, the decode whose exact match counts; Gaussian: None."""
    router_loss: float | None = None
    """Discrete: the objective's batch-level router terms on the whole set, added to ``loss``."""


def summarize_discrete(records: list[ExampleRecord], labels: Sequence[Any], *, cfg) -> LatentSummary:
    """MI, router support, prior agreement and (with labels) NMI/ARI/matching of q(z|x,y) over the set."""
    has_labels = any(s is not None for s in labels)
    q_NK = np.asarray([r.posterior_K for r in records], dtype=np.float64)
    p_NK = np.asarray([r.prior_K for r in records], dtype=np.float64)
    lat = discrete_latent_metrics(q_NK, p_NK, labels=labels if has_labels else None)
    scalars: dict[str, float] = {}
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
    details: dict[str, Any] = {"latent_usage": lat["latent_usage"]}
    if "confusion" in lat:
        details.update(confusion=lat["confusion"], confusion_latent_labels=lat["confusion_latent_labels"],
                       confusion_strategy_labels=lat["confusion_strategy_labels"], matching=lat["matching"])
    else:
        counts_K1 = np.bincount(q_NK.argmax(1), minlength=q_NK.shape[1])[:, None]
        details.update(confusion=counts_K1, confusion_latent_labels=list(range(q_NK.shape[1])),
                       confusion_strategy_labels=["all"])
    assign = [int(np.argmax(r.posterior_K)) for r in records]
    return LatentSummary(scalars=scalars, details=details, assign=list(assign),
                         map_latent={r.index: a for r, a in zip(records, assign)}, router_loss=float(router_term))


def summarize_gaussian(records: list[ExampleRecord], labels: Sequence[Any], *, cfg) -> LatentSummary:
    """Active units, KL to N(0, I) and (with labels) NMI/ARI of k-means of the posterior means."""
    has_labels = any(s is not None for s in labels)
    mu_ND = np.asarray([r.mu_D for r in records], dtype=np.float64)
    logvar_ND = np.asarray([r.logvar_D for r in records], dtype=np.float64)
    out = LatentSummary(scalars={}, details={}, assign=[None] * len(records), map_latent=None)
    if mu_ND.shape[0] < 2:
        return out  # a variance across examples needs two of them
    lat = gaussian_latent_metrics(mu_ND, logvar_ND, labels=labels if has_labels else None,
                                  delta=ACTIVE_UNITS_DELTA, seed=cfg.optimization.seed)
    for key in ("active_units", "active_units_delta", "kl_to_standard_normal", "nmi", "ari",
                "homogeneity", "completeness", "num_clusters"):
        if key in lat:
            out.scalars[key] = float(lat[key])
    out.details["mean_variance_per_dim"] = lat["mean_variance_per_dim"]
    if "num_clusters" in lat:
        keep = [i for i, s in enumerate(labels) if s is not None]
        clusters = lat["cluster_labels"]  # of the labelled rows, in order
        for c, i in zip(clusters, keep):
            out.assign[i] = int(c)
        strategies = sorted({labels[i] for i in keep}, key=str)
        confusion = np.zeros((int(lat["num_clusters"]), len(strategies)), dtype=np.int64)
        for c, i in zip(clusters, keep):
            confusion[c, strategies.index(labels[i])] += 1
        out.details.update(confusion=confusion, confusion_latent_labels=list(range(confusion.shape[0])),
                           confusion_strategy_labels=strategies,
                           latent_usage=confusion.sum(1) / max(1, confusion.sum()))
    return out


# ----------------------------------------------------------------------------------------------
# Shared by both latent types
# ----------------------------------------------------------------------------------------------


def reduce_terms(records: list[ExampleRecord]) -> dict[str, float]:
    """Example-set reductions of every per-example term, as the trainer reduces them."""
    valid = [r for r in records if r.valid]
    out: dict[str, float] = {}
    for name in records[0].terms:
        if name == "valid":
            continue
        how = DIAGNOSTIC_REDUCTIONS.get(name, "mean")
        if how == "sum":
            out[name] = float(sum(r.terms[name] for r in records))
            continue
        values = [r.terms[name] for r in valid]
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


def information_gain(records: list[ExampleRecord], *, discrete: bool, val, task, tokenizer) -> tuple[dict[str, float], dict[str, Any]]:
    """Information gain of z per y position -> (``info_gain/mean``, ``info_gain/first_token``; the
    per-position details with the task family's decision positions)."""
    T = max(r.num_tokens for r in records)
    cond_NT = np.zeros((len(records), T))
    ref_NT = np.zeros((len(records), T))
    mask_NT = np.zeros((len(records), T), dtype=bool)
    for n, r in enumerate(records):
        m = r.num_tokens
        cond_NT[n, :m], ref_NT[n, :m], mask_NT[n, :m] = r.cond_nll_N, r.ref_nll_N, True
    gain = information_gain_by_position(cond_NT, ref_NT, mask_NT)
    scalars: dict[str, float] = {}
    if gain["mean"] is not None:
        scalars["info_gain/mean"] = gain["mean"]
        scalars["info_gain/first_token"] = gain["first_token_mean"]
    details = {"mean_by_position": gain["mean_by_position"], "count_by_position": gain["count_by_position"],
               "z": "posterior argmax" if discrete else "mean over posterior samples",
               "decision_positions": _decision_positions(records, val=val, task=task, tokenizer=tokenizer)}
    return scalars, details


def decoding_metrics(
    records: list[ExampleRecord], labels: Sequence[Any], decodes: list[DecodeRecord], *, discrete: bool, val, task,
    tokenizer, map_latent: dict[int, int] | None, num_decode_steps: int | None,
) -> tuple[dict[str, float], dict[str, Any]]:
    """Exact match, closure, distinct outputs and (with a parser) controllability of the decodes ->
    (scalars, details: ``control`` and a few ``samples``)."""
    scalars: dict[str, float] = {"decode/num_examples": float(len({d.index for d in decodes})),
                                 "decode/max_new_tokens": float(num_decode_steps)}
    details: dict[str, Any] = {}
    ctrl_records = control_records(decodes, val=val, tokenizer=tokenizer, task=task, map_latent=map_latent)
    exact = [float(r.exact_match) for r in ctrl_records if r.exact_match is not None]
    scalars["exact_match"] = float(np.mean(exact))
    scalars.update(stratified_decoding_metrics(records, labels, ctrl_records))
    if discrete:
        scalars["control/distinct_outputs"] = distinct_outputs(decodes)
    # every decoded row (each latent of each x): a decoder that cannot emit </y> never stops
    scalars["closure_rate"] = float(np.mean([bool(d.closed) for d in decodes]))
    if task is not None:
        ctrl = controllability_metrics(ctrl_records)
        scalars["control/parse_rate"] = float(ctrl["parse_rate"])
        scalars["answer_accuracy"] = float(ctrl["answer_accuracy"])
        if "gold_agreement" in ctrl:
            scalars["control/gold_agreement"] = float(ctrl["gold_agreement"])
        if discrete:
            scalars["control/purity"] = float(ctrl["mean_purity"])
            scalars["control/matching_accuracy"] = float(ctrl["matching_accuracy"])
            details["control"] = {"purity_per_latent": ctrl["purity_per_latent"],
                                  "majority_strategy": ctrl["majority_strategy"], "matching": ctrl["matching"]}
    details["samples"] = _samples(decodes, ctrl_records, val=val, tokenizer=tokenizer)
    return scalars, details


def _samples(decodes: list[DecodeRecord], ctrl_records: list[ControlRecord], *, val, tokenizer) -> list[dict[str, Any]]:
    """The decodes of the first ``NUM_JSON_SAMPLES`` x, as text, for a person to read."""
    samples = []
    for d, r in zip(decodes, ctrl_records):
        if d.index >= NUM_JSON_SAMPLES:
            continue
        ex = val[d.index]
        judged: dict[str, Any] = {}
        if r.parse_ok is not None:
            judged.update(parsed_strategy=r.parsed_strategy, parse_ok=r.parse_ok, answer_correct=r.answer_correct)
        if r.exact_match is not None:
            judged["exact_match"] = r.exact_match
        samples.append({"index": d.index, "id": ex.id, "latent": d.latent, "x": _decoded_text(tokenizer, ex.x_ids),
                        "gold_y": _decoded_text(tokenizer, ex.y_ids), "decoded_y": _decoded_text(tokenizer, d.generated),
                        "closed": d.closed, **judged})
    return samples


def _decoded_text(tokenizer, ids: Sequence[int]) -> str:
    return tokenizer.decode(list(ids))


def control_records(decodes: list[DecodeRecord], *, val, tokenizer, task, map_latent) -> list[ControlRecord]:
    """Parse each decode; ``exact_match`` only on the decode under the posterior's argmax latent."""
    out = []
    answers: dict[int, str | None] = {}
    for d in decodes:
        i = d.index
        ex = val[i]
        rec = ControlRecord(index=i, latent=0 if d.latent is None else d.latent, gold_strategy=ex.strategy)
        if map_latent is None or d.latent == map_latent[i]:
            rec.exact_match = bool(d.closed and list(d.generated) == list(ex.y_ids))
        if task is not None:
            parsed = task.parse(_decoded_text(tokenizer, d.generated))
            if i not in answers:
                try:
                    answers[i] = task.answer(_decoded_text(tokenizer, ex.x_ids))
                except ValueError:
                    answers[i] = None  # x truncated or not of this task: no answer to compare with
            rec.parsed_strategy = parsed.strategy
            rec.parse_ok = bool(parsed.parse_ok and d.closed)
            rec.answer_correct = bool(parsed.parse_ok and d.closed and answers[i] is not None and parsed.answer == answers[i])
        out.append(rec)
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
        ex = val[records[n].index]
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
        ex = val[r.index]
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
