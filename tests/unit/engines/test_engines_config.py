"""EngineConfig validation, the shipped DeepSpeed configs, and the single-process pieces of the engines."""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from zcvae import distributed as zdist
from zcvae.engines import Engine, EngineConfig, build_engine
from zcvae.engines.base import named_param_groups
from zcvae.engines.deepspeed import BUILTIN_DEEPSPEED_CONFIGS, resolve_deepspeed_config
from zcvae.model.hf_compat import decoder_layers

REPO = str(Path(__file__).resolve().parents[3])
DS_DIR = os.path.join(REPO, "ds_configs")
SHIPPED = sorted(f for f in os.listdir(DS_DIR) if f.endswith(".json"))


# ------------------------------------------------------------------------------------------------
# EngineConfig
# ------------------------------------------------------------------------------------------------


def test_defaults_round_trip():
    cfg = EngineConfig()
    assert cfg.engine == "local" and cfg.precision == "fp32" and cfg.deepspeed_config is None
    assert EngineConfig.from_dict(cfg.to_dict()) == cfg


@pytest.mark.parametrize(
    ("data", "field"),
    [
        ({"engine": "ddp"}, "engine"),
        ({"precision": "fp16"}, "precision"),
        ({"gradient_checkpointing": "yes"}, "gradient_checkpointing"),
        ({"cpu_offload": 1}, "cpu_offload"),
        ({"engine": "fsdp2", "deepspeed_config": "zero3"}, "deepspeed_config"),
        ({"engine": "deepspeed", "deepspeed_config": ""}, "deepspeed_config"),
        ({"cpu_offload": True}, "cpu_offload"),
        ({"stage": 3}, "stage"),
    ],
)
def test_invalid_fields_name_the_field(data, field):
    with pytest.raises(ValueError, match=field):
        EngineConfig.from_dict(data)


def test_from_dict_rejects_non_mapping():
    with pytest.raises(ValueError, match="mapping"):
        EngineConfig.from_dict(["engine", "local"])


# ------------------------------------------------------------------------------------------------
# DeepSpeed configs
# ------------------------------------------------------------------------------------------------


def test_every_builtin_is_shipped_and_identical():
    assert SHIPPED == sorted(f"{n}.json" for n in BUILTIN_DEEPSPEED_CONFIGS)
    for name, builtin in BUILTIN_DEEPSPEED_CONFIGS.items():
        with open(os.path.join(DS_DIR, f"{name}.json")) as f:
            assert json.load(f) == builtin, name


@pytest.mark.parametrize("filename", SHIPPED)
def test_shipped_config_parses_with_a_valid_stage(filename):
    path = os.path.join(DS_DIR, filename)
    with open(path) as f:
        raw = json.load(f)
    stage = raw["zero_optimization"]["stage"]
    assert stage in (0, 1, 2, 3)
    assert filename.startswith(f"zero{stage}")
    ds = resolve_deepspeed_config(EngineConfig(engine="deepspeed", deepspeed_config=path))
    assert ds["zero_optimization"]["stage"] == stage
    # The engine owns accumulation and clipping: DeepSpeed must never rescale the gradients itself.
    assert ds["gradient_accumulation_steps"] == 1 and ds["gradient_clipping"] == 0.0
    assert "bf16" not in ds and "fp16" not in ds


def test_shipped_configs_are_accepted_by_deepspeed():
    from deepspeed.runtime.config import DeepSpeedConfig

    for filename in SHIPPED:
        ds = resolve_deepspeed_config(EngineConfig(engine="deepspeed", deepspeed_config=os.path.join(DS_DIR, filename)))
        parsed = DeepSpeedConfig(ds)  # DeepSpeed's own schema validation (world size 1 without a group)
        assert parsed.zero_optimization_stage == ds["zero_optimization"]["stage"]
        assert parsed.gradient_accumulation_steps == 1


def test_none_means_builtin_zero2_and_names_work_without_the_repo(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no ds_configs/ here, as after pip install
    assert resolve_deepspeed_config(EngineConfig(engine="deepspeed"))["zero_optimization"]["stage"] == 2
    assert resolve_deepspeed_config(EngineConfig(engine="deepspeed", deepspeed_config="zero3"))["zero_optimization"]["stage"] == 3


def test_precision_and_offload_are_applied():
    ds = resolve_deepspeed_config(EngineConfig(engine="deepspeed", deepspeed_config="zero3", precision="bf16", cpu_offload=True))
    assert ds["bf16"] == {"enabled": True}
    assert ds["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    assert ds["zero_optimization"]["offload_param"]["device"] == "cpu"
    ds = resolve_deepspeed_config(EngineConfig(engine="deepspeed", deepspeed_config="zero2", cpu_offload=True))
    assert "offload_param" not in ds["zero_optimization"]
    with pytest.raises(ValueError, match="stage"):
        resolve_deepspeed_config(EngineConfig(engine="deepspeed", deepspeed_config="zero0", cpu_offload=True))


def test_resolving_does_not_mutate_the_builtins():
    before = json.dumps(BUILTIN_DEEPSPEED_CONFIGS, sort_keys=True)
    resolve_deepspeed_config(EngineConfig(engine="deepspeed", deepspeed_config="zero3", precision="bf16", cpu_offload=True))
    assert json.dumps(BUILTIN_DEEPSPEED_CONFIGS, sort_keys=True) == before


@pytest.mark.parametrize(
    ("content", "match"),
    [
        ({"gradient_accumulation_steps": 4}, "gradient_accumulation_steps"),
        ({"optimizer": {"type": "AdamW"}}, "optimizer"),
        ({"fp16": {"enabled": True}}, "fp16"),
        ({"gradient_clipping": 1.0}, "gradient_clipping"),
        ({"zero_optimization": {"stage": 4}}, "stage"),
        ([1, 2], "object"),
    ],
)
def test_user_json_that_would_be_contradicted_is_rejected(tmp_path, content, match):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(content))
    with pytest.raises(ValueError, match=match):
        resolve_deepspeed_config(EngineConfig(engine="deepspeed", deepspeed_config=str(path)))


def test_missing_or_broken_json_names_the_field(tmp_path):
    with pytest.raises(ValueError, match="deepspeed_config"):
        resolve_deepspeed_config(EngineConfig(engine="deepspeed", deepspeed_config=str(tmp_path / "nope.json")))
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="deepspeed_config"):
        resolve_deepspeed_config(EngineConfig(engine="deepspeed", deepspeed_config=str(bad)))


def test_importing_the_engines_does_not_import_deepspeed():
    import subprocess

    code = "import sys, zcvae.engines, zcvae.engines.deepspeed; sys.exit('deepspeed' in sys.modules)"
    env = dict(os.environ, PYTHONPATH=os.path.join(REPO, "src"))
    assert subprocess.run([sys.executable, "-c", code], env=env, timeout=120).returncode == 0


# ------------------------------------------------------------------------------------------------
# Single-process pieces (no process group)
# ------------------------------------------------------------------------------------------------


class _Toy(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(3, 3) for _ in range(2)])
        self.frozen = nn.Linear(3, 3)
        self.frozen.requires_grad_(False)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.frozen(x)


def _groups(model):
    return [
        {"params": list(model.layers[0].parameters()), "lr": 0.1, "name": "a"},
        {"params": list(model.layers[1].parameters()), "lr": 0.2, "weight_decay": 0.5, "name": "b"},
    ]


def test_param_group_validation():
    model = _Toy()
    named = named_param_groups(model, _groups(model))
    assert named[0]["params"] == ["layers.0.weight", "layers.0.bias"] and named[1]["weight_decay"] == 0.5
    with pytest.raises(ValueError, match="missing"):
        named_param_groups(model, _groups(model)[:1])
    with pytest.raises(ValueError, match="frozen"):
        named_param_groups(model, _groups(model) + [{"params": [model.frozen.weight]}])
    with pytest.raises(ValueError, match="two param groups"):
        named_param_groups(model, _groups(model) + [{"params": [model.layers[0].weight]}])
    with pytest.raises(ValueError, match="empty"):
        named_param_groups(model, _groups(model) + [{"params": []}])
    with pytest.raises(ValueError, match="not in the model"):
        named_param_groups(model, _groups(model) + [{"params": [nn.Parameter(torch.zeros(1))]}])
    with pytest.raises(ValueError, match="unknown key"):
        named_param_groups(model, [{**g, "momentum": 0.9} for g in _groups(model)])


def test_decoder_layers_falls_back_to_layers_modulelist():
    model = _Toy()
    assert decoder_layers(model) == list(model.layers)


def test_local_engine_world1_contract():
    """Sum semantics, lr per group, norm before clipping, the sync guard, non-finite skip."""
    torch.manual_seed(0)
    model = _Toy()
    engine = build_engine(EngineConfig(), model=model, param_groups=_groups(model), learning_rate=1.0)
    assert isinstance(engine, Engine)
    assert engine.world_size == 1 and engine.is_main and engine.module is model
    assert [g["lr"] for g in engine.optimizer.param_groups] == [0.1, 0.2]
    engine.set_learning_rates([0.3, 0.4])
    assert [g["lr"] for g in engine.optimizer.param_groups] == [0.3, 0.4]
    with pytest.raises(ValueError, match="lrs"):
        engine.set_learning_rates([0.1])

    x = torch.randn(4, 3)
    # Two micro-batches' gradients add up (nothing divides by the accumulation count).
    reference = _Toy()
    reference.load_state_dict(model.state_dict())
    reference(x).sum().mul(2).backward()
    want = torch.sqrt(sum((p.grad**2).sum() for p in reference.parameters() if p.requires_grad))
    engine.backward(model(x).sum(), sync=False)
    with pytest.raises(RuntimeError, match="sync=True"):
        engine.step(max_grad_norm=None)
    engine.backward(model(x).sum(), sync=True)
    before = model.layers[0].weight.detach().clone()
    norm = engine.step(max_grad_norm=1e-3)
    assert math.isclose(norm, float(want), rel_tol=1e-6)  # pre-clip
    assert not torch.equal(before, model.layers[0].weight)
    assert all(p.grad is None for p in model.parameters())

    before = model.layers[0].weight.detach().clone()
    engine.backward(model(x).sum() * float("nan"), sync=True)
    assert math.isnan(engine.step(max_grad_norm=1.0))
    assert torch.equal(before, model.layers[0].weight)  # a non-finite step is skipped

    with pytest.raises(ValueError, match="max_grad_norm"):
        engine.step(max_grad_norm=0.0)
    with pytest.raises(ValueError, match="op"):
        engine.all_reduce(torch.ones(1), "mean")
    assert engine.all_reduce(torch.ones(2), "max").tolist() == [1.0, 1.0]
    assert set(engine.trainable_state_dict()) == {"layers.0.weight", "layers.0.bias", "layers.1.weight", "layers.1.bias"}


def test_build_engine_passes_the_optimizer_settings_on():
    """learning_rate/weight_decay are defaults for groups that leave them out; betas and eps reach
    the one AdamW every engine builds (AdamWSettings)."""
    model = _Toy()
    groups = _groups(model)
    del groups[0]["lr"]
    engine = build_engine(
        EngineConfig(), model=model, param_groups=groups, learning_rate=0.7, weight_decay=0.3, betas=(0.8, 0.95), eps=1e-6
    )
    opt = engine.optimizer
    assert isinstance(opt, torch.optim.AdamW) and opt.defaults["foreach"] is False
    assert [(g["lr"], g["weight_decay"]) for g in opt.param_groups] == [(0.7, 0.3), (0.2, 0.5)]
    assert all(g["betas"] == (0.8, 0.95) and g["eps"] == 1e-6 for g in opt.param_groups)


def test_local_bf16_runs_forward_under_autocast():
    model = _Toy()
    engine = build_engine(EngineConfig(precision="bf16"), model=model, param_groups=_groups(model), learning_rate=1.0)
    assert engine.module(torch.randn(2, 3)).dtype == torch.bfloat16
    assert model.layers[0].weight.dtype == torch.float32  # master weights stay fp32


def test_build_engine_rejects_misplaced_options():
    model = _Toy()
    with pytest.raises(ValueError, match="decoder_layers"):
        build_engine(EngineConfig(), model=model, param_groups=_groups(model), learning_rate=1.0, decoder_layers=[model.layers[0]])
    with pytest.raises(ValueError, match="EngineConfig"):
        build_engine({"engine": "local"}, model=model, param_groups=_groups(model), learning_rate=1.0)


def test_reduce_metrics_world1_is_exact_and_checks_keys():
    out = zdist.reduce_metrics(
        sums={"nll": torch.tensor(6.0), "empty": 0.0}, counts={"nll": 4, "empty": 0}, mins={"lo": 1.5}, maxs={"hi": torch.tensor(2.0)}
    )
    assert out["nll"] == 1.5 and out["nll/sum"] == 6.0 and out["nll/count"] == 4.0
    assert math.isnan(out["empty"]) and out["lo"] == 1.5 and out["hi"] == 2.0
    with pytest.raises(ValueError, match="counts"):
        zdist.reduce_metrics(sums={"a": 1.0}, counts={"b": 1.0})
    with pytest.raises(ValueError, match="unique"):
        zdist.reduce_metrics(sums={"a": 1.0}, counts={"a": 1.0}, mins={"a": 0.0})
    with pytest.raises(ValueError, match="scalar"):
        zdist.reduce_metrics(mins={"a": torch.ones(2)})


def test_dist_info_without_torchrun(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    info = zdist.dist_info()
    assert (info.rank, info.world_size, info.local_rank, info.is_main) == (0, 1, 0, True)
    monkeypatch.setenv("WORLD_SIZE", "two")
    with pytest.raises(ValueError, match="WORLD_SIZE"):
        zdist.dist_info()
