"""Tests for zcvae.eval.verdict: the end-of-run verdict on hand-built runs (collapsed, merged, split,
healthy; with and without gold labels), its next steps, and verdict.json.

Each hand-built run is a set of posteriors q(z|x,y) and greedy decodes per latent, turned into the flat
metrics by the evaluation's own ``summarize`` (the numbers the trainer logs), then judged."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest

from zcvae.config import DEFAULT_OBJECTIVE, TrainConfig
from zcvae.eval.evaluation import summarize
from zcvae.eval.records import DecodeRecord, ExampleRecord
from zcvae.eval.verdict import (
    LONGER_RUN,
    delay_end_note,
    SUGGESTED_PRESET,
    MIN_DISTINCT_OUTPUTS,
    MIN_STRATEGY_OUTPUTS,
    MIN_MI_FRACTION,
    VERDICT,
    gold_collapsed,
    verdict_of,
    read_verdict,
    report_verdict,
)


class _Tok:
    def decode(self, ids):
        return " ".join(str(i) for i in ids)


def _config(**overrides):
    """A resolved config as run_config.json holds it (the default objective unless overridden)."""
    values = {"objective": DEFAULT_OBJECTIVE, "num_latents": 2, **overrides}
    return TrainConfig.from_dict(values).to_dict()


def _run_metrics(rows, *, num_latents, labelled=True, outputs=None, num_decoded=None):
    """Flat evaluation metrics of a hand-built run.

    ``rows``: [(gold strategy, q row)], one per validation example (x_i = (i,), y_i = (100 + i,)).
    ``outputs(i, k)``: the token ids decoded for example i under latent k (default: the latent's own
    strategy, so decoding differs across z); the first ``num_decoded`` examples are decoded with every z.
    """
    cfg = TrainConfig.from_flat(latent_type="discrete", num_latents=num_latents, seed=0, posterior_entropy_weight=0.0,
                                router_support_weight=0.0, router_marginal_kl_weight=0.0, inter_latent_divergence_weight=0.0,
                                posterior_variance_weight=0.0)
    val, records = [], []
    for i, (strategy, q) in enumerate(rows):
        gold = strategy if labelled else None
        val.append(SimpleNamespace(id=f"e{i}", x_ids=(i,), y_ids=(100 + i, 7), strategy=gold))
        terms = {"loss": 1.0, "kl": 0.0, "num_tokens": 3.0, "num_tokens_min": 3.0, "num_tokens_max": 3.0, "valid": 1.0}
        records.append(ExampleRecord(index=i, strategy=gold, terms=terms, cond_nll_N=[1.0, 0.5, 0.1], ref_nll_N=[1.5, 0.5, 0.1],
                                     posterior_K=list(q), prior_K=[1.0 / num_latents] * num_latents))
    outputs = outputs or (lambda i, k: [200 + k, 7])
    decodes = [DecodeRecord(index=i, latent=k, generated=outputs(i, k), closed=True)
               for i in range(num_decoded or len(rows)) for k in range(num_latents)]
    scalars, _ = summarize(records, decodes, cfg=cfg, val=val, task=None, tokenizer=_Tok(), c_base=1.0, num_decode_steps=4)
    return scalars


def _sharp(k, num_latents, mass=0.99):
    rest = (1 - mass) / (num_latents - 1)
    return [mass if j == k else rest for j in range(num_latents)]


def _healthy(labelled=True):
    # two strategies, one latent each
    rows = [("fwd", _sharp(0, 2))] * 6 + [("rev", _sharp(1, 2))] * 6
    return _run_metrics(rows, num_latents=2, labelled=labelled)


def _merged(labelled=True):
    # sort3: count and descending share latent 1, latent 2 unused
    rows = [("ascending", _sharp(0, 3))] * 6 + [("count", _sharp(1, 3))] * 6 + [("descending", _sharp(1, 3))] * 6
    return _run_metrics(rows, num_latents=3, labelled=labelled)


def _collapsed(labelled=True):
    # q the same for every example, and every latent decodes the same y
    rows = [("fwd", [0.5, 0.5])] * 6 + [("rev", [0.5, 0.5])] * 6
    return _run_metrics(rows, num_latents=2, labelled=labelled, outputs=lambda i, k: [300 + i, 7])


# ---------------------------------------------------------------- without gold labels


def test_healthy_run_without_labels_is_in_use_with_its_effective_number():
    metrics = _healthy(labelled=False)
    assert "nmi" not in metrics and metrics["control/distinct_outputs"] == 1.0
    verdict = verdict_of(metrics, _config())
    assert verdict["status"] == "in use" and verdict["category"] == "in use (2.0 of 2)"
    assert verdict["verdict"] == "in use (2.0 of 2)" and verdict["gold"] is None and verdict["gold_status"] is None
    assert verdict["information"]["carries_information"] is True
    assert verdict["information"]["mi_fraction"] == pytest.approx(metrics["mi"] / math.log(2))
    assert verdict["latents"]["num_used_latents"] == 2
    assert verdict["latents"]["effective_num_latents"] == pytest.approx(metrics["router_support"])
    assert verdict["decoding"]["distinct_outputs"] == 1.0 and verdict["decoding"]["num_decoded_examples"] == 12
    assert verdict["next_step"] is None
    assert verdict["lines"][0] == "[verdict] in use (2.0 of 2)"
    assert any("differs across z on 100% of 12" in line for line in verdict["lines"])


def test_collapsed_raw_run_without_labels_suggests_the_default_objective():
    metrics = _collapsed(labelled=False)
    assert metrics["mi"] < 1e-9 and metrics["control/distinct_outputs"] == 0.0
    verdict = verdict_of(metrics, _config(objective="raw"))
    assert verdict["status"] == "collapsed" and verdict["verdict"] == "collapsed"
    assert verdict["information"]["carries_information"] is False
    assert f"below {MIN_MI_FRACTION}" in verdict["reasons"][0]
    assert DEFAULT_OBJECTIVE in verdict["next_step"] and "--objective raw" in verdict["next_step"]
    # the same collapse under the default objective points at the late-decision recipe instead
    assert f"--config {SUGGESTED_PRESET}" in verdict_of(metrics, _config())["next_step"]
    # and with the late-decision parts on already, at more steps or the sum-mode variant
    recipe = _config(posterior_pooling="mean", router_support_weight=1.0, reconstruction_weight_scale="tokens")
    assert "--max-steps 900" in verdict_of(metrics, recipe)["next_step"] and "--config late-decisions" in verdict_of(metrics, recipe)["next_step"]
    assert f"--max-steps {LONGER_RUN * 40}" in verdict_of(metrics, {**recipe, "max_steps": 40})["next_step"]
    # a collapsed sum-mode run with the parts on is pointed to the mean-mode default, not back to itself
    in_sum = verdict_of(metrics, {**recipe, "reconstruction_loss_token_aggregation_mode": "sum"})["next_step"]
    assert "--max-steps 900" in in_sum and "--config late-decisions" not in in_sum and f"--config {SUGGESTED_PRESET}" in in_sum


def test_merged_run_without_labels_is_in_use_with_a_hedged_next_step():
    metrics = _merged(labelled=False)
    verdict = verdict_of(metrics, _config(num_latents=3))
    # a merge cannot be told from a spare latent: in use, 2 of 3, and no "merged"
    assert verdict["status"] == "in use" and "merged" not in verdict["verdict"]
    assert verdict["latents"]["num_used_latents"] == 2
    k_eff = metrics["router_support"]
    assert 1.8 < k_eff < 2.0 and verdict["verdict"] == f"in use ({k_eff:.1f} of 3)"
    assert verdict["next_step"].startswith("2 of 3 latents in use") and f"--config {SUGGESTED_PRESET}" in verdict["next_step"]


def test_decoder_that_ignores_z_counts_as_collapsed_even_when_q_separates():
    rows = [("fwd", _sharp(0, 2))] * 6 + [("rev", _sharp(1, 2))] * 6
    metrics = _run_metrics(rows, num_latents=2, labelled=False, outputs=lambda i, k: [300 + i, 7])
    assert metrics["mi"] > 0.5 and metrics["control/distinct_outputs"] == 0.0
    verdict = verdict_of(metrics, _config())
    assert verdict["status"] == "collapsed" and "ignores z" in verdict["reasons"][0]
    # a run from before control/distinct_outputs existed is judged on MI alone
    older = {k: v for k, v in metrics.items() if k != "control/distinct_outputs"}
    assert verdict_of(older, _config())["status"] == "in use"


def test_distinct_outputs_thresholds_are_fractions_of_x():
    rows = [("fwd", _sharp(0, 2))] * 10 + [("rev", _sharp(1, 2))] * 10

    def changed_on(n):  # z changes the output of the first n of the 20 x
        return _run_metrics(rows, num_latents=2, labelled=False, outputs=lambda i, k: [200 + k, 7] if i < n else [300 + i, 7])

    # 1 x in 20 (5%): at the bar of a decoder that ignores z, not below it; but z steers y on too few x for strategies
    at_ignore_bar = changed_on(1)
    assert at_ignore_bar["control/distinct_outputs"] == pytest.approx(MIN_DISTINCT_OUTPUTS)
    verdict = verdict_of(at_ignore_bar, _config())
    assert verdict["status"] == "collapsed" and "ignores z" not in verdict["reasons"][0]
    assert "only 5.0% of x (< 67%): z steers a part of y" in verdict["reasons"][0]
    # half the x (add and search at 300 steps decoded 46-54% apart): collapsed, with the collapse's next step
    half = verdict_of(changed_on(10), _config())
    assert half["status"] == "collapsed" and "only 50% of x" in half["reasons"][0] and half["next_step"] is not None
    # from two thirds of x on (14 of 20 = 70%), z is in use
    assert changed_on(14)["control/distinct_outputs"] >= MIN_STRATEGY_OUTPUTS > changed_on(13)["control/distinct_outputs"]
    assert verdict_of(changed_on(14), _config())["status"] == "in use" and verdict_of(changed_on(13), _config())["status"] == "collapsed"


def test_k1_and_missing_metrics():
    k1 = verdict_of({"mi": 0.0, "kl": 0.0, "num_used_latents": 1.0, "router_support": 1.0}, _config(num_latents=1))
    assert k1["status"] == "collapsed" and "--num-latents" in k1["next_step"]
    unknown = verdict_of({"kl": 0.3, "mi": None}, _config())
    assert unknown["status"] == "unknown" and unknown["information"]["carries_information"] is None
    assert "no MI" in unknown["reasons"][0]


# ---------------------------------------------------------------- with gold labels


def test_healthy_run_with_labels_is_aligned():
    metrics = _healthy()
    verdict = verdict_of(metrics, _config())
    assert verdict["gold_status"] == "aligned" and verdict["verdict"] == "in use (2.0 of 2); gold: aligned"
    assert verdict["gold"]["nmi"] == pytest.approx(1.0) and verdict["gold"]["merged"] == [] and verdict["gold"]["split"] == []
    assert verdict["next_step"] is None
    assert gold_collapsed(metrics) is False


def test_merged_run_with_labels_names_the_pair_and_the_recipe():
    metrics = _merged()
    verdict = verdict_of(metrics, _config(num_latents=3))
    assert verdict["gold_status"] == "merged" and verdict["verdict"].endswith("; gold: merged")
    assert verdict["gold"]["merged"] == [{"latent": 1, "strategies": ["count", "descending"]}]
    assert verdict["gold"]["num_strategies"] == 3
    assert verdict["gold"]["latents_in_use"] == [0, 1] and verdict["gold"]["unused_latents"] == [2]
    assert verdict["gold"]["latent_purity"]["1"] == pytest.approx(0.5, abs=0.01) and verdict["gold"]["pure"] is False
    assert f"--config {SUGGESTED_PRESET}" in verdict["next_step"]
    assert any("count+descending share latent 1" in line for line in verdict["lines"])
    # the same merge under the default (mean pooling and support on already) points to the sum-mode variant
    under_default = verdict_of(metrics, _config(num_latents=3, posterior_pooling="mean", router_support_weight=1.0,
                                           reconstruction_weight_scale="tokens"))
    assert "--config late-decisions" in under_default["next_step"] and "K is the number of strategies" in under_default["next_step"]
    # pooling and support without a weighted decision (raw+dist in mean mode: what split the user family late at
    # random) still lack a part of the default, so the default is the next step
    no_decision_weight = verdict_of(metrics, _config(num_latents=3, objective="raw+dist", posterior_pooling="mean",
                                                router_support_weight=1.0, reconstruction_weight_scale="tokens"))
    assert f"--config {SUGGESTED_PRESET}" in no_decision_weight["next_step"]
    # sum mode weighs a late decision by the example's length: with pooling and support, the recipe is on
    sum_recipe = verdict_of(metrics, _config(num_latents=3, objective="raw+dist", posterior_pooling="mean", router_support_weight=1.0,
                                        reconstruction_loss_token_aggregation_mode="sum"))
    assert "are on already" in sum_recipe["next_step"]
    # ... and its next step is the other variant, the mean-mode default, not the preset the run already is
    assert "--config late-decisions" not in sum_recipe["next_step"] and f"--config {SUGGESTED_PRESET}" in sum_recipe["next_step"]
    # fewer latents than strategies: the merge is forced, and K is what to change
    rows = [("a", _sharp(0, 2))] * 4 + [("b", _sharp(1, 2))] * 4 + [("c", _sharp(1, 2))] * 4
    forced = verdict_of(_run_metrics(rows, num_latents=2), _config())
    assert forced["gold_status"] == "merged" and forced["next_step"].startswith("--num-latents 3")


def test_split_run_with_labels_is_not_a_merge_and_needs_no_next_step():
    # copy with K = 3: rev spread evenly over latents 1 and 2, each latent pure
    rows = [("fwd", _sharp(0, 3))] * 8 + [("rev", _sharp(1, 3))] * 4 + [("rev", _sharp(2, 3))] * 4
    metrics = _run_metrics(rows, num_latents=3)
    assert metrics["homogeneity"] == pytest.approx(1.0) and metrics["nmi"] < 0.9
    verdict = verdict_of(metrics, _config(num_latents=3))
    assert verdict["gold_status"] == "split" and verdict["gold"]["split"] == [{"strategy": "rev", "latents": [1, 2]}]
    assert verdict["gold"]["merged"] == [] and verdict["next_step"] is None
    # every latent in use holds one strategy: the clean split that spare latents are allowed (issue 20, item 2)
    assert verdict["gold"]["pure"] is True and verdict["verdict"] == "in use (2.8 of 3); gold: split (pure)"
    assert verdict["gold"]["unused_latents"] == [] and min(verdict["gold"]["latent_purity"].values()) > 0.98


def test_spare_latents_unused_or_split_impurely_are_told_apart():
    # K = 4 for two strategies: the spare latents 2 and 3 stay unused
    rows = [("fwd", _sharp(0, 4))] * 8 + [("rev", _sharp(1, 4))] * 8
    spare = verdict_of(_run_metrics(rows, num_latents=4), _config(num_latents=4))
    assert spare["gold_status"] == "aligned" and spare["gold"]["unused_latents"] == [2, 3] and spare["gold"]["pure"] is True
    assert spare["latents"]["num_used_latents"] == 2 and spare["next_step"] is None
    assert any("unused latents 2, 3" in line for line in spare["lines"])
    # rev split over latents 1 and 2, but latent 2 also takes a share of fwd: not pure
    rows = [("fwd", _sharp(0, 4))] * 8 + [("fwd", _sharp(2, 4))] * 2 + [("rev", _sharp(1, 4))] * 5 + [("rev", _sharp(2, 4))] * 5
    metrics = _run_metrics(rows, num_latents=4)
    impure = verdict_of(metrics, _config(num_latents=4))
    assert metrics["homogeneity"] < 0.95
    assert impure["gold"]["split"] == [{"strategy": "rev", "latents": [1, 2]}] and impure["verdict"].endswith("gold: split (impure)")
    assert impure["gold"]["latent_purity"]["2"] == pytest.approx(5 / 7, abs=0.01)


def test_collapsed_run_with_labels_agrees_with_gold():
    metrics = _collapsed()
    verdict = verdict_of(metrics, _config(objective="raw"))
    assert metrics["nmi"] < 0.1 and gold_collapsed(metrics) is True
    assert verdict["status"] == "collapsed" and verdict["gold_status"] == "collapsed" and verdict["verdict"] == "collapsed"
    assert DEFAULT_OBJECTIVE in verdict["next_step"]


def test_unaligned_latent_is_mixed_and_soft_leak_is_not_a_split():
    # each strategy mostly in its own latent but far from clean: no merge, no split, nmi_ratio < 0.9
    rows = ([("a", _sharp(0, 2))] * 9 + [("a", _sharp(1, 2))] * 1 + [("b", _sharp(1, 2))] * 7 + [("b", _sharp(0, 2))] * 3)
    metrics = _run_metrics(rows, num_latents=2)
    assert 0.1 < metrics["nmi"] < 0.9
    verdict = verdict_of(metrics, _config())
    assert verdict["gold_status"] == "mixed" and verdict["gold"]["split"] == [] and verdict["gold"]["merged"] == []
    assert f"--config {SUGGESTED_PRESET}" in verdict["next_step"]


def test_gold_without_per_strategy_usage_falls_back_on_nmi_ratio():
    metrics = {"mi": 0.69, "kl": 0.69, "num_used_latents": 2.0, "router_support": 2.0, "nmi": 0.95, "nmi_ratio": 0.95}
    assert verdict_of(metrics, _config())["gold_status"] == "aligned"
    assert verdict_of({**metrics, "nmi_ratio": 0.5}, _config())["gold_status"] == "mixed"
    # z in use (MI high) but not along the strategies: gold collapsed, and the step for a merge, not the raw term's
    unaligned = verdict_of({**metrics, "nmi": 0.05, "nmi_ratio": 0.05}, _config(objective="raw"))
    assert unaligned["verdict"] == "in use (2.0 of 2); gold: collapsed" and f"--config {SUGGESTED_PRESET}" in unaligned["next_step"]


def test_gaussian_latent_is_judged_by_active_units():
    config = _config(latent_type="continuous", latent_dim=8)
    used = verdict_of({"active_units": 3.0, "kl": 1.2, "nmi": 0.97, "nmi_ratio": 0.97}, config)
    assert used["verdict"] == "in use (3 of 8); gold: aligned" and used["decoding"]["distinct_outputs"] is None
    dead = verdict_of({"active_units": 0.0, "kl": 1e-5, "nmi": 0.0}, config)
    assert dead["status"] == "collapsed" and dead["verdict"] == "collapsed" and dead["next_step"]


# ---------------------------------------------------------------- verdict.json


def test_report_verdict_writes_json_and_logs_every_line(tmp_path, logged):
    metrics = {**_merged(), "some_nan": float("nan"), "kl": None}
    verdict = report_verdict(tmp_path, metrics, _config(num_latents=3), step=300, source="train")
    assert logged == verdict["lines"] and logged[0].startswith("[verdict] in use")
    text = (tmp_path / VERDICT).read_text()
    assert VERDICT == "verdict.json" and "NaN" not in text
    on_disk = json.loads(text)
    assert on_disk == read_verdict(tmp_path)
    assert on_disk["verdict"] == verdict["verdict"] and on_disk["step"] == 300 and on_disk["source"] == "train"
    assert on_disk["thresholds"]["min_mi_fraction"] == MIN_MI_FRACTION
    # a missing or broken file reads as None (a reader then recomputes it)
    (tmp_path / VERDICT).write_text("{not json")
    assert read_verdict(tmp_path) is None and read_verdict(tmp_path / "absent") is None


# ---------------------------------------------------------------- at the end of the KL delay


def test_delay_end_note_warns_when_q_separates_but_the_decoder_does_not_read_z():
    recipe = _config(posterior_pooling="mean", router_support_weight=1.0, reconstruction_weight_scale="tokens")
    # q one latent per strategy (MI log 2), every latent decoding the same y: add at 300 steps, step 181
    unread = _run_metrics([("fwd", _sharp(0, 2))] * 6 + [("rev", _sharp(1, 2))] * 6, num_latents=2,
                          outputs=lambda i, k: [300 + i, 7])
    note = delay_end_note(unread, recipe, step=181)
    assert note.startswith("[kl] the KL delay ends after step 181: MI ") and "differs across z on 0% of x (< 5%)" in note
    assert "the decoder does not read z yet" in note and "--max-steps 900" in note
    # just under the bar: never printed as the bar itself
    almost = delay_end_note({**unread, "control/distinct_outputs": 0.049}, recipe, step=181)
    assert "differs across z on 4.9% of x (< 5%)" in almost
    # read on some x only (add at step 181: about half): the two-thirds bar's warning, with the same advice
    partly = delay_end_note({**unread, "control/distinct_outputs": 0.5}, recipe, step=181)
    assert "differs across z on 50% of x (< 67%). The decoder reads z on some x only" in partly and "--max-steps 900" in partly
    assert delay_end_note({**unread, "control/distinct_outputs": 0.7}, recipe, step=181).endswith("differs across z on 70% of x")
    # the raw control's dilution is not a matter of steps: the line points to the default, as its verdict does
    raw = delay_end_note(unread, _config(objective="raw"), step=91)
    assert DEFAULT_OBJECTIVE in raw and "--max-steps" not in raw
    # decoding follows z: the plain line, no advice
    read = delay_end_note(_healthy(), recipe, step=181)
    assert read.endswith("differs across z on 100% of x")
    # nothing in q yet
    assert delay_end_note(_collapsed(), recipe, step=181).endswith("z carries almost nothing yet (MI < 0.1 x log K), and the KL usually keeps it so")
    # no per-latent decodes to read: nothing to say
    assert delay_end_note(unread, {**recipe, "latent_type": "continuous"}, step=181) is None
