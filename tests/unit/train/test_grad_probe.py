"""The posterior-gradient probe (zcvae.train.grad_probe): its norms against autograd on each term alone,
its decision fractions by hand, its config rules, and a probed train() that trains bit for bit like an
unprobed one."""

from __future__ import annotations

import json
import math

import pytest
import torch

from zcvae.train.grad_probe import GradientProbe, decision_fractions


def _model_and_batches(backbone, *, checkpointing: bool):
    from zcvae.config import TrainConfig
    from zcvae.data import get_task, make_examples
    from zcvae.model.cvae import ZCVAE
    from zcvae.data.encoding import collate, encode_examples

    extra = dict(gradient_checkpointing=True, branch_chunk_size=3) if checkpointing else {}
    cfg = TrainConfig.from_flat(task="copy", backbone=str(backbone), objective="raw+tokcc", num_latents=2, **extra)
    model = ZCVAE.from_pretrained(cfg.model.backbone, cfg.model_config(), seed=0)
    if checkpointing:
        from zcvae.engines.base import enable_gradient_checkpointing

        enable_gradient_checkpointing(model)
    examples, _ = encode_examples(make_examples(get_task("copy"), seed=0, split="train", num_examples=8), model.tokenizer,
                                  model.tokens, max_length=cfg.data.max_length, num_z_slots=1)
    batches = [collate(examples[:4], model.tokens, num_z_slots=1), collate(examples[4:], model.tokens, num_z_slots=1)]
    model.calibrate(collate(examples, model.tokens, num_z_slots=1))
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():  # non-zero heads: q differs from p, so the KL has a gradient on both groups
        for p in model.router.parameters():
            p.copy_(0.3 * torch.randn(p.shape, generator=g))
    model.train()
    return cfg, model, examples, batches


def _terms(cfg, model, batch):
    from zcvae.core.objective import AuxiliaryWeights, per_example_objective

    out = model.train_forward(batch)
    # any detached, positive z-free NLL will do for the probe: a fixed one per batch
    ref_nll_BN = torch.rand(out.mask.shape, generator=torch.Generator().manual_seed(int(batch.input_ids.sum()))) + 0.1
    return per_example_objective(out, ref_nll_BN=ref_nll_BN, c_base=1.5, recon_config=cfg.reconstruction_config(),
                                 kl_weight=0.7, aux=AuxiliaryWeights.from_train_config(cfg))


def _groups(model):
    return {"posterior_head": list(model.router.posterior_head.parameters()), "lora": [p for _, p in model.lora_named_parameters()]}


def _grad_norms_by_backward(cfg, model, batches, term: str, count: float) -> dict[str, float]:
    """The independent path: a fresh forward per micro-batch, .backward() of one term alone, .grad summed."""
    model.zero_grad(set_to_none=True)
    for batch in batches:
        terms = _terms(cfg, model, batch)
        value = terms["weighted_reconstruction_loss"] * terms["valid"] if term == "reconstruction" else terms["kl"]
        (value.sum() / count).backward()
    out = {}
    for group, params in _groups(model).items():
        out[group] = math.sqrt(sum(float((p.grad.double() ** 2).sum()) for p in params if p.grad is not None))
    model.zero_grad(set_to_none=True)
    return out


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointed-chunks"])
def test_probe_norms_equal_autograd_on_each_term_alone_and_leave_the_backward_unchanged(tiny_backbone, checkpointing):
    cfg, model, examples, batches = _model_and_batches(tiny_backbone(), checkpointing=checkpointing)
    count = float(sum(len(b) for b in batches))
    expected = {t: _grad_norms_by_backward(cfg, model, batches, t, count) for t in ("reconstruction", "kl")}
    assert all(v > 0 for e in expected.values() for v in e.values()), expected

    # the gradients of the full loss, without a probe ...
    model.zero_grad(set_to_none=True)
    for batch in batches:
        (_terms(cfg, model, batch)["loss"].sum() / count).backward()
    plain = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    model.zero_grad(set_to_none=True)

    # ... and with the probe reading the same forwards first (two micro-batches of one step)
    probe = GradientProbe(_groups(model))
    for batch in batches:
        terms = _terms(cfg, model, batch)
        probe.accumulate(reconstruction=(terms["weighted_reconstruction_loss"] * terms["valid"]).sum() / count,
                         kl=terms["kl"].sum() / count)
        (terms["loss"].sum() / count).backward()
    probed = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    assert len(plain) == len(probed) and all(torch.equal(a, b) for a, b in zip(plain, probed))

    record = probe.result(kl_weight=0.25, all_reduce=lambda t: t.clone())
    for group in ("posterior_head", "lora"):
        assert record[f"{group}/reconstruction_grad_norm"] == pytest.approx(expected["reconstruction"][group], rel=1e-5)
        assert record[f"{group}/kl_grad_norm"] == pytest.approx(expected["kl"][group], rel=1e-5)
        assert record[f"{group}/scaled_kl_grad_norm"] == pytest.approx(0.25 * expected["kl"][group], rel=1e-5)
        assert record[f"{group}/reconstruction_to_kl_ratio"] == pytest.approx(
            expected["reconstruction"][group] / (0.25 * expected["kl"][group]), rel=1e-5)
    assert record["kl_weight"] == 0.25
    assert "decision_fraction" not in record  # no task given


def test_probe_ratio_is_absent_at_beta_zero_and_the_norms_are_global_over_ranks(tiny_backbone):
    cfg, model, examples, batches = _model_and_batches(tiny_backbone(), checkpointing=False)
    probe = GradientProbe(_groups(model))
    terms = _terms(cfg, model, batches[0])
    probe.accumulate(reconstruction=(terms["weighted_reconstruction_loss"]).sum(), kl=terms["kl"].sum())
    one = probe.result(kl_weight=0.0, all_reduce=lambda t: t.clone())
    assert one["posterior_head/scaled_kl_grad_norm"] == 0.0 and one["posterior_head/kl_grad_norm"] > 0
    assert not any(k.endswith("reconstruction_to_kl_ratio") for k in one)  # undefined: absent, not inf

    # two ranks holding the same gradient: the all-reduced vector is twice it, so every norm doubles
    terms = _terms(cfg, model, batches[0])
    probe.accumulate(reconstruction=(terms["weighted_reconstruction_loss"]).sum(), kl=terms["kl"].sum())
    two = probe.result(kl_weight=0.0, all_reduce=lambda t: 2 * t)
    for key in ("posterior_head/reconstruction_grad_norm", "lora/kl_grad_norm"):
        assert two[key] == pytest.approx(2 * one[key], rel=1e-9)
    with pytest.raises(RuntimeError, match="before any accumulate"):
        probe.result(kl_weight=1.0, all_reduce=lambda t: t)


def test_decision_fractions_count_the_decision_positions_over_the_supervised_tokens():
    from zcvae.data import build_tokenizer, get_task, make_examples
    from zcvae.data.encoding import encode_examples, prepare_tokenizer

    tok = build_tokenizer()
    tokens = prepare_tokenizer(tok, num_latents=3)
    for name in ("copy", "sort3", "mul"):
        raw = make_examples(get_task(name), seed=0, split="train", num_examples=6)
        encoded, _ = encode_examples(raw, tok, tokens, max_length=64, num_z_slots=1)
        got = decision_fractions(encoded, task=get_task(name), tokenizer=tok)
        # every built-in family parts its strategies at one y position; T = y words + </y>
        assert got == pytest.approx([1 / (len(ex.y.split()) + 1) for ex in raw]), name
    assert decision_fractions(encoded, task=None, tokenizer=tok) is None


def test_config_refuses_the_probe_off_the_local_engine_and_keeps_the_run_name():
    from zcvae.config import TrainConfig, train_run_name

    with pytest.raises(ValueError, match="grad_probe_every needs engine local"):
        TrainConfig.from_flat(task="copy", engine="fsdp2", grad_probe_every=5)
    with pytest.raises(ValueError, match="grad_probe_every must be >= 0"):
        TrainConfig.from_flat(task="copy", grad_probe_every=-1)
    on, off = TrainConfig.from_flat(task="copy", grad_probe_every=5), TrainConfig.from_flat(task="copy")
    assert train_run_name(on.to_dict()) == train_run_name(off.to_dict())


def _records(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_a_probed_run_trains_bit_for_bit_like_an_unprobed_one(tiny_backbone, tmp_path):
    """Same seed, probe on and off, through the real train(): every train and eval record is identical."""
    from zcvae.config import TrainConfig
    from zcvae.train.trainer import train

    common = dict(task="copy", backbone=str(tiny_backbone()), num_train_examples=32, num_val_examples=6, max_steps=4,
                  micro_batch_size=4, gradient_accumulation_steps=2, num_eval_decode_examples=2, max_new_tokens=4,
                  progress_bar=False, reference_policy="online", log_every=1, kl_delay_fraction=0.25,
                  kl_ramp_fraction=0.25, objective="raw+dist")
    runs = {}
    for probe_every in (0, 1):
        run_dir = tmp_path / f"probe{probe_every}"
        train(TrainConfig.from_flat(**common, output_dir=str(run_dir), grad_probe_every=probe_every))
        runs[probe_every] = _records(run_dir)
    off = [r for r in runs[0] if r["split"] != "grad_probe"]
    on = [r for r in runs[1] if r["split"] != "grad_probe"]
    assert len(off) == len(runs[0])  # the unprobed run wrote no probe record
    strip = lambda r: {k: v for k, v in r.items() if k != "tokens_per_second"}  # noqa: E731 - wall clock
    assert [strip(r) for r in on] == [strip(r) for r in off]
    assert {r["split"] for r in off} == {"train", "eval"} and len([r for r in off if r["split"] == "train"]) == 4

    probes = [r for r in runs[1] if r["split"] == "grad_probe"]
    assert [r["step"] for r in probes] == [1, 2, 3, 4]
    betas = {r["step"]: r["kl_weight"] for r in off if r["split"] == "train"}
    for r in probes:
        assert r["kl_weight"] == betas[r["step"]]
        assert r["posterior_head/reconstruction_grad_norm"] >= 0 and r["lora/reconstruction_grad_norm"] > 0
        # copy decides at the first y token: t0 = 1 over T = y + </y>
        assert 0 < r["decision_fraction"] < 0.5
        for group in ("posterior_head", "lora"):
            defined = r["kl_weight"] > 0 and r[f"{group}/kl_grad_norm"] > 0
            assert (f"{group}/reconstruction_to_kl_ratio" in r) == defined, (r["step"], group)
            if defined:
                assert r[f"{group}/reconstruction_to_kl_ratio"] == pytest.approx(
                    r[f"{group}/reconstruction_grad_norm"] / (r["kl_weight"] * r[f"{group}/kl_grad_norm"]))
    assert probes[0]["kl_weight"] == 0 and probes[-1]["kl_weight"] > 0  # both sides of the KL delay were probed
