"""torchrun worker for tests/distributed/test_engines.py: runs every engine scenario in one launch.

    DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node 2 \
        tests/distributed/engine_worker.py --out /tmp/out [--only zero3-mean ...]

Rank 0 writes ``<scenario>.safetensors`` (trainable parameters after the last step) and
``<scenario>.json`` (per-step loss, reference loss, grad norm) under ``--out``. Checkpoint
scenarios save after ``CKPT_AFTER`` steps, finish the run, then build a fresh engine, load and
redo the remaining steps: ``<scenario>-resumed.*``. A scenario that raises on a rank writes
``<scenario>.rank<r>.error`` and the worker moves on; a scenario that hangs is caught by the
test's launch timeout and the gloo timeout set here. ``metrics`` checks ``reduce_metrics`` on
deliberately different per-rank values (``metrics.rank<r>.json``).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time
import traceback
from datetime import timedelta

import torch
from safetensors.torch import save_file

import engine_harness as H
from zcvae import distributed as zdist
from zcvae.engines import EngineConfig, build_engine
from zcvae.engines.deepspeed import BUILTIN_DEEPSPEED_CONFIGS


def scenarios(zero3_path: str) -> dict[str, dict]:
    """name -> engine config, aggregation mode, and whether to round-trip a checkpoint."""
    ds = lambda path, **kw: {"engine": "deepspeed", "deepspeed_config": path, **kw}  # noqa: E731
    out = {}
    for name, cfg in {
        "ddp": {"engine": "local"},
        "zero2": ds("zero2"),
        "zero3": ds(zero3_path),
        "fsdp2": {"engine": "fsdp2"},
    }.items():
        out[f"{name}-mean"] = {"config": cfg, "mode": "mean", "checkpoint": True}
        out[f"{name}-sum"] = {"config": cfg, "mode": "sum", "checkpoint": False}
        out[f"{name}-token"] = {"config": cfg, "mode": "token", "checkpoint": False}
    out["zero0-mean"] = {"config": ds("zero0"), "mode": "mean", "checkpoint": False}
    out["zero1-mean"] = {"config": ds("zero1"), "mode": "mean", "checkpoint": False}
    out["zero3gc-mean"] = {"config": ds(zero3_path, gradient_checkpointing=True), "mode": "mean", "checkpoint": False}
    out["zero3offload-mean"] = {"config": ds(zero3_path, cpu_offload=True), "mode": "mean", "checkpoint": False}
    out["fsdp2offload-mean"] = {"config": {"engine": "fsdp2", "cpu_offload": True}, "mode": "mean", "checkpoint": False}
    out["ddpgc-mean"] = {"config": {"engine": "local", "gradient_checkpointing": True}, "mode": "mean", "checkpoint": False}
    out["fsdp2gc-mean"] = {"config": {"engine": "fsdp2", "gradient_checkpointing": True}, "mode": "mean", "checkpoint": False}
    return out


def write(out_dir: str, name: str, state: dict, record: dict) -> None:
    save_file({k: v.contiguous() for k, v in state.items()}, os.path.join(out_dir, f"{name}.safetensors"))
    with open(os.path.join(out_dir, f"{name}.json"), "w") as f:
        json.dump(record, f)


def run_scenario(out_dir: str, name: str, spec: dict, accumulation: int) -> None:
    config = EngineConfig.from_dict(spec["config"])
    model = H.make_model()
    engine = build_engine(config, model=model, param_groups=H.param_groups(model), learning_rate=1.0)
    ckpt_dir = os.path.join(out_dir, f"ckpt-{name}")
    client = {"step": H.CKPT_AFTER, "marker": torch.arange(3.0)}

    def on_step(step: int) -> None:
        if spec["checkpoint"] and step == H.CKPT_AFTER - 1:
            engine.save_checkpoint(ckpt_dir, client_state=client)

    record = H.run_steps(engine, mode=spec["mode"], steps=range(H.NUM_STEPS), accumulation=accumulation, on_step=on_step)
    state = engine.trainable_state_dict()
    assert (len(state) > 0) == engine.is_main, "trainable_state_dict: rank 0 only"
    if engine.is_main:
        write(out_dir, name, state, record)
    if not spec["checkpoint"]:
        return
    model = H.make_model()
    engine = build_engine(config, model=model, param_groups=H.param_groups(model), learning_rate=1.0)
    loaded = engine.load_checkpoint(ckpt_dir)
    assert loaded["step"] == client["step"] and torch.equal(loaded["marker"], client["marker"]), loaded
    record = H.run_steps(engine, mode=spec["mode"], steps=range(H.CKPT_AFTER, H.NUM_STEPS), accumulation=accumulation)
    state = engine.trainable_state_dict()
    if engine.is_main:
        write(out_dir, f"{name}-resumed", state, record)


def check_metrics(out_dir: str, rank: int) -> None:
    """Ranks hold different (sum, count) pairs; rank 1 has no data (the has_data MIN pattern)."""
    got = zdist.reduce_metrics(
        sums={"nll": torch.tensor(1.0 + 2.0 * rank), "empty": 0.0},
        counts={"nll": 1 + 3 * rank, "empty": 0},
        mins={"has_data": float(rank == 0), "lo": rank + 0.5},
        maxs={"hi": torch.tensor(10.0 * rank)},
    )
    with open(os.path.join(out_dir, f"metrics.rank{rank}.json"), "w") as f:
        json.dump(got, f)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--only", nargs="*")
    args = parser.parse_args()
    info = zdist.init_distributed(timeout=timedelta(seconds=120))
    accumulation = H.NUM_EXAMPLES // (2 * info.world_size)  # 2 examples per micro-batch
    zero3 = copy.deepcopy(BUILTIN_DEEPSPEED_CONFIGS["zero3"])
    # Shard every parameter (the default keeps tiny ones whole), so gathers and exports are exercised.
    zero3["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    zero3_path = os.path.join(args.out, "zero3-test.json")
    if info.is_main:
        with open(zero3_path, "w") as f:
            json.dump(zero3, f)
    zdist.barrier()
    failed = False
    if not args.only or "metrics" in args.only:
        check_metrics(args.out, info.rank)
    start = time.time()
    for name, spec in scenarios(zero3_path).items():
        if args.only and name not in args.only:
            continue
        try:
            run_scenario(args.out, name, spec, accumulation)
        except Exception:  # noqa: BLE001 - report and keep going; the test reads the .error file
            failed = True
            with open(os.path.join(args.out, f"{name}.rank{info.rank}.error"), "w") as f:
                f.write(traceback.format_exc())
            traceback.print_exc()
        zdist.barrier()
        print(f"[rank {info.rank}] {name} done at {time.time() - start:.1f} s", flush=True)
    zdist.shutdown_distributed()  # a live gloo group can abort the process at exit (SIGABRT) after the work is done
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
