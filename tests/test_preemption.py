"""Preemption under torchrun: the launcher forwards SIGTERM to the workers and SIGKILLs them `--shutdown_timeout`
seconds later (30 by default). A worker finishes the step in flight and saves (train.py's SIGTERM handler), so a
grace longer than a step plus a save ends with a checkpoint of the interrupted step; with a shorter grace the step
in flight is lost and `--checkpoint_minutes` bounds what is lost. Two gloo processes, steps made long on purpose
(4096-token sequences, 4 micro-steps)."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from storage.checkpoint import checkpoints, verify_checkpoint

ROOT = Path(__file__).resolve().parent.parent


def preempt(data_dir: Path, out_dir: Path, grace: int, *options: str) -> str:
    """Start 2 workers under torchrun, send the launcher SIGTERM once step 1 is logged, return the output."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={port}",
               f"--shutdown_timeout={grace}", str(ROOT / "train.py"), "--model_size", "tiny", "--context_length",
               "4096", "--batch_size", "1", "--gradient_accumulation_steps", "4", "--max_steps", "50",
               "--checkpoint_interval", "0", "--sample_tokens", "0", "--data_dir", str(data_dir), "--out_dir",
               str(out_dir), *options]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    metrics = out_dir / "metrics.jsonl"
    deadline = time.monotonic() + 240
    while not (metrics.exists() and metrics.read_text().strip()) and proc.poll() is None:
        assert time.monotonic() < deadline, "step 1 never finished"
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)  # what a cluster scheduler sends the launcher
    output, _ = proc.communicate(timeout=240)
    return output


@pytest.mark.slow
def test_a_grace_longer_than_a_step_ends_with_a_checkpoint_of_the_interrupted_step(data_dir: Path, tmp_path: Path):
    output = preempt(data_dir, tmp_path, 120)
    step_time = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])["step_time_s"]
    assert output.count("SIGTERM: finishing this step, saving a checkpoint, exiting") == 2, output[-3000:]
    assert [p.name for p in checkpoints(tmp_path)] == ["step-2"] and step_time > 1
    verify_checkpoint(tmp_path / "step-2")


@pytest.mark.slow
def test_a_short_grace_loses_at_most_checkpoint_minutes(data_dir: Path, tmp_path: Path):
    """SIGKILL 1 s after the SIGTERM, mid-step: the step is lost, the time-based checkpoint of step 1 is intact."""
    preempt(data_dir, tmp_path, 1, "--checkpoint_minutes", "0.001")
    saved = checkpoints(tmp_path)
    assert saved and saved[-1].name in ("step-1", "step-2")
    verify_checkpoint(saved[-1])
