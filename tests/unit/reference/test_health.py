"""The reference health check of ``zcvae train`` (zcvae.reference.health): the template markers a
backbone lacks, c_base against the family's floor or the per-token threshold, the closure note; and
the proceed flag making the fresh marker rows trainable tokens (input and output head), exported and
loaded back.

Backbones: ``raw_tiny_backbone`` (tests/conftest.py) has a tokenizer without the markers, as a raw
pretrained LM; ``tiny_backbone`` carries them, as every entangled checkpoint does.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from zcvae.config import TrainConfig
from zcvae.reference.c_base import CBase
from zcvae.core.aggregation import NEARLY_DEGENERATE_MAX_SURPRISAL
from zcvae.reference.health import (
    DEGENERATE_IDS_SHOWN,
    FLOOR_MARGIN_PER_SEQUENCE,
    DegenerateWeights,
    HIGH_C_BASE_PER_TOKEN,
    MIN_CLOSURE_RATE,
    ReferenceHealth,
    check_markers,
    closure_warning,
    entangled_command,
)
from zcvae.data.encoding import MARKERS, EncodedExample, collate, missing_markers

C_BASE = {"value": 0.25, "mode": "mean", "fingerprint": "f00d", "source": "validation"}


def _cfg(**kw) -> TrainConfig:
    return TrainConfig.from_flat(**{"output_dir": "runs/a", **kw})


# ------------------------------------------------------------------------------------------ markers
def test_missing_markers_lists_what_a_vocabulary_lacks_in_marker_order():
    assert missing_markers({m: i for i, m in enumerate(MARKERS)}) == []
    assert missing_markers({"<x>": 0, "</y>": 1, "hello": 2}) == ["</x>", "<z>", "</z>", "<y>", "<znull>"]


def test_check_fires_on_a_raw_backbone_with_the_pretrain_command(raw_tiny_backbone):
    raw = str(raw_tiny_backbone())
    with pytest.raises(ValueError) as err:
        check_markers(_cfg(backbone=raw, task="sort"), raw)
    message = str(err.value)
    assert "\n" not in message
    assert " ".join(MARKERS) in message
    assert f"`zcvae pretrain --backbone {raw} --task sort --output-dir runs/entangled-{Path(raw).name}`" in message
    assert f"--backbone runs/entangled-{Path(raw).name}" in message and "--allow-fresh-markers" in message

    # user data: the command names the same JSONL files
    cfg = _cfg(backbone=raw, train_data="d/train.jsonl", val_data="d/val.jsonl")
    with pytest.raises(ValueError, match=r"--train-data d/train.jsonl --val-data d/val.jsonl --output-dir"):
        check_markers(cfg, raw)


def test_check_is_quiet_on_a_backbone_that_knows_the_markers(tiny_backbone, logged):
    entangled = str(tiny_backbone())
    lines = logged
    health = check_markers(_cfg(backbone=entangled, task="copy"), entangled)
    assert health.fresh_markers == [] and health.warnings == [] and lines == []
    assert health.to_dict()["allow_fresh_markers"] is False


def test_proceed_flag_records_the_fresh_markers_and_says_so(raw_tiny_backbone, logged):
    raw = str(raw_tiny_backbone())
    lines = logged
    health = check_markers(_cfg(backbone=raw, allow_fresh_markers=True), raw)
    assert health.fresh_markers == list(MARKERS) and health.allow_fresh_markers
    assert len(lines) == 1 and "--allow-fresh-markers" in lines[0] and health.warnings == lines
    assert health.entangled_command == entangled_command(_cfg(backbone=raw))[0]


def test_allow_fresh_markers_reaches_the_model_config_and_yaml_keys():
    assert _cfg().model_config().train_fresh_markers is False
    cfg = TrainConfig.from_dict({"allow_fresh_markers": True})
    assert cfg.model_config().train_fresh_markers is True
    with pytest.raises(ValueError, match="allow_fresh_markers"):
        TrainConfig.from_dict({"allow_fresh_markers": "yes"})


# ------------------------------------------------------------------------------------------ c_base
def _val(lengths):
    """Encoded examples with n_i = length + 1 (y and </y>), raw examples with copy's x."""
    encoded = [EncodedExample(f"e{i}", (1,), tuple(range(n))) for i, n in enumerate(lengths)]
    raw = [SimpleNamespace(id=f"e{i}", x="3 1 4") for i in range(len(lengths))]
    return encoded, raw


def _health():
    return ReferenceHealth(backbone="b", fresh_markers=[], allow_fresh_markers=False,
                           entangled_command="zcvae pretrain --task copy --output-dir x")


@pytest.mark.parametrize("mode", ["mean", "sum"])
def test_c_base_is_compared_with_the_family_floor_in_its_own_units(mode, logged):
    from zcvae.data import get_task

    task = get_task("copy")
    h = task.y_entropy("3 1 4")  # both strategies give their own y: log 2
    assert h == pytest.approx(math.log(2))
    encoded, raw = _val([3, 7])  # n_i = 4, 8
    if mode == "mean":
        floor = (h / 4 + h / 8) / 2
        threshold = ((h + FLOOR_MARGIN_PER_SEQUENCE) / 4 + (h + FLOOR_MARGIN_PER_SEQUENCE) / 8) / 2
    else:
        floor, threshold = h, h + FLOOR_MARGIN_PER_SEQUENCE
    lines = logged
    below = _health()
    assert below.check_c_base(CBase(**{**C_BASE, "mode": mode, "value": threshold * 0.99}), val=encoded, examples=raw,
                              task=task) is None
    assert below.floor == pytest.approx(floor) and below.c_base_threshold == pytest.approx(threshold)
    assert below.floor_per_sequence == pytest.approx(h) and below.warnings == [] and lines == []

    above = _health()
    line = above.check_c_base(CBase(**{**C_BASE, "mode": mode, "value": threshold * 1.01}), val=encoded, examples=raw,
                              task=task)
    assert line is not None and lines == [line] and above.warnings == [line]
    assert f"c_base[{mode}]" in line and "floor" in line and "zcvae pretrain" in line
    record = json.loads(json.dumps(above.to_dict()))
    assert record["c_base"] == pytest.approx(threshold * 1.01) and record["c_base_mode"] == mode
    assert record["floor"] == pytest.approx(floor) and record["warnings"] == [line]


@pytest.mark.parametrize("mode", ["mean", "sum"])
def test_c_base_without_a_floor_uses_the_per_token_threshold(mode):
    encoded, raw = _val([3, 7])  # n_i = 4, 8
    threshold = HIGH_C_BASE_PER_TOKEN if mode == "mean" else HIGH_C_BASE_PER_TOKEN * (4 + 8) / 2
    quiet, loud = _health(), _health()
    assert quiet.check_c_base(CBase(**{**C_BASE, "mode": mode, "value": threshold - 1e-3}), val=encoded, examples=raw,
                              task=None) is None
    assert quiet.floor is None and quiet.c_base_threshold == pytest.approx(threshold)
    assert loud.check_c_base(CBase(**{**C_BASE, "mode": mode, "value": threshold + 1e-3}), val=encoded, examples=raw,
                             task=None) is not None


def test_a_user_c_base_is_recorded_not_checked():
    encoded, raw = _val([3])
    health = _health()
    assert health.check_c_base(CBase(**{**C_BASE, "value": 50.0, "source": "user"}), val=encoded, examples=raw,
                               task=None) is None
    assert health.c_base == 50.0 and health.c_base_threshold is None and "not checked" in health.c_base_threshold_rule


# ------------------------------------------------------------------------------------------ degenerate weights
def _planted_b():
    """One degenerate row, one nearly degenerate, one normal, over 3 supervised tokens each."""
    b_BN = torch.tensor([[0.0, 0.0, 0.0], [0.002, 0.004, 0.001], [0.01, 0.69, 0.0]])
    return b_BN, torch.ones_like(b_BN, dtype=torch.bool), ["deg", "near", "ok"]


def test_degenerate_weights_name_the_examples_and_say_what_to_do(logged):
    found = DegenerateWeights(splits="train and validation")
    found.add(*_planted_b())
    assert (found.num_examples, found.degenerate, found.nearly_degenerate) == (3, ["deg"], ["near"])
    lines = logged
    health = _health()
    line = health.check_weights(found)
    assert line is not None and lines == [line] and health.warnings == [line] and "\n" not in line
    assert line.startswith("[health] warning: 2 of 3 examples (train and validation)")
    assert "deg, near" in line and "ok" not in line.split("e.g.")[1].split(":")[0]
    assert f"{NEARLY_DEGENERATE_MAX_SURPRISAL:g} nats" in line and "uniform" in line
    assert "entangled stage" in line and "duplicated x -> y pairs" in line
    record = json.loads(json.dumps(health.to_dict()))["degenerate_weights"]
    assert record == {"splits": "train and validation", "num_examples": 3, "max_surprisal": NEARLY_DEGENERATE_MAX_SURPRISAL,
                      "num_degenerate": 1, "num_nearly_degenerate": 1, "degenerate": ["deg"], "nearly_degenerate": ["near"]}


def test_degenerate_weights_are_quiet_on_normal_rows_and_merge_the_ranks(logged):
    b_BN, mask_BN, ids = _planted_b()
    quiet = DegenerateWeights(splits="validation")
    quiet.add(b_BN[2:], mask_BN[2:], ids[2:])
    assert quiet.note() is None and _health().check_weights(quiet) is None and logged == []
    ranks = [DegenerateWeights(splits="validation") for _ in range(2)]
    for rank, part in enumerate(ranks):  # rank r holds rows r, r + 2, ...
        part.add(b_BN[rank::2], mask_BN[rank::2], ids[rank::2])
    merged = DegenerateWeights.merge(ranks)
    assert (merged.num_examples, merged.degenerate, merged.nearly_degenerate) == (3, ["deg"], ["near"])
    many = DegenerateWeights(splits="validation")
    many.add(torch.zeros(5, 2), torch.ones(5, 2, dtype=torch.bool), [f"d{i}" for i in range(5)])
    shown = many.note().split("e.g. ")[1].split(":")[0]
    assert shown == ", ".join(f"d{i}" for i in range(DEGENERATE_IDS_SHOWN)) + " ..."


def test_no_b_at_setup_is_recorded_as_not_checked(logged):
    health = _health()
    assert health.check_weights(None) is None and logged == []
    assert health.degenerate_weights.startswith("not checked") and health.warnings == []


def test_closure_note_only_below_the_threshold():
    assert closure_warning({"nmi": 1.0}) is None
    assert closure_warning({"closure_rate": MIN_CLOSURE_RATE}) is None
    note = closure_warning({"closure_rate": 0.25})
    assert note is not None and "\n" not in note and "25%" in note and "</y>" in note


# ------------------------------------------------------------------------------ fresh marker rows
def _model(backbone, *, train_fresh_markers: bool):
    from zcvae.model.config import ModelConfig
    from zcvae.model.cvae import ZCVAE

    return ZCVAE.from_pretrained(str(backbone), ModelConfig(num_latents=2, lora_r=4, train_fresh_markers=train_fresh_markers))


def _batch(model):
    from zcvae.data import make_examples
    from zcvae.data.encoding import encode_examples

    encoded, _ = encode_examples(make_examples("copy", seed=0, split="train", num_examples=4), model.tokenizer, model.tokens,
                                 max_length=32, num_z_slots=1)
    return collate(encoded, model.tokens)


def _rows(model, ids):
    """(input rows, output-head rows) of token ids as the adapted model uses them."""
    emb = model.peft_model.get_input_embeddings()
    head = model.peft_model.get_output_embeddings()
    ids = torch.tensor(ids)
    inputs = emb(ids).detach().clone()
    eye = torch.eye(inputs.shape[1])
    outputs = head(eye).detach().T[ids].clone()  # (V, H) rows of the head read back through its forward
    return inputs, outputs


def _train(model, batch, steps: int = 3):
    groups = model.param_groups(lora_lr=1e-2, latent_lr=1e-2, weight_decay=0.0)
    model.check_trainable(groups)
    opt = torch.optim.AdamW(groups)
    for _ in range(steps):
        opt.zero_grad()
        out = model.train_forward(batch)
        mean_nll_BK = (out.token_nll * out.mask[:, None]).sum(-1) / out.mask.sum(-1, keepdim=True)
        ((out.branch_weights * mean_nll_BK).sum(-1) + out.kl).mean().backward()
        opt.step()


@pytest.mark.parametrize("tied", [False, True])
def test_proceed_flag_trains_the_fresh_marker_rows_input_and_output(raw_tiny_backbone, tied):
    backbone = raw_tiny_backbone(tied=tied)
    torch.manual_seed(0)
    model = _model(backbone, train_fresh_markers=True)
    batch = _batch(model)
    model.calibrate(batch)
    t = model.tokens
    markers = [t.x_open, t.x_close, t.z_open, t.z_close, t.y_open, t.y_close]  # <znull> is not in a discrete batch
    others = [i for i in range(len(model.tokenizer)) if i not in {*markers, t.znull, *t.latents}]
    in0, out0 = _rows(model, markers)
    in_other0, out_other0 = _rows(model, others)
    _train(model, batch)
    in1, out1 = _rows(model, markers)
    in_other1, out_other1 = _rows(model, others)
    assert (in1 - in0).abs().amax(-1).min() > 0, "every marker's input row should have trained"
    # </y> is predicted: its output-head row trains (tied: through the input row; untied: its own delta)
    y_close = markers.index(t.y_close)
    assert (out1[y_close] - out0[y_close]).abs().max() > 0
    assert torch.equal(in_other1, in_other0) and torch.equal(out_other1, out_other0), "a row the backbone knew changed"
    deltas = [n for n, _ in model._latent_named_parameters() if "trainable_tokens_delta" in n]
    assert len(deltas) == (1 if tied else 2)


def test_without_the_flag_the_fresh_marker_rows_stay_frozen(raw_tiny_backbone):
    model = _model(raw_tiny_backbone(), train_fresh_markers=False)
    batch = _batch(model)
    model.calibrate(batch)
    t = model.tokens
    markers = [t.x_open, t.y_open, t.y_close]
    in0, out0 = _rows(model, markers)
    _train(model, batch, steps=2)
    in1, out1 = _rows(model, markers)
    assert torch.equal(in0, in1) and torch.equal(out0, out1)


def test_fresh_marker_rows_round_trip_through_export_and_load(raw_tiny_backbone, tmp_path, checkpointed_run):
    """Trained marker rows (and z rows, LoRA, heads) come back from an export: load_for_inference and
    the model card's peft recipe give the trained model's logits."""
    from peft import PeftModel

    from zcvae.commands.cli import main as cli_main
    from zcvae.export.load import load_for_inference, prepare_base
    from zcvae.model.cvae import ZCVAE

    backbone = raw_tiny_backbone()
    cfg = TrainConfig.from_flat(backbone=str(backbone), num_latents=2, lora_r=4, max_length=32, allow_fresh_markers=True,
                      output_dir=str(tmp_path / "run"), run_name="raw")
    model = ZCVAE.from_pretrained(str(backbone), cfg.model_config(), seed=cfg.optimization.seed)
    batch = _batch(model)
    run_dir = checkpointed_run(model, batch, cfg, scale=0.05, step=2, c_base=C_BASE)
    model.eval()
    (run_dir / "metrics.jsonl").write_text(json.dumps({"step": 2, "split": "eval", "nmi": 0.5}) + "\n")
    out = tmp_path / "export"
    assert cli_main(["export", str(run_dir), "--out", str(out)]) == 0

    with torch.no_grad():
        want = model.peft_model(input_ids=batch.z_input_ids, attention_mask=batch.z_attention_mask).logits
        loaded = load_for_inference(out)
        got = loaded.peft_model(input_ids=batch.z_input_ids, attention_mask=batch.z_attention_mask).logits
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
        peft_model = PeftModel.from_pretrained(prepare_base(str(backbone), out), str(out)).eval()
        got = peft_model(input_ids=batch.z_input_ids, attention_mask=batch.z_attention_mask).logits
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    t = model.tokens
    rows = lambda m: _rows(m, [t.y_close, t.y_open])  # noqa: E731
    for a, b in zip(rows(loaded), rows(model)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_entangled_command_names_the_checkpoint_after_the_backbone():
    cmd, out = entangled_command(_cfg(backbone="/m/SmolLM2.Q4_1.gguf", task="copy"))
    assert out == "runs/entangled-SmolLM2.Q4_1" and cmd.startswith("zcvae pretrain --backbone /m/SmolLM2.Q4_1.gguf --task copy")
    assert entangled_command(_cfg(backbone="bb/model.v1-abc"))[1] == "runs/entangled-model.v1-abc"  # a directory keeps its dots
    assert entangled_command(_cfg(backbone="my dir/m"))[0].endswith("--backbone 'my dir/m' --task copy --output-dir runs/entangled-m")



def test_a_high_c_base_on_an_entangled_stage_asks_for_a_longer_stage_not_a_stage_on_top(tmp_path, raw_tiny_backbone):
    """A stage that stopped short of the floor (SmolLM2's sort3 stage: 0.2 nats per sequence above it) was told to
    pretrain its own output again; the advice names its steps and twice them instead. A raw LM keeps the command."""
    from zcvae.backbone.pretraining import pretrain
    from zcvae.backbone.stage_config import PretrainConfig, stage_steps

    entangled, raw = str(tmp_path / "stage"), str(raw_tiny_backbone())
    pretrain(PretrainConfig(task="copy", output_dir=entangled, max_steps=3, warmup_steps=1, num_train_examples=64,
                            num_val_examples=8, num_decode_examples=2, hidden_size=32, num_layers=2, num_heads=4,
                            intermediate_size=64, progress_bar=False))
    assert stage_steps(entangled) == 3 and stage_steps(raw) is None
    encoded, examples = _val([3, 7])
    lines = {}
    for name, backbone in (("stage", entangled), ("raw", raw)):
        health = check_markers(_cfg(backbone=backbone, task="copy", allow_fresh_markers=True), backbone,
                               stage_steps=stage_steps(backbone))
        lines[name] = health.check_c_base(CBase(**{**C_BASE, "value": 50.0}), val=encoded, examples=examples, task=None)
    assert "entangled stage of 3 steps" in lines["stage"] and "--max-steps 6" in lines["stage"]
    assert f"{entangled}/pretrain_summary.json" in lines["stage"]
    assert "zcvae pretrain --backbone" not in lines["stage"]
    assert f"zcvae pretrain --backbone {raw}" in lines["raw"] and "stage of" not in lines["raw"]
