"""Latent-variable math and the small router heads that sit on the backbone's final hidden state.

Everything here is per-example tensor math or a tiny ``nn.Module``; nothing talks to
``torch.distributed`` (batch and cross-rank reductions belong to the trainer and the evaluation).

Shape legend
    B  examples
    K  latent branches (discrete: the K z values; Gaussian: S posterior samples)
    N  left-aligned supervised span positions
    H  backbone hidden size
    D  Gaussian latent dimension
    M  soft-prompt slots (Gaussian)

Units: nats throughout (KL per example, entropy per example, NLL per token).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "DiscreteRouter",
    "GaussianRouter",
    "SoftPromptProjection",
    "ZConditionedNorm",
    "Standardize",
    "categorical_kl",
    "entropy",
    "gaussian_entropy",
    "gaussian_kl",
    "inter_latent_divergence",
    "marginal_kl_to_uniform",
    "router_support",
]

# logvar outside this range means sigma outside [4.5e-5, 2.2e4]: no sane posterior lives there, and the
# clamp keeps exp() from overflowing into a NaN KL (a failure users of other VAE codebases report).
LOGVAR_MIN, LOGVAR_MAX = -20.0, 20.0


# ----------------------------------------------------------------------------------------------
# Pure functions
# ----------------------------------------------------------------------------------------------


def categorical_kl(q_logits_BK: torch.Tensor, p_logits_BK: torch.Tensor) -> torch.Tensor:
    """Exact KL(q || p) between two categoricals given by logits -> [B] nats.

        KL_i = sum_k q_ik (log q_ik - log p_ik),   q = softmax(q_logits), p = softmax(p_logits)

    Differentiable w.r.t. both arguments; terms with q_ik = 0 contribute 0.
    """
    if q_logits_BK.shape != p_logits_BK.shape or q_logits_BK.dim() != 2:
        raise ValueError(f"logits must both be [B, K], got {tuple(q_logits_BK.shape)} and {tuple(p_logits_BK.shape)}")
    log_q = F.log_softmax(q_logits_BK.float(), dim=-1)
    log_p = F.log_softmax(p_logits_BK.float(), dim=-1)
    return (log_q.exp() * (log_q - log_p)).sum(-1)


def entropy(logits_BK: torch.Tensor) -> torch.Tensor:
    """Shannon entropy of softmax(logits) -> [B] nats: H_i = -sum_k q_ik log q_ik."""
    log_q = F.log_softmax(logits_BK.float(), dim=-1)
    return -(log_q.exp() * log_q).sum(-1)


def gaussian_kl(
    mu_q: torch.Tensor,
    logvar_q: torch.Tensor,
    mu_p: torch.Tensor | None = None,
    logvar_p: torch.Tensor | None = None,
) -> torch.Tensor:
    """Closed-form KL(N(mu_q, diag e^logvar_q) || N(mu_p, diag e^logvar_p)) -> [B] nats.

        KL_i = 1/2 sum_d [ logvar_p - logvar_q + (e^logvar_q + (mu_q - mu_p)^2) / e^logvar_p - 1 ]

    ``mu_p``/``logvar_p`` None mean the standard normal prior (0 and 0). Inputs are [B, D].
    """
    mu_q, logvar_q = mu_q.float(), logvar_q.float()
    mu_p = torch.zeros_like(mu_q) if mu_p is None else mu_p.float()
    logvar_p = torch.zeros_like(logvar_q) if logvar_p is None else logvar_p.float()
    ratio = (logvar_q.exp() + (mu_q - mu_p).pow(2)) * torch.exp(-logvar_p)
    return 0.5 * (logvar_p - logvar_q + ratio - 1.0).sum(-1)


def gaussian_entropy(logvar_BD: torch.Tensor) -> torch.Tensor:
    """Differential entropy of N(mu, diag e^logvar) -> [B] nats: 1/2 sum_d (1 + log 2 pi + logvar_d)."""
    return 0.5 * (1.0 + math.log(2.0 * math.pi) + logvar_BD.float()).sum(-1)


def marginal_kl_to_uniform(mean_q_K: torch.Tensor) -> torch.Tensor:
    """Router marginal KL: KL(mean q || U_K) = log K - H(mean q) -> scalar nats.

    ``mean_q_K`` is the posterior averaged over a set of examples (the caller owns that average, and
    under data parallelism it must be the global one). 0 when every latent gets equal mass, log K when
    all the mass sits on one latent.
    """
    q = mean_q_K.float()
    K = q.shape[-1]
    plogp = torch.where(q > 0, q * torch.log(q.clamp_min(1e-38)), torch.zeros_like(q))
    return plogp.sum(-1) + math.log(K)


def router_support(mean_q_K: torch.Tensor) -> torch.Tensor:
    """Effective number of latents in use: exp(H(mean q)) (codebook perplexity), in [1, K]."""
    q = mean_q_K.float()
    plogp = torch.where(q > 0, q * torch.log(q.clamp_min(1e-38)), torch.zeros_like(q))
    return torch.exp(-plogp.sum(-1))


def inter_latent_divergence(
    token_nll_BKN: torch.Tensor, weights_BK: torch.Tensor, mask_BN: torch.Tensor
) -> torch.Tensor:
    """How differently the decoder scores the supervised span under different z -> [B] nats per token.

    For example i with span S_i (n_i = |S_i|) and branches k, j, the branch distance is the mean
    absolute difference of per-token NLL over the span,

        d_ikj = (1/n_i) sum_{t in S_i} | l_ikt - l_ijt |,

    and the divergence is the pair-weighted mean over unordered pairs k < j,

        D_i = sum_{k<j} w_ik w_ij d_ikj / sum_{k<j} w_ik w_ij.

    Uniform weights give the plain mean over the K(K-1)/2 pairs (what the model reports: a property
    of the decoder, not of the router). D_i = 0 for K = 1, for n_i = 0, and where the pair weights sum
    to 0 (a one-hot weight vector). 0 means z has no effect on the span's likelihood.
    """
    if token_nll_BKN.dim() != 3:
        raise ValueError(f"token_nll_BKN must be [B, K, N], got {tuple(token_nll_BKN.shape)}")
    B, K, N = token_nll_BKN.shape
    if weights_BK.shape != (B, K) or mask_BN.shape != (B, N):
        raise ValueError(
            f"weights_BK must be [{B}, {K}] and mask_BN [{B}, {N}], got {tuple(weights_BK.shape)} and {tuple(mask_BN.shape)}"
        )
    l = token_nll_BKN.float()
    if K < 2:
        return l.new_zeros(B)
    m = mask_BN.to(l.dtype)  # (B, N)
    n = m.sum(-1)  # (B,)
    diff_BKKN = (l[:, :, None, :] - l[:, None, :, :]).abs() * m[:, None, None, :]
    d_BKK = diff_BKKN.sum(-1) / n.clamp_min(1.0)[:, None, None]
    w = weights_BK.to(l.dtype)
    pair_BKK = (w[:, :, None] * w[:, None, :]).triu(diagonal=1)
    den = pair_BKK.sum((1, 2))
    num = (pair_BKK * d_BKK).sum((1, 2))
    return torch.where(den > 0, num / den.clamp_min(1e-30), torch.zeros_like(num))


# ----------------------------------------------------------------------------------------------
# Router heads
# ----------------------------------------------------------------------------------------------


class Standardize(nn.Module):
    """Per-feature (h - mean) / std with *fixed* statistics held in buffers.

    Why not BatchNorm: the final hidden states of an LM share a large common component, so a linear
    head on the raw state sends every example to the same latent (the prototype collapsed that way).
    BatchNorm removed the component but makes each output depend on the rest of its micro-batch, which
    breaks the requirement that (world 1 x accumulation 4) equal (world 2 x accumulation 2). Here the
    statistics are estimated once from a calibration batch (data-dependent initialisation) and then
    frozen, so the map is a fixed affine function of one example's hidden state.

    ``std = sqrt(var + eps)`` with the biased variance, as BatchNorm does.
    """

    def __init__(self, num_features: int, *, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.register_buffer("mean", torch.zeros(num_features))
        self.register_buffer("std", torch.ones(num_features))
        # A buffer (not a Python bool) so that it travels with the state dict and a resumed model
        # does not re-estimate its statistics.
        self.register_buffer("calibrated", torch.zeros((), dtype=torch.bool))

    @torch.no_grad()
    def calibrate(self, h_BH: torch.Tensor) -> None:
        """Estimate mean/std from ``h_BH`` (at least 2 rows) and mark the module calibrated."""
        if h_BH.dim() != 2 or h_BH.shape[1] != self.mean.numel():
            raise ValueError(f"calibration states must be [B, {self.mean.numel()}], got {tuple(h_BH.shape)}")
        if h_BH.shape[0] < 2:
            raise ValueError(f"calibration needs at least 2 examples to estimate a std, got {h_BH.shape[0]}")
        h = h_BH.detach().float()
        self.mean.copy_(h.mean(0))
        self.std.copy_(torch.sqrt(h.var(0, unbiased=False) + self.eps))
        self.calibrated.fill_(True)

    def forward(self, h_BH: torch.Tensor) -> torch.Tensor:
        return (h_BH.to(self.mean.dtype) - self.mean) / self.std


class DiscreteRouter(nn.Module):
    """Posterior q(z|x,y) and prior p(z|x) logits over K latents from two final hidden states.

    The posterior reads the state at ``</y>`` (it has seen x and y), the prior the state at ``</x>``
    (causal: it has seen x only). Each state is standardised with its own frozen statistics (the two
    positions have different distributions), then a linear head gives the logits.

    Both heads start at zero, so q and p are exactly uniform at step 0 and neither favours a latent:
    a randomly initialised posterior (std 0.3 on standardised features of norm ~sqrt(H)) starts nearly
    one-hot and collapsed within 25 steps in the prototype. The zero start still trains: the weight
    gradient is (dL/dlogits) x (standardised state), non-zero as soon as the K branches reconstruct an
    example differently, which the distinct z rows guarantee. The posterior head has no bias (a bias
    would be a per-latent preference independent of the example, exactly what collapse looks like);
    the prior keeps one, since a marginal preference is legitimate for p(z|x).
    """

    def __init__(self, hidden_size: int, num_latents: int) -> None:
        super().__init__()
        if num_latents < 1:
            raise ValueError(f"num_latents must be >= 1, got {num_latents}")
        self.posterior_norm = Standardize(hidden_size)
        self.prior_norm = Standardize(hidden_size)
        self.posterior_head = nn.Linear(hidden_size, num_latents, bias=False)
        self.prior_head = nn.Linear(hidden_size, num_latents, bias=True)
        for p in self.parameters():
            nn.init.zeros_(p)

    @property
    def calibrated(self) -> bool:
        return bool(self.posterior_norm.calibrated) and bool(self.prior_norm.calibrated)

    def calibrate(self, *, h_posterior_BH: torch.Tensor, h_prior_BH: torch.Tensor) -> None:
        self.posterior_norm.calibrate(h_posterior_BH)
        self.prior_norm.calibrate(h_prior_BH)

    def forward(self, *, h_posterior_BH: torch.Tensor, h_prior_BH: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (posterior_logits_BK, prior_logits_BK), float32."""
        hq = self.posterior_norm(h_posterior_BH).to(self.posterior_head.weight.dtype)
        hp = self.prior_norm(h_prior_BH).to(self.prior_head.weight.dtype)
        return self.posterior_head(hq).float(), self.prior_head(hp).float()


class GaussianRouter(nn.Module):
    """Diagonal Gaussian posterior q(z|x,y) = N(mu, e^logvar) and prior p(z|x) from final hidden states.

    Same reading positions and frozen standardisation as :class:`DiscreteRouter`. Heads output
    [mu, logvar] (2D values) and start at zero, so q = p = N(0, I) and KL = 0 at step 0 (a VAE that
    starts with a large KL spends its first steps shrinking it, usually into collapse). With
    ``learned_prior`` False the prior is N(0, I) and no prior parameters exist.
    """

    def __init__(self, hidden_size: int, latent_dim: int, *, learned_prior: bool = True) -> None:
        super().__init__()
        if latent_dim < 1:
            raise ValueError(f"latent_dim must be >= 1, got {latent_dim}")
        self.latent_dim = latent_dim
        self.learned_prior = learned_prior
        self.posterior_norm = Standardize(hidden_size)
        self.posterior_head = nn.Linear(hidden_size, 2 * latent_dim)
        if learned_prior:
            self.prior_norm = Standardize(hidden_size)
            self.prior_head = nn.Linear(hidden_size, 2 * latent_dim)
        for p in self.parameters():
            nn.init.zeros_(p)

    @property
    def calibrated(self) -> bool:
        ok = bool(self.posterior_norm.calibrated)
        return ok and (not self.learned_prior or bool(self.prior_norm.calibrated))

    def calibrate(self, *, h_posterior_BH: torch.Tensor, h_prior_BH: torch.Tensor) -> None:
        self.posterior_norm.calibrate(h_posterior_BH)
        if self.learned_prior:
            self.prior_norm.calibrate(h_prior_BH)

    @staticmethod
    def _split(out_B2D: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        mu, logvar = out_B2D.float().chunk(2, dim=-1)
        return mu, logvar.clamp(LOGVAR_MIN, LOGVAR_MAX)

    def forward(
        self, *, h_posterior_BH: torch.Tensor, h_prior_BH: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """-> (mu_BD, logvar_BD, prior_mu_BD, prior_logvar_BD), float32 (prior zeros when not learned)."""
        hq = self.posterior_norm(h_posterior_BH).to(self.posterior_head.weight.dtype)
        mu, logvar = self._split(self.posterior_head(hq))
        if not self.learned_prior:
            return mu, logvar, torch.zeros_like(mu), torch.zeros_like(logvar)
        hp = self.prior_norm(h_prior_BH).to(self.prior_head.weight.dtype)
        prior_mu, prior_logvar = self._split(self.prior_head(hp))
        return mu, logvar, prior_mu, prior_logvar


class SoftPromptProjection(nn.Module):
    """z [R, D] -> M additive soft-prompt offsets [R, M, H] for the z slots.

    The model adds the offsets to the slot token's own embedding (``<znull>``), so at initialisation
    the decoder sees ``<znull>`` plus a small z-dependent perturbation, mirroring the discrete z rows
    (``<znull>`` row + noise): a backbone pretrained with ``<znull>`` in the slot is not disturbed. The
    weights are drawn so that for z ~ N(0, I) each offset has expected norm ``init_scale``:
    std = init_scale / sqrt(H D). The bias starts at 0.
    """

    def __init__(self, latent_dim: int, num_slots: int, hidden_size: int) -> None:
        super().__init__()
        self.num_slots = num_slots
        self.hidden_size = hidden_size
        self.proj = nn.Linear(latent_dim, num_slots * hidden_size)
        nn.init.zeros_(self.proj.bias)
        nn.init.zeros_(self.proj.weight)

    @torch.no_grad()
    def reset_parameters(self, *, init_scale: float, generator: torch.Generator | None = None) -> None:
        D = self.proj.in_features
        std = init_scale / math.sqrt(self.hidden_size * D)
        w = torch.randn(self.proj.weight.shape, generator=generator, dtype=torch.float32) * std
        self.proj.weight.copy_(w.to(self.proj.weight))
        self.proj.bias.zero_()

    def forward(self, z_RD: torch.Tensor) -> torch.Tensor:
        out = self.proj(z_RD.to(self.proj.weight.dtype))  # (R, M*H)
        return out.view(z_RD.shape[0], self.num_slots, self.hidden_size)  # (R, M, H)


class ZConditionedNorm(nn.Module):
    """z -> a scale and a shift for each of the decoder's ``num_norms`` norms: (R, num_norms, 2, H).

    The model applies them to a norm's output on the z-conditioned positions, ``norm(h) * (1 + scale) +
    shift`` (``ZCVAE``, ``--z-conditioned-norm``): the notes' architectural remedy for the single z token,
    whose effect on early y positions goes through attention alone and may stay too small for the
    reconstruction to pull z into use (docs/objective.md#dilution). Here z reaches every
    position of every layer directly. Zero at initialisation, so the model starts as it would without
    it, while the gradient on the table is not zero: ``d l_t / d scale_z = d l_t / d out * norm(h)``
    at every conditioned position.

    Discrete (``num_latents``): one learned row per latent value. Gaussian (``latent_dim``): a linear
    map of z, without bias (a z-free shift is the LoRA's job).
    """

    def __init__(self, num_norms: int, hidden_size: int, *, num_latents: int | None = None, latent_dim: int | None = None) -> None:
        super().__init__()
        if (num_latents is None) == (latent_dim is None):
            raise ValueError("ZConditionedNorm takes num_latents (discrete) or latent_dim (Gaussian)")
        self.num_norms, self.hidden_size = num_norms, hidden_size
        width = num_norms * 2 * hidden_size
        if num_latents is not None:
            self.table = nn.Embedding(num_latents, width)
            nn.init.zeros_(self.table.weight)
        else:
            self.linear = nn.Linear(latent_dim, width, bias=False)
            nn.init.zeros_(self.linear.weight)

    def forward(self, latent: torch.Tensor) -> torch.Tensor:
        """``latent``: latent indices (R,) long (discrete) or z (R, D) (Gaussian) -> (R, num_norms, 2, H)."""
        if hasattr(self, "table"):
            out = self.table(latent.to(self.table.weight.device))
        else:
            out = self.linear(latent.to(self.linear.weight.dtype))
        return out.view(latent.shape[0], self.num_norms, 2, self.hidden_size)
