"""Where a run's examples come from, and which ones each rank sees at each step.

A run reads either a built-in synthetic task (generated deterministically from the seed) or the
user's JSONL files. The sampler is a pure function of (seed, step), so a resumed run sees exactly the
batches an uninterrupted one would, and so that (world 1, accumulation 4) and (world 2, accumulation
2) see the same global batch: the global batch of step s is one slice of a seeded permutation, and
micro-batch m of rank r is its chunk ``m * world_size + r``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from zcvae.data import DEFAULT_TASK, get_task, make_examples, read_jsonl


@dataclass
class Splits:
    train: list
    val: list
    task: object | None  # the TaskFamily (with a parser) for built-in tasks; None for user data
    source: str


def load_splits(cfg) -> Splits:
    """Train and validation examples for a :class:`~zcvae.config.TrainConfig`."""
    if cfg.data.train_data is not None:
        for name in ("train_data", "val_data"):
            path = getattr(cfg.data, name)
            if not os.path.isfile(path):
                what = "is a directory, not a JSONL file" if os.path.isdir(path) else "does not exist"
                raise ValueError(f"{name} {path!r} {what}")
        train, val = read_jsonl(cfg.data.train_data), read_jsonl(cfg.data.val_data)
        if not train:
            raise ValueError(f"train_data {cfg.data.train_data} holds no example")
        if not val:
            raise ValueError(f"val_data {cfg.data.val_data} holds no example")
        return Splits(train, val, None, f"jsonl:{cfg.data.train_data}")
    name = cfg.data.task or DEFAULT_TASK
    task = get_task(name)
    train = make_examples(task, seed=cfg.optimization.seed, split="train", num_examples=cfg.data.num_train_examples)
    val = make_examples(task, seed=cfg.optimization.seed, split="val", num_examples=cfg.data.num_val_examples)
    return Splits(train, val, task, f"task:{name}")


def global_batch_indices(*, num_examples: int, global_batch_size: int, step: int, seed: int) -> list[int]:
    """Example indices of the global batch of ``step``: consecutive slices of per-epoch permutations."""
    if num_examples < 1:
        raise ValueError("the training set is empty")
    out: list[int] = []
    position = step * global_batch_size
    while len(out) < global_batch_size:
        epoch, offset = divmod(position, num_examples)
        generator = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
        perm = torch.randperm(num_examples, generator=generator).tolist()
        take = min(global_batch_size - len(out), num_examples - offset)
        out.extend(perm[offset : offset + take])
        position += take
    return out


def rank_micro_batches(
    indices: list[int], *, micro_batch_size: int, accumulation_steps: int, rank: int, world_size: int
) -> list[list[int]]:
    """This rank's micro-batches (lists of example indices) of one global batch."""
    chunks = [indices[i : i + micro_batch_size] for i in range(0, len(indices), micro_batch_size)]
    return [chunks[m * world_size + rank] for m in range(accumulation_steps)]


def passes_over_data(*, num_examples: int, global_batch_size: int, max_steps: int) -> float:
    return max_steps * global_batch_size / max(1, num_examples)
