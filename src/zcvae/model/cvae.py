"""The CVAE around a Hugging Face causal LM: z tokens, LoRA, router heads and the reference pass.

One module, one entry point. Every pass goes through ``ZCVAE.forward(batch, mode=...)`` because the
scale-out engines (DeepSpeed ZeRO-3, FSDP2) gather sharded weights only when the *wrapped* module is
called; the trainer calls ``engine.module(batch, mode=...)``.

Modes
    "reference"  frozen backbone (adapters disabled), z-free template -> (ref_nll_BN, mask_BN)
    "train"      router pass + all K branches (discrete) or S samples (Gaussian) -> CVAEOutput
    "encode"     router pass only (posterior/prior, z-free adapted NLL) -> CVAEOutput without branches
    "decode"     next-token logits at the last non-pad position of given rows -> logits_RV

Discrete latent (``latent_type="discrete"``): z is one of K values; value k owns M new tokens
(``<z_k>`` for M = 1, ``<z_k_1> .. <z_k_M>`` for M > 1, see ``templates.latent_token_texts``) written
into the M z slots of ``<bos> <x> {x} </x> <z> z_k^1 .. z_k^M </z> <y> {y} </y> <eos>``. One LoRA-adapted pass over the z-free
template gives the prior p(z|x) from the final hidden state at ``</x>`` (causal: it has seen x only)
and the posterior q(z|x,y) from the state at ``</y>``; the K branches then run as one batched forward
of B*K rows (optionally in chunks, each rebuilt in the backward so branch memory does not grow with K),
and the trainer takes the exact expectation over q. Every pass runs the decoder only; the LM head is
applied at the supervised positions, in chunks (``core.losses.supervised_token_nll``).

Gaussian latent (``latent_type="continuous"``): q(z|x,y) = N(mu, diag e^logvar) from the ``</y>``
state, p(z|x) learned from ``</x>`` (or N(0, I)); S reparameterised samples are projected to M
soft-prompt offsets added to the ``<znull>`` slot embeddings of the z-conditioned template.

Shape legend: B batch, T z-free length, S z-conditioned length, V vocabulary, H hidden size,
K branches (discrete latents, or Gaussian samples), N supervised span (left-aligned), D latent
dimension, M z slots, R rows of a branch forward (B*K) or of a decode call.
"""

from __future__ import annotations

import contextlib
import inspect
import math
import os
import warnings
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from zcvae.core.latent import (
    DiscreteRouter,
    GaussianRouter,
    SoftPromptProjection,
    categorical_kl,
    entropy,
    gaussian_entropy,
    gaussian_kl,
    inter_latent_divergence,
)
from zcvae.core.losses import gather_span, supervised_token_nll, token_nll
from zcvae.templates import IGNORE_INDEX, ZNULL, Batch, TemplateTokens, missing_markers, prepare_tokenizer
from zcvae.strict import StrictDataclass

__all__ = ["CVAEOutput", "LATENT_TYPES", "MODES", "ModelConfig", "ZCVAE", "default_lora_targets"]

LATENT_TYPES = ("discrete", "continuous")
MODES = ("reference", "train", "encode", "decode")
DTYPES = ("float32", "bfloat16", "float16", "auto")
# float32 logits per chunk of the supervised-token NLL (64 MiB): 341 tokens at V = 49k, 128 at V = 128k
LOGIT_CHUNK_ELEMENTS = 1 << 24

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


POSTERIOR_POOLING = ("last", "mean")


def posterior_state(h_BTH: torch.Tensor, start_B: torch.Tensor, end_B: torch.Tensor, pooling: str) -> torch.Tensor:
    """The posterior's input (B, H): the state at ``end_B`` (``last``) or the mean of the states at
    ``start_B .. end_B`` inclusive (``mean``); both index the T axis of ``h_BTH``."""
    rows = torch.arange(h_BTH.shape[0], device=h_BTH.device)
    if pooling == "last":
        return h_BTH[rows, end_B]
    if pooling != "mean":
        raise ValueError(f"posterior_pooling must be one of {POSTERIOR_POOLING}, got {pooling!r}")
    t_T = torch.arange(h_BTH.shape[1], device=h_BTH.device)
    inside_BT = (t_T[None, :] >= start_B[:, None]) & (t_T[None, :] <= end_B[:, None])
    weights_BT = inside_BT.to(h_BTH.dtype) / (end_B - start_B + 1).to(h_BTH.dtype)[:, None]
    return torch.einsum("bt,bth->bh", weights_BT, h_BTH)


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
    (tests/unit/test_prefix_sharing.py), with gradient checkpointing too (a replay-safe cache, see
    ``_replay_safe_cache``). Falls back to the full path, with a one-time warning naming the reason,
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
        if not isinstance(self.train_fresh_markers, bool):
            raise ValueError(f"train_fresh_markers must be a bool, got {self.train_fresh_markers!r}")


@dataclass
class CVAEOutput:
    """What ``forward(mode="train")`` (and, without the branch fields, ``mode="encode"``) returns.

    All float tensors are float32. "Gaussian" fields are None for the discrete latent and vice versa;
    the branch fields (``token_nll``, ``branch_weights``, ``inter_latent_divergence``) are None in
    encode mode.
    """

    latent_type: str
    mask: torch.Tensor  # (B, N) bool, supervised span positions
    num_supervised: torch.Tensor  # (B,) n_i
    kl: torch.Tensor  # (B,) nats: exact KL(q || p) (discrete) or closed form (Gaussian)
    posterior_entropy: torch.Tensor  # (B,) nats: H(q) (discrete) or differential entropy of q (Gaussian)
    zfree_nll: torch.Tensor  # (B, N) LoRA-adapted z-free token NLL from the router pass
    token_nll: torch.Tensor | None = None  # (B, K, N) z-conditioned token NLL per branch (K = S samples)
    branch_weights: torch.Tensor | None = None  # (B, K) q (differentiable) or 1/S (Gaussian, constant)
    inter_latent_divergence: torch.Tensor | None = None  # (B,) see latent.inter_latent_divergence
    posterior_logits: torch.Tensor | None = None  # (B, K) discrete
    prior_logits: torch.Tensor | None = None  # (B, K) discrete
    mu: torch.Tensor | None = None  # (B, D) Gaussian posterior mean
    logvar: torch.Tensor | None = None  # (B, D)
    prior_mu: torch.Tensor | None = None  # (B, D) zeros when the prior is N(0, I)
    prior_logvar: torch.Tensor | None = None  # (B, D)
    posterior_variance: torch.Tensor | None = None  # (B,) Gaussian: mean_d exp(logvar_d)
    z: torch.Tensor | None = None  # (B, S, D) Gaussian samples used by the branches (train mode)

    @property
    def posterior(self) -> torch.Tensor | None:
        """q(z|x,y) as probabilities (B, K), discrete only."""
        return None if self.posterior_logits is None else self.posterior_logits.softmax(-1)

    @property
    def prior(self) -> torch.Tensor | None:
        return None if self.prior_logits is None else self.prior_logits.softmax(-1)


@contextlib.contextmanager
def adapters_disabled(peft_model: nn.Module):
    """Run the base model: every peft tuner layer (LoRA, trainable tokens) passes its input through.

    Unlike ``PeftModel.disable_adapter()``, this flips only the layers' ``_disable_adapters`` flags and
    never ``requires_grad``: peft's context sets ``requires_grad=False`` on the adapter weights and back
    to True on exit, which under ZeRO-3 broke gradient accumulation of the partitioned trainable-token
    delta ("expand(... size=[0])" in backward) and under FSDP2 toggled the unsharded copies.
    """
    from peft.tuners.tuners_utils import BaseTunerLayer

    layers = [m for m in peft_model.modules() if isinstance(m, BaseTunerLayer)]
    previous = [m._disable_adapters for m in layers]
    for m in layers:
        m._disable_adapters = True
    try:
        yield
    finally:
        for m, flag in zip(layers, previous):
            m._disable_adapters = flag


def _chunks(num_rows: int, chunk: int | None) -> list[slice]:
    step = num_rows if not chunk else chunk
    return [slice(i, min(i + step, num_rows)) for i in range(0, num_rows, max(step, 1))]


def _replay_safe_cache(kv: list[tuple[torch.Tensor, torch.Tensor]] | None = None):
    """A Hugging Face cache whose ``update`` never changes what a later ``update`` returns, so that a
    checkpointed layer replayed in the backward sees exactly what its forward saw.

    ``kv`` None (the prefix pass): each layer records the keys/values it is given and returns them
    unchanged (no past; a replay records equal tensors again). ``kv`` given (a suffix pass): each
    layer returns ``cat(prefix, new)`` and stores nothing. A plain DynamicCache appends, so a replay
    would attend over the prefix twice; that is why transformers drops writable caches inside
    checkpointed layers.
    """
    from transformers.cache_utils import Cache, DynamicCache, DynamicLayer

    class ReplaySafeLayer(DynamicLayer):
        def __init__(self, keys: torch.Tensor | None = None, values: torch.Tensor | None = None) -> None:
            super().__init__()
            self.record = keys is None
            if keys is not None:
                self.keys, self.values, self.device, self.is_initialized = keys, values, keys.device, True

        def update(self, key_states, value_states, *args, **kwargs):
            if self.record:
                self.keys, self.values, self.device, self.is_initialized = key_states, value_states, key_states.device, True
                return key_states, value_states
            return torch.cat([self.keys, key_states], dim=-2), torch.cat([self.values, value_states], dim=-2)

    class ReplaySafeCache(DynamicCache):
        def __init__(self) -> None:  # DynamicCache's own __init__ would build appending layers
            if kv is None:
                Cache.__init__(self, layer_class_to_replicate=ReplaySafeLayer)
            else:
                Cache.__init__(self, layers=[ReplaySafeLayer(k, v) for k, v in kv])

    return ReplaySafeCache()


@contextlib.contextmanager
def _cache_through_checkpointing(hf: nn.Module):
    """Let the replay-safe cache reach checkpointed layers during one shared-prefix forward.

    transformers' ``GradientCheckpointingLayer`` drops a cache argument unless the layer sets
    ``_can_checkpoint_with_cache`` (meant for layers that only read the cache, which is what a
    replay-safe cache makes every layer); some models (GPT-2) also drop it in the decoder when their
    own ``gradient_checkpointing`` flag is on, although the layers do the checkpointing. Both are
    switched for the duration of the call only, so other callers (generate, a plain DynamicCache)
    keep transformers' protection. The layers themselves still checkpoint.
    """
    from transformers.modeling_layers import GradientCheckpointingLayer

    changed = []
    for m in hf.modules():
        if isinstance(m, GradientCheckpointingLayer):
            if m.gradient_checkpointing and not m._can_checkpoint_with_cache:
                changed.append((m, "_can_checkpoint_with_cache"))
                m._can_checkpoint_with_cache = True
        elif getattr(m, "gradient_checkpointing", False) is True:
            changed.append((m, "gradient_checkpointing"))
            m.gradient_checkpointing = False
    try:
        yield
    finally:
        for m, name in changed:
            if name == "_can_checkpoint_with_cache":
                del m._can_checkpoint_with_cache  # back to the class attribute
            else:
                m.gradient_checkpointing = True


@contextlib.contextmanager
def _layer_checkpointing_off(hf: nn.Module):
    """Switch Hugging Face's per-layer checkpointing off for one branch chunk that is itself
    checkpointed (its recompute runs inside this context too, so both see the same layers)."""
    changed = [m for m in hf.modules() if getattr(m, "gradient_checkpointing", False) is True]
    for m in changed:
        m.gradient_checkpointing = False
    try:
        yield
    finally:
        for m in changed:
            m.gradient_checkpointing = True


@dataclass
class _SharedPrefix:
    """``<bos> <x> {x} </x>`` of every example after one forward, right-padded to P columns."""

    kv: list[tuple[torch.Tensor, torch.Tensor]]  # per layer: keys, values (B, heads, P, head_dim), in the graph
    mask_BP: torch.Tensor  # (B, P) long: 1 on the P_i real prefix tokens
    length_B: torch.Tensor  # (B,) P_i = len(x) + 3
    h_prior_BH: torch.Tensor  # (B, H) final hidden state at </x>


def _suffix(ids_BT, mask_BT, labels_BT, start_B, *, pad: int):
    """Columns start_i .. of each right-padded row, re-packed from column 0 and right-padded
    -> (ids_BW, mask_BW, labels_BW), W = the longest suffix."""
    start_B = start_B.to(ids_BT.device)
    length_B = mask_BT.sum(1) - start_B
    W = int(length_B.max())
    cols_W = torch.arange(W, device=ids_BT.device)
    valid_BW = cols_W[None] < length_B[:, None]
    index_BW = (start_B[:, None] + cols_W).clamp(max=ids_BT.shape[1] - 1)
    ids = ids_BT.gather(1, index_BW).masked_fill(~valid_BW, pad)
    labels = labels_BT.gather(1, index_BW).masked_fill(~valid_BW, IGNORE_INDEX)
    return ids, valid_BW.to(mask_BT.dtype), labels


def _disable_dropout(model: nn.Module) -> None:
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
        # Llama-style attention passes a float attribute to the attention kernel instead of a module.
        if isinstance(getattr(module, "attention_dropout", None), float):
            module.attention_dropout = 0.0


def _check_backbone_files(backbone_dir: str) -> None:
    """ValueError naming the file when the backbone's config.json is not JSON or its safetensors
    weights are missing (transformers would raise deep inside, or look for other formats)."""
    import json

    path = os.path.join(backbone_dir, "config.json")
    try:
        with open(path, encoding="utf-8") as f:
            json.load(f)
    except (OSError, ValueError) as err:
        raise ValueError(f"backbone file {path!r} is not valid JSON: {err}") from None
    names = ("model.safetensors", "model.safetensors.index.json")
    if not any(os.path.isfile(os.path.join(backbone_dir, n)) for n in names):
        raise ValueError(f"backbone_dir {backbone_dir!r} has no {names[0]} (nor {names[1]}): zcvae loads safetensors weights only")


class ZCVAE(nn.Module):
    """A causal LM with LoRA adapters, trainable z rows (discrete) or a soft-prompt projection
    (Gaussian), and router heads. Build it with :meth:`from_pretrained`."""

    def __init__(
        self,
        *,
        peft_model: nn.Module,
        tokenizer,
        tokens: TemplateTokens,
        config: ModelConfig,
        router: nn.Module,
        projection: nn.Module | None = None,
    ) -> None:
        super().__init__()
        self.peft_model = peft_model
        self.router = router
        self.projection = projection
        self.tokenizer = tokenizer
        self.tokens = tokens
        self.config = config

    # ------------------------------------------------------------------------------------------
    # Construction
    # ------------------------------------------------------------------------------------------

    @classmethod
    def from_pretrained(
        cls, backbone_dir: str, config: ModelConfig, *, calibration: Batch | None = None, seed: int = 0
    ) -> "ZCVAE":
        """Load a local Hugging Face directory (model + tokenizer, safetensors only) and wrap it.

        Steps, in this order because each depends on the previous one:
        1. tokenizer from the same directory; ``prepare_tokenizer`` adds the markers and K*M latent tokens;
        2. the backbone (``local_files_only``, ``use_safetensors``); its dropout is turned off;
        3. embeddings resized *before* wrapping (ZeRO-3 copies rows only inside a gather), the new
           rows initialised here (z rows from ``<znull>`` + noise, see ``_init_new_rows``);
        4. peft LoRA on the attention projections, with ``trainable_token_indices`` = the z rows (and,
           with ``train_fresh_markers``, the markers the backbone lacked), so only those rows train (a
           small delta parameter; the matrix itself stays frozen, so every other row is bitwise
           unchanged, weight decay included);
        5. router heads (+ soft-prompt projection), and their standardisation statistics from
           ``calibration`` when given. When it is None they are estimated from the first batch that
           reaches ``forward(mode="train"|"encode")``; under data parallelism that batch differs per
           rank, so distributed runs should pass the same ``calibration`` batch on every rank.
        All random initialisation draws from ``seed`` (LoRA A, z-row noise, projection), not from the
        global RNG state, so every rank builds the same model.
        """
        from peft import LoraConfig, get_peft_model
        from transformers import AutoModelForCausalLM, AutoTokenizer

        if not isinstance(config, ModelConfig):
            raise ValueError(f"config must be a ModelConfig, got {type(config).__name__}")
        backbone_dir = os.fspath(backbone_dir)
        if not os.path.isdir(backbone_dir):
            raise ValueError(f"backbone_dir {backbone_dir!r} is not a directory")
        if not os.path.isfile(os.path.join(backbone_dir, "config.json")):
            raise ValueError(f"backbone_dir {backbone_dir!r} has no config.json (not a Hugging Face model directory)")
        _check_backbone_files(backbone_dir)

        try:
            tokenizer = AutoTokenizer.from_pretrained(
                backbone_dir, local_files_only=True, trust_remote_code=config.trust_remote_code
            )
        except (OSError, ValueError) as err:
            raise ValueError(f"backbone_dir {backbone_dir!r}: its tokenizer files could not be read: {err}") from None
        vocab_before = tokenizer.get_vocab()
        num_latent_tokens = config.num_latents if config.latent_type == "discrete" else 0
        tokens = prepare_tokenizer(tokenizer, num_latents=num_latent_tokens, num_z_slots=config.num_z_slots)
        vocab = tokenizer.get_vocab()
        added = sorted(i for t, i in vocab.items() if t not in vocab_before)

        dtype = config.dtype if config.dtype == "auto" else getattr(torch, config.dtype)
        try:
            model = AutoModelForCausalLM.from_pretrained(
                backbone_dir,
                local_files_only=True,
                use_safetensors=True,
                trust_remote_code=config.trust_remote_code,
                dtype=dtype,
            )
        except Exception as err:  # noqa: BLE001 - safetensors/transformers raise several types for a bad file
            raise ValueError(f"backbone_dir {backbone_dir!r}: its weights (model.safetensors) could not be loaded: {type(err).__name__}: {err}") from None
        if config.disable_backbone_dropout:
            _disable_dropout(model)
        model.config.use_cache = False

        rng = torch.Generator().manual_seed(seed)
        old_rows = model.get_input_embeddings().weight.shape[0]
        if len(tokenizer) > old_rows:
            model.resize_token_embeddings(len(tokenizer), mean_resizing=False)
        z_scale = cls._init_new_rows(
            model, tokens=tokens, added=added, old_rows=old_rows, had_znull=ZNULL in vocab_before,
            noise=config.z_init_noise, generator=rng,
        )
        if config.gradient_checkpointing:
            # Non-reentrant: works with inputs that do not require grad and with the no-grad
            # reference pass between training forwards (checked on CPU for ZeRO-2/3 and FSDP2).
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})

        hidden = model.get_input_embeddings().weight.shape[1]
        model_type = getattr(model.config, "model_type", "")
        targets = config.lora_target_modules or default_lora_targets(model_type)
        lora = LoraConfig(
            task_type="CAUSAL_LM",
            r=config.lora_r,
            lora_alpha=config.lora_alpha,
            lora_dropout=config.lora_dropout,
            target_modules=targets,
            fan_in_fan_out=model_type == "gpt2",  # GPT-2 uses Conv1D (transposed weights)
            trainable_token_indices=cls._trainable_token_indices(
                model, latents=tokens.latents,
                fresh_markers=[vocab[t] for t in missing_markers(vocab_before)] if config.train_fresh_markers else [],
            ),
        )
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)  # LoRA A matrices are drawn from the global RNG inside peft
            peft_model = get_peft_model(model, lora)

        projection = None
        if config.latent_type == "discrete":
            router: nn.Module = DiscreteRouter(hidden, config.num_latents)
        else:
            router = GaussianRouter(hidden, config.latent_dim, learned_prior=config.learned_prior)
            projection = SoftPromptProjection(config.latent_dim, config.num_z_slots, hidden)
            projection.reset_parameters(init_scale=config.z_init_noise * z_scale, generator=rng)

        out = cls(peft_model=peft_model, tokenizer=tokenizer, tokens=tokens, config=config, router=router, projection=projection)
        # Hugging Face returns models in eval mode; LoRA dropout and gradient checkpointing only act in
        # train mode, so hand back a module in train mode like any freshly built nn.Module (the
        # evaluation switches to eval mode itself).
        out.train()
        out._decoder()  # the one-time check, before an engine shards the weights
        if calibration is not None:
            out.calibrate(calibration)
        return out

    @staticmethod
    def _trainable_token_indices(model: nn.Module, *, latents: tuple[int, ...], fresh_markers: list[int]) -> list[int] | dict | None:
        """peft ``trainable_token_indices``: the z rows, plus the rows of ``fresh_markers``.

        The markers are predicted (``</y>`` is supervised), so their output-head rows must train too. A
        tied head follows the input rows (peft ties its trainable-token layer to the embedding's); an
        untied head gets its own trainable tokens for the markers only (z tokens are never predicted).
        """
        if not fresh_markers:
            return list(latents) if latents else None
        rows = [*latents, *fresh_markers]
        emb, head = model.get_input_embeddings(), model.get_output_embeddings()
        if head is None or head.weight.data_ptr() == emb.weight.data_ptr():
            return rows
        names = {id(m): n for n, m in model.named_modules()}
        return {names[id(emb)]: rows, names[id(head)]: list(fresh_markers)}

    @staticmethod
    @torch.no_grad()
    def _init_new_rows(
        model: nn.Module,
        *,
        tokens: TemplateTokens,
        added: list[int],
        old_rows: int,
        had_znull: bool,
        noise: float,
        generator: torch.Generator,
    ) -> float:
        """Initialise the rows of newly added tokens; return the norm scale used for z noise.

        z rows: ``<znull>`` row + noise when the backbone already knew ``<znull>`` (it was pretrained
        with ``<znull>`` in the slot, so z_k starts as "no latent" and the decoder is not disturbed);
        otherwise the mean embedding + noise. The noise has norm ``noise`` x the base row's norm
        (x the mean row norm for the mean embedding), in a random direction, so the K rows differ and
        the branches give the router distinct gradients from step 0. Other new markers (a backbone
        that lacked them) get the mean embedding; they train only with ``train_fresh_markers``. New
        rows of an untied output head get the mean output row, so no new token is favoured.
        """
        emb = model.get_input_embeddings().weight  # (V, H)
        base_rows = emb[:old_rows].float()
        mean_row = base_rows.mean(0)
        if had_znull:
            base, scale = emb[tokens.znull].float().clone(), float(emb[tokens.znull].float().norm())
        else:
            base, scale = mean_row, float(base_rows.norm(dim=1).mean())
        latents = set(tokens.latents)
        for row in added:
            if row in latents:
                direction = torch.randn(emb.shape[1], generator=generator)
                value = base + noise * scale * direction / direction.norm().clamp_min(1e-12)
            else:
                value = mean_row
            emb[row] = value.to(emb.dtype)
        out_emb = model.get_output_embeddings()
        if out_emb is not None and out_emb.weight.data_ptr() != emb.data_ptr() and out_emb.weight.shape[0] > old_rows:
            w = out_emb.weight
            w[old_rows:] = w[:old_rows].float().mean(0).to(w.dtype)
            bias = getattr(out_emb, "bias", None)
            if bias is not None:
                bias[old_rows:] = bias[:old_rows].float().mean().to(bias.dtype)
        return scale

    @torch.no_grad()
    def calibrate(self, batch: Batch) -> None:
        """Estimate the router's standardisation statistics from ``batch`` (>= 2 examples).

        Uses the LoRA-adapted hidden states; at construction LoRA B is zero, so they equal the base
        model's. Deterministic and independent of the rank when every rank passes the same batch.
        """
        h_prior, h_post, _, _ = self._router_states(batch, n_span=int(batch.num_supervised.max()))
        self.router.calibrate(h_posterior_BH=h_post, h_prior_BH=h_prior)

    # ------------------------------------------------------------------------------------------
    # Forward
    # ------------------------------------------------------------------------------------------

    def forward(self, batch: Batch | None = None, *, mode: str = "train", **kw):
        """Dispatch on ``mode`` (see the module docstring). Keyword arguments per mode:

        reference/train/encode: ``n_span`` (int, default max n_i of the batch) fixes N.
        train (Gaussian): ``latent_noise`` (B, S, D) standard-normal draws, or ``generator``; default
            the global RNG. Passing the noise makes the samples independent of how a global batch is
            split over ranks and micro-batches.
        decode: ``input_ids`` (R, S), ``attention_mask`` (R, S) (right padding), ``slot_start`` (R,),
            and ``latent_index`` (R,) long (discrete) or ``z`` (R, D) (Gaussian); with neither, the
            rows are decoded as given.
        """
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if mode == "decode":
            return self._decode(**kw)
        if batch is None:
            raise ValueError(f"mode {mode!r} needs a batch")
        if batch.num_z_slots != self.config.num_z_slots:
            raise ValueError(
                f"batch.num_z_slots={batch.num_z_slots} but the model was built with num_z_slots={self.config.num_z_slots}"
            )
        n_span = kw.pop("n_span", None)
        if n_span is None:
            n_span = int(batch.num_supervised.max())  # one host sync; pass n_span to avoid it
        if mode == "reference":
            if kw:
                raise ValueError(f"unexpected arguments for mode 'reference': {sorted(kw)}")
            return self._reference(batch, n_span=n_span)
        return self._cvae(batch, n_span=n_span, branches=mode == "train", **kw)

    def _lm(self, *, input_ids=None, inputs_embeds=None, attention_mask, hidden: bool = False, logits: bool = False, use_cache: bool = False, **extra):
        """One forward of the adapted LM. Unless ``logits`` is asked for, only its decoder runs (when
        ``_decoder()`` allows it) and the output has ``last_hidden_state`` instead of ``logits``: the
        head is applied later, at the supervised positions only (``_span_nll``)."""
        decoder = None if logits else self._decoder()
        module = self.peft_model if decoder is None else decoder
        return module(
            input_ids=input_ids,
            inputs_embeds=inputs_embeds,
            attention_mask=attention_mask,
            use_cache=use_cache,
            output_hidden_states=hidden,
            return_dict=True,
            **extra,
        )

    def _span_nll(self, out, labels_RS: torch.Tensor, *, n_span: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Token NLL of the supervised span of an ``_lm`` output -> (nll_RN, mask_RN), float32."""
        if getattr(out, "logits", None) is not None:  # the full-logits fallback
            return gather_span(token_nll(out.logits, labels_RS), labels_RS, n_span=n_span)
        # V from the tokenizer: under ZeRO-3 the head's weight reads as an empty partition outside its forward
        chunk = max(1, LOGIT_CHUNK_ELEMENTS // len(self.tokenizer))
        return supervised_token_nll(out.last_hidden_state, labels_RS, self.peft_model.get_output_embeddings(), n_span=n_span, chunk_tokens=chunk)

    def _decoder(self) -> nn.Module | None:
        """The backbone's decoder (``base_model``: the model without its LM head) when the LM's logits
        are exactly ``head(decoder(...).last_hidden_state)``, else None (logits come from the full LM).

        Checked once: no logit soft-capping in the config, and the head on the decoder's output equals
        the LM's logits on a 3-token input. Models that scale or cap their logits after the head keep
        the full-logits path."""
        if "_decoder_ok" not in self.__dict__:
            hf = self.peft_model.get_base_model()
            decoder, head = getattr(hf, "base_model", hf), hf.get_output_embeddings()
            ok = decoder is not hf and head is not None and getattr(hf.config, "final_logit_softcapping", None) is None
            # the decoder must take the cache and position arguments that the shared prefix passes the LM
            ok = ok and (self._forward_params() & {"cache", "past_key_values", "position_ids"}) <= set(inspect.signature(decoder.forward).parameters)
            if ok:
                device = next(self.peft_model.parameters()).device
                ids = torch.tensor([[self.tokens.bos, self.tokens.x_open, self.tokens.x_close]], device=device)
                with torch.no_grad():
                    full = self.peft_model(input_ids=ids, use_cache=False, return_dict=True).logits
                    mine = head(decoder(input_ids=ids, use_cache=False, return_dict=True).last_hidden_state)
                ok = full.shape == mine.shape and torch.allclose(mine.float(), full.float(), rtol=1e-6, atol=1e-6)
            self.__dict__["_decoder_ok"] = ok
        return self.peft_model.get_base_model().base_model if self.__dict__["_decoder_ok"] else None

    def _reference(self, batch: Batch, *, n_span: int) -> tuple[torch.Tensor, torch.Tensor]:
        # no_grad, never inference_mode: inference tensors cannot mix with a sharded training graph.
        # Adapters off also disables the trainable z rows; harmless, the z-free template has no z token.
        with torch.no_grad(), adapters_disabled(self.peft_model):
            out = self._lm(input_ids=batch.input_ids, attention_mask=batch.attention_mask)
            return self._span_nll(out, batch.labels, n_span=n_span)  # (B, N), (B, N)

    def _router_states(self, batch: Batch, *, n_span: int):
        """One LoRA-adapted z-free pass -> (h_prior_BH, h_posterior_BH, zfree_nll_BN, mask_BN)."""
        out = self._lm(input_ids=batch.input_ids, attention_mask=batch.attention_mask, hidden=True)
        h_BTH = out.hidden_states[-1]  # final (normed) hidden state
        rows = torch.arange(h_BTH.shape[0], device=h_BTH.device)
        h_prior = h_BTH[rows, batch.x_close_pos.to(h_BTH.device)]  # (B, H) sees x only
        # <y> sits right after the shared prefix <bos> <x> {x} </x>
        h_post = posterior_state(h_BTH, batch.prefix_length.to(h_BTH.device), batch.y_close_pos.to(h_BTH.device), self.config.posterior_pooling)
        zfree_nll, mask = self._span_nll(out, batch.labels, n_span=n_span)
        return h_prior, h_post, zfree_nll, mask

    def _cvae(self, batch: Batch, *, n_span: int, branches: bool, latent_noise=None, generator=None, **kw) -> CVAEOutput:
        if kw:
            raise ValueError(f"unexpected arguments: {sorted(kw)}")
        prefix = None
        if branches and self.config.share_x_prefix:
            blocker = self.prefix_sharing_blocker(batch)
            if blocker is None:
                prefix = self._run_prefix(batch)
            else:
                self._warn_once(f"share_x_prefix: falling back to the full-sequence path: {blocker}")
        if prefix is None:
            h_prior, h_post, zfree_nll, mask = self._router_states(batch, n_span=n_span)
        else:
            h_prior, h_post, zfree_nll, mask = self._router_states_shared(batch, prefix, n_span=n_span)
        if not self.router.calibrated:
            # Lazy data-dependent init (documented in from_pretrained): statistics of this first batch.
            self.router.calibrate(h_posterior_BH=h_post, h_prior_BH=h_prior)
        common = dict(latent_type=self.config.latent_type, mask=mask, num_supervised=batch.num_supervised, zfree_nll=zfree_nll)
        B = batch.input_ids.shape[0]

        if self.config.latent_type == "discrete":
            q_logits, p_logits = self.router(h_posterior_BH=h_post, h_prior_BH=h_prior)  # (B, K) each
            out = CVAEOutput(
                **common,
                kl=categorical_kl(q_logits, p_logits),
                posterior_entropy=entropy(q_logits),
                posterior_logits=q_logits,
                prior_logits=p_logits,
            )
            if branches:
                K = self.config.num_latents
                latent_index_R = torch.arange(K, device=batch.z_input_ids.device).repeat(B)  # r = i*K + k
                nll_BKN = self._discrete_branches(batch, latent_index_R=latent_index_R, n_span=n_span, prefix=prefix).view(B, K, n_span)
                out.token_nll = nll_BKN
                out.branch_weights = q_logits.softmax(-1)  # (B, K) differentiable: the exact expectation
                out.inter_latent_divergence = inter_latent_divergence(nll_BKN, torch.ones_like(q_logits), mask)
            return out

        mu, logvar, prior_mu, prior_logvar = self.router(h_posterior_BH=h_post, h_prior_BH=h_prior)  # (B, D) each
        out = CVAEOutput(
            **common,
            kl=gaussian_kl(mu, logvar, prior_mu, prior_logvar) if self.config.learned_prior else gaussian_kl(mu, logvar),
            posterior_entropy=gaussian_entropy(logvar),
            mu=mu,
            logvar=logvar,
            prior_mu=prior_mu,
            prior_logvar=prior_logvar,
            posterior_variance=logvar.exp().mean(-1),
        )
        if branches:
            S, D = self.config.num_latent_samples, self.config.latent_dim
            if latent_noise is None:
                latent_noise = torch.randn((B, S, D), generator=generator, device=mu.device if generator is None else generator.device)
            if latent_noise.shape != (B, S, D):
                raise ValueError(f"latent_noise must be [{B}, {S}, {D}], got {tuple(latent_noise.shape)}")
            eps = latent_noise.to(device=mu.device, dtype=mu.dtype)
            z_BSD = mu[:, None] + torch.exp(0.5 * logvar)[:, None] * eps  # reparameterised
            nll_BKN = self._soft_prompt_branches(batch, z_RD=z_BSD.reshape(B * S, D), n_span=n_span, prefix=prefix).view(B, S, n_span)
            out.token_nll = nll_BKN
            out.branch_weights = torch.full((B, S), 1.0 / S, device=mu.device)
            out.inter_latent_divergence = inter_latent_divergence(nll_BKN, out.branch_weights, mask)
            out.z = z_BSD
        return out

    # ------------------------------------------------------------------------------------------
    # Shared x prefix
    # ------------------------------------------------------------------------------------------
    # Both templates start with the same P_i = len(x) + 3 tokens <bos> <x> {x} </x>, and by causality
    # nothing after them changes their keys and values. The prefix runs once, right-padded to P
    # columns; each suffix (the router's "<y> y </y> <eos>", a branch's "<z> z </z> <y> y </y> <eos>")
    # then runs on a fresh DynamicCache holding the prefix keys/values of its example, with position
    # ids P_i + j (the positions of the full, unshared rows) and a 2-D mask covering cache + suffix.
    # Right padding leaves holes in the cache (columns P_i .. P-1) that the mask removes; left
    # padding would work too, but its pad queries would have no key to attend to (fully masked
    # softmax rows, NaN in some kernels), which right padding never produces. Gradients reach the
    # prefix through the cached tensors (the cache concatenates, it does not detach). Under
    # non-reentrant activation checkpointing the prefix keys/values are ordinary graph nodes made
    # inside a checkpointed layer: the backward replays that layer once, and the replay-safe cache
    # makes each replay return what its forward returned.

    def prefix_sharing_blocker(self, batch: Batch | None = None) -> str | None:
        """Why a train forward (of ``batch``) would *not* share the x prefix, or None when it would."""
        if not self.config.share_x_prefix:
            return "share_x_prefix=False"
        hf = self.peft_model.get_base_model()
        params = self._forward_params()
        if "position_ids" not in params or not ({"cache", "past_key_values"} & params):
            return f"{type(hf).__name__}.forward takes no position_ids or no cache"
        if torch.is_grad_enabled() and self._layer_checkpointing():
            from transformers.modeling_layers import GradientCheckpointingLayer

            if not any(isinstance(m, GradientCheckpointingLayer) and m.gradient_checkpointing for m in hf.modules()):
                # the replay-safe cache reaches checkpointed layers through GradientCheckpointingLayer only
                return "gradient checkpointing outside transformers' GradientCheckpointingLayer (the KV cache would be dropped)"
        cfg = hf.config
        layer_types = getattr(cfg, "layer_types", None) or ()
        window = getattr(cfg, "sliding_window", None)
        if any(t != "full_attention" for t in layer_types) or (
            window is not None and getattr(cfg, "use_sliding_window", True) and (batch is None or batch.z_input_ids.shape[1] > window)
        ):
            # a sliding window counts cache columns, and the cache of a shared prefix has holes
            return "sliding-window attention (windows would count the padding holes of the shared cache)"
        return None

    def _warn_once(self, message: str) -> None:
        seen = self.__dict__.setdefault("_warned", set())
        if message not in seen:
            seen.add(message)
            warnings.warn(message, stacklevel=3)

    def _forward_params(self) -> frozenset[str]:
        """Parameter names of the Hugging Face model's forward (read once: inspect is slow per step)."""
        if "_hf_forward_params" not in self.__dict__:
            self.__dict__["_hf_forward_params"] = frozenset(inspect.signature(self.peft_model.get_base_model().forward).parameters)
        return self.__dict__["_hf_forward_params"]

    def _cache_kwarg(self) -> str:
        # transformers 5.2x renamed `past_key_values` to `cache` (the old name warns, then goes in 5.40).
        return "cache" if "cache" in self._forward_params() else "past_key_values"

    def _run_prefix(self, batch: Batch) -> _SharedPrefix:
        """One LoRA-adapted forward of ``<bos> <x> {x} </x>`` per example (right-padded)."""
        device = batch.input_ids.device
        length_B = batch.prefix_length.to(device)  # P_i: bos <x> x </x>
        P = int(length_B.max())
        cols_P = torch.arange(P, device=device)
        mask_BP = (cols_P[None] < length_B[:, None]).long()
        ids_BP = batch.input_ids[:, :P].masked_fill(mask_BP == 0, self.tokens.pad)
        cache = _replay_safe_cache()  # records every column of every layer
        kwargs = {self._cache_kwarg(): cache}
        if self._decoder() is None and "logits_to_keep" in self._forward_params():
            kwargs["logits_to_keep"] = 1  # the prefix supervises nothing: skip its (B, P, V) logits
        with _cache_through_checkpointing(self.peft_model.get_base_model()):
            out = self._lm(
                input_ids=ids_BP,
                attention_mask=mask_BP,
                position_ids=cols_P[None].expand(ids_BP.shape[0], P),
                use_cache=True,
                hidden=True,
                **kwargs,
            )
        kv = [(layer.keys, layer.values) for layer in cache.layers]
        h_BPH = out.hidden_states[-1]
        rows = torch.arange(h_BPH.shape[0], device=device)
        return _SharedPrefix(kv=kv, mask_BP=mask_BP, length_B=length_B, h_prior_BH=h_BPH[rows, length_B - 1])

    def _lm_after_prefix(
        self, prefix: _SharedPrefix, *, rows: slice | None = None, reps: int = 1, attention_mask, input_ids=None, inputs_embeds=None, hidden: bool = False
    ):
        """A suffix forward on the cached prefix. Its rows are ``rows`` of the layout r = i*reps + k
        (all B*reps when None); ``attention_mask`` (R, W) covers the suffix only."""
        B = prefix.mask_BP.shape[0]
        lo, hi = (0, B * reps) if rows is None else (rows.start, rows.stop)
        e0, e1 = lo // reps, (hi - 1) // reps + 1  # the examples these rows belong to

        def repeat(t: torch.Tensor) -> torch.Tensor:
            # expand + reshape rather than index_select: its backward is a sum over the copies, where
            # index_select's is a scatter-add
            if reps == 1 and (e0, e1) == (0, B):
                return t
            t = t[e0:e1]
            t = t.unsqueeze(1).expand(t.shape[0], reps, *t.shape[1:]).reshape(-1, *t.shape[1:])
            return t[lo - e0 * reps : hi - e0 * reps]

        kv = [(repeat(k), repeat(v)) for k, v in prefix.kv]
        mask_RP, start_R = repeat(prefix.mask_BP), repeat(prefix.length_B)
        W = attention_mask.shape[1]
        position_RW = start_R[:, None] + torch.arange(W, device=start_R.device)
        with _cache_through_checkpointing(self.peft_model.get_base_model()):
            return self._lm(
                input_ids=input_ids,
                inputs_embeds=inputs_embeds,
                attention_mask=torch.cat([mask_RP, attention_mask.to(mask_RP.dtype)], dim=1),
                position_ids=position_RW,
                use_cache=True,
                hidden=hidden,
                **{self._cache_kwarg(): _replay_safe_cache(kv)},
            )

    def _router_states_shared(self, batch: Batch, prefix: _SharedPrefix, *, n_span: int):
        """``_router_states`` on the shared prefix: the z-free suffix ``<y> y </y> <eos>`` only."""
        ids_BW, mask_BW, labels_BW = _suffix(batch.input_ids, batch.attention_mask, batch.labels, prefix.length_B, pad=self.tokens.pad)
        out = self._lm_after_prefix(prefix, input_ids=ids_BW, attention_mask=mask_BW, hidden=True)
        h_BWH = out.hidden_states[-1]
        # The suffix starts at <y>: column 0.
        y_close_B = batch.y_close_pos.to(h_BWH.device) - prefix.length_B
        h_post = posterior_state(h_BWH, torch.zeros_like(y_close_B), y_close_B, self.config.posterior_pooling)
        zfree_nll, mask = self._span_nll(out, labels_BW, n_span=n_span)
        return prefix.h_prior_BH, h_post, zfree_nll, mask

    def _branch_rows(self, batch: Batch, *, reps: int, prefix: _SharedPrefix | None):
        """The z-conditioned rows r = i*reps + k, full or (with ``prefix``) their suffixes after </x>
        -> ids_RS, mask_RS, labels_RS, slot_start_R (column of the first slot)."""
        if prefix is None:
            ids, mask, labels, slot = batch.z_input_ids, batch.z_attention_mask, batch.z_labels, batch.z_slot_start
        else:
            ids, mask, labels = _suffix(batch.z_input_ids, batch.z_attention_mask, batch.z_labels, prefix.length_B, pad=self.tokens.pad)
            slot = batch.z_slot_start.to(prefix.length_B.device) - prefix.length_B  # = 1, after <z>
        example_R = torch.arange(ids.shape[0], device=ids.device).repeat_interleave(reps)
        return ids[example_R], mask[example_R], labels[example_R], slot.to(ids.device)[example_R]

    def _branch_lm(self, prefix: _SharedPrefix | None, rows: slice, reps: int, **inputs):
        if prefix is None:
            return self._lm(**inputs)
        return self._lm_after_prefix(prefix, rows=rows, reps=reps, **inputs)

    def _discrete_branches(self, batch: Batch, *, latent_index_R: torch.Tensor, n_span: int, prefix: _SharedPrefix | None = None) -> torch.Tensor:
        """Rows r = i*K + k: example i with latent latent_index_R[r] in its slot -> nll_RN."""
        R = latent_index_R.shape[0]
        reps = R // batch.z_input_ids.shape[0]
        ids_RS, mask_RS, labels_RS, slot_R = self._branch_rows(batch, reps=reps, prefix=prefix)
        ids_RS = self._write_latent(ids_RS, slot_R, latent_index_R)

        def chunk_nll(c: slice) -> torch.Tensor:
            out = self._branch_lm(prefix, c, reps, input_ids=ids_RS[c], attention_mask=mask_RS[c])
            return self._span_nll(out, labels_RS[c], n_span=n_span)[0]

        return self._run_branch_chunks(R, len(batch), chunk_nll)  # (R, N)

    def _write_latent(self, ids_RS: torch.Tensor, slot_start_R: torch.Tensor, latent_index_R: torch.Tensor) -> torch.Tensor:
        """A copy of ``ids_RS`` with latent value latent_index_R[r]'s M tokens in row r's slots
        slot_start_R[r] .. + M - 1."""
        device = ids_RS.device
        slots_KM = torch.tensor(self.tokens.latent_slots, device=device)  # (K, M)
        M = slots_KM.shape[1]
        pos_RM = slot_start_R.to(device)[:, None] + torch.arange(M, device=device)
        return ids_RS.scatter(1, pos_RM, slots_KM[latent_index_R.to(device)])

    def _slot_embeds(self, ids_RS: torch.Tensor, slot_start_R: torch.Tensor, z_RD: torch.Tensor) -> torch.Tensor:
        """Input embeddings with the M slot embeddings offset by the projected z -> (R, S, H)."""
        embeds = self.peft_model.get_input_embeddings()(ids_RS)  # (R, S, H)
        M, H = self.config.num_z_slots, embeds.shape[-1]
        pos_RM = slot_start_R.to(ids_RS.device)[:, None] + torch.arange(M, device=ids_RS.device)
        index = pos_RM[..., None].expand(-1, -1, H)
        slots = embeds.gather(1, index) + self.projection(z_RD).to(embeds.dtype)  # (R, M, H)
        return embeds.scatter(1, index, slots)

    def _soft_prompt_branches(self, batch: Batch, *, z_RD: torch.Tensor, n_span: int, prefix: _SharedPrefix | None = None) -> torch.Tensor:
        R = z_RD.shape[0]
        reps = R // batch.z_input_ids.shape[0]
        ids_RS, mask_RS, labels_RS, slot_R = self._branch_rows(batch, reps=reps, prefix=prefix)

        def chunk_nll(c: slice) -> torch.Tensor:
            embeds = self._slot_embeds(ids_RS[c], slot_R[c], z_RD[c])
            out = self._branch_lm(prefix, c, reps, inputs_embeds=embeds, attention_mask=mask_RS[c])
            return self._span_nll(out, labels_RS[c], n_span=n_span)[0]

        return self._run_branch_chunks(R, len(batch), chunk_nll)  # (R, N)

    def branch_chunk_rows(self, num_examples: int) -> int | None:
        """Rows per branch chunk of a train forward of ``num_examples`` examples (None = all at once):
        ``branch_chunk_size`` when set, else all rows at once.

        Why not chunk by default under activation checkpointing: layer checkpointing already keeps a
        layer's activations only, so one chunk's memory grew little with K on SmolLM2-135M (K=4 2540,
        K=8 2607 MiB), while B-row chunks switch layer checkpointing off inside each chunk and cost more
        time and memory (K=4: 4.01x vs 3.15x the LoRA step, 2690 MiB; BENCHMARKS.md, the SmolLM2 chunk table)."""
        del num_examples  # the chunk size does not depend on the batch; kept for callers' clarity
        return self.config.branch_chunk_size

    def _layer_checkpointing(self) -> bool:
        return any(getattr(m, "gradient_checkpointing", False) is True and m.training for m in self.peft_model.get_base_model().modules())

    def _run_branch_chunks(self, num_rows: int, num_examples: int, chunk_nll) -> torch.Tensor:
        """``cat([chunk_nll(c) for c in chunks])`` -> (R, N), with bounded activation memory.

        With gradients on and more than one chunk, each chunk runs under non-reentrant activation
        checkpointing as a whole: its forward keeps nothing but its inputs and its (r, N) NLL, and the
        backward re-runs it and back-propagates through it one chunk at a time, so peak branch memory
        grows with the chunk size, not with K. Exact (a deterministic recompute; dropout RNG states
        are replayed): every gradient, through q, the KL and the inter-latent divergence too, equals
        the unchunked path (tests/unit/test_branch_chunks.py). Cost: one more forward of the branch
        rows, except under layer checkpointing, which is switched off inside a chunk (the chunk is
        the checkpoint) so the total stays one forward + one recompute + one backward.
        """
        slices = _chunks(num_rows, self.branch_chunk_rows(num_examples))
        if not (torch.is_grad_enabled() and len(slices) > 1):
            return torch.cat([chunk_nll(c) for c in slices], 0)
        from torch.utils.checkpoint import checkpoint

        hf = self.peft_model.get_base_model()

        def isolated(c: slice) -> torch.Tensor:
            with _layer_checkpointing_off(hf):
                return chunk_nll(c)

        # No metadata check of the recomputed saved tensors: under ZeRO-3 a saved parameter reads as its
        # empty partition between its module's forward and backward hooks (its value is gathered
        # again before use, as in any ZeRO-3 backward); equality is what the tests check.
        return torch.cat([checkpoint(isolated, c, use_reentrant=False, determinism_check="none") for c in slices], 0)

    def _decode(
        self,
        *,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        slot_start: torch.Tensor | None = None,
        latent_index: torch.Tensor | None = None,
        z: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Next-token logits (R, V), float32, at the last attended position of each row.

        A full recompute per call (no KV cache): the evaluation calls it a fixed number of times so
        every rank runs the same number of forwards. Rows must be right-padded.
        """
        if input_ids.dim() != 2 or attention_mask.shape != input_ids.shape:
            raise ValueError(f"input_ids and attention_mask must both be [R, S], got {tuple(input_ids.shape)} and {tuple(attention_mask.shape)}")
        if (latent_index is not None or z is not None) and slot_start is None:
            raise ValueError("decode with a latent needs slot_start")
        if latent_index is not None and z is not None:
            raise ValueError("pass latent_index (discrete) or z (Gaussian), not both")
        if z is not None and self.config.latent_type != "continuous":
            raise ValueError("z is for the Gaussian latent; pass latent_index for the discrete one")
        R, S = input_ids.shape
        if latent_index is not None:
            if self.config.latent_type != "discrete":
                raise ValueError("latent_index is for the discrete latent; pass z for the Gaussian one")
            input_ids = self._write_latent(input_ids, slot_start, latent_index)
        positions = torch.arange(S, device=input_ids.device)
        last_R = (attention_mask.long() * positions).argmax(1)  # last position with mask 1
        with torch.no_grad():
            parts = []
            for c in _chunks(R, self.config.branch_chunk_size):
                if z is not None:
                    embeds = self._slot_embeds(input_ids[c], slot_start[c], z[c].to(input_ids.device))
                    logits = self._lm(inputs_embeds=embeds, attention_mask=attention_mask[c], logits=True).logits
                else:
                    logits = self._lm(input_ids=input_ids[c], attention_mask=attention_mask[c], logits=True).logits
                rows = torch.arange(logits.shape[0], device=logits.device)
                parts.append(logits[rows, last_R[c]].float())  # (r, V)
        return torch.cat(parts, 0)

    # ------------------------------------------------------------------------------------------
    # Optimisation helpers
    # ------------------------------------------------------------------------------------------

    def _latent_named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """z rows (peft's trainable-token delta) + router/prior heads + projection, in a fixed order."""
        out = [(n, p) for n, p in self.named_parameters() if "trainable_tokens_delta" in n]
        out += [(f"router.{n}", p) for n, p in self.router.named_parameters()]
        if self.projection is not None:
            out += [(f"projection.{n}", p) for n, p in self.projection.named_parameters()]
        return out

    def _lora_named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        latent = {id(p) for _, p in self._latent_named_parameters()}
        return [(f"peft_model.{n}", p) for n, p in self.peft_model.named_parameters() if p.requires_grad and id(p) not in latent]

    def param_groups(
        self, *, lora_lr: float, latent_lr: float, weight_decay: float, latent_weight_decay: float | None = None
    ) -> list[dict]:
        """Two optimizer groups: "lora" (adapter weights) and "latent" (z rows, router/prior heads,
        projection). ``latent_weight_decay`` defaults to ``weight_decay``; the prototype used 0 for
        both. The frozen embedding matrix is in neither group, so weight decay never touches it."""
        lwd = weight_decay if latent_weight_decay is None else latent_weight_decay
        return [
            {"name": "lora", "params": [p for _, p in self._lora_named_parameters()], "lr": lora_lr, "weight_decay": weight_decay},
            {"name": "latent", "params": [p for _, p in self._latent_named_parameters()], "lr": latent_lr, "weight_decay": lwd},
        ]

    def check_trainable(self, optimizer_params: Iterable[nn.Parameter]) -> None:
        """RuntimeError naming every z-row/router/prior/projection (and LoRA) parameter that does not
        require grad or is missing from ``optimizer_params`` (a parameter never optimised is a bug that
        looks exactly like posterior collapse). Accepts parameters or param-group dicts."""
        ids = set()
        for item in optimizer_params:
            if isinstance(item, dict):
                ids.update(id(p) for p in item["params"])
            else:
                ids.add(id(item))
        latent = self._latent_named_parameters()
        if self.config.latent_type == "discrete" and not any("trainable_tokens_delta" in n for n, _ in latent):
            raise RuntimeError("no trainable z rows (trainable_tokens_delta) found in the model")
        bad = [
            f"{n} ({'requires_grad=False' if not p.requires_grad else 'not in the optimizer'})"
            for n, p in latent + self._lora_named_parameters()
            if not p.requires_grad or id(p) not in ids
        ]
        if bad:
            raise RuntimeError(f"parameters that would not be trained: {', '.join(bad)}")
