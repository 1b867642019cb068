"""Softmax attention that also returns each row's log-sum-exp (lse), forward and backward: the primitive of NSA's
branches (nsa/attention.py) and of document-masked full attention (modeling/attention.py).

`attend`: attention over a key set with an additive mask, returning its output and lse. On CPU tensors it is
PyTorch's fused flash-attention kernel (`aten._scaled_dot_product_flash_attention_for_cpu` and its backward); on
other devices, or within `explicit_attention()`, an explicit computation of the same two results (`fused` decides).
Outputs over disjoint key sets combine through their lse like flash attention's key blocks, and backward needs no
recomputation of the forward: `attend_backward` given the output and lse of a larger attention yields this key set's
share of its gradients (the flash-attention backward identity dS = P * (dO V^T - rowsum(dO * O))).

`document_attention`: causal attention in which each query sees only its own packed document (or a left-padded
row's real tokens), chunk by chunk with no (T, T) mask; `packed_attention` the same on PyTorch's flash varlen
kernel, each document one sequence of it (CUDA, half precision: `varlen_ready`).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext

import torch
from torch import Tensor
from torch._subclasses.fake_tensor import is_fake

try:  # PyTorch's flash-attention kernel over variable-length sequences (CUDA)
    from torch.nn.attention.varlen import varlen_attn
except ImportError:  # an older PyTorch: documents run on `document_attention`
    varlen_attn = None

_explicit = [False]  # set by `explicit_attention`


@contextmanager
def explicit_attention() -> Iterator[None]:
    """Within the block, `attend` computes explicitly on every device, as it does on CUDA: for tests of that path
    and for profile_memory.py's estimates of GPU runs (the fused CPU kernels keep no chunk-sized logits)."""
    previous, _explicit[0] = _explicit[0], True
    try:
        yield
    finally:
        _explicit[0] = previous


def fused(t: Tensor) -> bool:
    """Whether `attend` uses PyTorch's fused CPU flash-attention kernels (CPU tensors, fake ones included) rather
    than the explicit computation (every other device)."""
    return t.device.type == "cpu" and not _explicit[0]


def additive_mask(allowed: Tensor, dtype: torch.dtype) -> Tensor:
    """Boolean mask -> additive mask (0 where allowed, -inf elsewhere) in `dtype`."""
    zero, minus_inf = (torch.tensor(v, dtype=dtype, device=allowed.device) for v in (0.0, -math.inf))
    return torch.where(allowed, zero, minus_inf)


def _logits(q: Tensor, k: Tensor, mask: Tensor | None, scale: float) -> Tensor:
    """Scaled, masked logits (..., L, S) in at least float32, built in one new buffer; autocast is off for the
    product (a bf16 autocast would round it, and backward, outside autocast, rebuilds it in float32 against its
    log-sum-exp)."""
    acc = torch.promote_types(q.dtype, torch.float32)
    with torch.autocast(q.device.type, enabled=False) if q.device.type in ("cpu", "cuda") else nullcontext():
        logits = (q.to(acc) * scale) @ k.to(acc).transpose(-1, -2)
    return logits if mask is None else logits.add_(mask)


def _probabilities(q: Tensor, k: Tensor, mask: Tensor | None, lse: Tensor, scale: float) -> Tensor:
    """Attention probabilities exp(logits - lse) (..., L, S) given each row's log-sum-exp lse (..., L)."""
    return _logits(q, k, mask, scale).sub_(lse[..., None]).exp_()


def attend(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale: float, causal: bool = False
           ) -> tuple[Tensor, Tensor]:
    """Softmax attention of q (N, M, L, D) over k, v (N, M, S, D) under an additive mask broadcastable to
    (N, M, L, S) (q's dtype; None: every key), or with `causal` (and no mask; L == S) row i over keys 0..i. Every
    row must see at least one key.

    Returns (out (N, M, L, D) in q's dtype, lse (N, M, L) in at least float32)."""
    if causal and q.shape[-2] != k.shape[-2]:
        raise ValueError(f"attend: a causal call needs as many keys as queries, got {k.shape[-2]} and {q.shape[-2]}")
    if fused(q):
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, attn_mask=mask,
                                                                          scale=scale)
    out, lse, _ = attend_explicit(q, k, v, _causal_mask(q, mask) if causal else mask, scale)
    return out, lse


def _causal_mask(q: Tensor, mask: Tensor | None) -> Tensor:
    """The additive causal mask (L, L) of q (..., L, D); `attend` takes it or a mask, not both."""
    if mask is not None:
        raise ValueError("attend: a causal call takes no mask")
    rows = torch.arange(q.shape[-2], device=q.device)  # the caller's keys are as many as its queries (L == S)
    return additive_mask(rows <= rows[:, None], q.dtype)


def attend_explicit(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale: float
                    ) -> tuple[Tensor, Tensor, Tensor]:
    """`attend` computed explicitly on any device, also returning the probabilities: (out, lse, p (N, M, L, S) in at
    least float32, zero where the mask is -inf)."""
    logits = _logits(q, k, mask, scale)  # (N, M, L, S)
    lse = logits.logsumexp(-1)
    p = logits.sub_(lse[..., None]).exp_()
    return p.to(v.dtype) @ v, lse, p


def attend_backward(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                    mask: Tensor | None, scale: float, causal: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients (dq, dk, dv) of `attend`. With `out` and `lse` those of a larger attention that also covers other
    keys (and grad_out its gradient), the result is this key set's share of the larger attention's gradients."""
    if fused(q):
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_out, q, k, v, out, lse, 0.0, causal, attn_mask=mask, scale=scale)
    p = _probabilities(q, k, _causal_mask(q, mask) if causal else mask, lse, scale)  # (N, M, L, S)
    dv = p.to(v.dtype).transpose(-1, -2) @ grad_out
    delta = (grad_out * out).sum(-1, keepdim=True).to(p.dtype)  # (N, M, L, 1)
    ds = p.mul_((grad_out @ v.transpose(-1, -2)).to(p.dtype).sub_(delta)).mul_(scale).to(q.dtype)  # dS = P(dP - delta)
    return ds @ k, ds.transpose(-1, -2) @ q, dv


_DOCUMENT_MASK_BYTES = 64 * 2**20  # bytes of one query chunk's float32 (Q*H, S) mask or explicit logits
_DOCUMENT_CHUNK = 256  # queries per chunk at most: a chunk reads keys up to its last query, so causal work is kept


def document_attention(q: Tensor, k: Tensor, v: Tensor, starts: Tensor | None, q_offset: int, scale: float
                       ) -> Tensor:
    """Causal attention in which each query sees only the keys from its own start on: query t (at position
    q_offset + t) of row b sees keys s with starts[b, t] <= s <= q_offset + t (a packed document's first position,
    or a left-padded row's first real token). q (B, H, T, D), k, v (B, KV, S, D) with S = q_offset + T (GQA: H a
    multiple of KV), starts (B, T) long, each at most its query's position; None: every key from 0 (the queries
    continue q_offset earlier positions: one chunk, no mask). Returns (B, H, T, D).

    Queries run in chunks of at most _DOCUMENT_CHUNK whose mask (or explicit logits) takes at most
    _DOCUMENT_MASK_BYTES, each chunk over the keys up to its last query (so the work stays about causal attention's)
    and from its queries' earliest start on (on CPU; from 0 elsewhere, where finding it would wait for the device,
    and on fake tensors); a chunk inside one document needs no mask at all. Masks are rebuilt from `starts` in
    backward, so no (T, S) tensor exists and backward keeps q, k, v, the output and its log-sum-exp only."""
    return _DocumentAttention.apply(q, k, v, starts, q_offset, scale)


def varlen_ready(q: Tensor) -> bool:
    """Whether `packed_attention` runs for q (B, H, T, D): PyTorch's flash varlen kernel takes CUDA tensors in half
    precision on an sm_80 or newer GPU, head dimensions up to 256 in multiples of 8 (not fake tensors:
    profile_memory.py's estimate takes `document_attention`'s chunks, an upper bound)."""
    D = q.shape[-1]
    return (varlen_attn is not None and q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and not is_fake(q)
            and not _explicit[0] and D <= 256 and D % 8 == 0 and torch.cuda.get_device_capability(q.device) >= (8, 0))


def packed_attention(q: Tensor, k: Tensor, v: Tensor, spans: list[list[tuple[int, int]]], scale: float) -> Tensor:
    """Causal attention of q (B, H, T, D) over k, v (B, KV, T, D) (GQA: H a multiple of KV) inside each document of
    `spans` (each row's (first, end) position pairs, `modeling.documents.document_spans`): the B rows' documents are
    the sequences of one call of PyTorch's flash varlen kernel, with no mask and no padding. Returns (B, H, T, D)
    as a view of a (B, T, H, D) tensor (the layout full attention's output is read in); its backward is the
    kernel's."""
    B, H, T, D = q.shape
    firsts = [b * T + first for b, row in enumerate(spans) for first, _ in row]
    cu = torch.tensor([*firsts, B * T], dtype=torch.int32).to(q.device, non_blocking=True)  # (N + 1,)
    longest = max(end - first for row in spans for first, end in row)

    def packed(x: Tensor) -> Tensor:  # (B, X, T, D) -> (B*T, X, D): a view in attention's (B, T, X, D) layout
        return x.transpose(1, 2).reshape(B * T, x.shape[1], D)

    out = varlen_attn(packed(q), packed(k), packed(v), cu, cu, longest, longest, scale=scale, window_size=(-1, 0),
                      enable_gqa=k.shape[1] != H)  # (B*T, H, D)
    return out.view(B, T, H, D).transpose(1, 2)


def _document_chunks(q: Tensor, k: Tensor, starts: Tensor | None, q_offset: int
                     ) -> Iterator[tuple[int, int, int, Tensor | None]]:
    """(first query, end query, first key, allowed) of each chunk: allowed (B, 1, Q*G, S') bool, rows t-major (row
    t*G + g), or None when every query of the chunk starts at its first key (one document over the chunk: it then
    runs as unmasked past keys and a causal square, `_DocumentAttention._parts`)."""
    B, H, T, _ = q.shape
    if starts is None:  # every query from key 0: the keys before the queries unmasked, and a causal square
        yield 0, T, 0, None
        return
    G, S = H // k.shape[1], k.shape[2]
    step = max(1, min(T, _DOCUMENT_CHUNK, _DOCUMENT_MASK_BYTES // max(1, 4 * H * S * B)))  # float32 (Q*H, S)
    host = starts.device.type == "cpu" and not is_fake(starts)
    for c0 in range(0, T, step):
        c1 = min(c0 + step, T)
        chunk = starts[:, c0:c1]  # (B, Q)
        low = int(chunk.min()) if host else 0
        if host and bool((chunk == low).all()):
            yield c0, c1, low, None
            continue
        keys = torch.arange(low, q_offset + c1, device=q.device)  # (S',)
        queries = torch.arange(q_offset + c0, q_offset + c1, device=q.device)  # (Q,)
        allowed = (keys >= chunk[:, :, None]) & (keys <= queries[:, None])  # (B, Q, S')
        yield c0, c1, low, allowed.repeat_interleave(G, dim=1)[:, None]  # (B, 1, Q*G, S')


def _rows(x: Tensor, G: int) -> Tensor:
    """(B, H, Q, D) -> (B, KV, Q*G, D): each K/V head's G query heads as rows, t-major."""
    B, H, Q, D = x.shape
    return x.reshape(B, H // G, G, Q, D).transpose(2, 3).reshape(B, H // G, Q * G, D)


def _heads(x: Tensor, G: int) -> Tensor:
    """The inverse of `_rows` for x (B, KV, Q*G, ...) -> (B, KV*G, Q, ...)."""
    B, KV, QG = x.shape[:3]
    return x.reshape(B, KV, QG // G, G, *x.shape[3:]).transpose(2, 3).reshape(B, KV * G, QG // G, *x.shape[3:])


class _DocumentAttention(torch.autograd.Function):
    """`document_attention`. A masked chunk attends its key range under its mask, heads folded into rows; a chunk
    inside one document attends the keys before it without a mask (rows) and itself causally (heads, the square's
    K/V repeated per head), the two merged through their log-sum-exp as flash attention's key blocks."""

    @staticmethod
    def _parts(q: Tensor, k: Tensor, v: Tensor, c0: int, c1: int, low: int, allowed: Tensor | None, q_offset: int
               ) -> list[tuple[Tensor, Tensor, Tensor, Tensor | None, bool, int, int]]:
        """(q, k, v, mask, causal, first key, end key) of each attention of a chunk; q, k, v as `attend` takes them:
        heads folded into rows (t-major) unless causal."""
        G, first, hi = q.shape[1] // k.shape[1], q_offset + c0, q_offset + c1
        if allowed is not None:
            return [(_rows(q[:, :, c0:c1], G), k[:, :, low:hi], v[:, :, low:hi], additive_mask(allowed, q.dtype),
                     False, low, hi)]
        square = [(q[:, :, c0:c1], k[:, :, first:hi].repeat_interleave(G, 1), v[:, :, first:hi].repeat_interleave(G, 1),
                   None, True, first, hi)]
        past = [(_rows(q[:, :, c0:c1], G), k[:, :, low:first], v[:, :, low:first], None, False, low, first)]
        return (past if low < first else []) + square

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, starts: Tensor | None, q_offset: int, scale: float) -> Tensor:
        G = q.shape[1] // k.shape[1]
        out = torch.empty_like(q)  # (B, H, T, D)
        lse = q.new_empty(q.shape[:3], dtype=torch.promote_types(q.dtype, torch.float32))  # (B, H, T)
        for c0, c1, low, allowed in _document_chunks(q, k, starts, q_offset):
            results = []
            for qp, kp, vp, mask, causal, _, _ in _DocumentAttention._parts(q, k, v, c0, c1, low, allowed, q_offset):
                o, l = attend(qp, kp, vp, mask, scale, causal)
                results.append((o, l) if causal else (_heads(o, G), _heads(l, G)))  # (B, H, Q, D), (B, H, Q)
            total = torch.logaddexp(results[0][1], results[1][1]) if len(results) == 2 else results[0][1]
            lse[:, :, c0:c1] = total
            out[:, :, c0:c1] = sum((o * (l - total).exp()[..., None].to(o.dtype) for o, l in results)
                                   ) if len(results) == 2 else results[0][0]
        ctx.save_for_backward(q, k, v, starts, out, lse)
        ctx.q_offset, ctx.scale = q_offset, scale
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor) -> tuple[Tensor | None, ...]:
        q, k, v, starts, out, lse = ctx.saved_tensors
        G, KV = q.shape[1] // k.shape[1], k.shape[1]
        acc = torch.promote_types(q.dtype, torch.float32)  # a key's gradient sums one part per later chunk
        dq, dk, dv = (torch.zeros_like(t, dtype=acc) for t in (q, k, v))
        for c0, c1, low, allowed in _document_chunks(q, k, starts, ctx.q_offset):
            for qp, kp, vp, mask, causal, k0, k1 in _DocumentAttention._parts(q, k, v, c0, c1, low, allowed,
                                                                               ctx.q_offset):
                g, o, l = (t[:, :, c0:c1] for t in (grad_out, out, lse))
                if not causal:
                    g, o, l = _rows(g, G), _rows(o, G), _rows(l[..., None], G)[..., 0]
                dq_p, dk_p, dv_p = attend_backward(g.contiguous(), qp, kp, vp, o.contiguous(), l.contiguous(), mask,
                                                   ctx.scale, causal)
                if causal:  # (B, H, Q, D): the square's keys were repeated per head
                    dq[:, :, c0:c1] += dq_p
                    dk[:, :, k0:k1] += dk_p.unflatten(1, (KV, G)).sum(2)
                    dv[:, :, k0:k1] += dv_p.unflatten(1, (KV, G)).sum(2)
                else:
                    dq[:, :, c0:c1] += _heads(dq_p, G)
                    dk[:, :, k0:k1] += dk_p
                    dv[:, :, k0:k1] += dv_p
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None
