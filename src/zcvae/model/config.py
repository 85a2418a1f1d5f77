"""How the backbone becomes a CVAE: :class:`ModelConfig` and the per-architecture LoRA targets.

Plain data, no torch: the config layer and the run directory read it without building a model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from zcvae.strict import StrictDataclass

__all__ = ["DTYPES", "LATENT_TYPES", "POSTERIOR_POOLING", "ModelConfig", "default_lora_targets"]

LATENT_TYPES = ("discrete", "continuous")
DTYPES = ("float32", "bfloat16", "float16", "auto")
POSTERIOR_POOLING = ("last", "mean")

# LoRA targets per architecture: the attention projections (the prototype's choice for Llama). GPT-2's
# attention and MLP both have a `c_proj`, so its default is a regex (peft full-matches a str target).
_LORA_TARGETS: dict[str, list[str] | str] = {
    "llama": ["q_proj", "k_proj", "v_proj", "o_proj"],
    "mistral": ["q_proj", "k_proj", "v_proj", "o_proj"],
    "qwen2": ["q_proj", "k_proj", "v_proj", "o_proj"],
    "qwen3": ["q_proj", "k_proj", "v_proj", "o_proj"],
    "gpt2": r".*\.attn\.(c_attn|c_proj)",
    "gpt_neox": ["query_key_value", "dense"],
}


def default_lora_targets(model_type: str) -> list[str] | str:
    """peft ``target_modules`` for a Hugging Face ``model_type``; ValueError for an unknown one."""
    if model_type not in _LORA_TARGETS:
        raise ValueError(
            f"lora_target_modules: no default for model_type {model_type!r} (known: {sorted(_LORA_TARGETS)}); set it explicitly"
        )
    return _LORA_TARGETS[model_type]


@dataclass
class ModelConfig(StrictDataclass):
    """How the backbone becomes a CVAE. ``from_dict`` rejects unknown keys."""

    latent_type: str = "discrete"
    """"discrete" (K learned z tokens, exact expectation) or "continuous" (Gaussian soft prompts)."""
    num_latents: int = 2
    """K, the number of discrete latents."""
    latent_dim: int = 16
    """D, the Gaussian z dimension."""
    num_z_slots: int = 1
    """M tokens in the z section: discrete, each latent value owns M learned rows (a multi-token
    z-prefix, a remedy for dilution: docs/objective.md#dilution); Gaussian, M soft-prompt embeddings."""
    num_latent_samples: int = 1
    """S reparameterised samples per example (Gaussian)."""
    z_conditioned_norm: bool = False
    """Condition every decoder norm on z (``core.latent.ZConditionedNorm``): ``norm(h) * (1 + scale_z) +
    shift_z`` on the positions from ``<z>`` on, zero at initialisation. The notes' other remedy for the
    single z token, beside ``num_z_slots``. Not with ``gradient_checkpointing``: a layer's recompute runs
    in the backward, outside the pass that says which z each row has."""
    learned_prior: bool = True
    """Gaussian: learned p(z|x) from the </x> state; False = N(0, I)."""
    lora_r: int = 8
    lora_alpha: int = 16
    lora_dropout: float = 0.0
    lora_target_modules: list[str] | None = None
    """None = per-architecture default (see ``default_lora_targets``)."""
    branch_chunk_size: int | None = None
    """Rows of the B*K branch forward run at once. With more than one chunk, each chunk is
    checkpointed as a whole (rebuilt in the backward, exact), so peak branch memory grows with this,
    not with K. None = all rows at once (``branch_chunk_rows``)."""
    z_init_noise: float = 0.1
    """z rows start as the <znull> row (or the mean embedding) plus noise of this fraction of its norm."""
    gradient_checkpointing: bool = False
    trust_remote_code: bool = False
    """Only behind this explicit flag: a local model directory may ship code."""
    dtype: str = "float32"
    """Backbone weight dtype on load: float32 | bfloat16 | float16 | auto (as saved)."""
    disable_backbone_dropout: bool = True
    """Set the backbone's own dropout to 0 (LoRA dropout is separate): the K branches of one example,
    the reference pass and a (world, accumulation) re-split must see the same function."""
    posterior_pooling: str = "last"
    """What the posterior q(z|x,y) reads: ``last``, the final hidden state at ``</y>``; ``mean``, the
    mean of the final hidden states over ``<y> y </y>``. A late decision (the strategy shows mid-y, and
    the strategies end alike) is in the states right after it, which next-token prediction must keep,
    but not necessarily in the ``</y>`` state, which only has to predict ``<eos>``."""
    share_x_prefix: bool = True
    """Train mode: run ``<bos> <x> {x} </x>`` once per example and reuse its keys and values (gradients
    flow through them) for the router's z-free suffix and every branch, instead of re-running x in
    each of the 1 + K rows. Exact: losses and gradients equal the full-sequence path to float noise
    (tests/unit/model/test_prefix_sharing.py), with gradient checkpointing too (a replay-safe cache, see
    ``hf_compat.replay_safe_cache``). Falls back to the full path, with a one-time warning naming the reason,
    for sliding-window attention shorter than the batch, for checkpointing done outside transformers'
    GradientCheckpointingLayer, and for an architecture whose forward takes no cache or position
    ids. False = always the full path."""
    train_fresh_markers: bool = False
    """Template markers (and ``<znull>``) that the backbone's tokenizer lacked, added fresh here, train
    as peft trainable tokens like the z rows: their input rows, and their output-head rows when the
    head is not tied to the input embedding. Off, they stay frozen mean rows, and the ``</y>`` logit
    stays at the mean of the others, so greedy decoding never closes y. Backbones that already know
    the markers (an entangled checkpoint, ``zcvae pretrain``) are unaffected."""

    def __post_init__(self) -> None:
        def positive_int(name: str) -> None:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")

        if self.latent_type not in LATENT_TYPES:
            raise ValueError(f"latent_type must be one of {LATENT_TYPES}, got {self.latent_type!r}")
        for name in ("num_latents", "latent_dim", "num_z_slots", "num_latent_samples", "lora_r"):
            positive_int(name)
        if isinstance(self.lora_alpha, bool) or not isinstance(self.lora_alpha, (int, float)) or self.lora_alpha <= 0:
            raise ValueError(f"lora_alpha must be > 0, got {self.lora_alpha!r}")
        if not isinstance(self.lora_dropout, (int, float)) or not 0.0 <= self.lora_dropout < 1.0:
            raise ValueError(f"lora_dropout must be in [0, 1), got {self.lora_dropout!r}")
        if self.lora_target_modules is not None and (
            not isinstance(self.lora_target_modules, (list, tuple))
            or not self.lora_target_modules
            or not all(isinstance(t, str) and t for t in self.lora_target_modules)
        ):
            raise ValueError(f"lora_target_modules must be None or a non-empty list of names, got {self.lora_target_modules!r}")
        if self.branch_chunk_size is not None:
            positive_int("branch_chunk_size")
        if not isinstance(self.z_init_noise, (int, float)) or not math.isfinite(self.z_init_noise) or self.z_init_noise < 0:
            raise ValueError(f"z_init_noise must be a finite number >= 0, got {self.z_init_noise!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.posterior_pooling not in POSTERIOR_POOLING:
            raise ValueError(f"posterior_pooling must be one of {POSTERIOR_POOLING}, got {self.posterior_pooling!r}")
        if not isinstance(self.share_x_prefix, bool):
            raise ValueError(f"share_x_prefix must be a bool, got {self.share_x_prefix!r}")
        if not isinstance(self.z_conditioned_norm, bool):
            raise ValueError(f"z_conditioned_norm must be a bool, got {self.z_conditioned_norm!r}")
        if self.z_conditioned_norm and self.gradient_checkpointing:
            raise ValueError("z_conditioned_norm does not work with gradient_checkpointing: a checkpointed layer is re-run in "
                             "the backward, outside the branch pass that says which z each row has; turn one of them off "
                             "(branch_chunk_size bounds the branches' memory instead)")
        if not isinstance(self.train_fresh_markers, bool):
            raise ValueError(f"train_fresh_markers must be a bool, got {self.train_fresh_markers!r}")
