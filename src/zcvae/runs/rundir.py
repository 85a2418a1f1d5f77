"""The run directory: its file names, the one atomic writer, its readers, its preparation for a run, the built-in backbone path.

A run directory (``--output-dir``) holds::

    run_config.json          the resolved TrainConfig, versions, c_base, backbone (RUN_CONFIG)
    metrics.jsonl            one JSON object per logged step, split "train" or "eval" (METRICS)
    checkpoints/step_N/      complete checkpoints, see zcvae.runs.checkpoint (CHECKPOINTS)
    eval_step{N}.json        the full evaluation at step N (eval_step_file)
    latents.png              the newest latent/strategy figure (LATENTS_FIGURE)
    verdict.json             the end-of-run verdict, zcvae.eval.verdict (VERDICT)
    zcvae.lock               while a run writes: its holder's host and pid (zcvae.runs.lock)

Every file that a reader may open while a writer runs is written through ``atomic_write``: into a
temporary file in the same directory, then ``os.replace``d over the target, so a reader sees the old
file or the new one, never half of one; a failed write leaves the old file and no temporary.

This module imports nothing of zcvae but the lock file's name (zcvae.runs.lock), so every layer (data/, runs/,
train/, eval/, export/) can use it.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable

from zcvae.runs.lock import LOCK_FILE

logger = logging.getLogger(__name__)

RUN_CONFIG = "run_config.json"
METRICS = "metrics.jsonl"
CHECKPOINTS = "checkpoints"
LATENTS_FIGURE = "latents.png"


def eval_step_file(step: int) -> str:
    """Name of the full evaluation record of step ``step``."""
    return f"eval_step{step}.json"


# The end-of-run verdict (zcvae.eval.verdict), written by `zcvae train` and `zcvae evaluate`.
VERDICT = "verdict.json"


# --------------------------------------------------------------------------- writers
def atomic_write(path: str | os.PathLike, write: Callable[[Path], Any], *, fsync: bool = False, mode: int | None = None) -> None:
    """Call ``write(tmp)`` on a temporary file next to ``path``, then move it over ``path``.

    ``fsync``: flush the file to disk before the rename (the reference store, datasets: files that
    are expensive to rebuild or that a crash must not truncate). ``mode``: the file's permissions
    (default: those of a newly created file, 0666 less the umask; mkstemp alone would give 0600).
    On any error the temporary is removed and the old ``path`` is left as it was.
    """
    path = Path(path)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        write(tmp)
        if fsync:
            with open(tmp, "rb+") as handle:
                os.fsync(handle.fileno())
        os.chmod(tmp, _default_mode() if mode is None else mode)
        os.replace(tmp, path)
    except BaseException as err:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        if isinstance(err, OSError) and err.filename is None and disk_error(err) is not None:
            # a write to a full disk names no file: name the one that could not be written
            raise OSError(err.errno, err.strerror, str(path)) from None
        raise


def _default_mode() -> int:
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


def atomic_write_bytes(path: str | os.PathLike, data: bytes, **kw) -> None:
    atomic_write(path, lambda tmp: tmp.write_bytes(data), **kw)


def atomic_write_text(path: str | os.PathLike, text: str, **kw) -> None:
    atomic_write(path, lambda tmp: tmp.write_text(text), **kw)


def atomic_write_json(path: str | os.PathLike, data: Any, **kw) -> None:
    """JSON with ``indent=2, sort_keys=True``; objects JSON cannot encode are written as ``str()``."""
    atomic_write_text(path, json.dumps(data, indent=2, sort_keys=True, default=str), **kw)


# --------------------------------------------------------------------------- disk errors
# What a full or read-only filesystem raises: the errno, or (safetensors' SafetensorError, which is no
# OSError) only a message.
DISK_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM)
_DISK_MESSAGES = {"No space left on device": errno.ENOSPC, "Disk quota exceeded": errno.EDQUOT,
                  "Read-only file system": errno.EROFS, "Permission denied": errno.EACCES}


def disk_error(err: BaseException) -> int | None:
    """The errno when ``err`` says the disk is full or the path is read-only / not writable, else None."""
    if isinstance(err, OSError) and err.errno in DISK_ERRNOS:
        return err.errno
    if type(err).__name__ == "SafetensorError":
        return next((code for text, code in _DISK_MESSAGES.items() if text in str(err)), None)
    return None


def describe_disk_error(err: BaseException, *, path: str | os.PathLike | None = None) -> str | None:
    """One line for a full or read-only filesystem naming the path (the error's own, else ``path``),
    or None for any other error."""
    code = disk_error(err)
    if code is None:
        return None
    path = getattr(err, "filename", None) or path
    where = f" writing {str(path)!r}" if path else ""
    advice = "free space or choose another path" if code in (errno.ENOSPC, errno.EDQUOT) else "choose a writable path"
    return f"{os.strerror(code).lower()}{where}; nothing written earlier was changed: {advice}"


def check_writable(path: str | os.PathLike, *, what: str) -> None:
    """ValueError naming ``path`` when it could not be written: its nearest existing directory is on a
    read-only filesystem or not writable by this user (checked up front, before any work is done)."""
    path = Path(path)
    existing = next((p for p in (path.parent, *path.parent.parents) if p.exists()), None)
    if existing is None or not existing.is_dir():
        return  # the write itself will name the problem
    if not os.access(existing, os.W_OK | os.X_OK):
        try:
            readonly = bool(os.statvfs(existing).f_flag & os.ST_RDONLY)
        except OSError:
            readonly = False
        why = "is on a read-only filesystem" if readonly else "is not writable"
        raise ValueError(f"{what} {str(path)!r} cannot be written: {str(existing)!r} {why}; choose a writable path")


# --------------------------------------------------------------------------- readers
def read_json(path: str | os.PathLike, *, what: str) -> Any:
    """The parsed JSON of ``path``; ValueError naming ``what`` and the file when missing or invalid."""
    path = Path(path)
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"{what}: {str(path)!r} does not exist") from None
    except ValueError as err:
        raise ValueError(f"{what}: {str(path)!r} is not valid JSON: {err}") from None


# The sections of run_config.json's ``config`` (zcvae.config.SECTIONS, whose test checks they agree).
CONFIG_SECTIONS = ("data", "model", "objective", "optimization", "engine", "run", "evaluation")


def flat_config(config: dict[str, Any]) -> dict[str, Any]:
    """run_config.json's ``config`` as flat keys, of either layout: in sections (written since the config has
    sections) or flat (written before). No flat value is a mapping, so a mapping under a section name is the section."""
    flat: dict[str, Any] = {}
    for key, value in config.items():
        if key in CONFIG_SECTIONS and isinstance(value, dict):
            flat.update(value)
        else:
            flat[key] = value
    return flat


def read_run_record(directory: str | os.PathLike) -> dict[str, Any]:
    """``run_config.json`` of a run or export directory, with its ``config`` flat (:func:`flat_config`: run
    names, verdicts and tables read flat keys, for old and new run directories alike); ValueError naming the file."""
    path = Path(directory) / RUN_CONFIG
    record = read_json(path, what="run config")
    if not isinstance(record, dict) or not isinstance(record.get("config"), dict):
        raise ValueError(f"run config: {str(path)!r} has no 'config' mapping (the resolved TrainConfig)")
    return {**record, "config": flat_config(record["config"])}


def iter_metric_records(run_dir: str | os.PathLike):
    """The JSON objects of ``metrics.jsonl`` in order; lines that do not parse (a line cut by a
    crash) are skipped; nothing when the file does not exist yet."""
    path = Path(run_dir) / METRICS
    if not path.is_file():
        return
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict):
            yield record



def final_eval_metrics(run_dir: str | os.PathLike) -> tuple[int | None, dict[str, float]]:
    """(step, numeric metrics) of the last eval record of ``metrics.jsonl`` ((None, {}) without one);
    the last wins, as a resumed run may repeat steps."""
    last: dict[str, Any] | None = None
    for record in iter_metric_records(run_dir):
        if record.get("split") == "eval":
            last = record
    if last is None:
        return None, {}
    metrics = {k: v for k, v in last.items() if k not in ("step", "split") and isinstance(v, (int, float)) and not isinstance(v, bool)}
    return last.get("step"), metrics


def truncate_metrics(path: str | os.PathLike, *, after_step: int) -> None:
    """Drop records of ``metrics.jsonl`` past ``after_step``: a resumed run logs those steps again,
    and a reader must not see a step twice."""
    path = Path(path)
    if not path.exists():
        return
    keep = [line for line in path.read_text().splitlines() if line.strip() and json.loads(line)["step"] <= after_step]
    atomic_write_text(path, "".join(line + "\n" for line in keep))


# --------------------------------------------------------------------------- a run's directory, made ready
def _inside(path: Path, directory: Path) -> bool:
    """Whether ``path`` is ``directory`` or lies inside it (symlinks resolved)."""
    path, directory = path.resolve(), directory.resolve()
    return path == directory or directory in path.parents


def prepare_run_dir(run_dir: Path, *, resume: bool, overwrite: bool, is_main: bool, keep: dict | None = None) -> None:
    """Make ``run_dir`` ready for one run, or raise ValueError saying why it is not.

    A non-empty directory holds an earlier run: writing a second run into it mixes metrics.jsonl,
    overwrites run_config.json and lets keep-last pruning delete the other run's checkpoints, so it
    is refused unless ``resume`` (continue it) or ``overwrite`` (delete it, after saying so). ``keep``
    names paths (``{field: path}``) that ``overwrite`` must never delete. Every rank calls this before
    any rank writes into the directory (rank 0 writes nothing there before the engine's first
    collective), so every rank sees the same directory and raises the same error.
    """
    check_output_dir_path(run_dir)
    try:
        # the run lock (zcvae.lock) is this run's own, taken before this check
        entries = sorted(p.name for p in run_dir.iterdir() if p.name != LOCK_FILE) if run_dir.is_dir() else []
    except FileNotFoundError:
        entries = []  # rank 0 deleted it for --overwrite while another rank looked
    except OSError as err:
        raise ValueError(f"output_dir {str(run_dir)!r} cannot be read: {err.strerror}") from None
    if entries and not resume:
        if not overwrite:
            raise ValueError(
                f"output_dir {str(run_dir)!r} is not empty (it holds {', '.join(entries[:4])}{' ...' if len(entries) > 4 else ''}): "
                f"pass --resume auto to continue that run, or --overwrite to delete it and start again, "
                f"or choose another --output-dir"
            )
        if not any(name in entries for name in (RUN_CONFIG, METRICS, CHECKPOINTS, "tensorboard")):
            raise ValueError(f"--overwrite deletes only a zcvae run directory; output_dir {str(run_dir)!r} holds other files "
                             f"({', '.join(entries[:4])}): choose another --output-dir")
        for name, path in (keep or {}).items():
            if path and Path(path).exists() and _inside(Path(path), run_dir):
                raise ValueError(f"--overwrite would delete {name} {str(path)!r}, which lies inside output_dir {str(run_dir)!r}")
        if is_main:
            logger.warning(f"[run] --overwrite: deleting the earlier run in {run_dir} ({', '.join(entries[:4])}{' ...' if len(entries) > 4 else ''})")
            # moved aside first, so a crash mid-delete leaves no half-deleted run that looks like a run; entry
            # by entry (the files that make it a run first), as the run lock inside must stay where it is
            doomed = run_dir.with_name(f"{run_dir.name}.deleting-{os.getpid()}")
            doomed.mkdir()
            for name in sorted(entries, key=lambda n: n not in (RUN_CONFIG, CHECKPOINTS)):
                os.replace(run_dir / name, doomed / name)
            shutil.rmtree(doomed)
    if is_main:
        try:
            run_dir.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise ValueError(f"output_dir {str(run_dir)!r} cannot be created: {err.strerror}") from None
    if run_dir.is_dir() and not os.access(run_dir, os.W_OK | os.X_OK):
        raise ValueError(f"output_dir {str(run_dir)!r} is not writable")


def check_output_dir_path(run_dir: Path) -> None:
    """ValueError when ``run_dir`` is, or lies under, an existing file."""
    for parent in (run_dir, *run_dir.parents):
        if parent.exists() and not parent.is_dir():
            where = "is an existing file" if parent == run_dir else f"lies under {str(parent)!r}, which is a file"
            raise ValueError(f"output_dir {str(run_dir)!r} {where}; choose a directory with --output-dir")


# --------------------------------------------------------------------------- caches
def cache_root() -> Path:
    """zcvae's cache directory (``$ZCVAE_CACHE``, else ``~/.cache/zcvae``)."""
    return Path(os.environ.get("ZCVAE_CACHE", Path.home() / ".cache" / "zcvae"))


def builtin_backbone_dir(task: str | None) -> Path:
    """Where the built-in tiny backbone pretrained on ``task`` is cached."""
    return cache_root() / "backbones" / f"{task or 'default'}"
