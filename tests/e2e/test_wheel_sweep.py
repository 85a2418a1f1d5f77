"""The built wheel, installed into a fresh venv, renders a family's SLURM scripts from outside the source
tree: the template is package data, not a file found next to a checkout.

Offline: the wheel is built without build isolation or dependencies, and the venv sees the running
interpreter's site-packages for torch and the rest. Those may hold an editable zcvae (pointing at a
checkout's src/); the venv's own install must win, which the test asserts.

The running interpreter may itself be a venv or a conda env. `venv --system-site-packages` would show the
new venv the *base* interpreter's site-packages (where torch is often absent), so the new venv is made
without them and a .pth file adds the running interpreter's site directories after its own."""

import json
import os
import shutil
import site
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]


def _env() -> dict[str, str]:
    """No path into any checkout, no index: only the venv and the running interpreter's site-packages."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "VIRTUAL_ENV")}
    return {**env, "PIP_NO_INDEX": "1", "PIP_DISABLE_PIP_VERSION_CHECK": "1", "PYTHONNOUSERSITE": "1"}


def _running_site_dirs() -> list[str]:
    """The site directories the running interpreter imports from: its own site-packages (a venv's, a conda
    env's or the system's) and, where it reads it, the user site."""
    dirs = list(site.getsitepackages())
    if site.ENABLE_USER_SITE:
        dirs.append(site.getusersitepackages())
    return [d for d in dict.fromkeys(dirs) if Path(d).is_dir()]


def _make_venv(venv: Path, *, cwd: Path) -> Path:
    """A venv whose own site-packages comes first, then the running interpreter's site directories.

    site.addsitedir (not a bare path line) so that their own .pth files are read too, as they are for the
    running interpreter (editable installs, distutils-precedence)."""
    _run([sys.executable, "-m", "venv", venv], cwd=cwd)
    python = venv / "bin" / "python"
    purelib = _run([python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"], cwd=cwd).stdout.strip()
    lines = [f"import site; site.addsitedir({d!r})" for d in _running_site_dirs()]
    (Path(purelib) / "zz_running_interpreter.pth").write_text("\n".join(lines) + "\n")
    return python


def _run(args, *, cwd, timeout=600):
    proc = subprocess.run([str(a) for a in args], cwd=cwd, env=_env(), capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{args}\n{proc.stdout}\n{proc.stderr}"
    return proc


def test_installed_wheel_renders_a_family_outside_the_source_tree(tmp_path):
    # build from a copy, so that the build's egg-info and build/ never land in the checkout
    source = tmp_path / "source"
    shutil.copytree(REPO / "src", source / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source / name)
    wheels = tmp_path / "wheels"
    _run([sys.executable, "-m", "pip", "wheel", "--no-build-isolation", "--no-deps", "--no-index", "-w", wheels, source], cwd=tmp_path)
    (wheel,) = wheels.glob("zcvae-*.whl")

    venv = tmp_path / "venv"
    python = _make_venv(venv, cwd=tmp_path)
    # --ignore-installed: a zcvae in the running interpreter's site-packages (editable or not) is not this wheel
    _run([python, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-index", "--ignore-installed", wheel], cwd=tmp_path)
    shutil.rmtree(source)  # nothing of the checkout's copy is left to import from

    work = tmp_path / "elsewhere"
    work.mkdir()
    where = _run([python, "-c", "import zcvae, zcvae.sweep.slurm as s; print(zcvae.__file__); print(s.DEFAULT_TEMPLATE)"], cwd=work)
    module_file, template = (Path(line) for line in where.stdout.split())
    site = venv.resolve()
    assert module_file.resolve().is_relative_to(site), f"zcvae came from {module_file}, not the venv's own install"
    assert template.resolve().is_relative_to(site) and template.is_file()

    family = work / "family.yaml"
    family.write_text(json.dumps({
        "pretrain": {"backbone": "smollm2", "max_steps": 5},
        "base": {"task": "copy", "max_steps": 3, "reconstruction_loss_token_aggregation_mode": "mean"},
        "grid": {"seed": [0, 1]},
    }))
    _run([venv / "bin" / "zcvae", "sweep", family.name, "--out", "slurm"], cwd=work)
    out = work / "slurm"
    records = [json.loads(line) for line in (out / "manifest.jsonl").read_text().splitlines()]
    assert [r["kind"] for r in records] == ["stage", "run", "run"]
    stage_text = (out / "entangled-copy.sbatch").read_text()
    assert "#SBATCH --requeue" in stage_text and '-m zcvae pretrain "${TRAIN_ARGS[@]}"' in stage_text
    for record in records[1:]:
        assert '-m zcvae train "${TRAIN_ARGS[@]}"' in (out / record["script"]).read_text()
    assert "--dependency=afterok:" in (out / "submit.sh").read_text()
