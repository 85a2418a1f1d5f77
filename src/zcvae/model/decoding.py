"""The one greedy decoder: evaluation (lock-step across ranks), export's generate and the backbone's
pretraining report (also sampled, through ``choose_next``) use it.

Shapes: R rows, L tokens (prompt + generated so far), V vocabulary.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence

import torch


def greedy_decode(
    next_logits: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    prompts: Sequence[Sequence[int]],
    *,
    num_steps: int,
    stop_id: int | Collection[int],
    pad_id: int,
    device: torch.device | str = "cpu",
    lock_step: bool = True,
    all_stopped: Callable[[bool], bool] | None = None,
    choose_next: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> tuple[list[list[int]], list[bool], int]:
    """Greedy continuation of right-padded prompts for at most ``num_steps`` forwards.

    ``next_logits(input_ids_RL, attention_mask_RL) -> logits_RV`` scores the next token after each
    row's last attended position. A row stops growing after a stop token (``stop_id``: one id or a
    collection). ``lock_step=True``: every rank runs the same forwards, whatever its rows do
    (evaluation: a sharded model's forwards are collectives): all ``num_steps`` of them, or, with
    ``all_stopped``, until every rank's rows have stopped: after each forward every rank calls
    ``all_stopped(its own rows have all stopped) -> every rank's have`` (a collective, an all-reduce),
    so all ranks stop after the same forward. ``lock_step=False``: stop as soon as this call's rows
    have stopped (one process: export's generate). ``choose_next(logits_RV) -> ids_R`` picks every
    row's next token (stopped rows included, their pick is dropped): argmax (greedy) when None; the
    backbone's pretraining report passes a draw from the softmax for its sampled decode. Returns the generated ids of each row without the
    stop token, whether the row emitted one, and the number of forwards run.
    """
    if num_steps < 1:
        raise ValueError(f"num_steps must be >= 1, got {num_steps}")
    R = len(prompts)
    lengths = [len(p) for p in prompts]
    width = max(lengths) + num_steps
    ids_RL = torch.full((R, width), pad_id, dtype=torch.long)
    for r, p in enumerate(prompts):
        ids_RL[r, : len(p)] = torch.tensor(p, dtype=torch.long)
    ids_RL = ids_RL.to(device)
    len_R = torch.tensor(lengths, dtype=torch.long, device=device)
    done_R = torch.zeros(R, dtype=torch.bool, device=device)
    positions_L = torch.arange(width, device=device)
    rows_R = torch.arange(R, device=device)
    stops = torch.tensor(sorted({stop_id} if isinstance(stop_id, int) else set(stop_id)), dtype=torch.long, device=device)
    num_forwards = 0
    for _ in range(num_steps):
        if not lock_step and bool(done_R.all()):
            break
        # no call before the first forward, so every rank makes the same calls
        if lock_step and all_stopped is not None and num_forwards > 0 and all_stopped(bool(done_R.all())):
            break
        cur = int(len_R.max())  # every row fits: len <= prompt + steps so far
        mask_RL = (positions_L[:cur][None, :] < len_R[:, None]).long()
        logits_RV = next_logits(ids_RL[:, :cur], mask_RL)
        num_forwards += 1
        next_R = (logits_RV.argmax(-1) if choose_next is None else choose_next(logits_RV)).to(device)
        live_R = ~done_R
        # Finished rows write nothing; live rows append at their own length.
        write_R = torch.where(live_R, len_R, torch.zeros_like(len_R))
        ids_RL[rows_R[live_R], write_R[live_R]] = next_R[live_R]
        len_R = len_R + live_R.long()
        done_R = done_R | (live_R & torch.isin(next_R, stops))
    generated, closed = [], []  # a stopped row's last token is its stop token
    for r in range(R):
        row = ids_RL[r, lengths[r] : int(len_R[r])].tolist()
        stopped = bool(done_R[r])
        generated.append(row[:-1] if stopped else row)
        closed.append(stopped)
    return generated, closed, num_forwards


class KVCache:
    """The key/value state that lets ``greedy_decode``'s ``next_logits`` feed only the new tokens.

    The caller makes one per ``greedy_decode`` call and passes it to every ``next_logits`` call
    (``ZCVAE.decode(cache=...)``, the backbone's pretraining report). The first call runs the
    right-padded prompts whole and keeps the LM's caches (one per row chunk, in ``past``); each later
    call appends one column: every row's newest token at its own position, or, for a row that did not
    grow (it stopped), a masked slot. ``mask_RC`` is the attention mask over the C cached columns, pad
    holes and all, so a row attends exactly its own tokens and the logits equal a full recompute.

    A plain class, not a dataclass: the engines' wrappers (DDP, FSDP2) rebuild dataclass arguments on
    their way to the device, and the model must fill the caller's object.
    """

    def __init__(self) -> None:
        self.past: dict[int, object] = {}  # chunk start row -> that chunk's Hugging Face cache
        self.mask_RC: torch.Tensor | None = None
        self.len_R: torch.Tensor | None = None
        self.latent: torch.Tensor | None = None  # the rows' latent (indices or z) when the model conditions its norms on it

    @property
    def started(self) -> bool:
        return self.len_R is not None

    def open(self, chunk: int, cache_kwarg: str) -> dict:
        """A fresh Hugging Face cache for the rows from ``chunk`` on -> the prompt forward's cache keywords."""
        from transformers import DynamicCache

        self.past[chunk] = DynamicCache()
        return self.kwargs(chunk, cache_kwarg)

    def kwargs(self, chunk: int, cache_kwarg: str) -> dict:
        """The cache keywords of a forward on the rows from ``chunk`` on (``cache_kwarg``: hf_compat.cache_kwarg)."""
        return {cache_kwarg: self.past[chunk], "use_cache": True}

    def start(self, attention_mask_RL: torch.Tensor) -> None:
        """Record the prompts' mask after the first (whole-prompt) forward."""
        self.mask_RC = attention_mask_RL.long()
        self.len_R = attention_mask_RL.long().sum(1)

    def advance(self, input_ids_RL: torch.Tensor, attention_mask_RL: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The next forward's inputs from ``greedy_decode``'s rows -> (ids_R1, position_ids_R1, mask_RC).

        Each row has grown by one token (live) or by none (stopped) since the previous call."""
        if not self.started:
            raise ValueError("KVCache.advance before the first forward: call start() with the prompts' mask")
        len_R = attention_mask_RL.long().sum(1)
        grew_R = len_R - self.len_R
        if bool(((grew_R < 0) | (grew_R > 1)).any()):
            raise ValueError("KVCache: every row must grow by at most one token per call (a cached decode "
                             "continues the rows it started with)")
        last_R1 = (len_R - 1)[:, None]
        ids_R1 = input_ids_RL.gather(1, last_R1)  # a stopped row repeats its last token, masked below
        self.mask_RC = torch.cat([self.mask_RC, grew_R[:, None]], 1)
        self.len_R = len_R
        return ids_R1, last_R1, self.mask_RC
