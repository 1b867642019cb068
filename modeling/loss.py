"""Language-model loss: next-token cross-entropy from hidden states and the output weight.

Notation: B batch, T sequence length, N = B*T tokens, C model width, V vocabulary size, c rows in one chunk.

Two paths compute the same loss (sum of per-token cross-entropy over non-ignored targets, divided once by the
number of non-ignored targets or by a given normalizer) and the same gradients:

- `standard_linear_cross_entropy` materialises the (N, V) logits and lets autograd differentiate them. It is the
  reference, and what the model uses while the logits are small.
- `chunked_linear_cross_entropy` never holds more than one (c, V) block of logits, in forward or in backward. It is
  a custom autograd.Function that computes the gradients of hidden and weight chunk by chunk during forward
  (3 GEMMs, like the plain path) and only scales them by grad_output in backward.

Why not a Python loop of "lm_head + cross-entropy" per chunk: autograd keeps what each chunk's softmax saves for
backward until backward runs, so such a loop keeps all N x V of it (see tests/test_loss.py, saved-tensor bytes).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

IGNORE_INDEX = -100


def shift_labels(labels: Tensor, ignore_index: int = IGNORE_INDEX) -> Tensor:
    """Targets for next-token prediction: position t of the result holds labels[t + 1]; the last is ignored.

    Shifting the labels (not the hidden states) keeps hidden states contiguous and never mixes rows of a batch.
    labels: (B, T) long. Returns (B, T) long.
    """
    pad = labels.new_full((labels.shape[0], 1), ignore_index)  # (B, 1)
    return torch.cat([labels[:, 1:], pad], dim=1)  # (B, T)


def loss_normalizer(targets: Tensor, ignore_index: int = IGNORE_INDEX) -> Tensor:
    """Number of non-ignored targets as a float32 tensor, at least 1 (so an all-ignored batch gives loss 0, not NaN)."""
    return (targets != ignore_index).sum().clamp(min=1).float()


def softcap_logits(logits: Tensor, softcap: float | None) -> Tensor:
    """Soft-capping `softcap * tanh(logits / softcap)` (Gemma 2); identity when softcap is None."""
    if softcap is None:
        return logits
    return softcap * torch.tanh(logits / softcap)


def cross_entropy_sum(
    logits: Tensor, targets: Tensor, *, ignore_index: int = IGNORE_INDEX, z_loss_coef: float = 0.0
) -> Tensor:
    """Sum over non-ignored rows of cross-entropy (+ z_loss_coef * logsumexp^2), in float32 (float64 stays float64).

    logits: (N, V) already soft-capped, any float dtype. targets: (N,) long. Returns a float32 (or float64) scalar.
    """
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    loss = F.cross_entropy(logits, targets, ignore_index=ignore_index, reduction="sum")
    if z_loss_coef:
        lse = torch.logsumexp(logits, dim=-1)  # (N,)
        loss = loss + z_loss_coef * (lse.square() * (targets != ignore_index)).sum()
    return loss


def _check_inputs(hidden: Tensor, weight: Tensor, targets: Tensor) -> None:
    """ValueError (before anything large is allocated) unless hidden (N, C), weight (V, C), targets (N,) long."""
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"need hidden (N, C) and weight (V, C) with the same C; got hidden {tuple(hidden.shape)}, "
                         f"weight {tuple(weight.shape)}")
    if targets.shape != hidden.shape[:1] or targets.dtype != torch.long:
        raise ValueError(f"targets must be a long tensor of shape ({hidden.shape[0]},), got {tuple(targets.shape)} "
                         f"{targets.dtype}")
    if hidden.dtype != weight.dtype or not hidden.is_floating_point():
        raise ValueError(f"hidden and weight need the same floating dtype, got {hidden.dtype} and {weight.dtype}")


def _as_normalizer(normalizer: Tensor | float | None, targets: Tensor, ignore_index: int) -> Tensor:
    """The divisor of the summed loss as a float32 scalar tensor on targets' device (never a host sync)."""
    if normalizer is None:
        return loss_normalizer(targets, ignore_index)
    return torch.as_tensor(normalizer, dtype=torch.float32, device=targets.device).detach()


def standard_linear_cross_entropy(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    *,
    ignore_index: int = IGNORE_INDEX,
    z_loss_coef: float = 0.0,
    softcap: float | None = None,
    normalizer: Tensor | float | None = None,
) -> tuple[Tensor, Tensor]:
    """Plain loss: full logits, then cross-entropy; the reference every other path must match.

    hidden: (N, C) or (B, T, C); weight: (V, C); targets: (N,) or (B, T), already shifted. `normalizer` divides
    the summed loss (default: the number of non-ignored targets). Returns (loss float32 scalar, logits (N, V) or
    (B, T, V) in hidden's dtype, or float32 when soft-capped). The logits are returned as their own tensor, not a
    view, so an FSDP2 root module can return them.
    """
    flat_targets = targets.flatten()  # (N,)
    _check_inputs(hidden.flatten(0, -2), weight, flat_targets)
    logits = hidden @ weight.t()  # (..., V)
    if softcap is not None:
        logits = softcap_logits(logits.float(), softcap)  # capped in float32
    normalizer = _as_normalizer(normalizer, flat_targets, ignore_index)
    loss = cross_entropy_sum(logits.flatten(0, -2), flat_targets, ignore_index=ignore_index,
                             z_loss_coef=z_loss_coef) / normalizer
    return loss, logits


# ---- chunked path ------------------------------------------------------------------------------------------------


def _chunk_loss_and_grad(
    logits: Tensor, targets: Tensor, row_scale: Tensor, *, ignore_index: int, z_loss_coef: float,
    softcap: float | None, need_grad: bool,
) -> tuple[Tensor, Tensor | None]:
    """Loss and d(loss)/d(logits) for one chunk, working in place on `logits` (c, V) in the accumulation dtype.

    targets: (c,) long. row_scale: (c,) = 1/normalizer for non-ignored rows, 0 for ignored ones.
    Returns (summed loss of the non-ignored rows, unnormalised; grad (c, V) = row_scale * d(row loss)/d(logits),
    which reuses `logits`' storage, or None when not `need_grad`).
    With z the (soft-capped) logits, p = softmax(z), lse = logsumexp(z), y the target:
        row loss = lse - z_y + z_loss_coef * lse^2
        d(row loss)/dz = (1 + 2 * z_loss_coef * lse) * p - onehot(y);   dz/dlogits = 1 - tanh^2(logits / softcap)
    """
    valid = targets != ignore_index  # (c,)
    safe_targets = torch.where(valid, targets, 0)[:, None]  # (c, 1): any in-range index for ignored rows
    tanh = None
    if softcap is not None:
        tanh = logits.div_(softcap).tanh_()  # (c, V) tanh(logits / softcap), in place
        z = tanh * softcap if need_grad else tanh.mul_(softcap)  # (c, V); tanh is kept for the chain rule
    else:
        z = logits
    z_target = z.gather(1, safe_targets).squeeze(1)  # (c,)
    z_max = z.amax(dim=1, keepdim=True)  # (c, 1)
    exp = z.sub_(z_max).exp_()  # (c, V) exp(z - max), in place
    sum_exp = exp.sum(dim=1, keepdim=True)  # (c, 1)
    lse = (z_max + sum_exp.log()).squeeze(1)  # (c,) float32 (or float64)
    row_loss = lse - z_target + z_loss_coef * lse.square()  # (c,)
    loss = torch.where(valid, row_loss, 0.0).sum()
    if not need_grad:
        return loss, None
    grad = exp.div_(sum_exp)  # (c, V) softmax, in place
    grad.mul_((row_scale * (1.0 + 2.0 * z_loss_coef * lse))[:, None])
    grad.scatter_add_(1, safe_targets, -row_scale[:, None])  # minus the one-hot (zero for ignored rows)
    if tanh is not None:
        grad.mul_(tanh.square_().neg_().add_(1.0))  # (1 - tanh^2), in place on the tanh buffer
    return loss, grad


def _chunked_forward(
    hidden: Tensor, weight: Tensor, targets: Tensor, normalizer: Tensor, *, chunk_size: int, ignore_index: int,
    z_loss_coef: float, softcap: float | None, need_grad_hidden: bool, need_grad_weight: bool,
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """The chunk loop. Returns (loss scalar in the accumulation dtype, grad_hidden (N, C) in hidden's dtype or None,
    grad_weight (V, C) in the accumulation dtype or None), both gradients for grad_output = 1.

    Matmuls keep hidden's dtype (bf16 operands, float32 accumulation inside the GEMM); each chunk's logits are
    upcast to the accumulation dtype (float32, or float64 for float64 inputs) for softmax and logsumexp, and the
    weight gradient is accumulated across chunks in that dtype.
    """
    N = hidden.shape[0]
    acc_dtype = torch.promote_types(hidden.dtype, torch.float32)
    need_grad = need_grad_hidden or need_grad_weight
    grad_hidden = torch.empty_like(hidden) if need_grad_hidden else None  # (N, C)
    grad_weight = torch.zeros_like(weight, dtype=acc_dtype) if need_grad_weight else None  # (V, C)
    row_scale_all = (targets != ignore_index).to(acc_dtype) / normalizer  # (N,)
    loss = hidden.new_zeros((), dtype=acc_dtype)
    for start in range(0, N, chunk_size):
        end = min(start + chunk_size, N)
        h = hidden[start:end]  # (c, C)
        logits = (h @ weight.t()).to(acc_dtype)  # (c, V)
        chunk_loss, grad = _chunk_loss_and_grad(
            logits, targets[start:end], row_scale_all[start:end], ignore_index=ignore_index,
            z_loss_coef=z_loss_coef, softcap=softcap, need_grad=need_grad)
        del logits
        loss = loss + chunk_loss
        if grad is None:
            continue
        grad = grad.to(hidden.dtype)  # (c, V) matmul operand in the compute dtype
        if grad_hidden is not None:
            torch.mm(grad, weight, out=grad_hidden[start:end])  # (c, C)
        if grad_weight is not None:
            if grad_weight.dtype == grad.dtype:
                grad_weight.addmm_(grad.t(), h)  # (V, C)
            else:
                grad_weight.add_(grad.t() @ h)  # (V, C) bf16 product, accumulated in float32
        del grad  # free this chunk's gradient before the next chunk's logits exist
    return loss / normalizer, grad_hidden, grad_weight


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """Gradients computed in forward, chunk by chunk; backward only multiplies them by grad_output."""

    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, targets: Tensor, normalizer: Tensor, chunk_size: int,
                ignore_index: int, z_loss_coef: float, softcap: float | None) -> Tensor:
        need_grad_hidden, need_grad_weight = ctx.needs_input_grad[:2]
        loss, grad_hidden, grad_weight = _chunked_forward(
            hidden, weight, targets, normalizer, chunk_size=chunk_size, ignore_index=ignore_index,
            z_loss_coef=z_loss_coef, softcap=softcap, need_grad_hidden=need_grad_hidden,
            need_grad_weight=need_grad_weight)
        ctx.save_for_backward(grad_hidden, grad_weight)
        ctx.weight_dtype = weight.dtype
        return loss

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_output: Tensor) -> tuple[Tensor | None, ...]:
        # Out of place, so backward through a retained graph can run again (gradcheck does); the copies fit under
        # the forward peak (one (c, V) float32 buffer is larger than grad_hidden + grad_weight for long sequences).
        grad_hidden, grad_weight = ctx.saved_tensors
        if grad_hidden is not None:
            grad_hidden = grad_hidden * grad_output.to(grad_hidden.dtype)
        if grad_weight is not None:
            grad_weight = (grad_weight * grad_output.to(grad_weight.dtype)).to(ctx.weight_dtype)
        return grad_hidden, grad_weight, None, None, None, None, None, None


def chunked_linear_cross_entropy(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    *,
    chunk_size: int = 4096,
    ignore_index: int = IGNORE_INDEX,
    z_loss_coef: float = 0.0,
    softcap: float | None = None,
    normalizer: Tensor | float | None = None,
) -> Tensor:
    """Same loss and gradients as `standard_linear_cross_entropy`, never holding more than one chunk of logits.

    Args:
        hidden: `(N, C)` final hidden states (rows of every batch element, flattened after the label shift).
        weight: `(V, C)` output weight, the live parameter (tied or not; under FSDP2, read inside the root
            module's forward so it is the unsharded parameter), same dtype as hidden.
        targets: `(N,)` long, already shifted; `ignore_index` entries do not count.
        chunk_size: rows per chunk; the last chunk may be shorter.
        z_loss_coef: adds `z_loss_coef * logsumexp^2` per non-ignored row.
        softcap: logits become `softcap * tanh(logits / softcap)` before the softmax (None: off).
        normalizer: divides the summed loss (default: number of non-ignored targets, at least 1; pass the global
            count across micro-batches / ranks for gradient accumulation). Treated as a constant.
    Returns:
        float32 scalar loss (float64 for float64 inputs). An all-ignored batch gives 0, still connected to the
        graph (zero gradients).

    Design: a custom autograd.Function that computes d(loss)/d(hidden) and d(loss)/d(weight) chunk by chunk during
    forward: per chunk one GEMM for the logits, softmax/logsumexp in float32 in place, and two GEMMs for the
    gradients, i.e. the plain path's 3 GEMMs with no recompute. Backward only scales the stored gradients by
    grad_output (so any grad_output works). Kept for backward: grad_hidden (N, C) and a float32 grad_weight (V, C);
    live during forward, beyond those: one float32 (c, V) logits/gradient buffer plus its cast to the compute dtype
    (one more float32 (c, V) buffer with softcap). Gradients are computed only for inputs that require them, and
    none at all under no_grad. Measured (benchmarks/results/chunked-loss.md, "Chunked loss"): fwd+bwd time 0.6-0.7x
    the plain path's on CPU float32 (C=128, V=151,936); fwd+bwd peak beyond the inputs at 131,072 x 2560,
    V=151,936, bf16, chunk 4096: 5.55 GiB vs 222.56 GiB for the plain path (FakeTensorMode, verify_chunked_loss.py).
    Not supported: double backward (create_graph=True). No host syncs in the chunk loop.
    """
    _check_inputs(hidden, weight, targets)
    if not isinstance(chunk_size, int) or chunk_size <= 0:
        raise ValueError(f"chunk_size must be a positive integer, got {chunk_size!r}")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap must be None or positive, got {softcap}")
    _check_not_sharded(weight)
    normalizer = _as_normalizer(normalizer, targets, ignore_index)
    z_loss_coef = float(z_loss_coef)
    if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
        return _ChunkedLinearCrossEntropy.apply(hidden, weight, targets, normalizer, chunk_size, ignore_index,
                                                z_loss_coef, softcap)
    loss, _, _ = _chunked_forward(hidden, weight, targets, normalizer, chunk_size=chunk_size,
                                  ignore_index=ignore_index, z_loss_coef=z_loss_coef, softcap=softcap,
                                  need_grad_hidden=False, need_grad_weight=False)
    return loss


def _check_not_sharded(weight: Tensor) -> None:
    """A DTensor here is an FSDP2 shard read outside the root module's forward: a silent wrong answer otherwise."""
    if torch.distributed.is_available():
        from torch.distributed.tensor import DTensor

        if isinstance(weight, DTensor):
            raise ValueError("the output weight is a sharded DTensor: compute the loss inside the FSDP-wrapped "
                             "model's forward (Transformer.compute_loss), where the parameter is unsharded")
