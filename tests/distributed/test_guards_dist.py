"""The step guard across two real gloo processes: a signal or a non-finite loss seen by ONE rank stops
BOTH at the same step, so no rank is left waiting in a collective (zcvae.loop.guards).

Each rank runs the guard's per-step check (the one all-reduce the trainer runs after every optimizer
step) over five steps. Scenario "signal": only rank 1 has received SIGUSR1, before step 3. Scenario
"diverge": only rank 0's loss is NaN at step 2 (the
gradient norm, global, is NaN on both). Every rank writes what it saw to ``<scenario>.rank<r>.json``.
"""

from __future__ import annotations

import json
import os
import signal
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))


class _Engine:
    device = torch.device("cpu")

    def all_reduce(self, tensor, op="sum"):
        from zcvae.distributed import all_reduce

        return all_reduce(tensor, op)


def _terms(loss: float):
    value = torch.tensor([loss, loss])
    return {"valid": torch.ones(2), "weighted_reconstruction_loss": value, "kl": torch.zeros(2)}, value.sum() / 4


def _worker(out: str) -> None:
    from zcvae.distributed import init_distributed
    from zcvae.loop.guards import StepGuard, StopSignals, TrainingDiverged

    info = init_distributed(require_group=True)
    engine, count = _Engine(), torch.tensor(4.0)
    for scenario in ("signal", "diverge"):
        seen = []
        with StopSignals() as signals:
            guard = StepGuard(signals=signals)
            for step in range(1, 6):
                if scenario == "signal" and step == 3 and info.rank == 1:
                    os.kill(os.getpid(), signal.SIGUSR1)
                bad_here = scenario == "diverge" and step == 2 and info.rank == 0
                guard.add(*_terms(float("nan") if bad_here else 1.0))
                # the gradient norm an engine returns is already global: NaN on every rank alike
                norm = float("nan") if scenario == "diverge" and step == 2 else 0.5
                try:
                    verdict = guard.check(engine, step=step, grad_norm=norm, global_count=count)
                except TrainingDiverged as err:
                    seen.append([step, "diverged", str(err)])
                    break
                seen.append([step, verdict])
                if verdict == "stop":
                    break
        with open(os.path.join(out, f"{scenario}.rank{info.rank}.json"), "w") as f:
            json.dump(seen, f)
    from zcvae.distributed import shutdown_distributed

    shutdown_distributed()  # exiting with a live gloo group can abort in its destructor


if __name__ == "__main__":
    sys.path.insert(0, os.path.join(REPO, "src"))
    _worker(sys.argv[1])
else:
    import launcher as C

    def test_one_ranks_signal_or_nan_stops_every_rank_at_the_same_step(tmp_path):
        launch = C.run_launch("worker", C.worker_cmd(__file__, tmp_path), log_dir=tmp_path, env=C.cpu_env(), timeout_s=300)
        assert launch.ok, launch.failure()
        for scenario in ("signal", "diverge"):
            ranks = [json.loads((tmp_path / f"{scenario}.rank{r}.json").read_text()) for r in range(2)]
            assert ranks[0] == ranks[1], scenario
        assert json.loads((tmp_path / "signal.rank0.json").read_text()) == [[1, "ok"], [2, "ok"], [3, "stop"]]
        diverge = json.loads((tmp_path / "diverge.rank1.json").read_text())
        assert diverge[0] == [1, "ok"] and diverge[1][:2] == [2, "diverged"]
        assert "weighted_reconstruction_loss is nan" in diverge[1][2] and "last finite values at step 1" in diverge[1][2]
