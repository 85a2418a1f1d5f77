"""Does the label-free verdict agree with the gold labels? Collapsed-or-not over a directory of runs.

    python bench/verdict_check.py runs/pilot-sort3 runs/pilot-mul runs/demo    # every run directory below them
    python bench/verdict_check.py runs --min-agreement 0.95                     # exit 1 below 95% agreement

A run directory is a directory below a root that holds ``run_config.json`` and an evaluation in
``metrics.jsonl``. For each, the verdict is recomputed from its final evaluation (the records of the
last eval step, read as ``zcvae aggregate`` reads them) and its config by ``zcvae.eval.verdict.verdict_of``;
``verdict.json`` is not read, so runs from before the verdict count too, and a change of the thresholds
is checked on every run at once. The verdict's label-free call (collapsed or not) is compared with the
gold call, NMI < ``GOLD_COLLAPSED_NMI`` (0.1). A verdict of ``unknown`` counts as a disagreement; runs
without a gold NMI (user data without strategies) or without an evaluation are listed and left out.

Prints one Markdown row per run, then ``agreement: A/N = R`` over the runs with a gold NMI.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "src"))


def run_dirs(roots: list[str]) -> list[Path]:
    """Every directory at or below the roots that holds run_config.json, sorted, each once."""
    found: set[Path] = set()
    for root in map(Path, roots):
        if not root.is_dir():
            raise ValueError(f"{root}: not a directory")
        found.update(p.parent.resolve() for p in root.rglob("run_config.json"))
    return sorted(found)


def check(directories: list[Path]) -> tuple[list[dict], int, int]:
    """(one row per run, runs that agree, runs with a gold NMI)."""
    from zcvae.commands.aggregate import RunLoadError, load_run
    from zcvae.eval.verdict import gold_collapsed, verdict_of

    rows, agree, judged = [], 0, 0
    for directory in directories:
        row = {"run": str(directory), "nmi": None, "mi_fraction": None, "distinct": None, "verdict": "-", "gold": "-", "agree": "-"}
        try:
            summary = load_run(directory)
        except RunLoadError as err:
            rows.append({**row, "verdict": f"unreadable: {err}"})
            continue
        row["run"] = summary.name
        if not summary.final_eval:
            rows.append({**row, "verdict": "no evaluation"})
            continue
        verdict = verdict_of(summary.final_eval, summary.config, step=summary.final_eval_step)
        gold = gold_collapsed(summary.final_eval)
        row.update(nmi=summary.final_eval.get("nmi"), mi_fraction=verdict["information"].get("mi_fraction"),
                   distinct=verdict["decoding"]["distinct_outputs"], verdict=verdict["verdict"])
        if gold is not None:
            judged += 1
            same = verdict["status"] != "unknown" and (verdict["status"] == "collapsed") == gold
            agree += same
            row.update(gold="collapsed" if gold else "not collapsed", agree="yes" if same else "NO")
        rows.append(row)
    return rows, agree, judged


def _cell(value) -> str:
    if value is None:
        return "-"
    return f"{value:.3g}" if isinstance(value, float) else str(value)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("roots", nargs="+", help="directories holding run directories (searched recursively)")
    parser.add_argument("--min-agreement", type=float, default=None, help="exit 1 when the agreement is below this")
    args = parser.parse_args(argv)
    try:
        directories = run_dirs(args.roots)
    except ValueError as err:
        print(f"verdict_check: error: {err}", file=sys.stderr)
        return 2
    rows, agree, judged = check(directories)
    columns = ("run", "nmi", "mi_fraction", "distinct", "verdict", "gold", "agree")
    print("| " + " | ".join(columns) + " |")
    print("|" + "|".join("---" for _ in columns) + "|")
    for row in rows:
        print("| " + " | ".join(_cell(row[c]).replace("|", "\\|") for c in columns) + " |")
    from zcvae.eval.verdict import GOLD_COLLAPSED_NMI

    ratio = agree / judged if judged else float("nan")
    print(f"\nagreement: {agree}/{judged} = {ratio:.3f} (collapsed-or-not vs gold NMI < {GOLD_COLLAPSED_NMI:g}; "
          f"{len(rows) - judged} of {len(rows)} runs without a gold NMI or an evaluation left out)")
    if args.min_agreement is not None and not (judged and ratio >= args.min_agreement):
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
