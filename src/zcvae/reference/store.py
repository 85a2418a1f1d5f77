"""z-free reference statistics: per-token surprisal b_t and the precomputed store (c_base per mode:
zcvae.reference.c_base; what the trainer holds: zcvae.reference.provider).

The reference is the frozen backbone (adapters disabled) reading the z-free template
``<bos> <x> {x} </x> <y> {y} </y> <eos>`` under teacher forcing (the frozen policy; docs/objective.md#notation). Its
per-token NLL over the supervised span (y tokens and ``</y>``) is b_i, a float32 vector of length
n_i per example; everything downstream (token weights, A_mode(b_i), c_base) is a function of b.

Two policies give the same b (up to the float noise of a different batch composition):

``online``
    The trainer calls ``engine.module(batch, mode="reference")`` for every micro-batch, *before* the
    training forward (ZeRO-3 ordering: the reference forward gathers the same sharded weights; docs/guide/scaling-out.md). Nothing is stored.
    The only policy for a reference that follows the model (``reference_refresh_every``: the model's
    copy of its adapter instead of the adapters disabled; docs/objective.md#the-following-reference).
``precomputed``
    b of every training and validation example is computed once by :func:`compute_reference_store`
    and kept in a :class:`ReferenceStore` keyed by example id; the trainer then calls
    :meth:`ReferenceStore.lookup` instead of the reference forward. The default when a run sees its
    data more than once (:func:`default_policy`).

Every forward goes through the engine-*wrapped* module (so ZeRO-3/FSDP hooks gather the shards) and
every rank runs the same number of forwards: :func:`iter_reference_batches` pads a rank that has run
out of data with a dummy batch whose results are discarded.

Store on disk (one pair of files per fingerprint, under ``cache_dir``, default
``~/.cache/zcvae/reference``)::

    {name}-{digest[:32]}.safetensors   tensors values (float32, all b concatenated, ids sorted),
                                       offsets (int64, E + 1), ids_utf8 (uint8, a JSON list: ids live in
                                       a tensor, not the header, whose size safetensors caps);
                                       metadata: format, fingerprint, values_sha256
    {name}-{digest[:32]}.json          the fingerprint digest and its parts, counts (for people)

Both are written to a temporary file and moved into place with ``os.replace``. The fingerprint is a
sha256 over the backbone weights, the template token ids, the tokenizer vocabulary, the data (ids and
encoded x/y of every example) and caller-chosen extras (precision, seed of new embedding rows): any
change gives a new file name, so a stale store is never read; old files stay until the cache is cleared.

A corrupt or truncated store: :meth:`ReferenceStore.load` raises :class:`ReferenceStoreError` (a
ValueError) naming the file; :func:`load_or_build_reference_store` catches it, warns with the file
name and the reason, and rebuilds (the store is a cache: recomputing is always correct).

c_base (docs/objective.md#c_base) is the mean over the validation set of A_mode(b_i), in the training objective's
aggregation mode, reduced as a ``(sum, count)`` pair across ranks; it is recorded as a :class:`~zcvae.reference.c_base.CBase`
with its mode, the validation fingerprint and its source. A stored c_base of another mode or
fingerprint is never reused (:func:`~zcvae.reference.c_base.resolve_c_base`).

Shape legend: B examples, N left-aligned supervised positions (y tokens + ``</y>``), E examples in a
store. Units: b in nats per token; c_base in nats per token (mean, token) or nats per sequence (sum).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from zcvae.runs.rundir import atomic_write
from zcvae.data.encoding import Batch, EncodedExample, TemplateLayout, TemplateTokens, collate

__all__ = [
    "C_BASE_SOURCES",
    "DEFAULT_CACHE_DIR",
    "POLICIES",
    "ReferenceBatch",
    "ReferenceFingerprint",
    "ReferenceStore",
    "ReferenceStoreError",
    "compute_reference_store",
    "default_policy",
    "fingerprint_backbone",
    "iter_reference_batches",
    "load_or_build_reference_store",
    "num_reference_forwards",
    "reference_fingerprint",
    "reference_output",
    "store_path",
]

POLICIES = ("online", "precomputed")
C_BASE_SOURCES = ("validation", "user")
DEFAULT_CACHE_DIR = Path("~/.cache/zcvae/reference")
STORE_FORMAT = "zcvae-reference/1"
_HASH_CHUNK = 1 << 24


# ----------------------------------------------------------------------------------------------
# Policy
# ----------------------------------------------------------------------------------------------


def default_policy(num_passes: float) -> str:
    """``precomputed`` when the run sees its training data more than once, else ``online``.

    ``num_passes`` is the number of epochs (fractional when the run is bounded by steps). With a single
    pass a store costs exactly the forwards the online policy runs, plus the disk.
    """
    if isinstance(num_passes, bool) or not isinstance(num_passes, (int, float)) or not math.isfinite(num_passes):
        raise ValueError(f"num_passes must be a finite number, got {num_passes!r}")
    if num_passes <= 0:
        raise ValueError(f"num_passes must be > 0, got {num_passes!r}")
    return "precomputed" if num_passes > 1 else "online"


# ----------------------------------------------------------------------------------------------
# Fingerprint
# ----------------------------------------------------------------------------------------------


def _sha256_json(value: Any) -> str:
    text = json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True, default=str)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _hash_file(h, path: Path) -> None:
    h.update(f"{path.name}\0{path.stat().st_size}\0".encode())
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            h.update(chunk)


def fingerprint_backbone(dir_or_module: str | os.PathLike | torch.nn.Module) -> str:
    """sha256 hex digest of a backbone's weights.

    A directory: the bytes of every ``*.safetensors`` file in it (sorted by name) and of
    ``config.json`` when present (the architecture changes b as much as the weights). A single
    ``.safetensors`` file: its bytes. A module: every ``state_dict`` entry (name, dtype, shape,
    bytes), sorted by name.

    Pass a module *before* it is sharded (ZeRO-3 or FSDP hold empty or partial tensors) and before
    peft wraps it (adapter weights and key prefixes would change the digest without changing the
    reference). Hash the module rather than the directory when the template markers were added and
    randomly initialised after loading: their rows are read by the reference but are not in the
    files (or put the initialisation seed in ``reference_fingerprint(extra=...)``).
    """
    h = hashlib.sha256()
    if isinstance(dir_or_module, torch.nn.Module):
        h.update(b"module\0")
        # keep_vars: the Parameters themselves, which carry DeepSpeed's partitioning attributes
        for name, tensor in sorted(dir_or_module.state_dict(keep_vars=True).items()):
            if not isinstance(tensor, torch.Tensor):
                continue
            if type(tensor) not in (torch.Tensor, torch.nn.Parameter):
                # DTensor (FSDP2) and similar subclasses hold a shard: hashing it would be rank-dependent.
                raise ValueError(f"fingerprint_backbone: {name} is a {type(tensor).__name__} (sharded); "
                                 "fingerprint the module before sharding, or its directory")
            if hasattr(tensor, "ds_id") or hasattr(tensor, "ds_numel"):
                raise ValueError(f"fingerprint_backbone: {name} is partitioned (ZeRO-3); "
                                 "fingerprint the module before deepspeed.initialize, or its directory")
            data = tensor.detach().to("cpu").contiguous()
            h.update(f"{name}\0{data.dtype}\0{tuple(data.shape)}\0".encode())
            h.update(data.reshape(-1).view(torch.uint8).numpy().tobytes())
        return h.hexdigest()
    path = Path(dir_or_module)
    if path.is_file():
        if path.suffix != ".safetensors":
            raise ValueError(f"fingerprint_backbone: {path} is not a .safetensors file")
        _hash_file(h, path)
        return h.hexdigest()
    if not path.is_dir():
        raise ValueError(f"fingerprint_backbone: {path} is neither a directory nor a .safetensors file")
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"fingerprint_backbone: no *.safetensors file in {path}")
    h.update(b"dir\0")
    for file in files + ([path / "config.json"] if (path / "config.json").is_file() else []):
        _hash_file(h, file)
    return h.hexdigest()


@dataclasses.dataclass(frozen=True)
class ReferenceFingerprint:
    """The parts of a store's fingerprint (each a sha256 hex digest) and their combined ``digest``."""

    backbone: str
    template: str
    vocab: str
    data: str
    extra: str

    @property
    def digest(self) -> str:
        return _sha256_json({"format": STORE_FORMAT, **self.to_dict()})

    def to_dict(self) -> dict[str, str]:
        return dataclasses.asdict(self)

    def changed(self, other: "ReferenceFingerprint") -> list[str]:
        """Names of the parts that differ from ``other`` (for messages)."""
        return [f.name for f in dataclasses.fields(self) if getattr(self, f.name) != getattr(other, f.name)]


def reference_fingerprint(
    *,
    backbone: str,
    tokens: TemplateTokens,
    vocab: Mapping[str, int] | Any,
    examples: Sequence[EncodedExample],
    extra: Mapping[str, Any] | None = None,
) -> ReferenceFingerprint:
    """Fingerprint of the reference values of ``examples``.

    ``backbone`` is the digest from :func:`fingerprint_backbone`; ``vocab`` a tokenizer (its
    ``get_vocab()``) or a token -> id mapping; ``extra`` anything else that changes b (precision,
    the seed that initialised new embedding rows), JSON-serialised with sorted keys. The data part is
    independent of the order of ``examples``; duplicate ids raise ValueError.
    """
    if not isinstance(backbone, str) or not backbone:
        raise ValueError(f"backbone must be a non-empty digest string, got {backbone!r}")
    mapping = vocab.get_vocab() if hasattr(vocab, "get_vocab") else vocab
    if not isinstance(mapping, Mapping):
        raise ValueError(f"vocab must be a tokenizer or a mapping, got {type(vocab).__name__}")
    seen: set[str] = set()
    rows = []
    for ex in sorted(examples, key=lambda e: e.id):
        if ex.id in seen:
            raise ValueError(f"duplicate example id {ex.id!r}: a reference store is keyed by id")
        seen.add(ex.id)
        rows.append([ex.id, list(ex.x_ids), list(ex.y_ids)])
    return ReferenceFingerprint(
        backbone=backbone,
        # the layout text: a change of the z-free template (or of what is supervised) must invalidate
        # every store, even though the token ids of the markers may stay the same
        template=_sha256_json({"layout": TemplateLayout.fingerprint_text(), "tokens": dataclasses.asdict(tokens)}),
        vocab=_sha256_json(sorted((str(k), int(v)) for k, v in mapping.items())),
        data=_sha256_json(rows),
        extra=_sha256_json(dict(extra or {})),
    )


# ----------------------------------------------------------------------------------------------
# Batches and the distributed computation
# ----------------------------------------------------------------------------------------------


class ReferenceBatch(NamedTuple):
    """A batch for the reference pass; ``keep`` is False for a padding batch whose results are discarded."""

    batch: Batch
    keep: bool


def num_reference_forwards(*, num_examples: int, batch_size: int, world_size: int) -> int:
    """Forwards every rank runs in :func:`iter_reference_batches` (the same on every rank)."""
    num_batches = -(-num_examples // batch_size)
    return -(-num_batches // world_size)


def iter_reference_batches(
    examples: Sequence[EncodedExample],
    tokens: TemplateTokens,
    *,
    batch_size: int,
    rank: int,
    world_size: int,
    num_z_slots: int = 1,
) -> Iterator[ReferenceBatch]:
    """This rank's share of the reference batches, padded so that every rank runs as many forwards.

    Examples are sorted by (length, id), so the shards do not depend on the input order and batches
    waste little padding; global batch j goes to rank ``j % world_size``. A rank with fewer batches
    repeats the shortest global batch with ``keep=False``.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    _check_rank(rank, world_size)
    order = sorted(examples, key=lambda e: (len(e.x_ids) + len(e.y_ids), e.id))
    chunks = [order[i : i + batch_size] for i in range(0, len(order), batch_size)]
    mine = chunks[rank::world_size]
    for chunk in mine:
        yield ReferenceBatch(collate(chunk, tokens, num_z_slots=num_z_slots), True)
    for _ in range(num_reference_forwards(num_examples=len(order), batch_size=batch_size, world_size=world_size) - len(mine)):
        yield ReferenceBatch(collate(chunks[0], tokens, num_z_slots=num_z_slots), False)


def _check_rank(rank: int, world_size: int) -> None:
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank}")


def reference_output(out: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ref_nll_BN, mask_BN)`` from what ``module(batch, mode="reference")`` returns.

    Accepts a 2-tuple, a mapping or an object with ``ref_nll_BN``/``mask_BN`` (or ``ref_nll``/``mask``).
    """
    if isinstance(out, (tuple, list)) and len(out) == 2:
        return out[0], out[1]
    for ref_key, mask_key in (("ref_nll_BN", "mask_BN"), ("ref_nll", "mask")):
        if isinstance(out, Mapping) and ref_key in out and mask_key in out:
            return out[ref_key], out[mask_key]
        if hasattr(out, ref_key) and hasattr(out, mask_key):
            return getattr(out, ref_key), getattr(out, mask_key)
    raise TypeError(f"the reference forward returned a {type(out).__name__}; expected (ref_nll_BN, mask_BN)")


def gather_parts(obj: Any, world_size: int, all_gather_object: Callable | None) -> list[Any]:
    """Every rank's ``obj``, in rank order (``all_gather_object``: torch.distributed's, or a test's stand-in)."""
    gather = all_gather_object or torch.distributed.all_gather_object
    parts: list[Any] = [None] * world_size
    gather(parts, obj)
    return parts


def compute_reference_store(
    module: Callable,
    batches: Iterable[Batch | ReferenceBatch],
    *,
    rank: int,
    world_size: int,
    all_gather_object: Callable[[list, Any], None] | None = None,
    device: torch.device | str | None = None,
    on_batch: Callable[[int], Any] | None = None,
) -> dict[str, torch.Tensor]:
    """b of every example: ``{id: float32 CPU tensor [n_i]}``, the same on every rank.

    ``module`` is the engine-wrapped module (called as ``module(batch, mode="reference")``, under
    ``torch.no_grad``; not ``inference_mode``, whose tensors cannot meet a training graph). Each rank
    passes its own shard (:func:`iter_reference_batches`); ``ReferenceBatch(keep=False)`` items are run
    and discarded, plain batches are kept. With ``world_size > 1`` the shards are exchanged with
    ``all_gather_object(output_list, obj)`` (default ``torch.distributed.all_gather_object``; pass
    ``functools.partial(..., group=a_gloo_group)`` to keep a large store off the accelerator).
    ``on_batch(forwards done)`` after each forward (every rank runs as many: ``zcvae.loop.setup``'s tick).
    """
    _check_rank(rank, world_size)
    local: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for forwards, item in enumerate(batches, start=1):
            batch, keep = (item.batch, item.keep) if isinstance(item, ReferenceBatch) else (item, True)
            if device is not None:
                batch = batch.to(device)
            ref_nll_BN, mask_BN = reference_output(module(batch, mode="reference"))
            if on_batch is not None:
                on_batch(forwards)
            if not keep:
                continue
            ref_nll_BN = ref_nll_BN.detach().to("cpu", torch.float32)
            mask_BN = mask_BN.detach().to("cpu", torch.bool)
            expected_B = batch.num_supervised.to("cpu")
            if mask_BN.shape[0] != len(batch) or not torch.equal(mask_BN.sum(1), expected_B):
                raise RuntimeError(
                    f"reference forward: supervised counts {mask_BN.sum(1).tolist()} differ from the "
                    f"batch's num_supervised {expected_B.tolist()} (ids {batch.ids[:4]}...)"
                )
            for i, ex_id in enumerate(batch.ids):
                if ex_id in local:
                    raise ValueError(f"example id {ex_id!r} occurs twice in the reference batches")
                b_n = ref_nll_BN[i][mask_BN[i]].clone()
                if not bool(torch.isfinite(b_n).all()):
                    raise RuntimeError(f"reference NLL of example {ex_id!r} is not finite: {b_n.tolist()}")
                local[ex_id] = b_n
    if world_size == 1:
        return local
    merged: dict[str, torch.Tensor] = {}
    for r, part in enumerate(gather_parts(local, world_size, all_gather_object)):
        for ex_id, b_n in part.items():
            if ex_id in merged:
                raise ValueError(f"example id {ex_id!r} was computed on two ranks (rank {r} and another)")
            merged[ex_id] = b_n
    return merged


# ----------------------------------------------------------------------------------------------
# The store
# ----------------------------------------------------------------------------------------------


class ReferenceStoreError(ValueError):
    """A store file that cannot be used: unreadable, truncated, inconsistent, or of another fingerprint."""


def _values_sha256(values: torch.Tensor) -> str:
    return hashlib.sha256(values.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


class ReferenceStore:
    """b of a fixed set of examples, flat in memory: ``values[offsets[e]:offsets[e + 1]]`` is example e.

    ``fingerprint`` is the digest the values were computed under (:class:`ReferenceFingerprint`).
    """

    def __init__(self, *, ids: Sequence[str], values: torch.Tensor, offsets: torch.Tensor, fingerprint: str):
        ids = list(ids)
        if values.dim() != 1 or values.dtype != torch.float32:
            raise ValueError(f"values must be a 1-D float32 tensor, got {values.dtype} {tuple(values.shape)}")
        if offsets.dim() != 1 or offsets.dtype != torch.int64 or offsets.numel() != len(ids) + 1:
            raise ValueError(f"offsets must be int64 of length {len(ids) + 1}, got {offsets.dtype} {tuple(offsets.shape)}")
        if int(offsets[0]) != 0 or int(offsets[-1]) != values.numel() or bool((offsets[1:] < offsets[:-1]).any()):
            raise ValueError("offsets must start at 0, be non-decreasing and end at len(values)")
        self.ids = ids
        self.values = values
        self.offsets = offsets
        self.fingerprint = fingerprint
        self._index = {ex_id: e for e, ex_id in enumerate(ids)}
        if len(self._index) != len(ids):
            raise ValueError("ids must be unique")

    @classmethod
    def from_values(cls, values: Mapping[str, torch.Tensor], *, fingerprint: str) -> "ReferenceStore":
        ids = sorted(values)
        flat = [values[i].detach().to("cpu", torch.float32).reshape(-1) for i in ids]
        lengths = torch.tensor([0] + [v.numel() for v in flat], dtype=torch.int64)
        return cls(
            ids=ids,
            values=torch.cat(flat) if flat else torch.zeros(0, dtype=torch.float32),
            offsets=lengths.cumsum(0),
            fingerprint=fingerprint,
        )

    def __len__(self) -> int:
        return len(self.ids)

    def __contains__(self, ex_id: object) -> bool:
        return ex_id in self._index

    def get(self, ex_id: str) -> torch.Tensor:
        """b of one example, [n_i] (a view into the store)."""
        e = self._index.get(ex_id)
        if e is None:
            raise KeyError(f"example id {ex_id!r} is not in the reference store (fingerprint {self.fingerprint[:12]}, "
                           f"{len(self)} examples): was the store built for another data set?")
        return self.values[int(self.offsets[e]) : int(self.offsets[e + 1])]

    def lookup(
        self, ids: Sequence[str], device: torch.device | str | None = None, *, n_span: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(ref_nll_BN float32, mask_BN bool)`` left-aligned and zero-padded like ``core.losses.gather_span``.

        N is the longest span among ``ids`` unless ``n_span`` is given. KeyError names a missing id.
        """
        rows = [self.get(i) for i in ids]
        width = max((r.numel() for r in rows), default=0) if n_span is None else n_span
        if n_span is not None and any(r.numel() > n_span for r in rows):
            raise ValueError(f"n_span={n_span} is shorter than the longest span {max(r.numel() for r in rows)}")
        ref_nll_BN = torch.zeros(len(rows), width, dtype=torch.float32)
        mask_BN = torch.zeros(len(rows), width, dtype=torch.bool)
        for i, r in enumerate(rows):
            ref_nll_BN[i, : r.numel()] = r
            mask_BN[i, : r.numel()] = True
        if device is not None:
            ref_nll_BN, mask_BN = ref_nll_BN.to(device), mask_BN.to(device)
        return ref_nll_BN, mask_BN

    # -- disk
    def save(self, path: str | os.PathLike, *, parts: Mapping[str, str] | None = None) -> None:
        """Write the store and its JSON sidecar (``path`` with suffix ``.json``), each atomically."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        checksum = _values_sha256(self.values)
        tensors = {
            "values": self.values.contiguous(),
            "offsets": self.offsets.contiguous(),
            "ids_utf8": torch.frombuffer(bytearray(json.dumps(self.ids).encode("utf-8")), dtype=torch.uint8),
        }
        metadata = {"format": STORE_FORMAT, "fingerprint": self.fingerprint, "values_sha256": checksum}
        _atomic_write(path, lambda tmp: save_file(tensors, str(tmp), metadata=metadata))
        sidecar = {
            "format": STORE_FORMAT,
            "fingerprint": self.fingerprint,
            "parts": dict(parts or {}),
            "num_examples": len(self),
            "num_tokens": int(self.values.numel()),
            "values_sha256": checksum,
        }
        _atomic_write(sidecar_path(path), lambda tmp: tmp.write_text(json.dumps(sidecar, indent=2) + "\n"))

    @classmethod
    def load(cls, path: str | os.PathLike, *, fingerprint: str | None = None) -> "ReferenceStore":
        """Read a store; :class:`ReferenceStoreError` naming ``path`` if it is unreadable, inconsistent
        or (when ``fingerprint`` is given) was computed under another fingerprint. FileNotFoundError if absent."""
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"no reference store at {path}")
        try:
            with safe_open(str(path), framework="pt") as f:
                metadata = f.metadata() or {}
                tensors = {k: f.get_tensor(k) for k in f.keys()}
        except Exception as e:  # safetensors raises several types for a bad header or short file
            raise ReferenceStoreError(f"{path}: unreadable reference store (corrupt or truncated): {e}") from e
        if metadata.get("format") != STORE_FORMAT or set(tensors) != {"values", "offsets", "ids_utf8"}:
            raise ReferenceStoreError(f"{path}: not a {STORE_FORMAT} store (format {metadata.get('format')!r}, "
                                      f"tensors {sorted(tensors)})")
        stored = metadata.get("fingerprint", "")
        if fingerprint is not None and stored != fingerprint:
            raise ReferenceStoreError(f"{path}: computed under fingerprint {stored[:16]}, wanted {fingerprint[:16]}")
        if _values_sha256(tensors["values"]) != metadata.get("values_sha256"):
            raise ReferenceStoreError(f"{path}: values do not match their checksum (corrupt file)")
        try:
            ids = json.loads(tensors["ids_utf8"].numpy().tobytes().decode("utf-8"))
            return cls(ids=ids, values=tensors["values"], offsets=tensors["offsets"], fingerprint=stored)
        except (ValueError, UnicodeDecodeError) as e:
            raise ReferenceStoreError(f"{path}: inconsistent reference store: {e}") from e


def sidecar_path(path: str | os.PathLike) -> Path:
    return Path(path).with_suffix(".json")


def store_path(cache_dir: str | os.PathLike | None, name: str, fingerprint: str) -> Path:
    """``{cache_dir}/{name}-{fingerprint[:32]}.safetensors`` (cache_dir None: ``DEFAULT_CACHE_DIR``)."""
    if not name or any(c in name for c in "/\\\0"):
        raise ValueError(f"name must be a plain file-name stem, got {name!r}")
    root = Path(cache_dir if cache_dir is not None else DEFAULT_CACHE_DIR).expanduser()
    return root / f"{name}-{fingerprint[:32]}.safetensors"


def _atomic_write(path: Path, write: Callable[[Path], Any]) -> None:
    atomic_write(path, write, fsync=True)  # a store is expensive to rebuild: on disk before the rename


def load_or_build_reference_store(
    module: Callable,
    examples: Sequence[EncodedExample],
    tokens: TemplateTokens,
    *,
    fingerprint: ReferenceFingerprint,
    name: str,
    batch_size: int,
    rank: int = 0,
    world_size: int = 1,
    cache_dir: str | os.PathLike | None = None,
    write: bool | None = None,
    all_gather_object: Callable[[list, Any], None] | None = None,
    device: torch.device | str | None = None,
    num_z_slots: int = 1,
    tick: Callable[[int, int], Any] | None = None,
) -> ReferenceStore:
    """The store of ``examples`` under ``fingerprint``: read from the cache, or computed and written.

    Collective: with ``world_size > 1`` every rank says whether it could read the file, and all ranks
    rebuild unless every one could (a rank-local decision would leave some ranks in forwards that the
    others never join). ``write`` (default: ``rank == 0``) says whether this rank writes the file;
    pass ``local_rank == 0`` when nodes do not share the cache directory. An unreadable file is reported
    with ``warnings.warn`` (naming the file and the reason) and rebuilt. ``tick(examples done, total)``
    after each forward of a rebuild (an estimate of the examples done over all ranks).
    """
    _check_rank(rank, world_size)
    digest = fingerprint.digest
    path = store_path(cache_dir, name, digest)
    wanted_ids = {ex.id for ex in examples}
    store: ReferenceStore | None = None
    if path.is_file():
        try:
            store = ReferenceStore.load(path, fingerprint=digest)
            if set(store.ids) != wanted_ids:
                raise ReferenceStoreError(f"{path}: holds {len(store)} ids, not the {len(wanted_ids)} of the data set")
        except ReferenceStoreError as e:
            warnings.warn(f"rebuilding the reference store: {e}", stacklevel=2)
            store = None
    found = store is not None
    if world_size > 1:
        found = all(gather_parts(found, world_size, all_gather_object))
    if found:
        return store
    values = compute_reference_store(
        module,
        iter_reference_batches(examples, tokens, batch_size=batch_size, rank=rank, world_size=world_size, num_z_slots=num_z_slots),
        rank=rank,
        world_size=world_size,
        all_gather_object=all_gather_object,
        device=device,
        on_batch=None if tick is None else lambda forwards: tick(min(len(examples), forwards * batch_size * world_size), len(examples)),
    )
    if set(values) != wanted_ids:  # depends on the world size and sharding, so not an assert (-O drops those)
        missing = sorted(wanted_ids - set(values))
        raise RuntimeError(f"reference batches covered {len(values)} of {len(wanted_ids)} examples; missing ids {missing[:5]}")
    store = ReferenceStore.from_values(values, fingerprint=digest)
    if write if write is not None else rank == 0:
        store.save(path, parts=fingerprint.to_dict())
    return store
