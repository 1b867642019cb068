"""NSA's selection-scoring loss (nsa/scoring.py): value and gradients against a float64 loop over queries,
gradcheck, what it keeps for backward and its memory under fake tensors, and how the model adds it to the loss (its
weight, micro-batches with sparse labels, autocast, gradient checkpointing, no gradients, the option's validation)."""

import math
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from model import Transformer
from modeling.config import ComputeConfig, ModelConfig
from modeling.memtrack import LiveBytesTracker
from modeling.objective import Objective
from nsa import blocks, scoring
from nsa.blocks import num_compressed_blocks, selection_pool_weights
from nsa.scoring import selection_score_loss

F64 = dict(rtol=0, atol=1e-12)



def score_loss(q: torch.Tensor, k_cmp: torch.Tensor, k_slc: torch.Tensor, config: ModelConfig, chunk: int = 512,
               **objective: object) -> torch.Tensor:
    """`selection_score_loss` scoring `chunk` queries at a time, with the Objective fields `objective`."""
    return selection_score_loss(q, k_cmp, k_slc, config, ComputeConfig(attention_query_chunk=chunk),
                                Objective(**objective))

def geometry(**overrides: object) -> ModelConfig:
    return ModelConfig.from_preset("tiny", attention_type="nsa", **overrides)


def naive_score_loss(q: torch.Tensor, k_cmp: torch.Tensor, k_slc: torch.Tensor, config: ModelConfig,
                     rows_of: torch.Tensor | None = None, top: int = 0,
                     extra: Callable[[int, int, int], list[int]] | None = None, as_set: bool = False,
                     temperature: float = 1.0, boundary: bool = False) -> torch.Tensor:
    """The loss one (batch, KV head, query) row at a time, straight from the definitions: rows where top-n chooses
    (the query's block c >= n: more blocks between block 0 and its previous block than n - 3 free slots), over those
    blocks 1 .. c - 2; the prediction sums each head's compression probabilities, pooled with Eq. 9's weights, over
    the group; the target averages each head's softmax of its best key's logit. With top = m > 0, both only over the
    row's m blocks of highest prediction and the blocks extra(b, kv, t) names; the prediction renormalised over the
    same blocks. `rows_of` (T,) bool: only those queries. `as_set`: the target uniform over its n - 3 highest
    blocks (all of them when fewer). `temperature`: the target's logits divided by it. `boundary`: softplus of the
    largest log prediction outside those n - 3 blocks minus the smallest inside, 0 for a row with either side
    empty."""
    B, H, T, D = q.shape
    KV = k_cmp.shape[1]
    G, l, d, l_sel = H // KV, config.nsa_block_size, config.nsa_stride, config.nsa_select_block_size
    first, weights = selection_pool_weights(l, d, l_sel)
    total, rows = q.new_zeros(()), 0
    for b in range(B):
        for kv in range(KV):
            for t in range(T):
                c, n = t // l_sel, config.nsa_num_selected
                if c < n or n < 4 or (rows_of is not None and not rows_of[t]):  # every block is selected anyway
                    continue
                n_visible = num_compressed_blocks(t + 1, l, d)
                importance = {j: q.new_zeros(()) for j in range(1, c - 1)}
                for h in range(kv * G, (kv + 1) * G):
                    p_cmp = (k_cmp[b, kv, :n_visible] @ q[b, h, t] / math.sqrt(D)).softmax(0)
                    for j in importance:
                        for offset, weight in enumerate(weights):
                            i = (l_sel // d) * j + first + offset
                            if 0 <= i < n_visible:
                                importance[j] = importance[j] + weight * p_cmp[i]
                chosen = list(importance)
                if top:
                    chosen = sorted(chosen, key=lambda j: -float(importance[j].detach()))[:top]
                    chosen += [j for j in (extra(b, kv, t) if extra else []) if j not in chosen]
                target = 0.0
                for h in range(kv * G, (kv + 1) * G):
                    best = torch.stack([(k_slc[b, kv, j * l_sel:(j + 1) * l_sel] @ q[b, h, t]).max()
                                        for j in chosen]) / math.sqrt(D)
                    target = target + (best / temperature).softmax(0).detach() / G
                p = torch.stack([importance[j] for j in chosen])
                p = p / p.sum()
                if boundary:
                    inside = sorted(range(len(chosen)), key=lambda i: -float(target[i]))[:n - 3]
                    outside = [i for i in range(len(chosen)) if i not in inside]
                    if outside:
                        gap = max(p[i].log() for i in outside) - min(p[i].log() for i in inside)
                        total = total + torch.nn.functional.softplus(gap)
                    rows += 1
                    continue
                if as_set:
                    kept = sorted(range(len(chosen)), key=lambda i: -float(target[i]))[:n - 3]
                    target = torch.zeros_like(target)
                    target[kept] = 1 / len(kept)
                total = total + torch.where(target > 0, target * (target.log() - p.log()), 0).sum()
                rows += 1
    return total / rows


@pytest.mark.parametrize("l,d,l_sel,n,key_tile,tau", [(8, 4, 16, 4, 1024, 1.0), (8, 8, 8, 5, 1024, 1.0),
                                                      (8, 4, 16, 4, 24, 1.0), (8, 4, 16, 4, 1024, 3.0)])
def test_loss_and_gradients_equal_a_float64_loop_over_queries(l: int, d: int, l_sel: int, n: int, key_tile: int,
                                                              tau: float, monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunks of 24 queries (not dividing T = 100, nor the blocks) give the loop's value and gradients to 1e-12,
    with the best-token scores in one tile of keys or in tiles of one block (24 // 16), and at a target
    temperature; no gradient reaches the selection keys."""
    monkeypatch.setattr(blocks, "_KEY_TILE", key_tile)
    config = geometry(nsa_block_size=l, nsa_stride=d, nsa_select_block_size=l_sel, nsa_num_selected=n)
    g = torch.Generator().manual_seed(0)
    B, H, KV, T, D = 2, 4, 2, 100, 8
    q = torch.randn(B, H, T, D, generator=g, dtype=torch.float64, requires_grad=True)
    k_cmp = torch.randn(B, KV, num_compressed_blocks(T, l, d), D, generator=g, dtype=torch.float64,
                        requires_grad=True)
    k_slc = torch.randn(B, KV, T, D, generator=g, dtype=torch.float64, requires_grad=True)
    loss = score_loss(q, k_cmp, k_slc, config, chunk=24, nsa_score_loss_temperature=tau)
    grads = torch.autograd.grad(loss, (q, k_cmp, k_slc), allow_unused=True)
    expected = naive_score_loss(q, k_cmp, k_slc, config, temperature=tau)
    expected_grads = torch.autograd.grad(expected, (q, k_cmp))
    torch.testing.assert_close(loss, expected, **F64)
    for got, want in zip(grads[:2], expected_grads, strict=True):
        torch.testing.assert_close(got, want, **F64)
    assert grads[2] is None


@pytest.mark.parametrize("l,d,l_sel,n", [(8, 4, 16, 4), (8, 8, 8, 6)])
@pytest.mark.parametrize("target", ["selection", "boundary"])
def test_the_ranking_targets_equal_a_float64_loop_over_queries(l: int, d: int, l_sel: int, n: int,
                                                                target: str) -> None:
    """nsa_score_loss_target "selection": the loop with the target made uniform over the n - 3 blocks its scores rank
    highest (with n = 4 one block, a cross-entropy on the best one); "boundary": per row, softplus of the strongest
    block outside those n - 3 minus the weakest inside (log predictions), 0 where a side is empty (and positive over
    the batch). Value and gradients to 1e-12."""
    config = geometry(nsa_block_size=l, nsa_stride=d, nsa_select_block_size=l_sel, nsa_num_selected=n)
    q, k_cmp, k_slc = inputs(11, B=2, H=4, KV=2, T=100, D=8, l=l, d=d)
    loss = score_loss(q, k_cmp, k_slc, config, chunk=24, nsa_score_loss_target=target)
    expected = naive_score_loss(q, k_cmp, k_slc, config, as_set=target == "selection", boundary=target == "boundary")
    torch.testing.assert_close(loss, expected, **F64)
    for got, want in zip(torch.autograd.grad(loss, (q, k_cmp)), torch.autograd.grad(expected, (q, k_cmp)),
                         strict=True):
        torch.testing.assert_close(got, want, **F64)
    assert target != "boundary" or loss > 0


def test_a_boundary_loss_without_blocks_outside_the_set_is_refused() -> None:
    """On candidate blocks, top + random <= n - 3 leaves every candidate inside the set: the loss would be 0."""
    config = geometry(nsa_num_selected=5, context_length=256)
    with pytest.raises(ValueError, match="candidate blocks leave no rest"):
        scoring.check_score_loss(config, Objective(nsa_score_loss_coef=0.1, nsa_score_loss_top=2,
                                                   nsa_score_loss_target="boundary"))
    scoring.check_score_loss(config, Objective(nsa_score_loss_coef=0.1, nsa_score_loss_top=2,
                                               nsa_score_loss_random=1, nsa_score_loss_target="boundary"))


def test_selection_target_is_uniform_over_the_top_allowed_blocks() -> None:
    """`selection_target`: 1 / free on each row's free highest allowed scores, 1 / count on all of them when a row
    has fewer, zero for a row with none; a loop over the rows says the same."""
    g = torch.Generator().manual_seed(12)
    scores = torch.rand(2, 3, 5, 9, generator=g)
    allowed = torch.rand(5, 9, generator=g) < 0.7
    allowed[0], allowed[1, 2:] = False, False  # a row with none, a row with 2 (fewer than free = 3)
    target = blocks.selection_target(scores, allowed, 3)
    for b, kv, t in [(b, kv, t) for b in range(2) for kv in range(3) for t in range(5)]:
        ranked = [j for j in sorted(range(9), key=lambda j: -float(scores[b, kv, t, j])) if allowed[t, j]][:3]
        want = torch.zeros(9)
        want[ranked] = 1 / max(len(ranked), 1)
        assert torch.equal(target[b, kv, t], want)


def test_a_strided_sample_of_the_rows_is_unbiased(monkeypatch: pytest.MonkeyPatch) -> None:
    """With stride k, the loss and gradients of one random offset are k x the float64 loop over those rows / all
    rows; averaged over the k offsets they are exactly the full loss and its gradients (each row is scored for one
    offset): an unbiased estimate."""
    config = geometry(nsa_block_size=8, nsa_stride=4, nsa_select_block_size=8, nsa_num_selected=5)
    g = torch.Generator().manual_seed(7)
    B, H, KV, T, D, k = 1, 4, 2, 90, 8, 3
    q = torch.randn(B, H, T, D, generator=g, dtype=torch.float64, requires_grad=True)
    k_cmp = torch.randn(B, KV, num_compressed_blocks(T, 8, 4), D, generator=g, dtype=torch.float64,
                        requires_grad=True)
    k_slc = torch.randn(B, KV, T, D, generator=g, dtype=torch.float64)
    full = score_loss(q, k_cmp, k_slc, config, chunk=8)
    full_grads = torch.autograd.grad(full, (q, k_cmp))
    first, rows = 5 * 8, B * KV * (T - 5 * 8)
    sampled = []
    for offset in range(k):
        monkeypatch.setattr(torch, "randint", lambda high, size, device, offset=offset: torch.tensor(offset))
        loss = score_loss(q, k_cmp, k_slc, config, chunk=8, nsa_score_loss_stride=k)
        sampled.append((loss, *torch.autograd.grad(loss, (q, k_cmp))))
        keep = torch.zeros(T, dtype=torch.bool)
        keep[first + offset::k] = True  # the loop over the sampled rows: the other queries cannot choose
        masked = q.detach().clone().requires_grad_()
        rows_sampled = B * KV * int(keep.sum())
        expected = naive_score_loss(masked, k_cmp, k_slc, config, keep) * rows_sampled * k / rows
        torch.testing.assert_close(loss, expected, **F64)
    monkeypatch.undo()
    for i, want in enumerate((full, *full_grads)):
        torch.testing.assert_close(sum(s[i] for s in sampled) / k, want, **F64)


def inputs(seed: int, B: int, H: int, KV: int, T: int, D: int, l: int, d: int) -> tuple[torch.Tensor, ...]:
    """Random float64 q (B, H, T, D), compressed keys and selection keys (B, KV, ., D); q and k_cmp need grad."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, T, D, generator=g, dtype=torch.float64, requires_grad=True)
    k_cmp = torch.randn(B, KV, num_compressed_blocks(T, l, d), D, generator=g, dtype=torch.float64,
                        requires_grad=True)
    return q, k_cmp, torch.randn(B, KV, T, D, generator=g, dtype=torch.float64)


@pytest.mark.parametrize("top,random,stride,target,tau", [(3, 0, 1, "scores", 1.0), (2, 3, 1, "scores", 1.0),
                                                       (4, 2, 1, "scores", 1.0), (4, 2, 3, "scores", 1.0),
                                                       (4, 2, 1, "selection", 1.0), (2, 3, 3, "selection", 1.0),
                                                       (4, 2, 1, "scores", 0.5), (4, 2, 3, "boundary", 1.0)])
def test_candidate_blocks_equal_a_float64_loop_over_queries(top: int, random: int, stride: int, target: str,
                                                            tau: float, monkeypatch: pytest.MonkeyPatch) -> None:
    """nsa_score_loss_top m, nsa_score_loss_random r: the loop over each row's m blocks of highest importance and the
    random blocks the loss drew (read back from `candidate_blocks`), its value and gradients to 1e-12, in chunks of
    16 queries; with a stride, over the sampled rows (the offset drawn as stride - 1), scaled as the strided loss
    is; with the "selection" target, its n - 3 = 2 best candidates."""
    config = geometry(nsa_block_size=8, nsa_stride=4, nsa_select_block_size=8, nsa_num_selected=5)
    q, k_cmp, k_slc = inputs(3, B=2, H=4, KV=2, T=110, D=8, l=8, d=4)
    drawn = []
    choose = scoring.candidate_blocks
    monkeypatch.setattr(scoring, "candidate_blocks", lambda *a: drawn.append(choose(*a)) or drawn[-1])
    randint = torch.randint
    monkeypatch.setattr(torch, "randint", lambda high, size, device: randint(high, size, device=device) if high > stride
                        else high - 1)
    loss = score_loss(q, k_cmp, k_slc, config, chunk=16, nsa_score_loss_top=top, nsa_score_loss_random=random,
                      nsa_score_loss_stride=stride, nsa_score_loss_target=target, nsa_score_loss_temperature=tau)
    grads = torch.autograd.grad(loss, (q, k_cmp))
    idx = torch.cat([i for i, _ in drawn], dim=2)  # (B, KV, rows, K): the rows from position n l' = 40 on
    valid = torch.cat([v for _, v in drawn], dim=2)
    assert idx.shape[-1] == top + random
    first = 40 + stride - 1  # the first sampled row
    rows_of = torch.zeros(110, dtype=torch.bool)
    rows_of[first::stride] = True

    def extra(b: int, kv: int, t: int) -> list[int]:
        row = (t - first) // stride
        return [int(j) for j, ok in zip(idx[b, kv, row, top:], valid[b, kv, row, top:], strict=True) if ok]

    sampled_share = int(rows_of.sum()) * stride / (110 - 40)  # the strided loss: the sampled rows' mean, rescaled
    expected = naive_score_loss(q, k_cmp, k_slc, config, rows_of, top=top, extra=extra,
                                as_set=target == "selection", temperature=tau,
                                boundary=target == "boundary") * sampled_share
    torch.testing.assert_close(loss, expected, **F64)
    for got, want in zip(grads, torch.autograd.grad(expected, (q, k_cmp)), strict=True):
        torch.testing.assert_close(got, want, **F64)
    if random:
        assert any(extra(0, 0, t) for t in range(first, 110, stride))  # rows with more blocks than m drew some


def test_enough_candidates_give_the_dense_loss() -> None:
    """A row with at most m contested blocks takes them all: with m at least the count of the longest row's the
    candidate loss is the dense one (and its gradients), to 1e-12."""
    config = geometry(nsa_block_size=8, nsa_stride=4, nsa_select_block_size=8, nsa_num_selected=5)
    q, k_cmp, k_slc = inputs(4, B=1, H=4, KV=2, T=100, D=8, l=8, d=4)
    results = []
    for form in ({}, {"nsa_score_loss_top": 11}):
        loss = score_loss(q, k_cmp, k_slc, config, chunk=32, **form)
        results.append((loss, *torch.autograd.grad(loss, (q, k_cmp))))
    for dense, candidates in zip(*results, strict=True):
        torch.testing.assert_close(candidates, dense, **F64)


def test_candidate_blocks_are_the_top_ones_and_a_uniform_draw_of_the_rest() -> None:
    """`candidate_blocks`: the m highest allowed scores, then r distinct allowed others; every block left out of the
    top is drawn with probability r / (blocks left), within 5 standard deviations over 4000 rows; rows with fewer
    allowed blocks than slots mark the rest invalid."""
    g = torch.Generator().manual_seed(8)
    Q, Ns, top, random = 4000, 12, 3, 2
    scores = torch.rand(1, 1, Q, Ns, generator=g)
    allowed = torch.ones(Q, Ns, dtype=torch.bool)
    allowed[:, 10:] = False  # 10 allowed blocks: 7 left after the top 3
    allowed[0, 4:] = False  # row 0: 4 allowed blocks, one random slot invalid
    idx, valid = blocks.candidate_blocks(scores, allowed, top, random, torch.Generator().manual_seed(9))
    assert idx.shape == valid.shape == (1, 1, Q, top + random)
    ranked = scores.masked_fill(~allowed, -1).argsort(-1, descending=True)[..., :top]
    assert torch.equal(idx[..., :top].sort(-1).values, ranked.sort(-1).values)
    assert valid[0, 0, 1:].all() and valid[0, 0, 0].tolist() == [True] * 4 + [False]
    rows = idx[0, 0, 1:]
    assert (rows < 10).all() and all(len(set(r.tolist())) == top + random for r in rows)
    counts = torch.zeros(Ns)
    for r in rows[:, top:]:
        counts[r] += 1
    drawn = counts / (Q - 1)  # per block: the times it was drawn / rows; expected r / 7 when not in the top
    not_top = torch.ones(Q - 1, Ns, dtype=torch.bool).scatter(-1, rows[:, :top], False)[:, :10].float().mean(0)
    expected = not_top * random / 7
    sd = (expected * (1 - expected) / (Q - 1)).sqrt()  # a Bernoulli count's
    assert ((drawn[:10] - expected).abs() <= 5 * sd + 1e-9).all()


def test_gradcheck_of_the_compressed_keys() -> None:
    """Finite differences in the compressed keys (on which the target does not depend; in q they would also move
    the detached target)."""
    config = geometry(nsa_block_size=4, nsa_stride=4, nsa_select_block_size=4)
    g = torch.Generator().manual_seed(1)
    q = torch.randn(1, 2, 30, 4, generator=g, dtype=torch.float64)
    k_cmp = torch.randn(1, 1, num_compressed_blocks(30, 4, 4), 4, generator=g, dtype=torch.float64,
                        requires_grad=True)
    k_slc = torch.randn(1, 1, 30, 4, generator=g, dtype=torch.float64)
    assert torch.autograd.gradcheck(lambda k: score_loss(q, k, k_slc, config, chunk=8), (k_cmp,))


@pytest.mark.parametrize("n", [4, 3])
def test_rows_where_top_n_chooses_nothing_have_no_loss(n: int) -> None:
    """Before position n l' every block between the forced ones (block 0, the previous and the own block) fits in
    the n - 3 free slots, and with n = 3 there is no free slot: no row chooses, the loss is 0 with zero gradients
    (those rows are not counted in the mean either, so the coefficient means the same at every length)."""
    config = geometry(nsa_num_selected=n)  # l' = 16
    T = 64
    q = torch.randn(1, 4, T, 16, requires_grad=True)
    k_cmp = torch.randn(1, 2, num_compressed_blocks(T, 8, 4), 16, requires_grad=True)
    loss = score_loss(q, k_cmp, torch.randn(1, 2, T, 16), config)
    loss.backward()
    assert loss.item() == 0 and not q.grad.any() and not k_cmp.grad.any()


def test_autocast_does_not_change_the_loss() -> None:
    """The loss runs in float32 with autocast off: under a bfloat16 autocast, float32 inputs give exactly the loss
    and gradients they give without it (single-process bf16 training and float32 train the same objective)."""
    config = geometry()
    g = torch.Generator().manual_seed(5)
    q = torch.randn(1, 4, 128, 16, generator=g, requires_grad=True)
    k_cmp = torch.randn(1, 2, num_compressed_blocks(128, 8, 4), 16, generator=g, requires_grad=True)
    k_slc = torch.randn(1, 2, 128, 16, generator=g)
    results = []
    for enabled in (False, True):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=enabled):
            loss = score_loss(q, k_cmp, k_slc, config, chunk=32)
        results.append((loss, *torch.autograd.grad(loss, (q, k_cmp))))
    for plain, autocast in zip(*results, strict=True):
        assert plain.dtype == autocast.dtype == torch.float32
        assert torch.equal(plain, autocast)


class _Float32Made(TorchDispatchMode):
    """The shapes of the float32 tensors operators make (not those they write in place)."""

    def __init__(self) -> None:
        super().__init__()
        self.shapes: list[tuple[int, ...]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in () if func._schema.is_mutable else out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.dtype == torch.float32:
                self.shapes.append(tuple(t.shape))
        return out


@pytest.mark.parametrize("top,random", [(0, 0), (3, 2)])
def test_bfloat16_keys_are_cast_to_float32_a_tile_at_a_time(top: int, random: int,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """The loss runs in float32, but the selection keys (under context parallelism the whole sequence's) are cast a
    tile at a time where read, never whole: with bfloat16 inputs no float32 tensor of the keys' shape is made
    (and, as the cast is exact, the loss is that of float32 copies of the inputs)."""
    config = geometry()
    g = torch.Generator().manual_seed(3)
    q = torch.randn(1, 4, 256, 16, generator=g).bfloat16().requires_grad_()
    k_cmp = torch.randn(1, 2, num_compressed_blocks(256, 8, 4), 16, generator=g).bfloat16().requires_grad_()
    k_slc = torch.randn(1, 2, 256, 16, generator=g).bfloat16()
    form = {"chunk": 32, "nsa_score_loss_top": top, "nsa_score_loss_random": random}
    monkeypatch.setattr(blocks, "_KEY_TILE", 64)  # tiles of 4 of the 16 blocks
    torch.manual_seed(0)  # the random candidates' draw
    with _Float32Made() as made:
        loss = score_loss(q, k_cmp, k_slc, config, **form)
    n_blocks, l_sel = 256 // config.nsa_select_block_size, config.nsa_select_block_size
    whole = {tuple(k_slc.shape), (1, 2, n_blocks, l_sel, 16), (2 * n_blocks, l_sel * 16)}  # the keys, as blocks, rows
    assert made.shapes and not whole & set(made.shapes)
    torch.manual_seed(0)
    assert torch.equal(loss, score_loss(q.float(), k_cmp.float(), k_slc.float(), config, **form))


@pytest.mark.parametrize("top,random,target", [(0, 0, "scores"), (3, 2, "scores"), (0, 0, "selection")])
def test_backward_keeps_only_the_input_gradients(top: int, random: int, target: str) -> None:
    """Gradients are computed in forward: what backward keeps is one gradient of q and one of the compressed keys,
    no chunk's logits, with the dense target and with candidate blocks."""
    config = geometry()
    q = torch.randn(2, 4, 256, 16, requires_grad=True)
    k_cmp = torch.randn(2, 2, num_compressed_blocks(256, 8, 4), 16, requires_grad=True)
    loss = score_loss(q, k_cmp, torch.randn(2, 2, 256, 16), config, chunk=64, nsa_score_loss_top=top,
                      nsa_score_loss_random=random, nsa_score_loss_target=target)
    saved = loss.grad_fn.saved_tensors
    assert sum(t.nbytes for t in saved) == q.nbytes + k_cmp.nbytes


@pytest.mark.slow
@pytest.mark.parametrize("top,random", [(0, 0), (8, 4)])
def test_memory_grows_linearly_with_the_sequence(top: int, random: int) -> None:
    """Forward peak (inputs excluded) under fake tensors at T and 2T with the query chunk fixed, with the dense
    target and with candidate blocks: no T x T tensor, so doubling T at most doubles it (a (T, T) score matrix
    would quadruple its share)."""
    config = geometry(nsa_block_size=8, nsa_stride=8, nsa_select_block_size=8)
    form = {"chunk": 256, "nsa_score_loss_top": top, "nsa_score_loss_random": random}
    peaks = []
    for T in (4096, 8192):
        with FakeTensorMode():
            q = torch.empty(1, 4, T, 16, requires_grad=True)
            k_cmp = torch.empty(1, 2, T // 8, 16, requires_grad=True)
            k_slc = torch.empty(1, 2, T, 16)
            with LiveBytesTracker() as tracker:
                score_loss(q, k_cmp, k_slc, config, **form)
        peaks.append(tracker.peak)
    assert peaks[1] <= 2.1 * peaks[0]
    assert peaks[1] < 4 * 8192 * 8192  # below one float32 (T, T) matrix of one head


@pytest.mark.parametrize("form", [{}, {"nsa_score_loss_top": 8, "nsa_score_loss_random": 4},
                                  {"nsa_score_loss_stride": 3}], ids=["dense", "candidates", "stride"])
def test_peak_chunks_allocate_what_every_chunk_does(form: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    """`peak_only` (the memory estimate's form, nsa/memory_stand_in.py) scores 3 of the 11 query chunks (the last
    one partial) and reaches the same forward peak and keeps the same bytes for backward as the whole loop, under
    fake tensors and with a real live-bytes count."""
    monkeypatch.setattr(torch, "randint", lambda high, size, device: 1)  # the offset and seed, as a real run draws
    config = geometry(nsa_block_size=8, nsa_stride=8, nsa_select_block_size=8)
    objective, compute = Objective(nsa_score_loss_coef=0.1, **form), ComputeConfig(attention_query_chunk=64)
    measured = []
    for peak_only in (False, True):
        with FakeTensorMode():
            q = torch.empty(1, 4, 700, 16, requires_grad=True)
            k_cmp = torch.empty(1, 2, 700 // 8, 16, requires_grad=True)
            k_slc = torch.empty(1, 2, 700, 16)
            with LiveBytesTracker() as tracker:
                loss = selection_score_loss(q, k_cmp, k_slc, config, compute, objective, peak_only=peak_only)
                measured.append((tracker.peak, tracker.live))
            del loss
    assert measured[0] == measured[1] and measured[0][1] > 0


@pytest.mark.slow
@pytest.mark.parametrize("top,random,growth", [(0, 0, (3.5, 4.5)), (8, 4, (1.9, 2.1))])
def test_work_beside_the_importance_is_linear_with_candidate_blocks(top: int, random: int, growth: tuple,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Floating-point operations of the loss with its backward (FlopCounterMode, fake tensors) at T and 2T, the
    importance replaced by a stand-in without any: what is left is the target. The dense target reads every key of
    the prefix, so doubling T quadruples it; candidate blocks read (m + r) l' keys a row, so it doubles with the
    rows. (The importance is the compression branch's own O(T^2 / d) product, which NSA's selection computes too.)"""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parent.parent / "benchmarks"))
    from bench_score_loss import call_flops, flat_log_importance  # no matrix product

    monkeypatch.setattr(scoring, "block_log_importance", flat_log_importance)
    form = {"nsa_score_loss_top": top, "nsa_score_loss_random": random}
    flops = [call_flops(T, form, geometry()) for T in (2048, 4096)]  # 4 heads, 2 K/V heads of 16, chunks of 512
    assert flops[0] > 0 and growth[0] <= flops[1] / flops[0] <= growth[1]


def nsa_model(coef: float, **objective: object) -> Transformer:
    torch.manual_seed(0)
    config = ModelConfig.from_preset("tiny", attention_type="nsa", context_length=256)
    return Transformer(config, ComputeConfig(attention_query_chunk=64),
                       Objective(nsa_score_loss_coef=coef, **objective))


def test_model_adds_the_weighted_loss() -> None:
    """loss = cross-entropy + coef x the layers' summed scoring losses x aux_weight; aux_loss reports that term,
    whatever the labels and the loss normalizer; no term without gradients."""
    ids = torch.randint(0, 512, (2, 200), generator=torch.Generator().manual_seed(2))
    plain = nsa_model(0.0)(ids, ids)
    model = nsa_model(0.5)
    q_of = {}
    seam = type(model.layers[0].attn).sparse_attention
    for i, block in enumerate(model.layers):  # capture each layer's q, k_cmp, k_slc at the attention seam
        def capture(q, k_cmp, v_cmp, k_slc, *rest, i=i, **kw):
            q_of[i] = (q.detach(), k_cmp.detach(), k_slc.detach())
            return seam(q, k_cmp, v_cmp, k_slc, *rest, **kw)
        block.attn.sparse_attention = capture
    out = model(ids, ids)
    terms = sum(selection_score_loss(*q_of[i], model.config, model.compute, model.objective) for i in q_of)
    torch.testing.assert_close(out.aux_loss, 0.5 * terms)
    torch.testing.assert_close(out.loss, plain.loss + out.aux_loss)
    sparse = torch.full_like(ids, -100)
    sparse[:, -5:] = ids[:, -5:]  # a few answer tokens: the term is the same
    torch.testing.assert_close(model(ids, sparse, loss_normalizer=1000.0).aux_loss, out.aux_loss)
    torch.testing.assert_close(model(ids, ids, aux_weight=0.5).aux_loss, out.aux_loss / 2)
    with torch.no_grad():
        assert model(ids, ids).aux_loss is None


def test_micro_batches_with_sparse_labels_train_the_mean_over_rows() -> None:
    """A step of two micro-batches whose answers differ in number (27 and 127 targets) has the loss term and the
    gradients of one batch of both: each micro-batch's term is the mean over its rows, weighted 1/2, not by its
    share of the targets; a micro-batch without a target keeps its term."""
    from training import trainer

    ids = torch.randint(0, 512, (2, 200), generator=torch.Generator().manual_seed(6))
    labels = torch.full_like(ids, -100)
    labels[0, -27:], labels[1, -127:] = ids[0, -27:], ids[1, -127:]
    no_autocast = torch.autocast("cpu", enabled=False)
    results = []
    for batches in ([[ids, labels]], [[ids[:1], labels[:1]], [ids[1:], labels[1:]]]):
        model = nsa_model(0.5)
        _, extras = trainer.forward_backward(model, batches, no_autocast)
        results.append((extras["aux_loss"], [p.grad for p in model.parameters()]))
    (one, one_grads), (two, two_grads) = results
    torch.testing.assert_close(two, one, rtol=1e-6, atol=0)
    for a, b in zip(one_grads, two_grads, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-7)  # float32 sums of the same terms in another order
    labels[1] = -100  # the second micro-batch has no target: its term still counts
    model = nsa_model(0.5)
    _, extras = trainer.forward_backward(model, [[ids[:1], labels[:1]], [ids[1:], labels[1:]]], no_autocast)
    torch.testing.assert_close(extras["aux_loss"], one, rtol=1e-6, atol=0)


def test_gradient_checkpointing_gives_the_same_gradients() -> None:
    """The layer computes the term in the recomputed forward too (not collected there): same gradients."""
    ids = torch.randint(0, 512, (2, 200), generator=torch.Generator().manual_seed(3))
    grads = []
    for checkpointing in (False, True):
        model = nsa_model(0.5)
        for block in model.layers:
            block.gradient_checkpointing = checkpointing
        model(ids, ids).loss.backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)  # float32 sums of the same terms in another order


def test_gradient_checkpointing_recomputes_the_loss_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """The chunks' own graphs bypass the block's checkpoint: with checkpointing each chunk is scored twice (forward,
    and the one recomputation in backward), not once more per chunk scored before it."""
    ids = torch.randint(0, 512, (1, 256), generator=torch.Generator().manual_seed(4))
    calls = []
    chunk_kl = scoring._chunk_kl
    monkeypatch.setattr(scoring, "_chunk_kl", lambda *args: calls.append(1) or chunk_kl(*args))
    counts = []
    for checkpointing in (False, True):
        model = nsa_model(0.5)
        for block in model.layers:
            block.gradient_checkpointing = checkpointing
        calls.clear()
        model(ids, ids).loss.backward()
        counts.append(len(calls))
    assert counts == [2 * 3, 2 * 2 * 3]  # 2 layers x 3 chunks of 64, those where top-n chooses (from n l' = 64)


@pytest.mark.parametrize("bad", [-0.1, math.inf, math.nan, "0.1"])
def test_bad_coefficient_is_refused(bad: object) -> None:
    with pytest.raises(ValueError, match="nsa_score_loss_coef must be a finite number >= 0"):
        Objective(nsa_score_loss_coef=bad)


@pytest.mark.parametrize("fields,message", [
    ({"nsa_score_loss_top": -1}, "nsa_score_loss_top must be an integer >= 0"),
    ({"nsa_score_loss_top": 2.0}, "nsa_score_loss_top must be an integer >= 0"),
    ({"nsa_score_loss_top": 4, "nsa_score_loss_random": True}, "nsa_score_loss_random must be an integer >= 0"),
    ({"nsa_score_loss_random": 2}, "goes with nsa_score_loss_top > 0"),
    ({"nsa_score_loss_target": "best"}, "nsa_score_loss_target must be 'scores', 'selection' or 'boundary'"),
    ({"nsa_score_loss_temperature": 0.0}, "nsa_score_loss_temperature must be a finite number > 0"),
    ({"nsa_score_loss_target": "boundary", "nsa_score_loss_temperature": 2.0}, "takes only the ranking"),
])
def test_bad_loss_options_are_refused(fields: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Objective(**fields)


def test_the_log_importance_keeps_blocks_far_below_the_best() -> None:
    """Compressed blocks 100 to 300 below the row's best in every head: their float32 probabilities underflow to 0,
    which the loss once floored before its log (no gradient for exactly the blocks it should raise). The log
    importance, computed in log space, equals float64's log of the importance to float32 rounding (relative 1e-5
    of the values' size), and its gradient reaches those blocks' keys as float64's does."""
    torch.manual_seed(0)
    l, d, l_sel, T, D = 8, 4, 16, 64, 16
    u = torch.nn.functional.normalize(torch.randn(D, dtype=torch.float64), dim=0)
    q = (12 * u + 0.1 * torch.randn(1, 4, T, D, dtype=torch.float64)).requires_grad_()  # (B, H, T, D)
    Nc = num_compressed_blocks(T, l, d)
    scale = torch.linspace(20, -60, Nc, dtype=torch.float64)[:, None]  # block i's logit: about 3 x scale_i
    k_cmp = (scale * u + 0.1 * torch.randn(1, 2, Nc, D, dtype=torch.float64)).requires_grad_()  # (B, KV, Nc, D)
    q_pos = torch.arange(T)
    n_select = T // l_sel
    want = blocks.block_log_importance(q, k_cmp, q_pos, l, d, l_sel, n_select)  # float64: nothing underflows
    exact = blocks.block_importance(q, k_cmp, q_pos, l, d, l_sel, n_select)
    assert torch.allclose(want, exact.log().clamp(min=blocks.NO_IMPORTANCE), rtol=1e-12, atol=1e-9)
    q32, k32 = q.detach().float().requires_grad_(), k_cmp.detach().float().requires_grad_()
    got = blocks.block_log_importance(q32, k32, q_pos, l, d, l_sel, n_select)
    underflowed = blocks.block_importance(q32, k32, q_pos, l, d, l_sel, n_select) == 0
    real = want > blocks.NO_IMPORTANCE
    assert (underflowed & real).any() and (want[real] < -100).any()  # the case: a float32 probability of 0
    scale_of = want[real].abs().max()
    assert (got[real].double() - want[real]).abs().max() <= 1e-5 * scale_of
    weights = torch.rand_like(want)  # any loss over the far blocks' log importance
    (want * weights * underflowed).sum().backward()
    (got * weights.float() * underflowed).sum().backward()
    assert k32.grad.abs().sum() > 0
    assert torch.allclose(k32.grad.double(), k_cmp.grad, rtol=1e-3, atol=1e-3 * k_cmp.grad.abs().max())


def test_the_retrieval_recipe_is_one_config_file(data_dir: Path, tmp_path: Path) -> None:
    """configs/nsa-retrieval.json trains NSA with the recipe's blocks, its selection-scoring loss and its warm-up of
    exact selection: the model's fields, objective and warm-up as the file says, the loss's term in the metrics."""
    import json

    import train
    from training.options import parse_config

    recipe = json.loads((Path(__file__).resolve().parent.parent / "configs" / "nsa-retrieval.json").read_text())
    cfg = parse_config(["--config", "configs/nsa-retrieval.json"])
    assert cfg.objective() == Objective(**{k: v for k, v in recipe.items() if k.startswith("nsa_score_loss")})
    train.main(["--config", "configs/nsa-retrieval.json", "--model_size", "tiny", "--batch_size", "1", "--max_steps",
                "1", "--sample_tokens", "0", "--data_dir", str(data_dir), "--out_dir", str(tmp_path / "run")])
    record = json.loads((tmp_path / "run" / "config.json").read_text())
    assert {k: record["model"][k] for k in recipe["model_overrides"]} == recipe["model_overrides"]
    assert record["train"]["nsa_score_loss_coef"] == 0.1 and record["model"]["attention_type"] == "nsa"
    assert record["train"]["nsa_exact_selection_steps"] == recipe["nsa_exact_selection_steps"] == 200  # warm-up
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    assert any(m.get("aux_loss", 0) > 0 for m in metrics)


def test_a_run_recorded_with_the_objective_in_its_overrides_resumes_with_the_options() -> None:
    """Runs once recorded the objective's terms among --model_overrides (ComputeConfig fields then): a resume reads
    them as the options of the same names."""
    from training.options import TrainConfig
    from training.resume import continue_options

    old = {"model_overrides": {"n_layers": 2, "nsa_score_loss_coef": 0.1, "nsa_score_loss_stride": 4,
                               "z_loss_coef": 1e-4}, "attention_type": "nsa", "context_length": 256}
    cfg = continue_options(TrainConfig(), frozenset(), old)
    assert cfg.model_overrides == {"n_layers": 2}
    assert cfg.objective() == Objective(z_loss_coef=1e-4, nsa_score_loss_coef=0.1, nsa_score_loss_stride=4)


def test_the_exact_selection_warm_up_selects_by_best_keys_for_its_steps(data_dir: Path, tmp_path: Path) -> None:
    """--nsa_exact_selection_steps K: the first K steps select blocks by their best key while the score loss trains
    the importance (the first step's loss is the model's under `exact_block_scores` on the same batch, and differs
    from its loss without); refused without that loss."""
    import json

    import train
    from nsa.primitive import exact_block_scores
    from text.shards import TokenLoader

    args = ["--model_size", "tiny", "--attention_type", "nsa", "--context_length", "256", "--batch_size", "2",
            "--max_steps", "1", "--sample_tokens", "0", "--data_dir", str(data_dir), "--nsa_score_loss_coef", "0.1"]
    first = train.main([*args, "--nsa_exact_selection_steps", "1", "--out_dir", str(tmp_path / "warm")])
    record = json.loads((tmp_path / "warm" / "config.json").read_text())
    torch.manual_seed(0)
    model = Transformer(ModelConfig.from_dict(record["model"]))
    model.objective = Objective(nsa_score_loss_coef=0.1)
    ids, labels = next(TokenLoader(data_dir, 256, 2, 0, 1, 0))
    with exact_block_scores():
        exact = model(ids, labels).loss.item()
    plain = model(ids, labels).loss.item()
    assert first["loss"] == pytest.approx(exact, rel=1e-5) and abs(exact - plain) > 1e-4
    with pytest.raises(ValueError, match="--nsa_exact_selection_steps is a warm-up .* add --nsa_score_loss_coef"):
        train.main([*args[:-2], "--nsa_exact_selection_steps", "1", "--out_dir", str(tmp_path / "x")])
