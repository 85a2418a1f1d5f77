"""The most sharded base-parameter bytes ZeRO-3 holds gathered at once, in forward and in backward, and the
peak RSS, for one real `zcvae train` per rank (BENCHMARKS.md, "Host memory").

    torchrun --standalone --nproc_per_node 2 bench/zero3_gathered.py [--without-per-call-release] -- \\
        train --backbone /tmp/shapes/SmolLM2-360M-bfloat16 --allow-fresh-markers --task copy --max-steps 1 \\
        --micro-batch-size 1 --num-train-examples 8 --num-val-examples 4 --num-eval-decode-examples 0 \\
        --reference-policy online --engine deepspeed --deepspeed-config zero3 --base-dtype bfloat16

(``python bench/memory_bench.py --keep /tmp/shapes`` builds the random-weight checkpoint.) Each rank wraps
DeepSpeed's ``PartitionedParameterCoordinator.fetch_sub_module`` and, after every fetch, sums the bytes of the
parameters that are gathered (``AVAILABLE``) and not persistent. ``--without-per-call-release`` turns off
``zcvae.engines.deepspeed._release_after_each_backward_call``, to see DeepSpeed's own per-module release.
Prints ``GATHERED {rank, forward_mib, backward_mib, peak_rss_mib}`` per rank.
"""

from __future__ import annotations

import json
import os
import resource
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))


def main(argv: list[str]) -> int:
    without = "--without-per-call-release" in argv
    train_argv = argv[argv.index("--") + 1:] if "--" in argv else [a for a in argv if a != "--without-per-call-release"]

    import deepspeed
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
    from deepspeed.runtime.zero.partitioned_param_coordinator import PartitionedParameterCoordinator as Coordinator

    from zcvae.commands.cli import main as cli_main
    from zcvae.engines import deepspeed as zds

    if without:
        zds._release_after_each_backward_call = lambda ds_engine: None
    held = {"forward": 0, "backward": 0}
    params: list = []
    initialize, fetch = deepspeed.initialize, Coordinator.fetch_sub_module

    def tracked_initialize(*args, **kwargs):
        out = initialize(*args, **kwargs)
        params[:] = [p for p in out[0].module.parameters() if hasattr(p, "ds_status")]
        return out

    def tracked_fetch(self, sub_module, forward):
        out = fetch(self, sub_module, forward)
        now = sum(p.ds_numel * p.element_size() for p in params if p.ds_status == ZeroParamStatus.AVAILABLE and not p.ds_persist)
        key = "forward" if forward else "backward"
        held[key] = max(held[key], now)
        return out

    deepspeed.initialize, Coordinator.fetch_sub_module = tracked_initialize, tracked_fetch
    rc = cli_main(train_argv)
    print("GATHERED " + json.dumps({"rank": int(os.environ.get("RANK", 0)), "forward_mib": round(held["forward"] / 2**20, 1),
                                    "backward_mib": round(held["backward"] / 2**20, 1),
                                    "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024}), flush=True)
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
