"""The following reference (``reference_refresh_every``): a frozen copy of the trained adapter that the
reference pass runs instead of the adapters-disabled backbone, renewed by ``ZCVAE.refresh_reference``.

Backbones: ``tiny_backbone`` (the markers known, LoRA and z rows adapt), and ``raw_tiny_backbone`` with a
tied head and ``train_fresh_markers``, where the template markers the reference reads are trainable tokens too.
"""

from __future__ import annotations

import pytest
import torch

from zcvae.data import make_examples
from zcvae.engines.base import trainable_named_parameters
from zcvae.model import hf_compat
from zcvae.model.config import ModelConfig
from zcvae.model.cvae import REFERENCE_ADAPTER, ZCVAE
from zcvae.data.encoding import collate, encode_examples


@pytest.fixture(params=["tiny", "fresh-markers-tied"])
def built(request, tiny_backbone, raw_tiny_backbone):
    """-> a function building (model, batch) afresh, every call the same."""
    if request.param == "tiny":
        backbone, config = tiny_backbone(), ModelConfig()
    else:
        backbone, config = raw_tiny_backbone(tied=True), ModelConfig(train_fresh_markers=True)

    def build():
        model = ZCVAE.from_pretrained(str(backbone), config, seed=0)
        examples = make_examples("copy", seed=3, split="train", num_examples=4)
        encoded, _ = encode_examples(examples, model.tokenizer, model.tokens, max_length=64, num_z_slots=1)
        batch = collate(encoded, model.tokens, num_z_slots=1)
        model.calibrate(batch)
        return model, batch

    return build


def train_a_little(model: ZCVAE, *, seed: int) -> None:
    """Move every trained tensor (LoRA A and B, the token deltas, the router) as training would."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in trainable_named_parameters(model):
            p.add_(0.3 * torch.randn(p.shape, generator=g))


def test_refresh_off_the_reference_is_the_adapters_disabled_backbone_bitwise(built):
    trained, batch = built()
    fresh, _ = built()
    train_a_little(trained, seed=1)
    assert not trained.follows_reference
    b_BN, mask_BN = trained.reference(batch)
    # the adapters play no part: a model that never trained gives the same b, bit for bit
    want_BN, want_mask_BN = fresh.reference(batch)
    assert torch.equal(b_BN, want_BN) and torch.equal(mask_BN, want_mask_BN)
    assert not torch.allclose(b_BN, trained.encode(batch).zfree_nll)  # the trained adapter's z-free NLL moved away


def test_after_a_refresh_the_reference_is_the_trained_models_zfree_nll(built):
    model, batch = built()
    frozen_BN, _ = model.reference(batch)
    model.add_reference_adapter()
    # the copy of an untrained adapter (LoRA B = 0, the token rows as loaded) scores as the frozen backbone
    assert torch.equal(model.reference(batch)[0], frozen_BN)

    train_a_little(model, seed=1)
    assert torch.equal(model.reference(batch)[0], frozen_BN)  # it does not follow until refreshed
    model.refresh_reference()
    b_BN, mask_BN = model.reference(batch)
    zfree_BN = model.encode(batch).zfree_nll  # the trained model's z-free NLL (its router pass)
    torch.testing.assert_close(b_BN, torch.where(mask_BN, zfree_BN, torch.zeros_like(zfree_BN)), rtol=0, atol=1e-6)
    assert not torch.allclose(b_BN, frozen_BN)

    train_a_little(model, seed=2)  # the copy is the refresh's: later training does not reach it
    assert torch.equal(model.reference(batch)[0], b_BN)


def test_the_reference_adapter_is_frozen_kept_out_of_training_and_round_trips(built):
    model, batch = built()
    model.add_reference_adapter()
    reference = hf_compat.adapter_parameters(model.peft_model, REFERENCE_ADAPTER)
    assert reference and not any(p.requires_grad for p in reference.values())
    groups = model.param_groups(lora_lr=1e-3, latent_lr=1e-2, weight_decay=0.0)
    model.check_trainable(groups)  # no frozen copy in the latent group
    in_groups = {id(p) for g in groups for p in g["params"]}
    assert not in_groups & {id(p) for p in reference.values()}
    assert {id(p) for _, p in trainable_named_parameters(model)} == in_groups  # what checkpoints and exports save

    train_a_little(model, seed=1)
    model.refresh_reference()
    state = model.reference_state()
    b_BN = model.reference(batch)[0]
    train_a_little(model, seed=2)
    model.refresh_reference()
    model.load_reference_state(state)  # what a resume restores
    assert torch.equal(model.reference(batch)[0], b_BN)
    with pytest.raises(ValueError, match="does not fit"):
        model.load_reference_state({k: v for k, v in list(state.items())[1:]})


def test_adding_the_reference_adapter_draws_no_random_number(built):
    model, _ = built()
    before = torch.get_rng_state()
    model.add_reference_adapter()
    assert torch.equal(torch.get_rng_state(), before)
