"""Building the pieces of a :class:`~zcvae.model.cvae.ZCVAE` from a local Hugging Face directory:
the files check, tokenizer, backbone, new embedding rows, LoRA and the router heads.

``ZCVAE.from_pretrained`` calls these steps in order; ``zcvae pretrain`` reuses the file check, the
dropout switch and the row initialisation for the entangled stage.
"""

from __future__ import annotations

import inspect
import json
import os

import torch
from torch import nn

from zcvae import cpu
from zcvae.core.latent import DiscreteRouter, GaussianRouter, SoftPromptProjection
from zcvae.model import hf_compat
from zcvae.model.config import ModelConfig, default_lora_targets
from zcvae.data.encoding import ZNULL, TemplateTokens, missing_markers, prepare_tokenizer

__all__ = [
    "attach_lora",
    "build_heads",
    "check_backbone_dir",
    "check_backbone_files",
    "decoder_matches_lm",
    "added_rows",
    "fill_new_rows_",
    "head_is_tied",
    "init_new_rows",
    "latent_directions",
    "load_backbone",
    "load_tokenizer",
    "resize_and_init_rows",
    "trainable_token_indices",
]


def check_backbone_files(backbone_dir: str) -> None:
    """ValueError naming the file when the backbone's config.json is not JSON or its safetensors
    weights are missing (transformers would raise deep inside, or look for other formats)."""
    path = os.path.join(backbone_dir, "config.json")
    try:
        with open(path, encoding="utf-8") as f:
            json.load(f)
    except (OSError, ValueError) as err:
        raise ValueError(f"backbone file {path!r} is not valid JSON: {err}") from None
    names = ("model.safetensors", "model.safetensors.index.json")
    if not any(os.path.isfile(os.path.join(backbone_dir, n)) for n in names):
        raise ValueError(f"backbone_dir {backbone_dir!r} has no {names[0]} (nor {names[1]}): zcvae loads safetensors weights only")


def check_backbone_dir(backbone_dir) -> str:
    """``backbone_dir`` as a str once it is a Hugging Face model directory with readable files."""
    backbone_dir = os.fspath(backbone_dir)
    if not os.path.isdir(backbone_dir):
        raise ValueError(f"backbone_dir {backbone_dir!r} is not a directory")
    if not os.path.isfile(os.path.join(backbone_dir, "config.json")):
        raise ValueError(f"backbone_dir {backbone_dir!r} has no config.json (not a Hugging Face model directory)")
    check_backbone_files(backbone_dir)
    return backbone_dir


def load_tokenizer(backbone_dir: str, config: ModelConfig):
    """The directory's tokenizer with the markers and K*M latent tokens added
    -> (tokenizer, tokens, vocab_before: the vocabulary as the backbone knew it)."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(backbone_dir, local_files_only=True, trust_remote_code=config.trust_remote_code)
    except (OSError, ValueError) as err:
        raise ValueError(f"backbone_dir {backbone_dir!r}: its tokenizer files could not be read: {err}") from None
    vocab_before = tokenizer.get_vocab()
    num_latent_tokens = config.num_latents if config.latent_type == "discrete" else 0
    tokens = prepare_tokenizer(tokenizer, num_latents=num_latent_tokens, num_z_slots=config.num_z_slots)
    return tokenizer, tokens, vocab_before


def load_backbone(backbone_dir: str, config: ModelConfig) -> nn.Module:
    """The causal LM (``local_files_only``, safetensors only), its dropout off per ``config``, no KV cache."""
    from transformers import AutoModelForCausalLM

    dtype = config.dtype if config.dtype == "auto" else getattr(torch, config.dtype)
    try:
        model = AutoModelForCausalLM.from_pretrained(
            backbone_dir, local_files_only=True, use_safetensors=True, trust_remote_code=config.trust_remote_code, dtype=dtype
        )
    except Exception as err:  # noqa: BLE001 - safetensors/transformers raise several types for a bad file
        raise ValueError(f"backbone_dir {backbone_dir!r}: its weights (model.safetensors) could not be loaded: {type(err).__name__}: {err}") from None
    if config.disable_backbone_dropout:
        hf_compat.disable_dropout(model)
    model.config.use_cache = False
    return model


def resize_and_init_rows(model: nn.Module, tokenizer, *, tokens: TemplateTokens, vocab_before: dict, noise: float, generator: torch.Generator) -> float:
    """Resize the embeddings to the tokenizer *before* any wrapping (ZeRO-3 copies rows only inside a
    gather) and initialise the new rows (``init_new_rows``); return the z-noise norm scale."""
    added = added_rows(tokenizer, vocab_before)
    old_rows = model.get_input_embeddings().weight.shape[0]
    if len(tokenizer) > old_rows:
        # detached: the resize may hand the old Parameter objects the new rows
        dropped = [w.detach() for w in (model.get_input_embeddings().weight, getattr(model.get_output_embeddings(), "weight", None))
                   if w is not None]
        model.resize_token_embeddings(len(tokenizer), mean_resizing=False)
        kept = {p.data_ptr() for p in model.parameters()}
        for weight in {w.data_ptr(): w for w in dropped if w.data_ptr() not in kept}.values():  # a tied head once
            cpu.release_file_pages(weight)  # a memory-mapped checkpoint keeps the old rows resident otherwise
    return init_new_rows(
        model, tokens=tokens, added=added, old_rows=old_rows, had_znull=ZNULL in vocab_before, noise=noise, generator=generator
    )


def added_rows(tokenizer, vocab_before: dict) -> list[int]:
    """The ids the markers and latent tokens got (sorted), i.e. the rows the backbone never trained."""
    return sorted(i for t, i in tokenizer.get_vocab().items() if t not in vocab_before)


def latent_directions(*, tokens: TemplateTokens, added: list[int], hidden: int, generator: torch.Generator) -> dict[int, torch.Tensor]:
    """The random direction of each new z row's noise, drawn from ``generator`` in row order. They
    depend on nothing but the generator, so a sharded build draws them before any weight exists."""
    latents = set(tokens.latents)
    return {row: torch.randn(hidden, generator=generator) for row in added if row in latents}


def init_new_rows(
    model: nn.Module,
    *,
    tokens: TemplateTokens,
    added: list[int],
    old_rows: int,
    had_znull: bool,
    noise: float,
    generator: torch.Generator,
) -> float:
    """Initialise the rows of newly added tokens in ``model``'s embeddings (``fill_new_rows_``); return the
    norm scale used for z noise."""
    emb = model.get_input_embeddings().weight  # (V, H)
    out_emb = model.get_output_embeddings()
    untied = not head_is_tied(model)
    directions = latent_directions(tokens=tokens, added=added, hidden=emb.shape[1], generator=generator)
    return fill_new_rows_(
        emb.data,
        head_VH=out_emb.weight.data if untied else None,
        head_bias_V=getattr(out_emb, "bias", None) if untied else None,
        tokens=tokens, added=added, old_rows=old_rows, had_znull=had_znull, noise=noise, directions=directions,
    )


@torch.no_grad()
def fill_new_rows_(
    emb_VH: torch.Tensor,
    *,
    head_VH: torch.Tensor | None,
    head_bias_V: torch.Tensor | None,
    tokens: TemplateTokens,
    added: list[int],
    old_rows: int,
    had_znull: bool,
    noise: float,
    directions: dict[int, torch.Tensor],
) -> float:
    """Write the new rows of the full (V, H) embedding (and of an untied head) in place; return the
    norm scale used for z noise. Pure tensor code: the replicated and the sharded builds share it.

    z rows: ``<znull>`` row + noise when the backbone already knew ``<znull>`` (it was pretrained
    with ``<znull>`` in the slot, so z_k starts as "no latent" and the decoder is not disturbed);
    otherwise the mean embedding + noise. The noise has norm ``noise`` x the base row's norm
    (x the mean row norm for the mean embedding), in the row's direction from ``directions``, so the
    K rows differ and the branches give the router distinct gradients from step 0. Other new markers
    (a backbone that lacked them) get the mean embedding; they train only with ``train_fresh_markers``.
    New rows of an untied output head get the mean output row, so no new token is favoured.
    """
    base_rows = emb_VH[:old_rows].float()
    mean_row = base_rows.mean(0)
    if had_znull:
        base, scale = emb_VH[tokens.znull].float().clone(), float(emb_VH[tokens.znull].float().norm())
    else:
        base, scale = mean_row, float(base_rows.norm(dim=1).mean())
    for row in added:
        if row in directions:
            direction = directions[row]
            value = base + noise * scale * direction / direction.norm().clamp_min(1e-12)
        else:
            value = mean_row
        emb_VH[row] = value.to(emb_VH.dtype)
    if head_VH is not None and head_VH.shape[0] > old_rows:
        head_VH[old_rows:] = head_VH[:old_rows].float().mean(0).to(head_VH.dtype)
        if head_bias_V is not None:
            head_bias_V[old_rows:] = head_bias_V[:old_rows].float().mean().to(head_bias_V.dtype)
    return scale


def head_is_tied(model: nn.Module) -> bool:
    """Whether the output head shares the input embedding's weight (or there is no head).

    By identity, as ``tie_weights`` ties them (one Parameter): a storage test would call every pair of
    meta tensors tied, since their ``data_ptr()`` is 0 in a skeleton built for sharded loading."""
    head = model.get_output_embeddings()
    return head is None or head.weight is model.get_input_embeddings().weight


def trainable_token_indices(model: nn.Module, *, latents: tuple[int, ...], fresh_markers: list[int]) -> list[int] | dict | None:
    """peft ``trainable_token_indices``: the z rows, plus the rows of ``fresh_markers``.

    The markers are predicted (``</y>`` is supervised), so their output-head rows must train too. A
    tied head follows the input rows (peft ties its trainable-token layer to the embedding's); an
    untied head gets its own trainable tokens for the markers only (z tokens are never predicted).
    """
    if not fresh_markers:
        return list(latents) if latents else None
    rows = [*latents, *fresh_markers]
    emb, head = model.get_input_embeddings(), model.get_output_embeddings()
    if head_is_tied(model):
        return rows
    names = {id(m): n for n, m in model.named_modules()}
    return {names[id(emb)]: rows, names[id(head)]: list(fresh_markers)}


def attach_lora(model: nn.Module, config: ModelConfig, *, tokenizer, tokens: TemplateTokens, vocab_before: dict, seed: int) -> nn.Module:
    """peft LoRA on the attention projections, with ``trainable_token_indices`` = the z rows (and,
    with ``train_fresh_markers``, the markers the backbone lacked), so only those rows train (a small
    delta parameter; the matrix itself stays frozen, so every other row is bitwise unchanged, weight
    decay included). LoRA A is drawn from ``seed``, not from the global RNG state."""
    from peft import LoraConfig

    model_type = getattr(model.config, "model_type", "")
    vocab = tokenizer.get_vocab()
    fresh = [vocab[t] for t in missing_markers(vocab_before)] if config.train_fresh_markers else []
    lora = LoraConfig(
        task_type="CAUSAL_LM",
        r=config.lora_r,
        lora_alpha=config.lora_alpha,
        lora_dropout=config.lora_dropout,
        target_modules=config.lora_target_modules or default_lora_targets(model_type),
        fan_in_fan_out=model_type == "gpt2",  # GPT-2 uses Conv1D (transposed weights)
        trainable_token_indices=trainable_token_indices(model, latents=tokens.latents, fresh_markers=fresh),
    )
    peft_model = hf_compat.lora_wrapped(model, lora, seed=seed)
    # Trainable parts keep float32 masters whatever the base dtype (peft copies the z rows in the
    # embedding's dtype); with a float32 base this changes nothing.
    for p in peft_model.parameters():
        if p.requires_grad and p.dtype != torch.float32:
            p.data = p.data.float()
    hf_compat.copy_free_token_layers(peft_model)  # no (V, H) copy per embedding or head call
    hf_compat.share_lora_input_casts(peft_model)  # one float32 copy of an input that q, k and v share
    return peft_model


def build_heads(hidden: int, config: ModelConfig, *, z_scale: float, generator: torch.Generator) -> tuple[nn.Module, nn.Module | None]:
    """The router (posterior and prior heads) and, for the Gaussian latent, the soft-prompt
    projection, initialised to offsets of ``z_init_noise`` x ``z_scale`` -> (router, projection)."""
    if config.latent_type == "discrete":
        return DiscreteRouter(hidden, config.num_latents), None
    router = GaussianRouter(hidden, config.latent_dim, learned_prior=config.learned_prior)
    projection = SoftPromptProjection(config.latent_dim, config.num_z_slots, hidden)
    projection.reset_parameters(init_scale=config.z_init_noise * z_scale, generator=generator)
    return router, projection


def decoder_matches_lm(peft_model: nn.Module, *, probe_ids: torch.Tensor, forward_params: frozenset[str]) -> bool:
    """Whether the LM's logits are exactly ``head(decoder(...).last_hidden_state)``, with the decoder
    (``base_model``: the model without its LM head) taking the cache and position arguments that the
    shared prefix passes the LM (``forward_params``, the LM forward's).

    No logit soft-capping in the config, and the head on the decoder's output equals the LM's logits
    on ``probe_ids`` (1, 3). Models that scale or cap their logits after the head fail the check and
    keep the full-logits path."""
    hf = peft_model.get_base_model()
    decoder, head = hf_compat.lm_decoder(peft_model), hf.get_output_embeddings()
    if decoder is None or head is None or getattr(hf.config, "final_logit_softcapping", None) is not None:
        return False
    if not (forward_params & {"cache", "past_key_values", "position_ids"}) <= set(inspect.signature(decoder.forward).parameters):
        return False
    with torch.no_grad():
        full = peft_model(input_ids=probe_ids, use_cache=False, return_dict=True).logits
        mine = head(decoder(input_ids=probe_ids, use_cache=False, return_dict=True).last_hidden_state)
    return full.shape == mine.shape and torch.allclose(mine.float(), full.float(), rtol=1e-6, atol=1e-6)
