"""The one registry of reconstruction terms: each term's name, weight field, abbreviation, function and
description, read by the loss, the config and its CLI flags, the run names, the logs and the aggregate.

A term is a :class:`ReconstructionTerm`; :data:`RECONSTRUCTION_TERM_REGISTRY` lists them in the order
of docs/objective.md ("The six reconstruction terms"), which is the order of the logs and of the tables.

- ``name``: the metric key (``metrics.jsonl``, evaluation, ``core.losses.reconstruction_terms``);
- ``weight_field``: the field holding its weight lambda_j, in ``TrainConfig`` (so also the CLI flag
  ``--<weight-field>`` and the YAML key) and in ``core.losses.ReconstructionLossConfig``;
- ``abbreviation``: its short key in run names and in the aggregate's ``recon`` column;
- ``function``: ``function(parts) -> [B]``, the per-example value from the shared quantities of one
  batch (:class:`TermParts`); pure tensor math;
- ``description``: one line, the CLI help of the weight flag;
- ``default_weight``: its weight in ``TrainConfig()`` and ``ReconstructionLossConfig()``;
- ``in_mode_units``: whether its value is in the aggregation mode's units (raw, tok), which
  ``--reconstruction-weight-scale tokens`` multiplies, rather than a ratio to c_base or A(b_i).

The config dataclasses get one weight field per registered term when they are defined, so a term is
registered before ``zcvae.config`` and ``zcvae.core.losses`` are imported: an entry in the tuple below
(CONTRIBUTING, "Adding a seventh reconstruction term"), or :func:`register_term` from code that runs
first (the registry test does that in a fresh interpreter).

Shape legend: B examples.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Union

if TYPE_CHECKING:  # run names and the aggregate read the registry without importing torch
    import torch

__all__ = [
    "RECONSTRUCTION_TERM_REGISTRY",
    "ReconstructionTerm",
    "TermParts",
    "register_term",
    "term_by_abbreviation",
    "with_term_weight_fields",
]


@dataclasses.dataclass(frozen=True)
class TermParts:
    """What every term is built from, per example ``[B]`` in the aggregation mode's units
    (docs/objective.md, "Aggregation"); c_base and the epsilons are scalars.

    ``raw_B`` = sum_k q_ik A(l_ik); ``token_B`` = sum_k q_ik W(l_ik; pi_i); ``inverse_B`` = sum_k q_ik W(l_ik; rho_i);
    ``base_B`` = A(b_i); ``kappa_B`` and ``eta_B`` the scale factors; ``c_base`` the mode-matched z-free scale.
    """

    raw_B: torch.Tensor
    token_B: torch.Tensor
    inverse_B: torch.Tensor
    base_B: torch.Tensor
    kappa_B: torch.Tensor
    eta_B: torch.Tensor
    c_base: Union[float, torch.Tensor]
    config: Any  # the ReconstructionLossConfig (alpha, epsilons, mode)


@dataclasses.dataclass(frozen=True)
class ReconstructionTerm:
    name: str
    weight_field: str
    abbreviation: str
    function: Callable[[TermParts], torch.Tensor]
    description: str
    default_weight: float = 0.0
    # True for a term whose value is in the aggregation mode's units (nats per token under mean, per sequence
    # under sum), so that its size against the per-example KL follows the mode; the terms divided by c_base
    # or by A(b_i) are ratios, the same size in every mode. --reconstruction-weight-scale multiplies these.
    in_mode_units: bool = False


RECONSTRUCTION_TERM_REGISTRY: list[ReconstructionTerm] = [
    ReconstructionTerm(
        "reconstruction_loss", "reconstruction_weight", "raw",
        lambda p: p.raw_B,
        "the posterior-weighted token NLL, sum_k q_ik A(l_ik).",
        default_weight=1.0,
        in_mode_units=True,
    ),
    ReconstructionTerm(
        "distribution_normalized_reconstruction_loss", "distribution_normalized_reconstruction_weight", "dist",
        lambda p: p.raw_B / p.c_base,
        "reconstruction_loss / c_base, the z-free reference scale of the mode.",
    ),
    ReconstructionTerm(
        "example_inverse_surprisal_weighted_reconstruction_loss", "example_inverse_surprisal_weighted_reconstruction_weight", "ex",
        lambda p: p.raw_B / (p.base_B + p.config.example_inverse_surprisal_epsilon),
        "each example's reconstruction divided by its own z-free loss A(b_i) + epsilon.",
    ),
    ReconstructionTerm(
        "token_weighted_reconstruction_loss", "token_weighted_reconstruction_weight", "tok",
        lambda p: p.token_B,
        "token NLL weighted by the reference surprisal share pi (temperature alpha).",
        in_mode_units=True,
    ),
    ReconstructionTerm(
        "normalized_concentration_corrected_token_weighted_reconstruction_loss",
        "normalized_concentration_corrected_token_weighted_reconstruction_weight", "tokcc",
        lambda p: p.token_B / p.kappa_B / p.c_base,
        "the token-weighted term divided by its concentration factor kappa_i and by c_base.",
    ),
    ReconstructionTerm(
        "normalized_inverse_surprisal_token_weighted_reconstruction_loss",
        "normalized_inverse_surprisal_token_weighted_reconstruction_weight", "tokinv",
        lambda p: p.inverse_B / p.eta_B / p.c_base,
        "token NLL weighted by inverse reference surprisal rho, divided by eta_i and by c_base.",
    ),
]


def register_term(term: ReconstructionTerm) -> None:
    """Append ``term``; its name, weight field and abbreviation must be new (ValueError naming the clash)."""
    for other in RECONSTRUCTION_TERM_REGISTRY:
        for attr in ("name", "weight_field", "abbreviation"):
            if getattr(other, attr) == getattr(term, attr):
                raise ValueError(f"reconstruction term {term.name!r}: {attr} {getattr(term, attr)!r} is already used by {other.name!r}")
    RECONSTRUCTION_TERM_REGISTRY.append(term)


def term_by_abbreviation(abbreviation: str) -> ReconstructionTerm:
    for term in RECONSTRUCTION_TERM_REGISTRY:
        if term.abbreviation == abbreviation:
            return term
    raise KeyError(abbreviation)


def with_term_weight_fields(*, after: str | None, make_field: Callable[[ReconstructionTerm], Any]):
    """Class decorator, applied under ``@dataclass``: one ``float`` field per registered term, named by its
    ``weight_field``, placed after field ``after`` (first when None) so the field order, and with it the
    order of run_config.json and of the CLI help, stays the registry's."""

    def decorate(cls):
        items = list(cls.__dict__.get("__annotations__", {}).items())
        position = 0 if after is None else [name for name, _ in items].index(after) + 1
        weights = []
        for term in RECONSTRUCTION_TERM_REGISTRY:
            weights.append((term.weight_field, "float"))
            setattr(cls, term.weight_field, make_field(term))
        cls.__annotations__ = dict(items[:position] + weights + items[position:])
        return cls

    return decorate
