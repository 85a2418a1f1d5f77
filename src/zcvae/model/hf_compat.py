"""Every place where zcvae relies on transformers' or peft's internals, and nowhere else.

A transformers or peft upgrade that changes one of these breaks ``tests/unit/model/test_hf_compat.py``
first, with a message naming the upstream assumption. What is relied on:

peft
    ``BaseTunerLayer._disable_adapters``: the per-layer flag that makes a LoRA / trainable-token layer
    pass its input through (``adapters_disabled``).
    ``BaseTunerLayer._active_adapter`` (the per-layer list of adapters a forward applies) and
    ``adapter_layer_names`` (the attributes holding each adapter's weights, keyed by adapter name: LoRA's
    ``lora_A``/``lora_B``, the trainable tokens' delta); ``PeftModel.add_adapter``, which draws the new
    LoRA A from the global RNG and leaves the new adapter frozen and inactive; ``peft_config`` keyed by
    adapter name (``add_adapter_copy``, ``adapter_parameters``, ``adapter_active``, ``has_adapter``).
    ``trainable_tokens_delta``: the name of the parameter that holds the trained rows of a
    ``trainable_token_indices`` layer (``TRAINABLE_TOKENS_DELTA``), its ``trainable_tokens_original``
    buffer, ``token_indices`` and ``get_base_layer()`` (``token_adapter_rows``).
    ``TrainableTokensLayer.base_layer``, the embedding or head whose full weight the layer reads
    without calling it (``trainable_token_base_weights``), and the ``token_adapter`` that peft's
    wrapper puts in the embedding's place (``embedding_weight``). Its ``active_adapters``,
    ``disable_adapters``, ``merged``, ``_check_overlapping_tokens`` and ``_get_embed_scale``, its
    embedding path (``F.embedding`` with the base layer's options, then the scale) and a linear path
    without a bias, which zcvae replaces with a base read plus a correction (``copy_free_token_layers``).
    ``peft_config[active_adapter]``: the LoRA config a model was built with (``adapter_config``).
    ``get_peft_model`` drawing LoRA A from the global RNG, and ``PeftModel.__init__`` (peft 0.21) reading
    transformers' deprecated ``is_gradient_checkpointing``, a FutureWarning on every build (``lora_wrapped``).
    ``LoraLayer`` casting its input through ``BaseTunerLayer._cast_input_dtype(x, dtype)`` once per layer
    (peft 0.15+), which zcvae shares between the layers that read one hidden state (``share_lora_input_casts``).
    LoRA's initialisation order (``lora_initial_values``): per LoRA layer, in module order,
    ``nn.Linear(in, r)`` then ``nn.Linear(r, out)`` (each drawing its default init), then
    ``kaiming_uniform_(A, a=sqrt(5))`` and zeros for B, the adapters cast through the base weight's
    dtype and back to float32. A sharded build attaches LoRA to meta weights, where those draws are lost.
transformers
    ``Cache(layer_class_to_replicate=...)`` / ``Cache(layers=...)`` and ``DynamicLayer``'s
    ``keys``, ``values``, ``device``, ``is_initialized`` and ``update`` (``replay_safe_cache``).
    ``GradientCheckpointingLayer`` with its ``gradient_checkpointing`` and ``_can_checkpoint_with_cache``
    flags, and the ``gradient_checkpointing`` flag some decoders (GPT-2) keep themselves
    (``enable_layer_checkpointing``, ``cache_through_checkpointing``, ``layer_checkpointing_off``,
    ``checkpointing_layers``).
    The cache keyword's name: ``cache`` from transformers 5.2x, ``past_key_values`` before
    (``cache_kwarg``).
    ``transformers.initialization.no_init_weights`` and ``integrations.deepspeed.prevent_arange_dtype_change``:
    building a model inside ``deepspeed.zero.Init`` without drawing weights that the checkpoint
    overwrites, with RoPE buffers in float32 (``zero3_build_contexts``).
    ``_no_split_modules``: the class names of a model's repeated blocks (``no_split_module_names``).
    ``PreTrainedModel.base_model``: the model without its LM head (``lm_decoder``).
    ``attention_dropout``: the float that Llama-style attention passes to its kernel instead of an
    ``nn.Dropout`` (``disable_dropout``).
    ``max_position_embeddings`` / ``n_positions`` / ``n_ctx``: a config's position limit, by
    architecture (``position_limit``).
"""

from __future__ import annotations

import contextlib
import inspect
import warnings
from collections.abc import Iterator

import torch
from torch import nn

__all__ = [
    "TRAINABLE_TOKENS_DELTA",
    "adapter_active",
    "adapter_config",
    "adapter_parameters",
    "adapters_disabled",
    "add_adapter_copy",
    "cache_kwarg",
    "cache_through_checkpointing",
    "checkpointing_layers",
    "copy_adapter",
    "copy_free_token_layers",
    "disable_dropout",
    "embedding_weight",
    "enable_layer_checkpointing",
    "forward_parameter_names",
    "has_adapter",
    "layer_checkpointing_active",
    "layer_checkpointing_off",
    "lm_cache_kwarg",
    "lm_decoder",
    "lora_initial_values",
    "lora_wrapped",
    "no_split_module_names",
    "position_limit",
    "recorded_kv",
    "replay_safe_cache",
    "token_adapter_rows",
    "trainable_token_base_weights",
    "zero3_build_contexts",
]

# peft names the trained rows of a trainable-token layer `<layer>.trainable_tokens_delta.<adapter>`.
TRAINABLE_TOKENS_DELTA = "trainable_tokens_delta"


@contextlib.contextmanager
def adapters_disabled(peft_model: nn.Module) -> Iterator[None]:
    """Run the base model: every peft tuner layer (LoRA, trainable tokens) passes its input through.

    Unlike ``PeftModel.disable_adapter()``, this flips only the layers' ``_disable_adapters`` flags and
    never ``requires_grad``: peft's context sets ``requires_grad=False`` on the adapter weights and back
    to True on exit, which under ZeRO-3 broke gradient accumulation of the partitioned trainable-token
    delta ("expand(... size=[0])" in backward) and under FSDP2 toggled the unsharded copies.
    """
    from peft.tuners.tuners_utils import BaseTunerLayer

    layers = [m for m in peft_model.modules() if isinstance(m, BaseTunerLayer)]
    previous = [m._disable_adapters for m in layers]
    for m in layers:
        m._disable_adapters = True
    try:
        yield
    finally:
        for m, flag in zip(layers, previous):
            m._disable_adapters = flag


@contextlib.contextmanager
def adapter_active(peft_model: nn.Module, adapter: str) -> Iterator[None]:
    """Run with adapter ``adapter`` instead of the active one in every peft tuner layer.

    Like ``adapters_disabled``, it flips only the layers' ``_active_adapter`` and never ``requires_grad``
    (peft's ``set_adapter`` marks the active adapter trainable and the others frozen)."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    layers = [m for m in peft_model.modules() if isinstance(m, BaseTunerLayer)]
    previous = [m._active_adapter for m in layers]
    for m in layers:
        m._active_adapter = [adapter]
    try:
        yield
    finally:
        for m, active in zip(layers, previous):
            m._active_adapter = active


def adapter_parameters(peft_model: nn.Module, adapter: str) -> dict[str, nn.Parameter]:
    """Every weight of adapter ``adapter`` (LoRA A and B, trainable-token deltas), keyed by a name that
    leaves the adapter out (``<layer>.<attribute>[.<parameter>]``), so two adapters' keys match. A
    delta shared by a tied head and its embedding appears once."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    out: dict[str, nn.Parameter] = {}
    seen: set[int] = set()
    for module_name, module in peft_model.named_modules():
        if not isinstance(module, BaseTunerLayer):
            continue
        for attr in module.adapter_layer_names:
            holder = getattr(module, attr, None)
            if holder is None or adapter not in holder:
                continue
            item = holder[adapter]
            named = [(f"{module_name}.{attr}", item)] if isinstance(item, nn.Parameter) else \
                [(f"{module_name}.{attr}.{n}", p) for n, p in item.named_parameters()]
            for key, param in named:
                if id(param) not in seen:
                    seen.add(id(param))
                    out[key] = param
    return out


def has_adapter(peft_model: nn.Module, adapter: str) -> bool:
    """Whether ``peft_model`` holds an adapter named ``adapter``."""
    return adapter in peft_model.peft_config


@torch.no_grad()
def copy_adapter(peft_model: nn.Module, *, target: str, source: str | None = None) -> None:
    """Overwrite adapter ``target``'s weights with adapter ``source``'s (default: the active, trained one),
    in place (same config, same shapes)."""
    source = peft_model.active_adapter if source is None else source
    src, dst = adapter_parameters(peft_model, source), adapter_parameters(peft_model, target)
    if src.keys() != dst.keys():
        raise RuntimeError(f"adapters {source!r} and {target!r} differ in their weights: {sorted(src.keys() ^ dst.keys())[:4]}")
    for key, param in dst.items():
        param.copy_(src[key])


def add_adapter_copy(peft_model: nn.Module, adapter: str) -> None:
    """A second adapter ``adapter``: the active adapter's config with LoRA dropout 0 (it only scores: a
    dropout would make its NLL random), its weights a copy of the active adapter's, frozen and inactive.

    peft draws the new LoRA A from the global RNG (on the CPU, where the layers are built before an
    engine moves them); the draw is forked off, so adding the copy changes no later random number."""
    import copy

    config = copy.deepcopy(adapter_config(peft_model))
    config.lora_dropout = 0.0
    with torch.random.fork_rng(devices=[]):
        peft_model.add_adapter(adapter, config)
    copy_adapter(peft_model, target=adapter)


def replay_safe_cache(kv: list[tuple[torch.Tensor, torch.Tensor]] | None = None):
    """A Hugging Face cache whose ``update`` never changes what a later ``update`` returns, so that a
    checkpointed layer replayed in the backward sees exactly what its forward saw.

    ``kv`` None (the prefix pass): each layer records the keys/values it is given and returns them
    unchanged (no past; a replay records equal tensors again). ``kv`` given (a suffix pass): each
    layer returns ``cat(prefix, new)`` and stores nothing. A plain DynamicCache appends, so a replay
    would attend over the prefix twice; that is why transformers drops writable caches inside
    checkpointed layers.
    """
    from transformers.cache_utils import Cache, DynamicCache, DynamicLayer

    class ReplaySafeLayer(DynamicLayer):
        def __init__(self, keys: torch.Tensor | None = None, values: torch.Tensor | None = None) -> None:
            super().__init__()
            self.record = keys is None
            if keys is not None:
                self.keys, self.values, self.device, self.is_initialized = keys, values, keys.device, True

        def update(self, key_states, value_states, *args, **kwargs):
            if self.record:
                self.keys, self.values, self.device, self.is_initialized = key_states, value_states, key_states.device, True
                return key_states, value_states
            return torch.cat([self.keys, key_states], dim=-2), torch.cat([self.values, value_states], dim=-2)

    class ReplaySafeCache(DynamicCache):
        def __init__(self) -> None:  # DynamicCache's own __init__ would build appending layers
            if kv is None:
                Cache.__init__(self, layer_class_to_replicate=ReplaySafeLayer)
            else:
                Cache.__init__(self, layers=[ReplaySafeLayer(k, v) for k, v in kv])

    return ReplaySafeCache()


def recorded_kv(cache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer (keys, values) that a recording ``replay_safe_cache()`` saw, in layer order."""
    return [(layer.keys, layer.values) for layer in cache.layers]


@contextlib.contextmanager
def cache_through_checkpointing(hf: nn.Module) -> Iterator[None]:
    """Let the replay-safe cache reach checkpointed layers during one shared-prefix forward.

    transformers' ``GradientCheckpointingLayer`` drops a cache argument unless the layer sets
    ``_can_checkpoint_with_cache`` (meant for layers that only read the cache, which is what a
    replay-safe cache makes every layer); some models (GPT-2) also drop it in the decoder when their
    own ``gradient_checkpointing`` flag is on, although the layers do the checkpointing. Both are
    switched for the duration of the call only, so other callers (generate, a plain DynamicCache)
    keep transformers' protection. The layers themselves still checkpoint.
    """
    from transformers.modeling_layers import GradientCheckpointingLayer

    changed = []
    for m in hf.modules():
        if isinstance(m, GradientCheckpointingLayer):
            if m.gradient_checkpointing and not m._can_checkpoint_with_cache:
                changed.append((m, "_can_checkpoint_with_cache"))
                m._can_checkpoint_with_cache = True
        elif getattr(m, "gradient_checkpointing", False) is True:
            changed.append((m, "gradient_checkpointing"))
            m.gradient_checkpointing = False
    try:
        yield
    finally:
        for m, name in changed:
            if name == "_can_checkpoint_with_cache":
                del m._can_checkpoint_with_cache  # back to the class attribute
            else:
                m.gradient_checkpointing = True


def enable_layer_checkpointing(model: nn.Module) -> None:
    """Hugging Face's per-layer activation checkpointing, non-reentrant: it works with inputs that do
    not require grad and with the no-grad reference pass between training forwards (checked on CPU
    for ZeRO-2/3 and FSDP2)."""
    # transformers 5.x deprecates this name for `activation_checkpointing_enable` (gone in v6)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


@contextlib.contextmanager
def layer_checkpointing_off(hf: nn.Module) -> Iterator[None]:
    """Switch Hugging Face's per-layer checkpointing off for one branch chunk that is itself
    checkpointed (its recompute runs inside this context too, so both see the same layers)."""
    changed = [m for m in hf.modules() if getattr(m, "gradient_checkpointing", False) is True]
    for m in changed:
        m.gradient_checkpointing = False
    try:
        yield
    finally:
        for m in changed:
            m.gradient_checkpointing = True


def layer_checkpointing_active(hf: nn.Module) -> bool:
    """Whether a forward of ``hf`` now would checkpoint its layers (flag on, module in train mode)."""
    return any(getattr(m, "gradient_checkpointing", False) is True and m.training for m in hf.modules())


def checkpointing_layers(hf: nn.Module) -> bool:
    """Whether ``hf``'s checkpointing is done by transformers' ``GradientCheckpointingLayer``s (the
    only checkpointing that ``cache_through_checkpointing`` can let a cache through)."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    return any(isinstance(m, GradientCheckpointingLayer) and m.gradient_checkpointing for m in hf.modules())


def forward_parameter_names(module: nn.Module) -> frozenset[str]:
    """Parameter names of ``module.forward`` (call it once: inspect is slow per step)."""
    return frozenset(inspect.signature(module.forward).parameters)


def lm_cache_kwarg(model: nn.Module) -> str:
    """The cache keyword of the Hugging Face LM inside ``model``, through the engines' wrappers
    (DDP, DeepSpeed: ``.module``) and peft (``get_base_model``), whose forwards take ``**kwargs``."""
    inner = model
    while True:
        if hasattr(inner, "get_base_model"):
            inner = inner.get_base_model()
        elif isinstance(getattr(inner, "module", None), nn.Module):
            inner = inner.module
        else:
            return cache_kwarg(forward_parameter_names(inner))


def cache_kwarg(forward_params: frozenset[str]) -> str:
    """The keyword that passes a cache to a forward with these parameter names."""
    # transformers 5.2x renamed `past_key_values` to `cache` (the old name warns, then goes in 5.40).
    return "cache" if "cache" in forward_params else "past_key_values"


def lora_wrapped(model: nn.Module, lora_config, *, seed: int) -> nn.Module:
    """``peft.get_peft_model(model, lora_config)`` with LoRA A drawn from ``seed``, not from (and without
    moving) the global RNG state, so that a run's adapters depend on its seed alone."""
    from peft import get_peft_model

    with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
        # peft 0.21 reads transformers 5's deprecated `is_gradient_checkpointing` when it wraps a model: a
        # FutureWarning on every run that no zcvae user can act on
        warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
        torch.manual_seed(seed)
        return get_peft_model(model, lora_config)


def lora_initial_values(peft_model: nn.Module, *, seed: int) -> dict[tuple[nn.Module, str], torch.Tensor]:
    """The values peft gives every LoRA parameter when ``get_peft_model`` runs under
    ``torch.manual_seed(seed)`` on real weights -> {(module, parameter name): tensor}.

    Replays peft's draws (module docstring) on the CPU. A model attached on the meta device has the
    right shapes but lost values; this gives them back, equal to a replicated build's bit for bit
    (``tests/unit/model/test_sharded_load.py``). Only the default initialisation (``init_lora_weights=True``)
    is replayed, the one zcvae uses."""
    import math

    from peft.tuners.lora.layer import LoraLayer

    out: dict[tuple[nn.Module, str], torch.Tensor] = {}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for module in peft_model.modules():
            if not isinstance(module, LoraLayer):
                continue
            for adapter in module.lora_A:
                A, B = module.lora_A[adapter], module.lora_B[adapter]
                a = nn.Linear(A.in_features, A.out_features, bias=False)
                b = nn.Linear(B.in_features, B.out_features, bias=B.bias is not None)
                nn.init.kaiming_uniform_(a.weight, a=math.sqrt(5))
                nn.init.zeros_(b.weight)
                if b.bias is not None:
                    nn.init.zeros_(b.bias)
                base_dtype = module.get_base_layer().weight.dtype
                for layer, value in ((A, a), (B, b)):
                    for name, p in value.named_parameters():
                        out[(layer, name)] = p.detach().to(base_dtype).to(getattr(layer, name).dtype)
    return out


def token_adapter_rows(peft_model: nn.Module) -> list[tuple[nn.Module, str, nn.Module, list[int]]]:
    """Every tensor of peft's trainable-token layers that copies rows of its base weight ->
    [(holder module, tensor name, base module whose ``weight`` it copies, row indices)]: the trained
    delta (a parameter) and the original rows (a buffer), per adapter. A tied layer (the head of a
    tied embedding) owns none."""
    from peft.tuners.trainable_tokens.layer import TrainableTokensLayer

    out = []
    for module in peft_model.modules():
        if not isinstance(module, TrainableTokensLayer):
            continue
        for adapter, indices in module.token_indices.items():
            for holder in (getattr(module, TRAINABLE_TOKENS_DELTA), module.trainable_tokens_original):
                if adapter in holder:
                    out.append((holder, adapter, module.get_base_layer(), list(indices)))
    return out


def copy_free_token_layers(peft_model: nn.Module) -> int:
    """Give every peft trainable-token layer a forward that reads the base weight as it is and corrects
    the trained tokens afterwards, instead of peft's, which copies the whole (V, H) weight with the
    trained rows written in and uses that copy. On an embedding: the base lookup, then the trained rows
    at the positions holding a trained token. On a linear head (a tied embedding's): the base logits,
    then the trained tokens' columns. Both give peft's outputs and gradients. What changes is memory:
    peft's merged copy is made per call, a tied head keeps it for the backward once per logit chunk, and
    its gradient is a dense (V, H) tensor; at SmolLM2-360M's 49k x 960 each is 90 MiB in bf16
    (BENCHMARKS.md, "Host memory"). Returns how many layers.

    Relies on peft's ``TrainableTokensLayer`` (``base_layer``, ``active_adapters``, ``disable_adapters``,
    ``merged``, ``token_indices``, ``trainable_tokens_delta``, ``_check_overlapping_tokens``,
    ``_get_embed_scale``), on its embedding path being ``F.embedding`` with the base layer's options
    then the embed scale, and on its linear path having no bias, as peft's own does not."""
    import types

    from peft.tuners.trainable_tokens.layer import TrainableTokensLayer

    count = 0
    for layer in peft_model.modules():
        if not isinstance(layer, TrainableTokensLayer):
            continue
        if isinstance(layer.base_layer, nn.Linear):
            layer.forward = types.MethodType(_column_corrected_forward, layer)
        elif isinstance(layer.base_layer, nn.Embedding):
            layer.forward = types.MethodType(_row_corrected_forward, layer)
        else:
            continue  # peft itself refuses other layer types
        count += 1
    return count


class _SharedInputCast:
    """peft's ``_cast_input_dtype`` for every LoRA layer of one model, with one cast kept for the next layer.

    peft casts a LoRA layer's input to its adapter's dtype once per layer. q, k and v read the same
    hidden state, so with a bf16 base and float32 adapters a step saved three float32 copies of it for the
    backward where one does (at SmolLM2-360M, 1 step at B = 1: 56 of the step's 127 MiB of saved activations
    were these copies; BENCHMARKS.md, "Host memory"). The values are the same; the gradient reaching the hidden
    state is the float32 sum of the layers' gradients, rounded to bf16 once instead of each in turn.

    Under autocast to the input's dtype (the local engine's bf16 precision with a bf16 base) no cast is made at
    all: autocast cast each float32 copy back to bf16 and saved that, one per layer. Where no cast is needed (a
    float32 base, or bf16 adapters under DeepSpeed and FSDP2) nothing changes. Both references are weak: a cast
    outlives its input's layer only while autograd has saved it, so no activation is kept longer than it was."""

    def __init__(self) -> None:
        self._last: tuple | None = None  # (weakref to the input, its version, dtype, grad mode, weakref to the cast)

    def __call__(self, layer: nn.Module, x: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
        import weakref

        if x is None or x.dtype == dtype or not getattr(layer, "cast_input_dtype_enabled", True):
            return x
        if torch.is_autocast_enabled(x.device.type) and x.dtype == torch.get_autocast_dtype(x.device.type):
            return x  # autocast runs the adapter in x's dtype anyway: a float32 copy would only be cast back, per layer
        key = (x._version, dtype, torch.is_grad_enabled())
        if self._last is not None and self._last[0]() is x and self._last[1:4] == key:
            cast = self._last[4]()
            if cast is not None:
                return cast
        cast = x.to(dtype=dtype)
        self._last = (weakref.ref(x), *key, weakref.ref(cast))
        return cast


def share_lora_input_casts(peft_model: nn.Module) -> int:
    """Give every LoRA layer of ``peft_model`` one shared input cast (``_SharedInputCast``) -> how many layers.

    Relies on peft's LoRA layers casting their input through ``BaseTunerLayer._cast_input_dtype(x, dtype)``
    (peft 0.15+), an instance attribute of that name taking precedence over the method."""
    import functools

    from peft.tuners.lora import LoraLayer

    shared, count = _SharedInputCast(), 0
    for layer in peft_model.modules():
        if isinstance(layer, LoraLayer):
            layer._cast_input_dtype = functools.partial(shared, layer)
            count += 1
    return count


def _adapters_in_use(layer) -> list[str]:
    """The adapters a trainable-token layer applies in this call, or [] where peft's own forward holds
    (adapters off, none active, or merged into the base weight)."""
    active = layer.active_adapters
    if layer.disable_adapters or not active or layer.merged:
        return []
    layer._check_overlapping_tokens(active)
    return active


def _column_corrected_forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    from peft.tuners.trainable_tokens.layer import TrainableTokensLayer

    active = _adapters_in_use(self)
    if not active:
        return TrainableTokensLayer.forward(self, x, *args, **kwargs)
    weight_VH = self.base_layer.weight
    logits = torch.nn.functional.linear(x, weight_VH)
    for adapter in active:  # in order, as peft merges them: a later adapter's rows win
        index = torch.tensor(self.token_indices[adapter], device=logits.device)
        columns = torch.nn.functional.linear(x, self.trainable_tokens_delta[adapter].to(weight_VH))
        logits = logits.index_copy(-1, index, columns)
    return logits


def _row_corrected_forward(self, ids: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    from peft.tuners.trainable_tokens.layer import TrainableTokensLayer

    active = _adapters_in_use(self)
    if not active:
        return TrainableTokensLayer.forward(self, ids, *args, **kwargs)
    base = self.base_layer
    weight_VH = base.weight
    options = dict(padding_idx=base.padding_idx, max_norm=base.max_norm, norm_type=base.norm_type,
                   scale_grad_by_freq=base.scale_grad_by_freq, sparse=base.sparse)
    out = torch.nn.functional.embedding(ids, weight_VH, **options)
    for adapter in active:  # in order, as peft merges them: a later adapter's rows win
        index_n = torch.tensor(self.token_indices[adapter], device=ids.device)
        hit = ids.unsqueeze(-1) == index_n  # (..., n): which trained token each position holds, if any
        slot = hit.int().argmax(-1)
        rows = torch.nn.functional.embedding(slot, self.trainable_tokens_delta[adapter].to(weight_VH))
        out = torch.where(hit.any(-1, keepdim=True), rows, out)
    embed_scale = getattr(self, "_get_embed_scale", lambda: None)()  # peft < 0.18 has no scale, nor applies one
    if embed_scale is not None:  # as peft: its F.embedding skips a scaled embedding's own forward
        out = out * embed_scale.to(out.dtype)
    return out


def zero3_build_contexts(zero_init) -> list:
    """Contexts to build a transformers model partitioned by ``deepspeed.zero.Init`` (``zero_init``, the
    engine's, entered after the others): no weight draws (the checkpoint overwrites them), RoPE
    buffers keep their float32 ``arange``."""
    from transformers.initialization import no_init_weights
    from transformers.integrations.deepspeed import prevent_arange_dtype_change

    return [no_init_weights(), prevent_arange_dtype_change(), zero_init]


def trainable_token_base_weights(model: nn.Module) -> list[tuple[nn.Module, nn.Parameter]]:
    """Every peft trainable-token layer in ``model`` with the full weight it reads from its child
    (``base_layer.weight``, the embedding or a tied LM head) without calling that child."""
    from peft.tuners.trainable_tokens.layer import TrainableTokensLayer

    return [(m, m.base_layer.weight) for m in model.modules()
            if isinstance(m, TrainableTokensLayer) and hasattr(getattr(m, "base_layer", None), "weight")]


def embedding_weight(module: nn.Module) -> torch.Tensor:
    """The full weight of an embedding or LM head, also when peft's trainable-token wrapper stands in
    its place (the wrapped module's weight, not the wrapper's)."""
    return getattr(getattr(module, "token_adapter", None), "base_layer", module).weight


def adapter_config(peft_model: nn.Module):
    """The ``peft.LoraConfig`` of ``peft_model``'s active adapter (the trained one; a following reference
    adds a frozen copy, ``add_adapter_copy``)."""
    return peft_model.peft_config[peft_model.active_adapter]


def no_split_module_names(model: nn.Module) -> set[str]:
    """The class names that any Hugging Face model inside ``model`` declares as blocks never to split
    (``_no_split_modules``, e.g. ``{"LlamaDecoderLayer"}``); empty for other modules."""
    names: set[str] = set()
    for m in model.modules():
        names |= set(getattr(m, "_no_split_modules", None) or ())
    return names


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The decoder's repeated blocks, in order.

    The classes named by any Hugging Face ``_no_split_modules`` inside ``model`` (e.g.
    ``LlamaDecoderLayer``); failing that, the children of every ``nn.ModuleList`` called ``layers`` or
    ``h``.
    """
    names = no_split_module_names(model)
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        layers = [
            child
            for name, m in model.named_modules()
            if isinstance(m, nn.ModuleList) and name.rsplit(".", 1)[-1] in ("layers", "h")
            for child in m
        ]
    return layers


def decoder_norms(model: nn.Module) -> list[nn.Module]:
    """Each decoder layer's own norms, layer by layer, in definition order: the modules directly in a
    layer whose class is ``nn.LayerNorm`` or whose name ends in ``Norm`` (Llama, Qwen2 and Mistral
    ``input_layernorm`` and ``post_attention_layernorm`` (RMSNorm); GPT-2 ``ln_1``, ``ln_2``; GPT-NeoX
    the same two as Llama). ValueError when a model has none: ``--z-conditioned-norm`` needs them."""
    norms = [child for layer in decoder_layers(model) for child in layer.children()
             if isinstance(child, nn.LayerNorm) or type(child).__name__.endswith("Norm")]
    if not norms:
        raise ValueError(f"no norm found inside the decoder layers of {type(model).__name__}: z_conditioned_norm needs them")
    return norms


def lm_decoder(peft_model: nn.Module) -> nn.Module | None:
    """The decoder of the Hugging Face LM inside ``peft_model``: the model without its LM head
    (``base_model``), or None when the LM has no separate one."""
    hf = peft_model.get_base_model()
    decoder = getattr(hf, "base_model", hf)
    return None if decoder is hf else decoder


def disable_dropout(model: nn.Module) -> None:
    """Every dropout in ``model`` off: ``nn.Dropout`` modules and the float that Llama-style attention
    passes to its kernel instead of a module."""
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
        if isinstance(getattr(module, "attention_dropout", None), float):
            module.attention_dropout = 0.0


def position_limit(config) -> int | None:
    """The most positions a backbone with this Hugging Face config was built for, under the name its
    architecture uses (Llama ``max_position_embeddings``, GPT-2 ``n_positions``, some ``n_ctx``); None
    when it names none (or ``config`` is None)."""
    for name in ("max_position_embeddings", "n_positions", "n_ctx"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None
