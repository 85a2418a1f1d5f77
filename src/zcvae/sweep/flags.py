"""A run's params as ``zcvae train`` (or ``zcvae pretrain``) flags, and back.

CLI values (:func:`params_to_flags`): ``--field-name value`` (snake case -> kebab case), floats as ``repr``
(exact); booleans as ``--field`` / ``--no-field``; lists as ``--field a b``; a ``None`` value is left out (the
config default applies; a ``None`` that differs from a non-``None`` default is refused by the planner).
The local runner and the SLURM scripts both launch :func:`command_args`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

_FLAG_RE = re.compile(r"--[A-Za-z0-9][A-Za-z0-9-]*")
# Every launch continues what is in its directory: a run (or stage) killed, preempted or requeued midway
# restarts from its newest complete checkpoint, and a fresh directory starts from step 0.
RESUME_ARGS = ("--resume", "auto")


def cli_value(value: Any) -> str:
    """The text of one scalar ``zcvae train`` flag value: floats as ``repr`` (exact), the rest as ``str``."""
    return repr(value) if isinstance(value, float) else str(value)


def params_to_flags(params: Mapping[str, Any]) -> list[list[str]]:
    """One ``[flag, *values]`` group per param, in sorted field order, as ``zcvae train`` parses them.

    ``True``/``False`` -> ``--field`` / ``--no-field`` (argparse ``BooleanOptionalAction``); a value starting
    with ``-`` -> ``--field=-1e-05`` (argparse would read it as an option); a list -> the flag followed by its
    items (``nargs="+"``); ``None`` -> left out, so the config default applies. Raises
    ``ValueError`` naming the field for values a flag cannot carry (empty lists, nested lists, dicts).
    """
    groups = []
    for field in sorted(params):
        value, flag = params[field], "--" + field.replace("_", "-")
        if value is None:
            continue
        if isinstance(value, bool):
            groups.append([flag if value else "--no-" + flag[2:]])
        elif isinstance(value, (list, tuple)):
            items = [cli_value(v) for v in value if not isinstance(v, (list, tuple, dict)) and v is not None]
            if not value or len(items) != len(value) or any(item.startswith("-") for item in items):
                raise ValueError(f"{field}: a list flag needs scalar items not starting with '-', got {value!r}")
            groups.append([flag, *items])
        elif isinstance(value, dict):
            raise ValueError(f"{field}: a mapping cannot be passed as a zcvae train flag")
        else:
            text = cli_value(value)
            # argparse takes "-1e-05" or "-inf" after a flag for another option; "--flag=-1e-05" is unambiguous
            groups.append([f"{flag}={text}"] if text.startswith("-") else [flag, text])
    return groups


def parse_train_flags(argv: Sequence[str]) -> dict[str, Any]:
    """Read ``zcvae train`` flags back: ``--field v`` and ``--field=v`` -> ``"v"``; ``--field a b`` ->
    ``["a", "b"]``; ``--field`` alone -> ``True``; ``--no-field`` alone -> ``False``. Values stay text."""
    out: dict[str, Any] = {}
    index = 0
    while index < len(argv):
        flag, eq, inline = argv[index].partition("=")
        if not _FLAG_RE.fullmatch(flag):
            raise ValueError(f"{argv[index]!r}: expected a --flag at position {index} of {list(argv)}")
        index += 1
        values = [inline] if eq else []
        while index < len(argv) and not _FLAG_RE.fullmatch(argv[index].partition("=")[0]):
            values.append(argv[index])
            index += 1
        field = flag[2:].replace("-", "_")
        if not values:
            value: Any = not field.startswith("no_")
            field = field if value else field[3:]
        else:
            value = values[0] if len(values) == 1 else values
        if field in out:
            raise ValueError(f"{flag}: given twice")
        out[field] = value
    return out




def command_flag_groups(params: Mapping[str, Any]) -> list[list[str]]:
    """The flags that launch a run or a stage, grouped as :func:`params_to_flags`, then ``--resume auto``."""
    return [*params_to_flags(params), list(RESUME_ARGS)]


def command_args(params: Mapping[str, Any]) -> list[str]:
    """:func:`command_flag_groups` as one argument list."""
    return [arg for group in command_flag_groups(params) for arg in group]
