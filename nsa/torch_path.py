"""NSA's three branches on PyTorch operators: the path of `nsa.attention._Chunk` wherever the Triton kernels do
not run (CPU tensors, `ComputeConfig(triton_kernels=False)`; the selection also where l' is not a power of two of at
least 16, which the Triton selection needs), every attention one `attend` call of
modeling/flash.py (on CPU tensors PyTorch's fused flash-attention kernel), which also returns each row's
log-sum-exp, with `attend_backward` reusing the saved output instead of recomputing the forward.
nsa/triton_path.py has the same classes on Triton kernels.

- Selection (`Selection`): the query's own block is attended densely, block by block, with a causal (l'*G, l') mask;
  the other selected (past, fully visible) blocks are grouped by block into tiles of R queries (`tile_plan`), each
  tile one unmasked attention of its R*G query rows over one l'-key block. The partial results merge through their
  lse.
- Sliding window (`Window`): pieces of 128 queries against their nearest keys with a band mask.
- Compression and the all-selected prefix (`MaskedAttention`): queries against a key set with an additive mask.

Every branch takes head-major query rows (B, KV, G*Q, D) (row g*Q + i is head g of query i) and has the interface
forward(out=None, lse=None) -> (out, lse), the results written into the given tensors when there are, and
backward(grad_out, out, lse, ..., dq=None) with the query gradient added into dq when given.

Notation: B batch, KV key/value heads, G query heads per KV head, Q queries of the chunk, D head dimension, l'
selection block size, n selected blocks per query, R (query, block) pairs per tile, P pairs of a chunk.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor
from torch._subclasses.fake_tensor import is_fake

from modeling.flash import additive_mask, attend, attend_backward
from nsa.blocks import pairs_by_block

# ---- selection branch: own block densely, past blocks in tiles ---------------------------------------------------

_TILE_ROWS = (16, 32)  # candidate (query, block) pairs per tile; one tile attends R * G query rows over l' keys
_SMALL_TILE_COST = 1.25  # per-row cost of R = 16 tiles relative to R = 32 (CPU kernels; benchmarks/results/nsa.md)


class TilePlan(NamedTuple):
    """How one chunk's (query, past selected block) pairs are grouped into tiles of R pairs that share one key block
    (`tile_plan`); padding rows point at the dummy query B*KV*Q."""

    tile_block: Tensor  # (n_tiles,) index of each tile's block among the B*KV*Nsb blocks
    query_of_row: Tensor  # (n_tiles * R,) query (index into B*KV*Q) of each tile row
    rows_per_tile: int  # R


def _tiles_per_block(counts: Tensor, P: int) -> tuple[int, Tensor, int]:
    """(R, tiles per block, n_tiles) for pairs-per-block counts: the R of `_TILE_ROWS` with the cheaper padded
    tiles, read from the device (one host sync per chunk). Fake and meta tensors, whose values are unknown, get the
    largest R and the worst-case count (profile_memory.py's estimate is then an upper bound)."""
    small, large = _TILE_ROWS
    tiles = [(counts + R - 1) // R for R in _TILE_ROWS]
    if counts.device.type == "meta" or is_fake(counts):
        return large, tiles[1], P // large + min(counts.numel(), P)
    n_small, n_large = torch.stack([t.sum() for t in tiles]).tolist()
    if n_small * small * _SMALL_TILE_COST < n_large * large:
        return small, tiles[0], n_small
    return large, tiles[1], n_large


@torch.no_grad()
def tile_plan(idx: Tensor, current: Tensor, n_blocks: int) -> TilePlan:
    """Group the pairs (query, idx[..., s]) with idx < current (past blocks; idx (B, KV, Q, n), current (R, Q) each
    query's own block, R = 1 or B) by block into tiles; n_blocks selection blocks per (B, KV). Tiles are made block
    by block, so n_tiles <= P / R + (distinct blocks selected)."""
    B, KV, Q, n = idx.shape
    P, BKQ, n_groups, dev = idx.numel(), B * KV * Q, B * KV * n_blocks, idx.device
    past = idx < current[:, None, :, None]
    gid, order, counts = pairs_by_block(idx, past, n_blocks)  # not past: group n_groups, last
    R, tiles, n_tiles = _tiles_per_block(counts[:n_groups], P)
    tile_end = tiles.cumsum(0)
    g_sorted = gid[order]
    rank = torch.arange(P, device=dev) - (counts.cumsum(0) - counts)[g_sorted]  # rank of a pair within its block
    first_row = F.pad((tile_end - tiles) * R, (0, 1), value=n_tiles * R)  # (n_groups + 1,); the rest: one spare row
    row_sorted = torch.minimum(first_row[g_sorted] + rank, torch.tensor(n_tiles * R, device=dev))
    query_of_row = torch.full((n_tiles * R + 1,), BKQ, device=dev).scatter_(0, row_sorted, order // n)
    return TilePlan(
        tile_block=torch.repeat_interleave(torch.arange(n_groups, device=dev), tiles, output_size=n_tiles),
        query_of_row=query_of_row[:-1],
        rows_per_tile=R,
    )


def _query_major(x: Tensor, Q: int) -> Tensor:
    """Head-major rows (B, KV, G*Q, *E) -> (B, KV, Q, G, *E)."""
    B, KV = x.shape[:2]
    return x.view(B, KV, -1, Q, *x.shape[3:]).transpose(2, 3)


def _head_major(x: Tensor) -> Tensor:
    """(B, KV, Q, G, *E) -> head-major rows (B, KV, G*Q, *E)."""
    B, KV, Q, G = x.shape[:4]
    return x.transpose(2, 3).reshape(B, KV, G * Q, *x.shape[4:])


def added(dq: Tensor | None, d: Tensor) -> Tensor:
    """A branch's query gradient d added into the accumulator dq when there is one (else d itself): the interface
    of the Triton branches, whose kernels add there directly."""
    return d if dq is None else dq.add_(d)


def written(result: tuple[Tensor, Tensor], out: Tensor | None, lse: Tensor | None) -> tuple[Tensor, Tensor]:
    """A branch's (out, lse), copied into the given tensors when there are (the interface of the Triton branches,
    which write there directly)."""
    if out is None:
        return result
    out.copy_(result[0])
    lse.copy_(result[1])
    return out, lse


class OwnBlocks(NamedTuple):
    """The selection blocks a chunk's queries own and where each query sits in them, for `Selection`: block (R, Q)
    each query's own block; first (R,) the chunk's first own block; count the own blocks of a row (the most of any
    row); row (R, Q) each query's position among the count * l' positions of blocks first .. first + count - 1. R = 1
    (every row of the batch alike) or B (packed documents, nsa/packing.py: a query's position in its block is its
    distance from the block's first key)."""

    block: Tensor
    first: Tensor
    count: int
    row: Tensor

    @staticmethod
    def uniform(q_start: int, Q: int, l_sel: int, device: torch.device) -> OwnBlocks:
        """Queries at positions [q_start, q_start + Q) of one sequence, blocks of l' keys from position 0."""
        q_pos = torch.arange(q_start, q_start + Q, device=device)  # (Q,)
        b0 = q_start // l_sel
        return OwnBlocks((q_pos // l_sel)[None], torch.tensor([b0], device=device),
                         (q_start + Q - 1) // l_sel - b0 + 1, (q_pos - b0 * l_sel)[None])


class Selection:
    """The selection branch of one chunk: head-major query rows q (B, KV, G*Q, D), their selected blocks idx
    (B, KV, Q, n) (entries >= the own block that are not it: unused slots) among the key/value blocks
    (B, KV, Nsb, l', D), or with `starts` (B, Nsb) (packed documents) among blocks of l' keys from those positions
    of the keys and values themselves (B, KV, S, D), read without a copy of them as blocks; `OwnBlocks` own says
    which block each query owns.

    Own block: the chunk's queries, placed at their rows of whole blocks, attend their block with a causal
    (l'*G, l') mask (rows ordered query-major, G heads per query). Past blocks: tiles of `tile_plan`, unmasked
    (every key is visible)."""

    def __init__(self, q: Tensor, k_blocks: Tensor, v_blocks: Tensor, idx: Tensor, own: OwnBlocks, scale: float,
                 starts: Tensor | None = None, block: int | None = None) -> None:
        q = _query_major(q, idx.shape[2])  # (B, KV, Q, G, D)
        B, KV, Q, G, D = q.shape
        self.starts, R = starts, own.block.shape[0]
        l_sel, n_blocks = (k_blocks.shape[3], k_blocks.shape[2]) if starts is None else (block, starts.shape[1])
        self.shape, self.scale, self.nb, self.block_shape = q.shape, scale, own.count, (KV, n_blocks, l_sel, D)
        self.rows = own.row.view(R, 1, Q, 1)  # each query's row among the own blocks' positions
        self.plan = tile_plan(idx, own.block, n_blocks)
        self.k_tiles = self._read(k_blocks, self.plan.tile_block)[:, None]  # (n_tiles, 1, l', D)
        self.v_tiles = self._read(v_blocks, self.plan.tile_block)[:, None]
        blocks = (own.first[:, None] + torch.arange(self.nb, device=q.device)).clamp(max=n_blocks - 1)  # (R, nb)
        bkv = torch.arange(B * KV, device=q.device).view(B, KV, 1)
        self.own_blocks = (bkv * n_blocks + blocks[:, None]).flatten()  # (B*KV*nb,) among the B*KV*Nsb blocks
        self.k_own = self._read(k_blocks, self.own_blocks)[:, None]  # (B*KV*nb, 1, l', D)
        self.v_own = self._read(v_blocks, self.own_blocks)[:, None]
        query = torch.arange(l_sel * G, device=q.device) // G  # (l'*G,) query of each own-block row
        self.causal = additive_mask(torch.arange(l_sel, device=q.device) <= query[:, None], q.dtype)  # (l'*G, l')
        self.q_tiles, self.q_own = self._tiles(q), self._own(q)

    def _tiles(self, x: Tensor) -> Tensor:
        """Per-query x (B, KV, Q, G, *E) -> tile rows (n_tiles, 1, R*G, *E); padding rows are zero."""
        B, KV, Q, G = self.shape[:4]
        extra = x.shape[4:]
        rows = F.pad(x.reshape(B * KV * Q, -1), (0, 0, 0, 1))  # (BKQ + 1, G * prod(E)), last row zero
        return rows.index_select(0, self.plan.query_of_row).view(-1, 1, self.plan.rows_per_tile * G, *extra)

    def _untile(self, x: Tensor) -> Tensor:
        """Tile rows (n_tiles, 1, R*G, *E) -> per-query sums (B, KV, Q, G, *E) (padding rows dropped)."""
        B, KV, Q, G = self.shape[:4]
        rows = x.reshape(self.plan.query_of_row.numel(), G * math.prod(x.shape[3:]))  # (n_tiles * R, G * prod(E))
        out = rows.new_zeros(B * KV * Q + 1, rows.shape[1]).index_add_(0, self.plan.query_of_row, rows)
        return out[:-1].view(B, KV, Q, G, *x.shape[3:])

    def _key_rows(self, blocks: Tensor, length: int) -> Tensor:
        """With `starts`: the rows (N * l',) of the keys flattened to (B*KV*S, D) (S = length) of the blocks (N,)
        (numbered among the B*KV*Nsb), positions past S clamped to its last (never seen)."""
        KV, n_blocks, l_sel, _ = self.block_shape
        bkv, j = blocks.div(n_blocks, rounding_mode="floor"), blocks % n_blocks
        first = self.starts[bkv.div(KV, rounding_mode="floor"), j]  # (N,)
        positions = (first[:, None] + torch.arange(l_sel, device=blocks.device)).clamp(max=length - 1)  # (N, l')
        return (bkv[:, None] * length + positions).flatten()

    def _read(self, x: Tensor, blocks: Tensor) -> Tensor:
        """The keys or values (N, l', D) of the blocks (N,) of x (blocks (B, KV, Nsb, l', D), or with `starts` keys
        (B, KV, S, D))."""
        if self.starts is None:
            return x.flatten(0, 2).index_select(0, blocks)
        _, _, l_sel, D = self.block_shape
        return x.reshape(-1, D).index_select(0, self._key_rows(blocks, x.shape[2])).view(-1, l_sel, D)

    def _add(self, grad: Tensor, blocks: Tensor, d: Tensor) -> None:
        """Adds the blocks' gradients d (N, l', D) into grad (laid out as `_read`'s x)."""
        if self.starts is None:
            grad.flatten(0, 2).index_add_(0, blocks, d)
        else:
            grad.view(-1, d.shape[-1]).index_add_(0, self._key_rows(blocks, grad.shape[2]), d.flatten(0, 1))

    def _rows(self, extra: tuple[int, ...]) -> Tensor:
        """Each query's row among the own blocks' positions as an index shaped (B, KV, Q, G, *extra)."""
        return self.rows.view(*self.rows.shape, *[1] * len(extra)).expand(*self.shape[:4], *extra)

    def _own(self, x: Tensor) -> Tensor:
        """Per-query x (B, KV, Q, G, *E) -> own-block rows (B*KV*nb, 1, l'*G, *E), zero where no query sits."""
        B, KV, _, G = self.shape[:4]
        rows = x.new_zeros(B, KV, self.nb * self.k_own.shape[2], G, *x.shape[4:])
        rows.scatter_(2, self._rows(x.shape[4:]), x)
        return rows.reshape(B * KV * self.nb, 1, -1, *x.shape[4:])

    def _unown(self, x: Tensor) -> Tensor:
        """Own-block rows (B*KV*nb, 1, l'*G, *E) -> (B, KV, Q, G, *E)."""
        B, KV, Q, G = self.shape[:4]
        x = x.reshape(B, KV, -1, G, *x.shape[3:])  # (B, KV, nb*l', G, *E)
        return x.gather(2, self._rows(x.shape[4:]))

    def forward(self, out: Tensor | None = None, lse_out: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """Returns (out (B, KV, G*Q, D), lse (B, KV, G*Q)) over each query's selected keys, written into the given
        tensors when there are."""
        o_tiles, lse_tiles = attend(self.q_tiles, self.k_tiles, self.v_tiles, None, self.scale)
        o_own, lse_own = attend(self.q_own, self.k_own, self.v_own, self.causal, self.scale)
        o_own, lse_own = self._unown(o_own), self._unown(lse_own)  # (B, KV, Q, G, D), (B, KV, Q, G)
        rows, G = self.plan.query_of_row, self.shape[3]
        lse_rows = lse_tiles.view(-1, G)  # (n_tiles * R, G)
        # lse over all parts: stabilised by each query's largest part (padding rows go to the dummy row).
        top = F.pad(lse_own.reshape(-1, G), (0, 0, 0, 1))  # (BKQ + 1, G)
        top.scatter_reduce_(0, rows[:, None].expand(-1, G), lse_rows, "amax")
        total = F.pad(torch.exp(lse_own.reshape(-1, G) - top[:-1]), (0, 0, 0, 1))
        total.index_add_(0, rows, torch.exp(lse_rows - top[rows]))
        lse = (top + total.log())  # (BKQ + 1, G)
        w_tiles = torch.exp(lse_rows - lse[rows]).view(lse_tiles.shape)[..., None]  # (n_tiles, 1, R*G, 1)
        lse = lse[:-1].view(lse_own.shape)
        merged = o_own * torch.exp(lse_own - lse)[..., None] + self._untile(o_tiles.to(w_tiles.dtype).mul_(w_tiles))
        return written((_head_major(merged.to(o_own.dtype)), _head_major(lse)), out, lse_out)

    def backward(self, grad_out: Tensor, out: Tensor, lse: Tensor, grad_k_blocks: Tensor, grad_v_blocks: Tensor,
                 dq: Tensor | None = None) -> Tensor:
        """Given grad_out, out (B, KV, G*Q, D) and lse (B, KV, G*Q) of the branch: adds the blocks' gradients into
        grad_k_blocks / grad_v_blocks (laid out as the keys and values given) and returns the gradient of q
        (B, KV, G*Q, D), added into dq when given."""
        B, KV, Q = self.shape[:3]
        grad_out, out, lse = (_query_major(x, Q) for x in (grad_out, out, lse))  # (B, KV, Q, G[, D])
        dq_t, dk_t, dv_t = attend_backward(self._tiles(grad_out), self.q_tiles, self.k_tiles, self.v_tiles,
                                           self._tiles(out), self._tiles(lse), None, self.scale)
        dq_o, dk_o, dv_o = attend_backward(self._own(grad_out), self.q_own, self.k_own, self.v_own, self._own(out),
                                           self._own(lse), self.causal, self.scale)
        for grad, d_tiles, d_own in ((grad_k_blocks, dk_t, dk_o), (grad_v_blocks, dv_t, dv_o)):
            self._add(grad, self.plan.tile_block, d_tiles[:, 0])
            self._add(grad, self.own_blocks, d_own[:, 0])
        return added(dq, _head_major(self._unown(dq_o) + self._untile(dq_t)))


class MaskedAttention:
    """`attend` of q (B, KV, L, D) over k, v (B, KV, S, D) under an additive mask, with the forward() ->
    (out, lse) / backward(grad_out, out, lse) -> (dq, dk, dv) interface of `Window` and
    `nsa.triton_path.RangeAttention`."""

    def __init__(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scale: float) -> None:
        self.q, self.k, self.v, self.mask, self.scale = q, k, v, mask, scale

    def forward(self, out: Tensor | None = None, lse: Tensor | None = None) -> tuple[Tensor, Tensor]:
        return written(attend(self.q, self.k, self.v, self.mask, self.scale), out, lse)

    def backward(self, grad_out: Tensor, out: Tensor, lse: Tensor, dq: Tensor | None = None
                 ) -> tuple[Tensor, Tensor, Tensor]:
        d_q, dk, dv = attend_backward(grad_out, self.q, self.k, self.v, out, lse, self.mask, self.scale)
        return added(dq, d_q), dk, dv


_WINDOW_ROWS = 128  # queries per window piece: each attends its s + w - 1 nearest keys (w in its band)


class Window:
    """The sliding-window branch of one chunk: queries q (B, KV, G*Q, D) (head-major rows) at positions
    [q_start, q_start + Q) over keys/values k, v (B, KV, W, D) at positions [k_start, k_start + W) with
    k_start >= q_start - w + 1. The queries are cut into ns pieces of s = min(`_WINDOW_ROWS`, Q) (the last one
    zero-padded); piece j attends keys [q_start + j*s - w + 1, q_start + (j+1)*s) under a band mask, so each
    query meets s + w - 1 keys instead of the chunk's Q + w - 1. With `first` (B, Q), query i of row b sees no key
    before position first[b, i] (packed documents: its document's start; the mask is then one per row)."""

    def __init__(self, q: Tensor, k: Tensor, v: Tensor, q_start: int, k_start: int, window: int, G: int,
                 scale: float, first: Tensor | None = None) -> None:
        B, KV, GQ, D = q.shape
        self.scale = scale
        Q, W = GQ // G, k.shape[2]
        s = min(_WINDOW_ROWS, Q)
        ns = -(-Q // s)
        self.shape, self.s, self.ns, self.width = (B, KV, G, Q, D), s, ns, s + window - 1
        self.left = k_start - (q_start - window + 1)  # key slots before the first key (zero, masked)
        self.right = ns * s - Q  # padded queries (and key slots) after the chunk
        self.W = W
        self.q = self._split(q)
        self.k, self.v = self._windows(k), self._windows(v)
        slot = torch.arange(self.width, device=q.device)  # (s + w - 1,)
        row = torch.arange(G * s, device=q.device) % s  # (G*s,) query of each row within its piece
        band = (slot >= row[:, None]) & (slot <= row[:, None] + window - 1)  # (G*s, s + w - 1): w keys, own last
        key = torch.arange(ns, device=q.device)[:, None] * s + slot  # (ns, s + w - 1) into the padded keys
        seen = (band & (key >= self.left)[:, None])[:, None]  # (ns, 1, G*s, s + w - 1)
        if first is not None:  # key position k_start - left + key at or after the query's first
            first = F.pad(first, (0, self.right)).view(B, ns, 1, s).expand(B, ns, G, s).reshape(B, ns, G * s)
            after = key[None, :, None] + (k_start - self.left) >= first[..., None]  # (B, ns, G*s, s + w - 1)
            seen = seen & after.transpose(0, 1)  # (ns, B, G*s, s + w - 1)
        self.mask = additive_mask(seen, q.dtype)  # (ns, 1 or B, G*s, s + w - 1)
        # one mask a row: the attention then takes the pieces as (ns*B, KV, ...), the mask as (ns*B, 1, ...)
        self.rows = first is not None and B > 1
        if self.rows:
            self.mask = self.mask.reshape(ns * B, 1, G * s, -1)

    def _attention(self, x: Tensor) -> Tensor:
        """Pieces (ns, B*KV, *E) as the attention takes them with this mask: (ns*B, KV, *E) when one a row."""
        return x.reshape(self.ns * self.shape[0], self.shape[1], *x.shape[2:]) if self.rows else x

    def _pieces(self, x: Tensor) -> Tensor:
        """The inverse of `_attention`."""
        return x.reshape(self.ns, -1, *x.shape[2:]) if self.rows else x

    def _split(self, x: Tensor) -> Tensor:
        """Rows (B, KV, G*Q, *E) -> pieces (ns, B*KV, G*s, *E), queries zero-padded to ns * s."""
        B, KV, G, Q, _ = self.shape
        x = x.view(B, KV, G, Q, *x.shape[3:])
        x = F.pad(x, [0, 0] * (x.dim() - 4) + [0, self.right])  # (B, KV, G, ns*s, *E)
        x = x.view(B * KV, G, self.ns, self.s, *x.shape[4:]).transpose(0, 2)  # (ns, G, B*KV, s, *E)
        return x.transpose(1, 2).reshape(self.ns, B * KV, G * self.s, *x.shape[4:])

    def _merge(self, x: Tensor) -> Tensor:
        """Pieces (ns, B*KV, G*s, *E) -> rows (B, KV, G*Q, *E)."""
        B, KV, G, Q, _ = self.shape
        x = x.view(self.ns, B * KV, G, self.s, *x.shape[3:]).permute(1, 2, 0, 3, *range(4, x.dim() + 1))
        return x.reshape(B, KV, G, self.ns * self.s, *x.shape[4:])[:, :, :, :Q].reshape(B, KV, G * Q, *x.shape[4:])

    def _windows(self, x: Tensor) -> Tensor:
        """Keys (B, KV, W, D) -> each piece's key slots (ns, B*KV, s + w - 1, D)."""
        B, KV, _, D = x.shape
        x = F.pad(x, (0, 0, self.left, self.right))  # (B, KV, ns*s + w - 1, D)
        x = x.unfold(2, self.width, self.s)  # (B, KV, ns, D, s + w - 1)
        return x.permute(2, 0, 1, 4, 3).reshape(self.ns, B * KV, self.width, D)

    def _unwindows(self, x: Tensor) -> Tensor:
        """Gradients of the key slots (ns, B*KV, s + w - 1, D) -> of the keys (B, KV, W, D)."""
        B, KV = self.shape[:2]
        out = x.new_zeros(B * KV, self.ns * self.s + self.width - self.s, x.shape[-1])
        for j in range(self.ns):
            out[:, j * self.s: j * self.s + self.width] += x[j]
        return out[:, self.left: self.left + self.W].view(B, KV, self.W, -1)

    def forward(self, out: Tensor | None = None, lse: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """Returns (out (B, KV, G*Q, D), lse (B, KV, G*Q)), written into the given tensors when there are."""
        o, o_lse = attend(*(self._attention(x) for x in (self.q, self.k, self.v)), self.mask, self.scale)
        return written((self._merge(self._pieces(o)), self._merge(self._pieces(o_lse))), out, lse)

    def backward(self, grad_out: Tensor, out: Tensor, lse: Tensor, dq: Tensor | None = None
                 ) -> tuple[Tensor, Tensor, Tensor]:
        """Given grad_out, out (B, KV, G*Q, D) and lse (B, KV, G*Q): gradients of q (B, KV, G*Q, D; added into dq
        when given) and of k, v (B, KV, W, D)."""
        inputs = (self._split(grad_out), self.q, self.k, self.v, self._split(out), self._split(lse))
        d_q, dk, dv = (self._pieces(d) for d in attend_backward(*(self._attention(x) for x in inputs), self.mask,
                                                                 self.scale))
        return added(dq, self._merge(d_q)), self._unwindows(dk), self._unwindows(dv)
