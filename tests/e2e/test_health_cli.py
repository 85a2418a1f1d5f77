"""The reference health check through the real ``zcvae train`` CLI, on tiny backbones.

A raw backbone (its tokenizer lacks the template markers, ``raw_tiny_backbone``): exit 2 with one line
naming the ``zcvae pretrain --backbone`` command, nothing in the run directory that blocks a rerun; the
same command with ``--allow-fresh-markers`` then trains into the same directory, records the check and
reports ``closure_rate``. The entangled tiny backbone (pretrained through the CLI): no health line about
markers, ``fresh_markers`` empty.
"""

from __future__ import annotations

import json

import pytest

from zcvae.data.encoding import MARKERS


FLAGS = ["--task", "copy", "--max-steps", "3", "--num-train-examples", "64", "--num-val-examples", "8",
         "--micro-batch-size", "4", "--num-eval-decode-examples", "4", "--log-every", "1", "--no-progress-bar"]


def test_raw_backbone_exits_2_then_trains_with_the_proceed_flag(cli, raw_tiny_backbone, tmp_path):
    raw = raw_tiny_backbone()
    run_dir = tmp_path / "run"
    proc = cli("train", "--backbone", raw, "--output-dir", run_dir, *FLAGS, cwd=tmp_path, check=False)
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("zcvae train: error:")]
    assert len(errors) == 1 and errors == lines[-1:], proc.stderr[-3000:]
    assert f"`zcvae pretrain --backbone {raw} --task copy --output-dir {tmp_path / ('entangled-' + raw.name)}`" in errors[0]
    assert " ".join(MARKERS) in errors[0] and "--allow-fresh-markers" in errors[0]
    assert not run_dir.exists() or not any(run_dir.iterdir())

    proc = cli("train", "--backbone", raw, "--output-dir", run_dir, *FLAGS, "--allow-fresh-markers", cwd=tmp_path)
    log = proc.stdout + proc.stderr
    meta = json.loads((run_dir / "run_config.json").read_text())
    health = meta["reference_health"]
    assert health["fresh_markers"] == list(MARKERS) and health["allow_fresh_markers"] is True
    assert health["backbone"] == str(raw) and health["c_base"] == meta["c_base"]["value"]
    assert health["floor_per_sequence"] == pytest.approx(0.6931, abs=1e-4)  # copy: two strategies, log 2
    # a random backbone is far above the floor: warned, never stopped
    assert health["c_base"] > health["c_base_threshold"] and "[health] warning: c_base[mean]" in log
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    final = [r for r in records if r["split"] == "eval"][-1]
    assert 0.0 <= final["closure_rate"] <= 1.0
    assert ("the decoder closed y" in log) == (final["closure_rate"] < 0.5)


def test_entangled_backbone_passes_the_check_quietly(cli, tiny_backbone, tmp_path):
    run_dir = tmp_path / "run"
    proc = cli("train", "--backbone", tiny_backbone, "--output-dir", run_dir, *FLAGS, cwd=tmp_path)
    health = json.loads((run_dir / "run_config.json").read_text())["reference_health"]
    assert health["fresh_markers"] == [] and health["allow_fresh_markers"] is False
    assert health["stage_steps"] == 40  # TINY_PRETRAIN's: the c_base advice is a longer stage, not one on top
    assert "--allow-fresh-markers" not in proc.stdout + proc.stderr
    assert all("--allow-fresh-markers" not in w for w in health["warnings"])
