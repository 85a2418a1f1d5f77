"""`zcvae sweep FAMILY --local`: real tiny runs, the table with seed groups, resume skips finished runs;
and `zcvae train` records its CPU set-up, objective and kl-weight-scale factor."""

import json
import shutil

from zcvae.runs.rundir import read_run_record  # run_config.json's config, flat, of either layout

TINY = {"task": "copy", "max_steps": 2, "micro_batch_size": 8, "num_train_examples": 32, "num_val_examples": 8,
        "num_eval_decode_examples": 2, "log_every": 1, "warmup_steps": 1}


def test_train_records_flushing_threads_objective_and_kl_factor(cli, tiny_backbone, tmp_path):
    run_dir = tmp_path / "run"
    args = [f"--{k.replace('_', '-')}={v}" for k, v in TINY.items()]
    cli("train", "--backbone", tiny_backbone, "--output-dir", run_dir, *args, "--no-progress-bar",
        "--objective", "raw", "--reconstruction-loss-token-aggregation-mode", "sum", "--kl-weight-scale", "tokens",
        cwd=tmp_path)
    meta = read_run_record(run_dir)
    # measured inside the trainer's own process: a subnormal times 1 came out 0
    assert meta["cpu"]["flush_denormals"] is True and meta["cpu"]["num_threads"] >= 1
    assert meta["objective"] == "raw" == meta["config"]["objective"]
    assert "klscale-tokens" in meta["config"]["run_name"] and "obj-raw" in meta["config"]["run_name"]
    evals = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    final = [r for r in evals if r["split"] == "eval"][-1]
    # the factor is the validation mean of n_i, which evaluation reports as num_tokens
    assert abs(meta["kl_weight_factor"] - final["num_tokens"]) < 1e-6 and meta["kl_weight_factor"] > 2
    assert meta["config"]["kl_weight_factor"] == meta["kl_weight_factor"]


def test_train_resolves_the_reconstruction_weight_scale_to_the_validation_mean_n(cli, tiny_backbone, tmp_path):
    run_dir = tmp_path / "run"
    args = [f"--{k.replace('_', '-')}={v}" for k, v in TINY.items()]
    cli("train", "--backbone", tiny_backbone, "--output-dir", run_dir, *args, "--no-progress-bar",
        "--objective", "raw+dist", "--reconstruction-weight-scale", "tokens", cwd=tmp_path)
    meta = read_run_record(run_dir)
    assert "rscale-tokens" in meta["config"]["run_name"] and meta["config"]["reconstruction_weight"] == 1.0
    final = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if '"eval"' in line][-1]
    factor = meta["reconstruction_weight_factor"]
    assert abs(factor - final["num_tokens"]) < 1e-6 and factor > 2 and meta["config"]["reconstruction_weight_factor"] == factor
    # the weighted reconstruction the evaluation reports is raw x n_bar + dist, not raw + dist
    raw, dist = final["reconstruction_loss"], final["distribution_normalized_reconstruction_loss"]
    assert abs(final["weighted_reconstruction_loss"] - (factor * raw + dist)) < 1e-4 * max(1.0, final["weighted_reconstruction_loss"])


def _family(path, backbone):
    base = {**TINY, "backbone": str(backbone), "objective": "dist", "reconstruction_loss_token_aggregation_mode": "sum"}
    path.write_text(json.dumps({"base": base, "grid": {"seed": [0, 1]}}))  # JSON is YAML
    return path


def test_local_sweep_runs_resumes_and_prints_seed_groups(cli, tiny_backbone, tmp_path, monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)  # a user's OMP_NUM_THREADS wins over the sweep's one thread per run
    family = _family(tmp_path / "fam.yaml", tiny_backbone)
    out = tmp_path / "sweep"
    proc = cli("sweep", family, "--local", "--output-dir", out, "--jobs", "2", cwd=tmp_path)
    runs = sorted(p.name for p in out.iterdir() if p.is_dir())
    assert runs == ["agg-sum_obj-dist_seed-0", "agg-sum_obj-dist_seed-1"], runs
    rows = [line for line in proc.stdout.splitlines() if line.startswith("|") and "---" not in line]
    assert len(rows) == 2 and "| 2 | 0,1 |" in rows[1] and "±" in rows[1] and "| dist |" in rows[1], proc.stdout
    printed = [line for line in proc.stdout.splitlines() if line.startswith("|")]
    assert (out / "table.md").read_text().splitlines() == printed
    for name in runs:
        meta = read_run_record(out / name)
        # --jobs: each runs on one thread, fixed (zcvae.cpu.cpu_threads: a count that followed the free cores would make
        # the numbers depend on the other runs)
        assert meta["config"]["run_name"] == name and meta["cpu"]["num_threads"] == 1
        assert meta["cpu"]["num_threads_from"] == "ZCVAE_START_THREADS=1"
        rows = [json.loads(line) for line in (out / name / "metrics.jsonl").read_text().splitlines()]
        train = [r for r in rows if r["split"] == "train"]
        assert train and all(r.get("num_threads", 1) == 1 for r in train)

    kept = out / runs[0] / "metrics.jsonl"
    before = kept.read_text()
    shutil.rmtree(out / runs[1])
    proc = cli("sweep", family, "--local", "--output-dir", out, cwd=tmp_path)
    assert f"{runs[0]}: finished, skipped" in proc.stdout and "run 1/1" in proc.stdout
    assert kept.read_text() == before  # the finished run was not touched
    assert (out / runs[1] / "run_config.json").is_file()
    rows = [line for line in proc.stdout.splitlines() if line.startswith("|") and "---" not in line]
    assert len(rows) == 2 and "| 2 | 0,1 |" in rows[1]


def test_a_changed_base_does_not_pass_off_the_finished_runs_as_its_own(cli, tiny_backbone, tmp_path):
    """Run names list only what a family varies: after its base changes (here beta), the same names point
    at the finished runs of the old family. The sweep must not skip them as done: it says which field
    differs, exits non-zero, leaves them untouched and keeps them out of the table."""
    family = _family(tmp_path / "fam.yaml", tiny_backbone)
    out = tmp_path / "sweep"
    cli("sweep", family, "--local", "--output-dir", out, "--jobs", "2", cwd=tmp_path)
    names = sorted(p.name for p in out.iterdir() if p.is_dir())
    before = {name: (out / name / "metrics.jsonl").read_text() for name in names}
    spec = json.loads(family.read_text())
    spec["base"]["kl_weight"] = 2.0
    family.write_text(json.dumps(spec))
    dry = cli("sweep", family, "--local", "--output-dir", out, "--dry-run", cwd=tmp_path)
    assert dry.stdout.count("other run") == 2 and "kl_weight = 1.0" in dry.stdout, dry.stdout
    proc = cli("sweep", family, "--local", "--output-dir", out, cwd=tmp_path, check=False)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "finished, skipped" not in proc.stdout
    assert "holds a finished run with kl_weight = 1.0, but the family asks for 2.0" in proc.stderr, proc.stderr
    assert not [line for line in proc.stdout.splitlines() if line.startswith("|")]  # no table of the old runs
    assert {name: (out / name / "metrics.jsonl").read_text() for name in names} == before
