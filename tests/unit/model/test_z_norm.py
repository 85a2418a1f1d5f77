"""--z-conditioned-norm: every decoder norm scaled and shifted per z on the positions from <z> on.

What it must do: start as the model without it (zero table), yet give every y position a gradient on
z's own parameters (the notes' remedy for the single z token, which reaches early positions only
through attention); condition the branches and decoding only, never the z-free passes (prefix, router,
reference); and refuse gradient checkpointing, whose backward recompute runs outside the branch pass.
The shared-prefix and cached-decode equalities with it on are in test_prefix_sharing.py and
test_decode_cache.py.

Shape legend: B examples, K latent values, N supervised span.
"""

from __future__ import annotations

import pytest
import torch

from zcvae.config import TrainConfig
from zcvae.model import hf_compat
from zcvae.model.config import ModelConfig
from zcvae.model.cvae import ZCVAE
from tiny_models import ragged_batch

LENGTHS = [(3, 4), (5, 2), (2, 6)]


def _pair(backbone: str, **cfg):
    """The same model (seed 0) without and with z-conditioned norms, and one batch."""
    plain = ZCVAE.from_pretrained(backbone, ModelConfig(num_latents=3, **cfg), seed=0)
    conditioned = ZCVAE.from_pretrained(backbone, ModelConfig(num_latents=3, z_conditioned_norm=True, **cfg), seed=0)
    batch = ragged_batch(plain, LENGTHS, generator=torch.Generator().manual_seed(0))
    return plain, conditioned, batch


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_it_starts_as_the_model_without_it_yet_every_y_position_has_a_gradient_on_z(hf_backbone, arch):
    plain, conditioned, batch = _pair(hf_backbone(arch))
    norms = hf_compat.decoder_norms(conditioned.peft_model.get_base_model())
    assert len(norms) == 2 * len(hf_compat.decoder_layers(conditioned.peft_model.get_base_model()))
    assert conditioned.z_norm.table.weight.shape == (3, len(norms) * 2 * 32)
    a, b = plain.train_forward(batch), conditioned.train_forward(batch)
    for name in ("token_nll", "posterior_logits", "prior_logits", "zfree_nll"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    # d l_t / d table[k] at the first y position of each example, branch k = 1: not zero
    nll_BKN = b.token_nll
    for i in range(len(LENGTHS)):
        (grad,) = torch.autograd.grad(nll_BKN[i, 1, 0], conditioned.z_norm.table.weight, retain_graph=True)
        assert grad[1].abs().sum() > 0 and grad[[0, 2]].abs().sum() == 0, "only branch 1's row moves branch 1's NLL"
    assert any(n.startswith("z_norm.") for n, _ in conditioned._latent_named_parameters())
    groups = conditioned.param_groups(lora_lr=1e-3, latent_lr=1e-2, weight_decay=0.0)
    conditioned.check_trainable(groups)  # z_norm is in the latent group and trains
    assert any(p is conditioned.z_norm.table.weight for p in groups[1]["params"])


def test_a_row_moves_its_branch_only_and_no_z_free_pass(hf_backbone):
    plain, conditioned, batch = _pair(hf_backbone("llama"))
    with torch.no_grad():
        conditioned.z_norm.table.weight[2].normal_(0.0, 0.5, generator=torch.Generator().manual_seed(1))
        a, b = plain.train_forward(batch), conditioned.train_forward(batch)
        ref_a, ref_b = plain.reference(batch), conditioned.reference(batch)
    mask_BN = b.mask
    changed_K = ((a.token_nll - b.token_nll).abs() * mask_BN[:, None]).amax(dim=(0, 2))
    assert changed_K[2] > 1e-3 and changed_K[:2].max() == 0
    # every supervised position of branch 2 moved, the first one included (not only through attention to z)
    assert bool(((a.token_nll[:, 2] - b.token_nll[:, 2]).abs() > 0)[mask_BN].all())
    for name in ("posterior_logits", "prior_logits", "zfree_nll"):
        assert torch.equal(getattr(a, name), getattr(b, name)), f"{name}: a z-free pass was conditioned"
    for x, y in zip(ref_a, ref_b):
        assert torch.equal(x, y), "the reference is z-free"


def test_gradient_checkpointing_is_refused_with_the_reason():
    with pytest.raises(ValueError, match="z_conditioned_norm does not work with gradient_checkpointing"):
        ModelConfig(z_conditioned_norm=True, gradient_checkpointing=True)
    with pytest.raises(ValueError, match="z_conditioned_norm does not work with gradient_checkpointing"):
        TrainConfig.from_flat(task="copy", z_conditioned_norm=True, gradient_checkpointing=True)
    assert TrainConfig.from_flat(task="copy", z_conditioned_norm=True).model_config().z_conditioned_norm


def test_export_and_load_keep_the_conditioned_norms_and_merge_is_refused(tmp_path, tiny_backbone, checkpointed_run):
    from zcvae.commands.cli import main as cli_main
    from zcvae.export.load import load_for_inference

    backbone = tiny_backbone()
    cfg = TrainConfig.from_flat(backbone=str(backbone), num_latents=3, lora_r=4, max_length=32, seed=0, z_conditioned_norm=True,
                                output_dir=str(tmp_path / "run"), run_name="z-norm")
    model = ZCVAE.from_pretrained(str(backbone), cfg.model_config(), seed=0)
    batch = ragged_batch(model, LENGTHS, generator=torch.Generator().manual_seed(0))
    run_dir = checkpointed_run(model, batch, cfg, scale=0.05, step=5, c_base={"value": 0.25, "mode": "mean", "fingerprint": "f", "source": "validation"})
    (run_dir / "metrics.jsonl").write_text('{"step": 5, "split": "eval", "nmi": 0.5}\n')
    assert model.z_norm.table.weight.abs().sum() > 0, "moved off zero: the round trip is not vacuous"
    assert cli_main(["export", str(run_dir), "--out", str(tmp_path / "merged"), "--merge"]) == 2
    assert not (tmp_path / "merged").exists()
    assert cli_main(["export", str(run_dir), "--out", str(tmp_path / "export")]) == 0
    model.eval()
    with torch.no_grad():
        want = model.train_forward(batch).token_nll
        for source in (tmp_path / "export", run_dir):
            loaded = load_for_inference(source)
            assert torch.equal(loaded.z_norm.table.weight, model.z_norm.table.weight), source
            torch.testing.assert_close(loaded.train_forward(batch).token_nll, want, rtol=0, atol=1e-6, msg=str(source))


def test_a_run_trains_the_conditioned_norms(tmp_path, tiny_backbone):
    from zcvae.export.load import load_for_inference
    from zcvae.train.trainer import train

    cfg = TrainConfig.from_flat(task="copy", backbone=str(tiny_backbone()), output_dir=str(tmp_path / "run"), num_train_examples=8,
                                num_val_examples=5, max_steps=3, micro_batch_size=4, num_eval_decode_examples=2, max_new_tokens=4,
                                progress_bar=False, log_every=1, z_conditioned_norm=True, kl_delay_fraction=0.0, kl_ramp_fraction=0.0)
    final = train(cfg)
    assert "kl" in final and "loss" in final
    table = load_for_inference(tmp_path / "run").z_norm.table.weight
    assert table.abs().sum() > 0, "the latent group's optimizer moved the z-conditioned norms off zero"
    assert table.abs().sum(-1).gt(0).all(), "every latent value's row trains (the exact expectation reaches all K)"
