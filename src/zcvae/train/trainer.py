"""The CVAE run: set-up, the CVAE objective on the shared step loop (zcvae.loop), the final evaluation.

    zcvae train --task sort --output-dir runs/a                          # one process
    torchrun --nproc_per_node 2 -m zcvae train --engine fsdp2 ...        # one node, two ranks
    torchrun --nproc_per_node 2 -m zcvae train --engine deepspeed --deepspeed-config ds_configs/zero3.json

Exactness across world sizes and accumulation: the objective of one optimizer step is the example
mean over the global batch (all ranks, all micro-batches). The number of valid examples is all-reduced
*before* the forwards, each micro-batch contributes ``local_sum / global_count``, and the engine undoes
its own implicit averaging, so (world 1, accumulation 4) and (world 2, accumulation 2) take the same
step. The trainer never branches on the engine type.
"""

from __future__ import annotations

import dataclasses
import logging
import random
from pathlib import Path

import numpy as np
import torch

from zcvae.config import TrainConfig, kl_delay_end, kl_weight_at, lr_factor_at, resolve_scale_factors, train_run_name
from zcvae.backbone.convert import conversion_record, describe_conversion, resolve_backbone_path
from zcvae.backbone.stage_config import stage_steps
from zcvae.data.dataset import load_splits, passes_over_data
from zcvae.cpu import cpu_threads, flush_denormals, limit_heap_retention
from zcvae.distributed import dist_info, init_distributed
from zcvae.runs.rundir import CHECKPOINTS, METRICS, RUN_CONFIG, atomic_write_json, check_output_dir_path, prepare_run_dir, truncate_metrics
from zcvae.runs.record import resume_changes_record, resume_note, run_metadata
from zcvae.runs.lock import RunLock
from zcvae.train.faults import fault_injection_from_env
from zcvae.train.grad_probe import PROBE_SPLIT, GradientProbe
from zcvae.train.kl_delay import KL_DELAY_SPLIT, READ_PROBE_EXAMPLES, KLDelay, check_delay
from zcvae.loop import LoopSettings, MicroLoss, RunLogger, run_loop
from zcvae.loop.guards import StopSignals
from zcvae.loop.setup import SetupPhases
from zcvae.core.objective import AuxiliaryWeights, marginal_router_terms, per_example_objective
from zcvae.data.encoding import collate, encode_examples, encoded_fingerprint

logger = logging.getLogger(__name__)


# --------------------------------------------------------------------------- the loop
def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def train(cfg: TrainConfig, *, overwrite: bool = False, allow_changes: tuple[str, ...] = ()) -> dict[str, float]:
    """Train one run; returns the final evaluation metrics (on every rank).

    ``overwrite``: delete an earlier run in ``cfg.run.output_dir`` (after saying so) instead of refusing it.
    ``allow_changes``: objective fields a resume may change (``--resume-allow-change``), recorded in
    run_config.json with the step they apply from.

    Rank 0 holds the run directory's lock (zcvae.runs.lock) for the whole run, taken before anything
    there is read or written and before the model loads; SIGTERM/SIGUSR1 become a stop at the end of the
    current step (zcvae.loop.guards). Raises :class:`~zcvae.loop.guards.RunStopped` when the run
    diverged or was preempted.
    """
    run_dir = Path(cfg.run.output_dir)
    check_output_dir_path(run_dir)
    # the handlers first: once the lock file names this process, a SIGTERM is already a clean stop
    with StopSignals() as signals:
        lock = RunLock(run_dir) if dist_info().rank == 0 else None
        if lock is not None:
            lock.acquire()
        try:
            return _train(cfg, overwrite=overwrite, allow_changes=tuple(allow_changes), signals=signals)
        finally:
            if lock is not None:
                lock.release()


def _train(cfg: TrainConfig, *, overwrite: bool, allow_changes: tuple[str, ...], signals: StopSignals) -> dict[str, float]:
    """The run in named steps, in this order (each consumes the random state the next one expects)."""
    from zcvae.engines import build_engine
    from zcvae.reference.provider import ReferenceProvider

    # 1. processes, seeds, run directory
    info, cpu, follower = _start_processes(follow_cores=cfg.run.follow_cores)
    seed_everything(cfg.optimization.seed)
    if cfg.run.run_name is None:  # a copy: the caller's config stays as given
        cfg = cfg.replace(run_name=train_run_name(cfg.to_dict()))
    run_dir = Path(cfg.run.output_dir)
    prepare_run_dir(run_dir, resume=cfg.run.resume is not None, overwrite=overwrite, is_main=info.rank == 0,
                    keep={"backbone": cfg.model.backbone, "train_data": cfg.data.train_data, "val_data": cfg.data.val_data})

    # setup: each phase named, timed and stoppable within seconds by SIGTERM/SIGUSR1 (zcvae.loop.setup)
    phases = SetupPhases.for_process_group(signals)
    if cfg.run.resume is not None:
        phases.hint = "nothing written; the same command with --resume continues from its checkpoint"

    # 2. data and backbone
    with phases.phase("loading the backbone"):
        data = _load_data_and_model(cfg, cpu=cpu)
    cfg, model, train_enc, val_enc = data.cfg, data.model, data.train_enc, data.val_enc

    # 3. engine and optimizer (a sharded build gets its weights here); fail loudly if a latent parameter would not train
    if cfg.objective.reference_refresh_every:
        model.add_reference_adapter()  # the following reference's frozen copy, before the engine moves the model
    groups = model.param_groups(lora_lr=cfg.optimization.lora_learning_rate, latent_lr=cfg.optimization.latent_learning_rate, weight_decay=cfg.optimization.weight_decay)
    model.check_trainable(p for g in groups for p in g["params"])
    peak_lrs = [g["lr"] for g in groups]  # before the engine: the schedule sets each group's lr in place

    def materialize() -> None:
        with phases.phase("writing the weights into the shards"):
            model.materialize_weights(tick=phases.tick)

    with phases.phase("building the engine"):
        engine = build_engine(cfg.engine_config(), model=model, param_groups=groups, learning_rate=cfg.optimization.lora_learning_rate,
                              weight_decay=cfg.optimization.weight_decay, materialize=materialize)
    with phases.phase("calibrating the router"):
        # through the engine: a sharded model's weights are whole only inside its forward
        engine.module(data.calibration, mode="calibrate")

    # 4. z-free reference statistics and c_base (mode-matched, fingerprinted)
    global_batch = cfg.optimization.micro_batch_size * cfg.optimization.gradient_accumulation_steps * info.world_size
    passes = passes_over_data(num_examples=len(train_enc), global_batch_size=global_batch, max_steps=cfg.optimization.max_steps)
    reference = ReferenceProvider.build(
        cfg, engine=engine, model=model, backbone=data.backbone, train=train_enc, val=val_enc, passes=passes, phases=phases
    )
    data.health.check_c_base(reference.c_base, val=val_enc, examples=data.splits.val, task=data.splits.task)  # warns only
    data.health.check_weights(reference.degenerate_weights)  # warns only: examples whose b leaves pi (nearly) uniform

    # 5. resume (or not), then run_config.json
    with phases.phase("resuming from the checkpoint" if cfg.run.resume is not None else "opening the checkpoints"):
        checkpoints, state = _open_checkpoints(cfg, engine=engine, reference=reference, allow_changes=allow_changes,
                                               train_data=data.train_data, is_main=info.rank == 0)
    if state is not None and state["step"] == cfg.optimization.max_steps and state["step"] > 0:
        from zcvae.runs.rundir import final_eval_metrics

        logger.info(f"[resume] checkpoint {state['checkpoint']!r} is already at max_steps {cfg.optimization.max_steps}: the run is complete, nothing written")
        return final_eval_metrics(run_dir)[1]
    if info.rank == 0:
        metadata = run_metadata(cfg, data.backbone, info.world_size, data.splits, data.train_report, data.val_report, reference,
                                backbone_conversion=conversion_record(data.backbone), cpu=cpu, reference_health=data.health.to_dict())
        metadata.update(resume_changes_record(run_dir, state))
        atomic_write_json(run_dir / RUN_CONFIG, metadata)

    # 6. the loop (zcvae.loop), with the CVAE objective of one micro-batch
    final = _run_loop(cfg, engine=engine, model=model, data=data, peak_lrs=peak_lrs,
                      group_names=[g["name"] for g in groups], reference=reference, checkpoints=checkpoints,
                      start_step=0 if state is None else state["step"], trainer_state=None if state is None else (state["meta"] or {}).get("trainer_state"),
                      trainer_tensors={} if state is None else state.get("trainer_tensors", {}),
                      world_size=info.world_size, is_main=info.rank == 0, signals=signals, phases=phases, follower=follower)
    _finish(cfg, final, run_dir=run_dir, is_main=info.rank == 0)
    return final


def _start_processes(*, follow_cores: bool = False):
    """Start the process group, set the CPU threads (``follow_cores``: ``--follow-cores``); returns (dist info, the cpu record, the thread follower or
    None)."""
    # No group at world size 1 yet: the engines that need one even alone start it themselves.
    info = init_distributed()
    flushes = flush_denormals()
    # a fixed count unless --follow-cores (zcvae.cpu.cpu_threads: the count changes the last digits); the ranks
    # of one job always keep theirs (torchrun sets OMP_NUM_THREADS=1 anyway)
    follow = follow_cores and info.world_size == 1
    follower, threads_from = cpu_threads(follow=follow) if info.device.type == "cpu" else (None, "torch default")
    cpu = {"flush_denormals": flushes, "num_threads": torch.get_num_threads(), "num_threads_from": threads_from}
    return info, cpu, follower


@dataclasses.dataclass
class _RunData:
    """What step 2 of a run loads: the config (with the resolved KL factor), splits, backbone, model, encodings."""

    cfg: TrainConfig
    splits: object
    backbone: str
    health: object
    model: object
    train_enc: list
    val_enc: list
    train_report: object
    val_report: object
    calibration: object  # the batch the router's statistics come from (calibrated through the engine)
    train_data: dict  # encoded_fingerprint(train_enc): each checkpoint records it, a resume on other data is refused


def _load_data_and_model(cfg: TrainConfig, *, cpu: dict) -> _RunData:
    """Splits, backbone (marker check before its weights load), model, encoded examples, the KL factor, calibration.
    ``cpu``: the run's CPU record, which gets ``heap_limit`` (glibc's mmap threshold set for this backbone and engine, 0 for none)."""
    from zcvae.engines import sharded_loading
    from zcvae.model.cvae import ZCVAE
    from zcvae.reference.health import check_markers

    splits = load_splits(cfg)
    backbone = resolve_backbone_path(cfg.model.backbone) if cfg.model.backbone else default_backbone(cfg)
    if (conversion := conversion_record(backbone)) is not None:
        logger.info(f"[backbone] {backbone}: {describe_conversion(conversion)}")
    # exits 2 (ValueError) on a backbone without the template markers, before its weights load
    health = check_markers(cfg, backbone, stage_steps=stage_steps(backbone))
    # ZeRO-3 and FSDP2 build the model without its weights (each rank later keeps its shard); the others load it whole
    loading = sharded_loading(cfg.engine_config())
    # before the weights load: a large backbone's freed tensors go back to the system (zcvae.cpu.limit_heap_retention)
    cpu["heap_limit"] = limit_heap_retention(weight_bytes=sum(f.stat().st_size for f in Path(backbone).glob("*.safetensors")),
                                             sharded=loading is not None)
    model = ZCVAE.from_pretrained(backbone, cfg.model_config(), seed=cfg.optimization.seed, loading=loading)
    if loading is not None:
        logger.info(f"[backbone] sharded load ({cfg.engine.engine}): weights stream from rank 0 once the engine has sharded the model; "
                    f"frozen base in {cfg.resolved_base_dtype}")
    check_limits(cfg, model, backbone=backbone)
    num_slots = cfg.slot_tokens
    train_enc, train_report = encode_examples(splits.train, model.tokenizer, model.tokens, max_length=cfg.data.max_length, num_z_slots=num_slots)
    val_enc, val_report = encode_examples(splits.val, model.tokenizer, model.tokens, max_length=cfg.data.max_length, num_z_slots=num_slots)
    for name, report in (("train", train_report), ("val", val_report)):
        report_encoding(name, report)
    if not train_enc or not val_enc:
        raise ValueError(f"no usable example left: train {len(train_enc)}, val {len(val_enc)} (see the skip messages above)")
    cfg = resolve_scale_factors(cfg, mean_num_tokens=float(np.mean([ex.num_supervised for ex in val_enc])))
    calibration = collate(train_enc[: min(len(train_enc), 256)], model.tokens, num_z_slots=num_slots)
    return _RunData(cfg=cfg, splits=splits, backbone=backbone, health=health, model=model, train_enc=train_enc, val_enc=val_enc,
                    train_report=train_report, val_report=val_report, calibration=calibration, train_data=encoded_fingerprint(train_enc))


def report_encoding(name: str, report) -> None:
    """Say what encoding skipped, truncated or could not tokenize; ValueError when most tokens are unknown."""
    if report.num_skipped:
        logger.info(f"[data] {name}: skipped {report.num_skipped} of {report.num_examples} examples, e.g. {report.skipped[:3]}")
    if report.num_x_truncated:
        logger.info(f"[data] {name}: truncated x of {report.num_x_truncated} examples from the left")
    if report.num_unknown_tokens:
        logger.info(f"[data] {name}: {report.num_unknown_tokens} of {report.num_tokens} tokens are unknown to the tokenizer "
                    f"(<unk>), e.g. in example {report.unknown_example!r}")
        if report.num_unknown_tokens > report.num_tokens / 2:
            raise ValueError(f"{name} data: {report.num_unknown_tokens} of {report.num_tokens} tokens are unknown (<unk>, e.g. "
                             f"example {report.unknown_example!r}): the backbone's tokenizer does not fit the data")


def _open_checkpoints(cfg: TrainConfig, *, engine, reference, allow_changes, train_data: dict, is_main: bool):
    """The checkpoint manager, and the resumed state (None on a fresh run); metrics past the resumed step are dropped."""
    from zcvae.runs.checkpoint import CheckpointManager

    run_dir = Path(cfg.run.output_dir)
    checkpoints = CheckpointManager(run_dir / CHECKPOINTS, keep=cfg.run.keep_last_checkpoints, is_main=is_main,
                                    on_event=fault_injection_from_env())
    if cfg.run.resume is None:
        return checkpoints, None
    state = checkpoints.load(engine, cfg.run.resume, config=cfg, c_base=reference.c_base, allow_changes=allow_changes,
                             train_data=train_data)
    start_step = state["step"]
    if start_step > cfg.optimization.max_steps:
        # training nothing and saving the later weights under an earlier step label would corrupt the run
        raise ValueError(
            f"resume: checkpoint {state['checkpoint']!r} is at step {start_step}, past max_steps {cfg.optimization.max_steps}; "
            f"resume with --max-steps {start_step} or more, or start a new run in another --output-dir"
        )
    if start_step == cfg.optimization.max_steps and start_step > 0:
        return checkpoints, state  # complete: the caller returns its final metrics
    logger.info(f"[resume] from step {start_step}" + resume_note(state, cfg))
    if is_main:
        truncate_metrics(run_dir / METRICS, after_step=start_step)
    return checkpoints, state


def _run_loop(cfg: TrainConfig, *, engine, model, data: _RunData, peak_lrs, group_names, reference, checkpoints, start_step: int,
              trainer_state: dict | None, trainer_tensors: dict, world_size: int, is_main: bool, signals, phases, follower) -> dict[str, float]:
    """The step loop with the CVAE objective, evaluating every ``eval_every`` steps and at the end.
    ``trainer_state``, ``trainer_tensors``: the objective's state saved with the resumed checkpoint (None and {}: a fresh
    run, or one saved before it)."""
    from zcvae.eval.evaluation import evaluate

    run_dir = Path(cfg.run.output_dir)
    recon_cfg = cfg.reconstruction_config()
    run_logger = RunLogger(run_dir, enabled=is_main, report_to=cfg.run.report_to, run_name=cfg.run.run_name)
    logger.info(f"[run] {cfg.run.run_name}: {len(data.train_enc)} train / {len(data.val_enc)} val examples, world {world_size}, "
                f"engine {cfg.engine.engine}, reference {reference.policy}, c_base[{recon_cfg.token_aggregation_mode}] = {reference.c_base.value:.4f}")

    settings = loop_settings(cfg)

    def run_eval(step: int) -> dict[str, float]:
        # a stop agreed inside raises PhaseStopped before anything is written: the loop saves step `step` (or,
        # after the last step, keeps the last checkpoint)
        phases.before_step = step + 1
        if step == cfg.optimization.max_steps:
            phases.hint = "the final checkpoint was not written; the same command with --resume auto continues from the last one"
        with phases.phase(f"the evaluation at step {step}"):
            metrics = evaluate(engine=engine, model=model, cfg=cfg, val=data.val_enc, reference=reference, task=data.splits.task,
                               run_dir=run_dir, step=step, tick=phases.tick)
        run_logger.log("eval", step, metrics)
        if step in settings.eval_at:  # the end of the KL delay
            from zcvae.eval.verdict import delay_end_note

            if (note := delay_end_note(metrics, cfg.to_dict(), step=step)) is not None:
                logger.info(note)
        return metrics

    # the posterior gradient of the dilution argument (docs/objective.md#dilution), every grad_probe_every steps (zcvae.train.grad_probe: reads the same forward)
    probe = GradientProbe.for_model(model, task=data.splits.task, tokenizer=model.tokenizer) if cfg.run.grad_probe_every else None
    objective = CVAEObjective(cfg, engine=engine, model=model, train=data.train_enc, reference=reference, recon_cfg=recon_cfg,
                              probe=probe, run_logger=run_logger, val=data.val_enc, eval_at=settings.eval_at)
    objective.load_state_dict(trainer_state, tensors=trainer_tensors)
    final = run_loop(
        engine=engine, objective=objective, settings=settings, num_examples=len(data.train_enc),
        peak_lrs=peak_lrs, group_names=group_names, lr_factor=lambda step: lr_factor_at(cfg, step),
        start_step=start_step, checkpoints=checkpoints, checkpoint_state={"config": cfg, "c_base": reference.c_base, "train_data": data.train_data},
        evaluate=run_eval, run_logger=run_logger, signals=signals, cpu_threads=follower,
    )
    final.update(objective.delay_metrics())
    run_logger.hparams(cfg, final)
    run_logger.close()
    return final


def _finish(cfg: TrainConfig, final: dict[str, float], *, run_dir: Path, is_main: bool) -> None:
    """The closing lines, and the verdict (after the checkpoint: a verdict must never cost a run)."""
    from zcvae.reference.health import closure_warning

    logger.info(f"[done] {cfg.run.run_name}: " + ", ".join(f"{k}={final[k]:.3f}" for k in ("nmi", "mi", "kl", "exact_match") if k in final))
    if (note := closure_warning(final)) is not None:
        logger.info(note)
    if is_main:
        from zcvae.eval.verdict import report_verdict

        report_verdict(run_dir, final, cfg.to_dict(), step=cfg.optimization.max_steps, source="train")


def loop_settings(cfg: TrainConfig) -> LoopSettings:
    return LoopSettings(
        max_steps=cfg.optimization.max_steps, micro_batch_size=cfg.optimization.micro_batch_size, gradient_accumulation_steps=cfg.optimization.gradient_accumulation_steps,
        seed=cfg.optimization.seed, log_every=cfg.run.log_every, eval_every=cfg.evaluation.eval_every, save_every=cfg.run.save_every, max_grad_norm=cfg.optimization.max_grad_norm,
        skip_nonfinite_steps=cfg.run.skip_nonfinite_steps, progress_bar=cfg.run.progress_bar, run_name=cfg.run.run_name,
        progress_metrics={"loss": ".3f", "kl": ".3f"},
        # the end of the KL delay: whether the decoder reads z when the KL starts (zcvae.eval.verdict.delay_end_note);
        # a delay that ends on evidence adds its step when it ends (CVAEObjective.end_step)
        eval_at=set() if (end := kl_delay_end(cfg)) is None else {end},
    )


class CVAEObjective:
    """The CVAE objective of one micro-batch for ``zcvae.loop.driver.run_loop``: the z-free reference NLL, the
    model's forward, ``per_example_objective`` over the global count, the marginal/router terms (their
    own all-reduce per global micro-batch) and the gradient probe; with ``reference_refresh_every`` N, the
    reference's copy of the adapter renewed after every N-th step (and kept in the checkpoint)."""

    def __init__(self, cfg: TrainConfig, *, engine, model, train, reference, recon_cfg, probe, run_logger, val=(), eval_at=None):
        self.cfg, self.engine, self.model, self.train = cfg, engine, model, train
        self.reference, self.recon_cfg, self.probe, self.run_logger = reference, recon_cfg, probe, run_logger
        self.beta, self.probing = 0.0, False
        self.aux = AuxiliaryWeights.from_train_config(cfg, beta=self.beta)
        # --kl-delay-mode read: the delay ends when the decoder reads z on a fixed probe set (zcvae.train.kl_delay)
        self.delay = KLDelay.from_config(cfg)
        self.delay_probe = list(val[:READ_PROBE_EXAMPLES])
        if self.delay.evidence and (cfg.model.latent_type != "discrete" or cfg.model.num_latents < 2):
            raise ValueError("kl_delay_mode read needs a discrete latent with num_latents >= 2 (it compares the decoder across z)")
        self.eval_at = eval_at
        self.refresh_every = cfg.objective.reference_refresh_every

    def begin_step(self, step: int, micro: list[list[int]], positions: list[list[int]]) -> tuple[list, list[float]]:
        """The step's KL weight, auxiliary weights and probe; this rank's collated micro-batches and their counts."""
        self.probing = self.probe is not None and (step + 1) % self.cfg.run.grad_probe_every == 0
        self.beta = kl_weight_at(self.cfg, step, delay_end=self.delay.ended_at)
        self.aux = AuxiliaryWeights.from_train_config(self.cfg, beta=self.beta)  # router support may follow beta
        batches = [collate([self.train[i] for i in mb], self.model.tokens, num_z_slots=self.cfg.slot_tokens).to(self.engine.device) for mb in micro]
        # every kept example has n_i >= 1; tokens per example is the `token` mode's normaliser (core.losses)
        return batches, [float(sum(len(b) for b in batches)), float(sum(int(b.num_supervised.sum()) for b in batches))]

    def micro_loss(self, batch, *, micro: list[int], num_micro: int, global_count, global_tokens) -> MicroLoss:
        engine = self.engine
        mean_num_tokens = global_tokens / global_count.clamp_min(1)
        ref_nll_BN = self.reference.ref_nll(engine, batch)  # before the training forward (ZeRO-3 ordering)
        out = engine.module(batch, mode="train")
        terms = per_example_objective(out, ref_nll_BN=ref_nll_BN, c_base=self.reference.c_base.value, recon_config=self.recon_cfg,
                                      kl_weight=self.beta, aux=self.aux, mean_num_tokens=mean_num_tokens)
        loss = terms["loss"].sum() / global_count
        router = {}  # the router's statistics for the metric window (a discrete latent's)
        if out.posterior is not None:
            local_q_K = (out.posterior * terms["valid"][:, None]).sum(0)
            # this global micro-batch's own count, not the step's: else the marginal sums to 1/accumulation
            global_qn = engine.all_reduce(torch.cat([local_q_K.detach(), terms["valid"].detach().float().sum()[None]]))
            marginal, router = marginal_router_terms(local_sum_q_K=local_q_K, global_sum_q_K=global_qn[:-1], global_count=global_qn[-1], aux=self.aux)
            loss = loss + marginal / num_micro
        if self.probing:
            self.probe.accumulate(reconstruction=(terms["weighted_reconstruction_loss"] * terms["valid"]).sum() / global_count,
                                  kl=terms["kl"].sum() / global_count, examples=[self.train[i] for i in micro])
        return MicroLoss(loss=loss, terms=terms, tokens=float(batch.num_supervised.sum()), scalars=router)

    def end_step(self, done: int) -> dict[str, float]:
        if self.refresh_every and done % self.refresh_every == 0:
            # after the step, before its evaluation and checkpoint: steps done+1 .. done+N read this copy
            self.model.refresh_reference()
        if self.probing:
            self.run_logger.log(PROBE_SPLIT, done, self.probe.result(kl_weight=self.beta, all_reduce=self.engine.all_reduce))
        if self.delay.checks_after(done):
            ended = check_delay(self.delay, done, engine=self.engine, model=self.model, probe=self.delay_probe,
                                batch_size=self.cfg.optimization.micro_batch_size, num_z_slots=self.cfg.slot_tokens)
            self.run_logger.log(KL_DELAY_SPLIT, done, self.delay.record())
            if ended is not None and self.eval_at is not None:
                self.eval_at.add(done)  # the delay-end evaluation and its [kl] line (_run_loop.run_eval)
        return {"kl_weight": self.beta, "c_base": self.reference.c_base.value}  # beta: this step's

    def checkpoint_state(self) -> tuple[dict, dict[str, torch.Tensor]]:
        state = {"kl_delay": self.delay.state_dict()} if self.delay.evidence else {}
        # the reference's copy is frozen, so no engine state holds it; it is the adapter of the last refresh, not the current one
        return state, self.model.reference_state() if self.refresh_every else {}

    def load_state_dict(self, state: dict | None, *, tensors: dict | None = None) -> None:
        if self.delay.evidence:
            self.delay.load_state_dict((state or {}).get("kl_delay"))
        if self.refresh_every and tensors:
            self.model.load_reference_state(tensors)
        elif self.refresh_every:
            # a fresh run (a no-op: the copy was made from these weights), or a checkpoint saved without the copy
            # (the refresh switched on at this resume, --resume-allow-change): follow the restored adapter from here
            self.model.refresh_reference()

    def delay_metrics(self) -> dict[str, float]:
        """The delay's end for the final metrics and the verdict (``kl_delay/ended_at``, ``kl_delay/ended_by_read``)."""
        return {f"{KL_DELAY_SPLIT}/{k}": v for k, v in self.delay.record().items()} if self.delay.evidence else {}


def check_limits(cfg: TrainConfig, model, *, backbone) -> None:
    """Limits checked before any step: ValueError when ``--max-length`` exceeds the positions the
    backbone was built for (past them a learned position table indexes out of range and a rotary model
    runs on positions it never saw); a note when K is more than the latent figure draws."""
    from zcvae.eval.figures import MAX_FIGURE_ROWS

    if cfg.model.latent_type == "discrete" and cfg.model.num_latents > MAX_FIGURE_ROWS:
        logger.info(f"[eval] num_latents {cfg.model.num_latents} > {MAX_FIGURE_ROWS}: latents.png shows the {MAX_FIGURE_ROWS} most used latents")
    from zcvae.model.hf_compat import position_limit

    limit = position_limit(getattr(getattr(model, "peft_model", None), "config", None))
    if limit is not None and cfg.data.max_length > limit:
        raise ValueError(f"max_length {cfg.data.max_length} exceeds the backbone's {limit} positions (max_position_embeddings of "
                         f"{str(backbone)!r}); use --max-length {limit} or less")


def default_backbone(cfg: TrainConfig) -> str:
    """The built-in tiny backbone pretrained on the run's task, built once and cached."""
    from zcvae.backbone.builtin import builtin_backbone

    if cfg.data.train_data is not None:
        raise ValueError("--backbone is required with --train-data (pretrain one with `zcvae pretrain --train-data ...`)")
    return str(builtin_backbone(cfg.data.task))
