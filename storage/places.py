"""What a directory holds, decided in one place (`holds`): a training checkpoint (step-N/), a model (the project's
export, a Hugging Face directory, LoRA adapters), a training run (config.json of train.py's options, metrics.jsonl,
step-N/), or prepared data (index.json). A run's resume replaces its model/ and prunes its step-N/, and a model's or
checkpoint's files are rewritten whole, so `kept_output` refuses any output written inside one of them (or into a run
directory itself, or under a name a run will write: model, step-N, abandoned-*): training/cli.py's check_writable
applies it for every entry point. Imports only storage/manifest.py (no model code), so any layer may use it."""

from __future__ import annotations

import json
import re
from pathlib import Path

from storage.manifest import MANIFEST_NAME

STATE_NAME = "train_state.json"  # a training checkpoint's record of its step and options (storage/checkpoint.py)
RUN_FILES = ("config.json", "metrics.jsonl")  # with step-N/, what makes a directory hold a run
RUN_NAMES = re.compile(r"model|hf|step-\d+|abandoned-.*|config\.json|metrics\.jsonl")  # what a run writes or moves


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


def holds_run(place: Path) -> bool:
    """Whether `place` holds a training run: its config.json, metrics.jsonl or a step-N checkpoint."""
    if any((place / name).exists() for name in RUN_FILES):
        return True
    try:
        return any(is_checkpoint_name(p.name) and p.is_dir() for p in place.iterdir())
    except OSError:
        return False


def holds(place: Path) -> str | None:
    """What `place` holds, as words naming it ("a training checkpoint", "a model", "a training run", "prepared
    data"), or None for a directory of none of them (or no directory)."""
    if not place.is_dir():
        return None
    try:
        if (place / STATE_NAME).is_file():
            return "a training checkpoint"
        if run_options(place) is not None:
            return "a training run"
        weights = any(place.glob("*.safetensors")) or any(place.glob("pytorch_model*.bin"))
        if ((place / MANIFEST_NAME).is_file() or (place / "adapter_config.json").is_file()
                or (place / "model.safetensors").is_file() or weights and (place / "config.json").is_file()):
            return "a model"
        if holds_run(place):
            return "a training run"
        if (place / "index.json").is_file():
            return "prepared data"
    except OSError:  # a directory we may pass through but not list
        return None
    return None


def kept_output(folder: Path) -> str | None:
    """Why an output written in directory `folder` would be lost or would damage what is there (one line's reason),
    or None when it may be written: `folder` holds no model, checkpoint or run, lies in no model or checkpoint, and
    is not a name a run directory around it writes (model/, step-N/, abandoned-*/)."""
    if (what := holds(folder)) not in (None, "prepared data"):
        return f"{folder} holds {what}, whose files a run or a resume replaces"
    return enclosing(folder)


def enclosing(folder: Path) -> str | None:
    """Why `folder` may not hold an output or a run of its own (one line's reason), or None: it lies inside a model
    or a checkpoint, or is a name a run directory around it writes (model/, step-N/, abandoned-*/)."""
    given, folder = folder, folder.resolve()
    for inner, outer in zip((folder, *folder.parents), folder.parents, strict=False):
        what = holds(outer)
        if what in ("a training checkpoint", "a model"):
            return f"{given} lies inside {_shown(outer)}, {what}, whose files are written whole"
        if what == "a training run" and RUN_NAMES.fullmatch(inner.name):
            return f"{given} is {inner.name}/ of the training run {_shown(outer)}, which a resume replaces or prunes"
    return None


def _shown(path: Path) -> Path:
    """`path` relative to the working directory when it lies inside it (as a user typed it), else whole."""
    try:
        return path.relative_to(Path.cwd())
    except ValueError:
        return path
