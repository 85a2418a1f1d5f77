"""marginal_router_terms (zcvae.core.objective): the router's batch-level terms on the global marginal of q.

Values against closed forms (uniform and one-hot marginals) and SciPy's entropy, the signs of the two
weights, and the gradient contract: each rank's term differentiates through its own q only, and the
sum of the ranks' gradients is the gradient of the term computed on the whole global batch.

Shape legend: B examples, K latents, R simulated ranks.
"""

from __future__ import annotations

import math

import pytest
import torch
from scipy.stats import entropy

from zcvae.core.objective import AuxiliaryWeights, marginal_router_terms

K = 4


def single_rank(q_BK: torch.Tensor, aux: AuxiliaryWeights):
    sum_q_K = q_BK.sum(0)
    return marginal_router_terms(local_sum_q_K=sum_q_K, global_sum_q_K=sum_q_K.detach(),
                                 global_count=torch.tensor(float(q_BK.shape[0])), aux=aux)


@pytest.mark.parametrize(
    "q_BK, kl, support",
    [
        (torch.full((6, K), 1.0 / K), 0.0, float(K)),  # uniform usage: no KL, all K latents in use
        (torch.eye(K)[[2, 2, 2]], math.log(K), 1.0),  # every example on latent 2: KL log K, support 1
        (torch.eye(K)[[0, 1, 0, 1]], math.log(2), 2.0),  # two latents used equally
    ],
)
def test_closed_forms(q_BK, kl, support):
    _, metrics = single_rank(q_BK, AuxiliaryWeights())
    assert metrics["router_marginal_kl"].item() == pytest.approx(kl, abs=1e-6)
    assert metrics["router_support"].item() == pytest.approx(support, rel=1e-5)


def test_matches_scipy_on_a_random_posterior_and_the_weights_signs():
    q_BK = torch.softmax(torch.randn(9, K, generator=torch.Generator().manual_seed(0), dtype=torch.float64), -1)
    mean_q = q_BK.mean(0).numpy()
    h = entropy(mean_q)  # nats
    kl = entropy(mean_q, [1.0 / K] * K)
    aux = AuxiliaryWeights(router_marginal_kl=0.7, router_support=0.3)
    term, metrics = single_rank(q_BK, aux)
    assert metrics["router_marginal_kl"].item() == pytest.approx(kl, rel=1e-5)
    assert metrics["router_support"].item() == pytest.approx(math.exp(h), rel=1e-5)
    # + w_kl KL(mean q || U)  -  w_support H(mean q): a positive support weight rewards spread usage
    assert term.item() == pytest.approx(0.7 * kl - 0.3 * h, rel=1e-5)
    assert single_rank(q_BK, AuxiliaryWeights())[0].item() == 0.0


def test_metrics_are_detached():
    q_BK = torch.softmax(torch.randn(5, K), -1).requires_grad_()
    term, metrics = single_rank(q_BK, AuxiliaryWeights(router_marginal_kl=1.0, router_support=1.0))
    assert term.requires_grad
    assert not any(m.requires_grad for m in metrics.values())


def test_rank_gradients_sum_to_the_global_gradient():
    aux = AuxiliaryWeights(router_marginal_kl=0.5, router_support=2.0)
    logits_BK = torch.randn(10, K, generator=torch.Generator().manual_seed(1))
    valid_B = torch.tensor([1.0, 1, 0, 1, 1, 1, 1, 0, 1, 1])  # two invalid examples

    # the whole global batch in one process
    whole = logits_BK.clone().requires_grad_()
    q_BK = torch.softmax(whole, -1) * valid_B[:, None]
    term, _ = marginal_router_terms(local_sum_q_K=q_BK.sum(0), global_sum_q_K=q_BK.sum(0).detach(),
                                    global_count=valid_B.sum(), aux=aux)
    term.backward()

    # R = 2 simulated ranks of 4 and 6 examples; the all-reduce is a sum of the detached local sums
    parts = [logits_BK[:4].clone().requires_grad_(), logits_BK[4:].clone().requires_grad_()]
    valid = [valid_B[:4], valid_B[4:]]
    local_q = [torch.softmax(p, -1) * v[:, None] for p, v in zip(parts, valid)]
    global_sum_q_K = sum(q.sum(0).detach() for q in local_q)
    for q, v in zip(local_q, valid):
        rank_term, _ = marginal_router_terms(local_sum_q_K=q.sum(0), global_sum_q_K=global_sum_q_K,
                                             global_count=valid_B.sum(), aux=aux)
        # every rank computes the same value: the global term
        assert rank_term.item() == pytest.approx(term.item(), rel=1e-6)
        rank_term.backward()

    torch.testing.assert_close(torch.cat([p.grad for p in parts]), whole.grad, rtol=1e-5, atol=1e-7)  # fp32: the KL is computed in float32
    assert bool(whole.grad[valid_B == 1].abs().sum() > 0)
    assert torch.equal(whole.grad[valid_B == 0], torch.zeros(2, K))


def test_router_support_schedule_kl_delay_keeps_support_only_while_beta_is_zero():
    """delay: support at its weight on exactly the steps where the KL weight is 0 (the delay), then 0;
    constant: at its weight on every step. The other auxiliaries are never touched."""
    from zcvae.config import TrainConfig, kl_weight_at
    from zcvae.core.objective import AuxiliaryWeights

    for schedule in ("constant", "delay"):
        cfg = TrainConfig.from_flat(max_steps=10, kl_delay_fraction=0.6, router_support_weight=1.0, posterior_entropy_weight=0.5,
                                    router_support_schedule=schedule)
        support = [AuxiliaryWeights.from_train_config(cfg, beta=kl_weight_at(cfg, step)).router_support for step in range(10)]
        # beta is 0 on steps 0-6 (step 6 starts the ramp at 0: (0.6 - 0.6) / 0.2), then > 0
        assert support == ([1.0] * 10 if schedule == "constant" else [1.0] * 7 + [0.0] * 3), schedule
        assert {AuxiliaryWeights.from_train_config(cfg, beta=kl_weight_at(cfg, s)).posterior_entropy for s in range(10)} == {0.5}
    with pytest.raises(ValueError, match="router_support_schedule"):
        TrainConfig.from_flat(router_support_schedule="sometimes")
