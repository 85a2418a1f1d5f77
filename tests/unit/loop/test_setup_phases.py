"""SetupPhases (zcvae.loop.setup): the phases outside the steps are named, timed, reported, and stop on a signal."""

from __future__ import annotations

import os
import signal

import pytest
import torch

from zcvae.loop.guards import EXIT_PREEMPTED, PhaseStopped, StopSignals
from zcvae.loop.setup import SetupPhases


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_progress_lines_come_at_once_then_at_most_every_interval_and_at_the_end(logged):
    clock, lines = Clock(), logged
    phases = SetupPhases(None, clock=clock, progress_every_s=10, report_after_s=60)
    with phases.phase("the c_base pass"):
        for done in range(1, 31):
            clock.now += 1.0
            phases.tick(done, 30)
    assert lines == ["[setup] the c_base pass: 1/30 examples, 1.0/s", "[setup] the c_base pass: 11/30 examples, 1.0/s",
                     "[setup] the c_base pass: 21/30 examples, 1.0/s", "[setup] the c_base pass: 30/30 examples, 1.0/s"]


def test_a_phase_over_the_bound_says_how_long_it_took_and_a_short_one_says_nothing(logged):
    clock, lines = Clock(), logged
    phases = SetupPhases(None, clock=clock, report_after_s=60)
    with phases.phase("loading the backbone"):
        clock.now += 59
    with phases.phase("building the engine"):
        with phases.phase("writing the weights into the shards"):
            clock.now += 61
        assert phases.current == "building the engine"  # nested phases restore the outer one
        clock.now += 70
    assert lines == ["[setup] writing the weights into the shards: took 1 min 1 s", "[setup] building the engine: took 2 min 11 s"]


def test_a_real_signal_stops_at_the_next_tick_naming_the_phase_and_exit_75():
    with StopSignals() as signals:
        phases = SetupPhases(signals)
        with pytest.raises(PhaseStopped) as info:
            with phases.phase("the reference store (train)"):
                phases.tick(1, 10)
                os.kill(os.getpid(), signal.SIGTERM)
                phases.tick(2, 10)
                raise AssertionError("the tick after the signal must stop")
    err = info.value
    assert err.exit_code == EXIT_PREEMPTED == 75 and err.phase == "the reference store (train)" and err.step == 0
    assert str(err).startswith("stopped by SIGTERM during the reference store (train), before step 1: nothing to save")


def test_the_flag_of_another_rank_stops_this_one():
    """The agreement is a max over the ranks: here the "other rank" is the reduction itself."""
    calls = []

    def reduce_max(t):
        calls.append(float(t[0]))
        return torch.ones_like(t)  # some rank got a signal

    phases = SetupPhases(StopSignals(), reduce_max=reduce_max)
    phases.before_step, phases.hint = 7, "the last checkpoint is kept"
    with pytest.raises(PhaseStopped, match="stopped by a signal on another rank during setup, before step 7: the last checkpoint is kept"):
        phases.tick(1, 2)
    assert calls == [0.0]  # this rank had none
