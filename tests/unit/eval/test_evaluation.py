"""Tests for zcvae.eval.evaluation: sharding, lock-step decoding, metrics over gathered records, and the full
evaluate() on a tiny Llama CVAE, including a simulated 2-rank run (two threads, two model replicas,
a thread-barrier all_gather_object) on an odd-sized validation set that must match one process."""

from __future__ import annotations

import copy
import math
import threading
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from zcvae.config import TrainConfig
from zcvae.model.decoding import greedy_decode
from zcvae.eval.evaluation import decode_length, evaluate, gather_records, shard_indices, summarize
from zcvae.eval.records import DecodeRecord, ExampleRecord
import zcvae.eval.summary as summary_module

# ---------------------------------------------------------------- pure parts


@pytest.mark.parametrize("num_items, world", [(7, 2), (8, 2), (1, 3), (10, 4), (5, 1)])
def test_shard_indices_cover_every_item_once_with_equal_lengths(num_items, world):
    shards = [shard_indices(num_items, rank=r, world_size=world) for r in range(world)]
    lengths = {len(idx) for idx, _ in shards}
    assert lengths == {math.ceil(num_items / world)}  # same forwards on every rank
    kept = sorted(i for idx, keep in shards for i, k in zip(idx, keep) if k)
    assert kept == list(range(num_items))
    for r, (idx, keep) in enumerate(shards):
        assert [i for i, k in zip(idx, keep) if k] == list(range(r, num_items, world))
        assert all(0 <= i < num_items for i in idx)


def test_shard_indices_rejects_bad_rank():
    with pytest.raises(ValueError, match="rank"):
        shard_indices(4, rank=2, world_size=2)
    with pytest.raises(ValueError, match="num_items"):
        shard_indices(0, rank=0, world_size=1)


def test_gather_records_merges_parts_in_index_order():
    parts = [[DecodeRecord(0, None, [], True), DecodeRecord(2, None, [], True)],
             [DecodeRecord(1, 1, [], True), DecodeRecord(1, 0, [], True)]]

    def fake_all_gather(out, obj):
        out[:] = copy.deepcopy(parts)

    merged = gather_records(parts[0], world_size=2, all_gather_object=fake_all_gather)
    assert [(r.index, r.latent) for r in merged] == [(0, None), (1, 0), (1, 1), (2, None)]


def test_greedy_decode_runs_fixed_steps_and_stops_rows_at_the_stop_token():
    V, stop, pad = 10, 9, 0
    seen_widths = []

    def next_logits(ids_RL, mask_RL):
        # next token = last attended token + 1: row [3] -> 4 5 6 7 8 9(stop); row [7, 7] -> 8 9(stop)
        seen_widths.append(ids_RL.shape[1])
        last_R = mask_RL.sum(1) - 1
        prev_R = ids_RL[torch.arange(ids_RL.shape[0]), last_R]
        return torch.nn.functional.one_hot((prev_R + 1) % V, V).float()

    generated, closed, forwards = greedy_decode(next_logits, [[3], [7, 7], [1]], num_steps=4, stop_id=stop, pad_id=pad)
    assert forwards == 4 and len(seen_widths) == 4  # even though row 1 stopped after two steps
    assert generated == [[4, 5, 6, 7], [8], [2, 3, 4, 5]]
    assert closed == [False, True, False]
    generated, closed, forwards = greedy_decode(next_logits, [[3]], num_steps=8, stop_id=stop, pad_id=pad)
    assert (generated, closed, forwards) == ([[4, 5, 6, 7, 8]], [True], 8)


def test_decode_length_defaults_to_longest_y_plus_two():
    val = [SimpleNamespace(y_ids=(1, 2, 3)), SimpleNamespace(y_ids=(1,) * 7)]
    assert decode_length(TrainConfig.from_flat(max_new_tokens=None), val) == 9
    assert decode_length(TrainConfig.from_flat(max_new_tokens=4), val) == 4


class _Task:
    """A minimal parser: y = '<strategy> <answer>', answer(x) = x."""

    def parse(self, y):
        words = y.split()
        ok = len(words) == 2 and words[0] in ("A", "B")
        return SimpleNamespace(strategy=words[0] if ok else None, answer=words[1] if ok else None, parse_ok=ok)

    def answer(self, x):
        return x


class _Tok:
    vocab = {1: "A", 2: "B", 3: "7", 4: "8"}

    def decode(self, ids):
        return " ".join(self.vocab.get(i, "?") for i in ids)


def _record(i, q, strategy, n=2):
    terms = {"loss": 1.0 + i, "kl": 0.5, "num_tokens": float(n), "num_tokens_min": float(n), "num_tokens_max": float(n), "valid": 1.0}
    return ExampleRecord(index=i, strategy=strategy, terms=terms, cond_nll_N=[1.0] * n, ref_nll_N=[1.5, 1.0][:n],
                         posterior_K=q, prior_K=[0.5, 0.5])


def test_summarize_computes_whole_set_metrics_and_controllability_by_hand():
    cfg = TrainConfig.from_flat(latent_type="discrete", num_latents=2, seed=0, posterior_entropy_weight=0.0, router_support_weight=0.0,
                                router_marginal_kl_weight=0.0, inter_latent_divergence_weight=0.0, posterior_variance_weight=0.0)
    val = [SimpleNamespace(id=f"e{i}", x_ids=(3,), y_ids=(1, 3), strategy=s) for i, s in enumerate(["A", "B", "A"])]
    records = [_record(0, [1.0, 0.0], "A"), _record(1, [0.0, 1.0], "B", n=1), _record(2, [0.9, 0.1], "A")]
    # latent 0 -> "A 7" (correct for x = 7), latent 1 -> "B 8" (wrong answer); example 1 latent 1 never closed
    decodes = [
        DecodeRecord(index=0, latent=0, generated=[1, 3], closed=True),
        DecodeRecord(index=0, latent=1, generated=[2, 4], closed=True),
        DecodeRecord(index=1, latent=0, generated=[1, 3], closed=True),
        DecodeRecord(index=1, latent=1, generated=[2, 3], closed=False),
    ]
    scalars, details = summarize(records, decodes, cfg=cfg, val=val, task=_Task(), tokenizer=_Tok(), c_base=2.0, num_decode_steps=5)
    assert scalars["loss"] == pytest.approx(2.0) and scalars["kl"] == pytest.approx(0.5)
    assert scalars["num_tokens"] == pytest.approx(5 / 3)
    assert scalars["num_tokens_min"] == 1 and scalars["num_tokens_max"] == 2
    qbar = np.array([1.9, 1.1]) / 3
    h = lambda p: -sum(x * math.log(x) for x in p if x > 0)  # noqa: E731
    assert scalars["mi"] == pytest.approx(h(qbar) - h([0.9, 0.1]) / 3)
    assert scalars["router_marginal_kl"] == pytest.approx(math.log(2) - h(qbar))
    assert scalars["nmi"] == pytest.approx(1.0) and scalars["c_base"] == 2.0
    np.testing.assert_array_equal(details["confusion"], [[2, 0], [0, 1]])
    # exact match only on the argmax latent: example 0 latent 0 = gold (1, 3); example 1 latent 1 not closed
    assert scalars["exact_match"] == pytest.approx(0.5)
    assert scalars["control/parse_rate"] == pytest.approx(3 / 4)
    assert scalars["answer_accuracy"] == pytest.approx(2 / 4)
    assert scalars["control/purity"] == pytest.approx((1.0 + 0.5) / 2)  # latent 0: A, A; latent 1: B, unparsed
    assert scalars["control/matching_accuracy"] == pytest.approx(3 / 4)
    # gain = ref - cond: positions [0.5, 0.0] for two rows, [0.5] for one
    assert scalars["info_gain/first_token"] == pytest.approx(0.5)
    assert scalars["info_gain/mean"] == pytest.approx(1.5 / 5)


def test_summarize_adds_the_batch_level_router_terms_of_the_objective_on_the_whole_set():
    # J's batch-level terms are w_kl KL(mean q || U) - w_support H(mean q), with the whole set as the batch.
    cfg = TrainConfig.from_flat(latent_type="discrete", num_latents=2, seed=0, posterior_entropy_weight=0.0, router_support_weight=0.7,
                                router_marginal_kl_weight=0.3, inter_latent_divergence_weight=0.0, posterior_variance_weight=0.0)
    val = [SimpleNamespace(id=f"e{i}", x_ids=(3,), y_ids=(1, 3), strategy=s) for i, s in enumerate(["A", "B", "A"])]
    records = [_record(0, [1.0, 0.0], "A"), _record(1, [0.0, 1.0], "B", n=1), _record(2, [0.9, 0.1], "A")]
    scalars, _ = summarize(records, [], cfg=cfg, val=val, task=_Task(), tokenizer=_Tok(), c_base=2.0, num_decode_steps=5)
    qbar = np.array([1.9, 1.1]) / 3
    h = -(qbar * np.log(qbar)).sum()
    assert scalars["loss"] == pytest.approx(2.0 + 0.3 * (math.log(2) - h) - 0.7 * h, rel=1e-6)


def _nmi_by_hand(a, b):
    """Arithmetic-mean NMI from the contingency counts (an independent implementation, for the test)."""
    n = len(a)
    pairs = {}
    for u, v in zip(a, b):
        pairs[(u, v)] = pairs.get((u, v), 0) + 1
    pa = {u: a.count(u) / n for u in set(a)}
    pb = {v: b.count(v) / n for v in set(b)}
    mi = sum(c / n * math.log((c / n) / (pa[u] * pb[v])) for (u, v), c in pairs.items())
    h = lambda p: -sum(x * math.log(x) for x in p.values())  # noqa: E731
    return mi / ((h(pa) + h(pb)) / 2)


RECON_TERMS = (
    "reconstruction_loss",
    "distribution_normalized_reconstruction_loss",
    "example_inverse_surprisal_weighted_reconstruction_loss",
    "token_weighted_reconstruction_loss",
    "normalized_concentration_corrected_token_weighted_reconstruction_loss",
    "normalized_inverse_surprisal_token_weighted_reconstruction_loss",
)


def _stratified_set():
    """Six hand-built examples: gold A, A, B, B, C, C; rows 3 and 4 have the same (x, y) (B and C)."""
    gold = ["A", "A", "B", "B", "C", "C"]
    lengths = [2, 2, 3, 4, 4, 5]
    q = [[1.0, 0.0], [1.0, 0.0], [0.0, 1.0], [0.0, 1.0], [0.0, 1.0], [0.6, 0.4]]
    xy = [((3,), (1, 3)), ((4,), (1, 4)), ((3,), (2, 3, 9)), ((5,), (2, 5, 9, 9)), ((5,), (2, 5, 9, 9)), ((6,), (3, 6, 9, 9, 9))]
    val = [SimpleNamespace(id=f"e{i}", x_ids=x, y_ids=y, strategy=g) for i, ((x, y), g) in enumerate(zip(xy, gold))]
    records = []
    for i in range(6):
        rec = _record(i, q[i], gold[i], n=lengths[i])
        rec.cond_nll_N, rec.ref_nll_N = [1.0] * lengths[i], [1.0] * lengths[i]
        # term j of example i = 10 j + i, so a stratum's mean is 10 j + (mean of its indices)
        rec.terms.update({name: 10.0 * j + i for j, name in enumerate(RECON_TERMS)})
        records.append(rec)
    return val, records, gold


def test_summarize_stratified_and_reachable_metrics_are_exact_on_a_hand_built_set(tmp_path):
    from zcvae.eval.evaluation import _write_outputs

    cfg = TrainConfig.from_flat(latent_type="discrete", num_latents=2, seed=0, posterior_entropy_weight=0.0, router_support_weight=0.0,
                                router_marginal_kl_weight=0.0, inter_latent_divergence_weight=0.0, posterior_variance_weight=0.0)
    val, records, gold = _stratified_set()
    scalars, details = summarize(records, [], cfg=cfg, val=val, task=None, tokenizer=_Tok(), c_base=0.0, num_decode_steps=None)
    argmax = [0, 0, 1, 1, 1, 0]
    assert scalars["nmi"] == pytest.approx(_nmi_by_hand(gold, argmax), abs=1e-12)
    # Reachable: the (x, y) of rows 3 and 4 is one input with gold B and C (a tie -> "B"), so the best
    # function of (x, y) labels the rows A A B B B C.
    reachable = _nmi_by_hand(gold, ["A", "A", "B", "B", "B", "C"])
    h_maj = -(2 / 6 * math.log(2 / 6) + 3 / 6 * math.log(3 / 6) + 1 / 6 * math.log(1 / 6))
    assert reachable == pytest.approx((0.5 * math.log(3) + math.log(2) / 3) / ((math.log(3) + h_maj) / 2))
    assert scalars["nmi_reachable"] == pytest.approx(reachable, abs=1e-12)
    assert scalars["nmi_ratio"] == pytest.approx(_nmi_by_hand(gold, argmax) / reachable, abs=1e-12)

    # by strategy
    for s, rows in {"A": [0, 1], "B": [2, 3], "C": [4, 5]}.items():
        p = f"by_strategy/{s}"
        assert scalars[f"{p}/num_examples"] == len(rows)
        for j, name in enumerate(RECON_TERMS):
            assert scalars[f"{p}/{name}"] == pytest.approx(10 * j + sum(rows) / len(rows)), (p, name)
        one_vs_rest = [g == s for g in gold]
        assert scalars[f"{p}/nmi"] == pytest.approx(_nmi_by_hand(one_vs_rest, argmax), abs=1e-12)
    assert scalars["by_strategy/A/latent_usage/0"] == 1.0 and scalars["by_strategy/A/latent_usage/1"] == 0.0
    assert scalars["by_strategy/A/num_used_latents"] == 1 and scalars["by_strategy/A/mi"] == pytest.approx(0.0)
    assert scalars["by_strategy/C/latent_usage/0"] == pytest.approx(0.3)
    assert scalars["by_strategy/C/latent_usage/1"] == pytest.approx(0.7)
    # within C: qbar = (0.3, 0.7); MI = H(qbar) - (H(0,1) + H(0.6,0.4)) / 2
    h = lambda p: -sum(x * math.log(x) for x in p if x > 0)  # noqa: E731
    assert scalars["by_strategy/C/mi"] == pytest.approx(h([0.3, 0.7]) - h([0.6, 0.4]) / 2)
    assert scalars["by_strategy/C/num_used_latents"] == 2

    # by tercile of n = 2 2 3 4 4 5: cut points 2 and 4 -> t1 = {0, 1}, t2 = {2, 3, 4}, t3 = {5}
    for t, rows in {"t1": [0, 1], "t2": [2, 3, 4], "t3": [5]}.items():
        p = f"by_length/{t}"
        assert scalars[f"{p}/num_examples"] == len(rows)
        assert scalars[f"{p}/min_length"] == min(records[i].num_tokens for i in rows)
        assert scalars[f"{p}/max_length"] == max(records[i].num_tokens for i in rows)
        for j, name in enumerate(RECON_TERMS):
            assert scalars[f"{p}/{name}"] == pytest.approx(10 * j + sum(rows) / len(rows)), (p, name)
        usage = np.mean([records[i].posterior_K for i in rows], axis=0)
        assert [scalars[f"{p}/latent_usage/{k}"] for k in (0, 1)] == pytest.approx(usage.tolist())
    assert scalars["by_length/t1/nmi"] == 1.0  # one strategy, one latent
    assert scalars["by_length/t2/nmi"] == 0.0  # B, B, C all on latent 1: no information
    assert scalars["by_length/t3/nmi"] == 1.0

    # user data: no decision positions, the information-gain figure is still written (unmarked)
    assert details["info_gain"]["decision_positions"] is None
    _write_outputs(tmp_path, 3, scalars, details)
    assert (tmp_path / "information_gain.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (tmp_path / "information_gain_step3.png").is_file()


def test_decoding_metrics_and_kappa_by_stratum_are_exact_on_a_hand_built_set():
    """Exact match, parse rate, answer accuracy and kappa per strategy and per length tercile, by hand."""
    cfg = TrainConfig.from_flat(latent_type="discrete", num_latents=2, seed=0, posterior_entropy_weight=0.0, router_support_weight=0.0,
                                router_marginal_kl_weight=0.0, inter_latent_divergence_weight=0.0, posterior_variance_weight=0.0)
    gold = ["A", "A", "B", "B", "A", "B"]
    lengths = [2, 2, 3, 4, 4, 5]  # terciles: cut points 2 and 4 -> t1 = {0, 1}, t2 = {2, 3, 4}, t3 = {5}
    q = [[0.9, 0.1], [0.8, 0.2], [0.1, 0.9], [0.3, 0.7], [0.6, 0.4], [0.2, 0.8]]  # argmax 0 0 1 1 0 1
    gold_y = {"A": (1, 3), "B": (2, 3)}  # x = "7": "A 7" and "B 7" both answer 7
    val = [SimpleNamespace(id=f"e{i}", x_ids=(3,), y_ids=gold_y[g], strategy=g) for i, g in enumerate(gold)]
    records = []
    for i in range(6):
        rec = _record(i, q[i], gold[i], n=lengths[i])
        rec.cond_nll_N, rec.ref_nll_N = [1.0] * lengths[i], [1.0] * lengths[i]
        rec.terms["token_concentration_factor"] = 0.5 + i
        records.append(rec)
    # the first five x are decoded with both latents (example 5 is not decoded); latent 0 writes "A 7",
    # latent 1 "B 7", except: example 1 latent 0 "A 8" (parses, wrong answer, not exact), example 3
    # latent 1 never closes, example 4 latent 1 "B" (no parse)
    generated = {(i, k): ((1, 3) if k == 0 else (2, 3)) for i in range(5) for k in (0, 1)}
    generated[(1, 0)], generated[(4, 1)] = (1, 4), (2,)
    decodes = [DecodeRecord(index=i, latent=k, generated=list(generated[(i, k)]), closed=(i, k) != (3, 1))
               for i in range(5) for k in (0, 1)]
    scalars, _ = summarize(records, decodes, cfg=cfg, val=val, task=_Task(), tokenizer=_Tok(), c_base=1.0, num_decode_steps=4)
    # whole set: exact on the argmax decodes of 0..4 = T F T F T; 8 of 10 parse; 7 of 10 answer 7
    assert scalars["exact_match"] == pytest.approx(3 / 5)
    assert scalars["control/parse_rate"] == pytest.approx(8 / 10) and scalars["answer_accuracy"] == pytest.approx(7 / 10)
    expected = {
        # stratum: (decoded examples, exact match, parse rate, answer accuracy)
        "by_strategy/A": (3, 2 / 3, 5 / 6, 4 / 6),  # examples 0, 1, 4
        "by_strategy/B": (2, 1 / 2, 3 / 4, 3 / 4),  # examples 2, 3 (5 is not decoded)
        "by_length/t1": (2, 1 / 2, 4 / 4, 3 / 4),  # examples 0, 1
        "by_length/t2": (3, 2 / 3, 4 / 6, 4 / 6),  # examples 2, 3, 4
    }
    for prefix, (num, exact, parse, answer) in expected.items():
        assert scalars[f"{prefix}/decode/num_examples"] == num, prefix
        assert scalars[f"{prefix}/exact_match"] == pytest.approx(exact), prefix
        assert scalars[f"{prefix}/control/parse_rate"] == pytest.approx(parse), prefix
        assert scalars[f"{prefix}/answer_accuracy"] == pytest.approx(answer), prefix
    # t3 holds only example 5, which was not decoded: its loss strata exist, its decoding keys do not
    assert scalars["by_length/t3/num_examples"] == 1
    assert not any(k.startswith("by_length/t3/") and k.endswith(("exact_match", "parse_rate", "answer_accuracy")) for k in scalars)
    # kappa per stratum: the mean of 0.5 + i over each stratum's examples, decoded or not
    for prefix, rows in {"by_strategy/A": [0, 1, 4], "by_strategy/B": [2, 3, 5], "by_length/t1": [0, 1],
                         "by_length/t2": [2, 3, 4], "by_length/t3": [5]}.items():
        assert scalars[f"{prefix}/token_concentration_factor"] == pytest.approx(0.5 + sum(rows) / len(rows)), prefix


def test_nmi_ratio_is_one_when_nothing_is_reachable():
    from zcvae.eval.metrics import nmi_ratio, reachable_nmi

    # every input is produced by both strategies equally often: no function of (x, y) tells them apart
    reach, majority = reachable_nmi(["u", "u", "v", "v"], ["a", "b", "a", "b"])
    assert reach == 0.0 and majority == ["a", "a", "a", "a"]
    assert nmi_ratio(0.0, reach) == 1.0
    assert nmi_ratio(0.45, 0.9) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="same length"):
        reachable_nmi(["u"], ["a", "b"])


def test_decision_positions_of_a_late_family_are_counted_in_token_positions(tmp_path):
    from zcvae.data import build_tokenizer, get_task, make_examples
    from zcvae.eval.summary import _decision_positions
    from zcvae.eval.figures import plot_information_gain

    tok = build_tokenizer()
    task = get_task("mul")
    examples = make_examples(task, seed=0, split="val", num_examples=12)
    val = [SimpleNamespace(x_ids=tuple(tok(e.x)["input_ids"]), y_ids=tuple(tok(e.y)["input_ids"])) for e in examples]
    counts = _decision_positions([SimpleNamespace(index=i) for i in range(len(val))], val=val, task=task, tokenizer=tok)
    expected: dict[int, int] = {}
    for e in examples:  # after 'a * b': len(a) + 2 words = tokens
        expected[len(e.x.split())] = expected.get(len(e.x.split()), 0) + 1
    assert counts == expected and len(counts) >= 2
    path = plot_information_gain([0.0, 0.1, None, 0.5], tmp_path / "g.png", decision_positions=counts)
    assert open(path, "rb").read()[:8] == b"\x89PNG\r\n\x1a\n"


# ---------------------------------------------------------------- the real model


@pytest.fixture(autouse=True)
def score_tiny_label_sets():
    """These tests check the metric formulas on hand-built and tiny sets, below the label counts that
    make gold metrics trustworthy (MIN_LABELLED, MIN_LABELLED_PER_STRATEGY); test_faults.py checks those."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(summary_module, "MIN_LABELLED", 1)
        mp.setattr(summary_module, "MIN_LABELLED_PER_STRATEGY", 1)
        yield


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    # A 16-wide model gains nothing from intra-op threads, and on a shared 2-core machine their spinning
    # made each evaluation 20x slower.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def setup(tiny_backbone):
    from zcvae.data import get_task, make_examples
    from zcvae.data.encoding import encode_examples

    backbone = tiny_backbone(hidden_size=16, num_layers=1, intermediate_size=32)
    task = get_task("copy")
    cfg = TrainConfig.from_flat(task="copy", backbone=str(backbone), micro_batch_size=2, num_eval_decode_examples=5, max_new_tokens=5,
                      reference_policy="online", num_latents=3)
    model = _build_model(cfg)
    # 5 examples in micro-batches of 2: a 2-way shard gives rank 0 three examples (two batches) and rank 1
    # two, so rank 1 must run a padding batch, in the example pass and in decoding (all 5 are decoded)
    val, _ = encode_examples(make_examples(task, seed=0, split="val", num_examples=5), model.tokenizer, model.tokens,
                             max_length=cfg.data.max_length, num_z_slots=cfg.slot_tokens)
    assert len(val) == 5
    engine, reference = _engine_and_reference(cfg, model, val)
    return SimpleNamespace(cfg=cfg, model=model, engine=engine, reference=reference, val=val, task=task, backbone=backbone)


def _build_model(cfg):
    from zcvae.data import get_task, make_examples
    from zcvae.model.cvae import ZCVAE
    from zcvae.data.encoding import collate, encode_examples

    model = ZCVAE.from_pretrained(cfg.model.backbone, cfg.model_config(), seed=0)
    calib, _ = encode_examples(make_examples(get_task("copy"), seed=1, split="train", num_examples=8), model.tokenizer,
                               model.tokens, max_length=cfg.data.max_length, num_z_slots=cfg.slot_tokens)
    with torch.no_grad():
        # the router's standardisation statistics come from the first batch that reaches it
        model.encode(collate(calib, model.tokens, num_z_slots=cfg.slot_tokens))
        # give the posterior head and the z rows some signal, so the latent metrics are not all trivial
        g = torch.Generator().manual_seed(1)
        for p in model.router.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    return model


def _engine_and_reference(cfg, model, val):
    from zcvae.engines import EngineConfig, build_engine
    from zcvae.reference.provider import ReferenceProvider

    groups = model.param_groups(lora_lr=1e-3, latent_lr=1e-2, weight_decay=0.0)
    engine = build_engine(EngineConfig(), model=model, param_groups=groups, learning_rate=1e-3)
    reference = ReferenceProvider.build(cfg, engine=engine, model=model, backbone=cfg.model.backbone, train=val, val=val,
                                        passes=1.0)
    return engine, reference


class _CountingModule(torch.nn.Module):
    """The engine's module, with a count of the forwards per mode and the train flag seen by each."""

    def __init__(self, inner, lock=None):
        super().__init__()
        self.inner = inner
        self.lock = lock or threading.Lock()
        self.calls: list[tuple[str, bool]] = []

    def forward(self, *args, **kwargs):
        self.calls.append((kwargs.get("mode"), self.inner.training))
        with self.lock:
            return self.inner(*args, **kwargs)


def _engine_view(engine, module, *, rank, world_size):
    return SimpleNamespace(rank=rank, world_size=world_size, device=engine.device, is_main=rank == 0, module=module,
                           all_reduce=engine.all_reduce)


EXPECTED_KEYS = {
    "loss", "kl", "reconstruction_loss", "distribution_normalized_reconstruction_loss",
    "example_inverse_surprisal_weighted_reconstruction_loss", "token_weighted_reconstruction_loss",
    "normalized_concentration_corrected_token_weighted_reconstruction_loss",
    "normalized_inverse_surprisal_token_weighted_reconstruction_loss", "mi", "router_support", "num_used_latents",
    "router_marginal_kl", "nmi", "ari", "homogeneity", "prior_agreement", "control/purity", "control/matching_accuracy",
    "control/parse_rate", "answer_accuracy", "exact_match", "info_gain/mean", "info_gain/first_token", "num_tokens",
    "num_tokens_min", "num_tokens_max", "c_base",
}


def test_evaluate_returns_every_metric_writes_files_and_restores_train_mode(setup, tmp_path):
    s = setup
    counting = _CountingModule(s.engine.module)
    engine = _engine_view(s.engine, counting, rank=0, world_size=1)
    s.model.train()
    metrics = evaluate(engine=engine, model=s.model, cfg=s.cfg, val=s.val, reference=s.reference, task=s.task,
                       run_dir=tmp_path, step=7)
    assert s.model.training and s.model.peft_model.training  # restored
    assert counting.calls and not any(training for _, training in counting.calls)  # every forward in eval mode
    missing = EXPECTED_KEYS - set(metrics)
    assert not missing, missing
    bad = {k: v for k, v in metrics.items() if not (isinstance(v, float) and math.isfinite(v))}
    assert not bad, bad
    # decoding: 5 examples x K=3 latents, micro-batches of 2 examples -> 3 batches of exactly 5 forwards
    modes = [m for m, _ in counting.calls]
    assert modes.count("decode") == 3 * s.cfg.evaluation.max_new_tokens
    assert modes.count("train") == math.ceil(len(s.val) / s.cfg.optimization.micro_batch_size)
    assert metrics["decode/max_new_tokens"] == 5 and metrics["decode/num_examples"] == 5
    assert 0 <= metrics["nmi"] <= 1 and metrics["mi"] >= 0 and 1 <= metrics["router_support"] <= 3
    assert metrics["c_base"] == pytest.approx(s.reference.c_base.value)

    png = tmp_path / "latents_step7.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (tmp_path / "latents.png").read_bytes() == png.read_bytes()
    gain_png = tmp_path / "information_gain_step7.png"
    assert gain_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (tmp_path / "information_gain.png").read_bytes() == gain_png.read_bytes()
    import json

    details = json.loads((tmp_path / "eval_step7.json").read_text())
    assert details["step"] == 7 and details["metrics"]["mi"] == pytest.approx(metrics["mi"])
    assert np.asarray(details["confusion"]).shape == (3, len(details["confusion_strategy_labels"]))
    assert np.asarray(details["confusion"]).sum() == len(s.val)
    assert set(details["control"]["purity_per_latent"]) == {"0", "1", "2"}
    assert len(details["info_gain"]["mean_by_position"]) == max(ex.num_supervised for ex in s.val)
    assert details["info_gain"]["decision_positions"] == {"0": len(s.val)}  # copy: the marker decides


def test_evaluate_losses_and_mi_match_a_direct_whole_set_forward(setup):
    """The reductions over shards and batches equal one forward over the whole set (independent path)."""
    from zcvae.core.objective import AuxiliaryWeights, per_example_objective
    from zcvae.data.encoding import collate

    s = setup
    metrics = evaluate(engine=s.engine, model=s.model, cfg=s.cfg, val=s.val, reference=s.reference, task=None,
                       run_dir=None, step=0)
    batch = collate(list(s.val), s.model.tokens, num_z_slots=1)
    s.model.eval()
    with torch.no_grad():
        ref = s.reference.ref_nll(s.engine, batch)
        out = s.model.train_forward(batch)
        terms = per_example_objective(out, ref_nll_BN=ref, c_base=s.reference.c_base.value,
                                      recon_config=s.cfg.reconstruction_config(), kl_weight=s.cfg.objective.kl_weight,
                                      aux=AuxiliaryWeights.from_train_config(s.cfg))
    s.model.train()
    for name in ("loss", "kl", "reconstruction_loss", "token_weighted_reconstruction_loss"):
        assert metrics[name] == pytest.approx(float(terms[name].mean()), rel=1e-5, abs=1e-6), name
    q = out.posterior_logits.softmax(-1).double()
    qbar = q.mean(0)
    mi = float(-(qbar * qbar.log()).sum() + (q * q.clamp_min(1e-30).log()).sum(1).mean())
    assert metrics["mi"] == pytest.approx(mi, abs=1e-6)
    assert metrics["num_tokens_max"] == max(ex.num_supervised for ex in s.val)
    # without a parser: no controllability, but exact match of the argmax decode
    assert "control/purity" not in metrics and "exact_match" in metrics


def test_simulated_two_rank_evaluation_on_an_odd_set_matches_one_process(setup, tmp_path):
    s = setup
    single = evaluate(engine=s.engine, model=s.model, cfg=s.cfg, val=s.val, reference=s.reference, task=s.task,
                      run_dir=None, step=0)
    # rank 1 gets its own replica (the same weights): the two "ranks" run concurrently in threads
    replica = copy.deepcopy(s.model)
    # one forward at a time: transformers/peft keep some per-module state that is not thread-safe
    lock = threading.Lock()
    modules = [_CountingModule(s.engine.module, lock), _CountingModule(replica, lock)]
    barrier = threading.Barrier(2, timeout=120)
    slots: list = [None, None]

    def all_gather_for(rank):
        def all_gather_object(out, obj):
            slots[rank] = copy.deepcopy(obj)  # as if pickled
            barrier.wait()
            out[:] = copy.deepcopy(slots)
            barrier.wait()

        return all_gather_object

    results: list = [None, None]
    errors: list = []

    def run(rank):
        try:
            engine = _engine_view(s.engine, modules[rank], rank=rank, world_size=2)
            results[rank] = evaluate(engine=engine, model=s.model, cfg=s.cfg, val=s.val, reference=s.reference,
                                     task=s.task, run_dir=tmp_path, step=1, all_gather_object=all_gather_for(rank))
        except BaseException as err:  # noqa: BLE001 - re-raised in the main thread
            errors.append(err)
            barrier.abort()

    threads = [threading.Thread(target=run, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    assert results[0] == results[1]  # every rank returns the same metrics
    calls = [[m for m, _ in module.calls] for module in modules]
    assert calls[0] == calls[1]  # the same forwards, in order: rank 1 ran padding batches
    assert calls[0].count("train") == 2 and calls[0].count("decode") == 2 * s.cfg.evaluation.max_new_tokens
    assert set(results[0]) == set(single)
    # The stratified and reachable metrics are among the keys compared (the shards split every stratum).
    assert {"nmi_reachable", "nmi_ratio", "by_length/t1/nmi", "by_length/t1/exact_match", "by_length/t1/answer_accuracy",
            "by_length/t1/control/parse_rate", "by_length/t1/token_concentration_factor"} <= set(single)
    assert "closure_rate" in single  # the decodes are sharded too; compared with every other key below
    assert any(k.startswith("by_strategy/") and k.endswith("/latent_usage/2") for k in single)
    for key, value in single.items():
        assert results[0][key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
    assert (tmp_path / "eval_step1.json").is_file()  # rank 0 wrote it


def test_gaussian_evaluation_reports_active_units_and_posterior_mean_decodes(setup):
    s = setup
    cfg = TrainConfig.from_flat(task="copy", backbone=str(s.backbone), micro_batch_size=4, num_eval_decode_examples=2,
                      max_new_tokens=3, reference_policy="online", latent_type="continuous", latent_dim=4,
                      num_latent_samples=2)
    model = _build_model(cfg)
    engine, reference = _engine_and_reference(cfg, model, s.val)
    first = evaluate(engine=engine, model=model, cfg=cfg, val=s.val, reference=reference, task=s.task, run_dir=None, step=0)
    again = evaluate(engine=engine, model=model, cfg=cfg, val=s.val, reference=reference, task=s.task, run_dir=None, step=0)
    assert first == again  # the posterior samples are seeded per example, not drawn from the global RNG
    for key in ("active_units", "active_units_delta", "kl_to_standard_normal", "nmi", "loss", "kl", "exact_match",
                "control/parse_rate", "answer_accuracy", "info_gain/mean"):
        assert key in first and math.isfinite(first[key]), key
    assert first["active_units_delta"] == 0.01 and 0 <= first["active_units"] <= 4
    assert "control/purity" not in first and "mi" not in first


def test_evaluate_run_reproduces_the_trainers_final_evaluation(setup, tmp_path, capsys):
    """train() -> evaluate() at the end -> checkpoint; `zcvae evaluate RUN_DIR` rebuilds it all and agrees."""
    import json

    from zcvae.commands.cli import main

    from zcvae.train.trainer import train

    s = setup
    run_dir = tmp_path / "run"
    cfg = TrainConfig.from_flat(task="copy", backbone=str(s.backbone), output_dir=str(run_dir), num_train_examples=16, num_val_examples=5,
                      max_steps=2, micro_batch_size=4, num_eval_decode_examples=3, max_new_tokens=4, progress_bar=False,
                      reference_policy="online", log_every=1, num_latents=2)
    final = train(cfg)
    assert (run_dir / "eval_step2.json").is_file() and (run_dir / "latents.png").is_file()

    assert main(["evaluate", str(run_dir)]) == 0
    assert "exact_match:" in capsys.readouterr().out
    written = json.loads((run_dir / "eval_metrics.json").read_text())
    assert written["step"] == 2
    metrics = written["metrics"]
    assert set(metrics) == set(final)
    for key, value in final.items():
        assert metrics[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
    # its own details and figure, next to the output; the trainer's files are left alone
    assert (run_dir / "evaluate" / "eval_step2.json").is_file() and (run_dir / "evaluate" / "latents.png").is_file()


def test_evaluate_run_names_a_missing_run_config(tmp_path):
    from zcvae.eval.evaluation import evaluate_run

    with pytest.raises(ValueError, match="run_config.json"):
        evaluate_run(tmp_path)


def test_reachable_nmi_counts_every_strategy_that_renders_a_y():
    from zcvae.eval.metrics import reachable_nmi

    # Three unique inputs: without candidates each is its own majority (NMI 1); with candidates the
    # second is produced by a and b alike, and the tie goes to "a".
    reach, best = reachable_nmi(["u", "v", "w", "z"], ["a", "b", "a", "b"], [["a"], ["a", "b"], ["a"], ["b"]])
    assert best == ["a", "a", "a", "b"]
    assert reach == pytest.approx(_nmi_by_hand(["a", "b", "a", "b"], best))
    assert reachable_nmi(["u", "v", "w", "z"], ["a", "b", "a", "b"])[0] == 1.0


def test_nmi_reachable_on_mul_equals_the_canonical_strategy_nmi():
    """On ``mul`` (direct = repeated iff b = 1), reachable NMI < 1, computed independently from b."""
    from zcvae.data import build_tokenizer, get_task, make_examples
    from zcvae.eval.summary import _equivalent_strategies
    from zcvae.eval.metrics import reachable_nmi

    tok = build_tokenizer()
    task = get_task("mul")
    examples = make_examples(task, seed=0, split="val", num_examples=60)
    val = [SimpleNamespace(x_ids=tuple(tok(e.x)["input_ids"]), y_ids=tuple(tok(e.y)["input_ids"]), strategy=e.strategy)
           for e in examples]
    records = [SimpleNamespace(index=i) for i in range(len(val))]
    candidates = _equivalent_strategies(range(len(val)), records, val=val, task=task, tokenizer=tok)
    gold = [e.strategy for e in examples]
    inputs = [(v.x_ids, v.y_ids) for v in val]
    reach, best = reachable_nmi(inputs, gold, candidates)
    canonical = ["direct" if e.x.endswith("* 1") and s in ("direct", "repeated") else s for e, s in zip(examples, gold)]
    assert any(e.x.endswith("* 1") and s == "repeated" for e, s in zip(examples, gold))  # the set is ambiguous
    assert best == canonical
    assert reach == pytest.approx(_nmi_by_hand(gold, canonical)) and reach < 1.0


def test_closure_rate_is_the_share_of_every_decode_that_emits_the_closing_marker():
    """Every decoded row counts (each latent of each x, the argmax latent or not), unlike exact match."""
    cfg = TrainConfig.from_flat(latent_type="discrete", num_latents=2, seed=0, posterior_entropy_weight=0.0, router_support_weight=0.0,
                                router_marginal_kl_weight=0.0, inter_latent_divergence_weight=0.0, posterior_variance_weight=0.0)
    val = [SimpleNamespace(id=f"e{i}", x_ids=(3,), y_ids=(1, 3), strategy=s) for i, s in enumerate(["A", "B", "A"])]
    records = [_record(0, [1.0, 0.0], "A"), _record(1, [0.0, 1.0], "B"), _record(2, [0.9, 0.1], "A")]
    decodes = [
        DecodeRecord(index=0, latent=0, generated=[1, 3], closed=True),
        DecodeRecord(index=0, latent=1, generated=[2, 4, 4, 4, 4], closed=False),  # repeats instead of stopping
        DecodeRecord(index=1, latent=0, generated=[1, 3, 1, 3, 1], closed=False),
        DecodeRecord(index=1, latent=1, generated=[2, 3, 2, 3, 2], closed=False),
        DecodeRecord(index=2, latent=0, generated=[1, 3], closed=True),
        DecodeRecord(index=2, latent=1, generated=[2], closed=True),
    ]
    scalars, details = summarize(records, decodes, cfg=cfg, val=val, task=_Task(), tokenizer=_Tok(), c_base=1.0, num_decode_steps=5)
    assert scalars["closure_rate"] == pytest.approx(3 / 6)
    assert [s["closed"] for s in details["samples"]] == [d.closed for d in decodes]
    scalars, _ = summarize(records, [], cfg=cfg, val=val, task=_Task(), tokenizer=_Tok(), c_base=1.0, num_decode_steps=None)
    assert "closure_rate" not in scalars  # nothing decoded, nothing to report


def test_the_reference_fingerprint_carries_the_runs_precision_and_seed(setup):
    """The provider reads precision and seed from their sections into the store's fingerprint (they change b or
    the new marker rows); read as flat attributes of the sectioned config they silently became None, so stores
    of other seeds matched and old run directories no longer resumed (c_base fingerprint changed)."""
    from zcvae.reference.provider import ReferenceProvider
    from zcvae.reference.store import fingerprint_backbone, reference_fingerprint

    s = setup
    digests = {}
    for seed in (0, 1):
        cfg = s.cfg.replace(seed=seed)
        digests[seed] = ReferenceProvider.build(cfg, engine=s.engine, model=s.model, backbone=cfg.model.backbone, train=s.val,
                                                val=s.val, passes=1.0).fingerprints["validation"]
    want = reference_fingerprint(backbone=fingerprint_backbone(s.backbone), tokens=s.model.tokens, vocab=s.model.tokenizer,
                                 examples=s.val, extra={"precision": "fp32", "seed": 0}).digest
    assert digests[0] == want and digests[1] != digests[0]
