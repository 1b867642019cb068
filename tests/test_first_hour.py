"""What a new user sees: each run its own default directory (a second run of the same command goes next to the
first; --resume continues the newest), one summary line at the start, elapsed time and an estimate of the time left
on every metrics line, and under torchrun a refusal that arrives once, as one line, at the end of the launcher's
report."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

import train

ROOT = Path(__file__).resolve().parent.parent


def test_default_directories_do_not_collide(data_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    run = ["--model_size", "tiny", "--context_length", "32", "--batch_size", "2", "--max_steps", "2",
           "--sample_tokens", "0", "--data_dir", str(data_dir)]
    train.main(run)
    first = capsys.readouterr().out
    assert (tmp_path / "runs" / "tiny-full-32" / "model").is_dir()
    summary = next(line for line in first.splitlines() if line.startswith("tiny:"))
    assert "0.1M parameters, full attention, full fine-tune, float32; 2 steps of 64 tokens" in summary
    assert "writing runs/tiny-full-32" in summary and '"model_size"' not in first  # no configuration dump
    train.main(run)
    assert "runs/tiny-full-32 holds a run: this one goes to runs/tiny-full-32-2" in capsys.readouterr().out
    train.main([*run, "--max_steps", "3", "--resume"])  # the last --max_steps wins
    lines = (tmp_path / "runs" / "tiny-full-32-2" / "metrics.jsonl").read_text().splitlines()
    rows = [row for row in map(json.loads, lines) if "loss" in row]
    assert [row["step"] for row in rows] == [1, 2, 3]  # the newest run was continued
    assert all(row["elapsed_s"] >= 0 and row["eta_s"] >= 0 for row in rows) and rows[-1]["eta_s"] == 0
    assert "elapsed, ETA 0s" in capsys.readouterr().out
    train.main([*run, "--verbose", "--out_dir", str(tmp_path / "verbose")])
    assert '"model_size": "tiny"' in capsys.readouterr().out


@pytest.mark.slow
def test_a_refusal_under_torchrun_is_one_line_at_the_end(data_dir, tmp_path):
    (tmp_path / "config.json").write_text('{"train": {}}')  # a directory that holds a run
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                           f"--master_port={port}", str(ROOT / "train.py"), "--model_size", "tiny",
                           "--data_dir", str(data_dir), "--out_dir", str(tmp_path)],
                          capture_output=True, text=True, timeout=300)
    message = f"error: {tmp_path} already holds a run"
    assert proc.returncode != 0 and proc.stderr.count(message) == 2, proc.stderr  # printed once, reported once
    last = [line for line in proc.stderr.strip().splitlines() if line.strip() and not line.startswith("=")]
    assert message in last[-1] and "traceback" in last[-1]


def test_what_a_short_run_on_little_data_says(data_dir, tmp_path, capsys):
    """A corpus of a few windows: the run says how often it rereads the data; the first metrics line says the ETA
    comes after the next step; the end draws the loss curve and names it; the sample of data that is not the
    default corpus (Python source) starts a document, not `def `."""
    import data

    (tmp_path / "small.txt").write_text("def f(x):\n    return x + 1\n" * 30)
    data.main(["prepare", "--input", str(tmp_path / "small.txt"), "--tokenizer", str(data_dir / "tokenizer.model"),
               "--out_dir", str(tmp_path / "small"), "--validation_fraction", "0"])
    capsys.readouterr()
    train.main(["--model_size", "tiny", "--context_length", "32", "--batch_size", "2", "--max_steps", "12",
                "--sample_tokens", "4", "--log_interval", "100", "--data_dir", str(tmp_path / "small"),
                "--out_dir", str(tmp_path / "run")])
    out = capsys.readouterr().out
    assert "batches a pass: --max_steps 12 reads it" in out and "times (each pass in a new order)" in out
    assert "(1 process x 1 accumulated x 2 sequences x 32 tokens)" in out
    first = next(line for line in out.splitlines() if line.startswith("step      1/12"))
    assert first.endswith("ETA after the next step")
    pytest.importorskip("matplotlib")
    assert f"wrote {tmp_path / 'run' / 'loss.png'} (the loss curve" in out and (tmp_path / "run" / "loss.png").is_file()
    assert "--- sample (4 tokens at temperature 0.8 after the start of a document) ---" in out
