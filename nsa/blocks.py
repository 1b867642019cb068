"""NSA's block geometry and top-n selection (Yuan et al. 2025, sections 3.3.1-3.3.2), 0-based: how many compressed
blocks are complete, how compressed-block probabilities map onto selection blocks (Eq. 9), and which blocks each
query selects, and the grouping of (query, selected block) pairs by block that both selection paths use. Used by
nsa/layer.py (the layer, the decoding cache), nsa/attention.py and nsa/kernels.py.

Notation: B batch, KV key/value heads, Q queries, Nc compressed blocks, Ns selection blocks, n selected blocks per
query. Block geometry: l (`nsa_block_size`), d (`nsa_stride`), l' (`nsa_select_block_size`).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor


def num_compressed_blocks(num_tokens: int, block_size: int, stride: int) -> int:
    """Number of compressed blocks complete within positions [0, num_tokens): blocks i with i*d + l - 1 < num_tokens."""
    return max(0, (num_tokens - block_size) // stride + 1)


def selection_pool_weights(block_size: int, stride: int, select_block_size: int) -> tuple[int, list[float]]:
    """Paper Eq. 9 in 0-based indexing: p_slc[j] = sum_{m < l'/d} sum_{n < l/d} p_cmp[(l'/d) j + m - n].

    Returns (first_offset, weights): selection block j collects compressed blocks (l'/d) j + first_offset + k with
    weight weights[k]; first_offset = -(l/d - 1), the weight is the overlap in units of d. Defaults (32, 16, 64):
    blocks 4j-1 .. 4j+3 with weights 1, 2, 2, 2, 1.
    """
    per_cmp, per_sel = block_size // stride, select_block_size // stride
    weights = [0.0] * (per_sel + per_cmp - 1)
    for m in range(per_sel):
        for n in range(per_cmp):
            weights[m - n + per_cmp - 1] += 1.0
    return -(per_cmp - 1), weights


def pool_to_selection_blocks(p_cmp: Tensor, block_size: int, stride: int, select_block_size: int,
                             num_select_blocks: int) -> Tensor:
    """Map compressed-block scores (..., Nc) onto selection blocks (..., Ns) with Eq. 9 (`selection_pool_weights`)."""
    first, weights = selection_pool_weights(block_size, stride, select_block_size)
    per_sel, width = select_block_size // stride, len(weights)
    # Pad so that window j starts at compressed index per_sel * j + first and all Ns windows fit.
    right = per_sel * num_select_blocks + width - per_sel - (p_cmp.shape[-1] - first)
    padded = F.pad(p_cmp, (-first, max(right, 0)))[..., : per_sel * (num_select_blocks - 1) + width]
    kernel = torch.tensor(weights, dtype=p_cmp.dtype, device=p_cmp.device)  # (width,)
    return padded.unfold(-1, width, per_sel) @ kernel  # windows (..., Ns, width) -> (..., Ns)


def select_blocks(scores: Tensor, q_pos: Tensor, select_block_size: int, num_selected: int) -> tuple[Tensor, Tensor]:
    """Top-n selection blocks per query from importance scores (B, KV, Q, Ns) of queries at positions q_pos (Q,).

    Block 0 and the query's own and previous blocks are forced in, future blocks are excluded. Returns indices
    (B, KV, Q, n') long and a validity mask of the same shape (False for slots that point at a future block because
    fewer than n' blocks exist yet), n' = min(n, Ns). No gradient.
    """
    Ns = scores.shape[-1]
    block = torch.arange(Ns, device=scores.device)  # (Ns,)
    current = (q_pos // select_block_size)[:, None]  # (Q, 1)
    forced = (block == 0) | (block == current) | (block == current - 1)  # (Q, Ns)
    scores = scores.masked_fill(forced, math.inf).masked_fill(block > current, -math.inf)
    idx = scores.topk(min(num_selected, Ns), dim=-1, sorted=False).indices  # (B, KV, Q, n')
    return idx, idx <= current


def pairs_by_block(idx: Tensor, keep: Tensor, n_blocks: int) -> tuple[Tensor, Tensor, Tensor]:
    """Group the (query, slot) pairs of idx (B, KV, Q, n) for which keep (same shape) holds by their block, one of
    n_blocks per batch x KV head. Returns (group (P,): each pair's block among the B*KV*n_blocks, n_groups for pairs
    not kept; order (P,): the pairs sorted by group, stable; counts (n_groups + 1,): pairs per group, the last
    counting those not kept). No host sync."""
    B, KV = idx.shape[:2]
    n_groups = B * KV * n_blocks
    bkv = torch.arange(B * KV, device=idx.device).view(B, KV, 1, 1)
    group = torch.where(keep, bkv * n_blocks + idx, n_groups).view(-1)
    counts = group.new_zeros(n_groups + 1).index_add_(0, group, torch.ones_like(group))
    return group, torch.argsort(group, stable=True), counts
