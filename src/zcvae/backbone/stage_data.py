"""The entangled stage's data: the examples (a built-in task or JSONL), their encoding, the two-template
mix the stage trains on, and its objective for the shared loop (:class:`SpanNLLObjective`).

Two templates are mixed (``z_template_share`` of the rows, drawn per row and per step, take the second)::

    <bos> <x> {x} </x> <y> {y} </y> <eos>                       z-free: the reference's input
    <bos> <x> {x} </x> <z> <znull> </z> <y> {y} </y> <eos>      z-shaped, <znull> in the slot

Shape legend: B batch, T sequence length, V vocabulary.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re

import torch
import torch.nn.functional as F

from zcvae.backbone.stage_config import PretrainConfig
from zcvae.core.losses import token_nll
from zcvae.data.encoding import (
    IGNORE_INDEX,
    Batch,
    EncodedExample,
    TemplateTokens,
    encode_examples,
    prepare_tokenizer,
)

logger = logging.getLogger(__name__)


def span_nll(logits_BTV: torch.Tensor, labels_BT: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token NLL (nats) of the supervised labels; logits at t predict labels at t + 1.

    Returns ``nll_BT`` (0 where unsupervised; position t scores the label at t + 1) and ``mask_BT``.
    The NLL is ``core.losses.token_nll``, the one the CVAE uses (bit-identical to the cross-entropy
    this function computed itself before, checked on CPU for float32 and bfloat16 logits).
    """
    mask_BT = labels_BT[:, 1:] != IGNORE_INDEX
    return token_nll(logits_BTV, labels_BT) * mask_BT, mask_BT


def mix_templates(
    batch: Batch, use_z_B: torch.Tensor, *, pad_id: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask, labels), each (B, T): row i in the z-shaped template where use_z_B[i].

    Both templates are right-padded, so the z-free rows are padded out to the z-shaped width and the
    result is trimmed to the longest row kept.
    """
    width = batch.z_input_ids.shape[1]
    grow = width - batch.input_ids.shape[1]
    pick = use_z_B[:, None]
    ids = torch.where(pick, batch.z_input_ids, F.pad(batch.input_ids, (0, grow), value=pad_id))
    mask = torch.where(pick, batch.z_attention_mask, F.pad(batch.attention_mask, (0, grow), value=0))
    labels = torch.where(pick, batch.z_labels, F.pad(batch.labels, (0, grow), value=IGNORE_INDEX))
    keep = int(mask.sum(1).max())
    return ids[:, :keep], mask[:, :keep], labels[:, :keep]



def load_data(config: PretrainConfig, tokenizer=None):
    """(tokenizer, tokens, train examples, val examples, task family or None).

    ``tokenizer``: a pretrained backbone's own (it gains the markers here); None builds the tiny
    model's word-level tokenizer over the data's words."""
    from zcvae.data import build_tokenizer, get_task, make_examples, read_jsonl

    if config.task is not None:
        task = get_task(config.task)
        train = make_examples(task, seed=config.seed, split="train", num_examples=config.num_train_examples)
        val = make_examples(task, seed=config.seed, split="val", num_examples=config.num_val_examples)
        if tokenizer is None:
            tokenizer = build_tokenizer()
    else:
        task = None
        train = read_jsonl(config.train_data)
        if config.val_data is not None:
            val = read_jsonl(config.val_data)
        else:
            num_val = min(config.num_val_examples, len(train) // 10)
            if num_val < 1:
                raise ValueError(
                    f"train_data {config.train_data!r} has {len(train)} examples: too few to hold out "
                    "validation examples; give val_data"
                )
            train, val = train[:-num_val], train[-num_val:]
        if tokenizer is None:
            words = sorted({w for ex in [*train, *val] for w in (*ex.x.split(), *ex.y.split())})
            tokenizer = build_tokenizer(extra_words=words)
    tokens = prepare_tokenizer(tokenizer, num_latents=0)
    return tokenizer, tokens, train, val, task


def encode_split(examples, tokenizer, tokens, *, max_length: int, what: str) -> list[EncodedExample]:
    encoded, report = encode_examples(examples, tokenizer, tokens, max_length=max_length, num_z_slots=1)
    if report.num_skipped or report.num_x_truncated or report.num_unknown_tokens:
        logger.info(
                    f"{what}: kept {report.num_kept}/{report.num_examples}, skipped {report.num_skipped}, "
                    f"x truncated {report.num_x_truncated}, unknown tokens {report.num_unknown_tokens}"
                    + (f"; first skip: {report.skipped[0]}" if report.skipped else "")
        )
    if not encoded:
        raise ValueError(f"{what}: no example fits max_length={max_length}")
    return encoded


def data_fingerprint(train, val) -> str:
    """sha256 of the examples a backbone was fit to (id, x, y, strategy; train then val, in order):
    ``zcvae train`` can tell whether its data is the data of the entangled stage."""
    h = hashlib.sha256()
    for split, examples in (("train", train), ("val", val)):
        for ex in examples:
            h.update(json.dumps([split, ex.id, ex.x, ex.y, ex.strategy], ensure_ascii=True).encode() + b"\n")
    return h.hexdigest()


def word_token_position(tokenizer, text: str, word_index: int) -> int:
    """Index of the token that holds whitespace word ``word_index`` of ``text``, tokenized as
    ``encode_examples`` tokenizes y. The families give decision positions in words; the word-level
    tokenizer has one token a word, a BPE tokenizer (a real LM's) splits digits and spaces, so the
    decision word of ``2 2 0 8 count ...`` is token 7 or 8, not 4. Past the last word: its token count."""
    starts = [m.start() for m in re.finditer(r"\S+", text)]
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    if word_index >= len(starts):
        return len(encoded["input_ids"])
    for i, (_, end) in enumerate(encoded["offset_mapping"]):
        if end > starts[word_index]:
            return i
    return len(encoded["input_ids"])



def validation_targets(task, tokenizer, val_examples, val: list[EncodedExample]) -> tuple[float | None, list[int] | None]:
    """(floor, decision positions) of the encoded validation examples ``val`` of a built-in ``task``
    (``val_examples``: the raw examples they came from): the best possible z-free y NLL, the mean of
    H(y | x) in nats per sequence, and the y token where each example's strategies first part (position
    0 for the marker-first families). (None, None) without a task (user JSONL has no known floor)."""
    if task is None:
        return None, None
    x_of, y_of = {ex.id: ex.x for ex in val_examples}, {ex.id: ex.y for ex in val_examples}
    decision_pos = [word_token_position(tokenizer, y_of[ex.id], (task.decision_positions(x_of[ex.id]) or (0,))[0])
                    for ex in val]
    floor = sum(task.y_entropy(x_of[ex.id]) for ex in val) / max(len(val), 1)
    return floor, decision_pos


class SpanNLLObjective:
    """The entangled stage's objective for ``zcvae.loop.driver.run_loop``: z-free mean token NLL over the
    supervised span (y and ``</y>``) of the two-template mix, over the global batch's tokens.

    Each row's template is drawn from (seed, step, its place in the global batch), so every world size
    and accumulation draws the same mix."""

    def __init__(self, *, engine, train_all: Batch, tokens: TemplateTokens, seed: int, z_template_share: float, global_batch: int):
        self.engine, self.train_all, self.tokens = engine, train_all, tokens
        self.seed, self.share, self.global_batch = seed, z_template_share, global_batch
        self.num_tokens = 0.0  # this rank's input tokens so far (train_tokens_per_s)

    def begin_step(self, step: int, micro: list[list[int]], positions: list[list[int]]) -> tuple[list, list[float]]:
        """This rank's micro-batches of the two-template mix, as (input_ids, attention_mask, labels), and their
        [rows, supervised tokens]."""
        digest = hashlib.sha256(f"zcvae pretrain templates {self.seed} {step}".encode()).digest()
        draws = torch.rand(self.global_batch, generator=torch.Generator().manual_seed(int.from_bytes(digest[:8], "little")))
        out = []
        for rows, places in zip(micro, positions):
            use_z_B = draws[places] < self.share
            out.append(tuple(t.to(self.engine.device) for t in mix_templates(self.train_all.select(rows), use_z_B, pad_id=self.tokens.pad)))
        return out, [float(sum(ids.shape[0] for ids, _, _ in out)),
                     float(sum(int((labels[:, 1:] != IGNORE_INDEX).sum()) for _, _, labels in out))]

    def micro_loss(self, batch, *, micro, num_micro: int, global_count, global_tokens):
        from zcvae.loop import MicroLoss

        ids_BT, mask_BT, labels_BT = batch
        logits_BTV = self.engine.module(input_ids=ids_BT, attention_mask=mask_BT).logits
        nll_BT, sup_BT = span_nll(logits_BTV, labels_BT)
        loss = nll_BT.sum() / global_tokens  # the mean token NLL over the global batch's y and </y>
        tokens_B = sup_BT.sum(1).float()
        # per row: its mean token NLL, weighted by its tokens in the window, so the window mean is the token mean
        terms = {"valid": tokens_B, "loss": nll_BT.detach().sum(1) / tokens_B.clamp_min(1)}
        self.num_tokens += float(mask_BT.sum())
        return MicroLoss(loss=loss, terms=terms, tokens=float(mask_BT.sum()))

    def end_step(self, done: int) -> dict[str, float]:
        return {}

    def checkpoint_state(self) -> tuple[dict, dict]:
        return {}, {}  # a pure function of (seed, step): nothing to keep besides the weights
