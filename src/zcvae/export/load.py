"""Load a trained run or an export for inference, and run it: decode y or read the latent for x.

``load_for_inference`` builds a :class:`~zcvae.model.cvae.ZCVAE` in eval mode from an export directory
(``zcvae.export.format``) or from a run directory's checkpoint; ``prepare_base`` gives peft users the
backbone resized with zcvae's added rows. The backbone's own code runs only with ``trust_remote_code``.
``decode_greedy`` and ``encode_xy`` are what ``zcvae generate`` and ``zcvae encode`` print.

Shape legend: R rows of a decode call, S sequence length, V vocabulary, K latents, D latent dim.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from zcvae.export.format import ADAPTER_WEIGHTS, EXPORT_META, LATENT_HEADS, base_config
from zcvae.model import hf_compat
from zcvae.runs.checkpoint import checkpoint_dirs, load_trainable_state, resolve_checkpoint
from zcvae.runs.rundir import CHECKPOINTS, RUN_CONFIG, builtin_backbone_dir, read_json, read_run_record

__all__ = [
    "build_model",
    "decode_greedy",
    "encode_xy",
    "get_adapter_keys",
    "input_embedding_weight",
    "load_checkpoint_into",
    "load_for_inference",
    "newest_checkpoint",
    "output_embedding_weight",
    "prepare_base",
    "resolve_backbone",
    "run_train_config",
]


# --------------------------------------------------------------------------- run records
def run_train_config(record: dict[str, Any], source: Path):
    """The TrainConfig of a run record (``run_config.json``); ValueError naming ``source``."""
    from zcvae.config import TrainConfig

    return TrainConfig.from_dict(dict(record["config"]), source=str(source))


def _builtin_backbone(cfg) -> Path:
    # The path of train.trainer.default_backbone without its side effect (it would pretrain a missing backbone).
    from zcvae.backbone.stage_config import is_pretrained

    cache = builtin_backbone_dir(cfg.data.task)
    if not is_pretrained(cache):
        raise ValueError(
            f"the run used the built-in backbone {str(cache)!r}, which is missing: rebuild it with "
            f"`zcvae pretrain --task {cfg.data.task or 'copy'} --output-dir {cache}` or pass --backbone DIR"
        )
    return cache


def resolve_backbone(cfg, *, override: str | None = None, recorded: str | None = None) -> str:
    """The backbone directory: ``override`` > the one an export recorded > the run's > the built-in one.

    A ``.gguf`` file is converted into (or found in) zcvae's cache, as ``zcvae train`` does.
    """
    from zcvae.backbone.convert import is_gguf_path, resolve_backbone_path

    for candidate in (override, recorded, cfg.model.backbone):
        if candidate:
            if is_gguf_path(candidate) and Path(candidate).is_file():
                return resolve_backbone_path(str(candidate))
            if not Path(candidate).is_dir():
                raise ValueError(f"backbone directory {candidate!r} does not exist (pass --backbone DIR if it moved)")
            return str(candidate)
    return str(_builtin_backbone(cfg))


def build_model(cfg, backbone: str, *, trust_remote_code: bool, device: str | torch.device | None):
    from zcvae.model.cvae import ZCVAE

    if cfg.model.trust_remote_code and not trust_remote_code:
        raise ValueError("the run was trained with trust_remote_code; pass --trust-remote-code to let the backbone's own code run")
    model_config = cfg.model_config()
    model_config.trust_remote_code = bool(trust_remote_code)
    model_config.gradient_checkpointing = False
    model = ZCVAE.from_pretrained(backbone, model_config, seed=cfg.optimization.seed)
    model.eval()
    if device is not None:
        model.to(device)
    return model


def load_checkpoint_into(model, checkpoint: Path) -> None:
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


def newest_checkpoint(run_dir: Path, checkpoint: str | None) -> Path:
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
def input_embedding_weight(peft_model) -> torch.Tensor:
    return hf_compat.embedding_weight(peft_model.get_input_embeddings())


def output_embedding_weight(peft_model) -> torch.Tensor | None:
    out = peft_model.get_output_embeddings()
    if out is None:
        return None
    weight = hf_compat.embedding_weight(out)
    return None if weight.data_ptr() == input_embedding_weight(peft_model).data_ptr() else weight


def write_added_rows(base_model, heads: dict[str, torch.Tensor]) -> None:
    """Write the rows of zcvae's added tokens (markers, z tokens) into a resized base model."""
    ids = heads["added_token_ids"].long()
    with torch.no_grad():
        emb = base_model.get_input_embeddings()
        weight = hf_compat.embedding_weight(emb)
        weight[ids] = heads["added_rows.input_embeddings"].to(weight)
        out = base_model.get_output_embeddings()
        if "added_rows.output_embeddings" in heads and out is not None:
            w = hf_compat.embedding_weight(out)
            w[ids] = heads["added_rows.output_embeddings"].to(w)


def prepare_base(backbone: str | os.PathLike, export_dir: str | os.PathLike, *, trust_remote_code: bool = False):
    """The backbone, resized to the export's vocabulary with zcvae's added rows, ready for
    ``peft.PeftModel.from_pretrained(base, export_dir)``."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    export_dir = Path(export_dir)
    meta = read_json(export_dir / EXPORT_META, what="export")
    check_base(meta, str(backbone), export_dir)
    tokenizer = AutoTokenizer.from_pretrained(export_dir, local_files_only=True, trust_remote_code=trust_remote_code)
    base = AutoModelForCausalLM.from_pretrained(backbone, local_files_only=True, use_safetensors=True, trust_remote_code=trust_remote_code)
    if len(tokenizer) > base.get_input_embeddings().weight.shape[0]:
        base.resize_token_embeddings(len(tokenizer))
    write_added_rows(base, load_file(str(export_dir / LATENT_HEADS)))
    return base


def check_base(meta: dict[str, Any], backbone: str, export_dir: Path) -> None:
    recorded, actual = meta.get("base_config") or {}, base_config(backbone)
    diffs = [f"{k}: {recorded[k]!r} vs {actual.get(k)!r}" for k in recorded if recorded[k] != actual.get(k)]
    if diffs:
        raise ValueError(
            f"{str(export_dir / EXPORT_META)!r} was exported from a run on another backbone than "
            f"{str(Path(backbone) / 'config.json')!r} ({'; '.join(diffs)}): pass the run's backbone with --backbone"
        )


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
    cfg = run_train_config(record, path / RUN_CONFIG)
    if (path / LATENT_HEADS).is_file():
        meta = read_json(path / EXPORT_META, what="export")
        backbone = resolve_backbone(cfg, override=backbone, recorded=meta.get("backbone"))
        check_base(meta, backbone, path)
        model = build_model(cfg, backbone, trust_remote_code=trust_remote_code, device=None)
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
            for prefix, module in (("router", model.router), ("projection", model.projection), ("z_norm", model.z_norm)):
                if module is not None:
                    module.load_state_dict({k[len(prefix) + 1:]: v for k, v in heads.items() if k.startswith(prefix + ".")}, strict=True)
        except RuntimeError as err:
            raise ValueError(f"{str(path / LATENT_HEADS)!r} does not fit the model: {err}") from None
        write_added_rows(model.peft_model, heads)
    elif (path / CHECKPOINTS).is_dir() or checkpoint is not None:
        ckpt = newest_checkpoint(path, checkpoint)
        backbone = resolve_backbone(cfg, override=backbone, recorded=record.get("backbone"))
        model = build_model(cfg, backbone, trust_remote_code=trust_remote_code, device=None)
        load_checkpoint_into(model, ckpt)
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
@torch.no_grad()
def decode_greedy(model, x_ids, *, latent_index=None, z=None, max_new_tokens: int) -> list[list[int]]:
    """Greedy y token ids (without ``</y>``) for x, one row per latent.

    ``latent_index`` (R,) long for the discrete latent, ``z`` (R, D) for the Gaussian one. Uses the
    model's "decode" mode with a key/value cache (the prompt once, then one token per forward).
    """
    from zcvae.model.decoding import KVCache, greedy_decode
    from zcvae.data.encoding import TemplateLayout

    t = model.tokens
    rows = int(latent_index.shape[0]) if latent_index is not None else int(z.shape[0])
    if max_new_tokens < 1:
        return [[] for _ in range(rows)]
    device = next(model.parameters()).device
    layout = TemplateLayout(model.config.num_z_slots)
    slot_R = torch.full((rows,), layout.z_slot_start(len(x_ids)), device=device)
    kw = {"latent_index": latent_index.to(device)} if latent_index is not None else {"z": z.to(device)}

    cache = KVCache()

    def next_logits(ids_RL, mask_RL):
        return model.decode(input_ids=ids_RL, attention_mask=mask_RL, slot_start=slot_R, cache=cache, **kw)

    prompts = [layout.zcond_prompt(x_ids, t)] * rows
    generated, _, _ = greedy_decode(next_logits, prompts, num_steps=max_new_tokens, stop_id=(t.y_close, t.eos),
                                    pad_id=t.pad, device=device, lock_step=False)
    return generated


def _xy_batch(model, x_ids, y_ids):
    from zcvae.data.encoding import EncodedExample, collate

    batch = collate([EncodedExample("input", tuple(x_ids), tuple(y_ids))], model.tokens, num_z_slots=model.config.num_z_slots)
    return batch.to(next(model.parameters()).device)


@torch.no_grad()
def encode_xy(model, x_ids, y_ids=None) -> dict[str, torch.Tensor]:
    """q(z|x,y) and p(z|x): discrete ``{"posterior", "prior"}`` (K,) probabilities; Gaussian
    ``{"mu", "sigma", "prior_mu", "prior_sigma"}`` (D,). Without ``y_ids`` only the prior is
    meaningful (the prior reads ``</x>``, which a causal model computes before any y token)."""
    placeholder = y_ids is None
    batch = _xy_batch(model, x_ids, y_ids if not placeholder else (model.tokens.pad,))
    out = model.encode(batch)
    if out.posterior_logits is not None:
        result = {"posterior": out.posterior_logits.softmax(-1)[0], "prior": out.prior_logits.softmax(-1)[0], "kl": out.kl[0]}
    else:
        result = {"mu": out.mu[0], "sigma": (0.5 * out.logvar[0]).exp(), "prior_mu": out.prior_mu[0],
                  "prior_sigma": (0.5 * out.prior_logvar[0]).exp(), "kl": out.kl[0]}
    if placeholder:
        result = {k: v for k, v in result.items() if k.startswith("prior")}
    return {k: v.cpu() for k, v in result.items()}
