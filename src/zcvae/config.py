"""The resolved training configuration: :class:`TrainConfig` in sections, the single source of every CLI flag.

The sections are nested dataclasses (data, model, objective, optimization, engine, run, evaluation), as
``run_config.json`` writes them. Every field of every section is also a flat key, named once across the
sections: the CLI flag in kebab case (``token_weight_alpha`` -> ``--token-weight-alpha``), the flat YAML
key and the run-name field. A config file may give keys flat, in sections, or both
(:func:`flat_values`); a ``run_config.json`` whose ``config`` is one flat mapping (the first layout) still
loads, so old run directories resume. The typed sub-configs the library needs
(:class:`~zcvae.core.losses.ReconstructionLossConfig`, :class:`~zcvae.model.config.ModelConfig`,
:class:`~zcvae.engines.EngineConfig`) are built from their sections in one place, here.

Why this module is over 600 lines: each field carries its own help text (the CLI's ``--help`` is
generated from it), which is about 150 lines, and the presets, the cross-field rules and the run names
all read those fields; split apart, each would have to import the others back.

Defaults start from what a CPU prototype of this CVAE measured (docs/objective.md, "The KL and its schedules"):
LoRA lr 1e-3, z rows and routers 1e-2, no weight decay, clipping at 1.0, and a KL weight held at 0 for
the first 30% of steps then ramped over 20% (a constant beta from step 0 collapsed every objective).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from collections.abc import Iterable, Mapping
from typing import Any
from zcvae.core.terms import RECONSTRUCTION_TERM_REGISTRY, term_by_abbreviation, with_term_weight_fields
from zcvae.presets import DEFAULT, objective_presets_path
from zcvae.runs.sinks import DEFAULT_REPORT_TO, sink_names
from zcvae.strict import StrictDataclass

logger = logging.getLogger(__name__)


def option(default, help: str, **kw):
    """A config field that is also a command-line option: its default, its --help text and flag keywords (choices)."""
    return field(default=default, metadata={"help": help, **kw})


def shared_option(section: type, name: str, *, default: Any = dataclasses.MISSING, help: str | None = None):
    """Another config's field that is ``section``'s field ``name`` (the entangled stage's PretrainConfig shares 27
    with `zcvae train`): its choices and help come from the section, with that config's own ``default`` and, where
    it reads the field otherwise, its own ``help``. The annotation is written again at the use; a test keeps it
    equal to the section's."""
    source = next((f for f in dataclasses.fields(section) if f.name == name), None)
    if source is None:
        raise ValueError(f"{section.__name__} has no field {name!r}")
    metadata = {**source.metadata, "section": section}
    if help is not None:
        metadata["help"] = help
    return field(default=source.default if default is dataclasses.MISSING else default, metadata=metadata)


def _read_objective_presets() -> dict[str, dict[str, float]]:
    """src/zcvae/presets/objectives.yaml: each preset's terms by abbreviation -> their weight fields."""
    import yaml

    path = objective_presets_path()
    presets = {}
    for name, entries in yaml.safe_load(path.read_text()).items():
        presets[name] = {key if key == "token_weight_alpha" else term_by_abbreviation(key).weight_field: float(value)
                         for key, value in entries.items()}
    return presets


# --objective NAME: its weights (absent = 0) and, where it sets one, alpha
OBJECTIVE_PRESETS: dict[str, dict[str, float]] = _read_objective_presets()


@dataclass
class DataSection(StrictDataclass):
    """What the run trains and validates on."""

    task: str | None = option(None, "Built-in synthetic task family (the default task when neither --task nor --train-data is given).")
    train_data: str | None = option(None, "JSONL file with fields id, x, y and optional strategy (instead of --task).")
    val_data: str | None = option(None, "Validation JSONL file (required with --train-data).")
    num_train_examples: int = option(4000, "Training examples generated for a built-in task.")
    num_val_examples: int = option(400, "Validation examples generated for a built-in task.")
    max_length: int = option(64, "Maximum z-conditioned sequence length; x is truncated from the left, an example whose y cannot fit is skipped and counted.")


@dataclass
class ModelSection(StrictDataclass):
    """The backbone and the latent: what :class:`~zcvae.model.config.ModelConfig` is built from."""

    backbone: str | None = option(None, "Local Hugging Face checkpoint directory of the causal LM, or a .gguf file (dequantized into a cached checkpoint, see `zcvae convert-gguf`); the built-in tiny backbone pretrained on the task when omitted.")
    trust_remote_code: bool = option(False, "Allow the backbone's own modelling code to run (off unless you trust the checkpoint).")
    allow_fresh_markers: bool = option(False, "Train on a backbone whose tokenizer lacks the template markers (<x> </x> <z> </z> <y> </y> <znull>) instead of exiting with the `zcvae pretrain --backbone` command that builds its entangled checkpoint; the added marker rows then train as trainable tokens, like the z rows (for studying a raw backbone as the reference).")
    latent_type: str = option("discrete", "discrete (K learned z tokens, exact expectation) or continuous (Gaussian soft prompt).", choices=("discrete", "continuous"))
    num_latents: int = option(2, "K, the number of discrete latent values (K = 1 is valid: no latent information; the benchmarks use it).")
    latent_dim: int = option(16, "Dimension of the Gaussian latent.")
    num_z_slots: int = option(1, "M tokens filling the <z> section: discrete, each latent value owns M learned rows (<z_k_1> .. <z_k_M>); Gaussian, M soft-prompt embeddings.")
    num_latent_samples: int = option(1, "S, reparameterised posterior samples per example (Gaussian).")
    z_conditioned_norm: bool = option(False, "Condition every decoder norm on z: norm(h) * (1 + scale_z) + shift_z on the positions from <z> on, learned in the latent group, zero at the start. The notes' other remedy for the single z token beside --num-z-slots: z reaches every position of every layer, not through attention alone (docs/objective.md#dilution). Not with --gradient-checkpointing.")
    learned_prior: bool = option(True, "Gaussian: learned prior p(z|x) instead of a standard normal.")
    lora_r: int = option(8, "LoRA rank.")
    lora_alpha: int = option(16, "LoRA alpha.")
    lora_dropout: float = option(0.0, "LoRA dropout.")
    lora_target_modules: list[str] | None = option(None, "Module names that get LoRA adapters (per-architecture default when omitted).")
    branch_chunk_size: int | None = option(None, "Rows of the B*K branch forward per chunk. Each chunk is rebuilt in the backward (exact), so peak branch memory grows with it, not with K; costs one more branch forward unless --gradient-checkpointing is on. Default: all rows at once, also with --gradient-checkpointing, whose per-layer checkpoints already keep branch memory nearly flat in K (a chunk switches them off inside itself; BENCHMARKS.md).")
    z_init_noise: float = option(0.1, "z rows start as the <znull> row plus this times the row norm of noise.")
    gradient_checkpointing: bool = option(False, "Recompute activations in the backward pass.")
    posterior_pooling: str = option("last", "What q(z|x,y) reads: last (the final state at </y>) or mean (the mean final state over <y> y </y>; for strategies that part mid-y and end alike).", choices=("last", "mean"))
    share_x_prefix: bool = option(True, "Run <bos> <x> {x} </x> once per example and reuse its keys/values for the router and all K branches (exact, also under gradient checkpointing; falls back with a reason where unsupported).")


@dataclass
@with_term_weight_fields(
    after="reconstruction_loss_sum_scale",
    make_field=lambda term: option(term.default_weight, f"Weight of {term.name} ({term.abbreviation}): {term.description}"),
)
class ObjectiveSection(StrictDataclass):
    """The training objective: the reconstruction terms (one weight per registered term), c_base, the KL and its schedule, the auxiliaries."""

    objective: str | None = option(None, f"Reconstruction preset (src/zcvae/presets/objectives.yaml): {', '.join(OBJECTIVE_PRESETS)}; explicit weight flags override its entries. Only weight flags: exactly those weights, recorded as 'custom'. Neither: the default run preset, src/zcvae/presets/default.yaml (its objective and the fields that go with it, under any flag given; TrainConfig() in Python keeps raw 1.0).", choices=(*OBJECTIVE_PRESETS, "custom"))
    reconstruction_loss_token_aggregation_mode: str = option("mean", "Token aggregation of every reconstruction term: mean (per-example token mean, then an example mean), sum (per-example token sum, then an example mean) or token (the global token mean: every supervised token of the global batch, all ranks and micro-batches, weighs the same).", choices=("mean", "sum", "token"))
    reconstruction_weight_scale: str = option("none", "none, or tokens: the weights of the terms in the mode's units (raw and tok; the terms divided by c_base or A(b_i) are ratios and stay) are brought to a sequence's size: under mean and token multiplied by the validation mean of n_i (supervised tokens per example), under sum by its scale C (1 unless reconstruction-loss-sum-scale is set). Under mean every example still weighs the same, but the reconstruction has a sequence's size against the per-example KL, as under sum (docs/objective.md, \"Scale against the KL\").", choices=("none", "tokens"))
    reconstruction_weight_factor: float | None = option(None, "The multiplier of the mode-unit weights that reconstruction-weight-scale resolved to (set by the trainer and recorded in run_config.json; 1 under none).")
    reconstruction_loss_sum_scale: float | None = option(None, "Sum mode only: divide each example's token sum by this constant C (Dr. GRPO's fixed divisor); c_base is divided by C too, so only raw, tok and ex change. Omitted: 1.")
    token_weight_alpha: float = option(1.0, "Temperature alpha of the surprisal-share token weights (0 = uniform).")
    example_inverse_surprisal_epsilon: float = option(1e-2, "Epsilon of the example-level inverse-surprisal ratio, in units of the aggregation mode.")
    inverse_surprisal_token_weight_epsilon: float = option(1e-2, "Epsilon of the inverse-surprisal token weights (nats).")
    zfree_reference_scale: float | None = option(None, "Fixed c_base; when omitted it is the validation mean of A_mode(b_i) in the selected mode.")
    reference_policy: str = option("auto", "z-free reference: online (a forward per batch), precomputed (a store), auto (precomputed when data is seen more than once).", choices=("auto", "online", "precomputed"))
    reference_cache_dir: str | None = option(None, "Directory of precomputed reference stores (default ~/.cache/zcvae/reference).")
    reference_refresh_every: int = option(0, "The dynamic reference: every N optimizer steps, copy the trained adapter (LoRA and trainable tokens) into a second, frozen adapter that the reference pass runs instead of the adapters-disabled backbone, so that b, and with it the token weights, follow the model (docs/objective.md#the-following-reference). 0: off, the frozen reference. c_base stays the setup value. Needs reference-policy online or auto (a store would be stale) and --engine local.")
    kl_weight: float = option(1.0, "beta, the final weight of KL(q || p).")
    kl_weight_scale: str = option("none", "none, or tokens: beta is multiplied by the validation mean of n_i (supervised tokens per example), the explicit beta control for sum aggregation (docs/objective.md).", choices=("none", "tokens"))
    kl_weight_factor: float | None = option(None, "The multiplier of beta that kl-weight-scale resolved to (set by the trainer and recorded in run_config.json; 1 under none).")
    kl_schedule: str = option("delay-ramp", "constant, delay-ramp (0 for kl-delay-fraction, then linear over kl-ramp-fraction) or cyclical.", choices=("constant", "delay-ramp", "cyclical"))
    kl_delay_fraction: float = option(0.3, "Fraction of steps (per cycle) with beta = 0.")
    kl_delay_mode: str = option("fixed", "When the KL delay of the delay-ramp schedule ends: fixed (after kl-delay-fraction of the steps) or read (after at least kl-delay-fraction, at the first check where the decoder reads z: on kl-delay-read-share of a fixed probe set of validation examples, teacher-forced y is e times likelier under one z than under another; at most kl-delay-max-fraction). Then beta ramps over kl-ramp-fraction of the steps. No labels are used.", choices=("fixed", "read"))
    kl_delay_max_fraction: float = option(0.8, "kl-delay-mode read: the cap of the delay, a fraction of max-steps; reached without a read, beta starts there and the run says so.")
    kl_delay_read_share: float = option(0.5, "kl-delay-mode read: the share of probe examples on which the decoder must read z (the best z makes y at least e times likelier than the worst) to end the delay.")
    kl_delay_check_every: int = option(10, "kl-delay-mode read: optimizer steps between two checks of whether the decoder reads z.")
    kl_ramp_fraction: float = option(0.2, "Fraction of steps (per cycle) over which beta ramps to kl-weight.")
    kl_cycles: int = option(4, "Number of cycles of the cyclical schedule.")
    posterior_entropy_weight: float = option(0.0, "Weight of the mean posterior entropy H(q) (positive sharpens q).")
    router_support_weight: float = option(0.0, "Weight of -log router support = -H(mean q) (positive spreads usage).")
    router_support_schedule: str = option("constant", "When router support applies: constant (every step) or delay (only while the KL weight is 0, the KL delay, so that once the KL prices latents a spare one can empty).", choices=("constant", "delay"))
    router_marginal_kl_weight: float = option(0.0, "Weight of KL(mean q || uniform) over the global batch.")
    inter_latent_divergence_weight: float = option(0.0, "Weight of -inter_latent_divergence (positive pushes latents apart).")
    posterior_variance_weight: float = option(0.0, "Gaussian: weight of the posterior variance term.")


@dataclass
class OptimizationSection(StrictDataclass):
    """Steps, batches, learning rates and their schedule, the seed."""

    max_steps: int = option(300, "Optimizer steps.")
    micro_batch_size: int = option(16, "Examples per rank per micro-batch.")
    gradient_accumulation_steps: int = option(1, "Micro-batches per optimizer step.")
    lora_learning_rate: float = option(1e-3, "Peak learning rate of the LoRA adapters.")
    latent_learning_rate: float = option(1e-2, "Peak learning rate of the z rows and router/prior/projection heads.")
    weight_decay: float = option(0.0, "AdamW weight decay.")
    max_grad_norm: float | None = option(1.0, "Gradient clipping norm (none when omitted).")
    warmup_steps: int = option(10, "Linear learning-rate warm-up steps.")
    min_lr_ratio: float = option(0.1, "Cosine decay floor as a fraction of the peak learning rate.")
    seed: int = option(0, "Seed of data order, initialisation and sampling.")


@dataclass
class EngineSection(StrictDataclass):
    """How the step is executed across processes and devices."""

    engine: str = option("local", "local (DDP when launched with several processes), deepspeed or fsdp2.", choices=("local", "deepspeed", "fsdp2"))
    deepspeed_config: str | None = option(None, "DeepSpeed JSON config (ds_configs/zero2.json when omitted).")
    precision: str = option("fp32", "fp32 or bf16.", choices=("fp32", "bf16"))
    base_dtype: str | None = option(None, "Dtype of the frozen backbone weights (the LoRA adapters, z rows and router heads always keep float32 masters): float32, bfloat16, or auto (as saved in the checkpoint). Default: bfloat16 under --precision bf16, float32 otherwise. A bfloat16 base halves the frozen weights' memory on every engine (gloo runs its bfloat16 collectives too: measured with torch 2.13).", choices=("float32", "bfloat16", "auto"))
    cpu_offload: bool = option(False, "Offload optimizer state (and ZeRO-3 parameters) to CPU.")


@dataclass
class RunSection(StrictDataclass):
    """The run directory, logging, checkpoints, resuming."""

    output_dir: str = option("runs/zcvae", "Run directory (created).")
    run_name: str | None = option(None, "Run name (derived from the parameters that differ from the defaults when omitted).")
    log_every: int = option(10, "Log train metrics every N steps.")
    report_to: str = option(DEFAULT_REPORT_TO, "Where the logged metrics go, a comma list: jsonl (metrics.jsonl; required, since resume, aggregate and the verdict read it), tensorboard (tensorboard/ in the run directory), wandb (a Weights & Biases run: pip install 'zcvae[wandb]'; WANDB_MODE and the other WANDB_* variables apply). Changes no training number.")
    grad_probe_every: int = option(0, "Every N steps, log the norms of the reconstruction and the KL gradient on the router's posterior head and on the LoRA weights, separately, their ratio and t0/T (the dilution argument, docs/objective.md#dilution; zcvae.train.grad_probe; records of split grad_probe in metrics.jsonl). 0: off. Changes no training number. Cost on a probed step: two extra backward passes per micro-batch (the reconstruction one about as long as the step's own backward, the KL one through the router pass only) and one all-reduce of those gradients. Needs --engine local.")
    progress_bar: bool = option(True, "Show a progress bar on rank 0.")
    follow_cores: bool = option(False, "On CPU, one process: start on the cores idle now and follow the cores other processes leave free at each log step (faster beside other jobs). Off: the thread count is fixed (OMP_NUM_THREADS, else every core), so a fixed-seed run gives the same numbers whatever else runs on the machine; the thread count sets the summation order, so following makes the last digits, and over a long run possibly the outcome, depend on the load.")
    save_every: int = option(0, "Save a resumable checkpoint every N steps (0: only at the end).")
    keep_last_checkpoints: int = option(2, "Resumable checkpoints kept.")
    resume: str | None = option(None, "Resume from a checkpoint directory, or 'auto' for the newest complete one in the run directory.")
    skip_nonfinite_steps: int = option(0, "Non-finite steps (loss or gradient norm NaN/inf; their update is skipped) to pass over, each logged, before the run stops as diverged (0: stop at the first).")


@dataclass
class EvaluationSection(StrictDataclass):
    """Evaluation during and at the end of the run."""

    eval_every: int = option(0, "Evaluate every N steps (0: only at the end).")
    num_eval_decode_examples: int = option(64, "Validation x decoded with each latent for controllability.")
    max_new_tokens: int | None = option(None, "Greedy decoding length (the longest validation y + 2 when omitted).")

# Section name -> its dataclass, in the order of run_config.json and of the CLI help.
SECTIONS: dict[str, type] = {
    "data": DataSection,
    "model": ModelSection,
    "objective": ObjectiveSection,
    "optimization": OptimizationSection,
    "engine": EngineSection,
    "run": RunSection,
    "evaluation": EvaluationSection,
}


def _flat_key_table() -> dict[str, str]:
    """Flat key (CLI flag, flat YAML key, run-name field) -> its section, read off the section dataclasses."""
    table: dict[str, str] = {}
    for section, cls in SECTIONS.items():
        for f in dataclasses.fields(cls):
            if f.name in table:
                raise ValueError(f"config field {f.name!r} is in two sections, {table[f.name]!r} and {section!r}: a flat key must name one field")
            table[f.name] = section
    return table


# Every flat key maps to exactly one section.
FLAT_KEYS: dict[str, str] = _flat_key_table()


def flat_fields() -> list[dataclasses.Field]:
    """The fields of every section, in section order: one CLI flag each."""
    return [f for cls in SECTIONS.values() for f in dataclasses.fields(cls)]


def config_fields(cls) -> tuple[list[dataclasses.Field], dict[str, Any]]:
    """(fields, name -> type annotation) of a config class, one per flat key: TrainConfig's are its sections'
    fields (:func:`flat_fields`), any other dataclass's (the stage's PretrainConfig) its own."""
    if cls is TrainConfig:
        return flat_fields(), {k: v for s in SECTIONS.values() for k, v in typing.get_type_hints(s).items()}
    return list(dataclasses.fields(cls)), typing.get_type_hints(cls)


def field_defaults() -> dict[str, Any]:
    """Flat key -> its field's default (``objective`` None: unresolved), the defaults run names are read against."""
    return {f.name: f.default for f in flat_fields()}


def flat_values(values: Mapping[str, Any], *, source: str = "config") -> dict[str, Any]:
    """Flat keys from ``values``, which may hold flat keys (``learning_rate: ...``), sections
    (``optimization: {learning_rate: ...}``) or both; keys may use dashes. ``objective`` and ``engine`` are
    both a section and a flat key: a mapping is the section, anything else the flat key.

    ValueError naming the key for an unknown key, a key that is not in the section it is given under, and a
    key given both flat and in its section.
    """
    if not isinstance(values, Mapping):
        raise ValueError(f"{source} must be a mapping, got {type(values).__name__}")
    out: dict[str, Any] = {}
    where: dict[str, str] = {}

    def put(key: str, value: Any, given_as: str) -> None:
        if key in out:
            raise ValueError(f"{source}: {key} is given twice, as {where[key]} and as {given_as}; give it once")
        out[key], where[key] = value, given_as

    unknown = []
    for raw_key, value in values.items():
        key = str(raw_key).replace("-", "_")
        if key in SECTIONS and isinstance(value, Mapping):
            for raw_sub, sub_value in value.items():
                sub = str(raw_sub).replace("-", "_")
                if FLAT_KEYS.get(sub) != key:
                    hint = f" (it belongs in section {FLAT_KEYS[sub]!r})" if sub in FLAT_KEYS else ""
                    raise ValueError(f"{source}: unknown key {key}.{sub}{hint}; section {key!r} has keys "
                                     f"{sorted(f.name for f in dataclasses.fields(SECTIONS[key]))}")
                put(sub, sub_value, f"{key}.{sub}")
        elif key in FLAT_KEYS:
            put(key, value, key)
        else:
            unknown.append(key)
    if unknown:
        raise ValueError(f"{source} (see `zcvae train --help`): unknown keys {sorted(unknown)}; known keys: "
                         f"{sorted(FLAT_KEYS)} (flat) or the sections {list(SECTIONS)}")
    return out


@dataclass
class TrainConfig(StrictDataclass):
    """The resolved training configuration, in sections (``cfg.optimization.max_steps``).

    Each field of each section is also a flat key: the CLI flag ``--max-steps``, the flat YAML key
    ``max_steps`` and the run-name field; :data:`FLAT_KEYS` maps it to its section. ``to_dict`` gives
    the flat dict (run names, verdicts, aggregate tables), ``to_sections`` the nested one (run_config.json).
    """

    data: DataSection = field(default_factory=DataSection)
    model: ModelSection = field(default_factory=ModelSection)
    objective: ObjectiveSection = field(default_factory=ObjectiveSection)
    optimization: OptimizationSection = field(default_factory=OptimizationSection)
    engine: EngineSection = field(default_factory=EngineSection)
    run: RunSection = field(default_factory=RunSection)
    evaluation: EvaluationSection = field(default_factory=EvaluationSection)

    def __post_init__(self) -> None:
        for name, cls in SECTIONS.items():
            if not isinstance(getattr(self, name), cls):
                raise ValueError(f"TrainConfig.{name} must be a {cls.__name__}, got {type(getattr(self, name)).__name__}")
        if self.objective.objective is None:
            # constructed directly (library use): name what the weights amount to
            self.objective = dataclasses.replace(self.objective, objective=matching_objective(self.to_dict()))
        validate(self)

    # -- construction
    @classmethod
    def from_dict(cls, values: Mapping[str, Any], *, source: str = "config", default_preset: str | None = None) -> "TrainConfig":
        """Build from a dict of the fields that were *given*, flat, in sections or both (:func:`flat_values`);
        the objective is resolved by :func:`expand_objective`, with ``default_preset`` under the given fields
        when they name no objective (so a dict must hold only what a user set, not a full default dict). Reads run_config.json's ``config`` of both layouts: nested, and one flat
        mapping."""
        values = flat_values(values, source=f"{source}")
        check_types(cls, values, source=source)
        return cls.from_flat(expand_objective(values, default=default_preset))

    @classmethod
    def from_flat(cls, values: Mapping[str, Any] | None = None, /, **kwargs: Any) -> "TrainConfig":
        """Build from flat keys as given (``TrainConfig.from_flat(max_steps=10)``), without resolving an
        objective preset (library use and tests)."""
        given = flat_values({**(values or {}), **kwargs}, source="TrainConfig")
        grouped: dict[str, dict[str, Any]] = {name: {} for name in SECTIONS}
        for key, value in given.items():
            grouped[FLAT_KEYS[key]][key] = value
        return cls(**{name: SECTIONS[name](**grouped[name]) for name in SECTIONS})

    def replace(self, **changes: Any) -> "TrainConfig":
        """A copy with flat keys changed (validated again); the config itself stays as it is."""
        given = flat_values(changes, source="TrainConfig.replace")
        sections = {name: getattr(self, name) for name in SECTIONS}
        for key, value in given.items():
            sections[FLAT_KEYS[key]] = dataclasses.replace(sections[FLAT_KEYS[key]], **{key: value})
        return dataclasses.replace(self, **sections)

    # -- views
    def to_dict(self) -> dict[str, Any]:
        """The flat dict, one key per field (run names, verdicts, aggregate tables read this)."""
        return {k: v for name in SECTIONS for k, v in dataclasses.asdict(getattr(self, name)).items()}

    def to_sections(self) -> dict[str, dict[str, Any]]:
        """The nested dict, one mapping per section (run_config.json's ``config``)."""
        return {name: dataclasses.asdict(getattr(self, name)) for name in SECTIONS}

    # -- derived sub-configs: each built from its section, here only
    def reconstruction_config(self):
        from zcvae.core.losses import ReconstructionLossConfig

        o = self.objective
        return ReconstructionLossConfig(
            **self.effective_reconstruction_weights,
            token_weight_alpha=o.token_weight_alpha,
            example_inverse_surprisal_epsilon=o.example_inverse_surprisal_epsilon,
            inverse_surprisal_token_weight_epsilon=o.inverse_surprisal_token_weight_epsilon,
            zfree_reference_scale=o.zfree_reference_scale,
            token_aggregation_mode=o.reconstruction_loss_token_aggregation_mode,
            sum_scale=o.reconstruction_loss_sum_scale,
        )

    def model_config(self):
        """The model's config: every field the model section shares with :class:`~zcvae.model.config.ModelConfig`
        by name, the fresh-marker flag (``allow_fresh_markers``, which the model calls what it does with them,
        ``train_fresh_markers``) and the base dtype as loaded."""
        from zcvae.model.config import ModelConfig

        shared = {f.name for f in dataclasses.fields(ModelConfig)} & {f.name for f in dataclasses.fields(ModelSection)}
        return ModelConfig(**{name: getattr(self.model, name) for name in sorted(shared)},
                           train_fresh_markers=self.model.allow_fresh_markers, dtype=self.resolved_base_dtype)

    @property
    def resolved_base_dtype(self) -> str:
        """``base_dtype`` as loaded: bfloat16 under bf16 precision and float32 otherwise when it is unset."""
        if self.engine.base_dtype is not None:
            return self.engine.base_dtype
        return "bfloat16" if self.engine.precision == "bf16" else "float32"

    def engine_config(self):
        from zcvae.engines import EngineConfig

        return EngineConfig(
            engine=self.engine.engine,
            deepspeed_config=self.engine.deepspeed_config,
            precision=self.engine.precision,
            gradient_checkpointing=self.model.gradient_checkpointing,
            cpu_offload=self.engine.cpu_offload,
        )

    @property
    def effective_reconstruction_weights(self) -> dict[str, float]:
        """Every term's weight as applied: the mode-unit terms' (raw, tok) times the resolved
        ``reconstruction_weight_factor``, the ratio terms' as given."""
        o = self.objective
        factor = 1.0 if o.reconstruction_weight_factor is None else o.reconstruction_weight_factor
        return {term.weight_field: getattr(o, term.weight_field) * (factor if term.in_mode_units else 1.0)
                for term in RECONSTRUCTION_TERM_REGISTRY}

    @property
    def effective_kl_weight(self) -> float:
        """The final beta actually applied: ``kl_weight`` times the resolved ``kl_weight_factor``."""
        o = self.objective
        return o.kl_weight * (1.0 if o.kl_weight_factor is None else o.kl_weight_factor)

    @property
    def slot_tokens(self) -> int:
        """M, the length of the z section, for both latent types (each discrete value owns M rows)."""
        return self.model.num_z_slots


# One weight field per registered reconstruction term (core/terms.py), in registry order.
RECONSTRUCTION_WEIGHT_FIELDS = tuple(term.weight_field for term in RECONSTRUCTION_TERM_REGISTRY)

# ---- objective presets (OBJECTIVE_PRESETS, read from their file above the sections) --------------------
_W_RAW, _W_DIST, _W_EX, _W_TOK, _W_TOKCC, _W_TOKINV = (
    term_by_abbreviation(a).weight_field for a in ("raw", "dist", "ex", "tok", "tokcc", "tokinv")
)


CUSTOM_OBJECTIVE = "custom"
# What `zcvae train` runs when no objective flag is given: the run preset src/zcvae/presets/default.yaml,
# its objective and the fields that go with it (docs/guide/objective-and-presets.md, "The default preset"); the library's TrainConfig() stays raw.
DEFAULT_PRESET = DEFAULT
# Its objective, DEFAULT_OBJECTIVE, is read from that file at the end of this module (the file is its one home).
# The hybrid the pilot families and `zcvae demo` run in mean and sum.
BEST_HYBRID = "raw+dist"


def preset_values(name: str) -> dict[str, float]:
    """All six reconstruction weights (and alpha where the preset sets it) of preset ``name``."""
    if name not in OBJECTIVE_PRESETS:
        raise ValueError(f"objective must be one of {sorted(OBJECTIVE_PRESETS)} or {CUSTOM_OBJECTIVE!r}, got {name!r}")
    return {**{f: 0.0 for f in RECONSTRUCTION_WEIGHT_FIELDS}, **OBJECTIVE_PRESETS[name]}


def expand_objective(values: dict[str, Any], *, default: str | None = None) -> dict[str, Any]:
    """``values`` (the fields a user gave) with the objective resolved.

    - ``objective`` given: its preset's weights (and alpha), then every field in ``values`` on top
      (explicit weight flags win entry by entry); nothing of the run preset ``default`` applies, so
      ``--objective raw`` is the plain raw term, the collapse control;
    - no ``objective`` but some reconstruction weights given: exactly those weights, the others 0,
      recorded as ``"custom"``;
    - neither: the run preset ``default`` when one is given (a file of :mod:`zcvae.presets`; the CLI and
      the sweeps pass :data:`DEFAULT_PRESET`, the no-flag default), its fields under the given ones, else the
      values as they are (TrainConfig's own defaults, raw 1.0, named by :func:`matching_objective`).
    """
    values = dict(values)
    name = values.get("objective")
    if name is None:
        if any(f in values for f in RECONSTRUCTION_WEIGHT_FIELDS):
            name = CUSTOM_OBJECTIVE
        elif default is not None:
            preset = flat_values(load_config_file(default), source=f"preset {default}")
            if preset.get("objective") is None:
                raise ValueError(f"preset {default} names no objective, so it cannot be the default")
            return expand_objective({**preset, **values})
        else:
            return values
    if name == CUSTOM_OBJECTIVE:
        base = {f: 0.0 for f in RECONSTRUCTION_WEIGHT_FIELDS}
    else:
        base = preset_values(name)
    return {**base, **values, "objective": name}


def matching_objective(config: dict[str, Any]) -> str:
    """The preset whose weights (and alpha, where it sets one) ``config`` has, else ``"custom"``."""
    for name in OBJECTIVE_PRESETS:
        if all(config.get(f) == v for f, v in preset_values(name).items()):
            return name
    return CUSTOM_OBJECTIVE


# The token-weighted terms (docs/objective.md, "Token weights"): the terms whose value depends on token_weight_alpha.
TOKEN_WEIGHTED_FIELDS = (_W_TOK, _W_TOKCC, _W_TOKINV)


def aggregation_label(config: dict[str, Any]) -> str:
    """The aggregation mode as tables show it: ``mean``, ``sum``, ``token``, or ``sum/C`` with a sum scale."""
    mode = str(config.get("reconstruction_loss_token_aggregation_mode", ObjectiveSection.reconstruction_loss_token_aggregation_mode))
    scale = config.get("reconstruction_loss_sum_scale")
    return mode if scale is None else f"{mode}/{scale:g}"


def token_weighting_confounds(configs: Iterable[dict[str, Any]]) -> list[str]:
    """One warning per aggregation mode whose token-weighted arms differ in preset and also in alpha.

    The pilot compares token-weighted presets (tok, tokcc, tokinv, raw+tokcc) at the same mode, alpha and
    c_base; when the presets at one mode are not all run at the same set of alphas, some pair of arms differs
    in both, and a difference between them may be alpha's. ``configs`` are a family's run params (resolved
    here as ``zcvae train`` resolves them: preset weights and alpha, DEFAULT_OBJECTIVE when none is named)
    or the resolved configs of run_config.json. Quiet when every preset has the same alphas.
    """
    defaults = field_defaults()
    by_mode: dict[str, dict[str, set[float]]] = {}
    for params in configs:
        cfg = {**defaults, **expand_objective(dict(params), default=DEFAULT_PRESET)}
        if not any(isinstance(cfg.get(f), (int, float)) and cfg[f] > 0 for f in TOKEN_WEIGHTED_FIELDS):
            continue
        alphas = by_mode.setdefault(aggregation_label(cfg), {}).setdefault(str(cfg.get("objective")), set())
        alphas.add(float(cfg["token_weight_alpha"]))
    messages = []
    for mode, presets in by_mode.items():
        if len(presets) > 1 and len({frozenset(a) for a in presets.values()}) > 1:
            arms = "; ".join(f"{name} at alpha {', '.join(f'{a:g}' for a in sorted(alphas))}" for name, alphas in presets.items())
            messages.append(
                f"token-weighted arms at mode {mode} differ in preset and also in alpha ({arms}): the comparison of these "
                f"presets is confounded by alpha; run every preset at the same alphas (token_weight_alpha)"
            )
    return messages


def naming_defaults(params: dict[str, Any]) -> dict[str, Any]:
    """Defaults to name a run against: TrainConfig's, with the weights of the run's objective, so a name
    reads ``obj-dist`` and lists a weight only where it differs from the preset."""
    defaults = field_defaults()
    name = params.get("objective")
    if name in OBJECTIVE_PRESETS:
        defaults.update(preset_values(name))
    elif name == CUSTOM_OBJECTIVE:
        defaults.update({f: 0.0 for f in RECONSTRUCTION_WEIGHT_FIELDS})
    return defaults


def train_run_name(config: dict[str, Any]) -> str:
    """The run name of a resolved config: the objective and aggregation mode always, then what differs."""
    from zcvae.runs.naming import AGGREGATION_MODE_FIELD, run_name

    return run_name(config, naming_defaults(config), always=(AGGREGATION_MODE_FIELD, "objective"))


def parse_train_run_name(name: str) -> dict[str, Any]:
    """Read a :func:`train_run_name` back (two passes: the objective first, then the rest against its preset)."""
    from zcvae.runs.naming import parse_run_name

    first = parse_run_name(name, naming_defaults({}))
    return parse_run_name(name, naming_defaults({"objective": first.get("objective")}))


def validate(config: TrainConfig) -> None:
    """Cross-field rules in one place; ValueError names the field by its flat key (the flag and YAML key)."""
    cfg = types.SimpleNamespace(**config.to_dict())  # the rules read the flat view, as their messages name it
    check_field_values(flat_fields(), config.to_dict())
    positive = ("num_latents", "latent_dim", "num_z_slots", "num_latent_samples", "lora_r", "max_steps",
                "micro_batch_size", "gradient_accumulation_steps", "num_train_examples", "num_val_examples",
                "log_every", "keep_last_checkpoints", "kl_cycles")
    for name in positive:
        if getattr(cfg, name) < 1:
            raise ValueError(f"{name} must be >= 1, got {getattr(cfg, name)}")
    nonneg = ("kl_weight", "weight_decay", "warmup_steps", "eval_every", "save_every", "skip_nonfinite_steps", "token_weight_alpha",
              "posterior_entropy_weight", "router_marginal_kl_weight", "lora_dropout", "z_init_noise",
              "num_eval_decode_examples") + RECONSTRUCTION_WEIGHT_FIELDS
    for name in nonneg:
        if getattr(cfg, name) < 0:
            raise ValueError(f"{name} must be >= 0, got {getattr(cfg, name)}")
    sink_names(cfg.report_to)
    if not any(getattr(cfg, name) > 0 for name in RECONSTRUCTION_WEIGHT_FIELDS):
        raise ValueError("at least one reconstruction weight must be > 0 (e.g. reconstruction_weight)")
    if cfg.latent_type == "continuous" and cfg.num_latents != ModelSection.num_latents:
        # K would be ignored, yet the run name would carry it (K-4): say so instead
        raise ValueError(f"num_latents (K = {cfg.num_latents}) applies to the discrete latent only; with latent_type continuous "
                         f"set latent_dim, num_z_slots or num_latent_samples instead, and leave num_latents out")
    if cfg.z_conditioned_norm and cfg.gradient_checkpointing:
        raise ValueError("z_conditioned_norm does not work with gradient_checkpointing: a checkpointed layer is re-run in the "
                         "backward, outside the branch pass that says which z each row has; turn one of them off "
                         "(branch_chunk_size bounds the branches' memory instead)")
    if cfg.train_data is not None and cfg.task is not None:
        raise ValueError("give either task or train_data, not both")
    if (cfg.train_data is None) != (cfg.val_data is None):
        raise ValueError("train_data and val_data go together")
    for name in ("lora_learning_rate", "latent_learning_rate"):
        if getattr(cfg, name) <= 0:
            raise ValueError(f"{name} must be > 0, got {getattr(cfg, name)}")
        # AdamW's first step moves by lr / (1 - beta1) = 10 lr, which must be a float32
        if getattr(cfg, name) * 10 > 3.4e38:
            raise ValueError(f"{name} {getattr(cfg, name):g} overflows float32 in AdamW's first step (10 x lr > 3.4e38); "
                             f"learning rates are typically 1e-5 to 1e-1")
    if not 0 <= cfg.min_lr_ratio <= 1:
        raise ValueError(f"min_lr_ratio must be in [0, 1], got {cfg.min_lr_ratio}")
    if not (0 <= cfg.kl_delay_fraction and 0 <= cfg.kl_ramp_fraction and cfg.kl_delay_fraction + cfg.kl_ramp_fraction <= 1):
        raise ValueError("kl_delay_fraction and kl_ramp_fraction must be >= 0 and sum to at most 1")
    if cfg.kl_delay_mode == "read":
        if cfg.kl_schedule != "delay-ramp":
            raise ValueError(f"kl_delay_mode read needs kl_schedule delay-ramp (one delay that can end on evidence), got {cfg.kl_schedule!r}")
        if not (cfg.kl_delay_fraction <= cfg.kl_delay_max_fraction and cfg.kl_delay_max_fraction + cfg.kl_ramp_fraction <= 1):
            raise ValueError(f"kl_delay_max_fraction {cfg.kl_delay_max_fraction:g} must be >= kl_delay_fraction {cfg.kl_delay_fraction:g} "
                             f"and leave room for the ramp (kl_delay_max_fraction + kl_ramp_fraction <= 1, kl_ramp_fraction is {cfg.kl_ramp_fraction:g})")
        if not 0 < cfg.kl_delay_read_share <= 1:
            raise ValueError(f"kl_delay_read_share must be in (0, 1], got {cfg.kl_delay_read_share}")
        if cfg.kl_delay_check_every < 1:
            raise ValueError(f"kl_delay_check_every must be >= 1, got {cfg.kl_delay_check_every}")
    if cfg.reconstruction_loss_sum_scale is not None:
        if cfg.reconstruction_loss_token_aggregation_mode != "sum":
            raise ValueError(f"reconstruction_loss_sum_scale applies to reconstruction_loss_token_aggregation_mode sum only, "
                             f"got mode {cfg.reconstruction_loss_token_aggregation_mode!r}")
        if not cfg.reconstruction_loss_sum_scale > 0:
            raise ValueError(f"reconstruction_loss_sum_scale must be > 0 or omitted, got {cfg.reconstruction_loss_sum_scale}")
    if cfg.zfree_reference_scale is not None and cfg.zfree_reference_scale <= 0:
        raise ValueError(f"zfree_reference_scale must be > 0, got {cfg.zfree_reference_scale}")
    if cfg.max_grad_norm is not None and cfg.max_grad_norm <= 0:
        raise ValueError(f"max_grad_norm must be > 0 or omitted, got {cfg.max_grad_norm}")
    if cfg.max_length < 16:
        raise ValueError(f"max_length must be >= 16, got {cfg.max_length}")
    if cfg.kl_weight_factor is not None and not cfg.kl_weight_factor > 0:
        raise ValueError(f"kl_weight_factor must be > 0 or omitted, got {cfg.kl_weight_factor}")
    if cfg.kl_weight_scale == "none" and cfg.kl_weight_factor not in (None, 1.0):
        raise ValueError(f"kl_weight_factor is {cfg.kl_weight_factor} but kl_weight_scale is none (set kl_weight_scale tokens or drop the factor)")
    if cfg.reconstruction_weight_factor is not None and not cfg.reconstruction_weight_factor > 0:
        raise ValueError(f"reconstruction_weight_factor must be > 0 or omitted, got {cfg.reconstruction_weight_factor}")
    if cfg.reconstruction_weight_scale == "none" and cfg.reconstruction_weight_factor not in (None, 1.0):
        raise ValueError(f"reconstruction_weight_factor is {cfg.reconstruction_weight_factor} but reconstruction_weight_scale is none "
                         f"(set reconstruction_weight_scale tokens or drop the factor)")
    if cfg.reference_refresh_every < 0:
        raise ValueError(f"reference_refresh_every must be >= 0 (0: off), got {cfg.reference_refresh_every}")
    if cfg.reference_refresh_every and cfg.reference_policy == "precomputed":
        raise ValueError(f"reference_refresh_every {cfg.reference_refresh_every} needs reference_policy online or auto: a precomputed "
                         f"store holds the b of the setup's reference and would be stale after the first refresh")
    if cfg.reference_refresh_every and cfg.engine != "local":
        # the copy runs on whole tensors; a second adapter's shards under ZeRO-3/FSDP2 are not built or tested
        raise ValueError(f"reference_refresh_every needs engine local (one process or DDP), got engine {cfg.engine!r}: the copy of "
                         f"the adapter into the reference runs on whole tensors, and ZeRO-3/FSDP2 hold shards")
    if cfg.grad_probe_every < 0:
        raise ValueError(f"grad_probe_every must be >= 0 (0: off), got {cfg.grad_probe_every}")
    if cfg.grad_probe_every and cfg.engine != "local":
        # ZeRO-3 and FSDP2 hold a shard of each parameter outside autograd's reach: no per-term gradient to read
        raise ValueError(f"grad_probe_every needs engine local (one process or DDP), got engine {cfg.engine!r}; "
                         f"probe a run with --engine local, or set grad_probe_every 0")


def check_field_values(fields: Iterable[dataclasses.Field], values: Mapping[str, Any]) -> None:
    """ValueError naming the field for a value outside the field's ``choices`` (None passes where it is the
    default) and for a float that is not finite."""
    for f in fields:
        choices, value = f.metadata.get("choices"), values[f.name]
        if choices and value not in choices and not (value is None and f.default is None):
            raise ValueError(f"{f.name} must be one of {list(choices)}, got {value!r}")
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"{f.name} must be finite, got {value!r}")


def check_types(cls, values: dict[str, Any], *, source: str = "config") -> None:
    """ValueError naming the field when a value's type does not fit the field's annotation (``max_steps: "two"``
    in a YAML file would otherwise fail deep inside training). pydantic judges, in strict mode, as YAML/JSON give
    values: an int fits a float, None an Optional, a list of str a ``list[str]``; a bool is not an int, "3" not a
    number."""
    from pydantic import TypeAdapter, ValidationError

    hints = config_fields(cls)[1]
    for name, value in values.items():
        if name not in hints:
            continue
        try:
            TypeAdapter(hints[name]).validate_python(value, strict=True)
        except ValidationError:
            want = str(hints[name]).replace("typing.", "").replace("<class '", "").replace("'>", "")
            raise ValueError(f"{source}: {name} must be of type {want}, got {value!r} ({type(value).__name__})") from None


def load_config_file(path: str | Path) -> dict[str, Any]:
    """Read a YAML or JSON config file into a dict; keys may use dashes or underscores. ``path`` may also
    name a preset that ships with the package (``late-decisions``, :mod:`zcvae.presets`); a file of
    that name in the working directory wins."""
    from zcvae.presets import preset_names, preset_path

    path = Path(path)
    if not path.is_file() and preset_path(str(path)) is not None:
        path = preset_path(str(path))
    if not path.is_file():
        raise ValueError(f"config file {path} does not exist (nor is it a preset: {', '.join(preset_names())})")
    text = path.read_text()
    try:
        if path.suffix in (".yaml", ".yml"):
            import yaml

            data = yaml.safe_load(text) or {}
        else:
            data = json.loads(text)
    except Exception as err:  # noqa: BLE001 - re-raised with the file name
        raise ValueError(f"config file {path} could not be parsed: {err}") from err
    if not isinstance(data, dict):
        raise ValueError(f"config file {path} must hold a mapping of field names to values")
    return {str(k).replace("-", "_"): v for k, v in data.items()}


def resolve_scale_factors(cfg: TrainConfig, *, mean_num_tokens: float) -> TrainConfig:
    """``cfg`` with the factors that ``kl_weight_scale`` and ``reconstruction_weight_scale`` ask for, read
    from the data (``mean_num_tokens``: the validation mean of n_i); a factor already set (a resumed run)
    stays. The trainer calls this once, before the first step, and records both in run_config.json."""
    o = cfg.objective
    if o.kl_weight_scale == "tokens" and o.kl_weight_factor is None:
        # the explicit beta control of sum aggregation: sum scales reconstruction by ~mean n_i, so
        # beta x mean n_i keeps the KL's share of J where mean aggregation has it (docs/objective.md)
        cfg = cfg.replace(kl_weight_factor=float(mean_num_tokens))
        logger.info(f"[kl] kl-weight-scale tokens: beta {o.kl_weight:g} x validation mean n_i {mean_num_tokens:.4g} = {cfg.effective_kl_weight:.4g}")
    if o.reconstruction_weight_scale == "tokens" and o.reconstruction_weight_factor is None:
        # mean (and token) aggregation divide each example's reconstruction by about n_i while the KL stays per
        # example: x mean n_i gives the mode-unit terms a sequence's size against the KL, and under mean every
        # example still weighs the same; a sum has that size already, up to its constant C
        if o.reconstruction_loss_token_aggregation_mode == "sum":
            factor, what = (o.reconstruction_loss_sum_scale or 1.0), "the sum's scale C"
        else:
            factor, what = float(mean_num_tokens), "validation mean n_i"
        cfg = cfg.replace(reconstruction_weight_factor=factor)
        logger.info(f"[recon] reconstruction-weight-scale tokens: the raw and tok weights x {what} {factor:.4g}")
    return cfg


def kl_weight_at(cfg: TrainConfig, step: int, *, delay_end: int | None = None) -> float:
    """beta at optimizer step ``step`` (0-based) under the configured schedule, times ``kl_weight_factor``.

    ``kl_delay_mode`` read: ``delay_end`` is the step the delay ended at (``zcvae.train.kl_delay.KLDelay``), None
    while it lasts (beta 0); from there beta ramps over ``kl_ramp_fraction`` of the steps, as after a fixed delay."""
    o, max_steps = cfg.objective, cfg.optimization.max_steps
    if o.kl_schedule == "constant":
        return cfg.effective_kl_weight
    if o.kl_delay_mode == "read":
        if delay_end is None or step < delay_end:
            return 0.0
        if o.kl_ramp_fraction == 0:
            return cfg.effective_kl_weight
        # the fixed schedule's expression with its delay end moved: a delay that ends at the fixed step gives its betas
        return cfg.effective_kl_weight * min(1.0, (step / max_steps - delay_end / max_steps) / o.kl_ramp_fraction)
    period = max_steps if o.kl_schedule == "delay-ramp" else max(1, max_steps // o.kl_cycles)
    frac = (step % period) / period if o.kl_schedule == "cyclical" else step / period
    if frac < o.kl_delay_fraction:
        return 0.0
    if o.kl_ramp_fraction == 0:
        return cfg.effective_kl_weight
    return cfg.effective_kl_weight * min(1.0, (frac - o.kl_delay_fraction) / o.kl_ramp_fraction)


def kl_delay_end(cfg: TrainConfig) -> int | None:
    """The number of optimizer steps after which beta first leaves 0 (the end of the first KL delay), or None when
    there is no delay (a constant schedule, ``kl_delay_fraction`` 0, or a zero KL weight) or beta never leaves 0. The
    trainer evaluates there once: whether the decoder reads z when the KL starts to price it
    (``zcvae.eval.verdict.delay_end_note``)."""
    max_steps = cfg.optimization.max_steps
    if cfg.objective.kl_delay_mode == "read":
        return None  # it ends on evidence: the trainer evaluates there when it does (zcvae.train.kl_delay)
    if cfg.objective.kl_schedule == "constant" or cfg.objective.kl_delay_fraction == 0:
        return None
    return next((step for step in range(1, max_steps) if kl_weight_at(cfg, step) != 0), None)


def lr_factor_at(cfg: TrainConfig, step: int) -> float:
    """Linear warm-up then cosine decay to ``min_lr_ratio`` of the peak (``core.schedule.lr_multiplier``)."""
    from zcvae.core.schedule import lr_multiplier

    o = cfg.optimization
    return lr_multiplier(step, warmup_steps=o.warmup_steps, max_steps=o.max_steps, min_lr_ratio=o.min_lr_ratio)


# The no-flag default's objective, from its preset file (what the verdict names when it suggests the default).
DEFAULT_OBJECTIVE: str = load_config_file(DEFAULT_PRESET)["objective"]
