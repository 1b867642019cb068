"""synthetic.py: retrieval documents of exact length that carry their answer (passkey, and MQAR in both forms: each
answer at its recorded distance from its key, deterministic from the seed), and SyntheticMix: deterministic, at the
asked rate, resumable bit for bit from the loader's state, checked against its longest documents, with a loss mask
that gives exactly the hand-computed answer-only loss; train.py trains on the mix."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import train
from model import Transformer
from modeling.config import ComputeConfig, ModelConfig
from text.shards import TokenLoader
from text.synthetic import (
    KEY_WORDS,
    PromptBuilder,
    RecallVocabulary,
    SyntheticDocuments,
    SyntheticMix,
    copy_document,
    mqar_document,
    mqar_text_document,
    passkey_document,
)
from text.tokenizer import Tokenizer
from training import options as train_config


@pytest.fixture(scope="module")
def tokenizer(data_dir: Path) -> Tokenizer:
    return Tokenizer(data_dir / "tokenizer.model")


def test_documents_have_the_length_and_their_answer(tokenizer):
    builder = PromptBuilder(tokenizer)
    for seed in range(6):
        doc = passkey_document(builder, 400, random.Random(seed))
        assert len(doc.ids) == 400
        text = tokenizer.decode(doc.ids[:doc.answers[-1] + 1])  # through the answer (filler follows it)
        answer = tokenizer.decode([doc.ids[a] for a in doc.answers]).strip()  # the number and its full stop
        assert answer.endswith(".") and answer[:-1].isdigit()
        assert doc.answers == list(range(doc.answers[0], doc.answers[-1] + 1))
        question, _, after = text.rpartition(" is")  # "... The pass key is 12345." / "... key redfox is 123456."
        answer = after.split(".")[0].strip()
        assert answer.isdigit() and answer in question  # the answer was hidden earlier in the document
    # the answer's position varies (a stop learned from a fixed position would not carry over to other lengths)
    assert len({passkey_document(builder, 400, random.Random(seed)).answers[0] for seed in range(20)}) > 10


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
    with pytest.raises(ValueError, match="--context_length 32 is too short for synthetic passkey documents"):
        SyntheticMix(TokenLoader(data_dir, 32, 4), tokenizer, 0.5)


@pytest.mark.parametrize("T", [64, 512, 2048])
def test_mqar_answers_sit_at_their_distance_and_cover_every_scale(T):
    vocab = RecallVocabulary(8192)
    doc = mqar_document(T, vocab, random.Random(T))
    assert len(doc.ids) == T and doc.answers and len(doc.answers) == len(doc.distances)
    for position, distance in zip(doc.answers, doc.distances, strict=True):
        key, value = doc.ids[position - 1], doc.ids[position]
        assert key in vocab.keys and value in vocab.values
        assert doc.ids[position - 1 - distance:position + 1 - distance] == [key, value]  # the pair, `distance` back
        assert doc.ids[:position - 1].count(key) == 1  # asked once, after its only pair
    if T == 2048:  # log-uniform distances: every octave from 2 to 1024 holds answers
        octaves = {d.bit_length() for d in doc.distances}
        assert set(range(2, 11)) <= octaves
        assert 250 <= len(doc.answers) <= 2048 // 6  # a third of the slots hold pairs, each asked once
    assert mqar_document(T, vocab, random.Random(T)) == doc  # deterministic
    assert mqar_document(T, vocab, random.Random(T + 1)) != doc


def test_pairs_sets_the_keys_a_query_tells_apart(tokenizer):
    """`pairs`: that many keys, each queried once, at any length (a layout as dense as a pair in every other slot
    leaves out the pairs it finds no room for); too many for the length, a pair count on passkey, or none at all
    are one-line errors naming the fix."""
    vocab = RecallVocabulary(8192)
    dense = mqar_document(64, vocab, random.Random(0), 16)
    assert 10 <= len(dense.answers) <= 16
    for T, pairs in ((64, 2), (64, 8), (512, 8), (2048, 8)):
        doc = mqar_document(T, vocab, random.Random(T), pairs)
        keys = [doc.ids[a - 1] for a in doc.answers]
        assert len(doc.ids) == T and len(set(keys)) == len(keys) == pairs
        assert sum(token in vocab.keys for token in doc.ids) == 2 * pairs  # each key: its pair and its query
        assert max(doc.distances) > T // 8  # the few pairs still spread over the context
    text = mqar_text_document(PromptBuilder(tokenizer), 1024, random.Random(0), 3)
    assert len(set(text.queries)) == 3
    with pytest.raises(ValueError, match="17 key-value pairs do not fit 64 tokens: at most 16"):
        mqar_document(64, vocab, random.Random(0), 17)
    SyntheticMix(TokenLoader(Path(tokenizer.path).parent, 64, 2), tokenizer, 1.0, task="mqar", pairs=16)
    with pytest.raises(ValueError, match="--context_length 64 is too short .* fewer --synthetic_pairs"):
        SyntheticMix(TokenLoader(Path(tokenizer.path).parent, 64, 2), tokenizer, 1.0, task="mqar", pairs=17)
    with pytest.raises(ValueError, match="200 key-value pairs need 200 distinct keys; this form has 144"):
        mqar_text_document(PromptBuilder(tokenizer), 8192, random.Random(0), 200)
    for task, pairs, message in (("passkey", 4, "not passkey"), ("mqar", 0, "must be positive")):
        with pytest.raises(ValueError, match=message):
            SyntheticDocuments(task, tokenizer, pairs)
    for options, message in (({"synthetic_pairs": 0}, "--synthetic_pairs must be >= 1"),
                             ({"synthetic_pairs": 4}, "--synthetic_pairs applies to --synthetic_task mqar")):
        with pytest.raises(ValueError, match=message):
            train_config.TrainConfig(synthetic_task="passkey", **options)


@pytest.mark.parametrize("T", [4, 65, 256])
def test_copy_answers_repeat_an_earlier_sequence_at_varying_distances(T, tokenizer):
    """copy: T tokens; every answer equals the token its distance back, the answers are one run of consecutive
    positions (the second copy from its second token), the distances vary from document to document (so a fixed
    offset cannot predict them); deterministic; fewer than 4 tokens is an error."""
    vocab = RecallVocabulary(8192)
    docs = [copy_document(T, vocab, random.Random(seed)) for seed in range(20)]
    for doc in docs:
        assert len(doc.ids) == T and doc.answers and len(set(doc.distances)) == 1
        assert doc.answers == list(range(doc.answers[0], doc.answers[-1] + 1))
        assert all(doc.ids[a] == doc.ids[a - d] for a, d in zip(doc.answers, doc.distances, strict=True))
        assert T // 4 - 1 <= len(doc.answers) <= T // 2 - 1
    if T > 4:
        assert len({doc.distances[0] for doc in docs}) > 5
    assert copy_document(T, vocab, random.Random(0)) == docs[0]
    documents = SyntheticDocuments("copy", tokenizer)
    documents.check_length(4)
    with pytest.raises(ValueError, match="3 is too short for synthetic copy documents"):
        documents.check_length(3)
    with pytest.raises(ValueError, match="not copy"):
        SyntheticDocuments("copy", tokenizer, 4)


def test_mqar_text_answers_are_the_values_of_earlier_statements(tokenizer):
    doc = mqar_text_document(PromptBuilder(tokenizer), 1024, random.Random(3))
    assert len(doc.ids) == 1024 and doc.answers
    by_query: dict[int, list[int]] = {}
    for position, query in zip(doc.answers, doc.queries, strict=True):
        by_query.setdefault(query, []).append(position)
    for positions in by_query.values():
        value = tokenizer.decode([doc.ids[p] for p in positions]).strip()
        before = tokenizer.decode(doc.ids[:positions[0]])
        key = before.rsplit("What is the value of key ", 1)[1].rstrip("?")
        assert key in KEY_WORDS and value.isdigit() and f"The value of key {key} is {value}." in before


def test_answer_loss_equals_the_hand_masked_loss(data_dir, tokenizer):
    """--answer_loss: the model's loss with the mix's labels equals the mean cross-entropy over the answer tokens
    alone, computed by hand from the logits (float64, 1e-12)."""
    mix = SyntheticMix(TokenLoader(data_dir, 256, 2, seed=0), tokenizer, 1.0, seed=0, task="mqar", answer_loss=True)
    input_ids, labels = next(mix)
    docs = []
    for row in range(2):  # the mix's own draws: (seed, epoch, step, rank, row), the rate first
        rng = random.Random(f"0-0-0-0-{row}")
        rng.random()
        docs.append(mix.documents(256, rng))
    for row, doc in enumerate(docs):
        assert torch.equal(input_ids[row], torch.tensor(doc.ids))
        assert (labels[row] != -100).nonzero().flatten().tolist() == doc.answers
    model = Transformer(ModelConfig.from_preset("tiny", vocab_size=512)).double()
    out = model(input_ids, labels)
    logits = model(input_ids).logits  # (B, T, V)
    terms = [F.cross_entropy(logits[row, a - 1], input_ids[row, a])
             for row, doc in enumerate(docs) for a in doc.answers]
    torch.testing.assert_close(out.loss, torch.stack(terms).mean(), rtol=0, atol=1e-12)
    # what train.py runs with --answer_loss: the output layer on the answer rows only, the same loss
    rows = Transformer(model.config, ComputeConfig(loss_rows="targets")).double()
    rows.load_state_dict(model.state_dict())
    torch.testing.assert_close(rows(input_ids, labels).loss, torch.stack(terms).mean(), rtol=0, atol=1e-12)
    cfg = train_config.resolve_config(train_config.TrainConfig(model_size="tiny", synthetic_mix=1.0,
                                                               answer_loss=True), torch.device("cpu"))
    assert train_config.build_model_config(cfg, 512)[1].loss_rows == "targets"


@pytest.mark.parametrize("task", ["passkey", "mqar", "mqar_text", "copy"])
def test_train_runs_on_the_mix(data_dir, tmp_path, task):
    metrics = train.main(["--model_size", "tiny", "--context_length", "400", "--batch_size", "2", "--max_steps", "2",
                          "--synthetic_mix", "0.5", "--synthetic_task", task, "--answer_loss", "--sample_tokens", "0",
                          "--data_dir", str(data_dir), "--out_dir", str(tmp_path)])
    assert metrics["step"] == 2
