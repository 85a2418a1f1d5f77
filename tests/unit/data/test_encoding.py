"""Template encoding (zcvae.data.encoding): marker ids, the length policy, and that both templates hold the same supervised span."""

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from zcvae.data.encoding import (
    IGNORE_INDEX,
    EncodedExample,
    collate,
    encode_examples,
    prepare_tokenizer,
    template_tokens,
)


class _Ex:
    def __init__(self, id, x, y, strategy=None):
        self.id, self.x, self.y, self.strategy = id, x, y, strategy


@pytest.fixture()
def tokenizer():
    words = ["<unk>"] + [str(d) for d in range(10)] + list("abcdef")
    tk = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>")


def test_prepare_is_idempotent_and_extends_latents(tokenizer):
    a = prepare_tokenizer(tokenizer, num_latents=2)
    b = prepare_tokenizer(tokenizer, num_latents=2)
    c = prepare_tokenizer(tokenizer, num_latents=4)
    assert a == b
    assert c.latents[:2] == a.latents and len(set(c.latents)) == 4
    assert template_tokens(tokenizer, num_latents=4) == c
    with pytest.raises(ValueError, match="<z_4>"):
        template_tokens(tokenizer, num_latents=6)


def test_both_templates_supervise_the_same_span(tokenizer):
    tokens = prepare_tokenizer(tokenizer, num_latents=2)
    exs = [_Ex("a", "1 2 3", "a b"), _Ex("b", "4", "c d e f 9"), _Ex("c", "", "a")]
    enc, report = encode_examples(exs, tokenizer, tokens, max_length=32, num_z_slots=3)
    assert report.num_kept == 3
    batch = collate(enc, tokens, num_z_slots=3)
    for i, ex in enumerate(enc):
        zf = batch.labels[i][batch.labels[i] != IGNORE_INDEX].tolist()
        zc = batch.z_labels[i][batch.z_labels[i] != IGNORE_INDEX].tolist()
        assert zf == zc == [*ex.y_ids, tokens.y_close]
        assert batch.num_supervised[i] == len(zf)
        assert batch.input_ids[i, batch.x_close_pos[i]] == tokens.x_close
        assert batch.input_ids[i, batch.y_close_pos[i]] == tokens.y_close
        slot = batch.z_input_ids[i, batch.z_slot_start[i] : batch.z_slot_start[i] + 3]
        assert slot.tolist() == [tokens.znull] * 3
        assert batch.z_input_ids[i, batch.z_slot_start[i] - 1] == tokens.z_open
        assert batch.z_input_ids[i, batch.z_slot_start[i] + 3] == tokens.z_close
    sub = batch.select([2])
    assert sub.input_ids.shape[1] == int(batch.attention_mask[2].sum())


def test_length_policy_truncates_x_left_and_never_y(tokenizer):
    tokens = prepare_tokenizer(tokenizer, num_latents=1)
    exs = [_Ex("long-x", "1 2 3 4 5 6 7 8", "a b"), _Ex("long-y", "1", " ".join(["a"] * 20))]
    enc, report = encode_examples(exs, tokenizer, tokens, max_length=14, num_z_slots=1)
    assert [e.id for e in enc] == ["long-x"]
    assert enc[0].x_truncated and report.num_x_truncated == 1
    assert enc[0].x_ids == tuple(tokenizer("6 7 8", add_special_tokens=False)["input_ids"])
    assert report.num_skipped == 1 and "long-y" in report.skipped[0]
    batch = collate(enc, tokens)
    assert batch.z_input_ids.shape[1] == 14


def test_bad_text_is_skipped_with_its_id(tokenizer):
    tokens = prepare_tokenizer(tokenizer, num_latents=2)
    exs = [_Ex("empty-y", "1", ""), _Ex("marker", "1 <z> 2", "a"), _Ex("latent", "1", "<z_1> a")]
    enc, report = encode_examples(exs, tokenizer, tokens, max_length=32, num_z_slots=1)
    assert enc == []
    assert [s.split(":")[0] for s in report.skipped] == ["empty-y", "marker", "latent"]


def test_batch_to_keeps_python_fields(tokenizer):
    tokens = prepare_tokenizer(tokenizer, num_latents=1)
    batch = collate([EncodedExample("q", (1,), (2, 3), "s")], tokens)
    moved = batch.to(torch.device("cpu"))
    assert moved.ids == ["q"] and moved.strategies == ["s"] and torch.equal(moved.input_ids, batch.input_ids)


def test_the_reference_fingerprint_text_is_rendered_from_the_template_and_unchanged():
    # Byte-identical to the hand-kept string it replaced: otherwise every stored reference store
    # would silently stop matching its fingerprint and be rebuilt.
    from zcvae.data.encoding import TemplateLayout

    want = "<bos> <x> {x} </x> <y> {y} </y> <eos>; supervised: y + </y>"
    assert TemplateLayout.fingerprint_text() == want


def test_markers_have_one_home():
    from zcvae.data import encoding, tokenizer

    assert encoding.MARKERS is tokenizer.TEMPLATE_TOKENS is encoding.TemplateLayout.MARKERS
    assert (encoding.X_OPEN, encoding.Y_CLOSE, encoding.ZNULL) == ("<x>", "</y>", "<znull>")


@pytest.mark.parametrize("num_z_slots", [1, 3])
def test_layout_positions_point_at_the_markers_of_both_sequences(tokenizer, num_z_slots):
    from zcvae.data.encoding import TemplateLayout

    tokens = prepare_tokenizer(tokenizer, num_latents=2, num_z_slots=num_z_slots)
    layout = TemplateLayout(num_z_slots)
    for x, y in [((), (5,)), ((1, 2, 3), (4, 5))]:
        ex = EncodedExample("e", x, y)
        zf, _ = layout.zfree_sequence(ex, tokens)
        zc, labels = layout.zcond_sequence(ex, tokens, [tokens.znull] * num_z_slots)
        nx, ny = len(x), len(y)
        assert zf[layout.x_close(nx)] == zc[layout.x_close(nx)] == tokens.x_close
        assert zf[: layout.prefix_length(nx)] == zc[: layout.prefix_length(nx)] == [tokens.bos, tokens.x_open, *x, tokens.x_close]
        assert zc[layout.z_slot_start(nx) - 1] == tokens.z_open
        assert zc[layout.z_slot_start(nx) + num_z_slots] == tokens.z_close
        assert zc[layout.zcond_y_start(nx) : layout.zcond_y_start(nx) + ny] == list(y)
        assert zf[layout.zfree_y_close(nx, ny)] == tokens.y_close
        assert len(zc) == layout.zcond_length(nx, ny) and layout.room_for_x(len(zc), ny) == nx
        assert zc[: layout.zcond_y_start(nx)] == layout.zcond_prompt(x, tokens)
        assert zf[: layout.zfree_y_close(nx, 0)] == layout.zfree_prompt(x, tokens)
    with pytest.raises(ValueError, match="num_z_slots"):
        layout.zcond_sequence(EncodedExample("e", (1,), (2,)), tokens, [tokens.znull] * (num_z_slots + 1))
    with pytest.raises(ValueError, match="num_z_slots"):
        TemplateLayout(0)


def test_batch_prefix_length_is_the_layouts(tokenizer):
    from zcvae.data.encoding import TemplateLayout

    tokens = prepare_tokenizer(tokenizer, num_latents=1)
    batch = collate([EncodedExample("a", (1, 2), (3,)), EncodedExample("b", (), (4, 5))], tokens)
    assert batch.prefix_length.tolist() == [TemplateLayout.prefix_length(2), TemplateLayout.prefix_length(0)] == [5, 3]
