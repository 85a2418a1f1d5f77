"""A discrete latent with M = 2 z slots per value survives checkpoint -> export -> load_for_inference,
and `zcvae generate` decodes with the model's own slot layout (``<z> z_k^1 z_k^2 </z>``)."""

from __future__ import annotations

import json

import torch

from zcvae.commands.cli import main as cli_main
from zcvae.config import TrainConfig
from zcvae.export.load import load_for_inference
from zcvae.model.cvae import ZCVAE
from zcvae.data.encoding import EncodedExample, collate
from tiny_models import greedy_reference as decode_reference

C_BASE = {"value": 0.25, "mode": "mean", "fingerprint": "f00d", "source": "validation"}
X = "3 1 4 1"


def encoded(model, x: str, y: str) -> EncodedExample:
    ids = lambda text: tuple(model.tokenizer(text, add_special_tokens=False)["input_ids"])  # noqa: E731
    return EncodedExample("e", ids(x), ids(y))


def greedy_reference(model, x: str, k: int, max_new_tokens: int) -> str:
    """Value k's M tokens in the z section."""
    return decode_reference(model, encoded(model, x, "a").x_ids, model.tokens.latent_slots[k], max_new_tokens)


def test_multi_slot_discrete_export_load_and_generate(tmp_path, capsys, tiny_backbone, checkpointed_run):
    backbone = tiny_backbone()
    cfg = TrainConfig.from_flat(backbone=str(backbone), num_latents=3, num_z_slots=2, lora_r=4, max_length=32, seed=0,
                      output_dir=str(tmp_path / "run"), run_name="tiny")
    assert cfg.slot_tokens == 2, "training and evaluation collate the discrete latent's M slots"
    model = ZCVAE.from_pretrained(str(backbone), cfg.model_config(), seed=cfg.optimization.seed)
    batch = collate([encoded(model, "3 1 4", "fwd 3 1 4 ."), encoded(model, "2 7", "rev 7 2 .")], model.tokens, num_z_slots=2)
    run_dir = checkpointed_run(model, batch, cfg, scale=0.3, step=1, c_base=C_BASE)
    out = tmp_path / "export"
    assert cli_main(["export", str(run_dir), "--out", str(out)]) == 0
    meta = json.loads((out / "zcvae_export.json").read_text())
    assert meta["z_token_ids"] == list(model.tokens.latents) and len(meta["z_token_ids"]) == 6

    model.eval()
    for source in (out, run_dir):
        loaded = load_for_inference(source)
        assert loaded.config.num_z_slots == 2 and loaded.tokens == model.tokens
        with torch.no_grad():
            a, b = loaded.train_forward(batch), model.train_forward(batch)
        torch.testing.assert_close(a.token_nll, b.token_nll, atol=1e-6, rtol=0)
        torch.testing.assert_close(a.posterior_logits, b.posterior_logits, atol=1e-6, rtol=0)
    expected = [greedy_reference(model, X, k, 4) for k in range(3)]
    capsys.readouterr()
    assert cli_main(["generate", str(out), "--x", X, "--all-latents", "--max-new-tokens", "4", "--device", "cpu"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("z=")]  # DeepSpeed may log to stdout
    assert lines == [f"z={k}\t{y}" for k, y in enumerate(expected)]

    # --x is cut under training's length policy with the model's M = 2 slots: the z-conditioned
    # sequence of a kept x and one y token is exactly max_length = 32 (8 frame tokens, 2 slots, 1 y)
    from zcvae.export.cli import _fit_x

    kept = _fit_x(loaded, tuple(range(100, 140)), y_len=1)
    assert kept == tuple(range(119, 140)) and 8 + 2 + len(kept) + 1 == 32
