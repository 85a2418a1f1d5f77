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
    choose_next: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> tuple[list[list[int]], list[bool], int]:
    """Greedy continuation of right-padded prompts for at most ``num_steps`` forwards.

    ``next_logits(input_ids_RL, attention_mask_RL) -> logits_RV`` scores the next token after each
    row's last attended position. A row stops growing after a stop token (``stop_id``: one id or a
    collection). ``lock_step=True``: the forwards go on for all ``num_steps`` (so every rank calls the
    model as often, whatever its rows do: evaluation); ``lock_step=False``: stop as soon as every row
    has stopped (one process: export's generate). ``choose_next(logits_RV) -> ids_R`` picks every
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
