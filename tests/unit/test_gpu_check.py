"""bench/gpu_check.py on this CPU machine: one clear line and a non-zero exit; its arithmetic by hand."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))

import gpu_check  # noqa: E402


def test_without_cuda_it_exits_non_zero_with_one_line():
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(REPO / "src")}
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "gpu_check.py")], capture_output=True, text=True, env=env,
                          timeout=300, cwd=REPO)
    assert proc.returncode != 0
    assert proc.stderr.strip().splitlines() == [gpu_check.CPU_LINE] and "needs a CUDA GPU" in gpu_check.CPU_LINE
    assert proc.stdout == ""


def test_summary_of_the_timed_steps_by_hand():
    # 3 steps, the first a warm-up; step s took tokens / tokens_per_second seconds
    result = {"supervised_tokens": [100, 200, 300], "flops_useful": [1e9, 2e9, 4e9], "flops_hardware": [2e9, 3e9, 5e9],
              "peak_flops": 1e12, "lora_ms": 250.0}
    metrics = {1: {"tokens_per_second": 10.0}, 2: {"tokens_per_second": 400.0}, 3: {"tokens_per_second": 1000.0}}
    s = gpu_check.summarize(result, metrics, warmup=1)
    # steps 2 and 3: 0.5 s and 0.3 s
    assert s["step_ms"] == pytest.approx(400.0) and s["tokens_per_s"] == pytest.approx(500 / 0.8)
    assert s["flops_useful_per_s"] == pytest.approx(6e9 / 0.8) and s["mfu"] == pytest.approx(6e9 / 0.8 / 1e12)
    assert s["hfu"] == pytest.approx(8e9 / 0.8 / 1e12) and s["ratio"] == pytest.approx(400 / 250)
    s = gpu_check.summarize({**result, "peak_flops": None, "lora_ms": None}, metrics, warmup=1)
    assert s["mfu"] is None and s["hfu"] is None and s["ratio"] is None


def test_bad_arguments_name_the_flag():
    with pytest.raises(SystemExit, match="--engines"):
        gpu_check.parse_args(["--engines", "zero2"])
    with pytest.raises(SystemExit, match="--warmup-steps"):
        gpu_check.parse_args(["--steps", "5", "--warmup-steps", "5"])
