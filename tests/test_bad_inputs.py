"""Bad inputs are refused with a message naming the argument, before anything large is built: train.py options
(a usage error, exit 2), ModelConfig values reaching the model (a ValueError), eval.py options, generation
arguments and load_model arguments. Nothing here is taken silently or clipped, and nothing that exists (prepared
data, a model, another run) is deleted or rewritten before the new thing is known to be good."""

from __future__ import annotations

import json

import pytest
import torch

import eval as evaluation
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
    """A fine-tuning mode's options belong to it: given to another mode they are one line (checked when the run
    starts, so that parsing options imports no model code), and the run directory is not created."""
    for args, message in ((["--lora_rank", "8"], "--lora_rank is not an option of --finetune full: pass --finetune "
                                                 "lora"),
                          (["--finetune", "npt", "--lora_alpha", "4"], "--lora_alpha is not an option of --finetune "
                                                                       "npt"),
                          (["--npt_rank", "4"], "--npt_rank is not an option of --finetune full")):
        with pytest.raises(ValueError, match=message):
            train.main(["--model_size", "tiny", "--data_dir", str(data_dir), "--out_dir", str(tmp_path / "run"),
                        *args])
        assert not (tmp_path / "run").exists()


def test_the_overrides_of_a_run_are_checked_before_its_model_is_built(data_dir, tmp_path):
    with pytest.raises(ValueError, match="ModelConfig.tie_embeddings must be true or false"):
        train.main(["--model_size", "tiny", "--data_dir", str(data_dir), "--out_dir", str(tmp_path),
                    "--model_overrides", '{"tie_embeddings": "no"}'])
    assert not (tmp_path / "config.json").exists()
    with pytest.raises(FileNotFoundError, match="--resume /no/such/step-3: no such checkpoint directory"):
        train.main(["--model_size", "tiny", "--data_dir", str(data_dir), "--out_dir", str(tmp_path / "b"),
                    "--resume", "/no/such/step-3"])


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
    (["--context_length", "0"], "--context_length must be >= 1"),
    (["--context_length", "100000"], "exceeds the model's context_length"),
    (["--device", "cuda"], "no CUDA device"),
])
def test_eval_options_are_one_line_errors(args, message, data_dir, tmp_path, capsys):
    if args[0] == "--device" and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    from storage.weights import export_model

    export_model(Transformer(ModelConfig.from_preset("tiny")), tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        evaluation.main([str(tmp_path / "model"), "--data_dir", str(data_dir), *args])
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
    err = one_line_usage_error(evaluation.main, ["run", "--tasks", "loss"], capsys)
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
    data.main(["prepare", "--input", str(corpus), "--tokenizer", str(data_dir / "tokenizer.model"), "--out_dir",
               str(tmp_path / "o"), "--validation_fraction", "0"])
    err = capsys.readouterr().err
    assert f"{corpus}: skipped 4 files of other formats (2 .json, 1 .csv, 1 no suffix)" in err
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
