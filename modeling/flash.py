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
