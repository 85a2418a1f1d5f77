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


def test_the_default_runs_a_built_shape_on_long_pairs_of_exact_token_lengths(tmp_path):
    from zcvae.data import build_tokenizer

    args = gpu_check.parse_args(["--out", str(tmp_path)])
    assert (args.shape, args.x_len, args.y_len, args.num_latents, args.micro_batch_size) == ("SmolLM2-1.7B", 256, 256, 4, 16)
    backbone, data = gpu_check.inputs(args, tmp_path)
    assert backbone == str(tmp_path / "shape-SmolLM2-1.7B") and "--allow-fresh-markers" in data and "--task" not in data
    argv = gpu_check._train_argv(args, backbone=backbone, run_dir=tmp_path / "run", engine="fsdp2-bf16", data=data)
    assert argv[argv.index("--train-data") + 1].endswith("train.jsonl") and argv[argv.index("--num-latents") + 1] == "4"
    tok = build_tokenizer()
    words = sorted(w for w in tok.get_vocab() if w not in set(tok.all_special_tokens) and not w.startswith("<"))
    records = gpu_check.long_examples(words, num=3, x_len=256, y_len=200, seed=0, prefix="t")
    for r in records:
        assert len(tok(r["x"], add_special_tokens=False)["input_ids"]) == 256
        assert len(tok(r["y"], add_special_tokens=False)["input_ids"]) == 200
    assert records == gpu_check.long_examples(words, num=3, x_len=256, y_len=200, seed=0, prefix="t")  # reproducible
    # a real backbone keeps the entangled stage and copy
    backbone, data = gpu_check.inputs(gpu_check.parse_args(["--backbone", "smollm2", "--out", str(tmp_path)]), tmp_path)
    assert backbone == str(tmp_path / "entangled") and data == ["--task", "copy"]
