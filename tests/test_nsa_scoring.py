"""NSA's selection-scoring loss (nsa/scoring.py): value and gradients against a float64 loop over queries,
gradcheck, what it keeps for backward and its memory under fake tensors, and how the model adds it to the loss
(share of the normalizer, gradient checkpointing, no gradients, the option's validation)."""

import math

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from model import Transformer
from modeling.config import ComputeConfig, ModelConfig
from modeling.memtrack import LiveBytesTracker
from nsa import blocks, scoring
from nsa.blocks import num_compressed_blocks, selection_pool_weights
from nsa.scoring import selection_score_loss

F64 = dict(rtol=0, atol=1e-12)


def geometry(**overrides: object) -> ModelConfig:
    return ModelConfig.from_preset("tiny", attention_type="nsa", **overrides)


def naive_score_loss(q: torch.Tensor, k_cmp: torch.Tensor, k_slc: torch.Tensor, config: ModelConfig) -> torch.Tensor:
    """The loss one (batch, KV head, query) row at a time, straight from the definitions: the target averages each
    head's softmax over the candidate blocks (those before the previous one) of its best key's logit; the
    prediction sums each head's compression probabilities, pooled with Eq. 9's weights, over the group and
    renormalises them over the candidates."""
    B, H, T, D = q.shape
    KV = k_cmp.shape[1]
    G, l, d, l_sel = H // KV, config.nsa_block_size, config.nsa_stride, config.nsa_select_block_size
    first, weights = selection_pool_weights(l, d, l_sel)
    total, rows = q.new_zeros(()), 0
    for b in range(B):
        for kv in range(KV):
            for t in range(T):
                candidates = range(t // l_sel - 1)
                if not candidates:
                    continue
                n_visible = num_compressed_blocks(t + 1, l, d)
                target, importance = 0.0, [q.new_zeros(()) for _ in candidates]
                for h in range(kv * G, (kv + 1) * G):
                    best = torch.stack([(k_slc[b, kv, j * l_sel:(j + 1) * l_sel] @ q[b, h, t]).max()
                                        for j in candidates]) / math.sqrt(D)
                    target = target + best.softmax(0).detach() / G
                    p_cmp = (k_cmp[b, kv, :n_visible] @ q[b, h, t] / math.sqrt(D)).softmax(0)
                    for j in candidates:
                        for offset, weight in enumerate(weights):
                            i = (l_sel // d) * j + first + offset
                            if 0 <= i < n_visible:
                                importance[j] = importance[j] + weight * p_cmp[i]
                p = torch.stack(importance)
                p = p / p.sum()
                total = total + (target * (target.log() - p.log())).sum()
                rows += 1
    return total / rows


@pytest.mark.parametrize("l,d,l_sel,key_tile", [(8, 4, 16, 1024), (8, 8, 8, 1024), (8, 4, 16, 24)])
def test_loss_and_gradients_equal_a_float64_loop_over_queries(l: int, d: int, l_sel: int, key_tile: int,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunks of 24 queries (not dividing T = 100, nor the blocks) give the loop's value and gradients to 1e-12,
    with the best-token scores in one tile of keys or in tiles of one block (24 // 16); no gradient reaches the
    selection keys."""
    monkeypatch.setattr(blocks, "_KEY_TILE", key_tile)
    config = geometry(nsa_block_size=l, nsa_stride=d, nsa_select_block_size=l_sel)
    g = torch.Generator().manual_seed(0)
    B, H, KV, T, D = 2, 4, 2, 100, 8
    q = torch.randn(B, H, T, D, generator=g, dtype=torch.float64, requires_grad=True)
    k_cmp = torch.randn(B, KV, num_compressed_blocks(T, l, d), D, generator=g, dtype=torch.float64,
                        requires_grad=True)
    k_slc = torch.randn(B, KV, T, D, generator=g, dtype=torch.float64, requires_grad=True)
    loss = selection_score_loss(q, k_cmp, k_slc, config, ComputeConfig(attention_query_chunk=24))
    grads = torch.autograd.grad(loss, (q, k_cmp, k_slc), allow_unused=True)
    expected = naive_score_loss(q, k_cmp, k_slc, config)
    expected_grads = torch.autograd.grad(expected, (q, k_cmp))
    torch.testing.assert_close(loss, expected, **F64)
    for got, want in zip(grads[:2], expected_grads, strict=True):
        torch.testing.assert_close(got, want, **F64)
    assert grads[2] is None


def test_gradcheck_of_the_compressed_keys() -> None:
    """Finite differences in the compressed keys (on which the target does not depend; in q they would also move
    the detached target)."""
    config = geometry(nsa_block_size=4, nsa_stride=4, nsa_select_block_size=4)
    g = torch.Generator().manual_seed(1)
    q = torch.randn(1, 2, 30, 4, generator=g, dtype=torch.float64)
    k_cmp = torch.randn(1, 1, num_compressed_blocks(30, 4, 4), 4, generator=g, dtype=torch.float64,
                        requires_grad=True)
    k_slc = torch.randn(1, 1, 30, 4, generator=g, dtype=torch.float64)
    compute = ComputeConfig(attention_query_chunk=8)
    assert torch.autograd.gradcheck(lambda k: selection_score_loss(q, k, k_slc, config, compute), (k_cmp,))


def test_short_sequences_have_no_loss() -> None:
    """Until position 2 l' no query has a block to choose: the loss is 0 with zero gradients."""
    config = geometry()  # l' = 16
    q = torch.randn(1, 4, 32, 16, requires_grad=True)
    k_cmp = torch.randn(1, 2, num_compressed_blocks(32, 8, 4), 16, requires_grad=True)
    loss = selection_score_loss(q, k_cmp, torch.randn(1, 2, 32, 16), config, ComputeConfig())
    loss.backward()
    assert loss.item() == 0 and not q.grad.any() and not k_cmp.grad.any()


def test_backward_keeps_only_the_input_gradients() -> None:
    """Gradients are computed in forward: what backward keeps is one gradient of q and one of the compressed keys,
    no chunk's logits."""
    config = geometry()
    q = torch.randn(2, 4, 256, 16, requires_grad=True)
    k_cmp = torch.randn(2, 2, num_compressed_blocks(256, 8, 4), 16, requires_grad=True)
    loss = selection_score_loss(q, k_cmp, torch.randn(2, 2, 256, 16), config, ComputeConfig(attention_query_chunk=64))
    saved = loss.grad_fn.saved_tensors
    assert sum(t.nbytes for t in saved) == q.nbytes + k_cmp.nbytes


@pytest.mark.slow
def test_memory_grows_linearly_with_the_sequence() -> None:
    """Forward peak (inputs excluded) under fake tensors at T and 2T with the query chunk fixed: no T x T tensor,
    so doubling T at most doubles it (a (T, T) score matrix would quadruple its share)."""
    config = geometry(nsa_block_size=8, nsa_stride=8, nsa_select_block_size=8)
    compute = ComputeConfig(attention_query_chunk=256)
    peaks = []
    for T in (4096, 8192):
        with FakeTensorMode():
            q = torch.empty(1, 4, T, 16, requires_grad=True)
            k_cmp = torch.empty(1, 2, T // 8, 16, requires_grad=True)
            k_slc = torch.empty(1, 2, T, 16)
            with LiveBytesTracker() as tracker:
                selection_score_loss(q, k_cmp, k_slc, config, compute)
        peaks.append(tracker.peak)
    assert peaks[1] <= 2.1 * peaks[0]
    assert peaks[1] < 4 * 8192 * 8192  # below one float32 (T, T) matrix of one head


def nsa_model(coef: float, **compute: object) -> Transformer:
    torch.manual_seed(0)
    config = ModelConfig.from_preset("tiny", attention_type="nsa", context_length=256)
    return Transformer(config, ComputeConfig(nsa_score_loss_coef=coef, attention_query_chunk=64, **compute))


def test_model_adds_the_weighted_loss_scaled_by_its_share() -> None:
    """loss = cross-entropy + coef x the layers' summed scoring losses x (this call's targets / normalizer);
    aux_loss reports that term; no term without gradients."""
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
    terms = sum(selection_score_loss(*q_of[i], model.config, model.compute) for i in q_of)
    torch.testing.assert_close(out.aux_loss, 0.5 * terms)
    torch.testing.assert_close(out.loss, plain.loss + out.aux_loss)
    n_targets = (ids[:, 1:] != -100).sum()
    halved = model(ids, ids, loss_normalizer=2 * n_targets)
    torch.testing.assert_close(halved.aux_loss, out.aux_loss / 2)
    with torch.no_grad():
        assert model(ids, ids).aux_loss is None


def test_gradient_checkpointing_gives_the_same_gradients() -> None:
    """The layer computes the term in the recomputed forward too (not collected there): same gradients."""
    ids = torch.randint(0, 512, (2, 200), generator=torch.Generator().manual_seed(3))
    grads = []
    for checkpointing in (False, True):
        model = nsa_model(0.5)
        for block in model.layers:
            block.checkpointing = checkpointing
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
            block.checkpointing = checkpointing
        calls.clear()
        model(ids, ids).loss.backward()
        counts.append(len(calls))
    assert counts == [2 * 4, 2 * 2 * 4]  # 2 layers x 4 chunks of 64, all with blocks to choose (from position 32)


@pytest.mark.parametrize("bad", [-0.1, math.inf, math.nan, "0.1"])
def test_bad_coefficient_is_refused(bad: object) -> None:
    with pytest.raises(ValueError, match="ComputeConfig.nsa_score_loss_coef must be a finite number >= 0"):
        ComputeConfig(nsa_score_loss_coef=bad)
