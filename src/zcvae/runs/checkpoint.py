"""Resumable checkpoints: atomic, verified, kept N deep, refused when the objective would change.

Layout of one checkpoint (``RUN_DIR/checkpoints/step_00000400/``)::

    engine/                  the engine's own state (local: safetensors + optimizer; DeepSpeed:
                             save_checkpoint; FSDP2: torch DCP), optimizer state included
    trainable.safetensors    every requires_grad parameter, gathered in full (rank 0): engine-independent,
                             so `zcvae export` reads any engine's run without pickle or a process group
    buffers.safetensors      the latent heads' buffers (router standardisation statistics): not
                             parameters, but the trained model needs them
    objective.safetensors    the objective's own tensors, only when it has any (the following reference's
                             copy of the adapter, which is frozen and so in no engine state)
    rng_rank{r}.pt           each rank's python/numpy/torch (CPU, CUDA) RNG states (weights_only-loadable)
    meta.json                step, data position, world size, engine, c_base, aggregation mode, resolved config
    COMPLETE                 written last by rank 0: a manifest of every file with its size and sha256

Atomicity: every rank writes into ``step_N.tmp/``; after a barrier rank 0 checks the files, writes
``COMPLETE`` and renames the directory to ``step_N/``. A crash at any point before the rename leaves a
``.tmp`` directory that is never loaded (and removed by the next save); the previous checkpoint stays
loadable. Every load checks the manifest before any loader runs (every file listed, no file unlisted:
sizes and sha256), so a truncated, corrupted or added file is reported by name rather than loaded.
``resume="auto"`` takes the newest complete checkpoint that passes this check, saying why it passed
over newer ones, and refuses only when none passes.

The checkpoint directory must be on a filesystem every rank sees (as DeepSpeed and DCP assume): rank 0
writes the manifest of files the other ranks wrote.

What may change on resume: ``max_steps``, logging and evaluation settings, the world size for the
local and FSDP2 engines (DDP replicas hold full state; DCP reshards). What is refused, with a ValueError
naming both values: a changed ``reconstruction_loss_token_aggregation_mode``, ``reconstruction_loss_sum_scale``
or c_base fingerprint (the objective would silently change), another training set (the fingerprint of the encoded
training examples, naming the settings that moved), another seed (the batches' permutation), a different engine, a
DeepSpeed world size change (ZeRO partitions do not reshard), and a changed latent or LoRA shape.

Events: ``CheckpointManager(on_event=f)`` calls ``f("files_written", step)`` after every rank wrote
the files of a checkpoint but before ``COMPLETE``, and ``f("complete", step)`` once it is in place. The
crash tests kill the process there (``zcvae.train.faults``).
"""

from __future__ import annotations

import logging
import errno
import hashlib
import json
import os
import random
import re
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from zcvae.runs.rundir import disk_error, read_json

logger = logging.getLogger(__name__)

__all__ = [
    "COMPLETE",
    "CheckpointManager",
    "checkpoint_dirs",
    "load_trainable_state",
    "read_meta",
    "resolve_checkpoint",
    "verify_checkpoint",
]

COMPLETE = "COMPLETE"
META = "meta.json"
TRAINABLE = "trainable.safetensors"
BUFFERS = "buffers.safetensors"
OBJECTIVE_TENSORS = "objective.safetensors"
ENGINE_DIR = "engine"
FORMAT_VERSION = 1
AGGREGATION_MODE_FIELD = "reconstruction_loss_token_aggregation_mode"
# Fields that change parameter shapes or what the parameters mean: a resume across them cannot work.
STRUCTURAL_FIELDS = (
    "latent_type",
    "num_latents",
    "latent_dim",
    "num_z_slots",
    "learned_prior",
    "lora_r",
    "lora_alpha",
    "lora_target_modules",
)
# Fields that decide the training examples: named when a resume finds another training set than its checkpoint's
# (check_same_train_data).
TRAIN_DATA_FIELDS = ("task", "train_data", "num_train_examples", "max_length")
# Fields that change the objective or what the model computes without changing any shape: a resume may
# change one only when asked (--resume-allow-change FIELD), and the change is recorded with its step.
OBJECTIVE_FIELDS = (
    "objective",
    "reconstruction_weight",
    "distribution_normalized_reconstruction_weight",
    "example_inverse_surprisal_weighted_reconstruction_weight",
    "token_weighted_reconstruction_weight",
    "normalized_concentration_corrected_token_weighted_reconstruction_weight",
    "normalized_inverse_surprisal_token_weighted_reconstruction_weight",
    "token_weight_alpha",
    "example_inverse_surprisal_epsilon",
    "inverse_surprisal_token_weight_epsilon",
    "posterior_pooling",
    "kl_weight",
    "kl_weight_scale",
    "reconstruction_weight_scale",
    "kl_schedule",
    "kl_delay_fraction",
    "kl_delay_mode",
    "kl_delay_max_fraction",
    "kl_delay_read_share",
    "kl_delay_check_every",
    "kl_ramp_fraction",
    "kl_cycles",
    "posterior_entropy_weight",
    "router_support_weight",
    "router_support_schedule",
    "router_marginal_kl_weight",
    "inter_latent_divergence_weight",
    "posterior_variance_weight",
    "num_latent_samples",
    "lora_dropout",
    "reference_refresh_every",
)
_STEP_DIR = re.compile(r"^step_(\d{8})$")


# --------------------------------------------------------------------------- finding checkpoints
def checkpoint_dirs(directory: str | os.PathLike) -> list[Path]:
    """Complete checkpoints in ``directory`` (those with a ``COMPLETE`` marker), oldest first."""
    root = Path(directory)
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        m = _STEP_DIR.match(child.name)
        if m and child.is_dir() and (child / COMPLETE).is_file():
            found.append((int(m.group(1)), child))
    return [path for _, path in sorted(found)]


def resolve_checkpoint(source: str | os.PathLike, *, default_dir: str | os.PathLike | None = None) -> Path | None:
    """The checkpoint directory that ``source`` names.

    ``"auto"``: the newest complete checkpoint in ``default_dir`` (None when there is none). A
    checkpoint directory: itself, if complete (ValueError naming it otherwise). A run directory or a
    ``checkpoints/`` directory: its newest complete checkpoint (ValueError when it has none).
    """
    if str(source) == "auto":
        if default_dir is None:
            raise ValueError("resume='auto' needs the run's checkpoint directory")
        found = checkpoint_dirs(default_dir)
        return found[-1] if found else None
    path = Path(source)
    if not path.exists():
        raise ValueError(f"resume: checkpoint {str(path)!r} does not exist")
    if (path / COMPLETE).is_file():
        return path
    for candidate in (path, path / "checkpoints"):
        found = checkpoint_dirs(candidate)
        if found:
            return found[-1]
    if path.name.endswith(".tmp") or _STEP_DIR.match(path.name) or (path / META).exists():
        raise ValueError(
            f"resume: checkpoint {str(path)!r} is incomplete (no {COMPLETE} marker): its save was interrupted; "
            f"resume from an earlier checkpoint or use --resume auto"
        )
    raise ValueError(f"resume: {str(path)!r} holds no complete checkpoint (step_NNNNNNNN/ with a {COMPLETE} marker)")


# --------------------------------------------------------------------------- manifest
def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _manifest(directory: Path) -> dict[str, dict[str, Any]]:
    files = {}
    for path in sorted(p for p in directory.rglob("*") if p.is_file()):
        rel = path.relative_to(directory).as_posix()
        if rel == COMPLETE:
            continue
        files[rel] = {"size": path.stat().st_size, "sha256": _sha256(path)}
    return files


def verify_checkpoint(directory: str | os.PathLike) -> dict[str, Any]:
    """Check every file of the ``COMPLETE`` manifest (exists, size, sha256); return the marker.

    ValueError naming the first missing, truncated or corrupted file.
    """
    directory = Path(directory)
    marker = directory / COMPLETE
    try:
        complete = json.loads(marker.read_text())
        files = complete["files"]
    except FileNotFoundError:
        raise ValueError(f"checkpoint {str(directory)!r} is incomplete: no {COMPLETE} marker") from None
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ValueError(f"checkpoint file {str(marker)!r} is corrupt: {err}") from None
    # a file the manifest does not list would reach a loader unchecked (DCP's .metadata is unpickled)
    extra = sorted(set(p.relative_to(directory).as_posix() for p in directory.rglob("*") if p.is_file()) - set(files) - {COMPLETE})
    if extra:
        raise ValueError(f"checkpoint file {str(directory / extra[0])!r} is not in the {COMPLETE} manifest (added after the save?); refusing to load it")
    for rel, expected in sorted(files.items()):
        path = directory / rel
        if not path.is_file():
            raise ValueError(f"checkpoint file {str(path)!r} is missing (listed in {COMPLETE})")
        size = path.stat().st_size
        if size != expected["size"]:
            raise ValueError(f"checkpoint file {str(path)!r} is truncated or corrupt: {size} bytes, expected {expected['size']}")
        if _sha256(path) != expected["sha256"]:
            raise ValueError(f"checkpoint file {str(path)!r} is corrupt: its sha256 differs from the {COMPLETE} manifest")
    return complete


def read_meta(directory: str | os.PathLike) -> dict[str, Any]:
    """The checkpoint's ``meta.json``; ValueError naming the file when it is missing or not JSON."""
    return read_json(Path(directory) / META, what="checkpoint file")


def load_trainable_state(directory: str | os.PathLike) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(trainable parameters, latent-head buffers) of a verified checkpoint, as CPU tensors."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    directory = Path(directory)
    verify_checkpoint(directory)
    out = []
    for name in (TRAINABLE, BUFFERS):
        path = directory / name
        try:
            out.append(load_file(str(path)) if path.exists() else {})
        except (SafetensorError, OSError) as err:
            raise ValueError(f"checkpoint file {str(path)!r} could not be read: {err}") from None
    return out[0], out[1]


def nonfinite_tensors(named) -> list[str]:
    """Names of the ``(name, tensor)`` pairs whose tensor holds a NaN or an infinity (a DTensor by its
    local shard): what is never saved (the trainer) or exported (export)."""
    bad = []
    for name, tensor in named:
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        if local.is_floating_point() and local.numel() and not bool(torch.isfinite(local).all()):
            bad.append(name)
    return bad


# --------------------------------------------------------------------------- RNG
def _rng_state() -> dict[str, Any]:
    np_state = np.random.get_state()
    state = {
        "python": random.getstate(),
        # weights_only loading admits tensors, not numpy arrays
        "numpy": {
            "key": torch.from_numpy(np_state[1].astype(np.int64)),
            "pos": int(np_state[2]),
            "has_gauss": int(np_state[3]),
            "cached_gaussian": float(np_state[4]),
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    n = state["numpy"]
    np.random.set_state(("MT19937", n["key"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached_gaussian"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        cuda = state["cuda"]
        if len(cuda) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(cuda)
        else:
            torch.cuda.set_rng_state(cuda[0])


# --------------------------------------------------------------------------- the manager
def _config_dict(config: Any) -> dict[str, Any]:
    if config is None:
        return {}
    if hasattr(config, "to_dict"):
        return dict(config.to_dict())
    return dict(config)


def _c_base_dict(c_base: Any) -> dict[str, Any] | None:
    if c_base is None:
        return None
    if hasattr(c_base, "to_dict"):
        return dict(c_base.to_dict())
    if isinstance(c_base, dict):
        return dict(c_base)
    return {"value": float(c_base)}


def _engine_name(config: dict[str, Any], engine: Any) -> str:
    return str(config.get("engine") or type(engine).__name__)


def _latent_buffers(model: Any) -> dict[str, torch.Tensor]:
    """Buffers of the latent heads (everything outside the backbone's peft model).

    The backbone's own buffers (rotary frequencies) are rebuilt from its config; the heads' buffers
    (standardisation statistics set by calibration) exist nowhere else.
    """
    out = {}
    for name, buf in getattr(model, "named_buffers", lambda: [])():
        if name.startswith("peft_model.") or buf is None:
            continue
        full = buf.full_tensor() if hasattr(buf, "full_tensor") else buf
        out[name] = full.detach().to("cpu", copy=True).contiguous()
    return out


class CheckpointManager:
    """Saves and loads resumable checkpoints under one directory (``RUN_DIR/checkpoints``).

    Call :meth:`save` and :meth:`load` on every rank: both hold barriers and collectives.
    """

    def __init__(self, directory: str | os.PathLike, *, keep: int, is_main: bool,
                 on_event: Callable[[str, int], None] | None = None):
        if not isinstance(keep, int) or keep < 1:
            raise ValueError(f"keep_last_checkpoints must be an int >= 1, got {keep!r}")
        self.directory = Path(directory)
        self.keep = keep
        self.is_main = is_main
        self.on_event = on_event  # (event, step): "files_written", then "complete"

    def _event(self, event: str, step: int) -> None:
        if self.on_event is not None:
            self.on_event(event, step)

    def path_for(self, step: int) -> Path:
        return self.directory / f"step_{step:08d}"

    def latest(self) -> Path | None:
        found = checkpoint_dirs(self.directory)
        return found[-1] if found else None

    # ---------------------------------------------------------------- save
    def save(self, engine: Any, *, step: int, config: Any, c_base: Any, trainer_state: dict | None = None,
             trainer_tensors: dict[str, torch.Tensor] | None = None, train_data: dict | None = None) -> Path:
        """Write checkpoint ``step`` atomically; prune to the newest ``keep``; return its path.

        ``trainer_state`` (plain types, into meta.json) and ``trainer_tensors`` (the same on every rank;
        rank 0 writes them) are the objective's own state besides the weights; :meth:`load` returns both.
        ``train_data``: ``{"fingerprint", "num_examples"}`` of the training set (``encoded_fingerprint``), which
        :meth:`load` compares.

        Any failure (a full disk, a read-only mount, Ctrl-C) removes the ``.tmp`` directory on rank 0 and
        leaves the earlier checkpoints as they were; a full or read-only filesystem becomes a ValueError
        naming the path and, for a full disk, the bytes a checkpoint takes and the bytes free.
        """
        if not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be an int >= 0, got {step!r}")
        tmp = self.path_for(step).with_name(self.path_for(step).name + ".tmp")
        try:
            return self._save(engine, step=step, config=config, c_base=c_base, trainer_state=trainer_state, trainer_tensors=trainer_tensors,
                              train_data=train_data)
        except BaseException as err:
            space = disk_error(err)
            # Ctrl-C and a full or read-only disk: this process lives on, so it tidies up (a crash leaves
            # the .tmp to the next save, which removes it; it is never loaded either way)
            if self.is_main and (space is not None or isinstance(err, (KeyboardInterrupt, OSError))):
                shutil.rmtree(tmp, ignore_errors=True)
            if space is None:
                raise
            raise ValueError(self._disk_message(tmp, space)) from None

    def _disk_message(self, tmp: Path, code: int) -> str:
        if code != errno.ENOSPC and code != errno.EDQUOT:
            return (f"cannot write checkpoint {str(tmp)!r}: {os.strerror(code)}; the earlier checkpoints are intact. "
                    f"Make {str(self.directory)!r} writable, then resume with --resume auto")
        latest = self.latest()
        need = sum(p.stat().st_size for p in latest.rglob("*") if p.is_file()) if latest is not None else None
        try:
            free = shutil.disk_usage(self.directory).free
        except OSError:
            free = None
        sizes = []
        if need is not None:
            sizes.append(f"a checkpoint of this run takes {need:,} bytes")
        if free is not None:
            sizes.append(f"{free:,} bytes are free there")
        return (f"no space left on device while writing checkpoint {str(tmp)!r}{' (' + ', '.join(sizes) + ')' if sizes else ''}; "
                f"the partial checkpoint was removed and the earlier checkpoints are intact. Free space, then resume with --resume auto")

    def _save(self, engine: Any, *, step: int, config: Any, c_base: Any, trainer_state: dict | None = None,
              trainer_tensors: dict[str, torch.Tensor] | None = None, train_data: dict | None = None) -> Path:
        final = self.path_for(step)
        tmp = final.with_name(final.name + ".tmp")
        if self.is_main:
            self.directory.mkdir(parents=True, exist_ok=True)
            for stale in self.directory.glob("step_*.tmp"):
                shutil.rmtree(stale, ignore_errors=True)
            tmp.mkdir()
        engine.barrier()

        cfg = _config_dict(config)
        cb = _c_base_dict(c_base)
        meta = {
            "format": FORMAT_VERSION,
            "step": step,
            # the sampler is a pure function of (seed, step): the step is the data position
            "data_position": step,
            "world_size": int(engine.world_size),
            "engine": _engine_name(cfg, engine),
            AGGREGATION_MODE_FIELD: cfg.get(AGGREGATION_MODE_FIELD),
            "c_base": cb,
            "config": cfg,
        }
        if train_data:
            meta["train_data"] = dict(train_data)
        if trainer_state:  # the objective's own state (the KL delay that ends on evidence: where it ended)
            meta["trainer_state"] = trainer_state
        # client_state travels through the engine (weights_only-loadable: plain types only)
        client_state = {"step": step, "world_size": meta["world_size"], "engine": meta["engine"], "meta_json": json.dumps(meta, sort_keys=True, default=str)}
        engine.save_checkpoint(str(tmp / ENGINE_DIR), client_state=client_state)

        # collective on every rank; only rank 0 gets tensors
        trainable = engine.trainable_state_dict()
        torch.save(_rng_state(), tmp / f"rng_rank{engine.rank}.pt")
        if self.is_main:
            from safetensors.torch import save_file

            save_file({n: t.contiguous() for n, t in trainable.items()}, str(tmp / TRAINABLE))
            buffers = _latent_buffers(engine.model)
            if buffers:
                save_file(buffers, str(tmp / BUFFERS))
            if trainer_tensors:
                save_file({k: t.detach().to("cpu").contiguous() for k, t in trainer_tensors.items()}, str(tmp / OBJECTIVE_TENSORS))
            (tmp / META).write_text(json.dumps(meta, indent=2, sort_keys=True, default=str) + "\n")
        engine.barrier()
        self._event("files_written", step)

        if self.is_main:
            complete = {"format": FORMAT_VERSION, "step": step, "files": _manifest(tmp)}
            marker_tmp = tmp / (COMPLETE + ".part")
            with open(marker_tmp, "w") as f:
                f.write(json.dumps(complete, indent=2, sort_keys=True) + "\n")
                f.flush()
                os.fsync(f.fileno())
            os.replace(marker_tmp, tmp / COMPLETE)
            old = final.with_name(final.name + ".old")
            if final.exists():  # the same step saved again (a run resumed at its last step)
                shutil.rmtree(old, ignore_errors=True)
                os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
            _fsync_dir(self.directory)
            self._prune()
        engine.barrier()
        self._event("complete", step)
        return final

    def _prune(self) -> None:
        for path in checkpoint_dirs(self.directory)[: -self.keep]:
            # rename first: a crash mid-delete must not leave a half-deleted dir that still looks complete
            doomed = path.with_name(path.name + ".deleting")
            os.replace(path, doomed)
            shutil.rmtree(doomed, ignore_errors=True)

    # ---------------------------------------------------------------- load
    def _newest_loadable(self) -> tuple[Path | None, dict[str, Any] | None]:
        """(path, meta) of the newest complete checkpoint whose files match its manifest, saying why
        each newer one was passed over; (None, None) when there is no checkpoint; ValueError when there
        are checkpoints but none is loadable. Every rank reads the same files, so all agree."""
        found = checkpoint_dirs(self.directory)
        reasons = []
        for path in reversed(found):
            try:
                verify_checkpoint(path)
                meta = read_meta(path)
            except ValueError as err:
                reasons.append(str(err))
                continue
            if reasons:
                logger.warning(f"[resume] skipped {len(reasons)} newer checkpoint(s): {'; '.join(reasons)}; falling back to {str(path)!r}")
            return path, meta
        if found:
            raise ValueError(f"resume auto: no checkpoint in {str(self.directory)!r} is loadable: {'; '.join(reasons)}")
        return None, None

    def load(self, engine: Any, source: str | os.PathLike, *, config: Any, c_base: Any, allow_changes: tuple[str, ...] = (),
             train_data: dict | None = None) -> dict[str, Any]:
        """Restore the engine, this rank's RNG states and the step from ``source``.

        ``source``: a checkpoint directory, a run or checkpoints directory (its newest complete
        checkpoint) or ``"auto"`` (the newest one here whose files match its manifest, falling back past
        corrupt ones; a fresh start, step 0, when there is none). Returns ``{"step", "checkpoint", "meta",
        "changes", "trainer_tensors"}`` (``changes``: the objective fields ``allow_changes`` let change, see
        :func:`objective_changes`; ``trainer_tensors``: what :meth:`save` was given, CPU tensors, {} for none).
        """
        if str(source) == "auto":
            path, meta = self._newest_loadable()
            if path is None:
                return {"step": 0, "checkpoint": None, "meta": None, "changes": [], "trainer_tensors": {}}
        else:
            path = resolve_checkpoint(source, default_dir=self.directory)
            # every rank verifies, so every rank raises the same error rather than one rank hanging
            verify_checkpoint(path)
            meta = read_meta(path)
        changes = check_compatible(meta, config=_config_dict(config), c_base=_c_base_dict(c_base), world_size=int(engine.world_size),
                                   engine=engine, path=path, allow_changes=tuple(allow_changes), train_data=train_data)
        try:
            client_state = engine.load_checkpoint(str(path / ENGINE_DIR))
        except Exception as err:  # noqa: BLE001 - re-raised with what was saved and what loads it
            raise RuntimeError(
                f"could not load checkpoint {str(path)!r} (saved by engine {meta['engine']!r} at world size "
                f"{meta['world_size']}; loading with engine {_engine_name(_config_dict(config), engine)!r} at world size "
                f"{engine.world_size}): {type(err).__name__}: {err}"
            ) from err
        if int(client_state.get("step", meta["step"])) != meta["step"]:
            raise ValueError(f"checkpoint {str(path)!r}: the engine state is for step {client_state.get('step')}, {META} says {meta['step']}")
        rng = path / f"rng_rank{engine.rank}.pt"
        if rng.is_file():
            try:
                _set_rng_state(torch.load(rng, map_location="cpu", weights_only=True))
            except Exception as err:  # noqa: BLE001 - name the file
                raise ValueError(f"checkpoint file {str(rng)!r} could not be read: {err}") from err
        else:
            warnings.warn(f"{rng} is missing (the checkpoint was saved by {meta['world_size']} ranks): rank {engine.rank} keeps its seeded RNG state")
        tensors = path / OBJECTIVE_TENSORS
        try:
            from safetensors.torch import load_file

            trainer_tensors = load_file(str(tensors)) if tensors.is_file() else {}
        except Exception as err:  # noqa: BLE001 - name the file
            raise ValueError(f"checkpoint file {str(tensors)!r} could not be read: {err}") from err
        engine.barrier()
        return {"step": int(meta["step"]), "checkpoint": str(path), "meta": meta, "changes": changes, "trainer_tensors": trainer_tensors}


def check_compatible(meta: dict[str, Any], *, config: dict[str, Any], c_base: dict[str, Any] | None, world_size: int, engine: Any,
                     path: Path, allow_changes: tuple[str, ...] = (), train_data: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """ValueError, naming the field and both values, when resuming ``meta`` under ``config`` would not
    continue the same training run. Returns the changes of :data:`OBJECTIVE_FIELDS` that
    ``allow_changes`` lets through, as ``{"field", "from", "to", "step"}``."""
    where = f"checkpoint {str(path)!r}"
    saved_cfg = meta.get("config") or {}
    saved_mode = meta.get(AGGREGATION_MODE_FIELD) or saved_cfg.get(AGGREGATION_MODE_FIELD)
    mode = config.get(AGGREGATION_MODE_FIELD)
    if saved_mode is not None and mode is not None and saved_mode != mode:
        raise ValueError(
            f"{AGGREGATION_MODE_FIELD} changed: {where} was trained with {saved_mode!r}, this run asks for {mode!r}; "
            f"the objective and its mode-matched c_base would silently change. Resume with "
            f"--{AGGREGATION_MODE_FIELD.replace('_', '-')} {saved_mode} or start a new run."
        )
    # the sum mode's fixed scale C changes the objective but not c_base's record (per sequence, before C)
    scale_field = "reconstruction_loss_sum_scale"
    if saved_cfg and saved_cfg.get(scale_field) != config.get(scale_field) and saved_mode == mode:
        raise ValueError(f"{scale_field} changed: {where} was trained with {saved_cfg.get(scale_field)!r}, this run asks for "
                         f"{config.get(scale_field)!r}; the objective would silently change. Resume with the old value or start a new run.")
    # before c_base: a changed latent changes c_base's fingerprint too, which would blame the backbone or data
    for name in STRUCTURAL_FIELDS:
        if name in saved_cfg and name in config and saved_cfg[name] != config[name]:
            raise ValueError(f"{name} changed: {where} has {saved_cfg[name]!r}, this run {config[name]!r}; the trained parameters do not fit. "
                             f"Resume with --{name.replace('_', '-')} {saved_cfg[name]} or start a new run.")
    if "seed" in saved_cfg and "seed" in config and saved_cfg["seed"] != config["seed"]:
        # the sampler is a pure function of (seed, step): another seed deals other batches from the resumed step on
        raise ValueError(f"seed changed: {where} has {saved_cfg['seed']!r}, this run {config['seed']!r}; the batches from here on "
                         f"would follow another permutation while run_config.json claims seed {config['seed']!r} for every step. "
                         f"Resume with --seed {saved_cfg['seed']} or start a new run.")
    changes = objective_changes(saved_cfg, config, allow_changes=allow_changes, where=where, step=int(meta.get("step", 0)))
    # before c_base: another task changes c_base's fingerprint too (its validation split changes with it), and
    # blaming "the backbone or the validation data" would hide which setting moved
    check_same_train_data(meta.get("train_data"), train_data, saved_cfg=saved_cfg, config=config, where=where)
    saved_cb = meta.get("c_base")
    if saved_cb and c_base:
        if saved_cb.get("mode") is not None and c_base.get("mode") is not None and saved_cb["mode"] != c_base["mode"]:
            raise ValueError(f"{AGGREGATION_MODE_FIELD} of c_base changed: {where} has {saved_cb['mode']!r}, this run {c_base['mode']!r}")
        if saved_cb.get("fingerprint") and c_base.get("fingerprint") and saved_cb["fingerprint"] != c_base["fingerprint"]:
            raise ValueError(
                f"c_base changed: {where} was trained with c_base {saved_cb.get('value')} (fingerprint "
                f"{saved_cb['fingerprint']}, {saved_cb.get('source')}), this run computed {c_base.get('value')} "
                f"(fingerprint {c_base['fingerprint']}, {c_base.get('source')}); the backbone, the validation data or "
                f"zfree_reference_scale differ, so the objective would silently change"
            )
    saved_engine, this_engine = meta.get("engine"), _engine_name(config, engine)
    if saved_engine != this_engine:
        raise ValueError(
            f"engine changed: {where} was written by engine {saved_engine!r}, this run uses engine {this_engine!r}; "
            f"their optimizer-state formats differ. Resume with --engine {saved_engine}, or export the adapter and start a new run."
        )
    saved_world = int(meta.get("world_size", world_size))
    if saved_world != world_size and this_engine == "deepspeed":
        raise ValueError(
            f"world size changed: {where} was written by {saved_world} DeepSpeed ranks, this run has {world_size}; "
            f"ZeRO optimizer partitions do not reshard. Resume with {saved_world} ranks."
        )
    return changes


def check_same_train_data(saved: dict[str, Any] | None, current: dict[str, Any] | None, *, saved_cfg: dict[str, Any],
                          config: dict[str, Any], where: str) -> None:
    """ValueError when a checkpoint's training set (its ``encoded_fingerprint``) is not this run's: the run would go
    on with other examples (or another order of them) while run_config.json claims them for every step. A checkpoint
    written before the record existed, or a caller without one, is not checked."""
    if not saved or not current or saved.get("fingerprint") == current.get("fingerprint"):
        return
    moved = [f"{k} {saved_cfg[k]!r} -> {config.get(k)!r}" for k in TRAIN_DATA_FIELDS if k in saved_cfg and saved_cfg[k] != config.get(k)]
    why = "; ".join(moved) if moved else "the same settings: the data file's contents changed"
    raise ValueError(
        f"training data changed: {where} was trained on {saved.get('num_examples')} examples (fingerprint "
        f"{str(saved.get('fingerprint'))[:12]}), this run has {current.get('num_examples')} (fingerprint "
        f"{str(current.get('fingerprint'))[:12]}): {why}. Resume with the data and settings the checkpoint was trained on, "
        f"or start a new run in another --output-dir"
    )


def objective_changes(saved_cfg: dict[str, Any], config: dict[str, Any], *, allow_changes: tuple[str, ...], where: str, step: int) -> list[dict[str, Any]]:
    """The allowed changes of objective fields between a checkpoint's config and this run's; ValueError
    for a change not allowed, or for an ``allow_changes`` entry that is not such a field."""
    for name in allow_changes:
        if name in STRUCTURAL_FIELDS or name == AGGREGATION_MODE_FIELD:
            raise ValueError(f"--resume-allow-change {name}: {name} cannot change on resume (the trained parameters or the "
                             f"mode-matched c_base would not fit); start a new run")
        if name not in OBJECTIVE_FIELDS:
            raise ValueError(f"--resume-allow-change {name}: not a field that resume refuses; the fields are {', '.join(OBJECTIVE_FIELDS)}")
    allowed = set(allow_changes)
    if "objective" in allowed:  # a preset sets the weights and alpha: allowing it allows what it sets
        allowed |= set(OBJECTIVE_FIELDS[1:9])
    changes = []
    for name in OBJECTIVE_FIELDS:
        if name not in saved_cfg or name not in config or saved_cfg[name] == config[name]:
            continue
        if name not in allowed:
            flag = "--" + name.replace("_", "-")
            raise ValueError(
                f"{name} changed: {where} was trained with {saved_cfg[name]!r}, this run asks for {config[name]!r}; the objective "
                f"would change mid-run while run_config.json claims the new value throughout. Resume with {flag} "
                f"{saved_cfg[name]}, or pass --resume-allow-change {name} to change it from step {step} on (recorded in run_config.json)"
            )
        changes.append({"field": name, "from": saved_cfg[name], "to": config[name], "step": step})
    return changes


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
