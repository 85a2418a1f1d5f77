"""``zcvae sweep``: a family's runs on SLURM (render the scripts) or on this machine (run them).

    zcvae sweep FAMILY.yaml --out DIR [--dry-run] [--defaults {auto,config,base}] [--force] [--template T]
    zcvae sweep FAMILY.yaml --local --output-dir DIR [--task T] [--jobs N] [--dry-run]

The family file is described in :mod:`zcvae.sweep.family`, the scripts in :mod:`zcvae.sweep.slurm` and the
local runner in :mod:`zcvae.sweep.local`; this module only parses the command line and prints.
``--local`` prints the aggregate table with seed groups as mean ± std at the end.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from zcvae.sweep.family import (
    DEFAULTS_SOURCES,
    Run,
    SlurmSettings,
    check_run_configs,
    confound_warnings,
    load_family,
    local_plan,
    plan_runs,
    pretrain_stages,
    resolve_defaults,
    stage_status,
    stages_of,
)
from zcvae.sweep.local import finished_run_mismatch, run_finished, run_local
from zcvae.sweep.slurm import DEFAULT_TEMPLATE, MANIFEST, SUBMIT_SCRIPT, write_scripts


def local_table(runs: Sequence[Run]) -> str:
    """The aggregate table (Markdown, seed groups as mean ± std) of the runs that have a run directory."""
    from zcvae.commands.aggregate import aggregate_runs, format_table

    dirs = [run.params["output_dir"] for run in runs if (Path(run.params["output_dir"]) / "run_config.json").is_file()]
    if not dirs:
        return ""
    return format_table(aggregate_runs(dirs, group_seeds=True, skip_bad=True), "markdown")


def local_main(argv: Sequence[str] | None = None) -> int:
    """``zcvae sweep``: with ``--local`` run the family here, else render its SLURM scripts (:func:`main`)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--local" not in argv:
        return main(argv)
    parser = argparse.ArgumentParser(prog="zcvae sweep", description="Run a family's runs on this machine and print the table.")
    parser.add_argument("family", help="family file (YAML or JSON), e.g. launch/families/pilot.yaml")
    parser.add_argument("--local", action="store_true", required=True, help="run here, not through SLURM")
    parser.add_argument("--output-dir", required=True, help="run directories go to DIR/<run_name>; the table to DIR/table.md")
    parser.add_argument("--task", help="run the family on this built-in task instead of its own (e.g. sort)")
    parser.add_argument("--jobs", type=int, default=1, help="runs at once, one thread each (default 1: one run at a time, on every core)")
    parser.add_argument("--dry-run", action="store_true", help="list the runs and whether each is finished; train nothing")
    args = parser.parse_args(argv)
    try:
        runs = local_plan(load_family(args.family), output_dir=args.output_dir, task=args.task)
        check_run_configs(runs)
        for message in confound_warnings(runs):
            print(f"zcvae sweep: warning: {message}", file=sys.stderr)
        if args.dry_run:
            for directory, stage in stages_of(runs).items():
                print(f"{stage_status(stage):8}  entangled stage {directory}")
            for run in runs:
                if not run_finished(run):
                    print(f"to run    {run.name}")
                elif (why := finished_run_mismatch(run)) is not None:
                    print(f"other run {run.name}: {why}")
                else:
                    print(f"finished  {run.name}")
            return 0
        _, failed = run_local(runs, jobs=args.jobs)
    except ValueError as err:
        print(f"zcvae sweep: error: {err}", file=sys.stderr)
        return 2
    failed_names = {run.name for run, _ in failed}
    table = local_table([run for run in runs if run.name not in failed_names])
    if table:
        print()
        print(table, end="")
        (Path(args.output_dir) / "table.md").write_text(table, encoding="utf-8")
    for run, why in failed:
        print(f"zcvae sweep: {run.name} failed: {why}", file=sys.stderr)
    return 1 if failed else 0


def main(argv: Sequence[str] | None = None) -> int:
    """``zcvae sweep FAMILY --out DIR`` (also ``launch/sweep.py``): render the family's SLURM scripts."""
    parser = argparse.ArgumentParser(
        prog="zcvae sweep", description="Render one SLURM script per run of a family (and per entangled stage), "
        "with submit.sh that chains them and manifest.jsonl.",
        epilog="Without SLURM: zcvae sweep FAMILY --local --output-dir DIR [--task T] [--jobs N] [--dry-run] "
        "runs the family here (see `zcvae sweep FAMILY --local --help`).")
    parser.add_argument("family", help="family file (YAML or JSON)")
    parser.add_argument("--out", required=True, help=f"directory for the scripts, {SUBMIT_SCRIPT}, {MANIFEST} and logs/")
    parser.add_argument("--dry-run", action="store_true", help="print the jobs, write nothing")
    parser.add_argument("--defaults", choices=DEFAULTS_SOURCES, default="auto",
                        help="where naming defaults come from (default: auto = TrainConfig if importable)")
    parser.add_argument("--template", default=None, help="SLURM template (default: the one shipped in zcvae, zcvae/sweep/slurm.sbatch)")
    parser.add_argument("--force", action="store_true", help="overwrite an existing manifest in --out")
    args = parser.parse_args(argv)
    try:
        return _render(args)
    except ValueError as err:
        print(f"zcvae sweep: error: {err}", file=sys.stderr)
        return 2


def _render(args: argparse.Namespace) -> int:
    family = load_family(args.family)
    defaults, source = resolve_defaults(family, source=args.defaults)
    known = source.startswith("config")
    runs = pretrain_stages(plan_runs(family, defaults, check_known_fields=known), family.get("pretrain"))
    if known:  # zcvae's TrainConfig: check each run (and stage) as `zcvae train` (`zcvae pretrain`) will
        check_run_configs(runs)
    for message in confound_warnings(runs):
        print(f"zcvae sweep: warning: {message}", file=sys.stderr)
    if args.template is None:
        template_text = DEFAULT_TEMPLATE.read_text(encoding="utf-8")
    elif Path(args.template).is_file():
        template_text = Path(args.template).read_text(encoding="utf-8")
    else:
        raise ValueError(f"--template: {args.template} not found (leave it out for the template shipped in zcvae)")
    stages = stages_of(runs)
    print(f"{len(runs)} runs" + (f" after {len(stages)} entangled stage(s)" if stages else "") + f"; naming defaults from {source}")
    write_scripts(runs, out=args.out, slurm=SlurmSettings.from_dict(family.get("slurm")), defaults_source=source,
                  template_text=template_text, dry_run=args.dry_run, force=args.force)
    if not args.dry_run:
        print(f"wrote {Path(args.out) / MANIFEST}; submit with: bash {Path(args.out) / SUBMIT_SCRIPT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
