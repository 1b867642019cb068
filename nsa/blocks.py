"""NSA's block geometry and top-n selection (Yuan et al. 2025, sections 3.3.1-3.3.2), 0-based: how many compressed
blocks are complete, how compressed-block probabilities map onto selection blocks (Eq. 9), the importance scores
computed explicitly (Eqs. 8-10) and the best-token scores that judge a block by its best key, which blocks each
query selects, and the grouping of (query, selected block) pairs by block that both selection paths use. Used by
nsa/layer.py (the layer, the decoding cache), nsa/attention.py, nsa/triton_path.py, nsa/scoring.py and
nsa/inspection.py.

Notation: B batch, H query heads, KV key/value heads, G = H // KV, D head dimension, Q queries, S keys, Nc compressed
blocks, Ns selection blocks, n selected blocks per query. Block geometry: l (`nsa_block_size`), d (`nsa_stride`),
l' (`nsa_select_block_size`).
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


def selection_windows(x: Tensor, block_size: int, stride: int, select_block_size: int, num_select_blocks: int,
                      fill: float | bool = 0.0) -> Tensor:
    """Each selection block's window of compressed blocks (Eq. 9): x (..., Nc) -> (..., Ns, width), window j holding
    compressed blocks (l'/d) j + first_offset + k, k < width (`selection_pool_weights`), `fill` where none exists."""
    first, weights = selection_pool_weights(block_size, stride, select_block_size)
    per_sel, width = select_block_size // stride, len(weights)
    # Pad so that window j starts at compressed index per_sel * j + first and all Ns windows fit.
    right = per_sel * num_select_blocks + width - per_sel - (x.shape[-1] - first)
    padded = F.pad(x, (-first, max(right, 0)), value=fill)[..., : per_sel * (num_select_blocks - 1) + width]
    return padded.unfold(-1, width, per_sel)


def pool_to_selection_blocks(p_cmp: Tensor, block_size: int, stride: int, select_block_size: int,
                             num_select_blocks: int) -> Tensor:
    """Map compressed-block scores (..., Nc) onto selection blocks (..., Ns) with Eq. 9 (`selection_pool_weights`)."""
    weights = selection_pool_weights(block_size, stride, select_block_size)[1]
    kernel = torch.tensor(weights, dtype=p_cmp.dtype, device=p_cmp.device)  # (width,)
    return selection_windows(p_cmp, block_size, stride, select_block_size, num_select_blocks) @ kernel  # (..., Ns)


def as_blocks(x: Tensor, block: int) -> Tensor:
    """x (B, KV, S, D) -> contiguous (B, KV, ceil(S / block), block, D), zero-padded at the end (a view when x is
    contiguous and S is a multiple of block, as for the KV cache)."""
    B, KV, S, D = x.shape
    x = (F.pad(x, (0, 0, 0, -S % block)) if S % block else x).contiguous()  # F.pad copies even with no padding
    return x.view(B, KV, x.shape[2] // block, block, D)


def block_importance(q: Tensor, k_cmp: Tensor, q_pos: Tensor, block_size: int, stride: int, select_block_size: int,
                     num_select_blocks: int) -> Tensor:
    """Eqs. 8-10 computed explicitly: queries q (B, H, Q, D) at positions q_pos (Q,) against the compressed keys
    k_cmp (B, KV, Nc, D) (block i is visible to position t iff i*d + l - 1 <= t); the softmax over the visible
    blocks, summed over each GQA group and pooled onto the first num_select_blocks selection blocks:
    (B, KV, Q, num_select_blocks) in at least float32 (in bfloat16 under a bfloat16 autocast), zero for queries that
    see no block. Differentiable (finite gradients everywhere)."""
    B, KV, Q = q.shape[0], k_cmp.shape[1], q.shape[2]
    if k_cmp.shape[2] == 0:
        return q.new_zeros(B, KV, Q, num_select_blocks, dtype=torch.promote_types(q.dtype, torch.float32))
    logits, visible, sees = _compression_logits(q, k_cmp, q_pos, block_size, stride)
    probs = logits.masked_fill(~visible, -math.inf).softmax(-1).sum(2) * sees[:, None]  # (B, KV, Q, Nc)
    return pool_to_selection_blocks(probs, block_size, stride, select_block_size, num_select_blocks)


def _compression_logits(q: Tensor, k_cmp: Tensor, q_pos: Tensor, block_size: int, stride: int
                        ) -> tuple[Tensor, Tensor, Tensor]:
    """Eq. 8's logits of queries q (B, H, Q, D) at positions q_pos (Q,) against the compressed keys k_cmp
    (B, KV, Nc >= 1, D), grouped by KV head: (logits (B, KV, G, Q, Nc) in at least float32, visible (Q, Nc): block i
    is visible to position t iff i*d + l - 1 <= t (a query that sees none is shown block 0), sees (Q,): the queries
    that see a block)."""
    B, H, Q, D = q.shape
    KV, Nc = k_cmp.shape[1], k_cmp.shape[2]
    acc = torch.promote_types(q.dtype, torch.float32)
    sees = q_pos >= block_size - 1  # (Q,)
    block_end = torch.arange(Nc, device=q.device) * stride + block_size - 1  # (Nc,)
    visible = block_end <= q_pos.clamp(min=block_size - 1)[:, None]  # (Q, Nc)
    q_groups = q.to(acc).view(B, KV, H // KV, Q, D)  # (B, KV, G, Q, D)
    logits = torch.einsum("bkgqd,bknd->bkgqn", q_groups, k_cmp.to(acc)) * D**-0.5  # (B, KV, G, Q, Nc)
    return logits, visible, sees


NO_IMPORTANCE = -1e30  # log importance of a block nothing points to: exp() is 0 and its gradient 0, never NaN;
# far below any real one (float32 logits differ by less than 1e30), so it never outweighs a real block


def block_log_importance(q: Tensor, k_cmp: Tensor, q_pos: Tensor, block_size: int, stride: int,
                         select_block_size: int, num_select_blocks: int) -> Tensor:
    """The log of `block_importance`, computed in log space: the compression log-probabilities (a log-softmax over
    the visible blocks) plus the log pooling weights, log-sum-exp'd over each GQA group's heads and each selection
    block's compressed blocks. Finite where the importance underflows (a block whose compressed logits sit 100 below
    the row's best in every head keeps its gradient), NO_IMPORTANCE where it is exactly 0 (no visible compressed
    block; a query that sees none). (B, KV, Q, num_select_blocks) in at least float32."""
    B, KV, Q = q.shape[0], k_cmp.shape[1], q.shape[2]
    acc = torch.promote_types(q.dtype, torch.float32)
    if k_cmp.shape[2] == 0:
        return q.new_full((B, KV, Q, num_select_blocks), NO_IMPORTANCE, dtype=acc)
    logits, visible, sees = _compression_logits(q, k_cmp, q_pos, block_size, stride)
    log_p = logits.masked_fill(~visible, -math.inf).log_softmax(-1)
    log_p = torch.where(visible, log_p, NO_IMPORTANCE)  # (B, KV, G, Q, Nc): finite, so no NaN in backward
    geometry = (block_size, stride, select_block_size, num_select_blocks)
    weights = selection_pool_weights(block_size, stride, select_block_size)[1]
    log_w = torch.tensor(weights, dtype=acc, device=q.device).log()  # (width,)
    windows = selection_windows(log_p, *geometry, fill=NO_IMPORTANCE)  # (B, KV, G, Q, Ns, width)
    pooled = (windows + log_w).logsumexp(-1).logsumexp(2)  # (B, KV, Q, Ns)
    shown = selection_windows(visible, *geometry, fill=False).any(-1) & sees[:, None]  # (Q, Ns): a visible block
    return torch.where(shown, pooled, NO_IMPORTANCE)


def choosable_blocks(q_pos: Tensor, select_block_size: int, num_select_blocks: int) -> Tensor:
    """(Q, num_select_blocks) bool: for queries at positions q_pos (Q,), the past blocks they choose among by score,
    those before the query's previous block (block 0 included; the own and previous blocks are always selected,
    later ones never). None before position 2 l'."""
    return torch.arange(num_select_blocks, device=q_pos.device) < (q_pos // select_block_size - 1)[:, None]


def first_choosing_position(select_block_size: int, num_selected: int) -> int | None:
    """The first query position at which top-n really chooses: block 0 and the query's own and previous blocks are
    forced in, so n - 3 slots are free for the c - 2 blocks between them (c: the query's block), more blocks than
    slots from c = n on. n l' when n >= 4; None (never) when fewer slots are free than one."""
    return num_selected * select_block_size if num_selected >= 4 else None


def contested_blocks(q_pos: Tensor, select_block_size: int, num_select_blocks: int, num_selected: int) -> Tensor:
    """(Q, num_select_blocks) bool: the blocks top-n really chooses among for queries at positions q_pos (Q,): for
    the queries from `first_choosing_position` on, blocks 1 .. c - 2 (c: the query's block). None for the others."""
    current = q_pos // select_block_size  # (Q,)
    block = torch.arange(num_select_blocks, device=q_pos.device)  # (Ns,)
    first = first_choosing_position(select_block_size, num_selected)
    choosing = q_pos >= first if first is not None else torch.zeros_like(q_pos, dtype=torch.bool)  # (Q,)
    return (block >= 1) & (block < (current - 1)[:, None]) & choosing[:, None]


_KEY_TILE = 1024  # keys per tile of `best_token_scores`


def best_token_scores(q: Tensor, k_blocks: Tensor, q_pos: Tensor, num_select_blocks: int,
                      candidates: Tensor | None = None, temperature: float = 1.0) -> Tensor:
    """Selection-block scores that judge each block by its best key: for queries q (B, H, Q, D) at positions q_pos
    (Q,) and key blocks k_blocks (B, KV, Ns', l', D), a query head's score for a candidate block j (`candidates`
    (Q, num_select_blocks) bool, past blocks only; default `choosable_blocks`) is the softmax over the candidates
    of max_{s in j} q . k_s / sqrt(D) (divided by `temperature`); summed over each GQA group -> (B, KV, Q,
    num_select_blocks) in at least float32 over the first num_select_blocks blocks, zero where a query has no
    candidate. Reads every key of those blocks, about `_KEY_TILE` at a time (the logits of a tile are
    (B, H, Q, tile))."""
    B, H, Q, D = q.shape
    KV, l_sel = k_blocks.shape[1], k_blocks.shape[3]
    G, acc, step = H // KV, torch.promote_types(q.dtype, torch.float32), max(1, _KEY_TILE // l_sel)
    q_rows = q.to(acc).reshape(B, KV, G * Q, D)  # (B, KV, G*Q, D): head-major rows
    tiles = k_blocks[:, :, :num_select_blocks].split(step, dim=2)  # each (B, KV, <= step, l', D)
    best = torch.cat([torch.einsum("bkqd,bknld->bkqnl", q_rows, k.to(acc)).amax(-1) for k in tiles],
                     dim=-1) * (D**-0.5 / temperature)  # (B, KV, G*Q, Ns)
    if candidates is None:
        candidates = choosable_blocks(q_pos, l_sel, num_select_blocks)  # (Q, Ns): never a key after the query
    return _group_softmax(best.view(B, KV, G, Q, num_select_blocks), candidates)  # (B, KV, Q, Ns)


def candidate_blocks(scores: Tensor, allowed: Tensor, top: int, random: int,
                     generator: torch.Generator | None = None) -> tuple[Tensor, Tensor]:
    """Each row's candidate blocks: for scores (B, KV, Q, Ns) and the blocks each query may take, allowed (Q, Ns)
    bool, the `top` highest-scoring allowed blocks, then `random` others drawn uniformly (from `generator`) among the
    allowed blocks left. Returns indices (B, KV, Q, K), K = min(top, Ns) + min(random, Ns - min(top, Ns)), and a
    validity mask of the same shape (False for slots beyond a row's allowed blocks). No gradient."""
    Ns = scores.shape[-1]
    allowed = allowed.expand_as(scores)  # (B, KV, Q, Ns)
    ranked = scores.masked_fill(~allowed, -math.inf)
    top_idx = ranked.topk(min(top, Ns), dim=-1, sorted=False).indices  # (B, KV, Q, top')
    top_ok = allowed.gather(-1, top_idx)
    if random == 0 or top_idx.shape[-1] == Ns:
        return top_idx, top_ok
    rest = allowed.scatter(-1, top_idx, False)  # allowed and not among the top
    noise = torch.rand(scores.shape, generator=generator, device=scores.device).masked_fill(~rest, -1.0)
    k_rand = min(random, Ns - top_idx.shape[-1])
    rand_idx = noise.topk(k_rand, dim=-1, sorted=False).indices  # a uniform subset of the rest
    return torch.cat([top_idx, rand_idx], dim=-1), torch.cat([top_ok, rest.gather(-1, rand_idx)], dim=-1)


def selection_target(scores: Tensor, allowed: Tensor, free: int) -> Tensor:
    """The set a selection by `scores` would choose, as a distribution: for scores (B, KV, Q, N) and the blocks a
    row chooses among, allowed (bool, broadcast to scores' shape), uniform over each row's `free` highest-scoring
    allowed blocks (all of them when it has fewer), zero for a row with none allowed. No gradient."""
    allowed = allowed.expand_as(scores)  # (B, KV, Q, N)
    idx = scores.masked_fill(~allowed, -math.inf).topk(min(free, scores.shape[-1]), dim=-1).indices
    chosen = torch.zeros_like(scores).scatter_(-1, idx, 1.0) * allowed  # (B, KV, Q, N): 1 on the chosen blocks
    return chosen / chosen.sum(-1, keepdim=True).clamp(min=1.0)


_GATHER_BYTES = 64 * 2**20  # bytes of candidate keys `candidate_token_scores` gathers at a time, once cast to float32


def candidate_token_scores(q: Tensor, k_blocks: Tensor, idx: Tensor, valid: Tensor, temperature: float = 1.0
                           ) -> Tensor:
    """`best_token_scores` over each row's own candidate blocks: for queries q (B, H, Q, D), key blocks k_blocks
    (B, KV, Ns', l', D) and candidates idx (B, KV, Q, K) with their mask valid, a query head's score for candidate
    slot s is the softmax over the valid slots of max over the block's keys of q . k / sqrt(D) (divided by
    `temperature`); summed over each GQA group -> (B, KV, Q, K) in at least float32, zero for a row without a valid
    slot. Reads the K l' keys of a row's
    candidates, gathered about `_GATHER_BYTES` at a time: O(Q K l') work, not O(Q S)."""
    B, H, Q, D = q.shape
    KV, Ns, l_sel, K = k_blocks.shape[1], k_blocks.shape[2], k_blocks.shape[3], idx.shape[-1]
    acc = torch.promote_types(q.dtype, torch.float32)
    q_groups = q.to(acc).view(B, KV, H // KV, Q, D)  # (B, KV, G, Q, D)
    flat = k_blocks.reshape(B * KV * Ns, l_sel * D)  # (B*KV*Ns, l'*D): a block's keys a row
    rows = idx + (torch.arange(B * KV, device=idx.device) * Ns).view(B, KV, 1, 1)  # (B, KV, Q, K) rows of flat
    step = max(1, _GATHER_BYTES // (B * KV * Q * l_sel * D * acc.itemsize))  # the gathered keys, cast to acc
    best = []
    for s0 in range(0, K, step):
        keys = flat.index_select(0, rows[..., s0:s0 + step].reshape(-1)).view(B, KV, Q, -1, D)  # (B, KV, Q, s*l', D)
        logits = torch.einsum("bkgqd,bkqnd->bkgqn", q_groups, keys.to(acc))  # (B, KV, G, Q, s*l')
        best.append(logits.unflatten(-1, (-1, l_sel)).amax(-1))  # (B, KV, G, Q, s)
    return _group_softmax(torch.cat(best, dim=-1) * (D**-0.5 / temperature), valid[:, :, None])  # (B, KV, Q, K)


def _group_softmax(best: Tensor, allowed: Tensor) -> Tensor:
    """Each query head's softmax of its best-key logits best (B, KV, G, Q, N) over the blocks `allowed` (a bool mask
    broadcast to best's shape), zero for a row with none allowed, summed over the GQA group -> (B, KV, Q, N)."""
    return best.masked_fill(~allowed, -math.inf).softmax(-1).nan_to_num(0.0).sum(2)


def select_blocks(scores: Tensor, q_pos: Tensor, select_block_size: int, num_selected: int) -> tuple[Tensor, Tensor]:
    """Top-n selection blocks per query from importance scores (B, KV, Q, Ns) of queries at positions q_pos (Q,).

    Block 0 and the query's own and previous blocks are forced in, future blocks are excluded. Returns indices
    (B, KV, Q, n') long and a validity mask of the same shape (False for slots that point at a future block because
    fewer than n' blocks exist yet), n' = min(n, Ns). No gradient.
    """
    return choose_blocks(scores, q_pos // select_block_size, torch.zeros_like(q_pos), num_selected)


def choose_blocks(scores: Tensor, own: Tensor, first: Tensor, num_selected: int) -> tuple[Tensor, Tensor]:
    """`select_blocks` for queries whose own block is own and whose sequence starts at block first (each
    broadcastable to (B, KV, Q): packed documents, nsa/packing.py): among blocks first .. own, first and the own and
    previous blocks are forced in. Returns (indices (B, KV, Q, n') long, whether each lies in first .. own)."""
    Ns = scores.shape[-1]
    block = torch.arange(Ns, device=scores.device)  # (Ns,)
    own, first = own[..., None], first[..., None]  # (..., Q, 1)
    forced = (block == first) | (block == own) | (block == own - 1)  # (..., Q, Ns)
    allowed = (block >= first) & (block <= own)
    scores = scores.masked_fill(forced, math.inf).masked_fill(~allowed, -math.inf)
    idx = scores.topk(min(num_selected, Ns), dim=-1, sorted=False).indices  # (B, KV, Q, n')
    return idx, (idx >= first) & (idx <= own)


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
