"""Resumable checkpoints on the local engine at world 1 with a tiny Llama ZCVAE.

Covers: a bitwise resume (parameters, optimizer, RNG, next step), atomic saves (a crash mid-save leaves a
.tmp directory that ``auto`` skips), keep-last-N, the refusals (aggregation
mode, c_base fingerprint, training set, engine, latent shape) and corrupt/truncated files named in the error.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from zcvae.runs.checkpoint import COMPLETE, CheckpointManager, checkpoint_dirs, load_trainable_state, resolve_checkpoint
from zcvae.engines import EngineConfig, build_engine
from zcvae.model.config import ModelConfig
from zcvae.model.cvae import ZCVAE
from zcvae.data.encoding import EncodedExample, collate

C_BASE = {"value": 0.5, "mode": "mean", "fingerprint": "abc123", "source": "validation"}


@pytest.fixture(scope="module")
def backbone(tiny_backbone) -> Path:
    return tiny_backbone()


def make_batch(model: ZCVAE, seed: int):
    rng = random.Random(seed)
    examples = []
    for i in range(4):
        digits = [str(rng.randrange(10)) for _ in range(rng.randrange(3, 6))]
        y = ["fwd", *digits, "."] if rng.random() < 0.5 else ["rev", *digits[::-1], "=", *digits, "."]
        ids = lambda words: tuple(model.tokenizer(" ".join(words), add_special_tokens=False)["input_ids"])  # noqa: E731
        examples.append(EncodedExample(f"ex{i}", ids(digits), ids(y)))
    return collate(examples, model.tokens)


def make_engine(backbone: Path):
    model = ZCVAE.from_pretrained(str(backbone), ModelConfig(num_latents=2, lora_r=4), seed=0)
    model.calibrate(make_batch(model, 999))
    groups = model.param_groups(lora_lr=1e-2, latent_lr=1e-2, weight_decay=0.0)
    engine = build_engine(EngineConfig(engine="local"), model=model, param_groups=groups, learning_rate=1e-2)
    return model, engine


def train_step(model, engine, step: int) -> None:
    batch = make_batch(model, step)
    out = engine.module(batch, mode="train")
    # uses the RNG, so a resume that forgot the RNG state would diverge
    noise = torch.rand(()) * 1e-3
    loss = ((out.branch_weights[..., None] * out.token_nll * out.mask[:, None]).sum() + out.kl.sum()) / len(batch) * (1 + noise)
    engine.backward(loss, sync=True)
    engine.step(max_grad_norm=1.0)


def config(**overrides) -> dict:
    cfg = {"engine": "local", "reconstruction_loss_token_aggregation_mode": "mean", "num_latents": 2, "lora_r": 4, "seed": 0}
    return {**cfg, **overrides}


@pytest.fixture(scope="module")
def saved(backbone, tmp_path_factory):
    """(engine, checkpoint directory holding step 1): loads that fail or saves elsewhere leave both as they are."""
    model, engine = make_engine(backbone)
    manager = CheckpointManager(tmp_path_factory.mktemp("saved") / "checkpoints", keep=1, is_main=True)
    manager.save(engine, step=1, config=config(), c_base=C_BASE)
    return engine, manager.directory


def trainable(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def test_resume_is_bitwise(backbone, tmp_path):
    model, engine = make_engine(backbone)
    manager = CheckpointManager(tmp_path / "checkpoints", keep=2, is_main=True)
    for step in range(2):
        train_step(model, engine, step)
    path = manager.save(engine, step=2, config=config(), c_base=C_BASE)
    assert path.name == "step_00000002" and (path / COMPLETE).is_file()
    saved = trainable(model)
    rng_at_save = (random.getstate(), np.random.get_state()[1].copy(), torch.get_rng_state())
    train_step(model, engine, 2)
    after_step_3 = trainable(model)

    model2, engine2 = make_engine(backbone)
    torch.manual_seed(12345)  # a different RNG state that the load must replace
    state = manager.load(engine2, "auto", config=config(), c_base=C_BASE)
    assert state["step"] == 2 and Path(state["checkpoint"]) == path
    for name, value in saved.items():
        assert torch.equal(dict(model2.named_parameters())[name], value), name
    # the router's standardisation buffers travel too (the export needs them)
    _, buffers = load_trainable_state(path)
    assert torch.equal(buffers["router.posterior_norm.mean"], model.router.posterior_norm.mean)
    assert random.getstate() == rng_at_save[0]
    assert np.array_equal(np.random.get_state()[1], rng_at_save[1])
    assert torch.equal(torch.get_rng_state(), rng_at_save[2])
    train_step(model2, engine2, 2)
    for name, value in after_step_3.items():
        assert torch.equal(dict(model2.named_parameters())[name], value), f"{name} differs after the resumed step"


def test_auto_skips_crashed_saves_and_keeps_last_n(saved, tmp_path):
    engine, _ = saved
    manager = CheckpointManager(tmp_path / "checkpoints", keep=2, is_main=True)
    for step in (1, 2, 3):
        manager.save(engine, step=step, config=config(), c_base=C_BASE)
    assert [p.name for p in checkpoint_dirs(manager.directory)] == ["step_00000002", "step_00000003"]
    # a save interrupted before the rename, and one whose COMPLETE marker never got written
    (manager.directory / "step_00000004.tmp" / "engine").mkdir(parents=True)
    broken = manager.directory / "step_00000005"
    (broken / "engine").mkdir(parents=True)
    (broken / "meta.json").write_text("{}")
    assert resolve_checkpoint("auto", default_dir=manager.directory).name == "step_00000003"
    assert manager.load(engine, "auto", config=config(), c_base=C_BASE)["step"] == 3
    with pytest.raises(ValueError, match="incomplete.*COMPLETE"):
        manager.load(engine, broken, config=config(), c_base=C_BASE)
    # the run directory resolves to its newest complete checkpoint; an empty one starts fresh
    assert manager.load(engine, tmp_path, config=config(), c_base=C_BASE)["step"] == 3
    assert CheckpointManager(tmp_path / "none", keep=1, is_main=True).load(engine, "auto", config=config(), c_base=C_BASE)["step"] == 0
    # the next save clears the stale .tmp
    manager.save(engine, step=6, config=config(), c_base=C_BASE)
    assert not (manager.directory / "step_00000004.tmp").exists()


class CrashingEngine:
    """The real engine, except that its ``crash_at``-th barrier raises: a rank dying mid-save.

    (The e2e resume test SIGKILLs a real training process in the same place.)"""

    def __init__(self, engine, crash_at: int):
        self._engine, self._left = engine, crash_at

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def barrier(self) -> None:
        self._left -= 1
        if self._left == 0:
            raise RuntimeError("simulated crash")
        self._engine.barrier()


@pytest.mark.parametrize("crash_at", [1, 2])
def test_crash_mid_save_leaves_the_previous_checkpoint(saved, tmp_path, crash_at):
    """Barrier 1 follows the directory creation, barrier 2 the files (before COMPLETE and the rename)."""
    engine, _ = saved
    manager = CheckpointManager(tmp_path / "checkpoints", keep=3, is_main=True)
    manager.save(engine, step=1, config=config(), c_base=C_BASE)
    with pytest.raises(RuntimeError, match="simulated crash"):
        manager.save(CrashingEngine(engine, crash_at), step=2, config=config(), c_base=C_BASE)
    tmp = manager.directory / "step_00000002.tmp"
    assert tmp.is_dir() and not (tmp / COMPLETE).exists()
    if crash_at == 2:
        assert (tmp / "trainable.safetensors").is_file()
    assert not (manager.directory / "step_00000002").exists()
    assert resolve_checkpoint("auto", default_dir=manager.directory).name == "step_00000001"
    assert manager.load(engine, "auto", config=config(), c_base=C_BASE)["step"] == 1


@pytest.mark.parametrize(
    ("changed", "match"),
    [
        (dict(reconstruction_loss_token_aggregation_mode="sum"), r"reconstruction_loss_token_aggregation_mode.*'mean'.*'sum'"),
        (dict(engine="fsdp2"), r"engine 'local'.*engine 'fsdp2'"),
        (dict(num_latents=3), r"num_latents changed.*2.*3"),
        (dict(seed=5), r"seed changed.*0.*5.*--seed 0"),
        # the fixed sum scale C changes the objective while c_base's record (per sequence) stays the same
        (dict(reconstruction_loss_sum_scale=16.0), r"reconstruction_loss_sum_scale changed.*None.*16"),
    ],
)
def test_resume_refuses_a_changed_run(saved, changed, match):
    engine, directory = saved
    manager = CheckpointManager(directory, keep=1, is_main=True)
    with pytest.raises(ValueError, match=match):
        manager.load(engine, "auto", config=config(**changed), c_base=C_BASE)


def test_resume_refuses_another_c_base(saved):
    engine, directory = saved
    manager = CheckpointManager(directory, keep=1, is_main=True)
    with pytest.raises(ValueError, match="c_base changed.*abc123.*zzz"):
        manager.load(engine, "auto", config=config(), c_base={**C_BASE, "fingerprint": "zzz"})
    with pytest.raises(ValueError, match="reconstruction_loss_token_aggregation_mode"):
        manager.load(engine, "auto", config=config(), c_base={**C_BASE, "mode": "sum"})


def _train_data(examples) -> dict:
    from zcvae.data.encoding import encoded_fingerprint

    return encoded_fingerprint(examples)


ROWS = [EncodedExample(id=f"e{i}", x_ids=(5 + i, 6), y_ids=(7, 8 + i), strategy="s") for i in range(4)]


def test_resume_refuses_another_training_set(saved, tmp_path):
    """A checkpoint records its training set; a resume on other examples is refused, naming the setting that moved,
    or saying that the file's contents did; the same set, no record in the checkpoint (an older run) or none given
    by the caller resume as before."""
    engine, _ = saved
    manager = CheckpointManager(tmp_path / "checkpoints", keep=1, is_main=True)
    manager.save(engine, step=1, config=config(num_train_examples=4), c_base=C_BASE, train_data=_train_data(ROWS))
    fewer = _train_data(ROWS[:2])
    with pytest.raises(ValueError, match=r"training data changed.*trained on 4 examples.*this run has 2.*num_train_examples 4 -> 2"):
        manager.load(engine, "auto", config=config(num_train_examples=2), c_base=C_BASE, train_data=fewer)
    reordered = _train_data([ROWS[1], ROWS[0], *ROWS[2:]])
    with pytest.raises(ValueError, match=r"training data changed.*the same settings: the data file's contents changed"):
        manager.load(engine, "auto", config=config(num_train_examples=4), c_base=C_BASE, train_data=reordered)
    assert manager.load(engine, "auto", config=config(num_train_examples=4), c_base=C_BASE, train_data=_train_data(ROWS))["step"] == 1
    assert manager.load(engine, "auto", config=config(num_train_examples=4), c_base=C_BASE)["step"] == 1


def test_a_checkpoint_without_a_training_set_record_still_resumes(saved):
    engine, directory = saved
    manager = CheckpointManager(directory, keep=1, is_main=True)
    assert manager.load(engine, "auto", config=config(), c_base=C_BASE, train_data=_train_data(ROWS))["step"] == 1


def test_the_training_set_fingerprint_reads_ids_tokens_strategies_and_order():
    base = _train_data(ROWS)
    assert base == _train_data(list(ROWS)) and base["num_examples"] == 4
    variants = [
        [EncodedExample(id="other", x_ids=ROWS[0].x_ids, y_ids=ROWS[0].y_ids, strategy="s"), *ROWS[1:]],
        [EncodedExample(id="e0", x_ids=(5, 7), y_ids=ROWS[0].y_ids, strategy="s"), *ROWS[1:]],
        # the same tokens split otherwise between x and y
        [EncodedExample(id="e0", x_ids=(5,), y_ids=(6, 7, 8), strategy="s"), *ROWS[1:]],
        [EncodedExample(id="e0", x_ids=ROWS[0].x_ids, y_ids=ROWS[0].y_ids, strategy="t"), *ROWS[1:]],
        [ROWS[1], ROWS[0], *ROWS[2:]],
        ROWS[:3],
    ]
    assert len({base["fingerprint"], *(_train_data(v)["fingerprint"] for v in variants)}) == len(variants) + 1


@pytest.mark.parametrize("damage", ["truncate", "flip", "delete"])
def test_corrupt_checkpoint_names_the_file(saved, tmp_path, damage):
    engine, directory = saved
    shutil.copytree(directory, tmp_path / "checkpoints")
    manager = CheckpointManager(tmp_path / "checkpoints", keep=1, is_main=True)
    path = manager.latest()
    victim = path / "engine" / "optimizer.pt" if damage != "flip" else path / "trainable.safetensors"
    data = victim.read_bytes()
    if damage == "truncate":
        victim.write_bytes(data[: len(data) // 2])
    elif damage == "flip":
        victim.write_bytes(data[:-1] + bytes([data[-1] ^ 0xFF]))
    else:
        victim.unlink()
    with pytest.raises(ValueError, match=rf"checkpoint file .*{victim.name}.* (is truncated|is corrupt|is missing)"):
        manager.load(engine, "auto", config=config(), c_base=C_BASE)
    (path / COMPLETE).write_text("{not json")
    with pytest.raises(ValueError, match=f"checkpoint file .*{COMPLETE}.* is corrupt"):
        manager.load(engine, path, config=config(), c_base=C_BASE)


def test_meta_records_mode_c_base_and_config(saved):
    engine, directory = saved
    path = directory / "step_00000001"
    meta = json.loads((path / "meta.json").read_text())
    assert meta["step"] == meta["data_position"] == 1
    assert meta["reconstruction_loss_token_aggregation_mode"] == "mean"
    assert meta["c_base"] == C_BASE and meta["config"] == config() and meta["world_size"] == 1
    manifest = json.loads((path / COMPLETE).read_text())["files"]
    assert {"meta.json", "rng_rank0.pt", "trainable.safetensors", "buffers.safetensors"} <= set(manifest)
    assert all(len(entry["sha256"]) == 64 for entry in manifest.values())
    # RNG files load without pickle
    torch.load(path / "rng_rank0.pt", weights_only=True)


def test_save_reports_files_written_then_complete_to_its_callback(saved, tmp_path):
    engine, _ = saved
    events = []

    def on_event(event, step):
        # at "files_written" the checkpoint is not complete yet; at "complete" it is
        events.append((event, step, [p.name for p in checkpoint_dirs(tmp_path / "checkpoints")]))

    CheckpointManager(tmp_path / "checkpoints", keep=1, is_main=True, on_event=on_event).save(
        engine, step=3, config=config(), c_base=C_BASE)
    assert events == [("files_written", 3, []), ("complete", 3, ["step_00000003"])]


def test_fault_injection_reads_only_its_variables_and_names_a_bad_value():
    import pytest

    from zcvae.train.faults import fault_injection_from_env

    assert fault_injection_from_env({}) is None
    assert callable(fault_injection_from_env({"ZCVAE_DEBUG_KILL_AT_STEP": "4"}))
    with pytest.raises(ValueError, match="ZCVAE_DEBUG_KILL_IN_SAVE_AT_STEP='x'"):
        fault_injection_from_env({"ZCVAE_DEBUG_KILL_IN_SAVE_AT_STEP": "x"})
