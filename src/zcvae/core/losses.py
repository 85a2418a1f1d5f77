"""The six reconstruction terms: their config, their per-example values, and J_recon.

The mathematics, in the project's notation: docs/objective.md.

Pure tensor math (no ``torch.distributed``, no config parsing beyond the dataclass below). Every
function returns per-example values; the trainer owns batch and cross-rank reduction. The primitives
have their own modules, re-exported here so that ``zcvae.core.losses`` stays the one import:
    core/nll.py          ``token_nll``, ``gather_span``, ``supervised_token_nll`` (per-token NLL, span alignment)
    core/aggregation.py  ``aggregate`` (A), ``weighted_aggregate`` (W), ``base_loss``, the token weights pi and rho
    core/diagnostics.py  ``DIAGNOSTIC_REDUCTIONS`` and the diagnostics returned next to the terms
    core/terms.py        the term registry: each term's name, weight field, abbreviation and formula

Shape legend
    B  examples in the batch
    K  latent branches (discrete: the K z values; Gaussian: S posterior samples)
    N  left-aligned supervised y-span positions

Units: as in core/aggregation.py, "mode units" is nats per supervised token (mean), nats per sequence
(sum) or nats per supervised token of the global batch (token).

Pipeline (steps 1 and 2, token NLL and span alignment: core/nll.py)
    3. ``reconstruction_terms(token_nll=l_BKN, posterior=q_BK, ref_nll=b_BN, mask=m_BN, c_base=c,
       config=cfg)`` -> dict of per-example [B] tensors: the terms, then the diagnostics.
    4. ``weighted_reconstruction(terms, cfg) -> [B]``: the reconstruction part of the objective.

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
An example with no supervised token holds 0 in every term and diagnostic (core/diagnostics.py).

Precision: inputs of any float dtype are computed in float32 (float64 inputs stay float64, so
``torch.autograd.gradcheck`` works) and the results come back in that dtype. Nothing on the path of
``reconstruction_terms`` synchronises with the host, except the ``c_base`` check for a CPU tensor.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any, NamedTuple, Optional, Union

import torch
from zcvae.core.aggregation import (
    AGGREGATION_MODES,
    aggregate,
    base_loss,
    inverse_surprisal_weights,
    is_real_number,
    reference_nll,
    surprisal_share_weights,
    weighted_aggregate,
)
from zcvae.core.diagnostics import DIAGNOSTIC_REDUCTIONS, reconstruction_diagnostics
from zcvae.core.nll import IGNORE_INDEX, compute_dtype, gather_span, supervised_token_nll, token_nll
from zcvae.core.terms import RECONSTRUCTION_TERM_REGISTRY, TermParts, with_term_weight_fields
from zcvae.strict import StrictDataclass

# The primitives are re-exported: callers (model/, reference/, eval/, bench/, the tests) import them from here.
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

# The registry (core/terms.py) owns each term's name, weight field, abbreviation and formula; this tuple
# is its names, fixed when this module is imported.
RECONSTRUCTION_TERMS = tuple(term.name for term in RECONSTRUCTION_TERM_REGISTRY)
_TERM_WEIGHT_FIELDS = tuple(term.weight_field for term in RECONSTRUCTION_TERM_REGISTRY)


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
            if not is_real_number(value) or not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value!r}")
            if value < 0:
                raise ValueError(f"{name} must be >= 0, got {value!r}")
        for name in ("example_inverse_surprisal_epsilon", "inverse_surprisal_token_weight_epsilon"):
            value = getattr(self, name)
            if not is_real_number(value) or not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value!r}")
            if value <= 0:
                raise ValueError(f"{name} must be > 0, got {value!r}")
        if self.sum_scale is not None:
            if self.token_aggregation_mode != "sum":
                raise ValueError(f"sum_scale applies to token_aggregation_mode 'sum' only, got mode {self.token_aggregation_mode!r}")
            if not is_real_number(self.sum_scale) or not math.isfinite(self.sum_scale) or self.sum_scale <= 0:
                raise ValueError(f"sum_scale must be a finite number > 0 or None, got {self.sum_scale!r}")
        scale = self.zfree_reference_scale
        if scale is not None:
            if not is_real_number(scale) or not math.isfinite(scale):
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
# The six terms, in named steps: each step is pure and reads only what the previous ones returned
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
    if not is_real_number(c_base) or not math.isfinite(c_base) or c_base <= 0:
        raise ValueError(f"c_base must be finite and > 0, got {c_base!r}")
    return float(c_base)


def _check_term_inputs(
    token_nll: torch.Tensor, posterior: torch.Tensor, ref_nll: torch.Tensor, mask: torch.Tensor, config: Any
) -> None:
    """Shapes [B, K, N], [B, K], [B, N], [B, N] bool; float tensors; a ``ReconstructionLossConfig``."""
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


def _mode_scales(
    c_base: Union[float, torch.Tensor, None],
    config: ReconstructionLossConfig,
    mean_num_tokens: Union[float, torch.Tensor, None],
) -> tuple[Union[float, torch.Tensor], Union[float, torch.Tensor, None]]:
    """(c, divisor): c_base checked (and divided by C under a scaled sum), and the divisor of the token
    sum (n_bar under ``token``, C under a scaled ``sum``, None otherwise)."""
    c = _check_c_base(c_base, config)
    mode = config.token_aggregation_mode
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
        elif not is_real_number(mean_num_tokens) or not math.isfinite(mean_num_tokens) or mean_num_tokens <= 0:
            raise ValueError(f"mean_num_tokens must be finite and > 0, got {mean_num_tokens!r}")
        else:
            divisor = float(mean_num_tokens)
    elif mode == "sum" and config.sum_scale is not None:
        divisor = float(config.sum_scale)
        c = c / divisor  # c_base is per sequence; E[A_sum(b)] / C is the scaled sum's own c_base
    return c, divisor


class _Reference(NamedTuple):
    """The z-free reference of each example in mode units, and the scale factors taken from it."""

    base_B: torch.Tensor  # A(b_i)
    token_base_B: torch.Tensor  # W(b_i; pi_i)
    inverse_base_B: torch.Tensor  # W(b_i; rho_i)
    kappa_B: torch.Tensor  # W(b_i; pi_i) / A(b_i), 1 where A(b_i) = 0
    eta_B: torch.Tensor  # W(b_i; rho_i) / A(b_i), 1 where A(b_i) = 0


def _reference_scales(
    b_BN: torch.Tensor,
    pi_BN: torch.Tensor,
    rho_BN: torch.Tensor,
    mask_BN: torch.Tensor,
    mode: str,
    divisor: Union[float, torch.Tensor, None],
) -> _Reference:
    base_B = aggregate(b_BN, mask_BN, mode, divisor=divisor)
    token_base_B = weighted_aggregate(b_BN, pi_BN, mask_BN, mode, divisor=divisor)
    inverse_base_B = weighted_aggregate(b_BN, rho_BN, mask_BN, mode, divisor=divisor)
    has_base_B = base_B > 0
    safe_base_B = torch.where(has_base_B, base_B, torch.ones_like(base_B))
    kappa_B = torch.where(has_base_B, token_base_B / safe_base_B, torch.ones_like(base_B))
    eta_B = torch.where(has_base_B, inverse_base_B / safe_base_B, torch.ones_like(base_B))
    return _Reference(base_B, token_base_B, inverse_base_B, kappa_B, eta_B)


def _posterior_weighted_aggregates(
    l_BKN: torch.Tensor,
    q_BK: torch.Tensor,
    pi_BN: torch.Tensor,
    rho_BN: torch.Tensor,
    mask_BN: torch.Tensor,
    mode: str,
    divisor: Union[float, torch.Tensor, None],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sum_k q_ik A(l_ik), sum_k q_ik W(l_ik; pi_i), sum_k q_ik W(l_ik; rho_i)) -> three [B]."""
    mask_B1N = mask_BN[:, None, :]
    raw_BK = aggregate(l_BKN, mask_B1N, mode, divisor=divisor)  # A(l_ik)
    tok_BK = weighted_aggregate(l_BKN, pi_BN[:, None, :], mask_B1N, mode, divisor=divisor)  # W(l_ik; pi_i)
    inv_BK = weighted_aggregate(l_BKN, rho_BN[:, None, :], mask_B1N, mode, divisor=divisor)  # W(l_ik; rho_i)
    return (q_BK * raw_BK).sum(dim=-1), (q_BK * tok_BK).sum(dim=-1), (q_BK * inv_BK).sum(dim=-1)


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
    and core/diagnostics.py for the diagnostic keys.
    """
    _check_term_inputs(token_nll, posterior, ref_nll, mask, config)
    c, divisor = _mode_scales(c_base, config, mean_num_tokens)
    mode = config.token_aggregation_mode

    dtype = compute_dtype(token_nll.dtype, posterior.dtype)
    l_BKN = token_nll.to(dtype)
    q_BK = posterior.to(dtype)
    if isinstance(c, torch.Tensor):
        c = c.to(dtype)
    if isinstance(divisor, torch.Tensor):
        divisor = divisor.to(device=l_BKN.device, dtype=dtype)
    num_B = mask.sum(dim=-1).to(dtype)  # n_i
    valid_B = mask.any(dim=-1)
    zero = torch.zeros((), dtype=dtype, device=l_BKN.device)

    b_BN = reference_nll(ref_nll, mask, dtype)  # detached
    pi_BN, degenerate_B = surprisal_share_weights(b_BN, mask, config.token_weight_alpha)
    rho_BN = inverse_surprisal_weights(b_BN, mask, config.token_weight_alpha, config.inverse_surprisal_token_weight_epsilon)
    pi_BN, rho_BN = pi_BN.to(dtype), rho_BN.to(dtype)

    ref = _reference_scales(b_BN, pi_BN, rho_BN, mask, mode, divisor)
    raw_B, tok_B, inv_B = _posterior_weighted_aggregates(l_BKN, q_BK, pi_BN, rho_BN, mask, mode, divisor)

    parts = TermParts(raw_B=raw_B, token_B=tok_B, inverse_B=inv_B, base_B=ref.base_B, kappa_B=ref.kappa_B,
                      eta_B=ref.eta_B, c_base=c, config=config)
    terms = {term.name: term.function(parts) for term in RECONSTRUCTION_TERM_REGISTRY}
    # where (not multiply) so a stray nan/inf in a posterior row of an empty example cannot leak out. Every
    # term is computed before the first where: the order the graph is built in fixes the order autograd sums
    # the gradients in, so interleaving them would change the last bits of a training step.
    terms = {name: torch.where(valid_B, value, zero) for name, value in terms.items()}
    terms.update(reconstruction_diagnostics(
        pi_BN=pi_BN, rho_BN=rho_BN, mask_BN=mask, valid_B=valid_B, degenerate_B=degenerate_B, num_B=num_B,
        base_B=ref.base_B, token_base_B=ref.token_base_B, inverse_base_B=ref.inverse_base_B,
        kappa_B=ref.kappa_B, eta_B=ref.eta_B,
    ))
    return terms
