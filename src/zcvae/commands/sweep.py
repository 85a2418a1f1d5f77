"""Expand a run family into named runs and render one SLURM script per run.

    python launch/sweep.py FAMILY.yaml --out DIR [--dry-run] [--defaults {auto,config,base}] [--force]
    zcvae sweep FAMILY.yaml --local --output-dir DIR [--task T] [--jobs N] [--dry-run]   # no SLURM

``--local`` (:func:`local_plan`, :func:`run_local`) trains the runs on this machine instead, one after
another (or ``--jobs N`` at once, one thread each), skips runs whose final evaluation exists, and prints
the aggregate table with seed groups as mean ± std.

A family file (YAML or JSON) holds::

    base:  {field: value, ...}           # config fields shared by every run
    grid:  {field: [v1, v2, ...], ...}   # cartesian product, in file order
    zip:   [{field_a: [a1, a2], field_b: [b1, b2]}, ...]   # each group varies together (optional)
    slurm: {nodes: 2, gpus_per_node: 8, time: "24:00:00", partition: ..., ...}   # optional, see SlurmSettings
    description: "free text"             # optional

Each run's params are ``base`` overlaid with one grid/zip assignment, plus ``slurm.engine`` as ``engine``,
``run_name`` (so the trainer records the sweep's name, not one derived against other defaults) and a per-run
``output_dir`` = ``<base output_dir, else the defaults', else runs>/<run_name>``. The aggregation mode is
always written into the params explicitly, even when the family leaves it at its default (the mode
must be explicit in slurm params, run names and tables).

Names come from :func:`zcvae.runs.naming.run_name` (with every grid and zip field always named, so the names of
one family have one shape) against a defaults dict whose source is explicit
(:func:`resolve_defaults`): ``config`` = ``dataclasses.asdict(zcvae.config.TrainConfig())``; ``base`` = the
family's own ``base`` (so names show only what the grid varies); ``auto`` = ``config`` if importable, else
``base``. The manifest records which one was used: :func:`zcvae.runs.naming.parse_run_name` needs the same
defaults to read a name back.

Output: ``DIR/<run_name>.sbatch`` per run, ``DIR/manifest.jsonl`` (one JSON object per run: ``run_name``,
``script``, ``defaults_source``, ``params``) and ``DIR/logs/`` for the SLURM output files. Each script carries
its params twice: as the ``zcvae train`` flags and as one line ``# zcvae-params: {json}``
(:func:`recover_params`).

CLI values (:func:`params_to_flags`): ``--field-name value`` (snake case -> kebab case), floats as ``repr``
(exact); booleans as ``--field`` / ``--no-field``; lists as ``--field a b``; a ``None`` value is left out (the
config default applies; a ``None`` that differs from a non-``None`` default is refused).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import itertools
import json
import re
import shlex
import string
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from zcvae.runs.naming import AGGREGATION_MODE_FIELD, run_name

__all__ = [
    "Run",
    "SlurmSettings",
    "confound_warnings",
    "expand_family",
    "load_family",
    "local_main",
    "local_plan",
    "main",
    "params_to_flags",
    "parse_train_flags",
    "plan_runs",
    "recover_params",
    "recover_train_args",
    "render_script",
    "resolve_defaults",
    "run_finished",
    "run_local",
    "validate_family",
]

FAMILY_KEYS = ("base", "grid", "zip", "slurm", "description", "pretrain")
# Fields of a family's pretrain block that the sweep sets itself: the data comes from each run, the
# stage's directory is <output root>/entangled-<task or data file>.
PRETRAIN_DERIVED = ("task", "train_data", "val_data", "output_dir")
DEFAULTS_SOURCES = ("auto", "config", "base")
DEFAULT_TEMPLATE = Path(__file__).resolve().parents[3] / "launch" / "slurm.sbatch"
DEFAULT_OUTPUT_ROOT = "runs"
PARAMS_PREFIX = "# zcvae-params: "
_FIELD_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_FLAG_RE = re.compile(r"--[A-Za-z0-9][A-Za-z0-9-]*")


@dataclasses.dataclass(frozen=True)
class SlurmSettings:
    """The ``slurm`` section of a family file; unknown keys are rejected."""

    nodes: int = 1
    """Nodes per run; one torchrun per node."""
    gpus_per_node: int = 8
    """GPUs per node, and torchrun's ``--nproc_per_node``."""
    cpus_per_task: int = 8
    """CPUs for the one task (torchrun and its workers) on each node."""
    time: str = "24:00:00"
    """Wall-clock limit, in any form ``sbatch --time`` accepts."""
    partition: str | None = None
    account: str | None = None
    job_name_prefix: str = "zcvae"
    """The job name is ``<prefix>-<run_name>``."""
    extra_sbatch: tuple[str, ...] = ()
    """Further ``#SBATCH`` lines, e.g. ``--qos=high`` or ``#SBATCH --exclusive``."""
    engine: str | None = None
    """The training engine for every run (``--engine``); conflicts with a different ``engine`` in the params."""
    master_port: int = 29500
    """Rendezvous port on the head node (the job's ``MASTER_PORT`` environment variable overrides it)."""
    setup: tuple[str, ...] = ()
    """Shell lines run before the launch (``module load ...``, ``source .venv/bin/activate``)."""
    log_dir: str | None = None
    """Where SLURM writes ``%x-%j.out``; default ``<out>/logs`` (created by the sweep, as SLURM needs it)."""

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any] | None) -> SlurmSettings:
        raw = dict(raw or {})
        known = {f.name for f in dataclasses.fields(cls)}
        for key in raw:
            if key not in known:
                raise ValueError(f"slurm.{key}: unknown setting (known: {', '.join(sorted(known))})")
        for key in ("extra_sbatch", "setup"):
            if key in raw:
                if isinstance(raw[key], str) or not isinstance(raw[key], Sequence):
                    raise ValueError(f"slurm.{key}: must be a list of lines")
                raw[key] = tuple(raw[key])
        return cls(**raw)

    def __post_init__(self) -> None:
        for key in ("nodes", "gpus_per_node", "cpus_per_task", "master_port"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"slurm.{key}: must be a positive integer, got {value!r}")
        if isinstance(self.time, int):
            raise ValueError(f"slurm.time: quote it (\"24:00:00\"): YAML reads 24:00:00 as the number {self.time}")
        for key in ("time", "partition", "account", "job_name_prefix", "engine", "log_dir"):
            value = getattr(self, key)
            if value is not None and (not isinstance(value, str) or not value or re.search(r"\s", value)):
                raise ValueError(f"slurm.{key}: must be a non-empty string without whitespace, got {value!r}")
        for key in ("extra_sbatch", "setup"):
            for line in getattr(self, key):
                if not isinstance(line, str) or "\n" in line or "\r" in line:
                    raise ValueError(f"slurm.{key}: each entry must be a single line of text, got {line!r}")
        for line in self.extra_sbatch:
            if not (line.startswith("#SBATCH ") or line.startswith("--")):
                raise ValueError(f"slurm.extra_sbatch: {line!r} must start with '--' or '#SBATCH '")


@dataclasses.dataclass(frozen=True)
class Run:
    name: str
    params: dict[str, Any]
    pretrain: dict[str, Any] | None = None
    """The entangled stage this run's backbone comes from (``zcvae pretrain`` fields, its ``output_dir``
    is ``params["backbone"]``), from the family's ``pretrain`` block; None when the family has none."""


# ---- family files ---------------------------------------------------------------------------------------


class _FamilyLoader(yaml.SafeLoader):
    """YAML 1.1 reads ``1e-3`` (no dot) as a string; a sweep over learning rates means numbers."""


_FamilyLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)?(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789."),
)


def load_family(path: str | Path) -> dict[str, Any]:
    """Read and validate a family file (YAML, of which JSON is a subset; ``1e-3`` reads as a float)."""
    try:
        with open(path, encoding="utf-8") as f:
            family = yaml.load(f, Loader=_FamilyLoader)
    except OSError as err:
        raise ValueError(f"family file {str(path)!r} cannot be read: {err.strerror}") from None
    validate_family(family)
    return family


def _zip_groups(family: Mapping[str, Any]) -> list[dict[str, list]]:
    groups = family.get("zip") or []
    return [groups] if isinstance(groups, Mapping) else list(groups)


def validate_family(family: Any) -> None:
    """Raise ``ValueError`` naming the offending key for anything a family file must not contain."""
    if not isinstance(family, Mapping):
        raise ValueError(f"family: must be a mapping with keys {FAMILY_KEYS}, got {type(family).__name__}")
    for key in family:
        if key not in FAMILY_KEYS:
            raise ValueError(f"{key}: unknown top-level key in family file (allowed: {', '.join(FAMILY_KEYS)})")
    for section in ("base", "grid"):
        if not isinstance(family.get(section) or {}, Mapping):
            raise ValueError(f"{section}: must be a mapping of config field -> value")
    base, grid = family.get("base") or {}, family.get("grid") or {}
    for field in [*base, *grid]:
        if not isinstance(field, str) or not _FIELD_RE.fullmatch(field):
            raise ValueError(f"{field!r}: config field names are snake_case identifiers")
    for field, values in grid.items():
        if not isinstance(values, list):
            raise ValueError(f"grid.{field}: must be a list of values, got {values!r}")
        if not values:
            raise ValueError(f"grid.{field}: empty list (it would expand to no runs)")
    raw_zip = family.get("zip") or []
    if not isinstance(raw_zip, (Mapping, list)):
        raise ValueError("zip: must be a list of groups, each a mapping field -> list of values")
    seen: dict[str, int] = {}
    for index, group in enumerate(_zip_groups(family)):
        if not isinstance(group, Mapping) or not group:
            raise ValueError(f"zip[{index}]: must be a non-empty mapping field -> list of values")
        lengths = {}
        for field, values in group.items():
            if not isinstance(field, str) or not _FIELD_RE.fullmatch(field):
                raise ValueError(f"{field!r}: config field names are snake_case identifiers")
            if field in grid:
                raise ValueError(f"{field}: is both in grid and in zip[{index}]; vary it in one place")
            if field in seen:
                raise ValueError(f"{field}: is in zip[{seen[field]}] and zip[{index}]")
            seen[field] = index
            if not isinstance(values, list):
                raise ValueError(f"zip[{index}].{field}: must be a list of values, got {values!r}")
            if not values:
                raise ValueError(f"zip[{index}].{field}: empty list (it would expand to no runs)")
            lengths[field] = len(values)
        if len(set(lengths.values())) > 1:
            raise ValueError(f"zip[{index}]: lists must have equal lengths, got {lengths}")
    SlurmSettings.from_dict(family.get("slurm"))
    validate_pretrain_block(family.get("pretrain"), base=family.get("base") or {})


def validate_pretrain_block(block: Any, *, base: Mapping[str, Any]) -> None:
    """A family's ``pretrain:`` block: ``zcvae pretrain`` fields (e.g. ``backbone``, ``max_steps``) of the
    entangled stage its runs start from. ValueError naming the key for anything it must not hold."""
    if block is None:
        return
    if not isinstance(block, Mapping) or not block:
        raise ValueError("pretrain: must be a non-empty mapping of `zcvae pretrain` fields (e.g. backbone, max_steps)")
    from zcvae.backbone.pretraining import PretrainConfig

    known = {f.name for f in dataclasses.fields(PretrainConfig)}
    for key in block:
        if key in PRETRAIN_DERIVED:
            raise ValueError(f"pretrain.{key}: set by the sweep (the data of each run; the stage's directory is "
                             f"<output dir>/entangled-<task>), not in the family")
        if key not in known:
            raise ValueError(f"pretrain.{key}: not a `zcvae pretrain` field (known: {', '.join(sorted(known - set(PRETRAIN_DERIVED)))})")
    if "backbone" in base:
        raise ValueError("base.backbone: the family's pretrain block builds the runs' backbone; name the source LM in "
                         "pretrain.backbone instead")


def pretrain_stages(runs: Sequence[Run], block: Mapping[str, Any] | None, *, root: str | Path) -> list[Run]:
    """``runs`` with the family's entangled stage attached: one stage per task (or per JSONL data file),
    in ``<root>/entangled-<task or data file stem>``, which becomes each run's ``backbone``."""
    if not block:
        return list(runs)
    out = []
    for run in runs:
        data = {k: run.params[k] for k in ("task", "train_data", "val_data") if run.params.get(k) is not None}
        if "train_data" in data:
            key = Path(str(data["train_data"])).stem
        else:
            from zcvae.data import DEFAULT_TASK

            data.setdefault("task", DEFAULT_TASK)
            key = data["task"]
        stage = {**block, **data, "output_dir": f"{str(root).rstrip('/')}/entangled-{key}"}
        out.append(dataclasses.replace(run, params={**run.params, "backbone": stage["output_dir"]}, pretrain=stage))
    return out


def expand_family(family: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The params of every run: ``base`` overlaid with each grid x zip assignment, in a fixed order."""
    validate_family(family)
    base, grid = dict(family.get("base") or {}), family.get("grid") or {}
    axes: list[list[dict[str, Any]]] = [[{field: value} for value in values] for field, values in grid.items()]
    for group in _zip_groups(family):
        length = len(next(iter(group.values())))
        axes.append([{field: values[i] for field, values in group.items()} for i in range(length)])
    runs = []
    for assignment in itertools.product(*axes):
        params = dict(base)
        for part in assignment:
            params.update(part)
        runs.append(params)
    return runs


# ---- defaults and planning --------------------------------------------------------------------------------


def resolve_defaults(
    family: Mapping[str, Any], *, source: str = "auto", config_module: str = "zcvae.config"
) -> tuple[dict[str, Any], str]:
    """(defaults for naming, a description of where they came from).

    ``config``: the defaults of ``<config_module>.TrainConfig`` (``ValueError`` if it cannot be imported);
    ``base``: the family's ``base`` (plus ``slurm.engine`` as ``engine``, which every run shares too);
    ``auto``: ``config`` when importable, else ``base``. Fields of ``TrainConfig`` without a default are
    left out.
    """
    if source not in DEFAULTS_SOURCES:
        raise ValueError(f"defaults source: must be one of {DEFAULTS_SOURCES}, got {source!r}")
    if source in ("auto", "config"):
        try:
            config_cls = importlib.import_module(config_module).TrainConfig
        except (ImportError, AttributeError) as err:
            if source == "config":
                raise ValueError(f"defaults source 'config': cannot import {config_module}.TrainConfig: {err}")
        else:
            defaults = {}
            for field in dataclasses.fields(config_cls):
                if field.default is not dataclasses.MISSING:
                    defaults[field.name] = field.default
                elif field.default_factory is not dataclasses.MISSING:
                    defaults[field.name] = field.default_factory()
            return defaults, f"config:{config_module}.TrainConfig"
    defaults = dict(family.get("base") or {})
    engine = (family.get("slurm") or {}).get("engine")
    if engine is not None:
        defaults.setdefault("engine", engine)  # shared by every run like base, so not worth naming
    return defaults, "base"


def _preset_defaults(defaults: Mapping[str, Any], params: Mapping[str, Any]) -> Mapping[str, Any]:
    """``defaults`` with the weights of ``params["objective"]`` when that names a preset."""
    try:
        from zcvae.config import OBJECTIVE_PRESETS, preset_values
    except ImportError:
        return defaults
    name = params.get("objective")
    return {**defaults, **preset_values(name)} if name in OBJECTIVE_PRESETS else defaults


def confound_warnings(runs: Sequence[Run]) -> list[str]:
    """Warnings about the planned runs: token-weighted arms that differ in preset and also in alpha at one
    mode (:func:`zcvae.config.token_weighting_confounds`). Printed by both planners; never fatal."""
    try:
        from zcvae.config import token_weighting_confounds
    except ImportError:
        return []
    return token_weighting_confounds(run.params for run in runs)


def plan_runs(
    family: Mapping[str, Any], defaults: Mapping[str, Any], *, check_known_fields: bool = False
) -> list[Run]:
    """Expand, name and check a family. ``check_known_fields``: every param must be a field of ``defaults``.

    Raises ``ValueError`` naming both parameter sets when two runs would get the same name.
    """
    slurm = SlurmSettings.from_dict(family.get("slurm"))
    # Fields the family varies are named in every run, even where a value equals the default, so the
    # runs of one family have names of one shape (seed-0 next to seed-1, not a missing seed part).
    varied = [*(family.get("grid") or {}), *(f for group in _zip_groups(family) for f in group)]
    always = (AGGREGATION_MODE_FIELD, *varied)
    runs: list[Run] = []
    by_name: dict[str, dict[str, Any]] = {}
    for params in expand_family(family):
        if slurm.engine is not None:
            if params.setdefault("engine", slurm.engine) != slurm.engine:
                raise ValueError(f"engine: slurm.engine is {slurm.engine!r} but a run sets {params['engine']!r}")
        if AGGREGATION_MODE_FIELD not in params:
            if AGGREGATION_MODE_FIELD not in defaults:
                raise ValueError(f"{AGGREGATION_MODE_FIELD}: set it in the family (every run must state its mode)")
            params[AGGREGATION_MODE_FIELD] = defaults[AGGREGATION_MODE_FIELD]
        for field, value in params.items():
            if check_known_fields and field not in defaults:
                raise ValueError(f"{field}: not a field of the config the defaults come from")
            if value is None and defaults.get(field) is not None:
                raise ValueError(f"{field}: None cannot be passed as a flag and the default is {defaults[field]!r}")
        # a run that names an objective preset is named against that preset's weights: obj-dist, not
        # obj-dist_raw-0_dist-1 (the weights still reach the trainer through --objective)
        objective_always = ("objective",) if "objective" in params else ()
        name = run_name(params, _preset_defaults(defaults, params), always=(*always, *objective_always))
        if name in by_name:
            raise ValueError(
                f"two runs get the same name {name!r}: {json.dumps(by_name[name], sort_keys=True)} and "
                f"{json.dumps(params, sort_keys=True)}; make them differ in a named field"
            )
        by_name[name] = dict(params)
        root = params.get("output_dir") or defaults.get("output_dir") or DEFAULT_OUTPUT_ROOT
        params["output_dir"] = f"{str(root).rstrip('/')}/{name}"
        params["run_name"] = name  # the trainer records this name, so aggregate tables match the manifest
        runs.append(Run(name=name, params=params))
    return runs


# ---- rendering and recovery ----------------------------------------------------------------------------------


class _SbatchTemplate(string.Template):
    """Only ``${lower_case}`` is a placeholder: ``$UPPER`` and ``${UPPER:-x}`` are bash and pass through."""

    flags = 0  # string.Template matches case-insensitively by default, which would capture bash variables
    pattern = r"""
    \$(?:
      (?P<escaped>(?!))
      | (?P<named>(?!))
      | \{(?P<braced>[a-z][a-z0-9_]*)\}
      | (?P<invalid>(?!))
    )
    """


def template_placeholders(template_text: str) -> set[str]:
    """The placeholder names in a template, for checking it against what :func:`render_script` provides."""
    return {m.group("braced") for m in _SbatchTemplate.pattern.finditer(template_text) if m.group("braced")}


def cli_value(value: Any) -> str:
    """The text of one scalar ``zcvae train`` flag value: floats as ``repr`` (exact), the rest as ``str``."""
    return repr(value) if isinstance(value, float) else str(value)


def params_to_flags(params: Mapping[str, Any]) -> list[list[str]]:
    """One ``[flag, *values]`` group per param, in sorted field order, as ``zcvae train`` parses them.

    ``True``/``False`` -> ``--field`` / ``--no-field`` (argparse ``BooleanOptionalAction``); a value starting
    with ``-`` -> ``--field=-1e-05`` (argparse would read it as an option); a list -> the flag followed by its
    items (``nargs="+"``); ``None`` -> left out, so the config default applies. Raises
    ``ValueError`` naming the field for values a flag cannot carry (empty lists, nested lists, dicts).
    """
    groups = []
    for field in sorted(params):
        value, flag = params[field], "--" + field.replace("_", "-")
        if value is None:
            continue
        if isinstance(value, bool):
            groups.append([flag if value else "--no-" + flag[2:]])
        elif isinstance(value, (list, tuple)):
            items = [cli_value(v) for v in value if not isinstance(v, (list, tuple, dict)) and v is not None]
            if not value or len(items) != len(value) or any(item.startswith("-") for item in items):
                raise ValueError(f"{field}: a list flag needs scalar items not starting with '-', got {value!r}")
            groups.append([flag, *items])
        elif isinstance(value, dict):
            raise ValueError(f"{field}: a mapping cannot be passed as a zcvae train flag")
        else:
            text = cli_value(value)
            # argparse takes "-1e-05" or "-inf" after a flag for another option; "--flag=-1e-05" is unambiguous
            groups.append([f"{flag}={text}"] if text.startswith("-") else [flag, text])
    return groups


def parse_train_flags(argv: Sequence[str]) -> dict[str, Any]:
    """Read ``zcvae train`` flags back: ``--field v`` and ``--field=v`` -> ``"v"``; ``--field a b`` ->
    ``["a", "b"]``; ``--field`` alone -> ``True``; ``--no-field`` alone -> ``False``. Values stay text."""
    out: dict[str, Any] = {}
    index = 0
    while index < len(argv):
        flag, eq, inline = argv[index].partition("=")
        if not _FLAG_RE.fullmatch(flag):
            raise ValueError(f"{argv[index]!r}: expected a --flag at position {index} of {list(argv)}")
        index += 1
        values = [inline] if eq else []
        while index < len(argv) and not _FLAG_RE.fullmatch(argv[index].partition("=")[0]):
            values.append(argv[index])
            index += 1
        field = flag[2:].replace("-", "_")
        if not values:
            value: Any = not field.startswith("no_")
            field = field if value else field[3:]
        else:
            value = values[0] if len(values) == 1 else values
        if field in out:
            raise ValueError(f"{flag}: given twice")
        out[field] = value
    return out


def render_script(*, template_text: str, run: Run, slurm: SlurmSettings, log_dir: str) -> str:
    """One run's SLURM script: the template with every placeholder filled (``KeyError`` on an unknown one)."""
    optional = []
    if slurm.partition:
        optional.append(f"#SBATCH --partition={slurm.partition}")
    if slurm.account:
        optional.append(f"#SBATCH --account={slurm.account}")
    optional += [line if line.startswith("#SBATCH") else f"#SBATCH {line}" for line in slurm.extra_sbatch]
    train_args = "\n".join("  " + shlex.join(group) for group in params_to_flags(run.params))
    return _SbatchTemplate(template_text).substitute(
        job_name=f"{slurm.job_name_prefix}-{run.name}",
        nodes=slurm.nodes,
        gpus_per_node=slurm.gpus_per_node,
        cpus_per_task=slurm.cpus_per_task,
        time=slurm.time,
        log_dir=log_dir,
        sbatch_optional="\n".join(optional),
        run_name=run.name,
        params_json=json.dumps(run.params, sort_keys=True),
        master_port=slurm.master_port,
        setup="\n".join(f"  {line}" for line in slurm.setup),
        train_args=train_args,
    )


def recover_params(script_text: str) -> dict[str, Any]:
    """The params of a rendered script, read from its single ``# zcvae-params: {json}`` line."""
    lines = [line for line in script_text.splitlines() if line.startswith(PARAMS_PREFIX)]
    if len(lines) != 1:
        raise ValueError(f"expected one '{PARAMS_PREFIX.strip()}' line in the script, found {len(lines)}")
    return json.loads(lines[0][len(PARAMS_PREFIX) :])


def recover_train_args(script_text: str) -> list[str]:
    """The ``zcvae train`` arguments of a rendered script, read from its ``TRAIN_ARGS=( ... )`` block."""
    match = re.search(r"^TRAIN_ARGS=\(\n(.*?)^\)$", script_text, flags=re.MULTILINE | re.DOTALL)
    if match is None:
        raise ValueError("no TRAIN_ARGS=( ... ) block in the script")
    return shlex.split(match.group(1))


# ---- local runner (no SLURM) ---------------------------------------------------------------------------------


def local_plan(family: Mapping[str, Any], *, output_dir: str | Path, task: str | None = None) -> list[Run]:
    """The family's runs with every run directory under ``output_dir`` and, with ``task``, on that built-in
    task instead of the family's (``ValueError`` if the family trains on its own JSONL data)."""
    family = {**family, "base": dict(family.get("base") or {})}
    if task is not None:
        if family["base"].get("train_data") is not None:
            raise ValueError("--task: the family trains on train_data; a built-in task cannot replace it")
        family["base"]["task"] = task
    family["base"]["output_dir"] = str(output_dir)
    config_defaults, _ = resolve_defaults(family, source="config")
    for field in [*family["base"], *(family.get("grid") or {}), *(f for group in _zip_groups(family) for f in group)]:
        if field not in config_defaults:
            raise ValueError(f"{field}: not a zcvae train config field")
    # named against the family's base: names show what the family varies (agg-sum_obj-dist_seed-2)
    defaults, _ = resolve_defaults(family, source="base")
    return pretrain_stages(plan_runs(family, defaults), family.get("pretrain"), root=output_dir)


def check_run_configs(runs: Sequence[Run]) -> None:
    """ValueError naming the run and the field when a run's params would be refused by ``zcvae train``
    (an unknown task, a value of the wrong type or out of range), so ``--dry-run`` catches what the
    real run would fail on."""
    from zcvae.config import DEFAULT_OBJECTIVE, TrainConfig
    from zcvae.data.tasks import get_task

    for run in runs:
        try:
            TrainConfig.from_dict(dict(run.params), source="family", default_objective=DEFAULT_OBJECTIVE)
            if run.params.get("task") is not None:
                get_task(run.params["task"])
        except ValueError as err:
            raise ValueError(f"run {run.name}: {err}") from None


def run_finished(run: Run) -> bool:
    """Whether ``run`` already has its final evaluation (an eval record at its last step)."""
    from zcvae.commands.aggregate import RunLoadError, load_run
    from zcvae.config import TrainConfig

    max_steps = int(run.params.get("max_steps", TrainConfig.max_steps))
    try:
        summary = load_run(run.params["output_dir"])
    except RunLoadError:
        return False
    return summary.final_eval_step == max_steps


def _train_argv(run: Run) -> list[str]:
    # --resume auto: a run killed midway continues from its newest complete checkpoint (or restarts)
    return [arg for group in params_to_flags(run.params) for arg in group] + ["--resume", "auto"]


# Stage fields that say how a stage ran, not what it built: a finished stage is reused whatever they were.
_STAGE_RUN_CONTROL = ("output_dir", "resume", "progress_bar", "log_every", "save_every", "keep_last_checkpoints")


def stage_status(stage: Mapping[str, Any]) -> str:
    """``finished``, ``to run``, or ValueError when a finished stage in that directory was built with
    other settings (reusing it would hand the runs a backbone the family does not describe)."""
    from zcvae.backbone.pretraining import SUMMARY_FILE, PretrainConfig, is_pretrained

    directory = Path(stage["output_dir"])
    if not is_pretrained(directory):
        return "to run"
    wanted = PretrainConfig.from_dict(dict(stage)).to_dict()
    built = json.loads((directory / SUMMARY_FILE).read_text())["config"]
    differ = sorted(k for k in wanted if k not in _STAGE_RUN_CONTROL and built.get(k) != wanted[k])
    if differ:
        raise ValueError(f"{directory}: holds an entangled stage built with other settings ("
                         + ", ".join(f"{k} {built.get(k)!r} there, {wanted[k]!r} in the family" for k in differ)
                         + "); delete it or change the family's pretrain block")
    return "finished"


def _prebuild_backbones(runs: Sequence[Run], log) -> None:
    """Before any run starts, build what the runs' backbones need: the family's entangled stages (one per
    task, reused when finished with the same settings) and the cached built-in backbone of every other
    task, so that parallel runs do not race to build the same directory."""
    from zcvae.backbone.pretraining import PretrainConfig, builtin_backbone, pretrain

    stages = {run.pretrain["output_dir"]: run.pretrain for run in runs if run.pretrain is not None}
    for directory, stage in sorted(stages.items()):
        if stage_status(stage) == "finished":
            log(f"[sweep] entangled stage {directory}: finished, reused")
            continue
        log(f"[sweep] entangled stage {directory}: training ({', '.join(f'{k}={v}' for k, v in sorted(stage.items()) if k != 'output_dir')})")
        # resume="auto": a stage interrupted with the sweep continues from its newest checkpoint
        pretrain(PretrainConfig.from_dict({**stage, "resume": "auto"}), log=log)
    tasks = {run.params.get("task") for run in runs if run.params.get("backbone") is None and run.params.get("train_data") is None}
    for task in sorted(tasks, key=str):
        builtin_backbone(task, log=log)


def run_local(
    runs: Sequence[Run], *, jobs: int = 1, log=print, progress_bar: bool = True
) -> tuple[list[Run], list[tuple[Run, str]]]:
    """Train ``runs`` on this machine; return (runs trained now, [(failed run, why)]).

    Runs whose final evaluation exists are skipped (so an interrupted sweep resumes where it stopped);
    an unfinished run resumes from its newest complete checkpoint. ``jobs == 1``: one after another in
    this process (through the ``zcvae train`` argument parser, as a SLURM script would). ``jobs > 1``:
    that many ``zcvae train`` processes at once, one thread each (``OMP_NUM_THREADS=1``), each logging
    to ``<run dir>/train.log``.
    """
    import os
    import subprocess
    import time

    if jobs < 1:
        raise ValueError(f"--jobs must be >= 1, got {jobs}")
    todo = []
    for run in runs:
        if run_finished(run):
            log(f"[sweep] {run.name}: finished, skipped")
        else:
            todo.append(run)
    _prebuild_backbones(todo, log)
    done: list[Run] = []
    failed: list[tuple[Run, str]] = []
    if jobs == 1:
        from zcvae.commands.cli import build_parser
        from zcvae.train.guards import Preempted

        for index, run in enumerate(todo):
            log(f"[sweep] run {index + 1}/{len(todo)}: {run.name}")
            argv = ["train", *_train_argv(run)] + ([] if progress_bar else ["--no-progress-bar"])
            args = build_parser().parse_args(argv)
            try:
                code = args.func(args)
            except Preempted:
                raise  # SIGTERM/SIGUSR1 stop the sweep, not just this run; a rerun resumes it (a diverged run only fails)
            except Exception as err:  # noqa: BLE001 - one failed run must not stop the sweep; it is reported
                failed.append((run, f"{type(err).__name__}: {err}"))
                log(f"[sweep] {run.name}: FAILED: {type(err).__name__}: {err}")
                continue
            if code == 0:
                done.append(run)
            else:
                failed.append((run, f"exit {code}"))
        return done, failed

    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    pending = list(todo)
    active: list[tuple[Run, subprocess.Popen, Any]] = []
    started = 0
    while pending or active:
        while pending and len(active) < jobs:
            run = pending.pop(0)
            started += 1
            run_dir = Path(run.params["output_dir"])
            run_dir.mkdir(parents=True, exist_ok=True)
            handle = open(run_dir / "train.log", "a", encoding="utf-8")
            log(f"[sweep] run {started}/{len(todo)}: {run.name} (log: {run_dir / 'train.log'})")
            proc = subprocess.Popen([sys.executable, "-m", "zcvae", "train", *_train_argv(run), "--no-progress-bar"],
                                    stdout=handle, stderr=subprocess.STDOUT, env=env)
            active.append((run, proc, handle))
        time.sleep(0.2)
        still = []
        for run, proc, handle in active:
            code = proc.poll()
            if code is None:
                still.append((run, proc, handle))
                continue
            handle.close()
            if code == 0:
                done.append(run)
                log(f"[sweep] {run.name}: done")
            else:
                failed.append((run, f"exit {code}, see {Path(run.params['output_dir']) / 'train.log'}"))
                log(f"[sweep] {run.name}: FAILED (exit {code}), see {Path(run.params['output_dir']) / 'train.log'}")
        active = still
    return done, failed


def local_table(runs: Sequence[Run]) -> str:
    """The aggregate table (Markdown, seed groups as mean ± std) of the runs that have a run directory."""
    from zcvae.commands.aggregate import aggregate_runs, format_table

    dirs = [run.params["output_dir"] for run in runs if (Path(run.params["output_dir"]) / "run_config.json").is_file()]
    if not dirs:
        return ""
    return format_table(aggregate_runs(dirs, group_seeds=True, skip_bad=True), "markdown")


def local_main(argv: Sequence[str] | None = None) -> int:
    """``zcvae sweep FAMILY.yaml --local --output-dir DIR [--task T] [--jobs N] [--dry-run]``; without
    ``--local`` it renders SLURM scripts exactly as ``launch/sweep.py`` does (``--out DIR``)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--local" not in argv:
        return main(argv)
    parser = argparse.ArgumentParser(prog="zcvae sweep", description="Run a family's runs on this machine and print the table.")
    parser.add_argument("family", help="family file (YAML or JSON), e.g. launch/families/pilot.yaml")
    parser.add_argument("--local", action="store_true", required=True, help="run here, not through SLURM")
    parser.add_argument("--output-dir", required=True, help="run directories go to DIR/<run_name>; the table to DIR/table.md")
    parser.add_argument("--task", help="run the family on this built-in task instead of its own (e.g. sort)")
    parser.add_argument("--jobs", type=int, default=1, help="runs at once, one thread each (default 1: one run at a time, threads on the free cores)")
    parser.add_argument("--dry-run", action="store_true", help="list the runs and whether each is finished; train nothing")
    args = parser.parse_args(argv)
    try:
        runs = local_plan(load_family(args.family), output_dir=args.output_dir, task=args.task)
        check_run_configs(runs)
        for message in confound_warnings(runs):
            print(f"zcvae sweep: warning: {message}", file=sys.stderr)
        if args.dry_run:
            stages = {run.pretrain["output_dir"]: run.pretrain for run in runs if run.pretrain is not None}
            for directory, stage in sorted(stages.items()):
                print(f"{stage_status(stage):8}  entangled stage {directory}")
            for run in runs:
                print(f"{'finished' if run_finished(run) else 'to run  '}  {run.name}")
            return 0
        _, failed = run_local(runs, jobs=args.jobs)
    except ValueError as err:
        print(f"zcvae sweep: error: {err}", file=sys.stderr)
        return 2
    table = local_table(runs)
    if table:
        print()
        print(table, end="")
        (Path(args.output_dir) / "table.md").write_text(table, encoding="utf-8")
    for run, why in failed:
        print(f"zcvae sweep: {run.name} failed: {why}", file=sys.stderr)
    return 1 if failed else 0


# ---- command line --------------------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="launch/sweep.py", description=__doc__.split("\n\n")[0],
        epilog="Without SLURM: zcvae sweep FAMILY --local --output-dir DIR [--task T] [--jobs N] [--dry-run] "
        "runs the family here (see `zcvae sweep FAMILY --local --help`).")
    parser.add_argument("family", help="family file (YAML or JSON)")
    parser.add_argument("--out", required=True, help="directory for the scripts, manifest.jsonl and logs/")
    parser.add_argument("--dry-run", action="store_true", help="print the runs, write nothing")
    parser.add_argument("--defaults", choices=DEFAULTS_SOURCES, default="auto",
                        help="where naming defaults come from (default: auto = TrainConfig if importable)")
    parser.add_argument("--template", default=str(DEFAULT_TEMPLATE), help="SLURM template (default: %(default)s)")
    parser.add_argument("--force", action="store_true", help="overwrite an existing manifest in --out")
    args = parser.parse_args(argv)
    try:
        return _run(args)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    family = load_family(args.family)
    defaults, source = resolve_defaults(family, source=args.defaults)
    if family.get("pretrain"):
        # a SLURM job per run cannot wait for a stage that another job builds without a dependency chain
        raise ValueError("pretrain: SLURM rendering does not run the entangled stage; build it once with `zcvae pretrain "
                         "--backbone ... --task ... --output-dir DIR` (or `zcvae sweep FAMILY --local`), then drop the "
                         "pretrain block and set base.backbone: DIR")
    runs = plan_runs(family, defaults, check_known_fields=source.startswith("config"))
    if source.startswith("config"):  # zcvae is importable: check each run as `zcvae train` will
        check_run_configs(runs)
    for message in confound_warnings(runs):
        print(f"warning: {message}", file=sys.stderr)
    slurm = SlurmSettings.from_dict(family.get("slurm"))
    out = Path(args.out)
    log_dir = slurm.log_dir or str((out / "logs").resolve())
    template_path = Path(args.template)
    if not template_path.is_file():
        raise ValueError(f"--template: {template_path} not found (pass the path of launch/slurm.sbatch)")
    template_text = template_path.read_text(encoding="utf-8")
    scripts = {run.name: render_script(template_text=template_text, run=run, slurm=slurm, log_dir=log_dir)
               for run in runs}

    print(f"{len(runs)} runs; naming defaults from {source}")
    if args.dry_run:
        for run in runs:
            print(f"{out / (run.name + '.sbatch')}  {json.dumps(run.params, sort_keys=True)}")
        return 0
    manifest = out / "manifest.jsonl"
    if manifest.exists() and not args.force:
        raise ValueError(f"--out: {manifest} exists; pass --force to overwrite or choose another directory")
    out.mkdir(parents=True, exist_ok=True)
    (out / "logs").mkdir(exist_ok=True)
    with open(manifest, "w", encoding="utf-8") as f:
        for run in runs:
            path = out / f"{run.name}.sbatch"
            path.write_text(scripts[run.name], encoding="utf-8")
            path.chmod(0o755)
            record = {"run_name": run.name, "script": path.name, "defaults_source": source, "params": run.params}
            f.write(json.dumps(record, sort_keys=True) + "\n")
            print(path)
    print(f"wrote {manifest}; submit with: for f in {out}/*.sbatch; do sbatch \"$f\"; done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
