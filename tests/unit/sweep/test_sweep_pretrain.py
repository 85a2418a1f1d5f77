"""A family's ``pretrain:`` block: the entangled stage its runs start from, planned and built by the sweep."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import yaml

from zcvae.sweep.family import load_family, local_plan, stage_status, validate_family

ROOT = Path(__file__).resolve().parents[3]


def family(**pretrain) -> dict:
    return {"pretrain": {"backbone": "smollm2", "max_steps": 5, **pretrain},
            "base": {"num_latents": 2, "max_steps": 3, "reconstruction_loss_token_aggregation_mode": "mean"}, "grid": {"seed": [0, 1]}, "zip": [{"objective": ["raw", "raw+dist"]}]}


def test_stage_per_task_becomes_each_runs_backbone_and_leaves_names_alone(tmp_path):
    with_stage = local_plan(family(), output_dir=tmp_path, task="sort")
    plain = local_plan({k: v for k, v in family().items() if k != "pretrain"}, output_dir=tmp_path, task="sort")
    assert [r.name for r in with_stage] == [r.name for r in plain]
    stage_dir = str(tmp_path / "entangled-sort")
    for run in with_stage:
        assert run.params["backbone"] == stage_dir
        assert run.pretrain == {"backbone": "smollm2", "max_steps": 5, "task": "sort", "output_dir": stage_dir}
    assert all(r.pretrain is None and "backbone" not in r.params for r in plain)


def test_jsonl_runs_get_a_stage_on_their_own_data(tmp_path):
    fam = family()
    fam["base"].update(train_data="data/train.jsonl", val_data="data/val.jsonl")
    run = local_plan(fam, output_dir=tmp_path)[0]
    assert run.pretrain["train_data"] == "data/train.jsonl" and run.pretrain["val_data"] == "data/val.jsonl"
    assert run.params["backbone"] == str(tmp_path / "entangled-train")


@pytest.mark.parametrize("block, message", [
    ({"backbone": "x", "max_step": 3}, r"pretrain\.max_step: not a `zcvae pretrain` field"),
    ({"backbone": "x", "task": "copy"}, r"pretrain\.task: set by the sweep"),
    ({"backbone": "x", "output_dir": "y"}, r"pretrain\.output_dir: set by the sweep"),
    ([], r"pretrain: must be a non-empty mapping"),
])
def test_bad_pretrain_blocks_name_the_key(block, message):
    fam = {**family(), "pretrain": block}
    with pytest.raises(ValueError, match=message):
        validate_family(fam)


def test_a_backbone_in_base_and_a_stage_are_refused():
    fam = family()
    fam["base"]["backbone"] = "somewhere"
    with pytest.raises(ValueError, match="base.backbone: the family's pretrain block builds"):
        validate_family(fam)


def _fake_sbatch(tmp_path):
    """`sbatch` for a machine without SLURM: logs its arguments, answers `--parsable` with "<id>;cluster"."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    script = bin_dir / "sbatch"
    script.write_text('#!/bin/bash\necho "$*" >> "$SBATCH_LOG"\nn=$(wc -l < "$SBATCH_LOG")\n'
                      'if [[ "$1" == --parsable ]]; then echo "$((4000 + n));cl"; else echo "Submitted batch job $((4000 + n))"; fi\n')
    script.chmod(0o755)
    return bin_dir


def test_slurm_renders_the_stage_as_a_job_the_runs_depend_on(tmp_path):
    """One job script per stage (`zcvae pretrain ... --resume auto` into the runs' backbone), every run's job
    submitted with afterok on it by submit.sh, and both kinds in the manifest, stages first."""
    from zcvae.commands.cli import build_parser
    from zcvae.commands.sweep import main
    from zcvae.sweep.flags import parse_train_flags
    from zcvae.sweep.slurm import recover_params, recover_train_args

    fam = family()
    fam["base"]["output_dir"] = "/scratch/study"
    fam["grid"]["task"] = ["copy", "sort"]
    fam["slurm"] = {"nodes": 2, "gpus_per_node": 4, "engine": "fsdp2"}
    path = tmp_path / "f.yaml"
    path.write_text(yaml.safe_dump(fam))
    out = tmp_path / "out"
    assert main([str(path), "--out", str(out), "--dry-run"]) == 0
    assert not out.exists()
    assert main([str(path), "--out", str(out)]) == 0

    records = [json.loads(line) for line in (out / "manifest.jsonl").read_text().splitlines()]
    assert [r["kind"] for r in records] == ["stage"] * 2 + ["run"] * 8
    stages = {r["stage"]: r for r in records[:2]}
    assert sorted(stages) == ["entangled-copy", "entangled-sort"]
    for task in ("copy", "sort"):
        stage = stages[f"entangled-{task}"]
        assert stage["script"] == f"entangled-{task}.sbatch"
        assert stage["params"] == {"backbone": "smollm2", "max_steps": 5, "task": task, "output_dir": f"/scratch/study/entangled-{task}"}
        text = (out / stage["script"]).read_text()
        assert recover_params(text) == stage["params"]
        assert '-m zcvae pretrain "${TRAIN_ARGS[@]}"' in text and "#SBATCH --job-name=zcvae-entangled-" + task in text
        assert "#SBATCH --nodes=2" in text and "#SBATCH --requeue" in text
        args = recover_train_args(text)
        assert args[-2:] == ["--resume", "auto"]
        assert parse_train_flags(args) == {"backbone": "smollm2", "max_steps": "5", "task": task,
                                           "output_dir": f"/scratch/study/entangled-{task}", "resume": "auto"}
        parsed = build_parser().parse_args(["pretrain", *args])  # the real `zcvae pretrain` flags
        assert (parsed.backbone, parsed.task, parsed.resume, parsed.max_steps) == ("smollm2", task, "auto", 5)
    runs = records[2:]
    for run in runs:
        task = run["params"]["task"]
        assert run["after"] == f"entangled-{task}.sbatch"
        assert run["params"]["backbone"] == f"/scratch/study/entangled-{task}"
        flags = parse_train_flags(recover_train_args((out / run["script"]).read_text()))
        assert flags["backbone"] == f"/scratch/study/entangled-{task}" and flags["resume"] == "auto"
        assert "backbone" not in run["run_name"]  # named as without the stage

    # submit.sh, with an sbatch that records what it was asked: stages first, each run after its own stage
    log = tmp_path / "sbatch.log"
    env = {**os.environ, "PATH": f"{_fake_sbatch(tmp_path)}:{os.environ['PATH']}", "SBATCH_LOG": str(log)}
    result = subprocess.run(["bash", str(out / "submit.sh")], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    calls = log.read_text().splitlines()
    assert calls[:2] == ["--parsable entangled-copy.sbatch", "--parsable entangled-sort.sbatch"]
    job_of = {"copy": "4001", "sort": "4002"}  # the fake's ids, with ";cl" stripped by submit.sh
    assert sorted(calls[2:]) == sorted(f"--dependency=afterok:{job_of[r['params']['task']]} {r['script']}" for r in runs)


def test_slurm_without_a_stage_submits_every_run_at_once(tmp_path):
    from zcvae.commands.sweep import main

    fam = {k: v for k, v in family().items() if k != "pretrain"}
    path = tmp_path / "f.yaml"
    path.write_text(yaml.safe_dump(fam))
    assert main([str(path), "--out", str(tmp_path / "out")]) == 0
    records = [json.loads(line) for line in (tmp_path / "out" / "manifest.jsonl").read_text().splitlines()]
    assert {r["kind"] for r in records} == {"run"} and {r["after"] for r in records} == {None}
    submit = (tmp_path / "out" / "submit.sh").read_text()
    assert "--dependency" not in submit and "--parsable" not in submit
    assert sorted(line for line in submit.splitlines() if line.startswith("sbatch ")) == sorted(f"sbatch {r['script']}" for r in records)


def test_slurm_refuses_a_stage_that_zcvae_pretrain_would_refuse(tmp_path, capsys):
    from zcvae.commands.sweep import main

    path = tmp_path / "f.yaml"
    path.write_text(yaml.safe_dump(family(max_steps=0)))
    assert main([str(path), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "pretrain (the stage in" in err and "max_steps" in err, err
    assert not (tmp_path / "out").exists()


def test_stage_status_reuses_only_a_stage_built_with_the_same_settings(tmp_path, raw_tiny_backbone):
    from zcvae.backbone.pretraining import pretrain
    from zcvae.backbone.stage_config import PretrainConfig

    stage = {"backbone": str(raw_tiny_backbone()), "task": "copy", "output_dir": str(tmp_path / "entangled-copy"),
             "max_steps": 2, "batch_size": 4, "num_train_examples": 32, "num_val_examples": 8, "num_decode_examples": 0,
             "warmup_steps": 1, "device": "cpu"}
    assert stage_status(stage) == "to run"
    pretrain(PretrainConfig.from_dict(stage))
    assert stage_status(stage) == "finished"
    with pytest.raises(ValueError, match=r"built with other settings \(max_steps 2 there, 3 in the family\)"):
        stage_status({**stage, "max_steps": 3})


@pytest.mark.parametrize("name", ["real-lm-copy.yaml", "real-lm-late.yaml"])
def test_shipped_real_lm_families_plan_with_their_stage(tmp_path, name):
    runs = local_plan(load_family(ROOT / "launch" / "families" / name), output_dir=tmp_path)
    assert len(runs) == 6 and len({r.pretrain["output_dir"] for r in runs}) == 1
    assert runs[0].pretrain["backbone"] == "smollm2"


def test_demo_backbone_runs_the_real_lm_stage_with_raw_mean_and_the_default():
    """`zcvae demo --backbone` builds the stage of launch/families/real-lm-copy.yaml and real-lm-default.yaml (so
    the demo and the studies share one reference) and runs their base as raw mean and as the default preset."""
    from zcvae.commands.demo import real_lm_family
    from zcvae.config import DEFAULT_OBJECTIVE, field_defaults, load_config_file

    shipped = load_family(ROOT / "launch" / "families" / "real-lm-default.yaml")
    demo = real_lm_family(backbone="smollm2", seeds=3)
    for key in ("pretrain", "base", "grid"):
        assert demo[key] == shipped[key], key
    (columns,) = demo["zip"]
    raw, default = ({k: v[i] for k, v in columns.items()} for i in range(2))
    assert (raw["objective"], default["objective"]) == ("raw", DEFAULT_OBJECTIVE)
    assert all(default[k] == v for k, v in load_config_file("default").items())
    # the raw arm is the plain raw term: every other column at TrainConfig's default
    defaults = field_defaults()
    assert all(raw[k] == defaults[k] for k in columns if k != "objective")


def test_real_lm_default_family_is_the_copy_study_without_an_objective(tmp_path):
    """real-lm-default.yaml builds the copy study's stage (so both share one reference) and runs its base with no
    objective, so each run is the default preset."""
    copy = load_family(ROOT / "launch" / "families" / "real-lm-copy.yaml")
    default = load_family(ROOT / "launch" / "families" / "real-lm-default.yaml")
    assert default["pretrain"] == copy["pretrain"] and default["base"] == copy["base"] and "objective" not in default["base"]
    runs = local_plan(default, output_dir=tmp_path)
    assert len(runs) == 3 and all("objective" not in r.params for r in runs)


def test_real_lm_default_late_family_is_the_late_study_without_an_objective(tmp_path):
    """real-lm-default-late.yaml builds the late study's stage (one reference for both) and runs its base with no
    objective and none of the arms' fields, so each run is the default preset."""
    late = load_family(ROOT / "launch" / "families" / "real-lm-late.yaml")
    default = load_family(ROOT / "launch" / "families" / "real-lm-default-late.yaml")
    assert default["pretrain"] == late["pretrain"]
    arm_fields = set(late["zip"][0]) | {"objective"}
    assert {k: v for k, v in late["base"].items() if k not in arm_fields} == {k: v for k, v in default["base"].items() if k not in arm_fields | {"reconstruction_loss_token_aggregation_mode"}}
    assert not arm_fields - {"reconstruction_loss_token_aggregation_mode"} & set(default["base"])
    runs = local_plan(default, output_dir=tmp_path)
    assert len(runs) == 3 and all("objective" not in r.params for r in runs) and runs[0].pretrain["backbone"] == "smollm2"


def test_real_lm_default_user_late_family_is_the_sort3_stage_on_the_user_late_data(tmp_path):
    """real-lm-default-user-late.yaml is real-lm-default-late.yaml on the JSONL family `late`: the same stage settings
    and run settings, the user files in place of the built-in task, one stage named after the train file."""
    sort3 = load_family(ROOT / "launch" / "families" / "real-lm-default-late.yaml")
    user = load_family(ROOT / "launch" / "families" / "real-lm-default-user-late.yaml")
    assert user["pretrain"] == sort3["pretrain"] and user["grid"] == sort3["grid"]
    data = ("task", "train_data", "val_data")
    assert {k: v for k, v in user["base"].items() if k not in data} == {k: v for k, v in sort3["base"].items() if k not in data}
    for key in ("train_data", "val_data"):
        assert (ROOT / user["base"][key]).is_file(), key
    runs = local_plan(user, output_dir=tmp_path)
    assert len(runs) == 3 and all("objective" not in r.params for r in runs)
    assert {r.params["backbone"] for r in runs} == {str(tmp_path / "entangled-late-train")}
    assert runs[0].pretrain["backbone"] == "smollm2" and runs[0].pretrain["train_data"] == user["base"]["train_data"]


def test_real_lm_user_late_recipe_family_is_the_default_family_with_the_late_decisions_preset(tmp_path):
    """real-lm-user-late-recipe.yaml runs the verdict's next step where the default merges on SmolLM2 `late`: the
    same stage and run settings as real-lm-default-user-late.yaml, plus exactly the shipped preset's fields."""
    default = load_family(ROOT / "launch" / "families" / "real-lm-default-user-late.yaml")
    recipe = load_family(ROOT / "launch" / "families" / "real-lm-user-late-recipe.yaml")
    preset = yaml.safe_load((ROOT / "src" / "zcvae" / "presets" / "late-decisions.yaml").read_text())
    assert recipe["pretrain"] == default["pretrain"] and recipe["grid"] == default["grid"]
    assert {k: v for k, v in recipe["base"].items() if k not in preset} == {k: v for k, v in default["base"].items() if k not in preset}
    assert {k: recipe["base"][k] for k in preset} == preset
    runs = local_plan(recipe, output_dir=tmp_path)
    assert len(runs) == 3 and {r.params["backbone"] for r in runs} == {str(tmp_path / "entangled-late-train")}


def test_late_family_arm_is_the_shipped_recipe():
    recipe = yaml.safe_load((ROOT / "launch" / "configs" / "late-decisions.yaml").read_text())
    fam = load_family(ROOT / "launch" / "families" / "real-lm-late.yaml")
    arm = {field: values[1] for field, values in fam["zip"][0].items()}
    assert {**arm, "objective": fam["base"]["objective"]} == recipe


def test_a_local_run_launches_exactly_what_its_slurm_job_launches(tmp_path):
    """One execution path: the local runner starts `python -m zcvae train` with the arguments the run's SLURM
    script carries (`--resume auto` included), whatever --jobs is; only the progress bar differs."""
    import sys

    from zcvae.sweep.family import SlurmSettings
    from zcvae.sweep.local import train_command
    from zcvae.sweep.slurm import DEFAULT_TEMPLATE, recover_train_args, render_script

    for run in local_plan(family(), output_dir=tmp_path, task="sort"):
        script = render_script(template_text=DEFAULT_TEMPLATE.read_text(), run=run, slurm=SlurmSettings(), log_dir="logs")
        assert train_command(run, progress_bar=True) == [sys.executable, "-m", "zcvae", "train", *recover_train_args(script)]
        assert train_command(run, progress_bar=False)[-1] == "--no-progress-bar"
        assert "--resume" in train_command(run, progress_bar=True)


def test_real_lm_raw_budget_family_is_the_copy_study_at_the_tiny_models_budget(tmp_path):
    """real-lm-raw-budget.yaml asks the dilution question on the copy study's stage (one reference for both): raw mean
    at 300 steps of 64 examples, checkpointed often enough that an interrupted run loses little."""
    copy = load_family(ROOT / "launch" / "families" / "real-lm-copy.yaml")
    budget = load_family(ROOT / "launch" / "families" / "real-lm-raw-budget.yaml")
    assert budget["pretrain"] == copy["pretrain"]
    runs = local_plan(budget, output_dir=tmp_path)
    assert len(runs) == 1 and runs[0].params["backbone"] == str(tmp_path / "entangled-copy")
    p = runs[0].params
    assert (p["objective"], p["reconstruction_loss_token_aggregation_mode"], p["task"]) == ("raw", "mean", "copy")
    assert p["max_steps"] == 300 and p["micro_batch_size"] * p["gradient_accumulation_steps"] == 64
    assert 0 < p["save_every"] <= 10
