"""The entangled stage (``zcvae pretrain --backbone DIR``) under torchrun equals the single-process stage.

Two gloo processes (fp32) against one, at the same global batch (world 1 x accumulation 2 against
world 2 x accumulation 1), on a raw tiny Llama that lacks the template markers:

    engine             method   compared with
    deepspeed zero3    LoRA     w1-lora   (the LoRA merge after the trained weights are gathered)
    fsdp2              LoRA     w1-lora
    deepspeed zero3    full     w1-full   (a full fine-tune saves the full weights)
    fsdp2              full     w1-full

Each pair agrees in the logged training loss and gradient norm at every step, in the final validation
y NLL, and in every tensor of the saved merged checkpoint (model.safetensors). The learning rate is
low for the reason tests/distributed/test_trainer_cli.py gives: Adam turns float noise on near-zero
gradient entries into parameter differences of the order of the learning rate.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:  # launcher sits next to this file (tests/distributed has no __init__.py)
    sys.path.insert(0, HERE)

import launcher as C  # noqa: E402


LAUNCH_TIMEOUT_S = 420
MAX_WORKERS = 4
TOL = 1e-5
STEPS = 3
COMMON = ["--task", "copy", "--max-steps", STEPS, "--batch-size", 4, "--num-train-examples", 32, "--num-val-examples", 8,
          "--num-decode-examples", 0, "--warmup-steps", 1, "--log-every", 1, "--no-progress-bar", "--max-length", 32]
RUNS = {
    # name: (world, method flags, engine flags, baseline)
    "w1-lora": (1, ("--learning-rate", "1e-4"), ("--engine", "local"), None),
    "zero3-lora": (2, ("--learning-rate", "1e-4"), ("--engine", "deepspeed", "--deepspeed-config", "zero3"), "w1-lora"),
    "fsdp2-lora": (2, ("--learning-rate", "1e-4"), ("--engine", "fsdp2"), "w1-lora"),
    "w1-full": (1, ("--full-finetune", "--learning-rate", "1e-5"), ("--engine", "local"), None),
    "zero3-full": (2, ("--full-finetune", "--learning-rate", "1e-5"), ("--engine", "deepspeed", "--deepspeed-config", "zero3"), "w1-full"),
    "fsdp2-full": (2, ("--full-finetune", "--learning-rate", "1e-5"), ("--engine", "fsdp2"), "w1-full"),
}


def raw_backbone(directory: Path) -> Path:
    """A tiny Llama with its own word-level tokenizer, *without* the template markers (like a real LM)."""
    from tokenizers import AddedToken, Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

    from zcvae.backbone.stage_model import tiny_llama_config
    from zcvae.data.tokenizer import task_vocabulary

    special = ["<pad>", "<unk>", "<s>", "</s>"]
    vocab = {t: i for i, t in enumerate([*special, *task_vocabulary()])}
    backend = Tokenizer(WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = WhitespaceSplit()
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                  unk_token="<unk>", clean_up_tokenization_spaces=False)
    config = tiny_llama_config(len(tok), hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64,
                               bos_token_id=2, eos_token_id=3, pad_token_id=0)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(directory)
    tok.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    root = tmp_path_factory.mktemp("pretrain_dist")
    env = C.cpu_env(root / "zcvae-cache")
    backbone = raw_backbone(root / "raw")
    launches = C.LaunchPool(max_workers=MAX_WORKERS)
    for name, (world, method, engine, _) in RUNS.items():
        args = ["pretrain", "--backbone", backbone, "--output-dir", root / name, *COMMON, *method, *engine,
                "--gradient-accumulation-steps", 2 // world]
        cmds = [C.zcvae_cmd(*args)] if world == 1 else [C.torchrun_cmd(*args, nproc=world)]
        launches.submit(C.Launch(name, cmds, num_workers=world, log_dir=root, env=env, timeout_s=LAUNCH_TIMEOUT_S))
    launches.root = root
    launches.start()
    yield launches
    launches.cancel_all()


def _stage_dir(pool, name: str) -> Path:
    launch = pool.wait(name)
    if not launch.ok:
        pytest.fail(launch.failure())
    return pool.root / name


@pytest.mark.parametrize("name", ["zero3-lora", "fsdp2-lora", "zero3-full", "fsdp2-full"])
def test_two_ranks_equal_single_process(pool, name):
    from safetensors.torch import load_file

    from zcvae.backbone.stage_config import is_pretrained

    world, _, engine, baseline = RUNS[name]
    got, want = _stage_dir(pool, name), _stage_dir(pool, baseline)
    assert is_pretrained(got) and is_pretrained(want)
    summary, base = (json.loads((d / "pretrain_summary.json").read_text()) for d in (got, want))
    assert (summary["world_size"], summary["engine"]) == (2, engine[1]) and base["world_size"] == 1
    assert summary["config"]["gradient_accumulation_steps"] == 1 and base["config"]["gradient_accumulation_steps"] == 2

    got_train, got_eval = C.read_metrics(got)
    want_train, want_eval = C.read_metrics(want)
    assert [r["step"] for r in want_train] == list(range(1, STEPS + 1))
    assert all(r["grad_norm"] > 0 for r in want_train)
    errors = C.compare_records(got_train, want_train, ["loss", "grad_norm"], tol=TOL, what="train")
    errors += C.compare_records(got_eval[-1:], want_eval[-1:], ["y_nll_per_example", "znull_y_nll_per_example"], tol=TOL, what="final eval")
    assert not errors, f"{name} vs {baseline}:\n" + "\n".join(errors)

    # the saved checkpoint: every tensor (merged LoRA + trained rows, or all weights) as one process saved it
    got_w, want_w = load_file(got / "model.safetensors"), load_file(want / "model.safetensors")
    assert got_w.keys() == want_w.keys()
    raw = load_file(pool.root / "raw" / "model.safetensors")
    moved = [k for k in want_w if k in raw and want_w[k].shape == raw[k].shape and not torch.equal(want_w[k], raw[k])]
    assert moved, "the single-process stage changed no weight: the comparison would be empty"
    for key in want_w:
        assert torch.allclose(got_w[key], want_w[key], rtol=1e-4, atol=1e-6), (
            f"{key}: max |diff| {float((got_w[key] - want_w[key]).abs().max()):.3g}")
