"""--allow-fresh-markers under the scale-out engines: the marker rows a raw backbone lacked train as
trainable tokens under DeepSpeed ZeRO-3 and FSDP2 (two gloo ranks) as in one process.

The backbone is ``raw_tiny_backbone`` (tests/conftest.py): its tokenizer has none of the template markers
and its head is untied, so the markers get two trainable-token deltas, the input rows (after the z rows)
and the output-head rows. Each run is the real ``zcvae train`` CLI, 3 steps of the same global batch
(world 1 x accumulation 4, world 2 x accumulation 2). What must hold: the logged losses and grad norms
equal the single-process run within 1e-5, the final checkpoints' deltas equal its deltas, and every
marker row that occurs in the template moved off its start, the mean row.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:  # launcher sits next to this file (tests/distributed has no __init__.py)
    sys.path.insert(0, HERE)

import launcher as C  # noqa: E402
from zcvae.runs.checkpoint import checkpoint_dirs  # noqa: E402
from zcvae.data.encoding import MARKERS  # noqa: E402


LAUNCH_TIMEOUT_S = 420
TOL = 1e-5
STEPS = 3
MICRO = 3
COMMON = ["--task", "copy", "--num-train-examples", "48", "--num-val-examples", "6", "--num-eval-decode-examples", "2",
          "--micro-batch-size", str(MICRO), "--num-latents", "2", "--log-every", "1", "--no-progress-bar", "--warmup-steps", "1",
          "--max-steps", str(STEPS), "--reference-policy", "online", "--allow-fresh-markers",
          # router support is a term of each global micro-batch's mean q (docs/objective.md, "Auxiliaries"), and the
          # runs compared here group the same examples into different micro-batches: off, the rest of the default on
          "--router-support-weight", "0",
          # small rates: Adam turns float noise on near-zero gradients into differences of order lr (see test_trainer_cli)
          "--lora-learning-rate", "1e-4", "--latent-learning-rate", "1e-3"]
RUNS = {
    "w1": (1, ["--engine", "local"]),
    "zero3": (2, ["--engine", "deepspeed", "--deepspeed-config", "zero3"]),
    "fsdp2": (2, ["--engine", "fsdp2"]),
}
KEYS = ["loss", "reconstruction_loss", "kl", "grad_norm"]


@pytest.fixture(scope="module")
def runs(raw_tiny_backbone, tmp_path_factory):
    root = tmp_path_factory.mktemp("fresh_markers")
    env = C.cpu_env(root / "zcvae-cache")
    backbone = raw_tiny_backbone()
    # run-<name>: the launches run in root, where a directory named zero3 would shadow the built-in config
    pool = C.cli_runs(root, RUNS, lambda name, world, engine: [
        "train", "--backbone", backbone, "--output-dir", root / f"run-{name}", *COMMON, *engine,
        "--gradient-accumulation-steps", str(4 // world)], env=env, timeout_s=LAUNCH_TIMEOUT_S)
    yield pool, root, backbone
    pool.cancel_all()


def _deltas(run_dir) -> dict[str, torch.Tensor]:
    trainable = load_file(str(checkpoint_dirs(run_dir / "checkpoints")[-1] / "trainable.safetensors"))
    return {k: v for k, v in trainable.items() if "trainable_tokens_delta" in k}


@pytest.mark.parametrize("name", ["zero3", "fsdp2"])
def test_marker_rows_train_under_the_engine_as_in_one_process(runs, name):
    pool, root, backbone = runs
    got, want = C.finished_run(pool, root, name), C.finished_run(pool, root, "w1")
    assert C.read_run_config(got)["world_size"] == 2
    got_train, _ = C.read_metrics(got)
    want_train, _ = C.read_metrics(want)
    errors = C.compare_records(got_train, want_train, KEYS, tol=TOL, what="train")
    assert not errors, "\n".join(errors)

    got_d, want_d = _deltas(got), _deltas(want)
    assert sorted(got_d) == sorted(want_d) and len(want_d) == 2  # input rows (z + markers) and the untied head's
    for key in want_d:
        torch.testing.assert_close(got_d[key], want_d[key], rtol=0, atol=TOL)

    with safe_open(str(backbone / "model.safetensors"), "pt") as saved:
        starts = {"embed_tokens": saved.get_tensor("model.embed_tokens.weight").mean(0),
                  "lm_head": saved.get_tensor("lm_head.weight").mean(0)}
    for key, delta in got_d.items():
        start = starts["lm_head" if "lm_head" in key else "embed_tokens"]
        markers = delta[-len(MARKERS):]  # MARKERS order, <znull> last (never in a discrete run's input)
        moved = (markers - start).abs().amax(-1)
        assert (moved[:-1] > 1e-6).all(), f"{key}: marker rows did not train: {moved.tolist()}"
