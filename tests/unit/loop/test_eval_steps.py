"""zcvae.loop.driver.evaluates_after: which steps the loop evaluates after, besides its final evaluation."""

from __future__ import annotations

from zcvae.loop.driver import LoopSettings, evaluates_after


def _settings(**kw) -> LoopSettings:
    base = dict(max_steps=10, micro_batch_size=2, gradient_accumulation_steps=1, seed=0, log_every=5, eval_every=0,
                save_every=0, max_grad_norm=None)
    return LoopSettings(**{**base, **kw})


def _steps(settings: LoopSettings, start: int = 0) -> list[int]:
    """The steps evaluated in the loop of a run that starts (or resumes) at ``start``."""
    return [done for done in range(start + 1, settings.max_steps + 1) if evaluates_after(settings, done)]


def test_every_eval_every_steps_and_each_eval_at_step_once_never_the_last():
    assert _steps(_settings()) == []
    assert _steps(_settings(eval_every=4)) == [4, 8]
    assert _steps(_settings(eval_at=(7,))) == [7]
    assert _steps(_settings(eval_every=4, eval_at=(4, 7))) == [4, 7, 8]  # 4 once
    assert _steps(_settings(eval_every=5, eval_at=(10,))) == [5]  # the final evaluation covers step 10


def test_a_run_resumed_past_an_eval_at_step_does_not_evaluate_it():
    assert _steps(_settings(eval_at=(7,)), start=7) == [] and _steps(_settings(eval_at=(7,)), start=6) == [7]
