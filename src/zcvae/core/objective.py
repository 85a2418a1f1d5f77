"""The training objective J, composed from the model's outputs (pure tensor functions).

J = sum_j lambda_j L_j (the six reconstruction terms)  +  beta KL(q || p)  +  weighted auxiliaries.

Per-example parts are returned as ``[B]`` tensors; the trainer turns them into ``local_sum /
global_count`` so that the objective is the example mean over the global batch on every engine.
The router's batch-level terms (marginal KL, support) need the marginal of q over the global batch and
are formed by :func:`marginal_router_terms` from an all-reduced sum the trainer supplies.

Shape legend: B examples, K latent branches (Gaussian: samples), N supervised positions.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from zcvae.core.latent import marginal_kl_to_uniform
from zcvae.core.losses import reconstruction_terms, weighted_reconstruction


@dataclass(frozen=True)
class AuxiliaryWeights:
    """Weights of the auxiliary terms (docs/objective.md#auxiliaries); the sign convention is in each comment."""

    posterior_entropy: float = 0.0  # + w * H(q): positive sharpens the posterior
    router_support: float = 0.0  # - w * H(mean q) = - w log support: positive spreads latent usage
    router_marginal_kl: float = 0.0  # + w * KL(mean q || U)
    inter_latent_divergence: float = 0.0  # - w * divergence: positive pushes the latents' decoders apart
    posterior_variance: float = 0.0  # + w * posterior variance term (Gaussian)

    @classmethod
    def from_train_config(cls, cfg, *, beta: float | None = None) -> "AuxiliaryWeights":
        """The weights at a step whose KL weight is ``beta`` (None: the final steps', ``effective_kl_weight``,
        which evaluation reports against). ``router_support_schedule delay`` turns router support off once
        beta is on: support keeps every latent in use while the split forms; after that the KL alone
        decides whether a spare latent stays."""
        o = cfg.objective
        beta = cfg.effective_kl_weight if beta is None else beta
        support_on = o.router_support_schedule == "constant" or beta == 0
        return cls(
            posterior_entropy=o.posterior_entropy_weight,
            router_support=o.router_support_weight if support_on else 0.0,
            router_marginal_kl=o.router_marginal_kl_weight,
            inter_latent_divergence=o.inter_latent_divergence_weight,
            posterior_variance=o.posterior_variance_weight,
        )


def per_example_objective(
    out, *, ref_nll_BN: torch.Tensor, c_base, recon_config, kl_weight: float, aux: AuxiliaryWeights, mean_num_tokens=None
) -> dict[str, torch.Tensor]:
    """Every per-example term and diagnostic, plus ``loss`` (the per-example part of J), each ``[B]``.

    All six reconstruction terms and every diagnostic are returned whatever their weights (docs/objective.md).
    ``mean_num_tokens``: n_bar, the supervised tokens per valid example of the global batch (the
    ``token`` aggregation mode's normaliser, see ``core.losses``; ignored by the other modes). With it,
    ``local_sum / global_count`` of ``loss`` holds the reconstruction part as a global token mean and
    the KL and auxiliaries as example means (the mode touches reconstruction terms only: docs/objective.md#aggregation).
    """
    terms = reconstruction_terms(
        token_nll=out.token_nll,
        posterior=out.branch_weights,
        ref_nll=ref_nll_BN,
        mask=out.mask,
        c_base=c_base,
        config=recon_config,
        mean_num_tokens=mean_num_tokens,
    )
    recon_B = weighted_reconstruction(terms, recon_config)
    zero_B = torch.zeros_like(recon_B)
    entropy_B = _maybe(out, "posterior_entropy", zero_B)
    divergence_B = _maybe(out, "inter_latent_divergence", zero_B)
    variance_B = _maybe(out, "posterior_variance", zero_B)
    kl_B = out.kl.float()
    loss_B = (
        recon_B
        + kl_weight * kl_B
        + aux.posterior_entropy * entropy_B
        - aux.inter_latent_divergence * divergence_B
        + aux.posterior_variance * variance_B
    )
    valid_B = terms["valid"]
    terms.update(
        loss=loss_B * valid_B,
        weighted_reconstruction_loss=recon_B,
        kl=kl_B * valid_B,
        posterior_entropy=entropy_B * valid_B,
        inter_latent_divergence=divergence_B * valid_B,
    )
    if getattr(out, "posterior_variance", None) is not None:
        terms["posterior_variance"] = variance_B * valid_B
    return terms


def marginal_router_terms(
    *, local_sum_q_K: torch.Tensor, global_sum_q_K: torch.Tensor, global_count: torch.Tensor, aux: AuxiliaryWeights
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Batch-level router terms on the marginal of q over the global (all ranks) micro-batch.

    ``global_sum_q_K`` is the all-reduced, detached sum of q; the local contribution is swapped back in
    so that gradients flow through this rank's q only, and the engine's sum over ranks then yields the
    gradient of the global term. Returns (the term to add to this rank's loss, detached metrics).
    """
    mean_q_K = (global_sum_q_K - local_sum_q_K.detach() + local_sum_q_K) / global_count.clamp_min(1)
    marginal_kl = marginal_kl_to_uniform(mean_q_K)
    entropy = -(mean_q_K.clamp_min(1e-12).log() * mean_q_K).sum()
    term = aux.router_marginal_kl * marginal_kl - aux.router_support * entropy
    return term, {"router_marginal_kl": marginal_kl.detach(), "router_support": entropy.detach().exp()}


def _maybe(out, name: str, default: torch.Tensor) -> torch.Tensor:
    value = getattr(out, name, None)
    return default if value is None else value.float()
