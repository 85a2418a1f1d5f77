"""A family's ``pretrain:`` block: the entangled stage its runs start from, planned and built by the sweep."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from zcvae.commands.sweep import load_family, local_plan, stage_status, validate_family

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


def test_slurm_rendering_refuses_a_stage_it_cannot_chain(tmp_path):
    from zcvae.commands.sweep import main

    path = tmp_path / "f.yaml"
    path.write_text(yaml.safe_dump(family()))
    assert main([str(path), "--out", str(tmp_path / "out"), "--dry-run"]) == 2
    assert not (tmp_path / "out").exists()


def test_stage_status_reuses_only_a_stage_built_with_the_same_settings(tmp_path, raw_tiny_backbone):
    from zcvae.backbone.pretraining import PretrainConfig, pretrain

    stage = {"backbone": str(raw_tiny_backbone()), "task": "copy", "output_dir": str(tmp_path / "entangled-copy"),
             "max_steps": 2, "batch_size": 4, "num_train_examples": 32, "num_val_examples": 8, "num_decode_examples": 0,
             "warmup_steps": 1, "device": "cpu"}
    assert stage_status(stage) == "to run"
    pretrain(PretrainConfig.from_dict(stage), log=lambda *_: None)
    assert stage_status(stage) == "finished"
    with pytest.raises(ValueError, match=r"built with other settings \(max_steps 2 there, 3 in the family\)"):
        stage_status({**stage, "max_steps": 3})


@pytest.mark.parametrize("name", ["real-lm-copy.yaml", "real-lm-late.yaml"])
def test_shipped_real_lm_families_plan_with_their_stage(tmp_path, name):
    runs = local_plan(load_family(ROOT / "launch" / "families" / name), output_dir=tmp_path)
    assert len(runs) == 6 and len({r.pretrain["output_dir"] for r in runs}) == 1
    assert runs[0].pretrain["backbone"] == "smollm2"


def test_demo_backbone_runs_the_families_key_arms():
    """`zcvae demo --backbone` runs launch/families/real-lm-copy.yaml's stage and arms (one seed list aside)."""
    from zcvae.commands.demo import real_lm_family

    shipped = load_family(ROOT / "launch" / "families" / "real-lm-copy.yaml")
    demo = real_lm_family(backbone="smollm2", seeds=3)
    for key in ("pretrain", "base", "grid", "zip"):
        assert demo[key] == shipped[key], key


def test_late_family_arm_is_the_shipped_recipe():
    recipe = yaml.safe_load((ROOT / "launch" / "configs" / "late-decisions.yaml").read_text())
    fam = load_family(ROOT / "launch" / "families" / "real-lm-late.yaml")
    arm = {field: values[1] for field, values in fam["zip"][0].items()}
    assert {**arm, "objective": fam["base"]["objective"]} == recipe
