"""The flat config: every field is a flag, files and flags merge, unknown keys and bad values fail."""

import json

import pytest

from zcvae.commands.cli import add_config_flags, resolve_train_config
from zcvae.config import TrainConfig, kl_weight_at, lr_factor_at


def _parse(argv):
    import argparse

    parser = argparse.ArgumentParser()
    parser.add_argument("--config")
    add_config_flags(parser)
    return resolve_train_config(parser.parse_args(argv))


def test_issue_flags_exist_and_set_fields():
    cfg = _parse([
        "--reconstruction-loss-token-aggregation-mode", "sum",
        "--token-weighted-reconstruction-weight", "0.5",
        "--normalized-concentration-corrected-token-weighted-reconstruction-weight", "2",
        "--token-weight-alpha", "0.5", "--latent-type", "continuous", "--latent-dim", "4",
        "--kl-weight", "3", "--backbone", "/tmp/b", "--task", "sort", "--output-dir", "o",
        "--max-steps", "7", "--micro-batch-size", "3", "--gradient-accumulation-steps", "2", "--seed", "5",
        "--engine", "fsdp2", "--no-progress-bar", "--lora-target-modules", "q_proj", "v_proj",
    ])
    assert cfg.reconstruction_loss_token_aggregation_mode == "sum"
    assert cfg.token_weighted_reconstruction_weight == 0.5
    assert cfg.normalized_concentration_corrected_token_weighted_reconstruction_weight == 2.0
    assert (cfg.token_weight_alpha, cfg.latent_type, cfg.latent_dim, cfg.kl_weight) == (0.5, "continuous", 4, 3.0)
    assert (cfg.backbone, cfg.task, cfg.output_dir, cfg.max_steps) == ("/tmp/b", "sort", "o", 7)
    assert (cfg.micro_batch_size, cfg.gradient_accumulation_steps, cfg.seed, cfg.engine) == (3, 2, 5, "fsdp2")
    assert cfg.progress_bar is False and cfg.lora_target_modules == ["q_proj", "v_proj"]


def test_flags_win_over_the_file(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("kl-weight: 3\nseed: 4\nreconstruction_loss_token_aggregation_mode: sum\n")
    cfg = _parse(["--config", str(path), "--seed", "9"])
    assert (cfg.kl_weight, cfg.seed, cfg.reconstruction_loss_token_aggregation_mode) == (3, 9, "sum")
    jpath = tmp_path / "c.json"
    jpath.write_text(json.dumps({"num_latents": 3}))
    assert _parse(["--config", str(jpath)]).num_latents == 3


def test_unknown_keys_and_bad_values_name_the_field(tmp_path):
    with pytest.raises(ValueError, match="bogus_field"):
        TrainConfig.from_dict({"bogus_field": 1})
    path = tmp_path / "c.yaml"
    path.write_text("not_a_field: 1\n")
    with pytest.raises(ValueError, match=r"c\.yaml.*not_a_field"):
        _parse(["--config", str(path)])
    for bad, name in [({"reconstruction_loss_token_aggregation_mode": "median"}, "reconstruction_loss_token_aggregation_mode"),
                      ({"num_latents": 0}, "num_latents"), ({"kl_weight": -1.0}, "kl_weight"),
                      ({"reconstruction_weight": 0.0}, "reconstruction weight"),
                      ({"zfree_reference_scale": 0.0}, "zfree_reference_scale"),
                      ({"train_data": "a.jsonl"}, "val_data")]:
        with pytest.raises(ValueError, match=name):
            TrainConfig.from_dict(bad)


def test_kl_schedule_delay_then_ramp_and_cyclical():
    cfg = TrainConfig(max_steps=100, kl_weight=2.0, kl_delay_fraction=0.3, kl_ramp_fraction=0.2)
    assert kl_weight_at(cfg, 0) == 0 and kl_weight_at(cfg, 29) == 0
    assert kl_weight_at(cfg, 40) == pytest.approx(1.0) and kl_weight_at(cfg, 50) == 2.0 and kl_weight_at(cfg, 99) == 2.0
    cyc = TrainConfig(max_steps=100, kl_schedule="cyclical", kl_cycles=4, kl_weight=1.0, kl_delay_fraction=0.2, kl_ramp_fraction=0.4)
    assert kl_weight_at(cyc, 25) == 0 and kl_weight_at(cyc, 35) == pytest.approx(0.5) and kl_weight_at(cyc, 49) == 1.0
    assert kl_weight_at(TrainConfig(kl_schedule="constant", kl_weight=0.7), 0) == 0.7


def test_lr_warmup_then_cosine_to_floor():
    cfg = TrainConfig(max_steps=110, warmup_steps=10, min_lr_ratio=0.1)
    assert lr_factor_at(cfg, 0) == pytest.approx(0.1) and lr_factor_at(cfg, 9) == pytest.approx(1.0)
    assert lr_factor_at(cfg, 10) == pytest.approx(1.0) and lr_factor_at(cfg, 110) == pytest.approx(0.1)
    assert lr_factor_at(cfg, 60) == pytest.approx(0.55)


def test_help_documents_every_field(capsys):
    from zcvae.commands.cli import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["train", "--help"])
    text = capsys.readouterr().out
    for name in TrainConfig.__dataclass_fields__:
        assert "--" + name.replace("_", "-") in text
