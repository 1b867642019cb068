"""RoPE tables: float32, built on the device of the caller, grown lazily, consistent across offsets and moves."""

import torch

from model import ModelConfig, Transformer
from modeling.layers import RotaryEmbedding, apply_rope


def reference_tables(length: int, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.arange(length, dtype=torch.float64)[:, None] * inv_freq[None, :]
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def test_tables_match_float64_reference_and_are_float32():
    rope = RotaryEmbedding(16, 1e6, context_length=64)
    cos, sin = rope(64, 0, torch.device("cpu"))
    ref_cos, ref_sin = reference_tables(64, 16, 1e6)
    assert cos.dtype == torch.float32 and cos.shape == (64, 16)
    torch.testing.assert_close(cos.double(), ref_cos, rtol=0, atol=1e-6)
    torch.testing.assert_close(sin.double(), ref_sin, rtol=0, atol=1e-6)


def test_cache_built_short_then_grown_and_offsets():
    rope = RotaryEmbedding(8, 1e4, context_length=16)
    cos_short, _ = rope(16, 0, torch.device("cpu"))
    assert rope.cos.shape[0] == 16
    cos_off, sin_off = rope(1, 100, torch.device("cpu"))  # decode at position 100: grows past context_length
    assert rope.cos.shape[0] >= 101
    ref_cos, ref_sin = reference_tables(101, 8, 1e4)
    torch.testing.assert_close(cos_off.double(), ref_cos[100:101], rtol=0, atol=1e-5)
    torch.testing.assert_close(sin_off.double(), ref_sin[100:101], rtol=0, atol=1e-5)
    torch.testing.assert_close(rope(16, 0, torch.device("cpu"))[0], cos_short)  # growing kept the old rows


def test_tables_follow_the_input_device_meta_included():
    rope = RotaryEmbedding(8, 1e4, context_length=16)
    cos, sin = rope(4, 0, torch.device("meta"))
    assert cos.device.type == "meta" and sin.shape == (4, 8)
    cos, _ = rope(4, 0, torch.device("cpu"))
    assert cos.device.type == "cpu"


def test_model_moved_after_building_keeps_float32_tables_out_of_the_state_dict():
    model = Transformer(ModelConfig.from_preset("tiny"))
    ids = torch.randint(0, 512, (1, 12))
    model(ids)  # builds the tables
    model = model.to(torch.float64)
    assert model.rope.cos.dtype == torch.float64  # .to() converted the buffer ...
    model(ids)
    assert model.rope.cos.dtype == torch.float32  # ... and the next forward rebuilt it in float32
    assert not any("rope" in k for k in model.state_dict())


def test_rotation_is_relative():
    """q.k after RoPE depends only on the position difference."""
    rope = RotaryEmbedding(16, 1e4, context_length=64)
    cos, sin = rope(64, 0, torch.device("cpu"))
    q, k = torch.randn(16, dtype=torch.float64), torch.randn(16, dtype=torch.float64)

    def score(i: int, j: int) -> torch.Tensor:
        qi = apply_rope(q.view(1, 1, 1, 16), cos[i:i + 1], sin[i:i + 1])
        kj = apply_rope(k.view(1, 1, 1, 16), cos[j:j + 1], sin[j:j + 1])
        return (qi * kj).sum()

    torch.testing.assert_close(score(10, 3), score(50, 43), rtol=1e-5, atol=1e-5)


def test_apply_rope_matches_plain_formula_and_gradcheck(monkeypatch):
    from modeling import layers

    monkeypatch.setattr(layers, "ROPE_CHUNK", 5)  # several chunks, the last one partial
    rope = RotaryEmbedding(8, 1e4, context_length=16)
    cos, sin = rope(13, 0, torch.device("cpu"))
    x = torch.randn(2, 3, 13, 8, dtype=torch.float64, requires_grad=True)
    rotated = torch.cat([-x[..., 4:], x[..., :4]], dim=-1)
    # Each output is x_i cos + x_j sin computed in another order (a fused multiply-add may skip one rounding):
    # within a few float64 ulps of the largest input.
    atol = 4 * torch.finfo(torch.float64).eps * x.detach().abs().max().item()
    torch.testing.assert_close(apply_rope(x, cos, sin), x * cos + rotated * sin, rtol=0, atol=atol)
    assert torch.autograd.gradcheck(lambda t: apply_rope(t, cos.double(), sin.double()), (x,))


def test_apply_rope_keeps_dtype_and_saves_no_activation():
    cos, sin = RotaryEmbedding(8, 1e4, context_length=16)(16, 0, torch.device("cpu"))
    x = torch.randn(1, 2, 16, 8, dtype=torch.bfloat16, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = apply_rope(x, cos, sin)
    assert y.dtype == torch.bfloat16
    assert all(t.shape == (16, 8) for t in saved)  # only the tables
