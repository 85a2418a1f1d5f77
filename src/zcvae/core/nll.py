"""Per-token NLL and span alignment: the primitives every reconstruction term reads.

The mathematics, in the project's notation: docs/objective.md.

Shape legend
    B  examples in the batch
    T  sequence positions (after the causal shift: T-1 of the input length)
    V  vocabulary
    H  hidden size (the LM head's input)
    N  left-aligned supervised y-span positions (max span length in the batch, or ``n_span``)

Units: NLL in nats per token.

Pipeline (``core.losses`` continues it)
    1. ``token_nll(logits_BTV, labels_BT) -> nll_BT`` (width T-1, Hugging Face shift: position t of
       the output scores ``labels[:, t + 1]`` from ``logits[:, t]``; 0 where that label is -100).
    2. ``gather_span(nll_BT, labels_BT, n_span=N) -> (span_BN, mask_BN)`` for the z-conditioned rows
       and for the z-free reference rows. The y-span sits at different positions in the two
       templates (the z-conditioned one carries ``<z> z </z>``), so both are left-aligned to [B, N];
       pass the same ``n_span`` to force the same width.
    ``supervised_token_nll`` is steps 1 and 2 without the (B, T, V) logits, in chunks.

Precision: inputs of any float dtype are computed in float32 (float64 inputs stay float64, so
``torch.autograd.gradcheck`` works): ``compute_dtype``.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

__all__ = ["IGNORE_INDEX", "compute_dtype", "gather_span", "supervised_token_nll", "token_nll"]

IGNORE_INDEX = -100


def compute_dtype(*dtypes: torch.dtype) -> torch.dtype:
    """At least float32; float64 when any input is float64."""
    out = torch.float32
    for dtype in dtypes:
        if dtype.is_floating_point:
            out = torch.promote_types(out, dtype)
    return out


def token_nll(logits_BTV: torch.Tensor, labels_BT: torch.Tensor, *, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Per-token NLL with the Hugging Face causal shift -> nll_BT of width T-1 (nats per token).

    ``nll[:, t]`` is -log p(labels[:, t + 1] | logits[:, t]); it is exactly 0 where
    ``labels[:, t + 1] == ignore_index``. Logits are upcast to float32 (float64 stays float64), so
    bf16 logits do not lose precision in the log-sum-exp. Pair with ``gather_span`` (which applies the
    same shift to the labels).
    """
    if logits_BTV.dim() != 3:
        raise ValueError(f"logits_BTV must be [B, T, V], got shape {tuple(logits_BTV.shape)}")
    if labels_BT.dim() != 2 or labels_BT.shape != logits_BTV.shape[:2]:
        raise ValueError(
            f"labels_BT must be [B, T] matching logits_BTV {tuple(logits_BTV.shape)}, got {tuple(labels_BT.shape)}"
        )
    B, T, V = logits_BTV.shape
    dtype = compute_dtype(logits_BTV.dtype)
    if T < 2:
        return logits_BTV.new_zeros((B, max(T - 1, 0)), dtype=dtype)
    # Score all T positions against labels shifted left (last one ignored) and drop the last column:
    # a float32 input is then read through a view instead of copying logits[:, :-1].
    shifted_BT = torch.cat([labels_BT[:, 1:], labels_BT.new_full((B, 1), ignore_index)], dim=1)
    nll_flat = F.cross_entropy(
        logits_BTV.reshape(B * T, V).to(dtype),
        shifted_BT.reshape(B * T).long(),
        ignore_index=ignore_index,
        reduction="none",
    )
    return nll_flat.view(B, T)[:, :-1]  # (B, T-1)


def supervised_token_nll(
    hidden_BTH: torch.Tensor,
    labels_BT: torch.Tensor,
    head,
    *,
    n_span: Optional[int] = None,
    chunk_tokens: Optional[int] = None,
    ignore_index: int = IGNORE_INDEX,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``gather_span(token_nll(head(hidden_BTH), labels_BT), labels_BT, n_span=N)`` without the
    (B, T, V) logits -> (span_BN, mask_BN), nats per token.

    ``hidden_BTH`` are the final hidden states (the LM head's input) and ``head`` maps (n, H) to
    (n, V) logits. Only the positions that predict a supervised label are read (the left-aligned span,
    as in ``gather_span``), flattened to the n supervised tokens of the batch, and scored
    ``chunk_tokens`` at a time (all at once when None). With more than one chunk and gradients on,
    each chunk runs under non-reentrant activation checkpointing: its (chunk, V) float32 logits are
    freed after the forward and recomputed in the backward (one more head matmul per chunk), so no
    (n, V) tensor is kept between the forward and the backward, where a plain cross-entropy keeps its
    log-probabilities. Equals the full-logits path to float noise (tests/unit/model/test_chunked_nll.py).
    """
    if hidden_BTH.dim() != 3 or labels_BT.shape != hidden_BTH.shape[:2]:
        raise ValueError(f"hidden_BTH must be [B, T, H] and labels_BT [B, T], got {tuple(hidden_BTH.shape)} and {tuple(labels_BT.shape)}")
    if chunk_tokens is not None and (isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int) or chunk_tokens < 1):
        raise ValueError(f"chunk_tokens must be an int >= 1 or None, got {chunk_tokens!r}")
    B, T, _ = hidden_BTH.shape
    if T < 2:
        N = 0 if n_span is None else n_span
        return hidden_BTH.new_zeros((B, N), dtype=torch.float32), torch.zeros((B, N), dtype=torch.bool, device=hidden_BTH.device)
    # position t predicts labels[:, t + 1] (the Hugging Face shift, as in token_nll)
    h_BNH, mask_BN = gather_span(hidden_BTH[:, :-1], labels_BT, n_span=n_span, ignore_index=ignore_index)
    target_BN, _ = gather_span(labels_BT[:, 1:], labels_BT, n_span=mask_BN.shape[1], ignore_index=ignore_index)
    h_nH, target_n = h_BNH[mask_BN], target_BN[mask_BN].long()  # (n, H), (n,)
    n = target_n.shape[0]
    step = n if chunk_tokens is None else chunk_tokens
    checkpointed = torch.is_grad_enabled() and n > step

    def chunk_nll(h_cH: torch.Tensor, target_c: torch.Tensor) -> torch.Tensor:
        logits_cV = head(h_cH)
        return F.cross_entropy(logits_cV.to(compute_dtype(logits_cV.dtype)), target_c, reduction="none")  # (c,)

    parts = []
    for lo in range(0, n, max(step, 1)):
        h_cH, target_c = h_nH[lo : lo + step], target_n[lo : lo + step]
        if checkpointed:
            from torch.utils.checkpoint import checkpoint

            parts.append(checkpoint(chunk_nll, h_cH, target_c, use_reentrant=False))
        else:
            parts.append(chunk_nll(h_cH, target_c))
    nll_n = torch.cat(parts) if parts else hidden_BTH.new_zeros((0,), dtype=torch.float32)
    span_BN = nll_n.new_zeros(mask_BN.shape).masked_scatter(mask_BN, nll_n)
    return span_BN, mask_BN


def gather_span(
    values_BT: torch.Tensor,
    labels_BT: torch.Tensor,
    *,
    n_span: Optional[int] = None,
    ignore_index: int = IGNORE_INDEX,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-align the supervised positions of each row -> (span_BN, mask_BN).

    ``values_BT`` is either the output of ``token_nll`` (width T-1: the labels are shifted, position
    t selected where ``labels[:, t + 1] != ignore_index``) or already aligned with ``labels_BT``
    (width T: selected where ``labels[:, t] != ignore_index``); trailing dims of ``values_BT`` are
    carried along. The j-th supervised position of row i lands in ``span[i, j]``; slots past the
    row's span length hold 0 with ``mask`` False. Differentiable w.r.t. ``values_BT`` (a gather).

    N is ``n_span`` when given (so the z-conditioned and z-free calls agree), else the longest span
    in the batch, which costs one host synchronisation. With ``n_span`` shorter than a span, CPU
    inputs raise ValueError; on an accelerator the check is skipped (it would synchronise) and the
    tail of that span is dropped.
    """
    if values_BT.dim() < 2:
        raise ValueError(f"values_BT must be [B, T, ...], got shape {tuple(values_BT.shape)}")
    if labels_BT.dim() != 2 or labels_BT.shape[0] != values_BT.shape[0]:
        raise ValueError(f"labels_BT must be [B, T] with B={values_BT.shape[0]}, got {tuple(labels_BT.shape)}")
    if values_BT.shape[1] == labels_BT.shape[1] - 1:
        labels_BT = labels_BT[:, 1:]  # causal shift, as in token_nll
    elif values_BT.shape[1] != labels_BT.shape[1]:
        raise ValueError(
            f"values_BT width {values_BT.shape[1]} must equal labels_BT width {labels_BT.shape[1]} "
            "or be one less (the output of token_nll)"
        )
    if n_span is not None and (not isinstance(n_span, int) or isinstance(n_span, bool) or n_span < 0):
        raise ValueError(f"n_span must be a non-negative int or None, got {n_span!r}")

    B, T = labels_BT.shape
    rest = values_BT.shape[2:]
    active_BT = labels_BT != ignore_index
    cum_BT = active_BT.long().cumsum(dim=1)  # number of supervised positions up to and including t
    num_B = cum_BT[:, -1] if T > 0 else labels_BT.new_zeros(B, dtype=torch.long)
    if n_span is None:
        n_span = int(num_B.max()) if B > 0 else 0  # host sync; pass n_span to avoid it
    elif values_BT.device.type == "cpu" and B > 0 and bool((num_B > n_span).any()):
        raise ValueError(f"n_span={n_span} is shorter than the longest span {int(num_B.max())}")

    slot_BN = torch.arange(1, n_span + 1, device=labels_BT.device).expand(B, n_span).contiguous()
    mask_BN = slot_BN <= num_B[:, None]
    if T == 0 or n_span == 0:
        return values_BT.new_zeros((B, n_span, *rest)), mask_BN
    # The j-th supervised position is the first t with cum[t] == j (cum is non-decreasing).
    index_BN = torch.searchsorted(cum_BT, slot_BN).clamp_max(T - 1)
    index = index_BN.view(B, n_span, *([1] * len(rest))).expand(B, n_span, *rest)
    span = values_BT.gather(1, index)
    mask = mask_BN.view(B, n_span, *([1] * len(rest)))
    return torch.where(mask, span, torch.zeros((), dtype=span.dtype, device=span.device)), mask_BN

