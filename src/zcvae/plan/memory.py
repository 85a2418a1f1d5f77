"""Per-rank memory of one CVAE training step, from shapes alone: what `zcvae plan` prints.

Terms (bytes per rank), each from the code path it models:

- ``frozen``: the frozen base (``N_base`` elements, embeddings and head included) at its dtype. Replicated
  on the local engine and ZeRO-0/1/2; sharded over the world by FSDP2 (every decoder layer and the root) and
  by ZeRO-3, which keeps parameters below ``stage3_param_persistence_threshold`` elements whole on every
  rank (the norms; ``engines.deepspeed._ZERO3``). ``loading="replicated"`` is today's ``model/build.py``:
  every rank builds the whole model in float32, and DeepSpeed bf16 then casts the module to bf16.
- ``trainable``: LoRA, the z rows (peft trainable tokens: a (K*M, H) delta) and the router heads, as fp32
  masters with AdamW's two moments and an fp32 gradient (16 bytes/element); DeepSpeed bf16 adds the
  bf16 working copy (18). ZeRO-1 shards the optimizer states, ZeRO-2 the gradients too, ZeRO-3 and
  FSDP2 everything (LoRA matrices sit below the persistence threshold: their bf16/fp32 weight stays whole).
- ``activations``: what autograd keeps from the forwards of ``train_forward`` to the backward, plus the
  largest transient. The shared x prefix runs once per example (B rows x P) and its keys/values are
  reused by the router's z-free suffix (B x W_y) and the B*K branch rows (x W_z), each repeating the
  cached keys (R x P per layer); without sharing every pass runs its whole sequence. Per token and layer
  a Llama block keeps its two RMSNorm inputs in fp32, the LoRA input, q and k/v repeated to the query
  heads, the attention output and the three MLP tensors (frozen linears keep no input). Layer
  checkpointing keeps only each layer's input plus one layer rebuilt in the backward; branch chunks
  (``branch_chunk_size``, each checkpointed whole, layer checkpointing off inside) keep nothing of the
  branches but rebuild one chunk at a time. Logits: the head runs on the supervised tokens only, in
  chunks of ``LOGIT_CHUNK_ELEMENTS // len(tokenizer)`` tokens; one chunk keeps its fp32 log-softmax for
  the backward, more chunks are checkpointed (``core.nll.supervised_token_nll``). The z rows (peft
  trainable tokens) cost no (V, H) tensor: the embedding overwrites the trained rows of its lookup and a
  tied head the trained columns of its logits (``model.hf_compat.copy_free_token_layers``).
- ``reference``: the z-free no-grad forward (adapters off), online per batch, or once before training for
  the precomputed store; a transient (one layer and a logit chunk), it does not add to the train peak.
- ``comm``: ZeRO-3 on CPU holds the embedding and head and about one layer gathered at once (measured: the
  trace never settles, so every module is released after each visit), plus gloo's staging copy of the (V, H)
  embedding it gathers again at each head call; on a GPU, once the trace has settled,
  up to ``stage3_max_reuse_distance`` (1e9) base elements may stay gathered at compute dtype, plus the
  prefetched bucket (not measured); either way plus its ``reduce_bucket_size`` gradient buffer; ZeRO-1/2 their reduce buckets; FSDP2 the root's parameters (embeddings, final norm, head; the
  root is not resharded after forward) and two decoder layers (the current one and the prefetched one)
  unsharded at compute dtype.
- host only (``device="cpu"``): ``load``, the transient of building the model (today: the whole float32
  model plus the safetensors pages it reads, mapped; the engines' shard copies are made while it is still
  whole), and the router calibration batch (``min(256, num_train)`` examples, no grad, before the engine,
  all hidden states kept), plus a fixed cost (interpreter and libraries) measured on the tiny backbone.

The peak is the largest of the phases: load, calibration, then training (frozen + trainable + comm +
the larger of activations and reference).

Shape legend: B examples, K branches, M z slots, R = B*K rows, T z-free length, P prefix, W suffix,
L layers, H hidden, I intermediate, V vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from zcvae.plan.flops import lora_parameters

__all__ = ["LOGIT_CHUNK_ELEMENTS", "PlanSpec", "ZERO3", "fixed_host_bytes", "largest_micro_batch", "plan_memory"]

# zcvae.model.cvae.LOGIT_CHUNK_ELEMENTS and engines.deepspeed._ZERO3, read here as numbers: the plan runs
# without importing torch; tests/unit/plan/test_memory.py checks that they are the code's values
LOGIT_CHUNK_ELEMENTS = 1 << 24
ZERO3 = {"reduce_bucket_size": 50_000_000, "stage3_param_persistence_threshold": 100_000,
         "stage3_max_live_parameters": 1_000_000_000, "stage3_max_reuse_distance": 1_000_000_000}
ZERO3_PREFETCH = {"gpu": 50_000_000, "cpu": 0}  # engines.deepspeed.resolve_deepspeed_config, by device
REDUCE_BUCKET = 50_000_000  # ZeRO-1/2 reduce (and ZeRO-2 all-gather) buckets, elements
DDP_BUCKET_BYTES = 25 * 2**20
# zcvae train on the tiny backbone (bench/memory_bench.py TINY), peak RSS per rank: the fixed cost of the
# interpreter, torch, transformers, peft (and deepspeed) that the model-dependent part sits on
FIXED_HOST_BYTES = {"local": int(0.45 * 2**30), "deepspeed": int(0.51 * 2**30), "fsdp2": int(0.44 * 2**30)}
DTYPE_BYTES = {"float32": 4, "bfloat16": 2}


def fixed_host_bytes(engine: str) -> int:
    return FIXED_HOST_BYTES[engine]


@dataclass
class PlanSpec:
    """One training configuration, in `zcvae train`'s terms."""

    config: dict  # the backbone's config.json
    micro_batch_size: int = 8
    num_latents: int = 2
    num_z_slots: int = 1
    x_len: int = 48
    y_len: int = 48
    engine: str = "local"
    zero_stage: int = 2  # deepspeed only
    world_size: int = 1
    precision: str = "fp32"
    base_dtype: str = "auto"
    loading: str = "sharded"  # "sharded" (ZeRO-3, FSDP2 shard at load) or "replicated" (today's build.py)
    gradient_checkpointing: bool = False
    branch_chunk_size: int | None = None
    share_x_prefix: bool = True
    lora_r: int = 8
    lora_target_modules: list[str] | None = None
    reference_policy: str = "online"
    tokenizer_size: int | None = None  # len(tokenizer) after the markers and latents; None = vocab_size
    device: str = "gpu"  # "gpu": device memory; "cpu": host RSS (adds loading, calibration, fixed cost)
    disk_dtype: str = "bfloat16"  # the safetensors files' dtype (host loading transient)
    num_train_examples: int = 4000  # the calibration batch is min(256, this)
    step: str = "steady"  # ZeRO-3 on a GPU: "steady" (the traced reuse distance) or "first" (step 1: released after each use)

    def resolved_base_dtype(self) -> str:
        if self.base_dtype == "auto":
            return "bfloat16" if self.precision == "bf16" else "float32"
        return self.base_dtype


@dataclass
class Plan:
    terms: dict[str, int]  # bytes per rank, in table order
    phases: dict[str, int]  # the peak candidates
    peak: int
    fixed: int  # host only: the fixed cost (0 on a GPU)
    counts: dict[str, int] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    @property
    def model_bytes(self) -> int:
        """The peak above the fixed cost: what memory_bench compares with (peak - tiny peak)."""
        return self.peak - self.fixed


def _dims(cfg: dict) -> tuple[int, int, int, int, int, int]:
    H, L, I = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["intermediate_size"]
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or H // heads
    kv = (cfg.get("num_key_value_heads") or heads) * head_dim
    return H, L, I, heads * head_dim, kv, cfg["vocab_size"]


def base_parameters(cfg: dict) -> tuple[int, int]:
    """(all frozen base elements, those below ZeRO-3's persistence threshold) of a Llama/Qwen2 shape."""
    H, L, I, q, kv, V = _dims(cfg)
    bias = (q + 2 * kv) if cfg.get("attention_bias") or cfg.get("model_type") == "qwen2" else 0
    per_layer = H * q * 2 + 2 * H * kv + 3 * H * I + 2 * H + bias
    head = 0 if cfg.get("tie_word_embeddings") else V * H
    total = V * H + head + L * per_layer + H
    persist = (2 * L + 1) * H + (L * bias if bias and max(q, kv) < ZERO3["stage3_param_persistence_threshold"] else 0)
    return total, persist


def _targets(spec: PlanSpec) -> list[str]:
    return list(spec.lora_target_modules or ["q_proj", "k_proj", "v_proj", "o_proj"])


def trainable_parameters(spec: PlanSpec) -> dict[str, int]:
    H = spec.config["hidden_size"]
    K = spec.num_latents
    return {"lora": lora_parameters(_dims_ns(spec.config), r=spec.lora_r, targets=_targets(spec)),
            "z_rows": K * spec.num_z_slots * H, "router": 2 * H * K + K}


class _NS:
    def __init__(self, cfg: dict):
        self.__dict__.update(cfg)


def _dims_ns(cfg: dict):
    return _NS({"head_dim": None, "num_key_value_heads": None, **cfg})


def _lengths(spec: PlanSpec) -> dict[str, int]:
    x, y, M = spec.x_len, spec.y_len, spec.num_z_slots
    # <bos> <x> x </x> <y> y </y> <eos>; the branch template adds <z> z_1..z_M </z>; the supervised span y </y>
    return {"T": x + y + 6, "P": x + 3, "Wy": y + 3, "Wz": y + 5 + M, "S": x + y + 8 + M, "N": y + 1}


def activation_bytes(spec: PlanSpec) -> dict[str, int]:
    """Activations of the train forward kept for the backward, and its largest transient (bytes)."""
    H, L, I, q, kv, V = _dims(spec.config)
    c = 2 if spec.precision == "bf16" else 4
    B, K = spec.micro_batch_size, spec.num_latents
    R = B * K
    n = _lengths(spec)
    per_token_layer = 8 * H + c * (H + 4 * q + 3 * I)  # fp32 norm inputs; LoRA input, q, k, v (repeated), attn out; MLP
    transient_token = c * (2 * H + 2 * I + 2 * q)  # one layer's backward gradients (or a no-grad layer's forward)
    lr = 4 * (spec.lora_r * 4) * L  # lora_A outputs, negligible
    kv_repeat = L * c * (2 * kv + 2 * q)  # cached prefix keys/values per row and prefix column (the cat, the repeat)
    chunk_tokens = max(1, LOGIT_CHUNK_ELEMENTS // (spec.tokenizer_size or V))

    def kept(tokens: int, cached_cols: int = 0, rows: int = 0) -> int:
        if spec.gradient_checkpointing:
            return tokens * L * c * H + rows * cached_cols * kv_repeat
        return tokens * (L * per_token_layer + lr) + rows * cached_cols * kv_repeat

    def logits_kept(n_sup: int) -> int:
        return 4 * n_sup * V if n_sup <= chunk_tokens else 0  # one chunk keeps its fp32 log-probabilities

    if spec.share_x_prefix:
        passes = {"prefix": (B * n["P"], 0, 0), "router": (B * n["Wy"], n["P"], B), "branches": (R * n["Wz"], n["P"], R)}
    else:
        passes = {"prefix": (0, 0, 0), "router": (B * n["T"], 0, 0), "branches": (R * n["S"], 0, 0)}
    out = {name: kept(*p) for name, p in passes.items()}
    out["router"] += logits_kept(B * n["N"])
    rows_at_once = R
    if spec.branch_chunk_size and spec.branch_chunk_size < R:
        # chunks keep only their inputs and NLL; the backward rebuilds one chunk, layer checkpointing off inside
        rows_at_once = spec.branch_chunk_size
        tokens, cols, _ = passes["branches"]
        tokens = tokens * rows_at_once // R
        out["branches"] = 0
        rebuild = tokens * (L * per_token_layer + lr) + rows_at_once * cols * kv_repeat + logits_kept(rows_at_once * n["N"])
    else:
        out["branches"] += logits_kept(R * n["N"])
        tokens = passes["branches"][0]
        rebuild = tokens * per_token_layer if spec.gradient_checkpointing else 0  # one layer rebuilt
    largest_pass = max(p[0] for p in passes.values()) * rows_at_once // max(R, 1) if rows_at_once < R else max(p[0] for p in passes.values())
    logit_transient = 8 * min(chunk_tokens, max(B * n["N"], rows_at_once * n["N"])) * V
    out["transient"] = rebuild + max(largest_pass * transient_token, logit_transient)
    return out


def reference_bytes(spec: PlanSpec) -> int:
    """The no-grad z-free forward's transient: one layer's tensors and a logit chunk."""
    H, L, I, q, kv, V = _dims(spec.config)
    c = 2 if spec.precision == "bf16" else 4
    n = _lengths(spec)
    tokens = spec.micro_batch_size * n["T"]
    chunk_tokens = max(1, LOGIT_CHUNK_ELEMENTS // (spec.tokenizer_size or V))
    return tokens * c * (3 * H + 2 * I + 2 * q) + 8 * min(chunk_tokens, spec.micro_batch_size * n["N"]) * V


def calibration_bytes(spec: PlanSpec) -> int:
    """Host: the router's calibration forward (no grad, fp32 before the engine, every hidden state kept)."""
    H, L, I, q, kv, V = _dims(spec.config)
    n = _lengths(spec)
    rows = min(256, spec.num_train_examples)
    chunk_tokens = max(1, LOGIT_CHUNK_ELEMENTS // (spec.tokenizer_size or V))
    return rows * n["T"] * (4 * H * (L + 1) + 4 * (2 * H + 2 * I + 2 * q)) + 8 * min(chunk_tokens, rows * n["N"]) * V


def plan_memory(spec: PlanSpec) -> Plan:
    if spec.engine not in ("local", "deepspeed", "fsdp2"):
        raise ValueError(f"engine must be local, deepspeed or fsdp2, got {spec.engine!r}")
    if spec.loading not in ("sharded", "replicated"):
        raise ValueError(f"loading must be sharded or replicated, got {spec.loading!r}")
    W = spec.world_size
    stage = spec.zero_stage if spec.engine == "deepspeed" else None
    base_dtype = spec.resolved_base_dtype()  # both loadings build the base in it (model.build, model.sharded)
    b = DTYPE_BYTES[base_dtype]
    c = 2 if spec.precision == "bf16" else 4
    g = min(b, c)  # a gathered base weight: the base dtype, or bf16 when mixed precision casts a float32 base down
    N_base, N_persist = base_parameters(spec.config)
    trainable = trainable_parameters(spec)
    N_train = sum(trainable.values())
    sharded_base = stage == 3 or spec.engine == "fsdp2"
    notes = []

    # frozen
    if stage == 3:
        frozen = (N_base - N_persist) * b / W + N_persist * b
    elif spec.engine == "fsdp2":
        frozen = N_base * b / W
    else:
        frozen = N_base * b

    # trainable: weight, grad, two moments (+ bf16 copy under DeepSpeed bf16)
    weight = 4 * N_train
    bf16_copy = 2 * N_train if spec.engine == "deepspeed" and spec.precision == "bf16" else 0
    grads, moments = 4 * N_train, 8 * N_train
    if stage is not None and stage >= 1:
        moments /= W
        weight = weight / W + bf16_copy  # fp32 master partitions; the bf16 working copy stays whole (LoRA persists)
        bf16_copy = 0
    if stage is not None and stage >= 2:
        grads /= W
    if spec.engine == "fsdp2":
        weight, grads, moments = weight / W, grads / W, moments / W
    trainable_bytes = weight + bf16_copy + grads + moments

    # communication buffers
    H, L, I, q, kv, V = _dims(spec.config)
    root = V * H * (1 if spec.config.get("tie_word_embeddings") else 2) + H  # embeddings, final norm, head
    root_and_two_layers = (root + 2 * (N_base - root) / L) * g
    if stage == 3:
        if spec.device == "cpu" or spec.step == "first":
            # before DeepSpeed has traced a step, and on CPU throughout (measured over 4 steps, bench/memory_bench.py:
            # zcvae's passes keep invalidating the trace), each module's parameters are released after each
            # forward and backward visit (engines.deepspeed._release_after_each_backward_call): the embedding and
            # head (each gathered whole for its lookup or logits) and about one layer are held at once
            live = root_and_two_layers
            if spec.device == "cpu" and W > 1:
                # gloo's all-gather stages its whole output in a buffer of its own before the copy into place
                # (measured: a 64 MiB all_gather_into_tensor raised the peak RSS by 65.7 MiB;
                # tests/distributed/test_gloo_gather_staging.py), and ZeRO-3 gathers the (V, H) embedding again
                # at every head call, with the step's activations alive
                live += V * H * g
        else:
            # once the trace is stable, DeepSpeed keeps parameters it will reuse within stage3_max_reuse_distance
            # elements, up to stage3_max_live_parameters, plus the prefetched bucket; not measured on a GPU
            live = (min(N_base - N_persist, ZERO3["stage3_max_live_parameters"], ZERO3["stage3_max_reuse_distance"])
                    + ZERO3_PREFETCH["gpu"]) * g
            notes.append("ZeRO-3 on a GPU: a fetched base parameter may stay gathered between its uses in a step (the "
                         "1e9-element stage3_max_reuse_distance, up to stage3_max_live_parameters): lower both in a "
                         "--deepspeed-config JSON to trade memory for gathers")
        # the gradient bucket is allocated whole; host RSS counts only the pages written, the gradients it holds
        bucket = ZERO3["reduce_bucket_size"] if spec.device == "gpu" else min(ZERO3["reduce_bucket_size"], N_train)
        comm = live + bucket * c + 4 * N_train / W
    elif stage in (1, 2):
        comm = REDUCE_BUCKET * 4 * (2 if stage == 2 else 1)
    elif spec.engine == "fsdp2":
        comm = root_and_two_layers  # the root is not resharded after forward; the current and the prefetched layer
    else:
        comm = DDP_BUCKET_BYTES if W > 1 else 0
    comm = min(comm, N_base * c + 4 * N_train) if stage in (1, 2) else comm

    acts = activation_bytes(spec)
    act_total = sum(acts.values())
    ref = reference_bytes(spec)
    terms = {"frozen": int(frozen), "trainable": int(trainable_bytes), "activations": int(act_total), "reference": int(ref),
             "comm": int(comm)}
    train_phase = frozen + trainable_bytes + comm + max(act_total, ref)
    phases = {"train": int(train_phase)}
    fixed = 0
    if spec.device == "cpu":
        disk = DTYPE_BYTES[spec.disk_dtype] * N_base
        if spec.loading == "replicated":
            whole = b * N_base
            shard_copy = b * N_base / W if sharded_base else 0
            # from_pretrained keeps the mapped file's tensors as they are when the dtypes match; it converts otherwise
            load = whole + (disk if spec.disk_dtype != base_dtype else 0) + shard_copy
            notes.append(f"replicated loading: every rank builds the whole model in {base_dtype}"
                         + (" and maps the safetensors it converts" if spec.disk_dtype != base_dtype else "")
                         + ("; the engine's shards are copied while the whole model is still held" if sharded_base else ""))
        else:
            # the shards, plus the embedding (and an untied head) broadcast whole to compute the new rows; rank 0
            # reads one tensor at a time (model.sharded.CheckpointReader), the largest being the embedding
            emb = max(spec.config["vocab_size"] * spec.config["hidden_size"], 1)
            load = frozen + 2 * emb * b + (emb * DTYPE_BYTES[spec.disk_dtype] if sharded_base else disk)
        terms["load"] = int(load)
        cal = calibration_bytes(spec)
        terms["calibration"] = int(cal)
        phases["load"] = int(load)
        phases["calibration"] = int((b * N_base if spec.loading == "replicated" else frozen) + cal)
        fixed = fixed_host_bytes(spec.engine)
    peak = max(phases.values()) + fixed
    counts = {"N_base": N_base, "N_persist": N_persist, "N_train": N_train, **{f"N_{k}": v for k, v in trainable.items()}}
    return Plan(terms=terms, phases=phases, peak=int(peak), fixed=fixed, counts=counts, notes=notes)


def largest_micro_batch(spec: PlanSpec, budget_bytes: float, *, limit: int = 4096) -> int:
    """The largest micro-batch whose predicted peak fits ``budget_bytes`` (0 when not even 1 does)."""
    from dataclasses import replace

    fits = lambda b: plan_memory(replace(spec, micro_batch_size=b)).peak <= budget_bytes  # noqa: E731
    if not fits(1):
        return 0
    lo, hi = 1, 2
    while hi <= limit and fits(hi):
        lo, hi = hi, hi * 2
    hi = min(hi, limit + 1)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo
