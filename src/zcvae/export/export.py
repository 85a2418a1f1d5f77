"""Export a trained run: the LoRA adapter, the z rows, the latent heads, the tokenizer and a model card.

    zcvae export runs/a --out exports/a [--merge] [--checkpoint runs/a/checkpoints/step_00000300]

The directory's layout is ``zcvae.export.format``; it is written to ``OUT.tmp`` and renamed. The
export is built from the checkpoint's ``trainable.safetensors`` (the engine-independent, fully
gathered trainable parameters), so runs of every engine and world size export the same way, in one
process.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch

from zcvae.export.card import model_card
from zcvae.export.format import ADAPTER_WEIGHTS, EXPORT_FORMAT, EXPORT_META, LATENT_HEADS, MERGED, base_config
from zcvae.export.load import (
    build_model,
    input_embedding_weight,
    load_checkpoint_into,
    newest_checkpoint,
    output_embedding_weight,
    resolve_backbone,
    run_train_config,
)
from zcvae.model.hf_compat import TRAINABLE_TOKENS_DELTA, adapter_config
from zcvae.runs.checkpoint import read_meta
from zcvae.runs.rundir import RUN_CONFIG, check_writable, describe_disk_error, final_eval_metrics, read_run_record

__all__ = ["export_run", "latent_heads_state"]


def _added_token_ids(model, backbone: str, *, trust_remote_code: bool) -> list[int]:
    from transformers import AutoTokenizer

    base = AutoTokenizer.from_pretrained(backbone, local_files_only=True, trust_remote_code=trust_remote_code).get_vocab()
    return sorted(i for t, i in model.tokenizer.get_vocab().items() if t not in base)


def _z_rows_parameter(model) -> torch.nn.Parameter | None:
    for name, p in model.peft_model.named_parameters():
        if TRAINABLE_TOKENS_DELTA in name and "embed" in name:
            return p
    return next((p for n, p in model.peft_model.named_parameters() if TRAINABLE_TOKENS_DELTA in n), None)


def latent_heads_state(model, *, added_ids: list[int]) -> dict[str, torch.Tensor]:
    """Everything of the trained model outside the LoRA adapter that the export needs (CPU tensors)."""
    out: dict[str, torch.Tensor] = {}
    z_rows, num_z = _z_rows_parameter(model), len(model.tokens.latents)
    if z_rows is not None and num_z:
        # the delta holds the z rows first, then any markers trained with allow_fresh_markers
        out["z_rows"] = z_rows.detach()[:num_z]
    for prefix, module in (("router", model.router), ("projection", model.projection), ("z_norm", model.z_norm)):
        if module is not None:
            out.update({f"{prefix}.{k}": v.detach() for k, v in module.state_dict().items()})
    ids = torch.tensor(added_ids, dtype=torch.long)
    out["added_token_ids"] = ids
    out["added_rows.input_embeddings"] = input_embedding_weight(model.peft_model).detach()[ids]
    output = output_embedding_weight(model.peft_model)
    if output is not None and len(added_ids):
        out["added_rows.output_embeddings"] = output.detach()[ids]
    return {k: v.to("cpu", copy=True).contiguous() for k, v in out.items()}


def _check_out_apart(out: Path, sources: dict[str, Path]) -> None:
    """ValueError when ``out`` is, contains or lies inside one of ``sources``: publishing the export
    replaces ``out`` whole, which would delete the run or the backbone it reads (whatever --overwrite says)."""
    target = out.resolve()
    for name, source in sources.items():
        source = Path(source).resolve()
        if target == source or source in target.parents or target in source.parents:
            how = "is" if target == source else ("lies inside" if source in target.parents else "contains")
            raise ValueError(f"--out {str(out)!r} {how} the {name} {str(source)!r}: the export would replace it; choose an --out outside it")


def _check_finite(ckpt: Path) -> None:
    """ValueError when the checkpoint's weights hold a NaN or an infinity (a diverged run): such an
    export would load and decode ``<pad> <pad> ...`` or encode ``nan`` without complaint."""
    from zcvae.runs.checkpoint import load_trainable_state, nonfinite_tensors

    trainable, buffers = load_trainable_state(ckpt)
    bad = nonfinite_tensors([*trainable.items(), *buffers.items()])
    if bad:
        raise ValueError(f"checkpoint {str(ckpt)!r} holds non-finite weights ({', '.join(bad[:3])}{' ...' if len(bad) > 3 else ''}): "
                         f"the run diverged; export an earlier checkpoint with --checkpoint, or retrain with lower learning rates")


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
    cfg = run_train_config(record, run_dir / RUN_CONFIG)
    ckpt = newest_checkpoint(run_dir, checkpoint)
    if merge and cfg.model.z_conditioned_norm:
        raise ValueError("--merge writes a plain Hugging Face checkpoint, which cannot hold the z-conditioned norms of this run "
                         "(--z-conditioned-norm: a scale and shift per z, applied at run time); export without --merge and "
                         "load it with zcvae.export.load")
    backbone = resolve_backbone(cfg, override=backbone, recorded=record.get("backbone"))
    _check_out_apart(out, {"run directory": run_dir, "checkpoint": ckpt, "backbone directory": Path(backbone)})
    _check_finite(ckpt)
    check_writable(out, what="--out")
    tmp = _prepare_out(out, overwrite=overwrite)
    try:
        model = build_model(cfg, backbone, trust_remote_code=trust_remote_code, device="cpu")
        load_checkpoint_into(model, ckpt)
        step = int(read_meta(ckpt)["step"])

        # LoRA + z rows under peft's own names; never the (resized) embedding matrix
        adapter = get_peft_model_state_dict(model.peft_model, save_embedding_layers=False)
        save_file({k: v.detach().to("cpu").contiguous() for k, v in adapter.items()}, str(tmp / ADAPTER_WEIGHTS), metadata={"format": "pt"})
        peft_config = adapter_config(model.peft_model)
        peft_config.base_model_name_or_path = backbone
        peft_config.inference_mode = True
        peft_config.save_pretrained(str(tmp))
        added = _added_token_ids(model, backbone, trust_remote_code=trust_remote_code)
        save_file(latent_heads_state(model, added_ids=added), str(tmp / LATENT_HEADS), metadata={"format": "pt"})
        model.tokenizer.save_pretrained(str(tmp))
        record = {**record, "config": cfg.to_sections()}  # in sections, whichever layout the run wrote
        (tmp / RUN_CONFIG).write_text(json.dumps(record, indent=2, sort_keys=True, default=str) + "\n")
        meta = {
            "format": EXPORT_FORMAT,
            "run_dir": str(run_dir.resolve()),
            "checkpoint": str(ckpt.resolve()),
            "step": step,
            "backbone": str(Path(backbone).resolve()),
            "base_config": base_config(backbone),
            "vocab_size": len(model.tokenizer),
            "added_token_ids": added,
            "z_token_ids": list(model.tokens.latents),
            "latent_type": cfg.model.latent_type,
            "num_latents": cfg.model.num_latents,
            "reconstruction_loss_token_aggregation_mode": cfg.objective.reconstruction_loss_token_aggregation_mode,
            "c_base": record.get("c_base"),
            "merged": bool(merge),
        }
        (tmp / EXPORT_META).write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
        metrics_step, metrics = final_eval_metrics(run_dir)
        (tmp / "README.md").write_text(model_card(cfg=cfg, record=record, meta=meta, metrics_step=metrics_step, metrics=metrics))
        if merge:
            # merges LoRA into the linear weights and the z rows into the embedding, in place (last use)
            merged = model.peft_model.merge_and_unload()
            merged.config.use_cache = True
            merged.save_pretrained(str(tmp / MERGED), safe_serialization=True)
            model.tokenizer.save_pretrained(str(tmp / MERGED))
    except BaseException as err:
        shutil.rmtree(tmp, ignore_errors=True)
        # safetensors and the tokenizer's writer do not name the file of a full disk: name the export's
        if (line := describe_disk_error(err, path=tmp)) is not None:
            raise ValueError(f"--out {str(out)!r}: {line}") from None
        raise
    _publish(tmp, out)
    return out
