"""The one training loop that ``zcvae train`` (the CVAE) and ``zcvae pretrain`` (the entangled stage)
share: the step driver (``driver``), its logs (``logs``) and its guards (``guards``)."""

from zcvae.loop.driver import LoopSettings, MicroLoss, Objective, run_loop
from zcvae.loop.logs import MetricWindow, RunLogger, progress_bar

__all__ = ["LoopSettings", "MetricWindow", "MicroLoss", "Objective", "RunLogger", "progress_bar", "run_loop"]
