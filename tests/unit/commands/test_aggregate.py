"""Tests for zcvae.commands.aggregate over run directories written in the trainer's on-disk format."""

import csv
import io
import json
import math

import pytest

from zcvae.commands.aggregate import RunLoadError, Stat, aggregate_runs, format_table, load_run, main

BASE_CONFIG = {
    "run_name": "dist-mean-b1",
    "task": "running_sums",
    "latent_type": "discrete",
    "num_latents": 2,
    "reconstruction_loss_token_aggregation_mode": "mean",
    "reconstruction_weight": 0.0,
    "distribution_normalized_reconstruction_weight": 1.0,
    "example_inverse_surprisal_weighted_reconstruction_weight": 0.0,
    "token_weighted_reconstruction_weight": 0.0,
    "normalized_concentration_corrected_token_weighted_reconstruction_weight": 0.0,
    "normalized_inverse_surprisal_token_weighted_reconstruction_weight": 0.0,
    "token_weight_alpha": 1.0,
    "kl_weight": 1.0,
    "seed": 0,
    "output_dir": "runs/dist-mean-b1",
}


def write_run(root, dirname, *, records, lines=None, **overrides):
    """A run directory as the trainer writes it: run_config.json + metrics.jsonl."""
    run_dir = root / dirname
    run_dir.mkdir()
    config = {**BASE_CONFIG, **overrides}
    (run_dir / "run_config.json").write_text(
        json.dumps({"config": config, "versions": {"torch": "2.13.0"}, "git_revision": "abc123"}, indent=2)
    )
    text = "".join(json.dumps(r) + "\n" for r in records) if lines is None else lines
    (run_dir / "metrics.jsonl").write_text(text)
    return str(run_dir)


def history(final_eval, *, steps=300):
    """Train records, a mid-run eval, the final eval split in two lines, then a trailing train record."""
    return [
        {"step": 10, "split": "train", "loss": 3.0, "kl": 0.1},
        {"step": 150, "split": "eval", "loss": 2.0, "kl": 0.2, "nmi": 0.1, "mi": 0.05},
        {"step": steps, "split": "eval", "loss": 1.0, **{k: v for k, v in final_eval.items() if k != "exact_match"}},
        {"step": steps, "split": "eval", **({"exact_match": final_eval["exact_match"]} if "exact_match" in final_eval else {})},
        {"step": steps, "split": "train", "loss": 0.9, "kl": 9.9, "nmi": 9.9},
    ]


def test_load_run_takes_final_eval(tmp_path):
    run = write_run(tmp_path, "r", records=history({"nmi": 0.98, "kl": 0.75, "exact_match": 0.97}))
    summary = load_run(run)
    assert summary.name == "dist-mean-b1" and summary.seed == 0
    assert summary.final_eval_step == 300 and summary.num_records == 5
    assert summary.final_eval["nmi"] == 0.98 and summary.final_eval["kl"] == 0.75
    assert summary.final_eval["exact_match"] == 0.97
    assert summary.git_revision == "abc123"


def test_two_runs_differing_only_in_aggregation_mode_give_two_rows(tmp_path):
    mean_run = write_run(tmp_path, "mean", records=history({"nmi": 1.0, "kl": 0.7}))
    sum_run = write_run(
        tmp_path, "sum", records=history({"nmi": 0.0, "kl": 0.001}),
        reconstruction_loss_token_aggregation_mode="sum", run_name="dist-sum-b1", output_dir="runs/dist-sum-b1",
    )
    rows = aggregate_runs([mean_run, sum_run])
    assert [r["mode"] for r in rows] == ["mean", "sum"]
    assert [r["name"] for r in rows] == ["dist-mean-b1", "dist-sum-b1"]
    assert all(r["n"] == 1 and r["recon"] == "dist=1" and r["beta"] == 1.0 for r in rows)
    assert rows[0]["nmi"] == Stat(mean=1.0, std=0.0, count=1)
    assert rows[1]["kl"].mean == 0.001
    table = format_table(rows)
    lines = table.strip().splitlines()
    assert len(lines) == 4  # header, rule, two rows
    assert "| mode |" in lines[0] and "| mean |" in lines[2] and "| sum |" in lines[3]


def test_seed_grouping_mean_and_sample_std(tmp_path):
    runs = [
        write_run(
            tmp_path, f"seed{s}", records=history({"nmi": nmi_value, "kl": 0.7, "exact_match": 0.9}),
            seed=s, run_name=f"tokcc-mean-b1-seed{s}", output_dir=f"runs/tokcc-mean-b1-seed{s}",
            distribution_normalized_reconstruction_weight=0.0,
            normalized_concentration_corrected_token_weighted_reconstruction_weight=1.0,
            reconstruction_weight=0.5,
        )
        for s, nmi_value in [(0, 0.9), (1, 1.0), (2, 0.8)]
    ]
    other_beta = write_run(tmp_path, "beta3", records=history({"nmi": 0.0, "kl": 0.0}), kl_weight=3.0)
    rows = aggregate_runs(runs + [other_beta])
    assert len(rows) == 2
    grouped = rows[0]
    assert grouped["n"] == 3 and grouped["seeds"] == [0, 1, 2]
    assert grouped["name"] == "tokcc-mean-b1"
    assert grouped["recon"] == "raw=0.5, tokcc=1"
    assert grouped["nmi"].mean == pytest.approx(0.9)
    assert grouped["nmi"].std == pytest.approx(0.1)  # sample std of 0.9, 1.0, 0.8
    assert grouped["kl"].std == pytest.approx(0.0, abs=1e-12) and grouped["kl"].count == 3
    assert rows[1]["beta"] == 3.0 and rows[1]["n"] == 1
    assert "0.9 ± 0.1" in format_table(rows)

    ungrouped = aggregate_runs(runs, group_seeds=False)
    assert [r["n"] for r in ungrouped] == [1, 1, 1]
    assert [r["name"] for r in ungrouped] == [f"tokcc-mean-b1-seed{s}" for s in range(3)]


def test_seed_groups_do_not_merge_other_differences(tmp_path):
    a = write_run(tmp_path, "a", records=history({"nmi": 1.0}), seed=0, run_name="x-seed0")
    b = write_run(tmp_path, "b", records=history({"nmi": 0.0}), seed=1, run_name="x-seed1", token_weight_alpha=0.5)
    assert [r["n"] for r in aggregate_runs([a, b])] == [1, 1]


def test_missing_metric_in_some_group_members_is_counted(tmp_path):
    a = write_run(tmp_path, "a", records=history({"nmi": 1.0, "exact_match": 0.5}), seed=0, run_name="x-seed0")
    b = write_run(tmp_path, "b", records=history({"nmi": 0.0}), seed=1, run_name="x-seed1")
    (row,) = aggregate_runs([a, b])
    assert row["exact_match"] == Stat(mean=0.5, std=0.0, count=1)
    assert "0.5 (1/2)" in format_table([row])


def test_csv_parses_and_run_without_eval_shows_dash(tmp_path):
    done = write_run(tmp_path, "done", records=history({"nmi": 0.25, "control/matching_accuracy": 0.5}))
    fresh = write_run(
        tmp_path, "fresh", records=[{"step": 1, "split": "train", "loss": 5.0}], run_name="fresh", seed=4
    )
    rows = aggregate_runs([done, fresh])
    parsed = list(csv.DictReader(io.StringIO(format_table(rows, fmt="csv"))))
    assert len(parsed) == 2
    assert float(parsed[0]["nmi"]) == 0.25 and parsed[0]["nmi_std"] == ""
    assert float(parsed[0]["control/matching_accuracy"]) == 0.5
    assert parsed[0]["mode"] == "mean" and parsed[0]["recon"] == "dist=1"
    assert parsed[1]["nmi"] == "-" and parsed[1]["name"] == "fresh"
    markdown_row = format_table(rows).strip().splitlines()[-1]
    cells = [c.strip() for c in markdown_row.strip("|").split("|")]
    assert cells[0] == "fresh" and cells[-7:] == ["-"] * 7


def test_main_metrics_option_and_formats(tmp_path, capsys):
    run = write_run(tmp_path, "r", records=history({"nmi": 0.5, "mi": 0.3, "kl": 0.2}))
    assert main([run, "--metrics", "kl,mi", "--format", "csv"]) == 0
    out = capsys.readouterr().out
    header = next(csv.reader(io.StringIO(out)))
    assert header[-4:] == ["kl", "kl_std", "mi", "mi_std"] and "nmi" not in header
    assert main([run]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].startswith("| name |") and "router_support" in out


def test_corrupt_metrics_line_names_file_and_line(tmp_path, capsys):
    good_lines = "".join(json.dumps(r) + "\n" for r in history({"nmi": 1.0}))
    bad = write_run(tmp_path, "bad", records=None, lines=good_lines[:-1] + "\n\n{\"step\": 301, \"split\": \"ev")
    good = write_run(tmp_path, "good", records=history({"nmi": 1.0}), run_name="good")
    bad_metrics = f"{bad}/metrics.jsonl"
    with pytest.raises(RunLoadError, match=rf"{bad_metrics}:7: invalid JSON"):
        load_run(bad)

    assert main([good, bad]) == 2
    err = capsys.readouterr().err
    assert f"{bad_metrics}:7" in err

    assert main([good, bad, "--skip-bad"]) == 0
    captured = capsys.readouterr()
    assert "warning" in captured.err and f"{bad_metrics}:7" in captured.err
    assert "| good |" in captured.out and "dist-mean-b1" not in captured.out


def test_missing_or_corrupt_run_config(tmp_path, capsys):
    not_a_run = tmp_path / "not_a_run"
    not_a_run.mkdir()
    with pytest.raises(RunLoadError, match="run_config.json: not found"):
        load_run(not_a_run)
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "run_config.json").write_text('{\n  "config": {\n    "seed": 1,\n  }\n}\n')
    with pytest.raises(RunLoadError, match=r"run_config.json:4: invalid JSON"):
        load_run(broken)
    no_config_key = tmp_path / "flat"
    no_config_key.mkdir()
    (no_config_key / "run_config.json").write_text('{"seed": 1}')
    with pytest.raises(RunLoadError, match='"config"'):
        load_run(no_config_key)
    assert main([str(not_a_run), "--skip-bad"]) == 2
    assert "no readable run directories" in capsys.readouterr().err


def test_format_table_rejects_unknown_format():
    with pytest.raises(ValueError, match="fmt"):
        format_table([], fmt="html")


def test_non_finite_metric_is_shown_not_hidden(tmp_path):
    run = write_run(tmp_path, "nan", records=history({"nmi": math.nan}))
    (row,) = aggregate_runs([run], metrics=["nmi"])
    assert "nan" in format_table([row])


def test_seed_grouping_with_project_run_names(tmp_path):
    # zcvae.runs.naming writes names like "agg-sum_dist-1_beta-3_seed-2"; a seed equal to another number
    # in the name (beta-1, seed-1) must still group.
    runs = [
        write_run(tmp_path, f"s{s}", records=history({"nmi": 1.0}), seed=s,
                  run_name=f"agg-mean_dist-1_beta-1_seed-{s}", output_dir=f"runs/agg-mean_dist-1_beta-1_seed-{s}")
        for s in (1, 2)
    ]
    (row,) = aggregate_runs(runs)
    assert row["n"] == 2 and row["name"] == "agg-mean_dist-1_beta-1"


def test_default_table_shows_reachable_nmi_and_ratio(tmp_path):
    run = write_run(tmp_path, "r", records=history({"nmi": 0.6, "nmi_reachable": 0.8, "nmi_ratio": 0.75}))
    rows = aggregate_runs([run])
    assert rows[0]["nmi_reachable"].mean == 0.8 and rows[0]["nmi_ratio"].mean == 0.75
    header = format_table(rows).splitlines()[0]
    assert "| nmi | nmi_reachable | nmi_ratio |" in header
    # issue 20, item 2: spare latents are judged by how many are in use and whether each holds one strategy
    assert "| homogeneity |" in header and "| num_used_latents |" in header


def test_table_shows_each_runs_verdict(tmp_path):
    from zcvae.eval.verdict import report_verdict, verdict_of

    collapsed = {"nmi": 0.0, "mi": 1e-6, "kl": 1e-5, "num_used_latents": 2.0, "router_support": 2.0}
    healthy = {"nmi": 1.0, "nmi_ratio": 1.0, "mi": 0.68, "kl": 0.69, "num_used_latents": 2.0, "router_support": 2.0}
    # seed 0 wrote its verdict.json at the end of training; seed 1 ran before verdicts existed (recomputed)
    written = write_run(tmp_path, "s0", records=history(healthy), seed=0, run_name="x-seed0")
    report_verdict(written, {**healthy, "loss": 1.0}, {**BASE_CONFIG, "seed": 0}, step=300, source="train", log_lines=False)
    older = write_run(tmp_path, "s1", records=history(collapsed), seed=1, run_name="x-seed1")
    fresh = write_run(tmp_path, "fresh", records=[{"step": 1, "split": "train", "loss": 5.0}], run_name="fresh", kl_weight=2.0)
    assert load_run(written).verdict == "in use (2.0 of 2); gold: aligned"
    assert load_run(older).verdict == verdict_of({**collapsed, "loss": 1.0}, BASE_CONFIG)["verdict"] == "collapsed"
    assert load_run(fresh).verdict is None

    rows = aggregate_runs([written, older, fresh])
    assert rows[0]["n"] == 2 and rows[0]["verdict"] == "in use (2.0 of 2); gold: aligned / collapsed"
    assert rows[1]["verdict"] == "-"
    lines = format_table(rows).splitlines()
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    column = header.index("verdict")
    assert [[c.strip() for c in line.strip("|").split("|")][column] for line in lines[2:]] == [rows[0]["verdict"], "-"]
    parsed = list(csv.DictReader(io.StringIO(format_table(rows, fmt="csv"))))
    assert [r["verdict"] for r in parsed] == [rows[0]["verdict"], "-"]
    # seeds that agree show one verdict
    again = write_run(tmp_path, "s2", records=history(collapsed), seed=2, run_name="x-seed2")
    assert aggregate_runs([older, again])[0]["verdict"] == "collapsed"
