"""Latent math and router heads: formulas against hand computations and torch.distributions."""

import math

import pytest
import torch

from zcvae.core.latent import (
    DiscreteRouter,
    GaussianRouter,
    SoftPromptProjection,
    Standardize,
    categorical_kl,
    entropy,
    gaussian_entropy,
    gaussian_kl,
    inter_latent_divergence,
    marginal_kl_to_uniform,
    router_support,
)


def test_categorical_kl_matches_hand_formula():
    g = torch.Generator().manual_seed(0)
    q, p = torch.randn(5, 4, generator=g), torch.randn(5, 4, generator=g)
    qp, pp = q.softmax(-1), p.softmax(-1)
    hand = torch.stack([sum(qp[i, k] * math.log(qp[i, k] / pp[i, k]) for k in range(4)) for i in range(5)])
    torch.testing.assert_close(categorical_kl(q, p), hand, atol=1e-6, rtol=1e-5)
    assert torch.allclose(categorical_kl(q, q), torch.zeros(5), atol=1e-7)
    # shift invariance of logits
    torch.testing.assert_close(categorical_kl(q + 3.0, p - 1.0), hand, atol=1e-6, rtol=1e-5)


def test_categorical_kl_one_hot_q_is_finite():
    q = torch.tensor([[1e4, -1e4, -1e4]])
    p = torch.zeros(1, 3)
    torch.testing.assert_close(categorical_kl(q, p), torch.tensor([math.log(3.0)]), atol=1e-5, rtol=0)


def test_entropy():
    assert torch.allclose(entropy(torch.zeros(2, 5)), torch.full((2,), math.log(5.0)))
    logits = torch.tensor([[0.0, math.log(3.0)]])  # q = (1/4, 3/4)
    hand = -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))
    assert abs(float(entropy(logits)) - hand) < 1e-6


def test_gaussian_kl_matches_torch_distributions():
    from torch.distributions import Independent, Normal, kl_divergence

    g = torch.Generator().manual_seed(1)
    mu_q, lv_q, mu_p, lv_p = (torch.randn(3, 6, generator=g) for _ in range(4))
    q = Independent(Normal(mu_q, (0.5 * lv_q).exp()), 1)
    p = Independent(Normal(mu_p, (0.5 * lv_p).exp()), 1)
    torch.testing.assert_close(gaussian_kl(mu_q, lv_q, mu_p, lv_p), kl_divergence(q, p), atol=1e-5, rtol=1e-5)
    std = Independent(Normal(torch.zeros(3, 6), torch.ones(3, 6)), 1)
    torch.testing.assert_close(gaussian_kl(mu_q, lv_q), kl_divergence(q, std), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(gaussian_entropy(lv_q), q.entropy(), atol=1e-5, rtol=1e-5)
    assert torch.allclose(gaussian_kl(mu_q, lv_q, mu_q, lv_q), torch.zeros(3), atol=1e-6)


def test_marginal_kl_and_support():
    K = 4
    uniform = torch.full((K,), 1.0 / K)
    one_hot = torch.tensor([0.0, 1.0, 0.0, 0.0])
    assert abs(float(marginal_kl_to_uniform(uniform))) < 1e-6
    assert abs(float(marginal_kl_to_uniform(one_hot)) - math.log(K)) < 1e-6
    assert abs(float(router_support(uniform)) - K) < 1e-5
    assert abs(float(router_support(one_hot)) - 1.0) < 1e-6
    half = torch.tensor([0.5, 0.5, 0.0, 0.0])
    assert abs(float(router_support(half)) - 2.0) < 1e-5


def test_inter_latent_divergence_hand_example():
    # B=1, K=3, N=3 with the last position masked out (its huge values must not count)
    l = torch.tensor([[[1.0, 2.0, 99.0], [3.0, 2.0, -99.0], [1.0, 5.0, 0.0]]])
    mask = torch.tensor([[True, True, False]])
    # pairs: (0,1): (2+0)/2=1, (0,2): (0+3)/2=1.5, (1,2): (2+3)/2=2.5 -> mean 5/3
    d = inter_latent_divergence(l, torch.ones(1, 3), mask)
    assert abs(float(d) - 5.0 / 3.0) < 1e-6
    # pair weights w_k w_j: w = (1, 1, 0) keeps only the pair (0, 1)
    d01 = inter_latent_divergence(l, torch.tensor([[1.0, 1.0, 0.0]]), mask)
    assert abs(float(d01) - 1.0) < 1e-6
    # one-hot weights and K = 1 give 0; identical branches give 0
    assert float(inter_latent_divergence(l, torch.tensor([[0.0, 1.0, 0.0]]), mask)) == 0.0
    assert float(inter_latent_divergence(l[:, :1], torch.ones(1, 1), mask)) == 0.0
    same = l[:, :1].expand(1, 3, 3)
    assert float(inter_latent_divergence(same, torch.ones(1, 3), mask)) == 0.0
    # empty span gives 0, not NaN
    assert float(inter_latent_divergence(l, torch.ones(1, 3), torch.zeros(1, 3, dtype=torch.bool))) == 0.0


def test_standardize_is_fixed_after_calibration():
    g = torch.Generator().manual_seed(2)
    h = torch.randn(16, 8, generator=g) * 3.0 + 5.0
    s = Standardize(8)
    assert not bool(s.calibrated)
    s.calibrate(h)
    out = s(h)
    assert torch.allclose(out.mean(0), torch.zeros(8), atol=1e-5)
    assert torch.allclose(out.var(0, unbiased=False), torch.ones(8), atol=1e-3)
    # one row's output does not depend on the rest of the batch (unlike BatchNorm)
    torch.testing.assert_close(s(h[:3])[1], out[1])
    assert set(dict(s.named_buffers())) == {"mean", "std", "calibrated"}
    with pytest.raises(ValueError, match="at least 2"):
        Standardize(8).calibrate(h[:1])


def test_routers_start_uniform_and_at_zero_kl():
    g = torch.Generator().manual_seed(3)
    h_q, h_p = torch.randn(6, 8, generator=g) + 4.0, torch.randn(6, 8, generator=g) - 2.0
    router = DiscreteRouter(8, 3)
    router.calibrate(h_posterior_BH=h_q, h_prior_BH=h_p)
    q, p = router(h_posterior_BH=h_q, h_prior_BH=h_p)
    assert torch.allclose(q.softmax(-1), torch.full((6, 3), 1 / 3), atol=1e-7)
    assert torch.allclose(p.softmax(-1), torch.full((6, 3), 1 / 3), atol=1e-7)
    assert router.posterior_head.bias is None  # no per-latent preference independent of the example
    for learned in (True, False):
        gr = GaussianRouter(8, 4, learned_prior=learned)
        gr.calibrate(h_posterior_BH=h_q, h_prior_BH=h_p)
        mu, lv, pmu, plv = gr(h_posterior_BH=h_q, h_prior_BH=h_p)
        assert torch.allclose(gaussian_kl(mu, lv, pmu, plv), torch.zeros(6))
        assert hasattr(gr, "prior_head") == learned


def test_soft_prompt_projection_init_scale():
    proj = SoftPromptProjection(latent_dim=16, num_slots=2, hidden_size=64)
    proj.reset_parameters(init_scale=0.5, generator=torch.Generator().manual_seed(0))
    z = torch.randn(4000, 16, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        out = proj(z)
    assert out.shape == (4000, 2, 64)
    assert abs(float(out.norm(dim=-1).pow(2).mean().sqrt()) - 0.5) < 0.05
