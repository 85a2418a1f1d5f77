"""The word-level tokenizer: stable ids, special tokens, unknown words, save/load round trip."""

from transformers import AutoTokenizer

from zcvae.data import SPECIAL_TOKENS, TASKS, TEMPLATE_TOKENS, build_tokenizer, make_examples


def test_vocabulary_is_specials_then_sorted_task_words():
    tokenizer = build_tokenizer()
    tokens = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    words = sorted({w for task in TASKS.values() for w in task.vocabulary()})
    assert tokens == [*SPECIAL_TOKENS, *words]
    assert tokens[:4] == ["<pad>", "<unk>", "<s>", "</s>"]
    assert (tokenizer.pad_token, tokenizer.unk_token, tokenizer.bos_token, tokenizer.eos_token) == tuple(tokens[:4])
    assert set(TEMPLATE_TOKENS) <= set(tokenizer.all_special_tokens)
    assert build_tokenizer().get_vocab() == tokenizer.get_vocab()  # stable across builds


def test_encoding_is_word_ids_only_and_decoding_joins_with_spaces():
    tokenizer = build_tokenizer()
    vocab = tokenizer.get_vocab()
    text = "rev 1 4 1 3 = 3 1 4 1 ."
    for add_special_tokens in (False, True):
        ids = tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]
        assert ids == [vocab[w] for w in text.split()]
    assert tokenizer.decode(tokenizer("  fwd\t1  2 .\n", add_special_tokens=False)["input_ids"]) == "fwd 1 2 ."
    templated = "<s> <x> 3 1 4 1 </x> <z> <znull> </z> <y> " + text + " </y> </s>"
    ids = tokenizer(templated, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(templated.split())
    assert ids[:2] == [tokenizer.bos_token_id, vocab["<x>"]]
    assert tokenizer.decode(ids, skip_special_tokens=True) == "3 1 4 1 " + text
    assert tokenizer.decode(ids) == templated


def test_unknown_words_map_to_unk():
    tokenizer = build_tokenizer()
    ids = tokenizer("fwd 12 zebra .", add_special_tokens=False)["input_ids"]
    assert ids[1:3] == [tokenizer.unk_token_id] * 2
    assert ids[0] != tokenizer.unk_token_id
    extended = build_tokenizer(extra_words=["zebra"])
    assert extended("zebra", add_special_tokens=False)["input_ids"] != [extended.unk_token_id]


def test_save_and_load_round_trip_offline(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    tokenizer = build_tokenizer()
    tokenizer.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    assert loaded.get_vocab() == tokenizer.get_vocab()
    assert loaded.all_special_tokens == tokenizer.all_special_tokens
    assert (loaded.bos_token_id, loaded.eos_token_id, loaded.pad_token_id, loaded.unk_token_id) == (
        tokenizer.bos_token_id,
        tokenizer.eos_token_id,
        tokenizer.pad_token_id,
        tokenizer.unk_token_id,
    )
    texts = [t for e in make_examples("search", seed=0, split="train", num_examples=20) for t in (e.x, e.y)]
    texts.append("<s> <x> 1 2 </x> <y> fwd 1 2 . unknownword </y> </s>")
    for text in texts:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert loaded(text, add_special_tokens=False)["input_ids"] == ids
        assert loaded.decode(ids, skip_special_tokens=True) == tokenizer.decode(ids, skip_special_tokens=True)
