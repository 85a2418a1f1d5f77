"""`zcvae demo --quick`: the README's main command end to end, at toy size."""

import json
from pathlib import Path

import pytest

from zcvae.commands.demo import DEMO_THREADS

from zcvae.runs.rundir import read_run_record  # run_config.json's config, flat, of either layout


# One thread, so that the second run below differs from this one in its thread count
ONE_THREAD = {"OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def quick_demo(cli, tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("demo")
    return tmp_path, cli("demo", "--quick", "--output-dir", tmp_path / "demo", cwd=tmp_path, env=ONE_THREAD)


def test_demo_quick_prints_the_three_arm_table(quick_demo):
    """The tiny demo: sort3's backbone, then raw mean, the former default and the default, each run exactly
    as its arm says (the default's fields from the packaged preset file) and tabled."""
    from zcvae.commands.demo import DEMO_ARMS, DEMO_NUM_LATENTS, DEMO_TASK
    from zcvae.config import BEST_HYBRID, DEFAULT_OBJECTIVE, load_config_file

    tmp_path, proc = quick_demo
    out = proc.stdout
    table = [line for line in out.splitlines() if line.startswith("|") and "---" not in line]
    assert len(table) == 1 + len(DEMO_ARMS), out[-3000:]
    assert "tensorboard --logdir" in out
    runs = sorted((tmp_path / "demo" / "runs").iterdir())
    assert len(runs) == len(DEMO_ARMS)
    configs = [read_run_record(r)["config"] for r in runs]
    assert {c["task"] for c in configs} == {DEMO_TASK} and {c["num_latents"] for c in configs} == {DEMO_NUM_LATENTS}
    by_objective_scale = {(c["objective"], c["reconstruction_weight_scale"]): c for c in configs}
    assert set(by_objective_scale) == {("raw", "none"), (BEST_HYBRID, "none"), (DEFAULT_OBJECTIVE, "tokens")}
    default = by_objective_scale[(DEFAULT_OBJECTIVE, "tokens")]
    assert all(default[k] == v for k, v in load_config_file("default").items())
    former = by_objective_scale[(BEST_HYBRID, "none")]
    assert (former["reconstruction_loss_token_aggregation_mode"], former["posterior_pooling"], former["kl_delay_fraction"],
            former["router_support_weight"]) == ("mean", "last", 0.3, 0.0)
    # the raw arm is the plain raw term: none of the default preset's parts
    raw = by_objective_scale[("raw", "none")]
    assert (raw["posterior_pooling"], raw["router_support_weight"], raw["reconstruction_weight_factor"]) == ("last", 0.0, None)
    assert all((r / "verdict.json").is_file() for r in runs)
    assert (tmp_path / "demo" / "table.md").read_text().strip() == "\n".join(
        line for line in out.splitlines() if line.startswith("|")
    ).strip()


def test_the_demo_prints_the_same_table_whatever_thread_count_it_is_given(quick_demo, cli, tmp_path):
    """The demo fixes its own thread counts (DEMO_THREADS): the count sets the summation order, and a table that
    followed the machine's threads or load would differ in its last digits (one against two threads, the quick
    demo's default: mi 0.000664 against 0.0006643) and, over 300 steps, possibly in its outcome. Run again with two
    OpenMP threads (passive, so that they do not spin on a shared core), the table is the same to the last digit."""
    first_dir, _ = quick_demo
    cli("demo", "--quick", "--output-dir", tmp_path / "demo", cwd=tmp_path, env={"OMP_NUM_THREADS": "2", "OMP_WAIT_POLICY": "PASSIVE"})
    first, again = (first_dir / "demo" / "table.md").read_text(), (tmp_path / "demo" / "table.md").read_text()
    assert again == first
    # ... and each of its runs did run on the demo's count, not on the one it was given
    for run in (tmp_path / "demo" / "runs").iterdir():
        threads = {json.loads(line).get("num_threads") for line in (run / "metrics.jsonl").read_text().splitlines()} - {None}
        record = json.loads((run / "run_config.json").read_text())
        assert record["cpu"]["num_threads"] == DEMO_THREADS["run"] and not threads - {DEMO_THREADS["run"]}, (threads, record["cpu"])


def test_demo_backbone_runs_the_entangled_stage_then_the_arms_and_resumes(cli, raw_tiny_backbone, tmp_path):
    """`zcvae demo --backbone` on a backbone that has never seen the template (as a real LM has not):
    the expected time first, the entangled stage, raw mean against the default on it, the table; a
    second call reuses the stage and the finished runs."""
    from zcvae.backbone.stage_config import is_pretrained
    from zcvae.commands.demo import REAL_LM_ARMS
    from zcvae.config import DEFAULT_OBJECTIVE

    out = tmp_path / "demo-lm"
    proc = cli("demo", "--backbone", raw_tiny_backbone(), "--quick", "--output-dir", out, cwd=tmp_path)
    assert "[demo] expected time: about" in proc.stdout
    stage = out / "runs" / "entangled-copy"
    assert is_pretrained(stage)
    runs = sorted(p for p in (out / "runs").iterdir() if p.name != stage.name)
    configs = [read_run_record(r) for r in runs]
    assert sorted(c["config"]["objective"] for c in configs) == sorted(["raw", DEFAULT_OBJECTIVE])
    assert {Path(c["backbone"]) for c in configs} == {stage.resolve()}
    # the health check passed: the stage taught the backbone the markers
    assert all(not c["reference_health"]["fresh_markers"] for c in configs)
    table = [line for line in proc.stdout.splitlines() if line.startswith("|") and "---" not in line]
    assert len(table) == 1 + len(REAL_LM_ARMS)

    again = cli("demo", "--backbone", raw_tiny_backbone(), "--quick", "--output-dir", out, cwd=tmp_path)
    assert "(already built)" in again.stdout
    assert again.stdout.count("finished, skipped") == len(REAL_LM_ARMS)
