"""Shared by every test directory: the markers each directory gets, and the tiny backbone builders
(``tiny_llama``, ``tiny_backbone``, ``raw_tiny_backbone`` here; ``hf_backbone(arch)``, ``perturbed_model``
and ``checkpointed_run`` from tests/tiny_models.py, which the torchrun workers import too).

A random tiny Llama, either in memory (``tiny_llama``) or saved with ``save_pretrained`` next to the
word-level tokenizer, as ``ZCVAE.from_pretrained`` and the CLI read it (``tiny_backbone``). Tests ask
for the sizes they need; a saved directory is built once per distinct set of arguments and shared for
the whole session, so tests must treat it as read-only (copy it first to change it).

The end-to-end tests have their own ``tiny_backbone`` (tests/e2e/conftest.py): a backbone *pretrained*
through the real CLI, which overrides this one in that directory.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

# tests/ is on sys.path: pytest's default (prepend) import mode puts each conftest's and test file's
# directory there (no __init__.py anywhere under tests/), so test basenames must be unique.
from tiny_models import HF_ARCHS, save_hf_backbone  # noqa: E402 - isort: skip
from tiny_models import checkpointed_run as _checkpointed_run  # noqa: E402
from tiny_models import perturbed_model as _perturbed_model  # noqa: E402

TESTS = Path(__file__).resolve().parent
# A test's directory decides its marker, so ``-m "not e2e"`` / ``-m "not distributed"`` deselect whole
# directories and a new file there is marked without having to remember it (pyproject registers them).
DIRECTORY_MARKERS = {"e2e": "e2e", "distributed": "distributed"}


def pytest_collection_modifyitems(config, items):
    for item in items:
        try:
            top = Path(item.path).resolve().relative_to(TESTS).parts[0]
        except ValueError:  # a test outside tests/ (a path given on the command line)
            continue
        if top in DIRECTORY_MARKERS:
            item.add_marker(DIRECTORY_MARKERS[top])

# The sizes most tests use: 2 layers, 32 wide, full multi-head attention (~0.1M parameters).
TINY_SIZES = dict(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64, max_position_embeddings=128)


def _build_tiny_llama(vocab_size: int, *, seed: int, special_ids: dict[str, int | None], **sizes):
    """A seeded random ``LlamaForCausalLM`` from ``zcvae.backbone.stage_model.tiny_llama_config`` (one home for the config)."""
    from transformers import LlamaForCausalLM

    from zcvae.backbone.stage_model import tiny_llama_config

    unknown = set(sizes) - set(TINY_SIZES)
    if unknown:
        raise TypeError(f"unknown tiny-backbone size(s) {sorted(unknown)}; expected some of {sorted(TINY_SIZES)}")
    config = tiny_llama_config(vocab_size, **{**TINY_SIZES, **sizes}, **special_ids)
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


@pytest.fixture
def logged():
    """The text of every record the ``zcvae`` loggers emit during the test (at their levels; any rank), in order."""
    from zcvae.console import capture_lines

    with capture_lines() as lines:
        yield lines


@pytest.fixture(scope="session")
def tiny_llama() -> Callable[..., torch.nn.Module]:
    """Factory ``tiny_llama(vocab_size, *, seed=0, **sizes) -> LlamaForCausalLM`` in eval mode, not saved.

    Same seed and sizes give the same weights, bit for bit. ``sizes`` are keyword arguments of
    ``tiny_llama_config`` (``hidden_size``, ``num_layers``, ``num_heads``, ``intermediate_size``,
    ``max_position_embeddings``); the defaults are ``TINY_SIZES``.
    """

    def build(vocab_size: int, *, seed: int = 0, **sizes) -> torch.nn.Module:
        return _build_tiny_llama(vocab_size, seed=seed, special_ids={}, **sizes).eval()

    return build


@pytest.fixture(scope="session")
def tiny_backbone(tmp_path_factory) -> Callable[..., Path]:
    """Factory ``tiny_backbone(*, seed=0, **sizes) -> Path``: a backbone directory (model + tokenizer).

    The vocabulary is the word-level tokenizer's (``zcvae.data.build_tokenizer``) and the model's
    bos/eos/pad ids are the tokenizer's. Built once per distinct (seed, sizes) and cached for the
    session: do not write into it.
    """
    from zcvae.data.tokenizer import build_tokenizer

    built: dict[tuple, Path] = {}

    def make(*, seed: int = 0, **sizes) -> Path:
        key = (seed, *sorted({**TINY_SIZES, **sizes}.items()))
        if key not in built:
            tok = build_tokenizer()
            ids = dict(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
            model = _build_tiny_llama(len(tok), seed=seed, special_ids=ids, **sizes)
            directory = tmp_path_factory.mktemp("tiny_backbone")
            model.save_pretrained(directory)
            tok.save_pretrained(directory)
            built[key] = directory
        return built[key]

    return make


def _raw_tokenizer():
    """The word-level tokenizer's words and <pad> <unk> <s> </s>, but none of the template markers:
    the tokenizer of a backbone that has not been through the entangled stage."""
    from tokenizers import AddedToken, Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import PreTrainedTokenizerFast

    from zcvae.data.tokenizer import BOS, EOS, PAD, UNK, task_vocabulary

    specials = [PAD, UNK, BOS, EOS]
    vocab = {token: i for i, token in enumerate([*specials, *task_vocabulary()])}
    backend = Tokenizer(WordLevel(vocab=vocab, unk_token=UNK))
    backend.pre_tokenizer = WhitespaceSplit()
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token=BOS, eos_token=EOS, pad_token=PAD, unk_token=UNK,
                                   clean_up_tokenization_spaces=False)


@pytest.fixture(scope="session")
def raw_tiny_backbone(tmp_path_factory) -> Callable[..., Path]:
    """Factory ``raw_tiny_backbone(*, tied=False, seed=0) -> Path``: a random tiny Llama (``TINY_SIZES``)
    whose tokenizer lacks the template markers, as a raw pretrained LM does (``zcvae train`` exits 2 on
    it unless --allow-fresh-markers). ``tied`` ties the output head to the input embedding. Built once
    per argument set and shared: do not write into it."""
    built: dict[tuple, Path] = {}

    def make(*, tied: bool = False, seed: int = 0) -> Path:
        if (tied, seed) not in built:
            tok = _raw_tokenizer()
            ids = dict(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
            model = _build_tiny_llama(len(tok), seed=seed, special_ids=ids)
            if tied:
                model.config.tie_word_embeddings = True
                model.tie_weights()
            directory = tmp_path_factory.mktemp("raw_backbone")
            model.save_pretrained(directory)
            tok.save_pretrained(directory)
            built[(tied, seed)] = directory
        return built[(tied, seed)]

    return make


@pytest.fixture(scope="session")
def hf_backbone(tmp_path_factory) -> Callable[..., str]:
    """Factory ``hf_backbone(arch, *, seed=0) -> str``: a saved random tiny backbone of ``arch`` ("llama"
    with grouped-query attention, or "gpt2" with a tied head; tests/tiny_models.py) and the word-level
    tokenizer. Built once per (arch, seed) and shared for the session: do not write into it."""
    built: dict[tuple[str, int], str] = {}

    def make(arch: str, *, seed: int = 0) -> str:
        if arch not in HF_ARCHS:
            raise ValueError(f"unknown arch {arch!r}; expected one of {HF_ARCHS}")
        if (arch, seed) not in built:
            built[(arch, seed)] = str(save_hf_backbone(arch, tmp_path_factory.mktemp(arch), seed=seed))
        return built[(arch, seed)]

    return make


@pytest.fixture(scope="session")
def perturbed_model() -> Callable[..., tuple]:
    """``perturbed_model(backbone, model_config, *, lengths, seed=0) -> (ZCVAE, batch)`` (tests/tiny_models.py):
    LoRA B, the new token rows and the router moved off their initialisation, calibrated on a ragged batch
    with one example per (len(x), len(y)) in ``lengths``. A fresh model on each call."""
    return _perturbed_model


@pytest.fixture(scope="session")
def checkpointed_run() -> Callable[..., Path]:
    """``checkpointed_run(model, batch, cfg, *, scale, step, c_base) -> run_dir`` (tests/tiny_models.py): every
    trainable tensor moved by ``scale``, saved as ``cfg.run.output_dir`` with one complete checkpoint and
    run_config.json, as the trainer leaves a run."""
    return _checkpointed_run


@pytest.fixture(scope="session")
def bench_script() -> Callable[[str], object]:
    """``bench_script("verdict_check")``: the module of bench/verdict_check.py, loaded from its file (bench/ is
    scripts, not a package), once per name."""
    import importlib.util

    loaded: dict[str, object] = {}

    def load(name: str):
        if name not in loaded:
            spec = importlib.util.spec_from_file_location(name, TESTS.parent / "bench" / f"{name}.py")
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            loaded[name] = module
        return loaded[name]

    return load
