"""Fixed inputs on which the hand-written clustering metrics were recorded (commit 433885b) before
they were replaced by scikit-learn/SciPy; ``test_metrics_recorded.py`` holds the recorded outputs."""

import numpy as np

_rng = np.random.default_rng(20261201)

# (labels_a, labels_b): ties, single clusters, rectangular contingency, strings vs ints, chance level.
CLUSTER_CASES = [
    ([0, 0, 1, 1], [1, 1, 0, 0]),  # same partition, renamed
    ([0, 0, 1, 1], [0, 1, 0, 1]),  # independent, tied counts
    ([0, 0, 0], [5, 5, 5]),  # a single cluster on both sides
    ([0, 0, 1, 1], [0, 0, 0, 0]),  # a single cluster on one side
    ([0, 0, 0, 0], [0, 1, 2, 3]),  # single vs all-singletons
    ([7], [3]),  # one item
    ([0, 0, 1, 1], [0, 0, 1, 2]),  # refinement
    ([0, 0, 1, 1, 2, 2, 2], [0, 1, 1, 1, 0, 0, 0]),  # rectangular 3 x 2
    (["ltr", "rtl", "rtl", "mid", "mid", "mid"], [1, 1, 2, 2, 2, 0]),  # strings vs ints
    ([0, 0, 0, 1, 1, 1], [0, 0, 1, 1, 2, 2]),
    (_rng.integers(0, 3, size=200).tolist(), _rng.integers(0, 4, size=200).tolist()),  # chance, 3 x 4
    (_rng.integers(0, 2, size=50).tolist(), _rng.integers(0, 5, size=50).tolist()),
]

# Cost matrices: square, rectangular both ways, ties everywhere, empty rows.
ASSIGN_CASES = [
    [[4, 1, 3], [2, 0, 5], [3, 2, 2]],  # scipy's documented example
    [[1, 1], [1, 1]],  # all tied
    [[0, 0, 0], [0, 0, 0]],  # all tied, rectangular
    [[-3, -1], [-2, -2], [0, -5]],  # 3 x 2
    [[5]],
    [[-2, -2, 0, -1], [-1, -3, -3, 0]],  # 2 x 4 with ties
    _rng.integers(-5, 10, size=(5, 7)).tolist(),
    _rng.integers(-5, 10, size=(6, 3)).tolist(),
    np.zeros((0, 3)),  # no rows
]

_blobs = np.concatenate([c + _rng.normal(0, 0.3, size=(20, 3)) for c in ([4.0, 0, 0], [-4.0, 0, 0], [0, 5.0, 0])])
# (x_ND, k, seed)
KMEANS_CASES = [
    (_blobs.tolist(), 3, 0),
    (_blobs.tolist(), 3, 11),
    ([[0.0, 0.0]] * 5 + [[1.0, 1.0]] * 5, 2, 7),  # duplicates
    ([[0.0, 0.0]] * 5 + [[1.0, 1.0]] * 5, 1, 0),  # a single cluster
    ([[0.0], [0.1], [10.0], [10.2], [20.0], [20.1]], 3, 0),
]


def _rows(logits):
    e = np.exp(np.asarray(logits, dtype=np.float64))
    return (e / e.sum(axis=1, keepdims=True)).tolist()


# (posterior rows, prior rows, gold labels or None rows)
DISCRETE_CASES = [
    (_rows([[3, 0, 0], [3, 0, 0], [0, 3, 0], [0, 0, 3], [0, 3, 0], [0, 0, 3]]), _rows(np.zeros((6, 3))),
     ["a", "a", "b", "c", "b", None]),
    # a tie in the latent x strategy table: two latents each hold one of each strategy
    (_rows([[2, 0], [2, 0], [0, 2], [0, 2]]), _rows([[1, 0], [0, 1], [1, 0], [0, 1]]), ["s", "t", "s", "t"]),
    # an empty latent (column 1 never the argmax) and a single strategy
    (_rows([[2, 0, 1], [2, 0, 1], [1, 0, 2]]), _rows(np.zeros((3, 3))), ["only", "only", "only"]),
    (_rows(_rng.normal(size=(40, 4)) * 2), _rows(_rng.normal(size=(40, 4))), [("p", "q", "r")[i % 3] for i in range(40)]),
]

# (mu_ND, labels, seed)
GAUSSIAN_CASES = [
    (_blobs.tolist(), [("ltr", "rtl", "mid")[i // 20] for i in range(60)], 0),
    (_blobs.tolist(), [("ltr", "rtl", "mid")[i // 20] if i % 7 else None for i in range(60)], 3),
]

CONTROL_CASES = [
    [  # two latents decode the same strategy: a tie for the one-to-one matching
        {"latent": 0, "parsed_strategy": "a", "parse_ok": True},
        {"latent": 1, "parsed_strategy": "a", "parse_ok": True},
        {"latent": 0, "parsed_strategy": "b", "parse_ok": True},
        {"latent": 1, "parsed_strategy": "b", "parse_ok": True},
    ],
    [
        {"latent": 0, "parsed_strategy": "a", "parse_ok": True},
        {"latent": 0, "parsed_strategy": "a", "parse_ok": True},
        {"latent": 1, "parsed_strategy": "c", "parse_ok": True},
        {"latent": 2, "parsed_strategy": "b", "parse_ok": True},
        {"latent": 2, "parsed_strategy": None, "parse_ok": False},
    ],
]
