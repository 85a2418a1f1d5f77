"""The posterior-gradient figure (docs/objective.md#dilution): the probe's reconstruction-to-KL gradient ratio over steps, run
against run (e.g. raw mean, which collapses, against dist, which keeps z).

    python -m zcvae.commands.grad_probe_figure runs/raw-mean runs/dist-mean --out grad_probe.png
    python -m zcvae.commands.grad_probe_figure A B --labels "raw mean" dist --group lora --out lora.png

Reads the ``grad_probe`` records of each run's metrics.jsonl (``zcvae train --grad-probe-every N``; see
``zcvae.train.grad_probe``) and writes one PNG of two panels over the optimizer step, one colour per run:
top, ``<group>/reconstruction_to_kl_ratio`` (log scale; a gap where beta = 0, since the ratio is undefined
there); bottom, ``<group>/reconstruction_grad_norm`` (solid) and ``<group>/scaled_kl_grad_norm`` (dashed).
The steps of the KL delay (beta = 0 in the first run) are shaded. A run resumed over logged steps keeps its
last record of each step, as ``metrics.jsonl`` readers do.
"""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

from zcvae.runs.rundir import atomic_write, iter_metric_records
from zcvae.train.grad_probe import PROBE_GROUPS, PROBE_SPLIT

__all__ = ["main", "plot_grad_probe", "read_probe_series"]


def read_probe_series(run_dir: str | os.PathLike, *, group: str = "posterior_head") -> dict[str, list[float]]:
    """``{"step", "kl_weight", "ratio", "reconstruction", "scaled_kl"}`` lists (NaN where a record lacks the
    key: an undefined ratio), ordered by step. ValueError naming the run without probe records."""
    if group not in PROBE_GROUPS:
        raise ValueError(f"group must be one of {list(PROBE_GROUPS)}, got {group!r}")
    by_step: dict[int, dict] = {}
    for record in iter_metric_records(run_dir):
        if record.get("split") == PROBE_SPLIT:
            by_step[int(record["step"])] = record  # the last wins (a resumed run logs a step again)
    if not by_step:
        raise ValueError(f"run {str(run_dir)!r} has no {PROBE_SPLIT} records in its metrics.jsonl: "
                         f"train it with --grad-probe-every N")

    def value(record: dict, key: str) -> float:
        v = record.get(key)
        return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else math.nan

    steps = sorted(by_step)
    keys = {"kl_weight": "kl_weight", "ratio": f"{group}/reconstruction_to_kl_ratio",
            "reconstruction": f"{group}/reconstruction_grad_norm", "scaled_kl": f"{group}/scaled_kl_grad_norm"}
    out: dict[str, list[float]] = {"step": [float(s) for s in steps]}
    for name, key in keys.items():
        out[name] = [value(by_step[s], key) for s in steps]
    return out


def plot_grad_probe(series: Mapping[str, Mapping[str, Sequence[float]]], path: str | os.PathLike, *,
                    group: str = "posterior_head", title: str | None = None) -> str:
    """Write the two-panel PNG of ``{label: read_probe_series(...)}`` to ``path`` (atomically); -> path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not series:
        raise ValueError("series: need at least one run")
    path = os.fspath(path)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7.0, 6.0), sharex=True)
    try:
        first = next(iter(series.values()))
        delay = [s for s, b in zip(first["step"], first["kl_weight"]) if b == 0]
        for ax in (top, bottom):
            if delay:
                ax.axvspan(min(delay), max(delay), color="grey", alpha=0.15, lw=0)
        positive = lambda xs: [x if x > 0 else math.nan for x in xs]  # noqa: E731 - log axes take no zeros
        for i, (label, s) in enumerate(series.items()):
            colour = f"C{i}"
            top.plot(s["step"], positive(s["ratio"]), color=colour, marker="o", ms=2, label=label)
            bottom.plot(s["step"], positive(s["reconstruction"]), color=colour, marker="o", ms=2, label=f"{label}: reconstruction")
            bottom.plot(s["step"], positive(s["scaled_kl"]), color=colour, ls="--", marker="x", ms=3, label=f"{label}: beta x KL")
        top.set_yscale("log")
        top.axhline(1.0, color="grey", lw=0.8)
        top.set_ylabel("||grad recon|| / ||beta grad KL||")
        top.legend(loc="best", fontsize=8)
        top.set_title(title or f"posterior gradient on {group} (shaded: KL delay, beta = 0)")
        bottom.set_yscale("log")
        bottom.set_ylabel("gradient norm")
        bottom.set_xlabel("optimizer step")
        bottom.legend(loc="best", fontsize=7)
        fig.tight_layout()
        atomic_write(path, lambda tmp: fig.savefig(tmp, format="png", dpi=100))
    finally:
        plt.close(fig)
    return path


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m zcvae.commands.grad_probe_figure", description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", help="run directories trained with --grad-probe-every N")
    parser.add_argument("--labels", nargs="+", help="one legend label per run (default: the directory names)")
    parser.add_argument("--group", default="posterior_head", choices=PROBE_GROUPS)
    parser.add_argument("--out", required=True, help="the PNG to write")
    args = parser.parse_args(argv)
    labels = args.labels or [Path(r).name for r in args.runs]
    try:
        if len(labels) != len(args.runs):
            raise ValueError(f"--labels: {len(labels)} labels for {len(args.runs)} runs")
        if len(set(labels)) != len(labels):
            raise ValueError(f"two runs share the label {next(x for x in labels if labels.count(x) > 1)!r}: give --labels")
        series = {label: read_probe_series(run, group=args.group) for label, run in zip(labels, args.runs)}
        print(plot_grad_probe(series, args.out, group=args.group))
    except ValueError as err:
        parser.exit(2, f"{parser.prog}: error: {err}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
