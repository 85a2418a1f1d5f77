"""The metric sinks (zcvae.runs.sinks): each available sink is written through and what it wrote is read
back (metrics.jsonl parsed, TensorBoard's event file through its EventAccumulator); wandb only where it
is installed, offline. The RunLogger that composes them: tests/unit/loop/test_run_logger.py."""

from __future__ import annotations

import importlib.util
import json

import pytest

from zcvae.runs.sinks import SINKS, JsonlSink, TensorBoardSink, sink_names

RECORDS = [("train", 3, {"loss": 1.5, "kl": float("nan"), "degenerate": 2, "learning_rate/lora": 1e-4}),
           ("eval", 3, {"nmi": 0.25, "note": "text", "nll": float("inf")}),
           ("train", 4, {"loss": 1.25, "kl": 0.5, "degenerate": 0, "learning_rate/lora": 5e-5})]


class _Config:
    def to_dict(self):
        return {"seed": 7, "report_to": "tensorboard,jsonl", "objective": None, "lengths": [1, 2]}


def _write(sink):
    for split, step, metrics in RECORDS:
        sink.log(split, step, metrics)
    sink.hparams(_Config().to_dict(), {"nmi": 0.25, "kl": float("nan")})
    sink.close()


def test_the_jsonl_sink_writes_one_sorted_line_per_record_with_null_for_non_finite(tmp_path):
    _write(JsonlSink(tmp_path, run_name="r"))
    text = (tmp_path / "metrics.jsonl").read_text()
    # the exact bytes the run has always written: keys sorted, ", " and ": " separators, NaN and inf as null
    assert text.splitlines()[0] == '{"degenerate": 2, "kl": null, "learning_rate/lora": 0.0001, "loss": 1.5, "split": "train", "step": 3}'
    assert [json.loads(line) for line in text.splitlines()] == [
        {"step": 3, "split": "train", "loss": 1.5, "kl": None, "degenerate": 2, "learning_rate/lora": 1e-4},
        {"step": 3, "split": "eval", "nmi": 0.25, "note": "text", "nll": None},
        {"step": 4, "split": "train", "loss": 1.25, "kl": 0.5, "degenerate": 0, "learning_rate/lora": 5e-5}]
    _write(JsonlSink(tmp_path, run_name="r"))  # a resumed run appends
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 6


def test_the_tensorboard_sink_writes_each_finite_scalar_under_split_slash_name(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _write(TensorBoardSink(tmp_path, run_name="r"))
    events = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    scalars = {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}
    assert scalars == {"train/loss": [(3, 1.5), (4, 1.25)], "train/kl": [(4, 0.5)], "train/degenerate": [(3, 2.0), (4, 0.0)],
                       "train/learning_rate/lora": [(3, pytest.approx(1e-4)), (4, pytest.approx(5e-5))], "eval/nmi": [(3, 0.25)]}
    assert "config/text_summary" in events.Tags()["tensors"]
    config = events.Tensors("config/text_summary")[0].tensor_proto.string_val[0].decode()
    assert json.loads(config.strip("`\n")) == _Config().to_dict()
    hparams = EventAccumulator(str(tmp_path / "tensorboard" / "hparams"), size_guidance={"scalars": 0})
    hparams.Reload()
    assert [(e.step, e.value) for e in hparams.Scalars("hparam/nmi")] == [(0, 0.25)]
    assert "hparam/kl" not in hparams.Tags()["scalars"]


def test_report_to_names_known_sinks_and_always_jsonl():
    assert sink_names("tensorboard,jsonl") == sink_names(" jsonl , tensorboard,") == ("jsonl", "tensorboard")
    assert sink_names("wandb,jsonl") == ("jsonl", "wandb") and set(SINKS) == {"jsonl", "tensorboard", "wandb"}
    with pytest.raises(ValueError, match="unknown sink 'mlflow' .*known: jsonl, tensorboard, wandb"):
        sink_names("jsonl,mlflow")
    with pytest.raises(ValueError, match="must include jsonl"):
        sink_names("tensorboard")


@pytest.mark.skipif(importlib.util.find_spec("wandb") is not None, reason="wandb is installed: its sink is tested below")
def test_naming_wandb_without_it_installed_says_how_to_install_it(tmp_path):
    with pytest.raises(ValueError, match=r"wandb, which is not installed: pip install 'zcvae\[wandb\]'"):
        SINKS["wandb"](tmp_path, run_name="r")


def test_the_wandb_sink_logs_the_same_scalars_offline(tmp_path, monkeypatch):
    pytest.importorskip("wandb", reason="wandb is an optional extra (pip install 'zcvae[wandb]'), not installed here")
    monkeypatch.setenv("WANDB_MODE", "offline")  # never the network
    monkeypatch.setenv("WANDB_SILENT", "true")
    sink = SINKS["wandb"](tmp_path, run_name="r")
    for split, step, metrics in RECORDS + [("train", 5, {"loss": 1.0})]:  # a later step commits step 4's row
        sink.log(split, step, metrics)
    sink.hparams(_Config().to_dict(), {"nmi": 0.25, "kl": float("nan")})
    summary = dict(sink.run.summary)  # the last committed value of each key
    assert (summary["train/loss"], summary["train/kl"], summary["eval/nmi"], summary["hparam/nmi"]) == (1.25, 0.5, 0.25, 0.25)
    assert summary["_step"] == 4 and "eval/nll" not in summary and "hparam/kl" not in summary
    assert dict(sink.run.config)["seed"] == 7
    sink.close()
    assert list(tmp_path.glob("wandb/offline-run-*"))
