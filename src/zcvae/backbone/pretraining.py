"""Pretrain the tiny entangled backbone that the CVAE starts from.

The backbone is an ordinary causal LM fit to the mixture of strategies: given x it spreads its
probability over the strategies (the first y token names one), so the strategy is *entangled* in the
model rather than exposed as a variable. The CVAE later learns a z that pulls the strategies apart.

Two templates are mixed during pretraining (``z_template_share`` of the examples, drawn per row and
per step, take the second)::

    <bos> <x> {x} </x> <y> {y} </y> <eos>                       z-free: the reference's input
    <bos> <x> {x} </x> <z> <znull> </z> <y> {y} </y> <eos>      z-shaped, <znull> in the slot

Why both: in the prototype a backbone pretrained on the z-free template alone went from 1.9 to 32
nats of y NLL when a z section was inserted, and LoRA did not repair it; with half of the examples in
the z-shaped template the CVAE's z rows can start as the ``<znull>`` row and the decoder reads them.

Loss: mean token NLL over the supervised span (y and ``</y>``) of the global batch, fp32, AdamW, linear
warm-up then cosine decay to ``min_lr_ratio`` of the peak. The steps run on the loop that ``zcvae train``
runs on (``zcvae.loop``), with its engines (local/DDP, DeepSpeed ZeRO, FSDP2), resume, metrics.jsonl,
TensorBoard and progress bar; the run state (``checkpoints/``, ``metrics.jsonl``, ``tensorboard/``)
lives in ``output_dir``. At the end the trained weights are gathered on rank 0 (ZeRO-3 and FSDP2
shards made whole), loaded into a fresh copy of the seeded start, LoRA merged, and the checkpoint, a
standard Hugging Face directory (``config.json``, ``model.safetensors``, tokenizer files) plus
``pretrain_summary.json``, is written into ``output_dir``, the summary last: ``is_pretrained`` never
accepts a half-written directory.

Run (2 CPU cores; about 1-2 minutes for the defaults on the default task)::

    zcvae pretrain --output-dir runs/backbone
    torchrun --nproc_per_node 2 -m zcvae pretrain --backbone DIR --engine deepspeed --deepspeed-config zero3 ...

The stage's parts: what it is asked (``stage_config``), its data and objective (``stage_data``), its model
(``stage_model``), how it is judged (``stage_eval``); the built-in backbones' cache is ``builtin``. This
module runs the stage, one named step after another (:func:`_pretrain`).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from zcvae.backbone.stage_config import SUMMARY_FILE, PretrainConfig
from zcvae.backbone.stage_data import (
    SpanNLLObjective,
    data_fingerprint,
    encode_split,
    load_data,
    validation_targets,
)
from zcvae.backbone.stage_eval import decoding_report, evaluate_nll
from zcvae.backbone.stage_model import build_tiny_model, load_backbone_for_finetune, merged_model
from zcvae.core.schedule import lr_multiplier
from zcvae.cpu import cpu_threads, flush_denormals
from zcvae.data.encoding import collate, encoded_fingerprint

logger = logging.getLogger(__name__)


def _resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def pretrain(config: PretrainConfig) -> dict:
    """Train the backbone, write the checkpoint to ``config.output_dir`` and return the summary.

    The steps run on the training loop of ``zcvae train`` (``zcvae.loop.driver.run_loop``) and its engines, so the
    stage runs multi-process under torchrun, resumes (``resume="auto"``) and logs metrics.jsonl and
    TensorBoard into ``output_dir``; its checkpoints go to ``output_dir/checkpoints``.

    The summary (also ``pretrain_summary.json``) holds the resolved config, steps, wall time, the
    validation y NLL per template before and after training (nats per sequence and per token, per
    strategy; for a built-in task also on each example's decision token), the floor (the validation mean
    of H(y | x): log S for S strategies that give S different ys) for a built-in task, and the
    decoding report when a task parser is available.
    """
    from zcvae.distributed import dist_info
    from zcvae.runs.lock import RunLock
    from zcvae.loop.guards import StopSignals

    flush_denormals()
    previous_threads = torch.get_num_threads()
    # a fixed thread count (zcvae.cpu.cpu_threads): every run trained on the stage starts from its numbers
    follower, _ = cpu_threads()
    try:
        # as in `zcvae train`: the stop handlers first, then rank 0 holds the directory's lock
        with StopSignals() as signals:
            lock = RunLock(Path(config.output_dir)) if dist_info().rank == 0 else None
            if lock is not None:
                lock.acquire()
            try:
                return _pretrain(config, signals=signals, follower=follower)
            finally:
                if lock is not None:
                    lock.release()
    finally:
        torch.set_num_threads(previous_threads)


# What a stage's output directory may hold besides the checkpoint files: its run state and the lock.
_RUN_STATE = ("checkpoints", "metrics.jsonl", "tensorboard")


def _prepare_output_dir(run_dir: Path, *, resume: bool, is_main: bool) -> None:
    """Make ``run_dir`` ready for the stage. Without ``resume`` the summary goes first, so ``is_pretrained`` is False
    from here until the new checkpoint is complete, and an earlier stage there (finished or not) is replaced; with
    ``resume`` the summary goes once the checkpoint is found compatible (``_train``), so a refused resume leaves the
    stage as it was. A directory that holds no stage is refused, not deleted."""
    from zcvae.distributed import barrier
    from zcvae.runs.lock import LOCK_FILE

    if run_dir.exists() and not run_dir.is_dir():
        raise ValueError(f"output_dir {str(run_dir)!r} is an existing file; choose a directory")
    entries = sorted(p.name for p in run_dir.iterdir() if p.name != LOCK_FILE) if run_dir.is_dir() else []
    if entries and not any(name in entries for name in (SUMMARY_FILE, *_RUN_STATE)):
        raise ValueError(f"output_dir {str(run_dir)!r} holds other files ({', '.join(entries[:4])}), not a pretraining stage: "
                         f"choose another --output-dir")
    barrier()  # every rank has looked before rank 0 changes anything, so all take the same decision
    if is_main and not resume:
        (run_dir / SUMMARY_FILE).unlink(missing_ok=True)
        if entries:
            logger.info(f"[pretrain] replacing the earlier stage in {run_dir}")
            for name in entries:
                path = run_dir / name
                shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)
    if is_main:
        run_dir.mkdir(parents=True, exist_ok=True)


class _StageLogger:
    """The RunLogger (rank 0: metrics.jsonl + TensorBoard) plus the stage's progress lines."""

    def __init__(self, inner, *, max_steps: int):
        self.inner, self.max_steps = inner, max_steps
        self.start = time.perf_counter()

    def log(self, split: str, step: int, metrics: dict) -> None:
        self.inner.log(split, step, metrics)
        if split == "train":
            lr = next((v for k, v in sorted(metrics.items()) if k.startswith("learning_rate/")), float("nan"))
            logger.info(f"step {step}/{self.max_steps} loss {metrics.get('loss', float('nan')):.4f} lr {lr:.2e} "
                        f"tokens/s {metrics.get('tokens_per_second', 0.0):.0f} elapsed {time.perf_counter() - self.start:.1f}s")

    def close(self) -> None:
        self.inner.close()



@dataclass
class _Stage:
    """What the stage trains and on what: built once by :func:`_build_stage`."""

    model: Any
    tokenizer: Any
    tokens: Any
    source: dict | None
    """Where the weights came from (None: the tiny model from scratch)."""
    train_examples: list
    val_examples: list
    task: Any
    """The built-in task family, or None for JSONL data."""
    train: list
    val: list
    rebuild: Callable[[], Any]
    """A fresh copy of the model before training (seeded, so equal to ``model`` at the start)."""


def _build_stage(config: PretrainConfig) -> _Stage:
    """The model and the encoded data. A pretrained backbone comes first (its tokenizer gains the markers
    that the data is then encoded with); the tiny model comes after its word-level tokenizer is built
    over the data."""
    if config.backbone is not None:
        model, tokenizer, tokens, source = load_backbone_for_finetune(config)
        _, _, train_ex, val_ex, task = load_data(config, tokenizer=tokenizer)

        def rebuild():
            return load_backbone_for_finetune(config)[0]
    else:
        tokenizer, tokens, train_ex, val_ex, task = load_data(config)
        model, source = build_tiny_model(config, tokenizer, tokens), None

        def rebuild():
            return build_tiny_model(config, tokenizer, tokens)
    train = encode_split(train_ex, tokenizer, tokens, max_length=config.max_length, what="train")
    val = encode_split(val_ex, tokenizer, tokens, max_length=config.max_length, what="val")
    return _Stage(model=model, tokenizer=tokenizer, tokens=tokens, source=source, train_examples=train_ex,
                  val_examples=val_ex, task=task, train=train, val=val, rebuild=rebuild)


def _micro_batch_size(config: PretrainConfig, world_size: int) -> int:
    micro_batch_size, rest = divmod(config.batch_size, config.gradient_accumulation_steps * world_size)
    if rest or micro_batch_size < 1:
        raise ValueError(f"batch_size {config.batch_size} must be a multiple of gradient_accumulation_steps "
                         f"{config.gradient_accumulation_steps} x world size {world_size}")
    return micro_batch_size


def _build_engine(config: PretrainConfig, model):
    """(engine, param groups): AdamW over the trained parameters, no decay on vectors."""
    from zcvae.engines import build_engine

    trained = [p for p in model.parameters() if p.requires_grad]
    groups = [g for g in ({"name": "decay", "params": [p for p in trained if p.ndim >= 2], "weight_decay": config.weight_decay,
                           "lr": config.learning_rate},
                          {"name": "no_decay", "params": [p for p in trained if p.ndim < 2], "weight_decay": 0.0,
                           "lr": config.learning_rate}) if g["params"]]
    engine = build_engine(config.engine_config(), model=model, param_groups=groups, learning_rate=config.learning_rate,
                          weight_decay=config.weight_decay, betas=(0.9, 0.95))
    return engine, groups


def _resume(config: PretrainConfig, *, engine, checkpoints, run_dir: Path, train_data: dict, is_main: bool) -> int:
    """The step to start from: 0, or that of the checkpoint ``config.resume`` names (loaded into ``engine``; refused
    when ``train_data``, the training set's fingerprint, is not the checkpoint's)."""
    from zcvae.runs.rundir import METRICS, truncate_metrics

    if config.resume is None:
        return 0
    state = checkpoints.load(engine, config.resume, config=config, c_base=None, train_data=train_data)
    start_step = state["step"]
    if start_step > config.max_steps:
        raise ValueError(f"resume: checkpoint {state['checkpoint']!r} is at step {start_step}, past max_steps {config.max_steps}; "
                         f"resume with --max-steps {start_step} or more")
    if start_step:
        logger.info(f"[resume] from step {start_step}")
    if is_main:
        truncate_metrics(run_dir / METRICS, after_step=start_step)
    return start_step


def _train(config: PretrainConfig, stage: _Stage, *, engine, groups, micro_batch_size: int, world_size: int,
           run_dir: Path, is_main: bool, decision_pos, signals, follower=None) -> dict:
    """Run the loop from the resumed step to ``max_steps``; return the timings, the tokens seen, the
    resumed step and the final validation statistics."""
    from zcvae.loop import LoopSettings, RunLogger, run_loop
    from zcvae.runs.checkpoint import CheckpointManager
    from zcvae.runs.rundir import CHECKPOINTS

    # One collated copy of the whole training set; each step selects rows and trims padding columns.
    train_all = collate(stage.train, stage.tokens)
    global_batch = micro_batch_size * config.gradient_accumulation_steps * world_size
    checkpoints = CheckpointManager(run_dir / CHECKPOINTS, keep=config.keep_last_checkpoints, is_main=is_main)
    train_data = encoded_fingerprint(stage.train)
    start_step = _resume(config, engine=engine, checkpoints=checkpoints, run_dir=run_dir, train_data=train_data, is_main=is_main)
    if is_main:  # a resume the checkpoint accepted: from here the stage's files change (a fresh stage removed it already)
        (run_dir / SUMMARY_FILE).unlink(missing_ok=True)
    run_logger = _StageLogger(RunLogger(run_dir, enabled=is_main), max_steps=config.max_steps)
    results: dict = {}

    def run_eval(step: int) -> dict[str, float]:
        stats = evaluate_nll(engine.module, stage.val, stage.tokens, decision_positions=decision_pos)
        zf, zn = stats["zfree"], stats["znull"]
        metrics = {"y_nll_per_example": zf["nll_per_example"], "y_nll_per_token": zf["nll_per_token"],
                   "znull_y_nll_per_example": zn["nll_per_example"]}
        if "decision_token_nll" in zf:
            metrics["decision_token_nll"] = zf["decision_token_nll"]
        run_logger.inner.log("eval", step, metrics)
        if step != config.max_steps:
            logger.info(f"step {step} val y NLL {zf['nll_per_example']:.3f} nats/sequence{_decision_note(zf)}")
        results["final"] = stats
        return metrics

    settings = LoopSettings(max_steps=config.max_steps, micro_batch_size=micro_batch_size,
                            gradient_accumulation_steps=config.gradient_accumulation_steps, seed=config.seed,
                            log_every=config.log_every, eval_every=config.eval_every, save_every=config.save_every,
                            max_grad_norm=config.grad_clip if config.grad_clip > 0 else None,
                            progress_bar=config.progress_bar, run_name=f"pretrain {run_dir.name}", progress_metrics={"loss": ".4f"})
    objective = SpanNLLObjective(engine=engine, train_all=train_all, tokens=stage.tokens, seed=config.seed,
                                 z_template_share=config.z_template_share, global_batch=global_batch)
    train_start, train_cpu_start = time.perf_counter(), time.process_time()
    run_loop(engine=engine, objective=objective, settings=settings, num_examples=len(stage.train),
             peak_lrs=[g["lr"] for g in groups], group_names=[g["name"] for g in groups],
             lr_factor=lambda step: lr_multiplier(step, warmup_steps=config.warmup_steps, max_steps=config.max_steps,
                                                  min_lr_ratio=config.min_lr_ratio),
             start_step=start_step, checkpoints=checkpoints, checkpoint_state={"config": config, "c_base": None, "train_data": train_data},
             evaluate=run_eval, run_logger=run_logger, signals=signals, cpu_threads=follower)
    train_time = time.perf_counter() - train_start
    # CPU seconds of this process: on a shared machine, a steadier measure of cost than wall time.
    train_cpu_time = time.process_time() - train_cpu_start
    total_tokens = float(engine.all_reduce(torch.tensor(objective.num_tokens, dtype=torch.float64)))
    run_logger.close()
    return {"train_time": train_time, "train_cpu_time": train_cpu_time, "total_tokens": total_tokens,
            "start_step": start_step, "final": results["final"]}


def _summary(config: PretrainConfig, stage: _Stage, *, trained: dict, initial: dict, floor, decoding,
             world_size: int, num_params: int, num_trainable: int) -> dict:
    """``pretrain_summary.json`` (without the wall time, which ends with the checkpoint's writing)."""
    summary: dict = {
        "finished": True,
        "config": config.to_dict(),
        "num_parameters": num_params,
        "num_trained_parameters": num_trainable,
        # where the weights came from (None: the tiny model from scratch) and the data they were fit to
        "source": stage.source,
        "data_fingerprint": data_fingerprint(stage.train_examples, stage.val_examples),
        "num_steps": config.max_steps,
        "resumed_from_step": trained["start_step"] or None,
        "world_size": world_size,
        "engine": config.engine,
        "num_train_examples": len(stage.train),
        "num_val_examples": len(stage.val),
        "train_time_s": trained["train_time"],
        "train_cpu_time_s": trained["train_cpu_time"],
        "num_threads": torch.get_num_threads(),
        "train_tokens_per_s": trained["total_tokens"] / max(trained["train_time"], 1e-9),
        "val_initial": initial,
        "val": trained["final"],
        # With equiprobable strategies and each y deterministic given (x, strategy), the best possible
        # y-sequence NLL is the validation mean of H(y | x): log S where the S strategies give S
        # different ys, all of it on the decision token.
        "floor_nll_per_example": floor,
    }
    if decoding is not None:
        summary["decoding"] = decoding
    return summary


def _save(stage: _Stage, trained_state: dict, summary: dict, output_dir: str) -> None:
    """Load the trained weights into a fresh copy of the seeded start (the frozen weights are the start's),
    merge LoRA, and write the checkpoint."""
    fresh = stage.rebuild()
    params = dict(fresh.named_parameters())
    missing = sorted(set(trained_state) - set(params))
    if missing:
        raise RuntimeError(f"trained parameters {missing[:3]} are not in a fresh copy of the model")
    with torch.no_grad():
        for name, tensor in trained_state.items():
            params[name].copy_(tensor)
    _write_checkpoint(merged_model(fresh), stage.tokenizer, summary, output_dir)


def _report(summary: dict, *, floor, output_dir: str) -> None:
    zf, zn = summary["val"]["zfree"], summary["val"]["znull"]
    logger.info(
                f"done in {summary['wall_time_s']:.1f}s: val y NLL z-free {zf['nll_per_example']:.3f} "
                f"{_decision_note(zf)}, znull {zn['nll_per_example']:.3f} nats/sequence"
                + (f", floor {floor:.3f}" if floor is not None else "")
                + f"; wrote {output_dir}"
    )
    for template, modes in summary.get("decoding", {}).items():
        for mode, d in modes.items():
            freq = ", ".join(f"{s} {f:.2f}" for s, f in d["strategy_freq"].items())
            logger.info(f"decode {template} {mode}: {freq}; parse_ok {d['parse_ok']:.2f} answer acc {d['answer_accuracy']:.2f}")


def _pretrain(config: PretrainConfig, *, signals, follower=None) -> dict:
    from zcvae.distributed import init_distributed

    start_time = time.perf_counter()
    info = init_distributed()
    is_main = info.rank == 0
    run_dir = Path(config.output_dir)
    if config.device != "auto" and _resolve_device(config.device).type != info.device.type:
        # the engines place each rank on its own device (zcvae.distributed), as in `zcvae train`
        logger.info(f"[pretrain] device {config.device!r}: the engine runs this rank on {info.device} "
                    f"(CUDA_VISIBLE_DEVICES= keeps a CUDA machine on the CPU)")
    micro_batch_size = _micro_batch_size(config, info.world_size)
    stage = _build_stage(config)
    # only now, with the config, data and model known good: an earlier stage there is replaced
    _prepare_output_dir(run_dir, resume=config.resume is not None, is_main=is_main)

    num_params = sum(p.numel() for p in stage.model.parameters())
    num_trainable = sum(p.numel() for p in stage.model.parameters() if p.requires_grad)
    logger.info(
                f"backbone: {num_params / 1e6:.2f}M parameters ({num_trainable / 1e6:.3f}M trained), vocab {len(stage.tokenizer)}, "
                f"{len(stage.train)} train / {len(stage.val)} val examples, engine {config.engine}, world {info.world_size}, "
                f"device {info.device}, {torch.get_num_threads()} threads"
    )
    floor, decision_pos = validation_targets(stage.task, stage.tokenizer, stage.val_examples, stage.val)
    engine, groups = _build_engine(config, stage.model)
    # on the engine's device, through its module (a sharded model's forwards are collectives), before a resume loads
    initial = evaluate_nll(engine.module, stage.val, stage.tokens, decision_positions=decision_pos)
    trained = _train(config, stage, engine=engine, groups=groups, micro_batch_size=micro_batch_size,
                     world_size=info.world_size, run_dir=run_dir, is_main=is_main, decision_pos=decision_pos,
                     signals=signals, follower=follower)

    # every rank decodes (a sharded model's forwards are collectives), only rank 0 writes
    decoding = None
    if stage.task is not None and config.num_decode_examples > 0:
        decoding = decoding_report(engine.module, stage.tokenizer, stage.val[: config.num_decode_examples], stage.tokens,
                                   stage.task, max_length=config.max_length, seed=config.seed)
    # the trained weights, whole, on rank 0 (a collective: ZeRO-3 gathers, FSDP2 makes full tensors)
    trained_state = engine.trainable_state_dict()
    if is_main:
        summary = _summary(config, stage, trained=trained, initial=initial, floor=floor, decoding=decoding,
                           world_size=info.world_size, num_params=num_params, num_trainable=num_trainable)
        summary["wall_time_s"] = time.perf_counter() - start_time
        _save(stage, trained_state, summary, config.output_dir)
    engine.barrier()
    if not is_main:
        return json.loads((run_dir / SUMMARY_FILE).read_text())
    _report(summary, floor=floor, output_dir=config.output_dir)
    return summary


def _decision_note(stats: dict) -> str:
    if "decision_token_nll" in stats:
        return f" (decision token {stats['decision_token_nll']:.3f})"
    return f" (first token {stats['first_token_nll']:.3f})"


def _write_checkpoint(model, tokenizer, summary: dict, output_dir: str) -> None:
    """Write the HF checkpoint into ``output_dir`` next to the stage's run state: every file goes to
    ``output_dir/.checkpoint.tmp`` first and is renamed into place, the summary last (``is_pretrained``
    reads it), so a crash at any point leaves nothing ``is_pretrained`` accepts."""
    final = Path(output_dir)
    tmp = final / ".checkpoint.tmp"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    (tmp / SUMMARY_FILE).write_text(json.dumps(summary, indent=2, sort_keys=True) + "\n")
    for path in sorted(tmp.iterdir(), key=lambda p: p.name == SUMMARY_FILE):
        os.replace(path, final / path.name)
    tmp.rmdir()
