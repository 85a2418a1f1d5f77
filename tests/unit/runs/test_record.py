"""What a run records about itself (zcvae.runs.record): run_config.json's contents and the resume's notes."""

import json
from types import SimpleNamespace

from zcvae.runs.record import resume_changes_record, resume_note, run_metadata
from zcvae.runs.rundir import RUN_CONFIG


def _change(field, step):
    return {"field": field, "from": 0.0, "to": 1.0, "step": step}


def test_resume_changes_keep_the_earlier_ones_up_to_the_resumed_step_then_add_this_resumes(tmp_path):
    assert resume_changes_record(tmp_path, None) == {}  # a fresh run records none
    (tmp_path / RUN_CONFIG).write_text(json.dumps({"config": {}, "resume_changes": [_change("kl_weight", 2), _change("kl_weight", 6)]}))
    state = {"step": 4, "changes": [_change("marginal_weight", 4)]}
    # the change from step 6 was recorded by a run that crashed before its checkpoint: replayed, it is dropped
    assert resume_changes_record(tmp_path, state) == {"resume_changes": [_change("kl_weight", 2), _change("marginal_weight", 4)]}


def test_the_resume_note_names_a_raised_max_steps_and_each_allowed_change():
    cfg = SimpleNamespace(optimization=SimpleNamespace(max_steps=20))
    assert resume_note({"meta": {"config": {"max_steps": 20}}}, cfg) == ""
    note = resume_note({"meta": {"config": {"max_steps": 10}}, "changes": [_change("kl_weight", 4)]}, cfg)
    assert note.startswith("; max_steps 10 -> 20: the schedule's fractions")
    assert note.endswith("; kl_weight 0.0 -> 1.0 from step 4 (--resume-allow-change)")


def test_run_metadata_holds_the_nested_config_and_what_the_run_started_with(tmp_path):
    from zcvae.config import TrainConfig

    cfg = TrainConfig.from_dict({"task": "copy"})
    report = SimpleNamespace(num_examples=8, num_kept=7, num_skipped=1, num_x_truncated=0, num_unknown_tokens=0)
    reference = SimpleNamespace(c_base=SimpleNamespace(to_dict=lambda: {"value": 1.5}), policy="online")
    conversion = {"kind": "gguf", "quantization": "Q8_0"}
    meta = run_metadata(cfg, tmp_path, 2, SimpleNamespace(source="task copy"), report, report, reference,
                        backbone_conversion=conversion, cpu={"num_threads": 1})
    assert meta["config"] == cfg.to_sections() and meta["backbone"] == str(tmp_path.resolve())
    assert meta["backbone_conversion"] == conversion and meta["c_base"] == {"value": 1.5} and meta["world_size"] == 2
    assert meta["data"]["train"] == {"examples": 8, "kept": 7, "skipped": 1, "x_truncated": 0, "unknown_tokens": 0}
    assert {"python", "zcvae", "torch"} <= set(meta["versions"]) and "git_revision" in meta
