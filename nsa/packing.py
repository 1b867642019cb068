"""Packed documents in one call of NSA's kernels: each document's blocks counted from its own first token, as if it
were alone, described by O(T) index tables instead of a copy of the sequence.

The documents of a row are laid on a virtual axis where each starts at a multiple of l' (its last selection block
padded to l' positions): position t of the document starting at o sits at virtual position V + (t - o), V the
document's virtual start. On that axis every document's selection blocks are whole blocks j = V/l' + i and its
compressed blocks are blocks c = V/d + i of the usual stride-d geometry, so Eq. 9's pooling from compressed onto
selection blocks is the same for every document and the importance kernel's tiles are shared by the queries of a
tile, whatever documents they belong to. Keys and values are never copied onto that axis: a selection block is read
at its real first position (`block_start`), and only the compressed keys (one per d positions) are placed at their
virtual slots. A query at t of the document starting at o, r = t - o tokens in, sees

- compressed blocks [V/d, V/d + n(r)), n(r) = floor((r + 1 - l) / d) + 1 (none before l - 1 tokens);
- selection blocks [V/l', (V + r)/l'], the first and its own two forced in;
- window keys [max(t - w + 1, o), t];

which is what the document gives alone (nsa/reference.py's `naive_nsa` with doc_start). The virtual axis is longer
than T by less than l' positions per document; `DocumentBlocks.virtual_length` says how much.

Notation: B batch, T positions, Tv virtual positions (the longest row's), Ns = Tv / l' selection blocks, Nc
compressed slots (`num_compressed_blocks(Tv)`), Ne a row's compressed blocks (the most of any row). Geometry: l
`nsa_block_size`, d `nsa_stride`, l' `nsa_select_block_size`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import torch
from torch import Tensor
from torch._subclasses.fake_tensor import is_fake
from torch.utils.weak import WeakIdKeyDictionary

from modeling.documents import NOT_DOCUMENTS
from nsa.blocks import num_compressed_blocks

if TYPE_CHECKING:
    from modeling.config import ModelConfig


class QueryRanges(NamedTuple):
    """What each query of a packed batch sees, per row (B, T) int32 each (`document_blocks`)."""

    cmp_lo: Tensor  # first compressed slot
    cmp_hi: Tensor  # one past its last visible compressed slot (= cmp_lo: none yet)
    block0: Tensor  # its document's first selection block
    own: Tensor  # its own selection block
    in_block: Tensor  # its distance from its own block's first key
    window_lo: Tensor  # its first window key (real position)

    def queries(self, pick: slice) -> QueryRanges:
        """The ranges of the queries `pick` (a slice of positions)."""
        return QueryRanges(*(x[:, pick] for x in self))


class DocumentBlocks(NamedTuple):
    """The block geometry of a batch of packed documents and what each query sees (`document_blocks`)."""

    ranges: QueryRanges  # each query's compressed slots, selection blocks and window
    block_start: Tensor  # (B, Ns) int32: each selection block's first real position (T for blocks a row lacks)
    block_end: Tensor  # (B, Ns) int32: one past its last real position in its document
    cmp_start: Tensor  # (B, Ne) long: the first real position of each complete compressed block of the row
    cmp_slot: Tensor  # (B, Ne) long: its slot on the virtual axis (n_compressed for the padding of shorter rows)
    virtual: Tensor  # (B, T) int32: each position on the virtual axis
    n_blocks: int  # Ns
    n_compressed: int  # Nc

    def virtual_length(self, block: int) -> int:
        """Tv for selection blocks of `block` positions."""
        return self.n_blocks * block


_BLOCKS = WeakIdKeyDictionary()  # doc_start -> {geometry: (its version, its blocks)}: the layers of a forward share
# them (the ranges are int32, 28 bytes a position with the virtual positions)


def document_blocks(doc_start: Tensor, config: ModelConfig) -> DocumentBlocks:
    """`DocumentBlocks` of doc_start (B, T) (`modeling.documents.document_starts`) for the config's geometry. One
    host read (the virtual length and the most compressed blocks of a row), kept while doc_start lives unchanged,
    so the layers of a forward share it. Fake and meta tensors, whose values are unknown, get one document a row
    (the virtual axis as long as the sequence)."""
    geometry = (config.nsa_block_size, config.nsa_stride, config.nsa_select_block_size, config.nsa_window)
    if doc_start.device.type == "meta" or is_fake(doc_start):
        return _blocks(torch.zeros_like(doc_start), geometry, known=True)
    if doc_start.is_inference():  # no version counter to tell a change in place: made every time
        return _blocks(doc_start, geometry)
    kept = _BLOCKS.setdefault(doc_start, {})
    version, blocks = kept.get(geometry, (None, None))
    if version != doc_start._version:
        blocks = _blocks(doc_start, geometry)
        kept[geometry] = (doc_start._version, blocks)
    return blocks


def _blocks(doc_start: Tensor, geometry: tuple[int, int, int, int], known: bool = False) -> DocumentBlocks:
    """`document_blocks` made; known: one document a row, the sizes known without reading the device."""
    l, d, l_sel, w = geometry
    B, T = doc_start.shape
    dev = doc_start.device
    pos = torch.arange(T, device=dev).expand(B, T)  # (B, T)
    rel = pos - doc_start  # (B, T): tokens before t in its document
    opens = torch.ones_like(rel, dtype=torch.bool)
    opens[:, 1:] = rel[:, 1:] == 0  # (B, T): a document opens at t
    last = torch.ones_like(opens)
    last[:, :-1] = opens[:, 1:]  # (B, T): t is its document's last position
    end = torch.where(last, pos + 1, T).flip(1).cummin(1).values.flip(1)  # (B, T): one past its document's last
    pad = torch.where(last, -(rel + 1) % l_sel, 0)  # (B, T): positions its document's last block is padded by
    virtual = pos + pad.cumsum(1) - pad  # (B, T): shifted by the padding of the documents before
    first = virtual - rel
    starts_cmp = (rel % d == 0) & (pos + l <= end)  # (B, T): a complete compressed block starts at t
    if known:
        Tv, Ne = T + -T % l_sel, num_compressed_blocks(T, l, d)
    else:
        split = ((rel[:, 1:] == 0) | (doc_start[:, 1:] == doc_start[:, :-1])).all() & (rel[:, 0] == 0).all()
        Tv, Ne, ok = torch.stack([(virtual[:, -1] + 1 + pad[:, -1]).max(), starts_cmp.sum(1).max(), split]).tolist()
        if not ok:
            raise ValueError(NOT_DOCUMENTS)
    Ns, Nc = Tv // l_sel, num_compressed_blocks(Tv, l, d)
    at = virtual % l_sel == 0  # (B, T): a selection block starts at t
    column = torch.where(at, virtual // l_sel, Ns)  # (B, T): its block, Ns (a spare column) elsewhere
    block_start = torch.full((B, Ns + 1), T, dtype=torch.int32, device=dev).scatter_(1, column, pos.to(torch.int32))
    block_end = torch.full((B, Ns + 1), T, dtype=torch.int32, device=dev)
    block_end.scatter_(1, column, torch.minimum(pos + l_sel, end).to(torch.int32))
    cmp_start = torch.where(starts_cmp, pos, T).sort(1).values[:, :Ne]  # (B, Ne): in order, T for padding
    cmp_slot = torch.where(cmp_start < T, virtual.gather(1, cmp_start.clamp(max=T - 1)) // d, Nc)
    cmp_lo = first // d
    ranges = QueryRanges(cmp_lo, cmp_lo + ((rel + 1 - l).div(d, rounding_mode="floor") + 1).clamp(min=0),
                         first // l_sel, virtual // l_sel, rel % l_sel, torch.maximum(pos - w + 1, doc_start))
    return DocumentBlocks(QueryRanges(*(x.to(torch.int32) for x in ranges)), block_start[:, :Ns].contiguous(),
                          block_end[:, :Ns].contiguous(), cmp_start.clamp(max=T - l), cmp_slot,
                          virtual.to(torch.int32), Ns, Nc)


def on_virtual_axis(x: Tensor, blocks: DocumentBlocks) -> Tensor:
    """Compressed keys or values of each row's complete blocks x (B, KV, Ne, D), in the order of
    `DocumentBlocks.cmp_start`, placed at their virtual slots: (B, KV, Nc, D), zero at the slots no block fills
    (never visible). Differentiable in x."""
    B, KV, Ne, D = x.shape
    slot = blocks.cmp_slot[:, None, :, None].expand(B, KV, Ne, D)  # the padding goes to a spare slot Nc
    return x.new_zeros(B, KV, blocks.n_compressed + 1, D).scatter(2, slot, x)[:, :, : blocks.n_compressed]


def document_windows(x: Tensor, blocks: DocumentBlocks, size: int) -> Tensor:
    """The windows of `size` positions from each complete compressed block's first position
    (`DocumentBlocks.cmp_start`) of x (B, KV, T, D): (B, KV, Ne, size, D), a copy; backward keeps only the starts."""
    return _Windows.apply(x, blocks.cmp_start, size)


def _window_index(starts: Tensor, size: int, shape: torch.Size) -> Tensor:
    """The gather index (B, KV, Ne*size, D) (an expanded view) of the windows at starts (B, Ne) in x of `shape`."""
    B, KV, _, D = shape
    index = (starts[:, :, None] + torch.arange(size, device=starts.device)).view(B, 1, -1, 1)  # (B, 1, Ne*size, 1)
    return index.expand(B, KV, -1, D)


class _Windows(torch.autograd.Function):
    """`document_windows`, whose backward keeps the starts (B, Ne), not the (B, Ne*size) gather index."""

    @staticmethod
    def forward(ctx, x: Tensor, starts: Tensor, size: int) -> Tensor:
        ctx.save_for_backward(starts)
        ctx.shape, ctx.size = x.shape, size
        B, KV, _, D = x.shape
        return x.gather(2, _window_index(starts, size, x.shape)).view(B, KV, starts.shape[1], size, D)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None, None]:
        (starts,) = ctx.saved_tensors
        B, KV, _, D = ctx.shape
        flat = grad.reshape(B, KV, -1, D)  # (B, KV, Ne*size, D)
        return flat.new_zeros(ctx.shape).scatter_add_(2, _window_index(starts, ctx.size, ctx.shape), flat), None, None
