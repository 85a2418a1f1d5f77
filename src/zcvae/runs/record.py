"""What a run records about itself: run_config.json's contents besides the config, and the resume's notes.

``run_metadata`` is written once a run has started (after a resume, with ``resume_changes_record`` merged in);
``zcvae.runs.rundir.read_run_record`` reads it back. ``resume_note`` is what the ``[resume]`` line adds.
The config and the run's parts (TrainConfig, the splits, the encoding reports, the reference) come in as
arguments: nothing above runs/ is imported here.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from zcvae._version import __version__
from zcvae.runs.rundir import read_run_record


def run_metadata(cfg, backbone, world_size, splits, train_report, val_report, reference, *, backbone_conversion: dict | None,
                 cpu=None, reference_health=None) -> dict:
    """run_config.json of a training run: the config (nested by section) and what the run was started with
    (backbone, its conversion record, c_base and the reference's health, the data kept, the CPU policy, versions,
    git revision, command line). ``backbone_conversion``: ``zcvae.backbone.convert.conversion_record(backbone)``."""
    return {
        "config": cfg.to_sections(),  # nested; TrainConfig.from_dict and read_run_record read it flat too
        "objective": cfg.objective.objective,
        "kl_weight_factor": 1.0 if cfg.objective.kl_weight_factor is None else cfg.objective.kl_weight_factor,
        "reconstruction_weight_factor": 1.0 if cfg.objective.reconstruction_weight_factor is None else cfg.objective.reconstruction_weight_factor,
        # measured at start-up: whether a subnormal times 1 came out 0, and the threads the steps ran on
        "cpu": cpu,
        "backbone": str(Path(backbone).resolve()),
        # the GGUF file and quantization the weights were dequantized from; None for a plain checkpoint
        "backbone_conversion": backbone_conversion,
        "reconstruction_loss_token_aggregation_mode": cfg.objective.reconstruction_loss_token_aggregation_mode,
        "c_base": reference.c_base.to_dict(),
        "reference_policy": reference.policy,
        # zcvae.reference.health: markers the backbone lacked, c_base against its floor or threshold, warnings
        "reference_health": reference_health,
        "world_size": world_size,
        "data": {
            "source": splits.source,
            "train": {"examples": train_report.num_examples, "kept": train_report.num_kept, "skipped": train_report.num_skipped, "x_truncated": train_report.num_x_truncated, "unknown_tokens": train_report.num_unknown_tokens},
            "val": {"examples": val_report.num_examples, "kept": val_report.num_kept, "skipped": val_report.num_skipped, "x_truncated": val_report.num_x_truncated, "unknown_tokens": val_report.num_unknown_tokens},
        },
        "versions": package_versions(),
        "git_revision": git_revision(),
        "command": sys.argv,
    }


def resume_changes_record(run_dir: Path, state: dict | None) -> dict:
    """``{"resume_changes": [...]}``: the earlier run_config.json's list plus this resume's allowed changes
    (each ``{field, from, to, step}``), so the record says which value held over which steps."""
    earlier = []
    if state is not None:
        try:
            earlier = list(read_run_record(run_dir).get("resume_changes", []))
        except ValueError:
            earlier = []
        # a step replayed after a crash drops the changes recorded from a later step
        earlier = [c for c in earlier if c.get("step", 0) <= state["step"]]
        earlier += state.get("changes", [])
    return {"resume_changes": earlier} if earlier else {}


def resume_note(state: dict, cfg) -> str:
    """What the resume line adds: a raised ``max_steps`` (the schedules stretch) and allowed changes."""
    saved = (state.get("meta") or {}).get("config") or {}
    notes = []
    if saved.get("max_steps") not in (None, cfg.optimization.max_steps):
        notes.append(f"max_steps {saved['max_steps']} -> {cfg.optimization.max_steps}: the schedule's fractions (learning-rate warm-up "
                     f"and decay, KL delay/ramp/cycles) now apply to the new total of {cfg.optimization.max_steps} steps")
    for change in state.get("changes", []):
        notes.append(f"{change['field']} {change['from']!r} -> {change['to']!r} from step {change['step']} (--resume-allow-change)")
    return ("; " + "; ".join(notes)) if notes else ""


def package_versions() -> dict[str, str]:
    import importlib.metadata as md

    out = {"python": sys.version.split()[0], "zcvae": __version__}
    for name in ("torch", "transformers", "peft", "deepspeed", "safetensors", "tensorboard"):
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            out[name] = "not installed"
    return out


def git_revision() -> str | None:
    try:
        here = Path(__file__).resolve().parent
        rev = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, timeout=5)
        return rev.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None
