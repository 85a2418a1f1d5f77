"""control/distinct_outputs: the fraction of decoded x whose greedy output changes with z, with or
without a parser (zcvae.eval.metrics.distinct_outputs, zcvae.eval.evaluation)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from test_evaluation import _CountingModule, _engine_view, one_thread, setup  # noqa: F401 - the tiny-model fixtures

from zcvae.config import TrainConfig
from zcvae.eval.evaluation import evaluate, summarize
from zcvae.eval.metrics import distinct_outputs
from zcvae.eval.records import DecodeRecord, ExampleRecord


def test_distinct_outputs_on_a_hand_built_decode():
    decodes = [
        # x 0: latents 0 and 1 write different tokens -> differs
        {"index": 0, "latent": 0, "generated": [5, 6], "closed": True},
        {"index": 0, "latent": 1, "generated": [5, 7], "closed": True},
        # x 1: the same tokens under all three latents -> does not differ
        *({"index": 1, "latent": k, "generated": [5, 6], "closed": True} for k in range(3)),
        # x 2: the same tokens, but one decode closed with </y> and the other ran out -> differs
        {"index": 2, "latent": 0, "generated": [8], "closed": True},
        {"index": 2, "latent": 1, "generated": [8], "closed": False},
        # x 3: one latent only: nothing to compare -> does not differ
        {"index": 3, "latent": 0, "generated": [9], "closed": True},
    ]
    assert distinct_outputs(decodes) == pytest.approx(2 / 4)
    assert distinct_outputs([SimpleNamespace(index=0, generated=(1,), closed=True)]) == 0.0  # objects work too
    with pytest.raises(ValueError, match="at least one"):
        distinct_outputs([])
    with pytest.raises(ValueError, match=r"decoded\[0\].*'generated'"):
        distinct_outputs([{"index": 0}])


class _Tok:
    def decode(self, ids):
        return " ".join(str(i) for i in ids)


def test_summarize_without_a_parser_reports_distinct_outputs_and_argmax_exact_match():
    cfg = TrainConfig.from_flat(latent_type="discrete", num_latents=2, seed=0, posterior_entropy_weight=0.0, router_support_weight=0.0,
                                router_marginal_kl_weight=0.0, inter_latent_divergence_weight=0.0, posterior_variance_weight=0.0)
    val = [SimpleNamespace(id=f"e{i}", x_ids=(i,), y_ids=(1, 3), strategy=None) for i in range(3)]
    terms = {"loss": 1.0, "kl": 0.1, "num_tokens": 2.0, "num_tokens_min": 2.0, "num_tokens_max": 2.0, "valid": 1.0}
    records = [ExampleRecord(index=i, strategy=None, terms=terms, cond_nll_N=[1.0, 1.0], ref_nll_N=[1.0, 1.0],
                             posterior_K=q, prior_K=[0.5, 0.5])
               for i, q in enumerate([[0.9, 0.1], [0.2, 0.8], [0.6, 0.4]])]
    # x 0: argmax latent 0 decodes the gold y, latent 1 something else; x 1 and x 2: both latents alike
    decodes = [
        DecodeRecord(index=0, latent=0, generated=[1, 3], closed=True),
        DecodeRecord(index=0, latent=1, generated=[2, 3], closed=True),
        DecodeRecord(index=1, latent=0, generated=[1, 3], closed=True),
        DecodeRecord(index=1, latent=1, generated=[1, 3], closed=True),
        DecodeRecord(index=2, latent=0, generated=[4], closed=True),
        DecodeRecord(index=2, latent=1, generated=[4], closed=True),
    ]
    scalars, _ = summarize(records, decodes, cfg=cfg, val=val, task=None, tokenizer=_Tok(), c_base=1.0, num_decode_steps=4)
    assert scalars["control/distinct_outputs"] == pytest.approx(1 / 3)
    assert scalars["exact_match"] == pytest.approx(2 / 3)  # only the argmax latent's decode of each x counts
    assert "control/purity" not in scalars and "control/matching_accuracy" not in scalars


def test_evaluate_without_a_parser_decodes_every_latent(setup, tmp_path):
    s = setup
    counting = _CountingModule(s.engine.module)
    engine = _engine_view(s.engine, counting, rank=0, world_size=1)
    metrics = evaluate(engine=engine, model=s.model, cfg=s.cfg, val=s.val, reference=s.reference, task=None,
                       run_dir=tmp_path, step=3)
    # 5 x K = 3 rows in micro-batches of 2 examples (6 rows): 3 batches of max_new_tokens forwards, as with a parser
    assert [m for m, _ in counting.calls].count("decode") == 3 * s.cfg.evaluation.max_new_tokens
    assert metrics["decode/num_examples"] == 5 and "control/purity" not in metrics
    # recompute the fraction from the decodes written for a person to read (all 5 x are among the samples)
    samples = json.loads((tmp_path / "eval_step3.json").read_text())["samples"]
    assert sorted((d["index"], d["latent"]) for d in samples) == [(i, k) for i in range(5) for k in range(3)]
    outputs: dict[int, set] = {}
    for d in samples:
        outputs.setdefault(d["index"], set()).add((d["decoded_y"], d["closed"]))
    assert metrics["control/distinct_outputs"] == pytest.approx(sum(len(o) > 1 for o in outputs.values()) / 5)
