"""Dataclasses built from mappings (config files, JSON records) that must not ignore a typo.

The one home of the unknown-key check: :class:`StrictDataclass` gives a dataclass ``from_dict`` (a
ValueError naming every unknown key, and the known ones) and ``to_dict``. It sits at the bottom of the
import graph (standard library only), so every layer can use it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, TypeVar

__all__ = ["StrictDataclass", "check_keys"]

T = TypeVar("T", bound="StrictDataclass")


def check_keys(cls: type, values: Any, *, what: str, require_all: bool = False) -> None:
    """ValueError unless ``values`` is a mapping whose keys are fields of dataclass ``cls`` (all of them
    with ``require_all``); the message starts with ``what`` and names the offending keys."""
    if not isinstance(values, Mapping):
        raise ValueError(f"{what} must be a mapping, got {type(values).__name__}")
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - names)
    missing = sorted(names - set(values)) if require_all else []
    if unknown or missing:
        problems = [f"unknown keys {unknown}"] if unknown else []
        problems += [f"missing keys {missing}"] if missing else []
        raise ValueError(f"{what}: {', '.join(problems)}; known keys: {sorted(names)}")


class StrictDataclass:
    """Mixin for a dataclass: ``from_dict`` rejects unknown keys by name, ``to_dict`` is ``asdict``."""

    @classmethod
    def from_dict(cls: type[T], values: Mapping[str, Any]) -> T:
        check_keys(cls, values, what=cls.__name__)
        return cls(**dict(values))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)  # type: ignore[call-overload]
