"""Shared by the engine tests and their torchrun worker: a tiny peft Llama, ragged data, the loop.

The loop is the trainer's contract in miniature: count the valid examples and the supervised tokens of
the optimizer step over all ranks first (one all-reduce; tokens per example is the ``token`` mode's n_bar), then per micro-batch a no-grad reference forward with adapters
disabled, the training forward, ``loss = local_sum / global_count`` and ``backward(sync=last)``.

Global batch per step: ``NUM_EXAMPLES`` examples; rank r's micro-batch m holds examples
``[(m * W + r) * B, (m * W + r + 1) * B)`` with ``B = NUM_EXAMPLES / (W * A)``, so (W=1, A=4) and
(W=2, A=2) see the same examples. In step ``EMPTY_STEP`` examples 2 and 3 have no supervised token:
under (W=2, A=2) that is rank 1's first micro-batch, which still runs every forward and backward.

Shape legend: B examples in a micro-batch, T padded length, V vocabulary.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from peft import LoraConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM

from zcvae.model.hf_compat import adapters_disabled

NUM_EXAMPLES = 8
NUM_STEPS = 4
CKPT_AFTER = 2  # save after this many steps, compare the rest
EMPTY_STEP = 1
EMPTY_EXAMPLES = (2, 3)
TRAINABLE_ROWS = [60, 61]
VOCAB = 64
HIDDEN = 32
MAX_GRAD_NORM = 0.5
GROUPS = (("lora", 5e-3, 0.01), ("tokens", 1e-2, 0.0))  # name, peak lr, weight decay

try:  # the project's aggregation (mean | sum over a row's supervised tokens), when it exists
    from zcvae.core.losses import aggregate
except ImportError:  # pragma: no cover - only while zcvae.core.losses is being written

    def aggregate(values_BN: torch.Tensor, mask_BN: torch.Tensor, mode: str) -> torch.Tensor:
        total = torch.where(mask_BN, values_BN, torch.zeros_like(values_BN)).sum(-1)
        return total if mode == "sum" else total / mask_BN.sum(-1).clamp_min(1)


def make_base_model(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        hidden_size=HIDDEN,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        use_cache=False,
    )
    return LlamaForCausalLM(config)


def make_model(seed: int = 0):
    """PeftModel: LoRA r=4 on q/k/v/o (B initialised non-zero, so the adapter matters from step 0)
    and a trainable delta for embedding rows 60 and 61."""
    base = make_base_model(seed)
    torch.manual_seed(seed + 1)
    lora = LoraConfig(
        r=4,
        lora_alpha=8,
        lora_dropout=0.0,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
        trainable_token_indices={"embed_tokens": TRAINABLE_ROWS},
        init_lora_weights=False,
    )
    return get_peft_model(base, lora)


def param_groups(model) -> list[dict]:
    lora = [p for n, p in model.named_parameters() if p.requires_grad and "lora_" in n]
    tokens = [p for n, p in model.named_parameters() if p.requires_grad and "lora_" not in n]
    assert lora and tokens
    return [
        {"params": params, "lr": lr, "weight_decay": wd, "name": name}
        for (name, lr, wd), params in zip(GROUPS, (lora, tokens))
    ]


def lrs_at(step: int) -> list[float]:
    return [lr * (1.0 - 0.15 * step) for _, lr, _ in GROUPS]


def step_examples(step: int) -> list[dict[str, torch.Tensor]]:
    """``NUM_EXAMPLES`` ragged examples: ids (L,), loss mask (L,) over the targets after a prompt."""
    g = torch.Generator().manual_seed(1000 + step)
    out = []
    for i in range(NUM_EXAMPLES):
        length = int(torch.randint(4, 14, (), generator=g))
        ids = torch.randint(1, 60, (length,), generator=g)
        ids[int(torch.randint(0, length, (), generator=g))] = TRAINABLE_ROWS[i % 2]  # the delta gets gradient
        prompt = int(torch.randint(1, length - 1, (), generator=g))
        mask = torch.zeros(length, dtype=torch.bool)
        if not (step == EMPTY_STEP and i in EMPTY_EXAMPLES):
            mask[prompt:] = True
        out.append({"ids": ids, "mask": mask})
    return out


def micro_batches(step: int, *, rank: int, world: int, accumulation: int) -> list[dict[str, torch.Tensor]]:
    examples = step_examples(step)
    size = NUM_EXAMPLES // (world * accumulation)
    assert size * world * accumulation == NUM_EXAMPLES
    return [collate(examples[(m * world + rank) * size : (m * world + rank + 1) * size]) for m in range(accumulation)]


def collate(examples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Right-padded batch; ``target_mask`` marks supervised next-token targets (position t predicts t+1)."""
    t = max(len(e["ids"]) for e in examples)
    ids_BT = torch.zeros(len(examples), t, dtype=torch.long)
    attn_BT = torch.zeros(len(examples), t, dtype=torch.long)
    target_mask_BT = torch.zeros(len(examples), t, dtype=torch.bool)
    for b, e in enumerate(examples):
        n = len(e["ids"])
        ids_BT[b, :n] = e["ids"]
        attn_BT[b, :n] = 1
        target_mask_BT[b, :n] = e["mask"]
    return {"input_ids": ids_BT, "attention_mask": attn_BT, "target_mask": target_mask_BT}


def per_example_nll(logits_BTV: torch.Tensor, batch: dict[str, torch.Tensor], mode: str, mean_num_tokens=None) -> torch.Tensor:
    """Per-example NLL aggregated over its supervised tokens by ``mode`` -> (B,); 0 for an empty row.
    ``token`` divides each token sum by ``mean_num_tokens``, the step's global tokens per valid example."""
    logits_BNV = logits_BTV[:, :-1].float()
    targets_BN = batch["input_ids"][:, 1:]
    mask_BN = batch["target_mask"][:, 1:]
    nll_BN = torch.nn.functional.cross_entropy(logits_BNV.transpose(1, 2), targets_BN, reduction="none")
    if mode == "token":
        return aggregate(nll_BN, mask_BN, mode, divisor=mean_num_tokens)
    return aggregate(nll_BN, mask_BN, mode)


def num_tokens(batch: dict[str, torch.Tensor]) -> int:
    return int(batch["target_mask"][:, 1:].sum())


def num_valid(batch: dict[str, torch.Tensor]) -> int:
    return int(batch["target_mask"][:, 1:].any(-1).sum())


def run_steps(
    engine,
    *,
    mode: str,
    steps: range,
    accumulation: int,
    on_step: Callable[[int], None] | None = None,
) -> dict[str, list[float]]:
    """Train ``steps``; returns the global loss, reference loss and pre-clip grad norm per step."""
    record: dict[str, list[float]] = {"loss": [], "ref": [], "grad_norm": []}
    for step in steps:
        batches = micro_batches(step, rank=engine.rank, world=engine.world_size, accumulation=accumulation)
        local = torch.tensor([float(sum(num_valid(b) for b in batches)), float(sum(num_tokens(b) for b in batches))])
        global_count, global_tokens = engine.all_reduce(local, "sum")
        mean_num_tokens = global_tokens / global_count  # the `token` mode's n_bar, before any forward
        engine.set_learning_rates(lrs_at(step))
        loss_sum = torch.zeros(())
        ref_sum = torch.zeros(())
        for m, batch in enumerate(batches):
            inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
            # Reference first, then the training forward: a no-grad forward between a ZeRO-3 training
            # forward and its backward can break the parameter coordinator's trace. The model's own
            # adapters_disabled (as ZCVAE.reference uses), not peft's disable_adapter(): peft's
            # context also toggles requires_grad, which the engines no longer guard against.
            with torch.no_grad(), adapters_disabled(engine.model):
                ref_B = per_example_nll(engine.module(**inputs).logits, batch, mode, mean_num_tokens)
            loss = per_example_nll(engine.module(**inputs).logits, batch, mode, mean_num_tokens).sum() / global_count
            engine.backward(loss, sync=m == len(batches) - 1)
            loss_sum += loss.detach()
            ref_sum += ref_B.sum() / global_count
        record["grad_norm"].append(engine.step(max_grad_norm=MAX_GRAD_NORM))
        totals = engine.all_reduce(torch.stack([loss_sum, ref_sum]), "sum")
        record["loss"].append(float(totals[0]))
        record["ref"].append(float(totals[1]))
        if on_step is not None:
            on_step(step)
    return record
