"""Where a real `zcvae` command's resident memory grows: every new high-water mark (+16 MiB) of rank 0, with the
innermost zcvae frames of the main thread at that moment (BENCHMARKS.md, "Host memory").

    torchrun --standalone --nproc_per_node 2 bench/rss_highwater.py train --backbone /tmp/shapes/SmolLM2-135M-bfloat16 \\
        --allow-fresh-markers --task copy --max-steps 1 --micro-batch-size 1 --num-train-examples 8 --num-val-examples 4 \\
        --num-eval-decode-examples 0 --reference-policy online --engine deepspeed --deepspeed-config zero3 --output-dir /tmp/rt

(``python bench/rss_highwater.py train ...`` for the local engine.) A thread samples /proc/self/statm every 2 ms and
prints ``RSSHW <MiB> | <frames>``; at exit each rank prints ``PEAK <rank> <MiB>`` (getrusage).
"""

from __future__ import annotations

import os
import resource
import sys
import threading
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))
STEP_MIB = 16


def _rss_mib() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") // 2**20


def _sample(main_id: int) -> None:
    top = 0
    while True:
        now = _rss_mib()
        if now > top + STEP_MIB:
            top = now
            stack = traceback.extract_stack(sys._current_frames()[main_id])
            frames = [f"{os.path.basename(f.filename)}:{f.lineno}:{f.name}" for f in stack if "zcvae" in f.filename][-6:]
            print(f"RSSHW {now} | " + " < ".join(reversed(frames + [f"{os.path.basename(stack[-1].filename)}:{stack[-1].lineno}"])), flush=True)
        time.sleep(0.002)


def main(argv: list[str]) -> int:
    from zcvae.commands.cli import main as cli_main

    if os.environ.get("RANK", "0") == "0":
        threading.Thread(target=_sample, args=(threading.get_ident(),), daemon=True).start()
    rc = cli_main(argv)
    print(f"PEAK {os.environ.get('RANK', 0)} {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024}", flush=True)
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
