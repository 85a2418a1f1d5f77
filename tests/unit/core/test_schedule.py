"""The one learning-rate schedule equals both schedules it replaced, bit for bit."""

import math

from zcvae.config import TrainConfig, lr_factor_at
from zcvae.core.schedule import lr_multiplier


def _old_backbone(step, *, warmup_steps, max_steps, min_lr_ratio):
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, max_steps - warmup_steps))
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def test_the_shared_schedule_equals_the_old_backbone_and_trainer_ones_exactly():
    for warmup, max_steps, min_ratio in [(10, 110, 0.1), (0, 7, 0.0), (3, 3, 0.25), (5, 1000, 0.333)]:
        cfg = TrainConfig.from_flat(warmup_steps=warmup, max_steps=max_steps, min_lr_ratio=min_ratio)
        for step in range(max_steps + 3):
            kw = dict(warmup_steps=warmup, max_steps=max_steps, min_lr_ratio=min_ratio)
            new = lr_multiplier(step, **kw)
            assert new == _old_backbone(step, **kw) == lr_factor_at(cfg, step), (warmup, max_steps, min_ratio, step)
