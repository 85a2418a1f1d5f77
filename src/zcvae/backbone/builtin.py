"""The built-in tiny backbones: one entangled tiny Llama per built-in task (seed 0), pretrained once into
the cache (``zcvae.runs.rundir.builtin_backbone_dir``) and reused by ``zcvae train`` without ``--backbone``."""

from __future__ import annotations

import logging
from pathlib import Path

from zcvae.backbone.pretraining import pretrain
from zcvae.backbone.stage_config import PretrainConfig, is_pretrained
from zcvae.runs.rundir import builtin_backbone_dir

logger = logging.getLogger(__name__)


def builtin_backbone(task: str | None) -> Path:
    """The built-in tiny backbone pretrained on ``task`` (seed 0), built once into the cache
    (``rundir.builtin_backbone_dir``) and reused."""
    pcfg = PretrainConfig(task=task, seed=0)
    cache = builtin_backbone_dir(pcfg.task)
    pcfg.output_dir = str(cache)
    if not is_pretrained(cache):
        logger.info(f"[backbone] pretraining the built-in backbone into {cache}")
        pretrain(pcfg)
    return cache

