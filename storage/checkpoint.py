"""Training checkpoints with torch.distributed.checkpoint (DCP): save, verify, resume, prune.

Layout of `out_dir/step-N/` (N = optimizer steps taken):
    .metadata, __R_r.distcp   model (trained parameters: not a frozen base) and optimizer state, sharded by rank;
                              DCP reshards on load, so a checkpoint written by W ranks resumes on any number of
                              ranks (with or without FSDP)
    train_state.json          step, scheduler, data-loader position, configs, world size (written by rank 0)
    rng_rank{r}.pt            torch RNG states of rank r (CPU, and CUDA when used)
    manifest.json             size and CRC-32 of every other file (written last, before the rename)
Loading never runs code from the checkpoint: `.metadata` is unpickled with an allow-list of the classes DCP
metadata holds (`SafeReader`), non-tensor entries are read with torch.load(weights_only=True) (`SafeLoadPlanner`);
anything else raises `UnsafeCheckpoint` before it is built. Integrity: every file is checked against the manifest
before anything is loaded (`verify_checkpoint`); a damaged file raises `DamagedCheckpoint` naming it and the
next-older checkpoint. A checkpoint is still trusted to be the one you meant: the manifest detects damage, not a
deliberate substitution.
Every rank writes into `step-N.tmp/`; once all have finished, the files are checksummed and fsynced (each rank a
share), rank 0 writes and fsyncs the manifest, renames the directory to `step-N` and fsyncs the parent. A directory
named `step-N` is therefore complete and on disk, and `latest_checkpoint` never considers `.tmp` leftovers.

The final weights are exported by weights.py (`export_model`), whose `load_model` also reads these checkpoints.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import pickle
import re
import shutil
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import ReadItem
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from model import Transformer
from storage.manifest import (
    MANIFEST_NAME,
    DamagedCheckpoint,
    file_damage,
    file_records,
    fsync,
    read_manifest,
)
from storage.places import STATE_NAME

# A checkpoint holds the trained parameters only: a frozen base (LoRA) comes from the run's --init_from weights.
# strict=False on load: the entries come from `_trained_state` of the same model, and DCP fails on any it lacks.
TRAINED = StateDictOptions(ignore_frozen_params=True, strict=False)
_STEP_DIR = re.compile(r"^step-(\d+)$")


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _gather(value: object) -> list:
    """`value` of every rank, in rank order (a one-element list without a process group)."""
    if not dist.is_initialized():
        return [value]
    values: list = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values


def _write_manifest(tmp: Path) -> None:
    """Collective: checksum and fsync every file of `tmp` (rank r takes every W-th file), then rank 0 writes and
    fsyncs the manifest of them all."""
    files = sorted(p.name for p in tmp.iterdir() if p.name != MANIFEST_NAME)
    mine = file_records([tmp / name for name in files[rank()::_world()]])
    for name in mine:
        fsync(tmp / name)
    records = {name: record for part in _gather(mine) for name, record in part.items()}
    if rank() == 0:
        manifest = tmp / MANIFEST_NAME
        with manifest.open("w") as f:
            json.dump({"files": dict(sorted(records.items()))}, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        fsync(tmp)


def verify_checkpoint(path: Path) -> None:
    """Check every file of checkpoint `path` against its manifest (collective under a process group: each rank
    checks a share); DamagedCheckpoint names the first damaged file and the next-older checkpoint to use."""
    try:
        manifest = read_manifest(path)
        problems = file_damage(path, manifest, sorted(manifest)[rank()::_world()])
    except ValueError as e:
        problems = [str(e)]
    problems = sorted(p for part in _gather(problems) for p in part)
    if problems:
        older = older_checkpoint(path)
        hint = (f"resume from the next-older checkpoint with --resume {older}" if older else
                "no older checkpoint exists: start again from scratch or from your own copy")
        raise DamagedCheckpoint(f"checkpoint {path} is damaged: {problems[0]}"
                                + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else "") + f"; {hint}")


@contextlib.contextmanager
def _single_process_quiet() -> Iterator[None]:
    """Silence DCP's warning that it runs without a process group (intended for single-process runs)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


class SaveFailed(RuntimeError):
    """A checkpoint could not be written; the message names the cause and the last complete checkpoint."""


LOW_DISK = 64 * 2**20  # free bytes under which a failed write is reported as a full disk


def save_checkpoint(out_dir: Path, step: int, model: Transformer, optimizer: torch.optim.Optimizer,
                    train_state: dict, write_files: Callable[[Path], None] | None = None) -> Path:
    """Write `out_dir/step-{step}` (collective: every rank calls it) and return its path. SaveFailed names the cause
    (a full disk, a read-only directory) and the last complete checkpoint; the partial step-N.tmp is removed.

    `train_state` must be JSON-serialisable and identical on every rank (rank 0 writes it). `write_files(directory)`:
    rank 0 adds files of its own (the run's tokenizer), covered by the manifest like the rest.
    """
    try:
        return _save(out_dir, step, model, optimizer, train_state, write_files)
    except (OSError, RuntimeError, CheckpointException) as e:  # DCP reports a short write as "unexpected pos"
        shutil.rmtree(out_dir / f"step-{step}.tmp", ignore_errors=True)
        full = shutil.disk_usage(out_dir).free < LOW_DISK if out_dir.is_dir() else False
        cause = "No space left on device" if full else getattr(e, "strerror", None) or f"{type(e).__name__}: {e}"
        last = latest_checkpoint(out_dir)
        raise SaveFailed(f"could not save step-{step}: {cause} at {out_dir}; the last complete checkpoint is "
                         f"{last.name if last else 'none'}") from e


def _save(out_dir: Path, step: int, model: Transformer, optimizer: torch.optim.Optimizer,
          train_state: dict, write_files: Callable[[Path], None] | None) -> Path:
    final = out_dir / f"step-{step}"
    tmp = out_dir / f"step-{step}.tmp"
    if rank() == 0 and tmp.exists():
        shutil.rmtree(tmp)  # left over from a save that was interrupted
    _barrier()
    state = {"model": _trained_state(model), "optim": get_optimizer_state_dict(model, optimizer)}
    with _single_process_quiet():
        dcp.save(state, checkpoint_id=tmp, no_dist=not dist.is_initialized())
    rng = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        rng["cuda"] = torch.cuda.get_rng_state()
    torch.save(rng, tmp / f"rng_rank{rank()}.pt")
    if rank() == 0:
        (tmp / STATE_NAME).write_text(json.dumps(train_state, indent=1))
        if write_files is not None:
            write_files(tmp)
    _barrier()  # every rank has finished writing
    _write_manifest(tmp)
    if rank() == 0:
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
        fsync(out_dir)
    _barrier()
    return final


def _trained_state(model: Transformer) -> dict:
    """The model's state dict without frozen parameters, under every name they have (a tied output weight shares
    the frozen embedding's Parameter, which `ignore_frozen_params` alone keeps under its second name)."""
    frozen = {name for name, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad}
    return {k: v for k, v in get_model_state_dict(model, options=TRAINED).items() if k not in frozen}


def prune_checkpoints(out_dir: Path, keep: int, spare: Path | None = None) -> list[Path]:
    """Rank 0: delete all but the `keep` newest complete `step-N` (the newest is never deleted: keep >= 1) and
    `spare` (the checkpoint being resumed from), and every `step-N.tmp` left by an interrupted save. Returns what
    was deleted."""
    if rank() != 0 or not out_dir.is_dir():
        return []
    steps = sorted((int(m.group(1)), p) for p in out_dir.iterdir() if p.is_dir() and (m := _STEP_DIR.match(p.name)))
    stale = [p for p in out_dir.iterdir() if p.is_dir() and p.name.endswith(".tmp") and p.name.startswith("step-")]
    spared = spare.resolve() if spare else None
    doomed = [p for _, p in steps[:-max(1, keep)] if p.resolve() != spared] + stale
    for path in doomed:
        shutil.rmtree(path)
    return doomed


def checkpoints(out_dir: Path) -> list[Path]:
    """The checkpoints `out_dir/step-N`, oldest first (partial `step-N.tmp` are not checkpoints)."""
    if not out_dir.is_dir():
        return []
    steps = [(int(m.group(1)), p) for p in out_dir.iterdir() if p.is_dir() and (m := _STEP_DIR.match(p.name))]
    return [p for _, p in sorted(steps)]


def latest_checkpoint(out_dir: Path) -> Path | None:
    """The checkpoint `out_dir/step-N` with the largest N, or None."""
    found = checkpoints(out_dir)
    return found[-1] if found else None


def older_checkpoint(path: Path) -> Path | None:
    """The checkpoint next older than `path` in its directory, or None."""
    found = checkpoints(path.parent)
    older = [p for p in found if int(p.name.split("-")[1]) < int(path.name.split("-")[1])] \
        if _STEP_DIR.match(path.name) else []
    return older[-1] if older else None


def checkpoint_to_resume(out_dir: Path, resume: str | None) -> Path | None:
    """The verified checkpoint a run resumes from (collective): None for `resume` None; for "auto" the newest intact
    `out_dir/step-N` (a damaged newer one is skipped with a warning; None when there is none); else the path
    `resume`, which must be intact (DamagedCheckpoint otherwise)."""
    if resume is None:
        return None
    if resume != "auto":
        if not Path(resume).is_dir():
            what = "is a file, not a" if Path(resume).exists() else "names no"
            raise FileNotFoundError(f"--resume {resume} {what} checkpoint directory: pass one (OUT_DIR/step-N), or "
                                    "--resume alone to continue --out_dir's newest")
        verify_checkpoint(Path(resume))
        return Path(resume)
    errors = []
    for path in reversed(checkpoints(out_dir)):
        try:
            verify_checkpoint(path)
            return path
        except DamagedCheckpoint as e:
            errors.append(e)
            if rank() == 0 and older_checkpoint(path):
                print(f"warning: {e}; --resume falls back to it", flush=True)
    if errors:
        raise DamagedCheckpoint(f"no intact checkpoint in {out_dir}: {errors[-1]}")
    return None


def read_train_state(path: Path) -> dict:
    """The `train_state.json` of checkpoint `path`, with a clear error when the directory is not a checkpoint."""
    hint = "delete it, or resume from an earlier step-N with --resume PATH"
    if not path.is_dir():
        raise FileNotFoundError(f"checkpoint {path} does not exist")
    for name in (STATE_NAME, ".metadata"):
        if not (path / name).is_file():
            raise ValueError(f"checkpoint {path} is corrupt: {name} is missing; {hint}")
    try:
        state = json.loads((path / STATE_NAME).read_text())
        int(state["step"])
    except (ValueError, KeyError, TypeError) as e:  # JSONDecodeError is a ValueError
        raise ValueError(f"checkpoint {path} is corrupt: unreadable {STATE_NAME} ({e!r}); {hint}") from e
    return state


def load_checkpoint(path: Path, model: Transformer, optimizer: torch.optim.Optimizer) -> dict:
    """Load model, optimizer and this rank's RNG states from checkpoint `path` (collective); return its train state.

    The checkpoint must hold the same architecture (`model.config`); it may come from any world size. Its integrity
    is the caller's to check first (`checkpoint_to_resume` verifies it).
    """
    train_state = read_train_state(path)
    saved = train_state.get("model_config", {})
    current = model.config.to_dict()
    differ = sorted(k for k in current if saved.get(k, current[k]) != current[k])
    if differ:
        raise ValueError(f"checkpoint {path} holds a different model: " + ", ".join(
            f"{k}={saved[k]!r} (now {current[k]!r})" for k in differ) + "; resume it with the options it was "
            f"trained with (leave the ones that change these out), or start a new run from it (--init_from {path})")
    state = {"model": _trained_state(model), "optim": get_optimizer_state_dict(model, optimizer)}
    _read(path, state)
    set_model_state_dict(model, state["model"], options=TRAINED)
    set_optimizer_state_dict(model, optimizer, state["optim"])
    rng_file = path / f"rng_rank{rank()}.pt"
    if rng_file.is_file():  # absent when resuming on more ranks than were saved: those keep their seeded state
        try:
            rng = safe_load(rng_file, rng_file.name)
        except UnsafeCheckpoint as e:
            raise UnsafeCheckpoint(f"checkpoint {path} is not safe to load: {e}; nothing was run. Do not resume "
                                   "from it") from None
        if not isinstance(rng, dict) or not all(isinstance(v, torch.Tensor) for v in rng.values()):
            raise DamagedCheckpoint(f"{rng_file} does not hold RNG states")
        torch.set_rng_state(rng["cpu"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["cuda"])
    return train_state


def load_model_weights(path: Path, model: Transformer) -> None:
    """Load only the model weights of checkpoint `path` into the plain `model` (built with the checkpoint's
    ModelConfig), in this process alone (under FSDP rank 0 reads, then broadcasts); the optimizer state is not read.
    The caller verifies the files first (`verify_files`)."""
    state = {"model": get_model_state_dict(model)}
    _read(path, state, alone=True)
    set_model_state_dict(model, state["model"])


class UnsafeCheckpoint(ValueError):
    """A checkpoint file asked to run code or build an object outside the allow-list: nothing was executed."""


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's `.metadata` building only the classes such metadata holds (`SAFE_GLOBALS`)."""

    def find_class(self, module: str, name: str) -> object:
        if (module, name) not in SAFE_GLOBALS:
            raise UnsafeCheckpoint(f"its .metadata asks to build {module}.{name}, outside the allow-list")
        return super().find_class(module, name)


# Everything torch.distributed.checkpoint writes into .metadata (dataclasses, their enums and the torch types of
# tensor properties); a pickle naming anything else is refused before it is built.
SAFE_GLOBALS = {("torch.distributed.checkpoint.metadata", name) for name in (
    "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata", "ChunkStorageMetadata",
    "BytesStorageMetadata", "_MEM_FORMAT_ENCODING")} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
    ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"),
    ("collections", "OrderedDict")} | {("torch", str(d).removeprefix("torch.")) for d in (
        torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
        torch.int8, torch.uint8, torch.bool)}


class SafeReader(FileSystemReader):
    """FileSystemReader whose `.metadata` is read with `_MetadataUnpickler` (DCP's own reader uses pickle.load)."""

    def read_metadata(self, *args: object, **kwargs: object) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as file:
            metadata = _MetadataUnpickler(file).load()
        for info in (getattr(metadata, "storage_data", None) or {}).values():
            where = str(getattr(info, "relative_path", ""))
            if Path(where).name != where or where in ("", ".", ".."):
                raise UnsafeCheckpoint(f"its .metadata points a tensor at {where!r}, outside the checkpoint")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DefaultLoadPlanner that reads non-tensor entries (the optimizer's step counts, ...) with
    torch.load(weights_only=True) instead of weights_only=False."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        loaded = safe_load(value, f"its entry {read_item.dest_index.fqn}")
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded


def safe_load(file: io.BytesIO | Path, what: str) -> object:
    """torch.load(weights_only=True) of `file`; UnsafeCheckpoint (naming `what`) when it holds anything else."""
    try:
        return torch.load(file, weights_only=True)
    except pickle.UnpicklingError:
        raise UnsafeCheckpoint(f"{what} holds an object that is not plain tensors and numbers (refused before it "
                               "was built)") from None


def _read(path: Path, state: dict, alone: bool = False) -> None:
    """dcp.load of the entries of `state` from checkpoint `path`, in place, through `SafeReader` and
    `SafeLoadPlanner` (no code in the checkpoint runs), with a clear error when unreadable or unsafe. `alone`: this
    process reads by itself (no collective), also under a process group."""
    reader, stored = SafeReader(path), {}
    try:
        stored = reader.read_metadata().state_dict_metadata  # refused here, before DCP would wrap it per rank
    except UnsafeCheckpoint as e:
        raise UnsafeCheckpoint(f"checkpoint {path} is not safe to load: {e}; nothing was run. Do not resume from "
                               "it") from None
    except Exception:
        pass  # unreadable: dcp.load below reports it like any other damage
    if any(".attn.gate_proj." in name for name in stored):
        raise ValueError(f"checkpoint {path} names NSA's branch gate attn.gate_proj, as versions before its rename to "
                         "attn.branch_gate wrote it: its run's model/ export loads here (pass it as --init_from), or "
                         "resume it with the version that wrote it")
    try:
        with _single_process_quiet():
            dcp.load(state, storage_reader=reader, planner=SafeLoadPlanner(),
                     no_dist=alone or not dist.is_initialized())
    except (Exception, CheckpointException) as e:  # CheckpointException (a BaseException) wraps per-rank errors
        unsafe = [failure[0] for failure in getattr(e, "failures", {}).values() if isinstance(failure[0],
                                                                                              UnsafeCheckpoint)]
        if isinstance(e, UnsafeCheckpoint) or unsafe:
            raise UnsafeCheckpoint(f"checkpoint {path} is not safe to load: {(unsafe or [e])[0]}; nothing was run. "
                                   "Do not resume from it") from None
        raise ValueError(f"checkpoint {path} could not be read into this run's model ({type(e).__name__}: {e}); "
                         "resume with the options it was written with, or from an earlier step-N with --resume "
                         "PATH") from e
