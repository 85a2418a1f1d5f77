"""Run a family's runs on this machine: each as its own ``zcvae train`` process, as a SLURM job would.

    zcvae sweep FAMILY.yaml --local --output-dir DIR [--task T] [--jobs N] [--dry-run]

Runs whose final evaluation exists are skipped (an interrupted sweep resumes where it stopped) and an
unfinished run continues from its newest complete checkpoint (``--resume auto``). Before any run starts,
the backbones they need are built here: the family's entangled stages and the cached built-in backbones.

There is one way to run: a subprocess per run, ``jobs`` at a time. With ``jobs == 1`` the run writes to this
terminal (its progress bar included) and takes every core; with more, each run logs to
``<run dir>/train.log`` and runs on one thread (``ZCVAE_START_THREADS=1``; a family's ``follow_cores: true`` lets
it follow the cores the others leave free, at the price of numbers that depend on them).
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO

from zcvae.sweep.family import Run, stage_status, stages_of
from zcvae.sweep.flags import command_args

logger = logging.getLogger(__name__)

TRAIN_LOG = "train.log"
_POLL_S = 0.2


def run_finished(run: Run) -> bool:
    """Whether ``run`` already has its final evaluation (an eval record at its last step)."""
    from zcvae.config import OptimizationSection
    from zcvae.runs.rundir import RUN_CONFIG, final_eval_metrics

    run_dir = Path(run.params["output_dir"])
    if not (run_dir / RUN_CONFIG).is_file():
        return False
    max_steps = int(run.params.get("max_steps", OptimizationSection.max_steps))
    return final_eval_metrics(run_dir)[0] == max_steps


# Fields that name a file: compared as the files they resolve to (a family may give them relative).
_PATH_FIELDS = ("backbone", "train_data", "val_data", "deepspeed_config")


def finished_run_mismatch(run: Run) -> str | None:
    """Why the finished run in ``run``'s directory is not the run the family asks for, or None.

    Run names list only the fields a family varies, so a family whose ``base`` changed (another task, K
    or budget under the same output directory) plans runs with the names of the finished ones. Skipping
    them would table the old runs as the new family's. Every field the family sets for the run (with the
    objective preset's weights) is compared with the run's ``run_config.json``; where and how a run logs
    (the fields run names leave out) are not compared."""
    from zcvae.config import DEFAULT_PRESET, TrainConfig, expand_objective
    from zcvae.runs.naming import DEFAULT_EXCLUDE
    from zcvae.runs.rundir import read_run_record

    planned = TrainConfig.from_dict(dict(run.params), source="family", default_preset=DEFAULT_PRESET).to_dict()
    given = set(expand_objective(dict(run.params), default=DEFAULT_PRESET)) - set(DEFAULT_EXCLUDE)
    recorded = read_run_record(run.params["output_dir"])["config"]
    for name in sorted(given):
        if name not in recorded or name not in planned:
            continue
        want, have = planned[name], recorded[name]
        if name in _PATH_FIELDS and want is not None and have is not None:
            same = Path(want).resolve() == Path(have).resolve()
        else:
            same = want == have
        if not same:
            return (f"{run.params['output_dir']} holds a finished run with {name} = {have!r}, but the family asks for "
                    f"{want!r} (run names list only what a family varies); use another --output-dir, or move that run away")
    return None


def prebuild_backbones(runs: Sequence[Run]) -> None:
    """Before any run starts, build what the runs' backbones need: the family's entangled stages (one per
    task, reused when finished with the same settings; each a ``zcvae pretrain`` process, as its SLURM job
    is) and the cached built-in backbone of every other task, so that parallel runs do not race to build
    the same directory."""
    from zcvae.backbone.builtin import builtin_backbone
    from zcvae.loop.guards import EXIT_PREEMPTED, Preempted

    for directory, stage in stages_of(runs).items():
        if stage_status(stage) == "finished":
            logger.info(f"[sweep] entangled stage {directory}: finished, reused")
            continue
        logger.info(f"[sweep] entangled stage {directory}: training ({', '.join(f'{k}={v}' for k, v in sorted(stage.items()) if k != 'output_dir')})")
        # --resume auto: a stage interrupted with the sweep continues from its newest checkpoint
        code = subprocess.run([sys.executable, "-m", "zcvae", "pretrain", *command_args(stage)]).returncode
        if code == EXIT_PREEMPTED:
            raise Preempted(f"the entangled stage in {directory} stopped at a checkpoint; the same command continues it", step=0)
        if code != 0:
            raise ValueError(f"the entangled stage in {directory} failed (`zcvae pretrain` exit {code}, its error is above); "
                             f"no run was started")
    tasks = {run.params.get("task") for run in runs if run.params.get("backbone") is None and run.params.get("train_data") is None}
    for task in sorted(tasks, key=str):
        builtin_backbone(task)


def run_local(
    runs: Sequence[Run], *, jobs: int = 1, progress_bar: bool = True
) -> tuple[list[Run], list[tuple[Run, str]]]:
    """Train ``runs`` on this machine, ``jobs`` ``zcvae train`` processes at a time; return (runs trained
    now, [(failed run, why)]). A failed run does not stop the others.

    SIGTERM or SIGUSR1 to this process (a preemption) is passed on to the running runs, which save a
    checkpoint and exit; no further run starts, and :class:`~zcvae.loop.guards.Preempted` is raised once
    they have stopped (the same command resumes). A run that was itself preempted (exit 75) stops the
    sweep the same way.
    """
    from zcvae.loop.guards import Preempted, StopSignals

    if jobs < 1:
        raise ValueError(f"--jobs must be >= 1, got {jobs}")
    todo = []
    failed: list[tuple[Run, str]] = []
    for run in runs:
        if not run_finished(run):
            todo.append(run)
        elif (why := finished_run_mismatch(run)) is not None:
            logger.info(f"[sweep] {run.name}: not run: {why}")
            failed.append((run, why))  # the finished run stays as it is: nothing written is overwritten
        else:
            logger.info(f"[sweep] {run.name}: finished, skipped")
    prebuild_backbones(todo)
    done: list[Run] = []
    pending = list(todo)
    active: list[tuple[Run, subprocess.Popen, IO | None]] = []
    preempted: list[str] = []
    stop_sent: set[int] = set()
    with StopSignals() as signals:
        try:
            while pending or active:
                stopping = signals.received is not None or bool(preempted)
                while pending and len(active) < jobs and not stopping:
                    run = pending.pop(0)
                    logger.info(f"[sweep] run {len(todo) - len(pending)}/{len(todo)}: {run.name}"
                                + (f" (log: {Path(run.params['output_dir']) / TRAIN_LOG})" if jobs > 1 else ""))
                    active.append((run, *_start(run, one_at_a_time=jobs == 1, progress_bar=progress_bar)))
                if stopping:
                    pending.clear()
                    for _, proc, _ in active:
                        if proc.pid not in stop_sent:  # once: the run finishes its step, saves and exits 75
                            proc.send_signal(signal.SIGTERM)
                            stop_sent.add(proc.pid)
                time.sleep(_POLL_S)
                active = _reap(active, done=done, failed=failed, preempted=preempted)
        except KeyboardInterrupt:
            # Ctrl-C reached the runs too (one process group): let each remove its half-written checkpoint
            for _, proc, _ in active:
                proc.wait()
            raise
        if signals.received is not None or preempted:
            raise Preempted(f"stopped by {signals.received or 'a preempted run'}: {len(done)} run(s) finished, "
                            f"{len(preempted)} saved a checkpoint; the same command continues the sweep", step=0)
    return done, failed


def _reap(active, *, done: list, failed: list, preempted: list) -> list:
    """The runs of ``active`` still running; each one that ended is sorted into done, failed or preempted."""
    from zcvae.loop.guards import EXIT_PREEMPTED

    still = []
    for run, proc, handle in active:
        code = proc.poll()
        if code is None:
            still.append((run, proc, handle))
            continue
        if handle is not None:
            handle.close()
        where = f", see {Path(run.params['output_dir']) / TRAIN_LOG}" if handle is not None else ""
        if code == 0:
            done.append(run)
            logger.info(f"[sweep] {run.name}: done")
        elif code == EXIT_PREEMPTED:
            preempted.append(run.name)
            logger.info(f"[sweep] {run.name}: stopped at a checkpoint (exit {code})")
        else:
            failed.append((run, f"exit {code}{where}"))
            logger.info(f"[sweep] {run.name}: FAILED (exit {code}){where}")
    return still


def train_command(run: Run, *, progress_bar: bool) -> list[str]:
    """The command of one local run: ``zcvae train`` with the arguments of the run's SLURM script."""
    return [sys.executable, "-m", "zcvae", "train", *command_args(run.params), *([] if progress_bar else ["--no-progress-bar"])]


def _start(run: Run, *, one_at_a_time: bool, progress_bar: bool) -> tuple[subprocess.Popen, IO | None]:
    """One ``zcvae train`` process for ``run``, with the same arguments as its SLURM script.

    ``one_at_a_time``: it writes to this terminal and picks its thread count itself; else it logs to
    ``<run dir>/train.log`` and starts on one thread."""
    args = train_command(run, progress_bar=progress_bar and one_at_a_time)
    if one_at_a_time:
        return subprocess.Popen(args), None
    run_dir = Path(run.params["output_dir"])
    run_dir.mkdir(parents=True, exist_ok=True)
    handle = open(run_dir / TRAIN_LOG, "a", encoding="utf-8")
    # one thread each, so that runs started together do not each take every core (zcvae.cpu.cpu_threads:
    # fixed, so that a run's numbers do not depend on what ran beside it). A user's OMP_NUM_THREADS still wins.
    from zcvae.cpu import START_THREADS_ENV  # torch, only once a run starts

    env = {START_THREADS_ENV: "1", **os.environ, "TOKENIZERS_PARALLELISM": "false"}
    return subprocess.Popen(args, stdout=handle, stderr=subprocess.STDOUT, env=env), handle

