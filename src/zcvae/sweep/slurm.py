"""SLURM scripts for a family: one job per run, one per entangled stage, and a submit script that chains them.

    zcvae sweep FAMILY.yaml --out DIR [--dry-run] [--defaults {auto,config,base}] [--force]

Output (:func:`write_scripts`):

- ``DIR/<run_name>.sbatch`` per run: ``zcvae train <its params as flags> --resume auto``;
- ``DIR/entangled-<task>.sbatch`` per entangled stage of a family with a ``pretrain:`` block:
  ``zcvae pretrain <the stage's fields> --resume auto``, into the directory the runs take as ``backbone``;
- ``DIR/submit.sh``: submits every stage first (``sbatch --parsable``) and every run after its stage
  (``sbatch --dependency=afterok:<stage job id>``), so one command runs both stages;
- ``DIR/manifest.jsonl``: one JSON object per job, ``kind`` ``stage`` (``stage``, ``script``, ``params``)
  or ``run`` (``run_name``, ``script``, ``defaults_source``, ``params``, ``after``: the stage script the
  run waits for, or null), stages first;
- ``DIR/logs/`` for the SLURM output files.

Every job is the one template :data:`DEFAULT_TEMPLATE` (shipped in the package), rendered with the
command (``train`` or ``pretrain``); each script carries its params twice: as the flags and as one line
``# zcvae-params: {json}`` (:func:`recover_params`).
"""

from __future__ import annotations

import importlib.resources
import json
import re
import shlex
import string
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from zcvae.sweep.family import Run, SlurmSettings, stages_of
from zcvae.sweep.flags import command_flag_groups

# package data (pyproject.toml), so an installed wheel renders too
DEFAULT_TEMPLATE = importlib.resources.files("zcvae.sweep").joinpath("slurm.sbatch")
PARAMS_PREFIX = "# zcvae-params: "
MANIFEST = "manifest.jsonl"
SUBMIT_SCRIPT = "submit.sh"


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


def render_script(*, template_text: str, run: Run, slurm: SlurmSettings, log_dir: str) -> str:
    """One run's SLURM script (``zcvae train``): the template with every placeholder filled (``KeyError`` on
    an unknown one)."""
    return _render(template_text, name=run.name, command="train", params=run.params, slurm=slurm, log_dir=log_dir)


def render_stage_script(*, template_text: str, stage: Mapping[str, Any], slurm: SlurmSettings, log_dir: str) -> str:
    """One entangled stage's SLURM script (``zcvae pretrain`` into ``stage["output_dir"]``), on the same
    nodes, engine set-up and preemption handling as the runs."""
    return _render(template_text, name=stage_name(stage), command="pretrain", params=stage, slurm=slurm, log_dir=log_dir)


def stage_name(stage: Mapping[str, Any]) -> str:
    """``entangled-<task>``: the stage directory's name, which also names its job and script."""
    return Path(stage["output_dir"]).name


def _render(template_text: str, *, name: str, command: str, params: Mapping[str, Any], slurm: SlurmSettings,
            log_dir: str) -> str:
    optional = []
    if slurm.partition:
        optional.append(f"#SBATCH --partition={slurm.partition}")
    if slurm.account:
        optional.append(f"#SBATCH --account={slurm.account}")
    optional += [line if line.startswith("#SBATCH") else f"#SBATCH {line}" for line in slurm.extra_sbatch]
    return _SbatchTemplate(template_text).substitute(
        job_name=f"{slurm.job_name_prefix}-{name}",
        nodes=slurm.nodes,
        gpus_per_node=slurm.gpus_per_node,
        cpus_per_task=slurm.cpus_per_task,
        time=slurm.time,
        log_dir=log_dir,
        sbatch_optional="\n".join(optional),
        run_name=name,
        params_json=json.dumps(dict(params), sort_keys=True),
        master_port=slurm.master_port,
        setup="\n".join(f"  {line}" for line in slurm.setup),
        command=command,
        train_args="\n".join("  " + shlex.join(group) for group in command_flag_groups(params)),
    )


def submit_script(jobs: Sequence[tuple[str, str | None]]) -> str:
    """``submit.sh`` for ``jobs`` = [(script, the stage script it waits for or None)], stages listed before
    the runs that wait for them: each stage is submitted with ``--parsable`` and its job id kept, each run
    with ``--dependency=afterok:<that id>`` (SLURM starts it only once the stage exited 0)."""
    lines = [
        "#!/bin/bash",
        "# Submit this family: each entangled stage first, then every run after its stage (afterok).",
        "# Written by `zcvae sweep FAMILY --out DIR`; run it from anywhere: bash DIR/submit.sh",
        "set -euo pipefail",
        'cd "$(dirname "$0")"',
    ]
    ids: dict[str, str] = {}
    waited = {after for _, after in jobs if after is not None}
    for script, after in jobs:
        dependency = ""
        if after is not None:
            if after not in ids:
                raise ValueError(f"{script}: waits for {after}, which is not submitted before it")
            dependency = f"--dependency=afterok:${{{ids[after]}}} "
        if script in waited:
            var = "JOB_" + re.sub(r"[^A-Za-z0-9]", "_", script.removesuffix(".sbatch")).upper()
            ids[script] = var
            # --parsable prints "<id>" or "<id>;<cluster>"; the dependency takes the id
            lines.append(f"{var}=$(sbatch --parsable {dependency}{shlex.quote(script)})")
            lines.append(f'{var}="${{{var}%%;*}}"')
            lines.append(f'echo "{script}: job ${var}"')
        else:
            lines.append(f"sbatch {dependency}{shlex.quote(script)}")
    return "\n".join(lines) + "\n"


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




def write_scripts(
    runs: Sequence[Run], *, out: str | Path, slurm: SlurmSettings, defaults_source: str, template_text: str,
    dry_run: bool = False, force: bool = False, log: Callable[[str], None] = print,
) -> list[Path]:
    """Render every stage's and run's script into ``out`` with ``submit.sh`` and ``manifest.jsonl`` (see
    the module docstring); return the scripts' paths, stages first. ``dry_run``: print what would be
    written and write nothing. ``ValueError`` if ``out`` holds a manifest already and not ``force``."""
    out = Path(out)
    log_dir = slurm.log_dir or str((out / "logs").resolve())
    stages = stages_of(runs)
    stage_scripts = {directory: f"{stage_name(stage)}.sbatch" for directory, stage in stages.items()}
    texts = {stage_scripts[d]: render_stage_script(template_text=template_text, stage=s, slurm=slurm, log_dir=log_dir)
             for d, s in stages.items()}
    records = [{"kind": "stage", "stage": stage_name(s), "script": stage_scripts[d], "params": s} for d, s in stages.items()]
    jobs: list[tuple[str, str | None]] = [(stage_scripts[d], None) for d in stages]
    for run in runs:
        script = f"{run.name}.sbatch"
        after = stage_scripts[run.pretrain["output_dir"]] if run.pretrain is not None else None
        texts[script] = render_script(template_text=template_text, run=run, slurm=slurm, log_dir=log_dir)
        records.append({"kind": "run", "run_name": run.name, "script": script, "defaults_source": defaults_source,
                        "params": run.params, "after": after})
        jobs.append((script, after))
    submit = submit_script(jobs)
    if dry_run:
        for record in records:
            log(f"{out / record['script']}  {json.dumps(record['params'], sort_keys=True)}"
                + (f"  (after {record['after']})" if record.get("after") else ""))
        return [out / record["script"] for record in records]
    manifest = out / MANIFEST
    if manifest.exists() and not force:
        raise ValueError(f"--out: {manifest} exists; pass --force to overwrite or choose another directory")
    out.mkdir(parents=True, exist_ok=True)
    (out / "logs").mkdir(exist_ok=True)
    paths = []
    for record in records:
        path = out / record["script"]
        path.write_text(texts[record["script"]], encoding="utf-8")
        path.chmod(0o755)
        paths.append(path)
        log(str(path))
    (out / SUBMIT_SCRIPT).write_text(submit, encoding="utf-8")
    (out / SUBMIT_SCRIPT).chmod(0o755)
    # the manifest last: its presence says that every script it lists is complete
    manifest.write_text("".join(json.dumps(record, sort_keys=True) + "\n" for record in records), encoding="utf-8")
    return paths
