"""The loop's side of the Objective protocol (zcvae.loop.driver.run_loop), with a toy objective and a one-process engine:
what each call receives, and where its returns go (the counts into the all-reduce before any forward, the scalars and
window metrics into the logged window, the state into the checkpoint)."""

import torch

from zcvae.loop.driver import LoopSettings, MicroLoss, run_loop
from zcvae.loop.guards import StopSignals


class OneProcessEngine:
    rank, world_size, device = 0, 1, torch.device("cpu")

    def __init__(self):
        self.model = torch.nn.Linear(1, 1, bias=False)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.1)
        self.reduced = []

    def set_learning_rates(self, lrs):
        self.optimizer.param_groups[0]["lr"] = lrs[0]

    def all_reduce(self, tensor, op="sum"):
        self.reduced.append(tensor.detach().clone())
        return tensor.detach().clone()

    def backward(self, loss, *, sync):
        loss.backward()

    def step(self, *, max_grad_norm):
        norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), float("inf")))
        self.optimizer.step()
        self.optimizer.zero_grad()
        return norm


class ToyObjective:
    """Example i's loss is (w - i)^2; each micro-batch reports its size as a window scalar."""

    def __init__(self, engine):
        self.engine, self.calls = engine, []

    def begin_step(self, step, micro, positions):
        self.calls.append(("begin_step", step, micro, positions))
        batches = [torch.tensor(mb, dtype=torch.float32) for mb in micro]
        return batches, [float(sum(len(b) for b in batches)), 2.0 * sum(len(b) for b in batches)]

    def micro_loss(self, batch, *, micro, num_micro, global_count, global_tokens):
        self.calls.append(("micro_loss", micro, num_micro, float(global_count), float(global_tokens)))
        per_row = (self.engine.model.weight[0, 0] - batch) ** 2
        terms = {"loss": per_row.detach(), "valid": torch.ones_like(batch)}
        return MicroLoss(loss=per_row.sum() / global_count, terms=terms, tokens=2.0 * len(batch), scalars={"rows": float(len(batch))})

    def end_step(self, done):
        self.calls.append(("end_step", done))
        return {"toy": float(done)}

    def checkpoint_state(self):
        return {"calls": len(self.calls)}, {}


class Recorder:
    def __init__(self):
        self.logged, self.saved = [], []

    def log(self, split, step, metrics):
        self.logged.append((split, step, metrics))

    def save(self, engine, *, step, trainer_state, **state):
        self.saved.append((step, trainer_state))

    def close(self):
        pass


def test_the_loop_asks_the_objective_in_step_order_and_routes_what_it_returns():
    engine = OneProcessEngine()
    objective, sink = ToyObjective(engine), Recorder()
    settings = LoopSettings(max_steps=2, micro_batch_size=2, gradient_accumulation_steps=2, seed=0, log_every=2, eval_every=0,
                            save_every=0, max_grad_norm=None, progress_bar=False)
    final = run_loop(engine=engine, objective=objective, settings=settings, num_examples=8, peak_lrs=[0.1], group_names=["all"],
                     lr_factor=lambda step: 1.0, start_step=0, checkpoints=sink, checkpoint_state={}, evaluate=lambda step: {"eval": step},
                     run_logger=sink, signals=StopSignals())

    assert final == {"eval": 2}
    assert [c[0] for c in objective.calls] == ["begin_step", "micro_loss", "micro_loss", "end_step"] * 2
    _, step, micro, positions = objective.calls[0]
    assert step == 0 and [len(m) for m in micro] == [2, 2] and positions == [[0, 1], [2, 3]]
    # the counts of begin_step, all-reduced before the first forward, reach every micro-batch; micro[m] goes with batch m
    assert torch.equal(engine.reduced[0], torch.tensor([4.0, 8.0]))
    assert objective.calls[1] == ("micro_loss", micro[0], 2, 4.0, 8.0) and objective.calls[2][1] == micro[1]
    [(split, logged_step, metrics)] = [r for r in sink.logged if r[0] == "train"]
    assert logged_step == 2 and metrics["rows"] == 2.0 and metrics["toy"] == 2.0  # MicroLoss.scalars, and end_step's values of the window's last step
    assert sink.saved == [(2, {"calls": 8})]  # the objective's state goes into the final checkpoint
