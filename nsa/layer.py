"""Native Sparse Attention (Yuan et al. 2025, https://arxiv.org/abs/2502.11089) in PyTorch, CPU and CUDA (on CUDA
the branches run on Triton kernels).

Each query head attends through three branches whose outputs are mixed by per-token, per-head sigmoid gates
(paper Eq. 5): o_t = g_cmp * cmp_t + g_slc * slc_t + g_win * win_t.

- Compression (section 3.3.1): K/V are cut into blocks of l tokens with stride d; block i covers tokens
  [i*d, i*d + l) and is mapped to one key and one value by phi (`nsa_compressor`). Query t sees block i iff
  i*d + l - 1 <= t (the whole block lies in its prefix). A query that sees no block gets a zero output from this
  branch. Two choices of phi:
  - "mlp" (paper Eq. 7): a learned MLP with an intra-block position encoding (`BlockCompressor`). Its keys are
    k-normed and rotated at the block's last position i*d + l - 1 (the position at which they become visible), so
    query-key distances are never negative.
  - "mean": the mean of the block's k-normed keys, each rotated at its own position, and of its values. No
    parameters; a compressed logit is then the mean of the block's token logits, and with one K/V set
    (`nsa_separate_kv` false) those are the logits the selection branch computes for the same keys.
- Selection (3.3.2): the compression branch's attention probabilities are pooled onto selection blocks of l'
  tokens (Eq. 9, 0-based: `selection_pool_weights`), summed over the query heads of one GQA group (Eq. 10), and the
  top n blocks are attended token by token (Eqs. 11-12). The n blocks include block 0 and the two most recent
  blocks (the query's own and the previous one), which are always selected; future blocks never are; inside the
  query's own block a token-level causal mask applies. The top-n indices carry no gradient; with the model's
  `objective.nsa_score_loss_coef` > 0, a training forward adds nsa/scoring.py's loss, which teaches the scores to
  rank blocks by their best key.
- Sliding window (3.3.3): the w keys (t - w, t], i.e. w keys counting the query's own token.

The attention itself (selection, the three branches, chunking, the custom backward, the memory formula) is in
nsa/attention.py (`sparse_attention`: q, per-branch keys/values, gates, positions -> output); on CUDA its branches
run on the Triton kernels of nsa/triton_path.py. This module holds the layer: projections, gates, the block compressor
and the decoding cache. Measured with FakeTensorMode for one 4B-geometry layer
(dim 2560, H=32, KV=8, D=128, separate K/V, bf16) at T = 131072, forward+backward, weights and input excluded
(`memtrack.LiveBytesTracker`, worst-case tile count): see benchmarks/results/nsa.md, "Memory at full size".

Notation: B batch, T new tokens (queries), H query heads, KV key/value heads, D head dimension, C model width,
N blocks, nb key/value sets (3 separate or 1 shared). Block geometry: l (`nsa_block_size`), d (`nsa_stride`),
l' (`nsa_select_block_size`), w (`nsa_window`).
"""

from __future__ import annotations

import itertools
import math
from contextlib import AbstractContextManager
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch._subclasses.fake_tensor import is_fake

from modeling.attention import add_aux_loss, attention_flops, projection_flops
from modeling.config import ComputeConfig, ModelConfig
from modeling.documents import document_spans, padding_starts
from modeling.layers import RMSNorm, apply_rope
from modeling.objective import Objective
from modeling.shard import SequenceShard
from nsa.attention import sparse_attention
from nsa.blocks import num_compressed_blocks
from nsa.packing import DocumentBlocks, document_blocks, document_windows, on_virtual_axis
from nsa.primitive import exact_scores_active, triton_ready
from nsa.scoring import score_loss_queries, selection_score_loss


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

    raw_k/raw_v (B, KV, l, D): ring of the last l compression inputs (a block completes within l tokens; keys
    un-normed and un-rotated for the "mlp" compressor, normed and rotated for "mean"); cmp_k/cmp_v (B, KV, Nc_max,
    D): compressed keys/values; slc_k/slc_v (B, KV, S_cap, D): the full cache the selection branch reads (capacity
    rounded up to whole selection blocks); win_k/win_v (B, KV, w, D): ring of the last w window keys (only with
    separate K/V; shared K/V read the window from slc_k/slc_v). The rings keep REWIND positions more than they
    read, so the sequence may be cut back by up to REWIND tokens (`rewind`: speculative decoding drops rejected
    draft tokens) and continued exactly.
    """

    REWIND = 64

    def __init__(self, config: ModelConfig, batch_size: int, max_seq_len: int, dtype: torch.dtype,
                 device: torch.device | str | None) -> None:
        super().__init__()
        self.max_seq_len = max_seq_len
        KV, D = config.n_kv_heads, config.head_dim
        n_cmp = num_compressed_blocks(max_seq_len, config.nsa_block_size, config.nsa_stride)
        slc = -(-max_seq_len // config.nsa_select_block_size) * config.nsa_select_block_size  # whole blocks
        lengths = {"raw": config.nsa_block_size + self.REWIND, "cmp": n_cmp, "slc": slc}
        if config.nsa_separate_kv:
            lengths["win"] = min(config.nsa_window + self.REWIND, max_seq_len)
        self.rewind = self.REWIND
        for name, length in lengths.items():
            for kind in ("k", "v"):
                buf = torch.zeros(batch_size, KV, length, D, dtype=dtype, device=device)
                self.register_buffer(f"{name}_{kind}", buf, persistent=False)

    def rows(self, rows: slice) -> CacheRows:
        """Views of the rows `rows` of every buffer."""
        buffers = {name: getattr(self, name, None) for name in CacheRows._fields}  # win_k/win_v: separate K/V only
        return CacheRows(**{name: None if buf is None else buf[rows] for name, buf in buffers.items()})


class CacheRows(NamedTuple):
    """Views of some rows of an `NSACache`'s buffers (writing to them writes the cache)."""

    raw_k: Tensor
    raw_v: Tensor
    cmp_k: Tensor
    cmp_v: Tensor
    slc_k: Tensor
    slc_v: Tensor
    win_k: Tensor | None
    win_v: Tensor | None


class _Branches(NamedTuple):
    """What NSA's attention reads, before compression: queries q (B, H, T, D), the compression inputs k_cmp_raw,
    v_cmp_raw, the selection and window keys/values (B, KV, T, D) each, gates (B, H, T, 3)."""

    q: Tensor
    k_cmp_raw: Tensor
    v_cmp_raw: Tensor
    k_slc: Tensor
    v_slc: Tensor
    k_win: Tensor
    v_win: Tensor
    gates: Tensor

    def positions(self, first: int, end: int) -> _Branches:
        """Positions [first, end) of every tensor (a view)."""
        return _Branches(*(x[:, :, first:end] for x in self))

    def rows(self, pick: slice | Tensor) -> _Branches:
        """The rows `pick` (a slice, or indices) of every tensor."""
        return _Branches(*(x[pick] if isinstance(pick, slice) else x.index_select(0, pick) for x in self))


PACKED_LENGTH = 1.25  # packed documents run in one call while their virtual axis is at most this times T


def _split_alike(doc_start: Tensor) -> bool:
    """Whether every row of doc_start (B, T) splits into the same documents (fake and meta tensors, whose values are
    unknown: one document a row, as `document_spans` reads them)."""
    return doc_start.device.type == "meta" or is_fake(doc_start) or bool((doc_start == doc_start[:1]).all())


class NativeSparseAttention(nn.Module):
    """NSA layer, the "nsa" attention type (an `attention.AttentionLayer`; see the module docstring).

    Parameters: q_proj, k_proj/v_proj (C -> nb*KV*D: compression, selection, window sets when separate), o_proj,
    branch_gate (C -> 3*H, with bias: the branches' gates; named apart from the MLP's gate_proj, so that an
    adapter aimed at one never adapts the other), k_compress/v_compress (`BlockCompressor`, "mlp" compressor only),
    q_norm/k_norm (RMSNorm over D, when qk_norm; k_norm applies to every key a query meets, always before RoPE:
    "mlp" compressed keys after compression, "mean" ones before).
    The attention itself is the class attribute `sparse_attention` (nsa.attention.sparse_attention), and the
    selection-scoring loss `selection_score_loss` (nsa.scoring): the seams through which profile_memory.py swaps in
    a memory double and the loss's peak chunks (nsa/memory_stand_in.py).
    """

    sparse_attention = staticmethod(sparse_attention)
    selection_score_loss = staticmethod(selection_score_loss)

    def __init__(self, config: ModelConfig, compute: ComputeConfig | None = None) -> None:
        super().__init__()
        self.config, self.compute = config, compute or ComputeConfig()
        self.objective = Objective()  # the training objective's terms; Transformer.objective sets it
        c, h, kv, d = config.dim, config.n_heads, config.n_kv_heads, config.head_dim
        self.n_sets = 3 if config.nsa_separate_kv else 1
        self.q_proj = nn.Linear(c, h * d, bias=False)
        self.k_proj = nn.Linear(c, self.n_sets * kv * d, bias=False)
        self.v_proj = nn.Linear(c, self.n_sets * kv * d, bias=False)
        self.o_proj = nn.Linear(h * d, c, bias=False)
        self.branch_gate = nn.Linear(c, 3 * h)
        if config.nsa_compressor == "mlp":
            self.k_compress = BlockCompressor(config.nsa_block_size, d, kv)
            self.v_compress = BlockCompressor(config.nsa_block_size, d, kv)
        self.q_norm = RMSNorm(d, config.norm_eps) if config.qk_norm else nn.Identity()
        self.k_norm = RMSNorm(d, config.norm_eps) if config.qk_norm else nn.Identity()
        self.cache: NSACache | None = None

    def _compress(self, k_raw: Tensor, v_raw: Tensor, first_pos: int, cos: Tensor, sin: Tensor,
                  cos_start: int) -> tuple[Tensor, Tensor]:
        """Compressed keys/values (B, KV, N, D) of the complete blocks in raw k, v (B, KV, L, D) at positions
        [first_pos, first_pos + L), blocks counted from first_pos. "mlp": keys are normed and rotated at each block's
        last position, read from cos/sin rows for positions [cos_start, ...). "mean": k is already normed and
        rotated token by token, and each block is averaged."""
        l, d = self.config.nsa_block_size, self.config.nsa_stride
        n = num_compressed_blocks(k_raw.shape[2], l, d)
        B, KV, _, D = k_raw.shape
        if n == 0:
            return k_raw.new_zeros(B, KV, 0, D), v_raw.new_zeros(B, KV, 0, D)
        blocks_k = k_raw.unfold(2, l, d).transpose(-1, -2)  # (B, KV, n, l, D)
        blocks_v = v_raw.unfold(2, l, d).transpose(-1, -2)  # (B, KV, n, l, D)
        if self.config.nsa_compressor == "mean":
            return blocks_k.mean(-2), blocks_v.mean(-2)
        rows = slice(first_pos + l - 1 - cos_start, first_pos + (n - 1) * d + l - cos_start, d)  # block ends
        k = apply_rope(self.k_norm(self.k_compress(blocks_k)), cos[rows], sin[rows])
        return k, self.v_compress(blocks_v)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, start_pos: int | None = None,
                doc_start: Tensor | None = None, shard: SequenceShard | None = None) -> Tensor:
        """x (B, T, C); cos, sin (T, D) for positions [start_pos or 0, +T). start_pos None: full causal forward
        without cache; an int: decode/prefill against the cache (`setup_cache`). doc_start (B, T) long, without the
        cache: the first position each query may see, splitting each row into documents (`_attend_documents`).
        shard: x holds a sequence shard's positions (`_attend_shard`; no doc_start). Returns (B, T, C)."""
        cfg = self.config
        B, T, _ = x.shape
        H, KV, D = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        if cos.shape != (T, D) or sin.shape != (T, D):
            raise ValueError(f"cos/sin must be ({T}, {D}), got {tuple(cos.shape)} and {tuple(sin.shape)}")
        q = self.q_proj(x).view(B, T, H, D).transpose(1, 2)  # (B, H, T, D)
        q = apply_rope(self.q_norm(q), cos, sin, contiguous=True)  # the kernels read heads whole
        # nb sets of (B, KV, T, D); unbind, not indexing: its backward stacks the sets' gradients once
        k = self.k_proj(x).view(B, T, self.n_sets, KV, D).permute(2, 0, 3, 1, 4).unbind(0)
        v = self.v_proj(x).view(B, T, self.n_sets, KV, D).permute(2, 0, 3, 1, 4).unbind(0)
        gates = torch.sigmoid(self.branch_gate(x)).view(B, T, H, 3).permute(0, 2, 1, 3)  # (B, H, T, 3)
        def rotated(keys: Tensor) -> Tensor:  # normed, then rotated at each token's position
            return apply_rope(self.k_norm(keys), cos, sin, contiguous=True)

        k_slc, v_slc = rotated(k[self.n_sets // 2]), v[self.n_sets // 2]
        k_cmp_raw, v_cmp_raw = k[0], v[0]
        if cfg.nsa_compressor == "mean":  # averaged after rotation at each token's position
            k_cmp_raw = k_slc if self.n_sets == 1 else rotated(k[0])
        k_win, v_win = (rotated(k[2]), v[2]) if self.n_sets == 3 else (k_slc, v_slc)

        branches = _Branches(q, k_cmp_raw, v_cmp_raw, k_slc, v_slc, k_win, v_win, gates)
        if start_pos is None:
            if shard is not None:
                if doc_start is not None:
                    raise ValueError("NSA does not split a sequence shard into documents: leave out --document_mask "
                                     "or --context_parallel")
                out, score_loss = self._attend_shard(branches, shard)
            elif doc_start is None:
                out, score_loss, _ = self._attend(branches, 0, cos, sin)
            else:
                out, score_loss = self._attend_documents(branches, doc_start, cos, sin)
            if score_loss is not None:
                add_aux_loss(self.objective.nsa_score_loss_coef * score_loss)
        else:
            cache = self._check_cache(B, start_pos, T)
            if doc_start is None:
                out = self._attend_cached(cache.rows(slice(None)), branches, start_pos, cos, sin)
            else:
                out = self._attend_padded(cache, branches, start_pos, cos, sin, doc_start)
        out = out.transpose(1, 2).reshape(B, T, H * D)  # (B, T, H*D)
        return self.o_proj(out)

    def _trains_scores(self, q: Tensor, k_cmp: Tensor) -> bool:
        """Whether this forward adds the selection-scoring loss: the objective asks for it and gradients flow to
        the queries or the compressed keys."""
        return bool(self.objective.nsa_score_loss_coef) and torch.is_grad_enabled() and (
            q.requires_grad or k_cmp.requires_grad)

    def _attend(self, branches: _Branches, first: int, cos: Tensor, sin: Tensor
                ) -> tuple[Tensor, Tensor | None, int]:
        """The attention of one sequence without cache: `branches` (`_Branches`) for positions [first, first + T),
        whose RoPE tables cos, sin start at position 0; block geometry counted from `first`. Returns (out
        (B, H, T, D), the selection-scoring loss when the objective asks for it in a training forward (a mean over
        its rows) else None, the number of those rows)."""
        cfg, b = self.config, branches
        k_cmp, v_cmp = self._compress(b.k_cmp_raw, b.v_cmp_raw, first, cos, sin, 0)
        out = self.sparse_attention(b.q, k_cmp, v_cmp, b.k_slc, b.v_slc, b.k_win, b.v_win, b.gates, cfg,
                                    compute=self.compute)
        if not self._trains_scores(b.q, k_cmp):
            return out, None, 0
        rows = b.q.shape[0] * cfg.n_kv_heads * score_loss_queries(cfg, b.q.shape[2])
        return out, self.selection_score_loss(b.q, k_cmp, b.k_slc, cfg, self.compute, self.objective), rows

    def _attend_shard(self, branches: _Branches, shard: SequenceShard) -> tuple[Tensor, Tensor | None]:
        """The attention of a sequence shard's queries (context parallelism), each span of the shard as the queries
        from its first position on over the keys up to its end, blocks and window counted from the sequence's start:
        what the whole sequence gives at those positions. What crosses ranks: the selection keys and values of the
        whole sequence (`shard.gather`: top-n may pick any block), the compressed ones (each rank compresses the
        blocks that end in its spans, from its tokens and the l - 1 before them), and for each span the window's w -
        1 keys before it (`shard.before`); with one K/V set and the "mean" compressor, the compressed and window keys
        come from the gathered selection keys. Returns (out (B, H, t, D), the selection-scoring loss of the shard's
        rows over the whole sequence's row count, so that the shards' add up to the mean, or None)."""
        cfg, b = self.config, branches
        k_slc, v_slc = shard.gather(b.k_slc), shard.gather(b.v_slc)  # (B, KV, T, D)
        cos, sin = shard.rope
        if b.k_cmp_raw is b.k_slc and b.v_cmp_raw is b.v_slc:
            k_cmp, v_cmp = self._compress(k_slc, v_slc, 0, cos, sin, 0)  # (B, KV, Nc, D)
        else:
            k_cmp, v_cmp = self._compress_shard(b.k_cmp_raw, b.v_cmp_raw, shard)
        shared_window = b.k_win is b.k_slc and b.v_win is b.v_slc
        if not shared_window:
            k_before, v_before = (shard.before(x, cfg.nsa_window - 1) for x in (b.k_win, b.v_win))
        outs = []
        for i, (lo, first, end) in enumerate(shard.pieces()):
            hi, n_cmp = lo + end - first, num_compressed_blocks(end, cfg.nsa_block_size, cfg.nsa_stride)
            win = max(0, first - cfg.nsa_window + 1)
            if shared_window:
                k_win, v_win = k_slc[:, :, win:end], v_slc[:, :, win:end]
            else:  # (B, KV, end - win, D)
                k_win, v_win = (torch.cat([before[i], x[:, :, lo:hi]], dim=2) for before, x in
                                ((k_before, b.k_win), (v_before, b.v_win)))
            outs.append(self.sparse_attention(
                b.q[:, :, lo:hi], k_cmp[:, :, :n_cmp], v_cmp[:, :, :n_cmp], k_slc[:, :, :end], v_slc[:, :, :end],
                k_win, v_win, b.gates[:, :, lo:hi], cfg, q_start=first, win_start=win, compute=self.compute))
        out = torch.cat(outs, dim=2)  # (B, H, t, D)
        if not self._trains_scores(b.q, k_cmp):
            return out, None
        return out, self.selection_score_loss(b.q, k_cmp, k_slc, cfg, self.compute, self.objective, shard)

    def _compress_shard(self, k_raw: Tensor, v_raw: Tensor, shard: SequenceShard) -> tuple[Tensor, Tensor]:
        """The compressed keys and values (B, KV, Nc, D) of the whole sequence from a shard's compression inputs
        k_raw, v_raw (B, KV, t, D): each rank compresses the blocks whose last position lies in its spans (from the
        span's tokens and the l - 1 before it, `shard.before`), and the ranks' blocks are gathered in order."""
        l, d = self.config.nsa_block_size, self.config.nsa_stride
        cos, sin = shard.rope

        def first_block(first: int) -> int:  # the start of the first block ending at or after `first`
            return max(0, -(-(first - l + 1) // d)) * d

        befores = [shard.before(x, l - 1) for x in (k_raw, v_raw)]
        parts: list[list[Tensor]] = [[], []]
        for i, (lo, first, end) in enumerate(shard.pieces()):
            raw = [torch.cat([before[i], x[:, :, lo:lo + end - first]], dim=2) for before, x in
                   zip(befores, (k_raw, v_raw), strict=True)]  # positions [first - l + 1 or 0, end)
            start, held = first_block(first), end - raw[0].shape[2]  # the first block's start, raw's first position
            k, v = self._compress(raw[0][:, :, start - held:], raw[1][:, :, start - held:], start, cos, sin, 0)
            parts[0].append(k)
            parts[1].append(v)

        def blocks(first: int, end: int) -> int:
            return num_compressed_blocks(end - first_block(first), l, d)

        k_cmp, v_cmp = (shard.gather_pieces(part, blocks) for part in parts)
        return k_cmp, v_cmp

    def _packed_blocks(self, doc_start: Tensor, q: Tensor) -> DocumentBlocks | None:
        """The documents' blocks when they run in one call (`_attend_packed`), else None: not while the
        selection-scoring loss is trained or `exact_block_scores` holds (both run document by document); not on CPU
        tensors without the Triton kernels when every row is split alike, where the loop (one batched call a
        document, no kernel launches, each call over its document's keys with no mask) is the faster, while rows
        split differently run one by one in the loop, slower than the one call (benchmarks/nsa_documents.py); nor
        when the virtual axis exceeds PACKED_LENGTH times the sequence (documents far shorter than l', whose padding
        would outweigh the one call)."""
        scores = exact_scores_active() or (self.objective.nsa_score_loss_coef and torch.is_grad_enabled())
        if scores or (q.device.type == "cpu" and not triton_ready(q, self.compute) and _split_alike(doc_start)):
            return None
        blocks = document_blocks(doc_start, self.config)
        fits = blocks.virtual_length(self.config.nsa_select_block_size) <= PACKED_LENGTH * doc_start.shape[1]
        return blocks if fits else None

    def _attend_packed(self, branches: _Branches, blocks: DocumentBlocks, cos: Tensor, sin: Tensor) -> Tensor:
        """Packed documents in one call, each document attended as if alone, its blocks counted from its first
        token (nsa/packing.py): what the loop of `_attend_documents` gives, without the loop. Returns
        (B, H, T, D)."""
        b = branches
        k_cmp, v_cmp = self._compress_documents(b.k_cmp_raw, b.v_cmp_raw, blocks, cos, sin)
        return self.sparse_attention(b.q, k_cmp, v_cmp, b.k_slc, b.v_slc, b.k_win, b.v_win, b.gates, self.config,
                                     compute=self.compute, documents=blocks)

    def _compress_documents(self, k_raw: Tensor, v_raw: Tensor, blocks: DocumentBlocks, cos: Tensor, sin: Tensor
                            ) -> tuple[Tensor, Tensor]:
        """The compressed keys/values of packed documents on their virtual axis (B, KV, Nc, D): each row's complete
        blocks (`DocumentBlocks.cmp_start`, counted from each document's first token) gathered from raw k, v
        (B, KV, T, D), compressed as `_compress` does ("mlp" keys rotated at each block's last position, read from
        cos/sin for positions [0, T)), and placed at their slots (`nsa.packing.on_virtual_axis`)."""
        l = self.config.nsa_block_size
        B, KV, _, D = k_raw.shape
        Ne = blocks.cmp_start.shape[1]
        if self.config.nsa_compressor == "mean":
            k, v = (document_windows(x, blocks, l).mean(-2) for x in (k_raw, v_raw))
        else:
            ends = (blocks.cmp_start + l - 1).flatten()  # (B*Ne,) each block's last position
            k = self.k_norm(self.k_compress(document_windows(k_raw, blocks, l)))  # (B, KV, Ne, D)
            k = apply_rope(k.transpose(0, 1).reshape(KV, 1, B * Ne, D), cos, sin, positions=ends)
            k, v = k.view(KV, B, Ne, D).transpose(0, 1), self.v_compress(document_windows(v_raw, blocks, l))
        return on_virtual_axis(k, blocks), on_virtual_axis(v, blocks)

    @torch.compiler.disable  # opaque to torch.compile: a Python loop over each row's documents (data-dependent)
    def _attend_documents(self, branches: _Branches, doc_start: Tensor, cos: Tensor, sin: Tensor
                          ) -> tuple[Tensor, Tensor | None]:
        """Each document of each row attended on its own, as if it were the whole sequence: its compressed and
        selection blocks counted from its first token (block 0 of the document is the one always selected), its
        window starting there; what the document gives alone (RoPE depends on relative positions only: equal up to
        the rounding of its float32 tables at other absolute positions). Each row's documents are read from
        doc_start (B, T) (`modeling.documents.document_spans`: one host read a forward); rows with the same
        documents run together. One-token documents need no kernel when l > 1 (`_one_token_documents`). Returns (out
        (B, H, T, D), the selection-scoring loss: the documents' losses weighted by their rows, so the mean over all
        the rows that choose, or None). Where they can, the documents run in one call instead (`_packed_blocks`)."""
        blocks = self._packed_blocks(doc_start, branches.q)
        if blocks is not None:
            return self._attend_packed(branches, blocks, cos, sin), None
        B, T = branches.q.shape[0], branches.q.shape[2]
        lone = self.config.nsa_block_size > 1  # a one-token document sees no compressed block: no kernel for it
        groups: dict[tuple[tuple[int, int], ...], list[int]] = {}
        for row, row_spans in enumerate(document_spans(doc_start)):
            groups.setdefault(tuple(row_spans), []).append(row)
        outs, order, losses, total_rows = [], [], [], 0
        for row_spans, rows in groups.items():
            part = branches
            if len(rows) < B:
                part = branches.rows(slice(rows[0], rows[0] + 1) if len(rows) == 1
                                     else torch.tensor(rows, device=branches.q.device))
            pieces, single = [], None  # single: the first of a run of one-token documents
            for first, end in (*row_spans, (T, T)):
                if end - first == 1 and lone:
                    single = first if single is None else single
                    continue
                if single is not None:
                    pieces.append(self._one_token_documents(part.positions(single, first)))
                    single = None
                if first == T:
                    break
                out, loss, n_rows = self._attend(part.positions(first, end), first, cos, sin)
                pieces.append(out.transpose(1, 2))  # (rows, t, H, D)
                if loss is not None and n_rows:
                    losses.append(loss * n_rows)
                    total_rows += n_rows
            outs.append(torch.cat(pieces, dim=1))  # (rows, T, H, D)
            order += rows
        out = outs[0] if len(outs) == 1 else torch.cat(outs).index_select(
            0, torch.tensor(order, device=branches.q.device).argsort())  # (B, T, H, D) in row order
        return out.transpose(1, 2), (torch.stack(losses).sum() / total_rows if losses else None)

    @staticmethod
    def _one_token_documents(branches: _Branches) -> Tensor:
        """The output (B, t, H, D) of t one-token documents (l > 1): each query sees no compressed block and only
        itself in the selection and window branches, so it is g_slc v_slc + g_win v_win (softmax over one key:
        weight 1)."""
        G = branches.q.shape[1] // branches.v_slc.shape[1]
        gates = branches.gates.transpose(1, 2)  # (B, t, H, 3)
        v_slc, v_win = (v.transpose(1, 2).repeat_interleave(G, 2) for v in (branches.v_slc, branches.v_win))
        return gates[..., 1:2] * v_slc + gates[..., 2:3] * v_win  # (B, t, H, D)

    def _attend_cached(self, cache: CacheRows, branches: _Branches, start: int, cos: Tensor, sin: Tensor) -> Tensor:
        """The attention of the tokens `branches` at positions [start, start + T) against `cache` (`CacheRows`),
        which holds the positions before them and receives theirs: new compressed blocks are emitted before any
        query attends. cos, sin: the tokens' RoPE rows. Returns (B, H, T, D)."""
        cfg, b = self.config, branches
        l, d = cfg.nsa_block_size, cfg.nsa_stride
        end = start + b.q.shape[2]
        first_new = num_compressed_blocks(start, l, d)  # compressed blocks already in the cache
        n_cmp = num_compressed_blocks(end, l, d)
        raw_k = _ring_extend(cache.raw_k, start, b.k_cmp_raw, first_new * d)  # (B, KV, end - first_new*d, D)
        raw_v = _ring_extend(cache.raw_v, start, b.v_cmp_raw, first_new * d)
        new_k, new_v = self._compress(raw_k, raw_v, first_new * d, cos, sin, start)
        cache.cmp_k[:, :, first_new:n_cmp] = new_k
        cache.cmp_v[:, :, first_new:n_cmp] = new_v
        win_start = max(0, start - cfg.nsa_window + 1)
        _ring_extend(cache.slc_k, start, b.k_slc, 0)  # never wraps (capacity >= max_seq_len)
        _ring_extend(cache.slc_v, start, b.v_slc, 0)
        k_slc, v_slc = cache.slc_k, cache.slc_v  # (B, KV, S_cap, D): whole buffer, read as blocks without a copy
        if cfg.nsa_separate_kv:
            k_win = _ring_extend(cache.win_k, start, b.k_win, win_start)  # (B, KV, end - win_start, D)
            v_win = _ring_extend(cache.win_v, start, b.v_win, win_start)
        else:
            k_win, v_win = k_slc[:, :, win_start:end], v_slc[:, :, win_start:end]
        return self.sparse_attention(b.q, cache.cmp_k[:, :, :n_cmp], cache.cmp_v[:, :, :n_cmp], k_slc, v_slc, k_win,
                                     v_win, b.gates, cfg, q_start=start, win_start=win_start, compute=self.compute)

    @torch.compiler.disable  # opaque to torch.compile: a Python loop over runs of rows (data-dependent)
    def _attend_padded(self, cache: NSACache, branches: _Branches, start_pos: int, cos: Tensor, sin: Tensor,
                       doc_start: Tensor) -> Tensor:
        """The cached attention of a batch padded on the left, whose doc_start (B, T) gives each pad itself and every
        later token its row's first real position r (`modeling.documents.padding_starts`): each row keeps its
        own block grid, from r, in its rows of the cache (position p of the row at slot p - r; the pads are never
        cached), so it generates what it generates alone. Pads take `_one_token_documents` (nothing reads their
        outputs).
        Rows with the same r next to each other run together. One host read of doc_start. Returns (B, H, T, D)."""
        T = branches.q.shape[2]
        starts = doc_start.cpu()
        first_real = starts[:, -1]  # (B,): a row's last token is real
        if not torch.equal(starts, padding_starts(first_real, start_pos, T)):
            raise ValueError("with NSA's KV cache, doc_start must be that of a batch padded on the left: each pad its "
                             "own position, every later token its row's first real one "
                             "(modeling.documents.padding_starts)")
        outs, row = [], 0
        for r, n_rows in ((r, len(list(run))) for r, run in itertools.groupby(first_real.tolist())):
            rows = slice(row, row + n_rows)
            row += n_rows
            part, pads = branches.rows(rows), max(0, r - start_pos)  # the call's pads in these rows
            pieces = [self._one_token_documents(part.positions(0, pads))] if pads else []
            local = start_pos + pads - r  # the first real token's position within its row
            out = self._attend_cached(cache.rows(rows), part.positions(pads, T), local, cos[pads:], sin[pads:])
            outs.append(torch.cat([*pieces, out.transpose(1, 2)], dim=1))  # (rows, T, H, D)
        return torch.cat(outs).transpose(1, 2)  # (B, H, T, D)

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
        for proj in (self.q_proj, self.k_proj, self.v_proj, self.branch_gate):
            nn.init.normal_(proj.weight, std=cfg.init_std)
        nn.init.zeros_(self.branch_gate.bias)
        nn.init.normal_(self.o_proj.weight, std=cfg.init_std / math.sqrt(2 * cfg.n_layers))
        if cfg.nsa_compressor == "mlp":
            self.k_compress.init_weights(cfg.init_std)
            self.v_compress.init_weights(cfg.init_std)
        for norm in (self.q_norm, self.k_norm):
            if isinstance(norm, RMSNorm):
                norm.init_weights()

    @classmethod
    def check_config(cls, config: ModelConfig) -> None:
        l, d, l_sel = config.nsa_block_size, config.nsa_stride, config.nsa_select_block_size
        if l % d or l_sel % d or l > l_sel:
            raise ValueError(f"NSA blocks need nsa_stride | nsa_block_size, nsa_stride | nsa_select_block_size and "
                             f"nsa_block_size <= nsa_select_block_size; got l={l}, d={d}, l'={l_sel}")
        if config.nsa_compressor not in ("mlp", "mean"):
            raise ValueError(f'ModelConfig.nsa_compressor must be "mlp" or "mean", got {config.nsa_compressor!r}')
        if config.nsa_num_selected < 3:
            raise ValueError(f"ModelConfig.nsa_num_selected must be >= 3 (block 0 and the two most recent blocks "
                             f"are always selected), got {config.nsa_num_selected}")

    @classmethod
    def flops_per_token(cls, config: ModelConfig, seq_len: int) -> float:
        """Projections (q, o, nb K/V sets, gates), the compressors' MLPs (one block every d tokens, for k and v;
        none for the "mean" compressor) and attention over the compressed ((T+1)/2 / d on average), selected (n l')
        and window (w) keys, each capped at the (T+1)/2 keys of a causal average."""
        c, half = config, (seq_len + 1) / 2
        n_sets = 3 if c.nsa_separate_kv else 1
        gates = 6 * c.dim * 3 * c.n_heads
        mlp = 2 * 6 * c.n_kv_heads * (c.nsa_block_size * c.head_dim + c.head_dim) * c.head_dim / c.nsa_stride
        compress = mlp if c.nsa_compressor == "mlp" else 0
        keys = (half / c.nsa_stride + min(half, c.nsa_num_selected * c.nsa_select_block_size)
                + min(half, c.nsa_window))
        return projection_flops(c, n_sets) + gates + compress + attention_flops(c, keys)

    @classmethod
    def memory_stand_in(cls, config: ModelConfig, compute: ComputeConfig, batch_size: int, seq_len: int,
                        dtype: torch.dtype, device: str, spans: tuple[tuple[int, int], ...] | None = None
                        ) -> AbstractContextManager[str]:
        from nsa.memory_stand_in import sparse_attention_stand_in

        return sparse_attention_stand_in(cls, config, compute, batch_size, seq_len, dtype, device, spans)
