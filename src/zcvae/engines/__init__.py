"""Scale-out engines behind one small protocol (see ``base.py`` for the loss-scaling contract).

    from zcvae.engines import EngineConfig, build_engine
    engine = build_engine(EngineConfig(engine="fsdp2"), model=peft_model, param_groups=groups, learning_rate=1e-4)
    count = engine.all_reduce(torch.tensor(float(num_valid_local)))          # before the forwards
    for i, mb in enumerate(micro_batches):
        ref_nll = engine.module(mb, mode="reference")                         # reference first
        loss = per_example_loss(engine.module(mb, mode="train"), ref_nll).sum() / count
        engine.backward(loss, sync=i == len(micro_batches) - 1)
    grad_norm = engine.step(max_grad_norm=1.0)

``deepspeed`` is imported only when a DeepSpeed engine is built.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from torch import nn

from zcvae.engines.base import AdamWSettings, Engine, EngineConfig

__all__ = ["Engine", "EngineConfig", "build_engine", "sharded_loading"]


def sharded_loading(config: EngineConfig):
    """How the model must be built for ``config``'s engine: a ``zcvae.model.sharded.ShardedLoading``
    for the engines that shard parameters (ZeRO-3, FSDP2), so that no rank ever holds the whole
    backbone; None for those that replicate it by definition (local, ZeRO-0/1/2), which load it whole
    on every rank. Starts the process group (and DeepSpeed's) if needed."""
    if config.engine == "fsdp2":
        from zcvae.engines.fsdp2 import FSDP2Loading

        return FSDP2Loading(config)
    if config.engine == "deepspeed":
        from zcvae.engines.deepspeed import Zero3Loading, resolve_deepspeed_config

        if resolve_deepspeed_config(config)["zero_optimization"]["stage"] == 3:
            return Zero3Loading(config)
    return None


def build_engine(
    config: EngineConfig,
    *,
    model: nn.Module,
    param_groups: Sequence[Mapping[str, Any]],
    learning_rate: float,
    weight_decay: float = 0.0,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    decoder_layers: Sequence[nn.Module] | None = None,
    materialize: Callable[[], None] | None = None,
) -> Engine:
    """Wrap ``model`` (on CPU, peft adapters and resized embeddings already in place) for training.

    ``param_groups``: ``[{"params": [...], "lr": float, "weight_decay": float, "name": str}, ...]``;
    every trainable parameter in exactly one non-empty group; ``set_learning_rates`` takes one lr per
    group in this order. ``learning_rate``/``weight_decay`` are the defaults for groups that omit them.
    ``decoder_layers``: FSDP2 only, the blocks sharded one by one (found from ``_no_split_modules``
    when None). ``materialize``: a model built with ``sharded_loading(config)`` has no weights yet; the
    engine calls this once its parameters are sharded, before the optimizer sees them
    (``ZCVAE.materialize_weights``). Starts the process group from the torchrun environment if needed.
    """
    if not isinstance(config, EngineConfig):
        raise ValueError(f"config must be an EngineConfig, got {type(config).__name__}")
    if decoder_layers is not None and config.engine != "fsdp2":
        raise ValueError(f"decoder_layers is only used by engine='fsdp2', not {config.engine!r}")
    adamw = AdamWSettings(learning_rate=learning_rate, weight_decay=weight_decay, betas=tuple(betas), eps=eps)
    common = dict(model=model, param_groups=param_groups, adamw=adamw)
    if config.engine == "local":
        from zcvae.engines.local import LocalEngine

        if materialize is not None:
            materialize()  # nothing is sharded: a no-op for a replicated build
        return LocalEngine(config, **common)
    common["materialize"] = materialize
    if config.engine == "deepspeed":
        from zcvae.engines.deepspeed import DeepSpeedEngine

        return DeepSpeedEngine(config, **common)
    from zcvae.engines.fsdp2 import FSDP2Engine

    return FSDP2Engine(config, **common, decoder_layers=decoder_layers)
