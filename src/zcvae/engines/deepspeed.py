"""DeepSpeed ZeRO stages 0-3 (optionally CPU offload). The only module that imports ``deepspeed``.

Undoing DeepSpeed's implicit averaging, so the gradient is d/dtheta of the SUM of the losses:

* Accumulation: the DeepSpeed config always says ``gradient_accumulation_steps: 1`` and ``backward``
  passes ``scale_wrt_gas=False``, so no micro-batch loss is divided by the accumulation count. The
  trainer's ``sync`` flag drives ``set_gradient_accumulation_boundary`` instead of DeepSpeed's own
  micro-step counter, so the trainer alone owns how many micro-batches an optimizer step has.
* Ranks: every stage divides the reduced gradient by the data-parallel size; ``backward`` multiplies
  the loss by ``world_size`` first (exact in fp32 for power-of-two worlds, one rounding otherwise).

Clipping and the gradient norm happen inside DeepSpeed's optimizer wrapper, where the partitioned
gradients live: ``step`` sets its ``clip_grad`` from ``max_grad_norm`` and reads back the pre-clip
global norm. ZeRO-0 in fp32 has no wrapper (the client AdamW steps full, all-reduced ``p.grad``), so
the engine clips those itself with the same formula.

The client optimizer is a torch AdamW over the trainer's param groups; DeepSpeed keeps those group
dicts, so per-group learning rates and weight decay survive. Under ZeRO-Offload a torch optimizer is
slower than DeepSpeedCPUAdam, which matters little for adapters (their optimizer state is small) and
avoids compiling the CPU Adam op; ``zero_force_ds_cpu_optimizer`` is therefore set to false.

Checkpoints are DeepSpeed's own (``save_checkpoint(exclude_frozen_parameters=True)``: frozen base
weights come from the base model when the run is rebuilt). DeepSpeed loads them with pickle
(``torch.load(weights_only=False)``): load only checkpoints your own runs wrote.
"""

from __future__ import annotations

import copy
import json
import logging
import math
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from zcvae import distributed as zdist
from zcvae.engines.base import AdamWSettings, EngineBase, EngineConfig, clip_and_norm, groups_from_names, prepare_model
from zcvae.engines.base import trainable_named_parameters
from zcvae.model import hf_compat

logger = logging.getLogger(__name__)

__all__ = ["BUILTIN_DEEPSPEED_CONFIGS", "DeepSpeedEngine", "Zero3Loading", "resolve_deepspeed_config"]

PREFETCH_BUCKET_GPU = 50_000_000
"""ZeRO-3's ``stage3_prefetch_bucket_size`` on a GPU (DeepSpeed's default); 0 on CPU."""

_COMMON: dict[str, Any] = {
    "steps_per_print": 1_000_000_000,
    "wall_clock_breakdown": False,
}
_ZERO3: dict[str, Any] = {
    "stage": 3,
    "overlap_comm": True,
    "contiguous_gradients": True,
    "reduce_bucket_size": 50_000_000,
    # stage3_prefetch_bucket_size: set by resolve_deepspeed_config, by device.
    # Parameters below this many elements stay whole on every rank (LoRA matrices usually do):
    # cheaper than gathering them for every forward.
    "stage3_param_persistence_threshold": 100_000,
    "stage3_max_live_parameters": 1_000_000_000,
    "stage3_max_reuse_distance": 1_000_000_000,
    # zcvae exports adapters by gathering only trainable parameters; never consolidate the base.
    "stage3_gather_16bit_weights_on_model_save": False,
}
BUILTIN_DEEPSPEED_CONFIGS: dict[str, dict[str, Any]] = {
    "zero0": {**_COMMON, "zero_optimization": {"stage": 0}},
    "zero1": {**_COMMON, "zero_optimization": {"stage": 1, "reduce_bucket_size": 50_000_000}},
    "zero2": {
        **_COMMON,
        "zero_optimization": {
            "stage": 2,
            "overlap_comm": True,
            "contiguous_gradients": True,
            "reduce_scatter": True,
            "reduce_bucket_size": 50_000_000,
            "allgather_bucket_size": 50_000_000,
        },
    },
    "zero3": {**_COMMON, "zero_optimization": dict(_ZERO3)},
    "zero3_offload": {
        **_COMMON,
        "zero_optimization": {
            **_ZERO3,
            "offload_optimizer": {"device": "cpu", "pin_memory": True},
            "offload_param": {"device": "cpu", "pin_memory": True},
        },
    },
}
"""The dicts of ``ds_configs/<name>.json``, usable by name after ``pip install`` (no repo checkout)."""

# Keys zcvae owns: the trainer decides accumulation and clipping, EngineConfig decides precision,
# build_engine decides the optimizer. A JSON that sets them would be silently contradicted.
_OWNED_KEYS = {
    "train_batch_size": "the trainer's batch size",
    "train_micro_batch_size_per_gpu": "the trainer's batch size",
    "gradient_accumulation_steps": "the trainer's accumulation (it calls backward(sync=...))",
    "gradient_clipping": "the trainer's max_grad_norm",
    "optimizer": "build_engine's AdamW over the trainer's param groups",
    "scheduler": "the trainer's learning-rate schedule (set_learning_rates)",
    "fp16": "EngineConfig.precision (fp16 is not supported)",
    "bf16": "EngineConfig.precision",
    "amp": "EngineConfig.precision",
    "torch_autocast": "EngineConfig.precision",
}


def _load_user_config(source: str | None) -> dict[str, Any]:
    if source is None:
        return copy.deepcopy(BUILTIN_DEEPSPEED_CONFIGS["zero2"])
    if not os.path.exists(source) and source in BUILTIN_DEEPSPEED_CONFIGS:
        return copy.deepcopy(BUILTIN_DEEPSPEED_CONFIGS[source])
    if not os.path.isfile(source):
        raise ValueError(
            f"deepspeed_config: {source!r} is neither a file nor a built-in name {sorted(BUILTIN_DEEPSPEED_CONFIGS)}"
        )
    with open(source, encoding="utf-8") as f:
        try:
            data = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"deepspeed_config: {source!r} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"deepspeed_config: {source!r} must hold a JSON object")
    return data


def resolve_deepspeed_config(config: EngineConfig) -> dict[str, Any]:
    """The dict handed to ``deepspeed.initialize``: the user's JSON plus the keys zcvae owns.

    Pure: reads the JSON file, imports nothing from DeepSpeed.
    """
    ds = _load_user_config(config.deepspeed_config)
    owned = sorted(set(ds) & set(_OWNED_KEYS))
    if owned:
        raise ValueError(
            f"deepspeed_config: remove {owned} from the JSON; zcvae sets them from "
            + "; ".join(f"{k}: {_OWNED_KEYS[k]}" for k in owned)
        )
    zero = ds.setdefault("zero_optimization", {"stage": 0})
    if not isinstance(zero, dict):
        raise ValueError("deepspeed_config: zero_optimization must be a JSON object")
    stage = zero.setdefault("stage", 0)
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"deepspeed_config: zero_optimization.stage must be 0, 1, 2 or 3, got {stage!r}")
    if stage == 3:
        # Prefetching gathers the next bucket while a GPU computes. On CPU it only adds memory: zcvae's
        # passes call the layers in a changing order, which keeps invalidating DeepSpeed's trace and
        # discards the prefetched buckets. Measured +0.46 GiB per rank at 360M, world 2 (BENCHMARKS.md,
        # "Host memory"). A value in the user's JSON wins.
        zero.setdefault("stage3_prefetch_bucket_size", PREFETCH_BUCKET_GPU if torch.cuda.is_available() else 0)
    if config.cpu_offload:
        if stage == 0:
            raise ValueError("cpu_offload needs ZeRO stage >= 1 (the deepspeed_config says stage 0)")
        zero.setdefault("offload_optimizer", {"device": "cpu", "pin_memory": torch.cuda.is_available()})
        if stage == 3:
            zero.setdefault("offload_param", {"device": "cpu", "pin_memory": torch.cuda.is_available()})
    # Accumulation is driven by backward(sync=...) and set_gradient_accumulation_boundary; these two
    # only feed DeepSpeed's sample counter and must leave gradients unscaled.
    ds["train_micro_batch_size_per_gpu"] = 1
    ds["gradient_accumulation_steps"] = 1
    ds["gradient_clipping"] = 0.0
    if config.precision == "bf16":
        ds["bf16"] = {"enabled": True}
    ds.setdefault("zero_allow_untested_optimizer", True)
    ds.setdefault("zero_force_ds_cpu_optimizer", False)
    return ds


def _register_trainable_token_bases(model: nn.Module) -> None:
    """ZeRO-3 gathers a module's own parameters before its forward. peft's trainable-token layer reads
    its child's full weight (``base_layer.weight``, the embedding or a tied LM head) without calling the
    child, so with the weight partitioned the merge sees a 0-element shard and fails; registering the
    weight as the layer's external parameter makes ZeRO-3 gather it for that forward."""
    import deepspeed

    for module, weight in hf_compat.trainable_token_base_weights(model):
        deepspeed.zero.register_external_parameter(module, weight)


def _release_after_each_backward_call(ds_engine: Any) -> None:
    """Make ZeRO-3 release a module's parameters after the backward of each of its forward calls.

    DeepSpeed counts a module's pending input gradients in one per-module counter, which every forward
    call resets to that call's count. A module called more than once before backward (zcvae runs the
    shared x-prefix, the K branches and the posterior pass through the same layers) therefore reaches
    zero once, after the backward of its last call, and never again: every later backward visit gathers
    the parameters anew and keeps them until the step ends. Measured, each rank ends its backward holding
    the whole base gathered (690 MiB of live bf16 parameters at 360M against 95 MiB with this), the peak
    of the step (BENCHMARKS.md, "Host memory"). This swaps in the same autograd hook with one counter per
    call; a linear layer whose parameters another call released in between gathers them again itself
    (DeepSpeed's ZeRO-3 linear), and the parameters of other layers are below the persistence threshold.
    Nothing numeric changes: the same gathers, fewer held at once (step losses identical, tested)."""
    offload = getattr(ds_engine.optimizer, "parameter_offload", None)
    hooked = [m for m in ds_engine.module.modules() if "post_bwd_fn" in m.__dict__]  # DeepSpeed's hook class per module
    if offload is None or not hooked or not hasattr(offload, "post_sub_module_backward_function"):
        import deepspeed

        logger.warning(f"[engine] ZeRO-3: DeepSpeed {deepspeed.__version__} lacks the post-backward hooks zcvae adjusts; "
                       "a layer called more than once per step stays gathered to the end of its backward (more memory, same numbers)")
        return
    for module in hooked:
        module.post_bwd_fn = _per_call_post_backward(module, offload)


def _per_call_post_backward(module: nn.Module, offload: Any) -> type[torch.autograd.Function]:
    # DeepSpeed applies this to each input tensor of each call, after setting ds_grads_remaining to 0
    # for the call: a 0 here starts a new call's counter.
    class PostBackwardPerCall(torch.autograd.Function):
        @staticmethod
        def forward(t: torch.Tensor) -> torch.Tensor:
            return t.detach()

        @staticmethod
        def setup_context(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
            (t,) = inputs
            ctx.call = None
            if t.requires_grad:
                if module.ds_grads_remaining == 0:
                    module.__dict__["_zcvae_pending_grads"] = [0]
                ctx.call = module.__dict__["_zcvae_pending_grads"]
                ctx.call[0] += 1
                module.ds_grads_remaining += 1

        @staticmethod
        def backward(ctx: Any, *grads: torch.Tensor) -> tuple:
            if ctx.call is not None:
                ctx.call[0] -= 1
                if ctx.call[0] == 0:
                    offload.post_sub_module_backward_function(module)
            return grads

    return PostBackwardPerCall


def _start_deepspeed(config: EngineConfig) -> zdist.DistInfo:
    import deepspeed

    info = zdist.init_distributed(require_group=True)
    if config.precision == "bf16" and info.world_size > 1 and dist.get_backend() == "gloo":
        raise ValueError("precision: bf16 collectives are not supported by gloo (CPU); use fp32 on CPU")
    # deepspeed.initialize insists on these even for a single process started without a launcher.
    for name, value in (("RANK", info.rank), ("WORLD_SIZE", info.world_size), ("LOCAL_RANK", info.local_rank)):
        os.environ.setdefault(name, str(value))
    # it JIT-builds an op on CPU (deepspeed_shm_comm): a lock left by a killed build would hang it, silently
    from zcvae.engines.extensions import check_build_locks

    check_build_locks()
    # Adopts the torch group just created (DeepSpeed needs a group even at world size 1).
    deepspeed.init_distributed(dist_backend=dist.get_backend(), verbose=False)
    return info


class Zero3Loading:
    """``zcvae.model.sharded.ShardedLoading`` for ZeRO-3: ``zero.Init`` partitions each module's
    parameters as it is built; a write gathers one parameter, rank 0 fills it, and it is partitioned again."""

    def __init__(self, config: EngineConfig):
        self.ds_config = resolve_deepspeed_config(config)
        info = _start_deepspeed(config)
        self.rank, self.device = info.rank, info.device

    def build_context(self, dtype: torch.dtype):
        import deepspeed

        # The dtype goes through the config: DeepSpeed 0.19 ignores Init(dtype=...) where the accelerator
        # lacks fp16 (the CPU's), and makes bf16 partitions. No F.linear patch: it persists process-wide.
        init_config = {**self.ds_config, "bf16": {"enabled": dtype == torch.bfloat16}}
        return deepspeed.zero.Init(config_dict_or_path=init_config, mem_efficient_linear=False)

    def whole(self, params):
        import deepspeed

        return deepspeed.zero.GatheredParameters(list(params), modifier_rank=None)

    def prepare(self, model: nn.Module) -> None:
        pass  # the partitions have storage from the start

    @torch.no_grad()
    def write(self, owner: nn.Module, name: str, full: torch.Tensor | None, *, on_every_rank: bool) -> None:
        import deepspeed

        t = getattr(owner, name)
        if hasattr(t, "ds_id"):
            with deepspeed.zero.GatheredParameters([t], modifier_rank=0):
                if self.rank == 0:
                    t.data.copy_(full.to(device=t.device, dtype=t.dtype))
            return
        # not partitioned (yet): LoRA, the trainable rows, the heads and buffers, the same on every rank
        if not on_every_rank:
            full = self.broadcast(full, shape=tuple(t.shape), dtype=t.dtype)
        t.data.copy_(full.to(device=t.device, dtype=t.dtype))

    def broadcast(self, full: torch.Tensor | None, *, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        buf = full.to(self.device) if self.rank == 0 else torch.empty(shape, dtype=dtype, device=self.device)
        dist.broadcast(buf, src=0)
        return buf.cpu()


class DeepSpeedEngine(EngineBase):
    def __init__(self, config: EngineConfig, *, model: nn.Module, param_groups: Sequence[Mapping[str, Any]], adamw: AdamWSettings,
                 materialize: Callable[[], None] | None = None):
        import deepspeed

        ds_config = resolve_deepspeed_config(config)
        info = _start_deepspeed(config)
        if materialize is not None:
            # a sharded build (ZeRO-3 partitions made at build time): every value in place before
            # deepspeed.initialize copies the trainable ones into the optimizer's flat partitions
            materialize()
        named_groups = prepare_model(config, model, param_groups)
        self._client_optimizer = adamw.build(groups_from_names(model, named_groups))
        ds_engine, _, _, _ = deepspeed.initialize(model=model, optimizer=self._client_optimizer, config=ds_config)
        if ds_config["zero_optimization"]["stage"] == 3:
            _register_trainable_token_bases(model)
            _release_after_each_backward_call(ds_engine)
        super().__init__(info, model=model, module=ds_engine, num_groups=len(named_groups))
        self.stage = int(ds_config["zero_optimization"]["stage"])
        self.ds_config = ds_config

    def backward(self, loss: torch.Tensor, *, sync: bool) -> None:
        self._note_backward(sync)
        self.module.set_gradient_accumulation_boundary(sync)
        # DeepSpeed averages reduced gradients over ranks; scale up so they come out summed.
        self.module.backward(loss * self.world_size, scale_wrt_gas=False)

    def step(self, *, max_grad_norm: float | None) -> float:
        self._check_step(max_grad_norm)
        wrapper = self.module.optimizer
        if hasattr(wrapper, "clip_grad"):
            # ZeRO-1/2/3 and the bf16 wrapper clip (and skip non-finite steps) inside their step().
            wrapper.clip_grad = float(max_grad_norm) if max_grad_norm is not None else 0.0
            self.module.step()
            return float(self.module.get_global_grad_norm())
        norm = float(clip_and_norm(self._params, max_grad_norm))
        if math.isfinite(norm):
            self.module.step()
        else:
            self.module.zero_grad()
        return norm

    def set_learning_rates(self, lrs: Sequence[float]) -> None:
        # DeepSpeed's wrappers step the client optimizer's own group dicts (their params replaced
        # by flat partitions), so this is where the learning rate is read.
        for group, lr in zip(self._client_optimizer.param_groups, self._check_lrs(lrs)):
            group["lr"] = lr

    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        import deepspeed

        out: dict[str, torch.Tensor] = {}
        # Same parameters, same order on every rank: each gather is a collective.
        for name, p in trainable_named_parameters(self.model):
            if hasattr(p, "ds_id"):
                with deepspeed.zero.GatheredParameters([p], modifier_rank=None):
                    if self.is_main:
                        out[name] = p.data.detach().to("cpu", copy=True)
            elif self.is_main:
                out[name] = p.detach().to("cpu", copy=True)
        return out

    def save_checkpoint(self, directory: str, *, client_state: dict) -> None:
        self.module.save_checkpoint(directory, client_state=dict(client_state), exclude_frozen_parameters=True)
        self.barrier()

    def load_checkpoint(self, directory: str) -> dict:
        # load_module_strict=False: the checkpoint holds only trainable parameters by design.
        path, client_state = self.module.load_checkpoint(directory, load_module_strict=False)
        if path is None:
            raise FileNotFoundError(f"no DeepSpeed checkpoint found in {directory!r}")
        self.barrier()
        return dict(client_state or {})
