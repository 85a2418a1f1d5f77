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


def test_prepare_run_dir_refuses_what_it_may_not_replace_and_moves_an_old_run_aside(tmp_path, logged):
    from zcvae.runs.lock import LOCK_FILE
    from zcvae.runs.rundir import prepare_run_dir

    run_dir, lines = tmp_path / "run", logged
    prepare_run_dir(run_dir, resume=False, overwrite=False, is_main=True)
    assert run_dir.is_dir() and not lines  # a new directory: made, nothing said
    (run_dir / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="is not empty .* --resume auto .* --overwrite"):
        prepare_run_dir(run_dir, resume=False, overwrite=False, is_main=True)
    with pytest.raises(ValueError, match="deletes only a zcvae run directory"):
        prepare_run_dir(run_dir, resume=False, overwrite=True, is_main=True)
    (run_dir / RUN_CONFIG).write_text("{}")
    (run_dir / "data.jsonl").write_text("")
    with pytest.raises(ValueError, match="would delete train_data"):
        prepare_run_dir(run_dir, resume=False, overwrite=True, is_main=True, keep={"train_data": run_dir / "data.jsonl"})
    prepare_run_dir(run_dir, resume=True, overwrite=False, is_main=True)  # a resume keeps everything
    assert (run_dir / RUN_CONFIG).exists()
    (run_dir / LOCK_FILE).write_text("")  # the run's own lock stays where it is
    prepare_run_dir(run_dir, resume=False, overwrite=True, is_main=True)
    assert sorted(p.name for p in run_dir.iterdir()) == [LOCK_FILE] and not list(tmp_path.glob("run.deleting-*"))
    assert lines and lines[0].startswith("[run] --overwrite: deleting the earlier run")


def test_an_output_dir_under_a_file_is_refused(tmp_path):
    from zcvae.runs.rundir import check_output_dir_path

    (tmp_path / "afile").write_text("")
    with pytest.raises(ValueError, match="is an existing file"):
        check_output_dir_path(tmp_path / "afile")
    with pytest.raises(ValueError, match="lies under .*afile.*, which is a file"):
        check_output_dir_path(tmp_path / "afile" / "run")
