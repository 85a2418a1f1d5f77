"""Validation metrics: losses, latent usage (MI, support, NMI/ARI), controllability, information gain.

    metrics = evaluate(engine=engine, model=model, cfg=cfg, val=val_enc, reference=reference,
                       task=splits.task, run_dir=run_dir, step=step)       # collective: every rank
    zcvae evaluate RUN_DIR                                                   # -> evaluate_run(RUN_DIR)

Where each part lives: ``eval.records`` (the typed records: ``ExampleRecord`` per validation example,
``DecodeRecord`` per decode; sharding and gathering), ``eval.passes`` (the per-rank forwards, through the
engine's module), ``eval.summary`` (every metric from the gathered records: ``summarize_discrete`` and
``summarize_gaussian``, one per latent type, then the shared parts), ``eval.strata`` (per stratum),
``eval.metrics`` (pure numpy/scikit-learn formulas), ``eval.figures``, ``eval.verdict``; this module runs
them and writes the files.

Exact under data parallelism. Example i of the validation set goes to rank ``i % W`` (rank r takes
r, r+W, ...); each rank's shard is padded to ``ceil(N / W)`` with repeats of example 0 whose results
are discarded, so every rank runs the same number of forwards of the same batch sizes (ZeRO-3 and
FSDP hang otherwise). The per-example records of every rank are exchanged with
``all_gather_object`` and ordered by example index, and every metric is computed once, over the
whole set, on every rank: MI over a per-rank mean of q would be a different, biased quantity. A set
whose size is not divisible by W therefore gives the single-process values, up to the float noise
of a different batch composition.

What is measured (one pass over the validation set, then greedy decoding of a prefix of it):

* Losses: the example mean of the six reconstruction terms, ``kl``, the objective ``loss`` (with the
  final KL weight ``cfg.effective_kl_weight``, the auxiliary weights of the run, and the router's marginal
  terms evaluated on the mean q of the whole set), every diagnostic of ``core.losses.reconstruction_terms``
  reduced as in training (mean, or min/max for ``num_tokens_min``/``num_tokens_max``), and ``c_base``.
  Gaussian latents: the S branch samples use noise drawn from a generator seeded by
  ``(cfg.optimization.seed, example index)``, so the estimate is deterministic and does not depend on the sharding.
* Discrete latents: ``eval.metrics.discrete_latent_metrics`` on q(z|x,y) and p(z|x) of every example.
  Gaussian: ``eval.metrics.gaussian_latent_metrics`` on the posterior means (active units with
  ``delta = ACTIVE_UNITS_DELTA``, KL to N(0, I), NMI/ARI of k-means of the means vs the strategy).
* Decoding, on the first ``cfg.evaluation.num_eval_decode_examples`` validation x: greedy, at most
  ``cfg.evaluation.max_new_tokens`` steps (or the longest validation y + 2) in lock-step on every rank, each row
  stopping at ``</y>`` (a stopped row still runs the forwards, and the loop ends only once every rank's rows have
  stopped, so no rank leaves it early), with a key/value cache: the prompts once, then one token per row.
  Discrete latent: every latent k is decoded for every x, with or without a parser.
  ``control/distinct_outputs`` is the fraction of those x whose decodes differ across the latents
  (``eval.metrics.distinct_outputs``; no parser needed). With a task parser, controllability:
  per-latent purity, best one-to-one latent->strategy matching accuracy, parse rate, answer
  accuracy. ``exact_match`` is the fraction of x whose decode under the posterior's argmax latent
  equals the gold y token for token (and closes with ``</y>``).
  ``closure_rate`` is the share of all decodes (every latent row) that emit ``</y>`` within the steps:
  a decoder whose ``</y>`` row never trained (a backbone without the markers) never closes y.
  Gaussian latent: controllability over latents is undefined, so each x is decoded once with z = the
  posterior mean mu(x, y): ``exact_match`` (reconstruction), and with a parser the parse rate, answer
  accuracy and agreement with the gold strategy of those decodes.
* Information gain per y position, g_t = log p(y_t|x,z) - log p(y_t|x) = b_t - l_t with b the frozen
  z-free reference: discrete z = the posterior's argmax latent (the z that decoding uses; the
  expectation under q would blur a sharp latent with its unused alternatives), Gaussian the mean of
  l_t over the S samples.

* Reachable NMI (with gold strategies, user JSONL included): ``nmi_reachable`` is the NMI against
  the gold strategy of the best function of (x, y), the majority strategy of each identical (x, y)
  token pair (``eval.metrics.reachable_nmi``); it is below 1 when two strategies produce the same y. For
  a built-in family the strategies that render a row's y from its x all count for it, so an
  ambiguous (x, y) is caught even when it occurs once (as in ``mul`` with b = 1); for user data only
  repeated (x, y) pairs reveal ambiguity.
  ``nmi_ratio`` = ``nmi`` / ``nmi_reachable`` (1.0 when ``nmi_reachable`` is 0: nothing to reach).
* Stratified (``eval.strata.stratified_metrics``; the aggregation pilot's confound "does sum only upweight long examples?"):
  ``by_strategy/<strategy>/...`` per gold strategy and ``by_length/t1|t2|t3/...`` per tercile of
  the supervised length n_i (t1 shortest, ties kept together), each with ``num_examples``, the six
  reconstruction terms (``by_strategy/forward/reconstruction_loss``, ...), ``nmi`` (by strategy:
  one-vs-rest, [gold == s] against the assigned latent over all labelled rows; by length: within
  the tercile), ``latent_usage/<k>``, ``num_used_latents`` and ``mi`` (discrete) or
  ``active_units`` (Gaussian), and ``min_length``/``max_length`` for the terciles; kappa
  (``token_concentration_factor``) per stratum too. Decoding by stratum
  (``stratified_decoding_metrics``; the aggregation pilot's confound "length correlates with parse and answer
  correctness"): ``P/exact_match``, ``P/answer_accuracy``, ``P/control/parse_rate`` and
  ``P/decode/num_examples`` over the decoded examples of each stratum P, the same strata.

Outputs: a flat dict of floats, the same on every rank (the trainer's logger prefixes ``eval/``);
on rank 0 ``eval_step{step}.json`` (everything non-scalar: confusion matrix, per-position gain,
per-latent purity, a few decoded samples, the decision positions) and ``latents_step{step}.png`` plus
its copy ``latents.png``, and ``information_gain_step{step}.png`` plus ``information_gain.png`` (mean
b_t - l_t per y position with the task family's decision positions marked; unmarked for user data)
in the run directory.

Shape legend: B examples of a batch, N supervised span positions (y + ``</y>``), K latents,
D Gaussian latent dimension, S Gaussian samples per example, R decode rows, L decode buffer width,
V vocabulary.
"""

from __future__ import annotations

import math
import os
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from zcvae.eval.figures import plot_information_gain, plot_latent_figure
from zcvae.eval.metrics import ACTIVE_UNITS_DELTA
from zcvae.eval.passes import decode_length, decode_pass, example_pass
from zcvae.eval.records import check_complete, gather_records, shard_indices
from zcvae.eval.strata import stratified_decoding_metrics, stratified_metrics
from zcvae.eval.summary import summarize
from zcvae.runs.rundir import RUN_CONFIG, LATENTS_FIGURE, atomic_write, atomic_write_json, eval_step_file, read_run_record
from zcvae.data.encoding import EncodedExample

# Re-exported: the evaluation's public names, whose homes are the modules above.
__all__ = [
    "ACTIVE_UNITS_DELTA",
    "EVAL_METRICS",
    "decode_length",
    "evaluate",
    "evaluate_run",
    "gather_records",
    "shard_indices",
    "stratified_decoding_metrics",
    "stratified_metrics",
    "summarize",
]

EVAL_METRICS = "eval_metrics.json"


# ----------------------------------------------------------------------------------------------
# Files (rank 0)
# ----------------------------------------------------------------------------------------------


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, np.ndarray):
        return _jsonable(value.tolist())
    if isinstance(value, np.generic):
        return _jsonable(value.item())
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def _write_json(path: Path, data: Any) -> None:
    atomic_write_json(path, _jsonable(data))


def _publish_latest(figure: Path, latest: Path) -> None:
    atomic_write(latest, lambda tmp: shutil.copyfile(figure, tmp))  # a viewer never sees a half-written "latest" figure


def _write_outputs(run_dir: Path, step: int, scalars: dict[str, float], details: dict[str, Any]) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    _write_json(run_dir / eval_step_file(step), {"step": step, "metrics": scalars, **details})
    if "confusion" in details and "latent_usage" in details:
        figure = run_dir / f"latents_step{step}.png"
        plot_latent_figure(details["confusion"], details["confusion_latent_labels"], details["confusion_strategy_labels"],
                           details["latent_usage"], figure, title=f"step {step}")
        _publish_latest(figure, run_dir / LATENTS_FIGURE)
    if "info_gain" in details:
        figure = run_dir / f"information_gain_step{step}.png"
        plot_information_gain(details["info_gain"]["mean_by_position"], figure,
                              decision_positions=details["info_gain"].get("decision_positions"),
                              title=f"information gain b_t - l_t by y position, step {step}")
        _publish_latest(figure, run_dir / "information_gain.png")


# ----------------------------------------------------------------------------------------------
# Entry points
# ----------------------------------------------------------------------------------------------


def evaluate(
    *,
    engine,
    model,
    cfg,
    val: Sequence[EncodedExample],
    reference,
    task,
    run_dir: str | os.PathLike | None,
    step: int,
    all_gather_object: Callable[[list, Any], None] | None = None,
    tick: Callable[[int, int], Any] | None = None,
) -> dict[str, float]:
    """Evaluate on the validation set; collective (call on every rank). -> flat dict of floats.

    ``engine`` provides ``module`` (the wrapped module every forward goes through), ``rank``,
    ``world_size``, ``device`` and ``is_main``; ``model`` the ``tokens`` and ``tokenizer``; ``reference``
    ``ref_nll(engine, batch)`` and ``c_base.value``; ``task`` a parser (``parse``, ``answer``) or None.
    The module is put in eval mode and every submodule's mode is restored afterwards. ``run_dir``
    None writes no file. ``all_gather_object`` replaces ``torch.distributed.all_gather_object``.
    ``tick(batches done, total)`` after each batch of either pass, on every rank alike (``zcvae.loop.setup``:
    a stop signal is agreed there, and raises out of the evaluation before anything is written).
    """
    if not val:
        raise ValueError("val: the validation set is empty")
    module = engine.module
    modes = [(m, m.training) for m in module.modules()]
    module.eval()
    try:
        with torch.no_grad():
            scalars, details = _evaluate(engine=engine, model=model, cfg=cfg, val=val, reference=reference, task=task,
                                         all_gather_object=all_gather_object, tick=tick)
    finally:
        for m, training in modes:
            m.training = training
    if run_dir is not None and engine.is_main:
        _write_outputs(Path(run_dir), step, scalars, details)
    return {k: float(v) for k, v in scalars.items() if v is not None}


def _evaluate(*, engine, model, cfg, val, reference, task, all_gather_object, tick=None):
    rank, world = engine.rank, engine.world_size
    indices, keep = shard_indices(len(val), rank=rank, world_size=world)
    num_decode = min(cfg.evaluation.num_eval_decode_examples, len(val))
    batch_size = cfg.optimization.micro_batch_size
    # the batches of both passes, for the progress line (every rank runs as many)
    total = math.ceil(len(indices) / batch_size) + (math.ceil(math.ceil(num_decode / world) / batch_size) if num_decode else 0)
    done = [0]

    def on_batch() -> None:
        done[0] += 1
        if tick is not None:
            tick(done[0], total, "batches")

    local = example_pass(engine=engine, model=model, cfg=cfg, val=val, reference=reference, indices=indices, keep=keep, on_batch=on_batch)
    records = gather_records(local, world_size=world, all_gather_object=all_gather_object)
    check_complete(records, len(val), "example")

    decodes = []
    num_steps = None
    if num_decode > 0:
        num_steps = decode_length(cfg, val)
        if cfg.model.latent_type == "discrete":
            # every latent, also without a parser: control/distinct_outputs compares the decodes across z
            latents, mu_by_index = list(range(cfg.model.num_latents)), None
        else:
            latents, mu_by_index = [None], {r.index: r.mu_D for r in records[:num_decode]}
        d_indices, d_keep = shard_indices(num_decode, rank=rank, world_size=world)
        local_dec = decode_pass(engine=engine, model=model, cfg=cfg, val=val, latents=latents, mu_by_index=mu_by_index,
                                indices=d_indices, keep=d_keep, num_steps=num_steps, on_batch=on_batch)
        decodes = gather_records(local_dec, world_size=world, all_gather_object=all_gather_object)
        check_complete(decodes[::len(latents)], num_decode, "decode")
    return summarize(records, decodes, cfg=cfg, val=val, task=task, tokenizer=model.tokenizer,
                     c_base=reference.c_base.value, num_decode_steps=num_steps)


def evaluate_run(
    run_dir: str | os.PathLike,
    output: str | os.PathLike | None = None,
    *,
    checkpoint: str | os.PathLike | None = None,
    backbone: str | None = None,
    trust_remote_code: bool = False,
) -> dict[str, float]:
    """``zcvae evaluate RUN_DIR``: rebuild a finished run and evaluate it on one process.

    The config comes from ``RUN_DIR/run_config.json`` (key ``config``), the model from the backbone and
    the run's newest complete checkpoint (or ``checkpoint``) via ``zcvae.export.load.load_for_inference``,
    the validation set exactly as in training (``zcvae.data.dataset.load_splits``). Always fp32, on the
    local engine (``zcvae.engines``, as ``engine: local`` trains; its device is the first GPU, else the
    CPU; its optimizer never steps); the reference is run online and c_base is the run's
    recorded value when its aggregation mode and validation fingerprint still match (else recomputed).
    Writes the metrics to ``output`` (default ``RUN_DIR/eval_metrics.json``) and the details and figure
    to ``evaluate/`` next to it, so the files the trainer wrote are never overwritten; the verdict of
    these metrics (``zcvae.eval.verdict``) goes to ``verdict.json`` next to ``output`` (by default
    replacing the trainer's, which it derives from the same checkpoint). A run trained
    with ``trust_remote_code`` needs ``trust_remote_code=True`` here too (the run directory alone
    never lets the backbone's code run).
    """
    from zcvae.runs.checkpoint import read_meta
    from zcvae.runs.rundir import check_writable
    from zcvae.config import TrainConfig
    from zcvae.data.dataset import load_splits
    from zcvae.engines import build_engine
    from zcvae.export.load import load_for_inference, newest_checkpoint, resolve_backbone
    from zcvae.reference.c_base import CBase
    from zcvae.reference.provider import ReferenceProvider
    from zcvae.data.encoding import encode_examples

    from zcvae.cpu import flush_denormals

    flush_denormals()
    run_dir = Path(run_dir)
    record_path = run_dir / RUN_CONFIG
    if not record_path.is_file():
        raise ValueError(f"run_dir: {str(run_dir)!r} has no {RUN_CONFIG} (not a run directory)")
    record = read_run_record(run_dir)
    # The local engine: whatever engine the run used, evaluation needs only its forwards (no backward, so
    # no activation checkpointing); and the online reference, as a store would also compute b of every
    # training example. The frozen reference even for a run whose reference followed the model: its copy of
    # the adapter is in no export (docs/objective.md, "The following reference").
    cfg = TrainConfig.from_dict(dict(record["config"]), source=str(record_path)).replace(
        engine="local", deepspeed_config=None, cpu_offload=False, precision="fp32", gradient_checkpointing=False,
        reference_policy="online", reference_refresh_every=0)

    ckpt = newest_checkpoint(run_dir, checkpoint)
    step = int(read_meta(ckpt).get("step", cfg.optimization.max_steps))
    # before the evaluation, not after it: a read-only run directory must not cost the whole computation
    check_writable(Path(output) if output is not None else run_dir / EVAL_METRICS, what="evaluate output")
    backbone_dir = resolve_backbone(cfg, override=backbone, recorded=record.get("backbone"))
    model = load_for_inference(run_dir, backbone=backbone_dir, checkpoint=str(ckpt), trust_remote_code=trust_remote_code)

    splits = load_splits(cfg)
    val, report = encode_examples(splits.val, model.tokenizer, model.tokens, max_length=cfg.data.max_length, num_z_slots=cfg.slot_tokens)
    if not val:
        raise ValueError(f"no usable validation example ({report.num_skipped} skipped, e.g. {report.skipped[:3]})")
    # the trainer's groups, because the engine checks that they hold every trainable parameter
    groups = model.param_groups(lora_lr=cfg.optimization.lora_learning_rate, latent_lr=cfg.optimization.latent_learning_rate, weight_decay=cfg.optimization.weight_decay)
    engine = build_engine(cfg.engine_config(), model=model, param_groups=groups, learning_rate=cfg.optimization.lora_learning_rate,
                          weight_decay=cfg.optimization.weight_decay)  # moves the model to its device
    stored = record.get("c_base")
    reference = ReferenceProvider.build(
        cfg, engine=engine, model=model, backbone=backbone_dir, train=val, val=val, passes=1.0,
        stored_c_base=CBase.from_dict(stored) if isinstance(stored, dict) else None,
    )
    output = Path(output) if output is not None else run_dir / EVAL_METRICS
    metrics = evaluate(engine=engine, model=model, cfg=cfg, val=val, reference=reference, task=splits.task,
                       run_dir=output.parent / "evaluate", step=step)
    output.parent.mkdir(parents=True, exist_ok=True)
    _write_json(output, {"step": step, "checkpoint": str(ckpt), "metrics": metrics})
    from zcvae.eval.verdict import report_verdict

    report_verdict(output.parent, metrics, record["config"], step=step, source="evaluate", log_lines=False)  # verdict.json next to it; the CLI prints its lines
    return metrics

