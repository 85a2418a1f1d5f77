"""Named run presets: config files that ship inside the package, so ``--config NAME`` works from any
directory and from a pip install (``zcvae train --config late-decisions``).

Each preset is one YAML file here (flat config keys, as ``--config FILE`` reads them); the file is the
preset's only home: the verdict's suggestions, the demo's arms and ``launch/configs/`` (a link) read it,
through :func:`zcvae.config.load_config_file`, which resolves a name to its file here. This package only
finds the files, so that it sits below ``config`` and everything can use it.
Flags given with ``--config NAME`` win over the preset's keys, as they do over a file's.
"""

from __future__ import annotations

from pathlib import Path

_HERE = Path(__file__).resolve().parent

# The sum-mode recipe for strategies that part late in y (docs/results/late-decisions.md).
LATE_DECISIONS = "late-decisions"
# What `zcvae train` runs when no objective flag is given (zcvae.config.DEFAULT_PRESET; docs/guide/objective-and-presets.md, "The default preset").
DEFAULT = "default"
# The objective presets (``--objective NAME``): term weights by the terms' abbreviations, one file for all of them
# (zcvae.config.OBJECTIVE_PRESETS reads it). Not a run preset: ``--config objectives`` is no preset name.
OBJECTIVES = "objectives"


def preset_names() -> list[str]:
    """The run presets that ship with this install."""
    return sorted(p.stem for p in _HERE.glob("*.yaml") if p.stem != OBJECTIVES)


def objective_presets_path() -> Path:
    """The file of the objective presets (``--objective NAME``)."""
    return _HERE / f"{OBJECTIVES}.yaml"


def preset_path(name: str) -> Path | None:
    """The file of preset ``name``, or None when no preset has that name."""
    path = _HERE / f"{name}.yaml"
    return path if name in preset_names() else None
