"""The end-of-run verdict through the real CLI: `zcvae train` prints it and writes verdict.json, `zcvae
aggregate` shows it, `zcvae evaluate` judges again. User JSONL without strategies, so no parser and no
gold labels: the label-free verdict, and every latent decoded for control/distinct_outputs."""

import dataclasses
import json


def _cells(line):
    return [c.strip() for c in line.strip().strip("|").split("|")]


def test_train_writes_and_prints_the_verdict_then_aggregate_and_evaluate_show_it(cli, tiny_backbone, tmp_path):
    from zcvae.data import get_task, make_examples, write_jsonl

    task = get_task("copy")
    for split, n in (("train", 32), ("val", 6)):
        unlabelled = [dataclasses.replace(e, strategy=None) for e in make_examples(task, seed=2, split=split, num_examples=n)]
        write_jsonl(tmp_path / f"{split}.jsonl", unlabelled)
    run_dir = tmp_path / "run"
    proc = cli("train", "--backbone", tiny_backbone, "--output-dir", run_dir, "--train-data", tmp_path / "train.jsonl",
               "--val-data", tmp_path / "val.jsonl", "--max-steps", "3", "--micro-batch-size", "8", "--log-every", "3",
               "--num-eval-decode-examples", "4", "--no-progress-bar", cwd=tmp_path)

    verdict = json.loads((run_dir / "verdict.json").read_text())
    assert verdict["source"] == "train" and verdict["step"] == 3
    assert verdict["status"] in ("collapsed", "in use") and verdict["gold"] is None and verdict["gold_status"] is None
    assert verdict["lines"][0] == f"[verdict] {verdict['verdict']}"
    for line in verdict["lines"]:
        assert line in proc.stdout
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    final = records[-1]
    assert final["split"] == "eval" and "nmi" not in final
    # the default's KL delay (60% of 3 steps) ends after step 2: one evaluation there, and its line
    assert [r["step"] for r in records if r["split"] == "eval"] == [2, 3] and (run_dir / "eval_step2.json").is_file()
    assert "[kl] the KL delay ends after step 2: MI " in proc.stdout
    # no parser: every latent was decoded for the 4 x, and the verdict read the fraction that differs
    assert final["decode/num_examples"] == 4 and 0.0 <= final["control/distinct_outputs"] <= 1.0
    assert verdict["decoding"]["distinct_outputs"] == final["control/distinct_outputs"]
    assert verdict["latents"]["num_used_latents"] == final["num_used_latents"]

    table = cli("aggregate", run_dir, cwd=tmp_path).stdout.splitlines()
    header, row = _cells(table[0]), _cells(table[2])
    assert row[header.index("verdict")] == verdict["verdict"]

    out = cli("evaluate", run_dir, cwd=tmp_path).stdout
    again = json.loads((run_dir / "verdict.json").read_text())
    assert again["source"] == "evaluate" and again["step"] == 3 and again["lines"][0] in out
