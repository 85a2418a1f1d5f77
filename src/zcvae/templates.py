"""Sequence templates, tokenisation policy and batch collation.

Two templates share one supervised span::

    z-free (the reference, and the backbone's own pretraining format)
        <bos> <x> {x} </x> <y> {y} </y> <eos>
    z-conditioned (the decoder; M slot tokens)
        <bos> <x> {x} </x> <z> {z_1 .. z_M} </z> <y> {y} </y> <eos>

The discrete latent value k owns M learned tokens: ``<z_k>`` when M = 1 (the single-slot names,
so M = 1 models and exports are unchanged), ``<z_k_1> .. <z_k_M>`` when M > 1. The Gaussian latent
fills the M slots with ``<znull>`` and adds projected offsets to their embeddings.

The supervised span is the y tokens plus ``</y>``. ``<eos>`` is *not* supervised in either template:
it carries no information about the strategy and leaving it out keeps n_i = len(y) + 1 identical in
both templates, which the loss core's span alignment relies on.

Over-long examples: x may be truncated from the left (the end of x, next to the answer, is kept);
y is never truncated: an example whose y cannot fit is skipped with a reason naming its id, and the
caller logs the count.

Shape legend: B batch, T z-free sequence length, S z-conditioned sequence length, M z-slot tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import torch

# The marker strings live with the tokenizer's vocabulary (zcvae.data stays importable without torch);
# everything else asks this module for them.
from zcvae.data.tokenizer import TEMPLATE_TOKENS as MARKERS

X_OPEN, X_CLOSE, Z_OPEN, Z_CLOSE, Y_OPEN, Y_CLOSE, ZNULL = MARKERS
IGNORE_INDEX = -100
# tokens outside x and y in the z-conditioned template: bos <x> </x> <z> </z> <y> </y> eos
NUM_FRAME_TOKENS = 8


def latent_token(k: int, slot: int | None = None) -> str:
    """The text of latent value k's token: ``<z_k>`` (single slot, ``slot`` None) or its ``slot``-th
    (1-based) of M > 1 tokens ``<z_k_slot>``."""
    return f"<z_{k}>" if slot is None else f"<z_{k}_{slot}>"


def latent_token_texts(num_latents: int, num_z_slots: int = 1) -> list[str]:
    """All K*M latent token texts, value-major: index k*M + m is slot m+1 of value k."""
    if num_z_slots == 1:
        return [latent_token(k) for k in range(num_latents)]
    return [latent_token(k, m + 1) for k in range(num_latents) for m in range(num_z_slots)]


@dataclass(frozen=True)
class TemplateTokens:
    """Resolved token ids of the template markers for one tokenizer."""

    bos: int
    eos: int
    pad: int
    x_open: int
    x_close: int
    z_open: int
    z_close: int
    y_open: int
    y_close: int
    znull: int
    latents: tuple[int, ...] = ()
    """K*M latent token ids, value-major (``latent_token_texts``); M = ``num_z_slots``."""
    num_z_slots: int = 1

    @property
    def latent_slots(self) -> tuple[tuple[int, ...], ...]:
        """(K, M) ids: row k is what the z section holds for latent value k."""
        M = self.num_z_slots
        return tuple(self.latents[k * M : (k + 1) * M] for k in range(len(self.latents) // M))

    @property
    def reserved(self) -> frozenset[int]:
        """Ids that user text must never produce (bos/eos/pad excluded: some tokenizers share them)."""
        ids = {self.x_open, self.x_close, self.z_open, self.z_close, self.y_open, self.y_close, self.znull}
        return frozenset(ids | set(self.latents))


def prepare_tokenizer(tokenizer, *, num_latents: int, num_z_slots: int = 1) -> TemplateTokens:
    """Add the template markers and ``num_latents`` x ``num_z_slots`` latent tokens as special tokens
    (idempotent).

    Tokenizers without a pad token get ``<pad>``; without bos/eos get ``<s>``/``</s>``. The caller
    must resize the model's embeddings to ``len(tokenizer)`` afterwards.
    """
    if num_latents < 0:
        raise ValueError(f"num_latents must be >= 0, got {num_latents}")
    if num_z_slots < 1:
        raise ValueError(f"num_z_slots must be >= 1, got {num_z_slots}")
    special = {}
    if tokenizer.bos_token is None:
        special["bos_token"] = "<s>"
    if tokenizer.eos_token is None:
        special["eos_token"] = "</s>"
    if tokenizer.pad_token is None:
        special["pad_token"] = "<pad>"
    if special:
        tokenizer.add_special_tokens(special)
    wanted = list(MARKERS) + latent_token_texts(num_latents, num_z_slots)
    vocab = tokenizer.get_vocab()
    missing = [t for t in wanted if t not in vocab]
    if missing:
        tokenizer.add_special_tokens({"additional_special_tokens": missing}, replace_extra_special_tokens=False)
    return template_tokens(tokenizer, num_latents=num_latents, num_z_slots=num_z_slots)


def template_tokens(tokenizer, *, num_latents: int, num_z_slots: int = 1) -> TemplateTokens:
    """Resolve marker ids without changing the tokenizer; ValueError naming a missing marker."""
    vocab = tokenizer.get_vocab()

    def tid(text: str) -> int:
        if text not in vocab:
            raise ValueError(f"tokenizer has no token {text!r}: call prepare_tokenizer first")
        return vocab[text]

    for name in ("bos_token", "eos_token", "pad_token"):
        if getattr(tokenizer, name) is None:
            raise ValueError(f"tokenizer has no {name}: call prepare_tokenizer first")
    return TemplateTokens(
        bos=tokenizer.bos_token_id,
        eos=tokenizer.eos_token_id,
        pad=tokenizer.pad_token_id,
        x_open=tid(X_OPEN),
        x_close=tid(X_CLOSE),
        z_open=tid(Z_OPEN),
        z_close=tid(Z_CLOSE),
        y_open=tid(Y_OPEN),
        y_close=tid(Y_CLOSE),
        znull=tid(ZNULL),
        latents=tuple(tid(t) for t in latent_token_texts(num_latents, num_z_slots)),
        num_z_slots=num_z_slots,
    )


def user_text_reserved_ids(tokenizer, tokens: TemplateTokens) -> dict[int, str]:
    """{id: token} of every id that user text (x, y) must not produce: the template markers, the
    latent tokens and the tokenizer's own special tokens (bos, eos, pad ...; ``</s>`` in y would put an
    eos inside the supervised span). The unknown token is left out: it is counted, not refused."""
    unk = getattr(tokenizer, "unk_token_id", None)
    ids = set(tokens.reserved) | {tokens.bos, tokens.eos, tokens.pad} | set(getattr(tokenizer, "all_special_ids", ()))
    return {i: tokenizer.convert_ids_to_tokens(i) for i in sorted(ids) if i is not None and i != unk}


@dataclass(frozen=True)
class EncodedExample:
    id: str
    x_ids: tuple[int, ...]
    y_ids: tuple[int, ...]
    strategy: str | None = None
    x_truncated: bool = False

    @property
    def num_supervised(self) -> int:
        return len(self.y_ids) + 1  # y tokens plus </y>


@dataclass
class EncodeReport:
    """What encoding did to a data set: counts that the trainer logs, and one line per skip."""

    num_examples: int = 0
    num_kept: int = 0
    num_x_truncated: int = 0
    num_unknown_tokens: int = 0
    num_tokens: int = 0  # x and y tokens of the examples whose unknown tokens were counted
    unknown_example: str | None = None  # the id of the first example with an unknown token
    skipped: list[str] = field(default_factory=list)

    @property
    def num_skipped(self) -> int:
        return len(self.skipped)


def encode_examples(
    examples, tokenizer, tokens: TemplateTokens, *, max_length: int, num_z_slots: int
) -> tuple[list[EncodedExample], EncodeReport]:
    """Tokenise examples under the length policy of the module docstring.

    ``max_length`` bounds the z-conditioned sequence (the longer template). Examples with an empty y,
    with user text that produces a template marker, or whose y cannot fit are skipped; each skip is
    reported with the example id and the reason.
    """
    if max_length <= NUM_FRAME_TOKENS + num_z_slots:
        raise ValueError(f"max_length={max_length} leaves no room for x and y (num_z_slots={num_z_slots})")
    report = EncodeReport()
    out: list[EncodedExample] = []
    reserved = user_text_reserved_ids(tokenizer, tokens)
    unk = getattr(tokenizer, "unk_token_id", None)
    for ex in examples:
        report.num_examples += 1
        x_ids = tokenizer(ex.x, add_special_tokens=False)["input_ids"] if ex.x else []
        y_ids = tokenizer(ex.y, add_special_tokens=False)["input_ids"] if ex.y else []
        if not y_ids:
            report.skipped.append(f"{ex.id}: empty y")
            continue
        hit = next((i for i in (*x_ids, *y_ids) if i in reserved), None)
        if hit is not None:
            report.skipped.append(f"{ex.id}: x or y contains the special token {reserved[hit]!r} (id {hit})")
            continue
        if unk is not None:
            found = x_ids.count(unk) + y_ids.count(unk)
            report.num_unknown_tokens += found
            report.num_tokens += len(x_ids) + len(y_ids)
            if found and report.unknown_example is None:
                report.unknown_example = ex.id
        room_x = max_length - NUM_FRAME_TOKENS - num_z_slots - len(y_ids)
        if room_x < 0:
            report.skipped.append(
                f"{ex.id}: y has {len(y_ids)} tokens and cannot fit in max_length={max_length}"
            )
            continue
        truncated = len(x_ids) > room_x
        if truncated:
            x_ids = x_ids[len(x_ids) - room_x :] if room_x > 0 else []
            report.num_x_truncated += 1
        out.append(EncodedExample(ex.id, tuple(x_ids), tuple(y_ids), ex.strategy, truncated))
    report.num_kept = len(out)
    return out, report


@dataclass
class Batch:
    """A collated, right-padded batch in both templates.

    ``labels`` hold the supervised span (y and </y>) at its own positions and IGNORE_INDEX elsewhere;
    logits at t predict labels at t + 1 (Hugging Face convention). ``z_*`` is the z-conditioned template
    with every slot token set to ``<znull>``: the model writes the latent into positions
    ``z_slot_start[i] .. z_slot_start[i] + M - 1``.
    """

    ids: list[str]
    strategies: list[str | None]
    input_ids: torch.Tensor  # (B, T) z-free
    attention_mask: torch.Tensor  # (B, T)
    labels: torch.Tensor  # (B, T)
    x_close_pos: torch.Tensor  # (B,) index of </x>; the prior reads its hidden state
    y_close_pos: torch.Tensor  # (B,) index of </y> in the z-free sequence; the posterior reads it
    z_input_ids: torch.Tensor  # (B, S) z-conditioned
    z_attention_mask: torch.Tensor  # (B, S)
    z_labels: torch.Tensor  # (B, S)
    z_slot_start: torch.Tensor  # (B,) index of the first slot token
    num_supervised: torch.Tensor  # (B,) n_i = len(y) + 1
    num_z_slots: int = 1

    def __len__(self) -> int:
        return len(self.ids)

    def to(self, device) -> "Batch":
        moved = {
            f.name: (getattr(self, f.name).to(device) if isinstance(getattr(self, f.name), torch.Tensor) else getattr(self, f.name))
            for f in fields(self)
        }
        return Batch(**moved)

    def select(self, index: list[int]) -> "Batch":
        """A sub-batch (rows ``index``), trimmed of all-padding columns."""
        idx = torch.as_tensor(index, dtype=torch.long)
        t = int(self.attention_mask[idx].sum(1).max()) if len(index) else 1
        s = int(self.z_attention_mask[idx].sum(1).max()) if len(index) else 1
        return Batch(
            ids=[self.ids[i] for i in index],
            strategies=[self.strategies[i] for i in index],
            input_ids=self.input_ids[idx, :t],
            attention_mask=self.attention_mask[idx, :t],
            labels=self.labels[idx, :t],
            x_close_pos=self.x_close_pos[idx],
            y_close_pos=self.y_close_pos[idx],
            z_input_ids=self.z_input_ids[idx, :s],
            z_attention_mask=self.z_attention_mask[idx, :s],
            z_labels=self.z_labels[idx, :s],
            z_slot_start=self.z_slot_start[idx],
            num_supervised=self.num_supervised[idx],
            num_z_slots=self.num_z_slots,
        )


def zfree_sequence(ex: EncodedExample, tokens: TemplateTokens) -> tuple[list[int], list[int]]:
    """(input ids, labels) of the z-free template."""
    prefix = [tokens.bos, tokens.x_open, *ex.x_ids, tokens.x_close, tokens.y_open]
    span = [*ex.y_ids, tokens.y_close]
    ids = prefix + span + [tokens.eos]
    labels = [IGNORE_INDEX] * len(prefix) + span + [IGNORE_INDEX]
    return ids, labels


def zfree_fingerprint_text() -> str:
    """The z-free template as text, rendered by ``zfree_sequence`` itself from symbolic tokens:
    ``"<bos> <x> {x} </x> <y> {y} </y> <eos>; supervised: y + </y>"``. It is part of the reference
    store's fingerprint, so a change of the template (or of what is supervised) invalidates every
    store; the text of an unchanged template must stay byte-identical (pinned in test_templates)."""
    names = {f.name: f"<{f.name}>" for f in fields(TemplateTokens)}
    names.update(x_open=X_OPEN, x_close=X_CLOSE, y_open=Y_OPEN, y_close=Y_CLOSE)
    symbolic = type("SymbolicTokens", (), names)
    ids, labels = zfree_sequence(EncodedExample("layout", ("{x}",), ("{y}",)), symbolic)
    supervised = [str(tok).strip("{}") for tok, label in zip(ids, labels) if label != IGNORE_INDEX]
    return f"{' '.join(map(str, ids))}; supervised: {' + '.join(supervised)}"


def zcond_sequence(
    ex: EncodedExample, tokens: TemplateTokens, slot_ids: list[int]
) -> tuple[list[int], list[int]]:
    """(input ids, labels) of the z-conditioned template with ``slot_ids`` in the z section."""
    prefix = [tokens.bos, tokens.x_open, *ex.x_ids, tokens.x_close, tokens.z_open, *slot_ids, tokens.z_close, tokens.y_open]
    span = [*ex.y_ids, tokens.y_close]
    ids = prefix + span + [tokens.eos]
    labels = [IGNORE_INDEX] * len(prefix) + span + [IGNORE_INDEX]
    return ids, labels


def zcond_prompt(x_ids, tokens: TemplateTokens, num_slots: int) -> list[int]:
    """``<bos> <x> {x} </x> <z> <znull>*M </z> <y>``: the decode prompt; the model writes z into the slots."""
    return [tokens.bos, tokens.x_open, *x_ids, tokens.x_close, tokens.z_open, *[tokens.znull] * num_slots,
            tokens.z_close, tokens.y_open]


def z_slot_start(num_x: int) -> int:
    """Position of the first z slot: ``<bos> <x> {x} </x> <z>`` come before it."""
    return num_x + 4


def _pad(rows: list[list[int]], value: int) -> torch.Tensor:
    width = max(len(r) for r in rows)
    return torch.tensor([r + [value] * (width - len(r)) for r in rows], dtype=torch.long)


def collate(examples: list[EncodedExample], tokens: TemplateTokens, *, num_z_slots: int = 1) -> Batch:
    """Right-pad a list of encoded examples into a :class:`Batch` (both templates)."""
    if not examples:
        raise ValueError("collate needs at least one example")
    zf = [zfree_sequence(ex, tokens) for ex in examples]
    zc = [zcond_sequence(ex, tokens, [tokens.znull] * num_z_slots) for ex in examples]
    input_ids = _pad([ids for ids, _ in zf], tokens.pad)
    z_input_ids = _pad([ids for ids, _ in zc], tokens.pad)
    x_len = torch.tensor([len(ex.x_ids) for ex in examples], dtype=torch.long)
    n = torch.tensor([ex.num_supervised for ex in examples], dtype=torch.long)
    return Batch(
        ids=[ex.id for ex in examples],
        strategies=[ex.strategy for ex in examples],
        input_ids=input_ids,
        attention_mask=_pad([[1] * len(ids) for ids, _ in zf], 0),
        labels=_pad([lab for _, lab in zf], IGNORE_INDEX),
        x_close_pos=x_len + 2,
        # bos <x> x </x> <y> y </y>: </y> sits at len(x) + 4 + len(y) = len(x) + 3 + n
        y_close_pos=x_len + 3 + n,
        z_input_ids=z_input_ids,
        z_attention_mask=_pad([[1] * len(ids) for ids, _ in zc], 0),
        z_labels=_pad([lab for _, lab in zc], IGNORE_INDEX),
        z_slot_start=z_slot_start(x_len),
        num_supervised=n,
        num_z_slots=num_z_slots,
    )
