"""The attention interface every attention type implements, and full attention (SDPA) as its first implementation.

An attention type is a class that satisfies `AttentionLayer`, registered under a name in `config.ATTENTION_TYPES`
("full" is `FullAttention` below, "nsa" is nsa/layer.py). `model.Block` builds `cls(config, compute)` and calls
only what the protocol lists; train.py's MFU, profile_memory.py's stand-ins and the choices of `--attention_type`
come from the same class. Adding a type is one file plus one registry line (docs/model.md, "Attention types, and
adding your own"; examples/sliding_window_attention.py).
A type may also add training-only loss terms during a forward (`add_aux_loss`); `model.Transformer.forward` adds them
to the loss. Their weights belong to the training objective: a type that has such terms declares an `objective`
attribute (modeling.objective.Objective), which `Transformer.objective` sets.

Notation: B batch, T new tokens, S cached tokens (keys visible to a query), C model width, H query heads,
KV key/value heads, D head dimension.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from contextvars import ContextVar
from typing import Protocol, runtime_checkable

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.backends.cuda import SDPAParams, can_use_flash_attention
from torch.nn.attention.bias import causal_lower_right

from modeling.config import ComputeConfig, ModelConfig
from modeling.documents import document_spans
from modeling.flash import document_attention, explicit_attention, fused, packed_attention, varlen_ready
from modeling.layers import RMSNorm, apply_rope
from modeling.shard import SequenceShard


@runtime_checkable
class AttentionLayer(Protocol):
    """What a decoder block needs from its attention (an nn.Module constructed as `cls(config, compute)`).

    Instance methods:
        forward(x, cos, sin, start_pos=None, doc_start=None) -> (B, T, C): x (B, T, C); cos, sin (T, D) float32
            RoPE rows for positions [start_pos or 0, +T). start_pos None: causal attention over x alone (training,
            scoring); an int: the tokens continue the sequence in the cache set up by `setup_cache`, and are
            appended to it. doc_start (B, T) long: the first position each query may see (its packed document's
            first token, a left-padded row's first real one; at most the query's own position); None: every
            earlier one. A type that cannot honour it raises ValueError. shard (`modeling.shard.SequenceShard`,
            without cache): x holds a shard's positions of a longer sequence (cos, sin and doc_start are theirs),
            whose other keys `shard.gather` reads (context parallelism); a type that cannot raises ValueError.
        setup_cache(batch_size, max_seq_len, dtype, device): preallocate the decoding state (never in state_dict).
        clear_cache(): drop it.
        init_weights(): (re)initialise every parameter from the torch RNG (used after building on the meta device).
    Class methods (used before any module exists):
        check_config(config): ValueError naming the field when `config` is impossible for this type.
        flops_per_token(config, seq_len): training FLOPs (forward + backward) per token of one layer, projections
            included, averaged over a causal sequence of seq_len tokens (train.py's MFU).
        memory_stand_in(config, compute, batch_size, seq_len, dtype, device[, spans]): a context manager, entered by
            profile_memory.py under FakeTensorMode around a whole training step, that yields a one-line description
            of how this type's memory is modelled (and may swap in a memory double for an operator that would be too
            slow to run under fake tensors at full size); `spans`, passed only under context parallelism: the
            (first, end) positions of the sequence the profiled rank holds.
    """

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, start_pos: int | None = None,
                doc_start: Tensor | None = None, shard: SequenceShard | None = None) -> Tensor: ...

    def setup_cache(self, batch_size: int, max_seq_len: int, dtype: torch.dtype,
                    device: torch.device | str | None) -> None: ...

    def clear_cache(self) -> None: ...

    def init_weights(self) -> None: ...

    @classmethod
    def check_config(cls, config: ModelConfig) -> None: ...

    @classmethod
    def flops_per_token(cls, config: ModelConfig, seq_len: int) -> float: ...

    @classmethod
    def memory_stand_in(cls, config: ModelConfig, compute: ComputeConfig, batch_size: int, seq_len: int,
                        dtype: torch.dtype, device: str, spans: tuple[tuple[int, int], ...] | None = None
                        ) -> AbstractContextManager[str]: ...


_aux_losses: ContextVar[list[Tensor] | None] = ContextVar("aux_losses", default=None)


@contextmanager
def _described(inner: AbstractContextManager, description: str) -> Iterator[str]:
    """`inner` entered, yielding `description` (a memory stand-in's line)."""
    with inner:
        yield description


@contextmanager
def collect_aux_losses() -> Iterator[list[Tensor]]:
    """Within the block, the losses passed to `add_aux_loss` are appended to the yielded list."""
    token = _aux_losses.set([])
    try:
        yield _aux_losses.get()
    finally:
        _aux_losses.reset(token)


@torch.compiler.disable  # reads a ContextVar, which torch.compile cannot trace
def add_aux_loss(loss: Tensor) -> None:
    """Hand a training-only loss term (a weighted 0-dim tensor) from inside a layer's forward to the innermost
    `collect_aux_losses` block (`model.Transformer.forward` opens one, and adds the terms to the loss when labels
    are given); outside one it is dropped, as when a caller runs `hidden_states` with gradients for a loss of its
    own. train.py's MFU does not count a term's FLOPs. A layer computes the term the same way
    whether or not it is collected, so gradient checkpointing, which recomputes the forward in backward outside any
    block, finds the same operations."""
    losses = _aux_losses.get()
    if losses is not None:
        losses.append(loss)


def projection_flops(config: ModelConfig, kv_sets: int = 1) -> float:
    """Training FLOPs per token of the q, k, v (`kv_sets` of each) and o projections: 6 x their weights."""
    c = config
    return 6 * c.dim * c.head_dim * (2 * c.n_heads + 2 * kv_sets * c.n_kv_heads)


def attention_flops(config: ModelConfig, keys_per_query: float) -> float:
    """Training FLOPs per token of scores and weighted values over `keys_per_query` keys: QK^T and PV are 2 x H x D
    multiply-adds per key forward, x 3 with backward."""
    return 12 * config.n_heads * config.head_dim * keys_per_query


class KVCache(nn.Module):
    """Preallocated keys and values (B, KV, S_max, D), written in place; non-persistent (never in the state_dict)."""

    def __init__(self, batch_size: int, n_kv_heads: int, max_seq_len: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str | None) -> None:
        super().__init__()
        shape = (batch_size, n_kv_heads, max_seq_len, head_dim)
        self.register_buffer("k", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v", torch.zeros(shape, dtype=dtype, device=device), persistent=False)

    def update(self, start_pos: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Write k, v (B, KV, T, D) at positions [start_pos, start_pos + T); return all keys/values so far
        (B, KV, start_pos + T, D)."""
        end = start_pos + k.shape[2]
        if end > self.k.shape[2]:
            raise ValueError(f"KV cache holds {self.k.shape[2]} positions; writing up to {end} does not fit")
        if k.shape[0] != self.k.shape[0]:
            raise ValueError(f"KV cache was set up for batch {self.k.shape[0]}, got batch {k.shape[0]}")
        self.k[:, :, start_pos:end] = k
        self.v[:, :, start_pos:end] = v
        return self.k[:, :, :end], self.v[:, :, :end]


class FullAttention(nn.Module):
    """Causal grouped-query attention through `scaled_dot_product_attention` (flash-style: no T x T tensor), with
    QK-norm and RoPE. The "full" attention type. Over a sequence shard (`shard`) through the shard's `attention`
    where it has one (a ring over the ranks, without document starts), otherwise over keys it gathers
    (`attend_shard`)."""

    def __init__(self, config: ModelConfig, compute: ComputeConfig | None = None) -> None:
        super().__init__()
        self.config = config
        c, h, kv, d = config.dim, config.n_heads, config.n_kv_heads, config.head_dim
        self.q_proj = nn.Linear(c, h * d, bias=False)
        self.k_proj = nn.Linear(c, kv * d, bias=False)
        self.v_proj = nn.Linear(c, kv * d, bias=False)
        self.o_proj = nn.Linear(h * d, c, bias=False)
        self.q_norm = RMSNorm(d, config.norm_eps) if config.qk_norm else nn.Identity()
        self.k_norm = RMSNorm(d, config.norm_eps) if config.qk_norm else nn.Identity()
        self.cache: KVCache | None = None

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, start_pos: int | None = None,
                doc_start: Tensor | None = None, shard: SequenceShard | None = None) -> Tensor:
        cfg = self.config
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, cfg.n_heads, cfg.head_dim).transpose(1, 2)  # (B, H, T, D)
        k = self.k_proj(x).view(B, T, cfg.n_kv_heads, cfg.head_dim).transpose(1, 2)  # (B, KV, T, D)
        v = self.v_proj(x).view(B, T, cfg.n_kv_heads, cfg.head_dim).transpose(1, 2)  # (B, KV, T, D)
        q = apply_rope(self.q_norm(q), cos, sin)
        k = apply_rope(self.k_norm(k), cos, sin)
        if start_pos is not None:
            if self.cache is None:
                raise RuntimeError("start_pos was given but no KV cache is set up; call model.setup_kv_cache()")
            k, v = self.cache.update(start_pos, k, v)  # (B, KV, S, D), S = start_pos + T
        if shard is not None:
            own_rule = type(self).attend_shard is not FullAttention.attend_shard  # a variant's keys: never the ring
            if type(self).attend is not FullAttention.attend and not own_rule:
                raise ValueError(f"{type(self).__name__} overrides attend (which keys a query sees), and a sequence "
                                 "shard would bypass it: override attend_shard too, or leave out --context_parallel")
            y = None  # (B, H, t, D)
            if shard.attention is not None and doc_start is None and not own_rule:
                y = shard.attention(q, k, v, cfg.head_dim**-0.5)  # on the group's ring, where it runs
            if y is None:  # over the gathered keys
                y = self.attend_shard(q, shard.gather(k), shard.gather(v), shard, doc_start)
        else:
            y = self.attend(q, k, v, start_pos or 0, doc_start)  # (B, H, T, D)
        y = y.transpose(1, 2).reshape(B, T, cfg.n_heads * cfg.head_dim)  # (B, T, H*D)
        return self.o_proj(y)

    def attend(self, q: Tensor, k: Tensor, v: Tensor, offset: int, doc_start: Tensor | None) -> Tensor:
        """The attention of rotated queries q (B, H, T, D) at positions [offset, offset + T) over the keys and values
        k, v (B, KV, S, D) at positions [0, S), S = offset + T: causal, from each query's `doc_start` on when given.
        Returns (B, H, T, D). A variant that changes which keys a query sees overrides this alone
        (examples/sliding_window_attention.py)."""
        T, scale = q.shape[2], self.config.head_dim**-0.5
        if doc_start is not None:  # each query from its document's start on: no (T, S) mask (modeling/flash.py)
            if offset == 0 and varlen_ready(q):  # each document one sequence of the flash varlen kernel
                return packed_attention(q, k, v, document_spans(doc_start), scale)
            return document_attention(q, k, v, doc_start, offset, scale)
        mask = None
        if offset > 0 and T > 1:  # continuing a cache with several tokens: query i sees keys <= offset + i
            pos_q = torch.arange(offset, offset + T, device=q.device)
            mask = pos_q[:, None] >= torch.arange(offset + T, device=q.device)[None, :]  # (T, S), small T
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None and T > 1,
                                              enable_gqa=self.config.n_rep > 1)

    def attend_shard(self, q: Tensor, k: Tensor, v: Tensor, shard: SequenceShard, doc_start: Tensor | None
                     ) -> Tensor:
        """`attend` for the queries q (B, H, t, D) of a sequence shard over the whole sequence's keys and values
        k, v (B, KV, T, D): each span of the shard as queries from its first position on, over the keys up to its
        end. With doc_start, from each query's start (`modeling.flash.document_attention`'s chunks); without, on
        the CPU's flash kernels (the keys before the span, then a causal square, merged by log-sum-exp), elsewhere
        through SDPA with a causal mask aligned to the last key (`causal_lower_right`: CUDA's flash kernel, no
        (t, T) mask). Returns (B, H, t, D)."""
        parts, scale = [], self.config.head_dim**-0.5
        for lo, first, end in shard.pieces():
            q_span, k_seen, v_seen = q[:, :, lo:lo + end - first], k[:, :, :end], v[:, :, :end]
            if doc_start is not None:
                parts.append(document_attention(q_span, k_seen, v_seen, doc_start[:, lo:lo + end - first], first,
                                                scale))
            elif fused(q):
                parts.append(document_attention(q_span, k_seen, v_seen, None, first, scale))
            else:  # only CUDA's flash kernel takes the lower-right mask unmaterialised: refuse what it cannot take
                if q.device.type == "cuda" and not can_use_flash_attention(SDPAParams(
                        q_span, k_seen, v_seen, None, 0.0, False, self.config.n_rep > 1)):
                    raise ValueError("full attention over a sequence shard (--context_parallel) runs on CUDA's "
                                     "flash kernel, which cannot take these inputs (it needs bfloat16 or float16 "
                                     "and a head_dim of at most 256): train with --dtype bfloat16")
                parts.append(F.scaled_dot_product_attention(q_span, k_seen, v_seen, scale=scale,
                                                            attn_mask=causal_lower_right(end - first, end),
                                                            enable_gqa=self.config.n_rep > 1))
        return torch.cat(parts, dim=2)

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
        for norm in (self.q_norm, self.k_norm):
            if isinstance(norm, RMSNorm):
                norm.init_weights()

    @classmethod
    def check_config(cls, config: ModelConfig) -> None:
        pass  # every geometry ModelConfig accepts works

    @classmethod
    def flops_per_token(cls, config: ModelConfig, seq_len: int) -> float:
        return projection_flops(config) + attention_flops(config, (seq_len + 1) / 2)  # causal: (T+1)/2 keys

    @classmethod
    def memory_stand_in(cls, config: ModelConfig, compute: ComputeConfig, batch_size: int, seq_len: int,
                        dtype: torch.dtype, device: str, spans: tuple[tuple[int, int], ...] | None = None
                        ) -> AbstractContextManager[str]:
        if spans is not None:  # CUDA runs each span through its flash kernel: the CPU's keeps as much
            return nullcontext("full attention over a sequence shard, each span through the CPU's flash kernels in "
                               "place of CUDA's (both keep only the output and log-sum-exp for backward: no (t, T) "
                               "matrix)")
        return _described(explicit_attention(), "full attention, through the CPU's flash SDPA kernel in place of "
                          "CUDA's flash/cuDNN kernels; both keep only the output and log-sum-exp for backward (no "
                          "T x T matrix); with document starts, the explicit chunks CUDA runs")
