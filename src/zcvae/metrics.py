"""Pure evaluation metrics: is the latent z used, and does it line up with the solution strategy?

Everything here is plain numpy over arrays that the caller has already gathered from every rank
(MI over a per-batch mean is a different, biased quantity; see notes/latent-models.md). Inputs may be
numpy arrays or torch tensors; outputs are python floats, numpy arrays and dicts. No
``torch.distributed``, no config parsing. All logarithms are natural: entropies, MI and KL are in nats.

The clustering metrics (NMI, ARI, homogeneity/completeness) and the linear assignment solver are
implemented here because the project does not depend on scikit-learn or scipy; they follow
scikit-learn's definitions and edge-case conventions so numbers are comparable with published ones.

Shape legend:
    N  examples (or decoded records)
    K  discrete latents
    S  distinct strategies (gold or parsed labels)
    D  Gaussian latent dimensions
    T  token positions of the y region
"""

from __future__ import annotations

import math
import os
import tempfile
from collections import Counter
from collections.abc import Hashable, Mapping, Sequence
from typing import Any

import numpy as np

__all__ = [
    "adjusted_rand_index",
    "controllability_metrics",
    "discrete_latent_metrics",
    "gaussian_latent_metrics",
    "homogeneity_completeness",
    "information_gain_by_position",
    "kmeans",
    "linear_assignment",
    "nmi",
    "plot_latent_figure",
]

# Rows of a posterior are probabilities; allow for fp16/bf16 softmax round-off before rejecting them.
_ROW_SUM_ATOL = 1e-3


# ----------------------------------------------------------------------------------------------
# Helpers
# ----------------------------------------------------------------------------------------------


def _to_numpy(x: Any, *, name: str, dtype=np.float64) -> np.ndarray:
    """Convert a numpy array, torch tensor or nested sequence into a numpy array of ``dtype``."""
    if hasattr(x, "detach") and hasattr(x, "cpu"):  # torch.Tensor without importing torch
        x = x.detach().cpu()
        if dtype is not None and str(x.dtype) in ("torch.bfloat16", "torch.float16"):
            x = x.float()  # numpy has no bfloat16
        x = x.numpy()
    try:
        arr = np.asarray(x, dtype=dtype)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{name}: cannot convert to a numeric array ({exc})") from exc
    return arr


def _entropy_rows(p_NK: np.ndarray) -> np.ndarray:
    """Row-wise entropy -sum_k p log p in nats, with 0 log 0 = 0."""
    with np.errstate(divide="ignore", invalid="ignore"):
        plogp_NK = np.where(p_NK > 0, p_NK * np.log(p_NK), 0.0)
    return -plogp_NK.sum(axis=-1)


def _encode(labels: Sequence[Hashable], *, name: str) -> tuple[np.ndarray, list]:
    """Map arbitrary hashable labels to 0..C-1 in order of first appearance."""
    index: dict = {}
    codes = np.empty(len(labels), dtype=np.int64)
    for i, label in enumerate(labels):
        if isinstance(label, np.ndarray):
            label = label.item()
        try:
            codes[i] = index.setdefault(label, len(index))
        except TypeError as exc:
            raise ValueError(f"{name}[{i}]: label {label!r} is not hashable") from exc
    return codes, list(index)


def _as_label_list(x: Any, *, name: str) -> list:
    if hasattr(x, "detach") and hasattr(x, "cpu"):
        x = x.detach().cpu().numpy()
    if isinstance(x, np.ndarray):
        if x.ndim != 1:
            raise ValueError(f"{name}: expected a 1-D sequence of labels, got shape {x.shape}")
        return x.tolist()
    return list(x)


def _contingency(labels_a: Sequence, labels_b: Sequence, *, names=("labels_a", "labels_b")) -> np.ndarray:
    """Counts n_ij of items with label i in ``labels_a`` and label j in ``labels_b``, shape (A, B)."""
    a = _as_label_list(labels_a, name=names[0])
    b = _as_label_list(labels_b, name=names[1])
    if len(a) != len(b):
        raise ValueError(f"{names[0]} and {names[1]} must have the same length, got {len(a)} and {len(b)}")
    codes_a, classes_a = _encode(a, name=names[0])
    codes_b, classes_b = _encode(b, name=names[1])
    counts_AB = np.zeros((len(classes_a), len(classes_b)), dtype=np.int64)
    np.add.at(counts_AB, (codes_a, codes_b), 1)
    return counts_AB


def _entropy_counts(counts: np.ndarray) -> float:
    n = counts.sum()
    if n == 0:
        return 0.0
    p = counts[counts > 0] / n
    return float(-(p * np.log(p)).sum())


def _mutual_info_counts(counts_AB: np.ndarray) -> float:
    """I(A;B) = sum_ij n_ij/n log(n n_ij / (n_i. n_.j)) in nats, from a contingency table."""
    n = counts_AB.sum()
    if n == 0:
        return 0.0
    rows_A = counts_AB.sum(axis=1)
    cols_B = counts_AB.sum(axis=0)
    ii, jj = np.nonzero(counts_AB)
    nij = counts_AB[ii, jj].astype(np.float64)
    # One log of the ratio (not a sum of four logs) so independent-by-construction tables give 0 exactly.
    ratio = nij * float(n) / (rows_A[ii].astype(np.float64) * cols_B[jj].astype(np.float64))
    mi = float((nij / n * np.log(ratio)).sum())
    # I >= 0 exactly; round-off can give -1e-17, which would read as "worse than independent".
    return max(mi, 0.0)


# ----------------------------------------------------------------------------------------------
# Clustering metrics and linear assignment
# ----------------------------------------------------------------------------------------------


def nmi(labels_a: Sequence, labels_b: Sequence) -> float:
    """Normalised mutual information with arithmetic-mean normalisation (scikit-learn's default).

    NMI = I(A;B) / ((H(A) + H(B)) / 2), entropies in nats from the empirical label counts. Labels are
    any hashable values (strings, ints). Conventions as in scikit-learn: 1.0 when both labelings
    have a single class (or are empty); 0.0 when I = 0 otherwise.
    """
    counts_AB = _contingency(labels_a, labels_b)
    num_a, num_b = counts_AB.shape
    if num_a == num_b == 1 or num_a == num_b == 0:
        return 1.0
    if np.all((counts_AB > 0).sum(axis=0) == 1) and np.all((counts_AB > 0).sum(axis=1) == 1):
        return 1.0  # the same partition up to renaming; avoids 0.9999999999999997 from round-off
    mi = _mutual_info_counts(counts_AB)
    if mi == 0.0:
        return 0.0
    h_a = _entropy_counts(counts_AB.sum(axis=1))
    h_b = _entropy_counts(counts_AB.sum(axis=0))
    normaliser = max((h_a + h_b) / 2.0, np.finfo(np.float64).eps)
    return float(min(mi / normaliser, 1.0))


def adjusted_rand_index(labels_a: Sequence, labels_b: Sequence) -> float:
    """Adjusted Rand index (Hubert & Arabie), symmetric, 1 for identical partitions, ~0 by chance.

    From the pair confusion counts over all N(N-1) ordered pairs -- tp (same cluster in both),
    fp/fn (same in one only), tn (different in both):
        ARI = 2 (tp tn - fn fp) / ((tp + fn)(fn + tn) + (tp + fp)(fp + tn)),
    which equals (sum_ij C(n_ij,2) - E) / (max - E) with E = sum_i C(a_i,2) sum_j C(b_j,2) / C(N,2).
    Returns 1.0 when fn = fp = 0 (identical partitions, including the trivial ones), as scikit-learn.
    """
    counts_AB = _contingency(labels_a, labels_b)
    n = int(counts_AB.sum())
    # Python ints: the pair counts grow like N^2 and their products like N^4.
    sum_sq = int((counts_AB.astype(object) ** 2).sum()) if counts_AB.size else 0
    rows_sq = int((counts_AB.sum(axis=1).astype(object) ** 2).sum()) if counts_AB.size else 0
    cols_sq = int((counts_AB.sum(axis=0).astype(object) ** 2).sum()) if counts_AB.size else 0
    tp = sum_sq - n
    fp = cols_sq - sum_sq
    fn = rows_sq - sum_sq
    tn = n * n - fp - fn - sum_sq
    if fn == 0 and fp == 0:
        return 1.0
    return float(2.0 * (tp * tn - fn * fp) / ((tp + fn) * (fn + tn) + (tp + fp) * (fp + tn)))


def homogeneity_completeness(labels_true: Sequence, labels_pred: Sequence) -> tuple[float, float]:
    """Homogeneity h = I(C;K)/H(C) and completeness c = I(C;K)/H(K) (Rosenberg & Hirschberg 2007).

    C are the true classes, K the predicted clusters. h = 1 when each cluster holds one class;
    c = 1 when each class sits in one cluster. By convention a zero entropy gives 1.0 (scikit-learn).
    """
    counts_CK = _contingency(labels_true, labels_pred, names=("labels_true", "labels_pred"))
    if counts_CK.sum() == 0:
        return 1.0, 1.0
    mi = _mutual_info_counts(counts_CK)
    h_c = _entropy_counts(counts_CK.sum(axis=1))
    h_k = _entropy_counts(counts_CK.sum(axis=0))
    homogeneity = min(mi / h_c, 1.0) if h_c > 0 else 1.0
    completeness = min(mi / h_k, 1.0) if h_k > 0 else 1.0
    return float(homogeneity), float(completeness)


def linear_assignment(cost: Any) -> tuple[np.ndarray, np.ndarray]:
    """Minimum-cost one-to-one assignment of rows to columns (exact; rectangular allowed).

    Solves min sum_i cost[rows[i], cols[i]] over matchings of size min(R, C) with the shortest
    augmenting path Hungarian method (O(min^2 max)). Returns ``(rows, cols)`` with ``rows`` ascending,
    like ``scipy.optimize.linear_sum_assignment``. To maximise a score, pass its negative.
    """
    cost_RC = _to_numpy(cost, name="cost")
    if cost_RC.ndim != 2:
        raise ValueError(f"cost: expected a 2-D matrix, got shape {cost_RC.shape}")
    if not np.all(np.isfinite(cost_RC)):
        raise ValueError("cost: entries must be finite")
    transposed = cost_RC.shape[0] > cost_RC.shape[1]
    a = cost_RC.T if transposed else cost_RC  # now n <= m
    n, m = a.shape
    if n == 0:
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty.copy()

    # 1-based potentials u (rows), v (columns); p[j] = row matched to column j (0 = free),
    # column 0 is the virtual start of each augmenting path.
    u = np.zeros(n + 1)
    v = np.zeros(m + 1)
    p = np.zeros(m + 1, dtype=np.int64)
    way = np.zeros(m + 1, dtype=np.int64)
    for i in range(1, n + 1):
        p[0] = i
        j0 = 0
        minv = np.full(m + 1, np.inf)
        used = np.zeros(m + 1, dtype=bool)
        while True:
            used[j0] = True
            i0 = p[j0]
            free = ~used[1:]
            cur = a[i0 - 1] - u[i0] - v[1:]
            improve = free & (cur < minv[1:])
            minv[1:][improve] = cur[improve]
            way[1:][improve] = j0
            candidates = np.where(free, minv[1:], np.inf)
            j1 = int(np.argmin(candidates)) + 1
            delta = candidates[j1 - 1]
            u[p[used]] += delta
            v[used] -= delta
            minv[~used] -= delta
            j0 = j1
            if p[j0] == 0:
                break
        while j0:  # flip the augmenting path
            j1 = way[j0]
            p[j0] = p[j1]
            j0 = j1

    matched_cols = np.nonzero(p[1:])[0]
    row_of_col = p[1:][matched_cols] - 1
    if transposed:
        rows, cols = matched_cols, row_of_col
    else:
        rows, cols = row_of_col, matched_cols
    order = np.argsort(rows, kind="stable")
    return rows[order].astype(np.int64), cols[order].astype(np.int64)


def _best_matching(counts_KS: np.ndarray) -> tuple[dict[int, int], int]:
    """Latent->strategy one-to-one matching that maximises the matched counts, and that total."""
    if counts_KS.size == 0:
        return {}, 0
    rows, cols = linear_assignment(-counts_KS.astype(np.float64))
    matching = {int(r): int(c) for r, c in zip(rows, cols)}
    return matching, int(counts_KS[rows, cols].sum())


# ----------------------------------------------------------------------------------------------
# Discrete latents
# ----------------------------------------------------------------------------------------------


def discrete_latent_metrics(
    posterior_NK: Any,
    prior_NK: Any = None,
    labels: Sequence[str | None] | None = None,
    eps_used: float = 1e-2,
) -> dict[str, Any]:
    """Usage and label alignment of a K-way latent from posteriors gathered over the whole eval set.

    With qbar = mean_i q(z|x_i,y_i) (mean over all N rows, never per batch):
      mi                   I(x,y; z) = H(qbar) - mean_i H(q_i)          (nats, exact for discrete z)
      router_support       exp(H(qbar)), the codebook perplexity, in [1, K]
      num_used_latents     #{k : qbar_k > eps_used}
      marginal_kl_uniform  KL(qbar || U_K) = log K - H(qbar)            (nats)
      posterior_entropy    mean_i H(q_i)                                (nats)
      latent_usage         qbar, shape (K,)
    With ``prior_NK`` (rows p(z|x_i)):
      prior_agreement      fraction of i with argmax_k p_i == argmax_k q_i
      kl_posterior_prior   mean_i KL(q_i || p_i) = mean_i sum_k q_ik (log q_ik - log p_ik)   (nats)
    With ``labels`` (gold strategy per row; None rows are left out of these metrics), on
    argmax_k q_i against the label:
      nmi, ari, homogeneity, completeness  (see ``nmi``, ``adjusted_rand_index``,
                           ``homogeneity_completeness``; homogeneity has the gold label as class)
      confusion            (K, S) int counts, rows latent 0..K-1, columns ``confusion_strategy_labels``
                           (sorted), plus ``confusion_latent_labels``
      matching             {latent: strategy} maximising matched counts (Hungarian, one-to-one)
      matching_accuracy    fraction of labelled rows whose argmax latent is matched to their label
                           (the argmax accuracy under the best matching)
      matching_soft_accuracy  mean posterior mass on the latent matched to the row's label
      num_labelled         number of rows with a label
    """
    q_NK = _to_numpy(posterior_NK, name="posterior_NK")
    if q_NK.ndim != 2 or q_NK.shape[0] == 0 or q_NK.shape[1] == 0:
        raise ValueError(f"posterior_NK: expected a non-empty (N, K) matrix, got shape {q_NK.shape}")
    if not np.all(np.isfinite(q_NK)) or np.any(q_NK < 0):
        raise ValueError("posterior_NK: entries must be finite and non-negative probabilities")
    if not np.allclose(q_NK.sum(axis=1), 1.0, atol=_ROW_SUM_ATOL):
        raise ValueError("posterior_NK: each row must sum to 1 (pass probabilities, not logits)")
    if not eps_used >= 0:
        raise ValueError(f"eps_used: must be >= 0, got {eps_used}")
    num_examples, num_latents = q_NK.shape

    qbar_K = q_NK.mean(axis=0)
    h_marginal = float(_entropy_rows(qbar_K))
    h_rows_N = _entropy_rows(q_NK)
    h_mean = float(h_rows_N.mean())
    out: dict[str, Any] = {
        "num_examples": num_examples,
        "num_latents": num_latents,
        # Exact I >= 0 by concavity of H; clip round-off so dashboards never show "negative MI".
        "mi": max(h_marginal - h_mean, 0.0),
        "router_support": math.exp(h_marginal),
        "num_used_latents": int((qbar_K > eps_used).sum()),
        "marginal_kl_uniform": max(math.log(num_latents) - h_marginal, 0.0),
        "posterior_entropy": h_mean,
        "latent_usage": qbar_K,
    }
    argmax_q_N = q_NK.argmax(axis=1)

    if prior_NK is not None:
        p_NK = _to_numpy(prior_NK, name="prior_NK")
        if p_NK.shape != q_NK.shape:
            raise ValueError(f"prior_NK: shape {p_NK.shape} does not match posterior_NK {q_NK.shape}")
        if not np.all(np.isfinite(p_NK)) or np.any(p_NK < 0):
            raise ValueError("prior_NK: entries must be finite and non-negative probabilities")
        if not np.allclose(p_NK.sum(axis=1), 1.0, atol=_ROW_SUM_ATOL):
            raise ValueError("prior_NK: each row must sum to 1 (pass probabilities, not logits)")
        tiny = np.finfo(np.float64).tiny
        with np.errstate(divide="ignore", invalid="ignore"):
            kl_terms_NK = np.where(q_NK > 0, q_NK * (np.log(q_NK) - np.log(np.maximum(p_NK, tiny))), 0.0)
        out["prior_agreement"] = float((p_NK.argmax(axis=1) == argmax_q_N).mean())
        out["kl_posterior_prior"] = float(kl_terms_NK.sum(axis=1).mean())

    if labels is not None:
        labels = _as_label_list(labels, name="labels")
        if len(labels) != num_examples:
            raise ValueError(f"labels: length {len(labels)} does not match posterior_NK rows {num_examples}")
        keep_N = np.array([label is not None for label in labels], dtype=bool)
        gold = [label for label in labels if label is not None]
        out["num_labelled"] = len(gold)
        if gold:
            pred = argmax_q_N[keep_N].tolist()
            strategies = sorted(set(gold), key=str)
            column = {s: j for j, s in enumerate(strategies)}
            gold_idx_N = np.array([column[s] for s in gold], dtype=np.int64)
            confusion_KS = np.zeros((num_latents, len(strategies)), dtype=np.int64)
            np.add.at(confusion_KS, (np.asarray(pred, dtype=np.int64), gold_idx_N), 1)
            matching, matched = _best_matching(confusion_KS)
            # Soft accuracy: posterior mass on the latent assigned to the row's label (0 if unassigned).
            latent_of_strategy = {c: r for r, c in matching.items()}
            q_kept_NK = q_NK[keep_N]
            soft = [
                q_kept_NK[i, latent_of_strategy[s]] if s in latent_of_strategy else 0.0
                for i, s in enumerate(gold_idx_N.tolist())
            ]
            homogeneity, completeness = homogeneity_completeness(gold, pred)
            out.update(
                nmi=nmi(gold, pred),
                ari=adjusted_rand_index(gold, pred),
                homogeneity=homogeneity,
                completeness=completeness,
                confusion=confusion_KS,
                confusion_latent_labels=list(range(num_latents)),
                confusion_strategy_labels=strategies,
                matching={k: strategies[s] for k, s in matching.items()},
                matching_accuracy=matched / len(gold),
                matching_soft_accuracy=float(np.mean(soft)),
            )
    return out


# ----------------------------------------------------------------------------------------------
# Controllability of decoding with a forced latent
# ----------------------------------------------------------------------------------------------


def _field(record: Any, key: str, default: Any = None) -> Any:
    if isinstance(record, Mapping):
        return record.get(key, default)
    return getattr(record, key, default)


def controllability_metrics(decoded: Sequence[Any]) -> dict[str, Any]:
    """How reliably forcing latent k yields one strategy, from greedy decodes with each z_k.

    Each record (a mapping or an object with these attributes) has ``latent`` (int),
    ``gold_strategy``, ``parsed_strategy``, ``parse_ok`` (bool), ``answer_correct`` (bool) and
    optionally ``exact_match`` (bool/float). A decode whose parse failed never counts as following
    a strategy.
      purity_per_latent[k]  n_k(majority parsed strategy of k) / n_k, n_k = decodes with latent k
      majority_strategy[k]  that strategy (None if nothing parsed)
      mean_purity           unweighted mean of purity over the latents present
      matching              {latent: parsed strategy}, one-to-one, maximising matched decodes
      matching_accuracy     fraction of all decodes whose parsed strategy is the one matched to their
                            latent. Under collapse every latent decodes the same strategy, so purity
                            stays high while this drops towards 1/K.
      parse_rate            fraction of decodes with parse_ok
      answer_accuracy       fraction with answer_correct (unparsed/None count as wrong)
      exact_match           mean of ``exact_match`` over records that carry it (absent if none do)
      gold_agreement        fraction whose parsed strategy equals the record's gold strategy
                            (over records with a gold strategy; absent if none have one)
      num_decodes
    """
    records = list(decoded)
    if not records:
        raise ValueError("decoded: need at least one decoded record")
    per_latent: dict[int, list[Any]] = {}
    for i, rec in enumerate(records):
        latent = _field(rec, "latent")
        if latent is None or isinstance(latent, bool):
            raise ValueError(f"decoded[{i}]: missing integer field 'latent'")
        try:
            latent = int(latent)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"decoded[{i}].latent: expected an int, got {latent!r}") from exc
        parsed = _field(rec, "parsed_strategy") if bool(_field(rec, "parse_ok", False)) else None
        per_latent.setdefault(latent, []).append(parsed)

    latents = sorted(per_latent)
    purity: dict[int, float] = {}
    majority: dict[int, Any] = {}
    for k in latents:
        parsed_k = [s for s in per_latent[k] if s is not None]
        if parsed_k:
            # most_common breaks ties by first appearance; sort first so ties are deterministic.
            top, count = Counter(sorted(parsed_k, key=str)).most_common(1)[0]
        else:
            top, count = None, 0
        majority[k] = top
        purity[k] = count / len(per_latent[k])

    strategies = sorted({s for k in latents for s in per_latent[k] if s is not None}, key=str)
    column = {s: j for j, s in enumerate(strategies)}
    counts_KS = np.zeros((len(latents), len(strategies)), dtype=np.int64)
    for row, k in enumerate(latents):
        for s in per_latent[k]:
            if s is not None:
                counts_KS[row, column[s]] += 1
    matching, matched = _best_matching(counts_KS)

    num = len(records)
    out: dict[str, Any] = {
        "num_decodes": num,
        "purity_per_latent": purity,
        "majority_strategy": majority,
        "mean_purity": float(np.mean(list(purity.values()))),
        "matching": {latents[r]: strategies[c] for r, c in matching.items()},
        "matching_accuracy": matched / num,
        "parse_rate": sum(bool(_field(r, "parse_ok", False)) for r in records) / num,
        "answer_accuracy": sum(bool(_field(r, "answer_correct", False)) for r in records) / num,
    }
    exact = [float(_field(r, "exact_match")) for r in records if _field(r, "exact_match") is not None]
    if exact:
        out["exact_match"] = float(np.mean(exact))
    with_gold = [r for r in records if _field(r, "gold_strategy") is not None]
    if with_gold:
        out["gold_agreement"] = sum(
            bool(_field(r, "parse_ok", False)) and _field(r, "parsed_strategy") == _field(r, "gold_strategy")
            for r in with_gold
        ) / len(with_gold)
    return out


# ----------------------------------------------------------------------------------------------
# Gaussian latents
# ----------------------------------------------------------------------------------------------


def kmeans(
    x_ND: Any, *, num_clusters: int, seed: int = 0, max_iter: int = 100, num_init: int = 4
) -> tuple[np.ndarray, np.ndarray, float]:
    """Lloyd's k-means with k-means++ seeding; deterministic for a given ``seed``.

    Runs ``num_init`` seedings from one ``numpy.random.default_rng(seed)`` and keeps the lowest
    inertia (sum of squared distances to the assigned centre). Returns ``(labels_N, centers_KD,
    inertia)``. An empty cluster keeps its previous centre.
    """
    x = _to_numpy(x_ND, name="x_ND")
    if x.ndim != 2 or x.shape[0] == 0:
        raise ValueError(f"x_ND: expected a non-empty (N, D) matrix, got shape {x.shape}")
    if not 1 <= num_clusters <= x.shape[0]:
        raise ValueError(f"num_clusters: must be in [1, N={x.shape[0]}], got {num_clusters}")
    if num_init < 1:
        raise ValueError(f"num_init: must be >= 1, got {num_init}")
    rng = np.random.default_rng(seed)
    n = x.shape[0]
    best: tuple[np.ndarray, np.ndarray, float] | None = None
    for _ in range(num_init):
        centers = np.empty((num_clusters, x.shape[1]))
        centers[0] = x[rng.integers(n)]
        d2_N = ((x - centers[0]) ** 2).sum(axis=1)
        for c in range(1, num_clusters):
            total = d2_N.sum()
            # All points already coincide with a centre: any pick is as good as another.
            idx = rng.integers(n) if total <= 0 else rng.choice(n, p=d2_N / total)
            centers[c] = x[idx]
            d2_N = np.minimum(d2_N, ((x - centers[c]) ** 2).sum(axis=1))
        labels = np.zeros(n, dtype=np.int64)
        for it in range(max_iter):
            d2_NC = ((x[:, None, :] - centers[None, :, :]) ** 2).sum(axis=2)
            new_labels = d2_NC.argmin(axis=1)
            if it > 0 and np.array_equal(new_labels, labels):
                break
            labels = new_labels
            for c in range(num_clusters):
                members = labels == c
                if members.any():
                    centers[c] = x[members].mean(axis=0)
        inertia = float(((x - centers[labels]) ** 2).sum())
        if best is None or inertia < best[2]:
            best = (labels.copy(), centers.copy(), inertia)
    assert best is not None
    return best


def gaussian_latent_metrics(
    mu_ND: Any,
    logvar_ND: Any = None,
    labels: Sequence[str | None] | None = None,
    delta: float = 0.01,
    num_clusters: int | None = None,
    seed: int = 0,
) -> dict[str, Any]:
    """Usage and label alignment of a diagonal-Gaussian latent from posterior means (and log-variances).

      active_units         #{d : Var_i(mu_id) > delta}, the variance across examples of E_q[z_d]
                           (unbiased, ddof=1, as Optimus). delta=0.01 follows Optimus, DELLA uses 0.2;
                           the threshold is returned as ``active_units_delta``.
      mean_variance_per_dim  (D,) those variances
      kl_to_standard_normal  mean_i KL(N(mu_i, diag exp(logvar_i)) || N(0, I))
                           = mean_i 0.5 sum_d (mu^2 + exp(logvar) - 1 - logvar)   (nats per example)
      nmi, ari, homogeneity, completeness  of k-means clusters of mu against ``labels`` (None rows
                           left out); k = ``num_clusters`` or the number of distinct labels,
                           k-means++ with ``seed``; ``num_clusters`` is reported back.
    """
    mu = _to_numpy(mu_ND, name="mu_ND")
    if mu.ndim != 2 or mu.shape[0] < 2 or mu.shape[1] == 0:
        raise ValueError(f"mu_ND: expected an (N, D) matrix with N >= 2, got shape {mu.shape}")
    if not np.all(np.isfinite(mu)):
        raise ValueError("mu_ND: entries must be finite")
    if not delta >= 0:
        raise ValueError(f"delta: must be >= 0, got {delta}")
    var_D = mu.var(axis=0, ddof=1)
    out: dict[str, Any] = {
        "num_examples": mu.shape[0],
        "num_dims": mu.shape[1],
        "active_units": int((var_D > delta).sum()),
        "active_units_delta": float(delta),
        "mean_variance_per_dim": var_D,
    }
    if logvar_ND is not None:
        logvar = _to_numpy(logvar_ND, name="logvar_ND")
        if logvar.shape != mu.shape:
            raise ValueError(f"logvar_ND: shape {logvar.shape} does not match mu_ND {mu.shape}")
        if not np.all(np.isfinite(logvar)):
            raise ValueError("logvar_ND: entries must be finite")
        kl_N = 0.5 * (mu**2 + np.exp(logvar) - 1.0 - logvar).sum(axis=1)
        out["kl_to_standard_normal"] = float(kl_N.mean())
    if labels is not None:
        labels = _as_label_list(labels, name="labels")
        if len(labels) != mu.shape[0]:
            raise ValueError(f"labels: length {len(labels)} does not match mu_ND rows {mu.shape[0]}")
        keep_N = np.array([label is not None for label in labels], dtype=bool)
        gold = [label for label in labels if label is not None]
        out["num_labelled"] = len(gold)
        if gold:
            k = len(set(gold)) if num_clusters is None else int(num_clusters)
            if not 1 <= k <= len(gold):
                raise ValueError(f"num_clusters: must be in [1, {len(gold)}] (labelled rows), got {k}")
            pred, _, _ = kmeans(mu[keep_N], num_clusters=k, seed=seed)
            pred_list = pred.tolist()
            homogeneity, completeness = homogeneity_completeness(gold, pred_list)
            out.update(
                num_clusters=k,
                nmi=nmi(gold, pred_list),
                ari=adjusted_rand_index(gold, pred_list),
                homogeneity=homogeneity,
                completeness=completeness,
            )
    return out


# ----------------------------------------------------------------------------------------------
# Per-token information gain from the paired z-free reference pass
# ----------------------------------------------------------------------------------------------


def information_gain_by_position(cond_nll_NT: Any, ref_nll_NT: Any, mask_NT: Any) -> dict[str, Any]:
    """Where z helps: per-token gain g_t = log p(y_t|x,z) - log p(y_t|x) = ref_nll_t - cond_nll_t (nats).

    ``cond_nll_NT`` is the z-conditioned token NLL, ``ref_nll_NT`` the z-free reference NLL of the same
    y tokens, aligned by y position t (0 = first y token), ``mask_NT`` true on real tokens.
      mean_by_position[t]   mean of g over rows with mask[:, t] (None where no row has a token)
      count_by_position[t]  number of such rows
      mean                  token-weighted mean of g over all masked tokens (None if no token)
      first_token_mean      mean over rows of g at each row's first masked position (None if none);
                            for a task whose first y token reveals the strategy this is where the
                            gain should concentrate
      num_tokens
    Values at masked-out positions are ignored, even if they are inf or NaN.
    """
    cond = _to_numpy(cond_nll_NT, name="cond_nll_NT")
    ref = _to_numpy(ref_nll_NT, name="ref_nll_NT")
    mask = _to_numpy(mask_NT, name="mask_NT", dtype=None).astype(bool)
    if cond.ndim != 2:
        raise ValueError(f"cond_nll_NT: expected an (N, T) matrix, got shape {cond.shape}")
    if ref.shape != cond.shape:
        raise ValueError(f"ref_nll_NT: shape {ref.shape} does not match cond_nll_NT {cond.shape}")
    if mask.shape != cond.shape:
        raise ValueError(f"mask_NT: shape {mask.shape} does not match cond_nll_NT {cond.shape}")
    with np.errstate(invalid="ignore"):
        gain_NT = np.where(mask, ref - cond, 0.0)
    if not np.all(np.isfinite(gain_NT)):
        raise ValueError("cond_nll_NT/ref_nll_NT: non-finite NLL at a masked-in token")
    count_T = mask.sum(axis=0)
    sum_T = gain_NT.sum(axis=0)
    means = [float(s / c) if c > 0 else None for s, c in zip(sum_T, count_T)]
    num_tokens = int(count_T.sum())
    has_token_N = mask.any(axis=1)
    first_T_N = mask.argmax(axis=1)  # index of the first True per row
    first_gain = gain_NT[np.arange(mask.shape[0]), first_T_N][has_token_N]
    return {
        "mean_by_position": means,
        "count_by_position": [int(c) for c in count_T],
        "mean": float(sum_T.sum() / num_tokens) if num_tokens else None,
        "first_token_mean": float(first_gain.mean()) if first_gain.size else None,
        "num_tokens": num_tokens,
    }


# ----------------------------------------------------------------------------------------------
# Figure
# ----------------------------------------------------------------------------------------------


def plot_latent_figure(
    confusion: Any,
    latent_labels: Sequence[Any],
    strategy_labels: Sequence[Any],
    latent_usage: Any,
    path: str | os.PathLike,
    title: str | None = None,
) -> str:
    """Write a PNG: left, the (K, S) latent x strategy count matrix with counts; right, mean q per latent.

    Written to a temporary file in the target directory and moved into place with ``os.replace``, so a
    reader (TensorBoard, a browser refreshing the run directory) never sees a half-written image.
    Returns the path written.
    """
    confusion_KS = _to_numpy(confusion, name="confusion")
    usage_K = _to_numpy(latent_usage, name="latent_usage").reshape(-1)
    if confusion_KS.ndim != 2:
        raise ValueError(f"confusion: expected a (K, S) matrix, got shape {confusion_KS.shape}")
    num_latents, num_strategies = confusion_KS.shape
    if len(latent_labels) != num_latents:
        raise ValueError(f"latent_labels: {len(latent_labels)} labels for {num_latents} confusion rows")
    if len(strategy_labels) != num_strategies:
        raise ValueError(f"strategy_labels: {len(strategy_labels)} labels for {num_strategies} confusion columns")
    if usage_K.shape[0] != num_latents:
        raise ValueError(f"latent_usage: {usage_K.shape[0]} values for {num_latents} latents")

    import matplotlib

    matplotlib.use("Agg")  # headless training nodes have no display
    import matplotlib.pyplot as plt

    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    width = 4.0 + 0.6 * num_strategies + 0.4 * num_latents
    height = 2.0 + 0.45 * max(num_latents, 2)
    fig, (ax_conf, ax_use) = plt.subplots(1, 2, figsize=(width, height))
    try:
        image = ax_conf.imshow(confusion_KS, cmap="Blues", aspect="auto")
        ax_conf.set_xticks(range(num_strategies), [str(s) for s in strategy_labels], rotation=45, ha="right")
        ax_conf.set_yticks(range(num_latents), [str(k) for k in latent_labels])
        ax_conf.set_xlabel("strategy")
        ax_conf.set_ylabel("latent (argmax q)")
        ax_conf.set_title("latent x strategy counts")
        peak = confusion_KS.max() if confusion_KS.size else 0
        for k in range(num_latents):
            for s in range(num_strategies):
                value = confusion_KS[k, s]
                text = f"{int(value)}" if float(value).is_integer() else f"{value:.2g}"
                ax_conf.text(
                    s, k, text, ha="center", va="center", fontsize=8,
                    color="white" if peak > 0 and value > 0.6 * peak else "black",
                )
        fig.colorbar(image, ax=ax_conf, fraction=0.046, pad=0.04)
        ax_use.bar(range(num_latents), usage_K, color="tab:orange")
        ax_use.set_xticks(range(num_latents), [str(k) for k in latent_labels])
        ax_use.set_xlabel("latent")
        ax_use.set_ylabel("mean q(z|x,y)")
        ax_use.set_ylim(0, max(1.0 / max(num_latents, 1), float(usage_K.max()) if usage_K.size else 0) * 1.15)
        ax_use.set_title("latent usage")
        if title:
            fig.suptitle(title)
        fig.tight_layout()
        fd, tmp_path = tempfile.mkstemp(dir=directory, prefix=".tmp-", suffix=".png")
        try:
            with os.fdopen(fd, "wb") as handle:
                fig.savefig(handle, format="png", dpi=100)
            os.replace(tmp_path, path)
        except BaseException:
            if os.path.exists(tmp_path):
                os.remove(tmp_path)
            raise
    finally:
        plt.close(fig)
    return path
