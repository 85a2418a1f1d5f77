"""SIGTERM during setup at world 2 (gloo): torchrun forwards it to both ranks, which agree on it at the next
batch of the c_base pass (zcvae.loop.setup) and exit 75 with one line each, writing nothing; and a stale
DeepSpeed extension build lock never hangs a run (zcvae.engines.extensions)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:  # launcher sits next to this file (tests/distributed has no __init__.py)
    sys.path.insert(0, HERE)

import launcher as C  # noqa: E402

# many validation examples, one per batch: a c_base pass of seconds on the tiny backbone
SLOW_C_BASE = ["--task", "copy", "--num-train-examples", "16", "--num-val-examples", "3000", "--num-eval-decode-examples", "0",
               "--micro-batch-size", "1", "--max-steps", "2", "--reference-policy", "online", "--no-progress-bar"]


def test_sigterm_in_the_c_base_pass_of_two_ranks_exits_75_within_10_s_with_one_line_each(tiny_backbone, tmp_path):
    run_dir = tmp_path / "run"
    cmd = C.torchrun_cmd("train", "--backbone", tiny_backbone(), "--output-dir", run_dir, *SLOW_C_BASE, "--engine", "fsdp2", nproc=2)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=C.cpu_env(tmp_path / "cache"),
                            cwd=tmp_path)
    out = []
    try:
        for line in proc.stdout:
            out.append(line)
            if line.startswith("[setup] the c_base pass:"):
                break
        else:
            pytest.fail("the run never reached its c_base pass:\n" + "".join(out)[-3000:])
        proc.send_signal(signal.SIGTERM)  # as SLURM and the sbatch script do: to torchrun, which forwards it
        start = time.monotonic()
        rest, _ = proc.communicate(timeout=60)
        took = time.monotonic() - start
    finally:
        if proc.poll() is None:
            proc.kill()
    text = "".join(out) + rest
    assert took < 10, text[-3000:]
    lines = [line for line in text.splitlines() if line.startswith("zcvae train:")]
    # torchrun forwards the signal to both ranks; a rank blocked in the phase's collective runs its Python handler only
    # after the collective returns, so it may learn of the stop from the other rank first and say so
    own, other = ("stopped by SIGTERM during the c_base pass, before step 1: nothing to save",
                  "stopped by a signal on another rank during the c_base pass, before step 1: nothing to save")
    assert len(lines) == 2 and all(own in line or other in line for line in lines), text[-3000:]
    assert any(own in line for line in lines), text[-3000:]
    # the one traceback allowed is torchrun's own: its agent re-raises the signal it forwarded
    assert text.count("Traceback") == text.count("elastic.multiprocessing.api.SignalException: Process"), text[-3000:]
    assert proc.returncode != 0  # torchrun's own code; the sbatch script requeues any non-zero after a stop it forwarded
    assert not (run_dir / "run_config.json").exists() and not (run_dir / "checkpoints").exists()
    assert not (run_dir / "zcvae.lock").exists()


def _built_extensions(env) -> "os.PathLike | None":
    from zcvae.engines.extensions import extensions_dir

    root, _ = extensions_dir(env)
    built = root / "deepspeed_shm_comm"
    return built if built.is_dir() and list(built.glob("*.so")) and not (built / "lock").exists() else None


@pytest.mark.parametrize("chosen_by_user", [False, True])
def test_a_stale_deepspeed_build_lock_is_removed_or_named_within_60_s(tiny_backbone, tmp_path, chosen_by_user):
    env = C.cpu_env(tmp_path / "cache")
    env.pop("TORCH_EXTENSIONS_DIR", None)
    env["XDG_CACHE_HOME"] = str(tmp_path / "xdg")
    if chosen_by_user:
        env["TORCH_EXTENSIONS_DIR"] = str(tmp_path / "mine")
    from zcvae.engines.extensions import extensions_dir

    root, _ = extensions_dir(env)
    # the op already built for this environment, copied, so the run does not compile it again (if it is not built yet, it builds)
    built = _built_extensions({k: v for k, v in os.environ.items() if k != "TORCH_EXTENSIONS_DIR"})
    build = root / "deepspeed_shm_comm"
    if built is not None:
        shutil.copytree(built, build)
    build.mkdir(parents=True, exist_ok=True)
    lock = build / "lock"
    lock.touch()
    old = time.time() - 600
    os.utime(lock, (old, old))

    run_dir = tmp_path / "run"
    cmd = C.zcvae_cmd("train", "--backbone", tiny_backbone(), "--output-dir", run_dir, "--task", "copy", "--num-train-examples", "8",
                      "--num-val-examples", "4", "--num-eval-decode-examples", "0", "--micro-batch-size", "2", "--max-steps", "1",
                      "--engine", "deepspeed", "--deepspeed-config", "zero2", "--no-progress-bar")
    start = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    text = proc.stdout + proc.stderr
    if chosen_by_user:  # another host may build there: named, never removed
        assert proc.returncode == 2 and time.monotonic() - start < 60, text[-3000:]
        lines = [line for line in text.splitlines() if line.startswith("zcvae train:")]
        assert len(lines) == 1 and f"rm {lock}" in lines[0] and "Traceback" not in text, text[-3000:]
        assert lock.exists()
    else:
        assert proc.returncode == 0, text[-3000:]
        assert f"removed a stale extension build lock {lock}" in text
        assert (run_dir / "checkpoints").is_dir()
