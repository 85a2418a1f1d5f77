"""What zcvae says while it works: stdlib ``logging``, one logger per module under ``zcvae``, one handler.

Every module logs through ``logging.getLogger(__name__)``, so the subsystems are the package's units:
``zcvae.train``, ``zcvae.loop``, ``zcvae.reference``, ``zcvae.engines``, ``zcvae.backbone``, ``zcvae.eval``,
``zcvae.runs``, ``zcvae.sweep``, ... A level set on one of them holds for every module below it.

The ``zcvae`` logger gets one handler when the package is imported (as transformers does for its own):
the bare message on stdout, from rank 0 only, so that a launch of 64 ranks prints each line once. A record
logged with ``extra={"all_ranks": True}`` passes on every rank. The handler writes to whatever ``sys.stdout``
is when the record is emitted, so ``contextlib.redirect_stdout`` and pytest's capture see the lines; the commands whose stdout is
their result (``convert-gguf``, ``export``, ``generate``, ``encode``, ``plan``) send it to stderr (:func:`use_stderr`).

``--log-level`` (every ``zcvae`` command, or ``ZCVAE_LOG_LEVEL``) takes a level and per-logger levels::

    --log-level debug
    --log-level warning,zcvae.reference=info      # quiet, except the reference's lines
    --log-level zcvae.engines=error               # the default level, minus the engines' lines

User errors are not log records: the CLI prints them as one line on stderr and exits with its code
(``zcvae.commands.cli.main``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Iterator

ROOT = "zcvae"
DEFAULT_LEVEL = "info"
ENV = "ZCVAE_LOG_LEVEL"
LEVELS = ("debug", "info", "warning", "error", "critical")


def current_rank() -> int:
    """This process's rank: the process group's once one is up, else torchrun's ``RANK`` (0 alone)."""
    dist = sys.modules.get("torch.distributed")  # never imports torch: a CLI without it stays fast
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0") or 0)


class RankZeroFilter(logging.Filter):
    """Pass rank 0's records, and any rank's record marked ``extra={"all_ranks": True}``."""

    def filter(self, record: logging.LogRecord) -> bool:
        return bool(getattr(record, "all_ranks", False)) or current_rank() == 0


class _ConsoleHandler(logging.StreamHandler):
    """A StreamHandler on the current ``sys.stdout`` (or ``sys.stderr``), looked up per record, not kept from
    install time."""

    def __init__(self) -> None:
        self.target = "stdout"
        super().__init__(sys.stdout)

    @property
    def stream(self):
        return getattr(sys, self.target)

    @stream.setter
    def stream(self, value) -> None:  # StreamHandler.__init__ assigns it; the property reads sys.<target> instead
        pass


def install() -> logging.Handler:
    """Give the ``zcvae`` logger its handler, once (idempotent); the level comes from ``ZCVAE_LOG_LEVEL``."""
    root = logging.getLogger(ROOT)
    for handler in root.handlers:
        if isinstance(handler, _ConsoleHandler):
            return handler
    handler = _ConsoleHandler()
    handler.setFormatter(logging.Formatter("%(message)s"))
    handler.addFilter(RankZeroFilter())
    root.addHandler(handler)
    # zcvae's lines are its console output: an application's root handlers would print each twice
    root.propagate = False
    set_levels(DEFAULT_LEVEL, source="default")
    if os.environ.get(ENV):
        try:
            set_levels(os.environ[ENV], source=ENV)
        except ValueError as err:  # at import time: say so and keep the default, rather than fail every import
            logging.getLogger(__name__).warning(f"{err}; using the default level {DEFAULT_LEVEL}")
    return handler


def use_stderr() -> None:
    """Send the log to stderr: for the commands whose stdout is their result (a path, generated text, a plan)."""
    install().target = "stderr"


def parse_levels(spec: str, *, source: str = "--log-level") -> dict[str, int]:
    """``"warning,zcvae.reference=debug"`` -> {"zcvae": WARNING, "zcvae.reference": DEBUG}; ValueError naming
    the bad part. A bare level is the ``zcvae`` logger's; ``NAME=LEVEL`` names a logger under ``zcvae``."""
    levels: dict[str, int] = {}
    for part in (p.strip() for p in spec.split(",")):
        if not part:
            continue
        name, _, level = part.rpartition("=")
        name = name.strip() or ROOT
        if name != ROOT and not name.startswith(ROOT + "."):
            raise ValueError(f"{source}: {part!r}: a logger's name starts with 'zcvae.' (e.g. zcvae.reference=debug)")
        if level.strip().lower() not in LEVELS:
            raise ValueError(f"{source}: {part!r}: the level must be one of {', '.join(LEVELS)}")
        levels[name] = getattr(logging, level.strip().upper())
    return levels


def set_levels(spec: str, *, source: str = "--log-level") -> dict[str, int]:
    """Apply a ``--log-level`` value (see :func:`parse_levels`); returns what it set."""
    levels = parse_levels(spec, source=source)
    for name, level in levels.items():
        logging.getLogger(name).setLevel(level)
    return levels


def pop_log_level(argv: list[str]) -> tuple[list[str], str | None]:
    """(argv without ``--log-level X`` / ``--log-level=X``, X): the flag may stand anywhere on a command line,
    since each ``zcvae`` command has its own parser."""
    out, value, i = [], None, 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--log-level":
            if i + 1 >= len(argv):
                raise ValueError("--log-level needs a value, e.g. --log-level debug or --log-level warning,zcvae.reference=info")
            value, i = argv[i + 1], i + 2
            continue
        if arg.startswith("--log-level="):
            value = arg.split("=", 1)[1]
        else:
            out.append(arg)
        i += 1
    return out, value


@contextlib.contextmanager
def capture_lines(name: str = ROOT) -> Iterator[list[str]]:
    """Collect the text of every record logger ``name`` (and those below it) emits inside the block, at their
    levels and on any rank: for tests and notebooks that check what a run said."""
    lines: list[str] = []

    class Lines(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    handler = Lines()
    logging.getLogger(name).addHandler(handler)
    try:
        yield lines
    finally:
        logging.getLogger(name).removeHandler(handler)
