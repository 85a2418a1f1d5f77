"""The gradient probe under DDP: two ranks log the probe records of one process with the same global batch.

The probe sums each micro-batch's per-term gradients and all-reduces them before taking norms, so
(world 2, accumulation 1) must give the norms of (world 1, accumulation 2): a per-rank norm, or a sum of
norms, would not. Both runs go through the real ``zcvae train`` CLI (DDP over gloo, CPU, fp32).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path


HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import launcher as C  # noqa: E402


LAUNCH_TIMEOUT_S = 300
TOL = 1e-5


def _probe_records(run_dir: Path) -> list[dict]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [r for r in records if r["split"] == "grad_probe"]


def test_two_ranks_log_the_probe_of_one_process(tiny_backbone, tmp_path):
    common = ["train", "--task", "copy", "--backbone", tiny_backbone(), "--num-train-examples", "32", "--num-val-examples", "6",
              "--max-steps", "3", "--micro-batch-size", "4", "--num-eval-decode-examples", "2", "--max-new-tokens", "4",
              "--no-progress-bar", "--reference-policy", "online", "--log-every", "1", "--kl-delay-fraction", "0.34",
              "--kl-ramp-fraction", "0", "--grad-probe-every", "1",
              # router support is a term of each global micro-batch's mean q (docs/objective.md, "Auxiliaries"): world 2
              # x accumulation 1 and world 1 x accumulation 2 have different micro-batches, so it is off here
              "--router-support-weight", "0"]
    env = C.cpu_env(tmp_path / "cache")
    runs = {"w1": C.zcvae_cmd(*common, "--gradient-accumulation-steps", "2", "--output-dir", tmp_path / "w1"),
            "w2": C.torchrun_cmd(*common, "--gradient-accumulation-steps", "1", "--output-dir", tmp_path / "w2")}
    for name, cmd in runs.items():
        launch = C.run_launch(name, cmd, log_dir=tmp_path, env=env, timeout_s=LAUNCH_TIMEOUT_S)
        assert launch.ok, launch.failure()
    want, got = _probe_records(tmp_path / "w1"), _probe_records(tmp_path / "w2")
    assert [r["step"] for r in want] == [1, 2, 3] and [r["step"] for r in got] == [1, 2, 3]
    for g, w in zip(got, want):
        assert set(g) == set(w), (g["step"], set(g) ^ set(w))
        for key, value in w.items():
            if isinstance(value, float):
                assert C.close(g[key], value, tol=TOL), (g["step"], key, g[key], value)
    assert want[0]["kl_weight"] == 0 and "posterior_head/reconstruction_to_kl_ratio" not in want[0]
    assert want[-1]["kl_weight"] == 1 and "posterior_head/reconstruction_to_kl_ratio" in want[-1]
