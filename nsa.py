"""Native Sparse Attention (Yuan et al. 2025, https://arxiv.org/abs/2502.11089) in pure PyTorch, CPU and CUDA.

Each query head attends through three branches whose outputs are mixed by per-token, per-head sigmoid gates
(paper Eq. 5): o_t = g_cmp * cmp_t + g_slc * slc_t + g_win * win_t.

- Compression (section 3.3.1): K/V are cut into blocks of l tokens with stride d; block i covers tokens
  [i*d, i*d + l) and is mapped by a learned MLP with an intra-block position encoding (`BlockCompressor`) to one key
  and one value. Query t sees block i iff i*d + l - 1 <= t (the whole block lies in its prefix). A query that sees
  no block gets a zero output from this branch. Compressed keys are k-normed and rotated at their block's last
  position i*d + l - 1 (the position at which they become visible), so query-key distances are never negative.
- Selection (3.3.2): the compression branch's attention probabilities are pooled onto selection blocks of l'
  tokens (Eq. 9, 0-based: `selection_pool_weights`), summed over the query heads of one GQA group (Eq. 10), and the
  top n blocks are attended token by token (Eqs. 11-12). The n blocks include block 0 and the two most recent
  blocks (the query's own and the previous one), which are always selected; future blocks never are; inside the
  query's own block a token-level causal mask applies. The top-n indices carry no gradient.
- Sliding window (3.3.3): the w keys (t - w, t], i.e. w keys counting the query's own token.

Memory and time (pure-PyTorch path). Queries are processed in chunks of Q = `nsa_query_chunk` tokens. Forward
keeps only its inputs (views of the layer's q/k/v/gates); backward recomputes one chunk at a time and adds its
gradients into the full ones in place (`_SparseAttention`). Nothing T x T and no T x (T/d) score matrix for all
queries is ever allocated. The selection branch is block-centric (`tile_plan`, `_selected_branch`): a chunk's
(query, block) pairs are grouped into tiles of R pairs sharing one key block, so each key block is read once per
tile and no per-query copy of the n * l' selected keys exists. With Nc = floor((T - l) / d) + 1 compressed blocks,
the peak of one layer's forward+backward, in elements, is

    linear part:  T * B * (c_lin * (H + 2 * nb * KV) * D + 5 * H + 2 * C)   (q, per-branch k/v, gates, x, grads)
    chunk part:   B * Q * (c_cmp * H * Nc + c_sel * KV * n * l' * D + c_win * H * (Q + w - 1))

with nb = 3 K/V sets when `nsa_separate_kv` else 1, and small constants c (tests/test_nsa.py checks the bound
with c_lin = 8, c_cmp = c_sel = c_win = 6; the selection term is loose: the tiles' working set is about
G * n * (l' + D) per query plus one block per tile). For fixed Q the peak is linear in T. Measured with
FakeTensorMode for one 4B-geometry layer (dim 2560, H=32, KV=8, D=128, separate K/V, bf16) at T = 131072,
forward+backward, weights and input excluded (`memtrack.LiveBytesTracker`, worst-case tile count): 17.1 GiB at
Q=512, 18.4 GiB at Q=1024, 21.4 GiB at Q=2048 (largest single tensor 2 GiB); most of it is the linear part.

Fast path: `sparse_attention` (q, per-branch keys/values, gates, positions -> output) is the single seam where a
fused GPU kernel (Triton selection kernel, flex_attention for compression/window) can replace the reference code;
none is provided because none could be tested here.

Notation: B batch, T new tokens (queries), S key positions, H query heads, KV key/value heads, G = H // KV (GQA
group), D head dimension, C model width, Q query-chunk length, Nc compressed blocks, Ns selection blocks,
N = n * l' selected key slots per query, W window keys of a chunk, nb key/value sets (3 separate or 1 shared),
R (query, block) pairs per tile, P pairs of a chunk.
Block geometry: l (`nsa_block_size`), d (`nsa_stride`), l' (`nsa_select_block_size`), n (`nsa_num_selected`),
w (`nsa_window`).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import TYPE_CHECKING, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch._subclasses.fake_tensor import is_fake

from layers import RMSNorm, apply_rope

if TYPE_CHECKING:
    from model import ModelConfig


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
    windows = padded.unfold(-1, width, per_sel)  # (..., Ns, width)
    return windows @ torch.tensor(weights, dtype=p_cmp.dtype, device=p_cmp.device)  # (..., Ns)


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


def _softmax(logits: Tensor) -> Tensor:
    """Softmax over the last dim computed in at least float32, returned in the input dtype."""
    return torch.softmax(logits, dim=-1, dtype=torch.promote_types(logits.dtype, torch.float32)).to(logits.dtype)


def _compressed_branch(q: Tensor, k: Tensor, v: Tensor, q_start: int, block_size: int, stride: int,
                       scale: float) -> tuple[Tensor, Tensor]:
    """Attention of q (B, KV, G, Q, D) at positions [q_start, q_start + Q) over the compressed keys/values
    (B, KV, Nc, D) visible to each query.

    Returns (output (B, KV, G, Q, D), probabilities (B, KV, G, Q, Nc)). Rows without a visible block (the first
    l - 1 positions) get zero probabilities and a zero output; their logits are zeroed before the softmax, so no NaN
    arises forwards or backwards.
    """
    B, KV, G, Q, D = q.shape
    Nc = k.shape[2]
    q_pos = torch.arange(q_start, q_start + Q, device=q.device)  # (Q,)
    block_end = torch.arange(Nc, device=q.device) * stride + block_size - 1  # (Nc,)
    visible = block_end[None, :] <= q_pos[:, None]  # (Q, Nc)
    logits = ((q * scale).reshape(B, KV, G * Q, D) @ k.transpose(-1, -2)).view(B, KV, G, Q, Nc)
    logits = logits.masked_fill(~visible, -math.inf)
    if q_start >= block_size - 1:  # every row sees block 0
        p = _softmax(logits)  # (B, KV, G, Q, Nc)
    else:
        row_has_block = visible[:, :1]  # (Q, 1): block 0 is the first to become visible
        p = _softmax(logits.masked_fill(~row_has_block, 0.0)) * row_has_block
    out = (p.view(B, KV, G * Q, Nc) @ v).view(B, KV, G, Q, D)
    return out, p


_TILE_ROWS = 32  # (query, block) pairs per tile (`tile_plan`): the tile matmuls are (32 * G, D) x (D, l')


class TilePlan(NamedTuple):
    """How one chunk's P = B*KV*Q*n' (query, selected block) pairs are grouped into tiles of R = `_TILE_ROWS` pairs
    that share one key block (`tile_plan`); rows = n_tiles * R, padding rows read an all-zero query."""

    tile_block: Tensor  # (n_tiles,) index of each tile's block among the B*KV*Nsb blocks
    query_of_row: Tensor  # (rows,) query (index into B*KV*Q) of each tile row; B*KV*Q for padding
    logit_rows: Tensor  # (B*KV*Q*G*n',) for each (query, head, slot): its (tile row, head) row of the tile logits
    p_rows: Tensor  # (rows*G,) for each (tile row, head): its (query, head, slot) row; B*KV*Q*G*n' for padding
    keep: Tensor  # (B, KV, Q, 1, n'*l') key slots a query may attend: valid slots, keys not after the query


def _tile_count(tile_end: Tensor, worst_case: int) -> int:
    """Number of tiles, read from the device (one host sync per chunk), or `worst_case` for fake and meta tensors,
    whose values are unknown (profile_memory.py's estimate is then an upper bound)."""
    if tile_end.device.type == "meta" or is_fake(tile_end):
        return worst_case
    return int(tile_end[-1])


@torch.no_grad()
def tile_plan(idx: Tensor, valid: Tensor, q_pos: Tensor, n_blocks: int, block: int, G: int) -> TilePlan:
    """Group the selections idx (B, KV, Q, n') (with validity `valid`, queries at q_pos (Q,)) among n_blocks
    selection blocks of `block` keys per (B, KV) into tiles; G query heads per KV head. Tiles are made block by
    block, so n_tiles <= P / R + (distinct blocks selected)."""
    B, KV, Q, n = idx.shape
    R, P, BKQ, dev = _TILE_ROWS, idx.numel(), B * KV * Q, idx.device
    gid = (torch.arange(B * KV, device=dev).view(B, KV, 1, 1) * n_blocks + idx).view(-1)  # (P,) block of each pair
    counts = gid.new_zeros(B * KV * n_blocks).index_add_(0, gid, torch.ones_like(gid))  # pairs per block
    tiles = (counts + R - 1) // R  # tiles per block
    tile_end = tiles.cumsum(0)
    n_tiles = _tile_count(tile_end, P // R + min(B * KV * n_blocks, P))
    order = torch.argsort(gid, stable=True)  # pairs grouped by block
    g_sorted = gid[order]
    rank = torch.arange(P, device=dev) - (counts.cumsum(0) - counts)[g_sorted]  # rank of a pair within its block
    row_sorted = (tile_end - tiles)[g_sorted] * R + rank  # tile row of each sorted pair
    row_of_pair = torch.empty_like(order).scatter_(0, order, row_sorted).view(BKQ, 1, n)  # (BKQ, 1, n')
    pair_of_row = torch.full((n_tiles * R,), P, device=dev).scatter_(0, row_sorted, order)  # (rows,) P: padding
    heads = torch.arange(G, device=dev)
    p_rows = ((pair_of_row // n)[:, None] * G + heads) * n + (pair_of_row % n)[:, None]  # (rows, G)
    pos = idx[..., None] * block + torch.arange(block, device=dev)  # (B, KV, Q, n', l')
    return TilePlan(
        tile_block=torch.repeat_interleave(torch.arange(B * KV * n_blocks, device=dev), tiles, output_size=n_tiles),
        query_of_row=pair_of_row // n,
        logit_rows=(row_of_pair * G + heads[:, None]).view(-1),
        p_rows=p_rows.masked_fill(pair_of_row[:, None] == P, BKQ * G * n).view(-1),
        keep=(valid[..., None] & (pos <= q_pos[:, None, None])).view(B, KV, Q, 1, n * block),
    )


def _selected_branch(q: Tensor, k_tiles: Tensor, v_tiles: Tensor, plan: TilePlan, scale: float) -> Tensor:
    """Attention of q (B, KV, G, Q, D) over its selected blocks, given as the tiles' blocks k_tiles, v_tiles
    (n_tiles, l', D) of `plan` (`tile_plan`). Returns (B, KV, G, Q, D).

    Block-centric: each tile is one (R*G, D) x (D, l') matmul of R queries' G heads against a key block read once,
    instead of gathering n'*l' keys per query (a copy that cost more than the arithmetic). The logits return to
    query order for a softmax over each query's n'*l' keys, and the probabilities go back through the tiles."""
    B, KV, G, Q, D = q.shape
    n_tiles, block = k_tiles.shape[:2]
    BKQ = B * KV * Q
    q_rows = F.pad((q * scale).transpose(2, 3).reshape(BKQ, G * D), (0, 0, 0, 1))  # (BKQ + 1, G*D), last row 0
    q_tiles = q_rows.index_select(0, plan.query_of_row).view(n_tiles, -1, D)  # (n_tiles, R*G, D)
    logits = (q_tiles @ k_tiles.transpose(1, 2)).view(-1, block).index_select(0, plan.logit_rows)  # (BKQ*G*n', l')
    logits = logits.view(B, KV, Q, G, -1).masked_fill(~plan.keep, -math.inf)  # (B, KV, Q, G, n'*l'); own key kept
    p = F.pad(_softmax(logits).view(-1, block), (0, 0, 0, 1))  # (BKQ*G*n' + 1, l'), last row 0 for padding
    out_tiles = p.index_select(0, plan.p_rows).view(n_tiles, -1, block) @ v_tiles  # (n_tiles, R*G, D)
    out = torch.index_add(q_rows.new_zeros(BKQ + 1, G * D), 0, plan.query_of_row, out_tiles.view(-1, G * D))
    return out[:BKQ].view(B, KV, Q, G, D).transpose(2, 3)  # (B, KV, G, Q, D)


def _as_blocks(x: Tensor, block: int) -> Tensor:
    """x (B, KV, S, D) -> contiguous (B, KV, ceil(S / block), block, D), zero-padded at the end (a view when x is
    contiguous and S is a multiple of block, as for the KV cache)."""
    B, KV, S, D = x.shape
    x = F.pad(x, (0, 0, 0, -S % block)).contiguous()
    return x.view(B, KV, x.shape[2] // block, block, D)


def _window_branch(q: Tensor, k: Tensor, v: Tensor, q_pos: Tensor, k_pos: Tensor, window: int) -> Tensor:
    """Attention of q (B, KV, G, Q, D) over the keys k, v (B, KV, W, D) at positions k_pos (W,) with
    q_pos - window < k_pos <= q_pos (w keys including the query's own). Returns (B, KV, G, Q, D)."""
    B, KV, G, Q, D = q.shape
    band = (k_pos[None, :] <= q_pos[:, None]) & (k_pos[None, :] > q_pos[:, None] - window)  # (Q, W)
    out = F.scaled_dot_product_attention(q.reshape(B, KV, G * Q, D), k, v, attn_mask=band.repeat(G, 1))
    return out.view(B, KV, G, Q, D)


def _attend_chunk(q: Tensor, k_cmp: Tensor, v_cmp: Tensor, k_blocks: Tensor, v_blocks: Tensor, k_win: Tensor,
                  v_win: Tensor, gates: Tensor, q_start: int, win_start: int,
                  config: ModelConfig) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """One query chunk: q (B, H, Q, D) at positions [q_start, q_start + Q), gates (B, H, Q, 3); selection keys and
    values as blocks (`_as_blocks`), the others as in `sparse_attention`, cut to what the chunk can see.

    Returns (out (B, H, Q, D), k_tiles, v_tiles (n_tiles, l', D), tile_block (n_tiles,)): the selected blocks are
    gathered here; under grad mode they are made leaves, so that `_SparseAttention.backward` gets their gradients
    without a full-size gradient of k_blocks per chunk."""
    B, H, Q, D = q.shape
    KV = k_blocks.shape[1]
    l, d, l_sel = config.nsa_block_size, config.nsa_stride, config.nsa_select_block_size
    scale = D**-0.5
    q = q.view(B, KV, H // KV, Q, D)  # (B, KV, G, Q, D)
    q_pos = torch.arange(q_start, q_start + Q, device=q.device)  # (Q,)

    o_cmp, p_cmp = _compressed_branch(q, k_cmp, v_cmp, q_start, l, d, scale)
    with torch.no_grad():
        num_select_blocks = (q_start + Q - 1) // l_sel + 1
        importance = pool_to_selection_blocks(p_cmp.sum(2), l, d, l_sel, num_select_blocks)  # (B, KV, Q, Ns)
        idx, valid = select_blocks(importance, q_pos, l_sel, config.nsa_num_selected)
        plan = tile_plan(idx, valid, q_pos, k_blocks.shape[2], l_sel, H // KV)
        k_tiles = k_blocks.view(-1, l_sel, D).index_select(0, plan.tile_block)  # (n_tiles, l', D)
        v_tiles = v_blocks.view(-1, l_sel, D).index_select(0, plan.tile_block)
    k_tiles.requires_grad_(torch.is_grad_enabled())
    v_tiles.requires_grad_(torch.is_grad_enabled())
    o_slc = _selected_branch(q, k_tiles, v_tiles, plan, scale)

    k_pos = torch.arange(win_start, win_start + k_win.shape[2], device=q.device)  # (W,)
    o_win = _window_branch(q, k_win, v_win, q_pos, k_pos, config.nsa_window)

    g = gates.view(B, KV, H // KV, Q, 3)
    out = g[..., 0:1] * o_cmp + g[..., 1:2] * o_slc + g[..., 2:3] * o_win  # (B, KV, G, Q, D)
    return out.view(B, H, Q, D), k_tiles, v_tiles, plan.tile_block


def _chunks(T: int, q_start: int, win_start: int, config: ModelConfig) -> Iterator[tuple[slice, int, int, slice]]:
    """Per query chunk: (its queries as a slice of [0, T), absolute position of its first query, compressed blocks
    it can see, its window keys as a slice of k_win)."""
    l, d, w, chunk = config.nsa_block_size, config.nsa_stride, config.nsa_window, config.nsa_query_chunk
    for c0 in range(0, T, chunk):
        c1 = min(c0 + chunk, T)
        t0, t1 = q_start + c0, q_start + c1  # absolute positions of the chunk's queries
        w0 = max(t0 - w + 1, win_start) - win_start  # first window key of the chunk, as an index into k_win
        yield slice(c0, c1), t0, num_compressed_blocks(t1, l, d), slice(w0, t1 - win_start)


class _SparseAttention(torch.autograd.Function):
    """`sparse_attention` with chunk-wise recomputation in backward. Forward keeps only its inputs. Backward
    recomputes one chunk at a time with autograd on chunk-local leaves (the chunk's queries and gates, the
    compressed and window keys it sees, its gathered selection blocks) and adds their gradients into the full
    gradients in place; activation checkpointing per chunk would instead build a full-size gradient of every
    input per chunk (O(T^2 / Q) work)."""

    @staticmethod
    def forward(ctx, q: Tensor, k_cmp: Tensor, v_cmp: Tensor, k_slc: Tensor, v_slc: Tensor, k_win: Tensor,
                v_win: Tensor, gates: Tensor, config: ModelConfig, q_start: int, win_start: int) -> Tensor:
        ctx.save_for_backward(q, k_cmp, v_cmp, k_slc, v_slc, k_win, v_win, gates)
        ctx.config, ctx.q_start, ctx.win_start = config, q_start, win_start
        l_sel = config.nsa_select_block_size
        k_blocks, v_blocks = _as_blocks(k_slc, l_sel), _as_blocks(v_slc, l_sel)  # (B, KV, Nsb, l', D)
        out = torch.empty_like(q)  # (B, H, T, D)
        for qs, t0, n_cmp, ws in _chunks(q.shape[2], q_start, win_start, config):
            out[:, :, qs] = _attend_chunk(q[:, :, qs], k_cmp[:, :, :n_cmp], v_cmp[:, :, :n_cmp], k_blocks, v_blocks,
                                          k_win[:, :, ws], v_win[:, :, ws], gates[:, :, qs], t0,
                                          win_start + ws.start, config)[0]
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor) -> tuple[Tensor | None, ...]:
        q, k_cmp, v_cmp, k_slc, v_slc, k_win, v_win, gates = ctx.saved_tensors
        config, l_sel = ctx.config, ctx.config.nsa_select_block_size
        k_blocks, v_blocks = _as_blocks(k_slc, l_sel), _as_blocks(v_slc, l_sel)  # (B, KV, Nsb, l', D)
        g_q, g_kc, g_vc, g_kb, g_vb, g_kw, g_vw, g_gates = (
            torch.zeros_like(t) for t in (q, k_cmp, v_cmp, k_blocks, v_blocks, k_win, v_win, gates))
        for qs, t0, n_cmp, ws in _chunks(q.shape[2], ctx.q_start, ctx.win_start, config):
            inputs = (q[:, :, qs], k_cmp[:, :, :n_cmp], v_cmp[:, :, :n_cmp], k_win[:, :, ws], v_win[:, :, ws],
                      gates[:, :, qs])
            grads = (g_q[:, :, qs], g_kc[:, :, :n_cmp], g_vc[:, :, :n_cmp], g_kw[:, :, ws], g_vw[:, :, ws],
                     g_gates[:, :, qs])
            _chunk_backward(inputs, grads, (k_blocks, v_blocks), (g_kb, g_vb), grad_out[:, :, qs], t0,
                            ctx.win_start + ws.start, config)
        S = k_slc.shape[2]
        g_kb, g_vb = (g.flatten(2, 3)[:, :, :S] for g in (g_kb, g_vb))  # (B, KV, S, D)
        return g_q, g_kc, g_vc, g_kb, g_vb, g_kw, g_vw, g_gates, None, None, None


def _chunk_backward(inputs: tuple[Tensor, ...], grads: tuple[Tensor, ...], blocks: tuple[Tensor, Tensor],
                    grad_blocks: tuple[Tensor, Tensor], grad_out: Tensor, q_start: int, win_start: int,
                    config: ModelConfig) -> None:
    """Recompute one chunk (`_attend_chunk`) with autograd from `inputs` (q, k_cmp, v_cmp, k_win, v_win, gates, cut
    to the chunk) and add the gradients into `grads` (views of the full gradients, same order); those of the
    gathered selection blocks go into grad_blocks (the gradients of `blocks`, (B, KV, Nsb, l', D)) by index."""
    with torch.enable_grad():
        leaves = [t.detach().requires_grad_() for t in inputs]
        q, k_cmp, v_cmp, k_win, v_win, gates = leaves
        out, k_tiles, v_tiles, tile_block = _attend_chunk(q, k_cmp, v_cmp, *blocks, k_win, v_win, gates, q_start,
                                                          win_start, config)
        chunk_grads = torch.autograd.grad(out, [*leaves, k_tiles, v_tiles], grad_out, allow_unused=True)
    for target, grad in zip(grads, chunk_grads[:6], strict=True):
        if grad is not None:  # None: the chunk sees no compressed block yet
            target.add_(grad)
    for target, grad in zip(grad_blocks, chunk_grads[6:], strict=True):
        target.view(-1, *grad.shape[1:]).index_add_(0, tile_block, grad)  # (B*KV*Nsb, l', D)


def sparse_attention(q: Tensor, k_cmp: Tensor, v_cmp: Tensor, k_slc: Tensor, v_slc: Tensor, k_win: Tensor,
                     v_win: Tensor, gates: Tensor, config: ModelConfig, q_start: int = 0, win_start: int = 0) -> Tensor:
    """The three gated NSA branches for queries at positions [q_start, q_start + T), chunk by chunk.

    Args:
        q: `(B, H, T, D)` rotated queries.
        k_cmp, v_cmp: `(B, KV, Nc, D)` compressed keys/values of blocks 0 .. Nc-1 (all blocks complete by the last
            query; keys rotated at their block's last position).
        k_slc, v_slc: `(B, KV, S, D)` keys/values at positions [0, S), S >= q_start + T (positions after the
            last query are never attended).
        k_win, v_win: `(B, KV, W, D)` keys/values at positions [win_start, win_start + W), covering each query's
            window.
        gates: `(B, H, T, 3)` branch gates (compression, selection, window).
        config: block geometry (`nsa_*` fields); `nsa_query_chunk` queries are processed at a time.
    Returns:
        `(B, H, T, D)`; backward recomputes chunk by chunk (`_SparseAttention`).
    """
    return _SparseAttention.apply(q, k_cmp, v_cmp, k_slc, v_slc, k_win, v_win, gates, config, q_start, win_start)


class BlockCompressor(nn.Module):
    """phi of paper Eq. 7: blocks (B, KV, N, l, D) -> (B, KV, N, D). Adds a learned intra-block position encoding
    (per KV head), then applies a two-layer MLP (l*D -> D -> D, SiLU, shared across heads) to the flattened block."""

    def __init__(self, block_size: int, head_dim: int, n_kv_heads: int) -> None:
        super().__init__()
        self.pos = nn.Parameter(torch.zeros(n_kv_heads, block_size, head_dim))
        self.fc1 = nn.Linear(block_size * head_dim, head_dim, bias=False)
        self.fc2 = nn.Linear(head_dim, head_dim, bias=False)

    def forward(self, blocks: Tensor) -> Tensor:
        h = (blocks + self.pos[:, None]).flatten(-2)  # (B, KV, N, l*D)
        return self.fc2(F.silu(self.fc1(h)))  # (B, KV, N, D)

    def init_weights(self, std: float) -> None:
        nn.init.normal_(self.pos, std=std)
        for fc in (self.fc1, self.fc2):  # unit-gain fan-in scaling keeps compressed values on the scale of v
            nn.init.normal_(fc.weight, std=fc.in_features**-0.5)


def _ring_extend(buf: Tensor, start: int, new: Tensor, keep_from: int) -> Tensor:
    """A ring buffer buf (B, KV, R, D) holding position p at slot p % R: write `new` (B, KV, T, D) at positions
    [start, start + T) and return the entries for positions [keep_from, start + T) (B, KV, start + T - keep_from, D)."""
    R, end = buf.shape[2], start + new.shape[2]
    if end <= R:  # never wrapped: slots are positions, return a view
        buf[:, :, start:end] = new
        return buf[:, :, keep_from:end]
    old = buf[:, :, torch.arange(keep_from, start, device=buf.device) % R]  # read before overwriting
    tail = new[:, :, -R:]
    buf[:, :, torch.arange(end - tail.shape[2], end, device=buf.device) % R] = tail
    return torch.cat([old, new], dim=2)


class NSACache(nn.Module):
    """Decoding state of one NSA layer (non-persistent buffers, never in the state_dict).

    raw_k/raw_v (B, KV, l, D): ring of the last l un-normed, un-rotated compression inputs (a block completes
    within l tokens); cmp_k/cmp_v (B, KV, Nc_max, D): compressed keys/values; slc_k/slc_v (B, KV, S_cap, D): the full
    cache the selection branch reads (capacity rounded up to whole selection
    blocks); win_k/win_v (B, KV, w, D): ring of the last w window keys (only with separate
    K/V; shared K/V read the window from slc_k/slc_v).
    """

    def __init__(self, config: ModelConfig, batch_size: int, max_seq_len: int, dtype: torch.dtype,
                 device: torch.device | str | None) -> None:
        super().__init__()
        self.max_seq_len = max_seq_len
        KV, D = config.n_kv_heads, config.head_dim
        n_cmp = num_compressed_blocks(max_seq_len, config.nsa_block_size, config.nsa_stride)
        slc = -(-max_seq_len // config.nsa_select_block_size) * config.nsa_select_block_size  # whole blocks
        lengths = {"raw": config.nsa_block_size, "cmp": n_cmp, "slc": slc}
        if config.nsa_separate_kv:
            lengths["win"] = min(config.nsa_window, max_seq_len)
        for name, length in lengths.items():
            for kind in ("k", "v"):
                buf = torch.zeros(batch_size, KV, length, D, dtype=dtype, device=device)
                self.register_buffer(f"{name}_{kind}", buf, persistent=False)


class NativeSparseAttention(nn.Module):
    """NSA layer implementing the attention-module protocol of model.py (see the module docstring).

    Parameters: q_proj, k_proj/v_proj (C -> nb*KV*D: compression, selection, window sets when separate), o_proj,
    gate_proj (C -> 3*H, with bias), k_compress/v_compress (`BlockCompressor`), q_norm/k_norm (RMSNorm over D, when
    qk_norm; k_norm applies to every key a query meets, compressed keys after compression, always before RoPE).
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        c, h, kv, d = config.dim, config.n_heads, config.n_kv_heads, config.head_dim
        self.n_sets = 3 if config.nsa_separate_kv else 1
        self.q_proj = nn.Linear(c, h * d, bias=False)
        self.k_proj = nn.Linear(c, self.n_sets * kv * d, bias=False)
        self.v_proj = nn.Linear(c, self.n_sets * kv * d, bias=False)
        self.o_proj = nn.Linear(h * d, c, bias=False)
        self.gate_proj = nn.Linear(c, 3 * h)
        self.k_compress = BlockCompressor(config.nsa_block_size, d, kv)
        self.v_compress = BlockCompressor(config.nsa_block_size, d, kv)
        self.q_norm = RMSNorm(d, config.norm_eps) if config.qk_norm else nn.Identity()
        self.k_norm = RMSNorm(d, config.norm_eps) if config.qk_norm else nn.Identity()
        self.cache: NSACache | None = None

    def _compress(self, k_raw: Tensor, v_raw: Tensor, first_pos: int, cos: Tensor, sin: Tensor,
                  cos_start: int) -> tuple[Tensor, Tensor]:
        """Compressed keys/values (B, KV, N, D) of the complete blocks in raw k, v (B, KV, L, D) at positions
        [first_pos, first_pos + L) (first_pos a multiple of d). Keys are normed and rotated at each block's last
        position, read from cos/sin rows for positions [cos_start, ...)."""
        l, d = self.config.nsa_block_size, self.config.nsa_stride
        n = num_compressed_blocks(k_raw.shape[2], l, d)
        B, KV, _, D = k_raw.shape
        if n == 0:
            return k_raw.new_zeros(B, KV, 0, D), v_raw.new_zeros(B, KV, 0, D)
        blocks_k = k_raw.unfold(2, l, d).transpose(-1, -2)  # (B, KV, n, l, D)
        blocks_v = v_raw.unfold(2, l, d).transpose(-1, -2)  # (B, KV, n, l, D)
        rows = slice(first_pos + l - 1 - cos_start, first_pos + (n - 1) * d + l - cos_start, d)  # block ends
        k = apply_rope(self.k_norm(self.k_compress(blocks_k)), cos[rows], sin[rows])
        return k, self.v_compress(blocks_v)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, start_pos: int | None = None) -> Tensor:
        """x (B, T, C); cos, sin (T, D) for positions [start_pos or 0, +T). start_pos None: full causal forward
        without cache; an int: decode/prefill against the cache (`setup_cache`). Returns (B, T, C)."""
        cfg = self.config
        B, T, _ = x.shape
        H, KV, D, l, d = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.nsa_block_size, cfg.nsa_stride
        if cos.shape != (T, D) or sin.shape != (T, D):
            raise ValueError(f"cos/sin must be ({T}, {D}), got {tuple(cos.shape)} and {tuple(sin.shape)}")
        q = self.q_proj(x).view(B, T, H, D).transpose(1, 2)  # (B, H, T, D)
        q = apply_rope(self.q_norm(q), cos, sin)
        k = self.k_proj(x).view(B, T, self.n_sets, KV, D).permute(2, 0, 3, 1, 4)  # (nb, B, KV, T, D)
        v = self.v_proj(x).view(B, T, self.n_sets, KV, D).permute(2, 0, 3, 1, 4)  # (nb, B, KV, T, D)
        gates = torch.sigmoid(self.gate_proj(x)).view(B, T, H, 3).permute(0, 2, 1, 3)  # (B, H, T, 3)
        k_cmp_raw, v_cmp_raw = k[0], v[0]
        k_slc, v_slc = apply_rope(self.k_norm(k[self.n_sets // 2]), cos, sin), v[self.n_sets // 2]
        k_win, v_win = (apply_rope(self.k_norm(k[2]), cos, sin), v[2]) if self.n_sets == 3 else (k_slc, v_slc)

        if start_pos is None:
            k_cmp, v_cmp = self._compress(k_cmp_raw, v_cmp_raw, 0, cos, sin, 0)
            out = sparse_attention(q, k_cmp, v_cmp, k_slc, v_slc, k_win, v_win, gates, cfg)
        else:
            cache = self._check_cache(B, start_pos, T)
            end = start_pos + T
            first_new = num_compressed_blocks(start_pos, l, d)  # compressed blocks already in the cache
            n_cmp = num_compressed_blocks(end, l, d)
            raw_k = _ring_extend(cache.raw_k, start_pos, k_cmp_raw, first_new * d)  # (B, KV, end - first_new*d, D)
            raw_v = _ring_extend(cache.raw_v, start_pos, v_cmp_raw, first_new * d)
            new_k, new_v = self._compress(raw_k, raw_v, first_new * d, cos, sin, start_pos)
            cache.cmp_k[:, :, first_new:n_cmp] = new_k  # emitted before any query of this call attends
            cache.cmp_v[:, :, first_new:n_cmp] = new_v
            win_start = max(0, start_pos - cfg.nsa_window + 1)
            _ring_extend(cache.slc_k, start_pos, k_slc, 0)  # never wraps (capacity >= max_seq_len)
            _ring_extend(cache.slc_v, start_pos, v_slc, 0)
            k_slc, v_slc = cache.slc_k, cache.slc_v  # (B, KV, S_cap, D): whole buffer, read as blocks without a copy
            if cfg.nsa_separate_kv:
                k_win = _ring_extend(cache.win_k, start_pos, k_win, win_start)  # (B, KV, end - win_start, D)
                v_win = _ring_extend(cache.win_v, start_pos, v_win, win_start)
            else:
                k_win, v_win = k_slc[:, :, win_start:end], v_slc[:, :, win_start:end]
            out = sparse_attention(q, cache.cmp_k[:, :, :n_cmp], cache.cmp_v[:, :, :n_cmp], k_slc, v_slc, k_win,
                                   v_win, gates, cfg, q_start=start_pos, win_start=win_start)
        out = out.transpose(1, 2).reshape(B, T, H * D)  # (B, T, H*D)
        return self.o_proj(out)

    def _check_cache(self, batch_size: int, start_pos: int, T: int) -> NSACache:
        if self.cache is None:
            raise RuntimeError("start_pos was given but no NSA cache is set up; call setup_cache() first")
        if start_pos < 0 or start_pos + T > self.cache.max_seq_len:
            raise ValueError(f"NSA cache holds {self.cache.max_seq_len} positions; positions [{start_pos}, "
                             f"{start_pos + T}) do not fit")
        if batch_size != self.cache.slc_k.shape[0]:
            raise ValueError(f"NSA cache was set up for batch {self.cache.slc_k.shape[0]}, got batch {batch_size}")
        return self.cache

    def setup_cache(self, batch_size: int, max_seq_len: int, dtype: torch.dtype,
                    device: torch.device | str | None) -> None:
        self.cache = NSACache(self.config, batch_size, max_seq_len, dtype, device)

    def clear_cache(self) -> None:
        self.cache = None

    def init_weights(self) -> None:
        """Projections ~ N(0, init_std) (o_proj scaled by 1/sqrt(2 n_layers) like full attention); gate weights
        ~ N(0, init_std) with zero bias, so every branch starts with gate ~0.5."""
        cfg = self.config
        for proj in (self.q_proj, self.k_proj, self.v_proj, self.gate_proj):
            nn.init.normal_(proj.weight, std=cfg.init_std)
        nn.init.zeros_(self.gate_proj.bias)
        nn.init.normal_(self.o_proj.weight, std=cfg.init_std / math.sqrt(2 * cfg.n_layers))
        self.k_compress.init_weights(cfg.init_std)
        self.v_compress.init_weights(cfg.init_std)
        for norm in (self.q_norm, self.k_norm):
            if isinstance(norm, RMSNorm):
                norm.init_weights()
