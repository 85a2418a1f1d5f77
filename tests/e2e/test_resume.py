"""A run SIGKILLed after step k and resumed with ``--resume auto`` ends bitwise where an uninterrupted
run ends (local engine, CPU, fp32): same trainable tensors, same logged metrics at every step.

Two crash points, through the debug hooks in ``zcvae.runs.checkpoint``: right after checkpoint 4 is
complete (resume from 4), and inside the save of checkpoint 4, after its files are written but before
``COMPLETE`` (the half-written ``step_00000004.tmp`` must be skipped: resume from 2, replaying 3-4).
The first crash point once more with run_config.json rewritten in the layout written before the config had
sections (one flat ``config`` mapping): an old run directory resumes bitwise too. Then a resume with another
aggregation mode is refused by the real CLI.
"""

import json

import pytest
import torch
from safetensors.torch import load_file

TRAIN = ["--task", "copy", "--max-steps", "6", "--micro-batch-size", "4", "--num-train-examples", "48",
         "--num-val-examples", "8", "--num-eval-decode-examples", "2", "--log-every", "2", "--save-every", "2",
         "--eval-every", "4", "--keep-last-checkpoints", "3", "--warmup-steps", "1", "--no-progress-bar"]
# timing differs between runs by nature
UNTIMED = {"tokens_per_second"}
# One BLAS/OpenMP thread: with several, MKL may pick a different split under load (dynamic threading),
# and a different summation order is not bitwise reproducible across processes.
ONE_THREAD = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "MKL_DYNAMIC": "FALSE"}


def _records(run_dir):
    """{(split, step): [records in file order]} without timing fields."""
    out = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = {k: v for k, v in json.loads(line).items() if k not in UNTIMED}
        out.setdefault((record["split"], record["step"]), []).append(record)
    return out


@pytest.fixture(scope="module")
def uninterrupted(cli, tiny_backbone, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("resume") / "straight"
    cli("train", "--backbone", tiny_backbone, "--output-dir", run_dir, *TRAIN, cwd=run_dir.parent, env=ONE_THREAD)
    return run_dir


@pytest.mark.parametrize(
    ("hook", "resumed_from", "flat_run_config"),
    [("ZCVAE_DEBUG_KILL_AT_STEP", 4, False), ("ZCVAE_DEBUG_KILL_IN_SAVE_AT_STEP", 2, False),
     ("ZCVAE_DEBUG_KILL_AT_STEP", 4, True)],
)
def test_killed_and_resumed_run_matches_the_uninterrupted_one(cli, tiny_backbone, uninterrupted, tmp_path, hook, resumed_from,
                                                             flat_run_config):
    run_dir = tmp_path / "killed"
    killed = cli("train", "--backbone", tiny_backbone, "--output-dir", run_dir, *TRAIN, cwd=tmp_path, check=False, env={**ONE_THREAD, hook: "4"})
    assert killed.returncode == -9, killed.stderr[-3000:]
    checkpoints = run_dir / "checkpoints"
    if resumed_from == 2:
        assert (checkpoints / "step_00000004.tmp").is_dir() and not (checkpoints / "step_00000004").exists()
    else:
        assert (checkpoints / "step_00000004" / "COMPLETE").is_file()
    if flat_run_config:  # as an old run directory holds it: one flat mapping, no sections
        record = json.loads((run_dir / "run_config.json").read_text())
        assert "optimization" in record["config"]
        record["config"] = {k: v for section in record["config"].values() for k, v in section.items()}
        (run_dir / "run_config.json").write_text(json.dumps(record))

    resumed = cli("train", "--backbone", tiny_backbone, "--output-dir", run_dir, *TRAIN, "--resume", "auto", cwd=tmp_path, env=ONE_THREAD)
    assert f"[resume] from step {resumed_from}" in resumed.stdout + resumed.stderr

    final, reference = checkpoints / "step_00000006", uninterrupted / "checkpoints" / "step_00000006"
    for name in ("trainable.safetensors", "buffers.safetensors"):
        a, b = load_file(str(final / name)), load_file(str(reference / name))
        assert a.keys() == b.keys()
        for key in a:
            assert torch.equal(a[key], b[key]), f"{name}:{key} differs after resuming"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step_00000002", "step_00000004", "step_00000006"]

    got, want = _records(run_dir), _records(uninterrupted)
    assert got.keys() == want.keys()
    for key, records in got.items():
        # steps replayed after the crash are logged twice; both copies equal the uninterrupted run
        for record in records:
            assert record == want[key][0], f"{key} differs"


def test_resume_with_another_aggregation_mode_is_refused(cli, tiny_backbone, uninterrupted, tmp_path):
    proc = cli("train", "--backbone", tiny_backbone, "--output-dir", uninterrupted, *TRAIN, "--resume", "auto",
               "--reconstruction-loss-token-aggregation-mode", "sum", cwd=tmp_path, check=False)
    assert proc.returncode == 2
    assert "reconstruction_loss_token_aggregation_mode changed" in proc.stderr and "'mean'" in proc.stderr and "'sum'" in proc.stderr


# --kl-delay-mode read: the delay is checked after every step from step 3 (0.3 x 10) to its cap at step 6 (0.6 x 10)
READ_DELAY = ["--max-steps", "10", "--kl-delay-mode", "read", "--kl-delay-fraction", "0.3", "--kl-delay-max-fraction", "0.6",
              "--kl-ramp-fraction", "0.2", "--kl-delay-check-every", "1"]


def test_a_run_killed_inside_an_evidence_based_kl_delay_resumes_it_bitwise(cli, tiny_backbone, tmp_path):
    """Killed after step 4, with two checks recorded and the delay still on: the resumed run checks at the steps
    the uninterrupted one did, ends the delay at the same step for the same reason, and ends with the same weights."""
    args = [*TRAIN, *READ_DELAY]
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    cli("train", "--backbone", tiny_backbone, "--output-dir", straight, *args, cwd=tmp_path, env=ONE_THREAD)
    proc = cli("train", "--backbone", tiny_backbone, "--output-dir", killed, *args, cwd=tmp_path, check=False,
               env={**ONE_THREAD, "ZCVAE_DEBUG_KILL_AT_STEP": "4"})
    assert proc.returncode == -9, proc.stderr[-3000:]
    meta = json.loads((killed / "checkpoints" / "step_00000004" / "meta.json").read_text())
    assert meta["trainer_state"]["kl_delay"]["ended_at"] is None and len(meta["trainer_state"]["kl_delay"]["checks"]) == 2

    resumed = cli("train", "--backbone", tiny_backbone, "--output-dir", killed, *args, "--resume", "auto", cwd=tmp_path, env=ONE_THREAD)
    assert "[resume] from step 4" in resumed.stdout + resumed.stderr

    got, want = _records(killed), _records(straight)
    checks = sorted(step for split, step in want if split == "kl_delay")
    assert checks[0] == 3 and checks[-1] <= 6  # the delay ended by its cap at the latest
    assert "ended_at" in want[("kl_delay", checks[-1])][0]
    assert got.keys() == want.keys()
    for key, records in got.items():
        for record in records:
            assert record == want[key][0], f"{key} differs"
    for name in ("trainable.safetensors", "buffers.safetensors"):
        a = load_file(str(killed / "checkpoints" / "step_00000010" / name))
        b = load_file(str(straight / "checkpoints" / "step_00000010" / name))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name
    verdict = json.loads((killed / "verdict.json").read_text())
    assert verdict["kl_delay"] == json.loads((straight / "verdict.json").read_text())["kl_delay"] is not None
