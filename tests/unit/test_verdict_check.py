"""bench/verdict_check.py on hand-built run directories: the verdict's collapsed-or-not against gold NMI < 0.1."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from zcvae.config import TrainConfig


@pytest.fixture(scope="module")
def verdict_check(bench_script):
    return bench_script("verdict_check")


def _run(root: Path, name: str, final: dict | None, **config):
    """A run directory as the trainer writes it; ``final`` split over two eval lines as evaluation may log it."""
    run_dir = root / name
    run_dir.mkdir(parents=True)
    cfg = TrainConfig.from_dict({"objective": "raw+dist", "run_name": name, **config}).to_dict()
    (run_dir / "run_config.json").write_text(json.dumps({"config": cfg}))
    records = [{"step": 10, "split": "train", "loss": 2.0}]
    if final is not None:
        items = list(final.items())
        records += [{"step": 300, "split": "eval", **dict(items[:2])}, {"step": 300, "split": "eval", **dict(items[2:])}]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


USED = {"num_used_latents": 2.0, "router_support": 2.0, "kl": 0.69}


def test_agreement_over_hand_built_runs(verdict_check, tmp_path, capsys):
    root = tmp_path / "runs"
    _run(root / "pilot", "collapsed", {"nmi": 0.0, "mi": 2e-6, **USED, "kl": 1e-5}, objective="raw")
    _run(root / "pilot", "healthy", {"nmi": 1.0, "mi": 0.68, **USED, "control/distinct_outputs": 1.0})
    _run(root / "late", "merged", {"nmi": 0.74, "mi": 0.64, **USED}, num_latents=3)
    # the verdict misses this one: z separates something (MI high), but not the strategy (gold NMI 0.05)
    _run(root / "late", "unaligned", {"nmi": 0.05, "mi": 0.6, **USED})
    _run(root / "user", "no-gold", {"mi": 0.68, **USED})
    _run(root / "user", "running", None)
    assert verdict_check.main([str(root)]) == 0
    out = capsys.readouterr().out
    rows = {cells[0]: cells for cells in (_cells(line) for line in out.splitlines() if line.startswith("| ") and "---" not in line)}
    assert set(rows) == {"run", "collapsed", "healthy", "merged", "unaligned", "no-gold", "running"}
    assert rows["collapsed"][4:] == ["collapsed", "collapsed", "yes"]
    assert rows["healthy"][4:] == ["in use (2.0 of 2); gold: aligned", "not collapsed", "yes"]
    assert rows["merged"][5:] == ["not collapsed", "yes"]
    assert rows["unaligned"][4:] == ["in use (2.0 of 2); gold: collapsed", "collapsed", "NO"]
    assert rows["no-gold"][5:] == ["-", "-"] and rows["running"][4] == "no evaluation"
    assert "agreement: 3/4 = 0.750" in out and "2 of 6 runs" in out
    assert verdict_check.main([str(root), "--min-agreement", "0.95"]) == 1
    assert verdict_check.main([str(root / "pilot"), "--min-agreement", "0.95"]) == 0


def test_a_root_that_is_not_a_directory_is_one_error_line(verdict_check, tmp_path, capsys):
    assert verdict_check.main([str(tmp_path / "absent")]) == 2
    assert "absent: not a directory" in capsys.readouterr().err


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]
