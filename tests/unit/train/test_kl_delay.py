"""The KL delay that ends on evidence (zcvae.train.kl_delay): the read measure on real tiny decoders, one that
ignores z and one that depends on it; the delay's end at the read step and at the cap; its betas against the fixed
schedule's; its state through a checkpoint; its config rules."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from zcvae.config import TrainConfig, kl_delay_end, kl_weight_at
from zcvae.train.kl_delay import READ_GAP_NATS, KLDelay, check_delay, probe_seq_nll_BK, read_share_BK


def test_read_share_counts_rows_whose_best_and_worst_z_differ_by_the_gap():
    seq_nll_BK = torch.tensor([[3.0, 3.0, 3.0], [3.0, 3.0 + READ_GAP_NATS, 3.2], [5.0, 1.0, 5.0], [2.0, 2.5, 2.9]])
    share, reads = read_share_BK(seq_nll_BK)
    assert reads == 2 and share == 0.5  # rows 1 (exactly the gap) and 2; row 3 differs by 0.9
    with pytest.raises(ValueError, match="K >= 2"):
        read_share_BK(torch.zeros(4, 1))


def _decoder(backbone, *, reads_z: bool):
    """A real tiny ZCVAE on ``copy`` with K = 3 and its probe set. Fresh, the z rows start near one mean row, so the
    decoder cannot tell the z apart. ``reads_z``: trained for a few steps with z = the example's gold strategy
    (forward -> z0, reverse -> z1), as a decoder that has learned to read z: its first y token (``fwd``/``rev``)
    then follows z."""
    from zcvae.data import get_task, make_examples
    from zcvae.model.cvae import ZCVAE
    from zcvae.data.encoding import collate, encode_examples

    cfg = TrainConfig.from_flat(task="copy", backbone=str(backbone), num_latents=3)
    model = ZCVAE.from_pretrained(cfg.model.backbone, cfg.model_config(), seed=0)
    probe, _ = encode_examples(make_examples(get_task("copy"), seed=0, split="val", num_examples=12), model.tokenizer,
                               model.tokens, max_length=cfg.data.max_length, num_z_slots=1)
    model.train()  # the probe puts it in eval mode and restores this
    if reads_z:
        train, _ = encode_examples(make_examples(get_task("copy"), seed=0, split="train", num_examples=32), model.tokenizer,
                                   model.tokens, max_length=cfg.data.max_length, num_z_slots=1)
        batch = collate(train, model.tokens)
        gold_B = torch.tensor([{"forward": 0, "reverse": 1}[s] for s in batch.strategies])
        torch.manual_seed(0)
        # every weight, not only LoRA: the random 32-wide backbone learns to route the z slot to y's first token
        # in tens of steps this way, where LoRA alone would take hundreds
        params = [p.requires_grad_(True) for p in model.parameters()]
        opt = torch.optim.Adam(params, lr=3e-2)
        for _ in range(STEPS_TO_READ_Z):
            out = model(batch, mode="train", n_span=int(batch.num_supervised.max()))
            nll_BN = out.token_nll[torch.arange(len(gold_B)), gold_B] * out.mask
            opt.zero_grad()
            (nll_BN.sum() / out.mask.sum()).backward()
            opt.step()
    engine = SimpleNamespace(module=model, device=torch.device("cpu"), all_reduce=lambda t: t)
    return cfg, model, engine, probe


# enough Adam steps for the tiny decoder's y to follow z (measured: the mean best-worst gap over the batch is
# 0.4 nats after 20 steps, 3.5 after 40, 6.7 after 50)
STEPS_TO_READ_Z = 50


@pytest.mark.parametrize("reads_z", [False, True])
def test_the_read_measure_tells_a_decoder_that_ignores_z_from_one_that_reads_it(tiny_backbone, reads_z):
    cfg, model, engine, probe = _decoder(tiny_backbone(), reads_z=reads_z)
    seq_nll_BK = probe_seq_nll_BK(engine, model, probe, batch_size=5, num_z_slots=1)
    assert seq_nll_BK.shape == (12, 3)
    assert all(m.training for m in model.modules())  # the modes it had
    share, _ = read_share_BK(seq_nll_BK)
    if reads_z:
        assert share >= 0.9, seq_nll_BK
    else:
        spread = (seq_nll_BK.max(1).values - seq_nll_BK.min(1).values).max()
        assert share == 0 and spread < 0.1 * READ_GAP_NATS, seq_nll_BK  # the z rows differ only by their init


@pytest.mark.parametrize(("reads_z", "ended_at", "reason"), [(True, 6, "read"), (False, 16, "cap")])
def test_the_delay_ends_at_the_read_step_or_at_the_cap(tiny_backbone, reads_z, ended_at, reason, logged):
    _, model, engine, probe = _decoder(tiny_backbone(), reads_z=reads_z)
    cfg = TrainConfig.from_flat(max_steps=20, kl_delay_mode="read", kl_delay_fraction=0.3, kl_delay_max_fraction=0.8,
                                kl_delay_check_every=3, kl_ramp_fraction=0.2)
    delay, lines = KLDelay.from_config(cfg), logged
    assert (delay.min_step, delay.cap_step) == (6, 16)
    checked = []
    for done in range(1, 21):
        if delay.checks_after(done):
            checked.append(done)
            check_delay(delay, done, engine=engine, model=model, probe=probe, batch_size=4, num_z_slots=1)
    # from the minimum, every 3 steps and at the cap; never again once ended
    assert checked == ([6] if reads_z else [6, 9, 12, 15, 16])
    assert (delay.ended_at, delay.reason) == (ended_at, reason)
    assert len(lines) == 1 and f"after step {ended_at} of 20" in lines[0]
    assert ("without a read" in lines[0]) == (reason == "cap") and ("--max-steps" in lines[0]) == (reason == "cap")
    betas = [kl_weight_at(cfg, step, delay_end=delay.ended_at) for step in range(20)]
    assert betas[: ended_at + 1] == [0.0] * (ended_at + 1) and betas[ended_at + 1] > 0


def test_a_delay_that_ends_at_the_fixed_step_gives_the_fixed_betas_exactly():
    fixed = TrainConfig.from_flat(max_steps=300, kl_delay_fraction=0.6, kl_ramp_fraction=0.2, kl_weight=0.7)
    read = fixed.replace(kl_delay_mode="read")
    assert [kl_weight_at(read, s, delay_end=180) for s in range(300)] == [kl_weight_at(fixed, s) for s in range(300)]
    assert all(kl_weight_at(read, s, delay_end=None) == 0.0 for s in range(300))  # the delay lasts
    assert kl_delay_end(fixed) == 181 and kl_delay_end(read) is None  # read: evaluated where it ends, not planned


def test_the_delay_state_round_trips():
    cfg = TrainConfig.from_flat(max_steps=100, kl_delay_mode="read")
    delay = KLDelay.from_config(cfg)
    delay.update(30, 0.1)
    delay.update(40, 0.75)
    again = KLDelay.from_config(cfg)
    again.load_state_dict(delay.state_dict())
    assert (again.ended_at, again.reason, again.share, again.checks) == (40, "read", 0.75, [[30, 0.1], [40, 0.75]])
    assert not again.checks_after(50)
    assert again.record() == {"read_share": 0.75, "ended_at": 40.0, "ended_by_read": 1.0}
    fixed = KLDelay.from_config(TrainConfig.from_flat(max_steps=100))
    assert not any(fixed.checks_after(d) for d in range(1, 101))


@pytest.mark.parametrize(("fields", "message"), [
    ({"kl_schedule": "cyclical"}, "needs kl_schedule delay-ramp"),
    ({"kl_delay_fraction": 0.6, "kl_delay_max_fraction": 0.5}, "kl_delay_max_fraction 0.5 must be >= kl_delay_fraction 0.6"),
    ({"kl_delay_max_fraction": 0.9, "kl_ramp_fraction": 0.2}, "leave room for the ramp"),
    ({"kl_delay_read_share": 0.0}, "kl_delay_read_share must be in"),
    ({"kl_delay_check_every": 0}, "kl_delay_check_every must be >= 1"),
])
def test_bad_read_delays_are_refused_naming_the_field(fields, message):
    with pytest.raises(ValueError, match=message):
        TrainConfig.from_flat(kl_delay_mode="read", **fields)
