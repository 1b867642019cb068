"""benchmarks/recall_experiment.py: the stage grammar, and a two-stage curriculum (copying, then MQAR) end to end."""

import argparse
import json
import runpy
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT_PATH = Path(__file__).resolve().parent.parent / "benchmarks" / "recall_experiment.py"
SCRIPT = runpy.run_path(str(SCRIPT_PATH))
Stage = SCRIPT["Stage"]


@pytest.mark.parametrize("text, stage, name", [
    ("64:600", Stage("mqar", 64, 600, None, None), "T64"),
    ("512:400:4", Stage("mqar", 512, 400, 4, None), "T512-p4"),
    ("2048:400:4@3e-4", Stage("mqar", 2048, 400, 4, 3e-4), "T2048-p4"),
    ("copy:64:1000", Stage("copy", 64, 1000, None, None), "copy-T64"),
    ("copy:64:1000@1e-3", Stage("copy", 64, 1000, None, 1e-3), "copy-T64"),
])
def test_stage_grammar(text, stage, name):
    assert SCRIPT["parse_stage"](text) == stage
    assert SCRIPT["stage_name"](stage) == name


@pytest.mark.parametrize("text", ["64", "64:0", "64:10:4:1", "copy:64:10:4", "x:64:10", "64:10@", "64:10@-1",
                                  "64:10@nan", "64:10@inf", "64:10@0"])
def test_bad_stage_is_refused(text):
    with pytest.raises(argparse.ArgumentTypeError, match="LENGTH:STEPS"):
        SCRIPT["parse_stage"](text)


def test_copy_then_mqar_curriculum(data_dir, tmp_path, capsys):
    """Each stage starts from the previous export with its own task and learning rate; the copying stage is not
    scored, the MQAR stage is, and both reach the table. Run again, finished stages are reused when their arguments
    are the same and refused (before any training) when they differ."""
    out = tmp_path / "recall"
    common = ["--types", "full", "--samples", "2", "--batch_tokens", "64", "--data_dir", str(data_dir),
              "--out_dir", str(out)]
    SCRIPT["main"]([*common, "--stages", "copy:32:2", "32:3:2@1e-3"])
    copy_cfg = json.loads((out / "full-seed0" / "copy-T32" / "config.json").read_text())["train"]
    mqar_cfg = json.loads((out / "full-seed0" / "T32-p2" / "config.json").read_text())["train"]
    assert (copy_cfg["synthetic_task"], copy_cfg["lr"], copy_cfg["init_from"]) == ("copy", 3e-3, None)
    assert (mqar_cfg["synthetic_task"], mqar_cfg["lr"], mqar_cfg["synthetic_pairs"]) == ("mqar", 1e-3, 2)
    assert mqar_cfg["init_from"] == str(out / "full-seed0" / "copy-T32" / "model")
    copy_row, mqar_row = json.loads((out / "summary.json").read_text())["full-seed0"]
    assert copy_row["mqar"] is None and mqar_row["mqar"]["answers"] == 4
    table = capsys.readouterr().out
    assert "| full-seed0 | 32 | copying | 2 |" in table and "| full-seed0 | 32 | 2 | 3 |" in table
    first = (out / "full-seed0" / "T32-p2" / "stage.json").read_text()
    SCRIPT["main"]([*common, "--stages", "copy:32:2", "32:3:2@1e-3"])  # reused: nothing retrained
    assert (out / "full-seed0" / "T32-p2" / "stage.json").read_text() == first
    with pytest.raises(SystemExit) as exit_info:
        SCRIPT["main"]([*common, "--stages", "copy:32:2", "32:3:2@2e-3"])
    assert exit_info.value.code == 2 and "T32-p2 finished with other arguments" in capsys.readouterr().err


def test_copying_only_curriculum(data_dir, tmp_path, capsys):
    """A curriculum without an MQAR stage trains, prints its row and draws no plot."""
    out = tmp_path / "copy"
    SCRIPT["main"](["--types", "full", "--stages", "copy:32:2", "--batch_tokens", "64", "--data_dir", str(data_dir),
                    "--out_dir", str(out)])
    table = capsys.readouterr().out
    assert "| full-seed0 | 32 | copying | 2 |" in table and "Mean over seeds" not in table
    assert not (out / "recall_by_distance.png").exists()


@pytest.mark.slow
def test_a_stopped_stage_ends_the_experiment_and_resumes(data_dir, tmp_path, capsys, monkeypatch):
    """A stage stopped by SIGTERM (saved at its step, not finished) ends the experiment with one line, before any
    later stage or score reads its model; the same command then resumes that stage from its checkpoint."""
    import contextlib

    import training.trainer

    @contextlib.contextmanager
    def signalled():
        yield {"stop": True}  # what a SIGTERM during the first step leaves

    out = tmp_path / "stopped"
    argv = ["--types", "full", "--stages", "copy:32:3", "32:2:2", "--batch_tokens", "64", "--samples", "2",
            "--data_dir", str(data_dir), "--out_dir", str(out)]
    with monkeypatch.context() as patch:
        patch.setattr(training.trainer, "stop_on_signals", signalled)
        with pytest.raises(SystemExit, match="copy-T32 stopped before its end .* the same command resumes it"):
            SCRIPT["main"](argv)
    assert (out / "full-seed0" / "copy-T32" / "step-1").is_dir() and not (out / "full-seed0" / "T32-p2").exists()
    SCRIPT["main"](argv)
    metrics = (out / "full-seed0" / "copy-T32" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in metrics if "loss" in json.loads(line)] == [1, 2, 3]
    assert "| full-seed0 | 32 | 2 |" in capsys.readouterr().out


@pytest.mark.slow
def test_runs_side_by_side(data_dir, tmp_path):
    """--jobs 2: each run in a process of its own (its output in its log), the table in the order of --types."""
    out = tmp_path / "jobs"
    done = subprocess.run([sys.executable, str(SCRIPT_PATH), "--types", "full", "nsa", "--stages", "copy:32:2",
                           "--jobs", "2", "--batch_tokens", "64", "--data_dir", str(data_dir), "--out_dir", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert list(json.loads((out / "summary.json").read_text())) == ["full-seed0", "nsa-seed0"]
    assert "copy-T32" in (out / "nsa-seed0.log").read_text()
    assert done.stdout.index("| full-seed0 |") < done.stdout.index("| nsa-seed0 |")


def test_mean_and_spread_over_seeds():
    """Percent with the sample standard deviation (n - 1) in points; one value has no spread; no answers: '-'."""
    assert SCRIPT["spread"]([0.5, 0.7]) == "60.0% (14.1)"
    assert SCRIPT["spread"]([0.25, None]) == "25.0%"
    assert SCRIPT["spread"]([None]) == "-"


def test_control_seeds(data_dir, tmp_path, capsys):
    """--control_seeds 1: the window control trains with the first seed only, the other types with every seed;
    the mean table counts each type's seeds. A count outside 1..len(--seeds), or one without swa among the types,
    is refused with exit 2."""
    out = tmp_path / "control"
    common = ["--types", "full", "swa", "--seeds", "0", "1", "--stages", "32:2:2", "--samples", "2",
              "--batch_tokens", "64", "--data_dir", str(data_dir), "--out_dir", str(out)]
    SCRIPT["main"]([*common, "--control_seeds", "1"])
    assert list(json.loads((out / "summary.json").read_text())) == ["full-seed0", "full-seed1", "swa-seed0"]
    table = capsys.readouterr().out
    assert "| full | 2 | 32 | 2 |" in table and "| swa | 1 | 32 | 2 |" in table
    for bad, message in ((["--control_seeds", "0"], "--control_seeds must lie between 1 and the 2"),
                         (["--control_seeds", "3"], "--control_seeds must lie between 1 and the 2"),
                         (["--control_seeds", "1", "--types", "full"], "add swa to --types")):
        with pytest.raises(SystemExit) as exit_info:
            SCRIPT["main"]([*common, *bad])
        assert exit_info.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.slow
def test_copy_overrides(data_dir, tmp_path, capsys):
    """--copy_overrides: the copying stage trains NSA with its own block sizes and RoPE base (the parameter-free mean
    compressor lets the same weights run with others); the MQAR stage after it goes back to --model_overrides' sizes
    and, for the base that only --copy_overrides sets, to the preset's; the stage after that inherits them without
    overrides of its own. Run again, every stage is reused; with other --copy_overrides, refused."""
    out = tmp_path / "coarse_copy"
    fine = {"nsa_compressor": "mean", "nsa_separate_kv": False, "nsa_block_size": 4, "nsa_stride": 4,
            "nsa_select_block_size": 4, "nsa_num_selected": 4}
    coarse = {"nsa_block_size": 16, "nsa_stride": 8, "nsa_select_block_size": 16, "rope_theta": 1e4}
    common = ["--types", "nsa", "--samples", "2", "--batch_tokens", "64", "--data_dir", str(data_dir),
              "--out_dir", str(out), "--model_overrides", json.dumps(fine), "--stages", "copy:32:2", "32:2:2", "48:2:2"]
    SCRIPT["main"]([*common, "--copy_overrides", json.dumps(coarse)])

    def model(stage: str) -> tuple:
        m = json.loads((out / "nsa-seed0" / stage / "model" / "config.json").read_text())["model"]
        return m["nsa_block_size"], m["nsa_stride"], m["nsa_select_block_size"], m["nsa_num_selected"], m["rope_theta"]

    preset_theta = SCRIPT["ModelConfig"].from_preset("demo").rope_theta
    assert model("copy-T32") == (16, 8, 16, 4, 1e4)
    assert model("T32-p2") == model("T48-p2") == (4, 4, 4, 4, preset_theta)
    records = [out / "nsa-seed0" / stage / "stage.json" for stage in ("copy-T32", "T32-p2", "T48-p2")]
    first, second = (json.loads(record.read_text())["args"] for record in records[1:])
    assert json.loads(first[first.index("--model_overrides") + 1]) == {**SCRIPT["TYPES"]["nsa"]["model_overrides"],
                                                                       **fine}
    assert float(first[first.index("--rope_theta") + 1]) == preset_theta
    assert "--model_overrides" not in second
    before = [record.read_text() for record in records]
    SCRIPT["main"]([*common, "--copy_overrides", json.dumps(coarse)])  # reused: nothing retrained
    assert [record.read_text() for record in records] == before
    with pytest.raises(SystemExit) as exit_info:
        SCRIPT["main"]([*common, "--copy_overrides", json.dumps({**coarse, "rope_theta": 1e5})])
    assert exit_info.value.code == 2 and "copy-T32 finished with other arguments" in capsys.readouterr().err


@pytest.mark.parametrize("extra, message", [
    (["--stages", "32:2:2", "--copy_overrides", '{"nsa_window": 16}'], "--copy_overrides applies to copying stages"),
    (["--copy_overrides", '{"qk_norm": false}'], "--copy_overrides changes the weights (layers.0.attn.k_norm.weight"),
    (["--copy_overrides", '{"nsa_block_size": 16}'], "nsa: --copy_overrides changes the weights"),
    (["--copy_overrides", '{"nsa_stride": 3}'], "nsa: NSA blocks need nsa_stride | nsa_block_size"),
    (["--model_overrides", '{"bogus": 1}'], "unknown ModelConfig field(s) ['bogus']"),
    (["--copy_overrides", '{"context_length": 128}'], "--copy_overrides sets context_length: the stages set"),
    (["--model_overrides", '{"attention_type": "full"}'], "--model_overrides sets attention_type"),
    (["--copy_overrides", "[]"], "argument --copy_overrides: expected a JSON object"),
    (["--model_overrides", "{"], "argument --model_overrides: not JSON"),
])
def test_bad_overrides_are_refused_before_training(data_dir, tmp_path, capsys, extra, message):
    """Overrides that build no model, or that the stage after copying could not load, or that are no JSON object:
    one line, exit 2, nothing trained."""
    with pytest.raises(SystemExit) as exit_info:
        SCRIPT["main"](["--types", "nsa", "--stages", "copy:32:2", "32:2:2", "--data_dir", str(data_dir),
                        "--out_dir", str(tmp_path / "bad"), *extra])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "bad").exists()


def test_copy_overrides_of_a_copying_only_curriculum(data_dir, tmp_path):
    """Without a stage after copying, --copy_overrides may change the weights: nothing has to load them."""
    out = tmp_path / "copy_only"
    SCRIPT["main"](["--types", "nsa", "--stages", "copy:32:2", "--copy_overrides", '{"qk_norm": false}',
                    "--batch_tokens", "64", "--data_dir", str(data_dir), "--out_dir", str(out)])
    model = json.loads((out / "nsa-seed0" / "copy-T32" / "model" / "config.json").read_text())["model"]
    assert model["qk_norm"] is False


@pytest.mark.parametrize("types, model_overrides, copy_overrides", [
    (["full", "swa", "nsa"], {"qk_norm": False}, {}),  # the README's command
    (["nsa"], {"qk_norm": False, "nsa_separate_kv": False, "nsa_compressor": "mean", "nsa_block_size": 8,
               "nsa_stride": 8, "nsa_select_block_size": 8, "nsa_num_selected": 18},
     {"nsa_block_size": 32, "nsa_stride": 16, "nsa_select_block_size": 32, "nsa_num_selected": 6}),  # RESULTS'
])
def test_documented_overrides_pass_the_checks(types, model_overrides, copy_overrides):
    """The overrides of the documented commands build every type's model, and their copying weights load into the
    MQAR stages."""
    args = argparse.Namespace(model_overrides=model_overrides, copy_overrides=copy_overrides)
    stages = [SCRIPT["parse_stage"](text) for text in ("copy:64:1000", "64:600:4", "512:400:4", "2048:400:4@3e-4")]
    SCRIPT["register_control"]()
    assert [SCRIPT["override_problem"](kind, stages, args) for kind in types] == [None] * len(types)


@pytest.mark.slow
def test_score_loss(data_dir, tmp_path, capsys):
    """--score_loss: NSA's MQAR stages long enough for top-n to choose (longer than n l' = 16) train with the
    scoring loss (train.py logs it as aux_loss), with --score_loss_top, --score_loss_random and --score_loss_target
    passed on; the copying stage, a stage of 16 tokens and the other types without; a negative weight, or one
    without an NSA run, or the candidate counts and the target without what they refine, are refused before
    training."""
    out = tmp_path / "score"
    fine = {"nsa_compressor": "mean", "nsa_separate_kv": False, "nsa_block_size": 4, "nsa_stride": 4,
            "nsa_select_block_size": 4, "nsa_num_selected": 4}
    common = ["--samples", "2", "--batch_tokens", "64", "--data_dir", str(data_dir), "--out_dir", str(out),
              "--stages", "copy:32:2", "16:2:2", "32:2:2"]
    SCRIPT["main"]([*common, "--types", "nsa", "full", "--model_overrides", json.dumps(fine), "--score_loss", "0.1",
                    "--score_loss_top", "2", "--score_loss_random", "1", "--score_loss_target", "selection",
                    "--exact_selection_steps", "1"])

    def run(kind: str, stage: str) -> tuple[dict, list[dict]]:
        args = json.loads((out / f"{kind}-seed0" / stage / "stage.json").read_text())["args"]
        score = {a[2:]: args[i + 1] for i, a in enumerate(args) if a.startswith(("--nsa_score_loss", "--nsa_exact"))}
        metrics = [json.loads(line) for line in (out / f"{kind}-seed0" / stage / "metrics.jsonl").open()]
        return score, [m for m in metrics if "loss" in m]

    score, metrics = run("nsa", "T32-p2")
    assert score == {"nsa_score_loss_coef": "0.1", "nsa_score_loss_top": "2", "nsa_score_loss_random": "1",
                     "nsa_score_loss_target": "selection", "nsa_exact_selection_steps": "1"}
    assert all(m["aux_loss"] > 0 for m in metrics)
    for kind, stage in (("nsa", "copy-T32"), ("nsa", "T16-p2"), ("full", "copy-T32"), ("full", "T32-p2")):
        score, metrics = run(kind, stage)
        assert not score and not any("aux_loss" in m for m in metrics)
    for bad, message in ((["--types", "nsa", "--score_loss", "-1"], "--score_loss must be a finite number >= 0"),
                         (["--types", "full", "--score_loss", "0.1"], "add nsa to --types"),
                         (["--types", "nsa", "--score_loss_stride", "4"], "goes with --score_loss"),
                         (["--types", "nsa", "--score_loss_top", "4"], "goes with --score_loss"),
                         (["--types", "nsa", "--score_loss", "0.1", "--score_loss_random", "2"],
                          "goes with --score_loss_top"),
                         (["--types", "nsa", "--score_loss_target", "selection"], "goes with --score_loss"),
                         (["--types", "nsa", "--score_loss_temperature", "2"], "goes with --score_loss"),
                         (["--types", "nsa", "--score_loss", "0.1", "--score_loss_target", "selection",
                           "--score_loss_temperature", "2"], "shapes the 'scores' target only"),
                         (["--types", "nsa", "--exact_selection_steps", "5"], "goes with --score_loss")):
        with pytest.raises(SystemExit) as exit_info:
            SCRIPT["main"]([*common[:-4], "--out_dir", str(tmp_path / "bad"), *bad])
        assert exit_info.value.code == 2 and message in capsys.readouterr().err
