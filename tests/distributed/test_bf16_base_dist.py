"""A bfloat16 frozen base at world 2 on gloo (CPU), under ZeRO-3 and FSDP2, trains as at world 1.

gloo in torch 2.13 runs bfloat16 all-gather, reduce-scatter, broadcast and all-reduce, so the frozen
base's collectives need no float32 copy. Each run is the real CLI, 3 steps of one global batch (world 1 x
accumulation 4, world 2 x accumulation 2), all with --base-dtype bfloat16. Tolerance 1e-3 relative: the
ranks sum the same bfloat16 products in another order (measured: FSDP2 equal to 1e-7, ZeRO-3 to 1.1e-4)."""

from __future__ import annotations

import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:  # launcher sits next to this file (tests/distributed has no __init__.py)
    sys.path.insert(0, HERE)

import launcher as C  # noqa: E402

TOL = 1e-3
COMMON = ["--task", "copy", "--num-train-examples", "48", "--num-val-examples", "6", "--num-eval-decode-examples", "0",
          "--micro-batch-size", "3", "--num-latents", "2", "--log-every", "1", "--no-progress-bar", "--warmup-steps", "1",
          "--max-steps", "3", "--reference-policy", "online", "--router-support-weight", "0", "--base-dtype", "bfloat16",
          "--lora-learning-rate", "1e-4", "--latent-learning-rate", "1e-3"]
RUNS = {"w1": (1, ["--engine", "local"]), "zero3": (2, ["--engine", "deepspeed", "--deepspeed-config", "zero3"]),
        "fsdp2": (2, ["--engine", "fsdp2"])}


@pytest.fixture(scope="module")
def runs(tiny_backbone, tmp_path_factory):
    root = tmp_path_factory.mktemp("bf16_base")
    env = C.cpu_env(root / "zcvae-cache")
    backbone = tiny_backbone()
    # run-<name>: the launches run in root, where a directory named zero3 would shadow the built-in config
    pool = C.cli_runs(root, RUNS, lambda name, world, engine: [
        "train", "--backbone", backbone, "--output-dir", root / f"run-{name}", *COMMON, *engine,
        "--gradient-accumulation-steps", str(4 // world)], env=env, timeout_s=420)
    yield pool, root
    pool.cancel_all()


@pytest.mark.parametrize("name", ["zero3", "fsdp2"])
def test_a_bfloat16_base_at_world_2_on_gloo_trains_as_at_world_1(runs, name):
    pool, root = runs
    got, want = C.finished_run(pool, root, name), C.finished_run(pool, root, "w1")
    config = C.read_run_config(got)
    assert config["world_size"] == 2
    got_train, want_train = C.read_metrics(got)[0], C.read_metrics(want)[0]
    assert len(want_train) == 3
    errors = C.compare_records(got_train, want_train, ["loss", "reconstruction_loss", "grad_norm"], tol=TOL, what="train")
    assert not errors, "\n".join(errors)
