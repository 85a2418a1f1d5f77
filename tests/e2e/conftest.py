"""Shared fixtures of the end-to-end tests: a tiny backbone pretrained through the real CLI, once; the CLI
in a fresh process; a copy of a run directory."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

TINY_PRETRAIN = [
    "--max-steps", "40", "--num-train-examples", "512", "--num-val-examples", "32",
    "--hidden-size", "32", "--num-layers", "2", "--num-heads", "4", "--intermediate-size", "64",
]


def run_cli(*args, cwd=None, check=True, timeout=600, env=None):
    """Run ``python -m zcvae ARGS`` in a fresh process; return the CompletedProcess."""
    full_env = {**os.environ, "ZCVAE_CACHE": str(Path(cwd or ".") / ".cache"), "TOKENIZERS_PARALLELISM": "false", **(env or {})}
    proc = subprocess.run([sys.executable, "-m", "zcvae", *map(str, args)], cwd=cwd, capture_output=True, text=True, timeout=timeout, env=full_env)
    if check and proc.returncode != 0:
        raise AssertionError(f"zcvae {' '.join(map(str, args))} exited {proc.returncode}\nstdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-5000:]}")
    return proc


@pytest.fixture(scope="session")
def cli():
    return run_cli


@pytest.fixture(scope="session")
def tiny_backbone(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("backbone") / "bb"
    run_cli("pretrain", "--task", "copy", "--output-dir", out, *TINY_PRETRAIN)
    return out


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """Private backbone cache for in-process calls (the default backbone is never built here)."""
    cache = tmp_path_factory.mktemp("cache")
    old = os.environ.get("ZCVAE_CACHE")
    os.environ["ZCVAE_CACHE"] = str(cache)
    yield cache
    if old is None:
        os.environ.pop("ZCVAE_CACHE", None)
    else:
        os.environ["ZCVAE_CACHE"] = old


@pytest.fixture
def copy_of(tmp_path):
    """``copy_of(run_dir) -> Path``: a copy of a (shared, module-scoped) run directory that a test may change."""

    def make(run_dir: Path) -> Path:
        target = tmp_path / "copy"
        shutil.copytree(run_dir, target)
        return target

    return make
