"""Pure evaluation metrics: is the latent z used, and does it line up with the solution strategy?

Everything here is plain numpy over arrays that the caller has already gathered from every rank
(MI over a per-batch mean is a different, biased quantity: the marginal of q over a small batch is noisy). Inputs may be
numpy arrays or torch tensors; outputs are python floats, numpy arrays and dicts. No
``torch.distributed``, no config parsing. All logarithms are natural: entropies, MI and KL are in nats.

The clustering scores (NMI with arithmetic-mean normalisation, ARI, homogeneity/completeness) and
k-means come from scikit-learn, the one-to-one matching from ``scipy.optimize.linear_sum_assignment``;
``tests/unit/eval/test_metrics_recorded.py`` shows they give the values of the hand-written versions they
replaced.

Shape legend:
    N  examples (or decoded records)
    K  discrete latents
    S  distinct strategies (gold or parsed labels)
    D  Gaussian latent dimensions
    T  token positions of the y region
"""

from __future__ import annotations

import math
import warnings
from collections import Counter
from collections.abc import Hashable, Mapping, Sequence
from typing import Any

import numpy as np

# scikit-learn and SciPy are imported inside the functions that use them: importing sklearn.cluster
# takes seconds, which every process that merely imports the evaluation would pay at start-up.

__all__ = [
    "ACTIVE_UNITS_DELTA",
    "cluster_scores",
    "length_terciles",
    "nmi_ratio",
    "reachable_nmi",
    "controllability_metrics",
    "discrete_latent_metrics",
    "distinct_outputs",
    "gaussian_latent_metrics",
    "information_gain_by_position",
    "kmeans_labels",
]

# Optimus' threshold for an active unit (DELLA uses 0.2); reported as eval/active_units_delta.
ACTIVE_UNITS_DELTA = 0.01
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


def cluster_scores(labels_true: Sequence, labels_pred: Sequence) -> dict[str, float]:
    """NMI, ARI, homogeneity and completeness of a clustering against gold labels (scikit-learn).

    Labels are any hashable values (strings, ints); each side is first mapped to integer codes, so a
    side that mixes types is compared by identity, not by its string form. ``nmi`` uses the
    arithmetic-mean normalisation I / ((H(C) + H(K)) / 2) (scikit-learn's default); homogeneity
    has ``labels_true`` as classes. Edge cases follow scikit-learn: two single-cluster labelings give
    NMI = ARI = 1; a zero entropy gives homogeneity (completeness) 1.
    """
    from sklearn.metrics import adjusted_rand_score, homogeneity_completeness_v_measure, normalized_mutual_info_score

    a = _as_label_list(labels_true, name="labels_true")
    b = _as_label_list(labels_pred, name="labels_pred")
    if len(a) != len(b):
        raise ValueError(f"labels_true and labels_pred must have the same length, got {len(a)} and {len(b)}")
    codes_a, _ = _encode(a, name="labels_true")
    codes_b, _ = _encode(b, name="labels_pred")
    homogeneity, completeness, _ = homogeneity_completeness_v_measure(codes_a, codes_b)
    return {
        "nmi": float(normalized_mutual_info_score(codes_a, codes_b)),
        "ari": float(adjusted_rand_score(codes_a, codes_b)),
        "homogeneity": float(homogeneity),
        "completeness": float(completeness),
    }


def reachable_nmi(
    inputs: Sequence[Hashable], labels: Sequence[Hashable], candidates: Sequence[Sequence[Hashable]] | None = None
) -> tuple[float, list]:
    """NMI of the best function of the input against the gold labels, and that function's labels.

    ``inputs[i]`` identifies what an encoder sees of row i (for zcvae the pair (x, y) as token ids);
    rows with the same input are indistinguishable, so the best any encoder can do is one label per
    distinct input: the majority label of the input's rows. ``candidates[i]``, when given, lists the
    labels that could have produced row i with equal probability (a built-in task family knows them:
    the strategies whose gold y for x is row i's y); each then counts once for the input instead of
    the gold label alone, so an ambiguous input is caught even when it occurs only once. Ties go to
    the smallest label by ``str`` (deterministic). Returns ``(NMI(labels, best), best)`` with NMI as
    in ``cluster_scores``: 1.0 when no input is ambiguous, lower when two strategies share an input.
    ValueError on a length mismatch or an empty set.
    """
    keys = _as_label_list(inputs, name="inputs")
    gold = _as_label_list(labels, name="labels")
    if len(keys) != len(gold):
        raise ValueError(f"inputs and labels must have the same length, got {len(keys)} and {len(gold)}")
    if candidates is not None and len(candidates) != len(gold):
        raise ValueError(f"candidates and labels must have the same length, got {len(candidates)} and {len(gold)}")
    if not gold:
        raise ValueError("labels: need at least one labelled row")
    by_input: dict[Hashable, Counter] = {}
    for i, (key, label) in enumerate(zip(keys, gold)):
        voters = [label] if candidates is None else list(candidates[i])
        if not voters:
            raise ValueError(f"candidates[{i}]: empty (the gold label {label!r} at least produced the row)")
        try:
            by_input.setdefault(key, Counter()).update(voters)
        except TypeError as exc:
            raise ValueError(f"inputs[{i}]: {key!r} is not hashable") from exc
    best = {}
    for key, counts in by_input.items():
        top = max(counts.values())
        best[key] = min((label for label, count in counts.items() if count == top), key=str)
    majority = [best[key] for key in keys]
    return cluster_scores(gold, majority)["nmi"], majority


def nmi_ratio(nmi: float, nmi_reachable: float) -> float:
    """``nmi / nmi_reachable``: the share of the reachable strategy information that z carries.

    0/0 (and x/0): when no function of (x, y) carries information about the strategy
    (``nmi_reachable == 0``) there is nothing to miss, so the ratio is defined as 1.0. It can exceed 1
    slightly: NMI is normalised by the entropy of the prediction, so a clustering finer than the
    majority function can score a little higher.
    """
    if not nmi_reachable > 0:
        return 1.0
    return float(nmi / nmi_reachable)


def length_terciles(lengths_N: Any) -> np.ndarray:
    """Tercile 0 (shortest), 1 or 2 of each row by its length, ties kept together. -> int array (N,).

    Cut points c1 <= c2 are the 1/3 and 2/3 quantiles taken as data values (numpy ``method="lower"``):
    tercile 0 holds n <= c1, tercile 1 c1 < n <= c2, tercile 2 n > c2. Equal lengths always share a
    tercile, so with many ties a tercile can hold more than a third of the rows, or none.
    """
    n = _to_numpy(lengths_N, name="lengths_N").reshape(-1)
    if n.size == 0:
        return np.zeros(0, dtype=np.int64)
    c1, c2 = np.quantile(n, [1.0 / 3.0, 2.0 / 3.0], method="lower")
    return np.where(n <= c1, 0, np.where(n <= c2, 1, 2)).astype(np.int64)


def _best_matching(counts_KS: np.ndarray) -> tuple[dict[int, int], int]:
    """Latent->strategy one-to-one matching that maximises the matched counts, and that total."""
    if counts_KS.size == 0:
        return {}, 0
    from scipy.optimize import linear_sum_assignment

    rows, cols = linear_sum_assignment(counts_KS, maximize=True)
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
      nmi, ari, homogeneity, completeness  (see ``cluster_scores``; homogeneity has the gold label
                           as class)
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
        out.update(_prior_agreement(q_NK, argmax_q_N, prior_NK))
    if labels is not None:
        out.update(_label_alignment(q_NK, argmax_q_N, labels))
    return out


def _prior_agreement(q_NK: np.ndarray, argmax_q_N: np.ndarray, prior_NK: Any) -> dict[str, float]:
    """``prior_agreement`` and ``kl_posterior_prior`` of :func:`discrete_latent_metrics`."""
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
    return {"prior_agreement": float((p_NK.argmax(axis=1) == argmax_q_N).mean()),
            "kl_posterior_prior": float(kl_terms_NK.sum(axis=1).mean())}


def _label_alignment(q_NK: np.ndarray, argmax_q_N: np.ndarray, labels: Sequence[str | None]) -> dict[str, Any]:
    """The gold-label keys of :func:`discrete_latent_metrics`: ``num_labelled``, the scores, confusion, matching."""
    num_examples, num_latents = q_NK.shape
    labels = _as_label_list(labels, name="labels")
    if len(labels) != num_examples:
        raise ValueError(f"labels: length {len(labels)} does not match posterior_NK rows {num_examples}")
    keep_N = np.array([label is not None for label in labels], dtype=bool)
    gold = [label for label in labels if label is not None]
    out: dict[str, Any] = {"num_labelled": len(gold)}
    if not gold:
        return out
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
    out.update(
        **cluster_scores(gold, pred),
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


def distinct_outputs(decoded: Sequence[Any]) -> float:
    """Fraction of decoded x whose greedy output differs across the latents it was decoded with.

    Each record (a mapping or an object) has ``index`` (the x), ``generated`` (the token ids) and
    ``closed`` (whether ``</y>`` ended it); two decodes of one x differ when their tokens or their
    closing differ. No parser is needed: it asks only whether z changes what the decoder writes, so 0
    means the decoder ignores z on every x (an x decoded with a single latent counts as not differing).
    """
    records = list(decoded)
    if not records:
        raise ValueError("decoded: need at least one decoded record")
    outputs: dict[Any, set] = {}
    for i, rec in enumerate(records):
        index, generated = _field(rec, "index"), _field(rec, "generated")
        if index is None or generated is None:
            raise ValueError(f"decoded[{i}]: needs the fields 'index' and 'generated'")
        outputs.setdefault(index, set()).add((tuple(int(t) for t in generated), bool(_field(rec, "closed", False))))
    return sum(len(seen) > 1 for seen in outputs.values()) / len(outputs)


# ----------------------------------------------------------------------------------------------
# Gaussian latents
# ----------------------------------------------------------------------------------------------


def kmeans_labels(x_ND: Any, *, num_clusters: int, seed: int = 0) -> tuple[np.ndarray, float]:
    """k-means (scikit-learn's ``KMeans``: k-means++ seeding, Lloyd, 4 seedings) -> ``(labels_N, inertia)``.

    Deterministic for a given ``seed`` (``random_state``). Cluster ids are arbitrary; the partition
    and inertia (sum of squared distances to the assigned centre) are what matter. On the recorded
    cases the partitions and inertias equal those of the hand-written k-means this replaced; its
    k-means++ sampler (greedy, several candidates per centre), tolerance and empty-cluster
    relocation differ, so on data without a clear cluster structure the partition can differ.
    """
    from sklearn.cluster import KMeans
    from sklearn.exceptions import ConvergenceWarning

    x = _to_numpy(x_ND, name="x_ND")
    if x.ndim != 2 or x.shape[0] == 0:
        raise ValueError(f"x_ND: expected a non-empty (N, D) matrix, got shape {x.shape}")
    if not 1 <= num_clusters <= x.shape[0]:
        raise ValueError(f"num_clusters: must be in [1, N={x.shape[0]}], got {num_clusters}")
    with warnings.catch_warnings():
        # Fewer distinct points than clusters (e.g. a collapsed encoder) is a valid input, not a fault.
        warnings.simplefilter("ignore", ConvergenceWarning)
        km = KMeans(n_clusters=num_clusters, n_init=4, max_iter=100, random_state=seed).fit(x)
    return km.labels_.astype(np.int64), float(km.inertia_)


def gaussian_latent_metrics(
    mu_ND: Any,
    logvar_ND: Any = None,
    labels: Sequence[str | None] | None = None,
    delta: float = ACTIVE_UNITS_DELTA,
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
                           ``kmeans_labels`` with ``seed``; ``num_clusters`` is reported back, and
                           ``cluster_labels`` (the cluster of each labelled row, in order).
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
            pred, _ = kmeans_labels(mu[keep_N], num_clusters=k, seed=seed)
            out.update(num_clusters=k, cluster_labels=pred, **cluster_scores(gold, pred.tolist()))
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
