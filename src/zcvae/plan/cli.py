"""``zcvae plan``: per-rank memory and FLOPs of a training configuration, before a job is queued.

    zcvae plan --backbone Llama-3.1-8B --engine local --precision bf16 --micro-batch-size 8 --gpu-memory 80
    zcvae plan --backbone Llama-3.1-70B --engine fsdp2 --world-size 8 --precision bf16 --gradient-checkpointing --gpu-memory 80
    zcvae plan --backbone DIR --engine deepspeed --deepspeed-config zero3 --world-size 2 --device cpu --loading replicated

``--backbone`` is a checkpoint directory, a bare config.json or a shape name (``zcvae.plan.shapes``). The
flags are `zcvae train`'s where they exist (same names, same defaults); |x| and |y| are ``--x-len`` and
``--y-len`` tokens, or those of a task's examples (``--task``). The memory model is ``zcvae.plan.memory``.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict

from zcvae.plan.flops import Shape, step_flops
from zcvae.plan.memory import PlanSpec, largest_micro_batch, plan_memory
from zcvae.plan.shapes import load_shape

__all__ = ["build_parser", "main", "plan_from_argv"]

GiB = 2**30
ZERO_STAGES = {"zero0": 0, "zero1": 1, "zero2": 2, "zero3": 3}


def build_parser() -> argparse.ArgumentParser:
    from zcvae.config import TrainConfig

    d = TrainConfig.from_flat()
    p = argparse.ArgumentParser(prog="zcvae plan", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backbone", required=True, help="checkpoint directory, config.json, or a shape name")
    p.add_argument("--override", action="append", default=[], metavar="KEY=VALUE", help="change a config field of the shape")
    p.add_argument("--num-latents", type=int, default=d.model.num_latents, help="K")
    p.add_argument("--num-z-slots", type=int, default=d.model.num_z_slots, help="M")
    p.add_argument("--micro-batch-size", type=int, default=d.optimization.micro_batch_size, help="B per rank")
    p.add_argument("--x-len", type=int, default=None, help="|x| in tokens (default: 48, or the --task's longest)")
    p.add_argument("--y-len", type=int, default=None, help="|y| in tokens (default: 48, or the --task's longest)")
    p.add_argument("--task", default=None, help="take |x|, |y| from this built-in task's training examples (in zcvae's tokenizer)")
    p.add_argument("--num-train-examples", type=int, default=d.data.num_train_examples, help="(host: the calibration batch)")
    p.add_argument("--engine", choices=("local", "deepspeed", "fsdp2"), default=d.engine.engine)
    p.add_argument("--deepspeed-config", default=d.engine.deepspeed_config or "zero2", choices=tuple(ZERO_STAGES),
                   help="the ZeRO stage (a built-in config's name)")
    p.add_argument("--world-size", type=int, default=None, help="ranks in all (default: --nnodes x --nproc-per-node)")
    p.add_argument("--nnodes", type=int, default=1)
    p.add_argument("--nproc-per-node", type=int, default=1)
    p.add_argument("--precision", choices=("fp32", "bf16"), default=d.engine.precision)
    p.add_argument("--base-dtype", choices=("float32", "bfloat16", "auto"), default="auto",
                   help="the frozen base's dtype (auto: bfloat16 under --precision bf16, else float32)")
    p.add_argument("--loading", choices=("sharded", "replicated"), default="sharded",
                   help="sharded: ZeRO-3 and FSDP2 shard the base as it loads; replicated: every rank builds the whole fp32 model first (zcvae before sharded loading)")
    p.add_argument("--gradient-checkpointing", action=argparse.BooleanOptionalAction, default=d.model.gradient_checkpointing)
    p.add_argument("--branch-chunk-size", type=int, default=d.model.branch_chunk_size)
    p.add_argument("--share-x-prefix", action=argparse.BooleanOptionalAction, default=d.model.share_x_prefix)
    p.add_argument("--lora-r", type=int, default=d.model.lora_r)
    p.add_argument("--lora-target-modules", nargs="+", default=d.model.lora_target_modules)
    p.add_argument("--reference-policy", choices=("auto", "online", "precomputed"), default=d.objective.reference_policy)
    p.add_argument("--device", choices=("gpu", "cpu"), default="gpu", help="gpu: device memory; cpu: host RSS per rank (adds loading and the fixed cost)")
    p.add_argument("--step", choices=("steady", "first"), default="steady", help="ZeRO-3: steady state (after the traced first step) or step 1")
    p.add_argument("--gpu-memory", type=float, default=None, help="GiB per device: also print the largest micro-batch that fits")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    return p


def _task_lengths(task: str, num: int) -> tuple[int, int]:
    """Longest |x| and |y| (tokens of zcvae's tokenizer) of a built-in task's first ``num`` examples."""
    from zcvae.config import TrainConfig
    from zcvae.data.dataset import load_splits
    from zcvae.data import build_tokenizer

    tok = build_tokenizer()
    splits = load_splits(TrainConfig.from_flat(task=task, num_train_examples=min(num, 512), num_val_examples=8))
    xs = [len(tok(ex.x)["input_ids"]) for ex in splits.train]
    ys = [len(tok(ex.y)["input_ids"]) for ex in splits.train]
    return max(xs), max(ys)


def spec_from_args(args) -> tuple[str, PlanSpec]:
    from zcvae.plan.shapes import _parse_override

    name, config = load_shape(args.backbone, dict(_parse_override(o) for o in args.override))
    world = args.world_size or args.nnodes * args.nproc_per_node
    x_len, y_len = args.x_len, args.y_len
    if args.task and (x_len is None or y_len is None):
        tx, ty = _task_lengths(args.task, args.num_train_examples)
        x_len, y_len = x_len or tx, y_len or ty
    for flag, value in (("--micro-batch-size", args.micro_batch_size), ("--num-latents", args.num_latents), ("--world-size", world)):
        if value < 1:
            raise ValueError(f"{flag} must be >= 1, got {value}")
    policy = "online" if args.reference_policy == "auto" else args.reference_policy
    # only ZeRO-3 and FSDP2 shard the base as it loads (zcvae.engines.sharded_loading); the others load it whole
    shards = args.engine == "fsdp2" or (args.engine == "deepspeed" and ZERO_STAGES[args.deepspeed_config] == 3)
    loading = args.loading if shards else "replicated"
    spec = PlanSpec(config=config, micro_batch_size=args.micro_batch_size, num_latents=args.num_latents, num_z_slots=args.num_z_slots,
                    x_len=x_len or 48, y_len=y_len or 48, engine=args.engine, zero_stage=ZERO_STAGES[args.deepspeed_config],
                    world_size=world, precision=args.precision, base_dtype=args.base_dtype, loading=loading,
                    gradient_checkpointing=args.gradient_checkpointing, branch_chunk_size=args.branch_chunk_size,
                    share_x_prefix=args.share_x_prefix, lora_r=args.lora_r, lora_target_modules=args.lora_target_modules,
                    reference_policy=policy, device=args.device, num_train_examples=args.num_train_examples, step=args.step)
    return name, spec


def flops_of(spec: PlanSpec) -> dict[str, float]:
    """FLOPs per rank per step (``zcvae.plan.flops``): the CVAE step and the plain LoRA step on the same batch."""
    from zcvae.plan.flops import lora_parameters
    from zcvae.plan.memory import _dims_ns, _targets

    cfg = _dims_ns(spec.config)
    shape = Shape.from_config(cfg, lora_params=lora_parameters(cfg, r=spec.lora_r, targets=_targets(spec)))
    kw = dict(B=spec.micro_batch_size, x_len=spec.x_len, y_len=spec.y_len, K=spec.num_latents, slots=spec.num_z_slots)
    useful, hardware = step_flops(shape, kind="cvae", share=spec.share_x_prefix, online=spec.reference_policy == "online", **kw)
    lora, _ = step_flops(shape, kind="lora", share=False, online=False, **kw)
    return {"useful": useful, "hardware": hardware, "lora": lora}


def plan_from_argv(argv: list[str]) -> dict:
    """The plan of `zcvae plan ARGV` as a dict (what ``--json`` prints)."""
    args = build_parser().parse_args(argv)
    name, spec = spec_from_args(args)
    plan = plan_memory(spec)
    out = {"shape": name, "spec": {k: v for k, v in asdict(spec).items() if k != "config"}, "terms": plan.terms, "phases": plan.phases,
           "peak": plan.peak, "fixed": plan.fixed, "model_bytes": plan.model_bytes, "counts": plan.counts, "notes": plan.notes,
           "flops": flops_of(spec)}
    if args.gpu_memory is not None:
        out["gpu_memory"] = args.gpu_memory
        out["largest_micro_batch"] = largest_micro_batch(spec, args.gpu_memory * GiB)
    return out


def render(out: dict) -> str:
    s, t = out["spec"], out["terms"]
    eng = s["engine"] + (f" ZeRO-{s['zero_stage']}" if s["engine"] == "deepspeed" else "")
    base = s["base_dtype"] if s["base_dtype"] != "auto" else ("bfloat16" if s["precision"] == "bf16" else "float32")
    c = out["counts"]
    lines = [f"zcvae plan: {out['shape']} ({c['N_base'] / 1e9:.3f}B frozen, {c['N_train'] / 1e6:.2f}M trainable), {eng}, world {s['world_size']}, "
             f"{s['precision']}, base {base}, {s['loading']} loading, {'host RSS' if s['device'] == 'cpu' else 'device memory'} per rank",
             f"  B={s['micro_batch_size']} K={s['num_latents']} M={s['num_z_slots']} |x|={s['x_len']} |y|={s['y_len']} "
             f"checkpointing={'on' if s['gradient_checkpointing'] else 'off'} branch_chunk_size={s['branch_chunk_size']} "
             f"share_x_prefix={s['share_x_prefix']} reference={s['reference_policy']}",
             "", "| term | GiB per rank |", "|---|---|"]
    labels = {"frozen": "frozen parameters", "trainable": "trainable: weights + grads + AdamW", "activations": "activations (train forward -> backward)",
              "reference": "reference pass (no grad; transient)", "comm": "communication buffers / gathered parameters",
              "load": "loading transient (host)", "calibration": "router calibration (host, no grad)"}
    for k, v in t.items():
        lines.append(f"| {labels.get(k, k)} | {v / GiB:.2f} |")
    phases = ", ".join(f"{k} {v / GiB:.2f}" for k, v in out["phases"].items())
    lines.append(f"| **peak** (largest phase: {phases}{'; + fixed ' + format(out['fixed'] / GiB, '.2f') if out['fixed'] else ''}) | **{out['peak'] / GiB:.2f}** |")
    f = out["flops"]
    lines += ["", f"FLOPs per rank per step: {f['useful'] / 1e12:.2f} TFLOP useful, {f['hardware'] / 1e12:.2f} TFLOP with the reference "
                  f"(plain LoRA step on the same batch: {f['lora'] / 1e12:.2f} TFLOP; CVAE/LoRA {f['useful'] / f['lora']:.2f}x)"]
    if "largest_micro_batch" in out:
        mb = out["largest_micro_batch"]
        lines.append(f"--gpu-memory {out['gpu_memory']:g} GiB: " + (f"fits at micro-batch <= {mb}" if mb else "does not fit even at micro-batch 1"))
    lines += [f"note: {n}" for n in out["notes"]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from zcvae.console import use_stderr

    use_stderr()  # stdout carries the plan alone (--json is read by scripts)
    argv = list(sys.argv[1:] if argv is None else argv)
    out = plan_from_argv(argv)
    print(json.dumps(out, indent=2) if "--json" in argv else render(out))
    return 0
