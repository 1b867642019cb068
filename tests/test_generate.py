"""KV cache and generation: decode equals prefill, greedy generation equals repeated full forward passes."""

import pytest
import torch

from model import ModelConfig, Transformer, sample_next_token


@pytest.fixture
def model() -> Transformer:
    return Transformer(ModelConfig.from_preset("tiny")).eval()


@torch.no_grad()
def test_decode_logits_equal_full_forward(model):
    ids = torch.randint(0, 512, (2, 30))
    full = model(ids).logits
    model.setup_kv_cache(2, 30)
    prefill = model(ids[:, :20], start_pos=0).logits
    steps = [model(ids[:, t:t + 1], start_pos=t).logits for t in range(20, 25)]
    chunk = model(ids[:, 25:], start_pos=25).logits  # several tokens on top of a filled cache
    model.clear_kv_cache()
    torch.testing.assert_close(prefill, full[:, :20], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(torch.cat(steps, 1), full[:, 20:25], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(chunk, full[:, 25:], rtol=1e-5, atol=1e-5)


@torch.no_grad()
@pytest.mark.parametrize("batch", [1, 3])
def test_greedy_generation_equals_repeated_full_forward(model, batch):
    prompt = torch.randint(0, 512, (batch, 7))
    out = model.generate(prompt, max_new_tokens=12, temperature=0)
    ids = prompt
    for _ in range(12):
        ids = torch.cat([ids, model(ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(out, ids)
    assert all(block.attn.cache is None for block in model.layers)  # cache released after generate


def test_generation_stops_at_eos_and_pads_finished_rows(model):
    prompt = torch.randint(0, 512, (2, 5))
    greedy = model.generate(prompt, max_new_tokens=6, temperature=0)
    eos = int(greedy[0, 6])  # row 0 emits this as its second new token
    out = model.generate(prompt, max_new_tokens=6, temperature=0, eos_id=eos)
    assert out[0, 6] == eos and (out[0, 6:] == eos).all()


@pytest.mark.parametrize("attention, lengths", [("full", (9, 4, 13)),
                                                # NSA (l = 8, l' = 16, n = 4, w = 32): prompts past the window and
                                                # past n l' = 64, where top-n chooses; two rows padded alike
                                                ("nsa", (70, 23, 23, 90))])
def test_prompts_of_different_lengths_generate_what_each_generates_alone(attention, lengths):
    """Left-padded in one batch, each row attending from its first real token (NSA: each row's blocks counted from
    it): greedy tokens equal each prompt's alone (float64, so that no near-tie flips between the two)."""
    torch.manual_seed(3)
    model = Transformer(ModelConfig.from_preset("tiny", attention_type=attention)).double().eval()
    prompts = [torch.randint(0, 512, (n,)).tolist() for n in lengths]
    longest = max(lengths)
    out = model.generate(prompts, max_new_tokens=12, temperature=0)
    assert out.shape == (len(prompts), longest + 12)
    for row, prompt in zip(out, prompts, strict=True):
        alone = model.generate(torch.tensor([prompt]), max_new_tokens=12, temperature=0)[0]
        assert row[longest - len(prompt):].tolist() == alone.tolist()
    with pytest.raises(ValueError, match="every prompt needs at least one token"):
        model.generate([[1, 2, 3], []], max_new_tokens=2)


@torch.no_grad()
def test_nsa_left_padded_decoding_equals_each_row_alone():
    """The logits of a left-padded NSA batch, prefill then decode through the cache, equal each row's alone (float64;
    RoPE's float32 tables at other absolute positions round differently, relative 2^-24 per entry: 1e-6 of the
    scale allowed, as tests/test_documents.py), and a doc_start that is not a left padding's is refused."""
    from modeling.documents import padding_starts

    torch.manual_seed(0)
    model = Transformer(ModelConfig.from_preset("tiny", attention_type="nsa")).double().eval()
    ids = torch.randint(0, 512, (3, 100))
    pads = torch.tensor([0, 37, 81])
    model.setup_kv_cache(3, 100)
    prefill = model(ids[:, :90], start_pos=0, doc_start=padding_starts(pads, 0, 90)).logits
    steps = [model(ids[:, t:t + 1], start_pos=t, doc_start=padding_starts(pads, t, 1)).logits for t in range(90, 100)]
    model.clear_kv_cache()
    batch = torch.cat([prefill, *steps], dim=1)  # (3, 100, V)
    for row, pad in enumerate(pads.tolist()):
        alone = model(ids[row:row + 1, pad:]).logits
        torch.testing.assert_close(batch[row:row + 1, pad:], alone, rtol=0, atol=1e-6 * alone.abs().max().item())
    model.setup_kv_cache(3, 100)
    with pytest.raises(ValueError, match="doc_start must be that of a batch padded on the left"):
        model(ids[:, :10], start_pos=0, doc_start=torch.zeros(3, 10, dtype=torch.long).fill_(2))


def test_generation_past_context_length_is_refused(model):
    with pytest.raises(ValueError, match="context_length"):
        model.generate(torch.zeros(1, 1000, dtype=torch.long), max_new_tokens=100)


def test_sampling_filters():
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0]])
    g = torch.Generator().manual_seed(0)
    draws = {int(sample_next_token(logits, 1.0, top_k=2, generator=g)) for _ in range(200)}
    assert draws == {2, 3}
    draws = {int(sample_next_token(logits, 1.0, top_p=0.5, generator=g)) for _ in range(200)}
    assert draws == {3}  # p(3) = 0.64 >= 0.5 alone
    assert int(sample_next_token(logits, 0.0)) == 3


@pytest.mark.parametrize("kwargs, message", [
    (dict(top_k=0), "top_k must be None or an integer >= 1"),
    (dict(temperature=float("nan")), "temperature must be finite and >= 0"),
    (dict(top_p=1.5), r"top_p must be None or in \(0, 1\]"),
])
def test_bad_sampling_arguments_name_the_argument(model, kwargs, message):
    with pytest.raises(ValueError, match=message):
        model.generate(torch.zeros(1, 3, dtype=torch.long), 2, **kwargs)


def test_empty_prompt_is_refused(model):
    with pytest.raises(ValueError, match="non-empty prompt"):
        model.generate(torch.zeros(1, 0, dtype=torch.long), 2)
