"""The CVAE around a Hugging Face causal LM: z tokens, LoRA, router heads and the reference pass.

One method per pass, each with one return type:

    reference(batch)      frozen backbone (adapters disabled), z-free template -> (ref_nll_BN, mask_BN);
                          after ``add_reference_adapter``, the reference adapter instead (a copy of the
                          trained adapter that ``refresh_reference`` renews: the dynamic reference)
    train_forward(batch)  router pass + all K branches (discrete) or S samples (Gaussian) -> CVAEOutput
    encode(batch)         router pass only (posterior/prior, z-free adapted NLL) -> CVAEOutput without branches
    decode(input_ids=...) next-token logits at the last non-pad position of given rows -> logits_RV

Inside an engine, call them through the wrapped module, ``engine.module(batch, mode="train")``:
the scale-out engines (DeepSpeed ZeRO-3, FSDP2, DDP) gather sharded weights and hook gradients only
when the *wrapped* module is called, so ``forward`` is kept as the one entry they see; it only
dispatches on ``mode`` (``MODES``) to the method above, and is typed per mode.

Discrete latent (``latent_type="discrete"``): z is one of K values; value k owns M new tokens
(``<z_k>`` for M = 1, ``<z_k_1> .. <z_k_M>`` for M > 1, see ``zcvae.data.encoding.latent_token_texts``) written
into the M z slots of ``<bos> <x> {x} </x> <z> z_k^1 .. z_k^M </z> <y> {y} </y> <eos>``. One LoRA-adapted pass over the z-free
template gives the prior p(z|x) from the final hidden state at ``</x>`` (causal: it has seen x only)
and the posterior q(z|x,y) from the state at ``</y>``; the K branches then run as one batched forward
of B*K rows (optionally in chunks, each rebuilt in the backward so branch memory does not grow with K,
``model.branches``), and the trainer takes the exact expectation over q. Every pass runs the decoder
only; the LM head is applied at the supervised positions, in chunks (``core.losses.supervised_token_nll``).

Gaussian latent (``latent_type="continuous"``): q(z|x,y) = N(mu, diag e^logvar) from the ``</y>``
state, p(z|x) learned from ``</x>`` (or N(0, I)); S reparameterised samples are projected to M
soft-prompt offsets added to the ``<znull>`` slot embeddings of the z-conditioned template.

Where the rest lives: ``model.config`` (ModelConfig), ``model.build`` (loading, LoRA, new rows),
``model.prefix`` (the shared x prefix), ``model.branches`` (branch rows and chunks) and
``model.hf_compat`` (every use of transformers' and peft's internals).

Shape legend: B batch, T z-free length, S z-conditioned length, V vocabulary, H hidden size,
K branches (discrete latents, or Gaussian samples), N supervised span (left-aligned), D latent
dimension, M z slots, R rows of a branch forward (B*K) or of a decode call, W suffix length.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Literal, overload

import torch
from torch import nn

from zcvae.core.latent import ZConditionedNorm, categorical_kl, entropy, gaussian_entropy, gaussian_kl, inter_latent_divergence
from zcvae.core.losses import gather_span, supervised_token_nll, token_nll
from zcvae.model import branches, build, hf_compat, prefix as shared, sharded
from zcvae.model.config import POSTERIOR_POOLING, ModelConfig
from zcvae.model.decoding import KVCache
from zcvae.data.encoding import Batch, TemplateTokens

__all__ = ["CVAEOutput", "MODES", "REFERENCE_ADAPTER", "ZCVAE", "posterior_state"]

MODES = ("reference", "train", "encode", "decode", "calibrate")
# the peft adapter that holds the following reference's copy of the trained adapter (docs/objective.md#the-following-reference)
REFERENCE_ADAPTER = "reference"
# float32 logits per chunk of the supervised-token NLL (64 MiB): 341 tokens at V = 49k, 128 at V = 128k
LOGIT_CHUNK_ELEMENTS = 1 << 24


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
class CVAEOutput:
    """What ``ZCVAE.train_forward`` (and, without the branch fields, ``ZCVAE.encode``) returns.

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
        # Read once: inspect is slow per step. The names say which cache/position keywords the LM takes.
        self._hf_forward_params: frozenset[str] = hf_compat.forward_parameter_names(peft_model.get_base_model())
        # Whether the decoder alone (+ head at the supervised positions) reproduces the LM's logits;
        # None until ``_decoder()`` first checks it (from_pretrained does, before an engine shards).
        self._decoder_ok: bool | None = None
        self._warned: set[str] = set()  # fallback warnings already given (each once per model)
        self._pending: sharded.PendingWeights | None = None  # a sharded build's weights, until materialize_weights
        self._built_sharded = False
        # --z-conditioned-norm: a scale and shift of every decoder norm per z, applied by hooks during the
        # passes that say which z each row has (the branches and decoding); None elsewhere (prefix, router,
        # reference: z-free)
        self.z_norm: ZConditionedNorm | None = None
        self._z_condition: tuple[torch.Tensor, torch.Tensor | None] | None = None
        if config.z_conditioned_norm:
            norms = hf_compat.decoder_norms(peft_model.get_base_model())
            hidden = sharded.full_shape(hf_compat.embedding_weight(peft_model.get_input_embeddings()))[1]
            discrete = config.latent_type == "discrete"
            self.z_norm = ZConditionedNorm(len(norms), hidden, num_latents=config.num_latents if discrete else None,
                                           latent_dim=None if discrete else config.latent_dim)
            for index, norm in enumerate(norms):
                norm.register_forward_hook(functools.partial(self._condition_norm, index))

    # ------------------------------------------------------------------------------------------
    # Construction
    # ------------------------------------------------------------------------------------------

    @classmethod
    def from_pretrained(
        cls, backbone_dir: str, config: ModelConfig, *, calibration: Batch | None = None, seed: int = 0, loading: "sharded.ShardedLoading | None" = None
    ) -> "ZCVAE":
        """Load a local Hugging Face directory (model + tokenizer, safetensors only) and wrap it.

        Steps (``model.build``), in this order because each depends on the previous one:
        1. tokenizer from the same directory; ``prepare_tokenizer`` adds the markers and K*M latent tokens;
        2. the backbone (``local_files_only``, ``use_safetensors``); its dropout is turned off;
        3. embeddings resized *before* wrapping (ZeRO-3 copies rows only inside a gather), the new
           rows initialised here (z rows from ``<znull>`` + noise, see ``build.init_new_rows``);
        4. peft LoRA on the attention projections, with the z rows (and, with ``train_fresh_markers``,
           the markers the backbone lacked) as trainable tokens (``build.attach_lora``);
        5. router heads (+ soft-prompt projection), and their standardisation statistics from
           ``calibration`` when given. When it is None they are estimated from the first batch that
           reaches ``train_forward`` or ``encode``; under data parallelism that batch differs per
           rank, so distributed runs should pass the same ``calibration`` batch on every rank.
        All random initialisation draws from ``seed`` (LoRA A, z-row noise, projection), not from the
        global RNG state, so every rank builds the same model.

        ``loading`` (from ``zcvae.engines.sharded_loading``, for ZeRO-3 and FSDP2): no weight is read
        yet. The modules are built where the engine makes parameters (meta, or ZeRO-3 partitions), and
        ``materialize_weights`` writes them once the engine has sharded the model, each rank keeping its
        shard (``model.sharded``). Until then the model cannot run: ``calibration`` must be None, and the
        router is calibrated through the engine (``engine.module(batch, mode="calibrate")``).
        """
        if not isinstance(config, ModelConfig):
            raise ValueError(f"config must be a ModelConfig, got {type(config).__name__}")
        backbone_dir = build.check_backbone_dir(backbone_dir)
        tokenizer, tokens, vocab_before = build.load_tokenizer(backbone_dir, config)
        if loading is not None:
            if calibration is not None:
                raise ValueError("calibration: a sharded build has no weights until the engine writes them; calibrate through the engine")
            return cls._sharded(backbone_dir, config, tokenizer=tokenizer, tokens=tokens, vocab_before=vocab_before, seed=seed, loading=loading)
        model = build.load_backbone(backbone_dir, config)
        rng = torch.Generator().manual_seed(seed)
        z_scale = build.resize_and_init_rows(model, tokenizer, tokens=tokens, vocab_before=vocab_before, noise=config.z_init_noise, generator=rng)
        if config.gradient_checkpointing:
            hf_compat.enable_layer_checkpointing(model)
        hidden = model.get_input_embeddings().weight.shape[1]
        peft_model = build.attach_lora(model, config, tokenizer=tokenizer, tokens=tokens, vocab_before=vocab_before, seed=seed)
        router, projection = build.build_heads(hidden, config, z_scale=z_scale, generator=rng)

        out = cls(peft_model=peft_model, tokenizer=tokenizer, tokens=tokens, config=config, router=router, projection=projection)
        # Hugging Face returns models in eval mode; LoRA dropout and gradient checkpointing only act in
        # train mode, so hand back a module in train mode like any freshly built nn.Module (the
        # evaluation switches to eval mode itself).
        out.train()
        out._decoder()  # the one-time check, before an engine shards the weights
        if calibration is not None:
            out.calibrate(calibration)
        return out

    @classmethod
    def _sharded(cls, backbone_dir: str, config: ModelConfig, *, tokenizer, tokens, vocab_before, seed: int, loading) -> "ZCVAE":
        """``from_pretrained``'s steps on a weightless skeleton (``model.sharded``), drawing the same
        random numbers in the same order as the replicated build, so both give the same model."""
        rng = torch.Generator().manual_seed(seed)
        model, reader, keys, old_rows = sharded.build_skeleton(backbone_dir, config, loading=loading, num_tokens=len(tokenizer))
        emb_mod, head_mod = model.get_input_embeddings(), model.get_output_embeddings()
        owners: dict[int, tuple[nn.Module, str]] = {}
        for module in model.modules():
            for name, p in module.named_parameters(recurse=False):
                owners.setdefault(id(p), (module, name))
        added = build.added_rows(tokenizer, vocab_before)
        hidden = sharded.full_shape(emb_mod.weight)[1]
        directions = build.latent_directions(tokens=tokens, added=added, hidden=hidden, generator=rng)
        if config.gradient_checkpointing:
            hf_compat.enable_layer_checkpointing(model)
        rows = [emb_mod.weight] + ([head_mod.weight] if head_mod is not None and head_mod.weight is not emb_mod.weight else [])
        with loading.whole(rows):  # the trainable tokens copy rows at attach; materialize_weights rewrites them
            peft_model = build.attach_lora(model, config, tokenizer=tokenizer, tokens=tokens, vocab_before=vocab_before, seed=seed)
        heads_state = rng.get_state()  # the projection's draws follow the rows', as in the replicated build
        router, projection = build.build_heads(hidden, config, z_scale=1.0, generator=rng)
        out = cls(peft_model=peft_model, tokenizer=tokenizer, tokens=tokens, config=config, router=router, projection=projection)
        pending = sharded.plan_weights(
            out, peft_model, reader=reader, keys=keys, owners_before_peft=owners, emb_mod=emb_mod, head_mod=head_mod,
            tokens=tokens, added=added, old_rows=old_rows, vocab_before=vocab_before, noise=config.z_init_noise,
            directions=directions, seed=seed, loading=loading,
        )
        if projection is not None:
            def init_projection(z_scale: float) -> dict:
                # a fresh projection drawn from the saved generator state, once z_scale (from the embedding) is known
                g = torch.Generator()
                g.set_state(heads_state)
                with torch.random.fork_rng(devices=[]):
                    _, fresh = build.build_heads(hidden, config, z_scale=z_scale, generator=g)
                mods = dict(projection.named_modules())
                return {(mods[m], n): t.detach().clone() for m, fm in fresh.named_modules() for n, t in fm.named_parameters(recurse=False)}

            pending.init_projection = init_projection
        out._pending = pending
        out._built_sharded = True
        out.train()
        return out

    @property
    def sharded(self) -> bool:
        """Built without reading the weights (``from_pretrained(loading=...)``)."""
        return self._built_sharded

    def materialize_weights(self, *, tick=None) -> None:
        """Write the weights of a sharded build, once the engine has sharded it (every rank calls it);
        a no-op for a replicated build, which has its weights already. ``tick(done, total, unit)``
        after each checkpoint tensor."""
        if self._pending is not None:
            self._pending.materialize(self, tick=tick)
            self._pending = None

    @torch.no_grad()
    def calibrate(self, batch: Batch) -> None:
        """Estimate the router's standardisation statistics from ``batch`` (>= 2 examples).

        Uses the LoRA-adapted hidden states; at construction LoRA B is zero, so they equal the base
        model's. Deterministic and independent of the rank when every rank passes the same batch.
        """
        h_prior, h_post, _, _ = self._router_states(batch, n_span=int(batch.num_supervised.max()))
        self.router.calibrate(h_posterior_BH=h_post, h_prior_BH=h_prior)

    # ------------------------------------------------------------------------------------------
    # The passes: one method each
    # ------------------------------------------------------------------------------------------

    @overload
    def forward(self, batch: Batch, *, mode: Literal["reference"], n_span: int | None = ...) -> tuple[torch.Tensor, torch.Tensor]: ...
    @overload
    def forward(self, batch: Batch, *, mode: Literal["train", "encode"] = ..., **kw) -> CVAEOutput: ...
    @overload
    def forward(self, batch: None = ..., *, mode: Literal["decode"], **kw) -> torch.Tensor: ...

    def forward(self, batch: Batch | None = None, *, mode: str = "train", **kw):
        """The engines' entry (see the module docstring): ``mode`` picks :meth:`reference`,
        :meth:`train_forward`, :meth:`encode` or :meth:`decode`; ``kw`` are that method's keywords."""
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if mode == "decode":
            return self.decode(**kw)
        if mode == "calibrate":  # through the engine: a sharded model's weights are whole only inside its forward
            return self.calibrate(batch, **kw)
        return {"reference": self.reference, "train": self.train_forward, "encode": self.encode}[mode](batch, **kw)

    def reference(self, batch: Batch, *, n_span: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The reference's token NLL on the z-free template -> (ref_nll_BN, mask_BN): the frozen backbone
        (adapters disabled), or, after :meth:`add_reference_adapter`, the reference adapter's copy of the
        trained one.

        ``n_span`` (default: max n_i of the batch, one host sync) fixes N."""
        n_span = self._check_batch(batch, n_span)
        # Adapters off also disables the trainable z rows; harmless, the z-free template has no z token.
        adapter = (hf_compat.adapter_active(self.peft_model, REFERENCE_ADAPTER) if self.follows_reference
                   else hf_compat.adapters_disabled(self.peft_model))
        # no_grad, never inference_mode: inference tensors cannot mix with a sharded training graph.
        with torch.no_grad(), adapter:
            out = self._lm(input_ids=batch.input_ids, attention_mask=batch.attention_mask)
            return self._span_nll(out, batch.labels, n_span=n_span)  # (B, N), (B, N)

    # ------------------------------------------------------------------------------------------
    # The following reference (--reference-refresh-every)
    # ------------------------------------------------------------------------------------------

    @property
    def follows_reference(self) -> bool:
        """Whether the reference pass runs the reference adapter (else the adapters are disabled)."""
        return hf_compat.has_adapter(self.peft_model, REFERENCE_ADAPTER)

    def add_reference_adapter(self) -> None:
        """Give the reference its own adapter, a frozen copy of the trained one (LoRA and trainable tokens),
        that :meth:`refresh_reference` renews. Call before an engine wraps the model (the engine then
        moves it with the rest); a sharded build is refused (its adapters are shards)."""
        if self.sharded:
            raise ValueError("a following reference (reference_refresh_every) needs a replicated model: "
                             "this one was built for sharding (ZeRO-3 or FSDP2)")
        if not self.follows_reference:
            hf_compat.add_adapter_copy(self.peft_model, REFERENCE_ADAPTER)

    def refresh_reference(self) -> None:
        """Copy the trained adapter into the reference adapter (every rank: the copies stay equal)."""
        hf_compat.copy_adapter(self.peft_model, target=REFERENCE_ADAPTER)

    def reference_state(self) -> dict[str, torch.Tensor]:
        """The reference adapter's weights (CPU copies), for a checkpoint; {} without one."""
        if not self.follows_reference:
            return {}
        return {k: p.detach().to("cpu", copy=True) for k, p in hf_compat.adapter_parameters(self.peft_model, REFERENCE_ADAPTER).items()}

    @torch.no_grad()
    def load_reference_state(self, state: dict[str, torch.Tensor]) -> None:
        """Restore what :meth:`reference_state` returned; ValueError when it does not fit this model."""
        params = hf_compat.adapter_parameters(self.peft_model, REFERENCE_ADAPTER)
        if state.keys() != params.keys():
            raise ValueError(f"the checkpoint's reference adapter does not fit the model: "
                             f"{sorted(state.keys() ^ params.keys())[:4]}")
        for key, param in params.items():
            param.copy_(state[key])

    def encode(self, batch: Batch, *, n_span: int | None = None) -> CVAEOutput:
        """The router pass only: posterior, prior, KL and the adapted z-free NLL; no branch fields."""
        n_span = self._check_batch(batch, n_span)
        h_prior, h_post, zfree_nll, mask = self._router_states(batch, n_span=n_span)
        return self._latent_output(batch, h_prior, h_post, zfree_nll, mask)

    def train_forward(
        self,
        batch: Batch,
        *,
        n_span: int | None = None,
        latent_noise: torch.Tensor | None = None,
        generator: torch.Generator | None = None,
    ) -> CVAEOutput:
        """The router pass and every branch -> CVAEOutput with ``token_nll`` (B, K, N).

        Gaussian: ``latent_noise`` (B, S, D) standard-normal draws, or ``generator``; default the
        global RNG. Passing the noise makes the samples independent of how a global batch is split
        over ranks and micro-batches.
        """
        n_span = self._check_batch(batch, n_span)
        prefix = self._shared_prefix(batch)
        if prefix is None:
            h_prior, h_post, zfree_nll, mask = self._router_states(batch, n_span=n_span)
        else:
            h_prior, h_post, zfree_nll, mask = self._router_states_shared(batch, prefix, n_span=n_span)
        out = self._latent_output(batch, h_prior, h_post, zfree_nll, mask)
        B = batch.input_ids.shape[0]
        if self.config.latent_type == "discrete":
            K = self.config.num_latents
            latent_index_R = torch.arange(K, device=batch.z_input_ids.device).repeat(B)  # r = i*K + k
            out.token_nll = self._discrete_branches(batch, latent_index_R=latent_index_R, n_span=n_span, prefix=prefix).view(B, K, n_span)
            out.branch_weights = out.posterior_logits.softmax(-1)  # (B, K) differentiable: the exact expectation
            out.inter_latent_divergence = inter_latent_divergence(out.token_nll, torch.ones_like(out.posterior_logits), mask)
            return out
        S, D = self.config.num_latent_samples, self.config.latent_dim
        if latent_noise is None:
            latent_noise = torch.randn((B, S, D), generator=generator, device=out.mu.device if generator is None else generator.device)
        if latent_noise.shape != (B, S, D):
            raise ValueError(f"latent_noise must be [{B}, {S}, {D}], got {tuple(latent_noise.shape)}")
        eps = latent_noise.to(device=out.mu.device, dtype=out.mu.dtype)
        z_BSD = out.mu[:, None] + torch.exp(0.5 * out.logvar)[:, None] * eps  # reparameterised
        out.token_nll = self._soft_prompt_branches(batch, z_RD=z_BSD.reshape(B * S, D), n_span=n_span, prefix=prefix).view(B, S, n_span)
        out.branch_weights = torch.full((B, S), 1.0 / S, device=out.mu.device)
        out.inter_latent_divergence = inter_latent_divergence(out.token_nll, out.branch_weights, mask)
        out.z = z_BSD
        return out

    def decode(
        self,
        *,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        slot_start: torch.Tensor | None = None,
        latent_index: torch.Tensor | None = None,
        z: torch.Tensor | None = None,
        cache: KVCache | None = None,
    ) -> torch.Tensor:
        """Next-token logits (R, V), float32, at the last attended position of each row.

        ``input_ids``/``attention_mask`` (R, S), right-padded; ``slot_start`` (R,) and ``latent_index``
        (R,) long (discrete) or ``z`` (R, D) (Gaussian); with neither, the rows are decoded as given.
        ``cache`` None: a full recompute. A ``KVCache`` (one per ``greedy_decode`` call): the first
        call runs the prompts whole, with the latent, and keeps the keys and values; each later call
        runs only the token each row has gained since (``KVCache.advance``), with the same logits.
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
        if latent_index is not None and self.config.latent_type != "discrete":
            raise ValueError("latent_index is for the discrete latent; pass z for the Gaussian one")
        if cache is not None and cache.started:  # the latent is in the cached prompt already
            return self._decode_cached(input_ids, attention_mask, cache)
        if cache is not None and hf_compat.layer_checkpointing_active(self.peft_model):
            cache = None  # transformers drops a writable cache inside checkpointed layers: recompute every call
        if latent_index is not None:
            input_ids = branches.write_latent(input_ids, slot_start, latent_index, latent_slots=self.tokens.latent_slots)
        positions = torch.arange(S, device=input_ids.device)
        last_R = (attention_mask.long() * positions).argmax(1)  # last position with mask 1
        with torch.no_grad():
            parts = []
            for c in branches.chunks(R, self.config.branch_chunk_size):
                kv = {} if cache is None else cache.open(c.start, hf_compat.cache_kwarg(self._hf_forward_params))
                latent = latent_index[c] if latent_index is not None else (z[c] if z is not None else None)
                with self._z_conditioned(latent, None if slot_start is None else slot_start[c].to(input_ids.device), S):
                    if z is not None:
                        embeds = self._slot_embeds(input_ids[c], slot_start[c], z[c].to(input_ids.device))
                        logits = self._lm(inputs_embeds=embeds, attention_mask=attention_mask[c], logits=True, **kv).logits
                    else:
                        logits = self._lm(input_ids=input_ids[c], attention_mask=attention_mask[c], logits=True, **kv).logits
                rows = torch.arange(logits.shape[0], device=logits.device)
                parts.append(logits[rows, last_R[c]].float())  # (r, V)
        if cache is not None:
            cache.start(attention_mask)
            cache.latent = latent_index if latent_index is not None else z  # the later steps' z-conditioned norms
        return torch.cat(parts, 0)

    def _decode_cached(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """A cached decode's later call: one new column per row on the kept keys and values -> logits_RV."""
        ids_R1, position_R1, mask_RC = cache.advance(input_ids, attention_mask)
        key = hf_compat.cache_kwarg(self._hf_forward_params)
        with torch.no_grad():
            parts = []
            for c in branches.chunks(input_ids.shape[0], self.config.branch_chunk_size):
                # every new column lies after the z slot
                with self._z_conditioned(None if cache.latent is None else cache.latent[c], None, 1):
                    out = self._lm(input_ids=ids_R1[c], attention_mask=mask_RC[c], position_ids=position_R1[c], logits=True,
                                   **cache.kwargs(c.start, key))
                parts.append(out.logits[:, -1].float())  # (r, V)
        return torch.cat(parts, 0)

    # ------------------------------------------------------------------------------------------
    # z-conditioned norms (--z-conditioned-norm)
    # ------------------------------------------------------------------------------------------

    @contextlib.contextmanager
    def _z_conditioned(self, latent: torch.Tensor | None, slot_start_R: torch.Tensor | None, width: int) -> Iterator[None]:
        """Inside: the decoder's norms are conditioned on ``latent`` (indices (R,) or z (R, D)), on the
        positions from ``<z>`` on (``slot_start_R - 1``; None: every position, as in a cached decode step).
        Entered inside a branch chunk's function, so a chunk's checkpointed recompute conditions alike."""
        if self.z_norm is None or latent is None:
            yield
            return
        keep_RS = None
        if slot_start_R is not None:
            keep_RS = torch.arange(width, device=slot_start_R.device)[None] >= (slot_start_R - 1)[:, None]
        # through the module's own forward: a ZeRO-3 partitioned table is gathered there
        self._z_condition = (self.z_norm(latent), keep_RS)
        try:
            yield
        finally:
            self._z_condition = None

    def _condition_norm(self, index: int, module: nn.Module, args, output: torch.Tensor) -> torch.Tensor | None:
        """Forward hook of decoder norm ``index``: ``output * (1 + scale_z) + shift_z`` on the conditioned positions."""
        if self._z_condition is None:
            return None
        scale_shift_RN2H, keep_RS = self._z_condition
        scale_shift_R2H = scale_shift_RN2H[:, index].to(output.device)
        conditioned = (output * (1 + scale_shift_R2H[:, None, 0]) + scale_shift_R2H[:, None, 1]).to(output.dtype)
        return conditioned if keep_RS is None else torch.where(keep_RS.to(output.device)[..., None], conditioned, output)

    # ------------------------------------------------------------------------------------------
    # Pieces of the passes
    # ------------------------------------------------------------------------------------------

    def _check_batch(self, batch: Batch | None, n_span: int | None) -> int:
        """ValueError for a batch this model cannot run; return N (``n_span``, or the batch's max n_i)."""
        if batch is None:
            raise ValueError("this pass needs a batch")
        if batch.num_z_slots != self.config.num_z_slots:
            raise ValueError(
                f"batch.num_z_slots={batch.num_z_slots} but the model was built with num_z_slots={self.config.num_z_slots}"
            )
        return int(batch.num_supervised.max()) if n_span is None else n_span  # one host sync; pass n_span to avoid it

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
        are exactly ``head(decoder(...).last_hidden_state)`` (``build.decoder_matches_lm``, checked
        once), else None (logits come from the full LM)."""
        if self._decoder_ok is None:
            device = next(self.peft_model.parameters()).device
            probe = torch.tensor([[self.tokens.bos, self.tokens.x_open, self.tokens.x_close]], device=device)
            self._decoder_ok = build.decoder_matches_lm(self.peft_model, probe_ids=probe, forward_params=self._hf_forward_params)
        return hf_compat.lm_decoder(self.peft_model) if self._decoder_ok else None

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

    def _latent_output(self, batch: Batch, h_prior_BH, h_post_BH, zfree_nll_BN, mask_BN) -> CVAEOutput:
        """The router heads on the states -> CVAEOutput (posterior, prior, KL, entropy), no branch fields."""
        if not self.router.calibrated:
            # Lazy data-dependent init (documented in from_pretrained): statistics of this first batch.
            self.router.calibrate(h_posterior_BH=h_post_BH, h_prior_BH=h_prior_BH)
        common = dict(latent_type=self.config.latent_type, mask=mask_BN, num_supervised=batch.num_supervised, zfree_nll=zfree_nll_BN)
        if self.config.latent_type == "discrete":
            q_logits, p_logits = self.router(h_posterior_BH=h_post_BH, h_prior_BH=h_prior_BH)  # (B, K) each
            return CVAEOutput(
                **common,
                kl=categorical_kl(q_logits, p_logits),
                posterior_entropy=entropy(q_logits),
                posterior_logits=q_logits,
                prior_logits=p_logits,
            )
        mu, logvar, prior_mu, prior_logvar = self.router(h_posterior_BH=h_post_BH, h_prior_BH=h_prior_BH)  # (B, D) each
        return CVAEOutput(
            **common,
            kl=gaussian_kl(mu, logvar, prior_mu, prior_logvar) if self.config.learned_prior else gaussian_kl(mu, logvar),
            posterior_entropy=gaussian_entropy(logvar),
            mu=mu,
            logvar=logvar,
            prior_mu=prior_mu,
            prior_logvar=prior_logvar,
            posterior_variance=logvar.exp().mean(-1),
        )

    # ------------------------------------------------------------------------------------------
    # Shared x prefix (model.prefix)
    # ------------------------------------------------------------------------------------------

    def prefix_sharing_blocker(self, batch: Batch | None = None) -> str | None:
        """Why a train forward (of ``batch``) would *not* share the x prefix, or None when it would."""
        if not self.config.share_x_prefix:
            return "share_x_prefix=False"
        return shared.sharing_blocker(self.peft_model.get_base_model(), forward_params=self._hf_forward_params, batch=batch)

    def _shared_prefix(self, batch: Batch) -> shared.SharedPrefix | None:
        """The x prefix of ``batch`` after one forward, or None (the full-sequence path) when it is
        not shared; a fallback other than ``share_x_prefix=False`` warns once, naming the reason."""
        if not self.config.share_x_prefix:
            return None
        blocker = self.prefix_sharing_blocker(batch)
        if blocker is not None:
            self._warn_once(f"share_x_prefix: falling back to the full-sequence path: {blocker}")
            return None
        return self._run_prefix(batch)

    def _warn_once(self, message: str) -> None:
        if message not in self._warned:
            self._warned.add(message)
            warnings.warn(message, stacklevel=4)

    def _run_prefix(self, batch: Batch) -> shared.SharedPrefix:
        """One LoRA-adapted forward of ``<bos> <x> {x} </x>`` per example (right-padded)."""
        ids_BP, mask_BP, position_BP, length_B = shared.prefix_inputs(batch, pad=self.tokens.pad)
        cache = hf_compat.replay_safe_cache()  # records every column of every layer
        kwargs = {hf_compat.cache_kwarg(self._hf_forward_params): cache}
        if self._decoder() is None and "logits_to_keep" in self._hf_forward_params:
            kwargs["logits_to_keep"] = 1  # the prefix supervises nothing: skip its (B, P, V) logits
        with hf_compat.cache_through_checkpointing(self.peft_model.get_base_model()):
            out = self._lm(input_ids=ids_BP, attention_mask=mask_BP, position_ids=position_BP, use_cache=True, hidden=True, **kwargs)
        h_BPH = out.hidden_states[-1]
        rows = torch.arange(h_BPH.shape[0], device=ids_BP.device)
        return shared.SharedPrefix(kv=hf_compat.recorded_kv(cache), mask_BP=mask_BP, length_B=length_B, h_prior_BH=h_BPH[rows, length_B - 1])

    def _lm_after_prefix(
        self, prefix: shared.SharedPrefix, *, rows: slice | None = None, reps: int = 1, attention_mask, input_ids=None, inputs_embeds=None, hidden: bool = False
    ):
        """A suffix forward on the cached prefix. Its rows are ``rows`` of the layout r = i*reps + k
        (all B*reps when None); ``attention_mask`` (R, W) covers the suffix only."""
        kv, mask_RP, start_R = shared.repeat_for_rows(prefix, rows=rows, reps=reps)
        W = attention_mask.shape[1]
        position_RW = start_R[:, None] + torch.arange(W, device=start_R.device)
        with hf_compat.cache_through_checkpointing(self.peft_model.get_base_model()):
            return self._lm(
                input_ids=input_ids,
                inputs_embeds=inputs_embeds,
                attention_mask=torch.cat([mask_RP, attention_mask.to(mask_RP.dtype)], dim=1),
                position_ids=position_RW,
                use_cache=True,
                hidden=hidden,
                **{hf_compat.cache_kwarg(self._hf_forward_params): hf_compat.replay_safe_cache(kv)},
            )

    def _router_states_shared(self, batch: Batch, prefix: shared.SharedPrefix, *, n_span: int):
        """``_router_states`` on the shared prefix: the z-free suffix ``<y> y </y> <eos>`` only."""
        ids_BW, mask_BW, labels_BW = shared.suffix(batch.input_ids, batch.attention_mask, batch.labels, prefix.length_B, pad=self.tokens.pad)
        out = self._lm_after_prefix(prefix, input_ids=ids_BW, attention_mask=mask_BW, hidden=True)
        h_BWH = out.hidden_states[-1]
        # The suffix starts at <y>: column 0.
        y_close_B = batch.y_close_pos.to(h_BWH.device) - prefix.length_B
        h_post = posterior_state(h_BWH, torch.zeros_like(y_close_B), y_close_B, self.config.posterior_pooling)
        zfree_nll, mask = self._span_nll(out, labels_BW, n_span=n_span)
        return prefix.h_prior_BH, h_post, zfree_nll, mask

    # ------------------------------------------------------------------------------------------
    # Branches (model.branches)
    # ------------------------------------------------------------------------------------------

    def branch_chunk_rows(self) -> int | None:
        """Rows per branch chunk of a train forward (None = all at once): ``branch_chunk_size``.

        Why not chunk by default under activation checkpointing: layer checkpointing already keeps a
        layer's activations only, so one chunk's memory grew little with K on SmolLM2-135M (K=4 2540,
        K=8 2607 MiB), while B-row chunks switch layer checkpointing off inside each chunk and cost more
        time and memory (K=4: 4.01x vs 3.15x the LoRA step, 2690 MiB; BENCHMARKS.md, the SmolLM2 chunk table)."""
        return self.config.branch_chunk_size

    def _branch_lm(self, prefix: shared.SharedPrefix | None, rows: slice, reps: int, **inputs):
        if prefix is None:
            return self._lm(**inputs)
        return self._lm_after_prefix(prefix, rows=rows, reps=reps, **inputs)

    def _run_branches(self, num_rows: int, chunk_nll) -> torch.Tensor:
        return branches.run_branch_chunks(chunk_nll, num_rows=num_rows, chunk_rows=self.branch_chunk_rows(), hf=self.peft_model.get_base_model())

    def _discrete_branches(self, batch: Batch, *, latent_index_R: torch.Tensor, n_span: int, prefix: shared.SharedPrefix | None = None) -> torch.Tensor:
        """Rows r = i*K + k: example i with latent latent_index_R[r] in its slot -> nll_RN."""
        R = latent_index_R.shape[0]
        reps = R // batch.z_input_ids.shape[0]
        ids_RS, mask_RS, labels_RS, slot_R = branches.branch_rows(batch, reps=reps, prefix=prefix, pad=self.tokens.pad)
        ids_RS = branches.write_latent(ids_RS, slot_R, latent_index_R, latent_slots=self.tokens.latent_slots)

        def chunk_nll(c: slice) -> torch.Tensor:
            with self._z_conditioned(latent_index_R[c], slot_R[c], ids_RS.shape[1]):
                out = self._branch_lm(prefix, c, reps, input_ids=ids_RS[c], attention_mask=mask_RS[c])
            return self._span_nll(out, labels_RS[c], n_span=n_span)[0]

        return self._run_branches(R, chunk_nll)  # (R, N)

    def _slot_embeds(self, ids_RS: torch.Tensor, slot_start_R: torch.Tensor, z_RD: torch.Tensor) -> torch.Tensor:
        """Input embeddings with the M slot embeddings offset by the projected z -> (R, S, H)."""
        embeds = self.peft_model.get_input_embeddings()(ids_RS)  # (R, S, H)
        M, H = self.config.num_z_slots, embeds.shape[-1]
        pos_RM = slot_start_R.to(ids_RS.device)[:, None] + torch.arange(M, device=ids_RS.device)
        index = pos_RM[..., None].expand(-1, -1, H)
        slots = embeds.gather(1, index) + self.projection(z_RD).to(embeds.dtype)  # (R, M, H)
        return embeds.scatter(1, index, slots)

    def _soft_prompt_branches(self, batch: Batch, *, z_RD: torch.Tensor, n_span: int, prefix: shared.SharedPrefix | None = None) -> torch.Tensor:
        """Rows r = i*S + s: example i with sample z_RD[r] offsetting its slots -> nll_RN."""
        R = z_RD.shape[0]
        reps = R // batch.z_input_ids.shape[0]
        ids_RS, mask_RS, labels_RS, slot_R = branches.branch_rows(batch, reps=reps, prefix=prefix, pad=self.tokens.pad)

        def chunk_nll(c: slice) -> torch.Tensor:
            embeds = self._slot_embeds(ids_RS[c], slot_R[c], z_RD[c])
            with self._z_conditioned(z_RD[c], slot_R[c], ids_RS.shape[1]):
                out = self._branch_lm(prefix, c, reps, inputs_embeds=embeds, attention_mask=mask_RS[c])
            return self._span_nll(out, labels_RS[c], n_span=n_span)[0]

        return self._run_branches(R, chunk_nll)  # (R, N)

    # ------------------------------------------------------------------------------------------
    # Optimisation helpers
    # ------------------------------------------------------------------------------------------

    def _latent_named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """z rows (peft's trainable-token delta) + router/prior heads + projection + z-conditioned norms, in a fixed order."""
        reference = {id(p) for p in hf_compat.adapter_parameters(self.peft_model, REFERENCE_ADAPTER).values()}
        out = [(n, p) for n, p in self.named_parameters() if hf_compat.TRAINABLE_TOKENS_DELTA in n and id(p) not in reference]
        out += [(f"router.{n}", p) for n, p in self.router.named_parameters()]
        if self.projection is not None:
            out += [(f"projection.{n}", p) for n, p in self.projection.named_parameters()]
        if self.z_norm is not None:
            out += [(f"z_norm.{n}", p) for n, p in self.z_norm.named_parameters()]
        return out

    def lora_named_parameters(self) -> list[tuple[str, nn.Parameter]]:
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
            {"name": "lora", "params": [p for _, p in self.lora_named_parameters()], "lr": lora_lr, "weight_decay": weight_decay},
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
        if self.config.latent_type == "discrete" and not any(hf_compat.TRAINABLE_TOKENS_DELTA in n for n, _ in latent):
            raise RuntimeError("no trainable z rows (trainable_tokens_delta) found in the model")
        bad = [
            f"{n} ({'requires_grad=False' if not p.requires_grad else 'not in the optimizer'})"
            for n, p in latent + self.lora_named_parameters()
            if not p.requires_grad or id(p) not in ids
        ]
        if bad:
            raise RuntimeError(f"parameters that would not be trained: {', '.join(bad)}")
