"""The run directory module: atomic writers leave the old file on failure, readers name the file."""

import json
import os
import stat

import pytest

from zcvae.runs.rundir import (
    METRICS,
    RUN_CONFIG,
    atomic_write_json,
    atomic_write_text,
    iter_metric_records,
    read_json,
    read_run_record,
    truncate_metrics,
)


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path, monkeypatch):
    target = tmp_path / "a.json"
    atomic_write_json(target, {"v": 1})

    def crash(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError, match="disk full"):
        atomic_write_json(target, {"v": 2})
    assert json.loads(target.read_text()) == {"v": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.json"]


def test_written_files_get_ordinary_permissions(tmp_path):
    atomic_write_text(tmp_path / "t.txt", "x")
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE((tmp_path / "t.txt").stat().st_mode) == 0o666 & ~umask


def test_readers_name_the_file(tmp_path):
    with pytest.raises(ValueError, match=rf"run config: .*{RUN_CONFIG}.* does not exist"):
        read_run_record(tmp_path)
    (tmp_path / RUN_CONFIG).write_text("{not json")
    with pytest.raises(ValueError, match=rf"{RUN_CONFIG}.* is not valid JSON"):
        read_run_record(tmp_path)
    (tmp_path / RUN_CONFIG).write_text('{"config": 3}')
    with pytest.raises(ValueError, match="has no 'config' mapping"):
        read_run_record(tmp_path)
    with pytest.raises(ValueError, match="thing: .*nope.json"):
        read_json(tmp_path / "nope.json", what="thing")


def test_metrics_records_skip_a_cut_line_and_truncate_drops_later_steps(tmp_path):
    path = tmp_path / METRICS
    path.write_text('{"step": 1, "split": "train"}\n{"step": 2, "split": "eval"}\n{"step": 3, "spl')
    assert [r["step"] for r in iter_metric_records(tmp_path)] == [1, 2]
    path.write_text('{"step": 1}\n{"step": 2}\n{"step": 3}\n')
    truncate_metrics(path, after_step=2)
    assert path.read_text() == '{"step": 1}\n{"step": 2}\n'


def test_final_eval_metrics_is_the_last_eval_record_numbers_only(tmp_path):
    from zcvae.runs.rundir import final_eval_metrics

    assert final_eval_metrics(tmp_path) == (None, {})
    lines = [
        {"split": "eval", "step": 4, "nmi": 0.1},
        {"split": "train", "step": 8, "loss": 1.0},
        {"split": "eval", "step": 8, "nmi": 0.3, "exact_match": 1, "note": "text", "flag": True},
    ]
    (tmp_path / METRICS).write_text("\n".join(json.dumps(r) for r in lines) + '\n{"split": "eval", "st')
    assert final_eval_metrics(tmp_path) == (8, {"nmi": 0.3, "exact_match": 1})
