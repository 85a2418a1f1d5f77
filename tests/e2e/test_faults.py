"""The second fault catalogue (issue 23): what a cluster user meets, through the real CLI.

Concurrent writers and SIGTERM run as real ``python -m zcvae`` processes; the rest call
``zcvae.commands.cli.main`` in this process (an uncaught exception fails the test as a traceback would
fail a user). Every case checks the exit code, that no traceback is printed, the words of the one line,
and that nothing earlier was lost and no lock or temporary file was left behind. The disk-full case
injects ENOSPC through the checkpoint manager's fault hook (``ZCVAE_DEBUG_ENOSPC_AT_STEP``), so it runs
everywhere; the read-only and full-filesystem cases mount a small tmpfs where this process may.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from cli_in_process import zcvae

from zcvae.commands.cli import main as cli_main
from zcvae.runs.rundir import read_run_record  # run_config.json's config, flat, of either layout

TRAIN = ["--task", "copy", "--num-train-examples", "32", "--num-val-examples", "4", "--num-eval-decode-examples", "2",
         "--micro-batch-size", "4", "--max-steps", "4", "--log-every", "3", "--warmup-steps", "1", "--no-progress-bar"]
# one BLAS/OpenMP thread: bitwise comparisons across processes (see test_resume.py)
ONE_THREAD = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "MKL_DYNAMIC": "FALSE"}


def ends_with_one_line(rc: int, out: str, code: int, *words: str) -> str:
    assert rc == code, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    lines = [line for line in out.splitlines() if line.startswith("zcvae ")]
    assert len(lines) == 1, out[-3000:]
    for word in words:
        assert word in lines[0], f"{word!r} not in {lines[0]!r}"
    return lines[0]


def no_leftovers(run_dir: Path) -> None:
    assert not (run_dir / "zcvae.lock").exists()
    assert not list(run_dir.glob("checkpoints/*.tmp"))


def steps_of(run_dir: Path) -> list[str]:
    return sorted(p.name for p in (run_dir / "checkpoints").iterdir())


@pytest.fixture(scope="module")
def run(tiny_backbone, tmp_path_factory, env):
    """(run dir, output) of a finished 4-step run (checkpoints at 2 and 4) on 4 validation examples."""
    import contextlib
    import io

    run_dir = tmp_path_factory.mktemp("faults") / "run"
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer), contextlib.redirect_stderr(buffer):
        rc = cli_main(["train", "--backbone", str(tiny_backbone), "--output-dir", str(run_dir), *TRAIN, "--save-every", "2"])
    assert rc == 0, buffer.getvalue()[-3000:]
    assert steps_of(run_dir) == ["step_00000002", "step_00000004"]
    return run_dir, buffer.getvalue()


def _python_zcvae(*args, env_extra=None, cwd=None) -> subprocess.Popen:
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", **ONE_THREAD, **(env_extra or {})}
    return subprocess.Popen([sys.executable, "-m", "zcvae", *map(str, args)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=env, cwd=cwd)


# ---------------------------------------------------------------------------------------------- 1. one writer
def test_01_two_writers_started_at_once_one_is_refused_naming_the_holder(tiny_backbone, tmp_path, env):
    run_dir = tmp_path / "shared"
    procs = [_python_zcvae("train", "--backbone", tiny_backbone, "--output-dir", run_dir, *TRAIN, "--seed", str(seed), cwd=tmp_path)
             for seed in (0, 1)]
    outs = [p.communicate(timeout=600)[0] for p in procs]
    codes = [p.returncode for p in procs]
    assert sorted(codes) == [0, 2], outs
    winner, loser = (0, 1) if codes[0] == 0 else (1, 0)
    line = ends_with_one_line(codes[loser], outs[loser], 2, "in use by another zcvae run", f"pid {procs[winner].pid}",
                              socket.gethostname(), "zcvae.lock")
    assert "[reference]" not in outs[loser] and "[backbone]" not in outs[loser], "refused only after loading the model"
    # one run's records only, in order; its config and checkpoints are the winner's
    steps = [(r["split"], r["step"]) for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())]
    # (the evaluation after step 3 is the end of the default's KL delay, 60% of 4 steps)
    assert steps == [("train", 3), ("eval", 3), ("train", 4), ("eval", 4)], line
    assert read_run_record(run_dir)["config"]["seed"] == winner
    no_leftovers(run_dir)


def test_01_without_flock_a_dead_holder_on_this_host_is_taken_over_or_reported_with_how_to_clear_it(tmp_path, monkeypatch):
    import fcntl

    from zcvae.runs.lock import RunLock, read_holder

    def no_flock(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_flock)
    run_dir = tmp_path / "r"
    first = RunLock(run_dir).acquire()
    assert first.mode == "soft" and read_holder(first.path)["pid"] == os.getpid()
    with pytest.raises(ValueError, match=f"in use by another zcvae run: pid {os.getpid()}"):
        RunLock(run_dir).acquire()
    first.release()
    assert not run_dir.exists()  # created by the lock, nothing written: no trace

    # filelock's record of a process on this host that died holding the lock: filelock takes it over
    run_dir.mkdir()
    dead = subprocess.run([sys.executable, "-c", "import os, sys, filelock; held = filelock.SoftFileLock(sys.argv[1]); "
                           "held.acquire(); print(os.getpid()); os._exit(0)", str(run_dir / "zcvae.lock")], capture_output=True, text=True, check=True)
    assert read_holder(run_dir / "zcvae.lock")["pid"] == int(dead.stdout)
    lock = RunLock(run_dir).acquire()
    assert read_holder(lock.path)["pid"] == os.getpid()
    lock.release()
    # a JSON record of a dead process on this host (a zcvae before filelock) is not filelock's to judge
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (run_dir / "zcvae.lock").write_text(json.dumps({"host": socket.gethostname(), "pid": dead.pid, "started": "then"}))
    with pytest.raises(ValueError) as err:
        RunLock(run_dir).acquire()
    assert "stale lock" in str(err.value) and f"pid {dead.pid}" in str(err.value) and "rm " in str(err.value)
    assert (run_dir / "zcvae.lock").exists(), "a stale lock is reported, never removed silently"
    # a holder on another host is never judged, in either record
    for record in (json.dumps({"host": "elsewhere", "pid": dead.pid, "started": "then"}), f"{dead.pid}\nelsewhere\n"):
        (run_dir / "zcvae.lock").write_text(record)
        with pytest.raises(ValueError, match="on host 'elsewhere'") as err:
            RunLock(run_dir).acquire()
        assert "stale" not in str(err.value) and "only once you know that process is gone" in str(err.value)
        assert (run_dir / "zcvae.lock").read_text() == record


def test_01_a_lock_file_left_by_a_killed_run_is_taken_over_with_flock(tmp_path):
    from zcvae.runs.lock import RunLock

    run_dir = tmp_path / "r"
    run_dir.mkdir()
    (run_dir / "zcvae.lock").write_text(json.dumps({"host": socket.gethostname(), "pid": 1, "started": "then"}))
    lock = RunLock(run_dir).acquire()  # the kernel dropped the dead holder's flock
    assert lock.mode == "flock" and json.loads(lock.path.read_text())["pid"] == os.getpid()
    lock.release()
    assert run_dir.is_dir() and not lock.path.exists()


def test_01_overwrite_keeps_the_lock_while_it_moves_the_old_run_aside(run, tmp_path):
    from zcvae.runs.lock import RunLock
    from zcvae.runs.rundir import prepare_run_dir

    old = tmp_path / "old"
    shutil.copytree(run[0], old)
    lock = RunLock(old).acquire()
    inode = lock.path.stat().st_ino
    prepare_run_dir(old, resume=False, overwrite=True, is_main=True)
    assert [p.name for p in old.iterdir()] == ["zcvae.lock"] and lock.path.stat().st_ino == inode
    with pytest.raises(ValueError, match="in use"):
        RunLock(old).acquire()
    assert not list(tmp_path.glob("old.deleting-*"))
    lock.release()


# ---------------------------------------------------------------------------------------------- 2. divergence
def test_02_a_diverging_run_stops_at_once_and_its_weights_are_never_saved(tiny_backbone, tmp_path, capsys, env):
    run_dir = tmp_path / "div"
    rc, out = zcvae(capsys, "train", "--backbone", tiny_backbone, "--output-dir", run_dir, *TRAIN, "--max-steps", "6",
                    "--save-every", "1", "--lora-learning-rate", "1e30", "--latent-learning-rate", "1e30")
    line = ends_with_one_line(rc, out, 3, "training diverged at step 2", "nan", "last finite values at step 1", "loss", "grad_norm")
    assert "posterior_NK" not in out
    assert steps_of(run_dir) == ["step_00000001"], line
    for name in ("trainable.safetensors", "buffers.safetensors"):
        for key, tensor in load_file(str(run_dir / "checkpoints" / "step_00000001" / name)).items():
            assert torch.isfinite(tensor).all(), key
    assert not (run_dir / "eval_step6.json").exists()
    no_leftovers(run_dir)
    rc, out = zcvae(capsys, "aggregate", run_dir)
    assert rc == 0 and "no evaluation in metrics.jsonl yet" in out, out


def test_02_export_refuses_non_finite_weights(run, tmp_path, capsys, env):
    from zcvae.runs.checkpoint import COMPLETE, _manifest

    run_dir = tmp_path / "nan"
    shutil.copytree(run[0], run_dir)
    ckpt = run_dir / "checkpoints" / "step_00000004"
    weights = load_file(str(ckpt / "trainable.safetensors"))
    name = sorted(weights)[0]
    weights[name] = torch.full_like(weights[name], float("nan"))
    save_file(weights, str(ckpt / "trainable.safetensors"))
    # a checkpoint whose manifest is consistent, as one saved by a zcvae without the guard would be
    (ckpt / COMPLETE).write_text(json.dumps({"format": 1, "step": 4, "files": _manifest(ckpt)}))
    rc, out = zcvae(capsys, "export", run_dir, "--out", tmp_path / "e")
    ends_with_one_line(rc, out, 2, "non-finite weights", name, "diverged")
    assert not (tmp_path / "e").exists() and not (tmp_path / "e.tmp").exists()


class _OneRank:
    """The one engine method the step guard uses, for a single process."""

    device = torch.device("cpu")

    def all_reduce(self, tensor, op="sum"):
        return tensor.clone()


def _step_terms(loss: float) -> tuple[dict, torch.Tensor]:
    value = torch.tensor([loss, loss])
    return {"valid": torch.ones(2), "weighted_reconstruction_loss": value, "kl": torch.zeros(2)}, value.sum() / 2


def test_02_skip_nonfinite_steps_passes_over_n_steps_logging_each_then_stops(logged):
    from zcvae.loop.guards import StepGuard, TrainingDiverged
    guard = StepGuard(skip_budget=2)
    count = torch.tensor(2.0)
    guard.add(*_step_terms(1.5))
    assert guard.check(_OneRank(), step=1, grad_norm=0.5, global_count=count) == "ok"
    for step in (2, 3):
        guard.add(*_step_terms(float("nan")))
        assert guard.check(_OneRank(), step=step, grad_norm=float("nan"), global_count=count) == "skipped"
    assert [line.split(":")[0] for line in logged] == ["[guard] step 2", "[guard] step 3"]
    assert "update skipped (2 of --skip-nonfinite-steps 2)" in logged[-1]
    guard.add(*_step_terms(float("inf")))
    with pytest.raises(TrainingDiverged, match="at step 4: weighted_reconstruction_loss is inf") as err:
        guard.check(_OneRank(), step=4, grad_norm=float("nan"), global_count=count)
    assert "last finite values at step 1: loss 1.5, grad_norm 0.5" in str(err.value) and "2 earlier" in str(err.value)
    # a non-finite loss whose update did happen (finite gradient norm) is never passed over
    guard = StepGuard(skip_budget=5)
    guard.add(*_step_terms(float("nan")))
    with pytest.raises(TrainingDiverged, match="no step before it was finite"):
        guard.check(_OneRank(), step=1, grad_norm=0.1, global_count=count)


# ---------------------------------------------------------------------------------------------- 3. preemption
def _wait_for_holder(run_dir: Path, proc: subprocess.Popen) -> None:
    lock = run_dir / "zcvae.lock"
    for _ in range(6000):
        if proc.poll() is not None:
            raise AssertionError(f"exited {proc.returncode} before taking the lock:\n{proc.stdout.read()[-3000:]}")
        try:
            if json.loads(lock.read_text() or "{}").get("pid") == proc.pid:
                return
        except (OSError, ValueError):
            pass
        time.sleep(0.01)
    raise AssertionError("the run never took its lock")


def _wait_for_step(run_dir: Path, proc: subprocess.Popen | None = None) -> None:
    """Until the run logged a training step: its setup is over (a signal before that stops it in setup)."""
    metrics = run_dir / "metrics.jsonl"
    for _ in range(60000):
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"exited {proc.returncode} before its first step:\n{proc.stdout.read()[-3000:]}")
        try:
            if any(json.loads(line).get("split") == "train" for line in metrics.read_text().splitlines() if line.strip()):
                return
        except (OSError, ValueError):
            pass
        time.sleep(0.01)
    raise AssertionError("the run never logged a step")


def _stopped_step(line: str, signame: str, max_steps: int) -> int:
    import re

    m = re.search(rf"stopped by {signame} after step (\d+) of {max_steps}", line)
    assert m is not None, line
    return int(m.group(1))


STEPS_03 = 40  # tiny steps: the signal, sent after step 1 was logged, lands well before the last one


def test_03_sigterm_saves_at_an_agreed_step_and_resume_is_bitwise(tiny_backbone, tmp_path, capsys, env, monkeypatch):
    # one thread here as in the real process, so the three runs sum in the same order
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        args = ["train", "--backbone", tiny_backbone, *TRAIN, "--max-steps", str(STEPS_03), "--save-every", "0", "--log-every", "1"]
        run_dir = tmp_path / "preempted"
        proc = _python_zcvae(*args, "--output-dir", run_dir, cwd=tmp_path)
        _wait_for_step(run_dir, proc)
        proc.send_signal(signal.SIGTERM)
        out = proc.communicate(timeout=600)[0]
        line = ends_with_one_line(proc.returncode, out, 75, "stopped by SIGTERM after step", "--resume auto")
        step = _stopped_step(line, "SIGTERM", STEPS_03)
        assert 1 <= step < STEPS_03 and f"step_{step:08d}" in line
        assert steps_of(run_dir) == [f"step_{step:08d}"], line  # no step lost: saved where it stopped
        no_leftovers(run_dir)

        rc, out = zcvae(capsys, *args, "--output-dir", run_dir, "--resume", "auto")
        assert rc == 0 and f"[resume] from step {step}" in out, out[-3000:]
        rc, out = zcvae(capsys, *args, "--output-dir", tmp_path / "straight")
        assert rc == 0, out[-3000:]
    finally:
        torch.set_num_threads(threads)
    final = f"step_{STEPS_03:08d}"
    for name in ("trainable.safetensors", "buffers.safetensors"):
        a = load_file(str(run_dir / "checkpoints" / final / name))
        b = load_file(str(tmp_path / "straight" / "checkpoints" / final / name))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name


def test_03_sigusr1_stops_the_same_way(tiny_backbone, tmp_path, capsys, env):
    run_dir = tmp_path / "usr1"

    def send_after_a_step():
        _wait_for_step(run_dir)
        os.kill(os.getpid(), signal.SIGUSR1)

    sender = threading.Thread(target=send_after_a_step, daemon=True)
    sender.start()
    rc, out = zcvae(capsys, "train", "--backbone", tiny_backbone, "--output-dir", run_dir, *TRAIN, "--max-steps", str(STEPS_03),
                    "--log-every", "1", "--save-every", "0")
    sender.join()
    step = _stopped_step(ends_with_one_line(rc, out, 75, "stopped by SIGUSR1 after step"), "SIGUSR1", STEPS_03)
    assert steps_of(run_dir) == [f"step_{step:08d}"]
    assert signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL, "the handlers are restored after the run"
    no_leftovers(run_dir)


def test_03_sigterm_in_setup_stops_at_once_naming_the_phase_and_writes_nothing(tiny_backbone, tmp_path, env):
    run_dir = tmp_path / "setup"
    proc = _python_zcvae("train", "--backbone", tiny_backbone, *TRAIN, "--output-dir", run_dir, cwd=tmp_path)
    _wait_for_holder(run_dir, proc)  # the handlers are in place before the lock names the process: setup has begun
    proc.send_signal(signal.SIGTERM)
    start = time.monotonic()
    out = proc.communicate(timeout=120)[0]
    assert time.monotonic() - start < 10, out[-3000:]
    ends_with_one_line(proc.returncode, out, 75, "stopped by SIGTERM during", "before step 1", "nothing to save")
    assert not (run_dir / "checkpoints").exists() or not list((run_dir / "checkpoints").iterdir())
    assert not (run_dir / "run_config.json").exists()
    no_leftovers(run_dir)


def test_03_ctrl_c_inside_a_save_is_one_line_and_removes_its_tmp(tiny_backbone, tmp_path, capsys, env, monkeypatch):
    import zcvae.train.trainer as trainer

    def interrupt_in_save(event, step):
        if event == "files_written" and step == 2:
            raise KeyboardInterrupt

    monkeypatch.setattr(trainer, "fault_injection_from_env", lambda: interrupt_in_save)
    run_dir = tmp_path / "ctrlc"
    rc, out = zcvae(capsys, "train", "--backbone", tiny_backbone, "--output-dir", run_dir, *TRAIN, "--save-every", "1")
    ends_with_one_line(rc, out, 130, "interrupted (Ctrl-C)", "--resume auto")
    assert steps_of(run_dir) == ["step_00000001"]
    no_leftovers(run_dir)


def test_03_the_sbatch_template_asks_for_the_early_signal_and_requeues_on_the_stop_code():
    from zcvae.sweep.slurm import DEFAULT_TEMPLATE
    from zcvae.loop.guards import EXIT_PREEMPTED

    text = DEFAULT_TEMPLATE.read_text()

    assert "#SBATCH --signal=B:USR1@" in text and "#SBATCH --requeue" in text
    assert f"PREEMPTED_EXIT={EXIT_PREEMPTED}" in text and 'scontrol requeue "$SLURM_JOB_ID"' in text
    assert "trap forward_stop USR1 TERM" in text


# ---------------------------------------------------------------------------------------------- 4. resume changes
def test_04_a_changed_objective_field_is_refused_naming_it_or_allowed_and_recorded(run, tiny_backbone, copy_of, capsys, env):
    run_dir = copy_of(run[0])
    resume = ["train", "--backbone", tiny_backbone, "--output-dir", run_dir, *TRAIN, "--resume", "auto", "--max-steps", "6"]
    before = (run_dir / "run_config.json").read_text()
    rc, out = zcvae(capsys, *resume, "--posterior-pooling", "last")  # the run has the default preset's mean pooling
    ends_with_one_line(rc, out, 2, "posterior_pooling changed", "'mean'", "'last'", "--resume-allow-change posterior_pooling")
    rc, out = zcvae(capsys, *resume, "--resume-allow-change", "num_latents")
    ends_with_one_line(rc, out, 2, "num_latents cannot change on resume")
    assert (run_dir / "run_config.json").read_text() == before
    no_leftovers(run_dir)

    rc, out = zcvae(capsys, *resume, "--kl-weight", "2", "--resume-allow-change", "kl_weight")
    assert rc == 0 and "Traceback" not in out, out[-3000:]
    assert "max_steps 4 -> 6: the schedule's fractions" in out and "kl_weight 1.0 -> 2.0 from step 4" in out
    record = read_run_record(run_dir)
    assert record["resume_changes"] == [{"field": "kl_weight", "from": 1.0, "to": 2.0, "step": 4}]
    assert record["config"]["kl_weight"] == 2.0
    # the first record after the resume averages steps 5-6 only, and says so
    train = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if '"train"' in line]
    assert [(r["step"], r.get("window_steps")) for r in train] == [(3, None), (4, None), (6, 2)]


# ---------------------------------------------------------------------------------------------- 5. evaluation
def test_05_gold_metrics_with_too_few_labels_are_absent_with_a_warning(run):
    run_dir, out = run
    assert "[eval] gold-strategy metrics" in out and "fewer than 8" in out
    final = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if '"eval"' in line][-1]
    assert "nmi" not in final and "ari" not in final and final["num_labelled_examples"] == 4
    assert not any(k.startswith("by_strategy/") and k.endswith("/nmi") for k in final)
    assert "fewer than 8" in json.loads((run_dir / "eval_step4.json").read_text())["gold_metrics_absent"]


def test_05_the_label_thresholds():
    from zcvae.eval.summary import gold_labels_problem

    assert gold_labels_problem([None] * 20) is None
    assert gold_labels_problem(["a"] * 4 + ["b"] * 4) is None
    assert "fewer than 8" in gold_labels_problem(["a"] * 4 + ["b"] * 3)
    assert "strategy c has fewer than 2" in gold_labels_problem(["a"] * 4 + ["b"] * 4 + ["c"])


# ---------------------------------------------------------------------------------------------- 6. limits
def test_06_max_length_beyond_the_backbones_positions_is_refused(tiny_backbone, tmp_path, capsys, env):
    rc, out = zcvae(capsys, "train", "--backbone", tiny_backbone, "--output-dir", tmp_path / "r", *TRAIN, "--max-length", "200")
    ends_with_one_line(rc, out, 2, "max_length 200 exceeds the backbone's 128 positions", "--max-length 128")
    assert not (tmp_path / "r").exists()


def test_06_the_latent_figure_of_many_latents_shows_the_most_used(tmp_path):
    import numpy as np
    from PIL import Image

    from zcvae.eval.figures import MAX_FIGURE_ROWS, plot_latent_figure

    usage = np.zeros(1000)
    usage[[7, 500]] = [0.6, 0.4]
    path = plot_latent_figure(np.ones((1000, 3)), list(range(1000)), ["a", "b", "c"], usage, tmp_path / "latents.png")
    width, height = Image.open(path).size
    assert height <= 100 * (2.0 + 0.45 * MAX_FIGURE_ROWS) + 1 and width < 2000
    assert not list(tmp_path.glob("*.tmp"))


@pytest.mark.parametrize("local", [True, False])
def test_06_a_sweep_with_an_unknown_task_fails_at_dry_run(tmp_path, capsys, local):
    family = tmp_path / "fam.yaml"
    mode = "  reconstruction_loss_token_aggregation_mode: mean\n"
    family.write_text("base:\n  task: nosuch\n  max_steps: 2\n" + mode + "grid:\n  seed: [0, 1]\n")
    where = ["--local", "--output-dir", tmp_path / "o"] if local else ["--out", tmp_path / "o"]
    rc, out = zcvae(capsys, "sweep", family, *where, "--dry-run")
    assert rc == 2 and "unknown task 'nosuch'" in out and "Traceback" not in out, out
    family.write_text("base:\n  task: copy\n  max_stepz: 2\n" + mode)
    rc, out = zcvae(capsys, "sweep", family, *where, "--dry-run")
    assert rc == 2 and "max_stepz" in out, out
    assert not (tmp_path / "o").exists()


# ---------------------------------------------------------------------------------------------- 7. disks
def test_07_a_disk_that_fills_during_a_checkpoint_is_one_line_and_resume_continues(tiny_backbone, tmp_path, capsys, env, monkeypatch):
    run_dir = tmp_path / "full"
    args = ["train", "--backbone", tiny_backbone, "--output-dir", run_dir, *TRAIN, "--save-every", "2"]
    monkeypatch.setenv("ZCVAE_DEBUG_ENOSPC_AT_STEP", "4")
    rc, out = zcvae(capsys, *args)
    ends_with_one_line(rc, out, 2, "no space left on device while writing checkpoint", "step_00000004.tmp", "bytes",
                       "earlier checkpoints are intact")
    assert steps_of(run_dir) == ["step_00000002"]
    no_leftovers(run_dir)
    monkeypatch.delenv("ZCVAE_DEBUG_ENOSPC_AT_STEP")
    rc, out = zcvae(capsys, *args, "--resume", "auto")
    assert rc == 0 and "[resume] from step 2" in out, out[-3000:]
    assert steps_of(run_dir) == ["step_00000002", "step_00000004"]


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 4 KiB tmpfs at tmp_path/mnt, where this process may mount one (root on Linux); else skip."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    if shutil.which("mount") is None or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4k", "tmpfs", str(mnt)],
                                                        capture_output=True).returncode != 0:
        pytest.skip("cannot mount a tmpfs here")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def test_07_a_real_full_and_read_only_filesystem(run, tiny_backbone, small_tmpfs, capsys, env):
    run_dir = run[0]
    rc, out = zcvae(capsys, "export", run_dir, "--out", small_tmpfs / "e")
    ends_with_one_line(rc, out, 2, "no space left on device", str(small_tmpfs / "e.tmp"))
    assert list(small_tmpfs.iterdir()) == []
    from zcvae.runs.rundir import atomic_write_text, describe_disk_error

    with pytest.raises(OSError) as err:  # run_config.json on a full disk (the resume after a full disk)
        atomic_write_text(small_tmpfs / "run_config.json", "x" * 100_000)
    assert str(small_tmpfs / "run_config.json") in describe_disk_error(err.value)
    assert list(small_tmpfs.iterdir()) == []

    assert subprocess.run(["mount", "-o", "remount,ro", str(small_tmpfs)], capture_output=True).returncode == 0
    rc, out = zcvae(capsys, "export", run_dir, "--out", small_tmpfs / "e")
    ends_with_one_line(rc, out, 2, "--out", str(small_tmpfs / "e"), "read-only")
    rc, out = zcvae(capsys, "evaluate", run_dir, "--output", small_tmpfs / "m.json")
    ends_with_one_line(rc, out, 2, "evaluate output", "read-only")
    rc, out = zcvae(capsys, "train", "--backbone", tiny_backbone, "--output-dir", small_tmpfs, *TRAIN, "--resume", "auto")
    ends_with_one_line(rc, out, 2, "not writable", str(small_tmpfs))


# ---------------------------------------------------------------------------------------------- 8. the rest
@pytest.mark.parametrize("size", [24, 1000])
def test_08_a_truncated_gguf_is_one_line_and_leaves_no_cache_lock(tiny_backbone, tmp_path, capsys, env, size):
    pytest.importorskip("gguf")
    cut = tmp_path / "model.gguf"
    cut.write_bytes((b"GGUF\x03\x00\x00\x00" + bytes(range(256)) * 4)[:size])
    rc, out = zcvae(capsys, "convert-gguf", cut)
    ends_with_one_line(rc, out, 2, "not a readable GGUF file", "truncated", f"{size} bytes")
    rc, out = zcvae(capsys, "train", "--backbone", cut, "--output-dir", tmp_path / "r", *TRAIN)
    ends_with_one_line(rc, out, 2, "not a readable GGUF file")
    assert not list(env.rglob("*.lock")) and not (tmp_path / "r").exists()


def test_08_a_learning_rate_that_overflows_adam_is_refused(tiny_backbone, tmp_path, capsys, env):
    rc, out = zcvae(capsys, "train", "--backbone", tiny_backbone, "--output-dir", tmp_path / "r", *TRAIN, "--lora-learning-rate", "1e38")
    ends_with_one_line(rc, out, 2, "lora_learning_rate 1e+38 overflows float32")
    assert not (tmp_path / "r").exists()


def test_08_rough_edges(run, tmp_path, capsys, env):
    empty = tmp_path / "empty"
    empty.mkdir()
    rc, out = zcvae(capsys, "aggregate", empty)
    assert rc == 2 and "Traceback" not in out, out
    rc, out = zcvae(capsys, "sweep", tmp_path / "nope.yaml", "--local", "--output-dir", tmp_path / "o", "--dry-run")
    ends_with_one_line(rc, out, 2, "family file", "nope.yaml", "cannot be read")
    rc, out = zcvae(capsys, "export", run[0], "--out", tmp_path / "e")
    assert rc == 0, out[-3000:]
    rc, out = zcvae(capsys, "encode", tmp_path / "e", "--x", "a b", "--y", "a <unk> b")
    ends_with_one_line(rc, out, 2, "special token '<unk>'")
