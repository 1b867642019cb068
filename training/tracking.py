"""Experiment trackers: the scalars of every metrics.jsonl line, also sent to TensorBoard or Weights & Biases, by
rank 0 at the step they belong to.

    python train.py --tracker tensorboard     # OUT_DIR/tensorboard/; then: tensorboard --logdir runs
    WANDB_MODE=offline python train.py --tracker wandb   # OUT_DIR/wandb/; `wandb sync` uploads it later

A resumed run continues the same record: TensorBoard drops the events of the steps after the checkpoint (as
metrics.jsonl does); W&B resumes the run id kept in OUT_DIR/wandb_id, and keeps its first values of steps a resume
redoes (it ignores a step it has already logged).
"""

from __future__ import annotations

import contextlib
import importlib.util
import math
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Protocol

# --tracker value -> (the package it needs, how to install it)
PACKAGES = {"tensorboard": ("tensorboard", "pip install tensorboard"), "wandb": ("wandb", "pip install wandb")}


class Tracker(Protocol):
    def log(self, metrics: dict) -> None:
        """Record the numbers of one metrics.jsonl line (its "step" is the x axis)."""

    def close(self, failed: bool = False) -> None:
        """End the record (`failed`: the run stopped on an error)."""


def scalars(metrics: dict) -> dict[str, float]:
    """The finite numbers of a metrics line, without its step (a skipped step's null loss is left out)."""
    return {name: float(value) for name, value in metrics.items()
            if name != "step" and isinstance(value, int | float) and not isinstance(value, bool)
            and math.isfinite(value)}


class TensorBoard:
    """torch.utils.tensorboard's event files in OUT_DIR/tensorboard."""

    def __init__(self, out_dir: Path, options: dict, step: int) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(out_dir / "tensorboard"), purge_step=step + 1 if step else None)

    def log(self, metrics: dict) -> None:
        for name, value in scalars(metrics).items():
            self.writer.add_scalar(name, value, metrics["step"])
        self.writer.flush()

    def close(self, failed: bool = False) -> None:
        self.writer.close()


class WandB:
    """A Weights & Biases run in OUT_DIR/wandb (online, or offline with WANDB_MODE=offline), resumed by its id."""

    def __init__(self, out_dir: Path, options: dict, step: int) -> None:
        import wandb

        id_file = out_dir / "wandb_id"
        if not id_file.is_file():
            id_file.write_text(uuid.uuid4().hex[:16] + "\n")
        try:
            self.run = wandb.init(project="longctx", name=out_dir.name, dir=str(out_dir),
                                  id=id_file.read_text().strip(), resume="allow", config=options)
        except Exception as e:  # wandb's UsageError (not logged in), CommError (no network)
            raise ValueError(f"--tracker wandb: {e} (WANDB_MODE=offline runs without an account)") from None

    def log(self, metrics: dict) -> None:
        self.run.log(scalars(metrics), step=metrics["step"])

    def close(self, failed: bool = False) -> None:
        self.run.finish(exit_code=int(failed))


TRACKERS = {"tensorboard": TensorBoard, "wandb": WandB}


def check_tracker(name: str | None) -> None:
    """ValueError naming the install command when --tracker's package is missing (before anything is built)."""
    if name and importlib.util.find_spec(PACKAGES[name][0]) is None:
        raise ValueError(f"--tracker {name} needs the {PACKAGES[name][0]} package: {PACKAGES[name][1]}")


@contextlib.contextmanager
def tracking(name: str | None, out_dir: Path, options: dict, step: int) -> Iterator[Callable[[dict], None]]:
    """For the block, `log(metrics)` of the tracker --tracker names (None: one that does nothing) for the run in
    `out_dir` with `options` (train.py's, as a dict) continuing after `step`; the tracker is closed at the end."""
    if not name:
        yield lambda metrics: None
        return
    tracker = TRACKERS[name](out_dir, options, step)
    try:
        yield tracker.log
    except BaseException:
        tracker.close(failed=True)
        raise
    tracker.close()
