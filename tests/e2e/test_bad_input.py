"""The bad-input and fault catalogue (issue 13): what a new user would try, through the real CLI.

Every case asserts the exit code, that no traceback is printed, the key words of the message, and that
nothing of an earlier run was lost (its files unchanged, by sha256). One tiny backbone (the session's)
and one finished run (6 steps, checkpoints at 3 and 6) serve the whole module; a case that must change
a run works on a copy.

Most cases call ``zcvae.commands.cli.main`` in this process (an uncaught exception fails the test the way a
traceback would fail a user); the data-loss cases also run as a real ``python -m zcvae`` process.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from cli_in_process import zcvae

TRAIN = ["--task", "copy", "--num-train-examples", "32", "--num-val-examples", "8", "--num-eval-decode-examples", "2",
         "--micro-batch-size", "4", "--max-steps", "6", "--save-every", "3", "--keep-last-checkpoints", "3",
         "--log-every", "3", "--warmup-steps", "1", "--no-progress-bar"]


def tree_hashes(root: Path) -> dict[str, str]:
    """{relative path: sha256} of every file under ``root``."""
    return {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(root.rglob("*")) if p.is_file()}


def refused(rc: int, out: str, *words: str) -> None:
    assert rc == 2, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    for word in words:
        assert word in out, f"{word!r} not in:\n{out[-3000:]}"


@pytest.fixture(scope="module")
def run(cli, tiny_backbone, tmp_path_factory) -> Path:
    """A finished run: checkpoints at steps 3 and 6."""
    run_dir = tmp_path_factory.mktemp("bad") / "run"
    cli("train", "--backbone", tiny_backbone, "--output-dir", run_dir, *TRAIN, cwd=run_dir.parent)
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step_00000003", "step_00000006"]
    return run_dir


# --------------------------------------------------------------------------- 1. export over the run
def test_01_export_over_the_run_or_backbone_is_refused(cli, run, tiny_backbone, tmp_path, capsys, env):
    before, backbone_before = tree_hashes(run), tree_hashes(tiny_backbone)
    proc = cli("export", run, "--out", run, "--overwrite", cwd=tmp_path, check=False)
    refused(proc.returncode, proc.stdout + proc.stderr, "--out", "is the run directory")
    for out, words in ((run.parent, "contains the run directory"), (run / "export", "lies inside the run directory"),
                       (run / "checkpoints", "lies inside the run directory"), (tiny_backbone, "backbone directory")):
        refused(*zcvae(capsys, "export", run, "--out", out, "--overwrite", "--backbone", tiny_backbone), "--out", words)
    assert tree_hashes(run) == before and tree_hashes(tiny_backbone) == backbone_before
    assert not list(run.parent.glob("*.tmp")) and not (run / "export").exists()


# --------------------------------------------------------------------------- 2. a second run into the run dir
def test_02_second_run_into_a_non_empty_dir_is_refused(cli, run, tiny_backbone, tmp_path):
    before = tree_hashes(run)
    proc = cli("train", "--backbone", tiny_backbone, "--output-dir", run, *TRAIN, "--seed", "1", cwd=tmp_path, check=False)
    refused(proc.returncode, proc.stdout + proc.stderr, "not empty", "--resume", "--overwrite")
    assert tree_hashes(run) == before


def test_02_overwrite_deletes_the_old_run_after_saying_so(cli, run, tiny_backbone, copy_of, tmp_path):
    old = copy_of(run)
    proc = cli("train", "--backbone", tiny_backbone, "--output-dir", old, *TRAIN, "--max-steps", "2", "--save-every", "0",
               "--overwrite", cwd=tmp_path)
    out = proc.stdout + proc.stderr
    assert "Traceback" not in out and "--overwrite: deleting the earlier run" in out
    assert sorted(p.name for p in (old / "checkpoints").iterdir()) == ["step_00000002"]
    steps = [json.loads(line)["step"] for line in (old / "metrics.jsonl").read_text().splitlines()]
    assert steps == sorted(steps) and max(steps) == 2  # one run's records only
    assert not list(tmp_path.glob("copy.deleting-*"))


def test_02_overwrite_refuses_a_directory_that_is_not_a_run(run, tiny_backbone, tmp_path, capsys, env):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "thesis.tex").write_text("years of work")
    refused(*zcvae(capsys, "train", "--backbone", tiny_backbone, "--output-dir", mine, *TRAIN, "--overwrite"),
            "only a zcvae run directory", "thesis.tex")
    assert (mine / "thesis.tex").read_text() == "years of work"


# --------------------------------------------------------------------------- 3. resume past max_steps
def test_03_resume_past_max_steps_is_refused_naming_both(cli, run, tiny_backbone, tmp_path):
    before = tree_hashes(run)
    proc = cli("train", "--backbone", tiny_backbone, "--output-dir", run, *TRAIN, "--max-steps", "3", "--resume", "auto",
               cwd=tmp_path, check=False)
    refused(proc.returncode, proc.stdout + proc.stderr, "step 6", "max_steps 3", "--max-steps 6")
    assert tree_hashes(run) == before


def test_03_resume_at_max_steps_finishes_at_once_writing_nothing(run, tiny_backbone, capsys, env):
    before = tree_hashes(run)
    rc, out = zcvae(capsys, "train", "--backbone", tiny_backbone, "--output-dir", run, *TRAIN, "--resume", "auto")
    assert rc == 0 and "Traceback" not in out and "already at max_steps 6" in out and "nothing written" in out
    assert tree_hashes(run) == before


# --------------------------------------------------------------------------- 4, 5. special and unknown tokens
@pytest.fixture(scope="module")
def jsonl_run(tiny_backbone, tmp_path_factory, env):
    """(exit code, output, run dir) of a 1-step run on JSONL data holding special and unknown tokens."""
    from zcvae.data import get_task, make_examples, write_jsonl
    from zcvae.data.tasks import Example

    root = tmp_path_factory.mktemp("jsonl")
    task = get_task("copy")
    good = make_examples(task, seed=1, split="train", num_examples=12)
    bad = [Example("eos-in-y", "1 2", "fwd 1 2 </s> ."), Example("bos-in-x", "<s> 1 2", "fwd 1 2 ."),
           Example("pad-in-x", "1 <pad> 2", "fwd 1 2 ."), Example("marker-in-y", "1 2", "fwd <y> 1 2 ."),
           Example("unknown-words", "1 zebra 2", "fwd 1 zebra 2 .")]
    write_jsonl(root / "train.jsonl", [*good, *bad])
    write_jsonl(root / "val.jsonl", make_examples(task, seed=1, split="val", num_examples=4))
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "zcvae", "train", "--backbone", str(tiny_backbone), "--output-dir", str(root / "run"),
                           "--train-data", str(root / "train.jsonl"), "--val-data", str(root / "val.jsonl"), "--max-steps", "1",
                           "--micro-batch-size", "4", "--num-eval-decode-examples", "2", "--no-progress-bar"],
                          capture_output=True, text=True, timeout=600, env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    return proc.returncode, proc.stdout + proc.stderr, root / "run"


def test_04_special_tokens_in_user_text_are_skipped_and_named(jsonl_run):
    rc, out, run_dir = jsonl_run
    assert rc == 0 and "Traceback" not in out, out[-3000:]
    assert "skipped 4 of 17" in out
    for example_id, token in (("eos-in-y", "'</s>' (id 3)"), ("bos-in-x", "'<s>' (id 2)"), ("pad-in-x", "'<pad>' (id 0)")):
        assert f"{example_id}: x or y contains the special token {token}" in out
    data = json.loads((run_dir / "run_config.json").read_text())["data"]
    assert (data["train"]["kept"], data["train"]["skipped"]) == (13, 4)


def test_05_unknown_tokens_are_printed_per_split_with_an_example(jsonl_run):
    rc, out, _ = jsonl_run
    assert rc == 0
    assert "[data] train: 2 of" in out and "unknown to the tokenizer (<unk>), e.g. in example 'unknown-words'" in out


def test_05_data_the_tokenizer_does_not_fit_is_refused(tiny_backbone, tmp_path, capsys, env):
    from zcvae.data import write_jsonl
    from zcvae.data.tasks import Example

    foreign = [Example(f"e{i}", "le chat noir dort", "la souris blanche mange") for i in range(6)]
    write_jsonl(tmp_path / "train.jsonl", foreign)
    write_jsonl(tmp_path / "val.jsonl", foreign[:2])
    refused(*zcvae(capsys, "train", "--backbone", tiny_backbone, "--output-dir", tmp_path / "r", "--train-data", tmp_path / "train.jsonl",
                   "--val-data", tmp_path / "val.jsonl", "--max-steps", "1", "--no-progress-bar"),
            "train data", "tokens are unknown", "'e0'", "does not fit the data")


# --------------------------------------------------------------------------- 6, 7, 11. config values
@pytest.mark.parametrize("value", ["0", "-1"])
def test_06_kl_cycles_must_be_positive(value, tiny_backbone, tmp_path, capsys, env):
    refused(*zcvae(capsys, "train", "--backbone", tiny_backbone, *TRAIN, "--kl-schedule", "cyclical", "--kl-cycles", value,
                   "--output-dir", tmp_path / "r"), "kl_cycles must be >= 1")
    assert not (tmp_path / "r").exists()


def test_07_num_latents_with_the_continuous_latent_is_refused(tiny_backbone, tmp_path, capsys, env):
    refused(*zcvae(capsys, "train", "--backbone", tiny_backbone, *TRAIN, "--latent-type", "continuous", "--num-latents", "4",
                   "--output-dir", tmp_path / "r"),
            "num_latents", "discrete latent only")


def test_11_yaml_values_are_type_checked_naming_the_field(tiny_backbone, tmp_path, capsys, env):
    bad = tmp_path / "bad.yaml"
    train = ("train", "--config", bad, "--backbone", tiny_backbone, "--task", "copy", "--output-dir", tmp_path / "r")
    bad.write_text('max_steps: "two"\n')
    refused(*zcvae(capsys, *train), "bad.yaml", "max_steps", "int", "'two'")
    bad.write_text("max_steps: 2\nprogress_bar: 1\n")
    refused(*zcvae(capsys, *train), "progress_bar", "bool")
    bad.write_text("max_steps: 2\nlora_target_modules: q_proj\n")
    refused(*zcvae(capsys, *train), "lora_target_modules", "list[str]")
    assert not (tmp_path / "r").exists()
    # what YAML gives for the annotated types is accepted: an int for a float, null for an Optional
    from zcvae.config import TrainConfig, load_config_file

    good = tmp_path / "good.yaml"
    good.write_text("kl_weight: 1\nmax_grad_norm: null\nzfree_reference_scale: 2\nlora_target_modules: [q_proj, v_proj]\n")
    cfg = TrainConfig.from_dict(load_config_file(good))
    assert (cfg.objective.kl_weight, cfg.optimization.max_grad_norm, cfg.objective.zfree_reference_scale) == (1, None, 2)


def test_11_pretrain_values_are_type_checked_naming_the_file_and_field(tmp_path, capsys, env):
    bad = tmp_path / "stage.yaml"
    pretrain = ("pretrain", "--config", bad, "--output-dir", tmp_path / "stage")
    bad.write_text('max_steps: "two"\n')
    refused(*zcvae(capsys, *pretrain), "stage.yaml", "max_steps", "int", "'two'")
    bad.write_text("engine: zero3\n")
    refused(*zcvae(capsys, *pretrain), "stage.yaml", "engine", "'local', 'deepspeed', 'fsdp2'")
    bad.write_text("max_step: 2\n")
    refused(*zcvae(capsys, *pretrain), "stage.yaml", "unknown keys ['max_step']")
    refused(*zcvae(capsys, "pretrain", "--warmup-steps", "-1", "--output-dir", tmp_path / "stage"), "command line", "warmup_steps")
    assert not (tmp_path / "stage").exists()


def test_missing_config_file_is_refused(tmp_path, capsys, env):
    refused(*zcvae(capsys, "train", "--config", tmp_path / "nope.yaml"), "nope.yaml", "does not exist")


# --------------------------------------------------------------------------- 8. inference input
def test_08_inference_applies_the_training_checks(run, tiny_backbone, capsys, env):
    before = tree_hashes(run)
    refused(*zcvae(capsys, "generate", run, "--x", "", "--device", "cpu"), "--x must not be empty")
    refused(*zcvae(capsys, "generate", run, "--x", "   ", "--device", "cpu"), "--x must not be empty")
    refused(*zcvae(capsys, "encode", run, "--x", "1 2", "--y", "fwd 1 2 </s> .", "--device", "cpu"), "--y", "'</s>'", "id 3")
    refused(*zcvae(capsys, "encode", run, "--x", "<s> 1 2", "--y", "fwd 1 2 .", "--device", "cpu"), "--x", "'<s>'")
    refused(*zcvae(capsys, "generate", run, "--x", "1 <z_0> 2", "--device", "cpu"), "--x", "<z_0>")
    long_x = " ".join(["1"] * 3000)
    rc, out = zcvae(capsys, "generate", run, "--x", long_x, "--z", "0", "--max-new-tokens", "2", "--device", "cpu")
    assert rc == 0 and "Traceback" not in out and "--x has 3000 tokens; kept its last" in out and "max_length=64" in out
    rc, out = zcvae(capsys, "encode", run, "--x", long_x, "--y", "fwd 1 1 .", "--device", "cpu")
    assert rc == 0 and "kept its last" in out and "q(z|x,y)" in out
    refused(*zcvae(capsys, "encode", run, "--x", "1", "--y", " ".join(["1"] * 100), "--device", "cpu"), "--y has 100 tokens", "max_length=64")
    assert tree_hashes(run) == before


def test_inference_on_a_missing_path_is_refused(tmp_path, capsys, env):
    refused(*zcvae(capsys, "generate", tmp_path / "nowhere", "--x", "1 2", "--device", "cpu"), "nowhere", "not a directory")


# --------------------------------------------------------------------------- 9, 10. paths
def test_09_train_data_missing_or_a_directory(tmp_path, tiny_backbone, capsys, env):
    (tmp_path / "val.jsonl").write_text('{"id": "a", "x": "1", "y": "fwd 1 ."}\n')
    refused(*zcvae(capsys, "train", "--backbone", tiny_backbone, "--train-data", tmp_path / "nope.jsonl", "--val-data", tmp_path / "val.jsonl",
                   "--output-dir", tmp_path / "r"), "train_data", "nope.jsonl", "does not exist")
    refused(*zcvae(capsys, "train", "--backbone", tiny_backbone, "--train-data", tmp_path, "--val-data", tmp_path / "val.jsonl",
                   "--output-dir", tmp_path / "r"), "train_data", "is a directory")
    refused(*zcvae(capsys, "train", "--backbone", tiny_backbone, "--train-data", tmp_path / "val.jsonl", "--val-data", tmp_path / "v2.jsonl",
                   "--output-dir", tmp_path / "r"), "val_data", "v2.jsonl")


def test_10_output_dir_that_is_a_file_or_lies_under_one(tmp_path, tiny_backbone, capsys, env):
    afile = tmp_path / "notes.txt"
    afile.write_text("keep me")
    refused(*zcvae(capsys, "train", "--backbone", tiny_backbone, *TRAIN, "--output-dir", afile), "output_dir", "is an existing file")
    refused(*zcvae(capsys, "train", "--backbone", tiny_backbone, *TRAIN, "--output-dir", afile / "run"), "lies under", "notes.txt")
    assert afile.read_text() == "keep me"


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_10_output_dir_not_writable(tmp_path, tiny_backbone, capsys, env):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        refused(*zcvae(capsys, "train", "--backbone", tiny_backbone, *TRAIN, "--output-dir", locked / "run"), "output_dir", "cannot be created")
    finally:
        locked.chmod(0o700)


# --------------------------------------------------------------------------- 12. broken backbones
@pytest.mark.parametrize(("damage", "words"), [
    ("config", ("config.json", "not valid JSON")),
    ("missing", ("model.safetensors",)),
    ("truncated", ("model.safetensors", "could not be loaded")),
])
def test_12_broken_backbone_is_named(damage, words, run, tiny_backbone, tmp_path, capsys, env):
    broken = tmp_path / "bb"
    shutil.copytree(tiny_backbone, broken)
    weights = broken / "model.safetensors"
    if damage == "config":
        (broken / "config.json").write_text('{"model_type": "llama", ')
    elif damage == "missing":
        weights.unlink()
    else:
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    before = tree_hashes(run)
    refused(*zcvae(capsys, "train", "--backbone", broken, *TRAIN, "--output-dir", tmp_path / "r"), *words)
    refused(*zcvae(capsys, "export", run, "--out", tmp_path / "e", "--backbone", broken), *words)
    assert tree_hashes(run) == before and not (tmp_path / "e").exists()


# --------------------------------------------------------------------------- 13. cuda without cuda
@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a torch without usable CUDA")
def test_13_device_cuda_without_cuda(run, capsys, env):
    refused(*zcvae(capsys, "generate", run, "--x", "1 2", "--device", "cuda"), "--device 'cuda'", "no usable CUDA", "--device cpu")
    refused(*zcvae(capsys, "encode", run, "--x", "1 2", "--y", "fwd 1 2 .", "--device", "cuda:3"), "--device 'cuda:3'")


def test_bad_device_name(run, capsys, env):
    refused(*zcvae(capsys, "generate", run, "--x", "1 2", "--device", "gpu0"), "--device 'gpu0'")


# --------------------------------------------------------------------------- 14. structural changes on resume
@pytest.mark.parametrize(("flags", "words"), [
    (["--num-latents", "3"], ("num_latents changed", "2", "3", "--num-latents 2")),
    (["--latent-type", "continuous"], ("latent_type changed", "'discrete'", "'continuous'")),
])
def test_14_resume_names_the_changed_latent_field(flags, words, run, tiny_backbone, capsys, env):
    before = tree_hashes(run)
    rc, out = zcvae(capsys, "train", "--backbone", tiny_backbone, "--output-dir", run, *TRAIN, "--max-steps", "9", "--resume", "auto", *flags)
    refused(rc, out, *words)
    assert "c_base changed" not in out
    assert tree_hashes(run) == before


def test_14_resume_on_another_training_set_is_refused(run, tiny_backbone, capsys, env):
    """Half the training examples (the validation split, and so c_base, unchanged): the run would go on with other
    data while run_config.json claims it throughout; the error names the setting that moved, and nothing is written."""
    before = tree_hashes(run)
    flags = [*TRAIN, "--max-steps", "9", "--resume", "auto", "--num-train-examples", "16"]  # the last value wins
    rc, out = zcvae(capsys, "train", "--backbone", tiny_backbone, "--output-dir", run, *flags)
    refused(rc, out, "training data changed", "trained on 32 examples", "this run has 16", "num_train_examples 32 -> 16")
    assert tree_hashes(run) == before


# --------------------------------------------------------------------------- 15, 16. damaged checkpoints
def test_15_resume_auto_falls_back_past_a_corrupt_checkpoint(run, tiny_backbone, copy_of, capsys, env):
    run_dir = copy_of(run)
    newest = run_dir / "checkpoints" / "step_00000006" / "trainable.safetensors"
    data = bytearray(newest.read_bytes())
    data[-1] ^= 0xFF
    newest.write_bytes(bytes(data))
    older = tree_hashes(run_dir / "checkpoints" / "step_00000003")
    rc, out = zcvae(capsys, "train", "--backbone", tiny_backbone, "--output-dir", run_dir, *TRAIN, "--resume", "auto")
    assert rc == 0 and "Traceback" not in out, out[-3000:]
    assert "step_00000006" in out and "corrupt" in out and "falling back" in out and "[resume] from step 3" in out
    assert tree_hashes(run_dir / "checkpoints" / "step_00000003") == older
    from zcvae.runs.checkpoint import verify_checkpoint

    verify_checkpoint(run_dir / "checkpoints" / "step_00000006")  # saved again, whole


def test_15_resume_auto_refuses_when_no_checkpoint_is_loadable(run, tiny_backbone, copy_of, capsys, env):
    run_dir = copy_of(run)
    for step in ("step_00000003", "step_00000006"):
        (run_dir / "checkpoints" / step / "meta.json").write_text("{}")
    before = tree_hashes(run_dir)
    refused(*zcvae(capsys, "train", "--backbone", tiny_backbone, "--output-dir", run_dir, *TRAIN, "--resume", "auto"),
            "no checkpoint", "is loadable", "step_00000003", "step_00000006")
    assert tree_hashes(run_dir) == before


def test_16_a_file_outside_the_manifest_is_refused_before_any_loader(run, tiny_backbone, copy_of, tmp_path, capsys, env):
    run_dir = copy_of(run)
    planted = run_dir / "checkpoints" / "step_00000006" / "engine" / "extra.pt"
    planted.write_bytes(b"not what was saved")
    before = tree_hashes(run_dir)
    ckpt = run_dir / "checkpoints" / "step_00000006"
    refused(*zcvae(capsys, "train", "--backbone", tiny_backbone, "--output-dir", run_dir, *TRAIN, "--max-steps", "9", "--resume", ckpt),
            "extra.pt", "not in the COMPLETE manifest")
    refused(*zcvae(capsys, "export", run_dir, "--out", tmp_path / "e"), "extra.pt", "not in the COMPLETE manifest")
    assert tree_hashes(run_dir) == before and not (tmp_path / "e").exists()


def test_resume_from_a_path_that_does_not_exist(run, tiny_backbone, tmp_path, capsys, env):
    before = tree_hashes(run)
    refused(*zcvae(capsys, "train", "--backbone", tiny_backbone, "--output-dir", run, *TRAIN, "--resume", tmp_path / "gone"),
            "resume", "gone", "does not exist")
    assert tree_hashes(run) == before


def test_export_of_a_directory_that_is_not_a_run(tmp_path, capsys, env):
    (tmp_path / "empty").mkdir()
    refused(*zcvae(capsys, "export", tmp_path / "empty", "--out", tmp_path / "e"), "run_config.json", "does not exist")
