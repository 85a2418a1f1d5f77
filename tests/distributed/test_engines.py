"""Every engine, two real processes on gloo, against one single-process run of the same global batch.

One torchrun launch runs all scenarios (engine_worker.py); the world-1 baseline (local engine,
accumulation 4) runs in this process. Each scenario trains the tiny peft Llama of engine_harness.py
for NUM_STEPS optimizer steps at (world 2, accumulation 2), ragged lengths, clipping active, two
param groups with their own learning-rate schedule, a no-grad adapters-off reference forward before
every training forward, and in step EMPTY_STEP a micro-batch whose examples are all invalid on rank 1.

What must hold (fp32): per-step global loss, reference loss and pre-clip grad norm, and every
trainable tensor after the last step, equal the baseline within 1e-5. AdamW is nearly blind to a
global gradient scale, so the grad norm is what catches an engine that still averages over ranks or
accumulation steps (a factor of 2 here); the parameters catch wrong relative weights between ranks
and micro-batches (ragged counts, the empty micro-batch). Learning rates are kept small because Adam
amplifies float noise on near-zero gradient entries into parameter differences of order lr * 1e-3.
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import engine_harness as H
import launcher as C
from zcvae.engines import EngineConfig, build_engine


HERE = os.path.dirname(os.path.abspath(__file__))
LAUNCH_TIMEOUT_S = 420  # a hang fails the test instead of stalling CI (first DeepSpeed run compiles ~25 s)
ATOL = 1e-5

ENGINES = ["ddp", "zero2", "zero3", "fsdp2"]
WORLD1_SCENARIOS = ["zero3-mean", "fsdp2-mean"]
MODES = ["mean", "sum", "token"]


def _baseline_run(mode: str, *, checkpoint_dir: str | None = None) -> tuple[dict, dict]:
    model = H.make_model()
    engine = build_engine(EngineConfig(), model=model, param_groups=H.param_groups(model), learning_rate=1.0)
    assert engine.world_size == 1
    on_step = None
    if checkpoint_dir is not None:

        def on_step(step: int) -> None:
            if step == H.CKPT_AFTER - 1:
                engine.save_checkpoint(checkpoint_dir, client_state={"step": H.CKPT_AFTER})

    record = H.run_steps(engine, mode=mode, steps=range(H.NUM_STEPS), accumulation=4, on_step=on_step)
    return record, engine.trainable_state_dict()


@pytest.fixture(scope="module")
def baseline(tmp_path_factory) -> dict[str, tuple[dict, dict]]:
    """World 1, accumulation 4, local engine: the ground truth for every scenario. The mean run also
    saves a checkpoint after CKPT_AFTER steps (key "checkpoint") for the world-1 resume test."""
    ckpt = str(tmp_path_factory.mktemp("local_world1") / "ckpt")
    runs = {mode: _baseline_run(mode, checkpoint_dir=ckpt if mode == "mean" else None) for mode in MODES}
    runs["checkpoint"] = ckpt
    return runs


@pytest.fixture(scope="module")
def launches(tmp_path_factory) -> dict[int, str]:
    """Output directories by world size: the two-rank torchrun launch with every scenario, and, at the
    same time, one plain process (no launcher, no group yet) running ZeRO-3 and FSDP2 at world 1.
    Their output: ``world2.0.log`` and ``world1.0.log``, each in its directory."""
    outs = {2: str(tmp_path_factory.mktemp("engines_world2")), 1: str(tmp_path_factory.mktemp("engines_world1"))}
    worker = os.path.join(HERE, "engine_worker.py")
    cmds = {2: C.worker_cmd(worker, "--out", outs[2]), 1: [sys.executable, worker, "--out", outs[1], "--only", *WORLD1_SCENARIOS]}
    pool = C.LaunchPool(max_workers=3)  # independent: a failure of one does not end the other
    for world, cmd in cmds.items():
        pool.submit(C.Launch(name=f"world{world}", cmds=[cmd], num_workers=world, log_dir=Path(outs[world]),
                             env=C.cpu_env(), timeout_s=LAUNCH_TIMEOUT_S))
    pool.start()
    hung = [launch.failure() for launch in (pool.wait(f"world{world}") for world in cmds) if launch.timed_out]
    if hung:
        pytest.fail("engine worker hung\n" + "\n".join(hung))
    return outs


@pytest.fixture(scope="module")
def results(launches) -> str:
    return launches[2]


def _load(results: str, name: str) -> tuple[dict, dict]:
    errors = sorted(f for f in os.listdir(results) if f.startswith(f"{name}.rank") and f.endswith(".error"))
    if errors:
        with open(os.path.join(results, errors[0])) as f:
            pytest.fail(f"{name} failed in the worker:\n{f.read()}")
    path = os.path.join(results, f"{name}.json")
    if not os.path.exists(path):
        with open(os.path.join(results, "world2.0.log")) as f:
            pytest.fail(f"{name}: no result; worker log tail:\n{f.read()[-6000:]}")
    with open(path) as f:
        record = json.load(f)
    return record, load_file(os.path.join(results, f"{name}.safetensors"))


def _assert_same_run(got: tuple[dict, dict], want: tuple[dict, dict], *, atol: float, steps: slice = slice(None)) -> None:
    (rec, state), (want_rec, want_state) = got, want
    for key in ("loss", "ref", "grad_norm"):
        g, w = rec[key], want_rec[key][steps]
        assert len(g) == len(w), key
        for i, (a, b) in enumerate(zip(g, w)):
            assert math.isfinite(a) and abs(a - b) <= atol * max(1.0, abs(b)), f"{key}[{i}]: {a} vs {b}"
    assert set(state) == set(want_state)
    for name, tensor in want_state.items():
        assert state[name].shape == tensor.shape, name
        torch.testing.assert_close(state[name], tensor, atol=atol, rtol=0, msg=lambda m: f"{name}: {m}")


def test_reduce_metrics_is_exact_over_ranks(results):
    """(sum, count) pairs reduce to the global mean (not the mean of rank means, 0.5 * (1/1 + 3/4)),
    identical on both ranks; min/max over ranks; an all-empty metric is nan."""
    for rank in (0, 1):
        with open(os.path.join(results, f"metrics.rank{rank}.json")) as f:
            got = json.load(f)
        assert got["nll"] == pytest.approx(4.0 / 5.0, abs=1e-12) and got["nll/count"] == 5.0
        assert math.isnan(got["empty"])
        assert (got["has_data"], got["lo"], got["hi"]) == (0.0, 0.5, 10.0)


def test_harness_has_an_empty_rank_micro_batch_and_reaches_trained_rows():
    """The data must really exercise what the other tests claim: an all-invalid micro-batch on rank 1
    mid-accumulation, ragged lengths across ranks, and the trainable embedding rows in the inputs."""
    rank1 = H.micro_batches(H.EMPTY_STEP, rank=1, world=2, accumulation=2)
    assert H.num_valid(rank1[0]) == 0 and H.num_valid(rank1[1]) > 0
    lengths = {b["input_ids"].shape[1] for r in (0, 1) for b in H.micro_batches(0, rank=r, world=2, accumulation=2)}
    assert len(lengths) > 1
    ids = torch.cat([b["input_ids"].flatten() for b in H.micro_batches(0, rank=0, world=1, accumulation=4)])
    assert all((ids == row).any() for row in H.TRAINABLE_ROWS)


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("mode", MODES)
def test_two_ranks_equal_single_process(results, baseline, engine, mode):
    """(world 2, accumulation 2) == (world 1, accumulation 4): each engine undoes its own averaging
    over ranks / accumulation steps, and an all-invalid micro-batch neither hangs nor biases."""
    _assert_same_run(_load(results, f"{engine}-{mode}"), baseline[mode], atol=ATOL)


@pytest.mark.parametrize("engine", ["zero0", "zero1", "zero3offload", "fsdp2offload"])
def test_other_configurations_equal_single_process(results, baseline, engine):
    # ZeRO-0 in fp32 has no DeepSpeed optimizer wrapper: the engine clips p.grad itself. The offload
    # variants (cpu_offload=True: ZeRO-3 optimizer + parameter offload, FSDP2 CPUOffloadPolicy) are
    # only smoke-tested for exactness here: on a CPU-only machine nothing actually moves.
    _assert_same_run(_load(results, f"{engine}-mean"), baseline["mean"], atol=ATOL)


@pytest.mark.parametrize("engine", ["zero3gc", "fsdp2gc", "ddpgc"])
def test_gradient_checkpointing_with_reference_pass(results, baseline, engine):
    """ZeRO-3 / FSDP2 / DDP with non-reentrant checkpointing and the reference forward before every training
    forward, for NUM_STEPS steps: runs, finite, and still equal to the single-process run."""
    _assert_same_run(_load(results, f"{engine}-mean"), baseline["mean"], atol=ATOL)


@pytest.mark.parametrize("engine", ENGINES)
def test_reference_pass_is_the_base_model(results, engine):
    """Adapters disabled on engine.model while forwarding through the wrapped engine.module gives the
    base model's NLL at every step, i.e. the reference really is adapter-free under every wrapper."""
    record, _ = _load(results, f"{engine}-mean")
    base = H.make_base_model()
    for step, got in enumerate(record["ref"]):
        batches = H.micro_batches(step, rank=0, world=1, accumulation=1)
        count = sum(H.num_valid(b) for b in batches)
        with torch.no_grad():
            want = sum(
                float(H.per_example_nll(base(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits, b, "mean").sum())
                for b in batches
            ) / count
        assert abs(got - want) <= ATOL, (step, got, want)


@pytest.mark.parametrize("engine", ["zero3", "fsdp2"])
def test_trainable_state_dict_is_full_and_holds_no_embedding_matrix(results, baseline, engine):
    """Sharded exports are gathered (every tensor full-shaped and equal to the single-process one, not
    rank 0's shard) and contain only the trainable-token delta, never the (V, H) embedding matrix."""
    _, state = _load(results, f"{engine}-mean")
    _, want = baseline["mean"]
    assert set(state) == set(want)
    for name, tensor in want.items():
        assert state[name].shape == tensor.shape, (name, state[name].shape, tensor.shape)
        torch.testing.assert_close(state[name], tensor, atol=ATOL, rtol=0)
    deltas = [n for n in state if "trainable_tokens_delta" in n]
    assert len(deltas) == 1 and state[deltas[0]].shape == (len(H.TRAINABLE_ROWS), H.HIDDEN)
    assert not any(t.shape[0] == H.VOCAB for t in state.values())


@pytest.mark.parametrize("engine", ENGINES)
def test_checkpoint_round_trip(results, engine):
    """Save after CKPT_AFTER steps, build a fresh engine, load, finish: equal to the uninterrupted run."""
    uninterrupted = _load(results, f"{engine}-mean")
    resumed = _load(results, f"{engine}-mean-resumed")
    _assert_same_run(resumed, uninterrupted, atol=1e-6, steps=slice(H.CKPT_AFTER, None))


@pytest.mark.parametrize("scenario", WORLD1_SCENARIOS)
def test_sharded_engines_run_alone_without_a_launcher(launches, baseline, scenario):
    """A single process without torchrun: the engine creates its one-rank group itself (DeepSpeed also
    needs LOCAL_RANK), equals the local engine, and resumes from its own checkpoint."""
    run = _load(launches[1], scenario)
    _assert_same_run(run, baseline["mean"], atol=ATOL)
    _assert_same_run(_load(launches[1], f"{scenario}-resumed"), run, atol=1e-6, steps=slice(H.CKPT_AFTER, None))


def test_local_world1_checkpoint_round_trip_and_frozen_rows(baseline):
    """World 1: the checkpoint files are safetensors + weights_only pickles, resume equals the
    uninterrupted run, and every frozen embedding row is bitwise unchanged by training."""
    ckpt = baseline["checkpoint"]
    record, state = baseline["mean"]
    assert sorted(os.listdir(ckpt)) == ["client_state.pt", "optimizer.pt", "trainable.safetensors"]
    for name in ("client_state.pt", "optimizer.pt"):
        torch.load(os.path.join(ckpt, name), weights_only=True)

    model = H.make_model()
    before = model.get_input_embeddings().token_adapter.base_layer.weight.detach().clone()
    engine = build_engine(EngineConfig(), model=model, param_groups=H.param_groups(model), learning_rate=1.0)
    assert engine.load_checkpoint(ckpt) == {"step": H.CKPT_AFTER}
    resumed = H.run_steps(engine, mode="mean", steps=range(H.CKPT_AFTER, H.NUM_STEPS), accumulation=4)
    _assert_same_run((resumed, engine.trainable_state_dict()), (record, state), atol=1e-6, steps=slice(H.CKPT_AFTER, None))
    after = model.get_input_embeddings().token_adapter.base_layer.weight
    assert torch.equal(before, after)
