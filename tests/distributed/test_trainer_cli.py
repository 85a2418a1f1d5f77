"""The real ``zcvae train`` CLI under torchrun: data-parallel runs equal the single-process run.

The trainer makes each micro-batch loss ``local_sum / global_count`` (count all-reduced before the
forwards) and every engine undoes its own averaging over ranks and accumulation steps, so
(world 2, accumulation 2, micro-batch 3) must take the same optimizer steps as (world 1,
accumulation 4, micro-batch 3): same examples per step (the global-batch sampler), same objective,
same gradient. Here that is checked end to end, through argument parsing, data, reference
statistics, c_base, the engines, metric reduction and the final evaluation, for

    engine             mode   reference      world-1 baseline
    local (DDP)        mean   online         w1-mean
    local (DDP)        token  online         w1-token   (the global token mean: n_bar all-reduced)
    deepspeed zero2    sum    precomputed    w1-sum
    deepspeed zero3    mean   online         w1-mean
    fsdp2              sum    precomputed    w1-sum
    deepspeed zero3    mean   online, gradient checkpointing, 4 steps   w1-gc-mean
    fsdp2, 2 "nodes"   sum    precomputed    the single-node fsdp2 run and w1-sum

All CPU, gloo, fp32. The validation set has 7 examples and the reference pass batches 3, so its
3 batches split 2/1 over the ranks: rank 1 runs a padding forward whose result must be dropped, and
c_base (a (sum, count) pair over the whole set) must still equal the single-process value. Warm-up is
1 step so every step updates at the peak learning rate (1/10 of the defaults, see LRS); one
reference-weighted reconstruction term is in the objective so the b of the reference pass (online or
from the precomputed store built by two ranks) reaches the gradient.

Runs start together in the background (at most MAX_WORKERS worker processes at a time); each test
waits for the runs it reads. Each launch has its own timeout and is killed with its process group.
"""

from __future__ import annotations

import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:  # launcher sits next to this file (tests/distributed has no __init__.py)
    sys.path.insert(0, HERE)

import launcher as C  # noqa: E402
from zcvae.core.losses import RECONSTRUCTION_TERMS  # noqa: E402


LAUNCH_TIMEOUT_S = 360  # per launch; a hang fails its tests instead of stalling CI
PRETRAIN_TIMEOUT_S = 300
MAX_WORKERS = 6  # concurrent worker processes: imports dominate, memory is ~0.5 GB each
TOL = 1e-5
STEPS = 3
GC_STEPS = 4
NUM_VAL = 7  # odd on purpose
MICRO = 3  # 7 validation examples -> reference batches of 3, 3, 1 -> 2 on rank 0, 1 + a padding batch on rank 1
NUM_LATENTS = 2

PRETRAIN = ["--task", "copy", "--max-steps", "40", "--num-train-examples", "512", "--num-val-examples", "32",
            "--hidden-size", "32", "--num-layers", "2", "--num-heads", "4", "--intermediate-size", "64"]
COMMON = ["--task", "copy", "--num-train-examples", "48", "--num-val-examples", str(NUM_VAL),
          "--num-eval-decode-examples", "2", "--micro-batch-size", str(MICRO), "--num-latents", str(NUM_LATENTS),
          "--log-every", "1", "--no-progress-bar", "--warmup-steps", "1",
          "--reconstruction-weight", "1", "--normalized-inverse-surprisal-token-weighted-reconstruction-weight", "0.5"]

# Learning rates: Adam turns ~1e-7 float noise on near-zero gradient entries into parameter differences
# of the order of the learning rate, which later steps show. Measured on this machine: at the default
# peak rates (1e-3 LoRA, 1e-2 latent) two *single-process* 4-step runs that differ only in gradient
# checkpointing (other rounding, same math) disagree by ~1e-4 relative in grad_norm at steps 3-4, and
# the sum-mode pairs reached 9e-6 in the final kl. At 1/10 the 3-step pairs agree to < 5e-7; the 4-step
# pair (whose KL weight jumps to 1 at step 3) needs 1/100 to get from 9e-6 to < 1e-7. So 1e-5 measures
# the engines, not the amplifier; a wrong scale or weighting already shows in step 1's grad_norm.
LRS = ("--lora-learning-rate", "1e-4", "--latent-learning-rate", "1e-3")
GC_LRS = ("--lora-learning-rate", "1e-5", "--latent-learning-rate", "1e-4")

TRAIN_KEYS = ["loss", *RECONSTRUCTION_TERMS, "kl", "kl_weight", "grad_norm", "num_tokens", "num_tokens_min", "num_tokens_max"]
EVAL_KEYS = ["loss", *RECONSTRUCTION_TERMS, "kl", "mi"]


@dataclass(frozen=True)
class Run:
    name: str
    mode: str
    policy: str
    engine: tuple[str, ...] = ("--engine", "local")
    world: int = 2
    two_nodes: bool = False
    steps: int = STEPS
    gradient_checkpointing: bool = False
    baseline: str | None = None
    extra: tuple[str, ...] = LRS

    @property
    def accumulation(self) -> int:
        return 4 // self.world  # the same global batch (12 examples) at every world size


RUNS = {r.name: r for r in [
    # world-1 baselines first: every comparison needs one of them
    Run("w1-mean", "mean", "online", world=1),
    Run("w1-sum", "sum", "precomputed", world=1),
    Run("w1-token", "token", "online", world=1),
    Run("local-mean", "mean", "online", baseline="w1-mean"),
    Run("local-token", "token", "online", baseline="w1-token"),
    Run("zero2-sum", "sum", "precomputed", ("--engine", "deepspeed", "--deepspeed-config", "zero2"), baseline="w1-sum"),
    Run("zero3-mean", "mean", "online", ("--engine", "deepspeed", "--deepspeed-config", "zero3"), baseline="w1-mean"),
    Run("fsdp2-sum", "sum", "precomputed", ("--engine", "fsdp2"), baseline="w1-sum"),
    Run("w1-gc-mean", "mean", "online", world=1, steps=GC_STEPS, gradient_checkpointing=True, extra=GC_LRS),
    Run("zero3-gc-mean", "mean", "online", ("--engine", "deepspeed", "--deepspeed-config", "zero3"), steps=GC_STEPS,
        gradient_checkpointing=True, baseline="w1-gc-mean", extra=GC_LRS),
    Run("fsdp2-sum-2nodes", "sum", "precomputed", ("--engine", "fsdp2"), two_nodes=True, baseline="fsdp2-sum"),
]}
PAIRS = ["local-mean", "local-token", "zero2-sum", "zero3-mean", "fsdp2-sum"]


def _train_args(run: Run, *, backbone: Path, root: Path) -> list:
    args = ["train", "--backbone", backbone, "--output-dir", root / run.name, "--reference-cache-dir", root / f"{run.name}.refcache",
            *COMMON, "--max-steps", run.steps, "--reconstruction-loss-token-aggregation-mode", run.mode,
            "--reference-policy", run.policy, "--gradient-accumulation-steps", run.accumulation, *run.engine]
    return args + (["--gradient-checkpointing"] if run.gradient_checkpointing else []) + list(run.extra)


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    root = tmp_path_factory.mktemp("trainer_cli")
    env = C.cpu_env(root / "zcvae-cache")
    backbone = root / "backbone"
    pretrain = C.Launch("pretrain", [C.zcvae_cmd("pretrain", "--output-dir", backbone, *PRETRAIN)], num_workers=1,
                        log_dir=root, env=env, timeout_s=PRETRAIN_TIMEOUT_S)
    pretrain.run()
    if not pretrain.ok:
        pytest.fail(pretrain.failure())

    launches = C.LaunchPool(max_workers=MAX_WORKERS)
    for run in RUNS.values():
        args = _train_args(run, backbone=backbone, root=root)
        if run.two_nodes:
            cmds = C.two_node_cmds(*args, port=C.free_port(), run_id=f"zcvae-cli-{os.getpid()}")
        elif run.world == 1:
            cmds = [C.zcvae_cmd(*args)]
        else:
            cmds = [C.torchrun_cmd(*args, nproc=run.world)]
        launches.submit(C.Launch(run.name, cmds, num_workers=run.world, log_dir=root, env=env, timeout_s=LAUNCH_TIMEOUT_S))
    launches.root = root
    launches.start()
    yield launches
    launches.cancel_all()
    times = ", ".join(f"{n} {launch.wall_s:.0f}s" for n, launch in launches.launches.items() if launch.done.is_set())
    print(f"\n[trainer-cli] launch wall times: pretrain {pretrain.wall_s:.0f}s, {times}")


def _run_dir(pool, name: str) -> Path:
    launch = pool.wait(name)
    if not launch.ok:
        pytest.fail(launch.failure())
    return pool.root / name


def _assert_same(got: Path, want: Path, *, train_keys=TRAIN_KEYS, eval_keys=EVAL_KEYS) -> None:
    got_train, got_eval = C.read_metrics(got)
    want_train, want_eval = C.read_metrics(want)
    errors = C.compare_records(got_train, want_train, train_keys, tol=TOL, what="train")
    errors += C.compare_records(got_eval[-1:], want_eval[-1:], eval_keys, tol=TOL, what="final eval")
    assert not errors, f"{got.name} vs {want.name}:\n" + "\n".join(errors[:20])


def _assert_ran(run_dir: Path, run: Run) -> None:
    """The run is what its name says: world size, steps, engine, policy; finite losses that train."""
    meta = C.read_run_config(run_dir)
    assert meta["world_size"] == (1 if run.world == 1 else 2)
    assert meta["reference_policy"] == run.policy
    assert meta["config"]["engine"] == run.engine[1]
    assert meta["config"]["gradient_checkpointing"] is run.gradient_checkpointing
    assert meta["data"]["val"]["kept"] == NUM_VAL
    train, evals = C.read_metrics(run_dir)
    assert [r["step"] for r in train] == list(range(1, run.steps + 1))
    assert evals and evals[-1]["step"] == run.steps
    for record in train:
        assert all(math.isfinite(record[k]) for k in TRAIN_KEYS), record
        assert record["grad_norm"] > 0


@pytest.mark.parametrize("name", PAIRS)
def test_two_ranks_equal_single_process(pool, name):
    """(world 2, accumulation 2) == (world 1, accumulation 4) through the CLI at every logged step
    (loss, all six reconstruction terms, kl, grad norm, token counts) and in the final evaluation."""
    run = RUNS[name]
    got, want = _run_dir(pool, name), _run_dir(pool, run.baseline)
    _assert_ran(got, run)
    _assert_ran(want, RUNS[run.baseline])
    if run.policy == "precomputed":  # the two ranks built the store themselves (no store shared between runs)
        assert list((pool.root / f"{name}.refcache").glob("train-*.safetensors"))
        assert list((pool.root / f"{name}.refcache").glob("validation-*.safetensors"))
    _assert_same(got, want)


@pytest.mark.parametrize("name", PAIRS)
def test_c_base_over_odd_validation_set_equals_single_process(pool, name):
    """c_base reduced over 2 ranks (one of which runs a discarded padding batch) equals the
    single-process value: online reference (mean runs) and the precomputed store (sum runs)."""
    run = RUNS[name]
    got = C.read_run_config(_run_dir(pool, name))["c_base"]
    want = C.read_run_config(_run_dir(pool, run.baseline))["c_base"]
    assert got["mode"] == want["mode"] == run.mode
    assert got["source"] == want["source"] == "validation"
    assert got["fingerprint"] == want["fingerprint"]
    assert want["value"] > 0 and C.close(got["value"], want["value"], tol=1e-6), (got, want)
    # a padding batch counted as data, or a rank's sum missing, would move it by a third of the set
    assert math.ceil(NUM_VAL / MICRO) % 2 == 1


def test_c_base_modes_differ(pool):
    """Sanity of the above: the sum-mode c_base is per sequence, far above the per-token mean one."""
    mean = C.read_run_config(_run_dir(pool, "w1-mean"))["c_base"]["value"]
    total = C.read_run_config(_run_dir(pool, "w1-sum"))["c_base"]["value"]
    assert total > 3 * mean


def test_zero3_gradient_checkpointing_online_reference(pool):
    """ZeRO-3 + gradient checkpointing + an online reference forward before every training forward,
    4 steps: finishes, finite, and equals the single-process run with gradient checkpointing."""
    run = RUNS["zero3-gc-mean"]
    got, want = _run_dir(pool, run.name), _run_dir(pool, run.baseline)
    _assert_ran(got, run)
    _assert_ran(want, RUNS[run.baseline])
    _assert_same(got, want)


def test_two_nodes_on_localhost_equal_single_node(pool):
    """torchrun --nnodes 2 --node_rank {0,1} over c10d on 127.0.0.1 (two agents, one rank each) runs the
    real CLI with FSDP2 and logs the same run as the single-node two-rank launch and as one process."""
    run = RUNS["fsdp2-sum-2nodes"]
    got = _run_dir(pool, run.name)
    _assert_ran(got, run)
    _assert_same(got, _run_dir(pool, "fsdp2-sum"))
    _assert_same(got, _run_dir(pool, "w1-sum"))


@pytest.mark.parametrize("name", ["w1-mean", "w1-sum", "zero3-mean", "fsdp2-sum"])
def test_router_marginal_at_step_one_is_uniform(pool, name):
    """At step 1 the router heads are zero-initialised, so q is uniform for every example and the
    marginal of q over any set of examples is uniform too: router_support = K, router_marginal_kl = 0.
    Both are logged from the marginal over each global micro-batch; dividing its q sum by the whole
    optimizer step's count (accumulation > 1) gave a marginal that sums to 1/accumulation."""
    train, _ = C.read_metrics(_run_dir(pool, name))
    first = train[0]
    assert abs(first["posterior_entropy"] - math.log(NUM_LATENTS)) < 1e-6  # premise: q uniform
    assert abs(first["router_support"] - NUM_LATENTS) < 1e-5, first["router_support"]
    assert abs(first["router_marginal_kl"]) < 1e-6, first["router_marginal_kl"]
