"""Objective presets: expansion, explicit weight flags win, 'custom', the default preset, names, the table,
and kl-weight-scale (issue 10 section 2)."""

import json

import pytest

from zcvae.commands.aggregate import aggregate_runs, format_table
from zcvae.commands.cli import build_parser, resolve_train_config
from zcvae.config import (
    resolve_scale_factors,
    DEFAULT_OBJECTIVE,
    OBJECTIVE_PRESETS,
    RECONSTRUCTION_WEIGHT_FIELDS,
    TrainConfig,
    kl_weight_at,
    parse_train_run_name,
    train_run_name,
)
from zcvae.core.losses import ReconstructionLossConfig, reconstruction_weights

RAW, DIST, EX, TOK, TOKCC, TOKINV = RECONSTRUCTION_WEIGHT_FIELDS


def train_cfg(*argv):
    """A config exactly as `zcvae train ARGV` resolves it."""
    return resolve_train_config(build_parser().parse_args(["train", *argv]))


def weights(cfg):
    return {f: cfg.to_dict()[f] for f in RECONSTRUCTION_WEIGHT_FIELDS}


# each preset written out by hand (independently of OBJECTIVE_PRESETS): weights, then alpha
EXPECTED = {
    "raw": ({RAW: 1.0}, 1.0),
    "dist": ({DIST: 1.0}, 1.0),
    "tok": ({TOK: 1.0}, 0.5),
    "tokcc": ({TOKCC: 1.0}, 0.5),
    "tokinv": ({TOKINV: 1.0}, 0.5),  # issue 21: the alpha of tokcc, so the two compare at matched alpha
    "ex": ({EX: 1.0}, 1.0),
    "raw+tokcc": ({RAW: 1.0, TOKCC: 1.0}, 0.5),
    "raw+dist": ({RAW: 1.0, DIST: 1.0}, 1.0),
    "raw+tok+dist": ({RAW: 1.0, TOK: 1.0, DIST: 1.0}, 0.5),
}


def test_the_issue_presets_exist_by_exact_name():
    assert set(OBJECTIVE_PRESETS) == set(EXPECTED)


def test_objective_presets_come_from_their_file_and_are_the_flags_choices_and_no_run_preset(tmp_path):
    """One mechanism, files: presets/objectives.yaml holds them; --objective offers exactly them; --config objectives
    is not a run preset."""
    import dataclasses

    import yaml

    from zcvae.config import ObjectiveSection
    from zcvae.core.terms import term_by_abbreviation
    from zcvae.presets import objective_presets_path, preset_names

    written = yaml.safe_load(objective_presets_path().read_text())
    assert {name: {k if k == "token_weight_alpha" else term_by_abbreviation(k).weight_field: v for k, v in entries.items()}
            for name, entries in written.items()} == OBJECTIVE_PRESETS
    choices = {f.name: f for f in dataclasses.fields(ObjectiveSection)}["objective"].metadata["choices"]
    assert set(choices) == set(OBJECTIVE_PRESETS) | {"custom"}
    assert "objectives" not in preset_names() and {"default", "late-decisions"} <= set(preset_names())
    with pytest.raises(ValueError, match="config file objectives does not exist"):
        train_cfg("--config", "objectives")


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_objective_flag_expands_to_all_six_weights_and_alpha(name):
    cfg = train_cfg("--objective", name)
    expected_weights, alpha = EXPECTED[name]
    assert weights(cfg) == {f: expected_weights.get(f, 0.0) for f in RECONSTRUCTION_WEIGHT_FIELDS}
    assert cfg.objective.token_weight_alpha == alpha and cfg.objective.objective == name


def test_objective_raw_reproduces_the_library_defaults():
    lib = ReconstructionLossConfig()
    assert reconstruction_weights(train_cfg("--objective", "raw").reconstruction_config()) == reconstruction_weights(lib)
    assert train_cfg("--objective", "raw").objective.token_weight_alpha == lib.token_weight_alpha
    assert TrainConfig().objective.objective == "raw" and weights(TrainConfig()) == weights(train_cfg("--objective", "raw"))


def test_explicit_weight_flags_win_entry_by_entry():
    cfg = train_cfg("--objective", "raw+tokcc", "--reconstruction-weight", "0.25", "--token-weight-alpha", "2")
    assert cfg.objective.objective == "raw+tokcc"
    assert weights(cfg) == {**{f: 0.0 for f in RECONSTRUCTION_WEIGHT_FIELDS}, RAW: 0.25, TOKCC: 1.0}
    assert cfg.objective.token_weight_alpha == 2.0


def test_weight_flags_without_objective_are_exactly_the_objective():
    cfg = train_cfg("--distribution-normalized-reconstruction-weight", "1", "--reconstruction-weight", "0")
    assert cfg.objective.objective == "custom" and weights(cfg) == {**{f: 0.0 for f in RECONSTRUCTION_WEIGHT_FIELDS}, DIST: 1.0}
    cfg = train_cfg("--token-weighted-reconstruction-weight", "0.5")
    assert cfg.objective.objective == "custom" and cfg.objective.reconstruction_weight == 0.0 and cfg.objective.token_weighted_reconstruction_weight == 0.5


def test_no_objective_flags_give_the_default_preset(tmp_path):
    cfg = train_cfg()
    assert cfg.objective.objective == DEFAULT_OBJECTIVE
    assert weights(cfg) == weights(train_cfg("--objective", DEFAULT_OBJECTIVE))
    # a config file counts like flags
    path = tmp_path / "c.yaml"
    path.write_text("objective: dist\ndistribution_normalized_reconstruction_weight: 2\n")
    cfg = train_cfg("--config", str(path))
    assert cfg.objective.objective == "dist" and weights(cfg)[DIST] == 2.0 and weights(cfg)[RAW] == 0.0


def test_unknown_objective_is_refused_by_name():
    with pytest.raises(SystemExit):
        build_parser().parse_args(["train", "--objective", "raw+ex"])
    with pytest.raises(ValueError, match="objective"):
        TrainConfig.from_dict({"objective": "bogus"})


def test_a_saved_config_reloads_unchanged():
    cfg = train_cfg("--objective", "tokcc", "--reconstruction-weight", "0.5", "--kl-weight-scale", "tokens")
    again = TrainConfig.from_dict(json.loads(json.dumps(cfg.to_dict())))
    assert again.to_dict() == cfg.to_dict()


def test_run_name_shows_objective_and_kl_scale_and_parses_back():
    cfg = train_cfg("--objective", "raw+tokcc", "--reconstruction-loss-token-aggregation-mode", "sum",
                    "--kl-weight-scale", "tokens", "--seed", "2")
    name = train_run_name(cfg.to_dict())
    assert name == "agg-sum_obj-raw+tokcc_klscale-tokens_seed-2"
    back = parse_train_run_name(name)
    for field in (*RECONSTRUCTION_WEIGHT_FIELDS, "token_weight_alpha", "objective", "kl_weight_scale", "seed",
                  "reconstruction_loss_token_aggregation_mode"):
        assert back[field] == cfg.to_dict()[field], field
    # an override of a preset entry is named; the preset's own weights are not
    name = train_run_name(train_cfg("--objective", "tokcc", "--token-weight-alpha", "1").to_dict())
    assert name == "agg-mean_obj-tokcc_alpha-1"


def test_kl_weight_scale_multiplies_beta_through_the_schedule():
    cfg = TrainConfig.from_flat(max_steps=100, kl_weight=2.0, kl_schedule="constant", kl_weight_scale="tokens", kl_weight_factor=7.5)
    assert kl_weight_at(cfg, 0) == 15.0 and cfg.effective_kl_weight == 15.0
    ramp = TrainConfig.from_flat(max_steps=100, kl_weight=2.0, kl_weight_scale="tokens", kl_weight_factor=4.0)
    assert kl_weight_at(ramp, 10) == 0.0 and kl_weight_at(ramp, 40) == pytest.approx(4.0) and kl_weight_at(ramp, 99) == 8.0
    with pytest.raises(ValueError, match="kl_weight_factor"):
        TrainConfig.from_flat(kl_weight_factor=3.0)  # a factor without the tokens scale


def test_reconstruction_weight_scale_multiplies_the_mode_unit_weights_only():
    cfg = train_cfg("--objective", "raw+dist", "--token-weighted-reconstruction-weight", "0.5",
                    "--normalized-concentration-corrected-token-weighted-reconstruction-weight", "2",
                    "--reconstruction-weight-scale", "tokens")
    assert cfg.reconstruction_config().reconstruction_weight == 1.0  # unresolved: the trainer sets the factor
    scaled = cfg.replace(reconstruction_weight_factor=16.0).reconstruction_config()
    # raw and tok are in the mode's units (nats per token under mean) and are multiplied; dist and tokcc are
    # ratios to c_base, the same size in every mode, and stay
    assert (scaled.reconstruction_weight, scaled.token_weighted_reconstruction_weight) == (16.0, 8.0)
    assert scaled.distribution_normalized_reconstruction_weight == 1.0
    assert scaled.normalized_concentration_corrected_token_weighted_reconstruction_weight == 2.0
    assert cfg.replace(reconstruction_weight_factor=16.0).objective.reconstruction_weight == 1.0  # the field keeps what was given
    name = train_run_name(cfg.to_dict())
    assert "rscale-tokens" in name and parse_train_run_name(name)["reconstruction_weight_scale"] == "tokens"
    with pytest.raises(ValueError, match="reconstruction_weight_factor"):
        TrainConfig.from_flat(reconstruction_weight_factor=3.0)  # a factor without the tokens scale


@pytest.mark.parametrize("mode, sum_scale, factor", [("mean", None, 14.5), ("token", None, 14.5), ("sum", None, 1.0), ("sum", 16.0, 16.0)])
def test_reconstruction_weight_scale_resolves_to_a_sequences_size_in_every_mode(mode, sum_scale, factor):
    flags = ["--reconstruction-weight-scale", "tokens", "--reconstruction-loss-token-aggregation-mode", mode]
    if sum_scale is not None:
        flags += ["--reconstruction-loss-sum-scale", str(sum_scale)]
    cfg = resolve_scale_factors(train_cfg(*flags), mean_num_tokens=14.5)
    assert cfg.objective.reconstruction_weight_factor == factor and cfg.objective.kl_weight_factor is None
    # a resumed run keeps the factor it recorded, whatever the data says now
    assert resolve_scale_factors(cfg, mean_num_tokens=99.0).objective.reconstruction_weight_factor == factor
    assert resolve_scale_factors(train_cfg("--objective", "raw+dist"), mean_num_tokens=14.5).objective.reconstruction_weight_factor is None


def _write_run(root, name, config, factor, nmi):
    run = root / name
    run.mkdir()
    (run / "run_config.json").write_text(json.dumps({"config": config, "kl_weight_factor": factor}))
    (run / "metrics.jsonl").write_text(json.dumps({"step": 3, "split": "eval", "nmi": nmi}) + "\n")
    return run


def test_aggregate_table_shows_objective_and_kl_schedule(tmp_path):
    runs = []
    for seed, factor in ((0, 7.0), (1, 7.5)):
        cfg = train_cfg("--objective", "raw", "--reconstruction-loss-token-aggregation-mode", "sum",
                        "--kl-weight-scale", "tokens", "--seed", str(seed)).to_dict()
        cfg.update(kl_weight_factor=factor, run_name=f"raw-sum-tokens_seed-{seed}")
        runs.append(_write_run(tmp_path, f"s{seed}", cfg, factor, 0.5 + seed))
    cyc = train_cfg("--objective", "dist", "--kl-schedule", "cyclical", "--kl-weight", "3").to_dict()
    runs.append(_write_run(tmp_path, "cyc", {**cyc, "run_name": "cyc"}, 1.0, 0.0))
    rows = aggregate_runs(runs)
    assert len(rows) == 2 and rows[0]["n"] == 2  # the factor differs per seed but the setting is one group
    assert rows[0]["objective"] == "raw" and rows[0]["kl_schedule"] == "delay-ramp 0.3+0.2; beta x 7-7.5 (tokens)"
    assert rows[1]["objective"] == "dist" and rows[1]["beta"] == 3.0 and rows[1]["kl_schedule"] == "cyclical x4 0.3+0.2"
    header = format_table(rows).splitlines()[0]
    assert "| objective |" in header and "| beta | kl_schedule |" in header


# ---- issue 21: matched alpha between the token-weighted presets ----------------------------------------------


def _family(tmp_path, zip_group):
    path = tmp_path / "family.yaml"
    lines = ["base: {max_steps: 2, reconstruction_loss_token_aggregation_mode: mean}", "grid: {seed: [0, 1]}", "zip:", "  - " + json.dumps(zip_group)]
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.parametrize("zip_group, confounded", [
    # the confound the issue found: tokcc's preset alpha 0.5 against tokinv's old default alpha 1
    ({"objective": ["tokcc", "tokinv"], "token_weight_alpha": [0.5, 1.0]}, True),
    # tok against tokcc with an alpha only one of them has, in one mode
    ({"objective": ["tok", "tokcc", "tok"], "token_weight_alpha": [0.5, 0.5, 1.0]}, True),
    # matched: every preset at every alpha, or one preset at several alphas (the alpha family)
    ({"objective": ["tok", "tokcc", "tok", "tokcc"], "token_weight_alpha": [0.5, 0.5, 1.0, 1.0]}, False),
    ({"objective": ["tokcc", "tokcc"], "token_weight_alpha": [0.5, 2.0]}, False),
    # the presets themselves now share alpha 0.5
    ({"objective": ["tok", "tokcc", "tokinv", "dist"]}, False),
    # different alphas, but in different modes: nothing is compared across modes
    ({"objective": ["tokcc", "tokinv"], "token_weight_alpha": [0.5, 1.0],
      "reconstruction_loss_token_aggregation_mode": ["mean", "sum"]}, False),
    # a non-token-weighted preset's alpha is irrelevant
    ({"objective": ["tokcc", "dist"], "token_weight_alpha": [0.5, 1.0]}, False),
])
def test_sweep_planning_warns_about_token_weighted_arms_at_unmatched_alpha(tmp_path, capsys, zip_group, confounded):
    from zcvae.commands.sweep import local_main, main

    path = _family(tmp_path, zip_group)
    assert local_main([str(path), "--local", "--output-dir", str(tmp_path / "runs"), "--dry-run"]) == 0
    err = capsys.readouterr().err
    assert ("confounded by alpha" in err) is confounded, err
    if confounded:
        assert "differ in preset and also in alpha" in err and "mode mean" in err
    # the SLURM planner says the same
    assert main([str(path), "--out", str(tmp_path / "slurm"), "--dry-run"]) == 0
    assert ("confounded by alpha" in capsys.readouterr().err) is confounded


@pytest.mark.parametrize("alphas, confounded", [((0.5, 1.0), True), ((0.5, 0.5), False)])
def test_aggregate_warns_about_token_weighted_arms_at_unmatched_alpha(tmp_path, alphas, confounded):
    runs = []
    for objective, alpha in zip(("tokcc", "tokinv"), alphas):
        cfg = train_cfg("--objective", objective, "--token-weight-alpha", str(alpha)).to_dict()
        runs.append(_write_run(tmp_path, objective, {**cfg, "run_name": objective}, 1.0, 0.5))
    messages = []
    rows = aggregate_runs(runs, warn=messages.append)
    assert len(rows) == 2
    assert any("tokcc at alpha 0.5" in m and f"tokinv at alpha {alphas[1]:g}" in m for m in messages) is confounded, messages
    assert bool(messages) is confounded


def test_aggregate_cli_prints_the_confound_warning(tmp_path, capsys):
    from zcvae.commands.aggregate import main

    runs = []
    for objective, alpha in (("tok", "1"), ("tokcc", "0.5")):
        cfg = train_cfg("--objective", objective, "--token-weight-alpha", alpha).to_dict()
        runs.append(str(_write_run(tmp_path, objective, {**cfg, "run_name": objective}, 1.0, 0.5)))
    assert main(runs) == 0
    assert "confounded by alpha" in capsys.readouterr().err


def test_token_mode_and_sum_scale_are_named_and_parse_back():
    cfg = train_cfg("--objective", "dist", "--reconstruction-loss-token-aggregation-mode", "token", "--seed", "1")
    name = train_run_name(cfg.to_dict())
    assert name == "agg-token_obj-dist_seed-1"
    assert parse_train_run_name(name)["reconstruction_loss_token_aggregation_mode"] == "token"
    cfg = train_cfg("--objective", "raw", "--reconstruction-loss-token-aggregation-mode", "sum",
                    "--reconstruction-loss-sum-scale", "16")
    name = train_run_name(cfg.to_dict())
    assert name == "agg-sum_sumscale-16_obj-raw"
    back = parse_train_run_name(name)
    assert back["reconstruction_loss_sum_scale"] == 16.0 and back["reconstruction_loss_token_aggregation_mode"] == "sum"
    assert TrainConfig.from_dict({k: back[k] for k in ("objective", "reconstruction_loss_token_aggregation_mode",
                                                       "reconstruction_loss_sum_scale")}).objective.reconstruction_loss_sum_scale == 16.0
    # a plain sum run and a scaled one cannot share a name
    assert train_run_name(train_cfg("--objective", "raw", "--reconstruction-loss-token-aggregation-mode", "sum").to_dict()) \
        == "agg-sum_obj-raw"


def test_sum_scale_is_refused_outside_sum_mode_and_must_be_positive():
    with pytest.raises(ValueError, match="reconstruction_loss_sum_scale applies to .* sum only"):
        TrainConfig.from_flat(reconstruction_loss_sum_scale=4.0)
    with pytest.raises(ValueError, match="reconstruction_loss_sum_scale"):
        TrainConfig.from_flat(reconstruction_loss_token_aggregation_mode="sum", reconstruction_loss_sum_scale=0.0)
    cfg = TrainConfig.from_flat(reconstruction_loss_token_aggregation_mode="sum", reconstruction_loss_sum_scale=4.0)
    assert cfg.reconstruction_config().sum_scale == 4.0


def test_aggregate_mode_column_shows_token_and_the_sum_scale(tmp_path):
    runs = []
    for name, argv in (("tokenmode", ["--reconstruction-loss-token-aggregation-mode", "token"]),
                       ("scaled", ["--reconstruction-loss-token-aggregation-mode", "sum", "--reconstruction-loss-sum-scale", "16"])):
        cfg = train_cfg("--objective", "raw", *argv).to_dict()
        runs.append(_write_run(tmp_path, name, {**cfg, "run_name": name}, 1.0, 0.5))
    assert [row["mode"] for row in aggregate_runs(runs)] == ["token", "sum/16"]


def test_mean_mode_at_a_sequences_size_is_the_sum_when_every_example_has_the_same_length():
    """What --reconstruction-weight-scale tokens is for: with every n_i = n, mean mode with raw x n_bar and
    dist is J of sum mode exactly (raw x n is the sum; dist is a ratio to the mode's c_base, the same in both),
    values and gradients on the posterior and the branch NLLs; with different lengths they part (mean
    still weighs every example the same)."""
    import torch

    from zcvae.core.losses import reconstruction_terms, weighted_reconstruction

    def objective(mode, *, factor, mask):
        cfg = train_cfg("--objective", "raw+dist", "--reconstruction-loss-token-aggregation-mode", mode,
                        *(["--reconstruction-weight-scale", "tokens"] if factor else []))
        cfg = cfg.replace(reconstruction_weight_factor=factor) if factor else cfg
        gen = torch.Generator().manual_seed(0)
        nll = torch.rand(4, 3, 6, generator=gen).requires_grad_(True)
        logits = torch.randn(4, 3, generator=gen).requires_grad_(True)
        ref = torch.rand(4, 6, generator=gen)
        # c_base of each mode, as the reference store computes it: the mean of A_mode(b_i)
        n = mask.sum(-1).float()
        c_base = float(((ref * mask).sum(-1) / (n if mode == "mean" else 1.0)).mean())
        terms = reconstruction_terms(token_nll=nll, posterior=logits.softmax(-1), ref_nll=ref, mask=mask, c_base=c_base,
                                     config=cfg.reconstruction_config())
        j = weighted_reconstruction(terms, cfg.reconstruction_config()).mean()
        j.backward()
        return j.detach(), nll.grad, logits.grad

    equal = torch.ones(4, 6, dtype=torch.bool)
    for got, want in zip(objective("mean", factor=6.0, mask=equal), objective("sum", factor=None, mask=equal)):
        torch.testing.assert_close(got, want)
    ragged = torch.arange(6)[None, :] < torch.tensor([2, 3, 5, 6])[:, None]
    n_bar = float(ragged.sum(-1).float().mean())
    assert not torch.allclose(objective("mean", factor=n_bar, mask=ragged)[1], objective("sum", factor=None, mask=ragged)[1])
