"""Step time across a collapsing run: the denormal stall is gone when the ratio stays near 1.

    python bench/collapse_bench.py                       # raw mean at the demo's budget (300 x 64) on copy, ~3-5 min
    python bench/collapse_bench.py --threads 1 --steps 80   # a shorter run on one thread

It trains raw mean at the demo's budget (objective raw, mean, beta 1 after the delay-ramp schedule, K = 2;
the demo's own raw-mean arm runs on sort3 at K = 3), which collapses the posterior around step 100 on the default task; before subnormal floats were flushed its
steps then went from 0.5 s to 3.0-3.4 s (MKL sgemm on subnormal gradients and Adam moments). It prints
the median step time of the last 100 steps over that of the first 50 (after a 5-step warm-up), plus the
final NMI and KL to show the run did collapse.

Step times come from the trainer's own log with ``log_every 1``: each record's ``tokens_per_second`` is
the supervised tokens of that one step over its wall time (logging happens outside the window), and
``num_tokens`` x B is those tokens, so step time = B x num_tokens / tokens_per_second. Nothing in the
trainer is changed for the benchmark. The backbone is the built-in one for the task (pretrained once
into ``$ZCVAE_CACHE``, not timed) unless ``--backbone`` is given.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "src"))

WARMUP = 5
FIRST, LAST = 50, 100


def step_times(metrics_path: Path, batch_size: int) -> list[float]:
    """Seconds per optimizer step, in step order, from a ``log_every 1`` metrics.jsonl."""
    out = []
    for line in metrics_path.read_text().splitlines():
        record = json.loads(line)
        if record.get("split") == "train" and record.get("tokens_per_second"):
            out.append(batch_size * record["num_tokens"] / record["tokens_per_second"])
    return out


@contextlib.contextmanager
def quiet_run():
    """The trainer's lines off (warnings stay): the bench prints its own table."""
    log = logging.getLogger("zcvae")
    level = log.level
    log.setLevel(logging.WARNING)
    try:
        yield
    finally:
        log.setLevel(level)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300, help="optimizer steps (>= 160 for both windows)")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--task", default=None, help="built-in task (default: the default task)")
    parser.add_argument("--backbone", default=None, help="backbone directory (default: the built-in one, cached)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: the trainer's choice, the idle cores)")
    args = parser.parse_args(argv)
    if args.threads is not None:
        os.environ["OMP_NUM_THREADS"] = str(args.threads)  # the trainer keeps an explicit OMP_NUM_THREADS

    from zcvae.config import TrainConfig
    from zcvae.data import DEFAULT_TASK
    from zcvae.commands.demo import DEMO_BASE
    from zcvae.train.trainer import default_backbone, train

    task = args.task or DEFAULT_TASK
    with tempfile.TemporaryDirectory(prefix="collapse-bench-") as tmp:
        values = {**DEMO_BASE, "objective": "raw", "task": task, "max_steps": args.steps, "micro_batch_size": args.batch_size,
                  "log_every": 1, "output_dir": tmp, "progress_bar": False}
        backbone = args.backbone or default_backbone(TrainConfig.from_dict({"task": task}))
        cfg = TrainConfig.from_dict({**values, "backbone": backbone})
        load = os.getloadavg()
        started = time.perf_counter()
        with quiet_run():
            final = train(cfg)
        wall = time.perf_counter() - started
        meta = json.loads((Path(tmp) / "run_config.json").read_text())
        times = step_times(Path(tmp) / "metrics.jsonl", args.batch_size)
    first = times[WARMUP : WARMUP + FIRST]
    last = times[-LAST:] if len(times) >= LAST else times[WARMUP:]
    if len(times) < WARMUP + FIRST + LAST:
        print(f"note: {len(times)} steps; the windows overlap (use --steps >= {WARMUP + FIRST + LAST})")
    ratio = statistics.median(last) / statistics.median(first)
    print(f"command: python bench/collapse_bench.py {' '.join(argv if argv is not None else sys.argv[1:])}".rstrip())
    print(f"task {task}, objective raw mean, beta {cfg.objective.kl_weight} ({cfg.objective.kl_schedule}), {args.steps} steps x {args.batch_size}; "
          f"threads {meta['cpu']['num_threads']} ({meta['cpu']['num_threads_from']}), flush_denormals {meta['cpu']['flush_denormals']}")
    print(f"load average before {load[0]:.1f}/{load[1]:.1f}/{load[2]:.1f}, after {'/'.join(f'{v:.1f}' for v in os.getloadavg())}; wall {wall:.0f} s incl. evaluation")
    print(f"final nmi {final.get('nmi', float('nan')):.3f}, kl {final.get('kl', float('nan')):.4f} (collapsed: nmi < 0.2)")
    print(f"median step: first {FIRST} (after {WARMUP}) {statistics.median(first) * 1000:.0f} ms, last {LAST} {statistics.median(last) * 1000:.0f} ms")
    print(f"median step over all steps after the warm-up: {statistics.median(times[WARMUP:]) * 1000:.0f} ms")
    print(f"ratio last/first: {ratio:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
