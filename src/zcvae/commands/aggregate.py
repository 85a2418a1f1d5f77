"""`zcvae aggregate RUN_DIR...`: one table row per run (or per group of seeds) from the run directories.

Each run directory holds ``run_config.json`` (``{"config": {...resolved config, in sections or flat...}, "versions":
..., "git_revision": ...}``) and ``metrics.jsonl`` (one flat JSON object per line with ``step``,
``split`` and metric keys). A row shows what distinguishes the objective -- latent type, token
aggregation mode (every table shows it: mean and sum answer different questions), the nonzero
reconstruction-term weights and the objective preset they came from, alpha, beta and the KL schedule --
the end-of-run verdict (``verdict.json``, or for a run without one the same verdict recomputed from its
final evaluation; ``zcvae.eval.verdict``) and the final evaluation metrics.

    zcvae aggregate runs/*                          # Markdown table, seeds grouped as mean ± std
    zcvae aggregate runs/* --format csv > table.csv
    zcvae aggregate runs/* --metrics nmi,kl,exact_match --no-group-seeds
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import math
import os
import re
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from zcvae.config import aggregation_label, token_weighting_confounds
from zcvae.core.terms import RECONSTRUCTION_TERM_REGISTRY
from zcvae.eval.verdict import read_verdict, verdict_of
from zcvae.runs.rundir import flat_config

__all__ = [
    "DEFAULT_METRICS",
    "RECONSTRUCTION_WEIGHT_ABBREVIATIONS",
    "RunLoadError",
    "RunSummary",
    "Stat",
    "aggregate_runs",
    "format_table",
    "load_run",
    "main",
]

CONFIG_FILENAME = "run_config.json"
METRICS_FILENAME = "metrics.jsonl"

DEFAULT_METRICS: tuple[str, ...] = (
    "nmi",
    "nmi_reachable",  # the best NMI any encoder of (x, y) can reach on this validation set
    "nmi_ratio",  # nmi / nmi_reachable
    "homogeneity",  # every latent in use holds one strategy (1.0); spare latents may split one cleanly
    "mi",
    "router_support",
    "num_used_latents",  # latents with more than 1% of the q mass
    "kl",
    "control/matching_accuracy",
    "exact_match",
    "answer_accuracy",
)

# Config field -> short name in the "recon" column (the registry's abbreviations), in registry order.
RECONSTRUCTION_WEIGHT_ABBREVIATIONS: dict[str, str] = {term.weight_field: term.abbreviation for term in RECONSTRUCTION_TERM_REGISTRY}

# Identity columns of a row, in table order, before the seed columns and the metrics.
# ``kl_schedule`` sits next to beta: a delay-ramp beta is not a constant beta, and kl-weight-scale
# tokens multiplies it by a factor read from the data.
_IDENTITY_COLUMNS = ("name", "latent", "mode", "objective", "recon", "alpha", "beta", "kl_schedule")
MISSING = "-"


class RunLoadError(ValueError):
    """A run directory that cannot be read; the message names the file (and line)."""


@dataclass
class RunSummary:
    """What the table needs from one run directory."""

    run_dir: str
    config: dict[str, Any]
    final_eval: dict[str, Any] | None
    """Metrics of the last evaluation (records at the step of the last ``split == "eval"`` line,
    merged in file order), or None when the run has no evaluation record yet."""
    final_eval_step: int | None = None
    num_records: int = 0
    versions: Any = None
    git_revision: Any = None
    kl_weight_factor: Any = None
    """The resolved multiplier of beta recorded in run_config.json (kl-weight-scale tokens), if any."""
    verdict: str | None = None
    """The run's end-of-run verdict string (None without an evaluation)."""

    @property
    def name(self) -> str:
        return str(self.config.get("run_name") or os.path.basename(os.path.normpath(self.run_dir)))

    @property
    def seed(self) -> Any:
        return self.config.get("seed")


@dataclass(frozen=True)
class Stat:
    """A metric over the runs of a group: mean, sample std (ddof=1; 0 for one run), and count."""

    mean: float
    std: float
    count: int

    def format(self, group_size: int) -> str:
        text = _format_number(self.mean)
        if self.count > 1:
            text += f" ± {_format_number(self.std)}"
        if self.count != group_size:
            text += f" ({self.count}/{group_size})"  # some runs of the group lack this metric
        return text


# ----------------------------------------------------------------------------------------------
# Loading
# ----------------------------------------------------------------------------------------------


def load_run(run_dir: str | os.PathLike) -> RunSummary:
    """Read ``run_config.json`` and ``metrics.jsonl`` of one run; raise RunLoadError naming the bad file.

    A missing ``metrics.jsonl`` means the run has logged nothing yet (its metrics show as "-");
    a line that is not a JSON object is an error naming the file and line.
    """
    run_dir = os.fspath(run_dir)
    if not os.path.isdir(run_dir):
        raise RunLoadError(f"{run_dir}: not a directory")
    config_path = os.path.join(run_dir, CONFIG_FILENAME)
    if not os.path.isfile(config_path):
        raise RunLoadError(f"{config_path}: not found ({run_dir} is not a zcvae run directory)")
    try:
        with open(config_path, encoding="utf-8") as handle:
            run_config = json.load(handle)
    except json.JSONDecodeError as exc:
        raise RunLoadError(f"{config_path}:{exc.lineno}: invalid JSON ({exc.msg})") from exc
    except (OSError, UnicodeDecodeError) as exc:
        raise RunLoadError(f"{config_path}: cannot read ({exc})") from exc
    if not isinstance(run_config, dict) or not isinstance(run_config.get("config"), dict):
        raise RunLoadError(f'{config_path}: expected a JSON object with a "config" object')
    run_config = {**run_config, "config": flat_config(run_config["config"])}  # sections or flat: flat keys

    metrics_path = os.path.join(run_dir, METRICS_FILENAME)
    records: list[dict[str, Any]] = []
    if os.path.exists(metrics_path):
        try:
            with open(metrics_path, encoding="utf-8") as handle:
                for lineno, line in enumerate(handle, start=1):
                    if not line.strip():
                        continue
                    try:
                        record = json.loads(line)
                    except json.JSONDecodeError as exc:
                        raise RunLoadError(
                            f"{metrics_path}:{lineno}: invalid JSON ({exc.msg}): {line.strip()[:80]!r}"
                        ) from exc
                    if not isinstance(record, dict):
                        raise RunLoadError(f"{metrics_path}:{lineno}: expected a JSON object per line")
                    records.append(record)
        except (OSError, UnicodeDecodeError) as exc:
            raise RunLoadError(f"{metrics_path}: cannot read ({exc})") from exc

    final_eval, final_step = _final_eval(records)
    written = read_verdict(run_dir)
    if written is not None:
        verdict = written["verdict"]
    else:  # a run from before verdict.json: the same judgement of its final evaluation
        verdict = verdict_of(final_eval, run_config["config"])["verdict"] if final_eval else None
    return RunSummary(
        run_dir=run_dir,
        config=dict(run_config["config"]),
        final_eval=final_eval,
        final_eval_step=final_step,
        num_records=len(records),
        versions=run_config.get("versions"),
        git_revision=run_config.get("git_revision"),
        kl_weight_factor=run_config.get("kl_weight_factor"),
        verdict=verdict,
    )


def _final_eval(records: Sequence[dict[str, Any]]) -> tuple[dict[str, Any] | None, int | None]:
    evals = [r for r in records if r.get("split") == "eval"]
    if not evals:
        return None, None
    last_step = evals[-1].get("step")
    # Evaluation may log latent metrics and decoding metrics as separate lines at one step.
    merged: dict[str, Any] = {}
    for record in evals:
        if record.get("step") == last_step:
            merged.update(record)
    return merged, last_step


# ----------------------------------------------------------------------------------------------
# Rows
# ----------------------------------------------------------------------------------------------


def _format_number(value: Any) -> str:
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value) or math.isinf(value):
            return str(value)
        return f"{value:.4g}"
    return str(value)


def _reconstruction_weights(config: dict[str, Any]) -> str:
    parts = []
    for key, short in RECONSTRUCTION_WEIGHT_ABBREVIATIONS.items():
        value = config.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value != 0:
            parts.append(f"{short}={value:g}")
    if not parts:
        return MISSING
    text = ", ".join(parts)
    if config.get("reconstruction_weight_scale") not in (None, "none"):
        # the mode-unit weights (raw, tok) as applied are these times the validation mean n_i
        text += f"; raw, tok x n ({config['reconstruction_weight_scale']})"
    return text


def _kl_schedule(config: dict[str, Any], factors: Sequence[Any]) -> str:
    """The KL schedule in a few words, e.g. ``delay-ramp 0.3+0.2``, ``cyclical x4 0.3+0.2``, ``constant``;
    with kl-weight-scale tokens, ``; beta x 7.1 (tokens)`` (the seeds' factors, if they differ, as a range)."""
    schedule = config.get("kl_schedule")
    if schedule is None:
        return MISSING
    text = str(schedule)
    if schedule != "constant":
        delay, ramp = config.get("kl_delay_fraction"), config.get("kl_ramp_fraction")
        if schedule == "cyclical":
            text += f" x{config.get('kl_cycles')}"
        text += f" {_format_number(delay)}+{_format_number(ramp)}"
    scale = config.get("kl_weight_scale")
    if scale not in (None, "none"):
        values = sorted({float(f) for f in factors if isinstance(f, (int, float))})
        shown = MISSING if not values else _format_number(values[0]) if len(values) == 1 else f"{_format_number(values[0])}-{_format_number(values[-1])}"
        text += f"; beta x {shown} ({scale})"
    return text


def _seed_free(value: Any, seed: Any) -> Any:
    """Replace the seed where a name marks it: ``b1-seed1`` -> ``b1-seed{seed}``, ``b1_s1`` -> ``b1_s{seed}``.

    Only marked occurrences: a bare digit equal to the seed (the 1 of ``b1``) is part of the name.
    """
    if seed is None or isinstance(seed, bool) or not isinstance(value, str):
        return value
    number = re.escape(str(seed))
    marked, count = re.subn(rf"(?i)(?<![0-9a-z])(seed[-_=]?){number}(?![0-9])", r"\1{seed}", value)
    if count:
        return marked
    # Otherwise only a seed that ends the name or path after a separator: "run-3", "run_s3".
    return re.sub(rf"([-_/.]s?){number}$", r"\1{seed}", value)


def _is_seed_bearing_key(key: str) -> bool:
    return key in ("run_name", "name") or key.endswith(("_dir", "_path", "output", "outdir"))


# Keys that never split a seed group: the seed itself; the kl- and reconstruction-weight-scale factors (read from each seed's
# data: one setting); and bookkeeping that does not change what is trained (a resumed run, a progress bar).
_NOT_GROUPING = frozenset({"seed", "kl_weight_factor", "reconstruction_weight_factor", "resume", "progress_bar", "save_every", "keep_last_checkpoints", "reference_cache_dir"})


def _group_key(summary: RunSummary) -> str:
    seed = summary.seed
    config = {
        key: (_seed_free(value, seed) if _is_seed_bearing_key(key) else value)
        for key, value in summary.config.items()
        if key not in _NOT_GROUPING
    }
    return json.dumps(config, sort_keys=True, default=str)


def _group_name(summaries: Sequence[RunSummary]) -> str:
    if len(summaries) == 1:
        return summaries[0].name
    name = _seed_free(summaries[0].name, summaries[0].seed)
    # "beta1-seed{seed}" -> "beta1"; a seed elsewhere in the name becomes "*".
    name = re.sub(r"(?i)[-_.]?seed[-_=]?\{seed\}", "", name)
    name = re.sub(r"[-_.]s?\{seed\}$", "", name)
    return name.replace("{seed}", "*") or summaries[0].name


def _numeric(value: Any) -> float | None:
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, (int, float)):
        return float(value)
    return None


def _stat(values: Sequence[float]) -> Stat | None:
    if not values:
        return None
    mean = sum(values) / len(values)
    if len(values) > 1:
        std = math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))
    else:
        std = 0.0
    return Stat(mean=mean, std=std, count=len(values))


def _config_cell(config: dict[str, Any], key: str) -> Any:
    value = config.get(key)
    return MISSING if value is None else value


def aggregate_runs(
    run_dirs: Iterable[str | os.PathLike],
    metrics: Sequence[str] | None = None,
    group_seeds: bool = True,
    *,
    skip_bad: bool = False,
    warn=None,
) -> list[dict[str, Any]]:
    """One row per run, or per group of runs that differ only in seed, in order of first appearance.

    Row keys: ``name``, ``latent``, ``mode``, ``objective``, ``recon``, ``alpha``, ``beta`` (config values
    or "-"), ``kl_schedule`` (the schedule and, under kl-weight-scale tokens, beta's factor),
    ``n`` (runs in the row), ``seeds`` (list), ``run_dirs`` (list), ``verdict`` (the runs' verdict, one
    string when every seed has the same, else each seed's joined by " / "), and one key per metric holding a
    ``Stat`` over the runs that report it (None when none does). A run directory listed twice counts once.
    With ``skip_bad`` an unreadable run is reported through ``warn(message)`` (default: stderr) and
    left out; otherwise its RunLoadError propagates. Token-weighted arms that differ in preset and also
    in alpha at one mode are reported through ``warn`` too (``zcvae.config.token_weighting_confounds``).
    ``mode`` shows a sum mode's fixed scale C as ``sum/C``.
    """
    metric_names = list(DEFAULT_METRICS if metrics is None else metrics)
    if warn is None:
        warn = lambda message: print(f"warning: {message}", file=sys.stderr)  # noqa: E731

    summaries: list[RunSummary] = []
    seen: set[str] = set()
    for run_dir in run_dirs:
        real = os.path.realpath(os.fspath(run_dir))
        if real in seen:
            continue
        seen.add(real)
        try:
            summaries.append(load_run(run_dir))
        except RunLoadError as exc:
            if not skip_bad:
                raise
            warn(f"skipping run: {exc}")

    for message in token_weighting_confounds(summary.config for summary in summaries):
        warn(message)

    groups: dict[str, list[RunSummary]] = {}
    for index, summary in enumerate(summaries):
        key = _group_key(summary) if group_seeds else str(index)
        groups.setdefault(key, []).append(summary)

    rows = []
    for members in groups.values():
        config = members[0].config
        row: dict[str, Any] = {
            "name": _group_name(members),
            "latent": _config_cell(config, "latent_type"),
            "mode": aggregation_label(config) if config.get("reconstruction_loss_token_aggregation_mode") else MISSING,
            "objective": _config_cell(config, "objective"),
            "recon": _reconstruction_weights(config),
            "alpha": _config_cell(config, "token_weight_alpha"),
            "beta": _config_cell(config, "kl_weight"),
            "kl_schedule": _kl_schedule(config, [m.kl_weight_factor for m in members]),
            "n": len(members),
            "seeds": [m.seed for m in members],
            "run_dirs": [m.run_dir for m in members],
            "verdict": _verdict_cell([m.verdict for m in members]),
        }
        for metric in metric_names:
            values = []
            for member in members:
                value = _numeric((member.final_eval or {}).get(metric))
                if value is not None:
                    values.append(value)
            row[metric] = _stat(values)
        unevaluated = [m.run_dir for m in members if not m.final_eval]
        if unevaluated:
            # a row of "-" alone reads like a run that scored nothing; say that it has no evaluation yet
            warn(f"{', '.join(map(str, unevaluated))}: no evaluation in metrics.jsonl yet (unfinished, or stopped "
                 f"early: see its log); its metrics show as '-'")
        rows.append(row)
    return rows


# ----------------------------------------------------------------------------------------------
# Formatting
# ----------------------------------------------------------------------------------------------


def _verdict_cell(verdicts: Sequence[str | None]) -> str:
    """One verdict when the seeds agree, else each seed's in order (``-`` for a run without one)."""
    shown = [v or MISSING for v in verdicts]
    return shown[0] if len(set(shown)) == 1 else " / ".join(shown)


def _metric_columns(rows: Sequence[dict[str, Any]]) -> list[str]:
    fixed = set(_IDENTITY_COLUMNS) | {"n", "seeds", "run_dirs", "verdict"}
    columns: list[str] = []
    for row in rows:
        for key in row:
            if key not in fixed and key not in columns:
                columns.append(key)
    return columns


def _seeds_cell(seeds: Sequence[Any]) -> str:
    shown = [str(s) for s in seeds if s is not None]
    return ",".join(shown) if shown else MISSING


def format_table(rows: Sequence[dict[str, Any]], fmt: str = "markdown") -> str:
    """Render ``aggregate_runs`` rows as a Markdown table or as CSV.

    Markdown cells show ``mean ± std`` (std only for n > 1) with 4 significant digits. CSV is for
    machines: full-precision numbers, the mean in the metric's column and the std in ``<metric>_std``
    (empty for a single run). Missing values are "-" in both.
    """
    if fmt not in ("markdown", "csv"):
        raise ValueError(f'fmt: expected "markdown" or "csv", got {fmt!r}')
    metrics = _metric_columns(rows)
    if fmt == "markdown":
        header = [*_IDENTITY_COLUMNS, "n", "seeds", "verdict", *metrics]
        lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
        for row in rows:
            cells = [_format_number(row.get(c, MISSING)) for c in _IDENTITY_COLUMNS]
            cells += [str(row.get("n", 1)), _seeds_cell(row.get("seeds", [])), str(row.get("verdict", MISSING))]
            for metric in metrics:
                stat = row.get(metric)
                cells.append(stat.format(row.get("n", 1)) if isinstance(stat, Stat) else MISSING)
            lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
        return "\n".join(lines) + "\n"

    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    header = [*_IDENTITY_COLUMNS, "n", "seeds", "verdict"]
    for metric in metrics:
        header += [metric, f"{metric}_std"]
    writer.writerow(header)
    for row in rows:
        cells = [row.get(c, MISSING) for c in _IDENTITY_COLUMNS]
        cells += [row.get("n", 1), _seeds_cell(row.get("seeds", [])), row.get("verdict", MISSING)]
        for metric in metrics:
            stat = row.get(metric)
            if isinstance(stat, Stat):
                cells += [repr(stat.mean), repr(stat.std) if stat.count > 1 else ""]
            else:
                cells += [MISSING, ""]
        writer.writerow(cells)
    return buffer.getvalue()


# ----------------------------------------------------------------------------------------------
# CLI
# ----------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="zcvae aggregate",
        description="Print one row per run (seeds grouped as mean ± std) with the final evaluation metrics.",
    )
    parser.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run directories (with run_config.json)")
    parser.add_argument("--format", choices=("markdown", "csv"), default="markdown", help="output format")
    parser.add_argument(
        "--metrics",
        default=None,
        help="comma-separated metric keys from metrics.jsonl eval records "
        f"(default: {','.join(DEFAULT_METRICS)})",
    )
    parser.add_argument(
        "--no-group-seeds", action="store_true", help="one row per run even when runs differ only in seed"
    )
    parser.add_argument(
        "--skip-bad", action="store_true", help="warn about unreadable run directories and leave them out"
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    metrics = None
    if args.metrics is not None:
        metrics = [m.strip() for m in args.metrics.split(",") if m.strip()]
        if not metrics:
            parser.error("--metrics: give at least one metric name")
    try:
        rows = aggregate_runs(
            args.run_dirs, metrics=metrics, group_seeds=not args.no_group_seeds, skip_bad=args.skip_bad
        )
    except RunLoadError as exc:
        print(f"zcvae aggregate: error: {exc}", file=sys.stderr)
        return 2  # a user error, as every command's (docs/guide/errors-and-recovery.md)
    if not rows:
        print("zcvae aggregate: error: no readable run directories", file=sys.stderr)
        return 2
    sys.stdout.write(format_table(rows, fmt=args.format))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
