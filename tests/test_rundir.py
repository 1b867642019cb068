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
from storage.checkpoint import checkpoints
from training.run_directory import LOCK_NAME, RunLock

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


@pytest.mark.slow
def test_a_dead_runs_lock_is_taken_over(data_dir, tmp_path, capsys):
    dies_holding_it = f"import os, pathlib; from training import run_directory; " \
                      f"run_directory.RunLock(pathlib.Path({str(tmp_path)!r})).acquire(); " \
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


# ---- a run holds from any working directory --------------------------------------------------------------------

def test_a_run_resumes_and_evaluates_from_another_directory(data_dir, tmp_path, monkeypatch, capsys):
    """A run started with relative paths records them absolute (config.json, checkpoints), so that from another
    working directory `--resume` continues it with its own options and data (nothing prepared there), and eval.py
    scores its validation data without --data_dir."""
    import eval as eval_cli

    (tmp_path / "start").mkdir()
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "start")
    train.main(["--model_size", "tiny", "--context_length", "32", "--batch_size", "3", "--max_steps", "2",
                "--lr", "1e-3", "--sample_tokens", "0", "--data_dir", os.path.relpath(data_dir),
                "--out_dir", "runs/a"])
    run = tmp_path / "start" / "runs" / "a"
    recorded = json.loads((run / "config.json").read_text())["train"]
    assert recorded["data_dir"] == str(data_dir.resolve()) and recorded["out_dir"] == str(run)
    assert Path(recorded["tokenizer"]).is_absolute() and Path(recorded["tokenizer"]).is_file()
    monkeypatch.chdir(tmp_path / "elsewhere")
    capsys.readouterr()
    train.main(["--resume", "--out_dir", str(run), "--max_steps", "3"])
    out = capsys.readouterr().out
    changes = [line for line in out.splitlines() if "takes effect" in line]
    assert changes == ["--max_steps 3 takes effect from step 3 (the checkpoint was trained with 2)"]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert rows[-2:][0] == {"step": 2, "resumed_with": {"max_steps": [2, 3]}} and rows[-1]["step"] == 3
    assert rows[-1]["lr"] < 1e-3 and not (tmp_path / "elsewhere" / "data").exists()
    results = eval_cli.main([str(run / "model"), "--tasks", "loss", "--eval_tokens", "256"])
    assert results["loss"]["tokens"] > 0 and (run / "eval-model" / "eval.json").is_file()


def test_a_resumed_run_records_what_changes_its_steps_and_keeps_its_data(data_dir, tmp_path, capsys):
    """Options given on resume take effect and are recorded; the batch size changes what a step is, so it is
    printed and recorded too. Options that define the run's data cannot change: one line naming the option."""
    run = ["--model_size", "tiny", "--context_length", "32", "--max_steps", "2", "--sample_tokens", "0",
           "--data_dir", str(data_dir), "--out_dir", str(tmp_path)]
    train.main([*run, "--batch_size", "4"])
    capsys.readouterr()
    train.main([*run, "--batch_size", "2", "--max_steps", "4", "--resume"])
    assert "--batch_size 2 takes effect from step 3 (the checkpoint was trained with 4)" in capsys.readouterr().out
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert {"step": 2, "resumed_with": {"max_steps": [2, 4], "batch_size": [4, 2]}} in rows
    for option, value in (("seed", "1"), ("data_dir", str(tmp_path / "other")), ("synthetic_mix", "0.5")):
        with pytest.raises(ValueError, match=f"--{option} .*: the run in .* trains with .*leave --{option} out"):
            train.main([*run, "--max_steps", "5", "--resume", f"--{option}", value])
    assert json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])["step"] == 4  # nothing trained
    capsys.readouterr()
    train.main([*run, "--max_steps", "5", "--resume", "--z_loss_coef", "0.01", "--document_mask"])
    out = capsys.readouterr().out
    assert "--z_loss_coef 0.01 takes effect from step 5 (the checkpoint was trained with 0.0)" in out
    assert "--document_mask True takes effect from step 5 (the checkpoint was trained with False)" in out
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert {"step": 4, "resumed_with": {"z_loss_coef": [0.0, 0.01], "document_mask": [False, True],
                                        "max_steps": [4, 5]}} in rows


# A value other than the default of every option, for the walk over what a resume may change.
OTHER = {"model_size": "tiny", "attention_type": "nsa", "init_from": "elsewhere", "rope_scaling": {"rope_type": "yarn",
         "factor": 2.0, "original_max_position_embeddings": 128}, "model_overrides": {"nsa_window": 32},
         "finetune": "lora", "lora_targets": "q,v", "quantize_base": "int8", "npt_layers": "all", "npt_targets": "gate",
         "npt_residual_mode": "additive", "adapter": "adapters", "loss": "chunked", "dtype": "float32",
         "nsa_score_loss_target": "selection", "data_dir": "data/other", "tokenizer": "tok.model",
         "synthetic_task": "mqar", "tracker": "tensorboard", "export_dtype": "float32", "out_dir": "elsewhere",
         "resume": "auto", "sample_prompt": "x", "synthetic_mix": 0.5, "lr": 1e-3, "min_lr_ratio": 0.5,
         "max_memory": 10.0}

NEEDS = {"nsa_score_loss_random": {"nsa_score_loss_top": 4}, "synthetic_pairs": {"synthetic_task": "mqar"}}


def test_every_option_given_on_resume_is_refused_or_announced():
    """The one rule for what a resume changes (training/resume.py), walked over every option: given with a value
    other than the run's, it is refused with one line naming it (continue_options), or it is one of the changes the
    trainer announces and records (resume_changes); only the options about one invocation are neither."""
    import dataclasses

    from training.options import TrainConfig
    from training.resume import NOT_CONTINUED, continue_options, record, resume_changes

    base = TrainConfig(out_dir="run")
    refused = set()
    for field in dataclasses.fields(TrainConfig):
        name, value = field.name, getattr(base, field.name)
        if name in OTHER:
            other = OTHER[name]
        elif isinstance(value, bool) or value is None and field.type == "bool | None":
            other = not value
        else:
            other = 2 if value is None else value + 1 if isinstance(value, int) else value / 2 if value else 0.5
        start = dataclasses.replace(base, **NEEDS.get(name, {}))  # a run where the option can take a value
        recorded = record(start)
        try:
            continued = continue_options(dataclasses.replace(start, **{name: other}), frozenset({name}), recorded)
        except ValueError as e:
            assert f"--{name} " in str(e) and "\n" not in str(e), (name, str(e))
            refused.add(name)
            continue
        assert name in resume_changes(continued, recorded) or name in NOT_CONTINUED, name
    assert refused == {"data_dir", "seed", "synthetic_mix", "synthetic_task", "synthetic_pairs", "answer_loss",
                       "finetune", "lora_rank", "lora_alpha", "lora_targets", "npt_rank", "npt_layers", "npt_targets",
                       "npt_residual_mode", "adapter", "init_from"}
