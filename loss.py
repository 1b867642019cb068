"""Language-model loss: next-token cross-entropy from hidden states and the output weight.

Notation: B batch, T sequence length, N = B*T tokens, C model width, V vocabulary size.

`standard_linear_cross_entropy` is the plain path: it materialises the (N, V) logits.
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

    hidden: (N, C); weight: (V, C); targets: (N,) already shifted. `normalizer` divides the summed loss
    (default: the number of non-ignored targets). Returns (loss float32 scalar, logits (N, V) in hidden's dtype,
    or float32 when soft-capped).
    """
    logits = hidden @ weight.t()  # (N, V)
    if softcap is not None:
        logits = softcap_logits(logits.float(), softcap)  # capped in float32
    if normalizer is None:
        normalizer = loss_normalizer(targets, ignore_index)
    loss = cross_entropy_sum(logits, targets, ignore_index=ignore_index, z_loss_coef=z_loss_coef) / normalizer
    return loss, logits
