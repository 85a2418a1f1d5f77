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

Everything is recorded under ``reference_health`` in ``run_config.json`` (:meth:`ReferenceHealth.to_dict`).
At the end of a run, :func:`closure_note` says so when the decoder rarely closed y
(``closure_rate`` below :data:`MIN_CLOSURE_RATE`).
"""

from __future__ import annotations

import shlex
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from zcvae.data.encoding import missing_markers

__all__ = [
    "FLOOR_MARGIN_PER_SEQUENCE",
    "HIGH_C_BASE_PER_TOKEN",
    "MIN_CLOSURE_RATE",
    "ReferenceHealth",
    "check_markers",
    "closure_note",
    "entangled_command",
]

FLOOR_MARGIN_PER_SEQUENCE = 0.1
"""Nats per sequence above the family's floor H(y|x) that c_base may reach before the warning."""
HIGH_C_BASE_PER_TOKEN = 1.0
"""Nats per supervised token above which c_base warns when the data has no known floor (user JSONL)."""
MIN_CLOSURE_RATE = 0.5
"""A final evaluation whose decodes emit ``</y>`` less often than this says that the decoder cannot stop."""


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
    warnings: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def check_c_base(self, c_base, *, val: Sequence, examples: Sequence, task, log: Callable[[str], Any] = print) -> str | None:
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
        line = (f"[health] warning: c_base[{c_base.mode}] = {self.c_base:.4g} {units} is above {self.c_base_threshold:.4g} "
                f"({self.c_base_threshold_rule}{floor}): the reference has not learned this data, so the "
                f"reference-weighted terms weigh its format more than the strategy; an entangled checkpoint helps: "
                f"{self.entangled_command}")
        self.warnings.append(line)
        log(line)
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


def check_markers(cfg, backbone: str, *, log: Callable[[str], Any] = print) -> ReferenceHealth:
    """Read the backbone's tokenizer (cheap: before the weights load) and check its template markers.

    ValueError (``zcvae train`` exits 2 with it, one line) naming the ``zcvae pretrain --backbone``
    command when a marker or ``<znull>`` would be added fresh, unless ``cfg.model.allow_fresh_markers``.
    A tokenizer that cannot be read is left to ``ZCVAE.from_pretrained``, which says why.
    """
    command, out = entangled_command(cfg)
    shown = cfg.model.backbone or str(backbone)
    fresh = _fresh_markers(backbone, trust_remote_code=cfg.model.trust_remote_code)
    health = ReferenceHealth(backbone=shown, fresh_markers=fresh, allow_fresh_markers=bool(cfg.model.allow_fresh_markers),
                             entangled_command=command)
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
    log(line)
    return health


def _fresh_markers(backbone: str, *, trust_remote_code: bool) -> list[str]:
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(backbone, local_files_only=True, trust_remote_code=trust_remote_code)
    except Exception:  # noqa: BLE001 - ZCVAE.from_pretrained, right after, reads it again and names the file
        return []
    return missing_markers(tokenizer.get_vocab())


def closure_note(metrics: dict[str, float]) -> str | None:
    """One line when the final decodes closed y (emitted ``</y>``) less often than :data:`MIN_CLOSURE_RATE`."""
    rate = metrics.get("closure_rate")
    if rate is None or rate >= MIN_CLOSURE_RATE:
        return None
    return (f"[health] warning: the decoder closed y (emitted </y>) in {rate:.0%} of the evaluation decodes "
            f"(closure_rate {rate:.3f} < {MIN_CLOSURE_RATE:g}): it cannot stop, so exact match and parse rate suffer "
            f"(train longer, or start from an entangled checkpoint that knows the markers: reference_health in run_config.json)")
