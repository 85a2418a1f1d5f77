"""The export directory: its file names, its format version and the backbone config it records.

An export directory (``zcvae export``; written by ``zcvae.export.export`` into ``DIR.tmp`` and renamed,
so it is complete or absent; read back by ``zcvae.export.load``)::

    adapter_config.json, adapter_model.safetensors   the LoRA adapter and the z rows in peft's format
                                                       (peft's trainable-token delta: K rows, never the
                                                       full embedding matrix)
    latent_heads.safetensors                           z rows, router/prior heads (+ their calibration
                                                       buffers), soft-prompt projection, z-conditioned
                                                       norms (``z_norm.*``, with --z-conditioned-norm), and
                                                       the rows of every token zcvae added to the vocabulary
    tokenizer files                                    the backbone's tokenizer plus the template markers
                                                       and latent tokens
    run_config.json                                    the run's resolved configuration and c_base
    zcvae_export.json                                  backbone path and config, step, token ids
    README.md                                          model card: the latent, K, aggregation mode, c_base,
                                                       final metrics, how to load it
    merged/                                            (--merge) a standard Hugging Face checkpoint:
                                                       LoRA merged, z rows written into the embedding

Everything in it is read with safetensors or JSON.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from zcvae.runs.rundir import read_json

EXPORT_META = "zcvae_export.json"
LATENT_HEADS = "latent_heads.safetensors"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
MERGED = "merged"
EXPORT_FORMAT = 1
# Backbone config keys compared between an export and the backbone it is loaded onto.
BASE_KEYS = ("model_type", "vocab_size", "hidden_size", "n_embd", "num_hidden_layers", "n_layer",
             "num_attention_heads", "n_head", "num_key_value_heads", "intermediate_size", "tie_word_embeddings")


def base_config(backbone: str) -> dict[str, Any]:
    """The ``BASE_KEYS`` of a backbone's ``config.json``: an export records them, a load compares them."""
    config = read_json(Path(backbone) / "config.json", what="backbone config")
    return {k: config[k] for k in BASE_KEYS if k in config}
