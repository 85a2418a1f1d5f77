"""``zcvae demo``: the whole pipeline on the built-in default task, in minutes on a laptop CPU.

1. Pretrain the entangled tiny backbone on the default task (reused when it already exists).
2. Run seed 001's pilot, all at the same beta, as a run family through the local sweep runner
   (:func:`zcvae.commands.sweep.run_local`; finished runs are skipped, so an interrupted demo resumes):
   raw mean | dist mean vs sum | tokcc mean vs sum | the best hybrid mean vs sum (the objective presets
   of :data:`zcvae.config.OBJECTIVE_PRESETS`), ``--seeds N`` seeds each.
3. Print the aggregate table (seed groups as mean ± std) and where the TensorBoard logs are.

The question the table answers (seed 002): does the reconstruction objective keep z in use when the KL
pushes the posterior to the prior, and does the decoder still work? Teacher-forcing dilution predicts raw
mean collapses first.
"""

from __future__ import annotations

import time
from pathlib import Path

from zcvae.config import BEST_HYBRID

# The pilot's arms: (objective preset, aggregation mode), in table order.
PILOT: tuple[tuple[str, str], ...] = (
    ("raw", "mean"),
    ("dist", "mean"),
    ("dist", "sum"),
    ("tokcc", "mean"),
    ("tokcc", "sum"),
    (BEST_HYBRID, "mean"),
    (BEST_HYBRID, "sum"),
)

# The demo's compute budget, in one place: backbone pretraining steps, then steps x batch per run.
# Measured target: the whole demo (pretraining + the 7 runs + evaluation) <= 600 s on 2 idle cores.
DEMO_BUDGET = {"pretrain_steps": 800, "max_steps": 300, "micro_batch_size": 64}
# Runs at once (one thread each when > 1; 1 = one run at a time on all free cores). See BENCHMARKS.md.
DEMO_JOBS = 2

# Chosen from the CPU prototype (shared/notes/cvae-training-findings.md): a delayed then ramped KL,
# LoRA 1e-3, latents 1e-2, K = 2 for a two-strategy task.
DEMO_BASE = {
    "num_latents": 2,
    "kl_weight": 1.0,
    "max_steps": DEMO_BUDGET["max_steps"],
    "micro_batch_size": DEMO_BUDGET["micro_batch_size"],
    "log_every": 20,
    "num_train_examples": 4000,
    "num_val_examples": 300,
    "num_eval_decode_examples": 48,
}
QUICK_BASE = {**DEMO_BASE, "max_steps": 6, "micro_batch_size": 8, "num_train_examples": 64, "num_val_examples": 16, "num_eval_decode_examples": 4, "log_every": 2}


def demo_family(*, backbone: str, task: str, seeds: int, quick: bool = False) -> dict:
    """The demo as a run family (the format of ``launch/families/*.yaml``)."""
    objectives, modes = zip(*PILOT)
    return {
        "description": "zcvae demo: seed 001's pilot on the built-in default task",
        "base": {**(QUICK_BASE if quick else DEMO_BASE), "task": task, "backbone": backbone},
        "grid": {"seed": list(range(seeds))},
        "zip": [{"objective": list(objectives), "reconstruction_loss_token_aggregation_mode": list(modes)}],
    }


def run_demo(*, output_dir: str = "runs/demo", quick: bool = False, seeds: int = 1, jobs: int | None = None, log=print) -> str:
    from zcvae.backbone.pretraining import PretrainConfig, is_pretrained, pretrain
    from zcvae.data import DEFAULT_TASK
    from zcvae.commands.sweep import local_plan, local_table, run_local

    if seeds < 1:
        raise ValueError(f"--seeds must be >= 1, got {seeds}")
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    backbone = out / "backbone"
    if is_pretrained(backbone):
        log(f"[demo] reusing the backbone in {backbone}")
    else:
        pcfg = PretrainConfig(task=DEFAULT_TASK, output_dir=str(backbone), max_steps=DEMO_BUDGET["pretrain_steps"])
        if quick:
            pcfg = PretrainConfig(task=DEFAULT_TASK, output_dir=str(backbone), max_steps=20, num_train_examples=256, num_val_examples=32, hidden_size=32, num_layers=2, num_heads=4, intermediate_size=64)
        log(f"[demo] 1/3 pretraining the entangled backbone on task {DEFAULT_TASK!r} -> {backbone}")
        pretrain(pcfg, log=log)
    log(f"[demo] pretraining done at {time.perf_counter() - started:.0f} s")
    runs = local_plan(demo_family(backbone=str(backbone.resolve()), task=DEFAULT_TASK, seeds=seeds, quick=quick), output_dir=out / "runs")
    log(f"[demo] 2/3 {len(runs)} runs: {', '.join(f'{o} {m}' for o, m in PILOT)}, {seeds} seed(s) each")
    _, failed = run_local(runs, jobs=DEMO_JOBS if jobs is None else jobs, log=log, progress_bar=not quick)
    if failed:
        raise ValueError("demo runs failed: " + "; ".join(f"{run.name}: {why}" for run, why in failed))
    table = local_table(runs)
    log("\n[demo] 3/3 final validation metrics (NMI: argmax q(z|x,y) vs the gold strategy; matching: best z-to-strategy decoding)\n")
    log(table)
    log(f"\n[demo] done in {time.perf_counter() - started:.0f} s. TensorBoard: tensorboard --logdir {out / 'runs'}")
    (out / "table.md").write_text(table + "\n")
    return table
