"""The run's logs: one RunLogger over the metric sinks (metrics.jsonl, TensorBoard, ...), the exact metric window, the progress bar."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

from zcvae.core.losses import DIAGNOSTIC_REDUCTIONS
from zcvae.distributed import reduce_metrics
from zcvae.runs.sinks import DEFAULT_REPORT_TO, SINKS, sink_names


@dataclass
class MetricWindow:
    """Per-rank running sums/minima/maxima of per-example values; reduced exactly across ranks.

    Tensors stay on the device until :meth:`reduce`, so logging costs no host sync per micro-batch.
    """

    sums: dict = field(default_factory=dict)
    counts: dict = field(default_factory=dict)
    mins: dict = field(default_factory=dict)
    maxs: dict = field(default_factory=dict)
    totals: dict = field(default_factory=dict)

    def add_examples(self, values: dict[str, torch.Tensor], valid_B: torch.Tensor) -> None:
        valid_B = valid_B.detach().float()
        has = valid_B > 0
        for name, value_B in values.items():
            if name == "valid":
                continue
            value_B = value_B.detach().float()
            how = DIAGNOSTIC_REDUCTIONS.get(name, "mean")
            if how == "mean":
                self._add(self.sums, name, (value_B * valid_B).sum())
                self._add(self.counts, name, valid_B.sum())
            elif how == "min":
                self._reduce(self.mins, name, torch.where(has, value_B, torch.full_like(value_B, math.inf)).min(), torch.minimum)
            elif how == "max":
                self._reduce(self.maxs, name, torch.where(has, value_B, torch.full_like(value_B, -math.inf)).max(), torch.maximum)
            else:  # "sum": a count over examples (e.g. degenerate)
                self._add(self.totals, name, value_B.sum())

    def add_scalar(self, name: str, value, weight=1.0) -> None:
        """A value that is the same on every rank (or a per-rank value to average over ranks)."""
        self._add(self.sums, name, torch.as_tensor(value, dtype=torch.float64) * weight)
        self._add(self.counts, name, torch.as_tensor(weight, dtype=torch.float64))

    def reduce(self) -> dict[str, float]:
        out = reduce_metrics(sums=self.sums, counts=self.counts, mins=self.mins, maxs=self.maxs)
        if self.totals:
            totals = reduce_metrics(sums=self.totals, counts={k: 1.0 for k in self.totals})
            out.update({k: totals[f"{k}/sum"] for k in self.totals})
        return {k: v for k, v in out.items() if not k.endswith(("/sum", "/count"))}

    @staticmethod
    def _add(store: dict, name: str, value: torch.Tensor) -> None:
        value = value.detach().to(torch.float64)
        store[name] = store[name] + value if name in store else value

    @staticmethod
    def _reduce(store: dict, name: str, value: torch.Tensor, fn) -> None:
        value = value.detach().to(torch.float64)
        store[name] = fn(store[name], value) if name in store else value


class RunLogger:
    """What the run logs, sent by rank 0 to each sink that ``report_to`` names (zcvae.runs.sinks)."""

    def __init__(self, run_dir: Path, *, enabled: bool, report_to: str = DEFAULT_REPORT_TO, run_name: str | None = None):
        self.sinks = [SINKS[name](run_dir, run_name=run_name or run_dir.name) for name in sink_names(report_to)] if enabled else []

    def log(self, split: str, step: int, metrics: dict[str, float]) -> None:
        for sink in self.sinks:
            sink.log(split, step, metrics)

    def hparams(self, cfg, final: dict[str, float]) -> None:
        for sink in self.sinks:
            sink.hparams(cfg.to_dict(), final)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()


def progress_bar(settings, start: int, *, enabled: bool):
    """A tqdm bar over ``settings.max_steps`` (``progress_bar``, ``run_name``) on the rank that shows it."""
    from tqdm import tqdm

    return tqdm(total=settings.max_steps, initial=start, disable=not (enabled and settings.progress_bar), desc=settings.run_name, dynamic_ncols=True, leave=False)
