"""A sequence split over the ranks of a context-parallel group, as the model sees it.

Under context parallelism every rank of a group holds some positions of one sequence: its tokens, their
activations, their part of the loss. Attention needs keys of positions other ranks hold, so the model asks the
shard for them (`gather`) and computes its own queries only. The model never talks to other processes itself: the
trainer builds a `SequenceShard` whose `gather` is a collective (training/parallel.py, `context_shard`) and hands
it to `Transformer.forward`.

Notation: B batch, T tokens of the whole sequence, t tokens of this shard, X heads, D head dimension.
"""

from __future__ import annotations

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
    """This process's part of a sequence of `length` tokens.

    spans: the (first, end) position ranges of the whole sequence this shard holds, ascending and disjoint; the
        shard's tokens are these ranges one after another (t = their total length).
    gather: (B, X, t, D) -> (B, X, T, D): a tensor over this shard's tokens, as every shard of the group holds its
        own, read as the whole sequence's (dim 2), differentiable: its backward gives each shard the sum of every
        shard's gradient at its positions. Every shard of a group calls it in the same order (a collective).
    rope: the RoPE tables (cos, sin), (T, D) each, of the whole sequence, for what rotates at positions of other
        shards (NSA's compressed keys); set by the model (`with_rope`).
    """

    length: int
    spans: tuple[tuple[int, int], ...]
    gather: Callable[[Tensor], Tensor]
    rope: tuple[Tensor, Tensor] | None = None

    def __post_init__(self) -> None:
        edges = [edge for span in self.spans for edge in span]
        if not self.spans or edges != sorted(edges) or edges[0] < 0 or edges[-1] > self.length or any(
                first >= end for first, end in self.spans):
            raise ValueError(f"spans {self.spans} must be ascending, disjoint, non-empty ranges within [0, "
                             f"{self.length})")

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

    def positions(self, device: torch.device | str | None = None) -> Tensor:
        """(t,) long: the position of each of this shard's tokens in the whole sequence."""
        return torch.cat([torch.arange(first, end, device=device) for first, end in self.spans])

    def take(self, whole: Tensor, dim: int = 1) -> Tensor:
        """This shard's positions of `whole`, a tensor over the whole sequence's T positions along `dim`."""
        if whole.shape[dim] != self.length:
            raise ValueError(f"a tensor over the whole sequence has {self.length} positions along dim {dim}, got "
                             f"{tuple(whole.shape)}")
        return torch.cat([whole.narrow(dim, first, end - first) for first, end in self.spans], dim=dim)

    def with_rope(self, cos: Tensor, sin: Tensor) -> SequenceShard:
        """This shard with the whole sequence's RoPE tables (T, D) each."""
        return dataclasses.replace(self, rope=(cos, sin))

