"""The posterior-gradient probe (docs/objective.md#dilution): how large the reconstruction gradient on the posterior is, next
to the KL gradient.

The dilution argument (docs/objective.md#dilution): under a per-token mean, the part of the reconstruction that varies with z
is t0/T of the whole, so its gradient on the posterior parameters xi shrinks by t0/T, while the KL
gradient on xi is O(beta) whatever T is; the posterior collapses when the KL side wins. This module
measures both sides in a real run, every ``--grad-probe-every`` optimizer steps:

    probe = GradientProbe.for_model(model, task=splits.task, tokenizer=model.tokenizer)
    probe.accumulate(reconstruction=recon_sum / global_count, kl=kl_sum / global_count, examples=exs)  # per micro-batch
    record = probe.result(kl_weight=beta, all_reduce=engine.all_reduce)                                 # collective

Each accumulate takes ``torch.autograd.grad`` of the micro-batch's two terms (its example sums over the
global count, exactly the step's share of J), with ``retain_graph=True``, before the trainer's own
backward: the probe reads the same forward and never touches ``.grad``, the optimizer or any RNG, so a
probed run trains bit for bit like an unprobed one. The gradients are summed over the step's
micro-batches and all-reduced over ranks before their norms are taken, so the norms are those of the
global step's gradients (a norm of the sum, not a sum of norms).

Parameter groups: ``posterior_head`` (the router's head that turns the posterior state into q's logits,
or into mu/logvar for the Gaussian latent: the posterior parameters xi) and ``lora`` (the adapter weights; q reads
y through them, and the KL reaches them through the router's states). Record (split ``grad_probe`` of
metrics.jsonl; TensorBoard tags ``grad_probe/<key>``), for G in {posterior_head, lora}:

    G/reconstruction_grad_norm   || d recon / d theta_G ||, recon = sum_j lambda_j L_j (the trained part)
    G/kl_grad_norm               || d KL / d theta_G ||, unscaled (beta = 1)
    G/scaled_kl_grad_norm        beta * G/kl_grad_norm, the KL gradient the step actually applies
    G/reconstruction_to_kl_ratio G/reconstruction_grad_norm / G/scaled_kl_grad_norm; absent when the
                                 denominator is 0 (beta = 0 during the KL delay, or q = p exactly),
                                 where the ratio is undefined
    kl_weight                    beta of the step
    decision_fraction            mean over the step's examples of t0_i / T_i (absent without a task
                                 family that knows its decision positions, e.g. user JSONL)

t0_i is the number of y positions where the family's strategies part (``TaskFamily.decision_positions``:
1 for every built-in family, whether the decision is the first y token or a late one), and T_i = n_i the
supervised tokens (y + ``</y>``). It is the count, not the index of the decision: the tokens before a
late decision restate x, the z-free reference predicts them, and they carry no z signal, so they dilute
like the suffix does. Positions count y words, which is y tokens with the built-in word-level tokenizer.

Cost: on a probed step, two extra backward passes per micro-batch: the reconstruction one runs back
through the K branches (about as long as the trainer's own backward), the KL one through the router
pass only (much cheaper); then one all-reduce of the probed gradients (posterior head + LoRA) and the
accumulated gradients held in memory until the step ends. The other steps cost nothing.

The parameters must be plain tensors holding their whole value, as under the local engine (one process
or DDP): under ZeRO-3 and FSDP2 a parameter is a shard that autograd does not reach, so
``TrainConfig`` refuses ``grad_probe_every`` with any other engine.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch

__all__ = ["PROBE_GROUPS", "PROBE_SPLIT", "GradientProbe", "decision_fractions"]

PROBE_SPLIT = "grad_probe"
PROBE_GROUPS = ("posterior_head", "lora")
_TERMS = ("reconstruction", "kl")


def decision_fractions(examples: Sequence, *, task, tokenizer) -> list[float] | None:
    """t0_i / T_i of each encoded example (see the module docstring), or None without decision positions.

    An example whose x the family cannot read (truncated, or not of this family) is left out.
    """
    if task is None or not hasattr(task, "decision_positions"):
        return None
    out = []
    for ex in examples:
        try:
            positions = task.decision_positions(tokenizer.decode(list(ex.x_ids)))
        except ValueError:
            continue
        out.append(len(positions) / ex.num_supervised)
    return out


class GradientProbe:
    """Accumulates d(reconstruction)/d theta and d(KL)/d theta of one optimizer step, per parameter group."""

    def __init__(self, groups: Mapping[str, Sequence[torch.nn.Parameter]], *, task=None, tokenizer=None):
        self.groups = {name: [p for p in params if p.requires_grad] for name, params in groups.items()}
        empty = [name for name, params in self.groups.items() if not params]
        if empty:
            raise ValueError(f"grad probe: no trainable parameter in group(s) {empty}")
        self._params = [p for params in self.groups.values() for p in params]
        # each group's slice of the flattened parameter vector
        self._slices: dict[str, slice] = {}
        start = 0
        for name, params in self.groups.items():
            width = sum(p.numel() for p in params)
            self._slices[name] = slice(start, start + width)
            start += width
        self._width = start
        self.task, self.tokenizer = task, tokenizer
        self._reset()

    @classmethod
    def for_model(cls, model, *, task=None, tokenizer=None) -> "GradientProbe":
        """The probe of a ``ZCVAE``: its router's posterior head and its LoRA weights."""
        lora = [p for _, p in model.lora_named_parameters()]  # the "lora" optimizer group (one home)
        return cls({"posterior_head": list(model.router.posterior_head.parameters()), "lora": lora},
                   task=task, tokenizer=tokenizer)

    def _reset(self) -> None:
        self._grads: dict[str, list[torch.Tensor]] | None = None
        self._fractions: list[float] = []
        self._has_fractions = False

    def accumulate(self, *, reconstruction: torch.Tensor, kl: torch.Tensor, examples: Sequence = ()) -> None:
        """Add one micro-batch: ``reconstruction`` and ``kl`` are scalars of the forward the trainer is about
        to back-propagate (its share of the step's objective); its graph is kept for that backward."""
        if self._grads is None:
            self._grads = {t: [torch.zeros_like(p, dtype=torch.float64) for p in self._params] for t in _TERMS}
        for term, value in zip(_TERMS, (reconstruction, kl)):
            if not value.requires_grad:
                continue  # no path to any parameter: a zero gradient
            grads = torch.autograd.grad(value, self._params, retain_graph=True, allow_unused=True)
            for acc, g in zip(self._grads[term], grads):
                if g is not None:
                    acc.add_(g.detach().to(torch.float64))
        fractions = decision_fractions(examples, task=self.task, tokenizer=self.tokenizer)
        if fractions is not None:
            self._has_fractions = True
            self._fractions.extend(fractions)

    def result(self, *, kl_weight: float, all_reduce: Callable[[torch.Tensor], torch.Tensor]) -> dict[str, float]:
        """The step's record (see the module docstring); collective: every rank calls it once per probed step.

        ``all_reduce(tensor)`` returns the sum over ranks (the engine's ``all_reduce``). Resets the probe.
        """
        if self._grads is None:
            raise RuntimeError("grad probe: result() before any accumulate() of this step")
        local = torch.cat([torch.cat([g.reshape(-1) for g in self._grads[t]]) for t in _TERMS]
                          + [torch.tensor([sum(self._fractions), float(len(self._fractions))], dtype=torch.float64,
                                          device=self._grads["kl"][0].device)])
        total = all_reduce(local)
        per_term = dict(zip(_TERMS, total[:-2].split(self._width)))
        out: dict[str, float] = {"kl_weight": float(kl_weight)}
        for group, where in self._slices.items():
            recon = float(per_term["reconstruction"][where].norm())
            kl = float(per_term["kl"][where].norm())
            scaled = float(kl_weight) * kl
            out[f"{group}/reconstruction_grad_norm"] = recon
            out[f"{group}/kl_grad_norm"] = kl
            out[f"{group}/scaled_kl_grad_norm"] = scaled
            if scaled > 0:
                out[f"{group}/reconstruction_to_kl_ratio"] = recon / scaled
        frac_sum, frac_count = float(total[-2]), float(total[-1])
        if self._has_fractions and frac_count > 0:
            out["decision_fraction"] = frac_sum / frac_count
        self._reset()
        return out
