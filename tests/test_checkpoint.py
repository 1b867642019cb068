"""checkpoint.py: resuming never runs code from a checkpoint. DCP's own reader unpickles `.metadata` with
pickle.load and reads non-tensor entries with torch.load(weights_only=False); ours builds only allow-listed classes
and reads with weights_only=True, so a crafted `.metadata` is refused before anything in it runs."""

from __future__ import annotations

import pickle
import shutil
from pathlib import Path

import pytest

import train
from checkpoint import UnsafeCheckpoint
from weights import load_model

RUN = ["--model_size", "tiny", "--context_length", "32", "--batch_size", "2", "--max_steps", "2", "--warmup_steps",
       "1", "--checkpoint_interval", "1", "--sample_tokens", "0"]


class _Payload:
    """Unpickling this writes a marker file: what an attacker's `.metadata` would do instead."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return (Path.write_text, (self.marker, "pwned"))


def test_a_crafted_metadata_runs_nothing(data_dir: Path, tmp_path: Path):
    run_dir = tmp_path / "run"
    train.main([*RUN, "--data_dir", str(data_dir), "--out_dir", str(run_dir)])
    marker = tmp_path / "marker"
    for name in ("step-1", "step-2"):
        (run_dir / name / ".metadata").write_bytes(pickle.dumps(_Payload(marker)))
    with pytest.raises(UnsafeCheckpoint, match="step-2 is not safe to load.*pathlib.*write_text.*nothing was run"):
        train.main([*RUN, "--max_steps", "3", "--data_dir", str(data_dir), "--out_dir", str(run_dir), "--resume"])
    with pytest.raises(UnsafeCheckpoint):
        load_model(run_dir / "step-1")
    assert not marker.exists()


def test_the_safe_reader_reads_real_checkpoints(data_dir: Path, tmp_path: Path):
    """A genuine checkpoint (model and AdamW state, step counts included) resumes through the safe reader."""
    train.main([*RUN, "--data_dir", str(data_dir), "--out_dir", str(tmp_path / "a")])
    shutil.copytree(tmp_path / "a" / "step-1", tmp_path / "b" / "step-1")
    metrics = train.main([*RUN, "--data_dir", str(data_dir), "--out_dir", str(tmp_path / "b"), "--resume"])
    assert metrics["step"] == 2


def test_old_checkpoints_and_stale_tmp_are_deleted(data_dir: Path, tmp_path: Path):
    """--keep_checkpoints 2 keeps the two newest step-N; a stale step-N.tmp goes at start; the checkpoint being
    resumed from is never deleted."""
    (tmp_path / "step-7.tmp").mkdir(parents=True)
    train.main([*RUN, "--max_steps", "4", "--keep_checkpoints", "2", "--data_dir", str(data_dir), "--out_dir",
                str(tmp_path)])
    assert sorted(p.name for p in tmp_path.glob("step-*")) == ["step-3", "step-4"]
    train.main([*RUN, "--max_steps", "6", "--keep_checkpoints", "1", "--data_dir", str(data_dir), "--out_dir",
                str(tmp_path), "--resume", str(tmp_path / "step-3")])
    assert sorted(p.name for p in tmp_path.glob("step-*")) == ["step-3", "step-6"]  # step-3 spared: resumed from


def test_metrics_are_strict_json_and_survive_a_cut_line(data_dir: Path, tmp_path: Path, monkeypatch):
    """A skipped step's NaN loss is written as null; on resume a partial last line (a kill mid-write) and the
    lines after the checkpoint are dropped, so each step appears once."""
    import json
    import math

    from model import Transformer

    compute_loss = Transformer.compute_loss
    calls = {"n": 0}

    def nan_once(self, *args):
        calls["n"] += 1
        loss, logits = compute_loss(self, *args)
        return (loss * math.nan if calls["n"] == 2 else loss), logits

    monkeypatch.setattr(Transformer, "compute_loss", nan_once)
    train.main([*RUN, "--max_steps", "3", "--data_dir", str(data_dir), "--out_dir", str(tmp_path)])
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    rows = [json.loads(line, parse_constant=lambda c: pytest.fail(f"non-JSON constant {c}")) for line in lines]
    assert rows[1]["loss"] is None and rows[1]["skipped"]
    monkeypatch.setattr(Transformer, "compute_loss", compute_loss)
    with (tmp_path / "metrics.jsonl").open("a") as f:
        f.write('{"step": 4, "loss": 1.2')  # a line cut short
    shutil.rmtree(tmp_path / "step-3")
    train.main([*RUN, "--max_steps", "3", "--data_dir", str(data_dir), "--out_dir", str(tmp_path), "--resume"])
    steps = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3]


@pytest.mark.slow
def test_run_directory_errors_are_one_line(data_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture):
    """From the command line: a directory holding a run, or a file as --out_dir, is one line with what to pass; a
    finished run resumed says so and trains nothing; malformed JSON in --config names the file."""
    import subprocess
    import sys

    train.main([*RUN, "--data_dir", str(data_dir), "--out_dir", str(tmp_path / "run")])
    root = Path(__file__).resolve().parent.parent
    command = [sys.executable, str(root / "train.py"), *RUN, "--data_dir", str(data_dir)]
    again = subprocess.run([*command, "--out_dir", str(tmp_path / "run")], capture_output=True, text=True)
    assert again.returncode == 1 and again.stderr.strip().splitlines() == [
        f"error: {tmp_path / 'run'} already holds checkpoints (step-2); pass --resume to continue that run, or "
        "choose another --out_dir"]
    (tmp_path / "file").write_text("")
    on_file = subprocess.run([*command, "--out_dir", str(tmp_path / "file")], capture_output=True, text=True)
    assert on_file.stderr.strip().splitlines() == [f"error: --out_dir {tmp_path / 'file'} is a file; pass a directory"]
    finished = subprocess.run([*command, "--out_dir", str(tmp_path / "run"), "--resume"], capture_output=True,
                              text=True)
    assert finished.returncode == 0 and "a run that has finished (--max_steps 2): nothing to train" in finished.stdout
    (tmp_path / "bad.json").write_text('{"lr": 0.1,')
    with pytest.raises(SystemExit):
        train.main(["--config", str(tmp_path / "bad.json")])
    assert f"{tmp_path / 'bad.json'} is not valid JSON" in capsys.readouterr().err
