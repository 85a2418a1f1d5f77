"""Sharing ``<bos> <x> {x} </x>`` between the router pass and every branch of a train forward.

Both templates start with the same P_i = len(x) + 3 tokens <bos> <x> {x} </x>, and by causality
nothing after them changes their keys and values. The prefix runs once, right-padded to P
columns; each suffix (the router's "<y> y </y> <eos>", a branch's "<z> z </z> <y> y </y> <eos>")
then runs on a cache holding the prefix keys/values of its example, with position ids P_i + j
(the positions of the full, unshared rows) and a 2-D mask covering cache + suffix.
Right padding leaves holes in the cache (columns P_i .. P-1) that the mask removes; left
padding would work too, but its pad queries would have no key to attend to (fully masked
softmax rows, NaN in some kernels), which right padding never produces. Gradients reach the
prefix through the cached tensors (the cache concatenates, it does not detach). Under
non-reentrant activation checkpointing the prefix keys/values are ordinary graph nodes made
inside a checkpointed layer: the backward replays that layer once, and the replay-safe cache
(``hf_compat.replay_safe_cache``) makes each replay return what its forward returned.

Shape legend: B examples, P prefix columns, T/S full z-free/z-conditioned length, W suffix length,
R rows (r = i*reps + k), H hidden size.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from zcvae.model import hf_compat
from zcvae.data.encoding import IGNORE_INDEX, Batch

__all__ = ["SharedPrefix", "prefix_inputs", "repeat_for_rows", "sharing_blocker", "suffix"]


@dataclass
class SharedPrefix:
    """``<bos> <x> {x} </x>`` of every example after one forward, right-padded to P columns."""

    kv: list[tuple[torch.Tensor, torch.Tensor]]  # per layer: keys, values (B, heads, P, head_dim), in the graph
    mask_BP: torch.Tensor  # (B, P) long: 1 on the P_i real prefix tokens
    length_B: torch.Tensor  # (B,) P_i = len(x) + 3
    h_prior_BH: torch.Tensor  # (B, H) final hidden state at </x>


def prefix_inputs(batch: Batch, *, pad: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The right-padded prefix rows of ``batch`` -> (ids_BP, mask_BP, position_BP, length_B)."""
    device = batch.input_ids.device
    length_B = batch.prefix_length.to(device)  # P_i: bos <x> x </x>
    P = int(length_B.max())
    cols_P = torch.arange(P, device=device)
    mask_BP = (cols_P[None] < length_B[:, None]).long()
    ids_BP = batch.input_ids[:, :P].masked_fill(mask_BP == 0, pad)
    return ids_BP, mask_BP, cols_P[None].expand(ids_BP.shape[0], P), length_B


def suffix(ids_BT, mask_BT, labels_BT, start_B, *, pad: int):
    """Columns start_i .. of each right-padded row, re-packed from column 0 and right-padded
    -> (ids_BW, mask_BW, labels_BW), W = the longest suffix."""
    start_B = start_B.to(ids_BT.device)
    length_B = mask_BT.sum(1) - start_B
    W = int(length_B.max())
    cols_W = torch.arange(W, device=ids_BT.device)
    valid_BW = cols_W[None] < length_B[:, None]
    index_BW = (start_B[:, None] + cols_W).clamp(max=ids_BT.shape[1] - 1)
    ids = ids_BT.gather(1, index_BW).masked_fill(~valid_BW, pad)
    labels = labels_BT.gather(1, index_BW).masked_fill(~valid_BW, IGNORE_INDEX)
    return ids, valid_BW.to(mask_BT.dtype), labels


def repeat_for_rows(prefix: SharedPrefix, *, rows: slice | None, reps: int):
    """The prefix of rows ``rows`` of the layout r = i*reps + k (all B*reps when None)
    -> (kv per layer with R rows, mask_RP, start_R)."""
    B = prefix.mask_BP.shape[0]
    lo, hi = (0, B * reps) if rows is None else (rows.start, rows.stop)
    e0, e1 = lo // reps, (hi - 1) // reps + 1  # the examples these rows belong to

    def repeat(t: torch.Tensor) -> torch.Tensor:
        # expand + reshape rather than index_select: its backward is a sum over the copies, where
        # index_select's is a scatter-add
        if reps == 1 and (e0, e1) == (0, B):
            return t
        t = t[e0:e1]
        t = t.unsqueeze(1).expand(t.shape[0], reps, *t.shape[1:]).reshape(-1, *t.shape[1:])
        return t[lo - e0 * reps : hi - e0 * reps]

    kv = [(repeat(k), repeat(v)) for k, v in prefix.kv]
    return kv, repeat(prefix.mask_BP), repeat(prefix.length_B)


def sharing_blocker(hf: nn.Module, *, forward_params: frozenset[str], batch: Batch | None) -> str | None:
    """Why a train forward of ``hf`` (on ``batch``) could *not* share the x prefix, or None."""
    params = forward_params
    if "position_ids" not in params or not ({"cache", "past_key_values"} & params):
        return f"{type(hf).__name__}.forward takes no position_ids or no cache"
    if torch.is_grad_enabled() and hf_compat.layer_checkpointing_active(hf) and not hf_compat.checkpointing_layers(hf):
        # the replay-safe cache reaches checkpointed layers through GradientCheckpointingLayer only
        return "gradient checkpointing outside transformers' GradientCheckpointingLayer (the KV cache would be dropped)"
    cfg = hf.config
    layer_types = getattr(cfg, "layer_types", None) or ()
    window = getattr(cfg, "sliding_window", None)
    if any(t != "full_attention" for t in layer_types) or (
        window is not None and getattr(cfg, "use_sliding_window", True) and (batch is None or batch.z_input_ids.shape[1] > window)
    ):
        # a sliding window counts cache columns, and the cache of a shared prefix has holes
        return "sliding-window attention (windows would count the padding holes of the shared cache)"
    return None
