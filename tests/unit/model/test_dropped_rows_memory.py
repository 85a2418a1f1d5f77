"""Resizing the embedding of a memory-mapped checkpoint gives the old rows' pages back (cpu.release_file_pages).

transformers keeps weights memory-mapped when they load in the file's dtype; the resize copies the old rows into a
new tensor, and without the release their pages stayed resident for the whole run (a real SmolLM2-135M, fp32,
local engine: 1.30 -> 1.19 GiB peak; BENCHMARKS.md, "Host memory")."""

import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from zcvae import cpu
from zcvae.model import build
from zcvae.model.config import ModelConfig

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/smaps and madvise: Linux")


def _resident_bytes_of(path: Path) -> int:
    """Resident bytes of this process's mappings of ``path`` (/proc/self/smaps)."""
    total, current = 0, ""
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split(maxsplit=1)[0]
            if head.endswith(":") and head[0].isupper():
                if head == "Rss:" and current.rstrip().endswith(str(path)):
                    total += int(line.split()[1]) * 1024
            else:
                current = line
    return total


def test_resize_gives_back_the_old_embeddings_pages(tiny_backbone):
    from zcvae.model.build import load_backbone, load_tokenizer

    # 1024-wide rows: the embedding spans many pages, so what stays resident is measurable
    directory = tiny_backbone(hidden_size=1024, num_heads=8, intermediate_size=64, num_layers=1)
    config = ModelConfig(num_latents=4)
    tokenizer, tokens, vocab_before = load_tokenizer(str(directory), config)
    model = load_backbone(str(directory), config)
    old = model.get_input_embeddings().weight.detach()
    old_bytes = old.numel() * old.element_size()
    before = old.clone()
    assert len(tokenizer) > old.shape[0], "the test needs a resize"
    build.resize_and_init_rows(model, tokenizer, tokens=tokens, vocab_before=vocab_before, noise=0.01,
                               generator=torch.Generator().manual_seed(0))
    new = model.get_input_embeddings().weight
    for p in model.parameters():  # every weight the run keeps resident, as its first step does
        p.detach().sum()
    weights = directory / "model.safetensors"
    resident, size = _resident_bytes_of(weights), weights.stat().st_size
    assert resident > 0, "the weights are expected memory-mapped (transformers' load in the file's dtype)"
    # all of the file but the dropped rows (give or take the two pages it shares with its neighbours)
    assert resident <= size - old_bytes + 2 * 4096 + 4096, (resident, size, old_bytes)
    # the old rows are intact and copied: dropping clean file pages loses nothing
    assert torch.equal(old, before)
    assert torch.equal(new[: old.shape[0]], before)


def test_release_file_pages_keeps_anonymous_memory_and_file_contents(tmp_path):
    anonymous = torch.randn(1 << 20)  # 4 MiB of heap memory: not a file's, never dropped
    assert cpu.release_file_pages(anonymous) == 0
    path = tmp_path / "w.safetensors"
    save_file({"w": torch.arange(1 << 20, dtype=torch.float32)}, path)
    storage = torch.UntypedStorage.from_file(str(path), shared=False, nbytes=path.stat().st_size)
    mapped = torch.empty(0).set_(storage).view(torch.uint8)
    mapped.sum()  # make it resident
    resident = _resident_bytes_of(path)
    released = cpu.release_file_pages(mapped)
    assert released >= (1 << 22) - 2 * 4096
    assert _resident_bytes_of(path) <= resident - released + 4096
    # a later read faults the same bytes back in from the file
    with open(path, "rb") as f:
        assert bytes(mapped.numpy()) == f.read()
