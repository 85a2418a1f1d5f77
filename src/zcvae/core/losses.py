"""Reconstruction-loss core: token NLL, span alignment, aggregation, token weights, the six terms.

The mathematics, in the project's notation: docs/objective.md.

Pure tensor math (no ``torch.distributed``, no config parsing beyond the dataclass below). Every
function returns per-example values; the trainer owns batch and cross-rank reduction.

Shape legend
    B  examples in the batch
    T  sequence positions (after the causal shift: T-1 of the input length)
    V  vocabulary
    K  latent branches (discrete: the K z values; Gaussian: S posterior samples)
    N  left-aligned supervised y-span positions (max span length in the batch, or ``n_span``)

Units: NLL in nats per token. ``A_mean`` gives nats per supervised token, ``A_sum`` nats per
sequence (docs/objective.md#aggregation), ``A_token`` nats per supervised token of the global batch; every "mode
units" below means whichever one is selected.

Pipeline
    1. ``token_nll(logits_BTV, labels_BT) -> nll_BT`` (width T-1, Hugging Face shift: position t of
       the output scores ``labels[:, t + 1]`` from ``logits[:, t]``; 0 where that label is -100).
    2. ``gather_span(nll_BT, labels_BT, n_span=N) -> (span_BN, mask_BN)`` for the z-conditioned rows
       and for the z-free reference rows. The y-span sits at different positions in the two
       templates (the z-conditioned one carries ``<z> z </z>``), so both are left-aligned to [B, N];
       pass the same ``n_span`` to force the same width.
    3. ``reconstruction_terms(token_nll=l_BKN, posterior=q_BK, ref_nll=b_BN, mask=m_BN, c_base=c,
       config=cfg)`` -> dict of per-example [B] tensors.
    4. ``weighted_reconstruction(terms, cfg) -> [B]``: the reconstruction part of the objective.

Aggregation (docs/objective.md#aggregation), over the supervised tokens S_i of example i, n_i = |S_i|:
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
    rho_it ~ (b_it + inverse_surprisal_token_weight_epsilon)^(-alpha), normalised over S_i
An example whose b is 0 on every supervised token is *degenerate*: pi is uniform there, and the
``degenerate`` diagnostic flags it.

Scale factors (identical in every mode, since the n_i, C and n_bar factors cancel):
    kappa_i = W(b_i; pi_i) / A(b_i)      eta_i = W(b_i; rho_i) / A(b_i)      (1 where A(b_i) = 0)

Reconstruction terms (``RECONSTRUCTION_TERMS``, the registry's order: core/terms.py), q_ik posterior weights, l_ik the
z-conditioned token NLL of branch k, c_base the mode-matched z-free reference scale, i.e. the
validation value of E_i[A(b_i)] (``token``: sum_i sum_t b_it / sum_i n_i over the validation set; the
``sum`` c_base is given per sequence and divided by C here, so the normalised terms do not depend on C):
    reconstruction_loss                        sum_k q_ik A(l_ik)
    distribution_normalized_reconstruction_loss
                                               reconstruction_loss / c_base
    example_inverse_surprisal_weighted_reconstruction_loss
                                               sum_k q_ik A(l_ik) / (A(b_i) + example_inverse_surprisal_epsilon)
    token_weighted_reconstruction_loss         sum_k q_ik W(l_ik; pi_i)
    normalized_concentration_corrected_token_weighted_reconstruction_loss
                                               sum_k q_ik W(l_ik; pi_i) / kappa_i / c_base
    normalized_inverse_surprisal_token_weighted_reconstruction_loss
                                               sum_k q_ik W(l_ik; rho_i) / eta_i / c_base
Each is meant to be reduced as a mean over valid examples (``valid`` = 1 where n_i > 0). Under
``token`` the per-example values are shares of the global token mean: only their mean over the global
batch G is a token mean of anything (the one n_bar of G must reach every micro-batch of the step).

Diagnostics (same dict, per-example [B]); ``DIAGNOSTIC_REDUCTIONS`` says how to reduce each:
    "mean": sum over valid examples / number of valid examples;
    "min" / "max": over valid examples only (invalid rows hold 0 and must be masked out);
    "sum": over all examples (``degenerate`` gives a count, ``valid`` the number of valid examples).
    token_weighted_base_loss                    W(b_i; pi_i), mode units            mean
    token_concentration_factor                  kappa_i                             mean
    inverse_token_weighted_base_loss            W(b_i; rho_i), mode units           mean
    inverse_token_base_scale_factor             eta_i                               mean
    token_weighting/weight_max                  max_t pi_it                         mean
    token_weighting/weight_ratio_max_min        max_t pi_it / max(min_t pi_it, 1e-12)  mean
    token_weighting/effective_token_count_mean  1 / sum_t pi_it^2                   mean
    inverse_token_weighting/...                 the same three for rho              mean
    base_loss                                   A(b_i), mode units                  min
    num_tokens / num_tokens_min / num_tokens_max  n_i (three keys, one tensor)      mean / min / max
    degenerate                                  1.0 where b_i is 0 on all of S_i    sum
    valid                                       1.0 where n_i > 0                   sum
An example with no supervised token holds 0 in every term and diagnostic.

Precision: inputs of any float dtype are computed in float32 (float64 inputs stay float64, so
``torch.autograd.gradcheck`` works) and the results come back in that dtype. Nothing on the path of
``reconstruction_terms`` synchronises with the host, except the ``c_base`` check for a CPU tensor.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any, Optional, Union

import torch
import torch.nn.functional as F
from zcvae.core.terms import RECONSTRUCTION_TERM_REGISTRY, TermParts, with_term_weight_fields
from zcvae.strict import StrictDataclass

__all__ = [
    "AGGREGATION_MODES",
    "DIAGNOSTIC_REDUCTIONS",
    "IGNORE_INDEX",
    "RECONSTRUCTION_TERMS",
    "ReconstructionLossConfig",
    "aggregate",
    "base_loss",
    "gather_span",
    "inverse_surprisal_weights",
    "reconstruction_terms",
    "reconstruction_weights",
    "supervised_token_nll",
    "surprisal_share_weights",
    "token_nll",
    "weighted_aggregate",
    "weighted_reconstruction",
]

IGNORE_INDEX = -100
AGGREGATION_MODES = ("mean", "sum", "token")

# The registry (core/terms.py) owns each term's name, weight field, abbreviation and formula; this tuple
# is its names, fixed when this module is imported.
RECONSTRUCTION_TERMS = tuple(term.name for term in RECONSTRUCTION_TERM_REGISTRY)
_TERM_WEIGHT_FIELDS = tuple(term.weight_field for term in RECONSTRUCTION_TERM_REGISTRY)

DIAGNOSTIC_REDUCTIONS: dict[str, str] = {
    "token_weighted_base_loss": "mean",
    "token_concentration_factor": "mean",
    "inverse_token_weighted_base_loss": "mean",
    "inverse_token_base_scale_factor": "mean",
    "token_weighting/weight_max": "mean",
    "token_weighting/weight_ratio_max_min": "mean",
    "token_weighting/effective_token_count_mean": "mean",
    "inverse_token_weighting/weight_max": "mean",
    "inverse_token_weighting/weight_ratio_max_min": "mean",
    "inverse_token_weighting/effective_token_count_mean": "mean",
    # The minimum shows how close example_inverse_surprisal_epsilon is to the smallest denominator.
    "base_loss": "min",
    # The length effects of sum and token are read from mean/min/max of the supervised length; one key
    # per reduction keeps this a plain str -> str table.
    "num_tokens": "mean",
    "num_tokens_min": "min",
    "num_tokens_max": "max",
    "degenerate": "sum",
    "valid": "sum",
}

# A token with zero weight would make max/min infinite; the floor keeps the diagnostic finite.
_WEIGHT_RATIO_MIN_FLOOR = 1e-12


def _is_real_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclasses.dataclass
@with_term_weight_fields(after=None, make_field=lambda term: term.default_weight)
class ReconstructionLossConfig(StrictDataclass):
    """Weights and knobs of the reconstruction stack: one weight lambda_j per registered term (its
    ``weight_field``, first, in registry order; see core/terms.py), then alpha, the epsilons and the
    aggregation mode."""

    token_weight_alpha: float = 1.0
    """Temperature alpha >= 0 of pi and rho; 0 gives uniform token weights."""
    example_inverse_surprisal_epsilon: float = 1e-2
    """Added to A(b_i) in the example-level inverse-surprisal term. Same units as A(b_i) in the
    selected mode (nats/token under mean, nats/sequence under sum); the value is reused unchanged
    under sum, and ``base_loss`` (min) shows how it compares."""
    inverse_surprisal_token_weight_epsilon: float = 1e-2
    """Added to b_t before the inverse power in rho, in nats/token: bounds the weight of a
    zero-surprisal token at (1e-2)^(-alpha) relative to a token of surprisal ~1 nat."""
    zfree_reference_scale: Optional[float] = None
    """A fixed c_base given by the user; None means c_base is calibrated on validation data in the
    selected mode."""
    token_aggregation_mode: str = "mean"
    """"mean" (per-example token mean), "sum" (per-example token sum, divided by ``sum_scale``) or
    "token" (per-example token sum divided by the global batch's mean length n_bar, so that the example
    mean over the global batch is the global token mean); batch reduction is an example mean always."""
    sum_scale: Optional[float] = None
    """C, the fixed divisor of the sum mode (Dr. GRPO's constant; None = 1); only with mode "sum"."""

    def __post_init__(self) -> None:
        if self.token_aggregation_mode not in AGGREGATION_MODES:
            raise ValueError(
                f"token_aggregation_mode must be one of {AGGREGATION_MODES}, got {self.token_aggregation_mode!r}"
            )
        for name in (*_TERM_WEIGHT_FIELDS, "token_weight_alpha"):
            value = getattr(self, name)
            if not _is_real_number(value) or not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value!r}")
            if value < 0:
                raise ValueError(f"{name} must be >= 0, got {value!r}")
        for name in ("example_inverse_surprisal_epsilon", "inverse_surprisal_token_weight_epsilon"):
            value = getattr(self, name)
            if not _is_real_number(value) or not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value!r}")
            if value <= 0:
                raise ValueError(f"{name} must be > 0, got {value!r}")
        if self.sum_scale is not None:
            if self.token_aggregation_mode != "sum":
                raise ValueError(f"sum_scale applies to token_aggregation_mode 'sum' only, got mode {self.token_aggregation_mode!r}")
            if not _is_real_number(self.sum_scale) or not math.isfinite(self.sum_scale) or self.sum_scale <= 0:
                raise ValueError(f"sum_scale must be a finite number > 0 or None, got {self.sum_scale!r}")
        scale = self.zfree_reference_scale
        if scale is not None:
            if not _is_real_number(scale) or not math.isfinite(scale):
                raise ValueError(f"zfree_reference_scale must be a finite number or None, got {scale!r}")
            if scale <= 0:
                raise ValueError(f"zfree_reference_scale must be > 0, got {scale!r}")


def reconstruction_weights(config: ReconstructionLossConfig) -> dict[str, float]:
    """lambda_j of each reconstruction term, keyed by term name in ``RECONSTRUCTION_TERMS`` order."""
    return {name: float(getattr(config, field)) for name, field in zip(RECONSTRUCTION_TERMS, _TERM_WEIGHT_FIELDS)}


def weighted_reconstruction(terms: Mapping[str, torch.Tensor], config: ReconstructionLossConfig) -> torch.Tensor:
    """J_recon per example: sum_j lambda_j * term_j -> [B].

    Zero-weight terms are still multiplied in (by 0) rather than skipped, so every rank builds the
    same graph whatever the configuration.
    """
    missing = [name for name in RECONSTRUCTION_TERMS if name not in terms]
    if missing:
        raise ValueError(f"terms is missing reconstruction terms {missing}")
    total_B = None
    for name, weight in reconstruction_weights(config).items():
        part_B = terms[name] * weight
        total_B = part_B if total_B is None else total_B + part_B
    return total_B


# ----------------------------------------------------------------------------------------------
# Token NLL and span alignment
# ----------------------------------------------------------------------------------------------


def _compute_dtype(*dtypes: torch.dtype) -> torch.dtype:
    """At least float32; float64 when any input is float64."""
    out = torch.float32
    for dtype in dtypes:
        if dtype.is_floating_point:
            out = torch.promote_types(out, dtype)
    return out


def token_nll(logits_BTV: torch.Tensor, labels_BT: torch.Tensor, *, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Per-token NLL with the Hugging Face causal shift -> nll_BT of width T-1 (nats per token).

    ``nll[:, t]`` is -log p(labels[:, t + 1] | logits[:, t]); it is exactly 0 where
    ``labels[:, t + 1] == ignore_index``. Logits are upcast to float32 (float64 stays float64), so
    bf16 logits do not lose precision in the log-sum-exp. Pair with ``gather_span`` (which applies the
    same shift to the labels).
    """
    if logits_BTV.dim() != 3:
        raise ValueError(f"logits_BTV must be [B, T, V], got shape {tuple(logits_BTV.shape)}")
    if labels_BT.dim() != 2 or labels_BT.shape != logits_BTV.shape[:2]:
        raise ValueError(
            f"labels_BT must be [B, T] matching logits_BTV {tuple(logits_BTV.shape)}, got {tuple(labels_BT.shape)}"
        )
    B, T, V = logits_BTV.shape
    dtype = _compute_dtype(logits_BTV.dtype)
    if T < 2:
        return logits_BTV.new_zeros((B, max(T - 1, 0)), dtype=dtype)
    # Score all T positions against labels shifted left (last one ignored) and drop the last column:
    # a float32 input is then read through a view instead of copying logits[:, :-1].
    shifted_BT = torch.cat([labels_BT[:, 1:], labels_BT.new_full((B, 1), ignore_index)], dim=1)
    nll_flat = F.cross_entropy(
        logits_BTV.reshape(B * T, V).to(dtype),
        shifted_BT.reshape(B * T).long(),
        ignore_index=ignore_index,
        reduction="none",
    )
    return nll_flat.view(B, T)[:, :-1]  # (B, T-1)


def supervised_token_nll(
    hidden_BTH: torch.Tensor,
    labels_BT: torch.Tensor,
    head,
    *,
    n_span: Optional[int] = None,
    chunk_tokens: Optional[int] = None,
    ignore_index: int = IGNORE_INDEX,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``gather_span(token_nll(head(hidden_BTH), labels_BT), labels_BT, n_span=N)`` without the
    (B, T, V) logits -> (span_BN, mask_BN), nats per token.

    ``hidden_BTH`` are the final hidden states (the LM head's input) and ``head`` maps (n, H) to
    (n, V) logits. Only the positions that predict a supervised label are read (the left-aligned span,
    as in ``gather_span``), flattened to the n supervised tokens of the batch, and scored
    ``chunk_tokens`` at a time (all at once when None). With more than one chunk and gradients on,
    each chunk runs under non-reentrant activation checkpointing: its (chunk, V) float32 logits are
    freed after the forward and recomputed in the backward (one more head matmul per chunk), so no
    (n, V) tensor is kept between the forward and the backward, where a plain cross-entropy keeps its
    log-probabilities. Equals the full-logits path to float noise (tests/unit/test_chunked_nll.py).
    """
    if hidden_BTH.dim() != 3 or labels_BT.shape != hidden_BTH.shape[:2]:
        raise ValueError(f"hidden_BTH must be [B, T, H] and labels_BT [B, T], got {tuple(hidden_BTH.shape)} and {tuple(labels_BT.shape)}")
    if chunk_tokens is not None and (isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int) or chunk_tokens < 1):
        raise ValueError(f"chunk_tokens must be an int >= 1 or None, got {chunk_tokens!r}")
    B, T, _ = hidden_BTH.shape
    if T < 2:
        N = 0 if n_span is None else n_span
        return hidden_BTH.new_zeros((B, N), dtype=torch.float32), torch.zeros((B, N), dtype=torch.bool, device=hidden_BTH.device)
    # position t predicts labels[:, t + 1] (the Hugging Face shift, as in token_nll)
    h_BNH, mask_BN = gather_span(hidden_BTH[:, :-1], labels_BT, n_span=n_span, ignore_index=ignore_index)
    target_BN, _ = gather_span(labels_BT[:, 1:], labels_BT, n_span=mask_BN.shape[1], ignore_index=ignore_index)
    h_nH, target_n = h_BNH[mask_BN], target_BN[mask_BN].long()  # (n, H), (n,)
    n = target_n.shape[0]
    step = n if chunk_tokens is None else chunk_tokens
    checkpointed = torch.is_grad_enabled() and n > step

    def chunk_nll(h_cH: torch.Tensor, target_c: torch.Tensor) -> torch.Tensor:
        logits_cV = head(h_cH)
        return F.cross_entropy(logits_cV.to(_compute_dtype(logits_cV.dtype)), target_c, reduction="none")  # (c,)

    parts = []
    for lo in range(0, n, max(step, 1)):
        h_cH, target_c = h_nH[lo : lo + step], target_n[lo : lo + step]
        if checkpointed:
            from torch.utils.checkpoint import checkpoint

            parts.append(checkpoint(chunk_nll, h_cH, target_c, use_reentrant=False))
        else:
            parts.append(chunk_nll(h_cH, target_c))
    nll_n = torch.cat(parts) if parts else hidden_BTH.new_zeros((0,), dtype=torch.float32)
    span_BN = nll_n.new_zeros(mask_BN.shape).masked_scatter(mask_BN, nll_n)
    return span_BN, mask_BN


def gather_span(
    values_BT: torch.Tensor,
    labels_BT: torch.Tensor,
    *,
    n_span: Optional[int] = None,
    ignore_index: int = IGNORE_INDEX,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-align the supervised positions of each row -> (span_BN, mask_BN).

    ``values_BT`` is either the output of ``token_nll`` (width T-1: the labels are shifted, position
    t selected where ``labels[:, t + 1] != ignore_index``) or already aligned with ``labels_BT``
    (width T: selected where ``labels[:, t] != ignore_index``); trailing dims of ``values_BT`` are
    carried along. The j-th supervised position of row i lands in ``span[i, j]``; slots past the
    row's span length hold 0 with ``mask`` False. Differentiable w.r.t. ``values_BT`` (a gather).

    N is ``n_span`` when given (so the z-conditioned and z-free calls agree), else the longest span
    in the batch, which costs one host synchronisation. With ``n_span`` shorter than a span, CPU
    inputs raise ValueError; on an accelerator the check is skipped (it would synchronise) and the
    tail of that span is dropped.
    """
    if values_BT.dim() < 2:
        raise ValueError(f"values_BT must be [B, T, ...], got shape {tuple(values_BT.shape)}")
    if labels_BT.dim() != 2 or labels_BT.shape[0] != values_BT.shape[0]:
        raise ValueError(f"labels_BT must be [B, T] with B={values_BT.shape[0]}, got {tuple(labels_BT.shape)}")
    if values_BT.shape[1] == labels_BT.shape[1] - 1:
        labels_BT = labels_BT[:, 1:]  # causal shift, as in token_nll
    elif values_BT.shape[1] != labels_BT.shape[1]:
        raise ValueError(
            f"values_BT width {values_BT.shape[1]} must equal labels_BT width {labels_BT.shape[1]} "
            "or be one less (the output of token_nll)"
        )
    if n_span is not None and (not isinstance(n_span, int) or isinstance(n_span, bool) or n_span < 0):
        raise ValueError(f"n_span must be a non-negative int or None, got {n_span!r}")

    B, T = labels_BT.shape
    rest = values_BT.shape[2:]
    active_BT = labels_BT != ignore_index
    cum_BT = active_BT.long().cumsum(dim=1)  # number of supervised positions up to and including t
    num_B = cum_BT[:, -1] if T > 0 else labels_BT.new_zeros(B, dtype=torch.long)
    if n_span is None:
        n_span = int(num_B.max()) if B > 0 else 0  # host sync; pass n_span to avoid it
    elif values_BT.device.type == "cpu" and B > 0 and bool((num_B > n_span).any()):
        raise ValueError(f"n_span={n_span} is shorter than the longest span {int(num_B.max())}")

    slot_BN = torch.arange(1, n_span + 1, device=labels_BT.device).expand(B, n_span).contiguous()
    mask_BN = slot_BN <= num_B[:, None]
    if T == 0 or n_span == 0:
        return values_BT.new_zeros((B, n_span, *rest)), mask_BN
    # The j-th supervised position is the first t with cum[t] == j (cum is non-decreasing).
    index_BN = torch.searchsorted(cum_BT, slot_BN).clamp_max(T - 1)
    index = index_BN.view(B, n_span, *([1] * len(rest))).expand(B, n_span, *rest)
    span = values_BT.gather(1, index)
    mask = mask_BN.view(B, n_span, *([1] * len(rest)))
    return torch.where(mask, span, torch.zeros((), dtype=span.dtype, device=span.device)), mask_BN


# ----------------------------------------------------------------------------------------------
# Aggregation and token weights
# ----------------------------------------------------------------------------------------------


def _check_mode(mode: str) -> None:
    if mode not in AGGREGATION_MODES:
        raise ValueError(f"mode must be one of {AGGREGATION_MODES}, got {mode!r}")


def _masked(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
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
    total = _masked(values_BN, mask_BN).sum(dim=-1)
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
    total = _masked(values_BN * weights_BN, mask_BN).sum(dim=-1)
    if mode == "mean":
        return total
    total = total * mask_BN.sum(dim=-1).to(total.dtype)
    return total if divisor is None else total / divisor


def _reference(ref_nll_BN: torch.Tensor, mask_BN: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """b: detached, clamped at 0 (an NLL is never negative; tiny negatives are rounding), 0 off-mask."""
    return _masked(ref_nll_BN.detach().to(dtype).clamp_min(0.0), mask_BN)


def base_loss(
    ref_nll_BN: torch.Tensor, mask_BN: torch.Tensor, mode: str, *, divisor: Union[float, torch.Tensor, None] = None
) -> torch.Tensor:
    """A_mode(b_i) -> [B]; the mean of this over a validation set is the mode-matched c_base (for
    ``token`` with divisor = the validation set's n_bar; ``zcvae.reference.c_base`` reduces it exactly)."""
    return aggregate(_reference(ref_nll_BN, mask_BN, _compute_dtype(ref_nll_BN.dtype)), mask_BN, mode, divisor=divisor)


def _normalise(raw_BN: torch.Tensor, mask_BN: torch.Tensor) -> torch.Tensor:
    """raw / sum(raw) over the mask; 0 on rows whose sum is 0."""
    raw_BN = _masked(raw_BN, mask_BN)
    total_B = raw_BN.sum(dim=-1, keepdim=True)
    return raw_BN / torch.where(total_B > 0, total_B, torch.ones_like(total_B))


def _uniform(mask_BN: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    num = mask_BN.sum(dim=-1, keepdim=True).clamp_min(1).to(dtype)
    return mask_BN.to(dtype) / num


def _check_alpha(alpha: float) -> None:
    if not _is_real_number(alpha) or not math.isfinite(alpha) or alpha < 0:
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
    b_BN = _reference(ref_nll_BN, mask_BN, _compute_dtype(ref_nll_BN.dtype))
    # Powers of b / max(b) instead of b: same pi, but b^alpha cannot overflow for large alpha.
    b_max_B1 = b_BN.amax(dim=-1, keepdim=True) if b_BN.shape[-1] > 0 else b_BN.sum(dim=-1, keepdim=True)
    ratio_BN = b_BN / torch.where(b_max_B1 > 0, b_max_B1, torch.ones_like(b_max_B1))
    pi_BN = _normalise(ratio_BN.pow(alpha), mask_BN)
    degenerate_B = mask_BN.any(dim=-1) & (b_max_B1.squeeze(-1) <= 0)
    pi_BN = torch.where(degenerate_B[..., None], _uniform(mask_BN, pi_BN.dtype), pi_BN)
    return pi_BN, degenerate_B


def inverse_surprisal_weights(
    ref_nll_BN: torch.Tensor, mask_BN: torch.Tensor, alpha: float, epsilon: float
) -> torch.Tensor:
    """rho^(alpha) -> rho_BN, proportional to (b_t + epsilon)^(-alpha), normalised over active tokens.

    b is detached and clamped at 0. Rows without active tokens get all-zero weights.
    """
    _check_alpha(alpha)
    if not _is_real_number(epsilon) or not math.isfinite(epsilon) or epsilon <= 0:
        raise ValueError(f"epsilon must be a finite number > 0, got {epsilon!r}")
    b_BN = _reference(ref_nll_BN, mask_BN, _compute_dtype(ref_nll_BN.dtype))
    if b_BN.shape[-1] == 0:
        return b_BN
    shifted_BN = b_BN + epsilon
    # ((min + eps) / (b + eps))^alpha lies in (0, 1] with 1 at the smallest b: no overflow.
    lo_B1 = torch.where(mask_BN, shifted_BN, torch.full_like(shifted_BN, float("inf"))).amin(dim=-1, keepdim=True)
    lo_B1 = torch.where(torch.isfinite(lo_B1), lo_B1, torch.ones_like(lo_B1))  # rows without active tokens
    return _normalise((lo_B1 / shifted_BN).pow(alpha), mask_BN)


def _weight_stats(weights_BN: torch.Tensor, mask_BN: torch.Tensor, valid_B: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(max weight, max/min ratio, effective token count 1/sum w^2) per row, 0 on invalid rows."""
    zero = torch.zeros((), dtype=weights_BN.dtype, device=weights_BN.device)
    if weights_BN.shape[-1] == 0:
        empty_B = weights_BN.sum(dim=-1)
        return empty_B, empty_B, empty_B
    w_max_B = _masked(weights_BN, mask_BN).amax(dim=-1)
    w_min_B = torch.where(mask_BN, weights_BN, torch.full_like(weights_BN, float("inf"))).amin(dim=-1)
    w_min_B = torch.where(valid_B, w_min_B, torch.ones_like(w_min_B)).clamp_min(_WEIGHT_RATIO_MIN_FLOOR)
    sq_B = _masked(weights_BN.square(), mask_BN).sum(dim=-1)
    ratio_B = torch.where(valid_B, w_max_B / w_min_B, zero)
    eff_B = torch.where(valid_B, 1.0 / torch.where(valid_B, sq_B, torch.ones_like(sq_B)), zero)
    return w_max_B, ratio_B, eff_B


# ----------------------------------------------------------------------------------------------
# The six terms
# ----------------------------------------------------------------------------------------------


def _check_c_base(
    c_base: Union[float, torch.Tensor, None], config: ReconstructionLossConfig
) -> Union[float, torch.Tensor]:
    if c_base is None:
        c_base = config.zfree_reference_scale
        if c_base is None:
            raise ValueError("c_base is required when config.zfree_reference_scale is None")
    if isinstance(c_base, torch.Tensor):
        if c_base.dim() != 0 or not c_base.dtype.is_floating_point:
            raise ValueError(
                f"c_base must be a python float or a 0-dim float tensor, got {c_base.dtype} {tuple(c_base.shape)}"
            )
        # Only a CPU tensor is checked: reading an accelerator tensor would stall the hot path.
        if c_base.device.type == "cpu":
            value = float(c_base)
            if not math.isfinite(value) or value <= 0:
                raise ValueError(f"c_base must be finite and > 0, got {value!r}")
        return c_base.detach()
    if not _is_real_number(c_base) or not math.isfinite(c_base) or c_base <= 0:
        raise ValueError(f"c_base must be finite and > 0, got {c_base!r}")
    return float(c_base)


def reconstruction_terms(
    *,
    token_nll: torch.Tensor,
    posterior: torch.Tensor,
    ref_nll: torch.Tensor,
    mask: torch.Tensor,
    c_base: Union[float, torch.Tensor, None] = None,
    config: ReconstructionLossConfig,
    mean_num_tokens: Union[float, torch.Tensor, None] = None,
) -> dict[str, torch.Tensor]:
    """The six reconstruction terms and the diagnostics, each a per-example [B] tensor.

    Args:
        token_nll: l_BKN, z-conditioned token NLL of each branch on the left-aligned span (nats/token).
        posterior: q_BK, branch weights; rows sum to 1 (discrete: q(z|x,y); Gaussian: full(1/S)).
            Not checked here: that would synchronise.
        ref_nll: b_BN, frozen z-free reference token NLL; detached and clamped at 0 here.
        mask: m_BN bool, supervised span slots.
        c_base: z-free reference scale in the selected mode (python float or 0-dim tensor, > 0);
            defaults to ``config.zfree_reference_scale``. Under ``sum`` it is per sequence (before C).
        config: weights are not used here (see ``weighted_reconstruction``), only alpha, epsilons,
            the aggregation mode and ``sum_scale``.
        mean_num_tokens: n_bar, supervised tokens per valid example over the global batch (float or
            0-dim tensor, > 0); required under ``token``, ignored otherwise (so a caller may always
            pass it). It must be the same on every rank and micro-batch of one optimizer step.

    Gradients reach ``token_nll`` and ``posterior`` only. See the module docstring for the formulas
    and the keys.
    """
    if token_nll.dim() != 3:
        raise ValueError(f"token_nll must be [B, K, N], got shape {tuple(token_nll.shape)}")
    B, K, N = token_nll.shape
    if tuple(posterior.shape) != (B, K):
        raise ValueError(f"posterior must be [B, K] = {(B, K)}, got {tuple(posterior.shape)}")
    if tuple(ref_nll.shape) != (B, N):
        raise ValueError(f"ref_nll must be [B, N] = {(B, N)}, got {tuple(ref_nll.shape)}")
    if tuple(mask.shape) != (B, N):
        raise ValueError(f"mask must be [B, N] = {(B, N)}, got {tuple(mask.shape)}")
    if mask.dtype != torch.bool:
        raise ValueError(f"mask must be a bool tensor, got {mask.dtype}")
    for name, tensor in (("token_nll", token_nll), ("posterior", posterior), ("ref_nll", ref_nll)):
        if not tensor.dtype.is_floating_point:
            raise ValueError(f"{name} must be a float tensor, got {tensor.dtype}")
    if not isinstance(config, ReconstructionLossConfig):
        raise ValueError(f"config must be a ReconstructionLossConfig, got {type(config).__name__}")
    c = _check_c_base(c_base, config)
    mode = config.token_aggregation_mode
    alpha = config.token_weight_alpha
    divisor = None  # the n_bar of token mode, or the C of a scaled sum; None leaves mean/sum as they were
    if mode == "token":
        if mean_num_tokens is None:
            raise ValueError("token_aggregation_mode 'token' needs mean_num_tokens: the global batch's supervised "
                             "tokens per valid example, reduced over all ranks and micro-batches")
        if isinstance(mean_num_tokens, torch.Tensor):
            if mean_num_tokens.dim() != 0 or not mean_num_tokens.dtype.is_floating_point:
                raise ValueError(f"mean_num_tokens must be a python float or a 0-dim float tensor, got "
                                 f"{mean_num_tokens.dtype} {tuple(mean_num_tokens.shape)}")
            divisor = mean_num_tokens.detach()
        elif not _is_real_number(mean_num_tokens) or not math.isfinite(mean_num_tokens) or mean_num_tokens <= 0:
            raise ValueError(f"mean_num_tokens must be finite and > 0, got {mean_num_tokens!r}")
        else:
            divisor = float(mean_num_tokens)
    elif mode == "sum" and config.sum_scale is not None:
        divisor = float(config.sum_scale)
        c = c / divisor  # c_base is per sequence; E[A_sum(b)] / C is the scaled sum's own c_base

    dtype = _compute_dtype(token_nll.dtype, posterior.dtype)
    l_BKN = token_nll.to(dtype)
    q_BK = posterior.to(dtype)
    if isinstance(c, torch.Tensor):
        c = c.to(dtype)
    if isinstance(divisor, torch.Tensor):
        divisor = divisor.to(device=l_BKN.device, dtype=dtype)
    mask_B1N = mask[:, None, :]
    num_B = mask.sum(dim=-1).to(dtype)  # n_i
    valid_B = mask.any(dim=-1)
    zero = torch.zeros((), dtype=dtype, device=l_BKN.device)

    b_BN = _reference(ref_nll, mask, dtype)  # detached
    pi_BN, degenerate_B = surprisal_share_weights(b_BN, mask, alpha)
    rho_BN = inverse_surprisal_weights(b_BN, mask, alpha, config.inverse_surprisal_token_weight_epsilon)
    pi_BN, rho_BN = pi_BN.to(dtype), rho_BN.to(dtype)

    base_B = aggregate(b_BN, mask, mode, divisor=divisor)  # A(b_i)
    tok_base_B = weighted_aggregate(b_BN, pi_BN, mask, mode, divisor=divisor)  # W(b_i; pi_i)
    inv_base_B = weighted_aggregate(b_BN, rho_BN, mask, mode, divisor=divisor)  # W(b_i; rho_i)
    has_base_B = base_B > 0
    safe_base_B = torch.where(has_base_B, base_B, torch.ones_like(base_B))
    kappa_B = torch.where(has_base_B, tok_base_B / safe_base_B, torch.ones_like(base_B))
    eta_B = torch.where(has_base_B, inv_base_B / safe_base_B, torch.ones_like(base_B))

    raw_BK = aggregate(l_BKN, mask_B1N, mode, divisor=divisor)  # A(l_ik)
    tok_BK = weighted_aggregate(l_BKN, pi_BN[:, None, :], mask_B1N, mode, divisor=divisor)  # W(l_ik; pi_i)
    inv_BK = weighted_aggregate(l_BKN, rho_BN[:, None, :], mask_B1N, mode, divisor=divisor)  # W(l_ik; rho_i)
    raw_B = (q_BK * raw_BK).sum(dim=-1)
    tok_B = (q_BK * tok_BK).sum(dim=-1)
    inv_B = (q_BK * inv_BK).sum(dim=-1)

    parts = TermParts(raw_B=raw_B, token_B=tok_B, inverse_B=inv_B, base_B=base_B, kappa_B=kappa_B, eta_B=eta_B,
                      c_base=c, config=config)
    terms = {term.name: term.function(parts) for term in RECONSTRUCTION_TERM_REGISTRY}
    # where (not multiply) so a stray nan/inf in a posterior row of an empty example cannot leak out.
    terms = {name: torch.where(valid_B, value, zero) for name, value in terms.items()}

    pi_max_B, pi_ratio_B, pi_eff_B = _weight_stats(pi_BN, mask, valid_B)
    rho_max_B, rho_ratio_B, rho_eff_B = _weight_stats(rho_BN, mask, valid_B)
    diagnostics = {
        "token_weighted_base_loss": tok_base_B,
        "token_concentration_factor": kappa_B,
        "inverse_token_weighted_base_loss": inv_base_B,
        "inverse_token_base_scale_factor": eta_B,
        "token_weighting/weight_max": pi_max_B,
        "token_weighting/weight_ratio_max_min": pi_ratio_B,
        "token_weighting/effective_token_count_mean": pi_eff_B,
        "inverse_token_weighting/weight_max": rho_max_B,
        "inverse_token_weighting/weight_ratio_max_min": rho_ratio_B,
        "inverse_token_weighting/effective_token_count_mean": rho_eff_B,
        "base_loss": base_B,
        "num_tokens": num_B,
        "num_tokens_min": num_B,
        "num_tokens_max": num_B,
        "degenerate": degenerate_B.to(dtype),
        "valid": valid_B.to(dtype),
    }
    for name, value in diagnostics.items():
        terms[name] = torch.where(valid_B, value.detach(), zero)
    return terms
