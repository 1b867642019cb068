"""synthetic.py: retrieval documents of exact length that carry their answer, and SyntheticMix: deterministic,
at the asked rate, and resumable bit for bit from the loader's state; train.py trains on the mix."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

import train
from data import TokenLoader
from synthetic import PromptBuilder, SyntheticMix, training_document
from tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tokenizer(data_dir: Path) -> Tokenizer:
    return Tokenizer(data_dir / "tokenizer.model")


def test_documents_have_the_length_and_their_answer(tokenizer):
    builder = PromptBuilder(tokenizer)
    for seed in range(6):
        ids = training_document(builder, 400, random.Random(seed))
        assert len(ids) == 400
        text = tokenizer.decode(ids)
        question, _, after = text.rpartition(" is")  # "... The pass key is 12345." / "... key redfox is 123456."
        answer = after.split(".")[0].strip()
        assert answer.isdigit() and answer in question  # the answer was hidden earlier in the document


def _batches(mix: SyntheticMix, n: int) -> list[torch.Tensor]:
    return [next(mix)[0] for _ in range(n)]


def test_mix_is_deterministic_at_its_rate_and_resumable(data_dir, tokenizer):
    base = _batches(SyntheticMix(TokenLoader(data_dir, 400, 4, seed=1), tokenizer, 0.0, seed=1), 6)
    plain = [next(TokenLoader(data_dir, 400, 4, seed=1))[0]]
    assert torch.equal(base[0], plain[0])  # rate 0: the loader's own batches
    mixed = _batches(SyntheticMix(TokenLoader(data_dir, 400, 4, seed=1), tokenizer, 0.5, seed=1), 6)
    again = _batches(SyntheticMix(TokenLoader(data_dir, 400, 4, seed=1), tokenizer, 0.5, seed=1), 6)
    assert all(torch.equal(a, b) for a, b in zip(mixed, again, strict=True))
    replaced = sum((m != b).any(-1).sum().item() for m, b in zip(mixed, base, strict=True))
    assert 6 <= replaced <= 18  # 24 rows at rate 0.5
    first = SyntheticMix(TokenLoader(data_dir, 400, 4, seed=1), tokenizer, 0.5, seed=1)
    _batches(first, 3)
    resumed = SyntheticMix(TokenLoader(data_dir, 400, 4, seed=1), tokenizer, 0.5, seed=1)
    resumed.load_state_dict(first.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(_batches(resumed, 3), mixed[3:], strict=True))
    with pytest.raises(ValueError, match="cannot hold the task's text"):
        SyntheticMix(TokenLoader(data_dir, 32, 4), tokenizer, 0.5)


def test_train_runs_on_the_mix(data_dir, tmp_path):
    metrics = train.main(["--model_size", "tiny", "--context_length", "400", "--batch_size", "2", "--max_steps", "2",
                          "--synthetic_mix", "0.5", "--sample_tokens", "0", "--data_dir", str(data_dir), "--out_dir",
                          str(tmp_path)])
    assert metrics["step"] == 2
