"""Deterministic, parseable run names built from the parameters that differ from the defaults.

A name is a sequence of ``key-value`` parts joined by ``_``, e.g. ``agg-sum_dist-1_beta-3_seed-2``:

- ``key`` is the field's abbreviation from :data:`ABBREVIATIONS`, or the field name itself when the table
  has none (field names are snake case, so a key may contain ``_`` but never ``-``).
- ``value`` never contains ``_`` (it may contain ``-``: ``beta--0.5``, ``lr-1e-05``), so a name splits
  unambiguously: a key runs to the next ``-``, its value to the next ``_``.
- Parts appear in a fixed order (:data:`ABBREVIATIONS` order, then other fields sorted by name, ``seed``
  last), so the same parameters always give the same name.
- The aggregation mode (``reconstruction_loss_token_aggregation_mode``) is always present, even at its
  default, so a ``mean``, a ``sum`` and a ``token`` run can never share a name (a c_base is per mode, docs/objective.md#c_base): ``agg-mean``,
  ``agg-sum``, ``agg-token``; a fixed sum scale C follows it as ``sumscale-C`` (``agg-sum_sumscale-16``).

Values are written losslessly and read back with the type of the default value:

- ``bool`` -> ``true`` / ``false``; ``int`` -> decimal; ``None`` -> ``None``;
- ``float`` -> the shortest text that parses back to the same float (``repr``; integral floats below 1e16 as
  ``3``; the exponent's ``+`` dropped: ``1e20``; ``-0`` keeps its sign; ``inf``, ``-inf``, ``nan``);
- ``str`` only if it matches ``[A-Za-z0-9.]+`` and reads back as the same string (the ``objective``
  field may also use ``+``: ``obj-raw+dist``).

Values that cannot be written this way (paths and other strings with ``/``, ``_``, ``-`` or spaces; strings
such as ``"123"`` or ``"inf"`` for a field whose default is not a string; lists; dicts) are *hashed*: they do
not appear one by one, but a single ``hash-<10 hex>`` part (before ``seed``) digests all of them, so two runs
that differ only in, say, the backbone path still get different names.
:func:`parse_run_name` cannot recover hashed fields: they come back as their defaults.

Fields in ``exclude`` (output locations and other bookkeeping) never influence the name.

Names longer than :data:`MAX_NAME_LEN` characters are cut and end in ``__`` plus a 16-hex digest of the full
name (``__`` cannot occur in an untruncated name). Such a name is still unique and stable but cannot be
parsed: :func:`parse_run_name` raises ``ValueError``; read the parameters from the sweep manifest or the
``# zcvae-params:`` line of the rendered script instead.

Parsing types: a field whose default is ``None``, or that is missing from the defaults, has no type to go
by: its value parses as ``None`` (``None``), ``bool`` (``true``/``false``), ``int`` (decimal digits),
``float`` (anything ``float()`` accepts) or else ``str``, in that order. A string that would read back as
something else is hashed (above); any other value that would not read back equal to itself is refused with a
``ValueError`` naming the field, e.g. ``2.5`` for an ``int`` field or ``1`` for a ``bool`` field.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Iterable, Mapping
from typing import Any

from zcvae.core.terms import RECONSTRUCTION_TERM_REGISTRY

__all__ = [
    "ABBREVIATIONS",
    "AGGREGATION_MODE_FIELD",
    "DEFAULT_EXCLUDE",
    "MAX_NAME_LEN",
    "format_value",
    "parse_run_name",
    "parse_value",
    "run_name",
]

AGGREGATION_MODE_FIELD = "reconstruction_loss_token_aggregation_mode"

# Order matters: it is the order of the parts in a name.
ABBREVIATIONS: dict[str, str] = {
    AGGREGATION_MODE_FIELD: "agg",
    "reconstruction_loss_sum_scale": "sumscale",
    "reconstruction_weight_scale": "rscale",
    "objective": "obj",
    "task": "task",
    "latent_type": "lat",
    "num_latents": "K",
    # one key per registered reconstruction term (core/terms.py: its weight field and abbreviation)
    **{term.weight_field: term.abbreviation for term in RECONSTRUCTION_TERM_REGISTRY},
    "token_weight_alpha": "alpha",
    "example_inverse_surprisal_epsilon": "exeps",
    "inverse_surprisal_token_weight_epsilon": "tokinveps",
    "reference_refresh_every": "refresh",
    "kl_weight": "beta",
    "kl_weight_scale": "klscale",
    "lora_learning_rate": "lr",
    "latent_learning_rate": "zlr",
    "lora_r": "r",
    "max_steps": "steps",
    "micro_batch_size": "mbs",
    "gradient_accumulation_steps": "gas",
    "engine": "eng",
    "seed": "seed",
}
_LAST_FIELDS = ("seed",)
HASH_KEY = "hash"

# Where a run writes and how it reports progress, not what it trains.
DEFAULT_EXCLUDE: tuple[str, ...] = (
    "output_dir",
    "run_name",
    "config",
    "resume",
    "reference_cache_dir",
    "progress_bar",
    "follow_cores",  # how many CPU threads, not what is trained
    "log_every",
    "report_to",
    "grad_probe_every",  # a probe that changes no training number
    "save_every",
    "keep_last_checkpoints",
    "kl_weight_factor",  # resolved from the data by the trainer; kl_weight_scale names the choice
    "reconstruction_weight_factor",  # likewise; reconstruction_weight_scale names the choice
)
MAX_NAME_LEN = 180
_TRUNCATION_MARK = "__"
_TRUNCATION_HASH_LEN = 16

_FIELD_RE = re.compile(r"[A-Za-z0-9]+(?:_[A-Za-z0-9]+)*")
_SAFE_STR_RE = re.compile(r"[A-Za-z0-9.]+")
# Objective preset names join terms with "+" (raw+dist); "+" is safe in file names and is no separator.
_PLUS_FIELDS = frozenset({"objective"})
_PLUS_STR_RE = re.compile(r"[A-Za-z0-9.+]+")
_INT_RE = re.compile(r"-?[0-9]+")
_NAME_RE = re.compile(r"[A-Za-z0-9._+-]+")
_UNREADABLE = object()
_FIELD_FOR_KEY = {abbrev: field for field, abbrev in ABBREVIATIONS.items()}
assert len(_FIELD_FOR_KEY) == len(ABBREVIATIONS), "abbreviations must be distinct"
assert HASH_KEY not in _FIELD_FOR_KEY


def _same(a: Any, b: Any) -> bool:
    """Equality that does not treat True as 1: a bool flag set to 1 is a different parameter."""
    return isinstance(a, bool) == isinstance(b, bool) and a == b


def _key_for(field: str) -> str:
    return ABBREVIATIONS.get(field, field)


def _field_for(key: str) -> str:
    return _FIELD_FOR_KEY.get(key, key)


def _order(field: str) -> tuple:
    if field in _LAST_FIELDS:
        return (3, _LAST_FIELDS.index(field), field)
    if field in ABBREVIATIONS:
        return (0, list(ABBREVIATIONS).index(field), field)
    return (1, 0, field)


def format_value(value: Any, field: str | None = None) -> str | None:
    """The name text of ``value``, or ``None`` when it cannot be written losslessly (it is then hashed).

    Strings of the fields in ``_PLUS_FIELDS`` (the objective preset) may also contain ``+``."""
    if field in _PLUS_FIELDS and isinstance(value, str) and _PLUS_STR_RE.fullmatch(value):
        return value
    if value is None:
        return "None"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        if value == 0.0:
            return "-0" if math.copysign(1.0, value) < 0 else "0"
        if value.is_integer() and abs(value) < 1e16:
            return str(int(value))
        return repr(value).replace("e+", "e")
    if isinstance(value, str) and _SAFE_STR_RE.fullmatch(value):
        return value
    return None


def parse_value(text: str, default: Any) -> Any:
    """Read a value written by :func:`format_value`, typed like ``default`` (see module docstring)."""
    if text == "None":
        return None
    if isinstance(default, bool):
        if text not in ("true", "false"):
            raise ValueError(f"expected true or false, got {text!r}")
        return text == "true"
    if isinstance(default, int):
        return int(text)
    if isinstance(default, float):
        return float(text)
    if isinstance(default, str):
        return text
    if text in ("true", "false"):
        return text == "true"
    if _INT_RE.fullmatch(text):
        return int(text)
    try:
        return float(text)
    except ValueError:
        return text


def _split(
    params: Mapping[str, Any],
    defaults: Mapping[str, Any],
    *,
    always: Iterable[str],
    exclude: Iterable[str],
) -> tuple[dict[str, str], dict[str, Any]]:
    """(field -> name text of nameable fields, field -> value of hashed fields) for the differing fields."""
    always = tuple(always)
    exclude = set(exclude)
    values = dict(params)
    for field in always:
        if field not in values:
            if field not in defaults:
                raise ValueError(f"{field}: must be in the params or the defaults (it is always named)")
            values[field] = defaults[field]
    named: dict[str, str] = {}
    hashed: dict[str, Any] = {}
    for field, value in values.items():
        if field in exclude:
            continue
        if field not in always and field in defaults and _same(value, defaults[field]):
            continue
        if not _FIELD_RE.fullmatch(field):
            raise ValueError(f"{field!r}: field names in a run name must be snake case [A-Za-z0-9_]")
        if field == HASH_KEY or (field in _FIELD_FOR_KEY and _FIELD_FOR_KEY[field] != field):
            raise ValueError(f"{field}: clashes with a reserved run-name key; rename the field")
        text = format_value(value, field)
        try:
            back = _UNREADABLE if text is None else parse_value(text, defaults.get(field))
        except ValueError:
            back = _UNREADABLE
        if text is None or (isinstance(value, str) and back != value):
            hashed[field] = value  # a path, or text that would read back as another type ("123", "inf")
            continue
        if not (_same(back, value) or (isinstance(value, float) and math.isnan(value) and back != back)):
            raise ValueError(
                f"{field}: value {value!r} would read back from a run name as {back!r} "
                f"(default {defaults.get(field)!r}); use the default's type"
            )
        named[field] = text
    return named, hashed


def run_name(
    params: Mapping[str, Any],
    defaults: Mapping[str, Any],
    *,
    always: Iterable[str] = (AGGREGATION_MODE_FIELD,),
    exclude: Iterable[str] = DEFAULT_EXCLUDE,
) -> str:
    """A filesystem-safe name (``[A-Za-z0-9._+-]``, ``+`` only from an objective name; at most :data:`MAX_NAME_LEN` characters) for ``params``.

    Built from the fields whose values differ from ``defaults`` plus the ``always`` fields; see the module
    docstring for the format, hashing of unwritable values and truncation.
    """
    named, hashed = _split(params, defaults, always=always, exclude=exclude)
    fields = sorted(named, key=_order)
    parts = [f"{_key_for(f)}-{named[f]}" for f in fields if f not in _LAST_FIELDS]
    if hashed:
        digest = json.dumps(hashed, sort_keys=True, default=repr)
        parts.append(f"{HASH_KEY}-{hashlib.sha256(digest.encode()).hexdigest()[:10]}")
    parts += [f"{_key_for(f)}-{named[f]}" for f in fields if f in _LAST_FIELDS]
    if not parts:
        raise ValueError("run name would be empty: pass `always` fields or params that differ from defaults")
    name = "_".join(parts)
    assert _NAME_RE.fullmatch(name) and _TRUNCATION_MARK not in name, name
    if len(name) > MAX_NAME_LEN:
        suffix = hashlib.sha256(name.encode()).hexdigest()[:_TRUNCATION_HASH_LEN]
        keep = MAX_NAME_LEN - len(_TRUNCATION_MARK) - _TRUNCATION_HASH_LEN
        name = name[:keep].rstrip("_") + _TRUNCATION_MARK + suffix
    return name


def parse_run_name(name: str, defaults: Mapping[str, Any]) -> dict[str, Any]:
    """``defaults`` overlaid with the values written in ``name`` (typed like the defaults).

    Hashed fields come back as their defaults. Raises ``ValueError`` for a truncated name (it ends in ``__``
    plus a digest and cannot be parsed) or a malformed one.
    """
    if _TRUNCATION_MARK in name:
        raise ValueError(
            f"run name {name!r} was truncated to {MAX_NAME_LEN} characters and cannot be parsed; "
            "read the parameters from the sweep manifest or the script's '# zcvae-params:' line"
        )
    if not _NAME_RE.fullmatch(name) or name.endswith("_"):
        raise ValueError(f"{name!r} is not a run name: only [A-Za-z0-9._+-] may occur")
    out = dict(defaults)
    pos = 0
    while pos < len(name):
        dash = name.find("-", pos)
        if dash <= pos:
            raise ValueError(f"{name!r}: expected key-value at offset {pos}")
        key = name[pos:dash]
        end = name.find("_", dash + 1)
        end = len(name) if end < 0 else end
        text = name[dash + 1 : end]
        if not text:
            raise ValueError(f"{name!r}: empty value for {key!r}")
        pos = end + 1
        if key == HASH_KEY:
            continue
        field = _field_for(key)
        try:
            out[field] = parse_value(text, defaults.get(field))
        except ValueError as err:
            raise ValueError(f"{field}: cannot read {text!r} from run name {name!r}: {err}") from None
    return out
