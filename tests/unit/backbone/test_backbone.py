"""Backbone pretraining: the checkpoint loads offline and reproduces the model, training helps, and
``is_pretrained`` accepts only finished checkpoints. One tiny pretraining run is shared (module fixture)."""

import argparse
import dataclasses
import json
import math
import shutil
import typing
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

from zcvae.backbone.pretraining import _write_checkpoint, pretrain
from zcvae.backbone.stage_config import CHECKPOINT_FILES, SUMMARY_FILE, PretrainConfig, is_pretrained
from zcvae.backbone.stage_data import mix_templates, span_nll
from zcvae.backbone.stage_eval import evaluate_nll
from zcvae.backbone.stage_model import tiny_llama_config
from zcvae.commands.cli import build_parser
from zcvae.config import FLAT_KEYS, SECTIONS, ModelSection, shared_option
from zcvae.console import capture_lines
from zcvae.core.schedule import lr_multiplier
from zcvae.data import Example, build_tokenizer, make_examples, write_jsonl
from zcvae.data.encoding import IGNORE_INDEX, collate, encode_examples, prepare_tokenizer

TINY = dict(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bb") / "backbone"
    config = PretrainConfig(
        task="copy", output_dir=str(out), max_steps=40, batch_size=32, learning_rate=1e-2, warmup_steps=5,
        num_train_examples=640, num_val_examples=48, log_every=20, num_decode_examples=8, **TINY,
    )
    with capture_lines() as lines:
        summary = pretrain(config)
    return config, summary, lines


def _val_encoded(config, tokenizer):
    tokens = prepare_tokenizer(tokenizer, num_latents=0)
    val = make_examples(config.task, seed=config.seed, split="val", num_examples=config.num_val_examples)
    encoded, _ = encode_examples(val, tokenizer, tokens, max_length=config.max_length, num_z_slots=1)
    return encoded, tokens


def test_checkpoint_round_trips_offline(run):
    config, summary, lines = run
    assert is_pretrained(config.output_dir)
    model = AutoModelForCausalLM.from_pretrained(config.output_dir, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(config.output_dir, local_files_only=True)
    reference = build_tokenizer()
    text = "<s> <x> 3 1 4 </x> <z> <znull> </z> <y> rev 4 1 3 = 3 1 4 . </y> </s>"
    assert tokenizer(text)["input_ids"] == reference(text)["input_ids"]
    assert len(tokenizer) == len(reference)
    # Exact reproduction of the trained weights: the loaded model re-scores val exactly as pretrain did.
    encoded, tokens = _val_encoded(config, tokenizer)
    again = evaluate_nll(model, encoded, tokens)
    for template in ("zfree", "znull"):
        assert again[template]["nll_per_example"] == pytest.approx(summary["val"][template]["nll_per_example"], abs=1e-5)
    on_disk = json.loads((Path(config.output_dir) / SUMMARY_FILE).read_text())
    assert on_disk["config"] == config.to_dict() and on_disk["num_steps"] == 40
    assert on_disk["floor_nll_per_example"] == pytest.approx(math.log(2))
    # copy decides at the first y token, so its decision token is the first token.
    assert on_disk["val"]["zfree"]["decision_token_nll"] == pytest.approx(on_disk["val"]["zfree"]["first_token_nll"])
    assert set(on_disk["val"]["zfree"]["per_strategy"]) == {"forward", "reverse"}
    assert set(on_disk["decoding"]) == {"zfree", "znull"}
    assert any(line.startswith("step 20/40 loss") and "tokens/s" in line for line in lines)


def test_decision_token_nll_scores_the_token_at_each_examples_position(run):
    """Checked against Hugging Face's own cross-entropy at the </y> position (position len(y))."""
    config, _, _ = run
    model = AutoModelForCausalLM.from_pretrained(config.output_dir, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(config.output_dir, local_files_only=True)
    encoded, tokens = _val_encoded(config, tokenizer)
    positions = [len(ex.y_ids) for ex in encoded]
    got = evaluate_nll(model, encoded, tokens, batch_size=7, decision_positions=positions)["zfree"]["decision_token_nll"]
    batch = collate(encoded, tokens)
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits.double(), -1)
    nll = []
    for i in range(len(encoded)):
        labelled = (batch.labels[i] != IGNORE_INDEX).nonzero()[:, 0]
        close = int(labelled[-1])  # </y>, the last supervised label
        nll.append(-float(logp[i, close - 1, batch.labels[i, close]]))
    assert got == pytest.approx(sum(nll) / len(nll), rel=1e-4)
    with pytest.raises(ValueError, match="decision_positions"):
        evaluate_nll(model, encoded, tokens, decision_positions=positions[:-1])


def test_training_lowers_val_loss_against_init(run):
    """Scored with Hugging Face's own LM loss (independent of span_nll), against the same init."""
    config, summary, _ = run
    trained = AutoModelForCausalLM.from_pretrained(config.output_dir, local_files_only=True)
    torch.manual_seed(config.seed)
    init = LlamaForCausalLM(trained.config)
    tokenizer = AutoTokenizer.from_pretrained(config.output_dir)
    encoded, tokens = _val_encoded(config, tokenizer)
    batch = collate(encoded, tokens)
    with torch.no_grad():
        for ids, mask, labels in ((batch.input_ids, batch.attention_mask, batch.labels),
                                  (batch.z_input_ids, batch.z_attention_mask, batch.z_labels)):
            before = init(input_ids=ids, attention_mask=mask, labels=labels).loss
            after_out = trained(input_ids=ids, attention_mask=mask, labels=labels)
            assert float(after_out.loss) < float(before) - 0.3
            nll_BT, mask_BT = span_nll(after_out.logits, labels)
            assert float(nll_BT.sum() / mask_BT.sum()) == pytest.approx(float(after_out.loss), rel=1e-5)
    assert summary["val"]["zfree"]["nll_per_example"] < summary["val_initial"]["zfree"]["nll_per_example"]


def test_is_pretrained_rejects_missing_and_partial_dirs(run, tmp_path):
    config, _, _ = run
    assert not is_pretrained(tmp_path / "nothing")
    assert not is_pretrained(config.output_dir + ".tmp")
    for name in CHECKPOINT_FILES:
        partial = tmp_path / f"without-{name}"
        shutil.copytree(config.output_dir, partial)
        (partial / name).unlink()
        assert not is_pretrained(partial), name
    truncated = tmp_path / "truncated-summary"
    shutil.copytree(config.output_dir, truncated)
    (truncated / SUMMARY_FILE).write_text('{"finished": tr')
    assert not is_pretrained(truncated)


def test_write_checkpoint_replaces_and_leaves_no_temporaries(tmp_path):
    tokenizer = build_tokenizer()
    out = tmp_path / "ckpt"
    for seed in (1, 2):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(tiny_llama_config(len(tokenizer), **TINY))
        _write_checkpoint(model, tokenizer, {"finished": True, "seed": seed}, str(out))
    assert is_pretrained(out)
    assert json.loads((out / SUMMARY_FILE).read_text())["seed"] == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    loaded = AutoModelForCausalLM.from_pretrained(out, local_files_only=True)
    ids = torch.tensor([[2, 4, 20, 5, 8, 21, 9, 3]])
    assert torch.equal(loaded(input_ids=ids).logits, model(input_ids=ids).logits)


def test_jsonl_train_and_val_data(tmp_path):
    # Words outside the built-in vocabulary must get their own tokens, not <unk>.
    def examples(split, n):
        return [Example(id=f"{split}{i}", x=f"apple {i % 7}", y=f"pear {i % 7} kiwi", strategy=None) for i in range(n)]

    write_jsonl(tmp_path / "train.jsonl", examples("t", 64))
    write_jsonl(tmp_path / "val.jsonl", examples("v", 16))
    out = tmp_path / "bb"
    summary = pretrain(
        PretrainConfig(train_data=str(tmp_path / "train.jsonl"), val_data=str(tmp_path / "val.jsonl"),
                       output_dir=str(out), max_steps=3, batch_size=16, log_every=1, **TINY),
    )
    assert is_pretrained(out)
    assert summary["config"]["task"] is None and summary["floor_nll_per_example"] is None
    assert summary["num_train_examples"] == 64 and summary["num_val_examples"] == 16
    assert "decoding" not in summary
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert tokenizer.unk_token_id not in tokenizer("apple pear kiwi")["input_ids"]


def test_config_rejects_unknown_keys_and_bad_values():
    with pytest.raises(ValueError, match="hiden_size"):
        PretrainConfig.from_dict({"hiden_size": 64})
    assert PretrainConfig.from_dict({"max_steps": 7}).max_steps == 7
    assert PretrainConfig().task == "copy"
    with pytest.raises(ValueError, match="z_template_share"):
        PretrainConfig(z_template_share=1.5)
    with pytest.raises(ValueError, match="train_data"):
        PretrainConfig(task="copy", train_data="a.jsonl")
    with pytest.raises(ValueError, match="val_data"):
        PretrainConfig(val_data="v.jsonl")
    with pytest.raises(ValueError, match="task"):
        PretrainConfig(task="nope")
    with pytest.raises(ValueError, match="num_heads"):
        PretrainConfig(hidden_size=30, num_heads=4)


def test_config_judges_types_and_choices_as_train_does():
    with pytest.raises(ValueError, match=r"max_steps must be of type int, got '2'"):
        PretrainConfig.from_dict({"max_steps": "2"})
    with pytest.raises(ValueError, match="progress_bar must be of type bool"):
        PretrainConfig(progress_bar=1)
    with pytest.raises(ValueError, match=r"engine must be one of \['local', 'deepspeed', 'fsdp2'\]"):
        PretrainConfig(engine="zero")
    with pytest.raises(ValueError, match="learning_rate must be finite"):
        PretrainConfig(learning_rate=math.inf)
    assert PretrainConfig(lora_alpha=16).lora_alpha == 16  # an int fits a float, as in a YAML file


def test_a_field_named_as_in_train_is_that_sections_field():
    """One home per field: the stage's fields that `zcvae train` has too take their type, choices and help from the
    section, so the two cannot drift apart (they did: the stage's flags had no --help text)."""
    own = {"lora_alpha"}  # a float, as peft takes it and the stage's summaries record it; train's is an int
    shared = [f for f in dataclasses.fields(PretrainConfig) if f.name in FLAT_KEYS and f.name not in own]
    assert len(shared) == 27
    hints = typing.get_type_hints(PretrainConfig)
    for f in shared:
        section = SECTIONS[FLAT_KEYS[f.name]]
        source = next(g for g in dataclasses.fields(section) if g.name == f.name)
        assert f.metadata["section"] is section, f.name
        assert hints[f.name] == typing.get_type_hints(section)[f.name], f.name
        assert f.metadata.get("choices") == source.metadata.get("choices"), f.name
    with pytest.raises(ValueError, match="ModelSection has no field 'lora_rank'"):
        shared_option(ModelSection, "lora_rank")


def test_every_pretrain_flag_says_what_it_does():
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices["pretrain"]
    flags = [a for a in sub._actions if a.dest in {f.name for f in dataclasses.fields(PretrainConfig)}]
    assert len(flags) == len(dataclasses.fields(PretrainConfig))
    bare = [a.option_strings[0] for a in flags if not a.help.split(" (default:")[0].strip()]
    assert not bare, f"flags without help text: {bare}"
    engine = next(a for a in flags if a.dest == "engine")
    assert engine.choices == ["local", "deepspeed", "fsdp2"]


def test_mix_templates_keeps_the_span_and_picks_rows():
    tokenizer = build_tokenizer()
    tokens = prepare_tokenizer(tokenizer, num_latents=0)
    exs = [Example(id=str(i), x="1 2 3"[: 1 + 2 * i], y="fwd 1 .") for i in range(3)]
    encoded, _ = encode_examples(exs, tokenizer, tokens, max_length=32, num_z_slots=1)
    batch = collate(encoded, tokens)
    use_z = torch.tensor([True, False, False])
    ids, mask, labels = mix_templates(batch, use_z, pad_id=tokens.pad)
    assert ids.shape[1] == int(batch.z_attention_mask[0].sum())  # trimmed to the longest kept row
    assert tokens.znull in ids[0].tolist() and tokens.znull not in ids[1:].flatten().tolist()
    for i in range(3):
        assert labels[i][labels[i] != IGNORE_INDEX].tolist() == [*encoded[i].y_ids, tokens.y_close]
        assert int(mask[i].sum()) == len(encoded[i].x_ids) + len(encoded[i].y_ids) + 6 + 3 * bool(use_z[i])


def test_lr_schedule_warms_up_then_decays_to_the_floor():
    kw = dict(warmup_steps=10, max_steps=110, min_lr_ratio=0.1)
    assert lr_multiplier(0, **kw) == pytest.approx(0.1)
    assert lr_multiplier(9, **kw) == pytest.approx(1.0)
    assert lr_multiplier(60, **kw) == pytest.approx(0.55)
    assert lr_multiplier(110, **kw) == pytest.approx(0.1)


@pytest.mark.parametrize("template", ["zfree", "znull"])
def test_generate_y_is_the_argmax_continuation_of_each_prompt(tiny_llama, template):
    from zcvae.backbone.stage_eval import generate_y
    from zcvae.data.encoding import TemplateLayout

    tokenizer = build_tokenizer()
    tokens = prepare_tokenizer(tokenizer, num_latents=0)
    model = tiny_llama(len(tokenizer), seed=3)
    examples, _ = encode_examples(make_examples("copy", seed=1, split="val", num_examples=6), tokenizer, tokens,
                                  max_length=64, num_z_slots=1)
    # a bias towards </y> makes rows stop at different steps (zfree: some run to the step bound)
    model.lm_head.bias = torch.nn.Parameter(torch.zeros(len(tokenizer)))
    model.lm_head.bias.data[tokens.y_close] = 0.3
    layout = TemplateLayout(1)
    for max_new_tokens in (None, 3):
        got = generate_y(model, examples, tokens, template=template, max_length=24, max_new_tokens=max_new_tokens)
        for ex, y_ids in zip(examples, got):
            ids = layout.zcond_prompt(ex.x_ids, tokens) if template == "znull" else layout.zfree_prompt(ex.x_ids, tokens)
            want = []
            for _ in range(max(1, min(max_new_tokens or 24, 24 - len(ids) - 1))):
                with torch.no_grad():
                    nxt = int(model(input_ids=torch.tensor([ids + want])).logits[0, -1].argmax())
                if nxt == tokens.y_close:
                    break
                want.append(nxt)
            assert y_ids == want
