"""FSDP2 (``torch.distributed.fsdp.fully_shard``): each decoder layer, then the root.

Set-up checklist, in this order:
1. activation checkpointing on the Hugging Face model (before sharding, so the wrapped layers are the
   checkpointed ones);
2. ``fully_shard`` every decoder layer, then the whole model, on a 1-D mesh over all ranks;
3. gradient divide factor 1 on every FSDP module: FSDP2 otherwise divides the reduce-scattered
   gradient by the data-parallel size, and the contract is the SUM of the ranks' losses;
4. AdamW over the new DTensor parameters (``fully_shard`` replaces parameter objects, so the
   trainer's groups are carried across by name).

``backward(sync=False)`` turns gradient reduction off (``set_requires_gradient_sync``): unsharded
gradients accumulate locally and the next synced backward reduce-scatters them all at once.

Sharded loading (``FSDP2Loading``, see ``zcvae.model.sharded``): the model arrives with its parameters
on the meta device; after step 2 ``to_empty`` gives each rank storage for its shards only, and the
model's ``materialize`` callback writes every tensor through ``FSDP2Loading.write``, which scatters
rank 0's full tensor (``distribute_tensor(src_data_rank=0)``) so a rank receives its shard alone.

Checkpoints are torch DCP directories (``model`` = trainable parameters only, ``optim``) plus
``client_state.pt`` written by rank 0.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor

from zcvae import distributed as zdist
from zcvae.engines.base import AdamWSettings, EngineBase, EngineConfig, groups_from_names, load_client_state, prepare_model
from zcvae.engines.base import save_client_state, trainable_named_parameters
from zcvae.model import hf_compat

__all__ = ["FSDP2Engine", "FSDP2Loading", "parameters_on_meta"]


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Every parameter registered inside is moved to the meta device; buffers stay real.

    ``torch.device("meta")`` would put the buffers there too, and RoPE's ``inv_freq`` (computed in the
    module's constructor, in no checkpoint) would then be lost. This is accelerate's
    ``init_empty_weights(include_buffers=False)``, which zcvae does not depend on. The parameter is
    created on the CPU first: an uninitialised ``torch.empty`` whose pages are never touched."""
    original = nn.Module.register_parameter

    def register(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        original(module, name, param)
        if param is not None and param.device.type != "meta":
            module._parameters[name] = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)

    nn.Module.register_parameter = register
    try:
        yield
    finally:
        nn.Module.register_parameter = original


class FSDP2Loading:
    """``zcvae.model.sharded.ShardedLoading`` for FSDP2: parameters built on meta, written as shards."""

    ds_config = None

    def __init__(self, config: EngineConfig):
        info = zdist.init_distributed(require_group=True)
        self.rank = info.rank
        # CPUOffloadPolicy keeps the sharded parameters on the host
        self.device = torch.device("cpu") if config.cpu_offload else info.device

    def build_context(self, dtype: torch.dtype):
        return parameters_on_meta()

    def whole(self, params):
        return contextlib.nullcontext()  # meta tensors have their whole shape already

    def prepare(self, model: nn.Module) -> None:
        model.to_empty(device=self.device)

    @torch.no_grad()
    def write(self, owner: nn.Module, name: str, full: torch.Tensor | None, *, on_every_rank: bool) -> None:
        t = getattr(owner, name)
        if isinstance(t, DTensor):
            if not on_every_rank and self.rank != 0:
                full = torch.empty(t.shape, dtype=t.dtype)
            value = full.to(device=t.device, dtype=t.dtype)
            shard = distribute_tensor(value, t.device_mesh, t.placements, src_data_rank=None if on_every_rank else 0)
            t.to_local().copy_(shard.to_local())
            return
        if not on_every_rank:
            full = self.broadcast(full, shape=tuple(t.shape), dtype=t.dtype)
        t.copy_(full.to(device=t.device, dtype=t.dtype))

    def broadcast(self, full: torch.Tensor | None, *, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        buf = full.to(self.device) if self.rank == 0 else torch.empty(shape, dtype=dtype, device=self.device)
        torch.distributed.broadcast(buf, src=0)
        return buf.cpu()


class FSDP2Engine(EngineBase):
    def __init__(
        self,
        config: EngineConfig,
        *,
        model: nn.Module,
        param_groups: Sequence[Mapping[str, Any]],
        adamw: AdamWSettings,
        decoder_layers: Sequence[nn.Module] | None = None,
        materialize: Callable[[], None] | None = None,
    ):
        info = zdist.init_distributed(require_group=True)
        if config.precision == "bf16" and info.world_size > 1 and torch.distributed.get_backend() == "gloo":
            raise ValueError("precision: bf16 collectives are not supported by gloo (CPU); use fp32 on CPU")
        named_groups = prepare_model(config, model, param_groups)
        layers = list(decoder_layers) if decoder_layers is not None else hf_compat.decoder_layers(model)
        if not layers:
            raise ValueError(
                "decoder_layers: found no decoder layers to shard (no _no_split_modules class and no "
                "ModuleList named 'layers' or 'h'); pass decoder_layers explicitly"
            )
        owned = {id(m) for m in model.modules()}
        if any(id(m) not in owned for m in layers):
            raise ValueError("decoder_layers: every layer must be a submodule of the model")
        mesh = init_device_mesh(info.device.type, (info.world_size,))
        mp_policy = (
            MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            if config.precision == "bf16"
            else MixedPrecisionPolicy()
        )
        offload_policy = CPUOffloadPolicy(pin_memory=info.device.type == "cuda") if config.cpu_offload else OffloadPolicy()
        for layer in layers:
            fully_shard(layer, mesh=mesh, mp_policy=mp_policy, offload_policy=offload_policy)
        # The root keeps FSDP2's default (its parameters stay gathered from forward to backward). That is
        # safe because nothing calls peft's disable_adapter(), which sets requires_grad on whichever
        # parameter object is registered when it exits (here it would be the temporary unsharded copy):
        # the reference forward uses hf_compat's adapters_disabled, which flips only the tuner layers' own
        # flags. Resharding the root after every forward would cost one all-gather per backward.
        fully_shard(model, mesh=mesh, mp_policy=mp_policy, offload_policy=offload_policy)
        self._fsdp_modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
        for m in self._fsdp_modules:
            # Both setters act on one module, not its children. Factor 1 = sum over ranks; forcing
            # plain SUM collectives avoids PREMUL_SUM, which gloo lacks (and with factor 1 costs no
            # extra scaling kernel on nccl either).
            m.set_gradient_divide_factor(1.0)
            m.set_force_sum_reduction_for_comms(True)
        if materialize is not None:  # a sharded build: the weights arrive now, shard by shard
            materialize()
        super().__init__(info, model=model, module=model, num_groups=len(named_groups))
        self.optimizer = adamw.build(groups_from_names(model, named_groups))

    def backward(self, loss: torch.Tensor, *, sync: bool) -> None:
        self._note_backward(sync)
        self.model.set_requires_gradient_sync(sync, recurse=True)
        loss.backward()

    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        with torch.no_grad():
            # full_tensor() is a collective: same parameters, same order on every rank. After a no-grad
            # forward the root's parameters are still gathered (plain tensors, on every rank alike).
            for name, p in trainable_named_parameters(self.model):
                full = p.full_tensor() if hasattr(p, "full_tensor") else p.detach()
                if self.is_main:
                    out[name] = full.to("cpu", copy=True)
        return out

    def _state_options(self) -> StateDictOptions:
        # Frozen weights come from the base model when a run is rebuilt; keep checkpoints adapter-sized.
        return StateDictOptions(ignore_frozen_params=True)

    def save_checkpoint(self, directory: str, *, client_state: dict) -> None:
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer, options=self._state_options())
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=directory)
        if self.is_main:
            save_client_state(directory, client_state)
        self.barrier()

    def load_checkpoint(self, directory: str) -> dict:
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer, options=self._state_options())
        state = {"model": model_sd, "optim": optim_sd}
        dcp.load(state, checkpoint_id=directory)
        set_state_dict(
            self.model,
            self.optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optim"],
            options=StateDictOptions(ignore_frozen_params=True, strict=False),
        )
        client_state = load_client_state(directory)
        self.barrier()
        return client_state
