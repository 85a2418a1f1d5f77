"""The learning-rate schedule, shared by training and the backbone's pretraining (pure, no torch)."""

from __future__ import annotations

import math


def lr_multiplier(step: int, *, warmup_steps: int, max_steps: int, min_lr_ratio: float) -> float:
    """Multiplier of the peak lr for the update number ``step`` (0-based): linear warm-up over
    ``warmup_steps``, then cosine decay to ``min_lr_ratio`` at ``max_steps`` (flat after it)."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = (step - warmup_steps) / max(1, max_steps - warmup_steps)
    cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return min_lr_ratio + (1 - min_lr_ratio) * cosine
