"""benchmarks/passkey_grid.py: its plan (every train.py command one that train.py's parser takes, the form's options
on NSA's long stages only) and the grid's row from a run's files."""

from __future__ import annotations

import dataclasses
import json
import runpy
import shlex
from pathlib import Path

import pytest

from training.options import parse_config

GRID = runpy.run_path(str(Path(__file__).resolve().parent.parent / "benchmarks" / "passkey_grid.py"))


def test_the_plan_is_the_recipe_for_each_type_length_and_seed(capsys):
    GRID["main"](["--dry_run", "--lengths", "1024", "4096", "--seeds", "3", "--out_dir", "grid", "--form",
                  "--nsa_exact_selection_steps", "200"])
    commands = [shlex.split(line.removeprefix("would run: ")) for line in capsys.readouterr().out.splitlines()]
    assert len(commands) == 2 * (2 + 2 * 2) + 2  # per type: copying, passkey at 256, a run and its eval per length;
    ablations = [c[2:] for c in commands if c[1] == "benchmarks/nsa_branch_ablation.py"]  # NSA's exact-score ceiling
    assert ablations[0] == ["grid/nsa-T1024-seed3/model", "--task", "passkey", "--length", "1014", "--samples", "10",
                            "--seed", "1000", "--json", "grid/nsa-T1024-seed3/eval-model/ablation.json"]
    assert len(ablations) == 2
    trains = [c[2:] for c in commands if c[1] == "train.py"]
    configs = [parse_config(argv) for argv in trains]
    long = [(c.context_length, c.seed, c.nsa_exact_selection_steps) for c in configs if c.context_length > 256]
    assert long == [(1024, 3, 200), (4096, 3, 200), (1024, 3, 0), (4096, 3, 0)]  # the form: NSA's stages only
    assert configs[0].model_overrides == GRID["BLOCKS"] and configs[0].nsa_score_loss_coef == 0.1
    evals = [c for c in commands if c[1] == "eval.py"]
    assert evals[0][2:] == ["grid/nsa-T1024-seed3/model", "--tasks", "passkey", "--lengths", "256", "1014",
                            "--samples", "10", "--seed", "1000"]  # prompts no training run drew
    copies = [c[c.index("--seeds") + 1] for c in commands if c[1] == "benchmarks/recall_experiment.py"]
    assert copies == ["3", "3"]  # every stage with the run's seed, the copying and 256-token stages too
    assert [c.seed for c in configs if c.context_length == 256] == [3, 3]


def test_the_default_form_is_the_recommended_recipe(capsys):
    """Without --form NSA's long stages take docs/nsa.md's recipe (configs/nsa-retrieval.json's loss and warm-up,
    at lr 1e-3); full attention's keep lr 3e-3 and no NSA option."""
    GRID["main"](["--dry_run", "--lengths", "1024", "--seeds", "0", "--out_dir", "grid"])
    commands = [shlex.split(line.removeprefix("would run: ")) for line in capsys.readouterr().out.splitlines()]
    runs = [parse_config(cmd[2:]) for cmd in commands if cmd[1] == "train.py" and "1024" in cmd]
    nsa, full = runs  # NSA's first (--types nsa full)
    recipe = parse_config(["--config", "configs/nsa-retrieval.json"])
    form = ("nsa_score_loss_coef", "nsa_score_loss_stride", "nsa_score_loss_top", "nsa_score_loss_random",
            "nsa_exact_selection_steps")
    assert [getattr(nsa, name) for name in form] == [getattr(recipe, name) for name in form] and nsa.lr == 1e-3
    assert (full.nsa_score_loss_coef, full.nsa_exact_selection_steps, full.lr) == (0.0, 0, 3e-3)


def test_a_row_reads_the_passkey_grid_and_the_answer_loss(tmp_path: Path):
    run = tmp_path / "nsa-T1024-seed0"
    (run / "eval-model").mkdir(parents=True)
    accuracy = [[1.0, 1.0, 0.9, 1.0, 1.0], [0.5, 1.0, 0.0, 0.5, 1.0]]
    (run / "eval-model" / "eval.json").write_text(json.dumps({"passkey": {"accuracy": accuracy}}))
    steps = [{"step": i, "loss": 1.0 + i, "aux_loss": 0.5, "grad_norm": 1.0} for i in range(60)]
    (run / "metrics.jsonl").write_text("\n".join(json.dumps(s) for s in [{"note": "start"}, *steps]))
    assert GRID["row"]("nsa", 1024, 0, run)["exact_beyond_window"] is None  # no ablation.json (full attention)
    exact = {"all": {"accuracy": [[0.5, 1, 0, 0.5, 1]]}, "exact block scores": {"accuracy": [[1, 1, 0.9, 0.9, 1]]}}
    (run / "eval-model" / "ablation.json").write_text(json.dumps(exact))
    row = GRID["row"]("nsa", 1024, 0, run)
    assert row["exact_beyond_window"] == pytest.approx(0.95)
    assert row["beyond_window"] == 0.5 and row["at_end"] == 1.0 and row["at_256"] == pytest.approx(0.98)
    assert row["answer_loss"] == pytest.approx(0.5 + sum(range(10, 60)) / 50)  # the last 50 steps, less the aux


def test_options_the_grid_would_misuse_are_refused(tmp_path: Path, capsys):
    """--form takes train.py's options to the end of the line (one of the grid's own after it would go to train.py),
    applies to NSA only, and a finished stage recorded with other options is not reused as if it were this one's."""
    for argv, message in ((["--form", "--nsa_exact_selection_steps", "200", "--dry_run"], "--dry_run is this script's"),
                          (["--types", "full", "--form", "--lr", "1e-3"], "--form applies to NSA's stages")):
        with pytest.raises(SystemExit):
            GRID["main"](argv)
        assert message in capsys.readouterr().err
    args = ["--out_dir", str(tmp_path), "--lengths", "1024", "--seeds", "0", "--types", "nsa", "--dry_run"]
    GRID["main"](args)
    train = next(shlex.split(line.removeprefix("would run: ")) for line in capsys.readouterr().out.splitlines()
                 if "nsa-T1024-seed0" in line)
    run = tmp_path / "nsa-T1024-seed0"
    (run / "model").mkdir(parents=True)
    (run / "model" / "config.json").write_text("{}")
    (run / "config.json").write_text(json.dumps({"train": dataclasses.asdict(parse_config(train[2:]))}))
    GRID["main"](args)  # the same options: reused
    assert f"would run: {shlex.join(train)}" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        GRID["main"]([*args, "--steps", "800"])
    assert f"{run} was trained with --max_steps 400, not 800" in capsys.readouterr().err
