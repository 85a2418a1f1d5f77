"""How the entangled stage is judged: the validation y NLL under both templates (per sequence, per token,
on the first and the decision token, per strategy), and decoding (greedy and sampled) with the task's
parser.

Shape legend: B batch, T sequence length, V vocabulary; decoding: R rows, L prompt + generated tokens.
"""

from __future__ import annotations

import functools
from collections import Counter, defaultdict
from collections.abc import Sequence

import torch

from zcvae.backbone.stage_data import span_nll
from zcvae.model import hf_compat
from zcvae.model.decoding import KVCache, greedy_decode
from zcvae.data.encoding import EncodedExample, TemplateLayout, TemplateTokens, collate

TEMPLATES = ("zfree", "znull")


@torch.no_grad()
def evaluate_nll(
    model,
    examples: Sequence[EncodedExample],
    tokens: TemplateTokens,
    *,
    batch_size: int = 256,
    decision_positions: Sequence[int] | None = None,
) -> dict:
    """Validation y-sequence NLL under both templates (``<znull>`` in the z slot for "znull").

    Per template: ``nll_per_example`` (nats per sequence: the sum over y and ``</y>``, averaged over
    examples), ``nll_per_token`` (total nats / total tokens), ``first_token_nll`` (nats on the first y
    token, where the marker-first families choose the strategy) and the same per gold strategy when
    examples carry one. With ``decision_positions`` (one y token index per example: where its
    strategies first part), also ``decision_token_nll``, the nats on that token.
    """
    if decision_positions is not None and len(decision_positions) != len(examples):
        raise ValueError(f"decision_positions has {len(decision_positions)} entries for {len(examples)} examples")
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    seq: dict[str, list[torch.Tensor]] = {t: [] for t in TEMPLATES}
    first: dict[str, list[torch.Tensor]] = {t: [] for t in TEMPLATES}
    decision: dict[str, list[torch.Tensor]] = {t: [] for t in TEMPLATES}
    count: list[torch.Tensor] = []
    for start in range(0, len(examples), batch_size):
        batch = collate(list(examples[start : start + batch_size]), tokens).to(device)
        count.append(batch.num_supervised.cpu())
        for template in TEMPLATES:
            if template == "zfree":
                ids, mask, labels = batch.input_ids, batch.attention_mask, batch.labels
            else:
                ids, mask, labels = batch.z_input_ids, batch.z_attention_mask, batch.z_labels
            nll_BT, mask_BT = span_nll(model(input_ids=ids, attention_mask=mask).logits, labels)
            seq[template].append(nll_BT.sum(1).cpu())
            first_pos_B = mask_BT.int().argmax(1)
            first[template].append(nll_BT.gather(1, first_pos_B[:, None])[:, 0].cpu())
            if decision_positions is not None:
                offset_B = torch.as_tensor(decision_positions[start : start + batch_size], device=first_pos_B.device)
                # A position past y (never for the built-in families) scores </y>, the last supervised token.
                last_B = first_pos_B + mask_BT.sum(1) - 1
                pos_B = torch.minimum(first_pos_B + offset_B, last_B)
                decision[template].append(nll_BT.gather(1, pos_B[:, None])[:, 0].cpu())
    model.train(was_training)

    n_B = torch.cat(count).double()
    strategies = [ex.strategy for ex in examples]
    groups: dict[str, list[int]] = defaultdict(list)
    for i, s in enumerate(strategies):
        if s is not None:
            groups[s].append(i)

    def stats(seq_B: torch.Tensor, first_B: torch.Tensor, decision_B: torch.Tensor | None, idx: list[int] | None) -> dict:
        m_B = n_B
        if idx is not None:
            sel = torch.as_tensor(idx)
            seq_B, first_B, m_B = seq_B[sel], first_B[sel], n_B[sel]
            decision_B = None if decision_B is None else decision_B[sel]
        entry = {
            "num_examples": int(seq_B.numel()),
            "nll_per_example": float(seq_B.mean()),
            "nll_per_token": float(seq_B.sum() / m_B.sum()),
            "first_token_nll": float(first_B.mean()),
            "mean_num_tokens": float(m_B.mean()),
        }
        if decision_B is not None:
            entry["decision_token_nll"] = float(decision_B.mean())
        return entry

    out = {}
    for template in TEMPLATES:
        seq_B, first_B = torch.cat(seq[template]).double(), torch.cat(first[template]).double()
        decision_B = torch.cat(decision[template]).double() if decision_positions is not None else None
        entry = stats(seq_B, first_B, decision_B, None)
        if groups:
            entry["per_strategy"] = {s: stats(seq_B, first_B, decision_B, idx) for s, idx in sorted(groups.items())}
        out[template] = entry
    return out


@torch.no_grad()
def generate_y(
    model,
    examples: Sequence[EncodedExample],
    tokens: TemplateTokens,
    *,
    template: str,
    max_length: int,
    max_new_tokens: int | None = None,
    generator: torch.Generator | None = None,
) -> list[list[int]]:
    """y token ids (without ``</y>``) decoded after each example's prompt by the one decoder
    (``model.decoding.greedy_decode``); greedy unless ``generator``, which draws each token from the
    softmax.

    Prompts end with ``<y>``; decoding stops at ``</y>``, after ``max_new_tokens`` or where the sequence
    would pass ``max_length`` (the length policy of training). Prompts are decoded in groups of one
    length: the step bound depends on it, and the draws of a sampled decode on the grouping.
    """
    if template not in TEMPLATES:
        raise ValueError(f"template must be one of {TEMPLATES}, got {template!r}")
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    layout = TemplateLayout(num_z_slots=1)
    prompts = [layout.zcond_prompt(ex.x_ids, tokens) if template == "znull" else layout.zfree_prompt(ex.x_ids, tokens)
               for ex in examples]
    by_length: dict[int, list[int]] = defaultdict(list)
    for i, p in enumerate(prompts):
        by_length[len(p)].append(i)
    if max_new_tokens is None:
        max_new_tokens = max_length

    cache_key = hf_compat.lm_cache_kwarg(model)
    use_cache = not hf_compat.layer_checkpointing_active(model)  # transformers drops a cache in checkpointed layers

    def next_logits(ids_RL: torch.Tensor, mask_RL: torch.Tensor, cache: KVCache) -> torch.Tensor:
        if cache.started:  # one new token per row on the kept keys and values
            ids_R1, position_R1, mask_RC = cache.advance(ids_RL, mask_RL)
            return model(input_ids=ids_R1, attention_mask=mask_RC, position_ids=position_R1, **cache.kwargs(0, cache_key)).logits[:, -1]
        kv = cache.open(0, cache_key) if use_cache else {"use_cache": False}
        logits_RLV = model(input_ids=ids_RL, attention_mask=mask_RL, **kv).logits
        if use_cache:
            cache.start(mask_RL)
        last_R = mask_RL.sum(1) - 1  # right padding: each row's last real token
        return logits_RLV[torch.arange(ids_RL.shape[0], device=ids_RL.device), last_R]

    def draw(logits_RV: torch.Tensor) -> torch.Tensor:
        return torch.multinomial(logits_RV.float().softmax(-1).cpu(), 1, generator=generator)[:, 0]

    result: list[list[int]] = [[] for _ in prompts]
    for length, rows in sorted(by_length.items()):
        # room left for y, </y> and <eos> within max_length
        num_steps = max(1, min(max_new_tokens, max_length - length - 1))
        generated, _, _ = greedy_decode(
            functools.partial(next_logits, cache=KVCache()), [prompts[i] for i in rows], num_steps=num_steps,
            stop_id=tokens.y_close, pad_id=tokens.pad,
            device=device, lock_step=False, choose_next=None if generator is None else draw,
        )
        for i, y_ids in zip(rows, generated):
            result[i] = y_ids
    model.train(was_training)
    return result


def decoding_report(
    model, tokenizer, examples: Sequence[EncodedExample], tokens: TemplateTokens, task, *, max_length: int, seed: int
) -> dict:
    """Strategy frequencies, parse rate and answer accuracy of greedy and sampled decoding, per template."""
    x_text = [tokenizer.decode(list(ex.x_ids)) for ex in examples]
    report: dict = {}
    for template in TEMPLATES:
        for mode in ("greedy", "sampled"):
            generator = torch.Generator().manual_seed(seed) if mode == "sampled" else None
            ys = generate_y(model, examples, tokens, template=template, max_length=max_length, generator=generator)
            counts: Counter = Counter()
            num_parse_ok = num_correct = 0
            for x, y_ids in zip(x_text, ys):
                parsed = task.parse(tokenizer.decode(y_ids))
                counts[parsed.strategy if parsed.strategy is not None else "unparsed"] += 1
                num_parse_ok += parsed.parse_ok
                num_correct += parsed.parse_ok and parsed.answer == task.answer(x)
            n = max(1, len(examples))
            report.setdefault(template, {})[mode] = {
                "strategy_freq": {s: counts[s] / n for s in sorted(counts)},
                "parse_ok": num_parse_ok / n,
                "answer_accuracy": num_correct / n,
            }
    return report
