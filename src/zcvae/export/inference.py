"""Export a trained run, load it back, and decode y or read the latent for a given x.

    zcvae export runs/a --out exports/a [--merge] [--checkpoint runs/a/checkpoints/step_00000300]
    zcvae generate exports/a --x "3 1 4 1" --all-latents
    zcvae generate exports/a --x "3 1 4 1" --z 1 --max-new-tokens 20
    zcvae encode exports/a --x "3 1 4 1" --y "fwd 3 1 4 1 ."

An export directory (written to ``DIR.tmp`` and renamed, so it is complete or absent)::

    adapter_config.json, adapter_model.safetensors   the LoRA adapter and the z rows in peft's format
                                                       (peft's trainable-token delta: K rows, never the
                                                       full embedding matrix)
    latent_heads.safetensors                           z rows, router/prior heads (+ their calibration
                                                       buffers), soft-prompt projection, and the rows of
                                                       every token zcvae added to the backbone's vocabulary
    tokenizer files                                    the backbone's tokenizer plus the template markers
                                                       and latent tokens
    run_config.json                                    the run's resolved configuration and c_base
    zcvae_export.json                                  backbone path and config, step, token ids
    README.md                                          model card: the latent, K, aggregation mode, c_base,
                                                       final metrics, how to load it
    merged/                                            (--merge) a standard Hugging Face checkpoint:
                                                       LoRA merged, z rows written into the embedding

Everything is read with safetensors or JSON; the backbone's own code runs only with
``--trust-remote-code``. The export is built from the checkpoint's ``trainable.safetensors`` (the
engine-independent, fully gathered trainable parameters), so runs of every engine and world size
export the same way, in one process.

Shape legend: R rows of a decode call, S sequence length, V vocabulary, K latents, D latent dim.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
from pathlib import Path
from typing import Any

import torch

from zcvae.export.card import model_card
from zcvae.runs.checkpoint import checkpoint_dirs, load_trainable_state, read_meta, resolve_checkpoint
from zcvae.runs.rundir import CHECKPOINTS, RUN_CONFIG, builtin_backbone_dir, iter_metric_records, read_json, read_run_record

__all__ = [
    "EXPORT_META",
    "LATENT_HEADS",
    "decode_greedy",
    "encode_main",
    "encode_xy",
    "export_main",
    "export_run",
    "generate_main",
    "load_for_inference",
    "prepare_base",
]

EXPORT_META = "zcvae_export.json"
LATENT_HEADS = "latent_heads.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
MERGED = "merged"
EXPORT_FORMAT = 1
# Backbone config keys compared between an export and the backbone it is loaded onto.
_BASE_KEYS = ("model_type", "vocab_size", "hidden_size", "n_embd", "num_hidden_layers", "n_layer",
              "num_attention_heads", "n_head", "num_key_value_heads", "intermediate_size", "tie_word_embeddings")


# --------------------------------------------------------------------------- run records
def _train_config(record: dict[str, Any], source: Path):
    from zcvae.config import TrainConfig

    return TrainConfig.from_dict(dict(record["config"]), source=str(source))


def _builtin_backbone(cfg) -> Path:
    # The path of train.trainer.default_backbone without its side effect (it would pretrain a missing backbone).
    from zcvae.backbone.pretraining import is_pretrained

    cache = builtin_backbone_dir(cfg.task)
    if not is_pretrained(cache):
        raise ValueError(
            f"the run used the built-in backbone {str(cache)!r}, which is missing: rebuild it with "
            f"`zcvae pretrain --task {cfg.task or 'copy'} --output-dir {cache}` or pass --backbone DIR"
        )
    return cache


def resolve_backbone(cfg, *, override: str | None = None, recorded: str | None = None) -> str:
    """The backbone directory: ``override`` > the one an export recorded > the run's > the built-in one.

    A ``.gguf`` file is converted into (or found in) zcvae's cache, as ``zcvae train`` does.
    """
    from zcvae.backbone.convert import is_gguf_path, resolve_backbone_path

    for candidate in (override, recorded, cfg.backbone):
        if candidate:
            if is_gguf_path(candidate) and Path(candidate).is_file():
                return resolve_backbone_path(str(candidate), log=lambda line: print(line, file=sys.stderr))
            if not Path(candidate).is_dir():
                raise ValueError(f"backbone directory {candidate!r} does not exist (pass --backbone DIR if it moved)")
            return str(candidate)
    return str(_builtin_backbone(cfg))


def _base_config(backbone: str) -> dict[str, Any]:
    config = read_json(Path(backbone) / "config.json", what="backbone config")
    return {k: config[k] for k in _BASE_KEYS if k in config}


def _build_model(cfg, backbone: str, *, trust_remote_code: bool, device: str | torch.device | None):
    from zcvae.model.cvae import ZCVAE

    if cfg.trust_remote_code and not trust_remote_code:
        raise ValueError("the run was trained with trust_remote_code; pass --trust-remote-code to let the backbone's own code run")
    model_config = cfg.model_config()
    model_config.trust_remote_code = bool(trust_remote_code)
    model_config.gradient_checkpointing = False
    model = ZCVAE.from_pretrained(backbone, model_config, seed=cfg.seed)
    model.eval()
    if device is not None:
        model.to(device)
    return model


def _load_checkpoint_into(model, checkpoint: Path) -> None:
    """Copy a checkpoint's trainable parameters and latent-head buffers into ``model``."""
    trainable, buffers = load_trainable_state(checkpoint)
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    where = str(checkpoint / "trainable.safetensors")
    missing, unexpected = sorted(set(params) - set(trainable)), sorted(set(trainable) - set(params))
    if missing or unexpected:
        raise ValueError(
            f"{where!r} does not fit this model (another backbone or latent config?): "
            f"missing {missing[:4]}{' ...' if len(missing) > 4 else ''}, unexpected {unexpected[:4]}{' ...' if len(unexpected) > 4 else ''}"
        )
    own_buffers = dict(model.named_buffers())
    with torch.no_grad():
        for name, value in trainable.items():
            if params[name].shape != value.shape:
                raise ValueError(f"{where!r}: {name} has shape {tuple(value.shape)}, the model {tuple(params[name].shape)} (another backbone?)")
            params[name].copy_(value)
        for name, value in buffers.items():
            if name not in own_buffers or own_buffers[name].shape != value.shape:
                raise ValueError(f"{str(checkpoint / 'buffers.safetensors')!r}: buffer {name} does not fit this model")
            own_buffers[name].copy_(value)


def _newest_checkpoint(run_dir: Path, checkpoint: str | None) -> Path:
    if checkpoint is not None:
        path = resolve_checkpoint(checkpoint)
        if path is None:
            raise ValueError(f"checkpoint {checkpoint!r}: no complete checkpoint there")
        return path
    found = checkpoint_dirs(run_dir / CHECKPOINTS)
    if not found:
        raise ValueError(f"run {str(run_dir)!r} has no complete checkpoint under checkpoints/ (did training finish?)")
    return found[-1]


# --------------------------------------------------------------------------- embeddings of added tokens
def _input_embedding_weight(peft_model) -> torch.Tensor:
    emb = peft_model.get_input_embeddings()
    layer = getattr(emb, "token_adapter", None)
    return layer.base_layer.weight if layer is not None else emb.weight


def _output_embedding_weight(peft_model) -> torch.Tensor | None:
    out = peft_model.get_output_embeddings()
    if out is None:
        return None
    layer = getattr(out, "token_adapter", None)
    weight = layer.base_layer.weight if layer is not None else out.weight
    return None if weight.data_ptr() == _input_embedding_weight(peft_model).data_ptr() else weight


def _added_token_ids(model, backbone: str, *, trust_remote_code: bool) -> list[int]:
    from transformers import AutoTokenizer

    base = AutoTokenizer.from_pretrained(backbone, local_files_only=True, trust_remote_code=trust_remote_code).get_vocab()
    return sorted(i for t, i in model.tokenizer.get_vocab().items() if t not in base)


def _z_rows_parameter(model) -> torch.nn.Parameter | None:
    for name, p in model.peft_model.named_parameters():
        if "trainable_tokens_delta" in name and "embed" in name:
            return p
    return next((p for n, p in model.peft_model.named_parameters() if "trainable_tokens_delta" in n), None)


def latent_heads_state(model, *, added_ids: list[int]) -> dict[str, torch.Tensor]:
    """Everything of the trained model outside the LoRA adapter that the export needs (CPU tensors)."""
    out: dict[str, torch.Tensor] = {}
    z_rows = _z_rows_parameter(model)
    if z_rows is not None:
        out["z_rows"] = z_rows.detach()
    for prefix, module in (("router", model.router), ("projection", model.projection)):
        if module is not None:
            out.update({f"{prefix}.{k}": v.detach() for k, v in module.state_dict().items()})
    ids = torch.tensor(added_ids, dtype=torch.long)
    out["added_token_ids"] = ids
    out["added_rows.input_embeddings"] = _input_embedding_weight(model.peft_model).detach()[ids]
    output = _output_embedding_weight(model.peft_model)
    if output is not None and len(added_ids):
        out["added_rows.output_embeddings"] = output.detach()[ids]
    return {k: v.to("cpu", copy=True).contiguous() for k, v in out.items()}


def _write_added_rows(base_model, heads: dict[str, torch.Tensor]) -> None:
    """Write the rows of zcvae's added tokens (markers, z tokens) into a resized base model."""
    ids = heads["added_token_ids"].long()
    with torch.no_grad():
        emb = base_model.get_input_embeddings()
        weight = getattr(getattr(emb, "token_adapter", None), "base_layer", emb).weight
        weight[ids] = heads["added_rows.input_embeddings"].to(weight)
        out = base_model.get_output_embeddings()
        if "added_rows.output_embeddings" in heads and out is not None:
            w = getattr(getattr(out, "token_adapter", None), "base_layer", out).weight
            w[ids] = heads["added_rows.output_embeddings"].to(w)


def prepare_base(backbone: str | os.PathLike, export_dir: str | os.PathLike, *, trust_remote_code: bool = False):
    """The backbone, resized to the export's vocabulary with zcvae's added rows, ready for
    ``peft.PeftModel.from_pretrained(base, export_dir)``."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    export_dir = Path(export_dir)
    meta = read_json(export_dir / EXPORT_META, what="export")
    _check_base(meta, str(backbone), export_dir)
    tokenizer = AutoTokenizer.from_pretrained(export_dir, local_files_only=True, trust_remote_code=trust_remote_code)
    base = AutoModelForCausalLM.from_pretrained(backbone, local_files_only=True, use_safetensors=True, trust_remote_code=trust_remote_code)
    if len(tokenizer) > base.get_input_embeddings().weight.shape[0]:
        base.resize_token_embeddings(len(tokenizer))
    _write_added_rows(base, load_file(str(export_dir / LATENT_HEADS)))
    return base


def _check_base(meta: dict[str, Any], backbone: str, export_dir: Path) -> None:
    recorded, actual = meta.get("base_config") or {}, _base_config(backbone)
    diffs = [f"{k}: {recorded[k]!r} vs {actual.get(k)!r}" for k in recorded if recorded[k] != actual.get(k)]
    if diffs:
        raise ValueError(
            f"{str(export_dir / EXPORT_META)!r} was exported from a run on another backbone than "
            f"{str(Path(backbone) / 'config.json')!r} ({'; '.join(diffs)}): pass the run's backbone with --backbone"
        )


# --------------------------------------------------------------------------- export
def _final_metrics(run_dir: Path) -> tuple[int | None, dict[str, float]]:
    """(step, metrics) of the last eval record of metrics.jsonl (a resumed run may repeat steps)."""
    last: dict[str, Any] | None = None
    for record in iter_metric_records(run_dir):
        if record.get("split") == "eval":
            last = record
    if last is None:
        return None, {}
    metrics = {k: v for k, v in last.items() if k not in ("step", "split") and isinstance(v, (int, float)) and not isinstance(v, bool)}
    return last.get("step"), metrics


def _check_out_apart(out: Path, sources: dict[str, Path]) -> None:
    """ValueError when ``out`` is, contains or lies inside one of ``sources``: publishing the export
    replaces ``out`` whole, which would delete the run or the backbone it reads (whatever --overwrite says)."""
    target = out.resolve()
    for name, source in sources.items():
        source = Path(source).resolve()
        if target == source or source in target.parents or target in source.parents:
            how = "is" if target == source else ("lies inside" if source in target.parents else "contains")
            raise ValueError(f"--out {str(out)!r} {how} the {name} {str(source)!r}: the export would replace it; choose an --out outside it")


def _prepare_out(out: Path, *, overwrite: bool) -> Path:
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not overwrite:
        raise ValueError(f"--out {str(out)!r} exists and is not empty; pass --overwrite to replace it")
    tmp = out.with_name(out.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    return tmp


def _publish(tmp: Path, out: Path) -> None:
    old = out.with_name(out.name + ".old")
    if out.exists():
        if old.exists():
            shutil.rmtree(old)
        os.replace(out, old)
    os.replace(tmp, out)
    if old.exists():
        shutil.rmtree(old) if old.is_dir() else old.unlink()


def export_run(
    run_dir: str | os.PathLike,
    *,
    out: str | os.PathLike,
    checkpoint: str | None = None,
    merge: bool = False,
    overwrite: bool = False,
    backbone: str | None = None,
    trust_remote_code: bool = False,
) -> Path:
    """Export ``run_dir``'s newest complete checkpoint (or ``checkpoint``) to ``out``; return ``out``."""
    from peft import get_peft_model_state_dict
    from safetensors.torch import save_file

    run_dir, out = Path(run_dir), Path(out)
    record = read_run_record(run_dir)
    cfg = _train_config(record, run_dir / RUN_CONFIG)
    ckpt = _newest_checkpoint(run_dir, checkpoint)
    backbone = resolve_backbone(cfg, override=backbone, recorded=record.get("backbone"))
    _check_out_apart(out, {"run directory": run_dir, "checkpoint": ckpt, "backbone directory": Path(backbone)})
    tmp = _prepare_out(out, overwrite=overwrite)
    try:
        model = _build_model(cfg, backbone, trust_remote_code=trust_remote_code, device="cpu")
        _load_checkpoint_into(model, ckpt)
        step = int(read_meta(ckpt)["step"])

        # LoRA + z rows under peft's own names; never the (resized) embedding matrix
        adapter = get_peft_model_state_dict(model.peft_model, save_embedding_layers=False)
        save_file({k: v.detach().to("cpu").contiguous() for k, v in adapter.items()}, str(tmp / ADAPTER_WEIGHTS), metadata={"format": "pt"})
        peft_config = model.peft_model.peft_config["default"]
        peft_config.base_model_name_or_path = backbone
        peft_config.inference_mode = True
        peft_config.save_pretrained(str(tmp))
        added = _added_token_ids(model, backbone, trust_remote_code=trust_remote_code)
        save_file(latent_heads_state(model, added_ids=added), str(tmp / LATENT_HEADS), metadata={"format": "pt"})
        model.tokenizer.save_pretrained(str(tmp))
        (tmp / RUN_CONFIG).write_text(json.dumps(record, indent=2, sort_keys=True, default=str) + "\n")
        meta = {
            "format": EXPORT_FORMAT,
            "run_dir": str(run_dir.resolve()),
            "checkpoint": str(ckpt.resolve()),
            "step": step,
            "backbone": str(Path(backbone).resolve()),
            "base_config": _base_config(backbone),
            "vocab_size": len(model.tokenizer),
            "added_token_ids": added,
            "z_token_ids": list(model.tokens.latents),
            "latent_type": cfg.latent_type,
            "num_latents": cfg.num_latents,
            "reconstruction_loss_token_aggregation_mode": cfg.reconstruction_loss_token_aggregation_mode,
            "c_base": record.get("c_base"),
            "merged": bool(merge),
        }
        (tmp / EXPORT_META).write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
        metrics_step, metrics = _final_metrics(run_dir)
        (tmp / "README.md").write_text(model_card(cfg=cfg, record=record, meta=meta, metrics_step=metrics_step, metrics=metrics))
        if merge:
            # merges LoRA into the linear weights and the z rows into the embedding, in place (last use)
            merged = model.peft_model.merge_and_unload()
            merged.config.use_cache = True
            merged.save_pretrained(str(tmp / MERGED), safe_serialization=True)
            model.tokenizer.save_pretrained(str(tmp / MERGED))
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _publish(tmp, out)
    return out


# --------------------------------------------------------------------------- loading
def load_for_inference(
    path: str | os.PathLike,
    *,
    backbone: str | None = None,
    checkpoint: str | None = None,
    trust_remote_code: bool = False,
    device: str | torch.device | None = None,
):
    """A :class:`~zcvae.model.cvae.ZCVAE` in eval mode from an export directory or a run directory.

    A run directory loads its newest complete checkpoint (or ``checkpoint``). ``backbone`` overrides
    the recorded backbone directory (it must have the same config). ``model.run_record`` holds the
    run's ``run_config.json``.
    """
    from peft import set_peft_model_state_dict
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = Path(path)
    if not path.is_dir():
        raise ValueError(f"{str(path)!r} is not a directory (an export or a run directory)")
    record = read_run_record(path)
    cfg = _train_config(record, path / RUN_CONFIG)
    if (path / LATENT_HEADS).is_file():
        meta = read_json(path / EXPORT_META, what="export")
        backbone = resolve_backbone(cfg, override=backbone, recorded=meta.get("backbone"))
        _check_base(meta, backbone, path)
        model = _build_model(cfg, backbone, trust_remote_code=trust_remote_code, device=None)
        if len(model.tokenizer) != meta.get("vocab_size"):
            raise ValueError(f"{str(path / EXPORT_META)!r} has a vocabulary of {meta.get('vocab_size')}, the backbone's tokenizer gives {len(model.tokenizer)}")
        tensors = {}
        for name in (ADAPTER_WEIGHTS, LATENT_HEADS):
            try:
                tensors[name] = load_file(str(path / name))
            except (SafetensorError, OSError) as err:
                raise ValueError(f"export file {str(path / name)!r} could not be read: {err}") from None
        result = set_peft_model_state_dict(model.peft_model, tensors[ADAPTER_WEIGHTS])
        wanted = set(get_adapter_keys(model))
        missing = sorted(k for k in result.missing_keys if k in wanted)
        if result.unexpected_keys or missing:
            raise ValueError(f"{str(path / ADAPTER_WEIGHTS)!r} does not fit the model: unexpected {result.unexpected_keys[:4]}, missing {missing[:4]}")
        heads = tensors[LATENT_HEADS]
        try:
            for prefix, module in (("router", model.router), ("projection", model.projection)):
                if module is not None:
                    module.load_state_dict({k[len(prefix) + 1:]: v for k, v in heads.items() if k.startswith(prefix + ".")}, strict=True)
        except RuntimeError as err:
            raise ValueError(f"{str(path / LATENT_HEADS)!r} does not fit the model: {err}") from None
        _write_added_rows(model.peft_model, heads)
    elif (path / CHECKPOINTS).is_dir() or checkpoint is not None:
        ckpt = _newest_checkpoint(path, checkpoint)
        backbone = resolve_backbone(cfg, override=backbone, recorded=record.get("backbone"))
        model = _build_model(cfg, backbone, trust_remote_code=trust_remote_code, device=None)
        _load_checkpoint_into(model, ckpt)
    else:
        raise ValueError(f"{str(path)!r} is neither an export ({LATENT_HEADS}) nor a run directory with checkpoints/")
    model.run_record = record
    if device is not None:
        model.to(device)
    return model.eval()


def get_adapter_keys(model) -> list[str]:
    """peft state-dict keys (adapter name stripped) of the model's trainable adapter tensors."""
    from peft import get_peft_model_state_dict

    return list(get_peft_model_state_dict(model.peft_model, save_embedding_layers=False))


# --------------------------------------------------------------------------- decoding and encoding
def _text_ids(model, text: str, *, what: str) -> tuple[int, ...]:
    from zcvae.templates import user_text_reserved_ids

    if not text.strip():
        # training rejects an empty x or y (zcvae.data.jsonl): the model never saw one
        raise ValueError(f"--{what} must not be empty")
    ids = tuple(model.tokenizer(text, add_special_tokens=False)["input_ids"])
    reserved = user_text_reserved_ids(model.tokenizer, model.tokens)
    hit = next((i for i in ids if i in reserved), None)
    if hit is not None:
        raise ValueError(f"--{what} contains the special token {reserved[hit]!r} (id {hit}), which training refuses in user text: {text!r}")
    unk = getattr(model.tokenizer, "unk_token_id", None)
    if unk is not None and unk in ids:
        print(f"warning: --{what} has {ids.count(unk)} word(s) outside the vocabulary", file=sys.stderr)
    return ids


def _fit_x(model, x_ids: tuple[int, ...], *, y_len: int) -> tuple[int, ...]:
    """x under the training length policy (zcvae.templates.encode_examples): truncated from the left so
    that the z-conditioned sequence with ``y_len`` y tokens fits the run's ``max_length``; says so."""
    from zcvae.templates import TemplateLayout

    max_length = int(model.run_record["config"].get("max_length", 64))
    room = TemplateLayout(model.config.num_z_slots).room_for_x(max_length, y_len)
    if room < 0:
        raise ValueError(f"--y has {y_len} tokens and cannot fit in the run's max_length={max_length}")
    if len(x_ids) > room:
        print(f"warning: --x has {len(x_ids)} tokens; kept its last {room} to fit the run's max_length={max_length} "
              f"(x is truncated from the left, as in training)", file=sys.stderr)
        x_ids = x_ids[len(x_ids) - room:] if room > 0 else ()
    return x_ids


@torch.no_grad()
def decode_greedy(model, x_ids, *, latent_index=None, z=None, max_new_tokens: int) -> list[list[int]]:
    """Greedy y token ids (without ``</y>``) for x, one row per latent.

    ``latent_index`` (R,) long for the discrete latent, ``z`` (R, D) for the Gaussian one. Uses the
    model's "decode" mode (a full recompute per token: exports are for inspection, not serving).
    """
    from zcvae.model.decoding import greedy_decode
    from zcvae.templates import TemplateLayout

    t = model.tokens
    rows = int(latent_index.shape[0]) if latent_index is not None else int(z.shape[0])
    if max_new_tokens < 1:
        return [[] for _ in range(rows)]
    device = next(model.parameters()).device
    layout = TemplateLayout(model.config.num_z_slots)
    slot_R = torch.full((rows,), layout.z_slot_start(len(x_ids)), device=device)
    kw = {"latent_index": latent_index.to(device)} if latent_index is not None else {"z": z.to(device)}

    def next_logits(ids_RL, mask_RL):
        return model(mode="decode", input_ids=ids_RL, attention_mask=mask_RL, slot_start=slot_R, **kw)

    prompts = [layout.zcond_prompt(x_ids, t)] * rows
    generated, _, _ = greedy_decode(next_logits, prompts, num_steps=max_new_tokens, stop_id=(t.y_close, t.eos),
                                    pad_id=t.pad, device=device, lock_step=False)
    return generated


def _xy_batch(model, x_ids, y_ids):
    from zcvae.templates import EncodedExample, collate

    batch = collate([EncodedExample("input", tuple(x_ids), tuple(y_ids))], model.tokens, num_z_slots=model.config.num_z_slots)
    return batch.to(next(model.parameters()).device)


@torch.no_grad()
def encode_xy(model, x_ids, y_ids=None) -> dict[str, torch.Tensor]:
    """q(z|x,y) and p(z|x): discrete ``{"posterior", "prior"}`` (K,) probabilities; Gaussian
    ``{"mu", "sigma", "prior_mu", "prior_sigma"}`` (D,). Without ``y_ids`` only the prior is
    meaningful (the prior reads ``</x>``, which a causal model computes before any y token)."""
    placeholder = y_ids is None
    batch = _xy_batch(model, x_ids, y_ids if not placeholder else (model.tokens.pad,))
    out = model(batch, mode="encode")
    if out.posterior_logits is not None:
        result = {"posterior": out.posterior_logits.softmax(-1)[0], "prior": out.prior_logits.softmax(-1)[0], "kl": out.kl[0]}
    else:
        result = {"mu": out.mu[0], "sigma": (0.5 * out.logvar[0]).exp(), "prior_mu": out.prior_mu[0],
                  "prior_sigma": (0.5 * out.prior_logvar[0]).exp(), "kl": out.kl[0]}
    if placeholder:
        result = {k: v for k, v in result.items() if k.startswith("prior")}
    return {k: v.cpu() for k, v in result.items()}


# --------------------------------------------------------------------------- CLI
def _common_load_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("path", help="An export directory (zcvae export) or a run directory.")
    parser.add_argument("--backbone", help="Backbone directory or .gguf file, if it moved since training (same config required).")
    parser.add_argument("--checkpoint", help="Run directories only: this checkpoint instead of the newest.")
    parser.add_argument("--trust-remote-code", action="store_true", help="Let the backbone's own modelling code run.")
    parser.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda when available).")


def _device(name: str | None) -> str:
    if name is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(name)
    except RuntimeError as err:
        raise ValueError(f"--device {name!r} is not a device (cpu, cuda, cuda:1 ...): {err}") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"--device {name!r}: this torch has no usable CUDA (torch {torch.__version__}); use --device cpu")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(f"--device {name!r}: only {torch.cuda.device_count()} CUDA device(s) are visible")
    return name


def _run(command: str, fn, argv) -> int:
    try:
        return fn(argv)
    except ValueError as err:
        print(f"zcvae {command}: error: {err}", file=sys.stderr)
        return 2


def export_main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="zcvae export", description="Export a run's LoRA adapter, z rows, latent heads and tokenizer.")
    parser.add_argument("run_dir")
    parser.add_argument("--out", required=True, help="Export directory (written to OUT.tmp, then renamed).")
    parser.add_argument("--merge", action="store_true", help="Also write OUT/merged: a full HF model with LoRA and the z rows merged.")
    parser.add_argument("--checkpoint", help="A checkpoint directory (default: the run's newest complete one).")
    parser.add_argument("--overwrite", action="store_true", help="Replace an existing non-empty OUT.")
    parser.add_argument("--backbone", help="Backbone directory or .gguf file, if it moved since training.")
    parser.add_argument("--trust-remote-code", action="store_true", help="Let the backbone's own modelling code run.")

    def go(argv) -> int:
        args = parser.parse_args(argv)
        out = export_run(args.run_dir, out=args.out, checkpoint=args.checkpoint, merge=args.merge, overwrite=args.overwrite,
                         backbone=args.backbone, trust_remote_code=args.trust_remote_code)
        print(f"exported {args.run_dir} to {out}")
        return 0

    return _run("export", go, argv)


def one_line(text: str) -> str:
    """``text`` with backslashes, newlines, carriage returns and tabs escaped (``\\n`` ...).

    Why: ``generate --all-latents`` prints one ``label<TAB>y`` line per latent, and a real LM's y can
    hold newlines (SmolLM2 often starts with one), which would break that format for a reader.
    """
    return text.replace("\\", "\\\\").replace("\n", "\\n").replace("\r", "\\r").replace("\t", "\\t")


def generate_main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="zcvae generate", description="Greedy-decode y for x with a chosen latent.")
    _common_load_args(parser)
    parser.add_argument("--x", required=True, help="The input text.")
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--z", help="Discrete: a latent index 0..K-1. Gaussian: D comma-separated floats.")
    which.add_argument("--sample-prior", action="store_true", help="Draw z from p(z|x).")
    which.add_argument("--all-latents", action="store_true", help="Discrete: one line per latent, z=k<TAB>y (backslashes, newlines and tabs in y escaped as \\\\, \\n, \\t).")
    parser.add_argument("--max-new-tokens", type=int, default=None, help="Default: the run's max_length.")
    parser.add_argument("--seed", type=int, default=0, help="Seed of --sample-prior.")

    def go(argv) -> int:
        args = parser.parse_args(argv)
        model = load_for_inference(args.path, backbone=args.backbone, checkpoint=args.checkpoint,
                                   trust_remote_code=args.trust_remote_code, device=_device(args.device))
        cfg = model.run_record["config"]
        max_new = args.max_new_tokens if args.max_new_tokens is not None else int(cfg.get("max_length", 64))
        if max_new < 1:
            raise ValueError(f"--max-new-tokens must be >= 1, got {max_new}")
        # room for at least one y token: the longest x a kept training example can have
        x_ids = _fit_x(model, _text_ids(model, args.x, what="x"), y_len=1)
        generator = torch.Generator().manual_seed(args.seed)
        discrete = model.config.latent_type == "discrete"
        K, D = model.config.num_latents, model.config.latent_dim
        labels: list[str]
        if discrete:
            if args.all_latents:
                index = torch.arange(K)
            elif args.z is not None:
                try:
                    k = int(args.z)
                except ValueError:
                    raise ValueError(f"--z must be a latent index 0..{K - 1}, got {args.z!r}") from None
                if not 0 <= k < K:
                    raise ValueError(f"--z must be in 0..{K - 1}, got {k}")
                index = torch.tensor([k])
            else:
                prior = encode_xy(model, x_ids)["prior"]
                k = int(torch.multinomial(prior, 1, generator=generator)) if args.sample_prior else int(prior.argmax())
                print(f"[z] {'sampled' if args.sample_prior else 'most probable'} z = {k} under p(z|x) = {prior[k]:.4f}", file=sys.stderr)
                index = torch.tensor([k])
            ys = decode_greedy(model, x_ids, latent_index=index, max_new_tokens=max_new)
            labels = [f"z={k}" for k in index.tolist()]
        else:
            if args.all_latents:
                raise ValueError("--all-latents needs a discrete latent; this model's z is Gaussian (use --z or --sample-prior)")
            if args.z is not None:
                try:
                    values = [float(v) for v in args.z.split(",")]
                except ValueError:
                    raise ValueError(f"--z must be {D} comma-separated floats, got {args.z!r}") from None
                if len(values) != D or not all(math.isfinite(v) for v in values):
                    raise ValueError(f"--z must be {D} finite comma-separated floats, got {len(values)}")
                z = torch.tensor([values])
            else:
                prior = encode_xy(model, x_ids)
                eps = torch.randn(prior["prior_mu"].shape, generator=generator) if args.sample_prior else 0.0
                z = (prior["prior_mu"] + prior["prior_sigma"] * eps)[None]
            ys = decode_greedy(model, x_ids, z=z, max_new_tokens=max_new)
            labels = ["z=" + ",".join(f"{v:.3f}" for v in z[0].tolist())]
        for label, y in zip(labels, ys):
            text = model.tokenizer.decode(y, skip_special_tokens=False)
            print(f"{label}\t{one_line(text)}" if len(ys) > 1 else text)
        return 0

    return _run("generate", go, argv)


def encode_main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="zcvae encode", description="Print the posterior q(z|x,y) and the prior p(z|x).")
    _common_load_args(parser)
    parser.add_argument("--x", required=True)
    parser.add_argument("--y", required=True)

    def go(argv) -> int:
        args = parser.parse_args(argv)
        model = load_for_inference(args.path, backbone=args.backbone, checkpoint=args.checkpoint,
                                   trust_remote_code=args.trust_remote_code, device=_device(args.device))
        x_ids, y_ids = _text_ids(model, args.x, what="x"), _text_ids(model, args.y, what="y")
        x_ids = _fit_x(model, x_ids, y_len=len(y_ids))
        r = encode_xy(model, x_ids, y_ids)

        def vec(t: torch.Tensor) -> str:
            return " ".join(f"{v:.4f}" for v in t.tolist())

        if "posterior" in r:
            print("q(z|x,y)\t" + "  ".join(f"z={k}:{p:.4f}" for k, p in enumerate(r["posterior"].tolist())))
            print("p(z|x)\t" + "  ".join(f"z={k}:{p:.4f}" for k, p in enumerate(r["prior"].tolist())))
        else:
            print(f"q(z|x,y)\tmu=[{vec(r['mu'])}]\tsigma=[{vec(r['sigma'])}]")
            print(f"p(z|x)\tmu=[{vec(r['prior_mu'])}]\tsigma=[{vec(r['prior_sigma'])}]")
        print(f"KL(q||p)\t{float(r['kl']):.4f} nats")
        return 0

    return _run("encode", go, argv)
