"""The Triton kernels of NSA's branches (paper section 3.4), the device code behind nsa/triton_path.py, which launches
them and allocates what they read and write (read it first: shapes, grids and the algorithm are described there).
Imported only to launch a kernel on real tensors, so nothing else in the project needs Triton.

Accumulation is in ACC (float32, or float64 for float64 inputs, so the tests compare exactly); float32 inputs use
IEEE products, not TF32. Without a GPU the kernels run in Triton's interpreter if TRITON_INTERPRET=1 is set before
this module is imported (tests/conftest.py does so).

Notation: B batch, KV key/value heads, G query heads per KV head, NQ queries of the call, NR = G * NQ rows
(head-major), D head dimension, S key positions, N_SEL selected blocks per query, NB blocks a query can select.
Per-query and per-block tables (key ranges, block starts) are per batch row: program bh = b * KV + kv reads row
b = bh // KV of a table at offset b * stride (stride 0: one row for the whole batch).
"""

try:
    import triton
    import triton.language as tl
except ImportError as e:  # nsa/triton_path.py launches kernels only when Triton is installed
    raise ImportError("nsa/triton_kernels.py needs Triton (pip install triton); without it NSA runs its PyTorch "
                      "path") from e


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
def _gated_grad(DO, DO_ROW, GATE, row, row_ok, cols, io_mask):
    """The rows' output gradient (rows, BLOCK_D), gate * dO: the gated output's gradient dO read at the rows'
    offsets DO_ROW (any strides) times each row's gate, in dO's dtype."""
    do = tl.load(DO + tl.load(DO_ROW + row, mask=row_ok, other=0)[:, None] + cols[None, :], mask=io_mask, other=0.0)
    return (do * tl.load(GATE + row, mask=row_ok, other=0.0)[:, None]).to(do.dtype)


@triton.jit
def _backward_rows(Q, DO, DO_ROW, GATE, LSE, DELTA, off, io_mask, row, row_ok, cols):
    """A tile of query rows for backward: q at offsets off (masked by io_mask), the branch's output gradient
    (`_gated_grad`), lse and delta = rowsum(dO * O) at row (masked by row_ok)."""
    return (tl.load(Q + off, mask=io_mask, other=0.0), _gated_grad(DO, DO_ROW, GATE, row, row_ok, cols, io_mask),
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
def _dq_tile(q, k, v, do, lse, delta, visible, scale, ACC: tl.constexpr):
    """A key tile's share of its query rows' dQ, before the scale: dS k."""
    _, ds = _probs_and_ds(q, k, v, do, lse, delta, visible, scale, ACC)
    return _dot(ds.to(k.dtype), k, ACC)


@triton.jit
def _dkdv_tile(dk, dv, q, k, v, do, lse, delta, visible, scale, ACC: tl.constexpr):
    """A key tile's dK (before the scale) and dV with a tile of query rows' shares added: dS^T q and P^T dO."""
    p, ds = _probs_and_ds(q, k, v, do, lse, delta, visible, scale, ACC)
    return dk + _dot(tl.trans(ds).to(q.dtype), q, ACC), dv + _dot(tl.trans(p).to(do.dtype), do, ACC)


@triton.jit
def _store_dq(DQ, off, mask, dq, ADD: tl.constexpr):
    """Store a tile of query gradients, added to what DQ holds when ADD (the branches' shares of one dQ)."""
    if ADD:
        dq += tl.load(DQ + off, mask=mask, other=0.0).to(dq.dtype)
    tl.store(DQ + off, dq.to(DQ.dtype.element_ty), mask=mask)


@triton.jit
def _key_block(K, V, bh, S, k0, cols, col_ok, D: tl.constexpr, BLOCK_N: tl.constexpr):
    """Positions k0 + [0, BLOCK_N), their offsets into (BKV, S, D) and mask (nothing past S), and their keys and
    values (BLOCK_N, BLOCK_D)."""
    pos = k0 + tl.arange(0, BLOCK_N)
    off = (bh * S + pos[:, None]) * D + cols[None, :]
    mask = (pos < S)[:, None] & col_ok[None, :]
    return pos, off, mask, tl.load(K + off, mask=mask, other=0.0), tl.load(V + off, mask=mask, other=0.0)


@triton.jit
def _tile_rows(tile, NQ, bh, r, cols, col_ok, G: tl.constexpr, D: tl.constexpr, QB: tl.constexpr):
    """The rows of the tile of queries tile * QB + [0, QB), G head rows each (row r: query r // G, head r % G), in
    head-major (BKV, G, NQ, D) tensors: (each row's query, row ok, the row's index among the BKV * G * NQ rows, its
    offsets into (BKV * G * NQ, D) and their mask)."""
    qi = tile * QB + r // G
    ok = (r < QB * G) & (qi < NQ)
    row = (bh * G + r % G) * NQ + qi
    return qi, ok, row, row[:, None] * D + cols[None, :], ok[:, None] & col_ok[None, :]


@triton.jit
def _chosen_blocks(IDX, bh, qi, ok, NQ, N_SEL, BLOCK_N: tl.constexpr):
    """Each row's selected blocks (BLOCK_R, BLOCK_N) from IDX (BKV, NQ, N_SEL); -1 in slots past N_SEL."""
    slot = tl.arange(0, BLOCK_N)
    return tl.load(IDX + (bh * NQ + qi[:, None]) * N_SEL + slot[None, :], mask=ok[:, None] & (slot < N_SEL)[None, :],
                   other=-1)


@triton.jit
def _union_block(UNION, K, V, START, bh, tile, NT, U_MAX, u, chosen, ok, t, S, cols, col_ok, D: tl.constexpr,
                 L_SEL: tl.constexpr):
    """Entry u of the tile's union of selected blocks: its keys and values (L_SEL, BLOCK_D) from its first position
    START[b] (START: this program's row of the block starts) and which of them each row sees (BLOCK_R, L_SEL): the
    rows whose query selected the block, keys at or before the query."""
    b = tl.load(UNION + (bh * NT + tile) * U_MAX + u)
    pos, _, _, k, v = _key_block(K, V, bh, S, tl.load(START + b), cols, col_ok, D, L_SEL)
    chose = tl.sum((chosen == b).to(tl.int32), 1) > 0
    return k, v, (chose & ok)[:, None] & (pos[None, :] <= t[:, None])


@triton.jit
def selection_forward_kernel(Q, K, V, IDX, UNION, COUNT, START, O, LSE, q_start, NQ, NT, U_MAX, S, N_SEL, KV,
                             START_STRIDE, scale,
                             G: tl.constexpr, D: tl.constexpr, L_SEL: tl.constexpr, QB: tl.constexpr,
                             BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, ACC: tl.constexpr):
    tile = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    r, cols = tl.arange(0, BLOCK_R), tl.arange(0, BLOCK_D)
    col_ok = cols < D
    qi, ok, row, off, io_mask = _tile_rows(tile, NQ, bh, r, cols, col_ok, G, D, QB)
    chosen = _chosen_blocks(IDX, bh, qi, ok, NQ, N_SEL, BLOCK_N)
    q = tl.load(Q + off, mask=io_mask, other=0.0)
    m = tl.full([BLOCK_R], float("-inf"), ACC)
    denom = tl.zeros([BLOCK_R], ACC)
    acc = tl.zeros([BLOCK_R, BLOCK_D], ACC)
    for u in range(0, tl.load(COUNT + bh * NT + tile)):  # the union of the tile's blocks, each loaded once
        k, v, visible = _union_block(UNION, K, V, START + bh // KV * START_STRIDE, bh, tile, NT, U_MAX, u, chosen,
                                     ok, q_start + qi, S, cols, col_ok, D, L_SEL)
        logits = tl.where(visible, _dot(q, tl.trans(k), ACC) * scale, float("-inf"))
        m, denom, acc = _online_softmax(m, denom, acc, logits, v, ACC)
    denom = tl.where(ok, denom, 1.0)  # every real row sees its own block's first key
    tl.store(O + off, (acc / denom[:, None]).to(O.dtype.element_ty), mask=io_mask)
    tl.store(LSE + row, m + tl.log(denom), mask=ok)


@triton.jit
def selection_dq_kernel(Q, K, V, DO, DO_ROW, GATE, LSE, DELTA, IDX, UNION, COUNT, START, DQ, q_start, NQ, NT,
                        U_MAX, S, N_SEL, KV, START_STRIDE, scale,
                        G: tl.constexpr, D: tl.constexpr, L_SEL: tl.constexpr, QB: tl.constexpr,
                        BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, ADD: tl.constexpr,
                        ACC: tl.constexpr):
    tile = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    r, cols = tl.arange(0, BLOCK_R), tl.arange(0, BLOCK_D)
    col_ok = cols < D
    qi, ok, row, off, io_mask = _tile_rows(tile, NQ, bh, r, cols, col_ok, G, D, QB)
    chosen = _chosen_blocks(IDX, bh, qi, ok, NQ, N_SEL, BLOCK_N)
    q, do, lse, delta = _backward_rows(Q, DO, DO_ROW, GATE, LSE, DELTA, off, io_mask, row, ok, cols)
    dq = tl.zeros([BLOCK_R, BLOCK_D], ACC)
    for u in range(0, tl.load(COUNT + bh * NT + tile)):
        k, v, visible = _union_block(UNION, K, V, START + bh // KV * START_STRIDE, bh, tile, NT, U_MAX, u, chosen,
                                     ok, q_start + qi, S, cols, col_ok, D, L_SEL)
        dq += _dq_tile(q, k, v, do, lse, delta, visible, scale, ACC)
    _store_dq(DQ, off, io_mask, dq * scale, ADD)


@triton.jit
def selection_dkdv_kernel(Q, K, V, DO, DO_ROW, GATE, LSE, DELTA, PTR, PAIR, START, END, DK, DV, q_start, NQ, S, NB,
                          N_SEL, KV, START_STRIDE, scale,
                          G: tl.constexpr, D: tl.constexpr, L_SEL: tl.constexpr, QB: tl.constexpr,
                          BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, ACC: tl.constexpr):
    jb = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    start = tl.load(PTR + bh * NB + jb)  # the block's (query, slot) pairs: PAIR[start:end]
    end = tl.load(PTR + bh * NB + jb + 1)
    if start < end:  # a block no query chose has no gradient to add
        r, cols = tl.arange(0, BLOCK_R), tl.arange(0, BLOCK_D)
        col_ok = cols < D
        table = bh // KV * START_STRIDE + jb
        pos, kv_off, kv_mask, k, v = _key_block(K, V, bh, S, tl.load(START + table), cols, col_ok, D, L_SEL)
        kv_mask &= (pos < tl.load(END + table))[:, None]  # the block's own keys: blocks of documents may overlap
        dk = tl.zeros([L_SEL, BLOCK_D], ACC)
        dv = tl.zeros([L_SEL, BLOCK_D], ACC)
        for base in range(start, end, QB):  # QB queries, G rows each: a full tile at G = 4
            slot = base + r // G
            ok = (r < QB * G) & (slot < end)
            qi = tl.load(PAIR + slot, mask=ok, other=0) // N_SEL - bh * NQ  # the pair's query
            row = (bh * G + r % G) * NQ + qi  # head-major
            off, io_mask = row[:, None] * D + cols[None, :], ok[:, None] & col_ok[None, :]
            q, do, lse, delta = _backward_rows(Q, DO, DO_ROW, GATE, LSE, DELTA, off, io_mask, row, ok, cols)
            visible = ok[:, None] & (pos[None, :] <= q_start + qi[:, None])  # (BLOCK_R, L_SEL)
            dk, dv = _dkdv_tile(dk, dv, q, k, v, do, lse, delta, visible, scale, ACC)
        dk_old = tl.load(DK + kv_off, mask=kv_mask, other=0.0)
        dv_old = tl.load(DV + kv_off, mask=kv_mask, other=0.0)
        tl.store(DK + kv_off, (dk_old + dk * scale).to(DK.dtype.element_ty), mask=kv_mask)
        tl.store(DV + kv_off, (dv_old + dv).to(DV.dtype.element_ty), mask=kv_mask)


@triton.jit
def delta_kernel(DO, DO_ROW, GATE, O, DELTA, NR, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
                 ACC: tl.constexpr):
    """The backward's DELTA[r] = rowsum(dO * O) in ACC for rows pid * BLOCK_M + [0, BLOCK_M) of the (NR, D) output
    O, dO the branch's output gradient (`_gated_grad`)."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_D)
    ok = rows < NR
    mask = ok[:, None] & (cols < D)[None, :]
    do = _gated_grad(DO, DO_ROW, GATE, rows, ok, cols, mask).to(ACC)
    o = tl.load(O + rows[:, None] * D + cols[None, :], mask=mask, other=0.0).to(ACC)
    tl.store(DELTA + rows, tl.sum(do * o, 1), mask=ok)


# ---- attention over a contiguous key range per query: the compression and window branches ----------------------


@triton.jit
def _range_rows(LO, HI, pid, NR, NQ, S, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Rows pid * BLOCK_M + [0, BLOCK_M) of the head-major (G * NQ) rows: (rows, in range, each row's key range
    lo, hi from the program's rows LO, HI of the ranges, and the union of the ranges as [start, end) with start a
    multiple of BLOCK_N)."""
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
def range_forward_kernel(Q, K, V, LO, HI, O, LSE, NR, NQ, S, KV, LO_STRIDE, scale,
                          D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                          ACC: tl.constexpr):
    pid = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    table = bh // KV * LO_STRIDE
    rows, row_ok, lo, hi, start, end = _range_rows(LO + table, HI + table, pid, NR, NQ, S, BLOCK_M, BLOCK_N)
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
def range_dq_kernel(Q, K, V, LO, HI, DO, DO_ROW, GATE, LSE, DELTA, DQ, NR, NQ, S, KV, LO_STRIDE, scale,
                     D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                     ADD: tl.constexpr, ACC: tl.constexpr):
    pid = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    table = bh // KV * LO_STRIDE
    rows, row_ok, lo, hi, start, end = _range_rows(LO + table, HI + table, pid, NR, NQ, S, BLOCK_M, BLOCK_N)
    cols = tl.arange(0, BLOCK_D)
    col_ok = cols < D
    io_off, io_mask = _row_tile(bh, NR, rows, row_ok, cols, col_ok, D)
    q, do, lse, delta = _backward_rows(Q, DO, DO_ROW, GATE, LSE, DELTA, io_off, io_mask, bh * NR + rows, row_ok, cols)
    dq = tl.zeros([BLOCK_M, BLOCK_D], ACC)
    for k0 in range(start, end, BLOCK_N):
        pos, _, _, k, v = _key_block(K, V, bh, S, k0, cols, col_ok, D, BLOCK_N)
        visible = (pos[None, :] >= lo[:, None]) & (pos[None, :] < hi[:, None])
        dq += _dq_tile(q, k, v, do, lse, delta, visible, scale, ACC)
    _store_dq(DQ, io_off, io_mask, dq * scale, ADD)


@triton.jit
def range_dkdv_kernel(Q, K, V, LO, HI, DO, DO_ROW, GATE, LSE, DELTA, QA, QB, DK, DV, NR, NQ, S, KV, LO_STRIDE,
                       QA_STRIDE, scale,
                       G: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_D: tl.constexpr, ACC: tl.constexpr):
    kb = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    col_ok = cols < D
    pos, kv_off, kv_mask, k, v = _key_block(K, V, bh, S, kb * BLOCK_N, cols, col_ok, D, BLOCK_N)
    dk = tl.zeros([BLOCK_N, BLOCK_D], ACC)
    dv = tl.zeros([BLOCK_N, BLOCK_D], ACC)
    q_first = tl.load(QA + bh // KV * QA_STRIDE + kb)  # the queries [q_first, q_last) see a key of this block
    q_last = tl.load(QB + bh // KV * QA_STRIDE + kb)
    table = bh // KV * LO_STRIDE
    for g in range(G):
        for q0 in range(q_first, q_last, BLOCK_M):
            qi = q0 + tl.arange(0, BLOCK_M)
            row_ok = qi < q_last
            rows = g * NQ + qi
            io_off, io_mask = _row_tile(bh, NR, rows, row_ok, cols, col_ok, D)
            q, do, lse, delta = _backward_rows(Q, DO, DO_ROW, GATE, LSE, DELTA, io_off, io_mask, bh * NR + rows,
                                               row_ok, cols)
            lo = tl.load(LO + table + qi, mask=row_ok, other=0)
            hi = tl.load(HI + table + qi, mask=row_ok, other=0)
            visible = (pos[None, :] >= lo[:, None]) & (pos[None, :] < hi[:, None])  # (BLOCK_M, BLOCK_N)
            dk, dv = _dkdv_tile(dk, dv, q, k, v, do, lse, delta, visible, scale, ACC)
    tl.store(DK + kv_off, (dk * scale).to(DK.dtype.element_ty), mask=kv_mask)
    tl.store(DV + kv_off, dv.to(DV.dtype.element_ty), mask=kv_mask)


# ---- importance scores (paper Eqs. 8-10) without the compression probabilities in memory -----------------------


@triton.jit
def _importance_tile(Q, K, LSE, W, bh, qi, q_ok, c_lo, c_hi, j0, NQ, NC, scale, G: tl.constexpr, D: tl.constexpr,
                     PER_SEL: tl.constexpr, FIRST: tl.constexpr, WIDTH: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_J: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_D: tl.constexpr, ACC: tl.constexpr):
    """Importance (BLOCK_M, BLOCK_J) of the queries qi for selection blocks j0 + [0, BLOCK_J): the compression
    probabilities recomputed from the rows' lse over the compressed blocks that feed those selection blocks (a query
    sees blocks [c_lo, c_hi)), summed over the group's G heads (Eq. 10) and pooled by Eq. 9's weights W."""
    cols = tl.arange(0, BLOCK_D)
    col_ok = cols < D
    cc = tl.arange(0, BLOCK_C)
    c = j0 * PER_SEL + FIRST + cc  # the compressed blocks that feed them
    c_ok = (c >= 0) & (c < NC)
    k = tl.load(K + (bh * NC + c[:, None]) * D + cols[None, :], mask=c_ok[:, None] & col_ok[None, :], other=0.0)
    visible = c_ok[None, :] & (c[None, :] >= c_lo[:, None]) & (c[None, :] < c_hi[:, None])  # (BLOCK_M, BLOCK_C)
    p = tl.zeros([BLOCK_M, BLOCK_C], ACC)  # compression probabilities summed over the group's heads (Eq. 10)
    for g in range(G):
        rows = bh * G * NQ + g * NQ + qi  # into (BKV * G * NQ) head-major rows
        q = tl.load(Q + rows[:, None] * D + cols[None, :], mask=q_ok[:, None] & col_ok[None, :], other=0.0)
        lse = tl.load(LSE + rows, mask=q_ok, other=0.0)
        p += _probs(q, k, lse, visible, scale, ACC)
    offset = cc[:, None] - PER_SEL * tl.arange(0, BLOCK_J)[None, :]  # (BLOCK_C, BLOCK_J): Eq. 9's weight index
    w = tl.load(W + offset, mask=(offset >= 0) & (offset < WIDTH), other=0.0)
    return _dot(p, w.to(ACC), ACC)  # (BLOCK_M, BLOCK_J)


@triton.jit
def _ranked(score, j):
    """int64 keys whose order is that of score (as float32), ties going to the lower block index j: the float's bits
    made monotone as a signed integer in the high 32 bits, 2^31 - 1 - j in the low ones."""
    bits = score.to(tl.float32).to(tl.int32, bitcast=True)
    ordered = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
    return ordered.to(tl.int64) * 4294967296 + (2147483647 - j.to(tl.int64))


@triton.jit
def selection_topn_kernel(Q, K, LSE, C_LO, C_HI, BLOCK0, OWN, W, IDX, NQ, NC, NS, NO_SLOT, KV, TABLE_STRIDE, scale,
                          G: tl.constexpr, D: tl.constexpr, PER_SEL: tl.constexpr, FIRST: tl.constexpr,
                          WIDTH: tl.constexpr, J_STEP: tl.constexpr, N_SEL: tl.constexpr, BLOCK_M: tl.constexpr,
                          BLOCK_J: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_D: tl.constexpr,
                          ACC: tl.constexpr):
    pid = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    qi = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    q_ok = qi < NQ
    table = bh // KV * TABLE_STRIDE + qi
    c_lo = tl.load(C_LO + table, mask=q_ok, other=0)  # the compressed blocks the query sees: [c_lo, c_hi)
    c_hi = tl.load(C_HI + table, mask=q_ok, other=0)
    first = tl.load(BLOCK0 + table, mask=q_ok, other=0)  # the first block it may choose (its sequence's block 0)
    own = tl.load(OWN + table, mask=q_ok, other=0)  # its own block
    best = tl.full([BLOCK_M, BLOCK_N], -9223372036854775807, tl.int64)  # no block yet
    jj, slot = tl.arange(0, BLOCK_J), tl.arange(0, BLOCK_N)
    for j0 in range(tl.min(tl.where(q_ok, first, NS)), tl.max(tl.where(q_ok, own + 1, 0)), J_STEP):
        importance = _importance_tile(Q, K, LSE, W, bh, qi, q_ok, c_lo, c_hi, j0, NQ, NC, scale, G, D, PER_SEL,
                                      FIRST, WIDTH, BLOCK_M, BLOCK_J, BLOCK_C, BLOCK_D, ACC)
        j = j0 + jj
        forced = (j[None, :] == first[:, None]) | (j[None, :] == own[:, None]) | (j[None, :] == own[:, None] - 1)
        allowed = ((jj < J_STEP) & (j < NS))[None, :] & (j[None, :] >= first[:, None]) & (j[None, :] <= own[:, None])
        score = tl.where(forced, float("inf"), importance)
        score = tl.where(allowed, score, float("-inf"))
        tile = _ranked(score, j[None, :])  # (BLOCK_M, BLOCK_J)
        merged = tl.full([BLOCK_M, BLOCK_N], -9223372036854775807, tl.int64)
        for s in range(N_SEL):  # the n largest of best and tile, one at a time (a block's key is unique; every
            # copy of a key that decodes to no block goes at once, and the slots it leaves decode to no block too)
            pick = tl.maximum(tl.max(best, 1), tl.max(tile, 1))  # (BLOCK_M,)
            merged = tl.where(slot[None, :] == s, pick[:, None], merged)
            best = tl.where(best == pick[:, None], -9223372036854775807, best)
            tile = tl.where(tile == pick[:, None], -9223372036854775807, tile)
        best = merged  # descending
    block = 2147483647 - (best & 4294967295)  # the low 32 bits (`_ranked`)
    # a score of -inf has high bits -2139095041 (its float32 bits, ordered): a slot no allowed block filled
    block = tl.where((best >> 32) > -2139095041, block, NO_SLOT)
    tl.store(IDX + (bh * NQ + qi[:, None]) * N_SEL + slot[None, :], block, mask=q_ok[:, None] & (slot < N_SEL)[None, :])


def launch(kernel: str, grid: tuple[int, ...], *args: object, float64: bool, **meta: object) -> None:
    """Run the kernel named `kernel` on `grid`, accumulating in float64 or float32."""
    globals()[kernel][grid](*args, ACC=tl.float64 if float64 else tl.float32, **meta)
