"""`zcvae plan` against measured per-rank peak host memory (RSS) of a real 1-step `zcvae train` on CPU.

    python bench/memory_bench.py                                   # the default cases (135M and 360M, world 1 and 2)
    python bench/memory_bench.py --shapes SmolLM2-135M --cases local:1,zero3:2,fsdp2:2
    python bench/memory_bench.py --shapes Llama-3.2-1B --cases local:1 --keep /tmp/shapes   # >= 1B: minutes, ~15 GB

Per case (shape, engine, world):

1. a random-weight checkpoint of the shape, bf16 on disk (``zcvae.plan.shapes``, cached under ``--keep``), and
   of the tiny shape (``TINY``: the same family at hidden 64, 2 layers, vocabulary 64);
2. ``torchrun --standalone --nproc_per_node W bench/memory_bench.py --worker -- train --backbone DIR
   --allow-fresh-markers --task copy --engine E --max-steps 1 --micro-batch-size 1 ...`` (``TRAIN_FLAGS``): each
   rank runs the CLI entry in process (``zcvae.commands.cli.main``) and prints its own peak resident set
   (``getrusage(RUSAGE_SELF).ru_maxrss``, the kernel's high-water mark: exact, and independent of machine load);
3. the same command on the tiny checkpoint; measured = the mean over ranks of (peak - tiny peak), the
   model-dependent part; predicted = `zcvae plan --device cpu` with the same flags (``--loading sharded`` on ZeRO-3
   and FSDP2, which shard the base as it loads; replicated elsewhere), its model-dependent part.

Prints one table row per case: measured and predicted GiB, their ratio, and both as a multiple of the
model's fp32 bytes (4 N). ``--write BENCHMARKS.md`` replaces the section between its markers.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "src"))

GiB = 2**30
PEAK = "MEMORY_BENCH_PEAK "
# the tiny shape: fixed cost of interpreter, torch, transformers, deepspeed (the same command's floor)
TINY = ("SmolLM2-135M", {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
                          "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 64})
# short: one step, a handful of examples, evaluation decodes nothing; the reference online (no store on disk)
NUM_TRAIN, NUM_VAL = 8, 4
TRAIN_FLAGS = ["--allow-fresh-markers", "--task", "copy", "--max-steps", "1", "--micro-batch-size", "1",
               "--num-train-examples", str(NUM_TRAIN), "--num-val-examples", str(NUM_VAL), "--num-eval-decode-examples", "0",
               "--reference-policy", "online", "--no-progress-bar", "--log-every", "1"]
ENGINES = {"local": ["--engine", "local"], "zero3": ["--engine", "deepspeed", "--deepspeed-config", "zero3"],
           "zero2": ["--engine", "deepspeed", "--deepspeed-config", "zero2"], "fsdp2": ["--engine", "fsdp2"]}
MARKER = "<!-- memory_bench -->"


def worker(argv: list[str]) -> int:
    """One torchrun rank: `zcvae <argv>` in process, then its peak RSS on one line."""
    from zcvae.commands.cli import main as cli_main

    rc = cli_main(argv)
    print(f"{PEAK}{json.dumps({'rank': int(os.environ.get('RANK', 0)), 'rc': rc, 'peak': resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024})}",
          flush=True)
    return rc


def checkpoint(shape: str, overrides: dict, keep: Path, *, dtype: str = "bfloat16") -> Path:
    from zcvae.plan.shapes import build_random_checkpoint

    tag = "-".join(f"{k}{v}" for k, v in sorted(overrides.items()))
    out = keep / f"{shape}{'-' + tag if tag else ''}-{dtype}"
    if not out.is_dir():
        build_random_checkpoint(shape, out, dtype=dtype, overrides=overrides)
    return out


# the engines that shard the base as it loads (zcvae.engines.sharded_loading); the others replicate it
SHARDED = ("zero3", "fsdp2")


def base_flags(base_dtype: str | None) -> list[str]:
    return [] if base_dtype is None else ["--base-dtype", base_dtype]


def train_argv(backbone: Path, engine: str, run_dir: Path, base_dtype: str | None = None) -> list[str]:
    return ["train", "--backbone", str(backbone), *TRAIN_FLAGS, *ENGINES[engine], *base_flags(base_dtype), "--output-dir", str(run_dir)]


def measure(backbone: Path, engine: str, world: int, *, work: Path, timeout: float, base_dtype: str | None = None) -> list[int]:
    """Peak RSS (bytes) of every rank of one `zcvae train` under torchrun."""
    run_dir = Path(tempfile.mkdtemp(dir=work, prefix=f"{engine}-w{world}-"))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(world), str(Path(__file__).resolve()),
           "--worker", "--", *train_argv(backbone, engine, run_dir / "run", base_dtype)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(REPO / "src"), os.environ.get("PYTHONPATH", "")) if p),
           "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout, cwd=REPO)
    peaks = [json.loads(line[len(PEAK):]) for line in proc.stdout.splitlines() if line.startswith(PEAK)]
    if proc.returncode != 0 or len(peaks) != world or any(p["rc"] != 0 for p in peaks):
        raise SystemExit(f"memory_bench: {' '.join(cmd)} failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return [p["peak"] for p in sorted(peaks, key=lambda p: p["rank"])]


def predict(backbone: Path, engine: str, world: int, *, base_dtype: str | None = None, loading: str | None = None) -> dict:
    """`zcvae plan`'s CPU prediction (model-dependent part, bytes per rank) for the measured command.
    ``loading``: what the plan assumes (default: what zcvae does, sharded on ZeRO-3 and FSDP2)."""
    from zcvae.plan.cli import plan_from_argv

    loading = loading or ("sharded" if engine in SHARDED else "replicated")
    argv = ["--backbone", str(backbone), *ENGINES[engine], "--world-size", str(world), "--micro-batch-size", "1", "--device", "cpu",
            "--loading", loading, *base_flags(base_dtype), "--step", "first", "--task", "copy", "--num-train-examples", str(NUM_TRAIN)]
    return plan_from_argv(argv)


def run_case(shape: str, engine: str, world: int, *, keep: Path, work: Path, timeout: float, tiny_cache: dict,
             base_dtype: str | None = None) -> dict:
    from zcvae.plan.shapes import load_shape, num_parameters

    big, tiny = checkpoint(shape, {}, keep), checkpoint(TINY[0], TINY[1], keep)
    key = (engine, world, base_dtype)
    if key not in tiny_cache:
        tiny_cache[key] = measure(tiny, engine, world, work=work, timeout=timeout, base_dtype=base_dtype)
    peaks = measure(big, engine, world, work=work, timeout=timeout, base_dtype=base_dtype)
    measured = sum(p - t for p, t in zip(peaks, tiny_cache[key])) / world
    plan = predict(big, engine, world, base_dtype=base_dtype)
    fp32 = 4 * num_parameters(load_shape(shape)[1])
    return {"shape": shape, "engine": engine, "world": world, "base": base_dtype or "default", "peaks": peaks, "tiny": tiny_cache[key],
            "measured": measured, "predicted": plan["model_bytes"], "fp32": fp32, "plan": plan}


def render(rows: list[dict]) -> str:
    lines = ["| shape | engine | world | base | tiny peak GiB | peak GiB (per rank) | measured - tiny GiB | plan GiB | plan / measured | measured / fp32 | plan / fp32 |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['shape']} | {r['engine']} | {r['world']} | {r['base']} | {max(r['tiny']) / GiB:.2f} | "
                     f"{' / '.join(f'{p / GiB:.2f}' for p in r['peaks'])} | {r['measured'] / GiB:.2f} | {r['predicted'] / GiB:.2f} | "
                     f"{r['predicted'] / r['measured']:.2f} | {r['measured'] / r['fp32']:.3f}x | {r['predicted'] / r['fp32']:.2f}x |")
    return "\n".join(lines)


def write_section(path: Path, body: str) -> None:
    text = path.read_text()
    start, end = text.find(MARKER), text.rfind(MARKER)
    if start < 0 or start == end:
        raise SystemExit(f"memory_bench: {path} has no pair of {MARKER} markers")
    path.write_text(text[: start + len(MARKER)] + "\n" + body + "\n" + text[end:])


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--worker"]:
        return worker(argv[2:] if argv[1:2] == ["--"] else argv[1:])
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="SmolLM2-135M,SmolLM2-360M", help="comma list of shapes (zcvae.plan.shapes)")
    p.add_argument("--cases", default="local:1,zero3:2,fsdp2:2,local:1:bfloat16",
                   help="comma list of ENGINE:WORLD[:BASE_DTYPE] (engines: %s; base dtype float32 or bfloat16, default the run's)" % ", ".join(ENGINES))
    p.add_argument("--keep", default=None, help="directory of the random checkpoints (default: a temporary one, deleted)")
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--write", default=None, help="replace the memory_bench section of this file (BENCHMARKS.md)")
    args = p.parse_args(argv)
    cases = []
    for item in args.cases.split(","):
        engine, world, base, *rest = item.split(":") + [None, None]
        if engine not in ENGINES or not (world or "").isdigit() or base not in (None, "float32", "bfloat16") or any(rest):
            raise SystemExit(f"memory_bench: --cases: bad case {item!r} (ENGINE:WORLD[:BASE_DTYPE], engines {', '.join(ENGINES)})")
        cases.append((engine, int(world), base))
    with tempfile.TemporaryDirectory(prefix="memory_bench-") as tmp:
        keep = Path(args.keep) if args.keep else Path(tmp) / "shapes"
        keep.mkdir(parents=True, exist_ok=True)
        work = Path(tmp) / "runs"
        work.mkdir()
        rows, tiny_cache = [], {}
        for shape in args.shapes.split(","):
            for engine, world, base in cases:
                row = run_case(shape, engine, world, keep=keep, work=work, timeout=args.timeout, tiny_cache=tiny_cache, base_dtype=base)
                rows.append(row)
                print(render([row]).splitlines()[-1], flush=True)
    table = render(rows)
    print()
    print(table)
    for r in rows:
        print(f"{r['shape']} {r['engine']} w{r['world']} base {r['base']}: " + ", ".join(f"{k} {v / GiB:.3f}" for k, v in r["plan"]["terms"].items()))
    if args.write:
        write_section(Path(args.write), table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
