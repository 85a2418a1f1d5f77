"""zcvae: a pretrained causal LM as a conditional VAE whose latent z captures the solution strategy.

The stable public API (kept from here on; every other module path is internal and may move):

    ZCVAE, ModelConfig, CVAEOutput                      the model, its config, its outputs
    TrainConfig                                         the training config in sections (CLI flags = their fields)
    ReconstructionLossConfig, reconstruction_terms,     the six reconstruction terms
    RECONSTRUCTION_TERMS
    ReconstructionTerm, register_term                   a new reconstruction term (before zcvae.config loads)
    Batch, EncodedExample, collate, encode_examples     the batch type and how to build one
    Engine, EngineConfig, build_engine                  the engines (local, deepspeed, fsdp2)
    AuxiliaryWeights, per_example_objective,            the per-example objective J and the
    marginal_router_terms                               batch-level router terms

Names are imported on first use (PEP 562), so ``import zcvae.data`` does not pull in torch,
transformers or peft.
"""

from __future__ import annotations

import importlib

from zcvae import console as _console
from zcvae._version import __version__

_console.install()  # the zcvae logger's one handler: stdout, rank 0 (zcvae.console)

_API = {
    "ZCVAE": "zcvae.model.cvae",
    "ModelConfig": "zcvae.model.config",
    "CVAEOutput": "zcvae.model.cvae",
    "TrainConfig": "zcvae.config",
    "ReconstructionLossConfig": "zcvae.core.losses",
    "reconstruction_terms": "zcvae.core.losses",
    "RECONSTRUCTION_TERMS": "zcvae.core.losses",
    "ReconstructionTerm": "zcvae.core.terms",
    "register_term": "zcvae.core.terms",
    "Batch": "zcvae.data.encoding",
    "EncodedExample": "zcvae.data.encoding",
    "collate": "zcvae.data.encoding",
    "encode_examples": "zcvae.data.encoding",
    "Engine": "zcvae.engines",
    "EngineConfig": "zcvae.engines",
    "build_engine": "zcvae.engines",
    "AuxiliaryWeights": "zcvae.core.objective",
    "per_example_objective": "zcvae.core.objective",
    "marginal_router_terms": "zcvae.core.objective",
}

__all__ = ["__version__", *_API]


def __getattr__(name: str):
    if name in _API:
        value = getattr(importlib.import_module(_API[name]), name)
        globals()[name] = value  # later lookups skip __getattr__
        return value
    raise AttributeError(f"module 'zcvae' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
