"""The figures an evaluation writes: the latent x strategy matrix with latent usage, and the
information gain of z per y position. Both are written atomically (a viewer never sees half a PNG).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from zcvae.eval.metrics import _to_numpy  # the one input check of array-likes in eval/
from zcvae.runs.rundir import atomic_write

__all__ = ["MAX_FIGURE_ROWS", "plot_information_gain", "plot_latent_figure"]


# The most latents (rows) and strategies (columns) the latent figure draws; beyond, the top ones.
MAX_FIGURE_ROWS = 32


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
    # The figure grows with K and S (0.4-0.6 in each): at K = 1000 it was 404 x 452 in and took 23.6 GB.
    # Past MAX_FIGURE_ROWS it shows the most used latents and the most frequent strategies only.
    notes = []
    if num_latents > MAX_FIGURE_ROWS:
        keep = np.sort(np.argsort(-usage_K, kind="stable")[:MAX_FIGURE_ROWS])
        confusion_KS, usage_K = confusion_KS[keep], usage_K[keep]
        latent_labels = [latent_labels[k] for k in keep]
        notes.append(f"the {MAX_FIGURE_ROWS} most used of {num_latents} latents")
        num_latents = MAX_FIGURE_ROWS
    if num_strategies > MAX_FIGURE_ROWS:
        keep = np.sort(np.argsort(-confusion_KS.sum(0), kind="stable")[:MAX_FIGURE_ROWS])
        confusion_KS = confusion_KS[:, keep]
        strategy_labels = [strategy_labels[s] for s in keep]
        notes.append(f"the {MAX_FIGURE_ROWS} most frequent of {num_strategies} strategies")
        num_strategies = MAX_FIGURE_ROWS
    if notes:
        title = (f"{title} " if title else "") + "(" + "; ".join(notes) + ")"

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
        atomic_write(path, lambda tmp: fig.savefig(tmp, format="png", dpi=100))
    finally:
        plt.close(fig)
    return path


def plot_information_gain(
    mean_by_position: Sequence[float | None],
    path: str | os.PathLike,
    decision_positions: Mapping[int, int] | None = None,
    title: str | None = None,
) -> str:
    """Write a PNG of the mean per-position information gain b_t - l_t (nats) over y positions t.

    ``mean_by_position`` as from ``information_gain_by_position`` (None where no row has a token).
    ``decision_positions`` maps a y position to the number of examples whose strategies part there;
    each is marked with a dashed vertical line whose opacity is its share of examples. Without it
    (user data) the curve is drawn unmarked. Written atomically like ``plot_latent_figure``.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    gains = [np.nan if g is None else float(g) for g in mean_by_position]
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fig, ax = plt.subplots(figsize=(max(5.0, 0.3 * len(gains) + 2.0), 3.2))
    try:
        ax.axhline(0.0, color="grey", lw=0.8)
        ax.plot(range(len(gains)), gains, marker="o", ms=3, color="tab:blue", label="mean b_t - l_t")
        if decision_positions:
            total = sum(decision_positions.values())
            for i, (position, count) in enumerate(sorted(decision_positions.items())):
                ax.axvline(position, color="tab:red", ls="--", alpha=max(0.15, count / total),
                           label="decision position (opacity: share of examples)" if i == 0 else None)
        ax.set_xlabel("y position t (0 = first y token)")
        ax.set_ylabel("information gain (nats)")
        ax.legend(loc="best", fontsize=8)
        ax.set_title(title or "where z acts")
        fig.tight_layout()
        atomic_write(path, lambda tmp: fig.savefig(tmp, format="png", dpi=100))
    finally:
        plt.close(fig)
    return path
