"""One run per directory: a second run on a locked directory is one line naming the holder, a dead run's lock is
taken over, a resume of an older checkpoint moves the newer ones aside (a later plain --resume continues the new
timeline and metrics.jsonl stays monotonic), and a worker asks to be stopped with its launcher."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import train
from checkpoint import checkpoints
from rundir import LOCK_NAME, RunLock

ROOT = Path(__file__).resolve().parent.parent


def test_a_locked_directory_refuses_a_second_run(data_dir, tmp_path):
    lock = RunLock(tmp_path)
    assert lock.acquire() is None
    holder = json.loads((tmp_path / LOCK_NAME).read_text())
    assert holder["pid"] == os.getpid()
    with pytest.raises(FileExistsError, match=f"is in use by a running training run .*\"pid\": {os.getpid()}"):
        train.main(["--model_size", "tiny", "--data_dir", str(data_dir), "--out_dir", str(tmp_path)])
    assert list(tmp_path.iterdir()) == [tmp_path / LOCK_NAME]  # nothing else written
    lock.release()
    assert not (tmp_path / LOCK_NAME).exists()


def test_a_dead_runs_lock_is_taken_over(data_dir, tmp_path, capsys):
    dies_holding_it = f"import os, pathlib, rundir; rundir.RunLock(pathlib.Path({str(tmp_path)!r})).acquire(); " \
                      "os._exit(0)"
    subprocess.run([sys.executable, "-c", dies_holding_it], cwd=ROOT, check=True)
    assert (tmp_path / LOCK_NAME).exists()
    train.main(["--model_size", "tiny", "--context_length", "32", "--batch_size", "2", "--max_steps", "1",
                "--sample_tokens", "0", "--data_dir", str(data_dir), "--out_dir", str(tmp_path)])
    assert "took over the lock of a run that is no longer running" in capsys.readouterr().out
    assert not (tmp_path / LOCK_NAME).exists()  # released at the end


def test_resuming_an_older_checkpoint_starts_a_new_timeline(data_dir, tmp_path, capsys):
    run = ["--model_size", "tiny", "--context_length", "32", "--batch_size", "2", "--sample_tokens", "0",
           "--checkpoint_interval", "1", "--keep_checkpoints", "1", "--data_dir", str(data_dir), "--out_dir",
           str(tmp_path)]
    train.main([*run, "--max_steps", "3", "--keep_checkpoints", "5"])
    train.main([*run, "--max_steps", "5", "--resume", str(tmp_path / "step-1")])
    out = capsys.readouterr().out
    assert "resuming step-1: its newer checkpoints, another timeline, moved to" in out
    aside = next(tmp_path.glob("abandoned-*"))
    assert sorted(p.name for p in aside.iterdir()) == ["step-2", "step-3"]  # kept, outside the timeline
    assert [p.name for p in checkpoints(tmp_path)] == ["step-1", "step-5"]  # its own, pruned to 1 + the one resumed
    train.main([*run, "--max_steps", "6", "--resume"])  # plain --resume: the new timeline
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == sorted(row["step"] for row in rows)  # monotonic
    assert [row["step"] for row in rows if "loss" in row] == [1, 2, 3, 4, 5, 6]
    assert [p.name for p in checkpoints(tmp_path)] == ["step-5", "step-6"]  # + the one resumed from
