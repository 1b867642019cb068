"""One run per directory: what a run directory holds, the lock a run keeps on it, the timeline a resume continues,
and workers that do not outlive their launcher.

- `RunLock`: rank 0 holds an advisory lock (flock) on OUT_DIR/.lock for the life of the run; the file names the
  holder (host, pid, start time). A second run on the directory is refused with one line naming the holder. A lock
  file whose process has died holds no lock (the kernel drops it with the process): it is taken over, with a line.
- `check_run_directory`: a fresh run needs a directory without a run; a checkpoint from elsewhere is never continued
  into a directory that holds another run.
- `start_timeline`: resuming a checkpoint older than the newest moves the newer ones aside (OUT_DIR/abandoned-<time>/)
  so that a later plain --resume continues this timeline and pruning never takes them for its own.
- `exit_with_launcher`: under torchrun a worker gets SIGTERM when its launcher dies (Linux), so `kill -9` of the
  launcher leaves nothing training: the worker finishes its step, saves and exits.
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import errno
import fcntl
import json
import os
import shutil
import signal
import socket
from pathlib import Path

from storage.checkpoint import checkpoints, latest_checkpoint
from storage.places import STARTED_FILES, STATE_NAME, enclosing, holds_run, run_options

LOCK_NAME = ".lock"


class RunLock:
    """The advisory lock of a run directory, held from `acquire` until the process exits (or `release`)."""

    def __init__(self, out_dir: Path) -> None:
        self.path = out_dir / LOCK_NAME
        self.fd: int | None = None
        self.created = False  # whether acquire made the directory (release removes it again if nothing was written)

    def acquire(self) -> str | None:
        """Take the lock; returns a note when a dead run's lock file was taken over. FileExistsError (one line,
        naming the holder) when another live process holds it; PermissionError when the directory is read-only."""
        if self.path.parent.exists() and not self.path.parent.is_dir():
            raise NotADirectoryError(f"--out_dir {self.path.parent} is a file; pass a directory")
        try:
            self.created = not self.path.parent.exists()
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise PermissionError(f"cannot write in {self.path.parent} ({e.strerror}); choose another --out_dir") \
                from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            holder = os.read(fd, 4096).decode(errors="replace").strip() or "another process"
            os.close(fd)
            if e.errno in (errno.EAGAIN, errno.EACCES):
                raise FileExistsError(f"{self.path.parent} is in use by a running training run ({holder}); wait for "
                                      "it to end, stop it, or choose another --out_dir") from None
            raise
        previous = os.read(fd, 4096).decode(errors="replace").strip()
        holder = {"host": socket.gethostname(), "pid": os.getpid(),
                  "started": datetime.datetime.now().isoformat(timespec="seconds")}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(holder).encode(), 0)
        self.fd = fd
        return f"took over the lock of a run that is no longer running ({previous})" if previous else None

    def release(self) -> None:
        """Remove the lock file (a run that ended leaves none), and the directory when `acquire` made it and nothing
        else was written there (a run refused at its start leaves nothing), and drop the lock. What cannot be
        removed (the directory became read-only) stays, harmless (a dead run's lock is taken over), and raises
        nothing: release runs while an error may be on its way out, and that error is the one to see."""
        if self.fd is not None:
            with contextlib.suppress(OSError):
                self.path.unlink(missing_ok=True)
                if self.created:
                    self.path.parent.rmdir()  # only when empty
            os.close(self.fd)  # closing the descriptor drops the flock
            self.fd = None




def clear_unstarted(out_dir: Path) -> None:
    """Rank 0, for a fresh run (its directory held no run) that failed before its first step: remove what it wrote
    (STARTED_FILES), so that the same command, corrected, starts there again instead of being sent to --resume."""
    for name in STARTED_FILES:
        path = out_dir / name
        with contextlib.suppress(OSError):
            if path.is_dir():
                shutil.rmtree(path)
            else:
                path.unlink(missing_ok=True)


def _is_json(file: Path) -> bool:
    try:
        json.loads(file.read_text())
    except (OSError, ValueError):
        return False
    return True


def run_record(out_dir: Path) -> dict | None:
    """The options the run in `out_dir` recorded (the "train" section of its config.json; where that file is cut
    short, those its newest checkpoint recorded, the same, and config.json is written again on resume), or None
    when it holds no config.json. FileExistsError when that config.json is not a training run's (a model's: an
    export, a Hugging Face directory), which a run would overwrite."""
    if not (out_dir / "config.json").is_file():
        return None
    options = run_options(out_dir)
    if options is None and not _is_json(out_dir / "config.json") and (newest := latest_checkpoint(out_dir)):
        try:
            options = json.loads((newest / STATE_NAME).read_text())["config"]
        except (OSError, ValueError, KeyError, TypeError):
            raise ValueError(f"{out_dir / 'config.json'} and {newest / STATE_NAME} are unreadable: resume from an "
                             f"earlier checkpoint (--resume {out_dir / 'step-N'}), or start a new run from its "
                             f"weights (--init_from {newest})") from None
    if options is None:
        raise FileExistsError(f"{out_dir} holds a config.json that is not a training run's (a model's?), which a run "
                              "would overwrite; choose another --out_dir")
    return options


def check_run_directory(out_dir: Path, resume: str | None, init_from: str | None = None) -> None:
    """FileExistsError (one line, naming what to pass) unless starting or resuming into `out_dir` leaves every other
    run's files and every model alone: `out_dir` is not --init_from and holds no model (weights, or a config.json
    that is not a run's: `run_record`); a fresh run needs a directory without a run (config.json, metrics.jsonl or
    step-N), and a checkpoint resumed from another directory may not be continued in one that holds a run."""
    if out_dir.exists() and not out_dir.is_dir():
        raise NotADirectoryError(f"--out_dir {out_dir} is a file; pass a directory")
    if resume not in (None, "auto") and not (Path(resume) / STATE_NAME).exists() and holds_run(Path(resume)):
        raise ValueError(f"--resume {resume} is a run directory, not a checkpoint: pass --resume --out_dir {resume} "
                         f"(its newest checkpoint), or --resume {Path(resume) / 'step-N'}")
    if init_from and out_dir.resolve() == Path(init_from).resolve():
        raise FileExistsError(f"--out_dir {out_dir} is the --init_from model: a run would overwrite it; choose "
                              "another --out_dir")
    if run_record(out_dir) is None and out_dir.is_dir() and (weights := next(out_dir.glob("*.safetensors"), None)):
        raise FileExistsError(f"{out_dir} holds a model ({weights.name}), which a run would overwrite; choose another "
                              "--out_dir")
    if (out_dir / "index.json").is_file():
        raise FileExistsError(f"{out_dir} holds prepared data (index.json), which a run would mix its files into; "
                              "choose another --out_dir")
    if reason := enclosing(out_dir):
        raise FileExistsError(f"--out_dir {reason}; choose a directory of its own")
    if resume is None and holds_run(out_dir):
        what = latest_checkpoint(out_dir).name if latest_checkpoint(out_dir) else "a run without a checkpoint"
        raise FileExistsError(f"{out_dir} already holds a run ({what}); pass --resume to continue it (from scratch "
                              "when it has no checkpoint), or choose another --out_dir")
    if resume == "auto" and not holds_run(out_dir):
        runs = sorted(p.name for p in out_dir.parent.glob("*") if p.is_dir() and holds_run(p))[:5] \
            if out_dir.parent.is_dir() else []
        there = f" (runs in {out_dir.parent}: {', '.join(runs)})" if runs else ""
        raise FileNotFoundError(f"--resume: {out_dir} holds no run to continue (no config.json, metrics.jsonl or "
                                f"step-N/): leave --resume out to start one there, or pass the run's --out_dir{there}")
    if resume not in (None, "auto") and holds_run(out_dir) and Path(resume).resolve().parent != out_dir.resolve():
        raise FileExistsError(f"{out_dir} holds another run: continuing {resume} there would rewrite its files; "
                              "choose an empty --out_dir")


def start_timeline(out_dir: Path, resume_from: Path) -> Path | None:
    """Rank 0, resuming `resume_from` inside `out_dir`: move the checkpoints newer than it into
    out_dir/abandoned-<time>/ (the timeline this resume leaves); returns that directory, or None when none is newer."""
    if resume_from.resolve().parent != out_dir.resolve():
        return None
    step = int(resume_from.name.split("-")[1])
    newer = [p for p in checkpoints(out_dir) if int(p.name.split("-")[1]) > step]
    if not newer:
        return None
    aside = out_dir / f"abandoned-{datetime.datetime.now().strftime('%Y%m%d-%H%M%S')}"
    aside.mkdir()
    for path in newer:
        path.rename(aside / path.name)
    return aside


def exit_with_launcher() -> None:
    """Under torchrun (Linux): have the kernel send this worker SIGTERM when its launcher dies, so that a killed
    launcher leaves no worker training (train.py's SIGTERM handler saves and exits)."""
    if "TORCHELASTIC_RUN_ID" not in os.environ or not hasattr(os, "getppid"):
        return
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
    except OSError:
        return  # not glibc Linux: the launcher must be stopped with a signal it forwards
    parent = os.getppid()
    libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    if os.getppid() != parent or parent == 1:  # the launcher died before the request took effect (while this
        os.kill(os.getpid(), signal.SIGTERM)  # worker imported torch, say): a worker's parent is never init
