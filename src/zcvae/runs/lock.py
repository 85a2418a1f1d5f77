"""One writer per run directory: an exclusive lock on ``RUN_DIR/zcvae.lock``, held for the whole run.

Two ``zcvae train`` processes in one ``--output-dir`` (a SLURM array whose runs collide on one name, a
job resubmitted while the old one still runs) would interleave ``metrics.jsonl`` and prune each other's
checkpoints. Rank 0 therefore takes this lock before anything in the directory is read or written, and
before the model is loaded, so the second writer is refused at once, naming the holder.

The lock is filelock's. Where the filesystem has ``flock``, ``UnixFileLock``: the kernel releases it when
the holder dies, however it dies, so a file left by a killed run is simply taken over; the holder writes
``{"host", "pid", "started", "command"}`` into it for the refusal to name. Where it has none (some network
filesystems), ``SoftFileLock``: the exclusive creation of the file is the lock, and the file holds
filelock's record (pid, host, process start time), which zcvae must not overwrite since other contenders
read it. filelock takes over a record of a dead process on this host (the start time tells a reused pid
apart) and never judges a holder on another host: the refusal names it and says when removing it is safe.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import socket
import sys
import tempfile
import time
from pathlib import Path

from filelock import BaseFileLock, SoftFileLock, Timeout, UnixFileLock

LOCK_FILE = "zcvae.lock"
# errnos by which flock says "not supported here". filelock's own fallback knows only ENOSYS, but NFS
# without a lock daemon answers ENOLCK, so the kind of lock is chosen here.
_NO_FLOCK = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL}
# A contender that opened the file just before the holder unlinked it locks a dead inode; filelock drops
# it and retries on the new file for this long.
_RETRY_S = 0.5


def _has_flock(directory: Path) -> bool:
    try:
        import fcntl
    except ImportError:
        return False
    with tempfile.TemporaryFile(dir=directory) as probe:
        try:
            fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            if err.errno not in _NO_FLOCK:
                raise
            return False
    return True


def read_holder(path: Path) -> dict | None:
    """The holder a lock file names (zcvae's JSON record, or the pid and host lines of a SoftFileLock's);
    None while the file is unreadable or still being written."""
    try:
        text = path.read_text()
        record = json.loads(text)
    except OSError:
        return None
    except ValueError:
        pid, host, *_ = text.split("\n") + [""]
        started = time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(path.stat().st_mtime))
        record = {"pid": int(pid), "host": host, "started": started} if pid.isdigit() else None
    return record if isinstance(record, dict) and record else None


class RunLock:
    """An exclusive lock on one run directory; :meth:`acquire` it, :meth:`release` it once.

    ``release`` removes the lock file, and the directory too when this lock created it and nothing
    else was written there (a run refused before its first write leaves no trace).
    """

    def __init__(self, run_dir: str | os.PathLike):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / LOCK_FILE
        self._lock: BaseFileLock | None = None
        self._created_dir = False
        self.mode: str | None = None  # "flock" or "soft"

    def acquire(self) -> "RunLock":
        """Take the lock or raise ValueError naming the holder (or why the directory cannot be used)."""
        try:
            self._created_dir = not self.run_dir.exists()
            self.run_dir.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise ValueError(f"output_dir {str(self.run_dir)!r} cannot be created: {err.strerror}") from None
        try:
            self.mode = "flock" if _has_flock(self.run_dir) else "soft"
            # no fallback inside filelock: the JSON record must never be written into a soft lock's file
            lock = (UnixFileLock(self.path, thread_local=False, fallback_to_soft=False) if self.mode == "flock"
                    else SoftFileLock(self.path, thread_local=False))
            lock.acquire(timeout=_RETRY_S)
        except Timeout:
            raise ValueError(self._held_message()) from None
        except OSError as err:
            self._cleanup_dir()
            raise ValueError(f"output_dir {str(self.run_dir)!r} is not writable: cannot create the lock file "
                             f"{str(self.path)!r}: {err.strerror}") from None
        self._lock = lock
        if self.mode == "flock":
            record = {"host": socket.gethostname(), "pid": os.getpid(), "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                      "command": sys.argv}
            try:
                self.path.write_text(json.dumps(record) + "\n")  # the inode held: no one replaces it meanwhile
            except OSError as err:
                self.release()
                raise ValueError(f"cannot write the lock file {str(self.path)!r}: {err.strerror}") from None
        return self

    def _held_message(self) -> str:
        for _ in range(20):  # the holder writes its record just after taking the lock: give it a moment
            if (holder := read_holder(self.path)) is not None:
                break
            time.sleep(0.05)
        named = "an unknown holder (the lock file is unreadable or still being written)" if holder is None else \
            f"pid {holder.get('pid')} on host {holder.get('host')!r} (since {holder.get('started')})"
        message = (f"output_dir {str(self.run_dir)!r} is in use by another zcvae run: {named} holds {str(self.path)!r}; "
                   f"wait for it to finish, or choose another --output-dir")
        if self.mode == "flock":
            return message
        # filelock takes over its own record of a dead process on this host, so such a record still here is
        # one it cannot read (JSON, from a zcvae before filelock): reported, never removed silently
        pid = (holder or {}).get("pid")
        if holder and holder.get("host") == socket.gethostname() and isinstance(pid, int) and not _pid_alive(pid):
            return (f"output_dir {str(self.run_dir)!r} holds a stale lock: {str(self.path)!r} names pid {pid} on this "
                    f"host ({holder['host']}), which is no longer running (this filesystem has no flock, so the lock "
                    f"outlived it). If no other zcvae run uses this directory, remove it: rm {str(self.path)!r}")
        return message + " (on a filesystem without flock a lock left by a dead process on another host looks the same: " \
                         f"remove {str(self.path)!r} only once you know that process is gone)"

    def release(self) -> None:
        if self._lock is None:
            return
        if self.mode == "flock":
            # unlinked while still held, so whoever locks this inode next finds it dead and filelock retries
            # on the path's new file (a SoftFileLock removes its file itself)
            with contextlib.suppress(OSError):  # a read-only or full filesystem: the flock still goes on release
                self.path.unlink()
        self._lock.release()
        self._lock = None
        self._cleanup_dir()

    def _cleanup_dir(self) -> None:
        if self._created_dir:
            with contextlib.suppress(OSError):
                self.run_dir.rmdir()  # only if empty

    def __enter__(self) -> "RunLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # exists, owned by someone else
    return True
