"""GGUF -> Hugging Face conversion on a tiny GGUF file written here with the ``gguf`` package (a 1-layer
32-wide Llama, Q8_0 weights, a 262-token byte-level BPE tokenizer): exactness, the record, the cache
key, atomicity and the refusals. The real SmolLM2 file is tested in tests/e2e/test_real_backbone.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf", reason="the gguf package is part of the [dev] extra")

from zcvae.commands.cli import main as cli_main  # noqa: E402
from zcvae.backbone.convert import (  # noqa: E402
    GGUF_RECORD,
    cached_conversion,
    conversion_record,
    convert_gguf,
    file_sha256,
    resolve_backbone_path,
)

H, I, V_SPECIAL = 32, 64, ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def _byte_level_alphabet() -> list[str]:
    """GPT-2's printable stand-ins for the 256 bytes (the base tokens of a byte-level BPE)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = [b for b in range(256) if b not in printable]
    return [chr(c) for c in printable] + [chr(256 + n) for n in range(len(extra))]


def write_tiny_gguf(path: Path, *, seed: int = 0) -> Path:
    """A 1-layer Llama GGUF: Q8_0 matrices (random, seeded), F32 norms, tied output head."""
    from gguf import GGMLQuantizationType, GGUFWriter, LlamaFileType
    from gguf.quants import quantize

    rng = np.random.default_rng(seed)
    tokens = [*V_SPECIAL, *_byte_level_alphabet(), "Ġ1", "Ġ2", "Ġ3"]
    writer = GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_context_length(64)
    writer.add_embedding_length(H)
    writer.add_feed_forward_length(I)
    writer.add_head_count(2)
    writer.add_head_count_kv(1)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(H // 2)
    writer.add_vocab_size(len(tokens))
    writer.add_file_type(LlamaFileType.MOSTLY_Q8_0)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(tokens)
    writer.add_token_merges(["Ġ 1", "Ġ 2", "Ġ 3"])
    writer.add_token_types([3] * len(V_SPECIAL) + [1] * (len(tokens) - len(V_SPECIAL)))
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_pad_token_id(2)

    def q8(name: str, shape: tuple[int, int]) -> None:
        packed = quantize((0.05 * rng.standard_normal(shape)).astype(np.float32), GGMLQuantizationType.Q8_0)
        writer.add_tensor(name, packed, raw_shape=packed.shape, raw_dtype=GGMLQuantizationType.Q8_0)

    q8("token_embd.weight", (len(tokens), H))
    writer.add_tensor("blk.0.attn_norm.weight", np.ones(H, dtype=np.float32))
    for name, shape in (("attn_q", (H, H)), ("attn_k", (H // 2, H)), ("attn_v", (H // 2, H)), ("attn_output", (H, H)),
                        ("ffn_gate", (I, H)), ("ffn_up", (I, H)), ("ffn_down", (H, I))):
        q8(f"blk.0.{name}.weight", shape)
    writer.add_tensor("blk.0.ffn_norm.weight", np.ones(H, dtype=np.float32))
    writer.add_tensor("output_norm.weight", np.ones(H, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.Q8_0.gguf")


@pytest.fixture(scope="module")
def converted(tiny_gguf, tmp_path_factory) -> Path:
    return convert_gguf(tiny_gguf, tmp_path_factory.mktemp("hf") / "tiny")


def test_conversion_is_gguf_dequantization_and_recorded(tiny_gguf, converted):
    from gguf import GGUFReader
    from gguf.quants import dequantize
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    record = conversion_record(converted)
    assert record["file_type"] == "MOSTLY_Q8_0" and record["tensor_types"] == {"Q8_0": 8, "F32": 3}
    assert record["sha256"] == file_sha256(tiny_gguf) and record["source"] == str(tiny_gguf.resolve())
    assert record["dtype"] == "float32" and record["vocab_size"] == 262
    assert "quantization_config" not in json.loads((converted / "config.json").read_text())
    assert not [p for p in converted.parent.iterdir() if p.name.startswith(".")]  # no temporary left

    saved = load_file(str(converted / "model.safetensors"))
    by_name = {t.name: t for t in GGUFReader(str(tiny_gguf)).tensors}
    for gguf_name, hf_name in (("token_embd.weight", "model.embed_tokens.weight"),
                               ("blk.0.ffn_down.weight", "model.layers.0.mlp.down_proj.weight"),
                               ("blk.0.attn_v.weight", "model.layers.0.self_attn.v_proj.weight")):
        t = by_name[gguf_name]
        expected = torch.from_numpy(dequantize(t.data, t.tensor_type).copy())
        assert torch.equal(saved[hf_name], expected.reshape(saved[hf_name].shape)), hf_name

    model = AutoModelForCausalLM.from_pretrained(converted, local_files_only=True, use_safetensors=True)
    assert model.config.num_hidden_layers == 1 and model.config.tie_word_embeddings
    tokenizer = AutoTokenizer.from_pretrained(converted, local_files_only=True)
    assert len(tokenizer) == 262 and tokenizer.decode(tokenizer(" 1 2 3 12")["input_ids"]) == " 1 2 3 12"


def test_cache_is_keyed_by_content(tiny_gguf, tmp_path, monkeypatch, logged):
    monkeypatch.setenv("ZCVAE_CACHE", str(tmp_path / "cache"))
    same = tmp_path / "elsewhere" / "copy.gguf"
    same.parent.mkdir()
    same.write_bytes(tiny_gguf.read_bytes())
    lines = logged
    first = cached_conversion(tiny_gguf)
    assert first.parent == tmp_path / "cache" / "gguf" and first.name.endswith(file_sha256(tiny_gguf)[:16])
    mtime = (first / "model.safetensors").stat().st_mtime_ns
    # the same bytes under another name: the same content key, found converted
    assert cached_conversion(same) == first and "up to date" in lines[-1]
    assert resolve_backbone_path(str(tiny_gguf)) == str(first)
    assert "up to date" in lines[-1] and (first / "model.safetensors").stat().st_mtime_ns == mtime
    # the file replaced in place with other weights: a new key, never the stale conversion
    write_tiny_gguf(tiny_gguf.parent / "other.gguf", seed=1)
    (tiny_gguf.parent / "other.gguf").replace(same)
    changed = cached_conversion(same)
    assert changed != first and conversion_record(changed)["sha256"] == file_sha256(same)


def test_a_failed_conversion_leaves_the_previous_one_and_no_temporary(tiny_gguf, converted, tmp_path):
    out = tmp_path / "hf"
    convert_gguf(tiny_gguf, out)
    before = conversion_record(out)
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file" * 8)
    with pytest.raises(ValueError, match=r"bad\.gguf.*not a readable GGUF file"):
        convert_gguf(bad, out)
    assert conversion_record(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.gguf", "hf"]


def test_refusals_name_the_path(tiny_gguf, tmp_path):
    mine = tmp_path / "my-checkpoint"
    mine.mkdir()
    (mine / "config.json").write_text("{}")
    with pytest.raises(ValueError, match=r"my-checkpoint.*not a zcvae GGUF conversion"):
        convert_gguf(tiny_gguf, mine)
    assert (mine / "config.json").read_text() == "{}"
    with pytest.raises(ValueError, match=r"missing\.gguf.*does not exist"):
        resolve_backbone_path(str(tmp_path / "missing.gguf"))
    not_gguf = tmp_path / "model.bin"
    not_gguf.write_bytes(b"x")
    with pytest.raises(ValueError, match=r"model\.bin.*not a \.gguf file"):
        convert_gguf(not_gguf, tmp_path / "out")
    assert resolve_backbone_path(str(mine)) == str(mine)  # a directory is passed through


def test_cli(tiny_gguf, converted, tmp_path, capsys):
    assert cli_main(["convert-gguf", str(tiny_gguf), "--out", str(converted)]) == 0
    out = capsys.readouterr()
    assert out.out.strip() == str(converted) and "up to date" in out.err
    assert cli_main(["convert-gguf", str(tmp_path / "nope.gguf"), "--out", str(tmp_path / "o")]) == 2
    assert "nope.gguf" in capsys.readouterr().err and not (tmp_path / "o").exists()
    assert (converted / GGUF_RECORD).is_file()


def test_the_cache_lock_serialises_converters_and_a_failed_one_leaves_no_file(tmp_path):
    import threading
    import time

    from zcvae.backbone.convert import _file_lock

    lock, order = tmp_path / "gguf" / "0123.lock", []

    def second_converter():
        with _file_lock(lock):
            order.append("second")

    with _file_lock(lock):
        waiter = threading.Thread(target=second_converter)
        waiter.start()
        time.sleep(0.3)
        order.append("first")
    waiter.join(timeout=10)
    assert order == ["first", "second"]
    with pytest.raises(RuntimeError, match="conversion failed"), _file_lock(lock):
        raise RuntimeError("conversion failed")
    assert not lock.exists()
    (tmp_path / "file").write_text("")  # a file where the cache directory should be
    with pytest.raises(ValueError, match="GGUF cache .* is not writable: .*ZCVAE_CACHE"), _file_lock(tmp_path / "file" / "x.lock"):
        pass
