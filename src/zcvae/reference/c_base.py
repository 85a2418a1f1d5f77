"""c_base per aggregation mode (docs/objective.md#c_base): the validation mean of A_mode(b_i), reduced as a
(sum, count) pair across ranks and recorded with its mode, fingerprint and source. Units: nats per
token (mean), nats per sequence (sum) or nats per token of the whole validation set (token).

One c_base per mode:
    mean   (1/|V|) sum_i (1/n_i) sum_t b_it        pair (sum_i A_mean(b_i), |V|)
    sum    (1/|V|) sum_i sum_t b_it                pair (sum_i A_sum(b_i),  |V|)
    token  sum_i sum_t b_it / sum_i n_i            pair (sum_i A_sum(b_i),  sum_i n_i)
The token value is E_i[A_token(b_i)] with n_bar the validation set's mean length, the global token
mean of the ``token`` mode. A fixed sum scale C (``sum_scale``) does not get a c_base of its own: the loss
divides the per-sequence sum c_base by C, so the normalised terms are exactly those of plain sum.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from zcvae.core.losses import AGGREGATION_MODES, base_loss
from zcvae.reference.store import C_BASE_SOURCES, ReferenceStore
from zcvae.strict import StrictDataclass, check_keys

__all__ = ["CBase", "c_base_from_store", "c_base_from_sum_count", "c_base_sum_count", "resolve_c_base"]

# ----------------------------------------------------------------------------------------------
# c_base
# ----------------------------------------------------------------------------------------------


def _check_mode(mode: str) -> None:
    if mode not in AGGREGATION_MODES:
        raise ValueError(f"mode must be one of {AGGREGATION_MODES}, got {mode!r}")


def _check_scale(value: Any, field: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{field} must be a number, got {value!r}")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{field} must be finite and > 0, got {value!r}")
    return float(value)


@dataclasses.dataclass(frozen=True)
class CBase(StrictDataclass):
    """The z-free reference scale c_base and what it was computed for."""

    value: float
    """Mean over the validation set of A_mode(b_i) (nats/token under mean and token, nats/sequence
    under sum), or the user's ``zfree_reference_scale``."""
    mode: str
    """Token aggregation mode the value belongs to: ``mean``, ``sum`` or ``token`` (never mixed: docs/objective.md#c_base)."""
    fingerprint: str
    """Digest of the validation reference (backbone, template, vocabulary, data) it was computed on;
    for a user value, the run's digest at the time (recorded, not checked)."""
    source: str
    """``validation`` (computed) or ``user`` (given as zfree_reference_scale)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "value", _check_scale(self.value, "c_base value"))
        _check_mode(self.mode)
        if self.source not in C_BASE_SOURCES:
            raise ValueError(f"c_base source must be one of {C_BASE_SOURCES}, got {self.source!r}")
        if not isinstance(self.fingerprint, str):
            raise ValueError(f"c_base fingerprint must be a string, got {self.fingerprint!r}")

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> "CBase":
        check_keys(cls, values, what="c_base record", require_all=True)
        return cls(**values)


def c_base_sum_count(ref_nll_BN: torch.Tensor, mask_BN: torch.Tensor, mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sum_i A_mode(b_i), number of examples with a supervised token)`` of one batch, float64 scalars;
    under ``token`` ``(sum_i sum_t b_it, sum_i n_i)`` (the global token mean's numerator and denominator).

    Accumulate over batches, all-reduce both (one ``all_reduce`` of the stacked pair) and finish with
    :func:`c_base_from_sum_count`. float64 keeps the result independent of the sharding to ~1e-15.
    """
    _check_mode(mode)
    valid_B = mask_BN.any(dim=-1)
    if mode == "token":
        per_example_B = base_loss(ref_nll_BN.detach().to(torch.float64), mask_BN, "sum")  # (B,)
        count = mask_BN.sum().to(torch.float64)
    else:
        per_example_B = base_loss(ref_nll_BN.detach().to(torch.float64), mask_BN, mode)  # (B,)
        count = valid_B.sum().to(torch.float64)
    total = torch.where(valid_B, per_example_B, torch.zeros_like(per_example_B)).sum()
    return total, count


def c_base_from_sum_count(total: float | torch.Tensor, count: float | torch.Tensor, *, mode: str, fingerprint: str) -> CBase:
    """c_base = total / count (globally reduced), recorded as a validation value; ValueError if count is 0."""
    count = float(count)
    if count <= 0:
        raise ValueError("c_base: the validation set has no example with a supervised token")
    return CBase(value=float(total) / count, mode=mode, fingerprint=fingerprint, source="validation")


def c_base_from_store(store: ReferenceStore, val_ids: Sequence[str], mode: str, *, chunk_size: int = 1024) -> CBase:
    """c_base over ``val_ids`` of a store (every rank holds the whole store: no reduction needed)."""
    _check_mode(mode)
    total = torch.zeros((), dtype=torch.float64)
    count = torch.zeros((), dtype=torch.float64)
    ids = list(val_ids)
    for start in range(0, len(ids), chunk_size):
        s, c = c_base_sum_count(*store.lookup(ids[start : start + chunk_size]), mode)
        total, count = total + s, count + c
    return c_base_from_sum_count(total, count, mode=mode, fingerprint=store.fingerprint)


def resolve_c_base(
    *,
    mode: str,
    fingerprint: str,
    stored: CBase | None,
    user_value: float | None,
    recompute: Callable[[], CBase] | None,
) -> CBase:
    """The c_base a run uses.

    1. ``user_value`` (the config's ``zfree_reference_scale``) wins and is recorded with source "user".
    2. ``stored`` (e.g. from a checkpoint) is reused only if its mode and fingerprint are the run's.
    3. Otherwise ``recompute()`` (which must return this mode and fingerprint); with ``recompute`` None,
       ValueError naming the stored and the wanted mode/fingerprint (docs/objective.md#c_base: a mean-scale c_base is
       never silently the denominator of a sum-scale objective).
    """
    _check_mode(mode)
    if user_value is not None:
        return CBase(value=_check_scale(user_value, "zfree_reference_scale"), mode=mode, fingerprint=fingerprint, source="user")
    if stored is not None and stored.mode == mode and stored.fingerprint == fingerprint:
        return stored
    if recompute is not None:
        fresh = recompute()
        if fresh.mode != mode or fresh.fingerprint != fingerprint:
            raise ValueError(f"recomputed c_base has mode={fresh.mode!r} fingerprint={fresh.fingerprint[:16]!r}, "
                             f"wanted mode={mode!r} fingerprint={fingerprint[:16]!r}")
        return fresh
    if stored is not None:
        raise ValueError(
            f"stored c_base (mode={stored.mode!r}, fingerprint={stored.fingerprint[:16]!r}, source={stored.source!r}) "
            f"does not match this run (mode={mode!r}, fingerprint={fingerprint[:16]!r}) and recomputation is off: "
            "recompute it on the validation set or give zfree_reference_scale"
        )
    raise ValueError("no c_base: nothing stored, no zfree_reference_scale, and recomputation is off")

