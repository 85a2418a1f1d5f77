"""The family file: its schema, the expansion into runs, their names, and the entangled stage they need.

A family file (YAML or JSON) holds::

    base:  {field: value, ...}           # config fields shared by every run
    grid:  {field: [v1, v2, ...], ...}   # cartesian product, in file order
    zip:   [{field_a: [a1, a2], field_b: [b1, b2]}, ...]   # each group varies together (optional)
    slurm: {nodes: 2, gpus_per_node: 8, time: "24:00:00", partition: ..., ...}   # optional, see SlurmSettings
    pretrain: {backbone: smollm2, max_steps: 200, ...}   # optional: the entangled stage, see pretrain_stages
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

With a ``pretrain:`` block every run trains from the entangled stage of its task (or JSONL data), built
into ``<the runs' output root>/entangled-<task or data file stem>``: that directory is the run's
``backbone``. The local runner (:mod:`zcvae.sweep.local`) builds it first; the SLURM rendering
(:mod:`zcvae.sweep.slurm`) gives it a job of its own that the runs' jobs depend on.
"""

from __future__ import annotations

import dataclasses
import importlib
import itertools
import json
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from zcvae.runs.naming import AGGREGATION_MODE_FIELD, run_name

FAMILY_KEYS = ("base", "grid", "zip", "slurm", "description", "pretrain")
# Fields of a family's pretrain block that the sweep sets itself: the data comes from each run, the
# stage's directory is <output root>/entangled-<task or data file>.
PRETRAIN_DERIVED = ("task", "train_data", "val_data", "output_dir")
STAGE_PREFIX = "entangled-"
DEFAULTS_SOURCES = ("auto", "config", "base")
DEFAULT_OUTPUT_ROOT = "runs"
_FIELD_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


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


def zip_groups(family: Mapping[str, Any]) -> list[dict[str, list]]:
    """The family's ``zip`` groups as a list (one group may be written without the list)."""
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
    for index, group in enumerate(zip_groups(family)):
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
    from zcvae.backbone.stage_config import PretrainConfig

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




def pretrain_stages(runs: Sequence[Run], block: Mapping[str, Any] | None) -> list[Run]:
    """``runs`` with the family's entangled stage attached: one stage per task (or per JSONL data file),
    in ``<the run's output root>/entangled-<task or data file stem>``, which becomes each run's
    ``backbone``. ``block`` None or empty: the runs unchanged."""
    if not block:
        return list(runs)
    from zcvae.data import DEFAULT_TASK

    out = []
    for run in runs:
        data = {k: run.params[k] for k in ("task", "train_data", "val_data") if run.params.get(k) is not None}
        if "train_data" in data:
            key = Path(str(data["train_data"])).stem
        else:
            data.setdefault("task", DEFAULT_TASK)
            key = data["task"]
        root = run.params["output_dir"].rsplit("/", 1)[0]  # plan_runs made it <root>/<run name>
        stage = {**block, **data, "output_dir": f"{root}/{STAGE_PREFIX}{key}"}
        out.append(dataclasses.replace(run, params={**run.params, "backbone": stage["output_dir"]}, pretrain=stage))
    return out


def stages_of(runs: Sequence[Run]) -> dict[str, dict[str, Any]]:
    """The distinct entangled stages of ``runs``: {stage directory: ``zcvae pretrain`` fields}, sorted."""
    stages = {run.pretrain["output_dir"]: run.pretrain for run in runs if run.pretrain is not None}
    return dict(sorted(stages.items()))


# Stage fields that say how a stage ran, not what it built: a finished stage is reused whatever they were.
_STAGE_RUN_CONTROL = ("output_dir", "resume", "progress_bar", "log_every", "save_every", "keep_last_checkpoints")


def stage_status(stage: Mapping[str, Any]) -> str:
    """``finished``, ``to run``, or ValueError when a finished stage in that directory was built with
    other settings (reusing it would hand the runs a backbone the family does not describe)."""
    from zcvae.backbone.stage_config import SUMMARY_FILE, PretrainConfig, is_pretrained

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


def expand_family(family: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The params of every run: ``base`` overlaid with each grid x zip assignment, in a fixed order."""
    validate_family(family)
    base, grid = dict(family.get("base") or {}), family.get("grid") or {}
    axes: list[list[dict[str, Any]]] = [[{field: value} for value in values] for field, values in grid.items()]
    for group in zip_groups(family):
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
            module = importlib.import_module(config_module)
            config_cls = module.TrainConfig
        except (ImportError, AttributeError) as err:
            if source == "config":
                raise ValueError(f"defaults source 'config': cannot import {config_module}.TrainConfig: {err}")
        else:
            defaults = {}
            # a config in sections lists its flat keys (zcvae.config.flat_fields); a flat one its own fields
            fields = module.flat_fields() if hasattr(module, "flat_fields") else dataclasses.fields(config_cls)
            for field in fields:
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
    from zcvae.config import OBJECTIVE_PRESETS, preset_values

    name = params.get("objective")
    return {**defaults, **preset_values(name)} if name in OBJECTIVE_PRESETS else defaults


def confound_warnings(runs: Sequence[Run]) -> list[str]:
    """Warnings about the planned runs: token-weighted arms that differ in preset and also in alpha at one
    mode (:func:`zcvae.config.token_weighting_confounds`). Printed by both planners; never fatal."""
    from zcvae.config import token_weighting_confounds

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
    varied = [*(family.get("grid") or {}), *(f for group in zip_groups(family) for f in group)]
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
    for field in [*family["base"], *(family.get("grid") or {}), *(f for group in zip_groups(family) for f in group)]:
        if field not in config_defaults:
            raise ValueError(f"{field}: not a zcvae train config field")
    # named against the family's base: names show what the family varies (agg-sum_obj-dist_seed-2)
    defaults, _ = resolve_defaults(family, source="base")
    return pretrain_stages(plan_runs(family, defaults), family.get("pretrain"))


def check_run_configs(runs: Sequence[Run]) -> None:
    """ValueError naming the run and the field when a run's params would be refused by ``zcvae train``
    (an unknown task, a value of the wrong type or out of range), so ``--dry-run`` catches what the
    real run would fail on."""
    from zcvae.config import DEFAULT_PRESET, TrainConfig
    from zcvae.data.tasks import get_task

    for run in runs:
        try:
            TrainConfig.from_dict(dict(run.params), source="family", default_preset=DEFAULT_PRESET)
            if run.params.get("task") is not None:
                get_task(run.params["task"])
        except ValueError as err:
            raise ValueError(f"run {run.name}: {err}") from None
    from zcvae.backbone.stage_config import PretrainConfig

    for directory, stage in stages_of(runs).items():
        try:
            PretrainConfig.from_dict(dict(stage))
        except ValueError as err:
            raise ValueError(f"pretrain (the stage in {directory}): {err}") from None


