"""The engine protocol the trainer talks to, its config, and helpers shared by the engines.

The trainer never branches on the engine type. Its contract with every engine:

* Every forward goes through ``engine.module`` (the wrapped module, so ZeRO-3/FSDP hooks gather the
  shards), including the no-grad reference forward with adapters disabled on ``engine.model``.
* Each micro-batch loss is ``local_sum / global_count``, where ``global_count`` counts the valid
  examples of the whole optimizer step over all ranks and micro-batches (one ``all_reduce`` before the
  forwards). After the backwards of one optimizer step each parameter's gradient equals d/dtheta of
  the SUM over ranks and micro-batches of the losses passed to ``backward``: each engine undoes its own
  implicit averaging (DDP and DeepSpeed mean over ranks, DeepSpeed's division by accumulation steps,
  FSDP2's divide factor), so ``(world 1, accumulation 4)`` and ``(world 2, accumulation 2)`` give the
  same update.
* Every rank runs the same forwards and backwards, also when its micro-batch has no valid example
  (its loss is then ``0 * something``, never skipped): ZeRO-3 and FSDP hang otherwise.
* ``backward(loss, sync=False)`` on all but the last micro-batch of an optimizer step; ``step`` refuses
  to run after an unsynced backward.
* A non-finite gradient norm skips the update (DeepSpeed does this itself; the other engines match it).
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from zcvae import distributed as zdist
from zcvae.strict import StrictDataclass

__all__ = ["ENGINES", "PRECISIONS", "AdamWSettings", "Engine", "EngineBase", "EngineConfig"]

ENGINES = ("local", "deepspeed", "fsdp2")
PRECISIONS = ("fp32", "bf16")


@dataclass
class EngineConfig(StrictDataclass):
    """How the model is replicated or sharded over processes."""

    engine: str = "local"
    """``local`` (one process, or DDP under torchrun), ``deepspeed`` (ZeRO stage from the JSON) or ``fsdp2``."""

    deepspeed_config: str | None = None
    """DeepSpeed only. A path to a JSON file (e.g. ``ds_configs/zero3.json``), or one of the built-in
    names ``zero0 zero1 zero2 zero3 zero3_offload`` (the same dicts as the shipped files, available
    after ``pip install`` where ``ds_configs/`` is not). ``None`` means the built-in ``zero2``.
    Batch size, accumulation, clipping, optimizer and precision keys are owned by zcvae and rejected
    in the JSON."""

    precision: str = "fp32"
    """``fp32`` or ``bf16``: FSDP2 MixedPrecisionPolicy(bf16 params, fp32 reduce); DeepSpeed ``bf16``
    section (fp32 master weights); local engine autocast to bf16. Keep CPU/gloo runs in fp32."""

    gradient_checkpointing: bool = False
    """Recompute activations in backward (non-reentrant ``torch.utils.checkpoint``)."""

    cpu_offload: bool = False
    """DeepSpeed: offload optimizer state (and parameters under ZeRO-3) to CPU; FSDP2:
    ``CPUOffloadPolicy``. Not supported by the local engine."""

    def __post_init__(self) -> None:
        if self.engine not in ENGINES:
            raise ValueError(f"engine must be one of {ENGINES}, got {self.engine!r}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, got {self.precision!r}")
        for name in ("gradient_checkpointing", "cpu_offload"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.deepspeed_config is not None:
            if not isinstance(self.deepspeed_config, str) or not self.deepspeed_config:
                raise ValueError(f"deepspeed_config must be a path or a built-in name, got {self.deepspeed_config!r}")
            if self.engine != "deepspeed":
                raise ValueError(f"deepspeed_config is only used by engine='deepspeed', not {self.engine!r}")
        if self.cpu_offload and self.engine == "local":
            raise ValueError("cpu_offload needs engine='deepspeed' or 'fsdp2'; the local engine keeps everything on its device")


@runtime_checkable
class Engine(Protocol):
    """What the trainer may use. See the module docstring for the loss-scaling contract."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    is_main: bool
    module: nn.Module
    model: nn.Module

    def backward(self, loss: torch.Tensor, *, sync: bool) -> None: ...

    def step(self, *, max_grad_norm: float | None) -> float: ...

    def set_learning_rates(self, lrs: Sequence[float]) -> None: ...

    def save_checkpoint(self, directory: str, *, client_state: dict) -> None: ...

    def load_checkpoint(self, directory: str) -> dict: ...

    def trainable_state_dict(self) -> dict[str, torch.Tensor]: ...

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor: ...

    def barrier(self) -> None: ...


# ------------------------------------------------------------------------------------------------
# Shared by the engines
# ------------------------------------------------------------------------------------------------


class EngineBase:
    """Rank bookkeeping, reductions, the sync/step guard and the clip-then-step every engine shares."""

    optimizer: torch.optim.Optimizer
    """Set by the engine; what the default ``step`` and ``set_learning_rates`` drive."""

    def __init__(self, info: zdist.DistInfo, *, model: nn.Module, module: nn.Module, num_groups: int):
        """Call once ``model`` is wrapped or sharded: ``_params`` are the parameter objects the
        optimizer will hold (FSDP2 replaces them when it shards)."""
        self.rank = info.rank
        self.world_size = info.world_size
        self.local_rank = info.local_rank
        self.device = info.device
        self.is_main = info.rank == 0
        self.model = model
        self.module = module
        self._num_groups = num_groups
        self._unsynced_backward = False
        self._params = [p for _, p in trainable_named_parameters(model)]

    # The trainer calls these through the protocol.
    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        return zdist.all_reduce(tensor, op)

    def barrier(self) -> None:
        zdist.barrier()

    def _note_backward(self, sync: bool) -> None:
        if not isinstance(sync, bool):
            raise ValueError(f"sync must be a bool, got {sync!r}")
        self._unsynced_backward = not sync

    def _check_step(self, max_grad_norm: float | None) -> None:
        if self._unsynced_backward:
            raise RuntimeError(
                "step() after backward(sync=False): the last micro-batch of an optimizer step must call "
                "backward(loss, sync=True), or the ranks' gradients are never reduced"
            )
        if max_grad_norm is not None and not (max_grad_norm > 0 and math.isfinite(max_grad_norm)):
            raise ValueError(f"max_grad_norm must be a positive finite float or None, got {max_grad_norm!r}")

    def step(self, *, max_grad_norm: float | None) -> float:
        """Clip the reduced gradients, update unless their norm is non-finite, clear them; returns
        the pre-clip global norm. Engines whose wrapper owns the update (DeepSpeed) override it."""
        self._check_step(max_grad_norm)
        norm = float(clip_and_norm(self._params, max_grad_norm))
        if math.isfinite(norm):
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return norm

    def set_learning_rates(self, lrs: Sequence[float]) -> None:
        for group, lr in zip(self.optimizer.param_groups, self._check_lrs(lrs)):
            group["lr"] = lr

    def _check_lrs(self, lrs: Sequence[float]) -> list[float]:
        lrs = [float(lr) for lr in lrs]
        if len(lrs) != self._num_groups:
            raise ValueError(f"lrs must give one learning rate per param group ({self._num_groups}), got {len(lrs)}")
        if any(not math.isfinite(lr) or lr < 0 for lr in lrs):
            raise ValueError(f"lrs must be finite and >= 0, got {lrs}")
        return lrs


def named_param_groups(model: nn.Module, param_groups: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Validate ``param_groups`` and replace each parameter by its name in ``model``.

    Sharding wrappers (FSDP2) replace parameter objects, so groups are carried by name across the
    wrapping and rebuilt with :func:`groups_from_names`. Every trainable parameter of the model must be
    in exactly one group: one left out would receive gradients and never move.
    """
    if not param_groups:
        raise ValueError("param_groups must hold at least one group")
    names_by_id = {id(p): n for n, p in model.named_parameters()}
    seen: dict[int, str] = {}
    out = []
    for i, group in enumerate(param_groups):
        if not isinstance(group, Mapping) or "params" not in group:
            raise ValueError(f"param_groups[{i}] must be a dict with a 'params' list")
        unknown = sorted(set(group) - {"params", "lr", "weight_decay", "name"})
        if unknown:
            raise ValueError(f"param_groups[{i}] has unknown key(s) {unknown}")
        label = group.get("name", str(i))
        params = list(group["params"])
        if not params:
            raise ValueError(f"param_groups[{i}] ({label!r}) is empty; leave empty groups out")
        names = []
        for p in params:
            if id(p) not in names_by_id:
                raise ValueError(f"param_groups[{i}] ({label!r}) holds a parameter that is not in the model")
            if not p.requires_grad:
                raise ValueError(f"param_groups[{i}] ({label!r}) holds frozen parameter {names_by_id[id(p)]!r}")
            if id(p) in seen:
                raise ValueError(f"parameter {names_by_id[id(p)]!r} is in two param groups ({seen[id(p)]!r}, {label!r})")
            seen[id(p)] = label
            names.append(names_by_id[id(p)])
        out.append({**{k: v for k, v in group.items() if k != "params"}, "params": names})
    missing = [n for n, p in model.named_parameters() if p.requires_grad and id(p) not in seen]
    if missing:
        raise ValueError(f"trainable parameters missing from param_groups: {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    return out


def groups_from_names(model: nn.Module, named_groups: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    params = dict(model.named_parameters())
    return [{**g, "params": [params[n] for n in g["params"]]} for g in named_groups]


@dataclass(frozen=True)
class AdamWSettings:
    """The AdamW every engine builds; ``learning_rate``/``weight_decay`` are the defaults for param
    groups that leave them out (group dicts win, so per-group values survive every engine)."""

    learning_rate: float
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8

    def build(self, groups: Sequence[Mapping[str, Any]]) -> torch.optim.AdamW:
        # foreach=False: DeepSpeed flattens groups into one tensor and steps it element by element;
        # the same per-element math keeps the engines numerically interchangeable.
        return torch.optim.AdamW(
            [dict(g) for g in groups],
            lr=self.learning_rate,
            weight_decay=self.weight_decay,
            betas=self.betas,
            eps=self.eps,
            foreach=False,
        )


def prepare_model(config: EngineConfig, model: nn.Module, param_groups: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """What every engine does to ``model`` before wrapping or sharding it; returns the groups by name.

    The groups are checked and carried by name first (:func:`named_param_groups`), then activation
    checkpointing is switched on, so the layers a wrapper later shards are the checkpointed ones.
    """
    named_groups = named_param_groups(model, param_groups)
    if config.gradient_checkpointing:
        enable_gradient_checkpointing(model)
    return named_groups


def enable_gradient_checkpointing(model: nn.Module) -> None:
    """Non-reentrant activation checkpointing on the Hugging Face model inside ``model``.

    Non-reentrant checkpointing needs no ``enable_input_require_grads`` (the embedding output of a
    frozen base does not have to require grad) and runs under DDP, ZeRO-3 and FSDP2.
    """
    target = next((m for m in model.modules() if hasattr(m, "gradient_checkpointing_enable")), None)
    if target is None:
        raise ValueError("gradient_checkpointing=True but the model has no gradient_checkpointing_enable()")
    target.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    config = getattr(target, "config", None)
    if config is not None and hasattr(config, "use_cache"):
        # A KV cache is meaningless in training and conflicts with recomputation.
        config.use_cache = False


def trainable_named_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


def clip_and_norm(params: Sequence[nn.Parameter], max_grad_norm: float | None) -> torch.Tensor:
    """Global L2 norm of the (already reduced) gradients; clips in place when ``max_grad_norm``.

    Works on plain and DTensor gradients: a DTensor norm is made full with one all-reduce, so every
    rank gets the same value. Clipping multiplies by ``max_norm / (norm + 1e-6)`` as DeepSpeed does.
    """
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.zeros(())
    norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0)
    if hasattr(norm, "full_tensor"):
        norm = norm.full_tensor()
    if max_grad_norm is not None and torch.isfinite(norm):
        torch.nn.utils.clip_grads_with_norm_([p for p in params if p.grad is not None], max_grad_norm, norm)
    return norm


def save_client_state(directory: str, client_state: dict) -> None:
    torch.save(client_state, os.path.join(directory, "client_state.pt"))


def load_client_state(directory: str) -> dict:
    path = os.path.join(directory, "client_state.pt")
    if not os.path.exists(path):
        raise FileNotFoundError(f"no client_state.pt in checkpoint directory {directory!r}")
    # weights_only: a checkpoint is data; client_state must hold tensors, numbers, strings and containers.
    return torch.load(path, map_location="cpu", weights_only=True)
