"""An attention type written outside the model code: causal sliding-window attention, each query sees its last
`window` keys (the query's own included). It exists to show, and to test, that a new attention type is one file plus
one registry line; nothing else in the repository names it.

    from modeling.config import register_attention
    register_attention("swa", "examples.sliding_window_attention:SlidingWindowAttention")   # the one registry line

Its option lives in `ModelConfig.attention_options` ({"window": int}, default 16). Training runs SDPA with an
explicit (T, T) band mask: fine for a test model, not for long sequences.

Notation: B batch, T new tokens, S keys (cached + new), C model width, H query heads, KV key/value heads, D head
dimension, w window.
"""

from __future__ import annotations

import math
from contextlib import AbstractContextManager, nullcontext

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from modeling.attention import KVCache, attention_flops, projection_flops
from modeling.config import ComputeConfig, ModelConfig
from modeling.layers import apply_rope

DEFAULT_WINDOW = 16


def _no_cudnn() -> AbstractContextManager:
    """SDPA on CUDA without the cuDNN backend. With an explicit mask, T % 128 == 64 and a row whose log-sum-exp
    falls below ln(1/FLT_MAX), cuDNN's backward returns NaN query gradients on H100/H200 (torch 2.11,
    https://github.com/pytorch/pytorch/issues/196678); it stopped a window-64 MQAR run at T = 64 after 193 steps."""
    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


class SlidingWindowAttention(nn.Module):
    """GQA over the last `window` positions, RoPE, no QK-norm; the cache holds every position (a test model)."""

    def __init__(self, config: ModelConfig, compute: ComputeConfig | None = None) -> None:
        super().__init__()
        self.config, self.window = config, config.attention_options.get("window", DEFAULT_WINDOW)
        c, h, kv, d = config.dim, config.n_heads, config.n_kv_heads, config.head_dim
        self.q_proj = nn.Linear(c, h * d, bias=False)
        self.k_proj = nn.Linear(c, kv * d, bias=False)
        self.v_proj = nn.Linear(c, kv * d, bias=False)
        self.o_proj = nn.Linear(h * d, c, bias=False)
        self.cache: KVCache | None = None

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, start_pos: int | None = None,
                doc_start: Tensor | None = None) -> Tensor:
        cfg = self.config
        B, T, _ = x.shape
        q = apply_rope(self.q_proj(x).view(B, T, cfg.n_heads, cfg.head_dim).transpose(1, 2), cos, sin)  # (B,H,T,D)
        k = apply_rope(self.k_proj(x).view(B, T, cfg.n_kv_heads, cfg.head_dim).transpose(1, 2), cos, sin)  # (B,KV,T,D)
        v = self.v_proj(x).view(B, T, cfg.n_kv_heads, cfg.head_dim).transpose(1, 2)  # (B, KV, T, D)
        offset = 0 if start_pos is None else start_pos
        if start_pos is not None:
            if self.cache is None:
                raise RuntimeError("start_pos was given but no cache is set up; call setup_cache() first")
            k, v = self.cache.update(start_pos, k, v)  # (B, KV, S, D), S = start_pos + T
        q_pos = torch.arange(offset, offset + T, device=x.device)[:, None]  # (T, 1)
        k_pos = torch.arange(k.shape[2], device=x.device)[None, :]  # (1, S)
        band = (k_pos <= q_pos) & (k_pos > q_pos - self.window)  # (T, S)
        if doc_start is not None:
            band = band & (k_pos >= doc_start[:, :, None])[:, None]  # (B, 1, T, S): from each query's document start
        with _no_cudnn() if x.is_cuda else nullcontext():
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=band, enable_gqa=cfg.n_rep > 1)  # (B, H, T, D)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, cfg.n_heads * cfg.head_dim))  # (B, T, C)

    def setup_cache(self, batch_size: int, max_seq_len: int, dtype: torch.dtype,
                    device: torch.device | str | None) -> None:
        cfg = self.config
        self.cache = KVCache(batch_size, cfg.n_kv_heads, max_seq_len, cfg.head_dim, dtype, device)

    def clear_cache(self) -> None:
        self.cache = None

    def init_weights(self) -> None:
        std = self.config.init_std
        for proj in (self.q_proj, self.k_proj, self.v_proj):
            nn.init.normal_(proj.weight, std=std)
        nn.init.normal_(self.o_proj.weight, std=std / math.sqrt(2 * self.config.n_layers))

    @classmethod
    def check_config(cls, config: ModelConfig) -> None:
        window = config.attention_options.get("window", DEFAULT_WINDOW)
        if not isinstance(window, int) or isinstance(window, bool) or window < 1:
            raise ValueError(f"ModelConfig.attention_options['window'] must be a positive integer, got {window!r}")

    @classmethod
    def flops_per_token(cls, config: ModelConfig, seq_len: int) -> float:
        window = config.attention_options.get("window", DEFAULT_WINDOW)
        return projection_flops(config) + attention_flops(config, min(window, (seq_len + 1) / 2))

    @classmethod
    def memory_stand_in(cls, config: ModelConfig, compute: ComputeConfig, batch_size: int, seq_len: int,
                        dtype: torch.dtype, device: str) -> AbstractContextManager[str]:
        return nullcontext("sliding-window attention: runs as in training (its (T, T) band mask included)")
