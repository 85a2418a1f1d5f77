"""The entangled stage on a pretrained backbone (``zcvae pretrain --backbone``).

The backbones here (``raw_tiny_backbone``) are tiny random Llamas whose tokenizer has never seen the template, as a real LM's
has not: the stage must add the markers, train their rows (and nothing else of the embedding under
LoRA), merge LoRA, and write a checkpoint that ``ZCVAE.from_pretrained`` reads without adding any
marker again and whose validation NLL is the one the summary reports (so the merge is exact).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from zcvae.backbone.pretraining import pretrain
from zcvae.backbone.stage_config import PretrainConfig, is_pretrained
from zcvae.backbone.stage_eval import evaluate_nll
from zcvae.data.encoding import TemplateLayout


def stage_config(backbone: Path, out: Path, **overrides) -> PretrainConfig:
    values = dict(backbone=str(backbone), task="copy", output_dir=str(out), max_steps=6, batch_size=8,
                  num_train_examples=64, num_val_examples=16, num_decode_examples=0, warmup_steps=1,
                  log_every=100, learning_rate=1e-2, device="cpu")
    return PretrainConfig(**{**values, **overrides})


def load_plain(directory: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(directory, local_files_only=True, use_safetensors=True, dtype=torch.float32)
    return model, AutoTokenizer.from_pretrained(directory, local_files_only=True)


def reloaded_val_nll(out: Path, summary: dict) -> float:
    """The z-free validation NLL of the *saved* checkpoint, on the stage's own validation split."""
    from zcvae.backbone.stage_data import encode_split, load_data
    from zcvae.data.encoding import template_tokens

    model, tok = load_plain(out)
    tokens = template_tokens(tok, num_latents=0)
    cfg = PretrainConfig.from_dict(summary["config"])
    _, _, _, val_ex, _ = load_data(cfg, tokenizer=tok)
    val = encode_split(val_ex, tok, tokens, max_length=cfg.max_length, what="val")
    return evaluate_nll(model, val, tokens)["zfree"]["nll_per_example"]


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_lora_stage_trains_markers_merges_exactly_and_loads_in_train(tmp_path, raw_tiny_backbone, tied):
    from zcvae.model.config import ModelConfig
    from zcvae.model.cvae import ZCVAE
    from zcvae.reference.store import fingerprint_backbone

    source = raw_tiny_backbone(tied=tied)
    out = tmp_path / "entangled"
    summary = pretrain(stage_config(source, out))
    assert is_pretrained(out)
    assert json.loads((out / "pretrain_summary.json").read_text()) == json.loads(json.dumps(summary))

    # provenance: the source, its digest, the data, the method
    record = summary["source"]
    assert record["backbone"] == str(source) and record["method"] == "lora"
    assert record["sha256"] == fingerprint_backbone(source)
    assert set(record["added_tokens"]) == set(TemplateLayout.MARKERS)
    assert len(summary["data_fingerprint"]) == 64
    assert summary["val"]["zfree"]["nll_per_example"] < summary["val_initial"]["zfree"]["nll_per_example"]

    # the merge is exact: the saved weights give the NLL the stage measured before merging
    assert reloaded_val_nll(out, summary) == pytest.approx(summary["val"]["zfree"]["nll_per_example"], rel=1e-4)

    # LoRA left every old embedding row bitwise unchanged and trained the new rows (both sides)
    before, _ = load_plain(source)
    after, tok = load_plain(out)
    old = before.get_input_embeddings().weight.shape[0]
    assert torch.equal(after.get_input_embeddings().weight[:old], before.get_input_embeddings().weight)
    mean_in = before.get_input_embeddings().weight.mean(0)
    # every marker that is read before a supervised token trains (</y> is only read to predict <eos>,
    # which is not supervised, so its input row may stay the mean row)
    for marker in ("<x>", "</x>", "<z>", "</z>", "<y>", "<znull>"):
        row = after.get_input_embeddings().weight[tok.convert_tokens_to_ids(marker)]
        assert not torch.allclose(row, mean_in), f"{marker} input row never trained"
    y_close = tok.convert_tokens_to_ids("</y>")
    mean_out = before.get_output_embeddings().weight.mean(0)
    assert not torch.allclose(after.get_output_embeddings().weight[y_close], mean_out), "</y> logit row stayed the mean row"
    if tied:
        assert after.get_output_embeddings().weight.data_ptr() == after.get_input_embeddings().weight.data_ptr()

    # train reads it with the markers known: only the K latent tokens are new
    model = ZCVAE.from_pretrained(str(out), ModelConfig(num_latents=2))
    assert len(model.tokenizer) == len(tok) + 2
    assert model.tokens.y_close == y_close


def test_full_finetune_trains_every_weight(tmp_path, raw_tiny_backbone):
    source = raw_tiny_backbone()
    out = tmp_path / "full"
    summary = pretrain(stage_config(source, out, full_finetune=True))
    assert summary["source"]["method"] == "full"
    assert summary["num_trained_parameters"] == summary["num_parameters"]
    before, _ = load_plain(source)
    after, _ = load_plain(out)
    assert not torch.equal(after.model.layers[0].mlp.up_proj.weight, before.model.layers[0].mlp.up_proj.weight)
    assert reloaded_val_nll(out, summary) == pytest.approx(summary["val"]["zfree"]["nll_per_example"], rel=1e-4)


def test_stage_is_deterministic_for_a_seed(tmp_path, raw_tiny_backbone):
    source = raw_tiny_backbone()
    a = pretrain(stage_config(source, tmp_path / "a"))
    b = pretrain(stage_config(source, tmp_path / "b"))
    assert a["val"] == b["val"]


def test_bad_stage_configs_name_the_field(tmp_path, raw_tiny_backbone):
    source = raw_tiny_backbone()
    with pytest.raises(ValueError, match="max_length 4096 exceeds the backbone's 128 positions"):
        pretrain(stage_config(source, tmp_path / "o", max_length=4096))
    with pytest.raises(ValueError, match="full_finetune needs backbone"):
        PretrainConfig(full_finetune=True)
    with pytest.raises(ValueError, match="neither a Hugging Face model directory"):
        pretrain(stage_config(tmp_path, tmp_path / "o"))
    assert not (tmp_path / "o").exists()


def test_decision_word_maps_to_its_token_for_word_level_and_bpe_tokenizers():
    from tokenizers import Tokenizer
    from tokenizers.models import BPE
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import PreTrainedTokenizerFast

    from zcvae.backbone.stage_data import word_token_position
    from zcvae.data import build_tokenizer

    y = "2 2 0 8 count 0 * 1 = 0 2 2 8 ."
    words = build_tokenizer()
    assert [word_token_position(words, y, w) for w in (0, 4, 13, 99)] == [0, 4, 13, 14]
    # byte-level BPE without merges: one token per byte, as digits and spaces of a real LM's tokenizer
    backend = Tokenizer(BPE(vocab={c: i for i, c in enumerate(sorted(set("".join(ByteLevel.alphabet()))))}, merges=[]))
    backend.pre_tokenizer = ByteLevel(add_prefix_space=False)
    bpe = PreTrainedTokenizerFast(tokenizer_object=backend)
    ids = bpe(y, add_special_tokens=False)["input_ids"]
    position = word_token_position(bpe, y, 4)
    pieces = bpe.convert_ids_to_tokens(ids)
    assert "".join(pieces[:position]).replace("Ġ", " ").strip() == "2 2 0 8"
    assert "".join(pieces[position:position + 6]).replace("Ġ", " ").strip() == "count"


def test_stage_resumes_to_the_weights_of_an_uninterrupted_run(tmp_path, raw_tiny_backbone, logged):
    """A stage stopped after its step-2 checkpoint (the later checkpoint and the HF files gone, as a crash
    leaves them) and resumed with resume="auto" ends with bitwise the weights of an uninterrupted run."""
    from safetensors.torch import load_file

    source = raw_tiny_backbone()
    settings = dict(max_steps=4, save_every=2, keep_last_checkpoints=5, log_every=1)
    pretrain(stage_config(source, tmp_path / "a", **settings))
    b = tmp_path / "b"
    pretrain(stage_config(source, b, **settings))
    assert sorted(p.name for p in (b / "checkpoints").iterdir()) == ["step_00000002", "step_00000004"]
    shutil.rmtree(b / "checkpoints" / "step_00000004")
    for name in ("pretrain_summary.json", "model.safetensors"):
        (b / name).unlink()
    assert not is_pretrained(b)

    lines = logged
    summary = pretrain(stage_config(source, b, resume="auto", **settings))
    assert "[resume] from step 2" in lines and summary["resumed_from_step"] == 2
    assert is_pretrained(b)
    want, got = load_file(tmp_path / "a" / "model.safetensors"), load_file(b / "model.safetensors")
    assert want.keys() == got.keys() and all(torch.equal(got[k], want[k]) for k in want)
    # each step logged once, the replayed ones with the uninterrupted run's loss
    records = [json.loads(line) for line in (b / "metrics.jsonl").read_text().splitlines()]
    train_b = [r for r in records if r["split"] == "train"]
    train_a = [json.loads(line) for line in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    train_a = [r for r in train_a if r["split"] == "train"]
    assert [r["step"] for r in train_b] == [1, 2, 3, 4]
    assert [r["loss"] for r in train_b] == [r["loss"] for r in train_a]
    # a resume on another training set is refused, the stage as it was
    before = {p: p.read_bytes() for p in b.rglob("*") if p.is_file()}
    with pytest.raises(ValueError, match=r"training data changed.*trained on 64 examples.*num_train_examples 64 -> 48"):
        pretrain(stage_config(source, b, resume="auto", num_train_examples=48, **settings))
    assert {p: p.read_bytes() for p in b.rglob("*") if p.is_file()} == before


def test_stage_writes_its_run_state_and_a_rerun_replaces_it(tmp_path, raw_tiny_backbone):
    """metrics.jsonl, TensorBoard and checkpoints live in the output directory next to the HF files;
    train's backbone check accepts the directory; a second run without resume replaces the first."""
    from zcvae.model.build import check_backbone_files

    source = raw_tiny_backbone()
    out = tmp_path / "stage"
    pretrain(stage_config(source, out, log_every=2))
    names = {p.name for p in out.iterdir()}
    assert {"checkpoints", "metrics.jsonl", "tensorboard", "config.json", "model.safetensors", "pretrain_summary.json"} <= names
    assert not any(name.endswith(".tmp") for name in names)
    check_backbone_files(str(out))
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()
             if json.loads(line)["split"] == "train"]
    assert steps == [2, 4, 6]
    pretrain(stage_config(source, out, log_every=3))
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()
             if json.loads(line)["split"] == "train"]
    assert steps == [3, 6] and is_pretrained(out)


def test_stage_refuses_a_directory_that_holds_no_stage(tmp_path, raw_tiny_backbone):
    source = raw_tiny_backbone()
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    with pytest.raises(ValueError, match="holds other files .*notes.txt.*not a pretraining stage"):
        pretrain(stage_config(source, out))
    assert (out / "notes.txt").read_text() == "keep me"
