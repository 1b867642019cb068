"""Softmax attention that also returns each row's log-sum-exp (lse), forward and backward: the primitive of NSA's
branches (nsa/attention.py) and of document-masked full attention (modeling/attention.py).

`attend`: attention over a key set with an additive mask, returning its output and lse. On CPU tensors it is
PyTorch's fused flash-attention kernel (`aten._scaled_dot_product_flash_attention_for_cpu` and its backward); on
other devices, or within `explicit_attention()`, an explicit computation of the same two results (`fused` decides).
Outputs over disjoint key sets combine through their lse like flash attention's key blocks, and backward needs no
recomputation of the forward: `attend_backward` given the output and lse of a larger attention yields this key set's
share of its gradients (the flash-attention backward identity dS = P * (dO V^T - rowsum(dO * O))).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import Tensor
from torch._subclasses.fake_tensor import is_fake

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
    """Scaled, masked logits (..., L, S) in at least float32, built in one new buffer."""
    acc = torch.promote_types(q.dtype, torch.float32)
    logits = (q.to(acc) * scale) @ k.to(acc).transpose(-1, -2)
    return logits if mask is None else logits.add_(mask)


def _probabilities(q: Tensor, k: Tensor, mask: Tensor | None, lse: Tensor, scale: float) -> Tensor:
    """Attention probabilities exp(logits - lse) (..., L, S) given each row's log-sum-exp lse (..., L)."""
    return _logits(q, k, mask, scale).sub_(lse[..., None]).exp_()


def attend(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale: float) -> tuple[Tensor, Tensor]:
    """Softmax attention of q (N, M, L, D) over k, v (N, M, S, D) under an additive mask broadcastable to
    (N, M, L, S) (q's dtype; None: every key). Every row must see at least one key.

    Returns (out (N, M, L, D) in q's dtype, lse (N, M, L) in at least float32)."""
    if fused(q):
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, False, attn_mask=mask,
                                                                          scale=scale)
    out, lse, _ = attend_explicit(q, k, v, mask, scale)
    return out, lse


def attend_explicit(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale: float
                    ) -> tuple[Tensor, Tensor, Tensor]:
    """`attend` computed explicitly on any device, also returning the probabilities: (out, lse, p (N, M, L, S) in at
    least float32, zero where the mask is -inf)."""
    logits = _logits(q, k, mask, scale)  # (N, M, L, S)
    lse = logits.logsumexp(-1)
    p = logits.sub_(lse[..., None]).exp_()
    return p.to(v.dtype) @ v, lse, p


def attend_backward(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                    mask: Tensor | None, scale: float) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients (dq, dk, dv) of `attend`. With `out` and `lse` those of a larger attention that also covers other
    keys (and grad_out its gradient), the result is this key set's share of the larger attention's gradients."""
    if fused(q):
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_out, q, k, v, out, lse, 0.0, False, attn_mask=mask, scale=scale)
    p = _probabilities(q, k, mask, lse, scale)  # (N, M, L, S)
    dv = p.to(v.dtype).transpose(-1, -2) @ grad_out
    delta = (grad_out * out).sum(-1, keepdim=True).to(p.dtype)  # (N, M, L, 1)
    ds = p.mul_((grad_out @ v.transpose(-1, -2)).to(p.dtype).sub_(delta)).mul_(scale).to(q.dtype)  # dS = P(dP - delta)
    return ds @ k, ds.transpose(-1, -2) @ q, dv


_DOCUMENT_MASK_BYTES = 64 * 2**20  # bytes of one query chunk's mask (or explicit logits) in `document_attention`


def document_attention(q: Tensor, k: Tensor, v: Tensor, starts: Tensor, q_offset: int, scale: float) -> Tensor:
    """Causal attention in which each query sees only the keys from its own start on: query t (at position
    q_offset + t) of row b sees keys s with starts[b, t] <= s <= q_offset + t (a packed document's first position,
    or a left-padded row's first real token). q (B, H, T, D), k, v (B, KV, S, D) with S = q_offset + T (GQA: H a
    multiple of KV), starts (B, T) long, each at most its query's position. Returns (B, H, T, D).

    Queries run in chunks whose mask (or explicit logits) takes about _DOCUMENT_MASK_BYTES, each chunk over the keys
    from its queries' earliest start on (on CPU; from 0 elsewhere, where finding it would wait for the device, and on
    fake tensors); the masks are rebuilt from `starts` in backward, so no (T, S) tensor exists and backward keeps
    q, k, v, the output and its log-sum-exp only."""
    return _DocumentAttention.apply(q, k, v, starts, q_offset, scale)


def _document_chunks(q: Tensor, k: Tensor, starts: Tensor, q_offset: int) -> Iterator[tuple[int, int, int, Tensor]]:
    """(first query, end query, first key, allowed (B, 1, G*Q, S') bool, rows t-major: row t*G + g) of each chunk."""
    B, H, T, _ = q.shape
    G, S = H // k.shape[1], k.shape[2]
    step = max(1, min(T, _DOCUMENT_MASK_BYTES // max(1, 4 * G * S * B)))
    for c0 in range(0, T, step):
        c1 = min(c0 + step, T)
        low = int(starts[:, c0:c1].min()) if starts.device.type == "cpu" and not is_fake(starts) else 0
        keys = torch.arange(low, q_offset + c1, device=q.device)  # (S',)
        queries = torch.arange(q_offset + c0, q_offset + c1, device=q.device)  # (Q,)
        allowed = (keys >= starts[:, c0:c1, None]) & (keys <= queries[:, None])  # (B, Q, S')
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
    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, starts: Tensor, q_offset: int, scale: float) -> Tensor:
        G = q.shape[1] // k.shape[1]
        out = torch.empty_like(q)  # (B, H, T, D)
        lse = q.new_empty(q.shape[:3], dtype=torch.promote_types(q.dtype, torch.float32))  # (B, H, T)
        for c0, c1, low, allowed in _document_chunks(q, k, starts, q_offset):
            hi = q_offset + c1
            o, l = attend(_rows(q[:, :, c0:c1], G), k[:, :, low:hi], v[:, :, low:hi], additive_mask(allowed, q.dtype),
                          scale)
            out[:, :, c0:c1], lse[:, :, c0:c1] = _heads(o, G), _heads(l, G)
        ctx.save_for_backward(q, k, v, starts, out, lse)
        ctx.q_offset, ctx.scale = q_offset, scale
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor) -> tuple[Tensor | None, ...]:
        q, k, v, starts, out, lse = ctx.saved_tensors
        G = q.shape[1] // k.shape[1]
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        for c0, c1, low, allowed in _document_chunks(q, k, starts, ctx.q_offset):
            hi = ctx.q_offset + c1
            rows = [_rows(t[:, :, c0:c1].contiguous(), G) for t in (grad_out, q, out)]
            dq_c, dk_c, dv_c = attend_backward(rows[0], rows[1], k[:, :, low:hi], v[:, :, low:hi], rows[2],
                                               _rows(lse[:, :, c0:c1, None], G)[..., 0],
                                               additive_mask(allowed, q.dtype), ctx.scale)
            dq[:, :, c0:c1] = _heads(dq_c, G)
            dk[:, :, low:hi] += dk_c
            dv[:, :, low:hi] += dv_c
        return dq, dk, dv, None, None, None
