"""Process-group set-up and exact cross-rank metric reductions.

One helper starts the process group for every engine, reading the variables torchrun sets
(``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``): gloo on CPU, nccl on
CUDA. The DeepSpeed engine calls it too and then lets ``deepspeed.init_distributed`` adopt the group,
so DDP, FSDP2 and DeepSpeed all run on the same default group.

Metrics are reduced as ``(sum, count)`` pairs, never as a mean of per-rank means: ranks hold different
numbers of examples (ragged shards, empty micro-batches), and a mean of means is biased.

    torchrun --nproc_per_node 2 -m zcvae ...      # RANK/WORLD_SIZE/LOCAL_RANK come from torchrun
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

__all__ = ["CoreFollower", "DistInfo", "all_reduce", "barrier", "busy_cpu_cores", "cpu_threads", "dist_info", "flush_denormals", "free_cpu_cores",
           "init_distributed", "limit_heap_retention", "reduce_metrics"]

_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX}


@dataclass(frozen=True)
class DistInfo:
    """Where this process sits in the job."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name} must be an integer, got {value!r}") from None


def dist_info() -> DistInfo:
    """Rank, world size, local rank and device from the torchrun environment (world 1 without it)."""
    rank = _env_int("RANK", 0)
    world_size = _env_int("WORLD_SIZE", 1)
    local_rank = _env_int("LOCAL_RANK", 0)
    if dist.is_available() and dist.is_initialized():
        rank, world_size = dist.get_rank(), dist.get_world_size()
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
    else:
        device = torch.device("cpu")
    return DistInfo(rank=rank, world_size=world_size, local_rank=local_rank, device=device)


def shutdown_distributed() -> None:
    """Destroy the default process group if one was started. Called once a command is done: a process
    that exits with a live gloo group can abort in the group's destructor ("terminate called without
    an active exception", SIGABRT), which torchrun reports as a failed rank after a finished run."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def init_distributed(*, timeout: timedelta | None = None, require_group: bool = False) -> DistInfo:
    """Start the default process group once; return where this process sits.

    At world size 1 no group is created unless ``require_group`` (DeepSpeed needs one even alone):
    then a one-process group on an in-memory store, so no port is opened. Calling it again is a no-op.
    """
    info = dist_info()
    if info.world_size > 1 and (info.rank >= info.world_size or info.rank < 0):
        raise ValueError(f"RANK={info.rank} is outside WORLD_SIZE={info.world_size}")
    if dist.is_initialized() or (info.world_size == 1 and not require_group):
        return info
    backend = "nccl" if info.device.type == "cuda" else "gloo"
    if info.device.type == "cuda":
        # nccl binds a communicator to the current device: set it before the first collective.
        torch.cuda.set_device(info.device)
    kwargs = {} if timeout is None else {"timeout": timeout}
    if info.world_size == 1:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, **kwargs)
    else:
        dist.init_process_group(backend, rank=info.rank, world_size=info.world_size, **kwargs)
    return dist_info()


def _group_active() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _comm_device(tensor: torch.Tensor) -> torch.device:
    """nccl reduces only CUDA tensors; gloo reduces CPU tensors (and CUDA ones through a copy)."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return tensor.device


def all_reduce(tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
    """A reduced copy of ``tensor`` (sum | min | max over ranks); the input is left untouched.

    Identity (a copy) when there is no group or the world has one rank. The result lives on the
    input's device.
    """
    if op not in _REDUCE_OPS:
        raise ValueError(f"op must be one of {sorted(_REDUCE_OPS)}, got {op!r}")
    out = tensor.detach().clone()
    if not _group_active():
        return out
    device = _comm_device(out)
    buf = out.to(device)
    dist.all_reduce(buf, op=_REDUCE_OPS[op])
    return buf.to(tensor.device)


def barrier() -> None:
    if _group_active():
        dist.barrier()


def _as_scalar(name: str, value: torch.Tensor | float | int) -> torch.Tensor:
    t = torch.as_tensor(value.detach() if isinstance(value, torch.Tensor) else value)
    if t.numel() != 1:
        raise ValueError(f"metric {name!r} must be a scalar, got shape {tuple(t.shape)}")
    # float64 keeps integer counts exact far beyond any realistic number of tokens.
    return t.reshape(()).to(device="cpu", dtype=torch.float64)


def _reduce_vector(values: Mapping[str, torch.Tensor | float | int], op: str) -> dict[str, float]:
    if not values:
        return {}
    names = list(values)
    packed_M = torch.stack([_as_scalar(n, values[n]) for n in names])
    packed_M = all_reduce(packed_M, op)
    return {n: float(v) for n, v in zip(names, packed_M.tolist())}


def reduce_metrics(
    *,
    sums: Mapping[str, torch.Tensor | float | int] | None = None,
    counts: Mapping[str, torch.Tensor | float | int] | None = None,
    mins: Mapping[str, torch.Tensor | float | int] | None = None,
    maxs: Mapping[str, torch.Tensor | float | int] | None = None,
) -> dict[str, float]:
    """Exact global means, minima and maxima over all ranks; every rank gets the same dict.

    ``sums[k] / counts[k]`` is returned under ``k`` (``nan`` when the global count is 0): the
    numerators and denominators are reduced first, so the result is the mean over all examples,
    not a mean of per-rank means. ``counts`` must name exactly the keys of ``sums``; a key
    ``k`` of ``mins``/``maxs`` is returned as ``k``. Totals are returned as well, as ``k + "/sum"`` and
    ``k + "/count"``, for callers that accumulate further.

    Communication: one all-reduce for all (sum, count) pairs, one for all minima, one for all maxima
    (skipped when empty). Every rank must call it with the same keys (use a neutral value, e.g.
    ``+inf`` for a min, on a rank that saw nothing). No ``gather_object``: nothing is pickled.
    """
    sums = dict(sums or {})
    counts = dict(counts or {})
    mins = dict(mins or {})
    maxs = dict(maxs or {})
    if set(sums) != set(counts):
        raise ValueError(
            f"counts must have the same keys as sums; missing {sorted(set(sums) - set(counts))}, "
            f"extra {sorted(set(counts) - set(sums))}"
        )
    overlap = (set(sums) & set(mins)) | (set(sums) & set(maxs)) | (set(mins) & set(maxs))
    if overlap:
        raise ValueError(f"metric names must be unique across sums, mins and maxs; repeated {sorted(overlap)}")
    pairs = {f"{k}/sum": v for k, v in sums.items()} | {f"{k}/count": counts[k] for k in sums}
    totals = _reduce_vector(pairs, "sum")
    out: dict[str, float] = {}
    for k in sums:
        total, count = totals[f"{k}/sum"], totals[f"{k}/count"]
        out[k] = total / count if count != 0 else float("nan")
        out[f"{k}/sum"] = total
        out[f"{k}/count"] = count
    out |= _reduce_vector(mins, "min")
    out |= _reduce_vector(maxs, "max")
    return out


def flush_denormals(*, log=None) -> bool:
    """Make this process's CPU math flush subnormal floats to zero; returns whether the CPU supports it.

    Why: once the posterior collapses, the gradients and AdamW moments of unused z rows and router
    weights decay into subnormals, and MKL's sgemm runs those several-fold slower (measured on the
    demo: 0.5 -> 3.3 s/step). Values below ~1e-38 carry nothing the optimiser can use.
    """
    torch.set_flush_denormal(True)
    # Measured rather than taken from the return value: a subnormal times one must come out zero.
    supported = bool((torch.tensor(1e-40, dtype=torch.float32) * 1.0).item() == 0.0)
    if log is not None:
        log("cpu: subnormal floats flushed to zero" if supported else "cpu: this CPU cannot flush subnormal floats; steps may slow once gradients decay")
    return supported


# glibc's M_MMAP_THRESHOLD (malloc.h): blocks at least this large are mmapped, so freeing returns them to the system
_M_MMAP_THRESHOLD = -3
HEAP_MMAP_THRESHOLD = 1 << 20


def limit_heap_retention() -> bool:
    """Keep glibc from holding freed tensor memory in its heap; returns whether it applied (glibc only).

    Why: glibc raises its mmap threshold to the largest block freed so far (up to 32 MiB), after which
    tensors of up to that size come from the heap, and a heap fragmented by many of them is never given
    back. Measured on a SmolLM2-360M shape, world 2 on CPU under FSDP2 (bench/memory_bench.py, BENCHMARKS.md,
    "Host memory"): per-rank peak RSS 4.54 / 3.55 GiB against 1.92 / 1.92 GiB with a fixed 1 MiB threshold. Setting the threshold
    also ends its dynamic growth. Nothing else changes: not a number, only where the memory comes from.
    ``MALLOC_MMAP_THRESHOLD_`` in the environment, if set, is the user's choice and is left alone."""
    import ctypes
    import ctypes.util
    import sys

    if not sys.platform.startswith("linux") or "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return bool(libc.mallopt(_M_MMAP_THRESHOLD, HEAP_MMAP_THRESHOLD))
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        return False


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

    ``follow`` (``--follow-cores``): the old speed-first policy. Start on the launcher's count or on the cores
    idle now (:func:`free_cpu_cores`: OpenMP threads that share a busy core spin-wait, up to 10x slower), then
    follow the cores the others leave free (:class:`CoreFollower`); the numbers then depend on the load.
    ``OMP_NUM_THREADS`` still fixes the count.
    """
    if "OMP_NUM_THREADS" in os.environ:
        return None, f"OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']}"
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
