"""Training checkpoints with torch.distributed.checkpoint (DCP), and export of the final weights.

Layout of `out_dir/step-N/` (N = optimizer steps taken):
    .metadata, __R_r.distcp   model and optimizer state, sharded by rank; DCP reshards on load, so a checkpoint
                              written by W ranks resumes on any number of ranks (with or without FSDP)
    train_state.json          step, scheduler, data-loader position, configs, world size (written by rank 0)
    rng_rank{r}.pt            torch RNG states of rank r (CPU, and CUDA when used)
Loading never runs code from the checkpoint: `.metadata` is unpickled with an allow-list of the classes DCP
metadata holds (`SafeReader`), non-tensor entries are read with torch.load(weights_only=True) (`SafeLoadPlanner`);
anything else raises `UnsafeCheckpoint` before it is built. A checkpoint is still trusted to be the one you meant:
integrity (a damaged but harmless file) is checked only as far as DCP's own reads go.
Every rank writes into `step-N.tmp/`; once all have finished, rank 0 renames it to `step-N`. A directory named
`step-N` is therefore complete, and `latest_checkpoint` never considers the `.tmp` leftovers of an interrupted save.

The final weights are exported by weights.py (`export_model`), which also reads these checkpoints (`load_model`).
"""

from __future__ import annotations

import contextlib
import io
import json
import pickle
import re
import shutil
import warnings
from collections.abc import Iterator
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
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from model import Transformer

STATE_NAME = "train_state.json"
_STEP_DIR = re.compile(r"^step-(\d+)$")


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


@contextlib.contextmanager
def _single_process_quiet() -> Iterator[None]:
    """Silence DCP's warning that it runs without a process group (intended for single-process runs)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def save_checkpoint(out_dir: Path, step: int, model: Transformer, optimizer: torch.optim.Optimizer,
                    train_state: dict) -> Path:
    """Write `out_dir/step-{step}` (collective: every rank calls it) and return its path.

    `train_state` must be JSON-serialisable and identical on every rank (rank 0 writes it).
    """
    final = out_dir / f"step-{step}"
    tmp = out_dir / f"step-{step}.tmp"
    if rank() == 0 and tmp.exists():
        shutil.rmtree(tmp)  # left over from a save that was interrupted
    _barrier()
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer)}
    with _single_process_quiet():
        dcp.save(state, checkpoint_id=tmp, no_dist=not dist.is_initialized())
    rng = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        rng["cuda"] = torch.cuda.get_rng_state()
    torch.save(rng, tmp / f"rng_rank{rank()}.pt")
    if rank() == 0:
        (tmp / STATE_NAME).write_text(json.dumps(train_state, indent=1))
    _barrier()  # every rank has finished writing
    if rank() == 0:
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
    _barrier()
    return final


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


def latest_checkpoint(out_dir: Path) -> Path | None:
    """The complete checkpoint `out_dir/step-N` with the largest N, or None. Partial `step-N.tmp` are ignored."""
    if not out_dir.is_dir():
        return None
    steps = [(int(m.group(1)), p) for p in out_dir.iterdir() if p.is_dir() and (m := _STEP_DIR.match(p.name))]
    return max(steps)[1] if steps else None


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

    The checkpoint must hold the same architecture (`model.config`); it may come from any world size.
    """
    train_state = read_train_state(path)
    saved = train_state.get("model_config", {})
    current = model.config.to_dict()
    differ = sorted(k for k in current if saved.get(k, current[k]) != current[k])
    if differ:
        raise ValueError(f"checkpoint {path} holds a different model: " + ", ".join(
            f"{k}={saved[k]!r} (now {current[k]!r})" for k in differ))
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer)}
    _read(path, state)
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, optimizer, state["optim"])
    rng_file = path / f"rng_rank{rank()}.pt"
    if rng_file.is_file():  # absent when resuming on more ranks than were saved: those keep their seeded state
        rng = torch.load(rng_file, weights_only=True)
        torch.set_rng_state(rng["cpu"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["cuda"])
    return train_state


def load_model_weights(path: Path, model: Transformer) -> None:
    """Load only the model weights of checkpoint `path` into `model` (built with the checkpoint's ModelConfig);
    the optimizer state is not read. Collective under a process group, like `load_checkpoint`."""
    state = {"model": get_model_state_dict(model)}
    _read(path, state)
    set_model_state_dict(model, state["model"])


class UnsafeCheckpoint(ValueError):
    """A checkpoint file asked to run code or build an object outside the allow-list: nothing was executed."""


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's `.metadata` building only the classes such metadata holds (`SAFE_GLOBALS`)."""

    def find_class(self, module: str, name: str) -> object:
        if (module, name) not in SAFE_GLOBALS:
            raise UnsafeCheckpoint(f"{module}.{name}")
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
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DefaultLoadPlanner that reads non-tensor entries (the optimizer's step counts, ...) with
    torch.load(weights_only=True) instead of weights_only=False."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        loaded = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded


def _read(path: Path, state: dict) -> None:
    """dcp.load of the entries of `state` from checkpoint `path`, in place, through `SafeReader` and
    `SafeLoadPlanner` (no code in the checkpoint runs), with a clear error when unreadable or unsafe."""
    reader = SafeReader(path)
    try:
        reader.read_metadata()  # refused here, with its own error, before DCP would wrap it per rank
    except UnsafeCheckpoint as e:
        raise UnsafeCheckpoint(f"checkpoint {path} is not safe to load: its .metadata asks to build {e}, outside "
                               "the allow-list; nothing was run. Do not resume from it") from None
    except Exception:
        pass  # unreadable: dcp.load below reports it like any other damage
    try:
        with _single_process_quiet():
            dcp.load(state, storage_reader=reader, planner=SafeLoadPlanner(), no_dist=not dist.is_initialized())
    except (Exception, CheckpointException) as e:  # CheckpointException (a BaseException) wraps per-rank errors
        raise ValueError(f"checkpoint {path} could not be read ({type(e).__name__}: {e}); delete it, or resume "
                         "from an earlier step-N with --resume PATH") from e
