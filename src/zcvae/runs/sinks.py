"""Where a run's metrics go: one sink per destination, all fed by ``zcvae.loop.logs.RunLogger`` on rank 0.

A sink writes what the loop logged and nothing else (a split, a step, the reduced metrics), so choosing
sinks (``--report-to``) changes no training number:

- ``jsonl``: ``metrics.jsonl``, one JSON object per record (``step``, ``split`` and the metrics, keys
  sorted, a non-finite value as null). Always on: resume, ``zcvae aggregate`` and the verdict read it.
- ``tensorboard``: each finite scalar under the tag ``SPLIT/NAME`` in ``tensorboard/``; at the end the
  hyperparameters with the final metrics (``hparam/NAME``) and the config as text.
- ``wandb``: the same scalars in a Weights & Biases run (the ``wandb`` extra; ``WANDB_MODE=offline``
  and the other ``WANDB_*`` variables apply); at the end the config and the final metrics.

Its library is imported only when a run asks for the sink. Adding one: CONTRIBUTING.md, "Adding a metrics sink".
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from zcvae.runs.rundir import METRICS


class MetricSink(Protocol):
    """One destination of the run's metrics (as torchtune's ``MetricLoggerInterface``)."""

    def log(self, split: str, step: int, metrics: dict[str, float]) -> None: ...

    def hparams(self, config: dict[str, Any], final: dict[str, float]) -> None:
        """Once, at the end: the flat config and the final metrics."""

    def close(self) -> None: ...


def _finite_scalars(metrics: dict[str, Any]) -> dict[str, float]:
    return {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and math.isfinite(float(v))}


class JsonlSink:
    def __init__(self, run_dir: Path, *, run_name: str):
        self.file = open(run_dir / METRICS, "a", buffering=1)  # line-buffered: a reader sees whole records

    def log(self, split: str, step: int, metrics: dict[str, float]) -> None:
        record = {"step": step, "split": split, **{k: _jsonable(v) for k, v in metrics.items()}}
        self.file.write(json.dumps(record, sort_keys=True) + "\n")

    def hparams(self, config: dict[str, Any], final: dict[str, float]) -> None:
        pass  # the config is in run_config.json, the final metrics are the last records

    def close(self) -> None:
        self.file.close()


def _jsonable(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class TensorBoardSink:
    def __init__(self, run_dir: Path, *, run_name: str):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(run_dir / "tensorboard"))

    def log(self, split: str, step: int, metrics: dict[str, float]) -> None:
        for name, value in _finite_scalars(metrics).items():
            self.writer.add_scalar(f"{split}/{name}", value, step)
        self.writer.flush()

    def hparams(self, config: dict[str, Any], final: dict[str, float]) -> None:
        hp = {k: (v if isinstance(v, (int, float, str, bool)) else str(v)) for k, v in config.items()}
        self.writer.add_hparams(hp, {f"hparam/{k}": v for k, v in _finite_scalars(final).items()}, run_name="hparams")
        self.writer.add_text("config", "```\n" + json.dumps(config, indent=2) + "\n```")
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    def __init__(self, run_dir: Path, *, run_name: str):
        try:
            import wandb
        except ImportError:
            raise ValueError("report_to names wandb, which is not installed: pip install 'zcvae[wandb]'") from None
        self.run = wandb.init(dir=str(run_dir), name=run_name)

    def log(self, split: str, step: int, metrics: dict[str, float]) -> None:
        self.run.log({f"{split}/{name}": value for name, value in _finite_scalars(metrics).items()}, step=step)

    def hparams(self, config: dict[str, Any], final: dict[str, float]) -> None:
        self.run.config.update(config, allow_val_change=True)
        self.run.summary.update({f"hparam/{k}": v for k, v in _finite_scalars(final).items()})

    def close(self) -> None:
        self.run.finish()


DEFAULT_REPORT_TO = "tensorboard,jsonl"
# name in --report-to -> the sink; a run opens them in this order
SINKS: dict[str, Callable[..., MetricSink]] = {"jsonl": JsonlSink, "tensorboard": TensorBoardSink, "wandb": WandbSink}


def sink_names(report_to: str) -> tuple[str, ...]:
    """The sinks a ``report_to`` comma list names, in ``SINKS`` order; ValueError on an unknown name or without jsonl."""
    names = {name.strip() for name in report_to.split(",") if name.strip()}
    if unknown := sorted(names - set(SINKS)):
        raise ValueError(f"report_to: unknown sink {', '.join(map(repr, unknown))} (known: {', '.join(SINKS)})")
    if "jsonl" not in names:
        raise ValueError(f"report_to must include jsonl (metrics.jsonl, which resume, aggregate and the verdict read), got {report_to!r}")
    return tuple(name for name in SINKS if name in names)
