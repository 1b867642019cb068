"""Context parallelism (training/parallel.py `context_shard`, modeling/shard.py): a sequence split over 2 or 4 gloo
processes, each holding 2 of its 2N chunks, gives the loss and every gradient of the whole sequence in one process,
for full attention (with and without document starts) and NSA (with its selection-scoring loss, at a length where
top-n chooses); the spans, their refusals, and one process holding a sequence in several spans.

Tolerances: the models run in float64, where the only difference from one process is the order of sums (the loss's
over ranks, a key's gradient over the ranks whose queries read it, each chunk's softmax merged by log-sum-exp): a
relative error of a few ulps times the number of terms, far below 1e-10.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from distributed import run_distributed

from model import ModelConfig, Objective, Transformer
from modeling.documents import document_starts
from modeling.loss import IGNORE_INDEX, shift_labels
from modeling.shard import SequenceShard, balanced_spans
from training import parallel

T = 128  # tiny preset's NSA: l' = 16, n = 4, so top-n chooses from position 64 on


def test_balanced_spans_pair_early_and_late_chunks() -> None:
    assert [balanced_spans(16, 2, r) for r in range(2)] == [((0, 4), (12, 16)), ((4, 8), (8, 12))]
    assert balanced_spans(8, 1, 0) == ((0, 4), (4, 8))
    with pytest.raises(ValueError, match=r"2 x 4 = 8 equal chunks.*multiple of 8, e.g. 128 or 136"):
        balanced_spans(130, 4, 0)


def test_a_shard_checks_its_spans_and_takes_its_positions() -> None:
    shard = SequenceShard(8, ((0, 2), (6, 8)), lambda x: x)
    assert shard.tokens == 4 and list(shard.pieces()) == [(0, 0, 2), (2, 6, 8)]
    assert shard.take(torch.arange(8)[None]).tolist() == [[0, 1, 6, 7]] == [shard.positions().tolist()]
    for spans in (((2, 4), (0, 2)), ((0, 3), (2, 4)), ((0, 9),), ((1, 1),)):
        with pytest.raises(ValueError, match="ascending, disjoint"):
            SequenceShard(8, spans, lambda x: x)


def _model(attention: str) -> Transformer:
    torch.manual_seed(0)
    config = ModelConfig.from_preset("tiny", attention_type=attention, context_length=T)
    objective = Objective(nsa_score_loss_coef=0.5) if attention == "nsa" else Objective()
    return Transformer(config, objective=objective).double()


def _batch(rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """rows x T token ids with end-of-document ids (id 1) at a few places, and labels ignoring a stretch."""
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(2, 512, (rows, T), generator=generator)
    ids[:, [5, 40, 41, 90]] = 1
    labels = ids.clone()
    labels[:, 10:30] = IGNORE_INDEX
    return ids, labels


def test_one_process_holding_several_spans_equals_the_whole_sequence() -> None:
    """A shard of one process in 3 spans (gather the identity): each span attends as queries from its first
    position on; the outputs, loss and gradients are the whole sequence's."""
    ids, labels = _batch(2)
    shard = SequenceShard(T, ((0, 40), (40, 97), (97, T)), lambda x: x)
    for attention in ("full", "nsa"):
        whole, split = _model(attention), _model(attention)
        expected = whole(ids, labels)
        expected.loss.backward()
        got = split(ids, shift_labels(labels), shard=shard)
        got.loss.backward()
        torch.testing.assert_close(got.loss, expected.loss, rtol=1e-12, atol=0)
        for (name, p), q in zip(split.named_parameters(), whole.parameters(), strict=True):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-10, atol=1e-14, msg=f"{attention} {name}")


def _parity(context_ranks: int) -> None:
    """In each rank of a (data x context) layout: the rank's share of the loss and of every gradient, summed over
    the ranks, equals one process's over the whole batch (each data group reads its own rows)."""
    rt = parallel.init_runtime(context_ranks)
    shard = parallel.context_shard(rt, T)
    assert shard.spans == balanced_spans(T, context_ranks, rt.rank % context_ranks)
    ids, labels = _batch(2 * rt.data_ranks)
    mine = slice(2 * rt.data_rank, 2 * rt.data_rank + 2)  # this data group's rows
    for attention, documents in (("full", False), ("full", True), ("nsa", False)):
        reference, model = _model(attention), _model(attention)
        starts = document_starts(ids, 1) if documents else None
        expected = reference(ids, labels, doc_start=starts)
        expected.loss.backward()
        targets = shard.take(shift_labels(labels[mine]))  # shifted first: a shard's tokens are not contiguous
        n_tokens = (targets != IGNORE_INDEX).sum().double()
        dist.all_reduce(n_tokens)  # every rank's targets: the whole batch's
        got = model(shard.take(ids[mine]), targets, loss_normalizer=n_tokens,
                    aux_weight=1 / rt.data_ranks, doc_start=None if starts is None else shard.take(starts[mine]),
                    shard=shard)
        got.loss.backward()
        loss = got.loss.detach()
        dist.all_reduce(loss)
        torch.testing.assert_close(loss, expected.loss.detach(), rtol=1e-12, atol=0)
        for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
            dist.all_reduce(p.grad)
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-10, atol=1e-14, msg=f"{attention} {name}")
    dist.destroy_process_group()


@pytest.mark.parametrize("world, context_ranks", [(2, 2), (4, 4), (4, 2)])
def test_context_parallel_equals_one_process(world: int, context_ranks: int) -> None:
    run_distributed(_parity, context_ranks, world_size=world)
