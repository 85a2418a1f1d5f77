"""DeepSpeed's just-in-time C++ extensions without the silent hang of a stale build lock.

On CPU, ``deepspeed.init_distributed`` builds ``deepspeed_shm_comm`` with
``torch.utils.cpp_extension.load``, under a ``lock`` file in the extension's build directory
(``torch.utils.file_baton.FileBaton``). A process killed during that build leaves the lock, and every
later process waits on it forever, printing nothing. DeepSpeed has no switch to skip the build (its
``TorchBackend`` builds the op whenever the accelerator offers it), so instead, before DeepSpeed
starts:

1. **One directory per environment and host.** Unless the user set ``TORCH_EXTENSIONS_DIR``, it is set
   to ``<torch's default root>/<py311_cpu>-<host>-<hash of sys.prefix and the torch version>``. Two
   virtualenvs no longer rebuild in turn over one directory (their ``build.ninja`` differ), and every
   builder in it is a process of this host, so the check below can see it.
2. **A lock is judged before anyone waits on it.** A ``lock`` with no process of this host working in
   its build directory (a live build runs ninja and the compiler there) is waited on for at most
   :data:`STALE_AFTER_S` of its age. Then, in zcvae's own directory, it is stale for certain: it is
   removed, with one line. In a directory the user chose, another host might be building there, so the
   run stops with one line naming the file to remove instead.
"""

from __future__ import annotations

import hashlib
import logging
import os
import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path

logger = logging.getLogger(__name__)

__all__ = ["STALE_AFTER_S", "StaleBuildLock", "check_build_locks", "extensions_dir", "local_builders"]

# A live build keeps a process in its directory; a lock this old with none there was left by a killed build.
STALE_AFTER_S = 60.0
POLL_S = 1.0


class StaleBuildLock(ValueError):
    """A build lock that no process of this host holds, in a directory that another host may share."""


def extensions_dir(environ=os.environ) -> tuple[Path, bool]:
    """(the root torch builds extensions under, whether the user chose it): ``TORCH_EXTENSIONS_DIR`` if
    set, else zcvae's per-environment, per-host directory (set in ``environ`` by :func:`check_build_locks`)."""
    if environ.get("TORCH_EXTENSIONS_DIR"):
        return Path(environ["TORCH_EXTENSIONS_DIR"]), True
    import torch

    # torch's own default root (torch.utils.cpp_extension.get_default_build_root), read from ``environ``
    cache = environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    accelerator = f"cu{torch.version.cuda.replace('.', '')}" if torch.version.cuda else "cpu"
    key = hashlib.sha256(f"{os.path.realpath(sys.prefix)}\0{torch.__version__}".encode()).hexdigest()[:10]
    host = socket.gethostname().split(".")[0] or "host"
    return Path(cache).resolve() / "torch_extensions" / f"py{sys.version_info.major}{sys.version_info.minor}_{accelerator}-{host}-{key}", False


def local_builders(build_dir: Path) -> list[int] | None:
    """PIDs of this host's processes whose working directory is ``build_dir`` (ninja, the compiler);
    None where that cannot be known (no ``/proc``)."""
    proc = Path("/proc")
    if not (proc / "self" / "cwd").exists():
        return None
    target = os.path.realpath(build_dir)
    pids = []
    for entry in proc.iterdir():
        if entry.name.isdigit():
            try:
                if os.path.realpath(entry / "cwd") == target:
                    pids.append(int(entry.name))
            except OSError:  # gone, or not ours to read
                continue
    return pids


def check_build_locks(*, environ=os.environ, stale_after_s: float = STALE_AFTER_S,
                      clock: Callable[[], float] = time.time, sleep: Callable[[float], object] = time.sleep) -> Path:
    """Choose the extensions directory (see the module docstring) and clear its stale locks; returns it.

    Returns at once when no ``lock`` is there (the usual case). Raises :class:`StaleBuildLock` for a
    stale lock in a directory the user chose."""
    root, chosen = extensions_dir(environ)
    if not chosen:
        environ["TORCH_EXTENSIONS_DIR"] = str(root)
    for lock in sorted(root.glob("*/lock")) if root.is_dir() else ():
        while True:
            try:
                age = clock() - lock.stat().st_mtime
            except FileNotFoundError:
                break  # the build finished
            builders = local_builders(lock.parent)
            if builders:
                break  # a live build on this host: torch's own wait is the right one
            if age < stale_after_s:
                sleep(POLL_S)
                continue
            if chosen:
                raise StaleBuildLock(
                    f"extension build lock {lock} is {age:.0f} s old and no process on this host is building in {lock.parent}: "
                    f"a build was killed. Every DeepSpeed run would wait on it forever; if no other host builds there, remove it: rm {lock}")
            lock.unlink(missing_ok=True)
            logger.warning(f"[deepspeed] removed a stale extension build lock {lock} ({age:.0f} s old, no process building): "
                           f"a build was killed; this run builds it again")
            break
    return root
