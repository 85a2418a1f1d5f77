"""Tests for zcvae.eval.metrics: hand-computed values, scikit-learn's documented examples, brute force."""

import math
import os

import numpy as np
import pytest
import torch

from sklearn.metrics import normalized_mutual_info_score

from zcvae.eval.metrics import (
    cluster_scores,
    controllability_metrics,
    discrete_latent_metrics,
    gaussian_latent_metrics,
    information_gain_by_position,
    kmeans_labels,
)
from zcvae.eval.figures import plot_latent_figure


def nmi(a, b):
    return cluster_scores(a, b)["nmi"]


def adjusted_rand_index(a, b):
    return cluster_scores(a, b)["ari"]


def homogeneity_completeness(a, b):
    out = cluster_scores(a, b)
    return out["homogeneity"], out["completeness"]


LN2 = math.log(2.0)


# ---------------------------------------------------------------- clustering metrics


@pytest.mark.parametrize(
    "a, b, expected",
    [
        # scikit-learn's documented adjusted_rand_score examples
        ([0, 0, 1, 1], [0, 0, 1, 1], 1.0),
        ([0, 0, 1, 1], [1, 1, 0, 0], 1.0),
        ([0, 0, 1, 2], [0, 0, 1, 1], 0.5714285714285714),
        ([0, 0, 1, 1], [0, 0, 1, 2], 0.5714285714285714),
        ([0, 0, 0, 0], [0, 1, 2, 3], 0.0),
        ([0, 0, 1, 1], [0, 1, 0, 1], -0.5),
    ],
)
def test_ari_documented_examples(a, b, expected):
    assert adjusted_rand_index(a, b) == pytest.approx(expected, abs=1e-12)


def test_ari_hand_computed_pairs():
    # a = [0,0,0,1,1,1], b = [0,0,1,1,2,2]: same-pairs a: 3+3 = 6; b: 1+1+1 = 3; both: (0,1), (4,5) = 2.
    # E = 6*3/15 = 1.2, max = 4.5 -> ARI = (2 - 1.2) / (4.5 - 1.2)
    assert adjusted_rand_index([0, 0, 0, 1, 1, 1], [0, 0, 1, 1, 2, 2]) == pytest.approx(0.8 / 3.3)


def test_nmi_values():
    assert nmi([0, 0, 1, 1], [0, 0, 1, 1]) == 1.0
    assert nmi([0, 0, 1, 1], [1, 1, 0, 0]) == 1.0
    assert nmi(["a", "a", "b", "b"], [7, 7, 3, 3]) == 1.0
    assert nmi([0, 0, 0, 0], [0, 1, 2, 3]) == 0.0
    assert nmi([0, 0, 1, 1], [0, 0, 0, 0]) == 0.0
    # b refines a: I = H(a) = ln 2, H(b) = 1.5 ln 2 -> NMI = ln2 / (1.25 ln 2) = 0.8
    assert nmi([0, 0, 1, 1], [0, 0, 1, 2]) == pytest.approx(0.8)
    assert nmi([0, 0, 1, 2], [0, 0, 1, 1]) == pytest.approx(0.8)


def test_homogeneity_completeness_documented_examples():
    assert homogeneity_completeness([0, 0, 1, 1], [0, 0, 0, 0]) == (0.0, 1.0)
    h, c = homogeneity_completeness([0, 0, 1, 1], [0, 0, 1, 2])
    assert h == pytest.approx(1.0) and c == pytest.approx(1 / 1.5)
    assert homogeneity_completeness([0, 0, 1, 1], [0, 1, 2, 3])[0] == pytest.approx(1.0)
    assert homogeneity_completeness([0, 0, 1, 1], [0, 1, 0, 1]) == pytest.approx((0.0, 0.0))
    assert homogeneity_completeness([0, 1, 2, 3], [0, 0, 1, 1])[1] == pytest.approx(1.0)


def test_clustering_metrics_permutation_invariant_and_near_zero_when_independent():
    rng = np.random.default_rng(0)
    a = rng.integers(0, 3, size=3000)
    b = rng.integers(0, 4, size=3000)
    assert nmi(a, b) < 0.01
    assert abs(adjusted_rand_index(a, b)) < 0.01
    # Relabelling either side changes nothing.
    a_renamed = np.array(["x", "y", "z"])[a]
    b_permuted = (b + 1) % 4
    assert nmi(a_renamed, b_permuted) == pytest.approx(nmi(a, b))
    assert adjusted_rand_index(a_renamed, b_permuted) == pytest.approx(adjusted_rand_index(a, b))
    # Symmetry of NMI and ARI.
    assert nmi(b, a) == pytest.approx(nmi(a, b))
    assert adjusted_rand_index(b, a) == pytest.approx(adjusted_rand_index(a, b))


def test_clustering_metrics_reject_length_mismatch():
    with pytest.raises(ValueError, match="same length"):
        nmi([0, 1], [0])


def test_cluster_scores_do_not_conflate_labels_of_mixed_type():
    # 1 and "1" are different strategies; a string array would merge them.
    assert nmi([1, "1", 1, "1"], [0, 1, 0, 1]) == 1.0


# ---------------------------------------------------------------- discrete latents


def test_discrete_metrics_hand_computed():
    q = np.array([[0.9, 0.1], [0.2, 0.8]])
    out = discrete_latent_metrics(q)
    h = lambda ps: -sum(p * math.log(p) for p in ps if p > 0)  # noqa: E731
    h_bar = h([0.55, 0.45])
    assert out["mi"] == pytest.approx(h_bar - (h([0.9, 0.1]) + h([0.2, 0.8])) / 2)
    assert out["router_support"] == pytest.approx(math.exp(h_bar))
    assert out["marginal_kl_uniform"] == pytest.approx(LN2 - h_bar)
    assert out["posterior_entropy"] == pytest.approx((h([0.9, 0.1]) + h([0.2, 0.8])) / 2)
    assert out["num_used_latents"] == 2
    np.testing.assert_allclose(out["latent_usage"], [0.55, 0.45])


def test_discrete_metrics_used_vs_collapsed():
    k = 4
    one_hot = np.eye(k)[np.arange(40) % k]
    used = discrete_latent_metrics(one_hot)
    assert used["mi"] == pytest.approx(math.log(k))
    assert used["router_support"] == pytest.approx(k)
    assert used["marginal_kl_uniform"] == pytest.approx(0.0, abs=1e-12)

    # Collapse that a non-zero KL to a peaked prior would hide: every q is uniform, so MI = 0
    # although support is full.
    uniform = np.full((40, k), 1.0 / k)
    flat = discrete_latent_metrics(uniform)
    assert flat["mi"] == pytest.approx(0.0, abs=1e-12)
    assert flat["router_support"] == pytest.approx(k)

    # Collapse onto one latent: one used latent, KL to uniform = log K.
    onto_one = np.zeros((40, k))
    onto_one[:, 2] = 1.0
    dead = discrete_latent_metrics(onto_one, eps_used=0.01)
    assert dead["num_used_latents"] == 1
    assert dead["router_support"] == pytest.approx(1.0)
    assert dead["marginal_kl_uniform"] == pytest.approx(math.log(k))


def test_discrete_metrics_eps_used_threshold():
    q = np.array([[0.995, 0.005, 0.0]] * 3)
    assert discrete_latent_metrics(q, eps_used=1e-2)["num_used_latents"] == 1
    assert discrete_latent_metrics(q, eps_used=1e-3)["num_used_latents"] == 2


def test_discrete_metrics_prior():
    q = np.array([[0.5, 0.5], [1.0, 0.0]])
    p = np.array([[0.25, 0.75], [0.5, 0.5]])
    out = discrete_latent_metrics(q, prior_NK=p)
    # Row 0: argmax q = 0 (tie -> first), argmax p = 1; row 1: both 0.
    assert out["prior_agreement"] == pytest.approx(0.5)
    kl0 = 0.5 * math.log(0.5 / 0.25) + 0.5 * math.log(0.5 / 0.75)
    kl1 = math.log(1.0 / 0.5)
    assert out["kl_posterior_prior"] == pytest.approx((kl0 + kl1) / 2)


def test_discrete_metrics_labels_perfect_permuted_and_collapsed():
    labels = ["ltr", "rtl"] * 10 + [None, None]
    # Latent 1 <-> "ltr", latent 0 <-> "rtl": a permuted but perfect code; None rows get nonsense.
    q = np.array([[0.1, 0.9], [0.8, 0.2]] * 10 + [[0.5, 0.5], [0.9, 0.1]])
    out = discrete_latent_metrics(q, labels=labels)
    assert out["num_labelled"] == 20
    assert out["nmi"] == 1.0 and out["ari"] == pytest.approx(1.0)
    assert out["homogeneity"] == pytest.approx(1.0) and out["completeness"] == pytest.approx(1.0)
    assert out["confusion_strategy_labels"] == ["ltr", "rtl"]
    assert out["confusion_latent_labels"] == [0, 1]
    assert out["confusion"].tolist() == [[0, 10], [10, 0]]
    assert out["matching"] == {0: "rtl", 1: "ltr"}
    assert out["matching_accuracy"] == pytest.approx(1.0)
    assert out["matching_soft_accuracy"] == pytest.approx(0.85)

    collapsed = discrete_latent_metrics(np.tile([[0.7, 0.3]], (20, 1)), labels=labels[:20])
    assert collapsed["nmi"] == 0.0
    assert collapsed["confusion"].tolist() == [[10, 10], [0, 0]]
    assert collapsed["matching_accuracy"] == pytest.approx(0.5)


def test_discrete_metrics_three_latents_two_strategies():
    labels = ["a"] * 6 + ["b"] * 4
    pred = [0, 0, 0, 0, 2, 2, 1, 1, 1, 2]
    q = np.eye(3)[pred]
    out = discrete_latent_metrics(q, labels=labels)
    assert out["confusion"].tolist() == [[4, 0], [0, 3], [2, 1]]
    assert out["matching"] == {0: "a", 1: "b"}
    assert out["matching_accuracy"] == pytest.approx(0.7)
    assert out["nmi"] == pytest.approx(normalized_mutual_info_score(labels, pred))


def test_discrete_metrics_accepts_torch_and_matches_numpy():
    rng = np.random.default_rng(1)
    logits = rng.normal(size=(50, 3))
    q = np.exp(logits) / np.exp(logits).sum(axis=1, keepdims=True)
    labels = [("a", "b", "c")[i % 3] for i in range(50)]
    from_np = discrete_latent_metrics(q, labels=labels)
    from_torch = discrete_latent_metrics(torch.tensor(q, dtype=torch.float32), labels=labels)
    for key in ("mi", "router_support", "nmi", "ari", "matching_accuracy"):
        assert from_torch[key] == pytest.approx(from_np[key], rel=1e-5)


def test_discrete_metrics_rejects_logits_and_bad_lengths():
    with pytest.raises(ValueError, match="posterior_NK"):
        discrete_latent_metrics(np.array([[2.0, -1.0]]))
    with pytest.raises(ValueError, match="labels"):
        discrete_latent_metrics(np.array([[0.5, 0.5]]), labels=["a", "b"])
    with pytest.raises(ValueError, match="prior_NK"):
        discrete_latent_metrics(np.array([[0.5, 0.5]]), prior_NK=np.array([[1.0, 0.0, 0.0]]))


# ---------------------------------------------------------------- controllability


def _records(latent, parsed, gold="ltr", correct=True, **extra):
    return [
        dict(latent=latent, gold_strategy=gold, parsed_strategy=s, parse_ok=s is not None,
             answer_correct=correct and s is not None, **extra)
        for s in parsed
    ]


def test_controllability_collapse_purity_misleads_matching_does_not():
    # Notes' collapse case: both latents decode strategy A 82% of the time.
    decoded = _records(0, ["A"] * 82 + ["B"] * 18) + _records(1, ["A"] * 82 + ["B"] * 18)
    out = controllability_metrics(decoded)
    assert out["purity_per_latent"] == {0: pytest.approx(0.82), 1: pytest.approx(0.82)}
    assert out["mean_purity"] == pytest.approx(0.82)
    assert out["majority_strategy"] == {0: "A", 1: "A"}
    assert out["matching_accuracy"] == pytest.approx(0.5)


def test_controllability_perfect_and_unparsed():
    decoded = (
        _records(0, ["B"] * 8 + [None] * 2, exact_match=1.0)
        + _records(1, ["A"] * 10, exact_match=0.0)
    )
    decoded[0]["answer_correct"] = False
    out = controllability_metrics(decoded)
    assert out["purity_per_latent"] == {0: pytest.approx(0.8), 1: pytest.approx(1.0)}
    assert out["matching"] == {0: "B", 1: "A"}
    assert out["matching_accuracy"] == pytest.approx(18 / 20)
    assert out["parse_rate"] == pytest.approx(18 / 20)
    assert out["answer_accuracy"] == pytest.approx(17 / 20)
    assert out["exact_match"] == pytest.approx(0.5)
    assert out["num_decodes"] == 20
    # gold is "ltr" everywhere and never parsed as such.
    assert out["gold_agreement"] == 0.0


def test_controllability_parsed_strategy_ignored_when_parse_failed():
    decoded = [dict(latent=0, gold_strategy=None, parsed_strategy="A", parse_ok=False, answer_correct=False)]
    out = controllability_metrics(decoded)
    assert out["purity_per_latent"] == {0: 0.0}
    assert out["matching_accuracy"] == 0.0
    assert "exact_match" not in out and "gold_agreement" not in out


def test_controllability_rejects_bad_records():
    with pytest.raises(ValueError, match="decoded"):
        controllability_metrics([])
    with pytest.raises(ValueError, match="latent"):
        controllability_metrics([dict(parsed_strategy="A", parse_ok=True)])


# ---------------------------------------------------------------- gaussian latents


def test_gaussian_active_units_and_kl():
    rng = np.random.default_rng(0)
    mu = np.concatenate([rng.normal(0, 1.0, size=(200, 2)), rng.normal(0, 0.03, size=(200, 3))], axis=1)
    out = gaussian_latent_metrics(mu, delta=0.01)
    assert out["active_units"] == 2
    assert out["active_units_delta"] == 0.01
    np.testing.assert_allclose(out["mean_variance_per_dim"], mu.var(axis=0, ddof=1))
    assert gaussian_latent_metrics(mu, delta=1e-4)["active_units"] == 5
    assert gaussian_latent_metrics(mu, delta=10.0)["active_units"] == 0

    zeros = np.zeros((4, 3))
    assert gaussian_latent_metrics(zeros, logvar_ND=zeros)["kl_to_standard_normal"] == pytest.approx(0.0)
    # mu = 1, var = e: 0.5 * (1 + e - 1 - 1) per dim
    out = gaussian_latent_metrics(np.ones((4, 3)), logvar_ND=np.ones((4, 3)))
    assert out["kl_to_standard_normal"] == pytest.approx(3 * 0.5 * (math.e - 1))


def test_gaussian_kmeans_recovers_separated_strategies_deterministically():
    rng = np.random.default_rng(3)
    centres = {"ltr": np.array([4.0, 0.0, 0.0]), "rtl": np.array([-4.0, 0.0, 0.0]), "mid": np.array([0, 5.0, 0])}
    labels = [("ltr", "rtl", "mid")[i % 3] for i in range(90)]
    mu = np.stack([centres[s] + rng.normal(0, 0.3, size=3) for s in labels])
    labels_with_none = labels + [None]
    mu_with_extra = np.concatenate([mu, np.full((1, 3), 100.0)])
    out = gaussian_latent_metrics(torch.tensor(mu_with_extra), labels=labels_with_none, seed=0)
    assert out["num_clusters"] == 3 and out["num_labelled"] == 90
    assert out["nmi"] == 1.0 and out["ari"] == pytest.approx(1.0)
    again = gaussian_latent_metrics(mu_with_extra, labels=labels_with_none, seed=0)
    assert again["nmi"] == out["nmi"] and again["ari"] == out["ari"]

    noise = rng.normal(size=(90, 3))
    unrelated = gaussian_latent_metrics(noise, labels=labels)
    assert unrelated["nmi"] < 0.1


def test_kmeans_is_deterministic_and_handles_duplicates():
    x = np.array([[0.0, 0.0]] * 5 + [[1.0, 1.0]] * 5)
    labels, inertia = kmeans_labels(x, num_clusters=2, seed=7)
    assert inertia == pytest.approx(0.0)
    assert nmi(labels, [0] * 5 + [1] * 5) == 1.0
    assert kmeans_labels(x, num_clusters=2, seed=7)[0].tolist() == labels.tolist()
    labels3, _ = kmeans_labels(x, num_clusters=3, seed=7)  # more clusters than distinct points
    assert len(labels3) == 10
    with pytest.raises(ValueError, match="num_clusters"):
        kmeans_labels(x, num_clusters=11)


# ---------------------------------------------------------------- information gain


def test_information_gain_by_position_hand_computed():
    cond = np.array([[0.1, 1.0, 2.0], [np.inf, 0.2, 0.5]])
    ref = np.array([[0.8, 1.5, 2.0], [np.nan, 0.9, 0.4]])
    mask = np.array([[True, True, False], [False, True, True]])
    out = information_gain_by_position(cond, ref, torch.tensor(mask))
    assert out["count_by_position"] == [1, 2, 1]
    assert out["mean_by_position"] == pytest.approx([0.7, (0.5 + 0.7) / 2, -0.1])
    assert out["mean"] == pytest.approx((0.7 + 0.5 + 0.7 - 0.1) / 4)
    # Each row's first real token: row 0 at t=0 (0.7), row 1 at t=1 (0.7).
    assert out["first_token_mean"] == pytest.approx(0.7)
    assert out["num_tokens"] == 4


def test_information_gain_empty_positions_and_errors():
    out = information_gain_by_position(np.zeros((2, 2)), np.ones((2, 2)), np.array([[1, 0], [0, 0]]))
    assert out["mean_by_position"] == [1.0, None]
    with pytest.raises(ValueError, match="mask_NT"):
        information_gain_by_position(np.zeros((2, 2)), np.zeros((2, 2)), np.ones((2, 3)))
    with pytest.raises(ValueError, match="non-finite"):
        information_gain_by_position(np.array([[np.inf]]), np.zeros((1, 1)), np.ones((1, 1)))


# ---------------------------------------------------------------- figure


def test_plot_latent_figure_writes_png_atomically(tmp_path):
    path = tmp_path / "figs" / "latents.png"
    written = plot_latent_figure(
        np.array([[10, 0], [1, 9], [0, 0]]), [0, 1, 2], ["ltr", "rtl"], [0.5, 0.5, 0.0], path, title="step 300"
    )
    assert written == str(path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert os.listdir(path.parent) == ["latents.png"]  # no temporary file left behind
    with pytest.raises(ValueError, match="strategy_labels"):
        plot_latent_figure(np.zeros((2, 2)), [0, 1], ["a"], [0.5, 0.5], path)
