"""The KL delay that ends on evidence (``--kl-delay-mode read``): beta stays 0 until the decoder reads z.

Why: under a fixed delay (a share of ``--max-steps``) q can find the strategies while beta is 0, yet the decoder
may not use z when beta leaves 0; the KL then prices every nat of q and collapses it (on ``add`` and ``search`` at
300 steps: NMI 0.94 at step 120, decoding differing across z on 4% of x at the delay's end). Whether the decoder
reads z is measured without labels, teacher-forced on a fixed probe set of validation examples:

    read_i = max_k NLL(y_i | x_i, z_k) - min_k NLL(y_i | x_i, z_k) >= READ_GAP_NATS    (y_i's summed token NLL)
    share  = mean_i read_i

i.e. some z makes the example's own y at least e times likelier than another z does. A decoder that ignores z
gives the same NLL under every z (share 0); one that reads z gives the y of another strategy a low likelihood
under the wrong z (share near 1 where every x has several strategies). It costs one no-grad forward of the probe
set (K branches, no decoding) per check.

The schedule: beta is 0 for at least ``kl_delay_fraction`` of the steps; from there the delay ends at the first
check (every ``kl_delay_check_every`` steps) whose share reaches ``kl_delay_read_share``, or at the cap,
``kl_delay_max_fraction`` of the steps; then beta ramps as after a fixed delay (``config.kl_weight_at``). A delay
whose decoder reads z at the fixed delay's end gives the fixed schedule's betas. The end (step, reason, share) is
checkpointed, so a resumed run continues the same delay; the checks fall on fixed steps, so a run resumed in the
middle of the delay checks where the uninterrupted one did.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any

import torch

from zcvae.data.encoding import collate

logger = logging.getLogger(__name__)

# y e times likelier under the best z than under the worst: far above what the z rows alone move in a decoder that
# ignores z, far below the gap at a strategy's decision token once the decoder reads z (several nats)
READ_GAP_NATS = 1.0
# the fixed probe set: the first examples of the validation split (every rank holds all of it)
READ_PROBE_EXAMPLES = 64
# metrics.jsonl split of the checks and of the end; TensorBoard tags kl_delay/<key>
KL_DELAY_SPLIT = "kl_delay"


def read_share_BK(seq_nll_BK: torch.Tensor, *, gap_nats: float = READ_GAP_NATS) -> tuple[float, int]:
    """(share of rows whose decoder reads z, rows that read) from the per-z sequence NLL of each row's own y,
    ``seq_nll_BK`` [B, K] in nats; a row reads z when its best and worst z differ by at least ``gap_nats``."""
    if seq_nll_BK.ndim != 2 or seq_nll_BK.shape[1] < 2:
        raise ValueError(f"seq_nll_BK must be [B, K] with K >= 2, got shape {tuple(seq_nll_BK.shape)}")
    reads = int(((seq_nll_BK.max(1).values - seq_nll_BK.min(1).values) >= gap_nats).sum())
    return reads / max(seq_nll_BK.shape[0], 1), reads


def probe_seq_nll_BK(engine, model, probe: list, *, batch_size: int, num_z_slots: int) -> torch.Tensor:
    """[P, K] summed token NLL of each probe example's y under each z: no grad, the module in eval mode (no dropout,
    no RNG drawn, so a check changes no training number), every submodule's mode restored. Collective: every rank
    runs the same probe (a sharded engine needs every rank in each forward)."""
    module = engine.module
    modes = [(m, m.training) for m in module.modules()]
    module.eval()
    rows = []
    try:
        with torch.no_grad():
            for start in range(0, len(probe), batch_size):
                batch = collate(probe[start : start + batch_size], model.tokens, num_z_slots=num_z_slots).to(engine.device)
                out = engine.module(batch, mode="train", n_span=int(batch.num_supervised.max()))
                mask_B1N = out.mask[:, None, :].to(out.token_nll.dtype)
                rows.append((out.token_nll.float() * mask_B1N).sum(-1).to("cpu", torch.float64))
    finally:
        for m, training in modes:
            m.training = training
    return torch.cat(rows)


@dataclass
class KLDelay:
    """Where the KL delay of one run stands: ``ended_at`` (the step beta starts to ramp from; None while the delay
    lasts), ``reason`` (``read`` or ``cap``) and the last check's ``share``. ``fixed`` mode: never checks, the
    schedule of ``config.kl_weight_at`` alone."""

    mode: str
    max_steps: int
    min_step: int
    cap_step: int
    check_every: int
    read_share: float
    ended_at: int | None = None
    reason: str | None = None
    share: float | None = None
    checks: list = field(default_factory=list)

    @classmethod
    def from_config(cls, cfg) -> "KLDelay":
        o, max_steps = cfg.objective, cfg.optimization.max_steps
        return cls(mode=o.kl_delay_mode, max_steps=max_steps, min_step=math.ceil(o.kl_delay_fraction * max_steps - 1e-9),
                   cap_step=math.floor(o.kl_delay_max_fraction * max_steps + 1e-9), check_every=o.kl_delay_check_every,
                   read_share=o.kl_delay_read_share)

    @property
    def evidence(self) -> bool:
        return self.mode == "read"

    def checks_after(self, done: int) -> bool:
        """Whether the delay is checked after ``done`` steps: while it lasts, from its minimum on, every
        ``check_every`` steps and at the cap."""
        if not self.evidence or self.ended_at is not None or done < self.min_step:
            return False
        return done % self.check_every == 0 or done >= self.cap_step

    def update(self, done: int, share: float) -> str | None:
        """Record the check after ``done`` steps; the reason when the delay ends there (``read`` or ``cap``), else None."""
        self.share = share
        self.checks.append([done, share])
        if share >= self.read_share:
            self.ended_at, self.reason = done, "read"
        elif done >= self.cap_step:
            self.ended_at, self.reason = done, "cap"
        return self.reason if self.ended_at == done else None

    def state_dict(self) -> dict[str, Any]:
        return {"ended_at": self.ended_at, "reason": self.reason, "share": self.share, "checks": list(self.checks)}

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        state = state or {}
        self.ended_at, self.reason, self.share = state.get("ended_at"), state.get("reason"), state.get("share")
        self.checks = [list(c) for c in state.get("checks", [])]

    def line(self, done: int, probe_size: int) -> str:
        """The ``[kl]`` line of the check that ended the delay."""
        share = f"the decoder reads z on {self.share:.0%} of {probe_size} probe x (y >= e times likelier under one z than another)"
        if self.reason == "read":
            return f"[kl] the KL delay ends after step {done} of {self.max_steps}: {share}, >= {self.read_share:.0%}; beta ramps from here"
        return (f"[kl] the KL delay reached its cap after step {done} of {self.max_steps} (kl-delay-max-fraction) without a read: "
                f"{share}, < {self.read_share:.0%}; beta ramps from here, and the KL will likely collapse q. The decoder needs more "
                f"steps to learn to read z: rerun with a larger --max-steps (the delay keeps its share), or a larger --kl-delay-max-fraction")

    def record(self) -> dict[str, float]:
        """The numbers of the last check for metrics.jsonl / TensorBoard (``kl_delay/<key>``)."""
        out = {"read_share": float(self.share if self.share is not None else float("nan"))}
        if self.ended_at is not None:
            out.update({"ended_at": float(self.ended_at), "ended_by_read": float(self.reason == "read")})
        return out


def check_delay(delay: KLDelay, done: int, *, engine, model, probe: list, batch_size: int, num_z_slots: int) -> str | None:
    """One check of ``delay`` after ``done`` steps (collective); says the line when the delay ends. The share is
    all-reduced as counts, so every rank takes the same decision."""
    seq_nll_BK = probe_seq_nll_BK(engine, model, probe, batch_size=batch_size, num_z_slots=num_z_slots)
    _, reads = read_share_BK(seq_nll_BK)
    reads_total = engine.all_reduce(torch.tensor([float(reads), float(len(probe))], dtype=torch.float64, device=engine.device))
    share = float(reads_total[0] / reads_total[1].clamp_min(1))
    reason = delay.update(done, share)
    if reason is not None:
        logger.info(delay.line(done, len(probe)))
    return reason


__all__ = ["KLDelay", "KL_DELAY_SPLIT", "READ_GAP_NATS", "READ_PROBE_EXAMPLES", "check_delay", "probe_seq_nll_BK", "read_share_BK"]
