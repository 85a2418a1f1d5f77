"""Tests for zcvae.core.losses against a per-example Python-loop reference and the seed identities.

Shape legend: B examples, K latent branches, N span slots, T positions, V vocabulary.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from zcvae.core.aggregation import NEARLY_DEGENERATE_MAX_SURPRISAL, reference_degeneracy
from zcvae.core.terms import RECONSTRUCTION_TERM_REGISTRY
from zcvae.core.losses import (
    DIAGNOSTIC_REDUCTIONS,
    RECONSTRUCTION_TERMS,
    ReconstructionLossConfig,
    aggregate,
    base_loss,
    gather_span,
    inverse_surprisal_weights,
    reconstruction_terms,
    reconstruction_weights,
    surprisal_share_weights,
    token_nll,
    weighted_aggregate,
    weighted_reconstruction,
)

MODES = ("mean", "sum")
ALPHAS = (0.0, 0.5, 1.0, 2.0)


# ----------------------------------------------------------------------------------------------
# Inputs and the loop reference
# ----------------------------------------------------------------------------------------------


def make_batch(*, K: int, seed: int, B: int = 7, N: int = 9, garbage: bool = True):
    """Ragged masks, exact-zero and slightly negative surprisal, one degenerate and one empty row."""
    g = torch.Generator().manual_seed(seed)
    l_BKN = torch.rand(B, K, N, generator=g) * 3.0
    q_BK = torch.softmax(torch.randn(B, K, generator=g) * 2.0, dim=-1)
    b_BN = torch.rand(B, N, generator=g) * 2.5
    b_BN[torch.rand(B, N, generator=g) < 0.3] = 0.0  # deterministic tokens
    b_BN[0, 1] = -1e-7  # rounding below zero: clamped to 0
    lengths = torch.randint(1, N + 1, (B,), generator=g)
    lengths[1] = N
    mask_BN = torch.arange(N)[None, :] < lengths[:, None]
    mask_BN[3, 0] = False  # a hole inside a span: masks need not be prefixes
    mask_BN[3, -1] = True
    b_BN[4] = 0.0  # degenerate: zero surprisal on every active token
    mask_BN[4, :3] = True
    mask_BN[5] = False  # empty example
    if garbage:  # padded slots may hold anything; they must not leak
        l_BKN = torch.where(mask_BN[:, None, :], l_BKN, torch.full_like(l_BKN, float("inf")))
        b_BN = torch.where(mask_BN, b_BN, torch.full_like(b_BN, float("nan")))
    return l_BKN, q_BK, b_BN, mask_BN


def loop_reference(l_BKN, q_BK, b_BN, mask_BN, *, c_base, cfg, mean_num_tokens=None):
    """Plain per-example loops in Python floats, written from seeds 001/003/004 (and issue 21: ``token``
    divides the token sum by the global batch's n_bar, a scaled ``sum`` by C, its c_base given per sequence)."""
    mode, alpha = cfg.token_aggregation_mode, cfg.token_weight_alpha
    divisor = mean_num_tokens if mode == "token" else (cfg.sum_scale or 1.0)
    if mode == "sum" and cfg.sum_scale is not None:
        c_base = c_base / cfg.sum_scale
    B, K, N = l_BKN.shape
    out = {name: [] for name in (*RECONSTRUCTION_TERMS, *DIAGNOSTIC_REDUCTIONS)}
    for i in range(B):
        S = [t for t in range(N) if bool(mask_BN[i, t])]
        n = len(S)
        if n == 0:
            for name in out:
                out[name].append(0.0)
            continue
        b = [max(float(b_BN[i, t]), 0.0) for t in S]

        def A(v):
            return sum(v) / n if mode == "mean" else sum(v) / divisor

        def W(v, w):
            s = sum(wt * vt for wt, vt in zip(w, v))
            return s if mode == "mean" else n * s / divisor

        degenerate = all(bt == 0.0 for bt in b)
        if degenerate:
            pi = [1.0 / n] * n
        else:
            raw = [bt**alpha for bt in b]  # python: 0.0 ** 0 == 1.0
            pi = [r / sum(raw) for r in raw]
        raw = [(bt + cfg.inverse_surprisal_token_weight_epsilon) ** (-alpha) for bt in b]
        rho = [r / sum(raw) for r in raw]
        Ab = A(b)
        kappa = W(b, pi) / Ab if Ab > 0 else 1.0
        eta = W(b, rho) / Ab if Ab > 0 else 1.0

        raw_loss = tok = inv = 0.0
        for k in range(K):
            l = [float(l_BKN[i, k, t]) for t in S]
            q = float(q_BK[i, k])
            raw_loss += q * A(l)
            tok += q * W(l, pi)
            inv += q * W(l, rho)
        values = {
            "reconstruction_loss": raw_loss,
            "distribution_normalized_reconstruction_loss": raw_loss / c_base,
            "example_inverse_surprisal_weighted_reconstruction_loss": raw_loss
            / (Ab + cfg.example_inverse_surprisal_epsilon),
            "token_weighted_reconstruction_loss": tok,
            "normalized_concentration_corrected_token_weighted_reconstruction_loss": tok / kappa / c_base,
            "normalized_inverse_surprisal_token_weighted_reconstruction_loss": inv / eta / c_base,
            "token_weighted_base_loss": W(b, pi),
            "token_concentration_factor": kappa,
            "inverse_token_weighted_base_loss": W(b, rho),
            "inverse_token_base_scale_factor": eta,
            "token_weighting/weight_max": max(pi),
            "token_weighting/weight_ratio_max_min": max(pi) / max(min(pi), 1e-12),
            "token_weighting/effective_token_count_mean": 1.0 / sum(p * p for p in pi),
            "inverse_token_weighting/weight_max": max(rho),
            "inverse_token_weighting/weight_ratio_max_min": max(rho) / max(min(rho), 1e-12),
            "inverse_token_weighting/effective_token_count_mean": 1.0 / sum(p * p for p in rho),
            "base_loss": Ab,
            "num_tokens": float(n),
            "num_tokens_min": float(n),
            "num_tokens_max": float(n),
            "degenerate": float(degenerate),
            "valid": 1.0,
        }
        for name in out:
            out[name].append(values[name])
    return {name: torch.tensor(v, dtype=torch.float64) for name, v in out.items()}


def terms_for(l_BKN, q_BK, b_BN, mask_BN, *, c_base=0.7, mean_num_tokens=None, **cfg_kwargs):
    cfg = ReconstructionLossConfig(**cfg_kwargs)
    return reconstruction_terms(token_nll=l_BKN, posterior=q_BK, ref_nll=b_BN, mask=mask_BN, c_base=c_base, config=cfg,
                                mean_num_tokens=mean_num_tokens)


# ----------------------------------------------------------------------------------------------
# Against the loop reference
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("alpha", ALPHAS)
@pytest.mark.parametrize("K", (1, 4))
def test_matches_loop_reference(mode, alpha, K):
    l_BKN, q_BK, b_BN, mask_BN = make_batch(K=K, seed=int(alpha * 10) + 100 * K + (mode == "sum"))
    cfg = ReconstructionLossConfig(token_aggregation_mode=mode, token_weight_alpha=alpha)
    got = reconstruction_terms(token_nll=l_BKN, posterior=q_BK, ref_nll=b_BN, mask=mask_BN, c_base=0.37, config=cfg)
    want = loop_reference(l_BKN, q_BK, b_BN, mask_BN, c_base=0.37, cfg=cfg)
    assert set(got) == set(RECONSTRUCTION_TERMS) | set(DIAGNOSTIC_REDUCTIONS)
    for name, value in got.items():
        assert value.shape == (l_BKN.shape[0],), name
        assert value.dtype == torch.float32, name
        assert torch.isfinite(value).all(), name
        torch.testing.assert_close(value.double(), want[name], rtol=2e-5, atol=1e-6, msg=name)
    # The batch has a degenerate row (4) and an empty row (5).
    assert got["degenerate"][4] == 1 and got["valid"][5] == 0


def test_degenerate_row_uses_uniform_weights():
    b_BN = torch.tensor([[0.0, 0.0, 0.0, 5.0], [0.0, 1.0, 0.0, 0.0]])
    mask_BN = torch.tensor([[True, True, True, False], [True, True, False, False]])
    pi_BN, degenerate_B = surprisal_share_weights(b_BN, mask_BN, 2.0)
    torch.testing.assert_close(pi_BN, torch.tensor([[1 / 3, 1 / 3, 1 / 3, 0.0], [0.0, 1.0, 0.0, 0.0]]))
    assert degenerate_B.tolist() == [True, False]


def test_degenerate_and_nearly_degenerate_rows_are_told_apart_from_a_normal_one():
    eps = NEARLY_DEGENERATE_MAX_SURPRISAL
    b_BN = torch.tensor([
        [0.0, -1e-7, 0.0, 9.0],          # degenerate: 0 on every active token (a rounding negative clamps to 0)
        [0.5 * eps, 0.0, 0.9 * eps, 9.0],  # nearly degenerate: every active b below the threshold, not all 0
        [1e-4, 0.7, 1e-4, 0.0],          # normal: one token carries a decision (~ log 2 nats)
        [eps, 0.0, 0.0, 0.0],            # at the threshold: not nearly degenerate (strictly below only)
        [0.0, 0.0, 0.0, 0.0],            # no active token: neither
    ])
    mask_BN = torch.tensor([[True, True, True, False]] * 4 + [[False] * 4])
    degenerate_B, nearly_B = reference_degeneracy(b_BN, mask_BN)
    assert degenerate_B.tolist() == [True, False, False, False, False]
    assert nearly_B.tolist() == [False, True, False, False, False]
    # one definition of "degenerate": the rows that surprisal_share_weights makes uniform
    assert torch.equal(surprisal_share_weights(b_BN, mask_BN, 1.0)[1], degenerate_B)


def test_empty_rows_are_zero_everywhere():
    l_BKN, q_BK, b_BN, mask_BN = make_batch(K=3, seed=5)
    mask_BN[:] = False
    for mode in MODES:
        got = terms_for(l_BKN, q_BK, b_BN, mask_BN, token_aggregation_mode=mode)
        for name, value in got.items():
            assert torch.equal(value, torch.zeros_like(value)), name


def test_large_alpha_does_not_overflow():
    b_BN = torch.tensor([[30.0, 20.0, 1e-3, 0.0]])
    mask_BN = torch.ones(1, 4, dtype=torch.bool)
    pi_BN, _ = surprisal_share_weights(b_BN, mask_BN, 60.0)  # 30^60 overflows float32
    rho_BN = inverse_surprisal_weights(b_BN, mask_BN, 60.0, 1e-2)
    for w in (pi_BN, rho_BN):
        assert torch.isfinite(w).all()
        torch.testing.assert_close(w.sum(), torch.tensor(1.0))
    assert pi_BN[0, 0] > 0.99 and rho_BN[0, 3] > 0.99


# ----------------------------------------------------------------------------------------------
# Seed identities
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_alpha_zero_recovers_uniform_terms(mode):
    l_BKN, q_BK, b_BN, mask_BN = make_batch(K=4, seed=11)
    got = terms_for(l_BKN, q_BK, b_BN, mask_BN, token_aggregation_mode=mode, token_weight_alpha=0.0)
    torch.testing.assert_close(got["token_weighted_reconstruction_loss"], got["reconstruction_loss"])
    dist = got["distribution_normalized_reconstruction_loss"]
    torch.testing.assert_close(got["normalized_concentration_corrected_token_weighted_reconstruction_loss"], dist)
    torch.testing.assert_close(got["normalized_inverse_surprisal_token_weighted_reconstruction_loss"], dist)


@pytest.mark.parametrize("alpha", ALPHAS + (5.0,))
def test_kappa_at_least_one_and_mode_free(alpha):
    l_BKN, q_BK, b_BN, mask_BN = make_batch(K=2, seed=21)
    by_mode = {m: terms_for(l_BKN, q_BK, b_BN, mask_BN, token_aggregation_mode=m, token_weight_alpha=alpha) for m in MODES}
    valid_B = by_mode["mean"]["valid"].bool()
    kappa_B = by_mode["mean"]["token_concentration_factor"]
    assert (kappa_B[valid_B] >= 1 - 1e-6).all()
    for key in ("token_concentration_factor", "inverse_token_base_scale_factor"):
        torch.testing.assert_close(by_mode["sum"][key], by_mode["mean"][key])
    # kappa_alpha = m_{alpha+1} / (m_alpha m_1) from the raw moments of b (seed 004), where b > 0 somewhere.
    b = b_BN.nan_to_num(0.0).clamp_min(0.0).double()
    maskd = mask_BN.double()
    n = maskd.sum(-1).clamp_min(1)
    m1 = (b * maskd).sum(-1) / n
    ma = (torch.where(mask_BN, b.pow(alpha), torch.zeros_like(b))).sum(-1) / n
    ma1 = (b.pow(alpha + 1) * maskd).sum(-1) / n
    ok = valid_B & (m1 > 0)
    torch.testing.assert_close(kappa_B[ok].double(), (ma1 / (ma * m1))[ok], rtol=1e-5, atol=1e-6)


def test_kappa_alpha_one_is_one_plus_cv_squared():
    g = torch.Generator().manual_seed(3)
    b_BN = torch.rand(5, 8, generator=g) * 2
    b_BN[:, ::3] = 0.0
    mask_BN = torch.rand(5, 8, generator=g) < 0.8
    mask_BN[:, 1] = True
    got = terms_for(torch.rand(5, 1, 8), torch.ones(5, 1), b_BN, mask_BN, token_weight_alpha=1.0)
    for i in range(5):
        active = b_BN[i][mask_BN[i]].double()
        cv2 = active.var(unbiased=False) / active.mean() ** 2  # population variance
        torch.testing.assert_close(got["token_concentration_factor"][i].double(), 1 + cv2, rtol=1e-5, atol=1e-6)


def test_sum_mode_scales_by_token_count():
    l_BKN, q_BK, b_BN, mask_BN = make_batch(K=3, seed=31)
    n_B = mask_BN.sum(-1).float()
    mean = terms_for(l_BKN, q_BK, b_BN, mask_BN, token_aggregation_mode="mean")
    summ = terms_for(l_BKN, q_BK, b_BN, mask_BN, token_aggregation_mode="sum")
    for name in ("reconstruction_loss", "token_weighted_reconstruction_loss", "base_loss", "token_weighted_base_loss"):
        torch.testing.assert_close(summ[name], n_B * mean[name], msg=name)
    values_BN = torch.randn(4, 6)
    mask2_BN = torch.rand(4, 6) < 0.7
    pi_BN, _ = surprisal_share_weights(torch.rand(4, 6), mask2_BN, 1.5)
    torch.testing.assert_close(
        weighted_aggregate(values_BN, pi_BN, mask2_BN, "sum"),
        mask2_BN.sum(-1) * weighted_aggregate(values_BN, pi_BN, mask2_BN, "mean"),
    )
    torch.testing.assert_close(aggregate(values_BN, mask2_BN, "sum"), mask2_BN.sum(-1) * aggregate(values_BN, mask2_BN, "mean"))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("alpha", (0.5, 1.0, 2.0))
def test_concentration_corrected_at_baseline(mode, alpha):
    _, _, b_BN, mask_BN = make_batch(K=1, seed=41, garbage=False)
    K = 3
    l_BKN = b_BN.clamp_min(0)[:, None, :].expand(-1, K, -1)  # every branch at the z-free baseline
    q_BK = torch.softmax(torch.randn(b_BN.shape[0], K), -1)
    base_B = base_loss(b_BN, mask_BN, mode)
    valid_B = mask_BN.any(-1)
    c_base = float(base_B[valid_B].mean())
    got = terms_for(l_BKN, q_BK, b_BN, mask_BN, c_base=c_base, token_aggregation_mode=mode, token_weight_alpha=alpha)
    tokcc_B = got["normalized_concentration_corrected_token_weighted_reconstruction_loss"]
    torch.testing.assert_close(tokcc_B * c_base, base_B, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(tokcc_B[valid_B].mean(), torch.tensor(1.0), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got["base_loss"], base_B)


# ----------------------------------------------------------------------------------------------
# Gradients, dtypes, host synchronisation
# ----------------------------------------------------------------------------------------------


def test_no_gradient_reaches_ref_nll():
    l_BKN, q_BK, b_BN, mask_BN = make_batch(K=2, seed=51, garbage=False)
    l_BKN.requires_grad_(True)
    q_BK.requires_grad_(True)
    b_BN.requires_grad_(True)
    got = terms_for(l_BKN, q_BK, b_BN, mask_BN, **{f: 1.0 for f in _weight_fields()})
    total = sum(v.sum() for v in got.values())
    total.backward()
    assert b_BN.grad is None or torch.count_nonzero(b_BN.grad) == 0
    assert l_BKN.grad is not None and q_BK.grad is not None
    assert torch.count_nonzero(l_BKN.grad[~mask_BN[:, None, :].expand_as(l_BKN)]) == 0  # padding gets none


@pytest.mark.parametrize("mode", MODES)
def test_gradcheck_token_nll_and_posterior(mode):
    l_BKN, q_BK, b_BN, mask_BN = make_batch(K=2, seed=61, B=7, N=5, garbage=False)
    l_BKN = l_BKN.double().requires_grad_(True)
    q_BK = q_BK.double().requires_grad_(True)
    cfg = ReconstructionLossConfig(token_aggregation_mode=mode, token_weight_alpha=1.5)

    def fn(l, q):
        out = reconstruction_terms(token_nll=l, posterior=q, ref_nll=b_BN.double(), mask=mask_BN, c_base=0.6, config=cfg)
        return tuple(out[name] for name in RECONSTRUCTION_TERMS)

    assert fn(l_BKN, q_BK)[0].dtype == torch.float64
    assert torch.autograd.gradcheck(fn, (l_BKN, q_BK))


def test_low_precision_inputs_are_computed_in_fp32():
    l_BKN, q_BK, b_BN, mask_BN = make_batch(K=2, seed=71, garbage=False)
    want = terms_for(l_BKN.bfloat16().float(), q_BK.bfloat16().float(), b_BN.bfloat16().float(), mask_BN)
    got = terms_for(l_BKN.bfloat16(), q_BK.bfloat16(), b_BN.bfloat16(), mask_BN)
    for name in want:
        assert got[name].dtype == torch.float32
        torch.testing.assert_close(got[name], want[name], msg=name)


def test_hot_path_never_reads_tensor_values():
    """Meta tensors hold no data, so any .item()/bool()/nonzero on the hot path would raise."""
    l_BKN, q_BK, b_BN, mask_BN = (t.to("meta") for t in make_batch(K=2, seed=81))
    got = terms_for(l_BKN, q_BK, b_BN, mask_BN, c_base=torch.tensor(0.5, device="meta"))
    assert all(v.shape == (7,) for v in got.values())
    span_BN, m_BN = gather_span(torch.randn(2, 6, device="meta"), torch.zeros(2, 7, dtype=torch.long, device="meta"), n_span=4)
    assert span_BN.shape == (2, 4) and m_BN.shape == (2, 4)


# ----------------------------------------------------------------------------------------------
# token_nll and gather_span
# ----------------------------------------------------------------------------------------------


def test_token_nll_matches_cross_entropy():
    g = torch.Generator().manual_seed(0)
    B, T, V = 3, 10, 17
    logits_BTV = torch.randn(B, T, V, generator=g) * 3
    labels_BT = torch.randint(0, V, (B, T), generator=g)
    labels_BT[torch.rand(B, T, generator=g) < 0.4] = -100
    want = F.cross_entropy(
        logits_BTV[:, :-1].reshape(-1, V), labels_BT[:, 1:].reshape(-1), ignore_index=-100, reduction="none"
    ).view(B, T - 1)
    got = token_nll(logits_BTV, labels_BT)
    assert got.shape == (B, T - 1) and got.dtype == torch.float32
    torch.testing.assert_close(got, want)
    assert torch.equal(got[labels_BT[:, 1:] == -100], torch.zeros_like(got[labels_BT[:, 1:] == -100]))
    # bf16 logits are upcast before the log-sum-exp.
    bf16 = token_nll(logits_BTV.bfloat16(), labels_BT)
    assert bf16.dtype == torch.float32
    want_bf16 = F.cross_entropy(
        logits_BTV.bfloat16().float()[:, :-1].reshape(-1, V), labels_BT[:, 1:].reshape(-1), ignore_index=-100, reduction="none"
    ).view(B, T - 1)
    torch.testing.assert_close(bf16, want_bf16)
    # Gradients reach the logits.
    logits = logits_BTV.clone().requires_grad_(True)
    token_nll(logits, labels_BT).sum().backward()
    assert logits.grad[:, -1].abs().sum() == 0 and logits.grad.abs().sum() > 0


def _layout(x, y, *, with_z: bool, T: int):
    """Token ids of one example in the z-free or z-conditioned template, right-padded to T."""
    BOS, XO, XC, ZO, Z, ZC, YO, YC, EOS, PAD = 1, 2, 3, 4, 5, 6, 7, 8, 9, 0
    prefix = [BOS, XO, *x, XC] + ([ZO, Z, ZC] if with_z else []) + [YO]
    ids = prefix + list(y) + [YC, EOS]
    labels = [-100] * len(prefix) + list(y) + [YC, -100]  # y and </y> are supervised
    pad = T - len(ids)
    return ids + [PAD] * pad, labels + [-100] * pad


def test_gather_span_aligns_zfree_and_zconditioned_layouts():
    g = torch.Generator().manual_seed(1)
    V, T = 40, 24
    xs = [[11, 12, 13], [14, 15], [16, 17, 18, 19]]
    ys = [[20, 21, 22, 23, 24], [25, 26], [27, 28, 29]]
    span_nll = {}
    outs = {}
    for with_z in (False, True):
        ids_labels = [_layout(x, y, with_z=with_z, T=T) for x, y in zip(xs, ys)]
        labels_BT = torch.tensor([lab for _, lab in ids_labels])
        logits_BTV = torch.randn(len(xs), T, V, generator=g)  # differs between layouts...
        for i, (x, y) in enumerate(zip(xs, ys)):
            start = labels_BT[i].ne(-100).nonzero()[0, 0].item()  # first supervised label
            for j in range(len(y) + 1):  # ...except where a supervised token is predicted
                key = (i, j)
                if key not in span_nll:
                    span_nll[key] = torch.randn(V, generator=g)
                logits_BTV[i, start - 1 + j] = span_nll[key]
        nll_BT = token_nll(logits_BTV, labels_BT)
        outs[with_z] = (gather_span(nll_BT, labels_BT, n_span=8), gather_span(nll_BT, labels_BT), labels_BT)
    (zf_fixed, zf_auto, zf_labels), (zc_fixed, zc_auto, _) = outs[False], outs[True]
    for a, b in ((zf_fixed, zc_fixed), (zf_auto, zc_auto)):
        torch.testing.assert_close(a[0], b[0], rtol=0, atol=0)
        assert torch.equal(a[1], b[1])
    assert zf_fixed[0].shape == (3, 8) and zf_auto[0].shape == (3, 6)  # N = max(|y| + 1)
    assert zf_auto[1].sum(-1).tolist() == [6, 3, 4]
    # Values are the NLL of the supervised tokens, in order, and 0 past each span.
    for i, y in enumerate(ys):
        targets = torch.tensor(list(y) + [8])
        want = F.cross_entropy(torch.stack([span_nll[(i, j)] for j in range(len(y) + 1)]), targets, reduction="none")
        torch.testing.assert_close(zf_fixed[0][i, : len(y) + 1], want)
        assert torch.equal(zf_fixed[0][i, len(y) + 1 :], torch.zeros(8 - len(y) - 1))


def test_gather_span_unshifted_trailing_dims_and_gradient():
    labels_BT = torch.tensor([[-100, 5, -100, 6, 7], [-100, -100, -100, -100, -100], [1, -100, -100, -100, 2]])
    values_BTK = torch.arange(30, dtype=torch.float64).view(3, 5, 2).requires_grad_(True)
    span_BNK, mask_BN = gather_span(values_BTK, labels_BT)  # same width: labels already aligned
    assert mask_BN.tolist() == [[True, True, True], [False, False, False], [True, True, False]]
    want = torch.tensor([[[2, 3], [6, 7], [8, 9]], [[0, 0]] * 3, [[20, 21], [28, 29], [0, 0]]], dtype=torch.float64)
    assert torch.equal(span_BNK.detach(), want)
    span_BNK.sum().backward()
    grad_mask = torch.zeros(3, 5, 2)
    grad_mask[0, [1, 3, 4]] = 1
    grad_mask[2, [0, 4]] = 1
    assert torch.equal(values_BTK.grad, grad_mask.double())
    wide_BN, wide_mask_BN = gather_span(values_BTK[..., 0].detach(), labels_BT, n_span=6)
    assert wide_BN.shape == (3, 6) and wide_mask_BN.sum().item() == 5 and wide_BN[:, 3:].abs().sum() == 0


# ----------------------------------------------------------------------------------------------
# Config, weights, validation
# ----------------------------------------------------------------------------------------------


def _weight_fields():
    return tuple(term.weight_field for term in RECONSTRUCTION_TERM_REGISTRY)


def test_weighted_reconstruction_is_the_lambda_sum():
    l_BKN, q_BK, b_BN, mask_BN = make_batch(K=2, seed=91)
    lambdas = dict(zip(_weight_fields(), (1.0, 0.5, 0.25, 2.0, 3.0, 0.125)))
    cfg = ReconstructionLossConfig(**lambdas)
    weights = reconstruction_weights(cfg)
    assert tuple(weights) == RECONSTRUCTION_TERMS
    assert list(weights.values()) == list(lambdas.values())
    got = reconstruction_terms(token_nll=l_BKN, posterior=q_BK, ref_nll=b_BN, mask=mask_BN, c_base=0.5, config=cfg)
    want = sum(lam * got[name] for name, lam in zip(RECONSTRUCTION_TERMS, lambdas.values()))
    torch.testing.assert_close(weighted_reconstruction(got, cfg), want)
    assert ReconstructionLossConfig().reconstruction_weight == 1.0 and reconstruction_weights(ReconstructionLossConfig())[
        "token_weighted_reconstruction_loss"
    ] == 0.0


def test_config_from_dict_and_defaults():
    cfg = ReconstructionLossConfig.from_dict({"token_aggregation_mode": "sum", "token_weight_alpha": 2.0})
    assert cfg.token_aggregation_mode == "sum" and cfg.token_weight_alpha == 2.0
    assert ReconstructionLossConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ValueError, match="token_weigth_alpha"):
        ReconstructionLossConfig.from_dict({"token_weigth_alpha": 1.0})


@pytest.mark.parametrize(
    "field, value",
    [
        ("token_aggregation_mode", "median"),
        ("token_weight_alpha", -0.1),
        ("token_weight_alpha", float("nan")),
        ("token_weight_alpha", float("inf")),
        ("example_inverse_surprisal_epsilon", 0.0),
        ("example_inverse_surprisal_epsilon", -1e-3),
        ("inverse_surprisal_token_weight_epsilon", 0.0),
        ("inverse_surprisal_token_weight_epsilon", float("nan")),
        ("zfree_reference_scale", 0.0),
        ("zfree_reference_scale", float("inf")),
        *[(f, -1.0) for f in _weight_fields()],
        *[(f, float("nan")) for f in _weight_fields()],
        ("reconstruction_weight", "1.0"),
    ],
)
def test_config_validation_names_field(field, value):
    with pytest.raises(ValueError, match=field):
        ReconstructionLossConfig(**{field: value})


def test_reconstruction_terms_validation_names_argument():
    l_BKN, q_BK, b_BN, mask_BN = make_batch(K=2, seed=7)
    cfg = ReconstructionLossConfig()
    good = dict(token_nll=l_BKN, posterior=q_BK, ref_nll=b_BN, mask=mask_BN, c_base=0.5, config=cfg)
    bad_cases = [
        ("token_nll", l_BKN[:, 0]),
        ("posterior", q_BK[:, :1]),
        ("ref_nll", b_BN[:, :-1]),
        ("mask", mask_BN[:-1]),
        ("mask", mask_BN.float()),
        ("c_base", 0.0),
        ("c_base", -1.0),
        ("c_base", float("nan")),
        ("c_base", float("inf")),
        ("c_base", torch.tensor(0.0)),
        ("c_base", torch.tensor([0.5])),
        ("c_base", None),
    ]
    for name, value in bad_cases:
        with pytest.raises(ValueError, match=name):
            reconstruction_terms(**{**good, name: value})
    # With no explicit c_base, the configured fixed scale is used.
    fixed_cfg = ReconstructionLossConfig(zfree_reference_scale=0.5)
    fixed = reconstruction_terms(**{**good, "c_base": None, "config": fixed_cfg})
    key = "distribution_normalized_reconstruction_loss"
    torch.testing.assert_close(fixed[key], reconstruction_terms(**good)[key])
    with pytest.raises(ValueError, match="mode"):
        aggregate(b_BN, mask_BN, "median")
    with pytest.raises(ValueError, match="alpha"):
        surprisal_share_weights(b_BN, mask_BN, -1.0)
    with pytest.raises(ValueError, match="epsilon"):
        inverse_surprisal_weights(b_BN, mask_BN, 1.0, 0.0)
    with pytest.raises(ValueError, match="n_span"):
        gather_span(torch.zeros(1, 4), torch.tensor([[0, 1, 2, 3, 4]]), n_span=2)
    with pytest.raises(ValueError, match="values_BT"):
        gather_span(torch.zeros(1, 3), torch.tensor([[0, 1, 2, 3, 4]]))
    with pytest.raises(ValueError, match="labels_BT"):
        token_nll(torch.zeros(1, 5, 3), torch.zeros(1, 4, dtype=torch.long))


def test_reductions_table_is_complete():
    assert set(DIAGNOSTIC_REDUCTIONS.values()) <= {"mean", "min", "max", "sum"}
    assert DIAGNOSTIC_REDUCTIONS["base_loss"] == "min"
    assert not set(DIAGNOSTIC_REDUCTIONS) & set(RECONSTRUCTION_TERMS)
    assert math.isclose(len(RECONSTRUCTION_TERMS), 6)


# ----------------------------------------------------------------------------------------------
# The global token mean (`token`) and the fixed-scale sum (issue 21, seed 000)
# ----------------------------------------------------------------------------------------------


def test_token_mode_by_hand():
    """Two examples of 1 and 3 tokens, K = 1: n_bar = 4 / 2 = 2 supervised tokens per example."""
    l_BKN = torch.tensor([[[4.0, 0.0, 0.0]], [[1.0, 2.0, 3.0]]], dtype=torch.float64)
    b_BN = torch.tensor([[1.0, 0.0, 0.0], [1.0, 1.0, 2.0]], dtype=torch.float64)
    mask_BN = torch.tensor([[True, False, False], [True, True, True]])
    q_BK = torch.ones(2, 1, dtype=torch.float64)
    cfg = ReconstructionLossConfig(token_aggregation_mode="token", token_weight_alpha=1.0)
    c_base = 1.25  # (1 + 4) / 4 tokens: the global token mean of b (reference/c_base.py, tested there)
    got = reconstruction_terms(token_nll=l_BKN, posterior=q_BK, ref_nll=b_BN, mask=mask_BN, c_base=c_base, config=cfg,
                               mean_num_tokens=2.0)
    raw = got["reconstruction_loss"]
    torch.testing.assert_close(raw, torch.tensor([4.0 / 2, 6.0 / 2], dtype=torch.float64))
    # the batch's example mean is the global token mean (4 + 1 + 2 + 3) / 4 = 2.5, not the per-example
    # token mean (4 + 2) / 2 = 3 of mode mean, nor the example mean of sums (4 + 6) / 2 = 5 of mode sum
    assert float(raw.mean()) == pytest.approx(2.5)
    torch.testing.assert_close(got["distribution_normalized_reconstruction_loss"], raw / 1.25)
    # pi = (1) and (1/4, 1/4, 1/2); W_token = n_i * sum_t pi l / n_bar: 1 * 4 / 2 and 3 * 2.25 / 2
    torch.testing.assert_close(got["token_weighted_reconstruction_loss"], torch.tensor([2.0, 3.375], dtype=torch.float64))
    # kappa = W_token(b) / A_token(b): (1/2) / (1/2) and (3 * 1.5 / 2) / (4 / 2)
    torch.testing.assert_close(got["token_concentration_factor"], torch.tensor([1.0, 1.125], dtype=torch.float64))
    torch.testing.assert_close(got["normalized_concentration_corrected_token_weighted_reconstruction_loss"],
                               torch.tensor([2.0 / 1.0 / 1.25, 3.375 / 1.125 / 1.25], dtype=torch.float64))
    torch.testing.assert_close(got["base_loss"], torch.tensor([0.5, 2.0], dtype=torch.float64))
    torch.testing.assert_close(got["example_inverse_surprisal_weighted_reconstruction_loss"],
                               torch.tensor([2.0 / (0.5 + 0.01), 3.0 / (2.0 + 0.01)], dtype=torch.float64))
    # a 0-dim tensor n_bar (what the trainer passes) gives the same
    again = reconstruction_terms(token_nll=l_BKN, posterior=q_BK, ref_nll=b_BN, mask=mask_BN, c_base=c_base, config=cfg,
                                 mean_num_tokens=torch.tensor(2.0))
    for name in RECONSTRUCTION_TERMS:
        torch.testing.assert_close(again[name], got[name], msg=name)


@pytest.mark.parametrize("alpha", ALPHAS)
@pytest.mark.parametrize("mode, sum_scale", [("token", None), ("sum", 16.0)])
def test_token_and_scaled_sum_match_loop_reference(mode, sum_scale, alpha):
    l_BKN, q_BK, b_BN, mask_BN = make_batch(K=3, seed=int(alpha * 10) + 500)
    cfg = ReconstructionLossConfig(token_aggregation_mode=mode, token_weight_alpha=alpha, sum_scale=sum_scale)
    got = reconstruction_terms(token_nll=l_BKN, posterior=q_BK, ref_nll=b_BN, mask=mask_BN, c_base=0.37, config=cfg,
                               mean_num_tokens=3.7)
    want = loop_reference(l_BKN, q_BK, b_BN, mask_BN, c_base=0.37, cfg=cfg, mean_num_tokens=3.7)
    for name, value in got.items():
        torch.testing.assert_close(value.double(), want[name], rtol=2e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("alpha", ALPHAS)
def test_token_mode_alpha_zero_is_uniform_and_kappa_mode_free(alpha):
    l_BKN, q_BK, b_BN, mask_BN = make_batch(K=2, seed=71)
    token = terms_for(l_BKN, q_BK, b_BN, mask_BN, token_aggregation_mode="token", token_weight_alpha=alpha, mean_num_tokens=3.0)
    mean = terms_for(l_BKN, q_BK, b_BN, mask_BN, token_aggregation_mode="mean", token_weight_alpha=alpha)
    for key in ("token_concentration_factor", "inverse_token_base_scale_factor"):
        torch.testing.assert_close(token[key], mean[key])
    if alpha == 0.0:
        torch.testing.assert_close(token["token_weighted_reconstruction_loss"], token["reconstruction_loss"])


def _token_terms(l_BKN, q_BK, b_BN, mask_BN, mean_num_tokens, c_base=0.8):
    cfg = ReconstructionLossConfig(token_aggregation_mode="token", token_weight_alpha=1.0)
    return reconstruction_terms(token_nll=l_BKN, posterior=q_BK, ref_nll=b_BN, mask=mask_BN, c_base=c_base, config=cfg,
                                mean_num_tokens=mean_num_tokens)


@pytest.mark.parametrize("world, accumulation", [(1, 1), (1, 2), (2, 2), (4, 2)])
def test_token_mode_is_exact_over_ranks_and_micro_batches(world, accumulation):
    """The trainer's reduction: every micro-batch adds local_sum / global_count of its per-example terms,
    with n_bar = (global supervised tokens) / global_count counted before the forwards. Whatever the split
    of the global batch, the sum is the global token mean sum_i sum_t q l / sum_i n_i, and so is its gradient;
    an n_bar of each micro-batch's own tokens would not be (checked last, so this test can fail)."""
    l_BKN, q_BK, b_BN, mask_BN = make_batch(K=2, seed=81, B=8, garbage=False)
    mask_BN[5, :2] = True  # every example valid, as the trainer's batches are (lengths stay ragged)
    l_BKN.requires_grad_(True)
    global_count = float(mask_BN.any(-1).sum())
    global_tokens = float(mask_BN.sum())
    n_bar = torch.tensor(global_tokens / global_count)

    by_hand = ((q_BK[:, :, None] * l_BKN) * mask_BN[:, None, :]).sum() / global_tokens
    want_grad, = torch.autograd.grad(by_hand, l_BKN)

    size = 8 // (world * accumulation)
    total = torch.zeros((), dtype=torch.float64)
    for start in range(0, 8, size):  # (rank, micro-batch) pairs: the engines sum their gradients
        sl = slice(start, start + size)
        terms = _token_terms(l_BKN[sl], q_BK[sl], b_BN[sl], mask_BN[sl], n_bar)
        total = total + terms["reconstruction_loss"].sum().double() / global_count
    got_grad, = torch.autograd.grad(total, l_BKN)
    assert float(total.detach()) == pytest.approx(float(by_hand.detach()), rel=1e-6)
    torch.testing.assert_close(got_grad, want_grad, rtol=1e-6, atol=1e-8)
    # the normalised term is that mean over the global token mean of b, c_base[token]
    dist = sum(_token_terms(l_BKN[s : s + size], q_BK[s : s + size], b_BN[s : s + size], mask_BN[s : s + size], n_bar)
               ["distribution_normalized_reconstruction_loss"].sum() for s in range(0, 8, size)) / global_count
    assert float(dist.detach()) == pytest.approx(float(by_hand.detach()) / 0.8, rel=1e-6)
    if size < 8:
        local = sum(_token_terms(l_BKN[s : s + size], q_BK[s : s + size], b_BN[s : s + size], mask_BN[s : s + size],
                                 float(mask_BN[s : s + size].sum()) / size)["reconstruction_loss"].sum()
                    for s in range(0, 8, size)) / global_count
        assert float(local.detach()) != pytest.approx(float(by_hand.detach()), rel=1e-5)


def test_token_mode_gradcheck():
    l_BKN, q_BK, b_BN, mask_BN = make_batch(K=2, seed=91, B=7, N=5, garbage=False)
    l_BKN = l_BKN.double().requires_grad_(True)
    q_BK = q_BK.double().requires_grad_(True)

    def fn(l, q):
        out = _token_terms(l, q, b_BN.double(), mask_BN, 2.5)
        return tuple(out[name] for name in RECONSTRUCTION_TERMS)

    assert torch.autograd.gradcheck(fn, (l_BKN, q_BK))


def test_sum_scale_divides_raw_tok_ex_and_leaves_normalised_terms():
    l_BKN, q_BK, b_BN, mask_BN = make_batch(K=3, seed=33)
    plain = terms_for(l_BKN, q_BK, b_BN, mask_BN, token_aggregation_mode="sum", token_weight_alpha=1.0)
    scaled = terms_for(l_BKN, q_BK, b_BN, mask_BN, token_aggregation_mode="sum", token_weight_alpha=1.0, sum_scale=16.0)
    for name in ("reconstruction_loss", "token_weighted_reconstruction_loss", "base_loss"):
        torch.testing.assert_close(scaled[name], plain[name] / 16.0, msg=name)
    for name in ("distribution_normalized_reconstruction_loss",
                 "normalized_concentration_corrected_token_weighted_reconstruction_loss",
                 "normalized_inverse_surprisal_token_weighted_reconstruction_loss", "token_concentration_factor"):
        torch.testing.assert_close(scaled[name], plain[name], msg=name)
    ex = "example_inverse_surprisal_weighted_reconstruction_loss"
    assert not torch.allclose(scaled[ex], plain[ex])  # epsilon is in the scaled units


def test_token_mode_and_sum_scale_are_refused_without_what_they_need():
    l_BKN, q_BK, b_BN, mask_BN = make_batch(K=2, seed=7)
    cfg = ReconstructionLossConfig(token_aggregation_mode="token")
    good = dict(token_nll=l_BKN, posterior=q_BK, ref_nll=b_BN, mask=mask_BN, c_base=0.5, config=cfg)
    for bad in (None, 0.0, -1.0, float("nan"), torch.tensor([2.0])):
        with pytest.raises(ValueError, match="mean_num_tokens"):
            reconstruction_terms(**good, mean_num_tokens=bad)
    with pytest.raises(ValueError, match="token"):
        aggregate(b_BN, mask_BN, "token")
    with pytest.raises(ValueError, match="sum_scale"):
        ReconstructionLossConfig(token_aggregation_mode="mean", sum_scale=4.0)
    for bad in (0.0, -2.0, float("inf")):
        with pytest.raises(ValueError, match="sum_scale"):
            ReconstructionLossConfig(token_aggregation_mode="sum", sum_scale=bad)
    # mean and sum ignore n_bar: the trainer passes it in every mode
    mean_cfg = ReconstructionLossConfig()
    torch.testing.assert_close(reconstruction_terms(**{**good, "config": mean_cfg}, mean_num_tokens=3.0)["reconstruction_loss"],
                               reconstruction_terms(**{**good, "config": mean_cfg})["reconstruction_loss"])
