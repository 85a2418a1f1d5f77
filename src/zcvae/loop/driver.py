"""The one training loop: the step driver that ``zcvae train`` and ``zcvae pretrain`` share.

What one optimizer step does, for any objective and any engine:

1. the learning rates of the step (peak x schedule factor);
2. the global batch of the step (``global_batch_indices``, a pure function of seed and step) and this
   rank's micro-batches of it (``rank_micro_batches``);
3. the global counts (examples, supervised tokens), all-reduced *before* any forward, so that every
   micro-batch contributes ``local_sum / global_count`` and (world 1, accumulation 4) takes the same
   step as (world 2, accumulation 2);
4. per micro-batch the objective's loss (``micro_loss``), backward with gradient sync on the last;
5. ``engine.step`` with clipping, the divergence guard and the preemption stop (``loop.guards``);
6. the metric window (exact over ranks) into the RunLogger (metrics.jsonl + TensorBoard), the
   progress bar, periodic evaluation and periodic checkpoints; at the end the final evaluation and
   checkpoint.

What differs between the CVAE and the entangled stage is the :class:`Objective`: how a micro-batch
is built from example indices and what its loss is (``begin_step``, ``micro_loss``), what it does after
the step and logs with the window (``end_step``), and what a checkpoint keeps of it (``checkpoint_state``).
The loop never branches on the engine type nor on the objective.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Container, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from zcvae.data.dataset import global_batch_indices, rank_micro_batches
from zcvae.loop.logs import MetricWindow, progress_bar
from zcvae.loop.guards import PhaseStopped, Preempted, StepGuard, StopSignals, check_finite_weights

logger = logging.getLogger(__name__)


@dataclass
class LoopSettings:
    """The step loop's own settings (a field named like a TrainConfig field has its meaning)."""

    max_steps: int
    micro_batch_size: int
    gradient_accumulation_steps: int
    seed: int
    log_every: int
    eval_every: int
    save_every: int
    max_grad_norm: float | None
    skip_nonfinite_steps: int = 0
    progress_bar: bool = True
    run_name: str = "run"
    progress_metrics: dict[str, str] = field(default_factory=lambda: {"loss": ".3f"})
    """What the progress bar shows after each log window: metric name -> format spec."""
    eval_at: Container[int] = ()
    """Steps evaluated besides every ``eval_every`` (the trainer's: the end of the KL delay; a set the objective adds
    to when its delay ends on evidence)."""


def evaluates_after(settings: LoopSettings, done: int) -> bool:
    """Whether the loop evaluates after ``done`` steps, before the end: every ``eval_every`` steps and at each of
    ``eval_at``, once even where both fall on one step; the last step's evaluation is the final one, never here."""
    s = settings
    return done != s.max_steps and (bool(s.eval_every and done % s.eval_every == 0) or done in s.eval_at)


@dataclass
class MicroLoss:
    """One micro-batch's contribution: ``loss`` (this rank's sum divided by the global count, so the
    step's gradient is the global mean), ``terms`` (per-row values ``[B]`` for the metric window and the
    guard; ``terms["valid"]`` weighs each row in the window means and is > 0 for rows that count),
    ``tokens`` (supervised tokens, for tokens/s) and ``scalars`` (one value each for the window, averaged
    over micro-batches and ranks: the CVAE's router statistics)."""

    loss: torch.Tensor
    terms: dict[str, torch.Tensor]
    tokens: float
    scalars: dict[str, torch.Tensor | float] = field(default_factory=dict)


class Objective(Protocol):
    """What the loop asks of a training objective (see ``train.trainer.CVAEObjective`` and
    ``backbone.stage_data.SpanNLLObjective``): the step's batches, a micro-batch's loss, what follows the
    optimizer step, and what a checkpoint keeps of it."""

    def begin_step(self, step: int, micro: list[list[int]], positions: list[list[int]]) -> tuple[list[Any], list[float]]:
        """Start step ``step`` (0-based): this rank's micro-batches on the device, and their [valid examples,
        supervised tokens] (summed over ranks by the loop before any forward). ``micro`` are example indices,
        ``positions`` their places in the global batch (the same on every world size)."""

    def micro_loss(self, batch: Any, *, micro: list[int], num_micro: int, global_count: torch.Tensor,
                   global_tokens: torch.Tensor) -> MicroLoss:
        """One micro-batch's forward and loss; ``micro``: its example indices, ``num_micro``: this rank's
        micro-batches in the step, ``global_count``/``global_tokens``: the step's counts over all ranks."""

    def end_step(self, done: int) -> dict[str, float]:
        """After the optimizer step of ``done`` steps: the objective's own work (logging, checks), and its values
        as of this step, logged with the window that this step ends, if it ends one (the same on every rank)."""

    def checkpoint_state(self) -> tuple[dict, dict[str, torch.Tensor]]:
        """What a checkpoint keeps of the objective besides the trained weights: plain values (JSON) and tensors
        (the same on every rank); ({}, {}) for none."""


def run_loop(
    *,
    engine,
    objective: Objective,
    settings: LoopSettings,
    num_examples: int,
    peak_lrs: Sequence[float],
    group_names: Sequence[str],
    lr_factor: Callable[[int], float],
    start_step: int,
    checkpoints,
    checkpoint_state: dict,
    evaluate: Callable[[int], dict[str, float]],
    run_logger,
    signals: StopSignals,
    cpu_threads=None,
) -> dict[str, float]:
    """Train from ``start_step`` to ``settings.max_steps``; returns the final evaluation's metrics.

    ``checkpoint_state``: the keyword arguments ``checkpoints.save`` takes besides engine and step
    (``config``, ``c_base``). ``evaluate(step)`` evaluates and logs. Raises
    :class:`~zcvae.loop.guards.Preempted` after saving when a stop signal arrived, and
    :class:`~zcvae.loop.guards.TrainingDiverged` on a divergence. ``cpu_threads``: a
    :class:`~zcvae.cpu.CoreFollower` updated after each log window (None: the thread count stays).
    """
    s = settings
    rank, world_size, device = engine.rank, engine.world_size, engine.device

    def save(done: int) -> None:
        state, tensors = objective.checkpoint_state()
        checkpoints.save(engine, step=done, **checkpoint_state, trainer_state=state, trainer_tensors=tensors)

    global_batch = s.micro_batch_size * s.gradient_accumulation_steps * world_size
    progress = progress_bar(s, start_step, enabled=rank == 0)
    guard = StepGuard(skip_budget=s.skip_nonfinite_steps, signals=signals)
    window = MetricWindow()
    window_tokens, window_start = 0.0, time.perf_counter()
    window_first = start_step  # a resume between two log steps starts a shorter first window
    for step in range(start_step, s.max_steps):
        factor = lr_factor(step)
        engine.set_learning_rates([lr * factor for lr in peak_lrs])
        indices = global_batch_indices(num_examples=num_examples, global_batch_size=global_batch, step=step, seed=s.seed)
        split = dict(micro_batch_size=s.micro_batch_size, accumulation_steps=s.gradient_accumulation_steps, rank=rank, world_size=world_size)
        micro = rank_micro_batches(indices, **split)
        positions = rank_micro_batches(list(range(len(indices))), **split)
        batches, counts = objective.begin_step(step, micro, positions)
        # the global counts of valid examples and of supervised tokens, before any forward
        global_count, global_tokens = engine.all_reduce(torch.tensor(counts, device=device))
        for m, batch in enumerate(batches):
            out = objective.micro_loss(batch, micro=micro[m], num_micro=len(batches), global_count=global_count,
                                       global_tokens=global_tokens)
            for name, value in out.scalars.items():
                window.add_scalar(name, value)
            engine.backward(out.loss, sync=m == len(batches) - 1)
            guard.add(out.terms, out.loss)
            window.add_examples(out.terms, out.terms["valid"])
            window_tokens += out.tokens
        grad_norm = engine.step(max_grad_norm=s.max_grad_norm)
        # every rank gets the same verdict; a divergence past the skip budget raises here
        verdict = guard.check(engine, step=step + 1, grad_norm=grad_norm, global_count=global_count)
        window.add_scalar("grad_norm", grad_norm)
        progress.update(1)

        done = step + 1
        objective_metrics = objective.end_step(done)
        if done % s.log_every == 0 or done == s.max_steps:
            metrics = window.reduce()
            elapsed = time.perf_counter() - window_start
            tokens = float(engine.all_reduce(torch.tensor(window_tokens, dtype=torch.float64)))
            metrics.update(objective_metrics)
            metrics["tokens_per_second"] = tokens / max(elapsed, 1e-9)
            if cpu_threads is not None:
                metrics["num_threads"] = torch.get_num_threads()  # the window's count; the next window's follows the free cores
                if cpu_threads.update() != metrics["num_threads"]:
                    logger.info(f"[cpu] step {done}: {torch.get_num_threads()} threads (was {metrics['num_threads']}), the cores other processes leave free")
            metrics.update({f"learning_rate/{name}": lr * factor for name, lr in zip(group_names, peak_lrs)})
            if window_first > (done - 1) // s.log_every * s.log_every:
                # the steps before the checkpoint were averaged by the interrupted run and never logged
                metrics["window_steps"] = done - window_first
            window_first = done
            run_logger.log("train", done, metrics)
            progress.set_postfix(**{name: f"{metrics.get(name, float('nan')):{spec}}" for name, spec in s.progress_metrics.items()})
            window, window_tokens, window_start = MetricWindow(), 0.0, time.perf_counter()
        stopped_in_eval = None
        if evaluates_after(s, done):
            try:
                evaluate(done)
            except PhaseStopped as e:  # agreed by every rank within the evaluation: step `done` is complete, save it
                stopped_in_eval = e
            window_start = time.perf_counter()  # keep evaluation out of tokens/s
        stop = (verdict == "stop" or stopped_in_eval is not None) and done != s.max_steps  # preempted: save here, then end
        if (s.save_every and done % s.save_every == 0 and done != s.max_steps) or stop:
            check_finite_weights(engine, step=done)
            save(done)
        if stop:
            progress.close()
            run_logger.close()
            during = f" (during the evaluation at step {done})" if stopped_in_eval is not None else ""
            raise Preempted(f"stopped by {signals.received or 'a signal on another rank'} after step {done} of {s.max_steps}{during}: "
                            f"saved checkpoint {checkpoints.path_for(done).name}; continue with the same command plus --resume auto", step=done)
    progress.close()

    check_finite_weights(engine, step=s.max_steps)
    final = evaluate(s.max_steps)
    save(s.max_steps)
    return final
