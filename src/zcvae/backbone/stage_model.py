"""The model the entangled stage trains: the tiny Llama from scratch, or a pretrained LM prepared for the
stage (the markers and ``<znull>`` added as trainable tokens, LoRA or a full fine-tune), and the plain
Hugging Face model it saves (LoRA and the token deltas merged)."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from zcvae.backbone.stage_config import PretrainConfig
from zcvae.data.encoding import TemplateTokens, prepare_tokenizer


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



def build_tiny_model(config: PretrainConfig, tokenizer, tokens: TemplateTokens) -> LlamaForCausalLM:
    """The tiny Llama before training, seeded: the same on every rank and on every call."""
    torch.manual_seed(config.seed)
    model_config = tiny_llama_config(
        len(tokenizer),
        hidden_size=config.hidden_size,
        num_layers=config.num_layers,
        num_heads=config.num_heads,
        intermediate_size=config.intermediate_size,
        max_position_embeddings=max(128, config.max_length),
        bos_token_id=tokens.bos,
        eos_token_id=tokens.eos,
        pad_token_id=tokens.pad,
    )
    return LlamaForCausalLM(model_config).to(dtype=torch.float32)


def load_backbone_for_finetune(config: PretrainConfig):
    """(model, tokenizer, source record, added token ids) for the entangled stage on ``config.backbone``.

    Mirrors ``ZCVAE.from_pretrained`` up to the adapters: the markers and ``<znull>`` are added to the
    backbone's tokenizer, the embeddings resized and the new rows set to the mean row (input and an
    untied head alike), dropout off. With LoRA the new rows train as peft trainable tokens, so every
    other row stays bitwise frozen; with ``full_finetune`` everything trains.
    """
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from zcvae.backbone.convert import conversion_record, file_sha256, is_gguf_path, resolve_backbone_path
    from zcvae.model.build import check_backbone_files, head_is_tied, init_new_rows
    from zcvae.model.hf_compat import disable_dropout, lora_wrapped, position_limit
    from zcvae.reference.store import fingerprint_backbone

    source = config.backbone
    directory = resolve_backbone_path(source)
    if not os.path.isdir(directory) or not os.path.isfile(os.path.join(directory, "config.json")):
        raise ValueError(f"backbone {source!r} is neither a Hugging Face model directory (with config.json) nor a .gguf file")
    check_backbone_files(directory)
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
    positions = position_limit(model.config)
    if positions is not None and config.max_length > positions:
        raise ValueError(f"max_length {config.max_length} exceeds the backbone's {positions} positions ({source!r})")
    disable_dropout(model)
    model.config.use_cache = False
    old_rows = model.get_input_embeddings().weight.shape[0]
    if len(tokenizer) > old_rows:
        model.resize_token_embeddings(len(tokenizer), mean_resizing=False)
    init_new_rows(model, tokens=tokens, added=added, old_rows=old_rows, had_znull=False, noise=0.0,
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
    tied = head_is_tied(model)
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
    model = lora_wrapped(model, lora, seed=config.seed)
    record["lora"] = {"r": config.lora_r, "alpha": config.lora_alpha, "target_modules": config.lora_target_modules or "all-linear"}
    return model, tokenizer, tokens, record


def merged_model(model):
    """The plain HF model to save: LoRA and the trainable-token deltas merged into the weights (a peft
    model), or ``model`` itself (the tiny model, a full fine-tune)."""
    from peft import PeftModel

    return model.merge_and_unload() if isinstance(model, PeftModel) else model
