"""``zcvae demo``: the whole pipeline on a late-decision task, in minutes on a laptop CPU.

1. Pretrain the entangled tiny backbone on ``sort3`` (reused when it already exists): y restates x, then
   one of three strategies, so the strategies part only at a decision token 3-5 tokens into y.
2. Train the three arms that show the three outcomes a user meets, as a run family through the local
   sweep runner (:func:`zcvae.sweep.local.run_local`; finished runs are skipped, so an interrupted demo
   resumes), ``--seeds N`` seeds each, two at a time:
   raw mean (the collapse control: z unused) | the former default (``--objective raw+dist``, mean mode,
   the ``</y>`` state: at 300 x 64 two of the three strategies merge into one latent; at the demo's 300 x 16 z
   collapses, docs/results/demo.md) | the default (no objective
   flag, the ``default`` preset: mean mode at a sequence's scale, mean pooling, 60% KL delay, router
   support, the decision tokens weighted: one latent per strategy). The controls run at a quarter of the rows
   (``DEMO_BUDGET``).
3. Print the aggregate table (seed groups as mean ± std) and where the TensorBoard logs are.

``zcvae demo --backbone DIR|FILE.gguf|smollm2`` does the same for a pretrained LM: its entangled stage
on copy first (a raw LM has never seen the template), then raw mean against the default
(:func:`real_lm_family`: the stage and base of ``launch/families/real-lm-copy.yaml`` and
``real-lm-default.yaml``). It prints its expected time, from one timed step of the backbone, before it starts.

What the table teaches (docs/results/demo.md): the plain per-token mean loses z (the
dilution argument, docs/objective.md#dilution); a normalized objective keeps z but, reading only the
``</y>`` state at the per-token scale, merges the strategies that part late; the default keeps all three
apart. The verdict of each run says which of these it is, without gold labels.
"""

from __future__ import annotations

import logging
import os
import time
from contextlib import contextmanager, nullcontext
from pathlib import Path

from zcvae.config import BEST_HYBRID, DEFAULT_PRESET, field_defaults, load_config_file

logger = logging.getLogger(__name__)

# The demo's task and K: sort3's three strategies (direct, count, descending) part at one token after y restates x.
DEMO_TASK = "sort3"
DEMO_NUM_LATENTS = 3

# The demo's compute budget, in one place: backbone pretraining steps, steps per run, and the batch of the
# default (the budget of the late-decision tables, docs/results/late-decisions.md, 300 x 64) and of the two controls. The controls
# fail at every batch we ran, 16, 32 and 64 (raw mean collapses; the former default merges two strategies, or at 16
# rows loses z altogether: docs/results/demo.md), so they run at a quarter of the rows, which keeps the demo near its
# 600 s / 1,100 CPU-s goal (BENCHMARKS.md, "The demo"); the default keeps the batch its 3-seed table was measured
# at (at 48 rows one sort3 seed of three merged).
DEMO_BUDGET = {"pretrain_steps": 800, "max_steps": 300, "micro_batch_size": 64, "control_micro_batch_size": 16}

# The demo's arms, in table order: (label, the config fields the arm sets).
DEMO_ARMS: tuple[tuple[str, dict], ...] = (
    ("raw mean", {"objective": "raw", "reconstruction_loss_token_aggregation_mode": "mean",
                  "micro_batch_size": DEMO_BUDGET["control_micro_batch_size"]}),
    # what `zcvae train` ran with no objective flag before the default preset: an objective given, so none of
    # the preset's other fields apply
    ("former default", {"objective": BEST_HYBRID, "reconstruction_loss_token_aggregation_mode": "mean",
                        "micro_batch_size": DEMO_BUDGET["control_micro_batch_size"]}),
    ("default", {**load_config_file(DEFAULT_PRESET), "micro_batch_size": DEMO_BUDGET["micro_batch_size"]}),
)
# Runs at once, one thread each: the default (the longest) starts first on one core and the two controls follow
# each other on the other (_run_and_tabulate starts the largest budget first). Three at once would share two cores
# three ways and end later.
DEMO_JOBS = 2
# The demo's thread counts, fixed whatever the machine or OMP_NUM_THREADS says: the count sets the summation order,
# so the table it prints, and docs/results/demo.md, are the same on any machine under any load. One thread each,
# pretraining included: two threads pinned on a loaded machine spin-wait on each other (the demo's pretraining at 2
# threads beside two other runs on 2 cores: 7.9 s/step, against 0.2 s/step on an idle machine).
DEMO_THREADS = {"pretrain": 1, "run": 1}

# Chosen from the CPU prototype of this CVAE: a delayed then ramped KL, LoRA 1e-3, latents 1e-2.
DEMO_BASE = {
    "kl_weight": 1.0,
    "max_steps": DEMO_BUDGET["max_steps"],
    "log_every": 20,
    "num_train_examples": 4000,
    "num_val_examples": 300,
    "num_eval_decode_examples": 48,
}
QUICK_BASE = {**DEMO_BASE, "max_steps": 6, "num_train_examples": 64, "num_val_examples": 16, "num_eval_decode_examples": 4, "log_every": 2}
QUICK_MICRO_BATCH_SIZE = 8


def arm_columns(arms: tuple[tuple[str, dict], ...], *, micro_batch_size: int | None = None) -> dict[str, list]:
    """``arms`` ((label, fields) pairs) as the columns of a family's ``zip``: every field any arm sets, with
    TrainConfig's default where an arm leaves it (so each run is exactly the arm, and its name lists what
    differs); ``micro_batch_size``: every arm at that batch (the quick demo's toy size)."""
    defaults = field_defaults()
    fields_per_arm = [{**fields, "micro_batch_size": micro_batch_size} if micro_batch_size else fields for _, fields in arms]
    keys = sorted({k for fields in fields_per_arm for k in fields})
    return {k: [fields.get(k, defaults[k]) for fields in fields_per_arm] for k in keys}


def demo_arm_columns(*, quick: bool = False) -> dict[str, list]:
    """The tiny demo's arms as zip columns; ``quick``: every arm at the toy batch."""
    return arm_columns(DEMO_ARMS, micro_batch_size=QUICK_MICRO_BATCH_SIZE if quick else None)


def demo_family(*, backbone: str, task: str = DEMO_TASK, seeds: int, quick: bool = False) -> dict:
    """The demo as a run family (the format of ``launch/families/*.yaml``)."""
    return {
        "description": f"zcvae demo: raw mean, the former default and the default on {task}",
        "base": {**(QUICK_BASE if quick else DEMO_BASE), "task": task, "num_latents": DEMO_NUM_LATENTS, "backbone": backbone},
        "grid": {"seed": list(range(seeds))},
        "zip": [demo_arm_columns(quick=quick)],
    }


# ---- a real pretrained LM (`zcvae demo --backbone`) ------------------------------------------------------
# The real-LM studies' stage and base (launch/families/real-lm-copy.yaml and real-lm-default.yaml; a test keeps
# them equal): the entangled stage on copy, then raw mean (the collapse control) against the no-flag default,
# the default's fields spelled out as in the tiny demo (DEMO_ARMS).
REAL_LM_TASK = "copy"
REAL_LM_STAGE = {"max_steps": 200, "batch_size": 16, "warmup_steps": 20, "num_val_examples": 200,
                 "num_decode_examples": 32, "max_length": 64, "log_every": 10, "eval_every": 100}
REAL_LM_BASE = {"task": REAL_LM_TASK, "num_latents": 2, "micro_batch_size": 8, "max_steps": 150, "num_val_examples": 100,
                "num_eval_decode_examples": 16, "log_every": 10, "max_length": 64,
                "reconstruction_loss_token_aggregation_mode": "mean"}
REAL_LM_ARMS: tuple[tuple[str, dict], ...] = (
    ("raw mean", {"objective": "raw"}),
    ("default", load_config_file(DEFAULT_PRESET)),
)
QUICK_REAL_LM_STAGE = {**REAL_LM_STAGE, "max_steps": 4, "batch_size": 8, "warmup_steps": 1, "num_train_examples": 64,
                       "num_val_examples": 16, "num_decode_examples": 4, "log_every": 2, "eval_every": 0}
QUICK_REAL_LM_BASE = {**REAL_LM_BASE, "max_steps": 4, "micro_batch_size": 4, "num_train_examples": 64, "num_val_examples": 16,
                      "num_eval_decode_examples": 4, "log_every": 2}


def real_lm_family(*, backbone: str, seeds: int, quick: bool = False) -> dict:
    """The demo on a pretrained LM as a run family with its entangled stage (``pretrain:`` block)."""
    return {
        "description": f"zcvae demo --backbone {backbone}: the entangled stage on {REAL_LM_TASK}, then raw mean against the default",
        "pretrain": {**(QUICK_REAL_LM_STAGE if quick else REAL_LM_STAGE), "backbone": backbone},
        "base": dict(QUICK_REAL_LM_BASE if quick else REAL_LM_BASE),
        "grid": {"seed": list(range(seeds))},
        "zip": [arm_columns(REAL_LM_ARMS)],
    }


def time_one_step(backbone: str, *, batch_size: int, num_tokens: int) -> float:
    """Seconds of one forward + backward of ``backbone`` on ``batch_size`` x ``num_tokens`` random tokens,
    on this process's threads (the second of two calls; the first warms up allocators and kernels)."""
    import torch
    from transformers import AutoModelForCausalLM

    from zcvae.backbone.convert import resolve_backbone_path

    model = AutoModelForCausalLM.from_pretrained(resolve_backbone_path(backbone), local_files_only=True,
                                                 use_safetensors=True, dtype=torch.float32)
    ids = torch.randint(0, model.get_input_embeddings().weight.shape[0], (batch_size, num_tokens),
                        generator=torch.Generator().manual_seed(0))
    seconds = 0.0
    for _ in range(2):
        start = time.perf_counter()
        model(input_ids=ids, labels=ids).loss.backward()
        seconds = time.perf_counter() - start
    return seconds


def expected_seconds(step_seconds: float, *, stage_batch: int, stage: dict | None, base: dict, num_runs: int, jobs: int) -> dict[str, float]:
    """A rough budget from one timed full-model step at the stage's batch (``time_one_step``): a stage step
    costs about that (LoRA saves the weight gradients, the logits cost the same); a CVAE step about
    (K + 2) of them at its own batch (router pass, K branches, the no-grad reference), ``jobs`` runs at a
    time, each on a core of its own. Evaluation is not counted. ``stage`` None: already built."""
    per_row = step_seconds / stage_batch
    stage_s = stage["max_steps"] * step_seconds if stage else 0.0
    run_s = base["max_steps"] * (base["num_latents"] + 2) * per_row * base["micro_batch_size"]
    waves = -(-num_runs // max(jobs, 1))
    return {"stage": stage_s, "run": run_s, "total": stage_s + waves * run_s}


def run_real_lm_demo(*, backbone: str, output_dir: str, quick: bool, seeds: int, jobs: int) -> str:
    """``zcvae demo --backbone``: the entangled stage, then raw mean and the default, through the local sweep
    runner (a finished stage and finished runs are reused, an unfinished run resumes)."""
    from zcvae.sweep.family import local_plan, stage_status

    out = Path(output_dir)
    started = time.perf_counter()
    family = real_lm_family(backbone=backbone, seeds=seeds, quick=quick)
    runs = local_plan(family, output_dir=out / "runs")
    stage = runs[0].pretrain
    todo_stage = stage_status(stage) != "finished"
    step_s = time_one_step(backbone, batch_size=family["pretrain"]["batch_size"], num_tokens=40)
    budget = expected_seconds(step_s, stage_batch=family["pretrain"]["batch_size"], stage=family["pretrain"] if todo_stage else None, base=family["base"],
                              num_runs=len(runs), jobs=jobs)
    logger.info(f"[demo] expected time: about {budget['total'] / 60:.0f} min (one timed step of {backbone}: {step_s:.1f} s at batch "
                f"{family['pretrain']['batch_size']}; the entangled stage ~{budget['stage'] / 60:.0f} min"
                f"{'' if todo_stage else ' (already built)'}, each of {len(runs)} runs ~{budget['run'] / 60:.0f} min, {jobs} at a time)")
    logger.info(f"[demo] 1/3 the entangled stage on {REAL_LM_TASK!r} -> {stage['output_dir']}; "
                f"2/3 {len(runs)} runs: {', '.join(label for label, _ in REAL_LM_ARMS)}, {seeds} seed(s) each")
    return _run_and_tabulate(runs, jobs=jobs, quick=quick, out=out, started=started,
                             heading="final validation metrics")


@contextmanager
def omp_threads(count: int):
    """``OMP_NUM_THREADS`` = ``count`` within: the one setting every zcvae process reads first
    (``zcvae.cpu.cpu_threads``), here and in the runs it starts; the caller's value comes back after."""
    old = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = str(count)
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = old


def _run_and_tabulate(runs, *, jobs: int, quick: bool, out: Path, started: float, heading: str, threads: int | None = None) -> str:
    """Step 2/3 and 3/3 of both demos: train the runs (finished ones skipped), print and save the table.
    ``threads``: each run's fixed thread count (None: the runs' own policy)."""
    from zcvae.commands.sweep import local_table
    from zcvae.sweep.local import run_local

    # the largest budget first, so that the longest run never starts last and leaves a core idle; the table keeps the arms' order
    by_cost = sorted(runs, key=lambda run: -run.params.get("max_steps", 0) * run.params.get("micro_batch_size", 0))
    with omp_threads(threads) if threads else nullcontext():
        _, failed = run_local(by_cost, jobs=jobs, progress_bar=not quick)
    if failed:
        raise ValueError("demo runs failed: " + "; ".join(f"{run.name}: {why}" for run, why in failed))
    table = local_table(runs)
    logger.info(f"\n[demo] 3/3 {heading}\n")
    logger.info(table)
    logger.info(f"\n[demo] done in {time.perf_counter() - started:.0f} s. TensorBoard: tensorboard --logdir {out / 'runs'}")
    (out / "table.md").write_text(table + "\n")
    return table


def run_demo(*, output_dir: str = "runs/demo", quick: bool = False, seeds: int = 1, jobs: int | None = None,
             backbone: str | None = None) -> str:
    from zcvae.backbone.pretraining import pretrain
    from zcvae.backbone.stage_config import PretrainConfig, is_pretrained
    from zcvae.sweep.family import local_plan

    if seeds < 1:
        raise ValueError(f"--seeds must be >= 1, got {seeds}")
    if backbone is not None:
        Path(output_dir).mkdir(parents=True, exist_ok=True)
        return run_real_lm_demo(backbone=backbone, output_dir=output_dir, quick=quick, seeds=seeds,
                                jobs=DEMO_JOBS if jobs is None else jobs)
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    backbone = out / "backbone"
    if is_pretrained(backbone):
        logger.info(f"[demo] reusing the backbone in {backbone}")
    else:
        pcfg = PretrainConfig(task=DEMO_TASK, output_dir=str(backbone), max_steps=DEMO_BUDGET["pretrain_steps"])
        if quick:
            pcfg = PretrainConfig(task=DEMO_TASK, output_dir=str(backbone), max_steps=20, num_train_examples=256, num_val_examples=32, hidden_size=32, num_layers=2, num_heads=4, intermediate_size=64)
        logger.info(f"[demo] 1/3 pretraining the entangled backbone on task {DEMO_TASK!r} -> {backbone}")
        with omp_threads(DEMO_THREADS["pretrain"]):
            pretrain(pcfg)
    logger.info(f"[demo] pretraining done at {time.perf_counter() - started:.0f} s")
    runs = local_plan(demo_family(backbone=str(backbone.resolve()), seeds=seeds, quick=quick), output_dir=out / "runs")
    logger.info(f"[demo] 2/3 {len(runs)} runs on {DEMO_TASK} (K = {DEMO_NUM_LATENTS}): {', '.join(label for label, _ in DEMO_ARMS)}, {seeds} seed(s) each")
    return _run_and_tabulate(runs, jobs=DEMO_JOBS if jobs is None else jobs, quick=quick, out=out, started=started,
                             threads=DEMO_THREADS["run"],
                             heading="final validation metrics (nmi: argmax q(z|x,y) against the gold strategy; num_used_latents: "
                                     "latents holding >1% of q; exact_match: decoding with the strategy's own z; verdict: without gold labels)")
