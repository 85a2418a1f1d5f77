"""`zcvae plan` against a real run it predicts: the per-rank peak resident memory of a 1-step `zcvae train`
of a random-weight SmolLM2-135M shape (local engine, world 1), minus the same command's on the tiny shape,
within the ±20% the plan promises (BENCHMARKS.md, "Host memory", holds the larger cases).

RSS peaks are the kernel's high-water marks (getrusage), so the measurement does not depend on machine load."""

from __future__ import annotations

def test_the_plan_is_within_20_percent_of_a_measured_peak(bench_script, tmp_path):
    bench = bench_script("memory_bench")
    keep, work = tmp_path / "shapes", tmp_path / "runs"
    keep.mkdir()
    work.mkdir()
    row = bench.run_case("SmolLM2-135M", "local", 1, keep=keep, work=work, timeout=600, tiny_cache={})
    ratio = row["predicted"] / row["measured"]
    assert 0.8 <= ratio <= 1.2, bench.render([row])
    # the run held the model: the measured part is at least its frozen fp32 weights
    assert row["measured"] >= 0.9 * row["fp32"], bench.render([row])
