"""The attention of Native Sparse Attention (nsa/layer.py holds the layer, nsa/blocks.py the block geometry and
top-n): the three gated branches over given queries, keys and values, chunk by chunk, with a custom backward.

Each branch is softmax attention returning its output and each row's log-sum-exp (lse); branch outputs combine
through their gates, and backward needs no recomputation of the forward (it reuses the saved outputs and lse).
The branches of one chunk (`_Chunk`) run on nsa/torch_path.py's PyTorch operators (CPU tensors: PyTorch's fused
flash-attention kernel, via modeling/flash.py) or, on CUDA with Triton installed, on nsa/triton_path.py's kernels.

- Compression: queries (G*Q rows per KV head) against the compressed keys with a visibility mask. On the PyTorch
  path its forward is explicit when the selection needs scores: one logits matrix gives the branch's output and the
  probabilities that score the selection blocks (paper Eqs. 8-10); the Triton path fuses the scores with top-n.
- Selection: each query's own block and its other selected blocks (`nsa.torch_path.Selection`: tiles of queries
  per block; `nsa.triton_path.TritonSelection`: tiles of queries over their blocks' union). A chunk whose queries
  have at most n blocks each (q_start + Q <= n*l') selects them all: there the branch is one causal attention over
  the prefix, with no scores and no top-n.
- Sliding window: each query's last w keys.
- On the Triton kernels all the queries of a training forward are one chunk (`_query_chunk`): a layer is a fixed
  number of kernel launches whatever T, with no host sync between them. Without gradients (prefill, evaluation)
  they run in eight chunks, whose branch outputs are gated before the next chunk runs.
- Packed documents (`documents`, nsa/packing.py), on the Triton kernels only: one chunk of all T queries, each
  query's compressed, selection and window ranges those of its document, as if the document were alone.

Threads. On CPU tensors the chunks run on one Python thread per PyTorch intra-op thread, each chunk on a single
intra-op thread (`_for_each_chunk`): a chunk is hundreds of small operators, and with several threads each of them
ends at a barrier that, on a machine shared with another job, waits a scheduler time slice for the thread that
lost its core. So W workers hold W chunks' temporaries and W sets of the key/value gradient sums at once; the
bound below is for one (as under fake tensors, a memory tracker or a single intra-op thread).

Memory and time. Queries are processed in chunks of Q = `ComputeConfig.attention_query_chunk` tokens. Forward keeps
its inputs plus,
when gradients are needed, each branch's output (3, B, H, T, D), its lse (3, B, H, T) and the selected block indices
(B, KV, T, n); backward walks the chunks again, rebuilding only the tiles, and adds gradients in place. Nothing
T x T and no T x (T/d) score matrix for all queries is allocated. With Nc = floor((T - l) / d) + 1 compressed
blocks, the peak of one layer's forward+backward, in elements, is

    linear part:  T * B * (c_lin * (H + 2 * nb * KV) * D + 5 * H + 2 * C)   (q, per-branch k/v, gates, x, saved
                                                                          branch outputs, grads)
    chunk part:   B * Q * (c_cmp * H * Nc + c_sel * KV * n * l' * D + c_win * H * (Q + w - 1))

with nb = 3 K/V sets when `nsa_separate_kv` else 1, and small constants c (tests/test_nsa.py checks the bound with
c_lin = 8, c_cmp = c_sel = c_win = 6; the selection term is loose: tiles hold about G * n * D values per query).
The chunk part is what the explicit path materialises: logits and probabilities of one chunk. The Triton kernels
(CUDA) run one chunk of all T queries in a training forward, and their chunk part is the selection's block lists:
each query's n blocks, their (query, slot) pairs sorted by block and each tile's union of blocks, about 32 bytes
per query, KV head and slot (the importance scores, logits and probabilities never reach memory; each branch's
output gradient is read as gate * dO inside the kernels, and the three branches add their dQ into one tensor).
One 4B layer at 131k: 16.3 GiB on that path against 22.3 GiB explicit with query chunk 2048
(benchmarks/nsa_memory_4b.py). For fixed Q the peak is linear in T.

Notation: B batch, T queries, H query heads, KV key/value heads, G = H // KV, D head dimension, C model width,
Q query-chunk length, Nc compressed blocks, Nsb selection blocks of the keys, n selected blocks per query, W window
keys of a chunk, R (query, block) pairs per tile, P pairs of a chunk. Block geometry: l (`nsa_block_size`),
d (`nsa_stride`), l' (`nsa_select_block_size`), n (`nsa_num_selected`), w (`nsa_window`).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor
from torch._subclasses.fake_tensor import is_fake
from torch.utils._python_dispatch import _get_current_dispatch_mode

from modeling.config import ComputeConfig
from modeling.flash import additive_mask, attend_explicit, fused
from nsa.blocks import (
    as_blocks,
    best_token_scores,
    choose_blocks,
    num_compressed_blocks,
    pool_to_selection_blocks,
    select_blocks,
)
from nsa.packing import DocumentBlocks, QueryRanges
from nsa.primitive import exact_scores_active, triton_ready
from nsa.torch_path import MaskedAttention, OwnBlocks, Selection, Window, written

if TYPE_CHECKING:
    from modeling.config import ModelConfig
    from nsa.triton_path import GatedGrad, TritonSelection

_Documents = tuple[DocumentBlocks, QueryRanges]  # packed documents' geometry and each query's ranges


# ---- one chunk: the three branches ------------------------------------------------------------------------------


class _Chunk:
    """The three branches of one query chunk: q (B, H, Q, D) at positions [q_start, q_start + Q); compressed keys
    and values (B, KV, Nc', D) it can see (Nc' >= 0), the selection blocks (B, KV, Nsb, l', D) and its window keys
    (B, KV, W, D) at positions [win_start, win_start + W). Every branch attends q as (B, KV, G*Q, D) rows
    (head-major: row g*Q + i is head g of query i).

    Packed documents (`documents`: the documents' blocks and the chunk's queries' `QueryRanges`): the compressed
    keys are all the slots of nsa/packing.py's virtual axis, each query's ranges those of its document, and
    k_blocks and v_blocks are the selection keys and values themselves (B, KV, S, D), each block read from its first
    position."""

    def __init__(self, q: Tensor, k_cmp: Tensor, v_cmp: Tensor, k_blocks: Tensor, v_blocks: Tensor, k_win: Tensor,
                 v_win: Tensor, q_start: int, win_start: int, config: ModelConfig, compute: ComputeConfig,
                 documents: _Documents | None = None) -> None:
        B, H, Q, D = q.shape
        KV = k_cmp.shape[1]
        G = H // KV
        l, d, w, l_sel = config.nsa_block_size, config.nsa_stride, config.nsa_window, config.nsa_select_block_size
        self.config, self.q_start, self.scale, self.documents = config, q_start, D**-0.5, documents
        self.k_cmp, self.v_cmp, self.k_blocks, self.v_blocks = k_cmp, v_cmp, k_blocks, v_blocks
        self.q_heads = q.reshape(B, KV, G * Q, D)  # (B, KV, G*Q, D)
        self.shape = (B, KV, G, Q, D)
        self.q_pos = q_pos = torch.arange(q_start, q_start + Q, device=q.device)  # (Q,)
        # Compression: block i visible to t iff i*d + l - 1 <= t. The first l - 1 positions see no block: they are
        # shown block 0 (no empty row) and their output is zeroed (`n_empty` rows, only in the first chunk).
        self.n_empty = min(Q, max(0, l - 1 - q_start))
        self.n_blocks = k_blocks.shape[2]  # selection blocks
        self.n_select = (q_start + Q - 1) // l_sel + 1  # of which the chunk's queries may choose the first n_select
        self.triton = triton_ready(q, compute)
        if documents is not None:
            self._packed(documents, k_win, v_win, win_start)
            return
        self.own = OwnBlocks.uniform(q_start, Q, l_sel, q.device)
        if self.triton:  # each query's compressed blocks and window keys are one contiguous range
            from nsa.triton_path import RangeAttention, TopNRanges

            self.n_visible = ((q_pos - (l - 1)).div(d, rounding_mode="floor") + 1).clamp(min=0)  # (Q,) blocks seen
            shown = self.n_visible.clamp(min=1)  # block 0 shown to the first l - 1 positions
            self.top_n = TopNRanges.uniform(self.n_visible, q_start, l_sel)
            self.compression = RangeAttention(self.q_heads, k_cmp, v_cmp, torch.zeros_like(shown), shown, self.scale)
            window_lo = (q_pos - w + 1).clamp(min=win_start) - win_start  # (Q,) into k_win
            self.window = RangeAttention(self.q_heads, k_win, v_win, window_lo, q_pos + 1 - win_start, self.scale)
        else:
            block_end = torch.arange(k_cmp.shape[2], device=q.device) * d + l - 1  # (Nc',)
            visible = block_end <= q_pos.clamp(min=l - 1).repeat(G)[:, None]  # (G*Q, Nc')
            self.compression = MaskedAttention(self.q_heads, k_cmp, v_cmp, additive_mask(visible, q.dtype), self.scale)
            self.window = Window(self.q_heads, k_win, v_win, q_start, win_start, w, G, self.scale)
        # Until n*l' keys exist every block of every query is selected: the branch is causal attention over the
        # prefix, one call, and needs neither importance scores nor top-n.
        self.all_selected = q_start + Q <= config.nsa_num_selected * config.nsa_select_block_size
        if self.all_selected:
            S = q_start + Q
            k_all, v_all = (x.flatten(2, 3)[:, :, :S] for x in (k_blocks, v_blocks))  # (B, KV, S, D)
            if self.triton:  # RangeAttention imported above
                self.prefix = RangeAttention(self.q_heads, k_all, v_all, torch.zeros_like(q_pos), q_pos + 1,
                                             self.scale)
            else:
                causal = torch.arange(S, device=q.device) <= q_pos.repeat(G)[:, None]  # (G*Q, S)
                self.prefix = MaskedAttention(self.q_heads, k_all, v_all, additive_mask(causal, q.dtype), self.scale)

    def _packed(self, documents: _Documents, k_win: Tensor, v_win: Tensor, win_start: int) -> None:
        """The branches of packed documents' queries (see the class docstring): each query's compressed slots,
        window and selection blocks from its document's ranges; the queries that see no compressed block yet (the
        first l - 1 of each document) are shown their document's first slot and their output is zeroed (`empty`).
        On the Triton kernels each range is one kernel argument; on PyTorch operators the compression and window
        take masks built from the ranges (as large as the logits they mask)."""
        blocks, ranges = documents
        B, KV, G, Q, _ = self.shape
        l_sel = self.config.nsa_select_block_size
        self.empty = ranges.cmp_hi == ranges.cmp_lo  # (B, Q)
        self.n_blocks = self.n_select = blocks.n_blocks
        self.all_selected = False
        shown = torch.maximum(ranges.cmp_hi, ranges.cmp_lo + 1)
        win_lo, win_hi = ranges.window_lo - win_start, (self.q_pos + 1 - win_start).expand_as(ranges.window_lo)
        if self.triton:
            from nsa.triton_path import BlockTable, RangeAttention, TopNRanges

            self.top_n = TopNRanges(ranges.cmp_lo, ranges.cmp_hi, ranges.block0, ranges.own)
            self.table = BlockTable(blocks.block_start, blocks.block_end, ranges.own, l_sel)
            self.compression = RangeAttention(self.q_heads, self.k_cmp, self.v_cmp, ranges.cmp_lo, shown, self.scale)
            self.window = RangeAttention(self.q_heads, k_win, v_win, win_lo, win_hi, self.scale)
        if not self.triton or not _triton_selects(l_sel):
            own = ranges.own.long()  # (B, Q)
            first = own[:, 0]  # (B,) the chunk's first own block in each row
            if is_fake(own) or own.device.type == "meta":  # values unknown: what Q queries of one document span
                count = min(Q, (Q - 1) // l_sel + 2)
            else:
                count = int((own[:, -1] - first).max()) + 1  # one host read: own blocks of a row
            self.own = OwnBlocks(own, first, count, (own - first[:, None]) * l_sel + ranges.in_block)
        if not self.triton:
            def within(lo: Tensor, hi: Tensor, n: int) -> Tensor:  # (B, 1, G*Q, n) mask: key j seen iff lo <= j < hi
                keys = torch.arange(n, device=lo.device)
                seen = (keys >= lo[..., None]) & (keys < hi[..., None])  # (B, Q, n)
                return additive_mask(seen.repeat(1, G, 1)[:, None], self.q_heads.dtype)

            self.compression = MaskedAttention(self.q_heads, self.k_cmp, self.v_cmp,
                                               within(ranges.cmp_lo, shown, self.k_cmp.shape[2]), self.scale)
            self.window = Window(self.q_heads, k_win, v_win, self.q_start, win_start, self.config.nsa_window, G,
                                 self.scale, first=ranges.window_lo)

    def _zero_empty(self, x: Tensor) -> None:
        """Zeroes x (B, H or KV, Q, *E) at the queries that see no compressed block (their compression output is
        0)."""
        if self.documents is None:
            x[:, :, : self.n_empty] = 0
        else:
            x.masked_fill_(self.empty.view(x.shape[0], 1, -1, *[1] * (x.dim() - 3)), 0)

    def _selection(self, idx: Tensor) -> Selection | TritonSelection:
        """The selection branch over the blocks idx (B, KV, Q, n): `Selection`, or the Triton kernels
        (`nsa.triton_path.TritonSelection`, same interface) when they run and l' suits them (`_triton_selects`)."""
        l_sel = self.config.nsa_select_block_size
        if self.triton and _triton_selects(l_sel):
            from nsa.triton_path import BlockTable, TritonSelection

            if self.documents is not None:  # the keys themselves, read at each block's first position
                return TritonSelection(self.q_heads, self.k_blocks, self.v_blocks, self.table, idx, self.q_start,
                                       self.scale)
            table = BlockTable.uniform(self.q_start, self.shape[3], l_sel, idx.device)
            return TritonSelection(self.q_heads, self.k_blocks.flatten(2, 3), self.v_blocks.flatten(2, 3), table, idx,
                                   self.q_start, self.scale)
        if self.documents is not None:  # the keys themselves, each block read from its first position
            return Selection(self.q_heads, self.k_blocks, self.v_blocks, idx, self.own, self.scale,
                             self.documents[0].block_start, l_sel)
        return Selection(self.q_heads, self.k_blocks, self.v_blocks, idx, self.own, self.scale)

    def _pooled(self, p: Tensor, n_select: int) -> Tensor:
        """Eqs. 8-10: compression probabilities p (B, KV, G*Q, Nc'), zero where not visible, summed over the group
        and pooled onto the first n_select selection blocks: (B, KV, Q, n_select); zero for the first l - 1
        positions, which see no block."""
        cfg, (B, KV, G, Q, _) = self.config, self.shape
        p_cmp = p.view(B, KV, G, Q, -1).sum(2)  # (B, KV, Q, Nc')
        self._zero_empty(p_cmp)
        return pool_to_selection_blocks(p_cmp, cfg.nsa_block_size, cfg.nsa_stride, cfg.nsa_select_block_size,
                                        n_select)

    def _compression(self, n_select: int | None, out: Tensor, lse: Tensor) -> Tensor | None:
        """Writes the compression branch's output into out (B, KV, G*Q, D) and its lse into lse (B, KV, G*Q);
        returns for n_select the importance scores (B, KV, Q, n_select) of `_pooled`, else None. The fused path
        computes the logits once, explicitly, and takes the output and the scores from the same probabilities (the
        Triton path's scores never reach memory: `_compression_and_selection`)."""
        B, KV, G, Q, D = self.shape
        if n_select is not None and exact_scores_active():
            self._compression(None, out, lse)
            q = self.q_heads.view(B, KV * G, Q, D)  # (B, H, Q, D)
            return best_token_scores(q, self.k_blocks, self.q_pos, n_select)
        importance = None
        if self.k_cmp.shape[2] == 0:  # no compressed block complete yet anywhere in the chunk
            out.zero_()
            lse.zero_()
            return None if n_select is None else self.q_heads.new_zeros(B, KV, Q, n_select, dtype=lse.dtype)
        if n_select is None:
            self.compression.forward(out, lse)
        else:
            c = self.compression
            o, o_lse, p = attend_explicit(c.q, c.k, c.v, c.mask, c.scale)  # p (B, KV, G*Q, Nc')
            written((o, o_lse), out, lse)
            importance = self._pooled(p, n_select)
        self._zero_empty(out.view(B, KV * G, Q, D))
        return importance

    def _compression_and_selection(self, n_select: int, out: Tensor, lse: Tensor) -> Tensor:
        """Writes the compression branch as `_compression` does and returns each query's selected blocks among the
        first n_select, idx (B, KV, Q, n) with unused slots holding Nsb: on the Triton kernels top-n fused with the
        importance scores, which never reach memory (`nsa.triton_path.select_top_blocks`); else `select_blocks`
        of `_compression`'s scores."""
        cfg, n, n_blocks = self.config, self.config.nsa_num_selected, self.n_blocks
        if self.triton and self.k_cmp.shape[2] > 0 and not exact_scores_active():
            from nsa.triton_path import select_top_blocks

            self._compression(None, out, lse)
            geometry = (cfg.nsa_block_size, cfg.nsa_stride, cfg.nsa_select_block_size)
            return select_top_blocks(self.q_heads, self.k_cmp, lse, self.top_n, geometry, n_select, n, n_blocks,
                                     self.scale)
        importance = self._compression(n_select, out, lse)
        if self.documents is None:
            idx, valid = select_blocks(importance, self.q_pos, cfg.nsa_select_block_size, n)  # (B, KV, Q, n')
        else:
            _, ranges = self.documents
            idx, valid = choose_blocks(importance, ranges.own[:, None], ranges.block0[:, None], n)
        return F.pad(idx.masked_fill(~valid, n_blocks), (0, n - idx.shape[-1]), value=n_blocks)

    def forward(self, outs: Tensor | None = None, lses: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """Returns (branch outputs (3, B, KV, G*Q, D), their lse (3, B, KV, G*Q), selected blocks (B, KV, Q, n)),
        the outputs and lse written into the given tensors when there are; unused slots of the selection hold
        Nsb."""
        cfg, (B, KV, G, Q, D) = self.config, self.shape
        l_sel, n, n_blocks = cfg.nsa_select_block_size, cfg.nsa_num_selected, self.n_blocks
        if outs is None:
            outs = self.q_heads.new_empty(3, B, KV, G * Q, D)
            lses = self.q_heads.new_empty(3, B, KV, G * Q, dtype=torch.promote_types(outs.dtype, torch.float32))
        if self.all_selected:
            self._compression(None, outs[0], lses[0])
            slot = torch.arange(n, device=self.q_pos.device)  # (n,): slot s holds block s while it exists
            idx = torch.where(slot <= (self.q_pos // l_sel)[:, None], slot, n_blocks)  # (Q, n)
            idx = idx.expand(B, KV, Q, n)
            self.prefix.forward(outs[1], lses[1])
        else:
            idx = self._compression_and_selection(self.n_select, outs[0], lses[0])
            self._selection(idx).forward(outs[1], lses[1])
        self.window.forward(outs[2], lses[2])
        return outs, lses, idx

    def backward(self, grad_out: Tensor, gates: Tensor, outs: Tensor, lses: Tensor, idx: Tensor,
                 grad_blocks: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor | None, Tensor | None, Tensor, Tensor]:
        """Given the gradient of the gated output grad_out (B, H, Q, D, any strides), the gates (B, H, Q, 3), the
        outputs and lse of `forward` and its selection idx: adds the selection blocks' gradients into grad_blocks
        (each (B, KV, Nsb, l', D)) and returns the gradients of q (B, KV, G*Q, D), the compressed keys and values
        (None when there are none) and the window keys and values. Each branch's output gradient is made when its
        backward runs (one of them in memory at a time), and every branch adds its share into one dQ."""
        B, KV, G, Q, D = self.shape

        if self.triton:
            from nsa.triton_path import GatedGrad, row_offsets

            if grad_out.stride(-1) != 1:  # the kernels read whole rows (an expanded gradient has stride 0)
                grad_out = grad_out.contiguous()
            offsets = row_offsets(grad_out)

        def branch_grad(s: int, fused: bool = self.triton) -> Tensor | GatedGrad:
            """The gradient of branch s's output, gate * grad_out, zero for the rows whose output is a constant
            (`_zero_empty`, compression): (B, KV, G*Q, D), or for the Triton kernels a `GatedGrad` that they read
            without forming it."""
            if fused:
                gate = gates[..., s].clone(memory_format=torch.contiguous_format)  # (B, H, Q)
                if s == 0:
                    self._zero_empty(gate)
                return GatedGrad(grad_out, offsets, gate.flatten())
            grad = torch.mul(grad_out, gates[..., s, None], out=grad_out.new_empty(B, KV * G, Q, D))
            if s == 0:
                self._zero_empty(grad)
            return grad.view(B, KV, G * Q, D)

        dq = dk_cmp = dv_cmp = None
        if self.k_cmp.shape[2] > 0:
            dq, dk_cmp, dv_cmp = self.compression.backward(branch_grad(0), outs[0], lses[0])
        if self.all_selected:
            dq, dk, dv = self.prefix.backward(branch_grad(1), outs[1], lses[1], dq)
            for grad, d in zip(grad_blocks, (dk, dv), strict=True):
                grad.flatten(2, 3)[:, :, : d.shape[2]] += d
        else:
            selection = self._selection(idx)
            fused = not isinstance(selection, Selection)
            if fused and self.documents is None:  # the Triton kernels add into the keys' layout (B, KV, S, D)
                grad_blocks = tuple(g.flatten(2, 3) for g in grad_blocks)
            dq = selection.backward(branch_grad(1, fused), outs[1], lses[1], *grad_blocks, dq)
            del selection  # its lists of blocks
        dq, dk_win, dv_win = self.window.backward(branch_grad(2), outs[2], lses[2], dq)
        return dq, dk_cmp, dv_cmp, dk_win, dv_win


def _triton_selects(l_sel: int) -> bool:
    """Whether `nsa.triton_path.TritonSelection` takes selection blocks of l' keys: a power of two >= 16, the
    smallest tensor-core tile."""
    return l_sel >= 16 and l_sel & (l_sel - 1) == 0


INFERENCE_CHUNKS = 8  # query chunks of a forward without gradients on the Triton kernels (`_query_chunk`)


def _query_chunk(q: Tensor, config: ModelConfig, compute: ComputeConfig, keep: bool) -> int:
    """Queries `sparse_attention` runs together (B, H, T, D = q.shape). On the Triton kernels, whose working memory
    does not grow with the chunk (no scores, no logits, no per-(query, slot) results): all T when the branch outputs
    are kept for backward anyway, so a layer is a fixed number of launches whatever T; without gradients
    INFERENCE_CHUNKS chunks (of at least `attention_query_chunk` queries), whose three branch outputs, held until
    they are gated, are 3/8 of q's size instead of 3x, for 4 launches a chunk. Elsewhere, and while
    `exact_block_scores` holds (its scores are (Q, Nsb) in memory), `compute.attention_query_chunk`."""
    T, Q = q.shape[2], compute.attention_query_chunk
    if not (triton_ready(q, compute) and _triton_selects(config.nsa_select_block_size) and not exact_scores_active()):
        return Q
    return max(T, 1) if keep else max(Q, -(-T // INFERENCE_CHUNKS))


class _Span(NamedTuple):
    """One query chunk: its queries as a slice of [0, T), the compressed blocks it can see, its window keys as a
    slice of k_win, and the positions of its first query and first window key."""

    queries: slice
    n_cmp: int
    window: slice
    q_start: int
    win_start: int


def _spans(T: int, q_start: int, win_start: int, config: ModelConfig, chunk: int,
           documents: _Documents | None = None) -> list[_Span]:
    """The query chunks of T queries at positions [q_start, q_start + T) whose window keys start at win_start,
    `chunk` queries each. With packed documents a chunk sees the compressed slots up to its last query's (one host
    read for all chunks; all of them under fake tensors, whose values are unknown: the last chunk's, the peak)."""
    l, d, w = config.nsa_block_size, config.nsa_stride, config.nsa_window
    n_cmp = None
    if documents is not None:
        (blocks, ranges), n_chunks = documents, -(-T // chunk)
        n_cmp = [blocks.n_compressed] * n_chunks
        if not is_fake(ranges.cmp_hi) and ranges.cmp_hi.device.type != "meta":
            last = torch.arange(min(chunk, T) - 1, T + chunk - 1, chunk, device=ranges.cmp_hi.device).clamp(max=T - 1)
            n_cmp = torch.maximum(ranges.cmp_hi, ranges.cmp_lo + 1)[:, last].amax(0).tolist()  # (n_chunks,)
    spans = []
    for c0 in range(0, T, chunk):
        c1 = min(c0 + chunk, T)
        t0, t1 = q_start + c0, q_start + c1  # absolute positions of the chunk's queries
        w0 = max(t0 - w + 1, win_start) - win_start  # first window key of the chunk, as an index into k_win
        spans.append(_Span(slice(c0, c1), num_compressed_blocks(t1, l, d) if n_cmp is None else n_cmp[len(spans)],
                           slice(w0, t1 - win_start), t0, win_start + w0))
    return spans


def _chunk(span: _Span, q: Tensor, k_cmp: Tensor, v_cmp: Tensor, k_blocks: Tensor, v_blocks: Tensor, k_win: Tensor,
           v_win: Tensor, config: ModelConfig, compute: ComputeConfig, documents: _Documents | None = None) -> _Chunk:
    """The `_Chunk` of one span; arguments as in `_SparseAttention.forward`, the selection keys/values as blocks
    (`as_blocks`; with documents the keys/values themselves)."""
    if documents is not None:
        documents = (documents[0], documents[1].queries(span.queries))
    return _Chunk(q[:, :, span.queries], k_cmp[:, :, : span.n_cmp], v_cmp[:, :, : span.n_cmp], k_blocks, v_blocks,
                  k_win[:, :, span.window], v_win[:, :, span.window], span.q_start, span.win_start, config, compute,
                  documents)


def _selection_keys(k_slc: Tensor, v_slc: Tensor, l_sel: int, documents: _Documents | None
                    ) -> tuple[Tensor, Tensor]:
    """The selection keys and values as `_Chunk` reads them: blocks (B, KV, Nsb, l', D) (`as_blocks`), or with
    packed documents the keys and values themselves (each block read from its first position)."""
    if documents is not None:
        return k_slc.contiguous(), v_slc.contiguous()
    return as_blocks(k_slc, l_sel), as_blocks(v_slc, l_sel)


def _workers(q: Tensor, compute: ComputeConfig, n_chunks: int) -> int:
    """How many threads run the chunks (`_for_each_chunk`): for real CPU tensors on the fused kernels, one per
    intra-op thread (at most one per chunk); else 1. Under a dispatch mode (fake tensors, a memory tracker) 1, so
    that the mode sees every operator."""
    if not fused(q) or triton_ready(q, compute) or is_fake(q) or _get_current_dispatch_mode() is not None:
        return 1
    return max(1, min(torch.get_num_threads(), n_chunks))


def _for_each_chunk(n_chunks: int, workers: int, body: Callable[[int, int], None]) -> None:
    """body(worker, chunk) for every chunk, each worker's calls in order.

    One worker: here, in chunk order. Several: one thread each, with PyTorch's intra-op threads set to 1 meanwhile,
    so each chunk runs single-threaded and no operator waits at a barrier for another thread (on a busy machine
    such a barrier costs a scheduler time slice, per operator). The chunks, the last (which see the most keys)
    first, are dealt to the workers in a zigzag: a fixed assignment, so gradients sum in the same order on every
    run, and a balanced one. The caller's grad mode and CPU autocast hold in the workers."""
    if workers == 1:
        for c in range(n_chunks):
            body(0, c)
        return
    mine: list[list[int]] = [[] for _ in range(workers)]
    for i, c in enumerate(reversed(range(n_chunks))):
        turn, k = divmod(i, workers)
        mine[k if turn % 2 == 0 else workers - 1 - k].append(c)
    grad, autocast = torch.is_grad_enabled(), torch.is_autocast_enabled("cpu")
    autocast_dtype = torch.get_autocast_dtype("cpu")

    def work(worker: int) -> None:
        with torch.set_grad_enabled(grad), torch.autocast("cpu", autocast_dtype, enabled=autocast):
            for c in mine[worker]:
                body(worker, c)

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with ThreadPoolExecutor(workers) as pool:
            for future in [pool.submit(work, w) for w in range(workers)]:
                future.result()
    finally:
        torch.set_num_threads(threads)


def _gate_into(out: Tensor, gates: Tensor, branches: Tensor) -> None:
    """out (B, H, Q, D) = sum over s of gates[..., s] (B, H, Q, 3) times branches[s] (3, B, H, Q, D), with no
    temporary of the branches' size."""
    torch.mul(branches[0], gates[..., 0, None], out=out)
    for s in (1, 2):
        out.addcmul_(branches[s], gates[..., s, None])


def _add_part(total: Tensor | None, like: Tensor, rows: slice, part: Tensor) -> Tensor:
    """A gradient shaped like `like` (B, KV, N, D), zero at first (None), with `part` added to its rows [rows]
    (dim 2); a part that covers every row is the gradient itself, with no zeros made."""
    if total is None:
        if part.shape == like.shape:
            return part
        total = torch.zeros_like(like)
    total[:, :, rows] += part
    return total


class _SparseAttention(torch.autograd.Function):
    """`sparse_attention`: forward chunk by chunk (one chunk on the Triton kernels: `_query_chunk`), keeping
    (when gradients are needed) each branch's output and lse and the selected blocks; backward walks the chunks
    again, each branch's backward starting from the saved output and lse (no recomputation of the forward), and
    adds each chunk's gradients into the full ones in place (one set of accumulators per worker of
    `_for_each_chunk`, summed at the end). A forward without gradients runs in chunks on the Triton kernels too, so
    that it holds one chunk's branch outputs, not those of all T queries (3 GiB for one 4B layer's 131k prefill:
    `_query_chunk`)."""

    @staticmethod
    def forward(ctx, q: Tensor, k_cmp: Tensor, v_cmp: Tensor, k_slc: Tensor, v_slc: Tensor, k_win: Tensor,
                v_win: Tensor, gates: Tensor, config: ModelConfig, compute: ComputeConfig, q_start: int,
                win_start: int, documents: _Documents | None, grad_enabled: bool) -> Tensor:
        B, H, T, D = q.shape
        KV, n, l_sel = k_cmp.shape[1], config.nsa_num_selected, config.nsa_select_block_size
        k_blocks, v_blocks = _selection_keys(k_slc, v_slc, l_sel, documents)
        keep = grad_enabled and any(ctx.needs_input_grad)  # (forward itself runs with grad mode off)
        chunk = _query_chunk(q, config, compute, keep)
        whole = chunk >= T
        out = torch.empty_like(q)  # (B, H, T, D)
        outs = q.new_empty(3, B, H, T, D) if keep else None
        lses = q.new_empty(3, B, H, T, dtype=torch.promote_types(q.dtype, torch.float32)) if keep else None
        idx = q.new_empty(B, KV, T, n, dtype=torch.long) if keep else None
        spans = _spans(T, q_start, win_start, config, chunk, documents)

        def run(worker: int, c: int) -> None:
            qs = spans[c].queries
            chunk = _chunk(spans[c], q, k_cmp, v_cmp, k_blocks, v_blocks, k_win, v_win, config, compute, documents)
            # one chunk writes its branches where they are kept; chunks write their own and are copied there
            into = (outs.view(3, B, KV, -1, D), lses.view(3, B, KV, -1)) if keep and whole else ()
            o, lse, chunk_idx = chunk.forward(*into)  # (3, B, KV, G*Q, D), (3, B, KV, G*Q), (B, KV, Q, n)
            o, lse = o.view(3, B, H, -1, D), lse.view(3, B, H, -1)
            _gate_into(out[:, :, qs], gates[:, :, qs], o)
            if keep:
                if not whole:
                    outs[:, :, :, qs], lses[:, :, :, qs] = o, lse
                idx[:, :, qs] = chunk_idx

        _for_each_chunk(len(spans), _workers(q, compute, len(spans)), run)
        ctx.save_for_backward(q, k_cmp, v_cmp, k_slc, v_slc, k_win, v_win, gates, outs, lses, idx)
        ctx.config, ctx.compute, ctx.q_start, ctx.win_start = config, compute, q_start, win_start
        ctx.chunk, ctx.whole, ctx.documents = chunk, whole, documents
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor) -> tuple[Tensor | None, ...]:
        q, k_cmp, v_cmp, k_slc, v_slc, k_win, v_win, gates, outs, lses, idx = ctx.saved_tensors
        config, compute, l_sel = ctx.config, ctx.compute, ctx.config.nsa_select_block_size
        B, H, T, D = q.shape
        KV = k_cmp.shape[1]
        documents = ctx.documents
        k_blocks, v_blocks = _selection_keys(k_slc, v_slc, l_sel, documents)
        g_q = None if ctx.whole else torch.empty_like(q)  # chunks' queries are disjoint: each written once
        g_gates = torch.empty_like(gates)  # (B, H, T, 3)
        spans = _spans(T, ctx.q_start, ctx.win_start, config, ctx.chunk, documents)
        workers = _workers(q, compute, len(spans))
        # per worker: gradients of k_cmp, v_cmp, k_win, v_win (made by the first chunk: `_add_part`), the blocks'
        sums: list[list[Tensor | None]] = [[None] * 4 + [torch.zeros_like(t) for t in (k_blocks, v_blocks)]
                                           for _ in range(workers)]

        def run(worker: int, c: int) -> None:
            nonlocal g_q
            qs, n_cmp, ws = spans[c].queries, spans[c].n_cmp, spans[c].window
            mine = sums[worker]
            chunk = _chunk(spans[c], q, k_cmp, v_cmp, k_blocks, v_blocks, k_win, v_win, config, compute, documents)
            for s in range(3):
                g_gates[:, :, qs, s] = torch.einsum("bhqd,bhqd->bhq", grad_out[:, :, qs], outs[s, :, :, qs])
            dq, dk_cmp, dv_cmp, dk_win, dv_win = chunk.backward(
                grad_out[:, :, qs], gates[:, :, qs], outs[:, :, :, qs].reshape(3, B, KV, -1, D),
                lses[:, :, :, qs].reshape(3, B, KV, -1), idx[:, :, qs], (mine[4], mine[5]))
            if ctx.whole:  # the one chunk's gradient is the whole
                g_q = dq.reshape(B, H, T, D)
            else:
                g_q[:, :, qs] = dq.reshape(B, H, -1, D)
            parts = ((0, k_cmp, slice(0, n_cmp), dk_cmp), (1, v_cmp, slice(0, n_cmp), dv_cmp),
                     (2, k_win, ws, dk_win), (3, v_win, ws, dv_win))
            for i, like, rows, part in parts:
                if part is not None:
                    mine[i] = _add_part(mine[i], like, rows, part)

        _for_each_chunk(len(spans), workers, run)
        totals = sums[0]
        for other in sums[1:]:
            for i, part in enumerate(other):
                if part is not None:
                    totals[i] = part if totals[i] is None else totals[i].add_(part)
        g_kc, g_vc, g_kw, g_vw = (torch.zeros_like(like) if t is None else t
                                  for t, like in zip(totals[:4], (k_cmp, v_cmp, k_win, v_win), strict=True))
        g_kb, g_vb = totals[4:]
        S = k_slc.shape[2]
        g_kb, g_vb = (g.flatten(2, g.dim() - 2)[:, :, :S] for g in (g_kb, g_vb))  # (B, KV, S, D)
        return g_q, g_kc, g_vc, g_kb, g_vb, g_kw, g_vw, g_gates, None, None, None, None, None, None


@torch.compiler.disable  # opaque to torch.compile: the chunk loop and its threads run eagerly between graphs
def sparse_attention(q: Tensor, k_cmp: Tensor, v_cmp: Tensor, k_slc: Tensor, v_slc: Tensor, k_win: Tensor,
                     v_win: Tensor, gates: Tensor, config: ModelConfig, q_start: int = 0, win_start: int = 0,
                     compute: ComputeConfig | None = None, documents: DocumentBlocks | None = None) -> Tensor:
    """The three gated NSA branches for queries at positions [q_start, q_start + T), chunk by chunk (one chunk
    on the Triton kernels when gradients are needed).

    Args:
        q: `(B, H, T, D)` rotated queries.
        k_cmp, v_cmp: `(B, KV, Nc, D)` compressed keys/values of blocks 0 .. Nc-1 (all blocks complete by the last
            query; keys rotated at their block's last position).
        k_slc, v_slc: `(B, KV, S, D)` keys/values at positions [0, S), S >= q_start + T (positions after the
            last query are never attended).
        k_win, v_win: `(B, KV, W, D)` keys/values at positions [win_start, win_start + W), covering each query's
            window.
        gates: `(B, H, T, 3)` branch gates (compression, selection, window).
        config: block geometry (`nsa_*` fields).
        compute: `attention_query_chunk` queries are processed at a time on the PyTorch path; `triton_kernels`
            lets CUDA tensors run on nsa/triton_path.py, all queries at once when gradients are needed, else in
            eight chunks (`_query_chunk`; default: ComputeConfig()).
        documents: packed documents (nsa/packing.py `document_blocks`), each query attending only its own
            document as if it were alone, in one call: then q_start = win_start = 0, the selection and window keys
            are at positions [0, T), k_cmp, v_cmp are on the documents' virtual axis (`nsa.packing.on_virtual_axis`);
            not under `exact_block_scores`.
    Returns:
        `(B, H, T, D)`; see `_SparseAttention` for what forward keeps for backward.
    """
    compute = compute or ComputeConfig()
    ranges = None
    if documents is not None:
        if exact_scores_active() or q_start or win_start:
            raise ValueError("sparse_attention takes packed documents from position 0 and not under "
                             "exact_block_scores; there attend each document on its own (NativeSparseAttention does)")
        ranges = (documents, documents.ranges)
    return _SparseAttention.apply(q, k_cmp, v_cmp, k_slc, v_slc, k_win, v_win, gates, config, compute, q_start,
                                  win_start, ranges, torch.is_grad_enabled())



