"""NSA's three branches on Triton kernels: the GPU path of `nsa.attention._Chunk`, used for CUDA tensors when
Triton is installed. This module is the host side (what each kernel reads and writes, allocated here, and its launch
grid); the kernels themselves are in nsa/triton_kernels.py, imported only to launch one on real tensors. So on fake
tensors this path runs without Triton, allocating what it allocates on a GPU (profile_memory.py's estimate). No
kernel writes logits or probabilities to memory.

Selection (paper section 3.4; `TritonSelection`) in tiles of whole queries, 64 rows a tile (16 queries x G = 4
heads: full tensor-core tiles, where one program per query pads its G rows to 16).
- Forward: one program per (tile of queries, batch x KV head) walks the union of the blocks its queries selected
  (`_union_by_tile`: one sorted list per tile, each block once), loading a block's l' keys and values once for all
  the tile's rows, from the block's first position in a table of block starts (`BlockTable`: every l' keys, or
  each packed document's blocks from its first token); a row sees a block's keys only if its query selected it.
  Online softmax, as flash attention:
  the output and lse are written once, with no partial results per (query, slot) in memory.
- Backward: dQ the same way (a program per tile over its union, the probabilities recomputed from the lse, as
  flash attention's backward: dS = P * (dP - rowsum(dO * O))); dK and dV by one program per key block walking the
  (query, slot) pairs that chose it (`_pairs_by_block`, one sort), 64 rows a step, so each block has one writer
  and no atomics are needed.
A key at position p is visible to the query at t iff p <= t and p lies in one of the query's selected blocks; slots
whose block lies after the query's own block are unused (the padding of `nsa.blocks.select_blocks`).

Compression and window (`RangeAttention`): each query sees one contiguous range of keys (a prefix of the compressed
blocks; the last w keys), so they are flash attention with per-query bounds: forward and dQ by blocks of 64 rows
walking the union of their ranges, dK/dV by blocks of 64 keys walking the queries whose ranges meet them (found by
a binary search, as the bounds never decrease with the query).

Importance scores and top-n (paper Eqs. 8-11; `select_top_blocks`): one program per 64 queries recomputes the
compression probabilities from the branch's lse, sums them over the group's heads and pools them onto a tile of
selection blocks by a product with Eq. 9's weights, and merges the tile into a running top-n by n row maxima (each
score packed with its block index into one int64 key, so a maximum carries both); only the (Q, n) selected blocks
reach memory.

Accumulation is in float32 (float64 for float64 inputs, so the tests compare exactly); float32 inputs use IEEE
products, not TF32. Without a GPU the kernels run in Triton's interpreter if TRITON_INTERPRET=1 is set before
nsa/triton_kernels.py is imported (tests/conftest.py does so): that is how the tests check them on CPU.

Notation: B batch, KV key/value heads, G query heads per KV head, Q queries of the call at positions
[q_start, q_start + Q), NR = G * Q rows (head-major), D head dimension, S key positions, n selected blocks per
query, NB blocks a query of the call can select.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor
from torch._subclasses.fake_tensor import is_fake

from nsa.blocks import pairs_by_block, selection_pool_weights

_PAIR_ROWS = 64  # query rows per step of the selection kernels (whole queries of G heads each: 16 queries at G = 4)
_RANGE_BLOCK = 64  # rows per program and keys per step of the range and importance kernels


def queries_per_tile(G: int) -> int:
    """Queries of a tile of the selection kernels (whole queries of G rows each, _PAIR_ROWS rows): the forward and
    dQ walk the union of the blocks a tile's queries selected."""
    return max(1, _PAIR_ROWS // G)


def _launch(kernel: str, grid: tuple[int, ...], *args: object, acc: torch.dtype, **meta: object) -> None:
    """nsa.triton_kernels.<kernel>[grid](*args, **meta) accumulating in `acc`, except on fake tensors: their outputs
    are allocated and nothing runs (nor is Triton imported), so FakeTensorMode measures the memory of this path on
    any machine (profile_memory.py)."""
    if any(isinstance(a, Tensor) and is_fake(a) for a in args):
        return
    from nsa.triton_kernels import launch

    launch(kernel, grid, *args, float64=acc == torch.float64, **meta)


def _acc_dtype(t: Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def _next_power_of_2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _tile(n: int) -> int:
    """A tile dimension covering n: a power of two, at least tl.dot's minimum of 16."""
    return max(16, _next_power_of_2(n))


class GatedGrad(NamedTuple):
    """The gradient of one branch's output, gate * dO, as the backward kernels read it without forming it: the
    gated output's gradient dO (any strides, its last dimension contiguous), the offsets of its rows (R,) int64 in
    the branch's head-major row order (row (b * H + h) * Q + t) and each row's gate (R,) (0 where the branch's output
    is a constant)."""

    grad_out: Tensor
    offsets: Tensor
    gate: Tensor


def row_offsets(grad_out: Tensor) -> Tensor:
    """The element offsets (B*H*Q,) int64 of the rows of grad_out (B, H, Q, D), head-major, whatever its strides."""
    B, H, Q, _ = grad_out.shape
    sb, sh, sq, sd = grad_out.stride()
    if sd != 1:
        raise ValueError(f"the kernels read rows of a gradient whose last dimension is contiguous, got {sd}")
    idx = [torch.arange(n, device=grad_out.device) * st for n, st in ((B, sb), (H, sh), (Q, sq))]
    return (idx[0][:, None, None] + idx[1][None, :, None] + idx[2][None, None, :]).flatten()


def _gated(grad: Tensor | GatedGrad) -> GatedGrad:
    """A branch's output gradient as `GatedGrad`: a tensor (B, KV, G*Q, D) is its own dO, gate 1."""
    if isinstance(grad, GatedGrad):
        return grad
    grad = grad.contiguous()
    rows = grad.numel() // grad.shape[-1]
    offsets = torch.arange(rows, device=grad.device) * grad.shape[-1]
    return GatedGrad(grad, offsets, grad.new_ones(rows))


def _backward_inputs(grad: Tensor | GatedGrad, out: Tensor, lse: Tensor) -> tuple[GatedGrad, Tensor, Tensor]:
    """The flash backward's per-row inputs for an attention's output gradient (a tensor (B, KV, G*Q, D) or
    `GatedGrad`), out (B, KV, G*Q, D) and lse (B, KV, G*Q): (the gradient as `GatedGrad`, lse and
    delta = rowsum(dO * O), both contiguous in the accumulator dtype; delta by a kernel, with no copy of dO)."""
    grad, acc = _gated(grad), _acc_dtype(out)
    delta = out.new_empty(out.shape[:-1], dtype=acc)
    D = out.shape[-1]
    _launch("delta_kernel", (_cdiv(delta.numel(), _RANGE_BLOCK),), *grad, out.contiguous(), delta, delta.numel(),
            D=D, BLOCK_M=_RANGE_BLOCK, BLOCK_D=_tile(D), acc=acc)
    return grad, lse.to(acc).contiguous(), delta


def _precision(t: Tensor) -> dict:
    """Launch parameters set by the inputs' dtype: the accumulator type, and for float32 / float64 inputs (checks,
    not training) one pipeline stage instead of Triton's 3: their D = 128 tiles would otherwise need more shared
    memory than an A100's 164 KB (the range dK/dV kernel 193 KB at 2 stages, compiled for sm_80)."""
    wide = t.element_size() >= 4
    return dict(acc=_acc_dtype(t), num_stages=1 if wide else 3)


class BlockTable(NamedTuple):
    """Where the selection blocks' keys lie and which block each query owns, for `TritonSelection`: block j's keys
    are positions [start[j], end[j]) (start, end (R, NB) int32; end - start <= size = l'), query i's own block is
    own[i] (R, Q) long; R = 1 (every row of the batch alike) or B."""

    start: Tensor
    end: Tensor
    own: Tensor
    size: int

    @staticmethod
    def uniform(q_start: int, Q: int, l_sel: int, device: torch.device) -> BlockTable:
        """Blocks of l' keys from position 0 for queries at positions [q_start, q_start + Q) (one sequence)."""
        start = torch.arange(0, q_start + Q, l_sel, dtype=torch.int32, device=device)[None]  # (1, NB)
        own = (torch.arange(q_start, q_start + Q, device=device) // l_sel)[None]  # (1, Q)
        return BlockTable(start, start + l_sel, own, l_sel)


class TritonSelection:
    """`nsa.torch_path.Selection` on the Triton kernels: head-major query rows q (B, KV, G*Q, D) at positions
    [q_start, q_start + Q), their selected blocks idx (B, KV, Q, n) among the blocks of `BlockTable` `blocks` over
    the keys and values k, v (B, KV, S, D, contiguous); a slot whose block lies after the query's own block is
    unused. Forward and dQ walk each query tile's union of blocks (`_union_by_tile`); dK and dV walk each block's
    (query, slot) pairs (`_pairs_by_block`)."""

    def __init__(self, q: Tensor, k: Tensor, v: Tensor, blocks: BlockTable, idx: Tensor, q_start: int,
                 scale: float) -> None:
        B, KV, NR, D = q.shape
        Q, n = idx.shape[2], idx.shape[3]
        G = NR // Q
        self.q_start, self.scale, self.n, self.Q = q_start, scale, n, Q
        self.q = q.contiguous()
        self.k = k.view(B * KV, -1, D)  # (BKV, S, D)
        self.v = v.view(B * KV, -1, D)
        self.idx = idx.contiguous()
        self.blocks = blocks._replace(start=blocks.start.contiguous(), end=blocks.end.contiguous())  # (R, NB)
        self.n_blocks = blocks.start.shape[1]  # blocks a query of this call can select
        self.tables = (KV, self.n_blocks if blocks.start.shape[0] > 1 else 0)  # (KV, the tables' row stride)
        qb = queries_per_tile(G)  # whole queries of G rows per tile: 16 x 4 = 64 rows at G = 4
        self.used = idx <= blocks.own[:, None, :, None]  # (B, KV, Q, n): a slot after the own block is unused
        self.union, self.count = _union_by_tile(idx, self.used, qb)
        self.meta = dict(G=G, D=D, L_SEL=blocks.size, QB=qb, BLOCK_R=_tile(qb * G), BLOCK_D=_tile(D), **_precision(q))
        self.grid = (self.union.shape[1], B * KV)

    def forward(self, out: Tensor | None = None, lse: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """Writes and returns (out (B, KV, G*Q, D), lse (B, KV, G*Q) in float32, float64 for float64 inputs), into
        the given tensors when there are: one kernel, a program per tile of queries."""
        out = torch.empty_like(self.q) if out is None else out
        lse = self.q.new_empty(self.q.shape[:3], dtype=_acc_dtype(self.q)) if lse is None else lse
        _launch("selection_forward_kernel", self.grid, self.q, self.k, self.v, self.idx, self.union, self.count,
                self.blocks.start, out, lse, *self._sizes(), self.scale, BLOCK_N=_next_power_of_2(self.n),
                **self.meta)
        return out, lse

    def _sizes(self) -> tuple[int, ...]:
        """The forward and dQ kernels' (q_start, NQ, NT, U_MAX, S, N_SEL, KV, START_STRIDE)."""
        return self.q_start, self.Q, self.union.shape[1], self.union.shape[2], self.k.shape[1], self.n, *self.tables

    def backward(self, grad_out: Tensor | GatedGrad, out: Tensor, lse: Tensor, grad_k: Tensor, grad_v: Tensor,
                 dq: Tensor | None = None) -> Tensor:
        """Given grad_out (B, KV, G*Q, D, or `GatedGrad`), out (B, KV, G*Q, D) and lse (B, KV, G*Q) of the branch:
        adds the keys' and values' gradients into grad_k / grad_v (B, KV, S, D, contiguous) and returns
        the gradient of q (B, KV, G*Q, D), added into dq (contiguous) when given. dQ by query tiles over their
        unions; dK and dV by blocks over their pairs (each block has one writer: no atomics)."""
        grad, lse, delta = _backward_inputs(grad_out, out, lse)  # GatedGrad, (B, KV, G*Q) x 2
        add, dq = dq is not None, torch.empty_like(self.q) if dq is None else dq
        _launch("selection_dq_kernel", self.grid, self.q, self.k, self.v, *grad, lse, delta, self.idx,
                self.union, self.count, self.blocks.start, dq, *self._sizes(), self.scale,
                BLOCK_N=_next_power_of_2(self.n), ADD=add, **self.meta)
        B, KV = self.q.shape[:2]
        S, D = self.k.shape[1:]
        ptr, pair = _pairs_by_block(self.idx, self.used, self.n_blocks)
        _launch("selection_dkdv_kernel", (self.n_blocks, B * KV), self.q, self.k, self.v, *grad, lse, delta,
                ptr, pair, self.blocks.start, self.blocks.end, grad_k.view(B * KV, S, D), grad_v.view(B * KV, S, D),
                self.q_start, self.Q, S, self.n_blocks, self.n, *self.tables, self.scale, **self.meta)
        return dq


def _union_by_tile(idx: Tensor, used: Tensor, qb: int) -> tuple[Tensor, Tensor]:
    """For idx (B, KV, Q, n) and which of its slots are used (same shape): the union of the used slots' blocks of
    each tile of qb consecutive queries, as (union (B*KV, NT, qb*n) int32, ascending with the tile's count
    (B*KV, NT) int32 of distinct blocks first). No host sync: two sorts, in place where it can (int32 halves them)."""
    B, KV, Q, n = idx.shape
    nt, none = _cdiv(Q, qb), torch.iinfo(torch.int32).max
    ids = idx.new_full((B * KV, nt * qb, n), none, dtype=torch.int32)
    ids[:, :Q] = idx.view(B * KV, Q, n)
    ids[:, :Q].masked_fill_(~used.view(B * KV, Q, n), none)
    blocks = ids.view(B * KV, nt, qb * n).sort(-1).values
    del ids
    first = F.pad(blocks[..., 1:] != blocks[..., :-1], (1, 0), value=True) & (blocks != none)  # a block's first copy
    return blocks.masked_fill_(~first, none).sort(-1).values, first.sum(-1, dtype=torch.int32)


def _pairs_by_block(idx: Tensor, used: Tensor, n_blocks: int) -> tuple[Tensor, Tensor]:
    """For idx (B, KV, Q, n) and which of its slots are used (same shape): (ptr (B*KV*n_blocks + 1,), pair (P,))
    such that pair[ptr[g]:ptr[g + 1]] are the (query, slot) pairs (indices into idx's B*KV*Q*n entries) whose used
    slot selects block g % n_blocks of batch x KV head g // n_blocks."""
    B, KV = idx.shape[:2]
    _, order, counts = pairs_by_block(idx, used, n_blocks)  # unused slots: the last group
    return F.pad(counts.cumsum(0), (1, 0))[: B * KV * n_blocks + 1], order


class RangeAttention:
    """Softmax attention in which each query sees one contiguous range of keys, on the Triton kernels (no logits in
    memory): rows q (B, KV, G*Q, D) head-major (row g*Q + i is head g of query i) over keys/values k, v
    (B, KV, S, D); query i sees keys [lo[i], hi[i]) with lo, hi (Q,) for every row of the batch or (B, Q) a row
    each, non-decreasing in i and hi > lo. NSA's compression (lo = 0, or a document's first block; hi = the visible
    compressed blocks) and window (the last w keys, from the document's start) are such ranges.
    Interface of `nsa.torch_path.Window`: forward() -> (out, lse); backward(grad_out, out, lse) -> (dq, dk, dv)."""

    def __init__(self, q: Tensor, k: Tensor, v: Tensor, lo: Tensor, hi: Tensor, scale: float) -> None:
        B, KV, NR, D = q.shape
        self.q, self.k, self.v = q.contiguous(), k.contiguous(), v.contiguous()
        self.lo, self.hi = (x.to(torch.int32).reshape(-1, x.shape[-1]).contiguous() for x in (lo, hi))  # (R, Q)
        Q = self.lo.shape[1]
        self.scale, self.G = scale, NR // Q
        self.meta = dict(D=D, BLOCK_M=_RANGE_BLOCK, BLOCK_N=_RANGE_BLOCK, BLOCK_D=_tile(D), **_precision(q))
        # rows, queries, keys, and the tables' KV and row stride (0: one row for the batch)
        self.sizes = (NR, Q, k.shape[2], KV, Q if self.lo.shape[0] > 1 else 0)
        self.grid = (_cdiv(NR, _RANGE_BLOCK), B * KV)

    def forward(self, out: Tensor | None = None, lse: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """Writes and returns (out (B, KV, G*Q, D), lse (B, KV, G*Q) in float32, float64 for float64 inputs), into
        the given tensors when there are."""
        out = torch.empty_like(self.q) if out is None else out
        lse = self.q.new_empty(self.q.shape[:3], dtype=_acc_dtype(self.q)) if lse is None else lse
        _launch("range_forward_kernel", self.grid, self.q, self.k, self.v, self.lo, self.hi, out, lse, *self.sizes,
                self.scale, **self.meta)
        return out, lse

    def backward(self, grad_out: Tensor | GatedGrad, out: Tensor, lse: Tensor, dq: Tensor | None = None
                 ) -> tuple[Tensor, Tensor, Tensor]:
        """Given grad_out (B, KV, G*Q, D, or `GatedGrad`), out (B, KV, G*Q, D) and lse (B, KV, G*Q) of this
        attention: gradients of q (B, KV, G*Q, D; added into dq, contiguous, when given) and of k, v
        (B, KV, S, D)."""
        grad, lse, delta = _backward_inputs(grad_out, out, lse)  # GatedGrad, (B, KV, G*Q) x 2
        add, dq = dq is not None, torch.empty_like(self.q) if dq is None else dq
        dk, dv = torch.empty_like(self.k), torch.empty_like(self.v)
        args = (self.q, self.k, self.v, self.lo, self.hi, *grad, lse, delta)
        _launch("range_dq_kernel", self.grid, *args, dq, *self.sizes, self.scale, ADD=add, **self.meta)
        S = self.k.shape[2]
        R = self.lo.shape[0]
        first = torch.arange(0, S, _RANGE_BLOCK, device=self.q.device, dtype=torch.int32).repeat(R, 1)  # (R, NKB)
        q_first = torch.searchsorted(self.hi, first, right=True).to(torch.int32)  # first query with hi > block start
        q_last = torch.searchsorted(self.lo, first + _RANGE_BLOCK).to(torch.int32)  # first with lo >= block end
        _launch("range_dkdv_kernel", (first.shape[1], self.grid[1]), *args, q_first, q_last, dk, dv, *self.sizes,
                first.shape[1] if R > 1 else 0, self.scale, G=self.G, **self.meta)
        return dq, dk, dv


_POOL_WEIGHTS: dict[tuple[tuple[int, int, int], torch.device], Tensor] = {}


def _pool_weights(geometry: tuple[int, int, int], like: Tensor) -> Tensor:
    """`selection_pool_weights`' weights for geometry (l, d, l') on `like`'s device, copied there once per device
    (a copy from the host blocks the stream; fake tensors get their own)."""
    key = (geometry, like.device)
    if is_fake(like) or key not in _POOL_WEIGHTS:
        weights = torch.tensor(selection_pool_weights(*geometry)[1], device=like.device)  # (width,)
        if is_fake(like):
            return weights
        _POOL_WEIGHTS[key] = weights
    return _POOL_WEIGHTS[key]


class TopNRanges(NamedTuple):
    """What `select_top_blocks` reads of each query i, (Q,) for every row of the batch or (B, Q) a row each: it
    sees compressed blocks [cmp_lo[i], cmp_hi[i]) and chooses among selection blocks block0[i] .. own[i]."""

    cmp_lo: Tensor
    cmp_hi: Tensor
    block0: Tensor
    own: Tensor

    @staticmethod
    def uniform(n_visible: Tensor, q_start: int, l_sel: int) -> TopNRanges:
        """Queries at positions [q_start, q_start + Q) of one sequence, query i seeing the first n_visible[i]
        compressed blocks (Q,)."""
        own = torch.arange(q_start, q_start + n_visible.shape[0], device=n_visible.device) // l_sel
        return TopNRanges(torch.zeros_like(n_visible), n_visible, torch.zeros_like(own), own)


def select_top_blocks(q: Tensor, k_cmp: Tensor, lse: Tensor, ranges: TopNRanges, geometry: tuple[int, int, int],
                      n_select_blocks: int, n_selected: int, no_slot: int, scale: float) -> Tensor:
    """Top-n selection (`nsa.blocks.select_blocks`) of the importance scores (paper Eqs. 8-10) in one kernel, the
    scores never in memory: for queries q (B, KV, G*Q, D) (head-major rows), the compression branch's lse
    (B, KV, G*Q) over compressed keys k_cmp (B, KV, Nc, D), each query seeing the blocks `TopNRanges` gives: the
    probabilities recomputed from the lse, summed over each group's heads and pooled onto the first n_select_blocks
    selection blocks with `nsa.blocks.selection_pool_weights` for geometry (l, d, l'), one tile of blocks at a time
    merged into a running top-n. The query's first block (block0) and its own and previous blocks are forced in,
    blocks outside block0 .. own excluded, the rest ranked by importance in float32 (exact ties to the lower block, as
    nsa/reference.py breaks them; float64 scores closer than float32 resolves count as ties; a NaN score, as
    torch.topk ranks it, above every block). Returns (B, KV, Q, n_selected) long in descending order of score, slots no
    block fills holding `no_slot`."""
    B, KV, NR, D = q.shape
    l, d, l_sel = geometry
    first, weights = selection_pool_weights(l, d, l_sel)
    per_sel, width, block_c = l_sel // d, len(weights), max(64, _next_power_of_2(len(weights)))
    j_step = (block_c - width) // per_sel + 1  # selection blocks whose compressed blocks fit one tile of block_c
    block_n = _next_power_of_2(n_selected)
    tables = [x.to(torch.int32).reshape(-1, x.shape[-1]).contiguous() for x in ranges]  # (R, Q) each
    R, nq = tables[0].shape
    idx = torch.empty(B, KV, nq, n_selected, dtype=torch.long, device=q.device)
    _launch("selection_topn_kernel", (_cdiv(nq, _RANGE_BLOCK), B * KV), q.contiguous(), k_cmp.contiguous(),
            lse.to(_acc_dtype(q)).contiguous(), *tables, _pool_weights(geometry, q), idx, nq, k_cmp.shape[2],
            n_select_blocks, no_slot, KV, nq if R > 1 else 0, scale, G=NR // nq, D=D,
            PER_SEL=per_sel, FIRST=first, WIDTH=width, J_STEP=j_step, N_SEL=n_selected, BLOCK_M=_RANGE_BLOCK,
            BLOCK_J=_tile(j_step), BLOCK_N=block_n, BLOCK_C=block_c, BLOCK_D=_tile(D), **_precision(q))
    return idx
