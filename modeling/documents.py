"""Where each packed document starts. The loader packs documents end to end, each after the end-of-document id that
closes the one before (as eval.py's documents task reads one: the id, then its text); the id therefore opens the
next document. `document_starts` gives each position the first position of its document, the `doc_start` the model's
attention takes to keep every token inside its own document; `padding_starts` does the same for rows padded on the
left, whose one document begins at their first real token; `document_spans` reads the documents back as position
ranges (for attention that runs each document on its own, NSA).
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch._subclasses.fake_tensor import is_fake
from torch.utils.weak import WeakIdKeyDictionary


def document_starts(input_ids: Tensor, eod_id: int) -> Tensor:
    """(B, T) long: for each position of input_ids (B, T), its document's first position: the last end-of-document
    id at or before it, 0 when none (a window that begins inside a document). O(T), no host sync."""
    T = input_ids.shape[1]
    positions = torch.arange(T, device=input_ids.device).expand_as(input_ids)  # (B, T)
    return torch.where(input_ids == eod_id, positions, 0).cummax(dim=1).values


def padding_starts(pads: Tensor, start: int, n_new: int) -> Tensor:
    """(B, n_new) long: for the n_new tokens from position `start` of rows padded on the left with pads (B,) tokens,
    the first position each may attend to: its row's first real token (a pad sees itself)."""
    positions = torch.arange(start, start + n_new, device=pads.device)  # (n_new,)
    return torch.minimum(positions, pads[:, None])


NOT_DOCUMENTS = ("doc_start must split each row into documents: every position's start is its own position (a "
                 "document opens) or the start of the position before (modeling.documents.document_starts gives "
                 "such starts)")

_SPANS = WeakIdKeyDictionary()  # doc_start -> (its version, its spans): every layer of a forward reads them once


def document_spans(doc_start: Tensor) -> list[list[tuple[int, int]]]:
    """Each row's documents as (first, end) position pairs, in order, from doc_start (B, T) at positions [0, T): a
    document opens where a position's start is itself and runs while the start stays the same. One host sync per
    tensor (kept while the tensor lives and is not changed in place, so the layers of a forward share it). Fake and
    meta tensors, whose values are unknown, give one document a row (the costliest case, for memory estimates).
    ValueError when doc_start is not such a partition (a start that is neither the position itself nor the start
    before it)."""
    B, T = doc_start.shape
    if doc_start.device.type == "meta" or is_fake(doc_start):
        return [[(0, T)] for _ in range(B)]
    if doc_start.is_inference():  # no version counter to tell a change in place: read every time
        return _read_spans(doc_start)
    version, spans = _SPANS.get(doc_start, (None, None))
    if version != doc_start._version:
        spans = _read_spans(doc_start)
        _SPANS[doc_start] = (doc_start._version, spans)
    return spans


def _read_spans(doc_start: Tensor) -> list[list[tuple[int, int]]]:
    """`document_spans` read from the device."""
    B, T = doc_start.shape
    starts = doc_start.cpu()
    positions = torch.arange(T)
    opens = starts == positions  # (B, T)
    before = torch.cat([starts[:, :1], starts[:, :-1]], dim=1)  # (B, T): each position's predecessor's start
    if not bool((opens | (starts == before)).all()) or not bool(opens[:, 0].all()):
        raise ValueError(NOT_DOCUMENTS)
    spans = []
    for row in opens:
        firsts = row.nonzero().flatten().tolist()
        spans.append(list(zip(firsts, [*firsts[1:], T], strict=True)))
    return spans
