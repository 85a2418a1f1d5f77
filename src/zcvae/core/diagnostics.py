"""The diagnostics of ``core.losses.reconstruction_terms``: what the token weights and the reference
look like, per example, next to the terms.

The mathematics, in the project's notation: docs/objective.md.

Shape legend
    B  examples in the batch
    N  left-aligned supervised y-span positions

Every diagnostic is a per-example [B] tensor, detached, 0 on an example with no supervised token;
``DIAGNOSTIC_REDUCTIONS`` says how to reduce each over a batch:
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
"""

from __future__ import annotations

import torch
from zcvae.core.aggregation import masked

__all__ = ["DIAGNOSTIC_REDUCTIONS", "reconstruction_diagnostics"]

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


def _weight_stats(weights_BN: torch.Tensor, mask_BN: torch.Tensor, valid_B: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(max weight, max/min ratio, effective token count 1/sum w^2) per row, 0 on invalid rows."""
    zero = torch.zeros((), dtype=weights_BN.dtype, device=weights_BN.device)
    if weights_BN.shape[-1] == 0:
        empty_B = weights_BN.sum(dim=-1)
        return empty_B, empty_B, empty_B
    w_max_B = masked(weights_BN, mask_BN).amax(dim=-1)
    w_min_B = torch.where(mask_BN, weights_BN, torch.full_like(weights_BN, float("inf"))).amin(dim=-1)
    w_min_B = torch.where(valid_B, w_min_B, torch.ones_like(w_min_B)).clamp_min(_WEIGHT_RATIO_MIN_FLOOR)
    sq_B = masked(weights_BN.square(), mask_BN).sum(dim=-1)
    ratio_B = torch.where(valid_B, w_max_B / w_min_B, zero)
    eff_B = torch.where(valid_B, 1.0 / torch.where(valid_B, sq_B, torch.ones_like(sq_B)), zero)
    return w_max_B, ratio_B, eff_B

def reconstruction_diagnostics(
    *,
    pi_BN: torch.Tensor,
    rho_BN: torch.Tensor,
    mask_BN: torch.Tensor,
    valid_B: torch.Tensor,
    degenerate_B: torch.Tensor,
    num_B: torch.Tensor,
    base_B: torch.Tensor,
    token_base_B: torch.Tensor,
    inverse_base_B: torch.Tensor,
    kappa_B: torch.Tensor,
    eta_B: torch.Tensor,
) -> dict[str, torch.Tensor]:
    """Every key of ``DIAGNOSTIC_REDUCTIONS`` -> [B], detached, 0 where ``valid_B`` is False.

    ``pi_BN``/``rho_BN`` the token weights; ``base_B``, ``token_base_B``, ``inverse_base_B`` are A(b_i),
    W(b_i; pi_i), W(b_i; rho_i) in mode units; ``num_B`` is n_i in the compute dtype.
    """
    dtype = num_B.dtype
    zero = torch.zeros((), dtype=dtype, device=num_B.device)
    pi_max_B, pi_ratio_B, pi_eff_B = _weight_stats(pi_BN, mask_BN, valid_B)
    rho_max_B, rho_ratio_B, rho_eff_B = _weight_stats(rho_BN, mask_BN, valid_B)
    diagnostics = {
        "token_weighted_base_loss": token_base_B,
        "token_concentration_factor": kappa_B,
        "inverse_token_weighted_base_loss": inverse_base_B,
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
    return {name: torch.where(valid_B, value.detach(), zero) for name, value in diagnostics.items()}
