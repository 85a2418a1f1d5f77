"""The shipped family files (launch/families/*.yaml): the runs each one promises, every run's parameters
recovered from its rendered SLURM script (mode included), and the sweep commands of the README and docs/."""

import re
from pathlib import Path

import pytest

from zcvae.commands.cli import build_parser, resolve_train_config
from zcvae.config import BEST_HYBRID, RECONSTRUCTION_WEIGHT_FIELDS, TrainConfig, preset_values
from zcvae.sweep.family import SlurmSettings, load_family, local_plan, plan_runs, resolve_defaults
from zcvae.sweep.slurm import DEFAULT_TEMPLATE, recover_params, recover_train_args, render_script

REPO = Path(__file__).resolve().parents[3]
FAMILIES = REPO / "launch" / "families"
SEEDS = {0, 1, 2}


def _arms(path):
    """(objective, mode, kl_weight_scale, alpha, beta, seed) of every run, read back through `zcvae train`."""
    family = load_family(path)
    defaults, _ = resolve_defaults(family, source="config")
    runs = plan_runs(family, defaults, check_known_fields=True)
    template = DEFAULT_TEMPLATE.read_text()
    slurm = SlurmSettings.from_dict(family.get("slurm"))
    out = []
    for run in runs:
        script = render_script(template_text=template, run=run, slurm=slurm, log_dir="/tmp/logs")
        assert recover_params(script) == run.params
        cfg = resolve_train_config(build_parser().parse_args(["train", *recover_train_args(script)]))
        # the script trains exactly the preset (no weight flag in the family overrides it)
        expected = {**preset_values(cfg.objective.objective)}
        for field in RECONSTRUCTION_WEIGHT_FIELDS:
            assert cfg.to_dict()[field] == expected[field], (run.name, field)
        if "token_weight_alpha" in run.params:
            assert cfg.objective.token_weight_alpha == run.params["token_weight_alpha"]
        elif "token_weight_alpha" in expected:
            assert cfg.objective.token_weight_alpha == expected["token_weight_alpha"]
        assert cfg.objective.reconstruction_loss_token_aggregation_mode == run.params["reconstruction_loss_token_aggregation_mode"]
        assert f"agg-{cfg.objective.reconstruction_loss_token_aggregation_mode}" in run.name and cfg.run.run_name == run.name
        out.append((cfg.objective.objective, cfg.objective.reconstruction_loss_token_aggregation_mode, cfg.objective.kl_weight_scale,
                    cfg.objective.token_weight_alpha, cfg.objective.kl_weight, cfg.optimization.seed))
    assert len(set(out)) == len(out)
    return out


def test_pilot_family_is_seed_001s_pilot():
    arms = _arms(FAMILIES / "pilot.yaml")
    expected = {("dist", m, "none") for m in ("mean", "sum")} | {("tokcc", m, "none") for m in ("mean", "sum")}
    expected |= {(BEST_HYBRID, m, "none") for m in ("mean", "sum")}
    expected |= {("raw", "mean", "none"), ("raw", "sum", "none"), ("raw", "sum", "tokens")}
    assert {a[:3] for a in arms} == expected
    for arm in expected:
        assert {a[5] for a in arms if a[:3] == arm} == SEEDS
    assert len(arms) == 27 and {a[4] for a in arms} == {1.0}


def test_alpha_family():
    arms = _arms(FAMILIES / "alpha.yaml")
    assert {(a[0], a[1], a[3]) for a in arms} == {("tokcc", m, al) for m in ("mean", "sum") for al in (0.0, 0.5, 1.0, 2.0)}
    assert len(arms) == 8 * 3 and {a[5] for a in arms} == SEEDS


def test_beta_family():
    arms = _arms(FAMILIES / "beta.yaml")
    objectives = {"raw", "dist", "tokcc", BEST_HYBRID}
    assert {(a[0], a[4]) for a in arms} == {(o, b) for o in objectives for b in (0.3, 1.0, 3.0)}
    assert {a[1] for a in arms} == {"mean", "sum"} and len(arms) == 4 * 3 * 2 * 3


@pytest.mark.parametrize("name", ["pilot", "alpha", "beta"])
def test_local_plan_overrides_task_and_output_dir(name, tmp_path):
    runs = local_plan(load_family(FAMILIES / f"{name}.yaml"), output_dir=tmp_path, task="sort")
    assert all(r.params["task"] == "sort" and r.params["output_dir"] == str(tmp_path / r.name) for r in runs)
    assert all(re.fullmatch(r"agg-(mean|sum)_obj-[a-z+]+_.*seed-[012]", r.name) for r in runs)
    TrainConfig.from_dict({k: v for k, v in runs[0].params.items()})  # every param is a config field


def test_readme_and_docs_sweep_commands_name_files_that_exist():
    pages = [REPO / "README.md", REPO / "launch" / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
    text = "".join(p.read_text() for p in pages)
    commands = re.findall(r"(?:python launch/sweep\.py|zcvae sweep) ([a-z]\S*\.yaml)", text)
    assert commands, "the README shows a sweep command"
    assert re.search(r"zcvae sweep [a-z]\S*\.yaml", (REPO / "README.md").read_text()), "the README shows a sweep command"
    for family in commands:
        assert (REPO / family).is_file(), family


@pytest.mark.parametrize("path", sorted(FAMILIES.glob("*.yaml")), ids=lambda p: p.stem)
def test_every_shipped_family_plans_with_known_fields_and_distinct_names(path):
    """A typo in a family's field, or two arms that collapse onto one run name, fails here rather than after an
    hour of sweeping."""
    family = load_family(path)
    defaults, _ = resolve_defaults(family, source="config")
    runs = plan_runs(family, defaults, check_known_fields=True)
    assert runs and len({r.name for r in runs}) == len(runs)
    for run in runs:
        TrainConfig.from_dict(dict(run.params))


def test_late_decisions_config_is_the_first_arm_of_late_pool_support():
    """The recipe users get (launch/configs/late-decisions.yaml) is the arm the late-decision table of
    docs/results/late-decisions.md measured, so the two files cannot drift apart."""
    config = REPO / "launch" / "configs" / "late-decisions.yaml"
    args = build_parser().parse_args(["train", "--config", str(config), "--task", "sort3", "--num-latents", "3"])
    cfg = resolve_train_config(args)
    family = load_family(FAMILIES / "late-pool-support.yaml")
    arm = {key: values[0] for key, values in family["zip"][0].items()}
    assert arm["kl_delay_fraction"] == 0.6 and arm["router_support_weight"] == 1.0
    for key, value in arm.items():
        assert cfg.to_dict()[key] == value, key
    assert cfg.objective.distribution_normalized_reconstruction_weight == 1.0 and cfg.objective.reconstruction_weight == 1.0


def _trained(path):
    """The resolved `zcvae train` config of every run of a family, read back from its rendered SLURM script."""
    family = load_family(path)
    defaults, _ = resolve_defaults(family, source="config")
    runs = plan_runs(family, defaults, check_known_fields=True)
    template = DEFAULT_TEMPLATE.read_text()
    slurm = SlurmSettings.from_dict(family.get("slurm"))
    cfgs = []
    for run in runs:
        script = render_script(template_text=template, run=run, slurm=slurm, log_dir="/tmp/logs")
        cfg = resolve_train_config(build_parser().parse_args(["train", *recover_train_args(script)]))
        assert cfg.run.run_name == run.name
        cfgs.append(cfg)
    return cfgs


def test_token_weighting_family_is_matched_alpha_on_the_late_decision_tasks():
    """tok, tokcc and tokinv at alpha 0.5 and 1, mean and sum, 3 seeds, on sort3 (pooled posterior) and mul,
    K = 3 with each task (issue 21, item 2), and no arm confounds preset with alpha."""
    from zcvae.sweep.family import confound_warnings

    cfgs = _trained(FAMILIES / "token-weighting.yaml")
    arms = {(c.data.task, c.objective.objective, c.objective.token_weight_alpha, c.objective.reconstruction_loss_token_aggregation_mode, c.optimization.seed) for c in cfgs}
    assert arms == {(t, o, a, m, s) for t in ("sort3", "mul") for o in ("tok", "tokcc", "tokinv")
                    for a in (0.5, 1.0) for m in ("mean", "sum") for s in SEEDS}
    assert len(cfgs) == len(arms) == 72
    assert {(c.data.task, c.model.num_latents, c.model.posterior_pooling) for c in cfgs} == {("sort3", 3, "mean"), ("mul", 3, "last")}
    for c in cfgs:
        weighted = {f for f in RECONSTRUCTION_WEIGHT_FIELDS if getattr(c.objective, f) > 0}
        assert weighted == {f for f, v in preset_values(c.objective.objective).items() if f in RECONSTRUCTION_WEIGHT_FIELDS and v > 0}
    family = load_family(FAMILIES / "token-weighting.yaml")
    runs = local_plan(family, output_dir="/tmp/tw")
    assert confound_warnings(runs) == []
    # dropping tokinv's alpha 0.5 arms would confound the family: the warning would fire
    assert confound_warnings([r for r in runs if not (r.params["objective"] == "tokinv" and r.params["token_weight_alpha"] == 0.5)])


def test_aggregation_family_is_seed_000s_four_arm_ablation():
    """mean, token, sum and sum / C, each with raw and dist, with and without kl-weight-scale tokens, 3 seeds, on
    sort (K 2) and sort3 (K 3, pooled posterior); C near each task's mean supervised length; mean stays default."""
    cfgs = _trained(FAMILIES / "aggregation.yaml")
    arms = {(c.data.task, c.objective.reconstruction_loss_token_aggregation_mode, c.objective.reconstruction_loss_sum_scale, c.objective.objective,
             c.objective.kl_weight_scale, c.optimization.seed) for c in cfgs}
    scale = {"sort": 14.0, "sort3": 16.0}
    assert arms == {(t, m, s, o, k, seed) for t in ("sort", "sort3")
                    for m, s in (("mean", None), ("token", None), ("sum", None), ("sum", scale[t]))
                    for o in ("raw", "dist") for k in ("none", "tokens") for seed in SEEDS}
    assert len(cfgs) == len(arms) == 96
    assert {(c.data.task, c.model.num_latents, c.model.posterior_pooling) for c in cfgs} == {("sort", 2, "last"), ("sort3", 3, "mean")}
    names = {c.run.run_name for c in cfgs}
    assert len(names) == 96 and any("agg-token_" in n for n in names) and any("_sumscale-16_" in n for n in names)
    assert TrainConfig().objective.reconstruction_loss_token_aggregation_mode == "mean"
    # C is about the validation mean of n_i of its task (y tokens + </y>), so sum / C has the per-token scale
    from zcvae.data.tasks import make_examples

    for task, c in scale.items():
        mean_n = sum(len(ex.y.split()) + 1 for ex in make_examples(task, seed=0, split="val", num_examples=300)) / 300
        assert abs(mean_n - c) < 1.0, (task, mean_n)


def test_the_tokcc_screen_is_the_default_against_the_default_with_tokcc_in_place_of_tok():
    """default-tokcc-mul.yaml states the default's fields rather than leaving them to the preset (it sets term
    weights, which turn the preset off): its first arm must be the no-flag default, field for field, and its second
    the same with the tok weight moved to tokcc."""
    from zcvae.config import DEFAULT_PRESET, load_config_file

    default = TrainConfig.from_dict({"task": "mul", "num_latents": 3, **load_config_file(DEFAULT_PRESET)}).to_dict()
    arms = {(c.objective.token_weighted_reconstruction_weight,
             c.objective.normalized_concentration_corrected_token_weighted_reconstruction_weight): c.to_dict()
            for c in _trained(FAMILIES / "default-tokcc-mul.yaml") if c.optimization.seed == 0}
    assert set(arms) == {(1.0, 0.0), (0.0, 1.0)}
    for (tok, tokcc), cfg in arms.items():
        swapped = {"token_weighted_reconstruction_weight": tok,
                   "normalized_concentration_corrected_token_weighted_reconstruction_weight": tokcc}
        differ = {k for k in default if k in load_config_file(DEFAULT_PRESET) or k.endswith("_weight") or k == "token_weight_alpha"}
        assert {k: cfg[k] for k in differ} == {**{k: default[k] for k in differ}, **swapped}, (tok, tokcc)


def test_the_default_families_run_the_no_flag_default_and_the_user_families_the_former_one():
    """default.yaml, default-add-search.yaml, user-*-default.yaml, k-spare-default.yaml, real-lm-default.yaml, real-lm-default-late.yaml and real-lm-default-user-late.yaml give no objective, so each run is the default preset, as `zcvae
    train` resolves it from the rendered arguments; user-late.yaml and user-ambiguous.yaml, whose runs the
    user-family tables of docs/results/ quote, name raw+dist and so keep the former default (the </y> state,
    no scale, no support)."""
    from zcvae.config import DEFAULT_PRESET, load_config_file

    preset = load_config_file(DEFAULT_PRESET)
    for name in ("default", "default-add-search", "user-late-default", "user-ambiguous-default", "k-spare-default", "real-lm-default",
                 "real-lm-default-late", "real-lm-default-user-late"):
        for cfg in _trained(FAMILIES / f"{name}.yaml"):
            assert all(cfg.to_dict()[k] == v for k, v in preset.items()), name
    tasks = {(c.data.task, c.model.num_latents, c.optimization.seed) for c in _trained(FAMILIES / "default.yaml")}
    assert tasks == {(t, k, s) for t, k in (("copy", 2), ("sort", 2), ("add", 2), ("search", 2), ("sort3", 3), ("mul", 3))
                     for s in (0, 1, 2)}
    # add and search at 3x the steps, from 3,000-step stages: the rows of docs/results/default.md for them
    longer = {(c.data.task, c.model.num_latents, c.optimization.max_steps, c.optimization.seed) for c in _trained(FAMILIES / "default-add-search.yaml")}
    assert longer == {(t, 2, 900, s) for t in ("add", "search") for s in (0, 1, 2)}
    for name in ("user-late", "user-ambiguous"):
        for cfg in _trained(FAMILIES / f"{name}.yaml"):
            assert (cfg.objective.objective, cfg.objective.reconstruction_weight_scale, cfg.model.posterior_pooling,
                    cfg.objective.router_support_weight) == ("raw+dist", "none", "last", 0.0), name


def test_verdict_next_step_family_is_the_late_decisions_preset():
    """verdict-next-step.yaml states the preset the verdict names for a merged default run: each run must resolve,
    field for field, to `zcvae train --config late-decisions` with the family's task, K and run settings."""
    from zcvae.config import load_config_file

    preset = load_config_file("late-decisions")
    settings = {k: v for k, v in load_family(FAMILIES / "verdict-next-step.yaml")["base"].items() if k not in preset}
    cfgs = _trained(FAMILIES / "verdict-next-step.yaml")
    assert {(c.data.task, c.optimization.seed) for c in cfgs} == {(t, s) for t in ("mul", "sort3") for s in (0, 1, 2)}
    for cfg in cfgs:
        args = ["train", "--config", "late-decisions", "--seed", str(cfg.optimization.seed), "--task", cfg.data.task]
        args += [arg for key, value in settings.items() for arg in (f"--{key.replace('_', '-')}", str(value))]
        expected = resolve_train_config(build_parser().parse_args(args)).to_dict()
        # what the sweep sets around the run: its name and directory, and --resume auto
        around = {"run_name", "output_dir", "resume"}
        assert {k: v for k, v in cfg.to_dict().items() if k not in around} == {k: v for k, v in expected.items() if k not in around}
