"""The typed records an evaluation passes around, and how they are sharded over ranks and gathered.

Each rank turns its share of the validation set into :class:`ExampleRecord` s (the loss pass) and
:class:`DecodeRecord` s (greedy decoding); :func:`gather_records` gives every rank all of them in
example order, and the summaries (``eval.summary``) read only these records. A
:class:`ControlRecord` is a decode judged against its example (exact match, parse, answer).

Shape suffixes: N supervised span positions of the example (y + ``</y>``), K discrete latents,
D Gaussian latent dimensions. Lists rather than tensors: records cross ranks by
``all_gather_object`` (pickled) and are read by numpy.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["ControlRecord", "DecodeRecord", "ExampleRecord", "check_complete", "gather_records", "shard_indices"]


@dataclass
class ExampleRecord:
    """One validation example after the loss pass (padding rows never become records)."""

    index: int
    """Position in the validation set."""
    strategy: Any
    """Gold strategy, or None (unlabelled)."""
    terms: dict[str, float]
    """Every per-example output of ``core.objective.per_example_objective`` (``valid`` included)."""
    cond_nll_N: list[float]
    """-log p(y_t|x,z) per span position: discrete z = the posterior's argmax, Gaussian the branch mean."""
    ref_nll_N: list[float]
    """-log p(y_t|x) of the z-free reference per span position."""
    posterior_K: list[float] | None = None
    """Discrete: q(z|x,y)."""
    prior_K: list[float] | None = None
    """Discrete: p(z|x)."""
    mu_D: list[float] | None = None
    """Gaussian: the posterior mean."""
    logvar_D: list[float] | None = None
    """Gaussian: the posterior log-variance."""

    @property
    def num_tokens(self) -> int:
        """n_i, the supervised length."""
        return len(self.cond_nll_N)

    @property
    def valid(self) -> bool:
        return self.terms.get("valid", 1.0) > 0


@dataclass
class DecodeRecord:
    """One greedy decode of a validation x."""

    index: int
    latent: int | None
    """The forced discrete latent; None for a Gaussian decode (z = the posterior mean)."""
    generated: list[int]
    """Token ids without ``</y>``."""
    closed: bool
    """Whether ``</y>`` ended it within the steps."""


@dataclass
class ControlRecord:
    """A decode judged against its example; None means "not measured" (``eval.metrics`` skips it)."""

    index: int
    latent: int
    """The forced latent (0 for a Gaussian decode)."""
    gold_strategy: Any
    exact_match: bool | None = None
    """Only on the decode under the posterior's argmax latent (every Gaussian decode)."""
    parsed_strategy: Any = None
    parse_ok: bool | None = None
    """This and ``answer_correct``: only with a task parser."""
    answer_correct: bool | None = None


def shard_indices(num_items: int, *, rank: int, world_size: int) -> tuple[list[int], list[bool]]:
    """This rank's items ``rank, rank + W, ...``, padded with item 0 to ``ceil(num_items / W)``.

    Returns ``(indices, keep)``; ``keep`` is False on the padding, whose results must be discarded.
    Every rank gets the same length, so every rank runs the same number of forwards.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
    if num_items < 1:
        raise ValueError(f"num_items must be >= 1, got {num_items}")
    mine = list(range(rank, num_items, world_size))
    per_rank = -(-num_items // world_size)
    pad = per_rank - len(mine)
    return mine + [0] * pad, [True] * len(mine) + [False] * pad


def gather_records(records: list, *, world_size: int, all_gather_object: Callable[[list, Any], None] | None = None) -> list:
    """Every rank's records, on every rank, sorted by ``(index, latent)``.

    ``all_gather_object(output_list, obj)`` defaults to ``torch.distributed.all_gather_object`` (works on
    gloo and nccl); it is not called at world size 1.
    """
    if world_size > 1:
        gather = all_gather_object or torch.distributed.all_gather_object
        parts: list[Any] = [None] * world_size
        gather(parts, records)
        records = [r for part in parts for r in part]
    return sorted(records, key=_order)


def _order(record) -> tuple[int, int]:
    latent = getattr(record, "latent", None)
    return record.index, -1 if latent is None else latent


def check_complete(records: Sequence, num_items: int, what: str) -> None:
    seen = [r.index for r in records]
    if seen != list(range(num_items)):
        # An invariant of the sharding: every index once. A failure means ranks disagree on the data.
        raise RuntimeError(f"evaluation: gathered {what} records cover {len(set(seen))} distinct of "
                           f"{num_items} examples ({len(seen)} records); do all ranks hold the same validation set?")
