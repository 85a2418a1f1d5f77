"""How an example becomes model input: the sequence templates, the tokenisation policy, ``Batch`` and collation.

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

:class:`TemplateLayout` is the one place that knows the templates' shape: the marker strings, where
x, z and y sit, the sequences and the reference store's fingerprint text. Everything else asks it.

Shape legend: B batch, T z-free sequence length, S z-conditioned sequence length, M z-slot tokens.
"""

from __future__ import annotations

import hashlib
from array import array
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, ClassVar

if TYPE_CHECKING:
    import torch

# torch is imported inside the functions that build tensors: zcvae.data (its tokenizer takes the
# marker strings from here) stays importable without torch.

IGNORE_INDEX = -100


@dataclass(frozen=True)
class TemplateLayout:
    """The one description of both templates: the marker strings, where x, z and y sit, the token
    sequences themselves and the fingerprint text of the reference store.

    Positions are 0-based token indices in an example's own (unpadded) row; ``num_x``/``num_y`` count
    its x and y tokens and may be ints or integer tensors (the arithmetic is elementwise)::

        z-free         <bos> <x> {x} </x> <y> {y} </y> <eos>
        z-conditioned  <bos> <x> {x} </x> <z> {z_1 .. z_M} </z> <y> {y} </y> <eos>
                       |-- prefix_length --| identical in both templates; </x> at x_close

    ``num_z_slots`` is M, the length of the z section (the z-free template does not depend on it).
    """

    num_z_slots: int = 1

    MARKERS: ClassVar[tuple[str, ...]] = ("<x>", "</x>", "<z>", "</z>", "<y>", "</y>", "<znull>")
    """The marker strings, defined here only (the built-in tokenizer's vocabulary and
    ``prepare_tokenizer`` read them); ``<znull>`` fills a z slot that holds no latent."""
    NUM_FRAME_TOKENS: ClassVar[int] = 8
    """Tokens of the z-conditioned template outside x, y and the z slots:
    ``<bos> <x> </x> <z> </z> <y> </y> <eos>``."""

    def __post_init__(self) -> None:
        if isinstance(self.num_z_slots, bool) or not isinstance(self.num_z_slots, int) or self.num_z_slots < 1:
            raise ValueError(f"num_z_slots must be an int >= 1, got {self.num_z_slots!r}")

    # ---- positions -----------------------------------------------------------------------------
    @staticmethod
    def x_close(num_x):
        """Index of ``</x>`` in both templates (the prior reads its hidden state): after ``<bos> <x> {x}``."""
        return num_x + 2

    @classmethod
    def prefix_length(cls, num_x):
        """Length of ``<bos> <x> {x} </x>``, the prefix that both templates share."""
        return cls.x_close(num_x) + 1

    @classmethod
    def z_slot_start(cls, num_x):
        """Index of the first z slot (z-conditioned template): after the prefix and ``<z>``."""
        return cls.prefix_length(num_x) + 1

    def zcond_y_start(self, num_x):
        """Index of the first y token of the z-conditioned template: after the M slots, ``</z> <y>``."""
        return self.z_slot_start(num_x) + self.num_z_slots + 2

    @classmethod
    def zfree_y_close(cls, num_x, num_y):
        """Index of ``</y>`` in the z-free template (the posterior reads its hidden state): after the
        prefix, ``<y>`` and y."""
        return cls.prefix_length(num_x) + 1 + num_y

    def zcond_length(self, num_x, num_y):
        """Length of the z-conditioned sequence, the longer template (``max_length`` bounds it)."""
        return self.NUM_FRAME_TOKENS + self.num_z_slots + num_x + num_y

    def room_for_x(self, max_length: int, num_y: int) -> int:
        """How many x tokens fit beside ``num_y`` y tokens within ``max_length`` (negative when y alone
        does not fit)."""
        return max_length - self.zcond_length(0, num_y)

    # ---- sequences -----------------------------------------------------------------------------
    @staticmethod
    def zfree_sequence(ex: EncodedExample, tokens: TemplateTokens) -> tuple[list[int], list[int]]:
        """(input ids, labels) of the z-free template."""
        prefix = [tokens.bos, tokens.x_open, *ex.x_ids, tokens.x_close, tokens.y_open]
        span = [*ex.y_ids, tokens.y_close]
        ids = prefix + span + [tokens.eos]
        labels = [IGNORE_INDEX] * len(prefix) + span + [IGNORE_INDEX]
        return ids, labels

    def zcond_sequence(self, ex: EncodedExample, tokens: TemplateTokens, slot_ids) -> tuple[list[int], list[int]]:
        """(input ids, labels) of the z-conditioned template with the M ``slot_ids`` in the z section."""
        if len(slot_ids) != self.num_z_slots:
            raise ValueError(f"the z section holds num_z_slots={self.num_z_slots} token(s), got {len(slot_ids)} slot ids")
        prefix = [tokens.bos, tokens.x_open, *ex.x_ids, tokens.x_close, tokens.z_open, *slot_ids, tokens.z_close, tokens.y_open]
        span = [*ex.y_ids, tokens.y_close]
        ids = prefix + span + [tokens.eos]
        labels = [IGNORE_INDEX] * len(prefix) + span + [IGNORE_INDEX]
        return ids, labels

    @staticmethod
    def zfree_prompt(x_ids, tokens: TemplateTokens) -> list[int]:
        """``<bos> <x> {x} </x> <y>``: the z-free decode prompt (the backbone's own format)."""
        return [tokens.bos, tokens.x_open, *x_ids, tokens.x_close, tokens.y_open]

    def zcond_prompt(self, x_ids, tokens: TemplateTokens) -> list[int]:
        """``<bos> <x> {x} </x> <z> <znull>*M </z> <y>``: the decode prompt; the model writes z into the slots."""
        return [tokens.bos, tokens.x_open, *x_ids, tokens.x_close, tokens.z_open, *[tokens.znull] * self.num_z_slots,
                tokens.z_close, tokens.y_open]

    @classmethod
    def fingerprint_text(cls) -> str:
        """The z-free template as text, rendered by ``zfree_sequence`` itself from symbolic tokens:
        ``"<bos> <x> {x} </x> <y> {y} </y> <eos>; supervised: y + </y>"``. It is part of the reference
        store's fingerprint, so a change of the template (or of what is supervised) invalidates every
        store; the text of an unchanged template must stay byte-identical (pinned in test_templates)."""
        names = {f.name: f"<{f.name}>" for f in fields(TemplateTokens)}
        names.update(x_open=X_OPEN, x_close=X_CLOSE, y_open=Y_OPEN, y_close=Y_CLOSE)
        symbolic = type("SymbolicTokens", (), names)
        ids, labels = cls.zfree_sequence(EncodedExample("layout", ("{x}",), ("{y}",)), symbolic)
        supervised = [str(tok).strip("{}") for tok, label in zip(ids, labels) if label != IGNORE_INDEX]
        return f"{' '.join(map(str, ids))}; supervised: {' + '.join(supervised)}"


MARKERS = TemplateLayout.MARKERS
X_OPEN, X_CLOSE, Z_OPEN, Z_CLOSE, Y_OPEN, Y_CLOSE, ZNULL = MARKERS


def missing_markers(vocab) -> list[str]:
    """The template markers (``MARKERS``, in that order) that a tokenizer's vocabulary lacks.

    ``prepare_tokenizer`` adds them as new tokens whose rows the backbone never trained: a backbone
    that lacks them has not been through the entangled stage (``zcvae pretrain --backbone``)."""
    return [t for t in MARKERS if t not in vocab]


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


def encoded_fingerprint(examples: list[EncodedExample]) -> dict[str, object]:
    """``{"fingerprint", "num_examples"}`` of the encoded examples a run trains on, in order (id, x and y token ids,
    strategy): what a checkpoint records so that a resume on other training data is refused rather than continued.
    Encoded, not raw, so a change that alters which examples fit ``max_length`` or how they tokenize counts too."""
    h = hashlib.sha256()
    for ex in examples:
        h.update(f"{ex.id}\x00{ex.strategy}\x00".encode())
        h.update(array("q", ex.x_ids).tobytes() + b"\x01" + array("q", ex.y_ids).tobytes() + b"\x02")
    return {"fingerprint": h.hexdigest(), "num_examples": len(examples)}


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
    layout = TemplateLayout(num_z_slots)
    if max_length <= layout.zcond_length(0, 0):
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
        room_x = layout.room_for_x(max_length, len(y_ids))
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

    @property
    def prefix_length(self) -> torch.Tensor:
        """(B,) length of ``<bos> <x> {x} </x>``, the prefix both templates share
        (``TemplateLayout.prefix_length``): the token after ``</x>``."""
        return self.x_close_pos + 1

    def to(self, device) -> "Batch":
        import torch

        moved = {
            f.name: (getattr(self, f.name).to(device) if isinstance(getattr(self, f.name), torch.Tensor) else getattr(self, f.name))
            for f in fields(self)
        }
        return Batch(**moved)

    def select(self, index: list[int]) -> "Batch":
        """A sub-batch (rows ``index``), trimmed of all-padding columns."""
        import torch

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


def _pad(rows: list[list[int]], value: int) -> torch.Tensor:
    import torch

    width = max(len(r) for r in rows)
    return torch.tensor([r + [value] * (width - len(r)) for r in rows], dtype=torch.long)


def collate(examples: list[EncodedExample], tokens: TemplateTokens, *, num_z_slots: int = 1) -> Batch:
    """Right-pad a list of encoded examples into a :class:`Batch` (both templates)."""
    if not examples:
        raise ValueError("collate needs at least one example")
    import torch

    layout = TemplateLayout(num_z_slots)
    zf = [layout.zfree_sequence(ex, tokens) for ex in examples]
    zc = [layout.zcond_sequence(ex, tokens, [tokens.znull] * num_z_slots) for ex in examples]
    input_ids = _pad([ids for ids, _ in zf], tokens.pad)
    z_input_ids = _pad([ids for ids, _ in zc], tokens.pad)
    x_len = torch.tensor([len(ex.x_ids) for ex in examples], dtype=torch.long)
    y_len = torch.tensor([len(ex.y_ids) for ex in examples], dtype=torch.long)
    n = torch.tensor([ex.num_supervised for ex in examples], dtype=torch.long)
    return Batch(
        ids=[ex.id for ex in examples],
        strategies=[ex.strategy for ex in examples],
        input_ids=input_ids,
        attention_mask=_pad([[1] * len(ids) for ids, _ in zf], 0),
        labels=_pad([lab for _, lab in zf], IGNORE_INDEX),
        x_close_pos=layout.x_close(x_len),
        y_close_pos=layout.zfree_y_close(x_len, y_len),
        z_input_ids=z_input_ids,
        z_attention_mask=_pad([[1] * len(ids) for ids, _ in zc], 0),
        z_labels=_pad([lab for _, lab in zc], IGNORE_INDEX),
        z_slot_start=layout.z_slot_start(x_len),
        num_supervised=n,
        num_z_slots=num_z_slots,
    )
