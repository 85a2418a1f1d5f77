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
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

__all__ = ["DistInfo", "all_reduce", "barrier", "dist_info", "init_distributed", "reduce_metrics"]

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
