"""What the trainer holds: the run's reference policy, its c_base and (precomputed) the store of
training and validation b, and which examples of those b have degenerate weights (zcvae.reference.health).
Shapes as in zcvae.reference.store.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import logging
import os
from collections.abc import Sequence

import torch

from zcvae.data.encoding import Batch, EncodedExample
from zcvae.reference.store import POLICIES, ReferenceStore, default_policy, gather_parts, fingerprint_backbone, iter_reference_batches, load_or_build_reference_store, reference_fingerprint, reference_output
from zcvae.reference.c_base import CBase, c_base_from_store, c_base_from_sum_count, c_base_sum_count, resolve_c_base
from zcvae.reference.health import DegenerateWeights

logger = logging.getLogger(__name__)

__all__ = ["ReferenceProvider"]

# ----------------------------------------------------------------------------------------------
# What the trainer holds
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass
class ReferenceProvider:
    """The run's reference policy, its c_base and (precomputed) the store of train and validation b.

    The trainer calls :meth:`ref_nll` once per micro-batch on every rank, before the training forward.
    """

    policy: str
    c_base: CBase
    fingerprints: dict[str, str]
    store: ReferenceStore | None = None
    degenerate_weights: DegenerateWeights | None = None
    """The examples whose b the setup passes computed, with those of degenerate weights; None when no pass
    computed b (online with a c_base that is not recomputed)."""

    @classmethod
    def build(
        cls,
        cfg,
        *,
        engine,
        model,
        backbone: str | os.PathLike,
        train: Sequence[EncodedExample],
        val: Sequence[EncodedExample],
        passes: float,
        stored_c_base: CBase | None = None,
        phases=None,
    ) -> "ReferenceProvider":
        """Choose the policy, build or load the stores, and resolve c_base (collective: call on every rank).

        Reads from ``cfg``: reference_policy (auto | online | precomputed; auto is online when
        reference_refresh_every is set), reference_cache_dir,
        reconstruction_loss_token_aggregation_mode, zfree_reference_scale, micro_batch_size (the batch
        size of the reference pass), precision and seed (fingerprint extras: they change b or the new
        marker rows the reference reads). ``model`` provides ``tokens`` and ``tokenizer``; ``engine``
        provides ``module`` (wrapped), ``all_reduce`` and ``info`` (rank, world_size, device).
        ``phases``: a ``zcvae.loop.setup.SetupPhases`` that names, reports and can stop the passes (None: silent).
        """
        from zcvae.distributed import dist_info

        phases = phases if phases is not None else _SILENT

        info = getattr(engine, "info", None) or dist_info()
        gather = torch.distributed.all_gather_object if info.world_size > 1 else None
        mode = cfg.objective.reconstruction_loss_token_aggregation_mode
        policy = cfg.objective.reference_policy
        if policy == "auto":
            # a reference that follows the model changes b at every refresh: only online can follow it
            policy = "online" if cfg.objective.reference_refresh_every else default_policy(passes)
        if policy not in POLICIES:
            raise ValueError(f"reference_policy must be one of {('auto', *POLICIES)}, got {cfg.objective.reference_policy!r}")
        try:
            backbone_digest = fingerprint_backbone(backbone)
        except ValueError as e:
            if cfg.objective.reference_policy == "precomputed":
                raise ValueError(f"reference_policy=precomputed needs a fingerprintable backbone: {e}") from e
            if policy == "precomputed":
                logger.warning(f"[reference] {e}; falling back to the online policy")
                policy = "online"
            backbone_digest = hashlib.sha256(f"unhashed:{backbone}".encode()).hexdigest()
        extra = {"precision": cfg.engine.precision, "seed": cfg.optimization.seed}
        fps = {
            split: reference_fingerprint(backbone=backbone_digest, tokens=model.tokens, vocab=model.tokenizer, examples=examples, extra=extra)
            for split, examples in (("train", train), ("validation", val))
        }
        common = dict(
            tokens=model.tokens,
            batch_size=cfg.optimization.micro_batch_size,
            rank=info.rank,
            world_size=info.world_size,
            cache_dir=cfg.objective.reference_cache_dir,
            write=info.local_rank == 0,
            all_gather_object=gather,
            device=info.device,
            num_z_slots=cfg.slot_tokens,
        )
        store = None
        found: list[DegenerateWeights] = []  # what the setup passes saw of degenerate weights (one entry, or none)
        if policy == "precomputed":
            stores = {}
            for split, examples in (("train", train), ("validation", val)):
                with phases.phase(f"the reference store ({split})"):
                    stores[split] = load_or_build_reference_store(engine.module, examples, fingerprint=fps[split], name=split,
                                                                  tick=phases.tick, **common)
            store = _merge_stores(stores["train"], stores["validation"], train, val)
            found.append(_degenerate_weights_of(store))

            def recompute() -> CBase:
                return c_base_from_store(stores["validation"], [ex.id for ex in val], mode)

        else:

            def recompute() -> CBase:
                total = torch.zeros((), dtype=torch.float64, device=info.device)
                count = torch.zeros((), dtype=torch.float64, device=info.device)
                seen = DegenerateWeights(splits="validation")
                batch_size = cfg.optimization.micro_batch_size
                batches = iter_reference_batches(val, model.tokens, batch_size=batch_size, rank=info.rank, world_size=info.world_size, num_z_slots=cfg.slot_tokens)
                with torch.no_grad(), phases.phase("the c_base pass"):
                    for forwards, (batch, keep) in enumerate(batches, start=1):
                        ref_nll_BN, mask_BN = reference_output(engine.module(batch.to(info.device), mode="reference"))
                        phases.tick(min(len(val), forwards * batch_size * info.world_size), len(val))
                        if keep:
                            s, c = c_base_sum_count(ref_nll_BN, mask_BN, mode)
                            total, count = total + s, count + c
                            seen.add(ref_nll_BN, mask_BN, batch.ids)
                total, count = engine.all_reduce(torch.stack([total, count])).tolist()
                found.append(DegenerateWeights.merge([seen] if gather is None else gather_parts(seen, info.world_size, gather)))
                return c_base_from_sum_count(total, count, mode=mode, fingerprint=fps["validation"].digest)

        c_base = resolve_c_base(
            mode=mode, fingerprint=fps["validation"].digest, stored=stored_c_base,
            user_value=cfg.objective.zfree_reference_scale, recompute=recompute,
        )
        follows = (f"; follows the trained adapter every {cfg.objective.reference_refresh_every} steps (c_base stays this value)"
                   if cfg.objective.reference_refresh_every else "")
        logger.info(f"[reference] policy {policy}; c_base[{mode}] = {c_base.value:.6g} ({c_base.source}){follows}")
        return cls(policy=policy, c_base=c_base, fingerprints={k: v.digest for k, v in fps.items()}, store=store,
                   degenerate_weights=found[0] if found else None)

    def ref_nll(self, engine, batch: Batch) -> torch.Tensor:
        """The z-free reference NLL of ``batch``, [B, N] left-aligned (0 past each span)."""
        if self.store is not None:
            return self.store.lookup(batch.ids, device=batch.input_ids.device)[0]
        with torch.no_grad():
            ref_nll_BN, _ = reference_output(engine.module(batch, mode="reference"))
        return ref_nll_BN


def _degenerate_weights_of(store: ReferenceStore, *, chunk_size: int = 1024) -> DegenerateWeights:
    """Degenerate weights over every example of ``store`` (the same on every rank: each holds the whole store)."""
    found = DegenerateWeights(splits="train and validation")
    for start in range(0, len(store), chunk_size):
        ids = store.ids[start : start + chunk_size]
        found.add(*store.lookup(ids), ids)
    return found


class _Silent:
    """The phases of a pass nobody watches or stops (``zcvae.loop.setup.SetupPhases``'s interface)."""

    def phase(self, name: str):
        return contextlib.nullcontext()

    def tick(self, done: int, total: int, unit: str = "examples") -> None:
        pass


_SILENT = _Silent()


def _merge_stores(
    train_store: ReferenceStore, val_store: ReferenceStore, train: Sequence[EncodedExample], val: Sequence[EncodedExample]
) -> ReferenceStore:
    """One store over both splits; an id in both must name the same example (then b is the same)."""
    train_by_id = {ex.id: ex for ex in train}
    for ex in val:
        other = train_by_id.get(ex.id)
        if other is not None and (other.x_ids, other.y_ids) != (ex.x_ids, ex.y_ids):
            raise ValueError(f"example id {ex.id!r} names different examples in train and validation: "
                             "ids must be unique across splits for the precomputed reference")
    values = {i: val_store.get(i) for i in val_store.ids}
    values.update({i: train_store.get(i) for i in train_store.ids})
    digest = hashlib.sha256(f"{train_store.fingerprint}+{val_store.fingerprint}".encode()).hexdigest()
    return ReferenceStore.from_values(values, fingerprint=digest)
