"""``zcvae demo``: the whole pipeline on the built-in default task, in minutes on a laptop CPU.

1. Pretrain the entangled tiny backbone on the default task (reused when it already exists).
2. Run seed 001's first pilot against the raw-mean baseline, all at the same beta:
   raw mean | distribution-normalized mean vs sum | concentration-corrected (alpha 1) mean vs sum.
3. Print the aggregate table and where the TensorBoard logs are.

The question the table answers (seed 002): does the reconstruction objective keep z in use when the KL
pushes the posterior to the prior? Teacher-forcing dilution predicts raw mean collapses first.
"""

from __future__ import annotations

import time
from pathlib import Path

from zcvae.config import TrainConfig

# The pilot: name -> overrides of the demo's base config.
PILOT = {
    "raw-mean": {"reconstruction_weight": 1.0},
    "dist-mean": {"reconstruction_weight": 0.0, "distribution_normalized_reconstruction_weight": 1.0},
    "dist-sum": {"reconstruction_weight": 0.0, "distribution_normalized_reconstruction_weight": 1.0, "reconstruction_loss_token_aggregation_mode": "sum"},
    "tokcc-mean": {"reconstruction_weight": 0.0, "normalized_concentration_corrected_token_weighted_reconstruction_weight": 1.0},
    "tokcc-sum": {"reconstruction_weight": 0.0, "normalized_concentration_corrected_token_weighted_reconstruction_weight": 1.0, "reconstruction_loss_token_aggregation_mode": "sum"},
}

# Chosen from the CPU prototype (shared/notes/cvae-training-findings.md): a delayed then ramped KL,
# LoRA 1e-3, latents 1e-2, batch 64, K = 2 for a two-strategy task.
DEMO_BASE = {
    "num_latents": 2,
    "kl_weight": 1.0,
    "max_steps": 300,
    "micro_batch_size": 64,
    "log_every": 20,
    "num_train_examples": 4000,
    "num_val_examples": 300,
    "num_eval_decode_examples": 48,
}
QUICK_BASE = {**DEMO_BASE, "max_steps": 6, "micro_batch_size": 8, "num_train_examples": 64, "num_val_examples": 16, "num_eval_decode_examples": 4, "log_every": 2}


def run_demo(*, output_dir: str = "runs/demo", quick: bool = False, seeds: int = 1, log=print) -> str:
    from zcvae.aggregate import aggregate_runs, format_table
    from zcvae.backbone import PretrainConfig, is_pretrained, pretrain
    from zcvae.data import DEFAULT_TASK
    from zcvae.trainer import train

    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    backbone = out / "backbone"
    if is_pretrained(backbone):
        log(f"[demo] reusing the backbone in {backbone}")
    else:
        pcfg = PretrainConfig(task=DEFAULT_TASK, output_dir=str(backbone))
        if quick:
            pcfg = PretrainConfig(task=DEFAULT_TASK, output_dir=str(backbone), max_steps=20, num_train_examples=256, num_val_examples=32, hidden_size=32, num_layers=2, num_heads=4, intermediate_size=64)
        log(f"[demo] 1/3 pretraining the entangled backbone on task {DEFAULT_TASK!r} -> {backbone}")
        pretrain(pcfg, log=log)
    base = QUICK_BASE if quick else DEMO_BASE
    run_dirs = []
    for seed in range(seeds):
        for i, (name, overrides) in enumerate(PILOT.items()):
            run_dir = out / "runs" / f"{name}_seed-{seed}"
            log(f"[demo] 2/3 run {i + 1}/{len(PILOT)} (seed {seed}): {name}")
            cfg = TrainConfig.from_dict({**base, **overrides, "task": DEFAULT_TASK, "backbone": str(backbone), "seed": seed, "output_dir": str(run_dir), "run_name": f"{name}_seed-{seed}", "progress_bar": not quick})
            train(cfg, log=log, overwrite=True)  # the demo owns its run directories: a second demo replaces them
            run_dirs.append(run_dir)
    rows = aggregate_runs([str(d) for d in run_dirs], group_seeds=seeds > 1)
    table = format_table(rows, "markdown")
    log("\n[demo] 3/3 final validation metrics (NMI: argmax q(z|x,y) vs the gold strategy)\n")
    log(table)
    log(f"\n[demo] done in {time.perf_counter() - started:.0f} s. TensorBoard: tensorboard --logdir {out / 'runs'}")
    (out / "table.md").write_text(table + "\n")
    return table
