"""What a directory holds, decided in one place (`holds`): a training checkpoint (step-N/), a model (the project's
export, a Hugging Face directory, adapters), a training run (config.json of train.py's options, metrics.jsonl,
step-N/), or prepared data (index.json). A resume replaces a run's exports and prunes its step-N/, and a model's or
checkpoint's files are written whole, so `kept_output` refuses any output inside a model or a checkpoint, or at a
name a run writes, moves or deletes in its directory (RUN_NAMES): training/cli.py's check_writable applies it for
every entry point. Imports only storage/manifest.py (no model code), so any layer may use it."""

from __future__ import annotations

import json
import re
from enum import Enum
from pathlib import Path

from storage.manifest import EXPORTS, MANIFEST_NAME

STATE_NAME = "train_state.json"  # a training checkpoint's record of its step and options (storage/checkpoint.py)
RUN_FILES = ("config.json", "metrics.jsonl")  # with step-N/, what makes a directory hold a run
# What a run writes before its first step (removed again when that step never completes: run_directory.py).
STARTED_FILES = (*RUN_FILES, "npt_config.json", "wandb_id", "wandb", "tensorboard")
# Every name a run writes, moves or deletes in its directory: those, its exports, checkpoints (and their partial
# .tmp / replaced .old copies), timelines moved aside, its lock, loss curve, end record and NPT adapters.
RUN_NAMES = re.compile("|".join([*map(re.escape, (*STARTED_FILES, *EXPORTS, ".lock", "loss.png", "finished.json",
                                                  "adapters.safetensors")),
                                 r"step-\d+", r"abandoned-.*", r".*\.tmp", r".*\.old"]))


class Holds(str, Enum):
    """What a directory holds (its value: how a message names it)."""

    CHECKPOINT = "a training checkpoint"
    MODEL = "a model"
    RUN = "a training run"
    DATA = "prepared data"


def is_checkpoint_name(name: str) -> bool:
    """Whether `name` is a checkpoint's directory name, step-N."""
    return re.fullmatch(r"step-\d+", name) is not None


def run_options(place: Path) -> dict | None:
    """The "train" section of `place`/config.json when that file is a training run's record, else None."""
    try:
        values = json.loads((place / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return values["train"] if isinstance(values, dict) and isinstance(values.get("train"), dict) else None


def _has_checkpoints(place: Path) -> bool:
    try:
        return any(is_checkpoint_name(p.name) and p.is_dir() for p in place.iterdir())
    except OSError:
        return False


def holds_run(place: Path) -> bool:
    """Whether `place` holds a training run's files: config.json, metrics.jsonl or a step-N checkpoint."""
    return any((place / name).exists() for name in RUN_FILES) or _has_checkpoints(place)


def holds(place: Path) -> Holds | None:
    """What `place` holds, or None for a directory of none of them (or no directory). A config.json that is neither
    a run's record nor beside weights (an editor's, a tool's) makes nothing of a directory."""
    try:
        if not place.is_dir():
            return None
        if (place / STATE_NAME).is_file():
            return Holds.CHECKPOINT
        if run_options(place) is not None:
            return Holds.RUN
        config = (place / "config.json").is_file()
        if any((place / name).is_file() for name in (MANIFEST_NAME, "adapter_config.json", "model.safetensors")) \
                or config and (any(place.glob("*.safetensors")) or any(place.glob("pytorch_model*.bin"))):
            return Holds.MODEL
        if (place / "metrics.jsonl").is_file() or _has_checkpoints(place):
            return Holds.RUN
        if (place / "index.json").is_file():
            return Holds.DATA
    except OSError:  # a directory we may pass through but not list
        return None
    return None


def kept_output(target: Path, directory: bool) -> str | None:
    """Why writing `target` (a file; an output directory when `directory`) would damage or lose what is there (one
    line's reason), or None: the directory it writes in holds no model, checkpoint or run (a run's directory takes
    only what the run writes; another output goes in a directory of its own), and `enclosing` finds nothing."""
    folder = target if directory else target.parent
    if (what := holds(folder.resolve())) in (Holds.MODEL, Holds.CHECKPOINT, Holds.RUN):
        return f"{folder} holds {what.value}, whose files a run writes, replaces or prunes"
    return enclosing(target)


def enclosing(target: Path) -> str | None:
    """Why `target` may not be written, from the directories around it (one line's reason), or None: it lies in a
    model or a checkpoint, whose files are written whole, or a run directory on its way writes, moves or deletes a
    file or directory of its name (RUN_NAMES)."""
    given, target = target, target.resolve()
    for inner, outer in zip((target, *target.parents), target.parents, strict=False):
        what = holds(outer)
        if what in (Holds.MODEL, Holds.CHECKPOINT):
            return f"{given} lies inside {_shown(outer)}, {what.value}, whose files are written whole"
        if what is Holds.RUN and RUN_NAMES.fullmatch(inner.name):
            return f"{given} is {inner.name} of the training run {_shown(outer)}, which a run writes or prunes"
    return None


def _shown(path: Path) -> Path:
    """`path` relative to the working directory when it lies inside it (as a user typed it), else whole."""
    try:
        return path.relative_to(Path.cwd())
    except ValueError:
        return path
