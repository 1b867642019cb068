"""Bad inputs are refused with a message naming the argument, before anything large is built: train.py options
(a usage error, exit 2), ModelConfig values reaching the model (a ValueError), eval.py options, generation
arguments and load_model arguments. Nothing here is taken silently or clipped."""

from __future__ import annotations

import pytest
import torch

import eval as evaluation
import train
import train_config
from config import ModelConfig
from model import Transformer
from weights import load_model


@pytest.mark.parametrize("args, message", [
    (["--lr", "inf"], "--lr must be a finite number > 0 and <= 1, got inf"),
    (["--lr", "1e30"], "--lr must be a finite number > 0 and <= 1"),
    (["--lr", "nan"], "--lr must be a finite number"),
    (["--weight_decay", "-0.1"], "--weight_decay must be a finite number >= 0"),
    (["--seed", "-1"], "--seed must be >= 0"),
    (["--seed", str(2**70)], "--seed must be <= 9223372036854775807"),
    (["--lora_rank", "8"], "--lora_rank is not an option of --finetune full: pass --finetune lora"),
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
    from weights import export_model

    export_model(Transformer(ModelConfig.from_preset("tiny")), tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        evaluation.main([str(tmp_path / "model"), "--data_dir", str(data_dir), *args])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and message in err and "Traceback" not in err
