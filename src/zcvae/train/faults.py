"""Fault injection for the crash tests: a documented environment interface, off unless set.

    ZCVAE_DEBUG_KILL_AT_STEP=k          SIGKILL every rank right after checkpoint k is complete
    ZCVAE_DEBUG_KILL_IN_SAVE_AT_STEP=k  SIGKILL every rank after the files of checkpoint k are
                                        written but before its COMPLETE marker (a crash mid-save)
    ZCVAE_DEBUG_ENOSPC_AT_STEP=k        raise OSError(ENOSPC) at the same point of checkpoint k, as a
                                        disk that fills during the save would (tests/e2e/test_faults.py)

SIGKILL leaves no chance to clean up, like a lost node; tests/e2e/test_resume.py checks that
``--resume auto`` recovers from both. The trainer passes :func:`fault_injection_from_env` to
``CheckpointManager(on_event=...)``; the checkpoint code itself knows nothing of it.
"""

from __future__ import annotations

import errno
import os
import signal
from collections.abc import Callable

# CheckpointManager event -> the variable that kills at it
EVENTS = {"files_written": "ZCVAE_DEBUG_KILL_IN_SAVE_AT_STEP", "complete": "ZCVAE_DEBUG_KILL_AT_STEP"}
ENOSPC_VARIABLE = "ZCVAE_DEBUG_ENOSPC_AT_STEP"


def fault_injection_from_env(environ=os.environ) -> Callable[[str, int], None] | None:
    """A checkpoint event callback that SIGKILLs this process where the environment asks; None when
    no variable is set. ValueError naming the variable when its value is not an integer step."""
    kill_at: dict[str, int] = {}
    for event, variable in (*EVENTS.items(), ("enospc", ENOSPC_VARIABLE)):
        value = environ.get(variable, "").strip()
        if value:
            try:
                kill_at[event] = int(value)
            except ValueError:
                raise ValueError(f"{variable}={value!r}: expected an integer checkpoint step") from None
    if not kill_at:
        return None

    def on_event(event: str, step: int) -> None:
        if kill_at.get(event) == step:
            os.kill(os.getpid(), signal.SIGKILL)
        if event == "files_written" and kill_at.get("enospc") == step:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC) + " (injected by " + ENOSPC_VARIABLE + ")")

    return on_event
