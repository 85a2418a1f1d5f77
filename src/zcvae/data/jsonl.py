"""JSONL datasets: one example per line, `{"id": ..., "x": ..., "y": ..., "strategy": ...}`.

`id`, `x` and `y` are required non-empty strings (x and y must hold a non-space character: an empty x
or y leaves nothing to condition on or to reconstruct); `strategy` is optional, a non-empty string or
null. Other fields are rejected, so a typo ("stratgy") is caught rather than silently ignored. Blank
lines are skipped. Every error is a ValueError naming the file, the line, the example id when known
and the field. Words of x and y outside the tokenizer's vocabulary are not an error here: they become
`<unk>` when tokenised (a later layer counts them).

`write_jsonl` writes atomically (a temporary file in the same folder, fsync, then `os.replace`), so a
crash leaves either the old file or the complete new one, never a partial file.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path

from zcvae.data.tasks import Example
from zcvae.runs.rundir import atomic_write_bytes

_REQUIRED_FIELDS = ("id", "x", "y")
_FIELDS = (*_REQUIRED_FIELDS, "strategy")
# Characters str.splitlines() breaks on that json.dumps(ensure_ascii=False) does not escape.
_RAW_LINE_BREAKS = ("\x85", "\u2028", "\u2029")


def _reject_duplicate_keys(pairs: list[tuple[str, object]]) -> dict[str, object]:
    keys = [key for key, _ in pairs]
    duplicates = sorted({key for key in keys if keys.count(key) > 1})
    if duplicates:
        raise ValueError(f"field {duplicates[0]!r} appears more than once")
    return dict(pairs)


def _check_fields(record: dict, where: str) -> Example:
    """The Example in `record`, or ValueError prefixed with `where` naming the offending field."""
    record_id = record.get("id")
    if isinstance(record_id, str) and record_id:
        where = f"{where}: example id {record_id!r}"
    unknown = sorted(set(record) - set(_FIELDS))
    if unknown:
        raise ValueError(f"{where}: unknown field(s) {unknown}; allowed fields are {list(_FIELDS)}")
    for field in _REQUIRED_FIELDS:
        if field not in record:
            raise ValueError(f"{where}: missing required field {field!r}")
        value = record[field]
        if not isinstance(value, str):
            raise ValueError(f"{where}: field {field!r} must be a string, got {type(value).__name__}")
        if not value.strip():
            raise ValueError(f"{where}: field {field!r} is empty or whitespace only")
    strategy = record.get("strategy")
    if strategy is not None and (not isinstance(strategy, str) or not strategy.strip()):
        raise ValueError(f"{where}: field 'strategy' must be a non-empty string or null, got {strategy!r}")
    return Example(id=record["id"], x=record["x"], y=record["y"], strategy=strategy)


def read_jsonl(path: str | os.PathLike) -> list[Example]:
    """The examples of a JSONL file, in file order. ValueError naming file/line/id/field if invalid."""
    path = Path(path)
    examples: list[Example] = []
    line_of_id: dict[str, int] = {}
    try:
        data = path.read_bytes()
    except OSError as error:  # missing, a directory, unreadable
        raise ValueError(f"{path}: cannot be read as a JSONL file: {error.strerror}") from None
    for line_number, raw_line in enumerate(data.split(b"\n"), start=1):
        where = f"{path}:{line_number}"
        try:
            line = raw_line.decode("utf-8")
        except UnicodeDecodeError as error:
            raise ValueError(f"{where}: not valid UTF-8 ({error.reason} at byte {error.start})") from None
        if line_number == 1:
            line = line.removeprefix("\ufeff")  # a byte-order mark some editors write
        if not line.strip():
            continue
        try:
            record = json.loads(line, object_pairs_hook=_reject_duplicate_keys)
        except json.JSONDecodeError as error:
            raise ValueError(f"{where}: invalid JSON: {error.msg} (column {error.colno})") from None
        except ValueError as error:  # from _reject_duplicate_keys
            raise ValueError(f"{where}: {error}") from None
        if not isinstance(record, dict):
            raise ValueError(f"{where}: expected a JSON object, got {type(record).__name__}")
        example = _check_fields(record, where)
        if example.id in line_of_id:
            raise ValueError(
                f"{where}: field 'id': duplicate id {example.id!r} (first on line {line_of_id[example.id]})"
            )
        line_of_id[example.id] = line_number
        examples.append(example)
    return examples


def write_jsonl(path: str | os.PathLike, examples: Iterable[Example]) -> None:
    """Write examples as JSONL, atomically. ValueError (and no file change) if an example is invalid.

    Every example is validated as `read_jsonl` would, so what is written always reads back equal.
    """
    path = Path(path)
    lines: list[bytes] = []
    seen_ids: set[str] = set()
    for position, example in enumerate(examples):
        where = f"{path}: example {position}"
        if not isinstance(example, Example):
            raise ValueError(f"{where}: expected an Example, got {type(example).__name__}")
        record = {"id": example.id, "x": example.x, "y": example.y, "strategy": example.strategy}
        _check_fields(record, where)
        if example.id in seen_ids:
            raise ValueError(f"{where}: field 'id': duplicate id {example.id!r}")
        seen_ids.add(example.id)
        try:
            line = json.dumps(record, ensure_ascii=False)
            # Escape the non-ASCII line breaks that json leaves raw, so line-splitting readers
            # (str.splitlines, editors) still see one example per line.
            for char in _RAW_LINE_BREAKS:
                line = line.replace(char, f"\\u{ord(char):04x}")
            lines.append((line + "\n").encode("utf-8"))
        except UnicodeEncodeError as error:  # e.g. a lone surrogate
            raise ValueError(f"{where}: example id {example.id!r}: text is not encodable as UTF-8: {error}") from None

    path.parent.mkdir(parents=True, exist_ok=True)
    # fsync: a dataset written once and read by many runs must survive a crash right after the rename
    atomic_write_bytes(path, b"".join(lines), fsync=True, mode=0o644)
