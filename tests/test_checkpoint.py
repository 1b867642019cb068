"""checkpoint.py and the run directory: resuming never runs code from a checkpoint (DCP's own reader unpickles
`.metadata` with pickle.load and reads non-tensor entries with torch.load(weights_only=False); ours builds only
allow-listed classes and reads with weights_only=True), a damaged file is found by the manifest before anything is
loaded, options changed on resume take effect, and a run never rewrites another run's files."""

from __future__ import annotations

import dataclasses
import json
import pickle
import shutil
from pathlib import Path

import pytest
import torch

import train
from storage.checkpoint import UnsafeCheckpoint, verify_checkpoint
from storage.manifest import MANIFEST_NAME, DamagedCheckpoint, file_records
from storage.weights import load_model
from training import trainer
from training.options import TrainConfig

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
        forge_manifest(run_dir / name)  # an attacker can rewrite the manifest too: it detects damage, not intent
    with pytest.raises(UnsafeCheckpoint, match="step-2 is not safe to load.*pathlib.*write_text.*nothing was run"):
        train.main([*RUN, "--max_steps", "3", "--data_dir", str(data_dir), "--out_dir", str(run_dir), "--resume"])
    with pytest.raises(UnsafeCheckpoint):
        load_model(run_dir / "step-1")
    assert not marker.exists()


def forge_manifest(path: Path) -> None:
    manifest = json.loads((path / MANIFEST_NAME).read_text())
    manifest["files"] = file_records([path / name for name in manifest["files"]])
    (path / MANIFEST_NAME).write_text(json.dumps(manifest))


def flip_bit(file: Path, offset: int) -> None:
    data = bytearray(file.read_bytes())
    data[offset] ^= 1
    file.write_bytes(bytes(data))


def test_a_damaged_checkpoint_names_the_file_and_resume_falls_back(data_dir: Path, tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture):
    """One flipped bit, a truncated or a missing file: a one-line error naming the file and the next-older
    checkpoint, before anything is loaded; plain --resume falls back to that checkpoint with a warning and continues
    exactly as an uninterrupted run."""
    run = [*RUN, "--max_steps", "3", "--data_dir", str(data_dir)]
    reference = train.main([*run, "--out_dir", str(tmp_path / "reference")])
    train.main([*RUN, "--data_dir", str(data_dir), "--out_dir", str(tmp_path / "run")])
    step2 = tmp_path / "run" / "step-2"
    for damage in (lambda f: f.write_bytes(f.read_bytes()[:-10]), Path.unlink):
        victim = tmp_path / "victim"
        shutil.copytree(step2, victim / "step-2")
        damage(victim / "step-2" / "train_state.json")
        with pytest.raises(DamagedCheckpoint, match="train_state.json .*no older checkpoint exists"):
            verify_checkpoint(victim / "step-2")
        shutil.rmtree(victim)
    weights = next(step2.glob("*.distcp"))
    flip_bit(weights, weights.stat().st_size // 2)
    with pytest.raises(DamagedCheckpoint, match=rf"step-2 is damaged: {weights.name} has CRC-32 \w+; the "
                                               rf"manifest says .*--resume {tmp_path / 'run' / 'step-1'}"):
        verify_checkpoint(step2)
    with pytest.raises(DamagedCheckpoint, match="step-2 is damaged"):
        load_model(step2)
    resumed = train.main([*run, "--out_dir", str(tmp_path / "run"), "--resume"])
    assert "step-2 is damaged" in capsys.readouterr().out
    assert resumed["loss"] == reference["loss"]  # bitwise: resumed at step 1, trained steps 2 and 3 again


def test_changed_optimizer_options_take_effect_on_resume(data_dir: Path, tmp_path: Path):
    """--lr and --weight_decay given on resume replace the checkpoint's (restored optimizer and scheduler state would
    keep them otherwise); the change is printed and recorded in metrics.jsonl. Unchanged options resume bitwise."""
    run = [*RUN, "--max_steps", "4", "--data_dir", str(data_dir)]
    train.main([*run, "--max_steps", "2", "--out_dir", str(tmp_path / "a")])
    train.main([*run, "--out_dir", str(tmp_path / "a"), "--resume", "--lr", "0.5", "--weight_decay", "0.25"])
    rows = [json.loads(line) for line in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    assert rows[2] == {"step": 2, "resumed_with": {"lr": [3e-3, 0.5], "weight_decay": [0.1, 0.25], "max_steps": [2, 4]}}
    train.main([*run, "--lr", "0.5", "--weight_decay", "0.25", "--out_dir", str(tmp_path / "b")])
    expected = [json.loads(line) for line in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    assert rows[3]["lr"] == expected[2]["lr"] and rows[4]["lr"] == expected[3]["lr"]  # the new schedule at step 3
    model = torch.nn.Linear(2, 2)
    cfg = TrainConfig(lr=0.5, weight_decay=0.25, max_steps=4, warmup_steps=1)
    optimizer, scheduler = trainer.build_optimizer(model, dataclasses.replace(cfg, lr=3e-3, weight_decay=0.1))
    trainer.apply_optimizer_options(optimizer, scheduler, cfg, {})
    assert [(g["lr"], g["weight_decay"]) for g in optimizer.param_groups] == [(0.5, 0.25), (0.5, 0.0)]


def test_a_run_never_rewrites_another_runs_files(data_dir: Path, tmp_path: Path):
    """A directory holding a run refuses a fresh start and a checkpoint from elsewhere; a run killed before its
    first checkpoint restarts with --resume and a fresh metrics.jsonl."""
    train.main([*RUN, "--data_dir", str(data_dir), "--out_dir", str(tmp_path / "a")])
    train.main([*RUN, "--data_dir", str(data_dir), "--out_dir", str(tmp_path / "b")])
    before = {p: p.read_bytes() for p in (tmp_path / "b").rglob("*") if p.is_file()}
    with pytest.raises(FileExistsError, match="holds another run: continuing .*step-1 there would rewrite its files"):
        train.main([*RUN, "--max_steps", "3", "--data_dir", str(data_dir), "--out_dir", str(tmp_path / "b"),
                    "--resume", str(tmp_path / "a" / "step-1")])
    with pytest.raises(FileExistsError, match=r"already holds a run \(step-2\); pass --resume"):
        train.main([*RUN, "--data_dir", str(data_dir), "--out_dir", str(tmp_path / "b")])
    assert before == {p: p.read_bytes() for p in (tmp_path / "b").rglob("*") if p.is_file()}
    killed = tmp_path / "killed"
    killed.mkdir()
    (killed / "metrics.jsonl").write_text('{"step": 1, "loss": 9.0}\n')
    with pytest.raises(FileExistsError, match="a run without a checkpoint"):
        train.main([*RUN, "--data_dir", str(data_dir), "--out_dir", str(killed)])
    train.main([*RUN, "--data_dir", str(data_dir), "--out_dir", str(killed), "--resume"])
    assert [json.loads(line)["step"] for line in (killed / "metrics.jsonl").read_text().splitlines()] == [1, 2]


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

    def nan_once(self, *args, **kwargs):
        calls["n"] += 1
        loss, logits = compute_loss(self, *args, **kwargs)
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
    assert again.returncode == 2 and again.stderr.strip().splitlines() == [
        f"error: {tmp_path / 'run'} already holds a run (step-2); pass --resume to continue it (from scratch when "
        "it has no checkpoint), or choose another --out_dir"]
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


def test_a_checkpoint_naming_nsa_s_gate_as_before_its_rename_is_refused_saying_what_loads(tmp_path):
    """A step-N written while NSA's branch gate was `attn.gate_proj` (DCP reads by name): one line naming the rename,
    that the run's export loads, and the version that resumes it."""
    from model import ModelConfig, Transformer
    from storage.checkpoint import load_model_weights, save_checkpoint

    config = ModelConfig.from_preset("tiny", attention_type="nsa")
    old = Transformer(config)
    for block in old.layers:
        block.attn.gate_proj = block.attn.branch_gate
        del block.attn.branch_gate
    optimizer = torch.optim.AdamW(old.parameters())
    path = save_checkpoint(tmp_path, 1, old, optimizer, {"step": 1, "model_config": config.to_dict()})
    with pytest.raises(ValueError, match="names NSA's branch gate attn.gate_proj, as versions before its rename"):
        load_model_weights(path, Transformer(config))
