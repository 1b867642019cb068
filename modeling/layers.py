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
from torch._subclasses.fake_tensor import is_fake
from torch.utils.checkpoint import checkpoint


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

    `scaling` (None or a validated `ModelConfig.rope_scaling` dict) rescales the frequencies:
    - rope_type "llama3", as Llama 3.1 does (https://arxiv.org/abs/2407.21783): wavelengths shorter than
      original_max_position_embeddings / high_freq_factor are kept, those longer than original_max_position_embeddings
      / low_freq_factor are divided by `factor`, and the band in between is interpolated linearly in
      original_max_position_embeddings / wavelength;
    - rope_type "yarn" (https://arxiv.org/abs/2309.00071), as Qwen3 reaches 131k: see `yarn_scale_frequencies`;
      the tables are also multiplied by its attention factor.
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
        scale = 1.0
        if self.scaling is not None and self.scaling["rope_type"] == "llama3":
            inv_freq = llama3_scale_frequencies(inv_freq, self.scaling)
        elif self.scaling is not None:
            inv_freq, scale = yarn_scale_frequencies(inv_freq, self.scaling, self.head_dim, self.theta)
        pos = torch.arange(length, device=device, dtype=torch.float32)  # (T,)
        angles = torch.outer(pos, inv_freq)  # (T, D/2)
        angles = torch.cat([angles, angles], dim=-1)  # (T, D)
        self.cos = angles.cos() * scale
        self.sin = angles.sin() * scale

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


def yarn_scale_frequencies(inv_freq: Tensor, scaling: dict[str, float | int | str], head_dim: int, theta: float
                           ) -> tuple[Tensor, float]:
    """YaRN ("NTK-by-parts") rescaling of `inv_freq` (D/2,) for a context `factor` times the original length L:
    dimensions that turn more than beta_fast times over L keep their frequency (extrapolation), those turning fewer
    than beta_slow times are divided by `factor` (interpolation), with a linear ramp between the two (the ramp's
    ends rounded outwards when `truncate`, the default). Returns (the frequencies (D/2,), the attention factor that
    multiplies cos and sin: `attention_factor`, default 0.1 ln(factor) + 1)."""
    factor, original_length = scaling["factor"], scaling["original_max_position_embeddings"]
    beta_fast, beta_slow = scaling.get("beta_fast", 32), scaling.get("beta_slow", 1)

    def dimension(rotations: float) -> float:  # the dimension index whose wavelength fits `rotations` times in L
        return head_dim * math.log(original_length / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dimension(beta_fast), dimension(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    ramp = ((torch.arange(head_dim // 2, device=inv_freq.device, dtype=torch.float32) - low)
            / (max(high - low, 1e-3))).clamp(0, 1)  # (D/2,): 0 keeps the frequency, 1 interpolates it
    scaled = inv_freq / factor * ramp + inv_freq * (1 - ramp)
    attention_factor = scaling.get("attention_factor") or (0.1 * math.log(factor) + 1 if factor > 1 else 1.0)
    return scaled, float(attention_factor)


ROPE_CHUNK = 4096  # positions rotated at a time: bounds the float32 temporaries to (B, H, ROPE_CHUNK, D)


def _rotate(x: Tensor, cos: Tensor, sin: Tensor, contiguous: bool = False, positions: Tensor | None = None
            ) -> Tensor:
    """x * cos + rotate_half(x) * sin for x (B, H, T, D), in (at least) float32, chunk by chunk over T, written into
    a tensor of x's dtype and layout (contiguous (B, H, T, D) when `contiguous`); with positions (T,) long, x's t-th
    row takes the tables' row positions[t]. Under FakeTensorMode nothing is computed, so only the first chunk runs:
    the memory it shows (the output plus one chunk's temporaries) is the loop's, without thousands of operators at
    long T."""
    out = x.new_empty(x.shape) if contiguous else torch.empty_like(x)
    half = x.shape[-1] // 2
    compute_dtype = torch.promote_types(x.dtype, torch.float32)
    fake = not torch.compiler.is_compiling() and is_fake(x)  # (is_fake would break a compiled graph)
    chunks = range(0, min(x.shape[-2], ROPE_CHUNK) if fake else x.shape[-2], ROPE_CHUNK)
    for t0 in chunks:
        t1 = t0 + ROPE_CHUNK
        rows = slice(t0, t1) if positions is None else positions[t0:t1]
        xs, c, s = x[..., t0:t1, :].to(compute_dtype), cos[rows], sin[rows]  # (B, H, c, D), (c, D), (c, D)
        y = xs * c  # (B, H, c, D); then rotate_half(xs) * s added half by half, with no rotated copy of xs
        y[..., :half].addcmul_(xs[..., half:], s[..., :half], value=-1)
        y[..., half:].addcmul_(xs[..., :half], s[..., half:])
        out[..., t0:t1, :] = y
    return out


class _ApplyRope(torch.autograd.Function):
    """RoPE that keeps nothing of x for backward: the rotation is linear, and its transpose is the rotation by the
    opposite angle (the sin table repeats across the two halves, so rotate_half^T(g * sin) = rotate_half(g) * -sin)."""

    @staticmethod
    def forward(ctx, x: Tensor, cos: Tensor, sin: Tensor, contiguous: bool, positions: Tensor | None) -> Tensor:
        ctx.save_for_backward(cos, sin, positions)
        return _rotate(x, cos, sin, contiguous, positions)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None, None, None, None]:
        cos, sin, positions = ctx.saved_tensors
        return _rotate(grad, cos, -sin, positions=positions), None, None, None, None


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor, contiguous: bool = False, positions: Tensor | None = None
               ) -> Tensor:
    """Rotate `x` (B, H, T, D) by the tables `cos`, `sin` (T, D) (rotate-half convention), in (at least) float32;
    with `positions` (T,) long, x's row t by the tables' row positions[t] (tables for a whole sequence, rows picked
    without a copy of them being kept).

    Returns a tensor of x's shape, dtype and layout, or with `contiguous` a contiguous (B, H, T, D) one (what
    NSA's kernels read: head by head; full attention's SDPA takes x's (B, T, H, D) layout). The float32 work is
    done `ROPE_CHUNK` positions at a time and nothing of x is saved for backward, so at long T the rotation costs
    one output tensor, not several float32 copies.
    The tables carry no gradient.
    """
    return _ApplyRope.apply(x, cos, sin, contiguous, positions)


class FeedForward(nn.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x)); (B, T, C) -> (B, T, C).

    With `chunk_size`, sequences longer than it run `chunk_size` tokens at a time and, when gradients are recorded,
    each tile is recomputed in backward (tiled MLP): the (B, T, F) intermediates never exist at once, only one tile's.
    The price is one more forward of the FFN per step.
    """

    def __init__(self, dim: int, ffn_dim: int, chunk_size: int | None = None) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dim, ffn_dim, bias=False)
        self.up_proj = nn.Linear(dim, ffn_dim, bias=False)
        self.down_proj = nn.Linear(ffn_dim, dim, bias=False)
        self.chunk_size = chunk_size

    def _ffn(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))

    def forward(self, x: Tensor) -> Tensor:
        c = self.chunk_size
        if c is None or x.shape[1] <= c:
            return self._ffn(x)
        tiles = [x[:, t0:t0 + c] for t0 in range(0, x.shape[1], c)]  # (B, c, C) views
        if torch.is_grad_enabled():
            return torch.cat([checkpoint(self._ffn, tile, use_reentrant=False) for tile in tiles], dim=1)
        return torch.cat([self._ffn(tile) for tile in tiles], dim=1)

    def init_weights(self, std: float, out_std: float) -> None:
        nn.init.normal_(self.gate_proj.weight, std=std)
        nn.init.normal_(self.up_proj.weight, std=std)
        nn.init.normal_(self.down_proj.weight, std=out_std)
