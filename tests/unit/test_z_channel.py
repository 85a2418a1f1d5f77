"""bench/z_channel.py: the slot sensitivities are the gradient at the z slot, checked against finite differences."""

from __future__ import annotations

import pytest
import torch

from zcvae.data.tasks import make_examples
from zcvae.data.encoding import IGNORE_INDEX, EncodedExample, TemplateLayout


@pytest.fixture(scope="module")
def z_channel(bench_script):
    return bench_script("z_channel")


@pytest.fixture(scope="module")
def backbone(tiny_backbone):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    directory = tiny_backbone(seed=3)
    model = AutoModelForCausalLM.from_pretrained(directory, attn_implementation="eager").eval().double()
    return model, AutoTokenizer.from_pretrained(directory)


def _numeric(model, tokenizer, tokens, ex, *, h=1e-3):
    """(d log p(y_t) / d slot embedding for every supervised t, by central differences: (N, H); b_t: (N,)).

    h is not smaller because Llama's RMSNorm computes in float32 even in a float64 model."""
    layout = TemplateLayout(1)
    enc = EncodedExample(ex.id, tuple(tokenizer(ex.x, add_special_tokens=False)["input_ids"]),
                         tuple(tokenizer(ex.y, add_special_tokens=False)["input_ids"]))
    ids, labels = layout.zcond_sequence(enc, tokens, [tokens.znull])
    target = torch.tensor(labels[1:])
    where = (target != IGNORE_INDEX).nonzero()[:, 0]
    base = model.get_input_embeddings()(torch.tensor([ids])).detach()
    slot = layout.z_slot_start(len(enc.x_ids))

    def logp(embeds):
        with torch.no_grad():
            lp = model(inputs_embeds=embeds).logits[0, :-1].log_softmax(-1)
        return lp[where, target[where]]

    columns = []
    for d in range(base.shape[-1]):
        step = torch.zeros_like(base)
        step[0, slot, d] = h
        columns.append((logp(base + step) - logp(base - step)) / (2 * h))
    z_ids, z_labels = layout.zfree_sequence(enc, tokens)
    with torch.no_grad():
        lp = model(input_ids=torch.tensor([z_ids])).logits[0, :-1].log_softmax(-1)
    z_target = torch.tensor(z_labels[1:])
    keep = z_target != IGNORE_INDEX
    b_t = -lp[keep].gather(1, z_target[keep, None])[:, 0]
    return torch.stack(columns, dim=1), b_t


def test_sensitivities_are_the_gradient_at_the_slot(z_channel, backbone):
    model, tokenizer = backbone
    tokens = z_channel._tokens(tokenizer)
    examples = make_examples("add", seed=0, split="val", num_examples=3)
    got = z_channel.channel(model, tokenizer, examples)
    znull = model.get_input_embeddings().weight[tokens.znull].norm().item()
    for i, ex in enumerate(examples):
        grads_NH, b_t = _numeric(model, tokenizer, tokens, ex)
        sens_N = grads_NH.norm(dim=1) / znull
        assert sens_N[0].item() > 0
        assert got["first"][i] == pytest.approx(sens_N[0].item(), rel=1e-3)
        assert got["decision"][i] == pytest.approx(float((sens_N * b_t).sum() / b_t.sum()), rel=1e-3)
    layers = got["attention"]
    assert len(layers) == model.config.num_hidden_layers and all(0 < a < 1 for a in layers)


def test_a_backbone_without_the_markers_is_refused(z_channel, tmp_path):
    from zcvae.data.tokenizer import build_tokenizer

    tokenizer = build_tokenizer()
    vocab = {w: i for w, i in tokenizer.get_vocab().items() if w not in ("<z>", "<znull>")}
    tokenizer.get_vocab = lambda: vocab  # a tokenizer that never went through the entangled stage

    with pytest.raises(SystemExit, match="lacks the template markers .*'<z>'"):
        z_channel._tokens(tokenizer)
