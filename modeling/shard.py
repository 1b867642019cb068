"""A sequence split over the ranks of a context-parallel group, as the model sees it.

Under context parallelism every rank of a group holds some positions of one sequence: its tokens, their
activations, their part of the loss. Attention needs keys of positions other ranks hold, so the model asks the
shard for them (`gather`: the whole sequence's; `before`: the few before each span) and computes its own queries
only. The model never talks to other processes itself: the trainer builds a `SequenceShard` whose one collective,
`all_gather`, comes from training/parallel.py (`context_shard`), and hands it to `Transformer.forward`.

Notation: B batch, T tokens of the whole sequence, t tokens of this shard, X heads, D head dimension.
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import Tensor


def balanced_spans(length: int, ranks: int, rank: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """The positions rank `rank` of `ranks` holds of a sequence of `length` tokens cut into 2 x ranks equal chunks:
    chunks rank and 2 ranks - 1 - rank, as (first, end) pairs. Under a causal mask a query's work grows with its
    position, and each rank's early and late chunk add up to the same work ("head-tail" or zig-zag balance).
    ValueError, naming the lengths that work, when `length` is not a multiple of 2 x ranks."""
    if length % (2 * ranks):
        low = length // (2 * ranks) * 2 * ranks
        raise ValueError(f"a context of {length} tokens does not split into 2 x {ranks} = {2 * ranks} equal chunks "
                         f"(--context_parallel {ranks}): use a multiple of {2 * ranks}, e.g. "
                         f"{max(low, 2 * ranks)} or {low + 2 * ranks}")
    chunk = length // (2 * ranks)
    late = 2 * ranks - 1 - rank
    return (rank * chunk, (rank + 1) * chunk), (late * chunk, (late + 1) * chunk)


@dataclass(frozen=True)
class SequenceShard:
    """One rank's part of a sequence of `length` tokens split over a group of ranks.

    layouts: every rank's spans, by rank: the (first, end) position ranges of the whole sequence it holds,
        ascending and disjoint, together the whole sequence; a rank's tokens are its ranges one after another.
    rank: this process's index in `layouts` (`spans` are its ranges; t = their total length).
    all_gather: x -> (N, *x.shape): x as every rank of the group passes it (the same shape on each), stacked by
        rank; differentiable: its backward gives each rank the sum of every rank's gradient of its x. Every rank of
        a group calls it in the same order (a collective). The identity with one rank: `x[None]`.
    rope: the RoPE tables (cos, sin), (T, D) each, of the whole sequence, for what rotates at positions of other
        ranks (NSA's compressed keys); set by the model (`with_rope`).
    attention: (q (B, H, t, D), k, v (B, KV, t, D), scale) -> (B, H, t, D) or None: causal attention of this
        shard's queries over the whole sequence's keys, given this shard's keys and values, computed by the group
        (a ring: training/parallel.py `ring_attention`, for the `balanced_spans` layouts only); a collective like
        `all_gather`. It, or the field, None: the model gathers the keys (`gather`) and attends itself.
    """

    length: int
    layouts: tuple[tuple[tuple[int, int], ...], ...]
    rank: int
    all_gather: Callable[[Tensor], Tensor]
    rope: tuple[Tensor, Tensor] | None = None
    attention: Callable[[Tensor, Tensor, Tensor, float], Tensor] | None = None

    def __post_init__(self) -> None:
        for spans in self.layouts:
            edges = [edge for span in spans for edge in span]
            if not spans or edges != sorted(edges) or edges[0] < 0 or edges[-1] > self.length or any(
                    first >= end for first, end in spans):
                raise ValueError(f"spans {spans} must be ascending, disjoint, non-empty ranges within [0, "
                                 f"{self.length})")
        covered = sorted(span for spans in self.layouts for span in spans)
        if covered[0][0] != 0 or covered[-1][1] != self.length or any(
                a[1] != b[0] for a, b in zip(covered, covered[1:], strict=False)):
            raise ValueError(f"the ranks' spans {self.layouts} must tile the sequence [0, {self.length})")

    @property
    def spans(self) -> tuple[tuple[int, int], ...]:
        """This rank's (first, end) ranges."""
        return self.layouts[self.rank]

    @property
    def tokens(self) -> int:
        """t, the tokens this shard holds."""
        return sum(end - first for first, end in self.spans)

    def pieces(self) -> Iterator[tuple[int, int, int]]:
        """(local start, first, end) of each span: positions [first, end) of the whole sequence are this shard's
        tokens [local start, local start + end - first)."""
        local = 0
        for first, end in self.spans:
            yield local, first, end
            local += end - first

    def take(self, whole: Tensor, dim: int = 1) -> Tensor:
        """This shard's positions of `whole`, a tensor over the whole sequence's T positions along `dim`."""
        if whole.shape[dim] != self.length:
            raise ValueError(f"a tensor over the whole sequence has {self.length} positions along dim {dim}, got "
                             f"{tuple(whole.shape)}")
        return torch.cat([whole.narrow(dim, first, end - first) for first, end in self.spans], dim=dim)

    def with_rope(self, cos: Tensor, sin: Tensor) -> SequenceShard:
        """This shard with the whole sequence's RoPE tables (T, D) each."""
        return dataclasses.replace(self, rope=(cos, sin))

    def gather_pieces(self, parts: list[Tensor], size: Callable[[int, int], int]) -> Tensor:
        """Every rank's pieces, one a span, in position order: parts[i] (B, X, size(first, end), D) is this rank's
        piece of its i-th span (first, end), every rank's sized by the same `size`; returns them all concatenated
        along dim 2 in the order of their spans' positions. One `all_gather` (the pieces padded to the largest
        rank's total); differentiable."""
        sizes = [[size(first, end) for first, end in spans] for spans in self.layouts]
        width = max(sum(row) for row in sizes)
        first = parts[0]
        pad = first.new_zeros(*first.shape[:2], width - sum(p.shape[2] for p in parts), *first.shape[3:])
        stacked = self.all_gather(torch.cat([*parts, pad], dim=2))  # (N, B, X, width, D): one copy of the parts
        pieces = []
        for rank, (spans, row) in enumerate(zip(self.layouts, sizes, strict=True)):
            offset = 0
            for (first, _), n in zip(spans, row, strict=True):
                pieces.append((first, stacked[rank][:, :, offset:offset + n]))
                offset += n
        return torch.cat([piece for _, piece in sorted(pieces, key=lambda item: item[0])], dim=2)

    def gather(self, x: Tensor) -> Tensor:
        """x (B, X, t, D) over this rank's tokens -> (B, X, T, D), the whole sequence's, from every rank's x
        (differentiable: each rank gets the sum of every rank's gradient at its positions)."""
        return self.gather_pieces([x[:, :, lo:lo + end - first] for lo, first, end in self.pieces()],
                                  lambda first, end: end - first)

    def before(self, x: Tensor, m: int) -> list[Tensor]:
        """For each of this rank's spans, x at the m positions before it (fewer at the sequence's start): x (B, X, t,
        D) over this rank's tokens -> [(B, X, min(m, first), D) a span], from the ranks that hold them. Each rank
        sends the last m positions of each of its spans (the whole span when it is shorter, so that the positions
        before a span are always among them); differentiable."""
        if m <= 0:
            return [x[:, :, :0] for _ in self.spans]

        def size(first: int, end: int) -> int:
            return min(m, end - first)

        tails = self.gather_pieces([x[:, :, lo + end - first - size(first, end):lo + end - first]
                                    for lo, first, end in self.pieces()], size)  # (B, X, sum of sizes, D)
        spans = sorted(span for row in self.layouts for span in row)
        positions = [p for first, end in spans for p in range(end - size(first, end), end)]  # the tails', ascending
        out = []
        for _, first, _ in self.pieces():
            low, high = bisect.bisect_left(positions, max(0, first - m)), bisect.bisect_left(positions, first)
            out.append(tails[:, :, low:high])
        return out

