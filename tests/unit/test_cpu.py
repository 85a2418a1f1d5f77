"""CPU set-up of every training process: subnormal floats are flushed, and the thread count follows the
cores that are idle now (not the 1-minute load average, which still counts the caller's previous stage)."""

import os

import pytest
import torch

from zcvae import distributed
from zcvae.distributed import busy_cpu_cores, flush_denormals, free_cpu_cores

SUBNORMAL = 1e-40  # below float32's smallest normal, 1.18e-38


def test_flush_denormals_makes_a_subnormal_times_one_zero():
    lines = []
    try:
        torch.set_flush_denormal(False)
        if (torch.tensor(SUBNORMAL, dtype=torch.float32) * 1.0).item() == 0.0:
            pytest.skip("this CPU flushes subnormals already")
        assert flush_denormals(log=lines.append) is True
        assert (torch.tensor(SUBNORMAL, dtype=torch.float32) * 1.0).item() == 0.0
        # the matmul path (MKL sgemm) that stalled is flushed too
        a = torch.full((8, 8), SUBNORMAL)
        assert torch.count_nonzero(a @ torch.eye(8)).item() == 0
        assert lines == ["cpu: subnormal floats flushed to zero"]
    finally:
        torch.set_flush_denormal(True)


def _fake_proc_stat(monkeypatch, before, after):
    """/proc/stat read twice: (idle, total) per cpu."""
    reads = iter([before, after])
    monkeypatch.setattr(distributed, "_cpu_times", lambda cpus: next(reads))
    monkeypatch.setattr("time.sleep", lambda seconds: None)


def test_free_cores_follow_current_usage_not_the_load_average(monkeypatch):
    cpus = os.sched_getaffinity(0)
    if len(cpus) < 2:
        pytest.skip("needs two cores")
    monkeypatch.setattr(os, "getloadavg", lambda: (float(len(cpus)), 0.0, 0.0))  # a busy minute behind us
    idle_now = ({c: (0, 0) for c in cpus}, {c: (100, 100) for c in cpus})
    _fake_proc_stat(monkeypatch, *idle_now)
    assert free_cpu_cores() == len(cpus)
    one_busy = ({c: (0, 0) for c in cpus}, {c: (0 if i == 0 else 100, 100) for i, c in enumerate(sorted(cpus))})
    _fake_proc_stat(monkeypatch, *one_busy)
    assert free_cpu_cores() == len(cpus) - 1
    all_busy = ({c: (0, 0) for c in cpus}, {c: (0, 100) for c in cpus})
    _fake_proc_stat(monkeypatch, *all_busy)
    assert free_cpu_cores() == 1


def test_without_proc_stat_the_load_average_is_used(monkeypatch):
    monkeypatch.setattr(distributed, "_cpu_times", lambda cpus: None)
    monkeypatch.setattr(os, "getloadavg", lambda: (100.0, 0.0, 0.0))
    assert free_cpu_cores() == 1


def test_busy_cores_reads_this_machine():
    busy = busy_cpu_cores(0.05)
    assert busy is None or 0.0 <= busy <= len(os.sched_getaffinity(0)) + 1e-9
