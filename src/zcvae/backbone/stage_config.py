"""What an entangled stage is asked to do (:class:`PretrainConfig`) and what a finished one leaves behind:
``pretrain_summary.json`` next to a Hugging Face checkpoint (:func:`is_pretrained`, :func:`build_summary`)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, fields
from pathlib import Path

from zcvae.config import (DataSection, EngineSection, EvaluationSection, ModelSection, OptimizationSection, RunSection,
                          check_field_values, check_types, option, shared_option)
from zcvae.data.encoding import TemplateLayout
from zcvae.strict import StrictDataclass

SUMMARY_FILE = "pretrain_summary.json"
# Files a finished checkpoint directory must hold; the summary is written last.
CHECKPOINT_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", SUMMARY_FILE)


@dataclass
class PretrainConfig(StrictDataclass):
    """How to pretrain the backbone: one flat field per ``zcvae pretrain`` flag and ``--config`` key.

    A field that ``zcvae train`` has too (same name) is that section field (:func:`zcvae.config.shared_option`):
    its choices and help come from there (the annotation, written again here, is kept equal by a test), with the
    stage's own default and, where the stage reads it otherwise, its own help. ``from_dict`` rejects unknown keys;
    values are checked on creation, types by the same ``check_types`` as ``zcvae train``'s."""

    task: str | None = shared_option(DataSection, "task")
    train_data: str | None = shared_option(DataSection, "train_data")
    val_data: str | None = shared_option(DataSection, "val_data", help=(
        "Validation JSONL for train_data; without it the last num_val_examples lines (at most a tenth of the file) are held out."))
    output_dir: str = shared_option(RunSection, "output_dir", default="runs/backbone", help=(
        "Where the checkpoint goes (replaced if it exists, unless resume), with the stage's run state (checkpoints/, "
        "metrics.jsonl, tensorboard/)."))
    backbone: str | None = shared_option(ModelSection, "backbone", help=(
        "A pretrained causal LM to fine-tune z-free instead of a tiny model from scratch: a local Hugging Face directory or "
        "a .gguf file (converted once into the cache). This is the entangled stage for a real LM: its tokenizer gains the "
        "template markers and <znull>, whose rows train (peft trainable tokens) together with LoRA on every linear layer; "
        "LoRA is merged into the weights at the end, so the output is a plain HF checkpoint that `zcvae train --backbone` "
        "reads with the markers already known. The tiny-model size fields (hidden_size ... intermediate_size) are ignored."))
    full_finetune: bool = option(False, "With backbone: train every weight instead of LoRA + the new rows.")
    lora_r: int = shared_option(ModelSection, "lora_r", default=16)
    # a float, as peft takes it (the stage's summaries record 32.0); `zcvae train`'s is an int
    lora_alpha: float = option(32.0, "LoRA alpha (with backbone).")
    lora_target_modules: list[str] | None = shared_option(ModelSection, "lora_target_modules", help=(
        "With backbone and LoRA: peft target_modules; omitted = every linear layer but the head (peft's all-linear): "
        "the stage must fit p(y | x), not only re-route attention."))
    trust_remote_code: bool = shared_option(ModelSection, "trust_remote_code")
    max_steps: int = shared_option(OptimizationSection, "max_steps", default=800, help=(
        "Optimizer steps. On the default task the y NLL reaches 0.697 nats/sequence at 800 steps (floor log 2 = 0.693) "
        "and 0.694 at 1,200; a step costs 0.3 CPU-s on one heavily shared core (76 ms was measured for this model size on "
        "2 idle cores in the prototype, i.e. about 1 minute)."))
    batch_size: int = option(64, "Examples per optimizer step over all ranks (micro-batch x gradient_accumulation_steps x world size).")
    learning_rate: float | None = option(None, (
        "Peak learning rate after warm-up; omitted = 1.5e-3 for the tiny model, 1e-3 for LoRA on a backbone, 5e-5 for "
        "full_finetune (resolved on creation and recorded)."))
    warmup_steps: int = shared_option(OptimizationSection, "warmup_steps", default=100)
    weight_decay: float = shared_option(OptimizationSection, "weight_decay", help=(
        "AdamW decoupled weight decay; 0 because a 1M model fit in ~1k steps does not overfit 20k examples."))
    min_lr_ratio: float = shared_option(OptimizationSection, "min_lr_ratio")
    grad_clip: float = option(1.0, "Max global gradient norm; 0 disables clipping.")
    num_train_examples: int = shared_option(DataSection, "num_train_examples", default=20000, help=(
        "Examples generated for a built-in task (ignored with train_data)."))
    num_val_examples: int = shared_option(DataSection, "num_val_examples", default=500, help=(
        "Validation examples (generated, or held out of train_data when there is no val_data)."))
    z_template_share: float = option(0.5, "Share of training rows in the z-shaped template with <znull> in the slot.")
    hidden_size: int = option(128, "Tiny model: hidden size.")
    num_layers: int = option(4, "Tiny model: decoder layers.")
    num_heads: int = option(4, "Tiny model: attention heads.")
    intermediate_size: int = option(512, "Tiny model: MLP width.")
    max_length: int = shared_option(DataSection, "max_length", help=(
        "Bound on the z-shaped sequence in tokens (the longer template); see zcvae.data.encoding."))
    seed: int = shared_option(OptimizationSection, "seed", help=(
        "Seeds the model initialisation, the data order, the template draw and the generated task data."))
    log_every: int = shared_option(RunSection, "log_every", default=100, help="Steps between progress lines.")
    eval_every: int = shared_option(EvaluationSection, "eval_every", help=(
        "Steps between validation y-NLL lines (z-free template, nats per sequence); 0: only at the end."))
    num_decode_examples: int = option(64, "Validation x decoded (greedy and sampled) after training to count strategies; 0 skips.")
    device: str = option("auto", (
        "auto (cuda when available, else cpu), cpu, cuda, cuda:1, ...; under torchrun each rank takes the device the "
        "engine gives it (zcvae.distributed)."))
    engine: str = shared_option(EngineSection, "engine")
    deepspeed_config: str | None = shared_option(EngineSection, "deepspeed_config", help=(
        "DeepSpeed only: a JSON file or a built-in name (zero0 ... zero3_offload); omitted = zero2."))
    precision: str = shared_option(EngineSection, "precision", help="fp32 or bf16 (see zcvae.engines.EngineConfig); keep CPU/gloo runs in fp32.")
    gradient_checkpointing: bool = shared_option(ModelSection, "gradient_checkpointing")
    gradient_accumulation_steps: int = shared_option(OptimizationSection, "gradient_accumulation_steps", help=(
        "Micro-batches per optimizer step on each rank: batch_size (the examples of one step over all ranks) = "
        "micro-batch size x gradient_accumulation_steps x world size, which must divide it."))
    save_every: int = shared_option(RunSection, "save_every", help="Steps between resumable checkpoints in output_dir/checkpoints; 0: only the final one.")
    keep_last_checkpoints: int = shared_option(RunSection, "keep_last_checkpoints")
    resume: str | None = shared_option(RunSection, "resume", help=(
        "auto: continue the stage from the newest checkpoint in output_dir/checkpoints (a fresh start when there is none), "
        "or a checkpoint directory."))
    progress_bar: bool = shared_option(RunSection, "progress_bar")

    def __post_init__(self) -> None:
        # types as `zcvae train` judges them (a bool is not an int, "3" not a number), then the choices a field carries
        check_types(PretrainConfig, self.to_dict(), source="PretrainConfig")
        check_field_values(fields(self), self.to_dict())
        if self.task is not None and self.train_data is not None:
            raise ValueError("task and train_data are exclusive: give a built-in task or a JSONL path, not both")
        if self.val_data is not None and self.train_data is None:
            raise ValueError("val_data needs train_data (a built-in task generates its own validation split)")
        if self.task is None and self.train_data is None:
            from zcvae.data import DEFAULT_TASK

            self.task = DEFAULT_TASK
        if self.task is not None:
            from zcvae.data import get_task

            try:
                get_task(self.task)
            except ValueError as error:
                raise ValueError(f"task: {error}") from None
        for name in ("max_steps", "batch_size", "num_train_examples", "num_val_examples", "hidden_size", "num_layers",
                     "num_heads", "intermediate_size", "log_every", "lora_r", "gradient_accumulation_steps", "keep_last_checkpoints"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be an int >= 1, got {getattr(self, name)!r}")
        for name in ("warmup_steps", "eval_every", "num_decode_examples", "seed", "save_every"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be an int >= 0, got {getattr(self, name)!r}")
        if self.learning_rate is None:
            self.learning_rate = 1.5e-3 if self.backbone is None else 5e-5 if self.full_finetune else 1e-3
        if self.backbone is not None and not self.backbone.strip():
            raise ValueError(f"backbone must be a model directory or a .gguf file, got {self.backbone!r}")
        if self.full_finetune and self.backbone is None:
            raise ValueError("full_finetune needs backbone: the tiny model from scratch trains every weight anyway")
        if self.lora_target_modules is not None and (not self.lora_target_modules or not all(self.lora_target_modules)):
            raise ValueError(f"lora_target_modules must be None or a non-empty list of names, got {self.lora_target_modules!r}")
        for name in ("lora_alpha", "learning_rate"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
        if not self.weight_decay >= 0:
            raise ValueError(f"weight_decay must be >= 0, got {self.weight_decay!r}")
        if not self.grad_clip >= 0:
            raise ValueError(f"grad_clip must be >= 0 (0 disables), got {self.grad_clip!r}")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio!r}")
        if not 0.0 <= self.z_template_share <= 1.0:
            raise ValueError(f"z_template_share must be in [0, 1], got {self.z_template_share!r}")
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size={self.hidden_size} must be divisible by num_heads={self.num_heads}")
        if (self.hidden_size // self.num_heads) % 2:
            raise ValueError(f"head dim hidden_size/num_heads={self.hidden_size // self.num_heads} must be even (RoPE)")
        # One z slot; at least one x and one y token.
        shortest = TemplateLayout(num_z_slots=1).zcond_length(1, 1)
        if self.max_length < shortest:
            raise ValueError(f"max_length must be an int >= {shortest}, got {self.max_length!r}")
        if not self.output_dir.strip("/ "):
            raise ValueError(f"output_dir must be a non-empty path, got {self.output_dir!r}")
        if not (self.device in ("auto", "cpu") or self.device.startswith("cuda")):
            raise ValueError(f"device must be 'auto', 'cpu' or 'cuda[:N]', got {self.device!r}")
        self.engine_config()  # deepspeed_config against the engine (ValueError naming the field)
        if self.batch_size % self.gradient_accumulation_steps:
            raise ValueError(f"batch_size {self.batch_size} must be divisible by gradient_accumulation_steps {self.gradient_accumulation_steps}")
        if self.resume is not None and not self.resume:
            raise ValueError(f"resume must be 'auto' or a checkpoint directory, got {self.resume!r}")

    def engine_config(self):
        from zcvae.engines import EngineConfig

        return EngineConfig(engine=self.engine, deepspeed_config=self.deepspeed_config, precision=self.precision,
                            gradient_checkpointing=self.gradient_checkpointing)


def is_pretrained(output_dir: str | os.PathLike) -> bool:
    """Whether ``output_dir`` holds a finished backbone checkpoint (all files, readable summary)."""
    path = Path(output_dir)
    if not path.is_dir() or not all((path / name).is_file() for name in CHECKPOINT_FILES):
        return False
    try:
        summary = json.loads((path / SUMMARY_FILE).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(summary, dict) and summary.get("finished") is True


def stage_steps(output_dir: str | os.PathLike) -> int | None:
    """The optimizer steps of the finished stage in ``output_dir`` (its summary's ``max_steps``), or None when
    ``output_dir`` holds no finished stage (a raw LM, a GGUF file)."""
    if not is_pretrained(output_dir):
        return None
    steps = json.loads((Path(output_dir) / SUMMARY_FILE).read_text()).get("config", {}).get("max_steps")
    return steps if isinstance(steps, int) else None
