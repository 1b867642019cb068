"""How profile_memory.py models NSA's memory: a memory double of `sparse_attention`, calibrated on the real function.

The attention itself (nsa/attention.py) runs hundreds of small operators per query chunk: at 131k tokens, thousands
of chunks per step, which would take hours under fake tensors. Its memory is affine in T for a fixed query chunk
(see the nsa/attention.py docstring), so `sparse_attention_stand_in` measures one layer's call (forward and
backward, fake tensors, memtrack.LiveBytesTracker) at T itself, or at two lengths past the all-selected prefix
(`calibration_lengths`) and extrapolates linearly, and swaps `NativeSparseAttention.sparse_attention` (the layer's
one seam for its attention) for `_SparseAttentionDouble` while the profiled step runs. It calibrates on the path a
CUDA run takes: the Triton kernels' when `ComputeConfig.triton_kernels` (on fake tensors that path allocates what it
does on a GPU without Triton installed, nsa/triton_path.py, so the estimate is the same on every machine), else the
explicit one. Projections, compression and gates still run for real. The selection-scoring loss (nsa/scoring.py)
runs for real too, on the three query chunks of each span that set its peak (its `peak_only`, through the layer's
`selection_score_loss` seam): at 131k tokens its full chunk loop would take tens of minutes under fake tensors.

Notation: B batch, T tokens, H query heads, D head dimension, Q query chunk.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext

import torch
from torch import Tensor

from modeling.config import ComputeConfig, ModelConfig
from modeling.flash import explicit_attention
from modeling.layers import RotaryEmbedding
from modeling.memtrack import LiveBytesTracker
from modeling.shard import SequenceShard
from nsa.attention import sparse_attention
from nsa.primitive import triton_kernels as triton_path
from nsa.scoring import selection_score_loss

Spec = tuple[int, int, int, tuple[bool, ...]]  # kept, forward peak, backward peak (bytes), which inputs are kept


class _SparseAttentionDouble(torch.autograd.Function):
    """Memory double of `sparse_attention`: the same output and input gradients, the same inputs kept alive
    for backward, and as plain buffers the bytes the real function keeps for backward (`kept`), holds at its
    forward peak beyond them (`forward_peak`) and at its backward peak beyond them, its output and the input
    gradients (`backward_peak`). Everything goes through save_for_backward, so block checkpointing drops and
    recomputes it as it would the real tensors. Values are not computed."""

    @staticmethod
    def forward(ctx, spec: Spec, *inputs: Tensor) -> Tensor:
        kept, forward_peak, ctx.backward_peak, keeps = spec
        q = inputs[0]  # (B, H, T, D)
        ctx.shapes = [(t.shape, t.dtype) for t in inputs]
        ctx.save_for_backward(q.new_empty(kept, dtype=torch.uint8),
                              *(t for t, keep in zip(inputs, keeps, strict=True) if keep))
        q.new_empty(forward_peak, dtype=torch.uint8)  # the working set of one query chunk, freed at once
        return q.new_empty(q.shape)  # (B, H, T, D)

    @staticmethod
    def backward(ctx, grad_out: Tensor) -> tuple[Tensor | None, ...]:
        grads = tuple(torch.zeros(shape, dtype=dtype, device=grad_out.device) if needed else None
                      for (shape, dtype), needed in zip(ctx.shapes, ctx.needs_input_grad[1:], strict=True))
        grad_out.new_empty(ctx.backward_peak, dtype=torch.uint8)  # one chunk's recomputation and gradients
        return (None, *grads)


def _measure(args: tuple, kwargs: dict, autocast: AbstractContextManager) -> Spec:
    """The double's spec, from one forward + backward of `sparse_attention` with inputs shaped like `args` (fresh
    tensors made before the tracker starts: only the function's own allocations count)."""
    leaves = [torch.empty_strided(a.shape, a.stride(), dtype=a.dtype, device=a.device).requires_grad_()
              for a in args if isinstance(a, Tensor)]
    inputs = iter([leaf.clone() for leaf in leaves])  # non-leaves: alive after the call only if the call keeps them
    call_args = [next(inputs) if isinstance(a, Tensor) else a for a in args]
    refs = [weakref.ref(a) for a in call_args if isinstance(a, Tensor)]
    grad_out = torch.empty(args[0].shape, dtype=args[0].dtype, device=args[0].device)  # (B, H, T, D)
    with LiveBytesTracker() as tracker:
        with autocast:
            out = sparse_attention(*call_args, **kwargs)
        kept = tracker.live - out.numel() * out.element_size()
        forward_peak = tracker.peak - kept
        del call_args, inputs
        keeps = tuple(ref() is not None for ref in refs)
        tracker.reset_peak()
        after_forward = tracker.live
        out.backward(grad_out)
        backward_peak = tracker.peak - after_forward
    grads = sum(leaf.numel() * leaf.element_size() for leaf in leaves)
    return kept, max(0, forward_peak), max(0, backward_peak - grads), keeps


def _arguments(layer_class: type, config: ModelConfig, compute: ComputeConfig, B: int, T: int, dtype: torch.dtype,
               device: str, autocast: AbstractContextManager, first: int = 0) -> tuple[tuple, dict]:
    """The arguments one NSA layer computing in `dtype` passes to its attention for B x T tokens (captured at the
    layer's seam); with `first` > 0, for the queries at positions [first, T) of a sequence shard (context
    parallelism: the keys before them gathered from other ranks)."""
    captured: list[tuple[tuple, dict]] = []

    def capture(q: Tensor, *args: object, **kwargs: object) -> Tensor:
        captured.append(((q, *args), kwargs))
        return torch.zeros_like(q)

    def all_gather(x: Tensor) -> Tensor:  # what the rank holding positions [0, first) adds: shapes only
        return x.new_empty(2, *x.shape)

    # fp32 weights, autocast
    with torch.device(device), torch.no_grad(), autocast, _swapped(layer_class, sparse_attention=capture):
        layer = layer_class(config, compute)
        cos, sin = RotaryEmbedding(config.head_dim, config.rope_theta, T)(T, 0, torch.device(device))
        if first == 0:
            layer(torch.empty(B, T, config.dim), cos, sin)
        else:
            shard = SequenceShard(T, (((first, T),), ((0, first),)), 0, all_gather).with_rope(cos, sin)
            layer(torch.empty(B, T - first, config.dim), cos[first:], sin[first:], shard=shard)
    return captured[0]


@contextmanager
def _swapped(layer_class: type, **seams: object) -> Iterator[None]:
    """The layer class's seams (`sparse_attention`, `selection_score_loss`) replaced by the given functions while
    inside."""
    real = {name: layer_class.__dict__[name] for name in seams}
    for name, fn in seams.items():
        setattr(layer_class, name, staticmethod(fn))
    try:
        yield
    finally:
        for name, fn in real.items():
            setattr(layer_class, name, fn)


def calibration_lengths(config: ModelConfig, compute: ComputeConfig, seq_len: int) -> list[int]:
    """The lengths the double is measured at for `seq_len` tokens: seq_len itself when it is at most 8 query chunks
    past the all-selected prefix, else 4 and 8 chunks past it. The prefix (queries with at most n blocks, which
    select them all: one causal attention, no scores) is another regime, so both points lie beyond it, where every
    term of the peak is affine in T (the nsa/attention.py docstring)."""
    Q = compute.attention_query_chunk
    prefix = -(-config.nsa_num_selected * config.nsa_select_block_size // Q) * Q  # chunks that select every block
    points = [prefix + 4 * Q, prefix + 8 * Q]
    return [seq_len] if seq_len <= points[1] else points


def calibrated_spec(layer_class: type, config: ModelConfig, compute: ComputeConfig, batch_size: int, seq_len: int,
                    dtype: torch.dtype, device: str, points: list[int] | None = None) -> Spec:
    """The double's spec for `batch_size` x `seq_len` tokens: measured on the path a CUDA run takes at each of
    `points` (default `calibration_lengths`) and, for two points, extrapolated linearly to seq_len (call it under
    FakeTensorMode)."""
    points = points or calibration_lengths(config, compute, seq_len)
    autocast = torch.autocast(device, dtype=dtype) if dtype != torch.float32 else nullcontext()
    # What a CUDA run takes: PyTorch's CUDA builds bring Triton.
    path = triton_path() if compute.triton_kernels else explicit_attention()
    with path:  # not the CPU kernels
        measured = [_measure(*_arguments(layer_class, config, compute, batch_size, t, dtype, device, autocast),
                             autocast)
                    for t in points]
    if len(points) == 1:
        return measured[0]
    (t1, t2), (m1, m2) = points, measured
    return (*(max(0, round(a + (b - a) * (seq_len - t1) / (t2 - t1))) for a, b in zip(m1[:3], m2[:3], strict=True)),
            m2[3])


def span_spec(layer_class: type, config: ModelConfig, compute: ComputeConfig, batch_size: int, first: int, end: int,
              dtype: torch.dtype, device: str) -> Spec:
    """The double's spec for the queries at positions [first, end) of a sequence shard over the keys [0, end)
    (context parallelism; first > 0): measured at the span itself when it holds at most 8 query chunks, else at 4
    and 8 chunks ending at `end` (the same keys) and extrapolated linearly in the queries (the memory of a query
    chunk does not depend on how many came before it)."""
    Q = compute.attention_query_chunk
    autocast = torch.autocast(device, dtype=dtype) if dtype != torch.float32 else nullcontext()
    queries = [end - first] if end - first <= 8 * Q else [4 * Q, 8 * Q]
    with triton_path() if compute.triton_kernels else explicit_attention():  # what a CUDA run takes
        measured = [_measure(*_arguments(layer_class, config, compute, batch_size, end, dtype, device, autocast,
                                         end - n), autocast) for n in queries]
    if len(queries) == 1:
        return measured[0]
    (n1, n2), (m1, m2) = queries, measured
    return (*(max(0, round(a + (b - a) * (end - first - n1) / (n2 - n1))) for a, b in zip(m1[:3], m2[:3],
                                                                                         strict=True)), m2[3])


@contextmanager
def sparse_attention_stand_in(layer_class: type, config: ModelConfig, compute: ComputeConfig, batch_size: int,
                              seq_len: int, dtype: torch.dtype, device: str,
                              spans: tuple[tuple[int, int], ...] | None = None) -> Iterator[str]:
    """While inside, the attention of every `layer_class` (NativeSparseAttention) layer is `_SparseAttentionDouble`,
    calibrated for `batch_size` x `seq_len` tokens computing in `dtype` on `device` (call it under FakeTensorMode);
    with `spans`, for each (first, end) span of a sequence shard (context parallelism: the layer calls its attention
    once a span, `span_spec`), told apart by their first position. Yields a one-line description."""
    points = calibration_lengths(config, compute, seq_len) if spans is None else []
    specs = {first: calibrated_spec(layer_class, config, compute, batch_size, end, dtype, device) if first == 0
             else span_spec(layer_class, config, compute, batch_size, first, end, dtype, device)
             for first, end in spans or ((0, seq_len),)}

    def stand_in(*args: object, q_start: int = 0, **kwargs: object) -> Tensor:
        return _SparseAttentionDouble.apply(specs[q_start], *(a for a in args if isinstance(a, Tensor)))

    where = (f"T = {' and '.join(map(str, points))} (fake tensors), "
             f"{'extrapolated linearly in T; ' if len(points) > 1 else ''}") if spans is None else (
        f"each of the rank's spans {', '.join(f'[{a}, {b})' for a, b in spans)} of the sequence (fake tensors, at "
        "most 8 query chunks each, extrapolated linearly in the queries); ")
    with _swapped(layer_class, sparse_attention=stand_in,
                  selection_score_loss=functools.partial(selection_score_loss, peak_only=True)):
        yield (f"NSA, its attention (three gated branches) replaced by a function with the same memory, measured "
               f"on the real one ({'Triton kernels' if compute.triton_kernels else 'explicit path'}, as on CUDA) "
               f"for one layer at {where}projections, compression and gates run as in training (the "
               f"selection-scoring loss, when trained, on the three query chunks that set its peak)")
