"""What stops a run early, agreed by every rank: divergence, preemption signals, and Ctrl-C.

**Divergence.** A non-finite loss or gradient norm on any rank stops the run at once: each step the
ranks all-reduce one small vector (the step's sums of the objective's terms and a stop flag), so every
rank sees the same verdict in the same step and none is left waiting in a collective. Every engine
already skips the update of a step whose gradient norm is non-finite, so the weights stay those of the
last finite step; the run then ends without saving anything (the last checkpoint stays the newest), with
one line naming the step, the term that went non-finite and the last finite values.
``--skip-nonfinite-steps N`` instead lets up to N such skipped steps pass (logging each), as large-scale
trainers do for the odd bad batch.

**Preemption.** SIGTERM (SLURM preemption, ``scancel``) and SIGUSR1 (what ``#SBATCH --signal=B:USR1@N``
sends ahead of the time limit) only set a flag; the flag rides in the same per-step reduction, so the ranks
agree on the step at which to stop: they finish that optimizer step, save a checkpoint, print one line and
exit with :data:`EXIT_PREEMPTED`. ``--resume auto`` then continues bitwise.

Outside the steps (loading, the reference and c_base passes, evaluation) the flag is agreed at the
passes' own batch boundaries instead (``zcvae.loop.setup``): a stop there takes seconds, not a step.

Ctrl-C (SIGINT) stays an immediate KeyboardInterrupt: the checkpoint writer removes its ``.tmp`` and the
CLI prints one line.
"""

from __future__ import annotations

import logging
import math
import signal

import torch

from zcvae.runs.checkpoint import nonfinite_tensors

logger = logging.getLogger(__name__)

# The exit codes a scheduler script can act on. 75 is EX_TEMPFAIL ("try again later"): requeue.
EXIT_PREEMPTED = 75
EXIT_DIVERGED = 3
EXIT_INTERRUPTED = 130

# The parts of J, in the order they are named when the loss goes non-finite (the first bad one is blamed).
OBJECTIVE_TERMS = ("weighted_reconstruction_loss", "kl", "posterior_entropy", "inter_latent_divergence", "posterior_variance")


class RunStopped(Exception):
    """A run that ended early on purpose; ``exit_code`` and one line for the CLI."""

    exit_code = 1

    def __init__(self, message: str, *, step: int):
        super().__init__(message)
        self.step = step


class TrainingDiverged(RunStopped):
    exit_code = EXIT_DIVERGED


class Preempted(RunStopped):
    exit_code = EXIT_PREEMPTED


class PhaseStopped(Preempted):
    """A stop signal agreed outside the optimizer steps (``zcvae.loop.setup``): loading, the reference
    passes, evaluation. ``phase`` names it."""

    def __init__(self, message: str, *, phase: str, step: int):
        super().__init__(message, step=step)
        self.phase = phase


# --------------------------------------------------------------------------- signals
class StopSignals:
    """Turns SIGTERM and SIGUSR1 into a flag for the duration of a ``with`` block (main thread only;
    elsewhere, e.g. a run started from a worker thread, the default handling stays)."""

    SIGNALS = ("SIGTERM", "SIGUSR1")

    def __init__(self):
        self.received: str | None = None
        self._previous: dict[int, object] = {}

    def _handler(self, signum, frame) -> None:
        if self.received is None:
            self.received = signal.Signals(signum).name

    def __enter__(self) -> "StopSignals":
        for name in self.SIGNALS:
            sig = getattr(signal, name, None)
            if sig is None:
                continue
            try:
                self._previous[sig] = signal.signal(sig, self._handler)
            except ValueError:  # not the main thread
                break
        return self

    def __exit__(self, *exc) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()


# --------------------------------------------------------------------------- the per-step check
class StepGuard:
    """Collects one optimizer step's term sums on this rank; :meth:`check` reduces them with the stop flag.

    Use: :meth:`add` per micro-batch (the terms of ``per_example_objective`` and the micro-batch's loss),
    then ``verdict = guard.check(engine, step=done, grad_norm=..., global_count=...)`` after the update:
    ``"ok"``, ``"skipped"`` (a non-finite step within the ``--skip-nonfinite-steps`` budget), or
    ``"stop"`` (a signal asked for it; all ranks agree). A non-finite step over the budget raises
    :class:`TrainingDiverged` on every rank.
    """

    def __init__(self, *, skip_budget: int = 0, signals: StopSignals | None = None):
        self.skip_budget = skip_budget
        self.num_skipped = 0
        self.signals = signals
        self.last_finite: dict[str, float] | None = None
        self._sums: dict[str, torch.Tensor] = {}

    def add(self, terms: dict[str, torch.Tensor], loss: torch.Tensor) -> None:
        """``terms``: per-example values ``[B]`` (invalid rows are ignored); ``loss``: this micro-batch's
        scalar contribution to the step's objective (already divided by the global count)."""
        valid_B = terms["valid"].detach() > 0
        for name in OBJECTIVE_TERMS:
            if name in terms:
                value_B = terms[name].detach().float()
                # where(), not a product: a NaN on a padded row must not count, nor 0 * inf make one
                self._accumulate(name, torch.where(valid_B, value_B, torch.zeros_like(value_B)).sum())
        self._accumulate("loss", loss.detach().float())

    def _accumulate(self, name: str, value: torch.Tensor) -> None:
        value = value.to(torch.float64)
        self._sums[name] = self._sums[name] + value if name in self._sums else value

    def check(self, engine, *, step: int, grad_norm: float, global_count: torch.Tensor) -> str:
        names = ["loss", *[n for n in OBJECTIVE_TERMS if n in self._sums]]
        device = next(iter(self._sums.values())).device if self._sums else torch.device("cpu")
        stop = 1.0 if (self.signals is not None and self.signals.received) else 0.0
        local = torch.stack([*(self._sums.get(n, torch.zeros((), dtype=torch.float64, device=device)) for n in names),
                             torch.tensor(stop, dtype=torch.float64, device=device)])
        # one collective: the sums (a non-finite one on any rank stays non-finite) and the stop flag
        reduced = engine.all_reduce(local).tolist()
        self._sums = {}
        count = max(float(global_count), 1.0)
        values = {n: reduced[i] / (count if n != "loss" else 1.0) for i, n in enumerate(names)}
        values["grad_norm"] = float(grad_norm)
        bad = [n for n in ("loss", "grad_norm") if not math.isfinite(values[n])]
        if not bad:
            self.last_finite = {"step": step, **{k: values[k] for k in ("loss", "grad_norm")}}
            return "stop" if reduced[-1] > 0 else "ok"
        term = next((n for n in OBJECTIVE_TERMS if n in values and not math.isfinite(values[n])), bad[0])
        what = f"{term} is {_fmt(values[term])}" + (f", grad_norm is {_fmt(values['grad_norm'])}" if term != "grad_norm" and "grad_norm" in bad else "")
        # every engine skips the update of a step whose gradient norm is non-finite; one whose loss is
        # non-finite but norm finite did update, so it cannot be passed over as skipped
        if math.isfinite(values["grad_norm"]) or self.num_skipped >= self.skip_budget:
            raise TrainingDiverged(self._message(step, what), step=step)
        self.num_skipped += 1
        logger.warning(f"[guard] step {step}: {what}; update skipped ({self.num_skipped} of --skip-nonfinite-steps {self.skip_budget})")
        return "stop" if reduced[-1] > 0 else "skipped"

    def _message(self, step: int, what: str) -> str:
        if self.last_finite is None:
            last = "no step before it was finite"
        else:
            lf = self.last_finite
            last = f"last finite values at step {lf['step']}: loss {lf['loss']:.6g}, grad_norm {lf['grad_norm']:.6g}"
        skips = f"; {self.num_skipped} earlier non-finite step(s) were skipped" if self.num_skipped else ""
        return (f"training diverged at step {step}: {what} ({last}{skips}); stopped without saving these weights. "
                f"Lower the learning rates (--lora-learning-rate, --latent-learning-rate) or resume from the last "
                f"checkpoint with --resume auto; --skip-nonfinite-steps N passes over up to N such steps")


def _fmt(value: float) -> str:
    return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")


# --------------------------------------------------------------------------- weights
def check_finite_weights(engine, *, step: int) -> None:
    """TrainingDiverged on every rank when any rank's trainable parameters (its shard of them) hold a
    non-finite value: such weights are never checkpointed."""
    # ZeRO-3 keeps a rank's partition in ds_tensor (the parameter itself is an empty placeholder);
    # FSDP2's DTensor is checked shard by shard (nonfinite_tensors)
    bad = nonfinite_tensors((n, getattr(p, "ds_tensor", p).detach()) for n, p in engine.model.named_parameters() if p.requires_grad)
    flag = engine.all_reduce(torch.tensor(float(len(bad)), device=engine.device))
    if float(flag) > 0:
        raise TrainingDiverged(
            f"training diverged by step {step}: the trainable weights hold non-finite values"
            f"{' (e.g. ' + ', '.join(bad[:3]) + ')' if bad else ' (on another rank)'}; stopped without saving them. "
            f"Lower the learning rates or resume from the last checkpoint with --resume auto", step=step)
