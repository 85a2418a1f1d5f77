"""CPU set-up of every training process: subnormal floats are flushed, and the thread count follows the
cores that are idle now (not the 1-minute load average, which still counts the caller's previous stage),
at the start and again after each log window (CoreFollower)."""

import os

import pytest
import torch

from zcvae import cpu
from zcvae.cpu import START_THREADS_ENV, CoreFollower, busy_cpu_cores, cpu_threads, flush_denormals, free_cpu_cores

SUBNORMAL = 1e-40  # below float32's smallest normal, 1.18e-38


def test_flush_denormals_makes_a_subnormal_times_one_zero(logged, caplog):
    caplog.set_level("DEBUG", logger="zcvae.cpu")  # the line is a debug one: it says what always happens
    lines = logged
    try:
        torch.set_flush_denormal(False)
        if (torch.tensor(SUBNORMAL, dtype=torch.float32) * 1.0).item() == 0.0:
            pytest.skip("this CPU flushes subnormals already")
        assert flush_denormals() is True
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
    monkeypatch.setattr(cpu, "_cpu_times", lambda cpus: next(reads))
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
    monkeypatch.setattr(cpu, "_cpu_times", lambda cpus: None)
    monkeypatch.setattr(os, "getloadavg", lambda: (100.0, 0.0, 0.0))
    assert free_cpu_cores() == 1


def test_busy_cores_reads_this_machine():
    busy = busy_cpu_cores(0.05)
    assert busy is None or 0.0 <= busy <= len(os.sched_getaffinity(0)) + 1e-9


@pytest.fixture
def threads():
    """Restores torch's thread count after a test that sets it."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def _follower(monkeypatch, *, others: float, own: float, wall: float = 10.0, cpus=frozenset({0, 1})) -> CoreFollower:
    """A follower over ``cpus`` whose next window saw ``others`` cores busy in other processes and ``own``
    cores of this process's CPU time (all on /proc/stat's busy count too)."""
    busy = others + own  # cores busy in the window, spread evenly over the cpus
    stats = iter([{c: (0, 0) for c in cpus}, {c: (round(100 * (1 - busy / len(cpus))), 100) for c in cpus}])
    clock = iter([0.0, wall])
    process = iter([0.0, own * wall])
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(cpus))
    monkeypatch.setattr(cpu, "_cpu_times", lambda c: next(stats))
    monkeypatch.setattr(cpu.time, "monotonic", lambda: next(clock))
    monkeypatch.setattr(cpu.time, "process_time", lambda: next(process))
    return CoreFollower()


def test_a_run_takes_the_core_another_left_and_gives_it_back(monkeypatch, threads):
    torch.set_num_threads(1)
    assert _follower(monkeypatch, others=0.0, own=1.0).update() == 2  # the other run ended
    assert torch.get_num_threads() == 2
    # its own two threads are not load: it keeps both
    assert _follower(monkeypatch, others=0.0, own=1.9).update() == 2
    # another run started next to it: back to one
    assert _follower(monkeypatch, others=1.0, own=1.0).update() == 1
    assert torch.get_num_threads() == 1
    # more load than cores: still at least one
    assert _follower(monkeypatch, others=2.0, own=0.0).update() == 1


def test_without_proc_stat_the_follower_keeps_the_count(monkeypatch, threads):
    torch.set_num_threads(1)
    monkeypatch.setattr(cpu, "_cpu_times", lambda cpus: None)
    assert CoreFollower().update() == 1


def test_omp_num_threads_fixes_the_count_and_nothing_follows(monkeypatch, threads):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv(START_THREADS_ENV, "2")  # the user's fixed count wins over a launcher's start
    torch.set_num_threads(2)  # as torch started, before the variable was set (the demo sets it in-process)
    follower, source = cpu_threads()
    assert follower is None and source == "OMP_NUM_THREADS=1" and torch.get_num_threads() == 1


def test_a_launcher_sets_the_count_and_only_follow_cores_follows_from_there(monkeypatch, threads):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setenv(START_THREADS_ENV, "1")
    torch.set_num_threads(2)
    follower, source = cpu_threads()  # fixed: the numbers must not depend on the load
    assert follower is None and torch.get_num_threads() == 1 and source == f"{START_THREADS_ENV}=1"
    follower, source = cpu_threads(follow=True)  # --follow-cores
    assert isinstance(follower, CoreFollower) and torch.get_num_threads() == 1
    assert source == f"{START_THREADS_ENV}=1, then the free cores at each log step"


def test_the_default_count_is_every_core_however_busy_they_are(monkeypatch, threads):
    """Without OMP_NUM_THREADS or a launcher's count, a run takes every core of its affinity set, not the cores idle
    now: the count must not depend on the load. --follow-cores starts on the idle ones."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv(START_THREADS_ENV, raising=False)
    monkeypatch.setattr(cpu, "_affinity", lambda: frozenset({0, 1}))
    monkeypatch.setattr(cpu, "busy_cpu_cores", lambda interval=0.2: 1.0)  # another process keeps one core busy
    follower, source = cpu_threads()
    assert follower is None and torch.get_num_threads() == 2 and source == "every core of this process"
    follower, source = cpu_threads(follow=True)
    assert isinstance(follower, CoreFollower) and torch.get_num_threads() == 1


@pytest.mark.parametrize("bad", ["0", "two", "-1", ""])
def test_a_bad_start_count_names_the_variable(monkeypatch, bad):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setenv(START_THREADS_ENV, bad)
    with pytest.raises(ValueError, match=START_THREADS_ENV):
        cpu_threads()


def test_the_heap_is_capped_only_for_a_backbone_whose_host_memory_matters(monkeypatch):
    """A tiny backbone keeps glibc's own heap (mmapped tensors cost page faults on every allocation); a backbone
    with at least HEAP_LIMIT_MIN_WEIGHT_BYTES of weight files gets the 1 MiB threshold, or 128 KiB under an engine
    that shards the parameters; the user's MALLOC_MMAP_THRESHOLD_ always wins."""
    import sys

    from zcvae.cpu import HEAP_LIMIT_MIN_WEIGHT_BYTES, HEAP_MMAP_THRESHOLD, SHARDED_HEAP_MMAP_THRESHOLD, limit_heap_retention

    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    assert limit_heap_retention(weight_bytes=HEAP_LIMIT_MIN_WEIGHT_BYTES - 1) == 0
    assert limit_heap_retention(weight_bytes=HEAP_LIMIT_MIN_WEIGHT_BYTES - 1, sharded=True) == 0
    if sys.platform.startswith("linux"):  # glibc's mallopt answers 1 when it took the setting
        assert limit_heap_retention(weight_bytes=HEAP_LIMIT_MIN_WEIGHT_BYTES, sharded=True) == SHARDED_HEAP_MMAP_THRESHOLD
        assert limit_heap_retention(weight_bytes=HEAP_LIMIT_MIN_WEIGHT_BYTES) == HEAP_MMAP_THRESHOLD
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", str(1 << 20))
    assert limit_heap_retention(weight_bytes=HEAP_LIMIT_MIN_WEIGHT_BYTES) == 0
    assert limit_heap_retention(weight_bytes=HEAP_LIMIT_MIN_WEIGHT_BYTES, sharded=True) == 0
