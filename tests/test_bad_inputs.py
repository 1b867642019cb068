"""Bad inputs are refused with a message naming the argument, before anything large is built: train.py options
(a usage error, exit 2), ModelConfig values reaching the model (a ValueError), eval.py options, generation
arguments and load_model arguments. Nothing here is taken silently or clipped, and nothing that exists (prepared
data, a model, another run) is deleted or rewritten before the new thing is known to be good."""

from __future__ import annotations

import json
import os
import re
import runpy
from pathlib import Path

import pytest
import torch

import eval as eval_cli
import train
from model import Transformer
from modeling.config import ModelConfig
from storage.weights import load_model
from text.shards import TokenLoader
from training import options as train_config


@pytest.mark.parametrize("args, message", [
    (["--lr", "inf"], "--lr must be a finite number > 0 and <= 1, got inf"),
    (["--lr", "1e30"], "--lr must be a finite number > 0 and <= 1"),
    (["--lr", "nan"], "--lr must be a finite number"),
    (["--weight_decay", "-0.1"], "--weight_decay must be a finite number >= 0"),
    (["--seed", "-1"], "--seed must be >= 0"),
    (["--seed", str(2**70)], "--seed must be <= 9223372036854775807"),
    (["--finetune", "npt", "--npt_layers=-1"], "--npt_layers must be 'upper_half', 'all' or comma-separated indices"),
    (["--sample_tokens", "1000000"], "--sample_tokens must be less than --context_length (256)"),
    (["--ffn_chunk_size", "-1"], "--ffn_chunk_size must be >= 0"),
    (["--synthetic_task", "cloze"], "--synthetic_task must be one of"),
    (["--model_overrides", '{"n_layer": 2}'], "unknown field(s) ['n_layer']"),
    (["--max_steps", "ten"], "invalid int value"),
])
def test_train_options_are_usage_errors(args, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        train_config.parse_config(args)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and message in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("overrides, message", [
    ({"tie_embeddings": "no"}, "ModelConfig.tie_embeddings must be true or false, got 'no'"),
    ({"norm_eps": "1e-6"}, "ModelConfig.norm_eps must be a positive finite number"),
    ({"rope_theta": float("inf")}, "ModelConfig.rope_theta must be a positive finite number"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": "4", "original_max_position_embeddings": 64}},
     "rope_scaling values must be finite numbers"),
    ({"logit_softcap": float("nan")}, "ModelConfig.logit_softcap must be None or positive"),
])
def test_model_values_are_checked(overrides, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        ModelConfig.from_preset("tiny", **overrides)


def test_another_modes_option_is_refused_before_anything_is_written(data_dir, tmp_path):
    """A fine-tuning mode's options belong to it: given to another mode they are one line, even at their default
    value, as is an option the mode leaves without effect (checked when the run starts, so that parsing options
    imports no model code), and the run directory is not created."""
    for args, message in ((["--lora_rank", "8"], "--lora_rank is not an option of --finetune full: pass --finetune "
                                                 "lora"),
                          (["--lora_rank", "16"], "--lora_rank is not an option of --finetune full"),  # its default
                          (["--finetune", "npt", "--lora_alpha", "4"], "--lora_alpha is not an option of --finetune "
                                                                       "npt"),
                          (["--npt_rank", "4"], "--npt_rank is not an option of --finetune full"),
                          (["--finetune", "npt", "--npt_layers", "all", "--ffn_chunk_size", "16"],
                           "--ffn_chunk_size does not tile NPT's converted layers, and --npt_layers all converts all")):
        with pytest.raises(ValueError, match=message):
            train.main(["--model_size", "tiny", "--data_dir", str(data_dir), "--out_dir", str(tmp_path / "run"),
                        *args])
        assert not (tmp_path / "run").exists()


def test_the_overrides_of_a_run_are_checked_before_its_model_is_built(data_dir, tmp_path):
    with pytest.raises(ValueError, match="ModelConfig.tie_embeddings must be true or false"):
        train.main(["--model_size", "tiny", "--data_dir", str(data_dir), "--out_dir", str(tmp_path),
                    "--model_overrides", '{"tie_embeddings": "no"}'])
    assert not (tmp_path / "config.json").exists()
    with pytest.raises(FileNotFoundError, match="--resume /no/such/step-3 names no checkpoint directory"):
        train.main(["--model_size", "tiny", "--data_dir", str(data_dir), "--out_dir", str(tmp_path / "b"),
                    "--resume", "/no/such/step-3"])
    with pytest.raises(FileNotFoundError, match="--resume .*README.md is a file, not a checkpoint directory: pass one"):
        train.main(["--model_size", "tiny", "--data_dir", str(data_dir), "--out_dir", str(tmp_path / "b"),
                    "--resume", "README.md"])


def test_generation_and_loading_arguments():
    model = Transformer(ModelConfig.from_preset("tiny"))
    prompt = torch.zeros(1, 4, dtype=torch.long)
    with pytest.raises(ValueError, match="temperature must be finite"):
        model.generate(prompt, 2, temperature=float("inf"))
    with pytest.raises(ValueError, match=r"eos_id must be a token id in \[0, 512\), got 512"):
        model.generate(prompt, 2, eos_id=512)
    with pytest.raises(ValueError, match="dtype must be a torch.dtype"):
        load_model("anything", dtype="float16")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA device"):
            load_model("anything", device="cuda")


@pytest.mark.parametrize("args, message", [
    (["--eval_tokens", "0"], "--eval_tokens must be >= 1"),
    (["--eval_tokens", "-1"], "--eval_tokens must be >= 1"),
    (["--context_length", "0"], "--context_length must be >= 2"),
    (["--context_length", "1"], "--context_length must be >= 2"),
    (["--seed", "-1"], "--seed must be >= 0"),
    (["--device", "gpu"], "--device gpu: expected cpu, cuda or cuda:N"),
    (["--device", "meta"], "--device meta: expected cpu, cuda or cuda:N"),
    (["--tasks", "loss", "--pairs", "5"], "--pairs is read only by the task(s) mqar, mqar_text"),
    (["--tasks", "mqar", "--depths", "0.5"], "--depths is read only by the task(s) passkey, needle"),
    (["--tasks", "loss", "--documents", "x.jsonl"], "--documents is read only by the task(s) documents"),
    (["--context_length", "100000"], "exceeds the model's context_length"),
    (["--device", "cuda"], "no CUDA device"),
])
def test_eval_options_are_one_line_errors(args, message, data_dir, tmp_path, capsys):
    if args[0] == "--device" and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    from storage.weights import export_model

    export_model(Transformer(ModelConfig.from_preset("tiny")), tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        eval_cli.main([str(tmp_path / "model"), "--data_dir", str(data_dir), *args])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and message in err and "Traceback" not in err


# ---- by class: every input checked against what it means, nothing existing lost -------------------------------------
# Each class runs more inputs than were reported: paths, JSON options, numbers, foreign directories, formats,
# prepared data, adapters and architectures, errors during clean-up. Refusals are one line naming the input and the
# fix, before anything is written or allocated.

TINY = ["--model_size", "tiny", "--context_length", "32", "--batch_size", "2", "--max_steps", "1", "--sample_tokens",
        "0"]


def one_line_usage_error(main, args: list[str], capsys) -> str:
    """The refusal of main(args): exit 2 and one error line (progress bars may precede it), no usage text."""
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    err = capsys.readouterr().err
    lines = [line for line in err.strip().splitlines() if line.strip() and "tokenizing:" not in line]
    assert exit_info.value.code == 2 and len(lines) == 1 and "error: " in lines[0], err
    return err


@pytest.mark.parametrize("option", ["--model_overrides", "--rope_scaling"])
@pytest.mark.parametrize("value", ["[]", "null", "3", '"text"', "[1, 2]", "{not json"])
def test_json_options_must_be_objects(option, value, capsys):
    import profile_memory

    for main in (train_config.parse_config, profile_memory.main):
        err = one_line_usage_error(main, [option, value], capsys)
        assert f"argument {option}:" in err and ("expected a JSON object" in err or "not JSON" in err)


@pytest.mark.parametrize("value", ["-1e-3", "-1E-3", "-.5", "-2", "-1e+2", "-inf"])
def test_negative_numbers_are_read_as_numbers(value, capsys):
    err = one_line_usage_error(train_config.parse_config, ["--lr", value], capsys)
    assert "--lr must be a finite number > 0" in err and "expected one argument" not in err


def test_runs_started_side_by_side_prepare_the_default_corpus_once(tmp_path, monkeypatch):
    """Two runs that find the default corpus missing at once (recall_experiment.py --jobs on a new machine): one
    prepares it while the other waits on the lock, then finds it prepared; neither fails on the other's files."""
    import threading
    import time
    from types import SimpleNamespace

    from training import inputs

    monkeypatch.chdir(tmp_path)
    calls = []

    def prepare_default(cfg, data_dir: Path) -> None:
        calls.append(data_dir)
        time.sleep(0.3)  # long enough for the other run to arrive
        data_dir.mkdir(parents=True, exist_ok=True)
        (data_dir / "index.json").write_text("{}")

    monkeypatch.setattr(inputs, "_prepare_default", prepare_default)
    cfg, rt = train_config.TrainConfig(data_dir="data/stdlib"), SimpleNamespace(rank=0)
    runs = [threading.Thread(target=inputs.ensure_default_data, args=(cfg, rt)) for _ in range(2)]
    for run in runs:
        run.start()
    for run in runs:
        run.join()
    assert calls == [Path("data/stdlib")]


def test_paths_are_what_they_name(data_dir, tmp_path, monkeypatch, capsys):
    """Paths are compared resolved, never by their text: a directory whose name starts like the default corpus's
    is not prepared as it; a file is not a directory; a run directory is not a checkpoint nor a model."""
    from training.inputs import default_corpus
    from training.run_directory import LOCK_NAME

    monkeypatch.chdir(tmp_path)
    for path in ("data/stdlib", "./data/stdlib/", "data/../data/stdlib", str(tmp_path / "data" / "stdlib"),
                 "data/stdlib-0123456789ab"):
        assert default_corpus(path), path
    for path in ("data/stdlib_mycorpus", "data/stdlibx", "data/stdlib-mine", "data/stdlib/sub", "stdlib"):
        assert not default_corpus(path), path
    with pytest.raises(FileNotFoundError, match="data directory .*stdlib_mycorpus does not exist; create it with"):
        train.main([*TINY, "--data_dir", "data/stdlib_mycorpus", "--out_dir", "run"])
    assert not (tmp_path / "data").exists()  # nothing prepared in its place
    (tmp_path / "a_file").write_text("x")
    with pytest.raises(ValueError, match="--data_dir .*a_file is a file; pass a directory of prepared data"):
        train.main([*TINY, "--data_dir", "a_file", "--out_dir", "run2"])
    train.main([*TINY, "--data_dir", str(data_dir), "--out_dir", "run"])
    with pytest.raises(ValueError, match=r"--resume run is a run directory, not a checkpoint: pass --resume "
                                         r"--out_dir run \(its newest checkpoint\), or --resume run/step-N"):
        train.main([*TINY, "--data_dir", str(data_dir), "--resume", "run"])
    err = one_line_usage_error(eval_cli.main, ["run", "--tasks", "loss"], capsys)
    assert "run is a run directory, not a model: pass run/model (its export) or run/step-N" in err
    err = one_line_usage_error(__import__("data").main, ["prepare", "--tokenizer", str(data_dir / "tokenizer.model"),
                                                         "--out_dir", "a_file"], capsys)
    assert "--out_dir a_file is a file" in err
    assert not (tmp_path / "run" / LOCK_NAME).exists()


def test_directories_that_hold_models_are_never_overwritten(data_dir, qwen3, tmp_path):
    """A run never writes into --init_from, an export (model/, hf/) or a Hugging Face directory, fresh or with
    --resume: one line, and the directory is byte for byte as it was."""
    import shutil

    train.main([*TINY, "--data_dir", str(data_dir), "--out_dir", str(tmp_path / "run")])
    hf_dir = tmp_path / "qwen3"
    shutil.copytree(qwen3[0], hf_dir)
    model_dirs = [tmp_path / "run" / "model", tmp_path / "run" / "hf", hf_dir]
    before = {p: p.read_bytes() for d in model_dirs for p in sorted(d.rglob("*")) if p.is_file()}
    for target in model_dirs:
        for extra in ([], ["--resume"], ["--init_from", str(target)], ["--init_from", str(target), "--resume"]):
            options = [*TINY, "--data_dir", str(data_dir), "--out_dir", str(target), *extra]
            if target == hf_dir or extra[:1] == ["--init_from"]:
                options = [o for o in options if o not in ("--model_size", "tiny")]
            with pytest.raises(FileExistsError, match=f"{target}.* (is the --init_from model|holds a config.json that "
                                                      "is not a training run's|holds a model).* choose another "
                                                      "--out_dir"):
                train.main(options)
    assert {p: p.read_bytes() for d in model_dirs for p in sorted(d.rglob("*")) if p.is_file()} == before


def test_prepared_data_is_replaced_only_by_complete_data(data_dir, tmp_path, capsys):
    """`data.py prepare --overwrite` prepares beside the old data and swaps at the end: an input that fails keeps
    the old data byte for byte; into a new directory, a failure leaves nothing; a success replaces shards, masks and
    the validation split, and keeps the tokenizer stored there."""
    import shutil

    import data

    tokenizer = str(data_dir / "tokenizer.model")
    out = tmp_path / "small"
    (tmp_path / "good.txt").write_text("def f():\n    return 1\n" * 50)
    data.main(["prepare", "--input", str(tmp_path / "good.txt"), "--tokenizer", tokenizer, "--out_dir", str(out),
               "--validation_fraction", "0"])
    shutil.copy(tokenizer, out / "tokenizer.model")
    snapshot = {p.name: p.read_bytes() for p in out.iterdir()}
    (tmp_path / "bad.jsonl").write_text('{"text": "fine"}\n{"no_text": 1}\n')
    for inputs in (["bad.jsonl"], ["good.txt", "bad.jsonl"], ["missing.txt"]):
        one_line_usage_error(data.main, ["prepare", "--input", *(str(tmp_path / i) for i in inputs), "--tokenizer",
                                         tokenizer, "--out_dir", str(out), "--overwrite"], capsys)
        assert {p.name: p.read_bytes() for p in out.iterdir()} == snapshot
    one_line_usage_error(data.main, ["prepare", "--input", str(tmp_path / "bad.jsonl"), "--tokenizer", tokenizer,
                                     "--out_dir", str(tmp_path / "new")], capsys)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.jsonl", "good.txt", "small"]  # no staging left
    (tmp_path / "more").mkdir()
    for i in range(3):
        (tmp_path / "more" / f"{i}.txt").write_text(f"x = {i}\n" * 400)
    data.main(["prepare", "--input", str(tmp_path / "more"), "--tokenizer", tokenizer, "--out_dir", str(out),
               "--overwrite"])
    assert (out / "tokenizer.model").read_bytes() == snapshot["tokenizer.model"]
    assert (out / "index.json").read_bytes() != snapshot["index.json"] and (out / "validation").is_dir()
    assert TokenLoader(out, 16, 1).num_tokens > 0


@pytest.mark.parametrize("name, content, message", [
    ("b.json", '[{"text": "a"}]', "is a JSON document, not records: write one record per line as .jsonl"),
    ("t.csv", "text\nhello\n", "is a table: convert it to .jsonl or .parquet records"),
    ("t.tsv", "text\thello\n", "is a table"),
    ("c.txt.gz", "x", "is compressed: decompress it first"),
    ("c.zip", "x", "is compressed"),
])
def test_inputs_of_other_formats_are_named(name, content, message, data_dir, tmp_path, capsys):
    import data

    (tmp_path / name).write_text(content)
    for command in (["prepare", "--tokenizer", str(data_dir / "tokenizer.model"), "--out_dir", str(tmp_path / "o")],
                    ["train-tokenizer", "--vocab_size", "300", "--model_prefix", str(tmp_path / "tok")]):
        err = one_line_usage_error(data.main, [*command, "--input", str(tmp_path / name)], capsys)
        assert message in err
    assert not (tmp_path / "o").exists()


def test_a_directory_names_the_files_it_does_not_read(data_dir, tmp_path, capsys):
    import data

    corpus = tmp_path / "corpus"
    (corpus / "sub").mkdir(parents=True)
    (corpus / "a.txt").write_text("def f():\n    return 1\n" * 20)
    (corpus / "b.json").write_text("[]")
    (corpus / "sub" / "c.csv").write_text("x\n1\n")
    (corpus / "sub" / "d.json").write_text("{}")
    (corpus / "README").write_text("no suffix")
    (corpus / "gone.txt").symlink_to(tmp_path / "moved.txt")  # a dangling link: named, never dropped silently
    os.mkfifo(corpus / "pipe.txt")
    data.main(["prepare", "--input", str(corpus), "--tokenizer", str(data_dir / "tokenizer.model"), "--out_dir",
               str(tmp_path / "o"), "--validation_fraction", "0"])
    err = capsys.readouterr().err
    assert f"{corpus}: skipped 4 files of other formats (2 .json, 1 .csv, 1 no suffix)" in err
    assert (f"{corpus}: skipped 2 entries that are not files to read: {corpus / 'gone.txt'} (a link to "
            f"{tmp_path / 'moved.txt'}, which does not exist), {corpus / 'pipe.txt'} (not a regular file)") in err
    assert json.loads((tmp_path / "o" / "index.json").read_text())["num_documents"] == 1


def test_an_init_from_model_fixes_the_architecture_and_the_tokenizer(data_dir, qwen3, tmp_path):
    """An --init_from model of another size than --model_size, or with another tokenizer than the --data_dir's, is
    refused (one line) instead of training something else than was asked."""
    model_dir, _ = qwen3
    for size in ("demo", "0.6B", "4B"):
        with pytest.raises(ValueError, match=f"--model_size {size}: the --init_from model is another size .*leave "
                                             "--model_size out"):
            train.main([*TINY[2:], "--model_size", size, "--init_from", str(model_dir), "--data_dir", str(data_dir),
                        "--out_dir", str(tmp_path / size)])
    with pytest.raises(ValueError, match="data was tokenized with .* but the tokenizer given is .*tokenizer.json"):
        train.main([*TINY[2:], "--init_from", str(model_dir), "--data_dir", str(data_dir), "--out_dir",
                    str(tmp_path / "other_tokenizer")])
    assert not any((tmp_path / d).exists() for d in ("demo", "0.6B", "4B"))


def test_adapters_refuse_another_base(data_dir, tmp_path):
    """LoRA and NPT adapters record the base they were trained on (its weights' checksum and tokenizer); --adapter
    on another base is one line, on the same base it loads."""
    from training.modes import adapter_base

    base = ["--data_dir", str(data_dir), *TINY[2:]]
    for name in ("a", "b"):  # two bases of the same shape
        train.main([*base, "--model_size", "tiny", "--seed", str(ord(name)), "--out_dir", str(tmp_path / name)])
    for mode, adapter in (("lora", "lora/adapter"), ("npt", "npt")):
        on_a = [*base, "--finetune", mode, "--init_from", str(tmp_path / "a" / "model")]
        train.main([*on_a, "--out_dir", str(tmp_path / mode)])
        assert adapter_base(tmp_path / adapter)["checksum"]
        with pytest.raises(ValueError, match=f"--adapter .*{adapter} was trained on another base"):
            train.main([*on_a[:-1], str(tmp_path / "b" / "model"), "--adapter", str(tmp_path / adapter),
                        "--out_dir", str(tmp_path / f"{mode}-b")])
        train.main([*on_a, "--adapter", str(tmp_path / adapter), "--out_dir", str(tmp_path / f"{mode}-a")])


def test_the_real_cause_wins_over_a_clean_up_error(tmp_path, monkeypatch):
    """Releasing the run lock in a directory that became unwritable raises nothing: the error that ended the run
    (a failed save) is the one reported, not "Permission denied: .lock"."""
    from pathlib import Path

    from training.run_directory import RunLock

    lock = RunLock(tmp_path)
    lock.acquire()
    real_unlink = Path.unlink

    def read_only(path: Path, missing_ok: bool = False) -> None:
        if path.parent == tmp_path:
            raise PermissionError(13, "Permission denied", str(path))
        real_unlink(path, missing_ok)

    monkeypatch.setattr(Path, "unlink", read_only)
    with pytest.raises(RuntimeError, match="could not save step-2"):
        try:
            raise RuntimeError("could not save step-2: read-only directory; the last complete checkpoint is step-1")
        finally:
            lock.release()
    assert lock.fd is None


# ---- a refused run changes nothing ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def four_checkpoints(data_dir, tmp_path_factory) -> Path:
    """A tiny run with step-1 ... step-4 (copied by the tests that change it)."""
    out = tmp_path_factory.mktemp("four") / "run"
    train.main([*TINY, "--max_steps", "4", "--checkpoint_interval", "1", "--keep_checkpoints", "5", "--data_dir",
                str(data_dir), "--out_dir", str(out)])
    return out


def test_a_refused_resume_moves_and_deletes_no_checkpoint(four_checkpoints, data_dir, tmp_path):
    """Checkpoints are pruned, and newer ones moved aside, only once the resumed run is prepared: a resume refused
    for a changed architecture leaves every step-N where it was, and says how to go on."""
    import shutil

    run = tmp_path / "run"
    shutil.copytree(four_checkpoints, run)
    base = [*TINY[:-4], "--sample_tokens", "0", "--data_dir", str(data_dir), "--out_dir", str(run)]
    for extra in (["--resume", "--keep_checkpoints", "1", "--max_steps", "6"],
                  ["--resume", str(run / "step-2"), "--max_steps", "6"]):
        with pytest.raises(ValueError, match=r"holds a different model: context_length=32 \(now 64\); resume it "
                                             "with the options it was trained with"):
            train.main([*base, "--context_length", "64", *extra])
        assert sorted(p.name for p in run.iterdir() if p.name.startswith(("step-", "abandoned"))) == [
            "step-1", "step-2", "step-3", "step-4"]


def test_a_run_whose_config_json_was_cut_short_resumes_from_its_checkpoints(four_checkpoints, data_dir, tmp_path):
    """config.json cut short (a full disk, a kill) is no reason to call the run a model: its newest checkpoint
    records the same options, the run resumes with them and writes config.json again."""
    import shutil

    run = tmp_path / "run"
    shutil.copytree(four_checkpoints, run)
    text = (run / "config.json").read_text()
    (run / "config.json").write_text(text[: len(text) // 2])
    train.main(["--out_dir", str(run), "--resume", "--max_steps", "5"])
    assert json.loads((run / "config.json").read_text())["train"]["max_steps"] == 5
    assert (run / "step-5").is_dir()


def test_data_whose_tokenizer_is_gone_names_the_way_back(data_dir, tmp_path):
    """Prepared data whose own tokenizer.model was deleted: its ids are that tokenizer's, so the fix is that file
    (or --tokenizer naming the same one), never a new tokenizer."""
    import shutil

    data = tmp_path / "data"
    shutil.copytree(data_dir, data)
    index = json.loads((data / "index.json").read_text())
    index["tokenizer"]["path"] = str(data / "tokenizer.model")
    (data / "index.json").write_text(json.dumps(index))
    (data / "tokenizer.model").unlink()
    with pytest.raises(FileNotFoundError, match="tokenizer.model, is missing, and the data's ids are that tokenizer's"):
        train.main([*TINY, "--data_dir", str(data), "--out_dir", str(tmp_path / "run")])
    train.main([*TINY, "--data_dir", str(data), "--out_dir", str(tmp_path / "run"), "--tokenizer",
                str(data_dir / "tokenizer.model")])


def test_a_run_refused_before_its_first_step_leaves_nothing(data_dir, tmp_path, monkeypatch):
    """A fresh run that fails before it completes a step (here its tracker) removes what it wrote, so that the
    same command, corrected, starts there again instead of being sent to --resume."""
    from training import tracking

    def broken(*args: object) -> None:
        raise ValueError("--tracker tensorboard: cannot write its events")

    monkeypatch.setitem(tracking.TRACKERS, "tensorboard", broken)
    run = [*TINY, "--data_dir", str(data_dir), "--out_dir", str(tmp_path / "run")]
    with pytest.raises(ValueError, match="cannot write its events"):
        train.main([*run, "--tracker", "tensorboard"])
    assert not (tmp_path / "run").exists()
    assert train.main(run)["step"] == 1


def test_the_equivalence_entry_resumes_with_the_options_it_recorded(data_dir, tmp_path):
    """train_npt.py --resume continues the recorded training and equivalence options (lr, warmup,
    mse_weight), as train.py does; an option given changes it."""
    from train_npt import main

    common = ["--config", "configs/npt_tiny.json", "--data_dir", str(data_dir), "--out_dir", str(tmp_path),
              "--context_length", "32", "--batch_size", "2", "--sample_tokens", "0"]
    main([*common, "--max_steps", "2", "--lr", "0.01", "--warmup_steps", "0", "--mse_weight", "2"])
    main(["--out_dir", str(tmp_path), "--resume", "--max_steps", "3", "--kl_weight", "0.5"])  # the rest: recorded
    recorded = json.loads((tmp_path / "config.json").read_text())
    assert (recorded["train"]["lr"], recorded["train"]["warmup_steps"]) == (0.01, 0)
    assert (recorded["npt"]["mse_weight"], recorded["npt"]["kl_weight"]) == (2, 0.5)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert {"step": 2, "resumed_with": {"max_steps": [2, 3], "kl_weight": [1.0, 0.5]}} in rows  # announced, recorded
    text = (tmp_path / "config.json").read_text()  # config.json cut short: the run's npt_config.json holds them
    (tmp_path / "config.json").write_text(text[: len(text) // 2])
    main(["--out_dir", str(tmp_path), "--resume", "--max_steps", "4"])
    assert json.loads((tmp_path / "config.json").read_text())["npt"]["kl_weight"] == 0.5


# ---- paths and directories --------------------------------------------------------------------------------------

def test_directories_that_hold_data_or_lie_inside_a_model_are_refused(four_checkpoints, data_dir, tmp_path):
    for out_dir, message in ((data_dir, "holds prepared data"), (four_checkpoints / "step-2" / "x", "lies inside"),
                             (four_checkpoints / "model", "holds a config.json that is not a training run's")):
        with pytest.raises(FileExistsError, match=message):
            train.main([*TINY, "--data_dir", str(data_dir), "--out_dir", str(out_dir)])


def test_inputs_named_twice_are_refused(data_dir, tmp_path, capsys):
    import data

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("x = 1\n" * 20)
    for inputs in ([corpus / "a.txt", corpus / "a.txt"], [corpus, corpus / "a.txt"], [corpus, tmp_path / "corpus/"]):
        err = one_line_usage_error(data.main, ["prepare", "--input", *map(str, inputs), "--tokenizer",
                                               str(data_dir / "tokenizer.model"), "--out_dir", str(tmp_path / "o")],
                                   capsys)
        assert "is given twice" in err


def test_a_symlinked_data_directory_is_replaced_where_it_points(data_dir, tmp_path):
    """--overwrite stages beside the symlink's target (a rename cannot cross file systems) and replaces it there."""
    import data

    target, link = tmp_path / "target", tmp_path / "link"
    (tmp_path / "a.txt").write_text("def f():\n    return 1\n" * 40)
    (tmp_path / "b.txt").write_text("def g():\n    return 2\n" * 40)
    prepare = ["prepare", "--tokenizer", str(data_dir / "tokenizer.model"), "--validation_fraction", "0",
               "--input"]
    data.main([*prepare, str(tmp_path / "a.txt"), "--out_dir", str(target)])
    link.symlink_to(target)
    before = (target / "index.json").read_text()
    data.main([*prepare, str(tmp_path / "a.txt"), str(tmp_path / "b.txt"), "--out_dir", str(link), "--overwrite"])
    assert link.is_symlink() and (target / "index.json").read_text() != before
    assert json.loads((link / "index.json").read_text())["num_documents"] == 2


def test_unwritable_or_wrong_kind_outputs_are_one_line(four_checkpoints, data_dir, tmp_path, capsys):
    import data
    import gpu_check

    (tmp_path / "file").write_text("x")
    one_line_usage_error(data.main, ["prepare", "--tokenizer", str(data_dir / "tokenizer.model"), "--out_dir",
                                     str(tmp_path / "file" / "sub")], capsys)
    err = one_line_usage_error(eval_cli.main, [str(four_checkpoints / "model"), "--tasks", "loss", "--data_dir",
                                               str(data_dir), "--eval_tokens", "64", "--out_dir",
                                               str(tmp_path / "file")], capsys)
    assert "--out_dir" in err and "is a file" in err
    assert "is a directory" in one_line_usage_error(gpu_check.main, ["--dry_run", "--out", str(tmp_path)], capsys)


def test_evaluations_never_overwrite_one_another(four_checkpoints, data_dir, tmp_path, capsys):
    """A second evaluation of a model goes to a new directory; an --out_dir holding one is refused; an unwritable
    output is refused before the work, for eval.py, profile_memory.py and gpu_check.py."""
    import shutil

    import gpu_check
    import profile_memory

    model = tmp_path / "run" / "model"
    shutil.copytree(four_checkpoints, tmp_path / "run")
    args = [str(model), "--tasks", "loss", "--data_dir", str(data_dir), "--eval_tokens", "64"]
    eval_cli.main(args)
    eval_cli.main(args)
    assert (tmp_path / "run" / "eval-model" / "eval.json").is_file()
    assert (tmp_path / "run" / "eval-model-2" / "eval.json").is_file()
    assert "=> " in capsys.readouterr().out  # what the table means, in one line
    err = one_line_usage_error(eval_cli.main, [*args, "--out_dir", str(tmp_path / "run" / "eval-model")], capsys)
    assert "holds an earlier evaluation (eval.json): choose another --out_dir" in err
    for main, option in ((profile_memory.main, ["--plot"]), (gpu_check.main, ["--dry_run", "--out"])):
        err = one_line_usage_error(main, [*option, str(tmp_path / "missing" / "x.png")], capsys)
        assert "cannot write in" in err and "choose another path" in err


# Every option that names where an entry point writes: (script, option, whether it names a directory).
OUTPUTS = [("eval.py", "--out_dir", True), ("data.py", "--out_dir", True), ("data.py", "--model_prefix", False),
           ("profile_memory.py", "--plot", False), ("gpu_check.py", "--out", False), ("train.py", "--out_dir", True),
           ("train_npt.py", "--out_dir", True), ("benchmarks/recall_experiment.py", "--out_dir", True),
           ("benchmarks/long_context_experiment.py", "--out_dir", True),
           ("benchmarks/passkey_grid.py", "--out_dir", True), ("benchmarks/nsa_branch_ablation.py", "--json", False)]


def test_the_output_table_names_every_output_option():
    """OUTPUTS (below) walks every option through which an entry point writes: a new one must join it."""
    root = Path(__file__).resolve().parent.parent
    found = set()
    for script in [*root.glob("*.py"), *root.glob("benchmarks/*.py")]:
        for match in re.finditer(r'add_argument\(\s*"(--out_dir|--out|--plot|--json|--model_prefix|--save\w*)"'
                                 r"([^)]*)\)", script.read_text()):
            if "store_true" not in match.group(2):
                found.add((str(script.relative_to(root)), match.group(1)))
    assert found == {(script, option) for script, option, _ in OUTPUTS if script not in ("train.py", "train_npt.py")}


REFUSED_PLACE = (r"holds a (run|training run|model|training checkpoint)|lies inside|is inside|of the training run|"
                 r"not a training run's|is the --init_from model")


def test_no_entry_writes_inside_a_model_a_checkpoint_or_a_run(four_checkpoints, data_dir, tmp_path, capsys):
    """The one rule for outputs (storage/places.py kept_output): every output option of every entry point refuses
    a run directory itself, its model/ and step-N/ (existing or to come) and anything inside a model or a
    checkpoint, with one line naming the option, before any work and without writing there."""
    import shutil

    from storage.places import RUN_NAMES, STARTED_FILES, holds, kept_output
    from training.trainer import FINISHED_NAME

    run = tmp_path / "run"
    shutil.copytree(four_checkpoints, run)
    model, tokenizer = str(run / "model"), str(data_dir / "tokenizer.model")
    arguments = {"eval.py": [model, "--tasks", "loss", "--data_dir", str(data_dir), "--eval_tokens", "64"],
                 "data.py --out_dir": ["prepare", "--tokenizer", tokenizer],
                 "data.py --model_prefix": ["train-tokenizer", "--vocab_size", "64"],
                 "gpu_check.py": ["--dry_run"], "train.py": [*TINY, "--data_dir", str(data_dir)],
                 "train_npt.py": ["--init_from", model, "--data_dir", str(data_dir), "--max_steps", "1"],
                 "benchmarks/nsa_branch_ablation.py": [model]}
    before = sorted(str(p) for p in run.rglob("*"))
    for script, option, directory in OUTPUTS:
        for place in (run, run / "model", run / "step-4", run / "step-9", run / "model" / "x", run / "step-2" / "x",
                      run / "adapter", run / "step-3.tmp"):
            target = place if directory else place / {"--model_prefix": "tok", "--plot": "x.png", "--out": "x.md"}.get(
                option, "x.json")
            argv = [*arguments.get(f"{script} {option}", arguments.get(script, [])), option, str(target)]
            main = runpy.run_path(str(Path(__file__).resolve().parent.parent / script))["main"]
            with pytest.raises((SystemExit, ValueError, FileExistsError)) as refusal:
                main(argv)
            err = capsys.readouterr().err if refusal.type is SystemExit else str(refusal.value)
            assert refusal.type is not SystemExit or refusal.value.code == 2, (script, option, place, err)
            assert re.search(REFUSED_PLACE, err), (script, option, place, err)
    assert sorted(str(p) for p in run.rglob("*")) == before  # nothing written, nothing removed
    project = tmp_path / "project"  # a config.json that is no run's (an editor's) makes nothing of a directory
    project.mkdir()
    (project / "config.json").write_text('{"editor": "x"}')
    assert kept_output(project / "out", directory=True) is None and holds(project) is None
    assert kept_output(run / "eval-model", directory=True) is None  # eval.py's default, beside the run's files
    assert RUN_NAMES.fullmatch(FINISHED_NAME) and all(RUN_NAMES.fullmatch(name) for name in STARTED_FILES)


def test_a_harness_call_where_no_task_ran_is_an_error(four_checkpoints, tmp_path, monkeypatch):
    """Every RULER length too short for its prompts: an error naming the fix, not an empty result and exit 0."""
    from evaluation import harness

    monkeypatch.setattr(harness, "check_harness_tasks", lambda tasks: set(tasks))
    monkeypatch.setattr(harness, "run_harness", lambda *args, **kwargs: {})
    with pytest.raises(ValueError, match="--harness: no task ran at --lengths 16, each too short for its prompt"):
        eval_cli.evaluate(eval_cli.build_parser().parse_args([str(four_checkpoints / "model"), "--harness",
                                                                  "niah_single_1", "--lengths", "16", "--out_dir",
                                                                  str(tmp_path / "e")]))


def test_an_evaluation_where_every_cell_is_skipped_is_an_error(four_checkpoints, tmp_path, capsys):
    """Work that produces nothing is an error: every passkey length too short for its text, before the model loads
    and without an empty eval.json."""
    err = one_line_usage_error(eval_cli.main, [str(four_checkpoints / "model"), "--tasks", "passkey", "--lengths",
                                               "8", "--out_dir", str(tmp_path / "e")], capsys)
    assert "nothing to score: every length of passkey was skipped" in err and not (tmp_path / "e").exists()


def test_offline_ruler_tasks_download_nothing(monkeypatch):
    """lm-eval's RULER module asks nltk for punkt_tab when imported and downloads it when missing: for the offline
    tasks, nltk is told it is there, and nothing is downloaded."""
    nltk = pytest.importorskip("nltk")
    from evaluation.harness import OFFLINE_RULER, no_downloads

    def missing(resource: str, *args: object, **kwargs: object) -> str:
        raise LookupError(resource)

    monkeypatch.setattr(nltk.data, "find", missing)
    monkeypatch.setattr(nltk, "download", lambda *args, **kwargs: pytest.fail("nltk downloaded"))
    with no_downloads(list(OFFLINE_RULER)):
        assert nltk.data.find("tokenizers/punkt_tab") == "tokenizers/punkt_tab"
    with no_downloads(["niah_single_2"]), pytest.raises(LookupError):  # an essay haystack: needs it
        nltk.data.find("tokenizers/punkt_tab")


@pytest.mark.slow  # lm-eval's task index takes seconds to build
def test_harness_refusals_come_before_the_model_is_loaded(four_checkpoints, tmp_path, monkeypatch, capsys):
    """An unknown lm-eval task, a length beyond the context and a missing harness: one line each, exit 2, and the
    model never loaded."""
    import storage.weights
    from evaluation import harness

    pytest.importorskip("lm_eval")

    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(eval_cli, "load_model", no_load)
    monkeypatch.setattr(storage.weights, "load_model", no_load)
    model = str(four_checkpoints / "model")
    err = one_line_usage_error(eval_cli.main, [model, "--harness", "niah_single_1", "no_such_task"], capsys)
    assert "lm-eval has no task no_such_task" in err and "lm_eval ls tasks" in err
    err = one_line_usage_error(eval_cli.main, [model, "--harness", "niah_single_1", "--lengths", "64"], capsys)
    assert "--lengths 64 exceeds the context of 32 tokens" in err
    monkeypatch.setattr(harness, "harness_installed", lambda: False)
    err = one_line_usage_error(eval_cli.main, [model, "--harness", "niah_single_1"], capsys)
    assert "pip install -e '.[eval]'" in err


def test_prepare_deletes_nothing_it_did_not_write(four_checkpoints, data_dir, tmp_path, capsys):
    """prepare writes into a new or empty directory (its tokenizer may be there), never inside a run, model or
    checkpoint, and --overwrite replaces only what the old index lists."""
    import data

    tokenizer = str(data_dir / "tokenizer.model")
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(6):
        (corpus / f"{i}.txt").write_text(f"x = {i}\n" * 40)
    (tmp_path / "results" / "validation").mkdir(parents=True)
    (tmp_path / "results" / "validation" / "results.csv").write_text("a,b\n")
    (corpus / "validation").mkdir()
    (corpus / "validation" / "held.txt").write_text("mine\n")

    def files(root: Path) -> dict[Path, bytes]:
        return {p: p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}

    before = files(tmp_path)
    refusals = [(tmp_path / "results", re.escape("holds files that are not prepared data (validation)")),
                (corpus, re.escape("holds files that are not prepared data (0.txt, 1.txt, 2.txt and 4 more)")),
                (four_checkpoints / "x", "is inside .*, a training run"),
                (four_checkpoints / "model" / "data", "is inside .*model, a model,"),
                (four_checkpoints / "step-2" / "data", "is inside .*step-2, a training checkpoint")]
    for out_dir, message in refusals:
        for extra in ([], ["--overwrite"]):
            err = one_line_usage_error(data.main, ["prepare", "--input", str(corpus), "--tokenizer", tokenizer,
                                                   "--out_dir", str(out_dir), *extra], capsys)
            assert re.search(message, err), err
    assert files(tmp_path) == before
    assert not (four_checkpoints / "x").exists() and not (four_checkpoints / "model" / "data").exists()

    out = tmp_path / "mine"
    out.mkdir()
    (out / "tokenizer.model").write_bytes((data_dir / "tokenizer.model").read_bytes())  # a tokenizer may be there
    (out / "tokenizer_config.json").write_text("{}")  # and a Hugging Face tokenizer's companions
    data.main(["prepare", "--input", str(corpus), "--tokenizer", tokenizer, "--out_dir", str(out)])
    (out / "notes.txt").write_text("keep")
    (out / "validation" / "extra.csv").write_text("keep")
    data.main(["prepare", "--input", str(corpus / "0.txt"), str(corpus / "1.txt"), "--tokenizer", tokenizer,
               "--out_dir", str(out), "--overwrite", "--validation_fraction", "0"])
    assert sorted(p.relative_to(out).as_posix() for p in out.rglob("*")) == [
        "index.json", "notes.txt", "shard_00000.bin", "tokenizer.model", "tokenizer_config.json", "validation",
        "validation/extra.csv"]
    (out / "shard_00001.bin").write_bytes(b"mine")  # a file the next prepare would write, not listed by the index
    kept = files(out)
    err = one_line_usage_error(data.main, ["prepare", "--input", str(corpus), "--tokenizer", tokenizer, "--out_dir",
                                           str(out), "--overwrite", "--shard_tokens", "40"], capsys)
    assert "holds shard_00001.bin, which a prepare did not write" in err and files(out) == kept


def test_a_damaged_shard_is_named_when_a_run_opens_it(data_dir, tmp_path):
    """Shards carry CRC-32s in their index, checked whenever a loader opens them."""
    import shutil

    copy = tmp_path / "data"
    shutil.copytree(data_dir, copy)
    TokenLoader(copy, 16, 1)
    shard = copy / "shard_00000.bin"
    raw = bytearray(shard.read_bytes())
    raw[len(raw) // 2] ^= 1
    shard.write_bytes(bytes(raw))
    with pytest.raises(ValueError, match=f"shard {shard} is damaged: its CRC-32 differs from index.json's; prepare "
                                         "the data again"):
        TokenLoader(copy, 16, 1)
    with pytest.raises(ValueError, match="is damaged"):
        train.main([*TINY, "--data_dir", str(copy), "--out_dir", str(tmp_path / "run")])


def test_a_document_larger_than_the_tokenizer_holds_is_refused_before_any_work(data_dir, tmp_path, capsys):
    """A plain file is one document: one of 300 MiB (sparse zeros, as the strict mode's advice leads to --errors
    replace) is refused in one line naming it, for prepare and train-tokenizer, before any input is tokenized."""
    import data

    big = tmp_path / "zeros.txt"
    with big.open("wb") as f:
        f.truncate(300 * 2**20)
    for argv in (["prepare", "--tokenizer", str(data_dir / "tokenizer.model"), "--out_dir", str(tmp_path / "o")],
                 ["train-tokenizer", "--vocab_size", "64", "--model_prefix", str(tmp_path / "tok")]):
        err = one_line_usage_error(data.main, [*argv, "--input", str(big), "--errors", "replace"], capsys)
        assert f"{big} is 0.3 GiB, one document" in err and "split it into files" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["zeros.txt"]


def test_wide_text_is_refused_in_both_error_modes(data_dir, tmp_path, capsys):
    """UTF-16 (with or without a byte-order mark) is refused with how to convert it, also with --errors replace,
    which would otherwise read NUL-interleaved text; a binary file stays the binary message."""
    import data

    text = "def f():\n    return 1\n" * 20
    (tmp_path / "bom.txt").write_bytes(text.encode("utf-16"))
    (tmp_path / "le.txt").write_bytes(text.encode("utf-16-le"))
    for name in ("bom.txt", "le.txt"):
        for errors in ("strict", "replace"):
            err = one_line_usage_error(data.main, ["prepare", "--input", str(tmp_path / name), "--tokenizer",
                                                   str(data_dir / "tokenizer.model"), "--out_dir",
                                                   str(tmp_path / "o"), "--errors", errors], capsys)
            encoding = "UTF-16" if name == "bom.txt" else "UTF-16LE"
            assert f"looks like {encoding} text" in err and f"iconv -f {encoding} -t UTF-8 {tmp_path / name}" in err
    (tmp_path / "b.txt").write_bytes(bytes(range(256)) * 8)
    err = one_line_usage_error(data.main, ["prepare", "--input", str(tmp_path / "b.txt"), "--tokenizer",
                                           str(data_dir / "tokenizer.model"), "--out_dir", str(tmp_path / "o")], capsys)
    assert "a binary file" in err
    assert not (tmp_path / "o").exists()


def test_a_damaged_export_is_written_again_by_resume(data_dir, tmp_path, capsys):
    """The advice of a damaged export holds: --resume of the finished run exports again."""
    run = tmp_path / "run"
    train.main([*TINY, "--max_steps", "2", "--data_dir", str(data_dir), "--out_dir", str(run)])
    from safetensors.torch import load_file

    weights = run / "model" / "model.safetensors"
    intact = {name: t.clone() for name, t in load_file(weights).items()}  # not views of the file damaged next
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    err = one_line_usage_error(eval_cli.main, [str(run / "model"), "--tasks", "passkey"], capsys)
    assert "--resume the run, which exports again" in err
    train.main(["--resume", "--out_dir", str(run)])
    assert "model.safetensors has" in capsys.readouterr().out
    again = load_file(weights)
    assert again.keys() == intact.keys() and all(torch.equal(again[k], intact[k]) for k in intact)


# ---- numbers and option combinations ----------------------------------------------------------------------------

@pytest.mark.parametrize("args, message", [
    (["--gradient_accumulation_steps", "1000000000"], "tokens a step per process, whose ids and labels are held"),
    (["--model_overrides", '{"context_length": 16}'], "--model_overrides may not set context_length: pass "
                                                      "--context_length"),
    (["--model_overrides", '{"attention_type": "nsa"}'], "--model_overrides may not set attention_type"),
    (["--synthetic_task", "mqar"], "--synthetic_task has no effect without --synthetic_mix R"),
    (["--answer_loss"], "--answer_loss has no effect without --synthetic_mix R"),
    (["--synthetic_pairs", "4", "--synthetic_task", "mqar"], "has no effect without --synthetic_mix R"),
    (["--sample_prompt", "hello"], "--sample_prompt has no effect without --sample_tokens N other than 0"),
    (["--eval_tokens", "64"], "--eval_tokens has no effect without --eval_interval N"),
    (["--offload_activations"], "--offload_activations has no effect without a GPU: it moves what the blocks save"),
    (["--sample_tokens", "", "--sample_prompt", "word " * 40], "--sample_prompt is"),
    (["--config", "configs/nsa-retrieval.json", "--nsa_score_loss_coef", "0"],  # every one a recipe sets, at once
     "--nsa_score_loss_random, --nsa_score_loss_stride, --nsa_score_loss_top have no effect without"),
])
def test_options_that_contradict_or_do_nothing_are_refused(args, message, data_dir, tmp_path, capsys):
    args = [a for a in args if a]  # "" drops --sample_tokens's value: back to its default
    run = [a for a in TINY if a not in ("--sample_tokens", "0")] if "--sample_tokens" in args else TINY
    args = [a for a in args if a != "--sample_tokens"]
    try:  # a usage error while parsing (exit 2, on stderr), or a ValueError when the run starts
        train.main([*run, *args, "--data_dir", str(data_dir), "--out_dir", str(tmp_path / "run")])
    except SystemExit as e:
        assert e.code == 2 and message in capsys.readouterr().err
    except ValueError as e:
        assert message in str(e)
    else:
        raise AssertionError(f"{args} was accepted")
    assert not (tmp_path / "run").exists()


# Every train.py option, and every ModelConfig / ComputeConfig field (--model_overrides), that acts only beside
# another: the arguments that give it where it cannot act. The rest act on their own; both lists together must hold
# every option and field, so that a new one is classified here before it can be taken and silently ignored.
OPTION_CANNOT_ACT = {
    "synthetic_task": ["--synthetic_task", "mqar"],
    "synthetic_pairs": ["--synthetic_pairs", "4"],
    "answer_loss": ["--answer_loss"],
    "sample_prompt": ["--sample_prompt", "x"],
    "eval_tokens": ["--eval_tokens", "64"],
    "offload_activations": ["--offload_activations"],
    "export_dtype": ["--finetune", "lora", "--export_dtype", "float32"],
    "attention_query_chunk": ["--attention_type", "full", "--attention_query_chunk", "64"],
    "resume": ["--resume"],  # into a directory that holds no run
    "nsa_score_loss_coef": ["--attention_type", "full", "--nsa_score_loss_coef", "0.1"],
    "nsa_exact_selection_steps": ["--attention_type", "full", "--nsa_exact_selection_steps", "5"],
    **{name: ["--attention_type", "nsa", f"--{name}", value] for name, value in (
        ("nsa_score_loss_stride", "2"), ("nsa_score_loss_top", "4"), ("nsa_score_loss_target", "selection"),
        ("nsa_score_loss_temperature", "2"))},
    "nsa_score_loss_random": ["--attention_type", "nsa", "--nsa_score_loss_top", "4", "--nsa_score_loss_random", "2"],
    # another fine-tuning mode's options (this run: --finetune full)
    "lora_rank": ["--lora_rank", "4"], "lora_alpha": ["--lora_alpha", "3"], "lora_targets": ["--lora_targets", "q"],
    "quantize_base": ["--quantize_base", "int8"], "merge": ["--merge"], "adapter": ["--adapter", "x"],
    "npt_layers": ["--npt_layers", "all"], "npt_rank": ["--npt_rank", "4"],
    "npt_residual_mode": ["--npt_residual_mode", "additive"], "npt_targets": ["--npt_targets", "gate"],
}
OPTIONS_ACT_ALONE = (
    "attention_type", "batch_size", "checkpoint_interval", "checkpoint_minutes", "compile", "context_length",
    "context_parallel",  # splits each sequence; refused when it does not divide the processes (init_runtime)
    "data_dir", "document_mask", "dtype", "empty_cache_interval", "eval_interval", "ffn_chunk_size", "finetune",
    "grad_clip",
    "gradient_accumulation_steps", "gradient_checkpointing", "heartbeat_seconds", "init_from", "keep_checkpoints",
    "log_interval", "loss", "lr", "max_bad_steps", "max_memory", "max_steps", "model_overrides", "model_size",
    "min_lr_ratio",  # acts in every run longer than its warmup; a given --warmup_steps beyond the run is warned
    "out_dir", "rope_scaling", "rope_theta", "sample_tokens", "seed", "synthetic_mix", "tokenizer", "tracker",
    "verbose", "warmup_steps", "weight_decay", "z_loss_coef")
FIELD_CANNOT_ACT = {  # (--model_overrides, the run's other options)
    **{name: ({name: value}, []) for name, value in (
        ("nsa_block_size", 4), ("nsa_stride", 2), ("nsa_select_block_size", 8), ("nsa_num_selected", 5),
        ("nsa_window", 8), ("nsa_separate_kv", False), ("nsa_compressor", "mean"), ("triton_kernels", False),
        ("attention_options", {"window": 4}), ("attention_query_chunk", 64), ("offload_activations", True))},
    "loss_chunk_size": ({"loss_chunk_size": 16}, ["--loss", "standard"]),
    "loss_chunk_threshold_bytes": ({"loss_chunk_threshold_bytes": 2**20}, ["--loss", "chunked"]),
}
FIELDS_ACT_ALONE = ("dim", "ffn_dim", "head_dim", "init_std", "logit_softcap", "n_heads", "n_kv_heads", "n_layers",
                    "norm_eps", "qk_norm", "tie_embeddings", "vocab_size", "ffn_chunk_size",
                    "loss_mode", "loss_rows")


def test_every_option_that_cannot_act_is_refused(data_dir, tmp_path, capsys):
    """The walk over train.py's options and the model's fields: each that acts only beside another is refused with
    one line naming it where it cannot act; the others are declared to act alone."""
    import dataclasses

    from modeling.config import ComputeConfig
    from training.options import OBJECTIVE_FIELDS, OWN_OPTION, SHARED_FIELD, TrainConfig

    options = {f.name for f in dataclasses.fields(TrainConfig)}
    assert sorted(options) == sorted([*OPTION_CANNOT_ACT, *OPTIONS_ACT_ALONE]), "classify the new option here"
    fields = {f.name for config in (ModelConfig, ComputeConfig) for f in dataclasses.fields(config)}
    assert sorted(fields) == sorted([*FIELD_CANNOT_ACT, *FIELDS_ACT_ALONE, *OWN_OPTION]), "classify the new field"

    def refusal(args: list[str]) -> str:
        try:
            train.main([*TINY, *args, "--data_dir", str(data_dir), "--out_dir", str(tmp_path / "none")])
        except SystemExit as e:  # a usage error while parsing
            assert e.code == 2
            return capsys.readouterr().err
        except (ValueError, FileNotFoundError) as e:  # when the run starts
            return str(e)
        raise AssertionError(f"{args} was accepted")

    for option, args in OPTION_CANNOT_ACT.items():
        message = refusal(args)
        assert f"--{option}" in message and len(message.strip().splitlines()) == 1, (option, message)
    for name, (overrides, args) in FIELD_CANNOT_ACT.items():
        message = refusal([*args, "--model_overrides", json.dumps(overrides)])
        assert f"{name} has no effect without" in message, (name, message)
    for name, option in OWN_OPTION.items():
        assert f"pass {option} instead" in refusal(["--model_overrides", json.dumps({name: 1})])
    for name in OBJECTIVE_FIELDS:  # the objective's terms, once ComputeConfig fields: options of their own
        assert f"pass --{name} instead" in refusal(["--model_overrides", json.dumps({name: 1})])
    for name, option in SHARED_FIELD.items():  # an override and the option that sets the same field
        value = {"loss_mode": "chunked", "loss_rows": "targets", "offload_activations": False}.get(name, 64)
        args = {"loss": ["--loss", "chunked"], "answer_loss": ["--answer_loss", "--synthetic_mix", "0.5"],
                "offload_activations": ["--offload_activations"]}.get(option, [f"--{option}", "64"])
        message = refusal([*args, "--model_overrides", json.dumps({name: value})])
        assert f"--model_overrides sets {name} and --{option} sets it too" in message, message
    assert not (tmp_path / "none").exists()


def test_a_resume_keeps_the_adapters_it_trains(four_checkpoints, data_dir, tmp_path):
    """A resumed LoRA run cannot change its adapters' shapes, nor the adapters it started from (its checkpoint holds
    them: another --adapter would not be read): one line naming the option, the checkpoint intact."""
    run = tmp_path / "lora"
    train.main([*TINY, "--finetune", "lora", "--lora_rank", "4", "--init_from", str(four_checkpoints / "model"),
                "--data_dir", str(data_dir), "--out_dir", str(run)])
    before = {p: p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file()}
    for args in (["--lora_rank", "8"], ["--lora_targets", "q,v"]):
        with pytest.raises(ValueError, match=f"{args[0]} {args[1]}: the run in .* trains with .*, and a resumed run "
                                             "continues its adapters as they are; leave"):
            train.main(["--resume", "--out_dir", str(run), "--max_steps", "2", *args])
    with pytest.raises(ValueError, match="--adapter .*: the run in .* trains with None, and a resumed run continues "
                                         "from its checkpoint's adapters; leave --adapter out"):
        train.main(["--resume", "--out_dir", str(run), "--max_steps", "2", "--adapter", str(data_dir)])
    assert {p: p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file()} == before


def test_a_resume_where_every_weight_trains_keeps_the_weights_it_started_from(four_checkpoints, data_dir, tmp_path):
    """A run that trains every weight resumes its weights from its checkpoint: another --init_from (or one for a run
    started from random weights) is refused in one line, the run intact, unless the recorded one has moved away."""
    import shutil

    run = tmp_path / "run"
    shutil.copytree(four_checkpoints, run)
    before = {p: p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file()}
    with pytest.raises(ValueError, match="--init_from .*: the run in .* started from a random initialisation, and a "
                                         "resumed run continues from its checkpoint's weights; leave --init_from out"):
        train.main(["--resume", "--out_dir", str(run), "--max_steps", "5", "--init_from",
                    str(four_checkpoints / "model")])
    assert {p: p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file()} == before
    base, tuned = tmp_path / "base", tmp_path / "tuned"
    shutil.copytree(four_checkpoints / "model", base)
    train.main([*TINY, "--init_from", str(base), "--max_steps", "1", "--checkpoint_interval", "1", "--data_dir",
                str(data_dir), "--out_dir", str(tuned)])
    with pytest.raises(ValueError, match=f"--init_from .*: the run in .* started from {base}, and a resumed run"):
        train.main(["--resume", "--out_dir", str(tuned), "--max_steps", "2", "--init_from",
                    str(four_checkpoints / "model")])
    base.rename(tmp_path / "moved")  # the recorded base is gone: its new path is taken
    assert train.main(["--resume", "--out_dir", str(tuned), "--max_steps", "2", "--init_from",
                       str(tmp_path / "moved")])["step"] == 2


def test_data_and_eval_options_that_cannot_act_are_refused(four_checkpoints, data_dir, tmp_path, capsys):
    import data

    (tmp_path / "a.txt").write_text("def f():\n    return 1\n" * 20)
    err = one_line_usage_error(data.main, ["prepare", "--input", str(tmp_path / "a.txt"), "--tokenizer",
                                           str(data_dir / "tokenizer.model"), "--out_dir", str(tmp_path / "o"),
                                           "--text_field", "body"], capsys)
    assert "--text_field body has no effect: it names the text field of .jsonl and .parquet records" in err
    err = one_line_usage_error(eval_cli.main, [str(four_checkpoints / "model"), "--tasks", "loss", "--lengths",
                                                 "16"], capsys)
    assert "--lengths is read only by the task(s) passkey, needle, mqar, mqar_text, --harness" in err
    recall = runpy.run_path(str(Path(__file__).resolve().parent.parent / "benchmarks" / "recall_experiment.py"))
    assert "--seeds must lie in [0, " in one_line_usage_error(recall["main"], ["--seeds", "0", "-1"], capsys)


def test_options_that_depend_on_the_data_are_checked_against_it(four_checkpoints, data_dir, tmp_path, capsys):
    """--document_mask keeps documents apart: on training data of one document (train.py) or on validation windows
    that hold no document's end (eval.py's loss task) it would do nothing, so it is refused with one line."""
    import data

    (tmp_path / "one.txt").write_text("def f():\n    return 1\n" * 400)
    tokenizer = str(data_dir / "tokenizer.model")
    data.main(["prepare", "--input", str(tmp_path / "one.txt"), "--tokenizer", tokenizer, "--out_dir",
               str(tmp_path / "one"), "--validation_fraction", "0"])
    with pytest.raises(ValueError, match="--document_mask: .* holds 1 document, so no row holds the end of one"):
        train.main([*TINY, "--data_dir", str(tmp_path / "one"), "--out_dir", str(tmp_path / "run"), "--document_mask"])
    assert not (tmp_path / "run").exists()
    err = one_line_usage_error(eval_cli.main, [str(four_checkpoints / "model"), "--tasks", "loss", "--data_dir",
                                               str(data_dir), "--eval_tokens", "64", "--context_length", "8",
                                               "--document_mask"], capsys)
    assert "--document_mask: no window of" in err and "holds the end of a document" in err


EVAL_ACT_ALONE = ("help", "checkpoint", "tasks", "harness", "tokenizer", "context_length", "device", "out_dir",
                  "plugin")
DATA_ACT_ALONE = ("help", "input", "tokenizer", "out_dir", "shard_tokens", "overwrite", "validation_fraction",
                  "vocab_size", "model_prefix", "max_train_mb")
PROFILER_ACT_ALONE = ("help", "world_size", "gpu_memory", "json", "plot")


def test_every_option_of_the_other_entries_that_cannot_act_is_refused(four_checkpoints, data_dir, tmp_path, capsys):
    """The same walk over eval.py (the options only some tasks read: each given where none of them runs), data.py
    and profile_memory.py's own options: each classified, each that cannot act refused with one line naming it."""
    import data
    import profile_memory

    def dests(parser) -> set[str]:
        return {action.dest for action in parser._actions if action.dest != "command"}

    values = {"documents": "x.jsonl", "pairs": "4", "depths": "0.5", "data_dir": str(data_dir), "eval_tokens": "64",
              "lengths": "64", "samples": "2", "batch_size": "2", "seed": "1", "document_mask": None,  # None: a flag
              "after_text": "100"}
    assert dests(eval_cli.build_parser()) == {*eval_cli.readers(), "data_dir", *EVAL_ACT_ALONE}, "classify it"
    documents = str(tmp_path / "docs.jsonl")
    (tmp_path / "docs.jsonl").write_text('{"text": "def f(): pass"}\n')
    for name in eval_cli.readers():
        tasks = ["--tasks", "loss"] if name == "documents" else ["--tasks", "documents", "--documents", documents]
        option = [f"--{name}"] + ([values[name]] if values[name] is not None else [])
        err = one_line_usage_error(eval_cli.main, [str(four_checkpoints / "model"), *tasks, *option], capsys)
        assert f"--{name} is read only by the task(s)" in err, err
    err = one_line_usage_error(eval_cli.main, [str(four_checkpoints / "model"), "--tasks", "documents",
                                                 "--documents", documents, "--data_dir", str(data_dir)], capsys)
    assert "--data_dir is read only by the task(s) loss, mqar, mqar_text (and for its tokenizer.model when" in err

    commands = data.build_parser()._subparsers._group_actions[0].choices
    assert set().union(*(dests(c) for c in commands.values())) == {"text_field", "errors", *DATA_ACT_ALONE}
    (tmp_path / "a.txt").write_text("def f():\n    return 1\n" * 20)
    for option in (["--text_field", "body"], ["--errors", "replace"]):
        inputs = str(tmp_path / "a.txt")
        if option[0] == "--errors":
            pq = pytest.importorskip("pyarrow.parquet")
            pq.write_table(__import__("pyarrow").table({"text": ["def f(): pass"] * 4}), tmp_path / "a.parquet")
            inputs = str(tmp_path / "a.parquet")
        err = one_line_usage_error(data.main, ["prepare", "--input", inputs, "--tokenizer",
                                               str(data_dir / "tokenizer.model"), "--out_dir", str(tmp_path / "o"),
                                               *option], capsys)
        assert f"{option[0]}" in err and "has no effect" in err, err

    own = dests(profile_memory.build_parser()) - dests(train_config.build_parser())
    assert own == {"reserve", "measure", *PROFILER_ACT_ALONE} - {"help"}, "classify it here"
    assert "--reserve is what --gpu_memory keeps free" in one_line_usage_error(profile_memory.main, [
        "--reserve", "1"], capsys)
    if not torch.cuda.is_available():
        assert "--measure needs a CUDA device" in one_line_usage_error(profile_memory.main, ["--measure"], capsys)


def test_an_abbreviated_option_is_unknown(capsys):
    err = one_line_usage_error(train_config.parse_config, ["--verb"], capsys)
    assert "unrecognized arguments: --verb" in err


def test_a_lora_rank_beyond_a_layer_is_refused(four_checkpoints, data_dir, tmp_path):
    with pytest.raises(ValueError, match=r"--lora_rank 100 exceeds the smaller side of layers.0.attn.q_proj "
                                         r"\(64 -> 64\)"):
        train.main([*TINY[2:], "--finetune", "lora", "--lora_rank", "100", "--init_from",
                    str(four_checkpoints / "model"), "--data_dir", str(data_dir), "--out_dir", str(tmp_path / "r")])


@pytest.mark.parametrize("args, message", [
    (["--mse_weight", "inf"], "--mse_weight must be a finite number >= 0"),
    (["--kl_weight", "nan"], "--kl_weight must be a finite number >= 0"),
    (["--mse_weight", "0", "--kl_weight", "0", "--l2_weight", "0"], "all 0: the objective has no term"),
    (["--z_loss_coef", "0.5"], "--z_loss_coef has no effect here: equivalence training minimises the equivalence"),
    (["--sample_tokens", "20"], "--sample_tokens has no effect here"),
    (["--loss", "chunked"], "--loss has no effect here"),
    *([] if torch.cuda.is_available() else [(["--offload"], "--offload has no effect without a GPU")]),
])
def test_equivalence_options_are_checked(args, message, capsys):
    from train_npt import parse_config

    assert message in one_line_usage_error(parse_config, ["--config", "configs/npt_tiny.json", *args], capsys)


def test_data_py_options_are_checked_before_any_input_is_read(data_dir, tmp_path, capsys):
    import data

    tok = ["train-tokenizer", "--input", str(tmp_path / "nowhere"), "--vocab_size", "300"]
    (tmp_path / "old.model").write_text("x")
    for args, message in ((["--model_prefix", str(tmp_path / "t.model")], "a file name without .model"),
                          (["--model_prefix", f"{tmp_path}/"], "a file name without .model"),
                          (["--model_prefix", str(tmp_path / "old")], "old.model exists"),
                          (["--model_prefix", str(tmp_path / "t"), "--max_train_mb", "inf"], "--max_train_mb must"),
                          (["--model_prefix", str(tmp_path / "t"), "--max_train_mb", "0"], "--max_train_mb must")):
        assert message in one_line_usage_error(data.main, [*tok, *args], capsys)
    err = one_line_usage_error(data.main, [*tok[:-1], "0", "--model_prefix", str(tmp_path / "t")], capsys)
    assert "--vocab_size must be at least 2" in err
    prep = ["prepare", "--tokenizer", str(data_dir / "tokenizer.model"), "--out_dir", str(tmp_path / "o")]
    (tmp_path / "a.txt").write_text("x = 1\n" * 50)
    for args, message in ((["--validation_fraction", "0.7"], "--validation_fraction must be 0"),
                          (["--shard_tokens", str(10**14)], "--shard_tokens must be in [1,")):
        assert message in one_line_usage_error(data.main, [*prep, "--input", str(tmp_path / "a.txt"), *args],
                                               capsys)


# ---- empty and damaged inputs ------------------------------------------------------------------------------------

def test_empty_inputs_are_refused(four_checkpoints, data_dir, tmp_path, capsys):
    import data

    (tmp_path / "empty.model").write_bytes(b"")
    (tmp_path / "blank.txt").write_text("  \n\t\n")
    (tmp_path / "empty.jsonl").write_text('{"text": ""}\n')
    with pytest.raises(ValueError, match="empty.model is not a SentencePiece model"):
        train.main([*TINY, "--data_dir", str(data_dir), "--tokenizer", str(tmp_path / "empty.model"),
                    "--out_dir", str(tmp_path / "r")])
    err = one_line_usage_error(data.main, ["prepare", "--input", str(tmp_path / "blank.txt"), "--tokenizer",
                                           str(data_dir / "tokenizer.model"), "--out_dir", str(tmp_path / "o"),
                                           "--validation_fraction", "0"], capsys)
    assert "no non-empty document" in err and not (tmp_path / "o").exists()
    err = one_line_usage_error(eval_cli.main, [str(four_checkpoints / "model"), "--tasks", "documents",
                                                 "--documents", str(tmp_path / "empty.jsonl")], capsys)
    assert "holds no non-empty document" in err


def test_eval_checks_the_tokenizer_against_the_model_and_the_data(four_checkpoints, data_dir, qwen3, tmp_path,
                                                                  capsys):
    model = str(four_checkpoints / "model")
    other = str(qwen3[0] / "tokenizer.json")
    err = one_line_usage_error(eval_cli.main, [model, "--tasks", "passkey", "--tokenizer", other], capsys)
    assert "the tokenizer stored with the model: leave --tokenizer out" in err
    err = one_line_usage_error(eval_cli.main, [model, "--tasks", "loss", "--data_dir", str(qwen3[1])], capsys)
    assert "data was tokenized with" in err


def test_a_missing_validation_split_names_the_fix(data_dir, tmp_path):
    import shutil

    from text.shards import validation_dir

    copy = tmp_path / "data"
    shutil.copytree(data_dir, copy)
    shutil.rmtree(copy / "validation")
    with pytest.raises(FileNotFoundError, match=r"validation split .* is missing \(its index lists one\): prepare "
                                                r".* again \(`python data.py prepare --out_dir .* --overwrite`\)"):
        validation_dir(copy)


# ---- the other entry points, and the environment -------------------------------------------------------------------

def test_inspection_and_verification_errors_are_one_line(four_checkpoints, tmp_path, capsys):
    import inspect_nsa as inspection
    import verify_chunked_loss

    assert "unrecognized arguments: --foo" in one_line_usage_error(verify_chunked_loss.main, ["--foo"], capsys)
    err = one_line_usage_error(inspection.main, [str(four_checkpoints / "model"), "--text", "@" + str(tmp_path / "x")],
                               capsys)
    assert "no file" in err
    adapters = tmp_path / "adapter"  # a LoRA run's OUT_DIR/adapter: what it is and what to pass instead
    adapters.mkdir()
    (adapters / "adapter_config.json").write_text("{}")
    for main, extra in ((inspection.main, ["--text", "x"]), (eval_cli.main, [])):
        err = one_line_usage_error(main, [str(adapters), *extra], capsys)
        assert "holds adapters, not a model: evaluate the model they adapt merged with them" in err


def test_find_text_absent_from_the_prompt_is_refused(tmp_path, data_dir, capsys):
    import inspect_nsa as inspection

    train.main([*TINY, "--attention_type", "nsa", "--data_dir", str(data_dir), "--out_dir", str(tmp_path / "nsa")])
    err = one_line_usage_error(inspection.main, [str(tmp_path / "nsa" / "model"), "--text", "def f(): return 1",
                                                 "--find", "99999"], capsys)
    assert "--find '99999': not in the prompt's tokens" in err


def test_a_stray_rank_is_one_line(data_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(ValueError, match="RANK=1 with WORLD_SIZE=1: launch under torchrun, or unset RANK"):
        train.main([*TINY, "--data_dir", str(data_dir), "--out_dir", str(tmp_path / "r")])


def test_each_file_of_init_from_and_of_an_evaluated_model_is_checked_once(four_checkpoints, data_dir, tmp_path,
                                                                          monkeypatch):
    """--init_from (a frozen base: its files checked, fingerprinted and loaded) and eval.py's checkpoint (checked,
    then loaded) read each file's checksums once."""
    import storage.manifest
    import storage.weights

    model, read = four_checkpoints / "model", []
    real = storage.manifest.file_records

    def counted(paths: list[Path]) -> dict:
        read.extend(p.name for p in paths if p.parent == model)
        return real(paths)

    monkeypatch.setattr(storage.manifest, "file_records", counted)
    monkeypatch.setattr(storage.weights, "file_records", counted)
    train.main([*TINY, "--finetune", "lora", "--init_from", str(model), "--data_dir", str(data_dir), "--out_dir",
                str(tmp_path / "lora")])
    files = sorted(json.loads((model / "manifest.json").read_text())["files"])
    assert sorted(read) == files, read
    read.clear()
    (tmp_path / "doc.txt").write_text("def f():\n    return 1\n")
    eval_cli.main([str(model), "--tasks", "documents", "--documents", str(tmp_path / "doc.txt"), "--out_dir",
                   str(tmp_path / "eval")])
    assert sorted(read) == files, read


def test_a_one_process_mode_names_where_the_processes_come_from(capsys):
    """profile_memory.py estimates a launch it does not make: a one-process mode asked for two names --world_size
    beside torchrun, not torchrun alone."""
    import profile_memory

    for mode in (["--finetune", "npt"], ["--finetune", "lora", "--quantize_base", "int8"]):
        err = one_line_usage_error(profile_memory.main, [*mode, "--world_size", "2"], capsys)
        assert "runs in one process, and this run has 2 (torchrun's processes, or profile_memory.py's --world_size)" \
            in err, err
