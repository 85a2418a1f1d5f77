"""Metrics per stratum of the validation set: per gold strategy and per tercile of the supervised length.

Answers the aggregation pilot's confounds ("does sum only upweight long examples?", "length correlates
with parse and answer correctness"): the same losses, latent usage and decoding metrics as the whole
set, restricted to ``by_strategy/<s>`` and ``by_length/t1..t3``. Pure: computed from the gathered
records, so exact under sharding.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from zcvae.core.losses import RECONSTRUCTION_TERMS
from zcvae.eval.metrics import ACTIVE_UNITS_DELTA, cluster_scores, discrete_latent_metrics, gaussian_latent_metrics, length_terciles
from zcvae.eval.records import ControlRecord, ExampleRecord

__all__ = ["stratified_decoding_metrics", "stratified_metrics", "strata"]


def _stratum_name(strategy: Any) -> str:
    # A metric name part: TensorBoard groups tags on "/", so a strategy must not contain one.
    return str(strategy).replace("/", "_").replace(" ", "_") or "_"


def strata(records: list[ExampleRecord], labels: Sequence[Any]) -> tuple[list[tuple[str, list[int], Any]], np.ndarray]:
    """The strata ``[(prefix, rows, strategy or None), ...]`` of the records, and every row's n_i.

    ``by_strategy/<s>`` per gold strategy (sorted), then ``by_length/t1..t3`` (terciles of n_i over
    every row, ``eval.metrics.length_terciles``; an empty tercile is left out). The one definition the
    loss, latent and decoding strata share, so ``by_length/t1`` names the same examples in all three.
    """
    num = len(records)
    lengths_N = np.asarray([r.num_tokens for r in records])
    found: list[tuple[str, list[int], Any]] = []
    for strategy in sorted({s for s in labels if s is not None}, key=str):
        found.append((f"by_strategy/{_stratum_name(strategy)}", [n for n in range(num) if labels[n] == strategy], strategy))
    tercile_N = length_terciles(lengths_N)
    for j in range(3):
        rows = np.flatnonzero(tercile_N == j).tolist()
        if rows:
            found.append((f"by_length/t{j + 1}", rows, None))
    return found, lengths_N


def stratified_decoding_metrics(records: list[ExampleRecord], labels: Sequence[Any], ctrl_records: list[ControlRecord]) -> dict[str, float]:
    """Exact match, answer accuracy and parse rate per stratum -> flat ``{name: value}``.

    The strata are those of :func:`stratified_metrics`, cut over the whole validation set (the
    terciles use every row's n_i), although only its first ``num_eval_decode_examples`` x are
    decoded: ``by_length/t1`` is the same set of examples for the losses and for decoding. Each
    metric is its whole-set definition restricted to the decodes of the stratum's examples:
      P/decode/num_examples    decoded examples in P (absent strata: no keys)
      P/exact_match            over the decode under each x's argmax latent (Gaussian: its mean)
      P/control/parse_rate     over every decode of P's x (every latent), as ``control/parse_rate``
      P/answer_accuracy        likewise, as ``answer_accuracy``; both only with a task parser
    ``ctrl_records``: ``eval.summary.control_records``' output (``exact_match`` on the argmax decode,
    ``parse_ok``/``answer_correct`` with a parser). Pure: exact under sharding.
    """
    out: dict[str, float] = {}
    by_index: dict[int, list[ControlRecord]] = {}
    for rec in ctrl_records:
        by_index.setdefault(rec.index, []).append(rec)
    for prefix, rows, _ in strata(records, labels)[0]:
        decoded = [rec for n in rows for rec in by_index.get(records[n].index, [])]
        if not decoded:
            continue
        out[f"{prefix}/decode/num_examples"] = float(len({rec.index for rec in decoded}))
        exact = [float(rec.exact_match) for rec in decoded if rec.exact_match is not None]
        if exact:
            out[f"{prefix}/exact_match"] = float(np.mean(exact))
        if all(rec.parse_ok is not None for rec in decoded):
            out[f"{prefix}/control/parse_rate"] = float(np.mean([bool(rec.parse_ok) for rec in decoded]))
            out[f"{prefix}/answer_accuracy"] = float(np.mean([bool(rec.answer_correct) for rec in decoded]))
    return out


def stratified_metrics(
    records: list[ExampleRecord], labels: Sequence[Any], assign: Sequence[int | None], *, discrete: bool
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
    strata_, lengths_N = strata(records, labels)
    scored = [n for n in range(num) if labels[n] is not None and assign[n] is not None]
    for prefix, rows, strategy in strata_:
        out[f"{prefix}/num_examples"] = float(len(rows))
        valid = [n for n in rows if records[n].valid]
        for name in (*RECONSTRUCTION_TERMS, "token_concentration_factor"):
            if valid and name in records[rows[0]].terms:
                out[f"{prefix}/{name}"] = float(np.mean([records[n].terms[name] for n in valid]))
        if discrete:
            lat = discrete_latent_metrics(np.asarray([records[n].posterior_K for n in rows], dtype=np.float64))
            out[f"{prefix}/mi"] = float(lat["mi"])
            out[f"{prefix}/num_used_latents"] = float(lat["num_used_latents"])
            for k, usage in enumerate(lat["latent_usage"]):
                out[f"{prefix}/latent_usage/{k}"] = float(usage)
        elif len(rows) >= 2:
            lat = gaussian_latent_metrics(np.asarray([records[n].mu_D for n in rows], dtype=np.float64), delta=ACTIVE_UNITS_DELTA)
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
