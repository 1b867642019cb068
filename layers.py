"""Building blocks shared by the decoder and its attention variants: RMSNorm, rotary embeddings, SwiGLU.

Notation: B batch, T sequence length, H heads, D head dimension, C model width, F FFN width.

References: RMSNorm https://arxiv.org/abs/1910.07467, RoPE https://arxiv.org/abs/2104.09864,
SwiGLU https://arxiv.org/abs/2002.05202.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class RMSNorm(nn.Module):
    """Root-mean-square norm over the last dimension, computed in (at least) float32, cast back to the input dtype."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        x32 = x.to(torch.promote_types(x.dtype, torch.float32))
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * self.weight).to(x.dtype)

    def init_weights(self) -> None:
        nn.init.ones_(self.weight)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for rotary position embeddings, grown lazily on the device of the caller.

    The tables are non-persistent float32 buffers (never in the state_dict). `forward(seq_len, offset, device)`
    returns the rows for absolute positions [offset, offset + seq_len). When a longer sequence, a larger offset or
    another device arrives, the tables are rebuilt on that device, to at least the next power of two of the needed
    length, so repeated decode steps do not rebuild them. `context_length` only sets the initial size: positions
    past it work (the tables grow).

    `scaling` (None or a validated `ModelConfig.rope_scaling` dict, rope_type "llama3") rescales the frequencies as
    Llama 3.1 does (https://arxiv.org/abs/2407.21783): wavelengths shorter than original_max_position_embeddings /
    high_freq_factor are kept, those longer than original_max_position_embeddings / low_freq_factor are divided by
    `factor`, and the band in between is interpolated linearly in original_max_position_embeddings / wavelength.
    """

    def __init__(self, head_dim: int, theta: float, context_length: int,
                 scaling: dict[str, float | int | str] | None = None) -> None:
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {head_dim}")
        self.head_dim = head_dim
        self.theta = theta
        self.scaling = scaling
        self.initial_length = context_length
        self.register_buffer("cos", torch.empty(0, head_dim), persistent=False)
        self.register_buffer("sin", torch.empty(0, head_dim), persistent=False)

    def _build(self, length: int, device: torch.device) -> None:
        inv_freq = 1.0 / (self.theta ** (torch.arange(0, self.head_dim, 2, device=device, dtype=torch.float32)
                                         / self.head_dim))  # (D/2,)
        if self.scaling is not None:
            inv_freq = llama3_scale_frequencies(inv_freq, self.scaling)
        pos = torch.arange(length, device=device, dtype=torch.float32)  # (T,)
        angles = torch.outer(pos, inv_freq)  # (T, D/2)
        angles = torch.cat([angles, angles], dim=-1)  # (T, D)
        self.cos = angles.cos()
        self.sin = angles.sin()

    def forward(self, seq_len: int, offset: int, device: torch.device) -> tuple[Tensor, Tensor]:
        needed = offset + seq_len
        if self.cos.shape[0] < needed or self.cos.device != device or self.cos.dtype != torch.float32:
            length = max(needed, self.initial_length, self.cos.shape[0])
            self._build(1 << (length - 1).bit_length(), device)
        return self.cos[offset:needed], self.sin[offset:needed]  # (T, D) each

    def init_weights(self) -> None:
        """Drop the tables (e.g. after `to_empty`, which leaves them uninitialised); they are rebuilt on next use."""
        self.cos = torch.empty(0, self.head_dim, device=self.cos.device)
        self.sin = torch.empty(0, self.head_dim, device=self.sin.device)


def llama3_scale_frequencies(inv_freq: Tensor, scaling: dict[str, float | int | str]) -> Tensor:
    """Llama 3.1 frequency rescaling of `inv_freq` (D/2,) (see `RotaryEmbedding`); returns (D/2,)."""
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    original_length = scaling["original_max_position_embeddings"]
    wavelength = 2 * math.pi / inv_freq  # (D/2,)
    smooth = (original_length / wavelength - low) / (high - low)  # 1 at the short end of the band, 0 at the long end
    interpolated = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    scaled = torch.where(wavelength > original_length / low, inv_freq / factor, interpolated)
    return torch.where(wavelength < original_length / high, inv_freq, scaled)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate `x` (B, H, T, D) by the tables `cos`, `sin` (T, D) (rotate-half convention), in (at least) float32.

    Returns a tensor of x's shape and dtype.
    """
    x32 = x.to(torch.promote_types(x.dtype, torch.float32))
    half = x.shape[-1] // 2
    rotated = torch.cat([-x32[..., half:], x32[..., :half]], dim=-1)  # (B, H, T, D)
    return (x32 * cos + rotated * sin).to(x.dtype)


class FeedForward(nn.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x)); (B, T, C) -> (B, T, C)."""

    def __init__(self, dim: int, ffn_dim: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dim, ffn_dim, bias=False)
        self.up_proj = nn.Linear(dim, ffn_dim, bias=False)
        self.down_proj = nn.Linear(ffn_dim, dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))

    def init_weights(self, std: float, out_std: float) -> None:
        nn.init.normal_(self.gate_proj.weight, std=std)
        nn.init.normal_(self.up_proj.weight, std=std)
        nn.init.normal_(self.down_proj.weight, std=out_std)
