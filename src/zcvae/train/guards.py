"""The divergence guard and the preemption stop live in ``zcvae.loop.guards`` (the loop that ``train``
and ``pretrain`` share sits below ``backbone`` in the layering); this name stays for existing imports."""

from zcvae.loop.guards import *  # noqa: F401,F403
