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

    python -m zcvae.backbone.pretraining output_dir=runs/backbone    # or: zcvae pretrain --output-dir runs/backbone
    torchrun --nproc_per_node 2 -m zcvae pretrain --backbone DIR --engine deepspeed --deepspeed-config zero3 ...

Shape legend: B batch, T sequence length, V vocabulary; decoding: R rows, L prompt + generated tokens.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

from zcvae.core.losses import token_nll
from zcvae.core.schedule import lr_multiplier
from zcvae.distributed import flush_denormals, free_cpu_cores
from zcvae.runs.rundir import builtin_backbone_dir
from zcvae.model.decoding import greedy_decode
from zcvae.templates import (
    IGNORE_INDEX,
    Batch,
    EncodedExample,
    TemplateLayout,
    TemplateTokens,
    collate,
    encode_examples,
    prepare_tokenizer,
)
from zcvae.strict import StrictDataclass

SUMMARY_FILE = "pretrain_summary.json"
# Files a finished checkpoint directory must hold; the summary is written last.
CHECKPOINT_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", SUMMARY_FILE)
TEMPLATES = ("zfree", "znull")


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
    """Bound on the z-shaped sequence in tokens (the longer template); see ``zcvae.templates``."""
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


def tiny_llama_config(
    vocab_size: int,
    *,
    hidden_size: int = 128,
    num_layers: int = 4,
    num_heads: int = 4,
    intermediate_size: int = 512,
    max_position_embeddings: int = 128,
    bos_token_id: int | None = None,
    eos_token_id: int | None = None,
    pad_token_id: int | None = None,
) -> LlamaConfig:
    """A Llama config for a ~1M-parameter model (the defaults) with full multi-head attention."""
    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads,
        intermediate_size=intermediate_size,
        max_position_embeddings=max_position_embeddings,
        bos_token_id=bos_token_id,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        tie_word_embeddings=False,
        use_cache=True,
    )


def builtin_backbone(task: str | None, *, log=print) -> Path:
    """The built-in tiny backbone pretrained on ``task`` (seed 0), built once into the cache
    (``rundir.builtin_backbone_dir``) and reused."""
    pcfg = PretrainConfig(task=task, seed=0)
    cache = builtin_backbone_dir(pcfg.task)
    pcfg.output_dir = str(cache)
    if not is_pretrained(cache):
        log(f"[backbone] pretraining the built-in backbone into {cache}")
        pretrain(pcfg, log=log)
    return cache


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


# ---- pure pieces ---------------------------------------------------------------------------------


def span_nll(logits_BTV: torch.Tensor, labels_BT: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token NLL (nats) of the supervised labels; logits at t predict labels at t + 1.

    Returns ``nll_BT`` (0 where unsupervised; position t scores the label at t + 1) and ``mask_BT``.
    The NLL is ``core.losses.token_nll``, the one the CVAE uses (bit-identical to the cross-entropy
    this function computed itself before, checked on CPU for float32 and bfloat16 logits).
    """
    mask_BT = labels_BT[:, 1:] != IGNORE_INDEX
    return token_nll(logits_BTV, labels_BT) * mask_BT, mask_BT


def mix_templates(
    batch: Batch, use_z_B: torch.Tensor, *, pad_id: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask, labels), each (B, T): row i in the z-shaped template where use_z_B[i].

    Both templates are right-padded, so the z-free rows are padded out to the z-shaped width and the
    result is trimmed to the longest row kept.
    """
    width = batch.z_input_ids.shape[1]
    grow = width - batch.input_ids.shape[1]
    pick = use_z_B[:, None]
    ids = torch.where(pick, batch.z_input_ids, F.pad(batch.input_ids, (0, grow), value=pad_id))
    mask = torch.where(pick, batch.z_attention_mask, F.pad(batch.attention_mask, (0, grow), value=0))
    labels = torch.where(pick, batch.z_labels, F.pad(batch.labels, (0, grow), value=IGNORE_INDEX))
    keep = int(mask.sum(1).max())
    return ids[:, :keep], mask[:, :keep], labels[:, :keep]


# ---- data ----------------------------------------------------------------------------------------


def _load_data(config: PretrainConfig, tokenizer=None):
    """(tokenizer, tokens, train examples, val examples, task family or None).

    ``tokenizer``: a pretrained backbone's own (it gains the markers here); None builds the tiny
    model's word-level tokenizer over the data's words."""
    from zcvae.data import build_tokenizer, get_task, make_examples, read_jsonl

    if config.task is not None:
        task = get_task(config.task)
        train = make_examples(task, seed=config.seed, split="train", num_examples=config.num_train_examples)
        val = make_examples(task, seed=config.seed, split="val", num_examples=config.num_val_examples)
        if tokenizer is None:
            tokenizer = build_tokenizer()
    else:
        task = None
        train = read_jsonl(config.train_data)
        if config.val_data is not None:
            val = read_jsonl(config.val_data)
        else:
            num_val = min(config.num_val_examples, len(train) // 10)
            if num_val < 1:
                raise ValueError(
                    f"train_data {config.train_data!r} has {len(train)} examples: too few to hold out "
                    "validation examples; give val_data"
                )
            train, val = train[:-num_val], train[-num_val:]
        if tokenizer is None:
            words = sorted({w for ex in [*train, *val] for w in (*ex.x.split(), *ex.y.split())})
            tokenizer = build_tokenizer(extra_words=words)
    tokens = prepare_tokenizer(tokenizer, num_latents=0)
    return tokenizer, tokens, train, val, task


def _encode(examples, tokenizer, tokens, *, max_length: int, what: str, log) -> list[EncodedExample]:
    encoded, report = encode_examples(examples, tokenizer, tokens, max_length=max_length, num_z_slots=1)
    if report.num_skipped or report.num_x_truncated or report.num_unknown_tokens:
        log(
            f"{what}: kept {report.num_kept}/{report.num_examples}, skipped {report.num_skipped}, "
            f"x truncated {report.num_x_truncated}, unknown tokens {report.num_unknown_tokens}"
            + (f"; first skip: {report.skipped[0]}" if report.skipped else "")
        )
    if not encoded:
        raise ValueError(f"{what}: no example fits max_length={max_length}")
    return encoded


def data_fingerprint(train, val) -> str:
    """sha256 of the examples a backbone was fit to (id, x, y, strategy; train then val, in order):
    ``zcvae train`` can tell whether its data is the data of the entangled stage."""
    h = hashlib.sha256()
    for split, examples in (("train", train), ("val", val)):
        for ex in examples:
            h.update(json.dumps([split, ex.id, ex.x, ex.y, ex.strategy], ensure_ascii=True).encode() + b"\n")
    return h.hexdigest()


def word_token_position(tokenizer, text: str, word_index: int) -> int:
    """Index of the token that holds whitespace word ``word_index`` of ``text``, tokenized as
    ``encode_examples`` tokenizes y. The families give decision positions in words; the word-level
    tokenizer has one token a word, a BPE tokenizer (a real LM's) splits digits and spaces, so the
    decision word of ``2 2 0 8 count ...`` is token 7 or 8, not 4. Past the last word: its token count."""
    starts = [m.start() for m in re.finditer(r"\S+", text)]
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    if word_index >= len(starts):
        return len(encoded["input_ids"])
    for i, (_, end) in enumerate(encoded["offset_mapping"]):
        if end > starts[word_index]:
            return i
    return len(encoded["input_ids"])


# ---- a pretrained backbone -----------------------------------------------------------------------


def load_backbone_for_finetune(config: PretrainConfig, *, log: Callable[[str], None]):
    """(model, tokenizer, source record, added token ids) for the entangled stage on ``config.backbone``.

    Mirrors ``ZCVAE.from_pretrained`` up to the adapters: the markers and ``<znull>`` are added to the
    backbone's tokenizer, the embeddings resized and the new rows set to the mean row (input and an
    untied head alike), dropout off. With LoRA the new rows train as peft trainable tokens, so every
    other row stays bitwise frozen; with ``full_finetune`` everything trains.
    """
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from zcvae.backbone.convert import conversion_record, file_sha256, is_gguf_path, resolve_backbone_path
    from zcvae.model.build import check_backbone_files as _check_backbone_files, disable_dropout as _disable_dropout
    from zcvae.model.cvae import ZCVAE
    from zcvae.reference.store import fingerprint_backbone

    source = config.backbone
    directory = resolve_backbone_path(source, log=log)
    if not os.path.isdir(directory) or not os.path.isfile(os.path.join(directory, "config.json")):
        raise ValueError(f"backbone {source!r} is neither a Hugging Face model directory (with config.json) nor a .gguf file")
    _check_backbone_files(directory)
    try:
        tokenizer = AutoTokenizer.from_pretrained(directory, local_files_only=True, trust_remote_code=config.trust_remote_code)
    except (OSError, ValueError) as err:
        raise ValueError(f"backbone {source!r}: its tokenizer files could not be read: {err}") from None
    vocab_before = tokenizer.get_vocab()
    tokens = prepare_tokenizer(tokenizer, num_latents=0)
    added = sorted(i for t, i in tokenizer.get_vocab().items() if t not in vocab_before)
    try:
        model = AutoModelForCausalLM.from_pretrained(
            directory, local_files_only=True, use_safetensors=True, trust_remote_code=config.trust_remote_code, dtype=torch.float32
        )
    except Exception as err:  # noqa: BLE001 - safetensors/transformers raise several types for a bad file
        raise ValueError(f"backbone {source!r}: its weights could not be loaded: {type(err).__name__}: {err}") from None
    positions = getattr(model.config, "max_position_embeddings", None) or getattr(model.config, "n_positions", None)
    if positions is not None and config.max_length > positions:
        raise ValueError(f"max_length {config.max_length} exceeds the backbone's {positions} positions ({source!r})")
    _disable_dropout(model)
    model.config.use_cache = False
    old_rows = model.get_input_embeddings().weight.shape[0]
    if len(tokenizer) > old_rows:
        model.resize_token_embeddings(len(tokenizer), mean_resizing=False)
    ZCVAE._init_new_rows(model, tokens=tokens, added=added, old_rows=old_rows, had_znull=False, noise=0.0,
                         generator=torch.Generator().manual_seed(config.seed))
    record = {
        "backbone": source,
        "directory": str(Path(directory).resolve()),
        # the bytes the weights came from: the GGUF file, or the directory's safetensors + config.json
        "sha256": file_sha256(source) if is_gguf_path(source) and Path(source).is_file() else fingerprint_backbone(directory),
        "sha256_of": "gguf file" if is_gguf_path(source) and Path(source).is_file() else "safetensors + config.json",
        "conversion": conversion_record(directory),
        "model_type": getattr(model.config, "model_type", None),
        "added_tokens": [tokenizer.convert_ids_to_tokens(i) for i in added],
        "method": "full" if config.full_finetune else "lora",
    }
    if config.full_finetune:
        return model, tokenizer, tokens, record
    model_type = getattr(model.config, "model_type", "")
    tied = model.get_output_embeddings() is not None and (
        model.get_output_embeddings().weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()
    )
    # Untied heads need the new rows trained on both sides, else </y> keeps the mean logit and greedy
    # decoding never closes y; tied heads share the row (peft ties the two adapters).
    names = {id(m): n.rsplit(".", 1)[-1] for n, m in model.named_modules()}
    trainable = list(added) if tied else {
        names[id(model.get_input_embeddings())]: list(added), names[id(model.get_output_embeddings())]: list(added)
    }
    lora = LoraConfig(
        task_type="CAUSAL_LM",
        r=config.lora_r,
        lora_alpha=config.lora_alpha,
        lora_dropout=0.0,
        target_modules=config.lora_target_modules or "all-linear",
        fan_in_fan_out=model_type == "gpt2",  # GPT-2 uses Conv1D (transposed weights)
        trainable_token_indices=trainable if added else None,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(config.seed)  # LoRA A matrices are drawn from the global RNG inside peft
        model = get_peft_model(model, lora)
    record["lora"] = {"r": config.lora_r, "alpha": config.lora_alpha, "target_modules": config.lora_target_modules or "all-linear"}
    return model, tokenizer, tokens, record


def merged_model(model):
    """The plain HF model to save: LoRA and the trainable-token deltas merged into the weights (a peft
    model), or ``model`` itself (the tiny model, a full fine-tune)."""
    from peft import PeftModel

    return model.merge_and_unload() if isinstance(model, PeftModel) else model


# ---- evaluation ----------------------------------------------------------------------------------


@torch.no_grad()
def evaluate_nll(
    model,
    examples: Sequence[EncodedExample],
    tokens: TemplateTokens,
    *,
    batch_size: int = 256,
    decision_positions: Sequence[int] | None = None,
) -> dict:
    """Validation y-sequence NLL under both templates (``<znull>`` in the z slot for "znull").

    Per template: ``nll_per_example`` (nats per sequence: the sum over y and ``</y>``, averaged over
    examples), ``nll_per_token`` (total nats / total tokens), ``first_token_nll`` (nats on the first y
    token, where the marker-first families choose the strategy) and the same per gold strategy when
    examples carry one. With ``decision_positions`` (one y token index per example: where its
    strategies first part), also ``decision_token_nll``, the nats on that token.
    """
    if decision_positions is not None and len(decision_positions) != len(examples):
        raise ValueError(f"decision_positions has {len(decision_positions)} entries for {len(examples)} examples")
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    seq: dict[str, list[torch.Tensor]] = {t: [] for t in TEMPLATES}
    first: dict[str, list[torch.Tensor]] = {t: [] for t in TEMPLATES}
    decision: dict[str, list[torch.Tensor]] = {t: [] for t in TEMPLATES}
    count: list[torch.Tensor] = []
    for start in range(0, len(examples), batch_size):
        batch = collate(list(examples[start : start + batch_size]), tokens).to(device)
        count.append(batch.num_supervised.cpu())
        for template in TEMPLATES:
            if template == "zfree":
                ids, mask, labels = batch.input_ids, batch.attention_mask, batch.labels
            else:
                ids, mask, labels = batch.z_input_ids, batch.z_attention_mask, batch.z_labels
            nll_BT, mask_BT = span_nll(model(input_ids=ids, attention_mask=mask).logits, labels)
            seq[template].append(nll_BT.sum(1).cpu())
            first_pos_B = mask_BT.int().argmax(1)
            first[template].append(nll_BT.gather(1, first_pos_B[:, None])[:, 0].cpu())
            if decision_positions is not None:
                offset_B = torch.as_tensor(decision_positions[start : start + batch_size], device=first_pos_B.device)
                # A position past y (never for the built-in families) scores </y>, the last supervised token.
                last_B = first_pos_B + mask_BT.sum(1) - 1
                pos_B = torch.minimum(first_pos_B + offset_B, last_B)
                decision[template].append(nll_BT.gather(1, pos_B[:, None])[:, 0].cpu())
    model.train(was_training)

    n_B = torch.cat(count).double()
    strategies = [ex.strategy for ex in examples]
    groups: dict[str, list[int]] = defaultdict(list)
    for i, s in enumerate(strategies):
        if s is not None:
            groups[s].append(i)

    def stats(seq_B: torch.Tensor, first_B: torch.Tensor, decision_B: torch.Tensor | None, idx: list[int] | None) -> dict:
        m_B = n_B
        if idx is not None:
            sel = torch.as_tensor(idx)
            seq_B, first_B, m_B = seq_B[sel], first_B[sel], n_B[sel]
            decision_B = None if decision_B is None else decision_B[sel]
        entry = {
            "num_examples": int(seq_B.numel()),
            "nll_per_example": float(seq_B.mean()),
            "nll_per_token": float(seq_B.sum() / m_B.sum()),
            "first_token_nll": float(first_B.mean()),
            "mean_num_tokens": float(m_B.mean()),
        }
        if decision_B is not None:
            entry["decision_token_nll"] = float(decision_B.mean())
        return entry

    out = {}
    for template in TEMPLATES:
        seq_B, first_B = torch.cat(seq[template]).double(), torch.cat(first[template]).double()
        decision_B = torch.cat(decision[template]).double() if decision_positions is not None else None
        entry = stats(seq_B, first_B, decision_B, None)
        if groups:
            entry["per_strategy"] = {s: stats(seq_B, first_B, decision_B, idx) for s, idx in sorted(groups.items())}
        out[template] = entry
    return out


@torch.no_grad()
def generate_y(
    model,
    examples: Sequence[EncodedExample],
    tokens: TemplateTokens,
    *,
    template: str,
    max_length: int,
    max_new_tokens: int | None = None,
    generator: torch.Generator | None = None,
) -> list[list[int]]:
    """y token ids (without ``</y>``) decoded after each example's prompt by the one decoder
    (``model.decoding.greedy_decode``); greedy unless ``generator``, which draws each token from the
    softmax.

    Prompts end with ``<y>``; decoding stops at ``</y>``, after ``max_new_tokens`` or where the sequence
    would pass ``max_length`` (the length policy of training). Prompts are decoded in groups of one
    length: the step bound depends on it, and the draws of a sampled decode on the grouping.
    """
    if template not in TEMPLATES:
        raise ValueError(f"template must be one of {TEMPLATES}, got {template!r}")
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    layout = TemplateLayout(num_z_slots=1)
    prompts = [layout.zcond_prompt(ex.x_ids, tokens) if template == "znull" else layout.zfree_prompt(ex.x_ids, tokens)
               for ex in examples]
    by_length: dict[int, list[int]] = defaultdict(list)
    for i, p in enumerate(prompts):
        by_length[len(p)].append(i)
    if max_new_tokens is None:
        max_new_tokens = max_length

    def next_logits(ids_RL: torch.Tensor, mask_RL: torch.Tensor) -> torch.Tensor:
        logits_RLV = model(input_ids=ids_RL, attention_mask=mask_RL, use_cache=False).logits
        last_R = mask_RL.sum(1) - 1  # right padding: each row's last real token
        return logits_RLV[torch.arange(ids_RL.shape[0], device=ids_RL.device), last_R]

    def draw(logits_RV: torch.Tensor) -> torch.Tensor:
        return torch.multinomial(logits_RV.float().softmax(-1).cpu(), 1, generator=generator)[:, 0]

    result: list[list[int]] = [[] for _ in prompts]
    for length, rows in sorted(by_length.items()):
        # room left for y, </y> and <eos> within max_length
        num_steps = max(1, min(max_new_tokens, max_length - length - 1))
        generated, _, _ = greedy_decode(
            next_logits, [prompts[i] for i in rows], num_steps=num_steps, stop_id=tokens.y_close, pad_id=tokens.pad,
            device=device, lock_step=False, choose_next=None if generator is None else draw,
        )
        for i, y_ids in zip(rows, generated):
            result[i] = y_ids
    model.train(was_training)
    return result


def decoding_report(
    model, tokenizer, examples: Sequence[EncodedExample], tokens: TemplateTokens, task, *, max_length: int, seed: int
) -> dict:
    """Strategy frequencies, parse rate and answer accuracy of greedy and sampled decoding, per template."""
    x_text = [tokenizer.decode(list(ex.x_ids)) for ex in examples]
    report: dict = {}
    for template in TEMPLATES:
        for mode in ("greedy", "sampled"):
            generator = torch.Generator().manual_seed(seed) if mode == "sampled" else None
            ys = generate_y(model, examples, tokens, template=template, max_length=max_length, generator=generator)
            counts: Counter = Counter()
            num_parse_ok = num_correct = 0
            for x, y_ids in zip(x_text, ys):
                parsed = task.parse(tokenizer.decode(y_ids))
                counts[parsed.strategy if parsed.strategy is not None else "unparsed"] += 1
                num_parse_ok += parsed.parse_ok
                num_correct += parsed.parse_ok and parsed.answer == task.answer(x)
            n = max(1, len(examples))
            report.setdefault(template, {})[mode] = {
                "strategy_freq": {s: counts[s] / n for s in sorted(counts)},
                "parse_ok": num_parse_ok / n,
                "answer_accuracy": num_correct / n,
            }
    return report


# ---- training ------------------------------------------------------------------------------------


def _resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def pretrain(config: PretrainConfig, *, log: Callable[[str], None] = print) -> dict:
    """Train the backbone, write the checkpoint to ``config.output_dir`` and return the summary.

    The steps run on the training loop of ``zcvae train`` (``zcvae.train.loop``) and its engines, so the
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

    flush_denormals(log=log)
    previous_threads = torch.get_num_threads()
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(free_cpu_cores())
    try:
        # as in `zcvae train`: the stop handlers first, then rank 0 holds the directory's lock
        with StopSignals() as signals:
            lock = RunLock(Path(config.output_dir)) if dist_info().rank == 0 else None
            if lock is not None:
                lock.acquire()
            try:
                return _pretrain(config, log=log, signals=signals)
            finally:
                if lock is not None:
                    lock.release()
    finally:
        torch.set_num_threads(previous_threads)


# What a stage's output directory may hold besides the checkpoint files: its run state and the lock.
_RUN_STATE = ("checkpoints", "metrics.jsonl", "tensorboard")


def _prepare_output_dir(run_dir: Path, *, resume: bool, is_main: bool, log) -> None:
    """Make ``run_dir`` ready for the stage. The summary goes first, so ``is_pretrained`` is False from
    here until the new checkpoint is complete. Without ``resume`` an earlier stage there (finished or
    not) is replaced, as before; a directory that holds no stage is refused, not deleted."""
    from zcvae.distributed import barrier
    from zcvae.runs.lock import LOCK_FILE

    if run_dir.exists() and not run_dir.is_dir():
        raise ValueError(f"output_dir {str(run_dir)!r} is an existing file; choose a directory")
    entries = sorted(p.name for p in run_dir.iterdir() if p.name != LOCK_FILE) if run_dir.is_dir() else []
    if entries and not any(name in entries for name in (SUMMARY_FILE, *_RUN_STATE)):
        raise ValueError(f"output_dir {str(run_dir)!r} holds other files ({', '.join(entries[:4])}), not a pretraining stage: "
                         f"choose another --output-dir")
    barrier()  # every rank has looked before rank 0 changes anything, so all take the same decision
    if is_main:
        (run_dir / SUMMARY_FILE).unlink(missing_ok=True)
        if not resume and entries:
            log(f"[pretrain] replacing the earlier stage in {run_dir}")
            for name in entries:
                path = run_dir / name
                shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)
        run_dir.mkdir(parents=True, exist_ok=True)


class SpanNLLObjective:
    """The entangled stage's objective for ``zcvae.train.loop``: z-free mean token NLL over the
    supervised span (y and ``</y>``) of the two-template mix, over the global batch's tokens.

    Each row's template is drawn from (seed, step, its place in the global batch), so every world size
    and accumulation draws the same mix."""

    def __init__(self, *, engine, train_all: Batch, tokens: TemplateTokens, seed: int, z_template_share: float, global_batch: int):
        self.engine, self.train_all, self.tokens = engine, train_all, tokens
        self.seed, self.share, self.global_batch = seed, z_template_share, global_batch
        self.num_tokens = 0.0  # this rank's input tokens so far (train_tokens_per_s)

    def begin_step(self, step: int) -> None:
        pass

    def batches(self, step: int, micro: list[list[int]], positions: list[list[int]]) -> list:
        digest = hashlib.sha256(f"zcvae pretrain templates {self.seed} {step}".encode()).digest()
        draws = torch.rand(self.global_batch, generator=torch.Generator().manual_seed(int.from_bytes(digest[:8], "little")))
        out = []
        for rows, places in zip(micro, positions):
            use_z_B = draws[places] < self.share
            out.append(tuple(t.to(self.engine.device) for t in mix_templates(self.train_all.select(rows), use_z_B, pad_id=self.tokens.pad)))
        return out

    def counts(self, batches) -> list[float]:
        return [float(sum(ids.shape[0] for ids, _, _ in batches)),
                float(sum(int((labels[:, 1:] != IGNORE_INDEX).sum()) for _, _, labels in batches))]

    def micro_loss(self, batch, *, index: int, num_micro: int, micro, global_count, global_tokens, window):
        from zcvae.loop import MicroLoss

        ids_BT, mask_BT, labels_BT = batch
        logits_BTV = self.engine.module(input_ids=ids_BT, attention_mask=mask_BT).logits
        nll_BT, sup_BT = span_nll(logits_BTV, labels_BT)
        loss = nll_BT.sum() / global_tokens  # the mean token NLL over the global batch's y and </y>
        tokens_B = sup_BT.sum(1).float()
        # per row: its mean token NLL, weighted by its tokens in the window, so the window mean is the token mean
        terms = {"valid": tokens_B, "loss": nll_BT.detach().sum(1) / tokens_B.clamp_min(1)}
        self.num_tokens += float(mask_BT.sum())
        return MicroLoss(loss=loss, terms=terms, tokens=float(mask_BT.sum()))

    def end_step(self, done: int) -> None:
        pass

    def window_metrics(self) -> dict[str, float]:
        return {}

    def postfix(self, metrics: dict[str, float]) -> dict[str, str]:
        return {"loss": f"{metrics.get('loss', float('nan')):.4f}"}


class _StageLogger:
    """The RunLogger (rank 0: metrics.jsonl + TensorBoard) plus the stage's progress lines."""

    def __init__(self, inner, *, say, max_steps: int):
        self.inner, self.say, self.max_steps = inner, say, max_steps
        self.start = time.perf_counter()

    def log(self, split: str, step: int, metrics: dict) -> None:
        self.inner.log(split, step, metrics)
        if split == "train":
            lr = next((v for k, v in sorted(metrics.items()) if k.startswith("learning_rate/")), float("nan"))
            self.say(f"step {step}/{self.max_steps} loss {metrics.get('loss', float('nan')):.4f} lr {lr:.2e} "
                     f"tokens/s {metrics.get('tokens_per_second', 0.0):.0f} elapsed {time.perf_counter() - self.start:.1f}s")

    def close(self) -> None:
        self.inner.close()


def _pretrain(config: PretrainConfig, *, log: Callable[[str], None], signals) -> dict:
    from zcvae.distributed import init_distributed
    from zcvae.engines import build_engine
    from zcvae.runs.checkpoint import CheckpointManager
    from zcvae.runs.rundir import CHECKPOINTS, METRICS, truncate_metrics
    from zcvae.loop import LoopSettings, RunLogger, run_loop

    start_time = time.perf_counter()
    info = init_distributed()
    is_main = info.rank == 0
    say = log if is_main else (lambda *a, **k: None)
    run_dir = Path(config.output_dir)
    if config.device != "auto" and _resolve_device(config.device).type != info.device.type:
        # the engines place each rank on its own device (zcvae.distributed), as in `zcvae train`
        say(f"[pretrain] device {config.device!r}: the engine runs this rank on {info.device} "
            f"(CUDA_VISIBLE_DEVICES= keeps a CUDA machine on the CPU)")
    micro_batch_size, rest = divmod(config.batch_size, config.gradient_accumulation_steps * info.world_size)
    if rest or micro_batch_size < 1:
        raise ValueError(f"batch_size {config.batch_size} must be a multiple of gradient_accumulation_steps "
                         f"{config.gradient_accumulation_steps} x world size {info.world_size}")

    def build_model(log=say):
        """The model before training, the same on every rank and on every call (seeded)."""
        if config.backbone is not None:
            model, tokenizer, tokens, source = load_backbone_for_finetune(config, log=log)
            return model, tokenizer, tokens, source
        torch.manual_seed(config.seed)
        model_config = tiny_llama_config(
            len(tiny_tokenizer),
            hidden_size=config.hidden_size,
            num_layers=config.num_layers,
            num_heads=config.num_heads,
            intermediate_size=config.intermediate_size,
            max_position_embeddings=max(128, config.max_length),
            bos_token_id=tiny_tokens.bos,
            eos_token_id=tiny_tokens.eos,
            pad_token_id=tiny_tokens.pad,
        )
        return LlamaForCausalLM(model_config).to(dtype=torch.float32), tiny_tokenizer, tiny_tokens, None

    tiny_tokenizer = tiny_tokens = None
    if config.backbone is not None:
        model, tokenizer, tokens, source = build_model()
        _, _, train_ex, val_ex, task = _load_data(config, tokenizer=tokenizer)
    else:
        tiny_tokenizer, tiny_tokens, train_ex, val_ex, task = _load_data(config)
        model, tokenizer, tokens, source = build_model()
    train = _encode(train_ex, tokenizer, tokens, max_length=config.max_length, what="train", log=say)
    val = _encode(val_ex, tokenizer, tokens, max_length=config.max_length, what="val", log=say)
    # One collated copy of the whole training set; each step selects rows and trims padding columns.
    train_all = collate(train, tokens)
    # only now, with the config, data and model known good: an earlier stage there is replaced
    _prepare_output_dir(run_dir, resume=config.resume is not None, is_main=is_main, log=say)

    num_params = sum(p.numel() for p in model.parameters())
    num_trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    say(
        f"backbone: {num_params / 1e6:.2f}M parameters ({num_trainable / 1e6:.3f}M trained), vocab {len(tokenizer)}, "
        f"{len(train)} train / {len(val)} val examples, engine {config.engine}, world {info.world_size}, "
        f"device {info.device}, {torch.get_num_threads()} threads"
    )
    # Built-in families: where each validation y's strategies first part (the token that carries the
    # choice; position 0 for the marker-first families) and the best possible z-free NLL, H(y | x).
    floor = decision_pos = None
    if task is not None:
        x_of, y_of = {ex.id: ex.x for ex in val_ex}, {ex.id: ex.y for ex in val_ex}
        decision_pos = [word_token_position(tokenizer, y_of[ex.id], (task.decision_positions(x_of[ex.id]) or (0,))[0])
                        for ex in val]
        floor = sum(task.y_entropy(x_of[ex.id]) for ex in val) / max(len(val), 1)

    trained = [p for p in model.parameters() if p.requires_grad]
    groups = [g for g in ({"name": "decay", "params": [p for p in trained if p.ndim >= 2], "weight_decay": config.weight_decay,
                           "lr": config.learning_rate},
                          {"name": "no_decay", "params": [p for p in trained if p.ndim < 2], "weight_decay": 0.0,
                           "lr": config.learning_rate}) if g["params"]]
    engine = build_engine(config.engine_config(), model=model, param_groups=groups, learning_rate=config.learning_rate,
                          weight_decay=config.weight_decay, betas=(0.9, 0.95))
    # on the engine's device, through its module (a sharded model's forwards are collectives), before a resume loads
    initial = evaluate_nll(engine.module, val, tokens, decision_positions=decision_pos)
    global_batch = micro_batch_size * config.gradient_accumulation_steps * info.world_size
    checkpoints = CheckpointManager(run_dir / CHECKPOINTS, keep=config.keep_last_checkpoints, is_main=is_main)
    start_step = 0
    if config.resume is not None:
        state = checkpoints.load(engine, config.resume, config=config, c_base=None)
        start_step = state["step"]
        if start_step > config.max_steps:
            raise ValueError(f"resume: checkpoint {state['checkpoint']!r} is at step {start_step}, past max_steps {config.max_steps}; "
                             f"resume with --max-steps {start_step} or more")
        if start_step:
            say(f"[resume] from step {start_step}")
        if is_main:
            truncate_metrics(run_dir / METRICS, after_step=start_step)
    logger = _StageLogger(RunLogger(run_dir, enabled=is_main), say=say, max_steps=config.max_steps)
    results: dict = {}

    def run_eval(step: int) -> dict[str, float]:
        stats = evaluate_nll(engine.module, val, tokens, decision_positions=decision_pos)
        zf, zn = stats["zfree"], stats["znull"]
        metrics = {"y_nll_per_example": zf["nll_per_example"], "y_nll_per_token": zf["nll_per_token"],
                   "znull_y_nll_per_example": zn["nll_per_example"]}
        if "decision_token_nll" in zf:
            metrics["decision_token_nll"] = zf["decision_token_nll"]
        logger.inner.log("eval", step, metrics)
        if step != config.max_steps:
            say(f"step {step} val y NLL {zf['nll_per_example']:.3f} nats/sequence{_decision_note(zf)}")
        results["final"] = stats
        return metrics

    settings = LoopSettings(max_steps=config.max_steps, micro_batch_size=micro_batch_size,
                            gradient_accumulation_steps=config.gradient_accumulation_steps, seed=config.seed,
                            log_every=config.log_every, eval_every=config.eval_every, save_every=config.save_every,
                            max_grad_norm=config.grad_clip if config.grad_clip > 0 else None,
                            progress_bar=config.progress_bar, run_name=f"pretrain {run_dir.name}")
    objective = SpanNLLObjective(engine=engine, train_all=train_all, tokens=tokens, seed=config.seed,
                                 z_template_share=config.z_template_share, global_batch=global_batch)
    train_start, train_cpu_start = time.perf_counter(), time.process_time()
    run_loop(engine=engine, objective=objective, settings=settings, num_examples=len(train),
             peak_lrs=[g["lr"] for g in groups], group_names=[g["name"] for g in groups],
             lr_factor=lambda step: lr_multiplier(step, warmup_steps=config.warmup_steps, max_steps=config.max_steps,
                                                  min_lr_ratio=config.min_lr_ratio),
             start_step=start_step, checkpoints=checkpoints, checkpoint_state={"config": config, "c_base": None},
             evaluate=run_eval, logger=logger, signals=signals, log=say)
    train_time = time.perf_counter() - train_start
    # CPU seconds of this process: on a shared machine, a steadier measure of cost than wall time.
    train_cpu_time = time.process_time() - train_cpu_start
    total_tokens = float(engine.all_reduce(torch.tensor(objective.num_tokens, dtype=torch.float64)))
    final = results["final"]
    logger.close()

    # every rank decodes (a sharded model's forwards are collectives), only rank 0 writes
    decoding = None
    if task is not None and config.num_decode_examples > 0:
        decoding = decoding_report(engine.module, tokenizer, val[: config.num_decode_examples], tokens, task,
                                   max_length=config.max_length, seed=config.seed)
    # the trained weights, whole, on rank 0 (a collective: ZeRO-3 gathers, FSDP2 makes full tensors); the
    # frozen weights are the seeded start's, so a fresh copy with the trained ones loaded in is the model
    trained_state = engine.trainable_state_dict()
    if is_main:
        summary: dict = {
            "finished": True,
            "config": config.to_dict(),
            "num_parameters": num_params,
            "num_trained_parameters": num_trainable,
            # where the weights came from (None: the tiny model from scratch) and the data they were fit to
            "source": source,
            "data_fingerprint": data_fingerprint(train_ex, val_ex),
            "num_steps": config.max_steps,
            "resumed_from_step": start_step or None,
            "world_size": info.world_size,
            "engine": config.engine,
            "num_train_examples": len(train),
            "num_val_examples": len(val),
            "train_time_s": train_time,
            "train_cpu_time_s": train_cpu_time,
            "num_threads": torch.get_num_threads(),
            "train_tokens_per_s": total_tokens / max(train_time, 1e-9),
            "val_initial": initial,
            "val": final,
            # With equiprobable strategies and each y deterministic given (x, strategy), the best possible
            # y-sequence NLL is the validation mean of H(y | x): log S where the S strategies give S
            # different ys, all of it on the decision token.
            "floor_nll_per_example": floor,
        }
        if decoding is not None:
            summary["decoding"] = decoding
        summary["wall_time_s"] = time.perf_counter() - start_time
        fresh = build_model(log=lambda *a, **k: None)[0]
        params = dict(fresh.named_parameters())
        missing = sorted(set(trained_state) - set(params))
        if missing:
            raise RuntimeError(f"trained parameters {missing[:3]} are not in a fresh copy of the model")
        with torch.no_grad():
            for name, tensor in trained_state.items():
                params[name].copy_(tensor)
        _write_checkpoint(merged_model(fresh), tokenizer, summary, config.output_dir)
    engine.barrier()
    if not is_main:
        return json.loads((run_dir / SUMMARY_FILE).read_text())
    zf, zn = final["zfree"], final["znull"]
    say(
        f"done in {summary['wall_time_s']:.1f}s: val y NLL z-free {zf['nll_per_example']:.3f} "
        f"{_decision_note(zf)}, znull {zn['nll_per_example']:.3f} nats/sequence"
        + (f", floor {floor:.3f}" if floor is not None else "")
        + f"; wrote {config.output_dir}"
    )
    if "decoding" in summary:
        for template, modes in summary["decoding"].items():
            for mode, d in modes.items():
                freq = ", ".join(f"{s} {f:.2f}" for s, f in d["strategy_freq"].items())
                say(f"decode {template} {mode}: {freq}; parse_ok {d['parse_ok']:.2f} answer acc {d['answer_accuracy']:.2f}")
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


def _parse_value(text: str):
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return None if text in ("None", "null") else text


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m zcvae.backbone.pretraining key=value ...`` (keys of PretrainConfig)."""
    values = {}
    for arg in sys.argv[1:] if argv is None else argv:
        key, sep, text = arg.partition("=")
        if not sep:
            raise SystemExit(f"expected key=value, got {arg!r}")
        values[key.strip().lstrip("-").replace("-", "_")] = _parse_value(text)
    pretrain(PretrainConfig.from_dict(values))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
