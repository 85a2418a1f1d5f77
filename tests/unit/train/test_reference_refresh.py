"""--reference-refresh-every N through ``zcvae.train.trainer.train`` on the tiny backbone: the reference
follows the trained adapter from the N-th step on, nothing changes before it, the copy is kept in the
checkpoint so a resume between two refreshes continues bit for bit; and the refused combinations."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from zcvae.config import TrainConfig, train_run_name
from zcvae.runs.checkpoint import OBJECTIVE_TENSORS, TRAINABLE


def test_config_refuses_a_store_and_the_sharded_engines_in_one_line():
    with pytest.raises(ValueError, match="reference_refresh_every 3 needs reference_policy online or auto") as err:
        TrainConfig.from_flat(task="copy", reference_refresh_every=3, reference_policy="precomputed")
    assert "\n" not in str(err.value) and "stale" in str(err.value)
    for engine in ("deepspeed", "fsdp2"):
        with pytest.raises(ValueError, match=f"reference_refresh_every needs engine local .*got engine '{engine}'"):
            TrainConfig.from_flat(task="copy", reference_refresh_every=3, engine=engine)
    with pytest.raises(ValueError, match="reference_refresh_every must be >= 0"):
        TrainConfig.from_flat(task="copy", reference_refresh_every=-1)
    # it changes what is trained: it names the run
    on, off = TrainConfig.from_flat(task="copy", reference_refresh_every=3), TrainConfig.from_flat(task="copy")
    assert "refresh-3" in train_run_name(on.to_dict()) and "refresh" not in train_run_name(off.to_dict())


def _records(run_dir, split="train"):
    return [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if r.get("split") == split]


def _train(backbone, run_dir, **kw):
    from zcvae.console import capture_lines
    from zcvae.train.trainer import train

    cfg = TrainConfig.from_flat(task="copy", backbone=str(backbone), output_dir=str(run_dir), num_train_examples=8, num_val_examples=5,
                                max_steps=4, micro_batch_size=4, num_eval_decode_examples=2, max_new_tokens=4, progress_bar=False,
                                log_every=1, save_every=1, keep_last_checkpoints=10, **kw)
    with capture_lines() as lines:
        train(cfg)
    return lines


def test_the_reference_follows_from_the_first_refresh_and_resumes_exactly(tiny_backbone, tmp_path):
    backbone = tiny_backbone()
    _train(backbone, tmp_path / "frozen", reference_policy="online")
    # two passes over the data: auto would store b, but only online can follow the model
    lines = _train(backbone, tmp_path / "follows", reference_refresh_every=2)
    assert any("[reference] policy online" in line and "follows the trained adapter every 2 steps" in line for line in lines)
    frozen, follows = _records(tmp_path / "frozen"), _records(tmp_path / "follows")
    assert [r["step"] for r in follows] == [1, 2, 3, 4]
    # steps 1-2 read the copy made at step 0 (the untrained adapter): the frozen reference, bit for bit; c_base too
    for step in (0, 1):
        assert follows[step]["loss"] == frozen[step]["loss"] and follows[step]["c_base"] == frozen[step]["c_base"]
    # from step 3 on, b is the trained model's own z-free NLL after step 2: the token weights move
    assert follows[2]["token_weighted_base_loss"] != frozen[2]["token_weighted_base_loss"]

    # the copy in checkpoint 3 is the trained adapter of step 2 (the last refresh), not that of step 3
    checkpoints = tmp_path / "follows" / "checkpoints"
    copy = load_file(str(checkpoints / "step_00000003" / OBJECTIVE_TENSORS))
    trained = {name: load_file(str(checkpoints / f"step_0000000{s}" / TRAINABLE)) for s, name in ((2, "two"), (3, "three"))}

    def trained_name(key: str) -> str:  # the copy's key without the adapter -> the trained parameter's name
        for attr in ("lora_A", "lora_B", "trainable_tokens_delta"):
            if f".{attr}" in key:
                head, _, tail = key.partition(f".{attr}")
                return f"peft_model.{head}.{attr}.default{tail}"
        raise AssertionError(key)

    assert copy and all(torch.equal(t, trained["two"][trained_name(k)]) for k, t in copy.items())
    assert not all(torch.equal(t, trained["three"][trained_name(k)]) for k, t in copy.items())
    assert not (tmp_path / "frozen" / "checkpoints" / "step_00000003" / OBJECTIVE_TENSORS).exists()  # off: no new file

    # resumed from step 3 (between two refreshes), step 4 is the uninterrupted run's, bit for bit
    resumed = tmp_path / "resumed"
    shutil.copytree(tmp_path / "follows", resumed)
    shutil.rmtree(resumed / "checkpoints" / "step_00000004")
    _train(backbone, resumed, reference_refresh_every=2, resume=str(resumed / "checkpoints" / "step_00000003"))
    untimed = lambda r: {k: v for k, v in r.items() if k != "tokens_per_second"}  # noqa: E731
    assert untimed(_records(resumed)[-1]) == untimed(follows[-1])
    assert _records(resumed, "eval") == _records(tmp_path / "follows", "eval")
