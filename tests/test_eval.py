"""eval.py: the scorer on known answers, prompts of exact length with the needle at the asked depth, loss by position
against a plain full-logits computation, and the command end to end on runs of every attention type (the test-only
sliding-window type included) in all three checkpoint layouts."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import eval as evaluation
import train
from model import ModelConfig, Transformer
from tokenizer import Tokenizer


def test_scorer_reads_the_first_number():
    assert evaluation.is_correct(" 48213. Remember", "48213")
    assert evaluation.is_correct("48213", "48213")
    assert not evaluation.is_correct(" 4821", "48213")  # a prefix is wrong
    assert not evaluation.is_correct(" 482130", "48213")  # so is a longer number
    assert not evaluation.is_correct(" 11 and 48213", "48213")  # only the first number counts
    assert not evaluation.is_correct(" the pass key", "48213")


@pytest.fixture(scope="module")
def builder(data_dir: Path) -> evaluation.PromptBuilder:
    return evaluation.PromptBuilder(Tokenizer(data_dir / "tokenizer.model"))


@pytest.mark.parametrize("task", ["passkey", "needle"])
def test_prompts_have_the_exact_length_and_the_needle_at_its_depth(builder, task):
    make = builder.passkey if task == "passkey" else builder.needle
    for depth in (0.0, 0.5, 1.0):
        a, b = make(300, depth, random.Random(1)), make(300, depth, random.Random(1))
        assert a == b and len(a.ids) == 300  # deterministic from the seed
        text_after = builder.tokenizer.decode(a.ids[a.needle_start:])
        assert a.answer in text_after.split("?")[0]  # the queried needle starts at needle_start
        assert a.answer not in builder.tokenizer.decode(a.ids[:a.needle_start])
    early, middle, late = (make(300, depth, random.Random(2)) for depth in (0.0, 0.5, 1.0))
    assert early.needle_start < 100 < middle.needle_start < 200 < late.needle_start  # filler before and after
    with pytest.raises(ValueError, match="cannot hold the task's text"):
        make(20, 0.5, random.Random(0))


def test_loss_by_position_matches_full_logits():
    model = Transformer(ModelConfig.from_preset("tiny")).to(torch.float64).eval()
    windows = torch.randint(0, 512, (3, 700))  # more positions than one LOSS_CHUNK
    result = evaluation.loss_by_position(model, windows, batch_size=2)
    with torch.no_grad():
        logits = model(windows).logits  # (3, 700, V)
    want = F.cross_entropy(logits[:, :-1].flatten(0, 1), windows[:, 1:].flatten(), reduction="none").view(3, -1)
    torch.testing.assert_close(torch.tensor(result["positions"], dtype=torch.float64), want.mean(0),
                               rtol=1e-10, atol=1e-10)
    assert [(b["start"], b["end"]) for b in result["buckets"]][:3] == [(0, 1), (1, 3), (3, 7)]
    assert result["buckets"][-1]["end"] == 699 and result["tokens"] == 3 * 699


@pytest.mark.parametrize("attention", ["full", "nsa", "swa"])
def test_eval_runs_on_every_attention_type(attention, swa, data_dir, tmp_path):
    train.main(["--model_size", "tiny", "--attention_type", attention, "--context_length", "512", "--batch_size", "2",
                "--max_steps", "1", "--sample_tokens", "0", "--data_dir", str(data_dir), "--out_dir", str(tmp_path)])
    layouts = [tmp_path / "model", tmp_path / "step-1"] + ([tmp_path / "hf"] if attention == "full" else [])
    for checkpoint in layouts:
        out = tmp_path / f"eval-{checkpoint.name}"
        args = [str(checkpoint), "--lengths", "320", "496", "--depths", "0", "1", "--samples", "3", "--batch_size",
                "2", "--eval_tokens", "1100", "--out_dir", str(out)]
        if checkpoint.name == "hf":
            args += ["--data_dir", str(data_dir)]
        results = evaluation.main(args)
        assert results == json.loads((out / "eval.json").read_text())
        assert results["attention_type"] == attention and results["loss"]["tokens"] == 2 * 511
        for task in ("passkey", "needle"):
            grid = results[task]
            assert len(grid["accuracy"]) == 2 and all(0 <= a <= 1 for row in grid["accuracy"] for a in row)
            assert (out / f"{task}.png").read_bytes()[:4] == b"\x89PNG"
        assert (out / "loss_by_position.png").is_file()
