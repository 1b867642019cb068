"""Triton kernels for NSA's three branches: the GPU path of `nsa.attention._Chunk`, used for CUDA tensors when
Triton is installed. No kernel writes logits or probabilities to memory.

Selection (paper section 3.4; `TritonSelection`): each query's G heads attend the key blocks the query selected, read
in place from the (B, KV, S, D) keys, no tile of queries or keys gathered.
- Forward, one program per (query, batch x KV head): the query's G head rows (padded to at least 16, the smallest
  tensor-core tile) walk its selected blocks with an online softmax; output and log-sum-exp per row.
- Backward, dQ: the same walk, recomputing the probabilities from the saved lse (flash-attention backward,
  dS = P * (dP - rowsum(dO * O))).
- Backward, dK and dV: one program per (key block, batch x KV head) walks the queries that selected the block, a
  list built by one sort (`_queries_by_block`), in groups of rows; each block has one writer, so no atomics.
A key at position p is visible to the query at t iff p <= t and p lies in one of the query's selected blocks; slots
whose block lies after the query's own block are unused (the padding of `nsa.blocks.select_blocks`).

Compression and window (`RangeAttention`): each query sees one contiguous range of keys (a prefix of the compressed
blocks; the last w keys), so they are flash attention with per-query bounds: forward and dQ by blocks of 64 rows
walking the union of their ranges, dK/dV by blocks of 64 keys walking the queries whose ranges meet them (found by
a binary search, as the bounds never decrease with the query).

Importance scores (paper Eqs. 8-10; `importance_scores`): the compression probabilities recomputed from the branch's
lse, summed over the group's heads and pooled onto selection blocks by a product with Eq. 9's weights, one tile of
compressed blocks at a time: only the (Q, selection blocks) scores reach memory.

Accumulation is in float32 (float64 for float64 inputs, so the tests compare exactly); float32 inputs use IEEE
products, not TF32. Without a GPU the kernels run in Triton's interpreter if TRITON_INTERPRET=1 is set before this
module is imported (tests/conftest.py does so): that is how the tests check them on CPU.

Notation: B batch, KV key/value heads, G query heads per KV head, Q queries of the call at positions
[q_start, q_start + Q), NR = G * Q rows (head-major), D head dimension, S key positions, n selected blocks per
query, NB blocks a query of the call can select.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor
from torch._subclasses.fake_tensor import is_fake

from nsa.blocks import pairs_by_block, selection_pool_weights

_DK_ROWS = 64  # query rows per step of the selection's dK/dV kernel (whole queries of G heads each)
_RANGE_BLOCK = 64  # rows per program and keys per step of the range and importance kernels


@triton.jit
def _dot(a, b, ACC: tl.constexpr):
    """a @ b accumulated in ACC (float32 or float64), IEEE products."""
    return tl.dot(a, b, input_precision="ieee", out_dtype=ACC)


@triton.jit
def _online_softmax(m, denom, acc, logits, v, ACC: tl.constexpr):
    """One key tile of flash attention's forward: the running row max m, denominator and unnormalised output acc
    updated with the tile's masked logits (-inf where not visible) and values v. Returns (m, denom, acc)."""
    m_new = tl.maximum(m, tl.max(logits, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with no visible key so far: p = 0, not NaN
    p = tl.exp(logits - m_safe[:, None])
    alpha = tl.exp(m - m_safe)
    return m_new, denom * alpha + tl.sum(p, 1), acc * alpha[:, None] + _dot(p.to(v.dtype), v, ACC)


@triton.jit
def _backward_rows(Q, DO, LSE, DELTA, off, io_mask, row, row_ok):
    """A tile of query rows for backward: q and dO at offsets off (masked by io_mask), lse and delta = rowsum(dO * O)
    at row (masked by row_ok)."""
    return (tl.load(Q + off, mask=io_mask, other=0.0), tl.load(DO + off, mask=io_mask, other=0.0),
            tl.load(LSE + row, mask=row_ok, other=0.0), tl.load(DELTA + row, mask=row_ok, other=0.0))


@triton.jit
def _probs(q, k, lse, visible, scale, ACC: tl.constexpr):
    """Attention probabilities of a tile from its rows' saved lse: exp(q k^T * scale - lse) where visible, else 0."""
    return tl.where(visible, tl.exp(_dot(q, tl.trans(k), ACC) * scale - lse[:, None]), 0.0)


@triton.jit
def _probs_and_ds(q, k, v, do, lse, delta, visible, scale, ACC: tl.constexpr):
    """The flash-attention backward of one tile: P (`_probs`) and dS = P * (dO v^T - delta)."""
    p = _probs(q, k, lse, visible, scale, ACC)
    return p, p * (_dot(do, tl.trans(v), ACC) - delta[:, None])


@triton.jit
def _key_block(K, V, bh, S, k0, cols, col_ok, D: tl.constexpr, BLOCK_N: tl.constexpr):
    """Positions k0 + [0, BLOCK_N), their offsets into (BKV, S, D) and mask (nothing past S), and their keys and
    values (BLOCK_N, BLOCK_D)."""
    pos = k0 + tl.arange(0, BLOCK_N)
    off = (bh * S + pos[:, None]) * D + cols[None, :]
    mask = (pos < S)[:, None] & col_ok[None, :]
    return pos, off, mask, tl.load(K + off, mask=mask, other=0.0), tl.load(V + off, mask=mask, other=0.0)


@triton.jit
def _block(K, V, bh, S, j, t, cols, col_ok, D: tl.constexpr, L_SEL: tl.constexpr):
    """Keys and values (L_SEL, BLOCK_D) of block j of batch x KV head bh, zero where not visible from position t,
    and the visibility (L_SEL,)."""
    pos = j * L_SEL + tl.arange(0, L_SEL)
    visible = pos <= t
    off = (bh * S + pos[:, None]) * D + cols[None, :]  # into (BKV, S, D)
    mask = visible[:, None] & col_ok[None, :]
    return tl.load(K + off, mask=mask, other=0.0), tl.load(V + off, mask=mask, other=0.0), visible


@triton.jit
def _forward_kernel(Q, K, V, IDX, O, LSE, q_start, NQ, S, scale,
                    G: tl.constexpr, D: tl.constexpr, L_SEL: tl.constexpr, N_SEL: tl.constexpr,
                    BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, ACC: tl.constexpr):
    i = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    t = q_start + i  # the query's position
    rows, cols = tl.arange(0, BLOCK_G), tl.arange(0, BLOCK_D)
    row_ok, col_ok = rows < G, cols < D
    q_off = ((bh * NQ + i) * G + rows[:, None]) * D + cols[None, :]  # (BLOCK_G, BLOCK_D) into (BKV, NQ, G, D)
    q = tl.load(Q + q_off, mask=row_ok[:, None] & col_ok[None, :], other=0.0)
    m = tl.full([BLOCK_G], float("-inf"), ACC)
    denom = tl.zeros([BLOCK_G], ACC)
    acc = tl.zeros([BLOCK_G, BLOCK_D], ACC)
    for s in range(N_SEL):
        j = tl.load(IDX + (bh * NQ + i) * N_SEL + s)
        if j * L_SEL <= t:  # a used slot: the block starts at or before the query
            k, v, visible = _block(K, V, bh, S, j, t, cols, col_ok, D, L_SEL)
            logits = tl.where(visible[None, :], _dot(q, tl.trans(k), ACC) * scale, float("-inf"))
            m, denom, acc = _online_softmax(m, denom, acc, logits, v, ACC)
    tl.store(O + q_off, (acc / denom[:, None]).to(O.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])
    tl.store(LSE + (bh * NQ + i) * G + rows, m + tl.log(denom), mask=row_ok)


@triton.jit
def _dq_kernel(Q, K, V, IDX, DO, LSE, DELTA, DQ, q_start, NQ, S, scale,
               G: tl.constexpr, D: tl.constexpr, L_SEL: tl.constexpr, N_SEL: tl.constexpr,
               BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, ACC: tl.constexpr):
    i = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    t = q_start + i
    rows, cols = tl.arange(0, BLOCK_G), tl.arange(0, BLOCK_D)
    row_ok, col_ok = rows < G, cols < D
    q_off = ((bh * NQ + i) * G + rows[:, None]) * D + cols[None, :]
    io_mask = row_ok[:, None] & col_ok[None, :]
    q, do, lse, delta = _backward_rows(Q, DO, LSE, DELTA, q_off, io_mask, (bh * NQ + i) * G + rows, row_ok)
    dq = tl.zeros([BLOCK_G, BLOCK_D], ACC)
    for s in range(N_SEL):
        j = tl.load(IDX + (bh * NQ + i) * N_SEL + s)
        if j * L_SEL <= t:
            k, v, visible = _block(K, V, bh, S, j, t, cols, col_ok, D, L_SEL)
            _, ds = _probs_and_ds(q, k, v, do, lse, delta, visible[None, :], scale, ACC)  # (BLOCK_G, L_SEL)
            dq += _dot(ds.to(k.dtype), k, ACC)
    tl.store(DQ + q_off, (dq * scale).to(DQ.dtype.element_ty), mask=io_mask)


@triton.jit
def _dkdv_kernel(Q, K, V, DO, LSE, DELTA, PTR, ROW, DK, DV, q_start, NQ, S, NB, scale,
                 G: tl.constexpr, D: tl.constexpr, L_SEL: tl.constexpr, QB: tl.constexpr,
                 BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, ACC: tl.constexpr):
    jb = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    start = tl.load(PTR + bh * NB + jb)  # the block's (query, slot) pairs: ROW[start:end]
    end = tl.load(PTR + bh * NB + jb + 1)
    if start < end:
        r, cols = tl.arange(0, BLOCK_R), tl.arange(0, BLOCK_D)
        col_ok = cols < D
        pos, kv_off, kv_mask, k, v = _key_block(K, V, bh, S, jb * L_SEL, cols, col_ok, D, L_SEL)
        dk = tl.zeros([L_SEL, BLOCK_D], ACC)
        dv = tl.zeros([L_SEL, BLOCK_D], ACC)
        head = r % G
        for base in range(start, end, QB):  # QB queries, G rows each
            slot = base + r // G
            ok = (r < QB * G) & (slot < end)
            query = tl.load(ROW + slot, mask=ok, other=0)  # index into the (BKV * NQ) queries
            t = q_start + query - bh * NQ
            row_off = query * G + head
            io_mask = ok[:, None] & col_ok[None, :]
            q, do, lse, delta = _backward_rows(Q, DO, LSE, DELTA, row_off[:, None] * D + cols[None, :], io_mask,
                                               row_off, ok)
            visible = ok[:, None] & (pos[None, :] <= t[:, None])  # (BLOCK_R, L_SEL)
            p, ds = _probs_and_ds(q, k, v, do, lse, delta, visible, scale, ACC)
            dv += _dot(tl.trans(p).to(do.dtype), do, ACC)
            dk += _dot(tl.trans(ds).to(q.dtype), q, ACC)
        dk_old = tl.load(DK + kv_off, mask=kv_mask, other=0.0)
        dv_old = tl.load(DV + kv_off, mask=kv_mask, other=0.0)
        tl.store(DK + kv_off, (dk_old + dk * scale).to(DK.dtype.element_ty), mask=kv_mask)
        tl.store(DV + kv_off, (dv_old + dv).to(DV.dtype.element_ty), mask=kv_mask)


# ---- attention over a contiguous key range per query: the compression and window branches ----------------------


@triton.jit
def _range_rows(LO, HI, pid, NR, NQ, S, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Rows pid * BLOCK_M + [0, BLOCK_M) of the head-major (G * NQ) rows: (rows, in range, each row's key range
    lo, hi, and the union of the ranges as [start, end) with start a multiple of BLOCK_N)."""
    rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < NR
    lo = tl.load(LO + rows % NQ, mask=row_ok, other=0)
    hi = tl.load(HI + rows % NQ, mask=row_ok, other=0)
    start = tl.min(tl.where(row_ok, lo, S)) // BLOCK_N * BLOCK_N
    return rows, row_ok, lo, hi, start, tl.max(tl.where(row_ok, hi, 0))


@triton.jit
def _row_tile(bh, NR, rows, row_ok, cols, col_ok, D: tl.constexpr):
    """Offsets into (BKV, NR, D) and mask of the tile of rows x cols of batch x KV head bh."""
    return (bh * NR + rows[:, None]) * D + cols[None, :], row_ok[:, None] & col_ok[None, :]


@triton.jit
def _range_forward_kernel(Q, K, V, LO, HI, O, LSE, NR, NQ, S, scale,
                          D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                          ACC: tl.constexpr):
    pid = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    rows, row_ok, lo, hi, start, end = _range_rows(LO, HI, pid, NR, NQ, S, BLOCK_M, BLOCK_N)
    cols = tl.arange(0, BLOCK_D)
    col_ok = cols < D
    io_off, io_mask = _row_tile(bh, NR, rows, row_ok, cols, col_ok, D)
    q = tl.load(Q + io_off, mask=io_mask, other=0.0)
    m = tl.full([BLOCK_M], float("-inf"), ACC)
    denom = tl.zeros([BLOCK_M], ACC)
    acc = tl.zeros([BLOCK_M, BLOCK_D], ACC)
    for k0 in range(start, end, BLOCK_N):
        pos, _, _, k, v = _key_block(K, V, bh, S, k0, cols, col_ok, D, BLOCK_N)
        visible = (pos[None, :] >= lo[:, None]) & (pos[None, :] < hi[:, None])
        logits = tl.where(visible, _dot(q, tl.trans(k), ACC) * scale, float("-inf"))
        m, denom, acc = _online_softmax(m, denom, acc, logits, v, ACC)
    denom = tl.where(row_ok, denom, 1.0)  # padding rows saw nothing
    tl.store(O + io_off, (acc / denom[:, None]).to(O.dtype.element_ty), mask=io_mask)
    tl.store(LSE + bh * NR + rows, m + tl.log(denom), mask=row_ok)


@triton.jit
def _range_dq_kernel(Q, K, V, LO, HI, DO, LSE, DELTA, DQ, NR, NQ, S, scale,
                     D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                     ACC: tl.constexpr):
    pid = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    rows, row_ok, lo, hi, start, end = _range_rows(LO, HI, pid, NR, NQ, S, BLOCK_M, BLOCK_N)
    cols = tl.arange(0, BLOCK_D)
    col_ok = cols < D
    io_off, io_mask = _row_tile(bh, NR, rows, row_ok, cols, col_ok, D)
    q, do, lse, delta = _backward_rows(Q, DO, LSE, DELTA, io_off, io_mask, bh * NR + rows, row_ok)
    dq = tl.zeros([BLOCK_M, BLOCK_D], ACC)
    for k0 in range(start, end, BLOCK_N):
        pos, _, _, k, v = _key_block(K, V, bh, S, k0, cols, col_ok, D, BLOCK_N)
        visible = (pos[None, :] >= lo[:, None]) & (pos[None, :] < hi[:, None])
        _, ds = _probs_and_ds(q, k, v, do, lse, delta, visible, scale, ACC)
        dq += _dot(ds.to(k.dtype), k, ACC)
    tl.store(DQ + io_off, (dq * scale).to(DQ.dtype.element_ty), mask=io_mask)


@triton.jit
def _range_dkdv_kernel(Q, K, V, LO, HI, DO, LSE, DELTA, QA, QB, DK, DV, NR, NQ, S, scale,
                       G: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_D: tl.constexpr, ACC: tl.constexpr):
    kb = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    col_ok = cols < D
    pos, kv_off, kv_mask, k, v = _key_block(K, V, bh, S, kb * BLOCK_N, cols, col_ok, D, BLOCK_N)
    dk = tl.zeros([BLOCK_N, BLOCK_D], ACC)
    dv = tl.zeros([BLOCK_N, BLOCK_D], ACC)
    q_first = tl.load(QA + kb)  # the queries [q_first, q_last) see a key of this block
    q_last = tl.load(QB + kb)
    for g in range(G):
        for q0 in range(q_first, q_last, BLOCK_M):
            qi = q0 + tl.arange(0, BLOCK_M)
            row_ok = qi < q_last
            rows = g * NQ + qi
            io_off, io_mask = _row_tile(bh, NR, rows, row_ok, cols, col_ok, D)
            q, do, lse, delta = _backward_rows(Q, DO, LSE, DELTA, io_off, io_mask, bh * NR + rows, row_ok)
            lo = tl.load(LO + qi, mask=row_ok, other=0)
            hi = tl.load(HI + qi, mask=row_ok, other=0)
            visible = (pos[None, :] >= lo[:, None]) & (pos[None, :] < hi[:, None])  # (BLOCK_M, BLOCK_N)
            p, ds = _probs_and_ds(q, k, v, do, lse, delta, visible, scale, ACC)
            dv += _dot(tl.trans(p).to(do.dtype), do, ACC)
            dk += _dot(tl.trans(ds).to(q.dtype), q, ACC)
    tl.store(DK + kv_off, (dk * scale).to(DK.dtype.element_ty), mask=kv_mask)
    tl.store(DV + kv_off, dv.to(DV.dtype.element_ty), mask=kv_mask)


# ---- importance scores (paper Eqs. 8-10) without the compression probabilities in memory -----------------------


@triton.jit
def _importance_kernel(Q, K, LSE, NVIS, W, IMP, NQ, NC, NS, scale,
                       G: tl.constexpr, D: tl.constexpr, PER_SEL: tl.constexpr, FIRST: tl.constexpr,
                       WIDTH: tl.constexpr, J_STEP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_J: tl.constexpr,
                       BLOCK_C: tl.constexpr, BLOCK_D: tl.constexpr, ACC: tl.constexpr):
    pid = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    j0 = tl.program_id(2) * J_STEP  # this program's selection blocks: j0 .. j0 + J_STEP - 1
    qi = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    q_ok = qi < NQ
    n_visible = tl.load(NVIS + qi, mask=q_ok, other=0)
    cols = tl.arange(0, BLOCK_D)
    col_ok = cols < D
    cc = tl.arange(0, BLOCK_C)
    c = j0 * PER_SEL + FIRST + cc  # the compressed blocks that feed them
    c_ok = (c >= 0) & (c < NC)
    k = tl.load(K + (bh * NC + c[:, None]) * D + cols[None, :], mask=c_ok[:, None] & col_ok[None, :], other=0.0)
    visible = c_ok[None, :] & (c[None, :] < n_visible[:, None])  # (BLOCK_M, BLOCK_C)
    p = tl.zeros([BLOCK_M, BLOCK_C], ACC)  # compression probabilities summed over the group's heads (Eq. 10)
    for g in range(G):
        rows = bh * G * NQ + g * NQ + qi  # into (BKV * G * NQ) head-major rows
        q = tl.load(Q + rows[:, None] * D + cols[None, :], mask=q_ok[:, None] & col_ok[None, :], other=0.0)
        lse = tl.load(LSE + rows, mask=q_ok, other=0.0)
        p += _probs(q, k, lse, visible, scale, ACC)
    jj = tl.arange(0, BLOCK_J)
    offset = cc[:, None] - PER_SEL * jj[None, :]  # (BLOCK_C, BLOCK_J): Eq. 9's weight index of (c, j)
    w = tl.load(W + offset, mask=(offset >= 0) & (offset < WIDTH), other=0.0)
    importance = _dot(p, w.to(ACC), ACC)  # (BLOCK_M, BLOCK_J)
    j = j0 + jj
    tl.store(IMP + (bh * NQ + qi[:, None]) * NS + j[None, :], importance,
             mask=q_ok[:, None] & ((jj < J_STEP) & (j < NS))[None, :])


def _launch(kernel, grid: tuple[int, ...], *args: object, **meta: object) -> None:
    """kernel[grid](*args, **meta), except on fake tensors: their outputs are allocated and nothing runs, so
    FakeTensorMode measures the memory of this path (profile_memory.py)."""
    if not any(isinstance(a, Tensor) and is_fake(a) for a in args):
        kernel[grid](*args, **meta)


def _acc_dtype(t: Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def _tile(n: int) -> int:
    """A tile dimension covering n: a power of two, at least tl.dot's minimum of 16."""
    return max(16, triton.next_power_of_2(n))


def _backward_inputs(grad_out: Tensor, out: Tensor, lse: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The flash backward's per-row inputs for an attention's grad_out and out (..., D) and lse (...):
    (grad_out contiguous, lse and delta = rowsum(dO * O), both contiguous in the accumulator dtype)."""
    acc = _acc_dtype(grad_out)
    return grad_out.contiguous(), lse.to(acc).contiguous(), (grad_out.to(acc) * out.to(acc)).sum(-1)


def _precision(t: Tensor) -> dict:
    """Launch parameters set by the inputs' dtype: the accumulator type, and 2 pipeline stages instead of Triton's 3
    for float32 / float64 inputs (their D = 128 tiles would otherwise need up to 215 KB of shared memory, more than
    an A100's 164 KB; compiled for sm_80: at most 148 KB)."""
    wide = t.element_size() >= 4
    return dict(ACC=tl.float64 if _acc_dtype(t) == torch.float64 else tl.float32, num_stages=2 if wide else 3)


class TritonSelection:
    """Drop-in for `nsa.attention._Selection` on the Triton kernels: queries q (B, KV, Q, G, D) at positions
    [q_start, q_start + Q), their selected blocks idx (B, KV, Q, n) among the key/value blocks k_blocks, v_blocks
    (B, KV, Nsb, l', D) (contiguous, as `nsa.blocks.as_blocks` makes them)."""

    def __init__(self, q: Tensor, k_blocks: Tensor, v_blocks: Tensor, idx: Tensor, q_start: int, scale: float) -> None:
        B, KV, Q, G, D = q.shape
        self.shape, self.q_start, self.scale = q.shape, q_start, scale
        self.l_sel = k_blocks.shape[3]
        self.q = q.contiguous().view(B * KV, Q, G, D)
        self.k = k_blocks.view(B * KV, -1, D)  # (BKV, S, D), S = Nsb * l'
        self.v = v_blocks.view(B * KV, -1, D)
        self.idx = idx.contiguous()
        self.meta = dict(G=G, D=D, L_SEL=self.l_sel, BLOCK_D=_tile(D), **_precision(q))
        self.walk = dict(N_SEL=idx.shape[-1], BLOCK_G=_tile(G))  # query-centric kernels
        self.grid = (Q, B * KV)

    def forward(self) -> tuple[Tensor, Tensor]:
        """Returns (out (B, KV, Q, G, D), lse (B, KV, Q, G) in float32, float64 for float64 inputs)."""
        B, KV, Q, G, D = self.shape
        out = torch.empty_like(self.q)
        lse = torch.empty(B * KV, Q, G, dtype=_acc_dtype(self.q), device=self.q.device)
        _launch(_forward_kernel, self.grid, self.q, self.k, self.v, self.idx, out, lse, self.q_start, Q,
                self.k.shape[1], self.scale, **self.walk, **self.meta)
        return out.view(self.shape), lse.view(B, KV, Q, G)

    def backward(self, grad_out: Tensor, out: Tensor, lse: Tensor, grad_k_blocks: Tensor,
                 grad_v_blocks: Tensor) -> Tensor:
        """Given grad_out, out (B, KV, Q, G, D) and lse (B, KV, Q, G) of the branch: adds the blocks' gradients into
        grad_k_blocks / grad_v_blocks (B, KV, Nsb, l', D, contiguous) and returns the gradient of q
        (B, KV, Q, G, D)."""
        B, KV, Q, G, D = self.shape
        grad_out, lse, delta = _backward_inputs(grad_out, out, lse)  # (B, KV, Q, G, D), (B, KV, Q, G) x 2
        S = self.k.shape[1]
        dq = torch.empty_like(self.q)
        _launch(_dq_kernel, self.grid, self.q, self.k, self.v, self.idx, grad_out, lse, delta, dq, self.q_start, Q, S,
                self.scale, **self.walk, **self.meta)
        n_blocks = (self.q_start + Q - 1) // self.l_sel + 1  # blocks a query of this call can select
        ptr, row = _queries_by_block(self.idx, self.q_start, self.l_sel, n_blocks)
        qb = max(1, _DK_ROWS // G)
        _launch(_dkdv_kernel, (n_blocks, B * KV), self.q, self.k, self.v, grad_out, lse, delta, ptr, row,
                grad_k_blocks.view(B * KV, S, D), grad_v_blocks.view(B * KV, S, D), self.q_start, Q, S, n_blocks,
                self.scale, QB=qb, BLOCK_R=_tile(qb * G), **self.meta)
        return dq.view(self.shape)


def _queries_by_block(idx: Tensor, q_start: int, l_sel: int, n_blocks: int) -> tuple[Tensor, Tensor]:
    """For idx (B, KV, Q, n): (ptr (B*KV*n_blocks + 1,), row (P,)) such that row[ptr[g]:ptr[g + 1]] are the queries
    (indices into the B*KV*Q queries) whose used slots select block g % n_blocks of batch x KV head
    g // n_blocks."""
    B, KV, Q, n = idx.shape
    current = (torch.arange(q_start, q_start + Q, device=idx.device) // l_sel)[:, None]  # (Q, 1) own block
    _, order, counts = pairs_by_block(idx, idx <= current, n_blocks)  # unused slots: the last group
    ptr = F.pad(counts.cumsum(0), (1, 0))[: B * KV * n_blocks + 1]
    return ptr, order // n


class RangeAttention:
    """Softmax attention in which each query sees one contiguous range of keys, on the Triton kernels (no logits in
    memory): rows q (B, KV, G*Q, D) head-major (row g*Q + i is head g of query i) over keys/values k, v
    (B, KV, S, D); query i sees keys [lo[i], hi[i]) with lo, hi (Q,) non-decreasing in i and hi > lo. NSA's
    compression (lo = 0, hi = the visible compressed blocks) and window (the last w keys) are such ranges.
    Interface of `nsa.attention._Window`: forward() -> (out, lse); backward(grad_out, out, lse) -> (dq, dk, dv)."""

    def __init__(self, q: Tensor, k: Tensor, v: Tensor, lo: Tensor, hi: Tensor, scale: float) -> None:
        B, KV, NR, D = q.shape
        self.q, self.k, self.v = q.contiguous(), k.contiguous(), v.contiguous()
        self.lo, self.hi = lo.to(torch.int32).contiguous(), hi.to(torch.int32).contiguous()
        self.scale, self.G = scale, NR // lo.shape[0]
        self.meta = dict(D=D, BLOCK_M=_RANGE_BLOCK, BLOCK_N=_RANGE_BLOCK, BLOCK_D=_tile(D), **_precision(q))
        self.sizes = (NR, lo.shape[0], k.shape[2])  # rows, queries, keys
        self.grid = (triton.cdiv(NR, _RANGE_BLOCK), B * KV)

    def forward(self) -> tuple[Tensor, Tensor]:
        """Returns (out (B, KV, G*Q, D), lse (B, KV, G*Q) in float32, float64 for float64 inputs)."""
        out = torch.empty_like(self.q)
        lse = torch.empty(self.q.shape[:3], dtype=_acc_dtype(self.q), device=self.q.device)
        _launch(_range_forward_kernel, self.grid, self.q, self.k, self.v, self.lo, self.hi, out, lse, *self.sizes,
                self.scale, **self.meta)
        return out, lse

    def backward(self, grad_out: Tensor, out: Tensor, lse: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Given grad_out, out (B, KV, G*Q, D) and lse (B, KV, G*Q) of this attention: gradients of q
        (B, KV, G*Q, D) and of k, v (B, KV, S, D)."""
        grad_out, lse, delta = _backward_inputs(grad_out, out, lse)  # (B, KV, G*Q, D), (B, KV, G*Q) x 2
        dq, dk, dv = torch.empty_like(self.q), torch.empty_like(self.k), torch.empty_like(self.v)
        args = (self.q, self.k, self.v, self.lo, self.hi, grad_out, lse, delta)
        _launch(_range_dq_kernel, self.grid, *args, dq, *self.sizes, self.scale, **self.meta)
        S = self.k.shape[2]
        first = torch.arange(0, S, _RANGE_BLOCK, device=self.q.device, dtype=torch.int32)  # (n_key_blocks,)
        q_first = torch.searchsorted(self.hi, first, right=True).to(torch.int32)  # first query with hi > block start
        q_last = torch.searchsorted(self.lo, first + _RANGE_BLOCK).to(torch.int32)  # first with lo >= block end
        _launch(_range_dkdv_kernel, (first.numel(), self.grid[1]), *args, q_first, q_last, dk, dv, *self.sizes,
                self.scale, G=self.G, **self.meta)
        return dq, dk, dv


def importance_scores(q: Tensor, k_cmp: Tensor, lse: Tensor, n_visible: Tensor, geometry: tuple[int, int, int],
                      n_select_blocks: int, scale: float) -> Tensor:
    """Selection-block importance (paper Eqs. 8-10) of queries q (B, KV, G*Q, D) (head-major rows) given the
    compression branch's lse (B, KV, G*Q) over compressed keys k_cmp (B, KV, Nc, D), query i seeing the first
    n_visible[i] of them: the probabilities summed over each group's heads and pooled onto n_select_blocks selection
    blocks with `nsa.blocks.selection_pool_weights` for geometry (l, d, l'). Returns (B, KV, Q, n_select_blocks)
    in float32 (float64 for float64 inputs), as `pool_to_selection_blocks` of the explicit probabilities would."""
    B, KV, NR, D = q.shape
    l, d, l_sel = geometry
    first, weights = selection_pool_weights(l, d, l_sel)
    per_sel, width, block_c = l_sel // d, len(weights), max(64, triton.next_power_of_2(len(weights)))
    j_step = (block_c - width) // per_sel + 1  # selection blocks whose compressed blocks fit one tile of block_c
    nq, acc = n_visible.shape[0], _acc_dtype(q)
    out = torch.empty(B, KV, nq, n_select_blocks, dtype=acc, device=q.device)
    grid = (triton.cdiv(nq, _RANGE_BLOCK), B * KV, triton.cdiv(n_select_blocks, j_step))
    _launch(_importance_kernel, grid, q.contiguous(), k_cmp.contiguous(), lse.to(acc).contiguous(),
            n_visible.to(torch.int32).contiguous(), torch.tensor(weights, device=q.device), out, nq, k_cmp.shape[2],
            n_select_blocks, scale, G=NR // nq, D=D, PER_SEL=per_sel, FIRST=first, WIDTH=width, J_STEP=j_step,
            BLOCK_M=_RANGE_BLOCK, BLOCK_J=_tile(j_step), BLOCK_C=block_c, BLOCK_D=_tile(D), **_precision(q))
    return out
