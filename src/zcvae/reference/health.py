"""Is the backbone fit to be the frozen reference? The start-up check of ``zcvae train``.

The reference that gives b_t is the z-free backbone itself (a frozen reference
initialized from the entangled checkpoint; docs/guide/backbones.md, "The reference health check"), so it must already know the template and the data:

* **Markers.** A backbone whose tokenizer lacks a template marker (``<x> </x> <z> </z> <y> </y>``) or
  ``<znull>`` gets it as a new token with a mean row (``model.build.init_new_rows``): the reference cannot
  score the template, and a frozen ``</y>`` row leaves the decoder unable to close y (a raw
  SmolLM2 wrote the right digits, then repeated them, on all 16 decodes). :func:`check_markers` stops
  the run with the ``zcvae pretrain --backbone`` command that builds the entangled checkpoint (the CLI
  maps the ValueError to exit 2), unless ``allow_fresh_markers`` is set; then those rows train as
  trainable tokens. The K latent tokens ``<z_k>`` are always new and are not checked.
* **c_base.** A reference that has not learned the data spreads b over tokens whose format it lacks,
  so the surprisal-weighted and distribution-normalized terms stop pointing at the strategy decision.
  :meth:`ReferenceHealth.check_c_base` only warns (user data has no known floor, and tests use
  deliberately undertrained backbones). Thresholds, per example and then aggregated like c_base
  (``A_mode``: divided by n_i under ``mean``, as is under ``sum``):

  - a built-in task: the floor H(y|x) (``TaskFamily.y_entropy``, the best z-free y NLL, as
    ``zcvae pretrain`` reports it) plus :data:`FLOOR_MARGIN_PER_SEQUENCE` nats, the margin within
    which the real-backbone check counts an entangled checkpoint as fit;
  - user data: :data:`HIGH_C_BASE_PER_TOKEN` nats per supervised token. A reference that knows the
    format predicts its deterministic tokens (``</y>``, the format words) almost exactly; the raw
    SmolLM2 gave 3.41 nats/token on ``copy``, the entangled tiny backbone 0.066 (floor ~0.06).

* **Degenerate weights.** An example whose b is 0 on every supervised token (or below
  ``core.aggregation.NEARLY_DEGENERATE_MAX_SURPRISAL`` on all of them) gives the reference-weighted terms
  nothing to tell its tokens apart by. :class:`DegenerateWeights` collects such examples from the b the
  setup passes computed, and :meth:`ReferenceHealth.check_weights` warns once. Which examples that is
  depends on the policy: ``precomputed`` has the b of every training and validation example in its
  store; ``online`` has only the validation b of the c_base pass, because it computes a training
  example's b in the step that trains on it (a setup pass over the training set would cost exactly the
  store that ``online`` was chosen to avoid; the ``degenerate`` metric counts them step by step). An
  ``online`` run whose c_base does not come from that pass (``zfree_reference_scale``, or the c_base of
  the checkpoint it resumes) has no b at setup and is not checked; the record says so.

Everything is recorded under ``reference_health`` in ``run_config.json`` (:meth:`ReferenceHealth.to_dict`).
At the end of a run, :func:`closure_warning` says so when the decoder rarely closed y
(``closure_rate`` below :data:`MIN_CLOSURE_RATE`).
"""

from __future__ import annotations

import logging
import shlex
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from zcvae.core.aggregation import NEARLY_DEGENERATE_MAX_SURPRISAL, reference_degeneracy
from zcvae.data.encoding import missing_markers

logger = logging.getLogger(__name__)

__all__ = [
    "DEGENERATE_IDS_SHOWN",
    "DegenerateWeights",
    "FLOOR_MARGIN_PER_SEQUENCE",
    "HIGH_C_BASE_PER_TOKEN",
    "MIN_CLOSURE_RATE",
    "ReferenceHealth",
    "check_markers",
    "closure_warning",
    "entangled_command",
]

FLOOR_MARGIN_PER_SEQUENCE = 0.1
"""Nats per sequence above the family's floor H(y|x) that c_base may reach before the warning."""
HIGH_C_BASE_PER_TOKEN = 1.0
"""Nats per supervised token above which c_base warns when the data has no known floor (user JSONL)."""
MIN_CLOSURE_RATE = 0.5
"""A final evaluation whose decodes emit ``</y>`` less often than this says that the decoder cannot stop."""
DEGENERATE_IDS_SHOWN = 3
"""Example ids the degenerate-weights line names (all of them are in ``reference_health``, up to ``_IDS_RECORDED``)."""
_IDS_RECORDED = 100  # run_config.json stays readable on a data set where every example is degenerate


def entangled_command(cfg) -> tuple[str, str]:
    """(the ``zcvae pretrain`` command that builds the entangled checkpoint of ``cfg``'s backbone and
    data, that checkpoint's directory)."""
    source = cfg.model.backbone
    # a GGUF file's name without ".gguf"; a directory's whole name (it may hold dots, as GGUF conversions do)
    name = (Path(source).stem if Path(source).suffix.lower() == ".gguf" else Path(source).name) if source else (cfg.data.task or "default")
    out = str(Path(cfg.run.output_dir).parent / f"entangled-{name}")
    parts = ["zcvae", "pretrain"]
    if source:
        parts += ["--backbone", source]
    if cfg.data.train_data is not None:
        parts += ["--train-data", cfg.data.train_data, "--val-data", cfg.data.val_data]
    else:
        from zcvae.data import DEFAULT_TASK

        parts += ["--task", cfg.data.task or DEFAULT_TASK]
    parts += ["--output-dir", out]
    return " ".join(shlex.quote(str(p)) for p in parts), out


@dataclass
class DegenerateWeights:
    """The examples whose reference b leaves their token weights uniform or nearly so, among those whose b
    a setup pass computed (``splits``). Fill with :meth:`add` per batch; ``merge`` the ranks' parts."""

    splits: str
    """Which examples' b was seen, e.g. ``"train and validation"``."""
    num_examples: int = 0
    """Examples with a supervised token among them."""
    degenerate: list[str] = field(default_factory=list)
    """Ids whose b is 0 on every supervised token (pi uniform)."""
    nearly_degenerate: list[str] = field(default_factory=list)
    """Ids whose b is below ``NEARLY_DEGENERATE_MAX_SURPRISAL`` on every supervised token (and not all 0)."""

    def add(self, ref_nll_BN: torch.Tensor, mask_BN: torch.Tensor, ids: Sequence[str]) -> None:
        """One batch: ``ref_nll_BN``/``mask_BN`` [B, N] left-aligned, ``ids`` the B example ids."""
        degenerate_B, nearly_B = reference_degeneracy(ref_nll_BN, mask_BN)
        self.num_examples += int(mask_BN.any(dim=-1).sum())
        self.degenerate += [i for i, flag in zip(ids, degenerate_B.tolist()) if flag]
        self.nearly_degenerate += [i for i, flag in zip(ids, nearly_B.tolist()) if flag]

    @classmethod
    def merge(cls, parts: Sequence["DegenerateWeights"]) -> "DegenerateWeights":
        """The ranks' parts (each over its own shard) as one, ids sorted."""
        return cls(splits=parts[0].splits, num_examples=sum(p.num_examples for p in parts),
                   degenerate=sorted(i for p in parts for i in p.degenerate),
                   nearly_degenerate=sorted(i for p in parts for i in p.nearly_degenerate))

    def note(self) -> str | None:
        """The ``[health]`` warning line, or None when no example is degenerate or nearly so."""
        flagged = self.degenerate + self.nearly_degenerate
        if not flagged:
            return None
        shown = ", ".join(flagged[:DEGENERATE_IDS_SHOWN]) + (" ..." if len(flagged) > DEGENERATE_IDS_SHOWN else "")
        return (f"[health] warning: {len(flagged)} of {self.num_examples} examples ({self.splits}) have degenerate reference "
                f"weights: {len(self.degenerate)} with b_t = 0 on every supervised token, {len(self.nearly_degenerate)} nearly so "
                f"(every b_t < {NEARLY_DEGENERATE_MAX_SURPRISAL:g} nats, each token above 99% likely under the reference), e.g. {shown}: "
                f"the reference-weighted terms cannot tell their tokens apart (pi falls back to uniform, tok weighs them as "
                f"raw's mean does, and ex divides them by little more than its epsilon); use an entangled stage that has "
                f"learned the data less perfectly (fewer steps, an earlier checkpoint), or check the data for duplicated x -> y pairs")

    def to_dict(self) -> dict[str, Any]:
        return {"splits": self.splits, "num_examples": self.num_examples, "max_surprisal": NEARLY_DEGENERATE_MAX_SURPRISAL,
                "num_degenerate": len(self.degenerate), "num_nearly_degenerate": len(self.nearly_degenerate),
                "degenerate": self.degenerate[:_IDS_RECORDED], "nearly_degenerate": self.nearly_degenerate[:_IDS_RECORDED]}


@dataclass
class ReferenceHealth:
    """What the start-up check found; ``to_dict`` is the ``reference_health`` block of ``run_config.json``."""

    backbone: str
    """The backbone as given (``--backbone``; the built-in one when empty)."""
    fresh_markers: list[str]
    """Template markers the backbone's tokenizer lacked (added with untrained rows)."""
    allow_fresh_markers: bool
    """Whether the run was told to proceed anyway (then the fresh rows train as trainable tokens)."""
    entangled_command: str
    """The command that builds the entangled checkpoint for this backbone and data."""
    stage_steps: int | None = None
    """The steps of the entangled stage the backbone already is (its ``pretrain_summary.json``); None for a raw LM."""
    c_base: float | None = None
    c_base_mode: str | None = None
    c_base_source: str | None = None
    floor: float | None = None
    """The floor H(y|x) in c_base's units (validation mean of A_mode(H)), built-in tasks only."""
    floor_per_sequence: float | None = None
    """The validation mean of H(y|x), nats per sequence."""
    c_base_threshold: float | None = None
    """c_base above this warns (c_base's units); see the module docstring."""
    c_base_threshold_rule: str | None = None
    degenerate_weights: dict[str, Any] | str | None = None
    """``DegenerateWeights.to_dict()`` of the examples checked, or why none was (``check_weights``)."""
    warnings: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def check_c_base(self, c_base, *, val: Sequence, examples: Sequence, task) -> str | None:
        """Compare ``c_base`` (a ``CBase``) with its threshold; record it; log and return the warning, if any.

        ``val`` the encoded validation examples c_base was computed on (``EncodedExample``: ``id``,
        ``num_supervised``); ``examples`` the raw ones (``id``, ``x``) for the family's floor; ``task`` the
        ``TaskFamily`` (None for user data). Never raises on a high value: it only warns.
        """
        self.c_base, self.c_base_mode, self.c_base_source = float(c_base.value), c_base.mode, c_base.source
        if c_base.source != "validation" or not val:
            self.c_base_threshold_rule = f"not checked: c_base is {c_base.source} (zfree_reference_scale)"
            return None
        sizes = [ex.num_supervised for ex in val]
        entropies = _entropies(val, examples, task)

        def aggregate(per_example: Sequence[float]) -> float:  # the validation mean of A_mode, as c_base
            if c_base.mode == "mean":
                return sum(v / n for v, n in zip(per_example, sizes)) / len(sizes)
            return sum(per_example) / len(sizes)

        if entropies is not None:
            self.floor_per_sequence = sum(entropies) / len(entropies)
            self.floor = aggregate(entropies)
            self.c_base_threshold = aggregate([h + FLOOR_MARGIN_PER_SEQUENCE for h in entropies])
            self.c_base_threshold_rule = f"the family's floor H(y|x) + {FLOOR_MARGIN_PER_SEQUENCE:g} nats per sequence"
        else:
            self.c_base_threshold = aggregate([HIGH_C_BASE_PER_TOKEN * n for n in sizes])
            self.c_base_threshold_rule = f"{HIGH_C_BASE_PER_TOKEN:g} nats per supervised token (no known floor)"
        if self.c_base <= self.c_base_threshold:
            return None
        units = "nats/token" if c_base.mode == "mean" else "nats/sequence"
        floor = f", floor {self.floor:.4g}" if self.floor is not None else ""
        if self.stage_steps is None:
            remedy = f"an entangled checkpoint helps: {self.entangled_command}"
        else:  # pretraining a stage's output again would stack a second stage on it: the stage itself wants more steps
            remedy = (f"the backbone is an entangled stage of {self.stage_steps} steps that stopped short of the floor; a "
                      f"longer one helps: build it again with --max-steps {2 * self.stage_steps} (in a sweep family, "
                      f"pretrain.max_steps) and its other settings as in {Path(self.backbone) / 'pretrain_summary.json'}, "
                      f"then train with --backbone on the new stage")
        line = (f"[health] warning: c_base[{c_base.mode}] = {self.c_base:.4g} {units} is above {self.c_base_threshold:.4g} "
                f"({self.c_base_threshold_rule}{floor}): the reference has not learned this data, so the "
                f"reference-weighted terms weigh its format more than the strategy; {remedy}")
        self.warnings.append(line)
        logger.warning(line)
        return line


    def check_weights(self, found: DegenerateWeights | None) -> str | None:
        """Record what the setup passes found about degenerate weights; log and return the warning, if any.
        ``found`` None: no pass computed b at setup (the module docstring says when)."""
        if found is None:
            self.degenerate_weights = "not checked: no b was computed at setup (online policy, c_base not from the validation pass)"
            return None
        self.degenerate_weights = found.to_dict()
        line = found.note()
        if line is not None:
            self.warnings.append(line)
            logger.warning(line)
        return line


def _entropies(val: Sequence, examples: Sequence, task) -> list[float] | None:
    """H(y|x) in nats of every kept validation example, or None without a family that knows it."""
    if task is None or not hasattr(task, "y_entropy"):
        return None
    x_of = {ex.id: ex.x for ex in examples}
    try:
        return [float(task.y_entropy(x_of[ex.id])) for ex in val]
    except (KeyError, ValueError):
        return None  # an example the family cannot read: no floor, the per-token rule applies


def check_markers(cfg, backbone: str, *, stage_steps: int | None = None) -> ReferenceHealth:
    """Read the backbone's tokenizer (cheap: before the weights load) and check its template markers.
    ``stage_steps``: the steps of the entangled stage the backbone already is, None for a raw LM; given, the
    c_base warning advises a longer stage rather than a stage on top of this one.

    ValueError (``zcvae train`` exits 2 with it, one line) naming the ``zcvae pretrain --backbone``
    command when a marker or ``<znull>`` would be added fresh, unless ``cfg.model.allow_fresh_markers``.
    A tokenizer that cannot be read is left to ``ZCVAE.from_pretrained``, which says why.
    """
    command, out = entangled_command(cfg)
    shown = cfg.model.backbone or str(backbone)
    fresh = _fresh_markers(backbone, trust_remote_code=cfg.model.trust_remote_code)
    health = ReferenceHealth(backbone=shown, fresh_markers=fresh, allow_fresh_markers=bool(cfg.model.allow_fresh_markers),
                             entangled_command=command, stage_steps=stage_steps)
    if not fresh:
        return health
    if not cfg.model.allow_fresh_markers:
        raise ValueError(
            f"backbone {shown!r} lacks the template markers {' '.join(fresh)} in its tokenizer, so the frozen "
            f"reference cannot score the template and the decoder cannot learn to close y: build its entangled "
            f"checkpoint with `{command}` and train with --backbone {shlex.quote(out)}, or pass --allow-fresh-markers "
            f"to train on the raw backbone anyway"
        )
    line = (f"[health] --allow-fresh-markers: backbone {shown!r} lacks {' '.join(fresh)}; their rows start as the mean "
            f"row and train as trainable tokens (the entangled checkpoint: {command})")
    health.warnings.append(line)
    logger.warning(line)
    return health


def _fresh_markers(backbone: str, *, trust_remote_code: bool) -> list[str]:
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(backbone, local_files_only=True, trust_remote_code=trust_remote_code)
    except Exception:  # noqa: BLE001 - ZCVAE.from_pretrained, right after, reads it again and names the file
        return []
    return missing_markers(tokenizer.get_vocab())


def closure_warning(metrics: dict[str, float]) -> str | None:
    """One line when the final decodes closed y (emitted ``</y>``) less often than :data:`MIN_CLOSURE_RATE`."""
    rate = metrics.get("closure_rate")
    if rate is None or rate >= MIN_CLOSURE_RATE:
        return None
    return (f"[health] warning: the decoder closed y (emitted </y>) in {rate:.0%} of the evaluation decodes "
            f"(closure_rate {rate:.3f} < {MIN_CLOSURE_RATE:g}): it cannot stop, so exact match and parse rate suffer "
            f"(train longer, or start from an entangled checkpoint that knows the markers: reference_health in run_config.json)")
