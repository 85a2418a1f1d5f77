"""The one launcher of the multi-process tests: run the real ``zcvae`` CLI or a worker file (plain, under
torchrun, as two "nodes") on CPU ranks over gloo, and read a run directory.

Every launch runs in its own process group (``start_new_session``) so that a timeout can kill the
torchrun agent *and* its workers; a hang fails the test that needs that run instead of stalling CI.
:func:`run_launch` runs one launch and waits; :class:`LaunchPool` starts launches in the background
with a bound on concurrent worker processes (each costs ~10-20 s of imports and several hundred MB), so
independent runs overlap while the tests that need one of them wait only for that one.

A worker file (``worker_cmd``) is a test module whose ``if __name__ == "__main__":`` branch is the rank's
code; ``cpu_env`` puts src/ and tests/ (tests/tiny_models.py) on its PYTHONPATH.
"""

from __future__ import annotations

import json
import math
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from zcvae.runs.rundir import read_run_record

HERE = Path(__file__).resolve().parent
TESTS = HERE.parent
REPO = TESTS.parent

# Variables a surrounding launcher may have set; a child must not inherit them (torchrun sets its own).
_DIST_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT",
              "TORCHELASTIC_RUN_ID", "NODE_RANK")


def cpu_env(cache_dir: str | os.PathLike | None = None) -> dict[str, str]:
    """Environment of a CPU-only child: gloo, one thread per process, src/ and tests/ importable, and
    a private ZCVAE_CACHE when ``cache_dir`` is given (a CLI run; worker files build no backbone)."""
    env = {k: v for k, v in os.environ.items() if k not in _DIST_VARS}
    env.update({
        "DS_ACCELERATOR": "cpu",
        "OMP_NUM_THREADS": "1",
        "CUDA_VISIBLE_DEVICES": "",
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONPATH": os.pathsep.join(p for p in (str(REPO / "src"), str(TESTS), env.get("PYTHONPATH", "")) if p),
    })
    if cache_dir is not None:
        env["ZCVAE_CACHE"] = str(cache_dir)
    return env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def zcvae_cmd(*args) -> list[str]:
    return [sys.executable, "-m", "zcvae", *map(str, args)]


def torchrun_cmd(*args, nproc: int = 2) -> list[str]:
    """``zcvae ARGS`` on a single node, ``nproc`` ranks; ``--standalone`` picks a free rendezvous port itself."""
    return worker_cmd("-m", "zcvae", *args, nproc=nproc)


def worker_cmd(*target, nproc: int = 2) -> list[str]:
    """torchrun of ``target`` (a worker file and its arguments, or ``-m module ...``) on ``nproc`` local ranks."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc), *map(str, target)]


def two_node_cmds(*args, port: int, run_id: str) -> list[list[str]]:
    """Two torchrun agents, one rank each, meeting over c10d on 127.0.0.1 like two hosts would."""
    return [
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "1",
         "--node_rank", str(node), "--rdzv_backend", "c10d", "--rdzv_endpoint", f"127.0.0.1:{port}",
         "--rdzv_id", run_id, "-m", "zcvae", *map(str, args)]
        for node in (0, 1)
    ]


@dataclass
class Launch:
    """One job: its commands start together (the two-node case has two) and must all exit 0."""

    name: str
    cmds: list[list[str]]
    num_workers: int
    log_dir: Path
    env: dict[str, str]
    timeout_s: float
    returncodes: list[int | None] = field(default_factory=list)
    timed_out: bool = False
    wall_s: float = 0.0
    cancelled: bool = False
    done: threading.Event = field(default_factory=threading.Event)
    _procs: list[subprocess.Popen] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def logs(self) -> list[Path]:
        return [self.log_dir / f"{self.name}.{i}.log" for i in range(len(self.cmds))]

    def tail(self, chars: int = 6000) -> str:
        parts = []
        for path in self.logs():
            text = path.read_text(errors="replace") if path.exists() else "(no log)"
            parts.append(f"--- {path.name}\n{text[-chars:]}")
        return "\n".join(parts)

    def run(self) -> None:
        start = time.monotonic()
        procs, files = self._procs, []
        try:
            for cmd, log in zip(self.cmds, self.logs()):
                f = open(log, "w")  # noqa: SIM115 - closed below
                files.append(f)
                with self._lock:
                    if self.cancelled:
                        break
                    procs.append(subprocess.Popen(cmd, env=self.env, cwd=self.log_dir, stdout=f,
                                                  stderr=subprocess.STDOUT, start_new_session=True))
            deadline = start + self.timeout_s
            for proc in procs:
                try:
                    proc.wait(timeout=max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    self.timed_out = True
                    break
            # a timeout, or one node failing while the other waits at the rendezvous: end them all
            if self.timed_out or any(p.returncode not in (None, 0) for p in procs):
                for proc in procs:
                    _kill_group(proc)
            self.returncodes = [p.wait() for p in procs]
        finally:
            for f in files:
                f.close()
            self.wall_s = time.monotonic() - start
            self.done.set()

    def cancel(self) -> None:
        with self._lock:
            if self.done.is_set():
                return
            self.cancelled = True
            for proc in self._procs:
                _kill_group(proc)

    @property
    def ok(self) -> bool:
        return (not self.timed_out and not self.cancelled and len(self.returncodes) == len(self.cmds)
                and all(rc == 0 for rc in self.returncodes))

    def failure(self) -> str:
        why = (f"timed out after {self.timeout_s:.0f} s" if self.timed_out
               else "cancelled" if self.cancelled else f"exit codes {self.returncodes}")
        return f"launch {self.name} failed ({why}):\n{self.tail()}"


def _kill_group(proc: subprocess.Popen) -> None:
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the session we created: the agent and its workers
    except ProcessLookupError:
        pass


def run_launch(name: str, *cmds: list[str], log_dir: str | os.PathLike, env: dict[str, str], timeout_s: float,
               num_workers: int = 2) -> Launch:
    """Start ``cmds`` together in ``log_dir`` (also their cwd), wait, and return the finished launch: ``ok``,
    ``timed_out``, ``failure()`` and ``tail()`` (the output of each command, in ``log_dir/NAME.I.log``)."""
    launch = Launch(name=name, cmds=list(cmds), num_workers=num_workers, log_dir=Path(log_dir), env=env, timeout_s=timeout_s)
    launch.run()
    return launch


class LaunchPool:
    """Runs launches in submission order, at most ``max_workers`` worker processes at a time."""

    def __init__(self, *, max_workers: int):
        self.max_workers = max_workers
        self.launches: dict[str, Launch] = {}
        self._queue: list[Launch] = []
        self._cv = threading.Condition()
        self._busy = 0
        self._thread: threading.Thread | None = None

    def submit(self, launch: Launch) -> None:
        assert launch.name not in self.launches, launch.name
        self.launches[launch.name] = launch
        self._queue.append(launch)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._schedule, daemon=True)
        self._thread.start()

    def _schedule(self) -> None:
        for launch in self._queue:
            with self._cv:
                # a job larger than the bound still runs, alone
                self._cv.wait_for(lambda: self._busy == 0 or self._busy + launch.num_workers <= self.max_workers)
                self._busy += launch.num_workers
            threading.Thread(target=self._run, args=(launch,), daemon=True).start()

    def _run(self, launch: Launch) -> None:
        try:
            launch.run()
        finally:
            with self._cv:
                self._busy -= launch.num_workers
                self._cv.notify_all()

    def wait(self, name: str) -> Launch:
        launch = self.launches[name]
        # the scheduler may not have started it yet; every launch ends by its own timeout
        launch.done.wait()
        return launch

    def cancel_all(self) -> None:
        """For teardown: a pending launch never starts, a running one is killed with its group."""
        for launch in self.launches.values():
            launch.cancel()


# --------------------------------------------------------------------------- run directories
def read_metrics(run_dir: str | os.PathLike) -> tuple[list[dict], list[dict]]:
    """(train records, eval records) of a run's metrics.jsonl, in file order."""
    lines = Path(run_dir, "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines if line.strip()]
    return [r for r in records if r["split"] == "train"], [r for r in records if r["split"] == "eval"]


def read_run_config(run_dir: str | os.PathLike) -> dict:
    """run_config.json with its ``config`` flat (the file keeps it in sections)."""
    return read_run_record(run_dir)


def close(a: float | None, b: float | None, *, tol: float) -> bool:
    """|a - b| <= tol * max(1, |b|): absolute near zero, relative for large values; both finite."""
    if a is None or b is None or not (math.isfinite(a) and math.isfinite(b)):
        return False
    return abs(a - b) <= tol * max(1.0, abs(b))


def compare_records(got: list[dict], want: list[dict], keys: list[str], *, tol: float, what: str) -> list[str]:
    """Mismatches (as messages) between two record lists, step by step; empty when they agree."""
    errors = []
    if [r["step"] for r in got] != [r["step"] for r in want]:
        return [f"{what}: logged steps {[r['step'] for r in got]} != {[r['step'] for r in want]}"]
    for g, w in zip(got, want):
        for key in keys:
            if key not in w or key not in g:
                errors.append(f"{what} step {w['step']}: {key} missing (got {key in g}, want {key in w})")
            elif not close(g[key], w[key], tol=tol):
                errors.append(f"{what} step {w['step']}: {key} {g[key]!r} vs {w[key]!r}")
    return errors


def cli_runs(root, runs: dict, args_of, *, env: dict[str, str], timeout_s: float = 420, max_workers: int = 5) -> "LaunchPool":
    """Started pool of one `zcvae` CLI launch per ``runs`` entry (name: (world, engine flags)): ``args_of(name,
    world, engine)`` gives its arguments; world 1 runs plainly, more under torchrun. Logs in ``root``."""
    pool = LaunchPool(max_workers=max_workers)
    for name, (world, engine) in runs.items():
        args = args_of(name, world, engine)
        cmds = [zcvae_cmd(*args)] if world == 1 else [torchrun_cmd(*args, nproc=world)]
        pool.submit(Launch(name, cmds, num_workers=world, log_dir=root, env=env, timeout_s=timeout_s))
    pool.start()
    return pool


def finished_run(pool: "LaunchPool", root, name: str):
    """``root/run-<name>`` once launch ``name`` ended; the test fails with its log when it failed."""
    import pytest

    launch = pool.wait(name)
    if not launch.ok:
        pytest.fail(launch.failure())
    return root / f"run-{name}"
