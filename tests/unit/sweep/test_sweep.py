"""Run families: expansion, naming, SLURM rendering, and recovery of every run's params from its script."""

import argparse
import json
import os
import shlex
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from zcvae.runs.naming import AGGREGATION_MODE_FIELD as AGG
from zcvae.runs.naming import parse_run_name
from zcvae.commands.sweep import main
from zcvae.sweep.family import (
    Run,
    SlurmSettings,
    expand_family,
    load_family,
    plan_runs,
    resolve_defaults,
    validate_family,
)
from zcvae.sweep.flags import params_to_flags, parse_train_flags
from zcvae.sweep.slurm import (
    DEFAULT_TEMPLATE,
    recover_params,
    recover_train_args,
    render_script,
    template_placeholders,
)

REPO = Path(__file__).resolve().parents[3]
TCCW = "normalized_concentration_corrected_token_weighted_reconstruction_weight"
DIST = "distribution_normalized_reconstruction_weight"

FAMILY_YAML = f"""
description: mean vs sum pilot (seed 001)
base:
  task: add
  backbone: /models/tiny llama
  max_steps: 10
  kl_weight: 1.0
  gradient_checkpointing: false
  learned_prior: true
  lora_target_modules: [q_proj, v_proj]
  output_dir: /scratch/pilot
grid:
  {AGG}: [mean, sum]
  token_weight_alpha: [0.0, 0.5, 1e-3]
  num_latents: [2, 4]
zip:
  - {TCCW}: [0.0, 1.0]
    {DIST}: [1.0, 0.0]
slurm:
  nodes: 2
  gpus_per_node: 4
  time: "02:00:00"
  partition: gpu
  extra_sbatch: ["--qos=high"]
  engine: deepspeed
  setup: ["module load cuda"]
"""


def _typed(flag_value, like):
    """Read a parsed CLI value the way the config would, typed like the expected value."""
    if isinstance(like, bool):
        assert isinstance(flag_value, bool)
        return flag_value
    if isinstance(like, list):
        items = flag_value if isinstance(flag_value, list) else [flag_value]
        return [type(x)(v) for x, v in zip(like, items)] + items[len(like):]
    return type(like)(flag_value)


@pytest.fixture
def fake_scontrol(tmp_path):
    """`scontrol show hostnames LIST` for a machine without SLURM: one host per comma-separated name."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    script = bin_dir / "scontrol"
    script.write_text('#!/bin/sh\necho "$3" | tr , "\\n"\n')
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return bin_dir


def test_family_renders_and_every_run_is_recovered_from_its_script(tmp_path, fake_scontrol):
    family_file = tmp_path / "pilot.yaml"
    family_file.write_text(FAMILY_YAML)
    out = tmp_path / "out"
    assert main([str(family_file), "--out", str(out), "--defaults", "base"]) == 0

    records = [json.loads(line) for line in (out / "manifest.jsonl").read_text().splitlines()]
    assert len(records) == 2 * 3 * 2 * 2
    names = [r["run_name"] for r in records]
    assert len(set(names)) == len(names)
    assert {r["defaults_source"] for r in records} == {"base"}
    assert (out / "logs").is_dir()

    base = load_family(family_file)["base"]
    combos = set()
    for record in records:
        name, params = record["run_name"], record["params"]
        text = (out / record["script"]).read_text()
        # 1. the machine-readable line gives back exactly the manifest's params
        assert recover_params(text) == params
        combos.add((params[AGG], params["token_weight_alpha"], params["num_latents"], params[TCCW], params[DIST]))
        assert params["engine"] == "deepspeed" and params["output_dir"] == f"/scratch/pilot/{name}"
        assert params["run_name"] == name
        assert params["backbone"] == "/models/tiny llama" and params["max_steps"] == 10
        # 2. the name carries the mode and parses back to the varied fields
        assert f"agg-{params[AGG]}" in name
        parsed = parse_run_name(name, base)
        for field in (AGG, "token_weight_alpha", "num_latents", TCCW, DIST):
            assert parsed[field] == params[field], (name, field)
        # 3. the embedded train flags, read statically, equal the params (typed)
        flags = parse_train_flags(recover_train_args(text))
        assert flags.pop("resume") == "auto"  # a requeued job continues from its checkpoint
        assert set(flags) == set(params)
        assert {f: _typed(v, params[f]) for f, v in flags.items()} == params
        assert "--no-gradient-checkpointing" in text and "--learned-prior" in text
        assert "--lora-target-modules q_proj v_proj" in text
        assert "#SBATCH --nodes=2" in text and "#SBATCH --gpus-per-node=4" in text
        assert "#SBATCH --partition=gpu" in text and "#SBATCH --qos=high" in text
        assert f"#SBATCH --output={(out / 'logs').resolve()}/%x-%j.out" in text
    assert combos == {(m, a, k, t, d) for m in ("mean", "sum") for a in (0.0, 0.5, 0.001) for k in (2, 4)
                      for t, d in ((0.0, 1.0), (1.0, 0.0))}

    # 4. the command the script would run (DRY_RUN=1) is the documented srun torchrun with the same flags
    env = dict(os.environ, DRY_RUN="1", PATH=f"{fake_scontrol}:{os.environ['PATH']}",
               SLURM_JOB_NODELIST="gpu-07,gpu-08", SLURM_NNODES="2", SLURM_JOB_ID="4242",
               SLURM_CPUS_PER_TASK="16")
    env.pop("MASTER_PORT", None)
    for record in records[:: max(1, len(records) // 6)]:
        result = subprocess.run(["bash", str(out / record["script"])], env=env, capture_output=True, text=True,
                                timeout=30)
        assert result.returncode == 0, result.stderr
        argv = shlex.split(result.stdout)
        head = argv[: argv.index("-m")]
        assert head[:2] == ["srun", "--kill-on-bad-exit=1"] and "torchrun" in head
        assert head[head.index("--nnodes") + 1] == "2"
        assert head[head.index("--nproc_per_node") + 1] == "4"
        assert head[head.index("--rdzv_id") + 1] == "4242"
        assert head[head.index("--rdzv_backend") + 1] == "c10d"
        assert head[head.index("--rdzv_endpoint") + 1] == "gpu-07:29500"
        assert head[head.index("--cpus-per-task") + 1] == "16"
        assert argv[argv.index("-m") + 1 : argv.index("-m") + 3] == ["zcvae", "train"]
        flags = parse_train_flags(argv[argv.index("-m") + 3 :])
        assert flags.pop("resume") == "auto"
        assert {f: _typed(v, record["params"][f]) for f, v in flags.items()} == record["params"]


def test_rendered_flags_parse_with_the_real_train_cli(tmp_path):
    cli = pytest.importorskip("zcvae.commands.cli")
    family_file = tmp_path / "pilot.yaml"
    family_file.write_text(FAMILY_YAML)
    out = tmp_path / "out"
    assert main([str(family_file), "--out", str(out), "--defaults", "config"]) == 0
    # the `zcvae train` flags without build_parser(), whose other subcommands import torch (seconds)
    parser = argparse.ArgumentParser()
    parser.add_argument("--config")
    cli.add_config_flags(parser)
    for line in (out / "manifest.jsonl").read_text().splitlines():
        record = json.loads(line)
        args = parser.parse_args(recover_train_args((out / record["script"]).read_text()))
        config = cli.resolve_train_config(args).to_dict()
        assert {field: config[field] for field in record["params"]} == record["params"]
        assert config["resume"] == "auto"


def test_plan_with_explicit_defaults_names_against_them():
    family = {"base": {"task": "arith"}, "grid": {AGG: ["mean", "sum"], "kl_weight": [1.0, 3.0]}}
    defaults = {AGG: "mean", "kl_weight": 1.0, "task": "arith", "seed": 0, "output_dir": "outputs"}
    runs = plan_runs(family, defaults)
    assert [r.name for r in runs] == ["agg-mean_beta-1", "agg-mean_beta-3", "agg-sum_beta-1", "agg-sum_beta-3"]
    assert runs[3].params == {"task": "arith", AGG: "sum", "kl_weight": 3.0, "output_dir": "outputs/agg-sum_beta-3",
                              "run_name": "agg-sum_beta-3"}
    with pytest.raises(ValueError, match="kl_weight"):
        plan_runs({"base": {"kl_weight": None}}, defaults)


def test_flags_follow_the_train_cli_conventions():
    params = {"kl_weight": 0.1 + 0.2, "gradient_checkpointing": True, "learned_prior": False,
              "lora_target_modules": ["q_proj"], "task": None, "seed": -3, "token_weight_alpha": -1e-05}
    groups = params_to_flags(params)
    assert groups == [["--gradient-checkpointing"], ["--kl-weight", "0.30000000000000004"], ["--no-learned-prior"],
                      ["--lora-target-modules", "q_proj"], ["--seed=-3"], ["--token-weight-alpha=-1e-05"]]
    parsed = parse_train_flags([arg for group in groups for arg in group])
    assert parsed == {"gradient_checkpointing": True, "kl_weight": "0.30000000000000004", "learned_prior": False,
                      "lora_target_modules": "q_proj", "seed": "-3", "token_weight_alpha": "-1e-05"}
    for bad in ({"lora_target_modules": []}, {"lora_target_modules": ["-x"]}, {"x": {"a": 1}}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            params_to_flags(bad)


def test_mode_is_written_explicitly_even_when_the_family_leaves_it_default():
    runs = plan_runs({"grid": {"seed": [1, 2]}}, {AGG: "mean", "seed": 0})
    assert all(r.params[AGG] == "mean" for r in runs)
    with pytest.raises(ValueError, match=AGG):
        plan_runs({"grid": {"seed": [1, 2]}}, {"seed": 0})


def test_two_runs_with_the_same_name_raise_naming_both():
    with pytest.raises(ValueError, match=r"/a/x.*/b/x|/b/x.*/a/x"):
        plan_runs({"base": {AGG: "sum"}, "grid": {"output_dir": ["/a/x", "/b/x"]}}, {AGG: "mean"})
    with pytest.raises(ValueError, match="same name 'agg-mean_beta-2'"):
        plan_runs({"grid": {"kl_weight": [2, 2.0]}}, {AGG: "mean", "kl_weight": 1.0})


def test_slurm_engine_fills_and_conflicts():
    assert plan_runs({"slurm": {"engine": "fsdp2"}}, {AGG: "mean"})[0].params["engine"] == "fsdp2"
    with pytest.raises(ValueError, match="engine"):
        plan_runs({"base": {"engine": "local"}, "slurm": {"engine": "fsdp2"}}, {AGG: "mean"})


@pytest.mark.parametrize(
    "family, field",
    [
        ({"base": {}, "grids": {"seed": [1]}}, "grids"),
        ({"grid": {"seed": []}}, "seed"),
        ({"grid": {"seed": 3}}, "seed"),
        ({"grid": {"seed": [1, 2]}, "zip": [{"seed": [3, 4], "kl_weight": [1.0, 2.0]}]}, "seed"),
        ({"zip": [{"seed": [3, 4], "kl_weight": [1.0]}]}, "zip"),
        ({"zip": [{"seed": [3]}, {"seed": [4]}]}, "seed"),
        ({"zip": [{"kl_weight": []}]}, "kl_weight"),
        ({"grid": {"kl-weight": [1.0]}}, "kl-weight"),
        ({"slurm": {"nodez": 2}}, "nodez"),
        ({"slurm": {"nodes": 0}}, "nodes"),
        ({"slurm": {"time": 86400}}, "time"),
        ({"slurm": {"extra_sbatch": ["--qos=high\nrm -rf /"]}}, "extra_sbatch"),
    ],
)
def test_bad_family_files_raise_naming_the_key(family, field):
    with pytest.raises(ValueError, match=field):
        validate_family(family)


def test_expansion_order_is_grid_then_zip():
    family = {"base": {"a": 0}, "grid": {"b": [1, 2]}, "zip": [{"c": [3, 4], "d": [5, 6]}]}
    assert expand_family(family) == [
        {"a": 0, "b": 1, "c": 3, "d": 5}, {"a": 0, "b": 1, "c": 4, "d": 6},
        {"a": 0, "b": 2, "c": 3, "d": 5}, {"a": 0, "b": 2, "c": 4, "d": 6},
    ]
    assert expand_family({"base": {"a": 0}}) == [{"a": 0}]


def test_defaults_source_is_explicit(tmp_path, monkeypatch):
    family = {"base": {AGG: "sum", "seed": 3}}
    assert resolve_defaults(family, source="base") == ({AGG: "sum", "seed": 3}, "base")
    with_engine = dict(family, slurm={"engine": "fsdp2"})
    assert resolve_defaults(with_engine, source="base") == ({AGG: "sum", "seed": 3, "engine": "fsdp2"}, "base")
    assert resolve_defaults(family, source="auto", config_module="no_such_zcvae_config")[1] == "base"
    with pytest.raises(ValueError, match="config"):
        resolve_defaults(family, source="config", config_module="no_such_zcvae_config")
    (tmp_path / "fake_zcvae_config.py").write_text(textwrap.dedent(f"""
        import dataclasses
        @dataclasses.dataclass
        class TrainConfig:
            backbone: str
            {AGG}: str = "mean"
            kl_weight: float = 1.0
            tags: list = dataclasses.field(default_factory=list)
        """))
    monkeypatch.syspath_prepend(str(tmp_path))
    defaults, source = resolve_defaults(family, source="auto", config_module="fake_zcvae_config")
    assert defaults == {AGG: "mean", "kl_weight": 1.0, "tags": []}
    assert source == "config:fake_zcvae_config.TrainConfig"
    with pytest.raises(ValueError, match="kl_wieght"):
        plan_runs({"grid": {"kl_wieght": [2.0]}}, defaults, check_known_fields=True)


def test_template_placeholders_are_exactly_what_rendering_provides():
    text = DEFAULT_TEMPLATE.read_text()
    assert template_placeholders(text) == {
        "job_name", "nodes", "gpus_per_node", "cpus_per_task", "time", "log_dir", "sbatch_optional",
        "run_name", "params_json", "master_port", "setup", "command", "train_args"}
    run = Run(name="agg-sum", params={AGG: "sum", "backbone": "it's a path", "max_grad_norm": None})
    rendered = render_script(template_text=text, run=run, slurm=SlurmSettings(), log_dir="logs")
    assert '"$SLURM_NNODES"' in rendered and "${DRY_RUN:-0}" in rendered and "${MASTER_PORT:-29500}" in rendered
    assert "#SBATCH --partition" not in rendered
    assert recover_params(rendered) == run.params
    assert parse_train_flags(recover_train_args(rendered)) == {AGG: "sum", "backbone": "it's a path", "resume": "auto"}
    assert '-m zcvae train "${TRAIN_ARGS[@]}"' in rendered
    with pytest.raises(KeyError):
        render_script(template_text=text + "${unknown_placeholder}\n", run=run, slurm=SlurmSettings(),
                      log_dir="logs")
    assert subprocess.run(["bash", "-n"], input=rendered, text=True).returncode == 0


def test_recover_params_needs_exactly_one_params_line():
    with pytest.raises(ValueError):
        recover_params("#!/bin/bash\necho hi\n")


def test_dry_run_writes_nothing_and_existing_manifest_needs_force(tmp_path):
    family_file = tmp_path / "f.json"
    family_file.write_text(json.dumps({"base": {AGG: "mean"}, "grid": {"seed": [1, 2]}}))
    out = tmp_path / "out"
    assert main([str(family_file), "--out", str(out), "--defaults", "base", "--dry-run"]) == 0
    assert not out.exists()
    assert main([str(family_file), "--out", str(out), "--defaults", "base"]) == 0
    assert sorted(p.name for p in out.glob("*.sbatch")) == ["agg-mean_seed-1.sbatch", "agg-mean_seed-2.sbatch"]
    assert main([str(family_file), "--out", str(out), "--defaults", "base"]) == 2
    assert main([str(family_file), "--out", str(out), "--defaults", "base", "--force"]) == 0


def test_launch_wrapper_calls_sweep_main(tmp_path):
    family_file = tmp_path / "f.yaml"
    family_file.write_text(f"base: {{{AGG}: sum}}\ngrid: {{kl_weight: [2.0]}}\n")
    result = subprocess.run(
        [sys.executable, str(REPO / "launch" / "sweep.py"), str(family_file), "--out", str(tmp_path / "o"),
         "--defaults", "base", "--dry-run"],
        capture_output=True, text=True, timeout=60, env=dict(os.environ, PYTHONPATH=str(REPO / "src")),
    )
    assert result.returncode == 0, result.stderr
    assert "agg-sum_beta-2.sbatch" in result.stdout
    assert not (tmp_path / "o").exists()
