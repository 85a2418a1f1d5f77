"""What a run needs before it is queued: real models' shapes without weights (``shapes``), the FLOP model
(``flops``), the per-rank memory model (``memory``) and the ``zcvae plan`` command (``cli``)."""
