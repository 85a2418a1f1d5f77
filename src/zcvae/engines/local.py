"""One process, or data-parallel replicas (DDP) under torchrun.

Gradient reduction uses a DDP communication hook that SUMS buckets over ranks instead of DDP's
default mean, so the gradient is d/dtheta of the sum of the losses passed to ``backward`` (the
trainer already divides by the global count). The hook also implements ``sync=False``: DDP's
``no_sync()`` has to wrap the forward, which the protocol cannot see, whereas the hook decides at
backward time and returns the bucket unreduced. The bucket holds the gradient accumulated so far on
this rank, so the first synced backward reduces every earlier micro-batch as well.

Checkpoint layout (rank 0 writes, all ranks read): ``trainable.safetensors`` (requires_grad
parameters; frozen weights come from the base model when the run is rebuilt), ``optimizer.pt`` and
``client_state.pt`` (both ``torch.load(weights_only=True)``-loadable).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from zcvae import distributed as zdist
from zcvae.engines.base import AdamWSettings, EngineBase, EngineConfig, groups_from_names, load_client_state, prepare_model
from zcvae.engines.base import save_client_state, trainable_named_parameters

__all__ = ["LocalEngine"]


class _Autocast(nn.Module):
    """Runs the wrapped module's forward under bf16 autocast (fp32 master weights stay fp32)."""

    def __init__(self, inner: nn.Module, device_type: str):
        super().__init__()
        self.inner = inner
        self.device_type = device_type

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        with torch.autocast(device_type=self.device_type, dtype=torch.bfloat16):
            return self.inner(*args, **kwargs)


# DDP's communication hook: sum the bucket over ranks (a sum, not DDP's mean: the engines' gradients are the exact
# sum of the passed losses) on a step's last micro-batch, and keep this rank's gradients as they are on the others.
# DDP's no_sync() would have to wrap the forward, but the engine learns whether to sync only at backward(sync=...).
# No annotations: DDP checks them by identity, which the postponed (string) annotations of this
# module would fail.
def _all_reduce_or_keep_local(engine, bucket):
    buffer = bucket.buffer()
    if not engine._sync_grads:
        held = torch.futures.Future()
        held.set_result(buffer)
        return held
    return dist.all_reduce(buffer, op=dist.ReduceOp.SUM, async_op=True).get_future().then(lambda f: f.value()[0])


class LocalEngine(EngineBase):
    def __init__(self, config: EngineConfig, *, model: nn.Module, param_groups: Sequence[Mapping[str, Any]], adamw: AdamWSettings):
        info = zdist.init_distributed()
        named_groups = prepare_model(config, model, param_groups)
        model.to(info.device)
        module: nn.Module = model
        self._sync_grads = True
        if info.world_size > 1:
            # DDP broadcasts rank 0's parameters and buffers at construction, so replicas start equal.
            # find_unused_parameters: a model may leave some trainable parameter out of a forward.
            module = DistributedDataParallel(
                model,
                device_ids=[info.device.index] if info.device.type == "cuda" else None,
                find_unused_parameters=True,
                broadcast_buffers=False,
            )
            module.register_comm_hook(self, _all_reduce_or_keep_local)
        if config.precision == "bf16":
            module = _Autocast(module, info.device.type)
        super().__init__(info, model=model, module=module, num_groups=len(named_groups))
        self.optimizer = adamw.build(groups_from_names(model, named_groups))

    def backward(self, loss: torch.Tensor, *, sync: bool) -> None:
        self._note_backward(sync)
        self._sync_grads = sync
        loss.backward()

    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        if not self.is_main:
            return {}
        return {n: p.detach().to("cpu", copy=True) for n, p in trainable_named_parameters(self.model)}

    def save_checkpoint(self, directory: str, *, client_state: dict) -> None:
        if self.is_main:
            os.makedirs(directory, exist_ok=True)
            save_file({n: t.contiguous() for n, t in self.trainable_state_dict().items()}, os.path.join(directory, "trainable.safetensors"))
            torch.save(self.optimizer.state_dict(), os.path.join(directory, "optimizer.pt"))
            save_client_state(directory, client_state)
        self.barrier()

    def load_checkpoint(self, directory: str) -> dict:
        tensors = load_file(os.path.join(directory, "trainable.safetensors"))
        params = dict(trainable_named_parameters(self.model))
        if set(tensors) != set(params):
            raise ValueError(
                f"checkpoint {directory!r} does not match the model's trainable parameters: "
                f"missing {sorted(set(params) - set(tensors))[:5]}, unexpected {sorted(set(tensors) - set(params))[:5]}"
            )
        with torch.no_grad():
            for n, p in params.items():
                p.copy_(tensors[n])
        state = torch.load(os.path.join(directory, "optimizer.pt"), map_location="cpu", weights_only=True)
        self.optimizer.load_state_dict(state)
        client_state = load_client_state(directory)
        self.barrier()
        return client_state

