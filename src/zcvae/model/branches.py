"""The z-conditioned branch rows of a train forward: which rows, which latent in their slots, and
running them in chunks whose memory does not grow with K.

Row layout: r = i*reps + k, example i with branch k (a discrete latent value, or a Gaussian sample).
Shape legend: B examples, R rows (B*reps, or the rows of a decode call), S z-conditioned length,
K latent values, M z slots, N supervised span.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from zcvae.model import hf_compat
from zcvae.model.prefix import SharedPrefix, suffix
from zcvae.data.encoding import Batch

__all__ = ["branch_rows", "chunks", "run_branch_chunks", "write_latent"]


def chunks(num_rows: int, chunk: int | None) -> list[slice]:
    """Consecutive slices of at most ``chunk`` rows covering ``num_rows`` (one slice when None)."""
    step = num_rows if not chunk else chunk
    return [slice(i, min(i + step, num_rows)) for i in range(0, num_rows, max(step, 1))]


def branch_rows(batch: Batch, *, reps: int, prefix: SharedPrefix | None, pad: int):
    """The z-conditioned rows r = i*reps + k, full or (with ``prefix``) their suffixes after </x>
    -> ids_RS, mask_RS, labels_RS, slot_start_R (column of the first slot)."""
    if prefix is None:
        ids, mask, labels, slot = batch.z_input_ids, batch.z_attention_mask, batch.z_labels, batch.z_slot_start
    else:
        ids, mask, labels = suffix(batch.z_input_ids, batch.z_attention_mask, batch.z_labels, prefix.length_B, pad=pad)
        slot = batch.z_slot_start.to(prefix.length_B.device) - prefix.length_B  # = 1, after <z>
    example_R = torch.arange(ids.shape[0], device=ids.device).repeat_interleave(reps)
    return ids[example_R], mask[example_R], labels[example_R], slot.to(ids.device)[example_R]


def write_latent(ids_RS: torch.Tensor, slot_start_R: torch.Tensor, latent_index_R: torch.Tensor, *, latent_slots) -> torch.Tensor:
    """A copy of ``ids_RS`` with latent value latent_index_R[r]'s M tokens (``latent_slots``, K x M
    token ids) in row r's slots slot_start_R[r] .. + M - 1."""
    device = ids_RS.device
    slots_KM = torch.tensor(latent_slots, device=device)  # (K, M)
    M = slots_KM.shape[1]
    pos_RM = slot_start_R.to(device)[:, None] + torch.arange(M, device=device)
    return ids_RS.scatter(1, pos_RM, slots_KM[latent_index_R.to(device)])


def run_branch_chunks(chunk_nll: Callable[[slice], torch.Tensor], *, num_rows: int, chunk_rows: int | None, hf: nn.Module) -> torch.Tensor:
    """``cat([chunk_nll(c) for c in chunks])`` -> (R, N), with bounded activation memory.

    With gradients on and more than one chunk, each chunk runs under non-reentrant activation
    checkpointing as a whole: its forward keeps nothing but its inputs and its (r, N) NLL, and the
    backward re-runs it and back-propagates through it one chunk at a time, so peak branch memory
    grows with the chunk size, not with K. Exact (a deterministic recompute; dropout RNG states
    are replayed): every gradient, through q, the KL and the inter-latent divergence too, equals
    the unchunked path (tests/unit/model/test_branch_chunks.py). Cost: one more forward of the branch
    rows, except under layer checkpointing of ``hf``, which is switched off inside a chunk (the chunk
    is the checkpoint) so the total stays one forward + one recompute + one backward.
    """
    slices = chunks(num_rows, chunk_rows)
    if not (torch.is_grad_enabled() and len(slices) > 1):
        return torch.cat([chunk_nll(c) for c in slices], 0)
    from torch.utils.checkpoint import checkpoint

    def isolated(c: slice) -> torch.Tensor:
        with hf_compat.layer_checkpointing_off(hf):
            return chunk_nll(c)

    # No metadata check of the recomputed saved tensors: under ZeRO-3 a saved parameter reads as its
    # empty partition between its module's forward and backward hooks (its value is gathered
    # again before use, as in any ZeRO-3 backward); equality is what the tests check.
    return torch.cat([checkpoint(isolated, c, use_reentrant=False, determinism_check="none") for c in slices], 0)
