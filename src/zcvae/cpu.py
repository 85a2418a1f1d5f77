"""The CPU policy of one process: subnormal floats flushed, freed memory given back, the thread count.

``zcvae train`` and ``zcvae pretrain`` start with :func:`flush_denormals`, :func:`limit_heap_retention` (train)
and :func:`cpu_threads`, which fixes the thread count or, with ``--follow-cores``, returns a
:class:`CoreFollower` that the loop updates after each log window; ``zcvae evaluate`` flushes subnormals too.
This is no distributed code: each process sets its own, whatever the world size.
"""

from __future__ import annotations

import logging
import os
import time

import torch

logger = logging.getLogger(__name__)

__all__ = ["START_THREADS_ENV", "CoreFollower", "busy_cpu_cores", "cpu_threads", "flush_denormals", "free_cpu_cores",
           "limit_heap_retention", "release_file_pages"]


def flush_denormals() -> bool:
    """Make this process's CPU math flush subnormal floats to zero; returns whether the CPU supports it.

    Why: once the posterior collapses, the gradients and AdamW moments of unused z rows and router
    weights decay into subnormals, and MKL's sgemm runs those several-fold slower (measured on the
    demo: 0.5 -> 3.3 s/step). Values below ~1e-38 carry nothing the optimiser can use.
    """
    torch.set_flush_denormal(True)
    # Measured rather than taken from the return value: a subnormal times one must come out zero.
    supported = bool((torch.tensor(1e-40, dtype=torch.float32) * 1.0).item() == 0.0)
    if supported:
        logger.debug("cpu: subnormal floats flushed to zero")
    else:
        logger.warning("cpu: this CPU cannot flush subnormal floats; steps may slow once gradients decay")
    return supported


# glibc's M_MMAP_THRESHOLD (malloc.h): blocks at least this large are mmapped, so freeing returns them to the system
_M_MMAP_THRESHOLD = -3
HEAP_MMAP_THRESHOLD = 1 << 20
# ZeRO-3 and FSDP2 gather each layer's weights into fresh buffers at every visit, many of them under 1 MiB (a
# SmolLM2-360M k/v projection in bf16: 600 KiB), and the heap those feed grows from step to step. At 128 KiB, world 2
# on CPU, bf16 base, per rank (BENCHMARKS.md, "Host memory"): ZeRO-3's 1-step peak fell from 1.41-1.46 to 1.30-1.31 GiB
# and its 4-step peak from 1.73-1.77 to 1.42-1.49 GiB, at the same 16-17 s/step; FSDP2's 4-step peak from 1.24-1.29 to
# 1.21-1.24 GiB, at 23-24 s/step against 22.5-23. The replicated engines keep 1 MiB: there 128 KiB cost a 135M-shaped
# local run 30% in step time (4.5-4.9 against 3.4-3.7 s/step), the page faults of its mmapped activations.
SHARDED_HEAP_MMAP_THRESHOLD = 128 << 10
# Backbones whose weight files are smaller than this keep glibc's own policy: their host memory is not the limit, and
# every tensor above 1 MiB coming from mmap costs page faults on each allocation (a tiny backbone's CVAE run, 40
# steps x 64 on one thread: 13.0 s of system time against 1.4 s, 103 s wall against 71 s). SmolLM2-135M in fp32
# (540 MB), the smallest shape the memory tables measure, is above it.
HEAP_LIMIT_MIN_WEIGHT_BYTES = 256 << 20


def limit_heap_retention(*, weight_bytes: int, sharded: bool = False) -> int:
    """Keep glibc from holding freed tensor memory in its heap, for a backbone of ``weight_bytes`` of weight files
    of at least ``HEAP_LIMIT_MIN_WEIGHT_BYTES``: a fixed mmap threshold of ``HEAP_MMAP_THRESHOLD``, or
    ``SHARDED_HEAP_MMAP_THRESHOLD`` when an engine shards the parameters (``sharded``) -> the threshold set, or 0
    where none was (glibc only).

    Why: glibc raises its mmap threshold to the largest block freed so far (up to 32 MiB), after which
    tensors of up to that size come from the heap, and a heap fragmented by many of them is never given
    back. Measured on a SmolLM2-360M shape, world 2 on CPU under FSDP2 (bench/memory_bench.py, BENCHMARKS.md,
    "Host memory"): per-rank peak RSS 4.54 / 3.55 GiB against 1.92 / 1.92 GiB with a fixed 1 MiB threshold. Setting the threshold
    also ends its dynamic growth. Nothing else changes: not a number, only where the memory comes from.
    ``MALLOC_MMAP_THRESHOLD_`` in the environment, if set, is the user's choice and is left alone."""
    import ctypes
    import ctypes.util
    import sys

    if weight_bytes < HEAP_LIMIT_MIN_WEIGHT_BYTES or not sys.platform.startswith("linux") or "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return 0
    threshold = SHARDED_HEAP_MMAP_THRESHOLD if sharded else HEAP_MMAP_THRESHOLD
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return threshold if libc.mallopt(_M_MMAP_THRESHOLD, threshold) == 1 else 0
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        return 0


_MADV_DONTNEED = 4  # Linux's value (asm-generic/mman-common.h)


def _file_mapping_of(start: int, end: int) -> str | None:
    """The path of the file mapping of this process that holds [start, end), if one does (Linux's /proc/self/maps)."""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                fields = line.split(maxsplit=5)
                lo, hi = (int(a, 16) for a in fields[0].split("-"))
                if lo <= start and end <= hi:
                    path = fields[5].strip() if len(fields) == 6 else ""
                    return path if path.startswith("/") and "(deleted)" not in path else None
    except OSError:
        return None
    return None


def release_file_pages(tensor: torch.Tensor) -> int:
    """Give back the resident pages of a weight the caller has dropped, when it sits in a file mapping -> bytes
    released (0 where it does not, or not on Linux).

    Why: transformers keeps a checkpoint's weights memory-mapped when they load in the file's dtype, and every
    tensor is a view of one mapping of the whole file. Resizing the embedding copies its rows into a new tensor;
    the old one's pages, read by that copy, stay resident as long as any weight of the file is alive, i.e. for
    the whole run: the 113 MB embedding of the real SmolLM2-135M in fp32 (its 1-step peak on the local engine fell
    from 1.30 to 1.19 GiB; BENCHMARKS.md, "Host memory"). The pages are clean
    file pages, so dropping them loses nothing: a later read would fault them in again from the file. Only
    whole pages inside the tensor are dropped, so its neighbours in the file keep theirs."""
    import ctypes
    import ctypes.util
    import mmap
    import sys

    if not sys.platform.startswith("linux") or tensor.device.type != "cpu" or tensor.numel() == 0:
        return 0
    page = mmap.PAGESIZE
    start = -(-tensor.data_ptr() // page) * page
    end = (tensor.data_ptr() + tensor.numel() * tensor.element_size()) // page * page
    if end <= start or _file_mapping_of(start, end) is None:
        return 0
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    if libc.madvise(start, end - start, _MADV_DONTNEED) != 0:
        logger.debug("cpu: madvise failed (errno %d); the dropped weight's pages stay resident", ctypes.get_errno())
        return 0
    return end - start


def _affinity() -> set[int]:
    """The CPU ids this process may run on."""
    return set(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))


def _available_cores() -> int:
    return max(1, len(_affinity()))


def _free_of(cores: int, busy: float) -> int:
    """Cores left free when ``busy`` cores are taken, at least 1."""
    return max(1, min(cores, cores - int(busy + 0.5)))


def _busy_between(before, after, cpus) -> float:
    """Busy cores (0..len(cpus)) between two ``_cpu_times`` readings."""
    busy = 0.0
    for cpu in cpus:
        d_idle, d_total = after[cpu][0] - before[cpu][0], after[cpu][1] - before[cpu][1]
        busy += 0.0 if d_total <= 0 else 1.0 - d_idle / d_total
    return busy


def _cpu_times(cpus) -> dict[int, tuple[int, int]] | None:
    """(idle, total) jiffies per CPU id in ``cpus`` from /proc/stat, or None where it cannot be read."""
    try:
        with open("/proc/stat", encoding="ascii") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    out = {}
    for line in lines:
        name, *fields = line.split()
        if not (name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cpus):
            continue
        ticks = [int(v) for v in fields[:8]]  # user nice system idle iowait irq softirq steal
        out[int(name[3:])] = (ticks[3] + ticks[4], sum(ticks))
    return out if len(out) == len(cpus) else None


def busy_cpu_cores(interval: float = 0.2) -> float | None:
    """Cores of this process's affinity set busy over the next ``interval`` seconds (0..cores), from
    /proc/stat; None where it cannot be read (then callers fall back to the load average)."""
    cpus = _affinity()
    before = _cpu_times(cpus)
    if before is None:
        return None
    time.sleep(interval)
    after = _cpu_times(cpus)
    if after is None:
        return None
    return _busy_between(before, after, cpus)


def free_cpu_cores(*, interval: float = 0.2) -> int:
    """Cores idle right now (sampled over ``interval`` s of /proc/stat), at least 1.

    Why not all of them: a tiny model's ops are short, and OpenMP threads that share a core with
    another process spin-wait on each other; on 2 loaded cores 2 threads ran 20x slower than 1.
    Why not the load average: its 1-minute window still counts the caller's own previous stage (the
    demo's pretraining), which left the demo on 1 of 2 idle cores. Without /proc/stat (not Linux) the
    1-minute load average is the fallback.
    """
    cores = _available_cores()
    busy = busy_cpu_cores(interval)
    if busy is None:
        try:
            busy = os.getloadavg()[0]
        except (AttributeError, OSError):
            busy = 0.0
    return _free_of(cores, busy)


class CoreFollower:
    """Keeps torch's CPU threads at the cores other processes leave free, re-measured at each ``update``
    (``--follow-cores`` only: the numbers then depend on the load, see :func:`cpu_threads`).

    Why: a run that starts next to another one keeps the thread count it started with, so when the
    other ends a core sits idle (the last runs of a local sweep). On the demo's default step 2 threads ran
    1.6x faster than 1 for 1.15x the CPU time (BENCHMARKS.md, "The demo"). The load of the others is
    measured over the whole interval between two calls (a log window, tens of seconds, so a short spike does
    not flip the count): the busy cores of /proc/stat less this process's own CPU time, so its own threads
    never count as load and no sampling sleep is needed. Without /proc/stat the count stays as it is.
    """

    def __init__(self):
        self.cpus = _affinity()
        self._last = self._snapshot()

    def _snapshot(self):
        return _cpu_times(self.cpus), time.process_time(), time.monotonic()

    def others_busy(self) -> float | None:
        """Cores that other processes kept busy since the previous call (0..cores), None where unknown."""
        (before, own_before, t_before), now = self._last, self._snapshot()
        self._last = now
        after, own_after, t_after = now
        wall = t_after - t_before
        if before is None or after is None or wall <= 0:
            return None
        return max(0.0, _busy_between(before, after, self.cpus) - (own_after - own_before) / wall)

    def update(self) -> int:
        """Set the thread count to the cores the others left free (at least 1); returns it."""
        others = self.others_busy()
        if others is not None:
            threads = _free_of(len(self.cpus), others)
            if threads != torch.get_num_threads():
                torch.set_num_threads(threads)
        return torch.get_num_threads()


# Set by a launcher that starts several runs at once (zcvae.sweep.local): this many threads per run, so that runs
# started together do not each take every core.
START_THREADS_ENV = "ZCVAE_START_THREADS"


def cpu_threads(*, follow: bool = False) -> tuple[CoreFollower | None, str]:
    """The thread policy of a CPU training process: sets the count and returns (the follower to update at
    each log step, or None where the count is fixed, and where the count came from).

    Fixed (the default): ``OMP_NUM_THREADS`` (the user's, or torchrun's), else ``ZCVAE_START_THREADS`` (a
    launcher's), else every core this process may use. Why fixed, and never from the load: the thread count
    sets the summation order of torch's parallel reductions, so it changes the last digits of a loss (the quick
    demo's c_base: 3.691550484972021 on one thread, 3.6915504846100498 on two), and a run of hundreds of steps
    can amplify those into another outcome. A count taken from the load would make a fixed-seed run depend on
    whatever else runs on the machine.

    ``follow`` (``--follow-cores``): speed first. Start on the launcher's count or on the cores
    idle now (:func:`free_cpu_cores`: OpenMP threads that share a busy core spin-wait, up to 10x slower), then
    follow the cores the others leave free (:class:`CoreFollower`); the numbers then depend on the load.
    ``OMP_NUM_THREADS`` still fixes the count.
    """
    if "OMP_NUM_THREADS" in os.environ:
        # set here too, not only read by OpenMP at start-up: a process that set it after importing torch (the
        # demo, around its in-process pretraining) would otherwise keep torch's default count
        omp = os.environ["OMP_NUM_THREADS"]
        if omp.isdigit() and int(omp) >= 1:  # OpenMP's nested lists ("4,2") are left to OpenMP
            torch.set_num_threads(int(omp))
        return None, f"OMP_NUM_THREADS={omp}"
    start = os.environ.get(START_THREADS_ENV)
    if start is not None:
        if not start.isdigit() or int(start) < 1:
            raise ValueError(f"{START_THREADS_ENV} must be a positive integer, got {start!r}")
        torch.set_num_threads(int(start))
        source = f"{START_THREADS_ENV}={start}"
    elif follow:
        torch.set_num_threads(free_cpu_cores())
        source = "free cores (/proc/stat)"
    else:
        torch.set_num_threads(_available_cores())
        source = "every core of this process"
    if not follow:
        return None, source
    return CoreFollower(), f"{source}, then the free cores at each log step"
