"""Where each packed document starts. The loader packs documents end to end, each after the end-of-document id that
closes the one before (as eval.py's documents task reads one: the id, then its text); the id therefore opens the
next document. `document_starts` gives each position the first position of its document, the `doc_start` the model's
attention takes to keep every token inside its own document; `padding_starts` does the same for rows padded on the
left, whose one document begins at their first real token.
"""

from __future__ import annotations

import torch
from torch import Tensor


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
