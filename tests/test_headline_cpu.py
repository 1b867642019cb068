"""The headline command, `torchrun --nproc_per_node=2 train.py --context_length 131072`, end to end on a CPU: two gloo
processes through the data, NSA, checkpointing, the tiled FFN, the chunked loss, a checkpoint, a resume, the export
and a sample, with a one-layer tiny model. NSA keeps the paper's selection (n = 16 blocks of l' = 64) and takes
compression blocks of 64 with stride 64 instead of 32 with stride 16: the compression branch is O(T^2 / d), a
quarter of the paper's at d = 64, and the code path is the same (a 131k-token step takes about 30 s here instead
of 90)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from storage.checkpoint import verify_checkpoint
from storage.weights import load_model

ROOT = Path(__file__).resolve().parent.parent
SMALL = json.dumps({"n_layers": 1, "nsa_block_size": 64, "nsa_stride": 64, "nsa_select_block_size": 64,
                    "nsa_window": 64, "attention_query_chunk": 4096})


def headline(data_dir: Path, out_dir: Path, *options: str) -> subprocess.CompletedProcess:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={port}",
               str(ROOT / "train.py"), "--context_length", "131072", "--model_size", "tiny", "--model_overrides",
               SMALL, "--data_dir", str(data_dir), "--out_dir", str(out_dir), "--heartbeat_seconds", "5", *options]
    return subprocess.run(command, capture_output=True, text=True, timeout=900,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})


@pytest.mark.slow
def test_the_headline_command_runs_end_to_end_on_cpu(data_dir: Path, tmp_path: Path):
    first = headline(data_dir, tmp_path, "--max_steps", "1", "--sample_tokens", "0")
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    resolved = json.loads((tmp_path / "config.json").read_text())
    assert resolved["model"]["attention_type"] == "nsa" and resolved["train"]["gradient_checkpointing"]
    assert resolved["compute"]["loss_mode"] == "chunked" and resolved["compute"]["ffn_chunk_size"] == 8192
    assert resolved["world_size"] == 2
    second = headline(data_dir, tmp_path, "--max_steps", "2", "--sample_tokens", "8", "--resume")
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    assert "resumed from" in second.stdout and "--- sample (8 tokens" in second.stdout
    assert "step 2: micro-batch 1/1, " in second.stdout  # the heartbeat inside the long step
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(row["step"], "loss" in row) for row in rows] == [(1, True), (1, False), (2, True)]
    assert rows[1]["resumed_with"] == {"max_steps": [1, 2], "sample_tokens": [0, 8]}  # every change recorded
    verify_checkpoint(tmp_path / "step-2")
    model = load_model(tmp_path / "model")
    assert model.config.context_length == 131072 and model.config.attention_type == "nsa"
