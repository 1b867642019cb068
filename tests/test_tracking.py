"""--tracker: TensorBoard's event file, read back, holds the scalars of metrics.jsonl at their steps, once each after a
resume that redoes a step; W&B receives them too (and runs offline); a tracker whose package is missing is refused
before the run starts."""

from __future__ import annotations

import importlib.machinery
import json
import sys
from pathlib import Path

import pytest

import train
from training import tracking

pytest.importorskip("tensorboard")


def run(data_dir: Path, out_dir: Path, *extra: str) -> dict:
    return train.main(["--model_size", "tiny", "--data_dir", str(data_dir), "--out_dir", str(out_dir),
                       "--context_length", "32", "--batch_size", "2", "--max_steps", "3", "--sample_tokens", "0",
                       "--checkpoint_interval", "2", *extra])


def metrics_lines(out_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]


def test_tensorboard_holds_the_metrics_of_every_step_once(data_dir: Path, tmp_path: Path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "run"
    run(data_dir, out, "--tracker", "tensorboard")
    run(data_dir, out, "--tracker", "tensorboard", "--resume", str(out / "step-2"))  # step 3 again
    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    lines = [line for line in metrics_lines(out) if "loss" in line]
    for name in ("loss", "lr", "grad_norm", "tokens_per_s", "elapsed_s"):
        scalars = events.Scalars(name)
        assert [s.step for s in scalars] == [1, 2, 3], name
        assert [s.value for s in scalars] == pytest.approx([line[name] for line in lines], rel=1e-6), name


class FakeWandb:
    """Stands in for the wandb module: records what the tracker sends."""

    def __init__(self) -> None:
        self.__spec__ = importlib.machinery.ModuleSpec("wandb", None)  # importlib's find_spec reads it
        self.inits: list[dict] = []
        self.logged: list[tuple[int, dict]] = []
        self.finished = 0

    def init(self, **kwargs: object) -> FakeWandb:
        self.inits.append(kwargs)
        return self

    def log(self, values: dict, step: int) -> None:
        self.logged.append((step, values))

    def finish(self, exit_code: int = 0) -> None:
        self.finished += 1


def test_wandb_receives_the_metrics_and_resumes_its_run(data_dir: Path, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch):
    fake = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    out = tmp_path / "run"
    run(data_dir, out, "--tracker", "wandb", "--max_steps", "2")
    run(data_dir, out, "--tracker", "wandb", "--resume")
    lines = [line for line in metrics_lines(out) if "loss" in line]
    assert [step for step, _ in fake.logged] == [1, 2, 3] and fake.finished == 2
    assert [values["loss"] for _, values in fake.logged] == [line["loss"] for line in lines]
    assert set(fake.logged[0][1]) == set(tracking.scalars(lines[0]))
    first, second = fake.inits
    assert first["id"] == second["id"] and second["resume"] == "allow" and first["config"]["max_steps"] == 2


@pytest.mark.slow
def test_wandb_runs_offline(data_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    out = tmp_path / "run"
    run(data_dir, out, "--tracker", "wandb")
    run_id = (out / "wandb_id").read_text().strip()
    assert next((out / "wandb").glob(f"offline-run-*-{run_id}/run-{run_id}.wandb")).stat().st_size > 0


def test_a_missing_tracker_package_is_refused_before_the_run(data_dir: Path, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setitem(tracking.PACKAGES, "tensorboard", ("no_such_package", "pip install no_such_package"))
    with pytest.raises(ValueError, match="--tracker tensorboard needs the no_such_package package: pip install"):
        run(data_dir, tmp_path / "run", "--tracker", "tensorboard")
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
