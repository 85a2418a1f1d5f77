"""The CLI run in the test's own process (the end-to-end tests that need no fresh interpreter)."""

from __future__ import annotations

from zcvae.commands.cli import main as cli_main


def zcvae(capsys, *args) -> tuple[int, str]:
    """(exit code, stdout + stderr) of ``zcvae ARGS`` run in this process."""
    capsys.readouterr()
    try:
        rc = cli_main([str(a) for a in args])
    except SystemExit as exit_:  # argparse
        rc = exit_.code
    captured = capsys.readouterr()
    return rc, captured.out + captured.err
