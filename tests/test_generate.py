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


def test_prompts_of_different_lengths_generate_what_each_generates_alone(model):
    """Left-padded in one batch, each row attending from its first real token: greedy tokens equal each prompt's
    alone (full attention); NSA refuses the padding, naming it."""
    torch.manual_seed(3)
    prompts = [torch.randint(0, 512, (n,)).tolist() for n in (9, 4, 13)]
    out = model.generate(prompts, max_new_tokens=8, temperature=0)
    assert out.shape == (3, 13 + 8)
    for row, prompt in zip(out, prompts, strict=True):
        alone = model.generate(torch.tensor([prompt]), max_new_tokens=8, temperature=0)[0]
        assert row[13 - len(prompt):].tolist() == alone.tolist()
    with pytest.raises(ValueError, match="every prompt needs at least one token"):
        model.generate([[1, 2, 3], []], max_new_tokens=2)
    nsa = Transformer(ModelConfig.from_preset("tiny", attention_type="nsa"))
    with pytest.raises(ValueError, match="a left-padded row"):
        nsa.generate([[1, 2, 3], [4, 5]], max_new_tokens=2)


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
