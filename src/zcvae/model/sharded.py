"""Building the CVAE without any rank holding the whole backbone: a skeleton first, weights after sharding.

The replicated build (``build.load_backbone``) reads every weight on every rank, then the engine
shards it: a 70B backbone needs 280 GB of host memory per rank in float32 before the first shard
exists. Here, instead (the torchtune/torchtitan recipe):

1. The engine says where parameters are made (``ShardedLoading.build_context``): FSDP2 on the meta
   device (no storage), DeepSpeed ZeRO-3 partitioned by ``zero.Init`` as each module is built. The
   skeleton is built from ``config.json`` with the final vocabulary (the markers and z tokens
   already counted), so no resize ever copies a weight.
2. LoRA, the trainable tokens and the router heads attach to the skeleton as in the replicated build,
   drawing the same random numbers in the same order (``build.latent_directions`` before any weight;
   LoRA's draws replayed by ``hf_compat.lora_initial_values`` where they landed on meta tensors).
3. Once the engine has sharded the model, ``PendingWeights.materialize`` writes every tensor through
   the engine's ``write``: frozen weights stream one tensor at a time from rank 0, which reads it from
   the safetensors files and lets the engine scatter it (so no rank holds more than its shard plus
   one tensor); the embedding and an untied head are broadcast whole (one tensor) so every rank
   computes the new rows with ``build.fill_new_rows_``, as the replicated build does; everything
   that was already real (router heads, RoPE buffers, LoRA) is written back from a copy.

A tensor that no source covers is an error naming it: a sharded model is complete or it does not train.
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch
from torch import nn

from zcvae.model import build, hf_compat
from zcvae.model.config import ModelConfig
from zcvae.data.encoding import ZNULL, TemplateTokens

__all__ = ["CheckpointReader", "PendingWeights", "ShardedLoading", "build_skeleton", "full_shape", "plan_weights"]


@runtime_checkable
class ShardedLoading(Protocol):
    """What an engine that shards parameters tells the model build (``zcvae.engines.sharded_loading``
    makes one; the engines implement it without importing this module)."""

    rank: int
    ds_config: dict | None
    """DeepSpeed ZeRO-3's resolved config (its partitions are made at build time); None for the others."""

    def build_context(self, dtype: torch.dtype) -> contextlib.AbstractContextManager:
        """The context the skeleton's parameters are made in."""

    def whole(self, params: list[nn.Parameter]) -> contextlib.AbstractContextManager:
        """Inside, ``params`` read as whole tensors (values not yet loaded): peft's trainable tokens copy
        rows of the embedding when they attach."""

    def prepare(self, model: nn.Module) -> None:
        """Give the sharded parameters storage (called once, before the writes)."""

    def write(self, owner: nn.Module, name: str, full: torch.Tensor | None, *, on_every_rank: bool) -> None:
        """Set ``owner``'s parameter or buffer ``name`` to ``full``: the whole tensor on rank 0 (None
        elsewhere), or on every rank alike when ``on_every_rank``."""

    def broadcast(self, full: torch.Tensor | None, *, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """Rank 0's ``full`` on every rank."""


class CheckpointReader:
    """A Hugging Face safetensors checkpoint read one tensor at a time.

    Each read opens the file afresh, so the memory map holds at most that tensor's pages: a reader kept
    open over the whole checkpoint would end up with the whole file resident."""

    def __init__(self, backbone_dir: str):
        index = os.path.join(backbone_dir, "model.safetensors.index.json")
        if os.path.isfile(index):
            with open(index, encoding="utf-8") as f:
                weight_map = json.load(f)["weight_map"]
            self.files = {k: os.path.join(backbone_dir, v) for k, v in weight_map.items()}
        else:
            from safetensors import safe_open

            path = os.path.join(backbone_dir, "model.safetensors")
            with safe_open(path, framework="pt") as f:
                self.files = {k: path for k in f.keys()}
        self.backbone_dir = backbone_dir

    def __contains__(self, key: str) -> bool:
        return key in self.files

    def shape(self, key: str) -> tuple[int, ...]:
        from safetensors import safe_open

        with safe_open(self.files[key], framework="pt") as f:
            return tuple(f.get_slice(key).get_shape())

    def read(self, key: str, dtype: torch.dtype) -> torch.Tensor:
        from safetensors import safe_open

        with safe_open(self.files[key], framework="pt") as f:
            return f.get_tensor(key).to(dtype, copy=True)


def build_skeleton(backbone_dir: str, config: ModelConfig, *, loading: ShardedLoading, num_tokens: int) -> tuple[nn.Module, CheckpointReader, dict, int]:
    """The backbone's modules with no weights read, made in ``loading``'s context, with the
    embeddings already as large as the tokenizer's ``num_tokens`` (as ``resize_token_embeddings``
    makes them, never smaller) -> (model, reader, {parameter id: checkpoint key}, the checkpoint's rows)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    reader = CheckpointReader(backbone_dir)
    hf_config = AutoConfig.from_pretrained(backbone_dir, local_files_only=True, trust_remote_code=config.trust_remote_code)
    if config.dtype == "auto":
        saved = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None) or "float32"
        dtype = saved if isinstance(saved, torch.dtype) else getattr(torch, str(saved).replace("torch.", ""))
    else:
        dtype = getattr(torch, config.dtype)
    old_rows = int(hf_config.vocab_size)
    hf_config.vocab_size = max(old_rows, num_tokens)
    with contextlib.ExitStack() as stack:
        if loading.ds_config is not None:
            for context in hf_compat.zero3_build_contexts(loading.build_context(dtype)):
                stack.enter_context(context)
        else:
            stack.enter_context(loading.build_context(dtype))
        model = AutoModelForCausalLM.from_config(hf_config, trust_remote_code=config.trust_remote_code, dtype=dtype)
    model.tie_weights()  # no_init_weights (ZeRO-3) also skips the tying that init_weights does
    keys: dict[int, str] = {}
    for name, p in model.named_parameters():  # tied weights appear once, under the name that is saved
        keys[id(p)] = name
    if config.disable_backbone_dropout:
        hf_compat.disable_dropout(model)
    model.config.use_cache = False
    return model, reader, keys, old_rows


@dataclass
class PendingWeights:
    """Everything needed to give a sharded CVAE its weights once the engine has sharded it."""

    reader: CheckpointReader
    checkpoint: list[tuple[nn.Module, str, str]]  # frozen base tensors: (owner, name, checkpoint key)
    embedding: tuple[nn.Module, str, str]  # the input embedding (owner, name, key)
    head: tuple[nn.Module, str, str] | None  # an untied output head (owner, name, key); None when tied
    head_bias: tuple[nn.Module, str, str] | None
    token_rows: list[tuple[nn.Module, str, nn.Module, list[int]]]  # hf_compat.token_adapter_rows
    values: dict[tuple[nn.Module, str], torch.Tensor]  # tensors known now (router, buffers, LoRA)
    tokens: TemplateTokens
    added: list[int]
    old_rows: int
    had_znull: bool
    noise: float
    directions: dict[int, torch.Tensor]
    init_projection: object = None  # Gaussian: callable(z_scale) -> None, the projection's deferred init
    loading: ShardedLoading | None = None
    done: bool = field(default=False)

    @torch.no_grad()
    def materialize(self, model: nn.Module, *, tick=None) -> None:
        """Write every parameter and buffer of ``model`` (the sharded CVAE) through ``self.loading``;
        ``tick(tensors done, total)`` after each checkpoint tensor (on every rank: ``zcvae.loop.setup``)."""
        if self.done:
            raise RuntimeError("the sharded weights were already written")
        loading = self.loading
        loading.prepare(model)
        written: set[int] = set()  # ids of the tensors written (tied weights are one tensor)

        def write(owner: nn.Module, name: str, full: torch.Tensor | None, *, on_every_rank: bool) -> None:
            written.add(id(getattr(owner, name)))
            loading.write(owner, name, full, on_every_rank=on_every_rank)

        rank0 = loading.rank == 0
        for done, (owner, name, key) in enumerate(self.checkpoint, start=1):
            dtype = getattr(owner, name).dtype
            write(owner, name, self.reader.read(key, dtype) if rank0 else None, on_every_rank=False)
            if tick is not None:
                tick(done, len(self.checkpoint), "tensors")
        emb = self._full_rows(*self.embedding)
        head = self._full_rows(*self.head) if self.head is not None else None
        bias = self._full_rows(*self.head_bias) if self.head_bias is not None else None
        z_scale = build.fill_new_rows_(emb, head_VH=head, head_bias_V=bias, tokens=self.tokens, added=self.added, old_rows=self.old_rows,
                                       had_znull=self.had_znull, noise=self.noise, directions=self.directions)
        for spec, full in ((self.embedding, emb), (self.head, head), (self.head_bias, bias)):
            if spec is not None:
                write(spec[0], spec[1], full, on_every_rank=True)
        # by weight: the head of a tied embedding has a trainable-token layer too, over the same tensor
        bases = {id(getattr(self.embedding[0], self.embedding[1])): emb}
        if self.head is not None:
            bases[id(getattr(self.head[0], self.head[1]))] = head
        for holder, name, base, rows in self.token_rows:
            if id(base.weight) not in bases:
                raise ValueError(f"trainable tokens on {type(base).__name__}: only the embedding and the output head are supported")
            full = bases[id(base.weight)][rows].to(getattr(holder, name).dtype)
            write(holder, name, full, on_every_rank=True)
        if self.init_projection is not None:
            self.values.update(self.init_projection(z_scale))
        for (owner, name), value in self.values.items():
            write(owner, name, value, on_every_rank=True)
        missing = [n for n, owner, t in _named_tensors(model) if getattr(owner, t) is not None and id(getattr(owner, t)) not in written]
        if missing:
            raise ValueError(f"sharded load: no source for {len(missing)} tensor(s), e.g. {missing[:3]}: "
                             f"the checkpoint lacks them; train on the local engine or ZeRO-0/1/2 to load it replicated")
        self.done = True
        self.values = {}

    def _full_rows(self, owner: nn.Module, name: str, key: str) -> torch.Tensor:
        """The checkpoint's rows of ``key`` padded to the model's rows, on every rank."""
        shape, dtype = full_shape(getattr(owner, name)), getattr(owner, name).dtype
        loaded = self.reader.read(key, dtype) if self.loading.rank == 0 else None
        if loaded is not None and loaded.shape[1:] != shape[1:]:
            raise ValueError(f"checkpoint tensor {key!r} has shape {tuple(loaded.shape)}, the model expects {shape}")
        full = None
        if loaded is not None:
            full = torch.zeros(shape, dtype=dtype)
            full[: loaded.shape[0]] = loaded
        return self.loading.broadcast(full, shape=shape, dtype=dtype)


def full_shape(t: torch.Tensor) -> tuple[int, ...]:
    """The whole tensor's shape: a DTensor's is global already; a ZeRO-3 partition keeps it in ``ds_shape``."""
    return tuple(getattr(t, "ds_shape", t.shape))


def _named_tensors(model: nn.Module):
    """(qualified name, owner module, local name) of every parameter and buffer, each owner slot once."""
    for mod_name, module in model.named_modules():
        for local, _ in list(module.named_parameters(recurse=False)) + list(module.named_buffers(recurse=False)):
            yield f"{mod_name}.{local}" if mod_name else local, module, local


def plan_weights(
    model: nn.Module,
    peft_model: nn.Module,
    *,
    reader: CheckpointReader,
    keys: dict[int, str],
    owners_before_peft: dict[int, tuple[nn.Module, str]],
    emb_mod: nn.Module,
    head_mod: nn.Module | None,
    tokens: TemplateTokens,
    added: list[int],
    old_rows: int,
    vocab_before: dict,
    noise: float,
    directions: dict[int, torch.Tensor],
    seed: int,
    loading: ShardedLoading,
) -> PendingWeights:
    """Sort every tensor of the built skeleton by where its value comes from (see the module docstring)."""
    tied = head_mod is None or head_mod.weight is emb_mod.weight
    spec = {}
    checkpoint = []
    for pid, (owner, name) in owners_before_peft.items():
        key = keys[pid]
        if owner is emb_mod and name == "weight":
            spec["emb"] = (owner, name, key)
        elif not tied and owner is head_mod and name in ("weight", "bias"):
            spec["head" if name == "weight" else "bias"] = (owner, name, key)
        elif key not in reader:
            raise ValueError(f"sharded load: the checkpoint in {reader.backbone_dir!r} has no tensor {key!r}")
        else:
            checkpoint.append((owner, name, key))
    for part in (spec.get("emb"), spec.get("head")):
        if part is not None and part[2] not in reader:
            raise ValueError(f"sharded load: the checkpoint in {reader.backbone_dir!r} has no tensor {part[2]!r}")
    values: dict[tuple[nn.Module, str], torch.Tensor] = {}
    if any(p.is_meta for p in peft_model.parameters() if p.requires_grad):
        values.update(hf_compat.lora_initial_values(peft_model, seed=seed))
    token_rows = hf_compat.token_adapter_rows(peft_model)
    computed = {(id(h), n) for h, n, _, _ in token_rows} | {(id(o), n) for o, n in owners_before_peft.values()}
    for _, owner, name in _named_tensors(model):
        t = getattr(owner, name)
        if (id(owner), name) in computed or (owner, name) in values or t is None:
            continue
        if t.is_meta or hasattr(t, "ds_id"):
            continue  # no value yet: the coverage check in materialize names it if nothing writes it
        values[(owner, name)] = t.detach().clone()
    head_bias = spec.get("bias")
    if head_bias is not None and head_bias[2] not in reader:
        raise ValueError(f"sharded load: the checkpoint in {reader.backbone_dir!r} has no tensor {head_bias[2]!r}")
    return PendingWeights(
        reader=reader, checkpoint=checkpoint, embedding=spec["emb"], head=spec.get("head"), head_bias=head_bias,
        token_rows=token_rows, values=values, tokens=tokens, added=added, old_rows=old_rows,
        had_znull=ZNULL in vocab_before, noise=noise, directions=directions, loading=loading,
    )
