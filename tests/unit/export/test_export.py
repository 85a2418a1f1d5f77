"""Export round trip on a tiny Llama ZCVAE (local engine, world 1), and the generate/encode CLI.

The "trained" model is the real ZCVAE whose trainable tensors (LoRA, z rows, router heads) were moved
off their initial values, saved through a real CheckpointManager checkpoint, exported by the CLI and
loaded back three ways: plain peft (the model card's recipe), ``load_for_inference`` and the merged
Hugging Face checkpoint.
"""

from __future__ import annotations

import json
import re

import pytest
import torch

from zcvae.commands.cli import main as cli_main
from zcvae.config import TrainConfig
from zcvae.export.load import load_for_inference
from zcvae.model.cvae import ZCVAE
from zcvae.data.encoding import EncodedExample, collate
from tiny_models import greedy_reference as decode_reference

C_BASE = {"value": 0.25, "mode": "sum", "fingerprint": "f00d", "source": "validation"}
X, Y = "3 1 4 1", "rev 1 4 1 3 = 3 1 4 1 ."


def example(model, x: str, y: str) -> EncodedExample:
    ids = lambda text: tuple(model.tokenizer(text, add_special_tokens=False)["input_ids"])  # noqa: E731
    return EncodedExample("e", ids(x), ids(y))


@pytest.fixture(scope="module")
def trained(tmp_path_factory, tiny_backbone, checkpointed_run):
    """(run_dir, model): a run directory with one complete checkpoint of ``model``."""
    root = tmp_path_factory.mktemp("export")
    backbone = tiny_backbone()
    cfg = TrainConfig.from_flat(backbone=str(backbone), num_latents=3, lora_r=4, max_length=32, seed=0,
                      reconstruction_loss_token_aggregation_mode="sum", output_dir=str(root / "run"), run_name="tiny")
    model = ZCVAE.from_pretrained(str(backbone), cfg.model_config(), seed=cfg.optimization.seed)
    batch = collate([example(model, "3 1 4", "fwd 3 1 4 ."), example(model, "2 7 1 8", Y), example(model, "5 5", "fwd 5 5 .")], model.tokens)
    run_dir = checkpointed_run(model, batch, cfg, scale=0.05, step=5, c_base=C_BASE)
    (run_dir / "metrics.jsonl").write_text(
        json.dumps({"step": 5, "split": "train", "loss": 9.0}) + "\n" + json.dumps({"step": 5, "split": "eval", "nmi": 0.75, "kl": 0.5}) + "\n"
    )
    return run_dir, model.eval()


@pytest.fixture(scope="module")
def exported(trained, tmp_path_factory):
    run_dir, _ = trained
    out = tmp_path_factory.mktemp("out") / "export"
    assert cli_main(["export", str(run_dir), "--out", str(out), "--merge"]) == 0
    return out


def z_free_and_z_inputs(model) -> tuple[torch.Tensor, torch.Tensor]:
    batch = collate([example(model, X, Y)], model.tokens)
    z_ids = batch.z_input_ids.clone()
    z_ids[0, batch.z_slot_start[0]] = model.tokens.latents[2]
    return batch.input_ids, z_ids


def test_export_files_and_no_embedding_matrix(trained, exported):
    run_dir, model = trained
    names = {p.name for p in exported.iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors", "latent_heads.safetensors", "run_config.json",
            "zcvae_export.json", "README.md", "tokenizer.json", "merged"} <= names
    assert not exported.with_name("export.tmp").exists()
    from safetensors.torch import load_file

    vocab = len(model.tokenizer)
    adapter = load_file(str(exported / "adapter_model.safetensors"))
    assert any("lora_A" in k for k in adapter) and any("trainable_tokens_delta" in k for k in adapter)
    for name, tensor in {**adapter, **load_file(str(exported / "latent_heads.safetensors"))}.items():
        assert tensor.dim() == 0 or tensor.shape[0] < vocab, f"{name} {tuple(tensor.shape)} looks like a full embedding matrix"
    heads = load_file(str(exported / "latent_heads.safetensors"))
    for k, v in model.router.state_dict().items():
        assert torch.equal(heads[f"router.{k}"], v), k
    z_rows = dict(model.named_parameters())["peft_model.base_model.model.model.embed_tokens.token_adapter.trainable_tokens_delta.default"]
    assert torch.equal(heads["z_rows"], z_rows)
    assert heads["added_token_ids"].tolist() == list(model.tokens.latents)  # this backbone already knew the markers
    card = (exported / "README.md").read_text()
    for needed in ("K = 3", "`sum`", "0.25", "| nmi | 0.75 |", "PeftModel.from_pretrained", "resize_token_embeddings"):
        assert needed in card, needed


def test_peft_round_trip_gives_the_trained_logits(trained, exported):
    """The model card's recipe: resized base + added rows, then PeftModel.from_pretrained."""
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    run_dir, model = trained
    backbone = json.loads((exported / "zcvae_export.json").read_text())["backbone"]
    tokenizer = AutoTokenizer.from_pretrained(exported)
    base = AutoModelForCausalLM.from_pretrained(backbone)
    if len(tokenizer) > base.get_input_embeddings().weight.shape[0]:
        base.resize_token_embeddings(len(tokenizer))
    heads = load_file(str(exported / "latent_heads.safetensors"))
    with torch.no_grad():
        base.get_input_embeddings().weight[heads["added_token_ids"]] = heads["added_rows.input_embeddings"]
        base.get_output_embeddings().weight[heads["added_token_ids"]] = heads["added_rows.output_embeddings"]
    loaded = PeftModel.from_pretrained(base, str(exported)).eval()
    zfree, zcond = z_free_and_z_inputs(model)
    with torch.no_grad():
        for ids in (zfree, zcond):  # the z-conditioned input checks the trained z row too
            torch.testing.assert_close(loaded(input_ids=ids).logits, model.peft_model(input_ids=ids).logits, rtol=0, atol=1e-6)
        # the merged checkpoint is a plain HF model with the same function
        merged = AutoModelForCausalLM.from_pretrained(exported / "merged").eval()
        torch.testing.assert_close(merged(input_ids=zcond).logits, model.peft_model(input_ids=zcond).logits, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("source", ["export", "run"])
def test_load_for_inference(trained, exported, source):
    run_dir, model = trained
    loaded = load_for_inference(exported if source == "export" else run_dir)
    batch = collate([example(model, X, Y)], model.tokens)
    with torch.no_grad():
        a, b = loaded.encode(batch), model.encode(batch)
    assert torch.equal(a.posterior_logits, b.posterior_logits) and torch.equal(a.prior_logits, b.prior_logits)
    assert not torch.allclose(b.posterior_logits.softmax(-1), torch.full((1, 3), 1 / 3))  # the heads are not at init


def greedy_reference(model, x: str, k: int, max_new_tokens: int) -> str:
    return decode_reference(model, example(model, x, "a").x_ids, [model.tokens.latents[k]], max_new_tokens)


def test_generate_cli_prints_one_line_per_latent(trained, exported, capsys):
    run_dir, model = trained
    assert cli_main(["generate", str(exported), "--x", X, "--all-latents", "--max-new-tokens", "4", "--device", "cpu"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines == [f"z={k}\t{greedy_reference(model, X, k, 4)}" for k in range(3)]
    assert cli_main(["generate", str(exported), "--x", X, "--z", "1", "--max-new-tokens", "4", "--device", "cpu"]) == 0
    assert capsys.readouterr().out.strip() == greedy_reference(model, X, 1, 4)
    assert cli_main(["generate", str(exported), "--x", X, "--z", "7"]) == 2
    assert "--z must be in 0..2" in capsys.readouterr().err


def test_encode_cli_prints_posterior_and_prior(trained, exported, capsys):
    run_dir, model = trained
    assert cli_main(["encode", str(exported), "--x", X, "--y", Y, "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    with torch.no_grad():
        ref = model(collate([example(model, X, Y)], model.tokens), mode="encode")
    for label, probs in (("q(z|x,y)", ref.posterior[0]), ("p(z|x)", ref.prior[0])):
        line = next(l for l in out.splitlines() if l.startswith(label))
        printed = [float(v) for v in re.findall(r"z=\d+:([0-9.]+)", line)]
        assert printed == pytest.approx(probs.tolist(), abs=1e-4)


def test_export_refuses_a_non_empty_out_and_overwrites_on_request(trained, tmp_path, capsys):
    run_dir, _ = trained
    out = tmp_path / "taken"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    assert cli_main(["export", str(run_dir), "--out", str(out)]) == 2
    assert "--overwrite" in capsys.readouterr().err and (out / "keep.txt").exists()
    assert cli_main(["export", str(run_dir), "--out", str(out), "--overwrite"]) == 0
    assert not (out / "keep.txt").exists() and (out / "adapter_model.safetensors").exists()
    assert not list(tmp_path.glob("*.tmp")) and not list(tmp_path.glob("*.old"))


def test_another_backbone_is_refused_naming_the_file(trained, exported, tiny_backbone):
    run_dir, _ = trained
    other = tiny_backbone(hidden_size=16)
    with pytest.raises(ValueError, match=r"zcvae_export\.json.*another backbone.*config\.json.*hidden_size: 32 vs 16"):
        load_for_inference(exported, backbone=str(other))
    with pytest.raises(ValueError, match=r"trainable\.safetensors.*shape"):
        load_for_inference(run_dir, backbone=str(other))


def test_one_line_escapes_what_would_break_a_line_per_latent():
    from zcvae.export.cli import one_line

    text = "a\nb\tc\\n\rd"
    escaped = one_line(text)
    assert "\n" not in escaped and "\t" not in escaped and "\r" not in escaped
    assert escaped == "a\\nb\\tc\\\\n\\rd"
    # reversible: a reader undoes it with the unicode_escape rules for these four characters
    assert escaped.encode().decode("unicode_escape") == text
    assert one_line("plain y 1 2 3") == "plain y 1 2 3"
