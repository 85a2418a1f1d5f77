"""`zcvae demo --quick`: the README's main command end to end, at toy size."""

import json


def test_demo_quick_prints_the_pilot_table(cli, tmp_path):
    proc = cli("demo", "--quick", "--output-dir", tmp_path / "demo", cwd=tmp_path)
    out = proc.stdout
    table = [line for line in out.splitlines() if line.startswith("|") and "---" not in line]
    assert len(table) == 1 + 7, out[-3000:]  # header + raw mean, dist/tokcc/hybrid mean and sum
    body = "\n".join(table[1:])
    assert body.count("| sum ") + body.count("| sum|") >= 2 or body.count("sum") >= 2
    assert "tensorboard --logdir" in out
    runs = sorted((tmp_path / "demo" / "runs").iterdir())
    assert len(runs) == 7
    configs = [json.loads((r / "run_config.json").read_text())["config"] for r in runs]
    arms = {(c["objective"], c["reconstruction_loss_token_aggregation_mode"]) for c in configs}
    from zcvae.commands.demo import PILOT

    assert arms == set(PILOT) and ("raw", "mean") in arms and len({o for o, _ in arms}) == 4
    assert (tmp_path / "demo" / "table.md").read_text().strip() == "\n".join(
        line for line in out.splitlines() if line.startswith("|")
    ).strip()
