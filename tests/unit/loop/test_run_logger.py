"""RunLogger (zcvae.loop.logs) sends every record to each sink that report_to names, on rank 0 only."""

from __future__ import annotations

import json

from zcvae.loop.logs import RunLogger
from zcvae.runs.sinks import JsonlSink, TensorBoardSink


class _Config:
    def to_dict(self):
        return {"seed": 7}


def _run(run_dir, **kw):
    run_dir.mkdir()
    logger = RunLogger(run_dir, **kw)
    logger.log("train", 1, {"loss": 2.0})
    logger.log("eval", 1, {"nmi": 0.5})
    logger.hparams(_Config(), {"nmi": 0.5})
    logger.close()
    return logger


def test_the_default_sinks_are_metrics_jsonl_and_tensorboard(tmp_path):
    logger = _run(tmp_path / "run", enabled=True)
    assert [type(sink) for sink in logger.sinks] == [JsonlSink, TensorBoardSink]
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert records == [{"step": 1, "split": "train", "loss": 2.0}, {"step": 1, "split": "eval", "nmi": 0.5}]
    assert list((tmp_path / "run" / "tensorboard").glob("events.out.tfevents.*"))
    assert list((tmp_path / "run" / "tensorboard" / "hparams").glob("events.out.tfevents.*"))


def test_report_to_chooses_the_sinks_and_other_ranks_write_nothing(tmp_path):
    _run(tmp_path / "jsonl", enabled=True, report_to="jsonl")
    assert sorted(p.name for p in (tmp_path / "jsonl").iterdir()) == ["metrics.jsonl"]
    # wandb is never opened on a rank that does not log, installed or not
    assert _run(tmp_path / "rank1", enabled=False, report_to="jsonl,tensorboard,wandb").sinks == []
    assert not list((tmp_path / "rank1").iterdir())
