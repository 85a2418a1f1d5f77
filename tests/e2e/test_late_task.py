"""The real CLI on a late-decision family with K = 3 strategies: pretrain, train with one latent per
strategy, and the stratified / reachable metrics and the information-gain figure on disk."""

import json

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

PNG = b"\x89PNG\r\n\x1a\n"


def test_pretrain_and_train_on_mul_with_three_latents(cli, tmp_path):
    backbone = tmp_path / "bb"
    cli("pretrain", "--task", "mul", "--output-dir", backbone, "--max-steps", "3", "--num-train-examples", "64",
        "--num-val-examples", "16", "--num-decode-examples", "4", "--hidden-size", "32", "--num-layers", "1",
        "--num-heads", "2", "--intermediate-size", "64", cwd=tmp_path)
    summary = json.loads((backbone / "pretrain_summary.json").read_text())
    assert summary["config"]["task"] == "mul"
    run_dir = tmp_path / "run"
    cli("train", "--backbone", backbone, "--task", "mul", "--num-latents", "3", "--output-dir", run_dir,
        "--max-steps", "2", "--micro-batch-size", "8", "--num-train-examples", "32", "--num-val-examples", "40",
        "--num-eval-decode-examples", "3", "--log-every", "1", "--no-progress-bar", cwd=tmp_path)
    final = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()][-1]
    assert final["split"] == "eval"
    for strategy in ("direct", "repeated", "column"):
        assert f"by_strategy/{strategy}/latent_usage/2" in final and f"by_strategy/{strategy}/nmi" in final
    assert {"by_length/t1/reconstruction_loss", "by_length/t3/max_length", "nmi_reachable", "nmi_ratio"} <= set(final)
    assert 0 < final["nmi_reachable"] <= 1
    acc = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    assert {"eval/nmi_reachable", "eval/nmi_ratio", "eval/by_strategy/column/nmi"} <= set(acc.Tags()["scalars"])
    assert (run_dir / "information_gain.png").read_bytes()[:8] == PNG
    details = json.loads(next(run_dir.glob("eval_step*.json")).read_text())
    # mul decides right after 'a * b': 4, 5 or 6 tokens into y
    assert set(details["info_gain"]["decision_positions"]) <= {"4", "5", "6"}
