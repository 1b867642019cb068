"""Native Sparse Attention written straight from the paper, one query at a time: read this first.

`naive_nsa` is what `nsa.attention.sparse_attention` computes, without any of its machinery (chunks, tiles, fused
kernels, log-sum-exp merges, custom backward). It loops over batch, query position and key/value head, so it is
only for short sequences: the tests use it as the oracle of the fast paths, in float64.

For query t and each of its G query heads (Yuan et al. 2025, https://arxiv.org/abs/2502.11089, 0-based positions):

1. Compression (Eq. 7): the compressed keys/values of blocks i with i*d + l - 1 <= t (the whole block lies in the
   query's prefix) are attended; no such block gives a zero output.
2. Selection scores (Eqs. 8-10): the compression probabilities p_i are spread onto selection blocks of l' tokens
   in proportion to how many of block i's tokens fall in selection block j (overlap / d: the paper's Eq. 9 for the
   usual geometries) and summed over the G heads of the group.
3. Selection (Eqs. 11-12): the n highest-scoring blocks among those starting at or before t, with block 0 and the
   two most recent blocks (t's own and the one before) always taken, are attended token by token, causally.
4. Sliding window: the w keys (t - w, t].
5. Gates (Eq. 5): o = g_cmp * o_cmp + g_slc * o_slc + g_win * o_win.
6. Packed documents (`doc_start`): each document is a sequence of its own; nothing before its first token is seen.

Notation: B batch, H query heads, KV key/value heads, G = H // KV, T queries (= keys), D head dimension,
Nc compressed blocks, Ns selection blocks. Geometry from the config: l `nsa_block_size`, d `nsa_stride`,
l' `nsa_select_block_size`, n `nsa_num_selected`, w `nsa_window`.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:
    from model import ModelConfig


def naive_nsa(q: Tensor, k_cmp: Tensor, v_cmp: Tensor, k_slc: Tensor, v_slc: Tensor, k_win: Tensor, v_win: Tensor,
              gates: Tensor, config: ModelConfig, doc_start: Tensor | None = None) -> Tensor:
    """NSA's output (B, H, T, D) for queries q (B, H, T, D) at positions 0..T-1; compressed keys/values k_cmp, v_cmp
    (B, KV, Nc, D); the selection and window branches' keys/values k_slc, v_slc, k_win, v_win (B, KV, T, D); gates
    (B, H, T, 3) in the order compression, selection, window. Positional encoding is the caller's (already applied).

    doc_start (B, T) long, optional: the first position of each query's document (packed documents,
    `modeling.documents.document_starts`). Each document is then its own sequence: positions, blocks (compressed and
    selection) and the window count from its first token, and it sees nothing before it. k_cmp, v_cmp then hold each
    row's documents' compressed blocks one document after another (rows padded at the end to the longest).
    """
    B, H, T, D = q.shape
    KV, G = k_slc.shape[1], H // k_slc.shape[1]
    l, d, ls, n, w = (config.nsa_block_size, config.nsa_stride, config.nsa_select_block_size,
                      config.nsa_num_selected, config.nsa_window)
    scale = D**-0.5
    Ns = (T - 1) // ls + 1
    # overlap[i, j]: tokens of compressed block i inside selection block j, divided by the stride d (Eq. 9)
    overlap = torch.tensor([[len(set(range(i * d, i * d + l)) & set(range(j * ls, (j + 1) * ls))) / d
                             for j in range(Ns)] for i in range(max(k_cmp.shape[2], (T - l) // d + 1))],
                           dtype=q.dtype)
    if doc_start is None:
        doc_start = torch.zeros(B, T, dtype=torch.long)
    out = torch.zeros_like(q)
    for b in range(B):
        first_block: dict[int, int] = {}  # document start -> index of its first compressed block in k_cmp[b]
        for t in range(T):
            o = int(doc_start[b, t])
            if o not in first_block:  # a document opens: the blocks of the one before are complete
                first_block[o] = sum(max(0, (length - l) // d + 1) for length in _lengths(doc_start[b], o))
            rel, c0 = t - o, first_block[o]  # the query's position within its document, its first block
            own = rel // ls  # the query's own selection block
            for kv in range(KV):
                heads = range(kv * G, (kv + 1) * G)
                n_visible = sum(1 for i in range(k_cmp.shape[2] - c0) if i * d + l - 1 <= rel)
                importance = torch.zeros(Ns, dtype=q.dtype)
                o_cmp = {}
                for h in heads:
                    if n_visible == 0:
                        o_cmp[h] = torch.zeros(D, dtype=q.dtype)
                        continue
                    p = (k_cmp[b, kv, c0:c0 + n_visible] @ q[b, h, t] * scale).softmax(-1)
                    o_cmp[h] = p @ v_cmp[b, kv, c0:c0 + n_visible]
                    importance += p @ overlap[:n_visible]  # summed over the group's heads (Eq. 10)
                score = {j: (math.inf if j in (0, own, own - 1) else importance[j].item()) for j in range(own + 1)}
                chosen = sorted(score, key=score.get, reverse=True)[:n]
                selected = [o + s for j in chosen for s in range(j * ls, (j + 1) * ls) if s <= rel]
                window = list(range(max(o, t - w + 1), t + 1))
                for h in heads:
                    p_slc = (k_slc[b, kv, selected] @ q[b, h, t] * scale).softmax(-1)
                    p_win = (k_win[b, kv, window] @ q[b, h, t] * scale).softmax(-1)
                    g = gates[b, h, t]
                    out[b, h, t] = (g[0] * o_cmp[h] + g[1] * (p_slc @ v_slc[b, kv, selected])
                                    + g[2] * (p_win @ v_win[b, kv, window]))
    return out


def _lengths(starts: Tensor, before: int) -> list[int]:
    """The lengths of the documents of one row's doc_start (T,) that open before position `before`."""
    bounds = [p for p in range(before) if int(starts[p]) == p] + [before]
    return [end - first for first, end in zip(bounds, bounds[1:])]  # noqa: B905 (one shorter)
