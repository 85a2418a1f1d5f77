"""The plan lines the README and the scaling-out guide print for 8B and 70B are what `zcvae plan` says today.

Those tables are copied by hand from the plan's output, and a change to a memory term changes them (they went
stale twice before this test). Each row is recomputed from the command the guide gives above the table."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from zcvae.plan.cli import GiB, plan_from_argv

ROOT = Path(__file__).resolve().parents[3]
COMMON = ["--precision", "bf16", "--num-latents", "4", "--x-len", "256", "--y-len", "256", "--gradient-checkpointing", "--gpu-memory", "80",
          "--micro-batch-size", "16"]
ROWS = {  # (backbone, engine column) -> the engine flags of the guide's command
    ("Llama-3.1-8B", "local"): ["--backbone", "Llama-3.1-8B", "--engine", "local"],
    ("Llama-3.1-70B", "ZeRO-3"): ["--backbone", "Llama-3.1-70B", "--engine", "deepspeed", "--deepspeed-config", "zero3", "--world-size", "8"],
    ("Llama-3.1-70B", "FSDP2"): ["--backbone", "Llama-3.1-70B", "--engine", "fsdp2", "--world-size", "8"],
}
ROW = re.compile(r"^\| (Llama-3\.1-\d+B) \| (local|ZeRO-3|FSDP2) \| [^|]+ \| ([\d.]+) GiB: (fits|does not fit) \| B <= (\d+) \|$", re.M)


@pytest.mark.parametrize("doc", ["README.md", "docs/guide/scaling-out.md"])
def test_the_documented_8b_and_70b_plans_are_the_plan_s_output(doc):
    rows = ROW.findall((ROOT / doc).read_text())
    assert {(b, e) for b, e, *_ in rows} == set(ROWS), f"{doc}: the plan table's rows changed; update ROWS in this test"
    for backbone, engine, gib, verdict, largest in rows:
        out = plan_from_argv(ROWS[backbone, engine] + COMMON)
        peak = out["peak"] / GiB
        assert float(gib) == pytest.approx(round(peak, 1), abs=1e-9), f"{doc}: {backbone} {engine} says {gib} GiB, the plan {peak:.1f}"
        assert verdict == ("fits" if peak <= 80 else "does not fit"), f"{doc}: {backbone} {engine}"
        assert int(largest) == out["largest_micro_batch"], f"{doc}: {backbone} {engine} says B <= {largest}, the plan {out['largest_micro_batch']}"
