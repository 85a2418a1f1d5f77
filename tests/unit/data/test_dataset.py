"""The sampler (zcvae.data.dataset): which examples each rank sees at each step, and where they come from.

The contracts: the global batch of a step is a pure function of (seed, step), so a resumed run sees
the batches an uninterrupted one would; every epoch visits each example exactly once; and any
(world size, accumulation) with the same global batch processes the same examples in one step.
"""

from __future__ import annotations

import json

import pytest

from zcvae.config import TrainConfig
from zcvae.data import make_examples
from zcvae.data.dataset import global_batch_indices, load_splits, passes_over_data, rank_micro_batches


def indices_of_steps(num_steps: int, **kw) -> list[int]:
    return [i for step in range(num_steps) for i in global_batch_indices(step=step, **kw)]


@pytest.mark.parametrize("num_examples, global_batch_size", [(10, 4), (7, 3), (5, 5), (3, 8)])
def test_every_epoch_visits_each_example_once(num_examples, global_batch_size):
    # enough steps for 4 whole epochs, including batches that straddle an epoch boundary (10 % 4 != 0)
    # and a global batch larger than the data (3 examples, batch 8: one batch spans three epochs)
    num_steps = 4 * num_examples  # 4 * num_examples * global_batch_size indices = 4 * global_batch_size epochs
    flat = indices_of_steps(num_steps, num_examples=num_examples, global_batch_size=global_batch_size, seed=5)
    assert len(flat) == num_steps * global_batch_size
    epochs = [flat[e : e + num_examples] for e in range(0, len(flat), num_examples)]
    for e, epoch in enumerate(epochs):
        assert sorted(epoch) == list(range(num_examples)), f"epoch {e}: {epoch}"
    if num_examples > 3:  # the order is reshuffled each epoch, not one permutation repeated
        assert len({tuple(epoch) for epoch in epochs}) > 1


def test_a_step_is_a_pure_function_of_seed_and_step():
    kw = dict(num_examples=13, global_batch_size=4)
    history = indices_of_steps(9, seed=7, **kw)
    # a resumed run asks for step 6 directly, without replaying steps 0..5
    assert global_batch_indices(step=6, seed=7, **kw) == history[24:28]
    assert global_batch_indices(step=6, seed=7, **kw) == global_batch_indices(step=6, seed=7, **kw)
    assert indices_of_steps(9, seed=8, **kw) != history


def test_empty_training_set_is_refused():
    with pytest.raises(ValueError, match="empty"):
        global_batch_indices(num_examples=0, global_batch_size=4, step=0, seed=0)


@pytest.mark.parametrize("world_size, accumulation", [(1, 4), (2, 2), (4, 1)])
def test_ranks_and_micro_batches_partition_the_global_batch(world_size, accumulation):
    micro_batch_size = 3
    indices = global_batch_indices(num_examples=50, global_batch_size=12, step=3, seed=1)
    per_rank = [
        rank_micro_batches(indices, micro_batch_size=micro_batch_size, accumulation_steps=accumulation, rank=r, world_size=world_size)
        for r in range(world_size)
    ]
    assert all(len(micro) == accumulation and all(len(mb) == micro_batch_size for mb in micro) for micro in per_rank)
    # micro-batch m of rank r is chunk m * world_size + r of the global batch: in that order they rebuild it
    rebuilt = [i for m in range(accumulation) for r in range(world_size) for i in per_rank[r][m]]
    assert rebuilt == indices


def test_world_layouts_with_the_same_global_batch_see_the_same_examples():
    indices = global_batch_indices(num_examples=40, global_batch_size=8, step=11, seed=2)
    seen = {}
    for world_size, accumulation in [(1, 4), (2, 2), (4, 1)]:
        seen[world_size] = sorted(
            i
            for r in range(world_size)
            for mb in rank_micro_batches(indices, micro_batch_size=2, accumulation_steps=accumulation, rank=r, world_size=world_size)
            for i in mb
        )
    assert seen[1] == seen[2] == seen[4] == sorted(indices)


def test_passes_over_data():
    assert passes_over_data(num_examples=12, global_batch_size=8, max_steps=3) == 2.0
    assert passes_over_data(num_examples=0, global_batch_size=8, max_steps=3) == 24.0  # no division by zero


def test_load_splits_builtin_task_is_seeded():
    cfg = TrainConfig.from_flat(task="copy", seed=3, num_train_examples=6, num_val_examples=4)
    splits = load_splits(cfg)
    assert splits.source == "task:copy" and splits.task is not None
    assert splits.train == make_examples("copy", seed=3, split="train", num_examples=6)
    assert splits.val == make_examples("copy", seed=3, split="val", num_examples=4)
    other = load_splits(TrainConfig.from_flat(task="copy", seed=4, num_train_examples=6, num_val_examples=4))
    assert [e.x for e in other.train] != [e.x for e in splits.train]


def test_load_splits_jsonl(tmp_path):
    train, val, empty = tmp_path / "train.jsonl", tmp_path / "val.jsonl", tmp_path / "empty.jsonl"
    train.write_text("".join(json.dumps({"id": f"t{i}", "x": "1 2", "y": "fwd 1 2 ."}) + "\n" for i in range(3)))
    val.write_text(json.dumps({"id": "v0", "x": "3", "y": "fwd 3 ."}) + "\n")
    empty.write_text("\n")
    splits = load_splits(TrainConfig.from_flat(train_data=str(train), val_data=str(val)))
    assert [e.id for e in splits.train] == ["t0", "t1", "t2"] and [e.id for e in splits.val] == ["v0"]
    assert splits.task is None and splits.source == f"jsonl:{train}"
    with pytest.raises(ValueError, match="train_data .*empty.jsonl"):
        load_splits(TrainConfig.from_flat(train_data=str(empty), val_data=str(val)))
    with pytest.raises(ValueError, match="val_data .*empty.jsonl"):
        load_splits(TrainConfig.from_flat(train_data=str(train), val_data=str(empty)))
