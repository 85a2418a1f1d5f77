"""The phases of a run outside its optimizer steps (loading, the engine, the reference and c_base passes,
evaluation): each named, timed, reported while it runs, and stoppable by SIGTERM/SIGUSR1 within seconds.

At scale, loading a backbone and its reference pass take many minutes before step 1, and evaluation takes
minutes between steps. The step loop's preemption (``guards.StepGuard``) agrees on a stop at a step
boundary, which these phases do not have: a signal there would wait for step 1, i.e. until the
scheduler's SIGKILL. Here instead:

* ``with phases.phase("the reference pass"):`` names what runs; a phase over :data:`REPORT_AFTER_S`
  says how long it took.
* ``phases.tick(done, total)``, called by the passes after each batch (every rank at the same points,
  since each runs as many forwards), all-reduces the stop flag: the ranks agree on the same tick, so none
  is left in a collective that the others never join. On rank 0 it also prints a progress line (done,
  total, rate) at most every :data:`PROGRESS_EVERY_S`, the first at once.
* An agreed stop raises :class:`~zcvae.loop.guards.PhaseStopped` (exit 75) naming the signal and the
  phase. Nothing is half-written: the reference store writes atomically, and nothing else is written
  before step 1. A stop during an evaluation between steps is turned into a checkpoint by the loop.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator

import torch

from zcvae.loop.guards import PhaseStopped, StopSignals

logger = logging.getLogger(__name__)

__all__ = ["PROGRESS_EVERY_S", "REPORT_AFTER_S", "SetupPhases"]

PROGRESS_EVERY_S = 10.0
REPORT_AFTER_S = 60.0


class SetupPhases:
    """Named phases with agreed stops and progress lines (see the module docstring).

    ``signals``: the run's :class:`StopSignals` (None: nothing stops; progress and timing only).
    ``reduce_max``: the all-reduce (max) of a float64 tensor
    over the ranks, or None at world size 1."""

    def __init__(self, signals: StopSignals | None, *, reduce_max: Callable[[torch.Tensor], torch.Tensor] | None = None,
                 progress_every_s: float = PROGRESS_EVERY_S, report_after_s: float = REPORT_AFTER_S,
                 clock: Callable[[], float] = time.monotonic):
        self.signals, self.reduce_max = signals, reduce_max
        self.progress_every_s, self.report_after_s, self.clock = progress_every_s, report_after_s, clock
        self.current = "setup"
        self.before_step = 1  # the step the run has not reached yet
        # what the stop line tells the user to do next (the trainer sets it once it knows about a resume)
        self.hint = "nothing to save; the same command starts the run again"
        self._started = self._last_line = 0.0

    @classmethod
    def for_process_group(cls, signals: StopSignals | None) -> "SetupPhases":
        """Agreeing over the default process group when there is one of more than one rank."""
        import torch.distributed as dist

        from zcvae.distributed import dist_info

        if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
            return cls(signals)
        device = dist_info().device

        def reduce_max(t: torch.Tensor) -> torch.Tensor:
            t = t.to(device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            return t.cpu()

        return cls(signals, reduce_max=reduce_max)

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Run the block as phase ``name``: an agreed stop check on entry and on exit; its duration
        said when it took longer than ``report_after_s``."""
        outer, outer_started = self.current, self._started
        self.current, self._started = name, self.clock()
        self._last_line = self._started - self.progress_every_s  # the first progress line comes at once
        try:
            self.check()
            yield
            self.check()
        finally:
            took = self.clock() - self._started
            if took >= self.report_after_s:
                logger.info(f"[setup] {name}: {_duration(took)}")
            self.current, self._started = outer, outer_started

    def tick(self, done: int, total: int, unit: str = "examples") -> None:
        """After a unit of work of the current phase (every rank alike): agree on a stop, maybe print progress."""
        self.check()
        now = self.clock()
        if now - self._last_line >= self.progress_every_s or done >= total:
            elapsed = now - self._started
            rate = f", {done / elapsed:.1f}/s" if elapsed > 0 and done else ""
            logger.info(f"[setup] {self.current}: {done}/{total} {unit}{rate}")
            self._last_line = now

    def check(self) -> None:
        """Raise :class:`PhaseStopped` on every rank when any rank received a stop signal (collective)."""
        received = self.signals.received if self.signals is not None else None
        if self.reduce_max is not None:
            flag = self.reduce_max(torch.tensor([1.0 if received else 0.0], dtype=torch.float64))
            stop = float(flag[0]) > 0
        else:
            stop = received is not None
        if stop:
            what = received or "a signal on another rank"
            raise PhaseStopped(f"stopped by {what} during {self.current}, before step {self.before_step}: {self.hint}",
                               phase=self.current, step=self.before_step - 1)


def _duration(seconds: float) -> str:
    minutes, s = divmod(int(round(seconds)), 60)
    return f"took {minutes} min {s} s" if minutes else f"took {s} s"
