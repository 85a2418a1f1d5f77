"""The real `zcvae` CLI on a tiny task: run directory contract, TensorBoard tags, names, aggregate."""

import json

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from zcvae.core.losses import RECONSTRUCTION_TERMS
from zcvae.runs.rundir import read_run_record  # run_config.json's config, flat, of either layout

TRAIN = ["--task", "copy", "--max-steps", "4", "--micro-batch-size", "8", "--num-train-examples", "64",
         "--num-val-examples", "12", "--num-eval-decode-examples", "4", "--log-every", "2", "--no-progress-bar"]


def _events(run_dir):
    acc = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    return set(acc.Tags()["scalars"])


def test_train_mean_and_sum_then_aggregate(cli, tiny_backbone, tmp_path):
    run_cli = cli
    runs = {}
    for mode in ("mean", "sum"):
        run_dir = tmp_path / f"run-{mode}"
        run_cli("train", "--backbone", tiny_backbone, "--output-dir", run_dir, *TRAIN,
                "--reconstruction-loss-token-aggregation-mode", mode,
                "--distribution-normalized-reconstruction-weight", "1", "--reconstruction-weight", "0", cwd=tmp_path)
        runs[mode] = run_dir

        meta = read_run_record(run_dir)
        assert meta["config"]["reconstruction_loss_token_aggregation_mode"] == mode
        assert meta["c_base"]["mode"] == mode and meta["c_base"]["value"] > 0
        assert {"torch", "transformers", "peft", "deepspeed"} <= set(meta["versions"])
        assert "git_revision" in meta

        records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        train = [r for r in records if r["split"] == "train"]
        evals = [r for r in records if r["split"] == "eval"]
        assert [r["step"] for r in train] == [2, 4] and evals[-1]["step"] == 4
        for record in (train[-1], evals[-1]):
            assert "loss" in record and all(term in record for term in RECONSTRUCTION_TERMS)
            assert {"num_tokens", "num_tokens_min", "num_tokens_max", "c_base", "kl"} <= set(record)
        assert {"grad_norm", "tokens_per_second", "learning_rate/lora", "learning_rate/latent"} <= set(train[-1])
        assert {"mi", "nmi", "router_support", "control/matching_accuracy", "exact_match"} <= set(evals[-1])
        # the optimised objective equals the weighted sum of its parts (distribution-normalized + beta KL)
        assert abs(train[0]["loss"] - train[0]["distribution_normalized_reconstruction_loss"]) < 1e-4  # beta = 0 early

        tags = _events(run_dir)
        for term in RECONSTRUCTION_TERMS:
            assert f"train/{term}" in tags and f"eval/{term}" in tags
        assert (run_dir / "latents.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    names = {m: read_run_record(d)["config"]["run_name"] for m, d in runs.items()}
    assert names["mean"] != names["sum"] and "agg-sum" in names["sum"]

    # sum-mode reconstruction is the per-example token sum: larger than the mean by the span length
    last = {m: [json.loads(l) for l in (d / "metrics.jsonl").read_text().splitlines()][-1] for m, d in runs.items()}
    assert last["sum"]["reconstruction_loss"] > 3 * last["mean"]["reconstruction_loss"]

    table = run_cli("aggregate", runs["mean"], runs["sum"], cwd=tmp_path).stdout
    rows = [line for line in table.splitlines() if line.startswith("|") and "---" not in line]
    assert len(rows) == 3  # header + one row per run
    assert any("sum" in r for r in rows[1:]) and any("mean" in r for r in rows[1:])
    csv = run_cli("aggregate", runs["mean"], runs["sum"], "--format", "csv", cwd=tmp_path).stdout
    assert len(csv.strip().splitlines()) == 3


def test_user_jsonl_data_and_bad_input(cli, tiny_backbone, tmp_path):
    run_cli = cli
    from zcvae.data import get_task, make_examples, write_jsonl

    task = get_task("copy")
    write_jsonl(tmp_path / "train.jsonl", make_examples(task, seed=1, split="train", num_examples=40))
    write_jsonl(tmp_path / "val.jsonl", make_examples(task, seed=1, split="val", num_examples=9))
    run_dir = tmp_path / "user"
    run_cli("train", "--backbone", tiny_backbone, "--output-dir", run_dir, "--train-data", tmp_path / "train.jsonl",
            "--val-data", tmp_path / "val.jsonl", "--max-steps", "2", "--micro-batch-size", "8", "--log-every", "1",
            "--no-progress-bar", "--report-to", "jsonl", cwd=tmp_path)
    meta = read_run_record(run_dir)
    assert meta["data"]["source"].startswith("jsonl:") and meta["data"]["val"]["kept"] == 9
    assert (run_dir / "metrics.jsonl").is_file() and not (run_dir / "tensorboard").exists()  # the one sink asked for

    bad = tmp_path / "bad.yaml"
    bad.write_text("kl_weight: 1\nnot_a_field: 3\n")
    proc = run_cli("train", "--config", bad, cwd=tmp_path, check=False)
    assert proc.returncode == 2 and "not_a_field" in proc.stderr
    (tmp_path / "broken.jsonl").write_text('{"id": "a", "x": "1 2", "y": "fwd 1 2 ."}\n{"id": "b", "x": "1"}\n')
    proc = run_cli("train", "--backbone", tiny_backbone, "--train-data", tmp_path / "broken.jsonl", "--val-data",
                   tmp_path / "val.jsonl", "--output-dir", tmp_path / "x", cwd=tmp_path, check=False)
    assert proc.returncode == 2 and "broken.jsonl" in proc.stderr and "broken.jsonl:2" in proc.stderr
