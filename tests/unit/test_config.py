"""The config in sections: every field is a flag and a flat key of one section, files (flat or nested) and flags
merge, unknown keys, keys given twice and bad values fail, and old flat run configs still load."""

import json

import pytest

from zcvae.commands.cli import add_config_flags, resolve_train_config
from zcvae.config import FLAT_KEYS, TrainConfig, kl_delay_end, kl_weight_at, lr_factor_at, train_run_name


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
    assert cfg.objective.reconstruction_loss_token_aggregation_mode == "sum"
    assert cfg.objective.token_weighted_reconstruction_weight == 0.5
    assert cfg.objective.normalized_concentration_corrected_token_weighted_reconstruction_weight == 2.0
    assert (cfg.objective.token_weight_alpha, cfg.model.latent_type, cfg.model.latent_dim, cfg.objective.kl_weight) == (0.5, "continuous", 4, 3.0)
    assert (cfg.model.backbone, cfg.data.task, cfg.run.output_dir, cfg.optimization.max_steps) == ("/tmp/b", "sort", "o", 7)
    assert (cfg.optimization.micro_batch_size, cfg.optimization.gradient_accumulation_steps, cfg.optimization.seed, cfg.engine.engine) == (3, 2, 5, "fsdp2")
    assert cfg.run.progress_bar is False and cfg.model.lora_target_modules == ["q_proj", "v_proj"]


def test_flags_win_over_the_file(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("kl-weight: 3\nseed: 4\nreconstruction_loss_token_aggregation_mode: sum\n")
    cfg = _parse(["--config", str(path), "--seed", "9"])
    assert (cfg.objective.kl_weight, cfg.optimization.seed, cfg.objective.reconstruction_loss_token_aggregation_mode) == (3, 9, "sum")
    jpath = tmp_path / "c.json"
    jpath.write_text(json.dumps({"num_latents": 3}))
    assert _parse(["--config", str(jpath)]).model.num_latents == 3


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
    cfg = TrainConfig.from_flat(max_steps=100, kl_weight=2.0, kl_delay_fraction=0.3, kl_ramp_fraction=0.2)
    assert kl_weight_at(cfg, 0) == 0 and kl_weight_at(cfg, 29) == 0
    assert kl_weight_at(cfg, 40) == pytest.approx(1.0) and kl_weight_at(cfg, 50) == 2.0 and kl_weight_at(cfg, 99) == 2.0
    cyc = TrainConfig.from_flat(max_steps=100, kl_schedule="cyclical", kl_cycles=4, kl_weight=1.0, kl_delay_fraction=0.2, kl_ramp_fraction=0.4)
    assert kl_weight_at(cyc, 25) == 0 and kl_weight_at(cyc, 35) == pytest.approx(0.5) and kl_weight_at(cyc, 49) == 1.0
    assert kl_weight_at(TrainConfig.from_flat(kl_schedule="constant", kl_weight=0.7), 0) == 0.7


@pytest.mark.parametrize("fields, end", [
    ({"kl_delay_fraction": 0.6}, 181),  # beta is 0 through step 180 (the ramp starts from 0 there)
    ({"kl_delay_fraction": 0.3, "kl_ramp_fraction": 0.0}, 90),
    ({"kl_schedule": "cyclical", "kl_cycles": 4, "kl_delay_fraction": 0.2}, 16),  # the first cycle's delay
    ({"kl_schedule": "constant"}, None),
    ({"kl_delay_fraction": 0.0}, None),
    ({"kl_delay_fraction": 1.0, "kl_ramp_fraction": 0.0}, None),  # beta never leaves 0
    ({"kl_delay_fraction": 0.6, "kl_weight": 0.0}, None),
])
def test_kl_delay_end_is_the_first_step_with_a_positive_beta(fields, end):
    cfg = TrainConfig.from_flat(max_steps=300, **fields)
    assert kl_delay_end(cfg) == end
    if end is not None:
        assert all(kl_weight_at(cfg, step) == 0 for step in range(end)) and kl_weight_at(cfg, end) > 0


def test_lr_warmup_then_cosine_to_floor():
    cfg = TrainConfig.from_flat(max_steps=110, warmup_steps=10, min_lr_ratio=0.1)
    assert lr_factor_at(cfg, 0) == pytest.approx(0.1) and lr_factor_at(cfg, 9) == pytest.approx(1.0)
    assert lr_factor_at(cfg, 10) == pytest.approx(1.0) and lr_factor_at(cfg, 110) == pytest.approx(0.1)
    assert lr_factor_at(cfg, 60) == pytest.approx(0.55)


def test_help_documents_every_field(capsys):
    from zcvae.commands.cli import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["train", "--help"])
    text = capsys.readouterr().out
    for name in FLAT_KEYS:
        assert "--" + name.replace("_", "-") in text


# ---- sections ----------------------------------------------------------------------------------------
from pathlib import Path  # noqa: E402

from zcvae.config import SECTIONS, flat_fields, flat_values  # noqa: E402
from zcvae.runs.rundir import CONFIG_SECTIONS, flat_config, read_run_record  # noqa: E402

# run_config.json as `zcvae train --task copy --max-steps 2` wrote it before the config had sections
FLAT_RUN_CONFIG = Path(__file__).parents[1] / "data" / "run_config_flat.json"


def test_every_flat_key_is_a_field_of_exactly_one_section():
    names = [f.name for f in flat_fields()]
    assert len(names) == len(set(names)) == len(FLAT_KEYS)
    for name, section in FLAT_KEYS.items():
        assert name in {f.name for f in __import__("dataclasses").fields(SECTIONS[section])}
    assert tuple(SECTIONS) == CONFIG_SECTIONS  # run_config.json's reader knows the same sections
    assert set(TrainConfig().to_dict()) == set(FLAT_KEYS)


def test_report_to_chooses_the_metric_sinks_and_is_not_part_of_the_run_name():
    cfg = _parse(["--report-to", "jsonl,wandb"])  # wandb is imported only when a run opens its sink
    assert cfg.run.report_to == "jsonl,wandb"
    assert train_run_name(cfg.to_dict()) == train_run_name(_parse([]).to_dict())
    with pytest.raises(ValueError, match="report_to must include jsonl"):
        _parse(["--report-to", "tensorboard"])
    with pytest.raises(ValueError, match="report_to: unknown sink 'mlflow'"):
        _parse(["--report-to", "jsonl,mlflow"])


def test_nested_yaml_equals_flat_yaml(tmp_path):
    flat, nested = tmp_path / "flat.yaml", tmp_path / "nested.yaml"
    flat.write_text("max_steps: 7\nlora-learning-rate: 0.002\nobjective: dist\nengine: local\nnum_latents: 3\n")
    nested.write_text("optimization:\n  max_steps: 7\n  lora-learning-rate: 0.002\nobjective:\n  objective: dist\n"
                      "engine:\n  engine: local\nmodel: {num_latents: 3}\n")
    a, b = _parse(["--config", str(flat)]), _parse(["--config", str(nested)])
    assert a.to_dict() == b.to_dict()
    assert (b.optimization.max_steps, b.optimization.lora_learning_rate, b.objective.objective, b.model.num_latents) == (7, 0.002, "dist", 3)
    mixed = tmp_path / "mixed.yaml"
    mixed.write_text("max_steps: 7\nmodel: {num_latents: 3}\n")
    assert _parse(["--config", str(mixed), "--num-latents", "4"]).model.num_latents == 4  # a flag still wins


@pytest.mark.parametrize("text, match", [
    ("max_steps: 7\noptimization: {max_steps: 8}\n", "max_steps is given twice, as max_steps and as optimization.max_steps"),
    ("optimization: {max-steps: 8}\nmax_steps: 7\n", "max_steps is given twice"),
    ("optimization: {kl_weight: 1.0}\n", r"unknown key optimization.kl_weight \(it belongs in section 'objective'\)"),
    ("model: {no_such_field: 1}\n", "unknown key model.no_such_field"),
    ("no_such_field: 1\n", r"unknown keys \['no_such_field'\]"),
    ("optimization: {max_steps: two}\n", "max_steps must be of type int"),
])
def test_bad_nested_keys_name_the_key(tmp_path, text, match):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(ValueError, match=match):
        _parse(["--config", str(path)])


def test_sections_round_trip_and_replace():
    cfg = _parse(["--objective", "tokcc", "--max-steps", "9", "--engine", "local", "--num-latents", "3"])
    nested = json.loads(json.dumps(cfg.to_sections()))
    assert list(nested) == list(SECTIONS) and nested["optimization"]["max_steps"] == 9
    assert TrainConfig.from_dict(nested).to_dict() == cfg.to_dict() == TrainConfig.from_dict(cfg.to_dict()).to_dict()
    assert flat_config(nested) == cfg.to_dict() == flat_values(nested)
    changed = cfg.replace(run_name="r", max_steps=10)
    assert (changed.run.run_name, changed.optimization.max_steps, cfg.optimization.max_steps) == ("r", 10, 9)
    with pytest.raises(ValueError, match="max_steps must be >= 1"):
        cfg.replace(max_steps=0)
    assert TrainConfig.from_flat(max_steps=5).to_dict() == TrainConfig().replace(max_steps=5).to_dict()


def test_a_flat_run_config_from_before_the_sections_still_loads(tmp_path):
    record = json.loads(FLAT_RUN_CONFIG.read_text())
    assert "max_steps" in record["config"] and "optimization" not in record["config"]  # really the old layout
    old = TrainConfig.from_dict(record["config"])
    assert (old.data.task, old.optimization.max_steps, old.objective.objective) == ("copy", 2, record["config"]["objective"])
    # every recorded field as recorded; a field added since (ADDED_SINCE) at its default
    ADDED_SINCE = {"router_support_schedule": "constant", "reconstruction_weight_scale": "none", "reconstruction_weight_factor": None,
                   "base_dtype": None, "kl_delay_mode": "fixed", "kl_delay_max_fraction": 0.8, "kl_delay_read_share": 0.5,
                   "kl_delay_check_every": 10, "follow_cores": False, "report_to": "tensorboard,jsonl",
                   "reference_refresh_every": 0, "z_conditioned_norm": False}
    assert old.to_dict() == {**ADDED_SINCE, **record["config"]}
    # a run directory of either layout reads back as the same flat config
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "run_config.json").write_text(json.dumps(record))
    (tmp_path / "new").mkdir()
    (tmp_path / "new" / "run_config.json").write_text(json.dumps({**record, "config": old.to_sections()}))
    assert read_run_record(tmp_path / "old")["config"] == record["config"]
    assert read_run_record(tmp_path / "new")["config"] == {**ADDED_SINCE, **record["config"]}


def test_a_named_preset_is_a_config_file_that_ships_with_the_package(tmp_path, monkeypatch):
    """`--config late-decisions` reads the packaged preset from any directory; flags still win over it,
    a file of that name in the working directory wins over the preset, and an unknown name says which
    presets exist. launch/configs/ links to the same file, so there is one copy of the recipe."""
    from pathlib import Path

    from zcvae.presets import LATE_DECISIONS, preset_names, preset_path

    monkeypatch.chdir(tmp_path)
    cfg = _parse(["--config", LATE_DECISIONS, "--num-latents", "3", "--kl-delay-fraction", "0.5"])
    assert (cfg.objective.objective, cfg.objective.reconstruction_loss_token_aggregation_mode, cfg.model.posterior_pooling,
            cfg.objective.router_support_weight) == ("raw+dist", "sum", "mean", 1.0)
    assert (cfg.model.num_latents, cfg.objective.kl_delay_fraction) == (3, 0.5)
    assert LATE_DECISIONS in preset_names() and preset_path("nope") is None
    (tmp_path / LATE_DECISIONS).write_text('{"seed": 5}')  # no suffix: read as JSON
    assert _parse(["--config", LATE_DECISIONS]).objective.reconstruction_loss_token_aggregation_mode == "mean"
    with pytest.raises(ValueError, match="nope does not exist .*late-decisions"):
        _parse(["--config", "nope"])
    repo = Path(__file__).resolve().parents[2]
    assert (repo / "launch" / "configs" / "late-decisions.yaml").resolve() == preset_path(LATE_DECISIONS).resolve()
    assert '"zcvae.presets" = ["*.yaml"]' in (repo / "pyproject.toml").read_text()  # shipped in a wheel too


def test_the_late_decisions_preset_round_trips_through_the_run_name_and_run_config(tmp_path):
    """A run started with --config late-decisions names every field the preset sets, the name parses back
    to them, and run_config.json's sections read back (flat) to the same values."""
    from zcvae.config import load_config_file, parse_train_run_name, train_run_name
    from zcvae.presets import LATE_DECISIONS
    from zcvae.runs.rundir import read_run_record

    preset = load_config_file(LATE_DECISIONS)
    cfg = _parse(["--config", LATE_DECISIONS, "--num-latents", "3", "--router-support-schedule", "delay"])
    name = train_run_name(cfg.to_dict())
    parsed = parse_train_run_name(name)
    assert {k: parsed[k] for k in preset} == preset, name
    assert (parsed["num_latents"], parsed["router_support_schedule"]) == (3, "delay")
    (tmp_path / "run_config.json").write_text(json.dumps({"config": cfg.to_sections()}))
    flat = read_run_record(tmp_path)["config"]
    assert {k: flat[k] for k in preset} == preset and flat["router_support_schedule"] == "delay"


def test_the_model_config_is_the_model_section_without_a_hand_copy():
    """Every ModelConfig field comes from the model section's field of the same name (none left at the model's
    own default by a forgotten copy), plus the fresh-marker flag under the model's name and the base dtype."""
    import dataclasses

    from zcvae.config import ModelSection
    from zcvae.model.config import ModelConfig

    changed = dict(latent_type="continuous", latent_dim=5, num_z_slots=3, num_latent_samples=2, learned_prior=False, lora_r=4,
                   lora_alpha=7, lora_dropout=0.1, lora_target_modules=["q_proj"], branch_chunk_size=3, z_init_noise=0.2,
                   gradient_checkpointing=True, posterior_pooling="mean", share_x_prefix=False, trust_remote_code=True,
                   allow_fresh_markers=True, precision="bf16")
    cfg = TrainConfig.from_flat(task="copy", **changed)
    model = cfg.model_config()
    for f in dataclasses.fields(ModelSection):
        if f.name in {g.name for g in dataclasses.fields(ModelConfig)}:
            assert getattr(model, f.name) == getattr(cfg.model, f.name), f.name
    assert model.train_fresh_markers is True and model.dtype == "bfloat16"
    untouched = {g.name for g in dataclasses.fields(ModelConfig)} - {f.name for f in dataclasses.fields(ModelSection)}
    assert untouched == {"train_fresh_markers", "dtype", "disable_backbone_dropout"}, "a new model field needs a section field"
    assert TrainConfig.from_flat(task="copy", z_conditioned_norm=True).model_config().z_conditioned_norm
