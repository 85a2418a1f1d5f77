"""MetricWindow (zcvae.loop.logs): the running per-example reductions the training loop logs.

Each per-example value is reduced as ``losses.DIAGNOSTIC_REDUCTIONS`` says, over *valid* examples
only (invalid rows hold 0 and must not pull a minimum down or count in a mean), accumulated across
micro-batches. World 1 here: ``reduce_metrics`` is then the identity, the cross-rank part is tested
in tests/distributed.
"""

from __future__ import annotations

import math

import pytest
import torch

from zcvae.core.losses import DIAGNOSTIC_REDUCTIONS
from zcvae.loop.logs import MetricWindow

# two micro-batches; the second row of the first and the last of the second are invalid
VALID = [torch.tensor([1.0, 0.0, 1.0]), torch.tensor([1.0, 1.0, 0.0])]
LOSS = [torch.tensor([2.0, 0.0, 4.0]), torch.tensor([6.0, 1.0, 0.0])]
BASE_LOSS = [torch.tensor([0.5, 0.0, 0.25]), torch.tensor([0.75, 0.125, 0.0])]  # min over valid: 0.125
NUM_TOKENS_MAX = [torch.tensor([3.0, 99.0, 5.0]), torch.tensor([4.0, 2.0, 50.0])]  # invalid rows hold big values
DEGENERATE = [torch.tensor([0.0, 1.0, 1.0]), torch.tensor([1.0, 0.0, 0.0])]


def filled_window() -> MetricWindow:
    window = MetricWindow()
    for m in range(2):
        values = {
            "loss": LOSS[m],
            "base_loss": BASE_LOSS[m],
            "num_tokens_max": NUM_TOKENS_MAX[m],
            "degenerate": DEGENERATE[m],
            "valid": VALID[m],
        }
        window.add_examples(values, VALID[m])
    return window


def test_the_table_covers_the_reductions_used_below():
    # if the table changes these names' reductions, the expectations below are stale
    assert DIAGNOSTIC_REDUCTIONS["base_loss"] == "min"
    assert DIAGNOSTIC_REDUCTIONS["num_tokens_max"] == "max"
    assert DIAGNOSTIC_REDUCTIONS["degenerate"] == "sum"
    assert "loss" not in DIAGNOSTIC_REDUCTIONS  # unlisted: "mean"


def test_reductions_over_valid_examples_across_micro_batches():
    got = filled_window().reduce()
    assert got["loss"] == pytest.approx((2 + 4 + 6 + 1) / 4)  # mean over the 4 valid rows, not the 6 rows
    assert got["base_loss"] == 0.125  # the invalid rows' 0.0 is not the minimum
    assert got["num_tokens_max"] == 5.0  # the invalid rows' 99 and 50 are not the maximum
    assert got["degenerate"] == 3.0  # "sum" counts over all rows, unmasked (the loss module zeroes invalid ones)
    assert "valid" not in got
    assert not any(k.endswith(("/sum", "/count")) for k in got)


def test_weighted_rows_count_by_their_weight():
    window = MetricWindow()
    window.add_examples({"kl": torch.tensor([1.0, 3.0])}, torch.tensor([1.0, 3.0]))
    assert window.reduce()["kl"] == pytest.approx((1 * 1 + 3 * 3) / 4)


def test_scalars_are_weighted_means():
    window = MetricWindow()
    window.add_scalar("grad_norm", 2.0)
    window.add_scalar("grad_norm", torch.tensor(4.0))
    window.add_scalar("router_support", 1.5, weight=3.0)
    window.add_scalar("router_support", 3.5, weight=1.0)
    got = window.reduce()
    assert got["grad_norm"] == pytest.approx(3.0)
    assert got["router_support"] == pytest.approx((1.5 * 3 + 3.5) / 4)


def test_a_window_with_no_valid_example_reports_nan_and_neutral_extremes():
    window = MetricWindow()
    zero_B = torch.zeros(2)
    window.add_examples({"loss": torch.tensor([1.0, 2.0]), "base_loss": torch.tensor([1.0, 2.0]),
                         "num_tokens_max": torch.tensor([1.0, 2.0])}, zero_B)
    got = window.reduce()
    assert math.isnan(got["loss"])
    assert got["base_loss"] == math.inf and got["num_tokens_max"] == -math.inf


def test_values_are_detached_and_accumulated_in_float64():
    window = MetricWindow()
    x = torch.tensor([1.0, 2.0], requires_grad=True)
    window.add_examples({"loss": x * 2}, torch.ones(2))
    assert not window.sums["loss"].requires_grad
    assert window.sums["loss"].dtype == torch.float64
    # 1e8 + 1 is exact in float64 and not in float32: the window must not sum in float32
    window = MetricWindow()
    window.add_examples({"loss": torch.tensor([1e8])}, torch.ones(1))
    window.add_examples({"loss": torch.tensor([1.0])}, torch.ones(1))
    assert window.reduce()["loss"] == (1e8 + 1.0) / 2
