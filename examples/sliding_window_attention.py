"""An attention type written outside the model code: causal sliding-window attention, each query sees its last
`window` keys (the query's own included). It exists to show, and to test, that a new attention type is one file plus
one registry line; nothing else in the repository names it.

    from modeling.config import register_attention
    register_attention("swa", "examples.sliding_window_attention:SlidingWindowAttention")   # the one registry line
    # or, without editing anything: python train.py --plugin examples.sliding_window_attention --attention_type swa

Its option lives in `ModelConfig.attention_options` ({"window": int}, default 16). Training runs SDPA with an
explicit (T, T) band mask: fine for a test model, not for long sequences.

Notation: B batch, T new tokens, S keys (cached + new), C model width, H query heads, KV key/value heads, D head
dimension, w window.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from modeling.attention import FullAttention, attention_flops, projection_flops
from modeling.config import ComputeConfig, ModelConfig, register_attention

DEFAULT_WINDOW = 16


def _no_cudnn() -> AbstractContextManager:
    """SDPA on CUDA without the cuDNN backend. With an explicit mask, T % 128 == 64 and a row whose log-sum-exp
    falls below ln(1/FLT_MAX), cuDNN's backward returns NaN query gradients on H100/H200 (torch 2.11,
    https://github.com/pytorch/pytorch/issues/196678); it stopped a window-64 MQAR run at T = 64 after 193 steps."""
    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


class SlidingWindowAttention(FullAttention):
    """GQA over the last `window` positions, RoPE, no QK-norm; the cache holds every position (a test model). Full
    attention's projections, cache and initialisation, with its `attend` replaced."""

    def __init__(self, config: ModelConfig, compute: ComputeConfig | None = None) -> None:
        super().__init__(config, compute)
        self.window = config.attention_options.get("window", DEFAULT_WINDOW)
        self.q_norm = self.k_norm = nn.Identity()  # the window control of benchmarks/recall_experiment.py has none

    def attend(self, q: Tensor, k: Tensor, v: Tensor, offset: int, doc_start: Tensor | None) -> Tensor:
        """Each query over its last `window` keys (and from its document's start on): an explicit (T, S) band."""
        T, S = q.shape[2], k.shape[2]
        q_pos = torch.arange(offset, offset + T, device=q.device)[:, None]  # (T, 1)
        k_pos = torch.arange(S, device=q.device)[None, :]  # (1, S)
        band = (k_pos <= q_pos) & (k_pos > q_pos - self.window)  # (T, S)
        if doc_start is not None:
            band = band & (k_pos >= doc_start[:, :, None])[:, None]  # (B, 1, T, S): from each query's document start
        with _no_cudnn() if q.is_cuda else nullcontext():
            return F.scaled_dot_product_attention(q, k, v, attn_mask=band, enable_gqa=self.config.n_rep > 1)

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


def register() -> None:
    """What `--plugin examples.sliding_window_attention` calls: the one registry line."""
    register_attention("swa", SlidingWindowAttention)
