"""Token aggregation A and W, and the token weights pi and rho, over a left-aligned span.

The mathematics, in the project's notation: docs/objective.md#aggregation.

Shape legend
    B  examples in the batch
    N  left-aligned supervised y-span positions (``core.nll.gather_span``)
    (``values_BN`` may carry extra leading dims, e.g. [B, K, N] for K latent branches.)

Units: ``A_mean`` gives nats per supervised token, ``A_sum`` nats per sequence, ``A_token`` nats per
supervised token of the global batch; "mode units" means whichever one is selected.

Aggregation, over the supervised tokens S_i of example i, n_i = |S_i|:
    A_mean(v_i) = (1/n_i) sum_t v_it          A_sum(v_i) = sum_t v_it / C
    W_mean(v_i; w_i) = sum_t w_it v_it        W_sum(v_i; w_i) = n_i sum_t w_it v_it / C
    A_token(v_i) = sum_t v_it / n_bar         W_token(v_i; w_i) = n_i sum_t w_it v_it / n_bar
with token weights w_i summing to 1 over S_i; so alpha = 0 recovers A in every mode.
    C      the fixed scale of the sum mode (``sum_scale``, Dr. GRPO's constant divisor; 1 when unset);
    n_bar  (sum_j n_j) / (number of valid examples), over the *global* batch G of the optimizer step
           (all ranks, all accumulation micro-batches): ``mean_num_tokens``, which the caller computes
           (the trainer all-reduces the supervised-token count before the forwards).
The batch reduction is an example mean in every mode, so under ``token`` it gives the global token
mean, (1/|G|) sum_i A_token(v_i) = sum_i sum_t v_it / sum_i n_i: each supervised token
of the global batch weighs the same. ``token`` is the sum mode divided by n_bar, a constant within
one step, so the token-weighted terms keep the n_i rule of W: an example's token weights only
redistribute its n_i tokens' share of the global batch, and alpha = 0 gives A_token.

Token weights, from the frozen z-free reference NLL b (clamped at 0, detached):
    pi_it  = b_it^alpha / sum_s b_is^alpha       (surprisal share; alpha = 0 uniform, 0^0 = 1)
    rho_it ~ (b_it + epsilon)^(-alpha), normalised over S_i
An example whose b is 0 on every supervised token is *degenerate*: pi is uniform there. One whose
largest b is below ``NEARLY_DEGENERATE_MAX_SURPRISAL`` is *nearly degenerate* (:func:`reference_degeneracy`).
"""

from __future__ import annotations

import math
from typing import Any, Union

import torch
from zcvae.core.nll import compute_dtype

__all__ = [
    "AGGREGATION_MODES",
    "NEARLY_DEGENERATE_MAX_SURPRISAL",
    "aggregate",
    "base_loss",
    "inverse_surprisal_weights",
    "is_real_number",
    "masked",
    "reference_degeneracy",
    "reference_nll",
    "surprisal_share_weights",
    "weighted_aggregate",
]

AGGREGATION_MODES = ("mean", "sum", "token")

NEARLY_DEGENERATE_MAX_SURPRISAL = 0.01
"""Nats. An example whose every supervised token has b_t below this is nearly degenerate: the reference
gives each of its tokens a probability above e^-0.01 ~ 0.99, so no token is a choice it still sees as
open (the notes' "b_t ~ 0 for all t": no token-level strategy ambiguity left). A two-way decision costs
log 2 ~ 0.69 nats, and even the likely side of a 99:1 one costs 0.01; the entangled tiny backbones'
smallest max_t b_t is about 0.7 nats. pi then follows differences among near-certain tokens, not a decision."""


def is_real_number(value: Any) -> bool:
    """An int or float that is not a bool: what a numeric knob or scale may be."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_mode(mode: str) -> None:
    if mode not in AGGREGATION_MODES:
        raise ValueError(f"mode must be one of {AGGREGATION_MODES}, got {mode!r}")


def masked(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    # where, not multiply: padded slots may hold inf/nan, and 0 * inf would poison sums and grads.
    return torch.where(mask, values, torch.zeros((), dtype=values.dtype, device=values.device))


def _check_divisor(mode: str, divisor: Union[float, torch.Tensor, None]) -> None:
    if mode == "token" and divisor is None:
        raise ValueError("mode 'token' needs its divisor: n_bar, the global batch's supervised tokens per valid example")
    if mode == "mean" and divisor is not None:
        raise ValueError("mode 'mean' takes no divisor (it divides each example by its own n_i)")


def aggregate(
    values_BN: torch.Tensor, mask_BN: torch.Tensor, mode: str, *, divisor: Union[float, torch.Tensor, None] = None
) -> torch.Tensor:
    """A_mode over the masked last dim -> [...] (leading dims kept; 0 for an empty row).

    ``values_BN`` may carry extra leading dims (e.g. [B, K, N]) as long as ``mask_BN`` broadcasts.
    ``divisor``: the token sum is divided by it under ``sum`` (C; None = 1) and ``token`` (n_bar, required).
    """
    _check_mode(mode)
    _check_divisor(mode, divisor)
    total = masked(values_BN, mask_BN).sum(dim=-1)
    if mode != "mean":
        return total if divisor is None else total / divisor
    num = mask_BN.sum(dim=-1).clamp_min(1).to(total.dtype)
    return total / num


def weighted_aggregate(
    values_BN: torch.Tensor,
    weights_BN: torch.Tensor,
    mask_BN: torch.Tensor,
    mode: str,
    *,
    divisor: Union[float, torch.Tensor, None] = None,
) -> torch.Tensor:
    """W_mode: sum_t w_t v_t under mean, n * sum_t w_t v_t / divisor under sum and token -> [...].

    ``weights_BN`` must already sum to 1 over the active tokens of each row (as returned by
    ``surprisal_share_weights`` / ``inverse_surprisal_weights``); it is not renormalised here.
    ``divisor`` as in :func:`aggregate`.
    """
    _check_mode(mode)
    _check_divisor(mode, divisor)
    total = masked(values_BN * weights_BN, mask_BN).sum(dim=-1)
    if mode == "mean":
        return total
    total = total * mask_BN.sum(dim=-1).to(total.dtype)
    return total if divisor is None else total / divisor


def reference_nll(ref_nll_BN: torch.Tensor, mask_BN: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """b: detached, clamped at 0 (an NLL is never negative; tiny negatives are rounding), 0 off-mask."""
    return masked(ref_nll_BN.detach().to(dtype).clamp_min(0.0), mask_BN)


def base_loss(
    ref_nll_BN: torch.Tensor, mask_BN: torch.Tensor, mode: str, *, divisor: Union[float, torch.Tensor, None] = None
) -> torch.Tensor:
    """A_mode(b_i) -> [B]; the mean of this over a validation set is the mode-matched c_base (for
    ``token`` with divisor = the validation set's n_bar; ``zcvae.reference.c_base`` reduces it exactly)."""
    return aggregate(reference_nll(ref_nll_BN, mask_BN, compute_dtype(ref_nll_BN.dtype)), mask_BN, mode, divisor=divisor)


def _normalise(raw_BN: torch.Tensor, mask_BN: torch.Tensor) -> torch.Tensor:
    """raw / sum(raw) over the mask; 0 on rows whose sum is 0."""
    raw_BN = masked(raw_BN, mask_BN)
    total_B = raw_BN.sum(dim=-1, keepdim=True)
    return raw_BN / torch.where(total_B > 0, total_B, torch.ones_like(total_B))


def _uniform(mask_BN: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    num = mask_BN.sum(dim=-1, keepdim=True).clamp_min(1).to(dtype)
    return mask_BN.to(dtype) / num


def _check_alpha(alpha: float) -> None:
    if not is_real_number(alpha) or not math.isfinite(alpha) or alpha < 0:
        raise ValueError(f"alpha must be a finite number >= 0, got {alpha!r}")


def surprisal_share_weights(
    ref_nll_BN: torch.Tensor, mask_BN: torch.Tensor, alpha: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """pi^(alpha) -> (pi_BN, degenerate_B).

    pi_t = b_t^alpha / sum_s b_s^alpha over active tokens (b detached, clamped at 0; 0^0 = 1, so
    alpha = 0 is uniform). ``degenerate_B`` (bool) marks rows with active tokens whose b is 0 on all
    of them; they get uniform weights. Rows without active tokens get all-zero weights.
    """
    _check_alpha(alpha)
    b_BN = reference_nll(ref_nll_BN, mask_BN, compute_dtype(ref_nll_BN.dtype))
    # Powers of b / max(b) instead of b: same pi, but b^alpha cannot overflow for large alpha.
    b_max_B1 = _max_reference_nll(b_BN)[..., None]
    ratio_BN = b_BN / torch.where(b_max_B1 > 0, b_max_B1, torch.ones_like(b_max_B1))
    pi_BN = _normalise(ratio_BN.pow(alpha), mask_BN)
    degenerate_B = _degenerate(mask_BN, b_max_B1.squeeze(-1))
    pi_BN = torch.where(degenerate_B[..., None], _uniform(mask_BN, pi_BN.dtype), pi_BN)
    return pi_BN, degenerate_B


def _max_reference_nll(b_BN: torch.Tensor) -> torch.Tensor:
    """max_t b_t -> [B] over a clamped, masked b (0 on rows without active tokens; amax fails on N = 0)."""
    return b_BN.amax(dim=-1) if b_BN.shape[-1] > 0 else b_BN.sum(dim=-1)


def _degenerate(mask_BN: torch.Tensor, b_max_B: torch.Tensor) -> torch.Tensor:
    return mask_BN.any(dim=-1) & (b_max_B <= 0)


def reference_degeneracy(ref_nll_BN: torch.Tensor, mask_BN: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (degenerate_B, nearly_degenerate_B), bool, from the reference NLL (clamped at 0, as pi reads it).

    degenerate: active tokens, b = 0 on all of them (pi uniform, as ``surprisal_share_weights`` marks);
    nearly degenerate: active tokens, 0 < max_t b_t < ``NEARLY_DEGENERATE_MAX_SURPRISAL`` (the two are
    disjoint). Rows without active tokens are neither.
    """
    b_max_B = _max_reference_nll(reference_nll(ref_nll_BN, mask_BN, compute_dtype(ref_nll_BN.dtype)))
    degenerate_B = _degenerate(mask_BN, b_max_B)
    nearly_B = mask_BN.any(dim=-1) & (b_max_B > 0) & (b_max_B < NEARLY_DEGENERATE_MAX_SURPRISAL)
    return degenerate_B, nearly_B


def inverse_surprisal_weights(
    ref_nll_BN: torch.Tensor, mask_BN: torch.Tensor, alpha: float, epsilon: float
) -> torch.Tensor:
    """rho^(alpha) -> rho_BN, proportional to (b_t + epsilon)^(-alpha), normalised over active tokens.

    b is detached and clamped at 0. Rows without active tokens get all-zero weights.
    """
    _check_alpha(alpha)
    if not is_real_number(epsilon) or not math.isfinite(epsilon) or epsilon <= 0:
        raise ValueError(f"epsilon must be a finite number > 0, got {epsilon!r}")
    b_BN = reference_nll(ref_nll_BN, mask_BN, compute_dtype(ref_nll_BN.dtype))
    if b_BN.shape[-1] == 0:
        return b_BN
    shifted_BN = b_BN + epsilon
    # ((min + eps) / (b + eps))^alpha lies in (0, 1] with 1 at the smallest b: no overflow.
    lo_B1 = torch.where(mask_BN, shifted_BN, torch.full_like(shifted_BN, float("inf"))).amin(dim=-1, keepdim=True)
    lo_B1 = torch.where(torch.isfinite(lo_B1), lo_B1, torch.ones_like(lo_B1))  # rows without active tokens
    return _normalise((lo_B1 / shifted_BN).pow(alpha), mask_BN)

