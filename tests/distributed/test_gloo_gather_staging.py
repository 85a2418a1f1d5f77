"""gloo's all-gather holds a second copy of its whole output while it runs: the plan counts it.

``zcvae plan --device cpu`` adds, under ZeRO-3 at world > 1, one more (V, H) embedding to what is gathered at once
(``plan.memory``, the ``comm`` term), because DeepSpeed gathers the tied embedding again at each head call and
gloo stages the result before copying it into place. If a torch release gathers in place, this test fails, and the
plan's term must go.

This file is both the pytest test and its torchrun worker:

    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node 2 tests/distributed/test_gloo_gather_staging.py --out DIR
"""

from __future__ import annotations

import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
OUTPUT_MIB = 64


def _worker(out: str) -> None:
    import ctypes
    import resource

    import torch
    import torch.distributed as dist

    ctypes.CDLL("libc.so.6").mallopt(-3, 128 << 10)  # M_MMAP_THRESHOLD as zcvae sets it under ZeRO-3: freed buffers go back
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    n = OUTPUT_MIB * 2**20 // 4
    shard = torch.ones(n // world)
    output = torch.zeros(n)  # written: its pages are resident before the gather
    dist.barrier()
    peak_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    dist.all_gather_into_tensor(output, shard)
    extra_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak_before) / 1024
    assert output.sum().item() == n
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump({"extra_mib": extra_mib}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    _worker(sys.argv[sys.argv.index("--out") + 1])
else:
    import launcher as C

    def test_gloo_all_gather_stages_a_copy_of_its_whole_output(tmp_path):
        launch = C.run_launch("gather", C.worker_cmd(__file__, "--out", tmp_path), log_dir=tmp_path, env=C.cpu_env(), timeout_s=120)
        assert launch.ok, launch.failure()
        for rank in range(2):
            extra = json.loads((tmp_path / f"rank{rank}.json").read_text())["extra_mib"]
            # the staging copy is the whole output (measured 104 MiB for 102): at least most of it, at most two
            assert 0.8 * OUTPUT_MIB <= extra <= 2 * OUTPUT_MIB, f"rank {rank}: the gather raised the peak by {extra:.0f} MiB"
