"""Exports of 2-rank ZeRO-3 and FSDP2 runs equal the export of a single-process run, tensor by tensor.

The same global batch (8 examples per optimizer step) is trained three times through the real CLI:
world 1 with the local engine and accumulation 2 (the reference), and world 2 under torchrun with
ZeRO-3 and with FSDP2 (accumulation 1). Each run directory is then exported; every tensor of
``adapter_model.safetensors`` and ``latent_heads.safetensors`` must have the reference's name and
shape and equal it within 1e-5. This catches an export that writes only rank 0's shard of a sharded
tensor (a bug reported elsewhere), or misses a trainable tensor on a sharded engine.
"""

from __future__ import annotations

from pathlib import Path

import launcher as C
import pytest
import torch
from safetensors.torch import load_file

from zcvae.export.export import export_run


TIMEOUT_S = 600  # a hang fails the test instead of stalling CI (the first DeepSpeed run compiles ~25 s)
ATOL = 1e-5
TRAIN = ["--task", "copy", "--max-steps", "3", "--micro-batch-size", "4", "--num-train-examples", "48",
         "--num-val-examples", "8", "--num-eval-decode-examples", "2", "--log-every", "1", "--warmup-steps", "1",
         "--no-progress-bar", "--reference-policy", "online",
         # router support is a term of each global micro-batch's mean q (docs/objective.md, "Auxiliaries"), and the
         # runs compared here group the same examples into different micro-batches: off, the rest of the default on
         "--router-support-weight", "0",
         # small rates, as in test_fresh_markers_engines: Adam turns the float noise of a different reduction order
         # on near-zero gradients (the default's raw x n_bar and mean pooling have more of them) into differences of order lr
         "--lora-learning-rate", "1e-4", "--latent-learning-rate", "1e-3"]
SCENARIOS = {
    "zero3": ["--engine", "deepspeed", "--deepspeed-config", "zero3"],
    "fsdp2": ["--engine", "fsdp2"],
}


def _run(name: str, cmd: list[str], tmp: Path) -> None:
    launch = C.run_launch(name, cmd, log_dir=tmp, env=C.cpu_env(tmp / ".cache"), timeout_s=TIMEOUT_S)
    if not launch.ok:
        pytest.fail(launch.failure())


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("export_dist")


@pytest.fixture(scope="module")
def backbone(tiny_backbone) -> Path:
    return tiny_backbone()


@pytest.fixture(scope="module")
def reference_export(workdir, backbone) -> Path:
    run_dir = workdir / "single"
    _run("single", C.zcvae_cmd("train", "--backbone", backbone, "--output-dir", run_dir, *TRAIN,
                               "--gradient-accumulation-steps", "2"), workdir)
    return export_run(run_dir, out=workdir / "export-single")


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_two_rank_export_equals_single_process_export(workdir, backbone, reference_export, scenario):
    run_dir = workdir / f"run-{scenario}"  # not ./zero3: a path named like a built-in DeepSpeed config wins over it
    _run(scenario, C.torchrun_cmd("train", "--backbone", backbone, "--output-dir", run_dir, *TRAIN, *SCENARIOS[scenario]), workdir)
    exported = export_run(run_dir, out=workdir / f"export-{scenario}")
    for name in ("adapter_model.safetensors", "latent_heads.safetensors"):
        got, want = load_file(str(exported / name)), load_file(str(reference_export / name))
        assert got.keys() == want.keys(), f"{name}: {sorted(got.keys() ^ want.keys())}"
        for key, value in want.items():
            assert got[key].shape == value.shape, f"{name}:{key} has shape {tuple(got[key].shape)}, single-process {tuple(value.shape)}"
            torch.testing.assert_close(got[key], value, rtol=0, atol=ATOL, msg=lambda m, k=key: f"{name}:{k}: {m}")
    # the run trained: the adapter moved away from LoRA's zero B
    adapter = load_file(str(exported / "adapter_model.safetensors"))
    assert any("lora_B" in k and bool(v.abs().max() > 0) for k, v in adapter.items())
