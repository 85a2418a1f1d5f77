"""Launch scripts: bash syntax, and the exact torchrun / deepspeed commands they print with --dry-run."""

import os
import re
import shlex
import subprocess
from pathlib import Path

import pytest

from zcvae.sweep.slurm import DEFAULT_TEMPLATE

LAUNCH = Path(__file__).resolve().parents[2] / "launch"
SLURM_TEMPLATE = Path(str(DEFAULT_TEMPLATE))  # shipped in the package (zcvae/sweep/slurm.sbatch)
LAUNCH_VARS = ("NNODES", "NPROC_PER_NODE", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT", "RDZV_ID", "RDZV_CONF",
               "TORCHRUN", "DEEPSPEED", "NUM_GPUS", "HOSTFILE", "NO_SSH", "INCLUDE", "EXCLUDE", "DS_CONFIG",
               "DRY_RUN")


def run_script(name, *args, **env_vars):
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    env.update(env_vars)
    return subprocess.run(["bash", str(LAUNCH / name), *args], env=env, capture_output=True, text=True,
                          timeout=30)


def dry_run(name, *args, **env_vars):
    result = run_script(name, "--dry-run", *args, **env_vars)
    assert result.returncode == 0, result.stderr
    return shlex.split(result.stdout)


def value_of(argv, flag):
    assert argv.count(flag) == 1, (flag, argv)
    return argv[argv.index(flag) + 1]


@pytest.mark.parametrize("path", [LAUNCH / "torchrun.sh", LAUNCH / "deepspeed.sh", SLURM_TEMPLATE], ids=lambda p: p.name)
def test_scripts_are_valid_bash_with_strict_mode(path):
    assert subprocess.run(["bash", "-n", str(path)], capture_output=True).returncode == 0
    assert "set -euo pipefail" in path.read_text()


def test_torchrun_one_node():
    argv = dry_run("torchrun.sh", "--task", "arith", "--backbone", "/models/my model", NPROC_PER_NODE="4")
    assert argv[:2] == ["torchrun", "--standalone"]
    assert value_of(argv, "--nproc_per_node") == "4"
    assert not {"--nnodes", "--rdzv_endpoint", "--node_rank"} & set(argv)
    assert argv[argv.index("-m"):] == ["-m", "zcvae", "train", "--task", "arith", "--backbone", "/models/my model"]


def test_torchrun_several_nodes():
    argv = dry_run("torchrun.sh", "--seed", "3", NNODES="2", NPROC_PER_NODE="8", NODE_RANK="1",
                   MASTER_ADDR="10.1.2.3", MASTER_PORT="29612", RDZV_ID="job7", RDZV_CONF="join_timeout=900")
    assert "--standalone" not in argv
    assert value_of(argv, "--nnodes") == "2" and value_of(argv, "--nproc_per_node") == "8"
    assert value_of(argv, "--node_rank") == "1"
    assert value_of(argv, "--rdzv_backend") == "c10d"
    assert value_of(argv, "--rdzv_endpoint") == "10.1.2.3:29612"
    assert value_of(argv, "--rdzv_id") == "job7"
    assert value_of(argv, "--rdzv_conf") == "join_timeout=900"
    assert argv[argv.index("-m"):] == ["-m", "zcvae", "train", "--seed", "3"]


def test_torchrun_defaults_and_dry_run_forms():
    argv = dry_run("torchrun.sh", NNODES="2", MASTER_ADDR="127.0.0.1")
    assert value_of(argv, "--rdzv_endpoint") == "127.0.0.1:29500" and value_of(argv, "--rdzv_id") == "zcvae"
    # DRY_RUN=1 works like --dry-run, and --dry-run is taken out wherever it stands
    env_form = run_script("torchrun.sh", "--seed", "1", DRY_RUN="1")
    flag_form = run_script("torchrun.sh", "--seed", "--dry-run", "1")
    assert env_form.returncode == flag_form.returncode == 0
    assert env_form.stdout == flag_form.stdout and "--dry-run" not in flag_form.stdout
    python_form = dry_run("torchrun.sh", TORCHRUN="python -m torch.distributed.run")
    assert python_form[:4] == ["python", "-m", "torch.distributed.run", "--standalone"]


def test_torchrun_several_nodes_needs_master_addr():
    result = run_script("torchrun.sh", "--dry-run", NNODES="2")
    assert result.returncode != 0 and "MASTER_ADDR" in result.stderr and not result.stdout


def test_deepspeed_one_node():
    argv = dry_run("deepspeed.sh", "--kl-weight", "2.0", NUM_GPUS="4")
    assert argv[0] == "deepspeed" and "--hostfile" not in argv and "--no_ssh" not in argv
    assert value_of(argv, "--num_nodes") == "1" and value_of(argv, "--num_gpus") == "4"
    assert value_of(argv, "--master_port") == "29500"
    tail = argv[argv.index("--no_local_rank"):]
    assert tail == ["--no_local_rank", "--module", "zcvae", "train", "--engine", "deepspeed",
                    "--deepspeed-config", "ds_configs/zero2.json", "--kl-weight", "2.0"]


def test_deepspeed_several_nodes_without_ssh():
    argv = dry_run("deepspeed.sh", "--seed", "1", NNODES="2", NPROC_PER_NODE="8",
                   HOSTFILE=str(LAUNCH / "hostfile.example"), NO_SSH="1", NODE_RANK="1",
                   MASTER_ADDR="10.0.0.1", MASTER_PORT="29700", DS_CONFIG="ds_configs/zero3.json",
                   INCLUDE="worker-1@worker-2:0,1")
    assert value_of(argv, "--hostfile") == str(LAUNCH / "hostfile.example")
    assert value_of(argv, "--num_nodes") == "2" and value_of(argv, "--num_gpus") == "8"
    assert value_of(argv, "--master_addr") == "10.0.0.1" and value_of(argv, "--master_port") == "29700"
    assert "--no_ssh" in argv and value_of(argv, "--node_rank") == "1"
    assert value_of(argv, "--include") == "worker-1@worker-2:0,1"
    assert value_of(argv, "--deepspeed-config") == "ds_configs/zero3.json"
    assert argv.index("--node_rank") < argv.index("--module") < argv.index("zcvae")
    assert argv[-2:] == ["--seed", "1"]


@pytest.mark.parametrize(
    "env, message",
    [
        ({"NNODES": "2"}, "HOSTFILE"),
        ({"HOSTFILE": "/nonexistent/hostfile"}, "HOSTFILE"),
        ({"NO_SSH": "1", "MASTER_ADDR": "10.0.0.1"}, "NODE_RANK"),
    ],
)
def test_deepspeed_refuses_incomplete_settings(env, message):
    result = run_script("deepspeed.sh", "--dry-run", **env)
    assert result.returncode != 0 and message in result.stderr and not result.stdout


def test_hostfile_example_is_in_deepspeed_format():
    lines = [line for line in (LAUNCH / "hostfile.example").read_text().splitlines()
             if line.strip() and not line.startswith("#")]
    assert lines and all(re.fullmatch(r"\S+ slots=\d+", line) for line in lines)


def test_slurm_template_follows_the_launch_conventions():
    text = SLURM_TEMPLATE.read_text()
    assert 'scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1' in text
    for line in ("#SBATCH --ntasks-per-node=1", "#SBATCH --nodes=${nodes}", "#SBATCH --gpus-per-node=${gpus_per_node}"):
        assert line in text
    for needle in ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME", "TORCH_NCCL_ASYNC_ERROR_HANDLING", "DRY_RUN",
                   "--rdzv_backend c10d", '--rdzv_id "$SLURM_JOB_ID"', '--nnodes "$SLURM_NNODES"',
                   "-m zcvae ${command}", "# zcvae-params: ${params_json}"):
        assert needle in text
