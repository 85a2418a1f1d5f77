"""One writer per run directory: an exclusive lock on ``RUN_DIR/zcvae.lock``, held for the whole run.

Two ``zcvae train`` processes in one ``--output-dir`` (a SLURM array whose runs collide on one name, a
job resubmitted while the old one still runs) would interleave ``metrics.jsonl`` and prune each other's
checkpoints. Rank 0 therefore takes this lock before anything in the directory is read or written, and
before the model is loaded, so the second writer is refused at once, naming the holder.

The lock is ``flock(LOCK_EX | LOCK_NB)`` on the file: the kernel releases it when the holder dies, however
it dies, so a leftover file from a killed run is simply taken over. Where the filesystem does not
support ``flock`` (some network filesystems), the file is created with ``O_CREAT | O_EXCL`` instead:
then a leftover file cannot be told from a live lock by the kernel, so a holder that is a dead pid on
this host is *reported* with the command that clears it, and a holder on another host is never judged
at all. Nothing is ever removed silently.

The file holds ``{"host", "pid", "started", "command"}`` so the refusal can name the holder.
"""

from __future__ import annotations

import errno
import json
import os
import socket
import sys
import time
from pathlib import Path

LOCK_FILE = "zcvae.lock"
# errnos by which flock says "not supported here" rather than "held by someone else"
_NO_FLOCK = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL}


def _holder_text(path: Path) -> str:
    try:
        holder = json.loads(path.read_text() or "{}")
    except (OSError, ValueError):
        return "an unknown holder (the lock file is unreadable)"
    if not isinstance(holder, dict) or not holder:
        return "an unknown holder (the lock file is empty: it is being taken right now)"
    return f"pid {holder.get('pid')} on host {holder.get('host')!r} (since {holder.get('started')})"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    return True


class RunLock:
    """An exclusive lock on one run directory; :meth:`acquire` it, :meth:`release` it once.

    ``release`` removes the lock file, and the directory too when this lock created it and nothing
    else was written there (a run refused before its first write leaves no trace).
    """

    def __init__(self, run_dir: str | os.PathLike):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / LOCK_FILE
        self._fd: int | None = None
        self._created_dir = False
        self.mode: str | None = None  # "flock" or "excl"

    # ---------------------------------------------------------------- acquire
    def acquire(self) -> "RunLock":
        """Take the lock or raise ValueError naming the holder (or why the directory cannot be used)."""
        try:
            self._created_dir = not self.run_dir.exists()
            self.run_dir.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise ValueError(f"output_dir {str(self.run_dir)!r} cannot be created: {err.strerror}") from None
        for _ in range(10):
            try:
                # O_EXCL first: whether this process created the file decides the no-flock fallback
                try:
                    fd, created = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644), True
                except FileExistsError:
                    fd, created = os.open(self.path, os.O_RDWR), False
            except FileNotFoundError:
                continue  # removed between the two opens: try again
            except OSError as err:
                self._cleanup_dir()
                raise ValueError(f"output_dir {str(self.run_dir)!r} is not writable: cannot create the lock file "
                                 f"{str(self.path)!r}: {err.strerror}") from None
            try:
                import fcntl

                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except (ImportError, OSError) as err:
                unsupported = isinstance(err, ImportError) or err.errno in _NO_FLOCK
                if unsupported and created:  # no flock here: the O_EXCL create is the lock
                    self._fd, self.mode = fd, "excl"
                    self._write_holder(fd)
                    return self
                os.close(fd)
                if unsupported:
                    raise ValueError(self._held_message(excl=True)) from None
                if err.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    raise ValueError(self._held_message()) from None
                raise
            # The holder before us may have unlinked the file between our open and our flock: then we
            # locked an orphan inode while a third process may lock a new file. Lock what the path names.
            try:
                same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if same:
                self._fd, self.mode = fd, "flock"
                self._write_holder(fd)
                return self
            os.close(fd)
        raise ValueError(f"could not take the lock {str(self.path)!r}: it was replaced ten times in a row")

    def _write_holder(self, fd: int) -> None:
        record = {"host": socket.gethostname(), "pid": os.getpid(), "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                  "command": sys.argv}
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, (json.dumps(record) + "\n").encode(), 0)
        except OSError as err:
            self.release()
            raise ValueError(f"cannot write the lock file {str(self.path)!r}: {err.strerror}") from None

    def _held_message(self, *, excl: bool = False) -> str:
        for _ in range(20):  # the holder writes its record just after taking the lock: give it a moment
            if _holder_text(self.path).startswith("pid "):
                break
            time.sleep(0.05)
        holder = _holder_text(self.path)
        message = (f"output_dir {str(self.run_dir)!r} is in use by another zcvae run: {holder} holds {str(self.path)!r}; "
                   f"wait for it to finish, or choose another --output-dir")
        if not excl:
            return message
        try:
            record = json.loads(self.path.read_text() or "{}")
        except (OSError, ValueError):
            record = {}
        if record.get("host") == socket.gethostname() and isinstance(record.get("pid"), int) and not _pid_alive(record["pid"]):
            return (f"output_dir {str(self.run_dir)!r} holds a stale lock: {str(self.path)!r} names pid {record['pid']} on this "
                    f"host ({record['host']}), which is no longer running (this filesystem has no flock, so the lock "
                    f"outlived it). If no other zcvae run uses this directory, remove it: rm {str(self.path)!r}")
        return message + " (on a filesystem without flock a lock left by a dead process on another host looks the same: " \
                         f"remove {str(self.path)!r} only once you know that process is gone)"

    # ---------------------------------------------------------------- release
    def release(self) -> None:
        if self._fd is None:
            return
        # unlink while still holding it: no one can lock this inode after we let go
        try:
            self.path.unlink()
        except FileNotFoundError:
            pass
        except OSError:
            pass  # a read-only or full filesystem: the kernel still drops the flock on close
        os.close(self._fd)
        self._fd = None
        self._cleanup_dir()

    def _cleanup_dir(self) -> None:
        if self._created_dir:
            try:
                self.run_dir.rmdir()  # only if empty
            except OSError:
                pass

    def __enter__(self) -> "RunLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()
