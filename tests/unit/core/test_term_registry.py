"""CONTRIBUTING's "Adding a seventh reconstruction term", followed literally: one registry entry, and the term
reaches the CLI flags, the run name, the logged metrics, the objective and the aggregate table.

The config dataclasses take their weight fields from the registry when they are defined, so the term is
registered in a fresh interpreter before zcvae.config is imported; this process's registry is never
touched (the fixture checks that it is the same afterwards).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from zcvae.core.terms import RECONSTRUCTION_TERM_REGISTRY, ReconstructionTerm, register_term

# The recipe's one step: a registry entry (here registered by code that runs before the rest of zcvae).
_WITH_SEVENTH_TERM = """
import sys
from zcvae import ReconstructionTerm, register_term
register_term(ReconstructionTerm(
    "dummy_reconstruction_loss", "dummy_reconstruction_weight", "dummy",
    lambda parts: 2.0 * parts.raw_B,
    "twice reconstruction_loss (a test term).",
))
from zcvae.commands.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.fixture
def registry_unchanged():
    before = list(RECONSTRUCTION_TERM_REGISTRY)
    yield
    assert RECONSTRUCTION_TERM_REGISTRY == before
    RECONSTRUCTION_TERM_REGISTRY[:] = before


def _zcvae_with_seventh_term(*args, cwd):
    env = {**os.environ, "ZCVAE_CACHE": str(cwd / ".cache"), "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", _WITH_SEVENTH_TERM, *map(str, args)], cwd=cwd, capture_output=True,
                          text=True, timeout=600, env=env)
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-5000:]}"
    return proc.stdout


def test_a_seventh_term_reaches_flags_names_logs_and_aggregate(tiny_backbone, tmp_path, registry_unchanged):
    assert "--dummy-reconstruction-weight" in _zcvae_with_seventh_term("train", "--help", cwd=tmp_path)

    run_dir = tmp_path / "run"
    _zcvae_with_seventh_term(
        "train", "--backbone", tiny_backbone(), "--task", "copy", "--output-dir", run_dir, "--max-steps", "2",
        "--log-every", "1", "--micro-batch-size", "4", "--num-train-examples", "16", "--num-val-examples", "8",
        "--num-eval-decode-examples", "2", "--no-progress-bar", "--kl-weight", "0",
        "--reconstruction-weight", "1", "--dummy-reconstruction-weight", "0.5", cwd=tmp_path,
    )
    # run_config.json keeps the config in sections: the new weight sits in the objective section
    config = json.loads((run_dir / "run_config.json").read_text())["config"]
    objective = config["objective"]
    assert objective["dummy_reconstruction_weight"] == 0.5 and objective["objective"] == "custom"
    assert "dummy-0.5" in config["run"]["run_name"].split("_")

    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["split"] == "train"]
    evals = [r for r in records if r["split"] == "eval"]
    assert [r["step"] for r in train] == [1, 2] and evals
    for record in (*train, evals[-1]):
        assert record["dummy_reconstruction_loss"] == pytest.approx(2.0 * record["reconstruction_loss"], rel=1e-5)
    # the weight reaches J: loss = 1 * raw + 0.5 * dummy = 2 * raw (beta 0, no auxiliaries)
    for record in train:
        assert record["loss"] == pytest.approx(2.0 * record["reconstruction_loss"], rel=1e-4)

    table = _zcvae_with_seventh_term("aggregate", run_dir, cwd=tmp_path)
    assert "dummy=0.5" in table and "raw=1" in table


def test_register_term_rejects_a_used_abbreviation(registry_unchanged):
    with pytest.raises(ValueError, match="abbreviation 'raw'"):
        register_term(ReconstructionTerm("other_loss", "other_weight", "raw", lambda parts: parts.raw_B, "a clash."))
