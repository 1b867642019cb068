"""Equivalence objective: teach converted layers to reproduce the original model.

The teacher is the same model with its converted layers in "original" mode (no second copy of the weights). The loss
of a batch is

    mse_weight * mean over converted layers of MSE(converted layer output, original layer output)
  + kl_weight  * mean over tokens of KL(original next-token distribution || converted one)
  + l2_weight  * mean over converted layers and tokens of ||dW(token)||_F^2      (the modulation's size)

The KL is computed over token chunks, each recomputed in backward, so at most one chunk of logits is alive.

Notation: B batch, T tokens, N = B * T, C model width, V vocabulary, P targets, r rank.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from model import Transformer
from modeling.loss import softcap_logits
from npt.convert import capture_outputs, np_blocks, using_mode


class EquivalenceLoss(NamedTuple):
    total: Tensor  # weighted sum, float32 scalar (the one to backpropagate)
    mse: Tensor  # per-layer output MSE, mean over converted layers
    kl: Tensor  # KL(original || converted) per token
    l2: Tensor  # ||dW||_F^2 per token and layer


def _kl_sum(hidden: Tensor, teacher_hidden: Tensor, weight: Tensor, softcap: float | None) -> Tensor:
    """Sum over rows of KL(softmax(teacher logits) || softmax(logits)); hidden, teacher_hidden (n, C), weight (V, C)."""
    log_q = softcap_logits((hidden @ weight.t()).float(), softcap).log_softmax(-1)  # (n, V)
    log_p = softcap_logits((teacher_hidden @ weight.t()).float(), softcap).log_softmax(-1)  # (n, V)
    return F.kl_div(log_q, log_p, log_target=True, reduction="sum")


def logits_kl(hidden: Tensor, teacher_hidden: Tensor, weight: Tensor, softcap: float | None = None,
              chunk_size: int = 1024) -> Tensor:
    """Mean over tokens of KL(teacher || student) of the next-token distributions, float32 scalar.

    hidden: `(B, T, C)` final-norm hidden states of the converted model; teacher_hidden: the same of the original
    model (no gradient); weight: `(V, C)` output projection. Each chunk of `chunk_size` tokens is checkpointed, so
    only one chunk's `(chunk, V)` logits exist at a time, in forward and in backward.
    """
    C = hidden.shape[-1]
    h, t = hidden.reshape(-1, C), teacher_hidden.reshape(-1, C)  # (N, C)
    total = hidden.new_zeros((), dtype=torch.float32)
    for hc, tc in zip(h.split(chunk_size), t.split(chunk_size), strict=True):
        total = total + checkpoint(_kl_sum, hc, tc, weight, softcap, use_reentrant=False)
    return total / h.shape[0]


def equivalence_loss(model: Transformer, input_ids: Tensor, mse_weight: float = 1.0, kl_weight: float = 1.0,
                     l2_weight: float = 1e-4, kl_chunk_size: int = 1024) -> EquivalenceLoss:
    """The equivalence loss of a batch `input_ids` (B, T) for a model with converted layers (see module doc)."""
    blocks = np_blocks(model)
    if not blocks:
        raise ValueError("the model has no converted layers (npt.convert first)")
    with torch.no_grad(), using_mode(model, "original"), capture_outputs(blocks) as teacher:
        teacher_hidden = model.hidden_states(input_ids)  # (B, T, C)
    with capture_outputs(blocks) as student, capture_outputs({i: b.np for i, b in blocks.items()}) as coefs:
        hidden = model.hidden_states(input_ids)  # (B, T, C)
    mse = torch.stack([F.mse_loss(student[i].float(), teacher[i].float()) for i in blocks]).mean()
    kl = logits_kl(hidden, teacher_hidden, model.output_weight, model.config.logit_softcap, kl_chunk_size)
    l2 = torch.stack([b.np.delta_sq_norm(coefs[i]).mean() for i, b in blocks.items()]).mean()
    total = mse_weight * mse + kl_weight * kl + l2_weight * l2
    return EquivalenceLoss(total, mse.detach(), kl.detach(), l2.detach())
