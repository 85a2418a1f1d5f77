"""What an entangled stage is asked to do (:class:`PretrainConfig`) and what a finished one leaves behind:
``pretrain_summary.json`` next to a Hugging Face checkpoint (:func:`is_pretrained`, :func:`build_summary`)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from zcvae.strict import StrictDataclass
from zcvae.data.encoding import TemplateLayout

SUMMARY_FILE = "pretrain_summary.json"
# Files a finished checkpoint directory must hold; the summary is written last.
CHECKPOINT_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", SUMMARY_FILE)


@dataclass
class PretrainConfig(StrictDataclass):
    """How to pretrain the backbone. ``from_dict`` rejects unknown keys; fields are checked on creation."""

    task: str | None = None
    """A built-in task (``zcvae.data.TASKS``); DEFAULT_TASK when neither task nor train_data is given."""
    train_data: str | None = None
    """A JSONL file of the user's own examples (``{"id","x","y","strategy"?}``) instead of ``task``."""
    val_data: str | None = None
    """Validation JSONL for ``train_data``; without it the last ``num_val_examples`` lines (at most a
    tenth of the file) are held out."""
    output_dir: str = "runs/backbone"
    """Where the checkpoint goes (replaced if it exists, unless ``resume``), with the stage's run state
    (checkpoints/, metrics.jsonl, tensorboard/)."""
    backbone: str | None = None
    """A pretrained causal LM to fine-tune z-free instead of a tiny model from scratch: a local Hugging
    Face directory or a ``.gguf`` file (converted once into the cache). This is the entangled stage for
    a real LM: its tokenizer gains the template markers and ``<znull>``, whose rows train (peft trainable
    tokens) together with LoRA on every linear layer; LoRA is merged into the weights at the end, so
    the output is a plain HF checkpoint that ``zcvae train --backbone`` reads with the markers already
    known. The tiny-model size fields (hidden_size ... intermediate_size) are ignored."""
    full_finetune: bool = False
    """With ``backbone``: train every weight instead of LoRA + the new rows."""
    lora_r: int = 16
    lora_alpha: float = 32.0
    lora_target_modules: list[str] | None = None
    """With ``backbone`` and LoRA: peft ``target_modules``; None = every linear layer but the head
    (peft's ``all-linear``): the stage must fit p(y | x), not only re-route attention."""
    trust_remote_code: bool = False
    """With ``backbone``: allow a model directory to ship its own code (off unless set explicitly)."""
    max_steps: int = 800
    """Optimizer steps. On the default task the y NLL reaches 0.697 nats/sequence at 800 steps (floor
    log 2 = 0.693) and 0.694 at 1,200; a step costs 0.3 CPU-s on one heavily shared core (76 ms was measured for
    this model size on 2 idle cores in the prototype, i.e. about 1 minute)."""
    batch_size: int = 64
    learning_rate: float | None = None
    """Peak learning rate after warm-up; None = 1.5e-3 for the tiny model, 1e-3 for LoRA on a
    ``backbone``, 5e-5 for ``full_finetune`` (resolved on creation and recorded)."""
    warmup_steps: int = 100
    """Linear warm-up from 0 to ``learning_rate``."""
    weight_decay: float = 0.0
    """AdamW decoupled weight decay; 0 because a 1M model fit in ~1k steps does not overfit 20k examples."""
    min_lr_ratio: float = 0.1
    """Cosine decay ends at ``min_lr_ratio * learning_rate``."""
    grad_clip: float = 1.0
    """Max global gradient norm; 0 disables clipping."""
    num_train_examples: int = 20000
    """Examples generated for a built-in task (ignored with ``train_data``)."""
    num_val_examples: int = 500
    """Validation examples (generated, or held out of ``train_data`` when there is no ``val_data``)."""
    z_template_share: float = 0.5
    """Share of training rows in the z-shaped template with ``<znull>`` in the slot."""
    hidden_size: int = 128
    num_layers: int = 4
    num_heads: int = 4
    intermediate_size: int = 512
    max_length: int = 64
    """Bound on the z-shaped sequence in tokens (the longer template); see ``zcvae.data.encoding``."""
    seed: int = 0
    """Seeds the model initialisation, the data order, the template draw and the generated task data."""
    log_every: int = 100
    """Steps between progress lines."""
    eval_every: int = 0
    """Steps between validation y-NLL lines (z-free template, nats per sequence); 0: only at the end."""
    num_decode_examples: int = 64
    """Validation x decoded (greedy and sampled) after training to count strategies; 0 skips."""
    device: str = "auto"
    """"auto" (cuda when available, else cpu), "cpu", "cuda", "cuda:1", ...; under torchrun each rank
    takes the device the engine gives it (``zcvae.distributed``)."""
    engine: str = "local"
    """``local`` (one process, or DDP under torchrun), ``deepspeed`` (ZeRO stage from ``deepspeed_config``)
    or ``fsdp2``, as in ``zcvae train`` (``zcvae.engines``)."""
    deepspeed_config: str | None = None
    """DeepSpeed only: a JSON file or a built-in name (``zero0`` ... ``zero3_offload``); None = ``zero2``."""
    precision: str = "fp32"
    """``fp32`` or ``bf16`` (see ``zcvae.engines.EngineConfig``); keep CPU/gloo runs in fp32."""
    gradient_checkpointing: bool = False
    """Recompute activations in backward."""
    gradient_accumulation_steps: int = 1
    """Micro-batches per optimizer step on each rank: ``batch_size`` (the examples of one step over all
    ranks) = micro-batch size x ``gradient_accumulation_steps`` x world size, which must divide it."""
    save_every: int = 0
    """Steps between resumable checkpoints in ``output_dir/checkpoints``; 0: only the final one."""
    keep_last_checkpoints: int = 2
    """Checkpoints kept in ``output_dir/checkpoints``."""
    resume: str | None = None
    """``auto``: continue the stage from the newest checkpoint in ``output_dir/checkpoints`` (a fresh
    start when there is none), or a checkpoint directory."""
    progress_bar: bool = True
    """A tqdm bar on rank 0."""

    def __post_init__(self) -> None:
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
        for name in ("max_steps", "batch_size", "num_train_examples", "num_val_examples", "hidden_size",
                     "num_layers", "num_heads", "intermediate_size", "log_every"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        for name in ("warmup_steps", "eval_every", "num_decode_examples", "seed"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an int >= 0, got {value!r}")
        if self.learning_rate is None:
            self.learning_rate = 1.5e-3 if self.backbone is None else 5e-5 if self.full_finetune else 1e-3
        if self.backbone is not None and (not isinstance(self.backbone, str) or not self.backbone.strip()):
            raise ValueError(f"backbone must be a model directory or a .gguf file, got {self.backbone!r}")
        if self.full_finetune and self.backbone is None:
            raise ValueError("full_finetune needs backbone: the tiny model from scratch trains every weight anyway")
        for name in ("full_finetune", "trust_remote_code"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if isinstance(self.lora_r, bool) or not isinstance(self.lora_r, int) or self.lora_r < 1:
            raise ValueError(f"lora_r must be an int >= 1, got {self.lora_r!r}")
        if isinstance(self.lora_alpha, bool) or not isinstance(self.lora_alpha, (int, float)) or not self.lora_alpha > 0:
            raise ValueError(f"lora_alpha must be > 0, got {self.lora_alpha!r}")
        if self.lora_target_modules is not None and (
            not isinstance(self.lora_target_modules, (list, tuple)) or not self.lora_target_modules
            or not all(isinstance(t, str) and t for t in self.lora_target_modules)
        ):
            raise ValueError(f"lora_target_modules must be None or a non-empty list of names, got {self.lora_target_modules!r}")
        if isinstance(self.learning_rate, bool) or not isinstance(self.learning_rate, (int, float)) or not self.learning_rate > 0:
            raise ValueError(f"learning_rate must be > 0, got {self.learning_rate!r}")
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
        if isinstance(self.max_length, bool) or not isinstance(self.max_length, int) or self.max_length < shortest:
            raise ValueError(f"max_length must be an int >= {shortest}, got {self.max_length!r}")
        if not isinstance(self.output_dir, str) or not self.output_dir.strip("/ "):
            raise ValueError(f"output_dir must be a non-empty path, got {self.output_dir!r}")
        if not isinstance(self.device, str) or not (self.device in ("auto", "cpu") or self.device.startswith("cuda")):
            raise ValueError(f"device must be 'auto', 'cpu' or 'cuda[:N]', got {self.device!r}")
        self.engine_config()  # engine, deepspeed_config, precision, gradient_checkpointing (ValueError naming the field)
        for name in ("gradient_accumulation_steps", "keep_last_checkpoints"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if isinstance(self.save_every, bool) or not isinstance(self.save_every, int) or self.save_every < 0:
            raise ValueError(f"save_every must be an int >= 0, got {self.save_every!r}")
        if self.batch_size % self.gradient_accumulation_steps:
            raise ValueError(f"batch_size {self.batch_size} must be divisible by gradient_accumulation_steps {self.gradient_accumulation_steps}")
        if self.resume is not None and (not isinstance(self.resume, str) or not self.resume):
            raise ValueError(f"resume must be 'auto' or a checkpoint directory, got {self.resume!r}")
        if not isinstance(self.progress_bar, bool):
            raise ValueError(f"progress_bar must be a bool, got {self.progress_bar!r}")

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
