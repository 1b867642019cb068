"""Tests of the nsa/ package against independent references: dense causal attention (explicit T x T
masks, allowed in tests only), nsa/reference.py's per-query brute-force NSA written from the paper's definitions
(overlap-weighted importance instead of Eq. 9), hand-made tables, gradcheck, causality at block boundaries,
decode == prefill, and memory trackers. The fused CPU path and the explicit path (the one CUDA runs) are both checked.

Tolerances: float64 comparisons use atol=1e-12 (different but equivalent reduction orders); causality checks are
exact (masked keys contribute exp(-inf) = 0 exactly); float32 model-level checks use 1e-5.
"""

import contextlib
import itertools
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode

from model import ModelConfig, Transformer
from modeling.attention import FullAttention
from modeling.config import ComputeConfig
from modeling.flash import additive_mask, attend, attend_backward, explicit_attention
from modeling.layers import RotaryEmbedding, apply_rope
from modeling.memtrack import LiveBytesTracker
from nsa import attention as nsa_attention
from nsa import torch_path
from nsa.attention import sparse_attention
from nsa.blocks import as_blocks, num_compressed_blocks, pool_to_selection_blocks, select_blocks, selection_pool_weights
from nsa.layer import NativeSparseAttention
from nsa.primitive import exact_block_scores, triton_kernels
from nsa.reference import naive_nsa

F64 = dict(rtol=0, atol=1e-12)
EXACT = dict(rtol=0, atol=0)


def nsa_config(**overrides) -> ModelConfig:
    """Tiny geometry: l=8, d=4, l'=16, n=4, w=32, H=4, KV=2, D=16, dim 64 (query chunk: ComputeConfig's)."""
    return ModelConfig.from_preset("tiny", attention_type="nsa", **overrides)


def make_layer(config: ModelConfig, dtype=torch.float64, compute: ComputeConfig | None = None
               ) -> tuple[NativeSparseAttention, RotaryEmbedding]:
    layer = NativeSparseAttention(config, compute).to(dtype)
    layer.init_weights()
    with torch.no_grad():  # a non-trivial position encoding and norm weights, so wiring mistakes show
        if config.nsa_compressor == "mlp":
            for p in (layer.k_compress.pos, layer.v_compress.pos):
                p.normal_()
        for norm in (layer.q_norm, layer.k_norm):
            norm.weight.uniform_(0.5, 1.5)
        layer.branch_gate.weight.normal_()
    return layer, RotaryEmbedding(config.head_dim, config.rope_theta, 64)


def run_layer(layer: NativeSparseAttention, rope: RotaryEmbedding, x: Tensor, start_pos: int | None = None) -> Tensor:
    cos, sin = rope(x.shape[1], start_pos or 0, x.device)
    return layer(x, cos, sin, start_pos)


def dense_causal(q: Tensor, k: Tensor, v: Tensor, window: int | None = None) -> Tensor:
    """Naive GQA causal attention q (B, H, T, D), k/v (B, KV, T, D) with an explicit (T, T) mask."""
    T, G = q.shape[2], q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(G, dim=1), v.repeat_interleave(G, dim=1)
    i = torch.arange(T)
    mask = i[None, :] <= i[:, None]
    if window is not None:
        mask &= i[None, :] > i[:, None] - window
    logits = (q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])).masked_fill(~mask, -math.inf)
    return logits.softmax(-1) @ v


def random_inputs(B, H, KV, T, D, config, dtype=torch.float64):
    n_cmp = num_compressed_blocks(T, config.nsa_block_size, config.nsa_stride)
    q = torch.randn(B, H, T, D, dtype=dtype)
    k_cmp, v_cmp = torch.randn(B, KV, n_cmp, D, dtype=dtype), torch.randn(B, KV, n_cmp, D, dtype=dtype)
    kv = [torch.randn(B, KV, T, D, dtype=dtype) for _ in range(4)]
    gates = torch.rand(B, H, T, 3, dtype=dtype)
    return q, k_cmp, v_cmp, *kv, gates


# ---- Eq. 9 mapping and top-n: hand-made tables -----------------------------------------------------------------


def test_selection_pool_weights_tables():
    assert selection_pool_weights(32, 16, 64) == (-1, [1, 2, 2, 2, 1])  # blocks 4j-1 .. 4j+3
    assert selection_pool_weights(64, 16, 64) == (-3, [1, 2, 3, 4, 3, 2, 1])
    assert selection_pool_weights(16, 16, 16) == (0, [1])  # l = d = l': identity
    assert selection_pool_weights(8, 4, 16) == (-1, [1, 2, 2, 2, 1])


def test_pool_to_selection_blocks_hand_table():
    p = 10.0 ** torch.arange(12, dtype=torch.float64)  # p[i] = 10^i: every contribution visible in the digits
    got = pool_to_selection_blocks(p, 32, 16, 64, 3)
    want = torch.tensor([2 * p[0] + 2 * p[1] + 2 * p[2] + p[3],  # block 0: compressed -1 (absent), 0, 1, 2, 3
                         p[3] + 2 * p[4] + 2 * p[5] + 2 * p[6] + p[7],
                         p[7] + 2 * p[8] + 2 * p[9] + 2 * p[10] + p[11]], dtype=torch.float64)
    torch.testing.assert_close(got, want, **EXACT)
    # identity geometry, and fewer compressed blocks than the selection blocks need (zero padding)
    torch.testing.assert_close(pool_to_selection_blocks(p[:3], 16, 16, 16, 5), torch.cat([p[:3], p.new_zeros(2)]))


@pytest.mark.parametrize("l,d,ls", [(32, 16, 64), (64, 16, 64), (8, 4, 16), (4, 4, 8), (16, 16, 16)])
def test_pool_matches_block_overlap(l, d, ls):
    n_cmp, Ns = 13, 5
    p = torch.rand(3, n_cmp, dtype=torch.float64)
    overlap = torch.tensor([[len(set(range(i * d, i * d + l)) & set(range(j * ls, (j + 1) * ls))) / d
                             for j in range(Ns)] for i in range(n_cmp)], dtype=torch.float64)
    torch.testing.assert_close(pool_to_selection_blocks(p, l, d, ls, Ns), p @ overlap, **F64)


def test_select_blocks_forced_and_future():
    ls, n = 4, 4
    q_pos = torch.tensor([0, 5, 13, 30])  # current blocks 0, 1, 3, 7
    scores = torch.tensor([0.0, 9.0, 1.0, 8.0, 7.0, 0.5, 6.0, 0.1]).expand(1, 1, 4, 8)  # (B, KV, Q, Ns)
    idx, valid = select_blocks(scores, q_pos, ls, n)
    chosen = [sorted(i for i, ok in zip(row.tolist(), v.tolist(), strict=True) if ok) for row, v in zip(idx[0, 0],
                                                                                                     valid[0, 0],
                                                                                                     strict=True)]
    assert chosen == [[0], [0, 1], [0, 1, 2, 3], [0, 1, 6, 7]]  # t=30: forced 0, 6, 7, then best of the rest (1)


# ---- oracles: each branch alone equals dense causal attention ---------------------------------------------------


def _module_vs_full_attention(config: ModelConfig, branch: int, T: int, compressor=None,
                              compute: ComputeConfig | None = None):
    """NSA with the gates pinned to `branch` against attention.FullAttention sharing that branch's K/V projection."""
    layer, rope = make_layer(config, compute=compute)
    if compressor is not None:
        layer.k_compress, layer.v_compress = compressor, compressor
    with torch.no_grad():
        layer.branch_gate.weight.zero_()
        layer.branch_gate.bias.fill_(-200.0)
        layer.branch_gate.bias.view(-1, 3)[:, branch] = 200.0  # sigmoid(+-200) is 1 / ~1e-87 in float64
    full = FullAttention(config).to(torch.float64)
    KV, D = config.n_kv_heads, config.head_dim
    s = branch if config.nsa_separate_kv else 0
    with torch.no_grad():
        for name in ("q_proj", "o_proj", "q_norm", "k_norm"):
            getattr(full, name).load_state_dict(getattr(layer, name).state_dict())
        full.k_proj.weight.copy_(layer.k_proj.weight.view(-1, KV * D, config.dim)[s])
        full.v_proj.weight.copy_(layer.v_proj.weight.view(-1, KV * D, config.dim)[s])
    x = torch.randn(2, T, config.dim, dtype=torch.float64)
    cos, sin = rope(T, 0, x.device)
    torch.testing.assert_close(layer(x, cos, sin), full(x, cos, sin), **F64)


class SqueezeBlock(nn.Module):
    """Identity compressor for l = 1: (B, KV, N, 1, D) -> (B, KV, N, D)."""

    def forward(self, blocks: Tensor) -> Tensor:
        return blocks.squeeze(-2)


@pytest.mark.parametrize("separate", [True, False])
def test_selection_all_blocks_equals_dense(separate):
    config = nsa_config(nsa_num_selected=7, nsa_separate_kv=separate)  # 7 blocks of 16 >= T
    _module_vs_full_attention(config, branch=1, T=100, compute=ComputeConfig(attention_query_chunk=32))


@pytest.mark.parametrize("separate", [True, False])
def test_window_wider_than_sequence_equals_dense(separate):
    _module_vs_full_attention(nsa_config(nsa_window=100, nsa_separate_kv=separate), branch=2, T=100)


@pytest.mark.parametrize("separate", [True, False])
def test_mean_compressor_matches_naive(separate):
    """The "mean" compressor: the layer equals nsa.reference.naive_nsa fed with block means written out one block at
    a time (keys normed and rotated at their own positions, then averaged; values averaged), and with one K/V set
    the layer's compressed logits are the block means of its selection-branch logits."""
    config = nsa_config(nsa_separate_kv=separate, nsa_compressor="mean")
    layer, rope = make_layer(config, compute=ComputeConfig(attention_query_chunk=24))
    assert not any("compress" in name for name, _ in layer.named_parameters())
    B, T, H, KV, D = 2, 90, config.n_heads, config.n_kv_heads, config.head_dim
    l, d, n_sets = config.nsa_block_size, config.nsa_stride, 3 if separate else 1
    x = torch.randn(B, T, config.dim, dtype=torch.float64)
    cos, sin = rope(T, 0, x.device)
    with torch.no_grad():
        q = apply_rope(layer.q_norm(layer.q_proj(x).view(B, T, H, D).transpose(1, 2)), cos, sin)  # (B, H, T, D)
        k = layer.k_proj(x).view(B, T, n_sets, KV, D).permute(2, 0, 3, 1, 4)  # (nb, B, KV, T, D)
        v = layer.v_proj(x).view(B, T, n_sets, KV, D).permute(2, 0, 3, 1, 4)  # (nb, B, KV, T, D)
        k = apply_rope(layer.k_norm(k), cos, sin)
        starts = range(0, T - l + 1, d)
        k_cmp = torch.stack([k[0, :, :, i:i + l].mean(2) for i in starts], dim=2)  # (B, KV, Nc, D)
        v_cmp = torch.stack([v[0, :, :, i:i + l].mean(2) for i in starts], dim=2)  # (B, KV, Nc, D)
        s, w = n_sets // 2, n_sets - 1
        gates = torch.sigmoid(layer.branch_gate(x)).view(B, T, H, 3).permute(0, 2, 1, 3)  # (B, H, T, 3)
        ref = naive_nsa(q, k_cmp, v_cmp, k[s], v[s], k[w], v[w], gates, config)  # (B, H, T, D)
        ref = layer.o_proj(ref.transpose(1, 2).reshape(B, T, H * D))
        torch.testing.assert_close(run_layer(layer, rope, x), ref, **F64)
    if not separate:  # the layer's own compressed keys and selection keys, captured at its sparse_attention seam
        seen = {}

        def capture(q, k_cmp, v_cmp, k_slc, *rest, **kwargs):
            seen.update(q=q, k_cmp=k_cmp, k_slc=k_slc)
            return NativeSparseAttention.sparse_attention(q, k_cmp, v_cmp, k_slc, *rest, **kwargs)

        layer.sparse_attention = capture
        with torch.no_grad():
            run_layer(layer, rope, x)
        q1 = seen["q"][:, ::H // KV]  # (B, KV, T, D): the first head of each group
        logits = q1 @ seen["k_slc"].transpose(-1, -2)  # (B, KV, T, T): the selection branch's token logits
        block_means = torch.stack([logits[..., i:i + l].mean(-1) for i in starts], dim=-1)  # (B, KV, T, Nc)
        torch.testing.assert_close(q1 @ seen["k_cmp"].transpose(-1, -2), block_means, **F64)


def test_compression_identity_l1_equals_dense():
    config = nsa_config(nsa_block_size=1, nsa_stride=1, nsa_select_block_size=4)
    _module_vs_full_attention(config, branch=0, T=70, compressor=SqueezeBlock())


def test_window_is_w_keys_including_own_token():
    config = nsa_config(nsa_window=5)
    compute = ComputeConfig(attention_query_chunk=16)
    q, k_cmp, v_cmp, k_slc, v_slc, k_win, v_win, _ = random_inputs(1, 4, 2, 40, 8, config)
    gates = torch.tensor([0.0, 0.0, 1.0], dtype=torch.float64).expand(1, 4, 40, 3)
    out = sparse_attention(q, k_cmp, v_cmp, k_slc, v_slc, k_win, v_win, gates, config, compute=compute)
    torch.testing.assert_close(out, dense_causal(q, k_win, v_win, window=5), **F64)


# ---- the whole kernel against the brute-force reference ---------------------------------------------------------


@pytest.mark.parametrize("H,KV", [(2, 2), (4, 2), (8, 2), (16, 1)])  # GQA ratios 1, 2, 4, 16
def test_sparse_attention_matches_naive(H, KV):
    config = nsa_config()
    compute = ComputeConfig(attention_query_chunk=24)
    T = 90  # 6 selection blocks > n = 4, so top-n really chooses; 21 compressed blocks
    inputs = random_inputs(2, H, KV, T, 8, config)
    torch.testing.assert_close(sparse_attention(*inputs, config, compute=compute), naive_nsa(*inputs, config), **F64)


@pytest.mark.parametrize("chunk", [16, 32, 64, 65])
def test_all_selected_prefix_chunks_match_naive(chunk):
    """Chunks that end at or before n * l' = 64 keys select every block and run as one causal attention over the
    prefix; the chunk that crosses that point (and every later one) selects top-n. Both, gradients included."""
    config = nsa_config()
    assert config.nsa_num_selected * config.nsa_select_block_size == 64
    inputs = [x.requires_grad_() for x in random_inputs(1, 4, 2, 90, 8, config)]
    out = sparse_attention(*inputs, config, compute=ComputeConfig(attention_query_chunk=chunk))
    ref = naive_nsa(*inputs, config)
    torch.testing.assert_close(out, ref, **F64)
    grad = torch.randn_like(out)
    for got, want in zip(torch.autograd.grad(out, inputs, grad), torch.autograd.grad(ref, inputs, grad), strict=True):
        torch.testing.assert_close(got, want, **F64)


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_chunk_threads_match_naive_and_repeat_bitwise(threads):
    """On CPU the chunks run on one thread per intra-op thread, each single-threaded, with a fixed assignment of
    chunks to threads: the same results as the naive reference, and the same bits on every run."""
    config = nsa_config()
    inputs = [x.requires_grad_() for x in random_inputs(2, 4, 2, 100, 8, config)]
    grad = torch.randn(2, 4, 100, 8, dtype=torch.float64)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        assert nsa_attention._workers(inputs[0], ComputeConfig(), 7) == threads
        runs = []
        for _ in range(2):
            out = sparse_attention(*inputs, config, compute=ComputeConfig(attention_query_chunk=16))
            runs.append((out, *torch.autograd.grad(out, inputs, grad)))
            assert torch.get_num_threads() == threads
    finally:
        torch.set_num_threads(previous)
    for first, second in zip(*runs, strict=True):
        torch.testing.assert_close(first, second, **EXACT)
    ref = naive_nsa(*inputs, config)
    for got, want in zip(runs[0], (ref, *torch.autograd.grad(ref, inputs, grad)), strict=True):
        torch.testing.assert_close(got, want, **F64)


@pytest.mark.parametrize("chunk", [1, 7, 64, 100])
def test_chunk_size_does_not_change_results(chunk):
    config = nsa_config()
    compute = ComputeConfig(attention_query_chunk=chunk)
    layer, rope = make_layer(config, compute=compute)
    x = torch.randn(2, 100, config.dim, dtype=torch.float64)
    ref_layer = NativeSparseAttention(config, ComputeConfig(attention_query_chunk=100)).to(torch.float64)
    ref_layer.load_state_dict(layer.state_dict())
    torch.testing.assert_close(run_layer(layer, rope, x), run_layer(ref_layer, rope, x), **F64)


def test_no_compressed_block_gives_zero_and_finite_gradients():
    config = nsa_config()
    layer, rope = make_layer(config)
    with torch.no_grad():
        layer.branch_gate.weight.zero_()
        layer.branch_gate.bias.view(-1, 3).copy_(torch.tensor([200.0, -200.0, -200.0]))  # compression branch only
    T = config.nsa_block_size + 3  # queries 0 .. l-2 see no complete block
    x = torch.randn(1, T, config.dim, dtype=torch.float64, requires_grad=True)
    out = run_layer(layer, rope, x)
    torch.testing.assert_close(out[:, : config.nsa_block_size - 1], torch.zeros_like(out[:, :7]), **F64)
    assert out[:, config.nsa_block_size - 1:].abs().min() > 0
    out.sum().backward()
    assert torch.isfinite(x.grad).all() and all(torch.isfinite(p.grad).all() for p in layer.parameters())


def test_exact_block_scores_select_the_blocks_of_the_best_tokens():
    """Under exact_block_scores a query takes block 0, its own and the previous block, then the past blocks with
    the highest softmax over blocks of their best token logit, summed over the group's heads (written out here)."""
    config = nsa_config(nsa_num_selected=5)  # 2 free slots; 6 blocks of 16 at T = 90
    B, H, KV, T, D, ls, n = 1, 4, 2, 90, 8, 16, 5
    q, k_cmp, v_cmp, k, v, k_win, v_win, _ = random_inputs(B, H, KV, T, D, config)
    blocks = as_blocks(k, ls)
    compute = ComputeConfig(attention_query_chunk=T)
    span, = nsa_attention._spans(T, 0, 0, config, T)
    with exact_block_scores():
        _, _, idx = nsa_attention._chunk(span, q, k_cmp, v_cmp, blocks, as_blocks(v, ls), k_win, v_win, config,
                                                compute).forward()
    G = H // KV
    for t in range(T):
        own = t // ls
        for kv in range(KV):
            score = torch.zeros(own + 1, dtype=torch.float64)
            if own >= 2:
                for h in range(kv * G, (kv + 1) * G):
                    best = torch.stack([(k[0, kv, j * ls:(j + 1) * ls] @ q[0, h, t]).max() for j in range(own - 1)])
                    score[: own - 1] += (best * D**-0.5).softmax(-1)
            free = sorted(range(1, max(own - 1, 1)), key=lambda j: -score[j])[: n - 3]
            want = sorted({0, own, max(own - 1, 0), *free})
            got = sorted(j for j in idx[0, kv, t].tolist() if j < blocks.shape[2])
            assert got == want, (t, kv)


def test_exact_block_scores_are_causal():
    config = nsa_config(nsa_num_selected=5)
    inputs = random_inputs(1, 4, 2, 90, 8, config)
    compute = ComputeConfig(attention_query_chunk=24)
    with exact_block_scores():
        base = sparse_attention(*inputs, config, compute=compute)
        for t in (47, 79, 81, 85):  # queries from n l' = 80 on choose blocks
            changed = [x.clone() for x in inputs]
            for i in (0, 3, 4, 5, 6):  # q and the token-level keys/values after t
                changed[i][:, :, t + 1:] = torch.randn_like(changed[i][:, :, t + 1:])
            out = sparse_attention(*changed, config, compute=compute)
            torch.testing.assert_close(out[:, :, : t + 1], base[:, :, : t + 1], **EXACT)
    assert not torch.equal(sparse_attention(*inputs, config, compute=compute), base)  # the scores chose other blocks


# ---- causality ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("separate,compressor", [(True, "mlp"), (False, "mlp"), (True, "mean"), (False, "mean")])
def test_causality_at_block_boundaries(separate, compressor):
    config = nsa_config(nsa_separate_kv=separate, nsa_compressor=compressor)
    compute = ComputeConfig(attention_query_chunk=24)
    l, d, ls, w = config.nsa_block_size, config.nsa_stride, config.nsa_select_block_size, config.nsa_window
    layer, rope = make_layer(config, compute=compute)
    T = 5 * ls + 7
    x = torch.randn(1, T, config.dim, dtype=torch.float64)
    base = run_layer(layer, rope, x)
    for t in sorted({0, l - 2, l - 1, l, 3 * d - 1, 5 * d - 1, ls - 1, ls, 2 * ls - 1, 3 * ls - 1, 3 * ls,
                     w - 1, w, T - 2}):
        x2 = x.clone()
        x2[:, t + 1:] = torch.randn_like(x2[:, t + 1:])
        out = run_layer(layer, rope, x2)
        torch.testing.assert_close(out[:, : t + 1], base[:, : t + 1], **EXACT, msg=f"leak into position <= {t}")
        assert (out[:, t + 1:] - base[:, t + 1:]).abs().amax() > 1e-6


def test_model_causality_and_generate():
    config = nsa_config(n_layers=2)
    model = Transformer(config).to(torch.float64)
    ids = torch.randint(0, config.vocab_size, (1, 60))
    base = model(ids).logits
    for t in (6, 7, 15, 16, 31, 47):
        ids2 = ids.clone()
        ids2[:, t + 1:] = (ids2[:, t + 1:] + 1) % config.vocab_size
        torch.testing.assert_close(model(ids2).logits[:, : t + 1], base[:, : t + 1], **EXACT)
    out = model.generate(ids[:, :20], max_new_tokens=25, temperature=0)  # KV-cache path: greedy == argmax of prefill
    with torch.no_grad():
        logits = model(out[:, :-1]).logits
    assert torch.equal(logits[:, 19:].argmax(-1), out[:, 20:])


# ---- decoding with the cache ------------------------------------------------------------------------------------


@pytest.mark.parametrize("separate,compressor", [(True, "mlp"), (False, "mlp"), (True, "mean"), (False, "mean")])
def test_decode_equals_prefill(separate, compressor):
    config = nsa_config(nsa_separate_kv=separate, nsa_compressor=compressor)
    compute = ComputeConfig(attention_query_chunk=16)
    layer, rope = make_layer(config, compute=compute)
    T = 200  # beyond w + REWIND = 96 (the window and compression rings wrap) and several compressed / selection blocks
    x = torch.randn(2, T, config.dim, dtype=torch.float64)
    full = run_layer(layer, rope, x)
    layer.setup_cache(2, T, torch.float64, "cpu")
    with torch.no_grad():
        # a 5-token prompt (no complete block yet), a 30-token continuation, then one token at a time
        steps = [(0, 5), (5, 35)] + [(t, t + 1) for t in range(35, T)]
        out = torch.cat([run_layer(layer, rope, x[:, a:b], start_pos=a) for a, b in steps], dim=1)
    torch.testing.assert_close(out, full, **F64)
    assert "cache" not in str(list(layer.state_dict()))
    layer.clear_cache()
    assert layer.cache is None


def test_cache_errors():
    config = nsa_config()
    layer, rope = make_layer(config)
    x = torch.randn(1, 4, config.dim, dtype=torch.float64)
    with pytest.raises(RuntimeError, match="setup_cache"):
        run_layer(layer, rope, x, start_pos=0)
    layer.setup_cache(1, 6, torch.float64, "cpu")
    with pytest.raises(ValueError, match="do not fit"):
        run_layer(layer, rope, x, start_pos=4)


# ---- gradients ------------------------------------------------------------------------------------------------------


def test_gradcheck_layer_all_blocks_selected():
    """Whole layer; n >= number of selection blocks, so the top-n set cannot flip under finite differences. No
    QK-norm: layers.RMSNorm computes in float32, too coarse for finite differences."""
    config = nsa_config(dim=8, n_heads=4, n_kv_heads=2, head_dim=4, qk_norm=False, nsa_block_size=4,
                        nsa_stride=2, nsa_select_block_size=8, nsa_num_selected=3, nsa_window=5)
    layer = NativeSparseAttention(config, ComputeConfig(attention_query_chunk=7)).to(torch.float64)
    layer.init_weights()
    rope = RotaryEmbedding(config.head_dim, config.rope_theta, 64)
    T = 20  # queries 0..2 see no compressed block
    cos, sin = rope(T, 0, torch.device("cpu"))
    x = torch.randn(1, T, config.dim, dtype=torch.float64, requires_grad=True)
    pos = torch.randn_like(layer.k_compress.pos, requires_grad=True)
    bias = torch.randn_like(layer.branch_gate.bias, requires_grad=True)

    def f(x, pos, bias):
        params = {"k_compress.pos": pos, "branch_gate.bias": bias}
        return torch.func.functional_call(layer, params, (x, cos, sin))

    assert torch.autograd.gradcheck(f, (x, pos, bias), fast_mode=True)


@pytest.mark.parametrize("small_tile_cost", [0.0, 1e9])  # force R = 16, then R = 32
def test_tile_plan_structure(monkeypatch, small_tile_cost):
    """Every (query, past block) pair sits in exactly one tile row, of its own query, in a tile of its own block;
    own-block and unused slots (idx >= the own block) are in none; tiles are as few as per-block packing allows
    (sum of ceil(pairs / R)); padding rows read the dummy query B*KV*Q."""
    monkeypatch.setattr(torch_path, "_SMALL_TILE_COST", small_tile_cost)
    B, KV, Q, n, n_blocks = 2, 2, 40, 3, 9
    idx = torch.stack([torch.randperm(n_blocks)[:n] for _ in range(B * KV * Q)]).view(B, KV, Q, n)
    current = torch.randint(0, n_blocks, (Q,))
    plan = torch_path.tile_plan(idx, current[None], n_blocks)
    R = plan.rows_per_tile
    assert plan.rows_per_tile == (16 if small_tile_cost == 0.0 else 32)
    query = torch.arange(B * KV * Q).view(B, KV, Q, 1).expand_as(idx)
    block = (torch.arange(B * KV).view(B, KV, 1, 1) * n_blocks + idx)
    past = idx < current[:, None]
    expected = sorted(zip(query[past].tolist(), block[past].tolist(), strict=True))
    real = plan.query_of_row < B * KV * Q
    rows = torch.arange(plan.query_of_row.numel())[real]
    got = sorted(zip(plan.query_of_row[real].tolist(), plan.tile_block[rows // R].tolist(), strict=True))
    assert got == expected
    counts = torch.bincount(block[past], minlength=B * KV * n_blocks)
    assert plan.tile_block.numel() == int(((counts + R - 1) // R).sum())


def dense_selected(q, k, v, idx, q_start, ls):
    """Naive selection branch: q (B, KV, Q, G, D), k/v (B, KV, S, D), each query over the keys of its blocks idx
    (B, KV, Q, n) that are not after it (slots beyond its own block unused), through an explicit (Q, S) mask."""
    B, KV, Q, G, D = q.shape
    S = k.shape[2]
    pos = torch.arange(q_start, q_start + Q)
    key_block = torch.arange(S) // ls
    chosen = (key_block[None, None, None, :, None] == idx[:, :, :, None, :]).any(-1)  # (B, KV, Q, S)
    own = (pos // ls)[:, None]
    allowed = chosen & (key_block <= own) & (torch.arange(S) <= pos[:, None])  # (B, KV, Q, S)
    logits = torch.einsum("bkqgd,bksd->bkqgs", q, k) * D**-0.5
    p = logits.masked_fill(~allowed[:, :, :, None], -math.inf).softmax(-1)
    return torch.einsum("bkqgs,bksd->bkqgd", p, v)


def head_major(x: torch.Tensor) -> torch.Tensor:
    """Query-major (B, KV, Q, G, D) -> the selection branches' head-major rows (B, KV, G*Q, D)."""
    B, KV, Q, G, D = x.shape
    return x.transpose(2, 3).reshape(B, KV, G * Q, D)


def distinct_selection(B, KV, Q, q_start, n_blocks, ls, n):
    """Random top-n-like indices (B, KV, Q, n): n distinct blocks per query, its own block among them, blocks after
    it replaced by the unused-slot value n_blocks."""
    own = torch.arange(q_start, q_start + Q) // ls
    rows = []
    for i in range(B * KV * Q):
        o = own[i % Q].item()
        rows.append([o] + [b for b in torch.randperm(n_blocks).tolist() if b != o][: n - 1])
    idx = torch.tensor(rows).view(B, KV, Q, n)
    return torch.where(idx > own[:, None], n_blocks, idx)


@pytest.mark.parametrize("impl,small_tile_cost", [("fused", 0.0), ("fused", 1e9), ("explicit", 0.0),
                                                  ("explicit", 1e9),
                                                  pytest.param("triton", 0.0, marks=pytest.mark.slow)])
def test_selection_branch_matches_dense_fixed_indices(monkeypatch, impl, small_tile_cost):
    """The selection branch against autograd through a dense masked attention, float64, fixed random indices with
    unused slots, chunks that start inside a block. `Selection` (own block dense, past blocks in tiles, partial
    results merged by lse, the backward from the merged output and lse) with both tile sizes on the fused CPU and
    explicit paths; `nsa.triton_path.TritonSelection` in Triton's interpreter (one sequence: the interpreter runs each
    program in Python; the two KV heads still offset every index)."""
    if impl == "triton":
        pytest.importorskip("triton")
    monkeypatch.setattr(torch_path, "_SMALL_TILE_COST", small_tile_cost)
    B, KV, G, Q, D, S, ls, n = 1 if impl == "triton" else 2, 2, 3, 37, 8, 192, 16, 4
    for q_start in (0, 5, S - Q):
        q = torch.randn(B, KV, Q, G, D, dtype=torch.float64, requires_grad=True)
        k, v = (torch.randn(B, KV, S, D, dtype=torch.float64, requires_grad=True) for _ in range(2))
        idx = distinct_selection(B, KV, Q, q_start, S // ls, ls, n)
        ref = dense_selected(q, k, v, idx, q_start, ls)
        grad = torch.randn_like(ref)
        ref_grads = torch.autograd.grad(ref, (q, k, v), grad)
        with explicit_attention() if impl == "explicit" else contextlib.nullcontext():
            blocks = [as_blocks(t.detach(), ls) for t in (k, v)]
            grad_blocks = [torch.zeros_like(b) for b in blocks]
            if impl == "triton":
                from nsa.triton_path import BlockTable, TritonSelection

                table = BlockTable.uniform(q_start, Q, ls, q.device)
                sel = TritonSelection(head_major(q.detach()), *(b.flatten(2, 3) for b in blocks), table, idx, q_start,
                                      D**-0.5)
                grads = [g.flatten(2, 3) for g in grad_blocks]
            else:
                own = torch_path.OwnBlocks.uniform(q_start, Q, ls, q.device)
                sel, grads = torch_path.Selection(head_major(q.detach()), *blocks, idx, own, D**-0.5), grad_blocks
            out, lse = sel.forward()
            dq = sel.backward(head_major(grad), out, lse, *grads)
        torch.testing.assert_close(out, head_major(ref), **F64)
        torch.testing.assert_close(dq, head_major(ref_grads[0]), **F64)
        for g, ref_g in zip(grad_blocks, ref_grads[1:], strict=True):
            torch.testing.assert_close(g.flatten(2, 3)[:, :, :S], ref_g, **F64)


@pytest.mark.parametrize("explicit", [False, True])
def test_attend_backward_is_a_share_of_the_larger_attention(explicit):
    """attend over two key sets merged through their lse equals attention over the union; attend_backward given
    the union's output and lse returns each set's share of the union's gradients (float64)."""
    q = torch.randn(2, 3, 7, 5, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(2, 3, 11, 5, dtype=torch.float64, requires_grad=True) for _ in range(2))
    mask = additive_mask(torch.rand(7, 11) > 0.3, torch.float64)
    mask[:, 0] = 0.0  # every row sees a key in both parts
    mask[:, 6] = 0.0
    ref = torch.softmax(q @ k.transpose(-1, -2) * 0.5 + mask, -1) @ v
    grad = torch.randn_like(ref)
    ref_grads = torch.autograd.grad(ref, (q, k, v), grad)
    with explicit_attention() if explicit else contextlib.nullcontext():
        parts = [attend(q.detach(), k[:, :, s].detach(), v[:, :, s].detach(), mask[:, s], 0.5)
                 for s in (slice(0, 6), slice(6, 11))]
        lse = torch.logsumexp(torch.stack([p[1] for p in parts]), 0)
        out = sum(o * torch.exp(part_lse - lse)[..., None] for o, part_lse in parts)
        torch.testing.assert_close(out, ref, **F64)
        dq = torch.zeros_like(q)
        for s in (slice(0, 6), slice(6, 11)):
            dq_s, dk_s, dv_s = attend_backward(grad, q.detach(), k[:, :, s].detach(), v[:, :, s].detach(), out, lse,
                                               mask[:, s], 0.5)
            dq += dq_s
            torch.testing.assert_close(dk_s, ref_grads[1][:, :, s], **F64)
            torch.testing.assert_close(dv_s, ref_grads[2][:, :, s], **F64)
        torch.testing.assert_close(dq, ref_grads[0], **F64)


@pytest.mark.parametrize("window_rows", [1, 5, 128])
def test_window_pieces_and_explicit_path_match_naive(monkeypatch, window_rows):
    """Whole kernel against the brute-force reference with the window cut into pieces of 1, 5 or the whole chunk,
    on the fused CPU and the explicit (CUDA) paths, plus gradcheck of the explicit path's backward."""
    monkeypatch.setattr(torch_path, "_WINDOW_ROWS", window_rows)
    config, compute = nsa_config(nsa_window=12), ComputeConfig(attention_query_chunk=24)
    inputs = random_inputs(1, 4, 2, 90, 8, config)
    ref = naive_nsa(*inputs, config)
    torch.testing.assert_close(sparse_attention(*inputs, config, compute=compute), ref, **F64)
    with explicit_attention():
        torch.testing.assert_close(sparse_attention(*inputs, config, compute=compute), ref, **F64)
        small = nsa_config(nsa_num_selected=3, nsa_window=7)
        small_compute = ComputeConfig(attention_query_chunk=13)
        leaves = [t.requires_grad_() for t in random_inputs(1, 4, 2, 40, 4, small)]
        assert torch.autograd.gradcheck(lambda *x: sparse_attention(*x, small, compute=small_compute), leaves,
                                        fast_mode=True)


def test_gradcheck_sparse_attention_top_n():
    """The custom backward (chunk-wise recomputation, gradients added in place) of all eight inputs, with top-n
    really choosing (n=3 of up to 6 blocks) and chunks that cut selection and compression blocks."""
    config = nsa_config(nsa_num_selected=3, nsa_window=12)
    compute = ComputeConfig(attention_query_chunk=13)
    inputs = [t.requires_grad_() for t in random_inputs(1, 4, 2, 90, 4, config)]
    assert torch.autograd.gradcheck(lambda *x: sparse_attention(*x, config, compute=compute), inputs, fast_mode=True)


# ---- the Triton kernels (nsa/triton_path.py), in Triton's interpreter without a GPU ---------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("H,KV", [(2, 2), (4, 2), (8, 2), (8, 1), (16, 1)])  # GQA ratios 1, 2, 4, 8, 16
def test_triton_matches_naive(H, KV):
    """sparse_attention with all three branches on the Triton kernels against the brute-force reference
    (float64, top-n really choosing, chunks cutting blocks, window and compression ranges crossing chunks)."""
    pytest.importorskip("triton")
    config = nsa_config()
    compute = ComputeConfig(attention_query_chunk=24)
    inputs = random_inputs(2, H, KV, 90, 8, config)
    with triton_kernels():
        torch.testing.assert_close(sparse_attention(*inputs, config, compute=compute), naive_nsa(*inputs, config),
                                   **F64)


class _HostReads(TorchDispatchMode):
    """Counts operators that read a tensor's value back to the host (`.item()`, `.tolist()`, `bool(t)`), and keeps
    the element count of the largest tensor an operator made (not one it wrote in place)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func is torch.ops.aten._local_scalar_dense.default
        out = func(*args, **(kwargs or {}))
        for t in () if func._schema.is_mutable else out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


@pytest.mark.slow
def test_triton_launches_do_not_grow_with_length(monkeypatch):
    """On the Triton kernels a layer's attention is one chunk whatever T: forward + backward launch the same kernels
    the same number of times at T = 100 and T = 300 (query chunk 16, where chunks would launch 7 and 19 times as
    many), and no operator reads a value back to the host (no sync between launches on a GPU)."""
    pytest.importorskip("triton")
    from nsa import triton_kernels as kernels

    launches: dict[int, list[str]] = {}
    launch = kernels.launch

    def counted(kernel: str, *args, **kwargs) -> None:
        launches[T].append(kernel)
        launch(kernel, *args, **kwargs)

    monkeypatch.setattr(kernels, "launch", counted)
    config = nsa_config()
    for T in (100, 300):
        launches[T] = []
        leaves = [t.requires_grad_() for t in random_inputs(1, 4, 2, T, 8, config)]
        with triton_kernels(), _HostReads() as reads:
            sparse_attention(*leaves, config, compute=ComputeConfig(attention_query_chunk=16)).sum().backward()
        assert reads.count == 0, T
    assert sorted(launches[100]) == sorted(launches[300]), launches
    assert len(launches[100]) == 13, launches  # forward: 4 (compression, top-n, selection, window); backward: 3 each


@pytest.mark.slow
def test_triton_forward_without_gradients_runs_in_chunks(monkeypatch):
    """Without gradients (grad mode off, even for inputs that require them) the Triton path runs eight query chunks
    of at least attention_query_chunk queries, gating each chunk's branch outputs before the next: no tensor of the
    three branch outputs of all T queries (3 x q's size, 3 GiB for a 4B layer's 131k prefill) is made, nothing is
    read back to the host, and the output is the one-chunk training forward's (float64, to rounding)."""
    pytest.importorskip("triton")
    config, compute = nsa_config(), ComputeConfig(attention_query_chunk=8)
    leaves = [t.requires_grad_() for t in random_inputs(1, 4, 2, 160, 8, config)]
    spans, real = [], nsa_attention._spans
    monkeypatch.setattr(nsa_attention, "_spans", lambda *args: spans.append(real(*args)) or spans[-1])
    with triton_kernels():
        whole = sparse_attention(*leaves, config, compute=compute)
        with torch.no_grad(), _HostReads() as watch:
            chunked = sparse_attention(*leaves, config, compute=compute)
    assert [len(s) for s in spans] == [1, 8]  # the training forward's one chunk, then 8 chunks of 20 queries
    assert watch.largest < 2 * leaves[0].numel() and watch.count == 0, (watch.largest, watch.count)
    torch.testing.assert_close(chunked, whole.detach(), rtol=1e-12, atol=1e-12)


@pytest.mark.slow
def test_triton_gradcheck():
    """gradcheck of all inputs of sparse_attention through the Triton kernels' backward (the selection's
    block-centric kernel: dK, dV and each pair's share of dQ; the range kernels), top-n choosing 3 of up to 4 blocks,
    chunks cutting blocks."""
    pytest.importorskip("triton")
    config = nsa_config(nsa_num_selected=3, nsa_window=12)
    compute = ComputeConfig(attention_query_chunk=13)
    leaves = [t.requires_grad_() for t in random_inputs(1, 4, 2, 56, 4, config)]
    with triton_kernels():
        assert torch.autograd.gradcheck(lambda *x: sparse_attention(*x, config, compute=compute), leaves,
                                        fast_mode=True)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["window", "compression"])
def test_triton_range_attention_matches_dense(kind):
    """`nsa.triton_path.RangeAttention` (each query one contiguous key range) against autograd through a dense masked
    attention, float64: window-like ranges (the last 40 keys, shifted by 80) and compression-like ones (a prefix
    growing by 3 keys every 2 queries), G = 3 heads, rows and keys not multiples of the kernels' 64-blocks."""
    pytest.importorskip("triton")
    from nsa.triton_path import RangeAttention

    B, KV, G, Q, D, S = 2, 2, 3, 150, 8, 230
    i = torch.arange(Q)
    if kind == "window":
        hi = i + 81
        lo = (hi - 40).clamp(min=0)
    else:
        hi, lo = ((i * 3) // 2 + 1).clamp(max=S), torch.zeros_like(i)
    q = torch.randn(B, KV, G * Q, D, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(B, KV, S, D, dtype=torch.float64, requires_grad=True) for _ in range(2))
    pos = torch.arange(S)
    allowed = ((pos >= lo[:, None]) & (pos < hi[:, None])).repeat(G, 1)  # (G*Q, S), head-major rows
    logits = (q @ k.transpose(-1, -2) * D**-0.5).masked_fill(~allowed, -math.inf)
    ref, ref_lse = logits.softmax(-1) @ v, logits.logsumexp(-1)
    grad = torch.randn_like(ref)
    ref_grads = torch.autograd.grad(ref, (q, k, v), grad)
    attention = RangeAttention(q.detach(), k.detach(), v.detach(), lo, hi, D**-0.5)
    out, lse = attention.forward()
    for got, expected in zip((out, lse, *attention.backward(grad, out, lse)), (ref, ref_lse.detach(), *ref_grads),
                             strict=True):
        torch.testing.assert_close(got, expected, **F64)


def reference_top_blocks(importance: torch.Tensor, q_pos: torch.Tensor, ls: int, n: int, no_slot: int) -> list:
    """nsa/reference.py's rule on importance (B, KV, Q, Ns): block 0 and the query's own and previous blocks first,
    then the rest of the blocks up to its own by descending score, ties to the lower block; its first n blocks as a
    sorted list per (b, kv, query), padded with no_slot."""
    chosen = []
    for b, kv, i in itertools.product(*map(range, importance.shape[:3])):
        own = int(q_pos[i]) // ls
        score = {j: math.inf if j in (0, own, own - 1) else float(importance[b, kv, i, j]) for j in range(own + 1)}
        top = sorted(score, key=lambda j: (-score[j], j))[:n]
        chosen.append(sorted(top) + [no_slot] * (n - len(top)))
    return chosen


@pytest.mark.parametrize("l,d,ls,n,ties", [(8, 4, 16, 4, False), (32, 16, 64, 5, False), (16, 16, 16, 3, False),
                                            (4, 4, 8, 16, False), (64, 16, 64, 8, False), (8, 4, 16, 4, True),
                                            (32, 16, 64, 5, True),
                                            (4, 4, 8, 20, False)])  # n above a tile of blocks
def test_triton_top_blocks_match_the_reference_rule(l, d, ls, n, ties):
    """`nsa.triton_path.select_top_blocks` (the importance recomputed from the lse, pooled by a tile product with
    Eq. 9's weights and merged into a running top-n, nothing of size Q x Ns in memory) chooses the blocks
    nsa/reference.py's rule chooses from the explicit probabilities pooled by `pool_to_selection_blocks`, float64;
    queries from before the first complete block to many blocks on, n above and below the blocks that exist. With
    ties (q = 0: uniform probabilities, equal scores for whole blocks) the lower blocks win, as in the reference."""
    pytest.importorskip("triton")
    from nsa.triton_path import TopNRanges, select_top_blocks

    B, KV, G, D, q_start, Q = 1, 2, 3, 8, 37, 150
    T = q_start + Q
    n_cmp, n_select = num_compressed_blocks(T, l, d), (T - 1) // ls + 1
    pos = torch.arange(q_start, q_start + Q)
    n_visible = ((pos - l + 1).div(d, rounding_mode="floor") + 1).clamp(min=0)
    q = torch.zeros(B, KV, G * Q, D, dtype=torch.float64) if ties else torch.randn(B, KV, G * Q, D,
                                                                                    dtype=torch.float64)
    k = torch.randn(B, KV, n_cmp, D, dtype=torch.float64)
    visible = (torch.arange(n_cmp) < n_visible[:, None]).repeat(G, 1)  # (G*Q, Nc)
    logits = q @ k.transpose(-1, -2) * D**-0.5
    lse = logits.masked_fill(~visible, -math.inf).logsumexp(-1)
    p = torch.exp(logits - lse[..., None]).masked_fill(~visible, 0.0).view(B, KV, G, Q, n_cmp).sum(2)
    expected = reference_top_blocks(pool_to_selection_blocks(p, l, d, ls, n_select), pos, ls, n, n_select)
    got = select_top_blocks(q, k, lse, TopNRanges.uniform(n_visible, q_start, ls), (l, d, ls), n_select, n, n_select,
                            D**-0.5)
    assert got.sort(-1).values.flatten(0, 2).tolist() == expected


@pytest.mark.slow
def test_triton_selection_half_precision():
    """The kernels' low-precision path (half inputs and outputs, probabilities cast to half before P @ V, float32
    accumulation and lse) at the 4B block geometry (l' = 64, D = 64 here, G = 4), against the float32 `Selection`:
    errors within 2e-3, the size of half rounding on O(1) values. float16 stands in for bfloat16, which Triton's
    interpreter cannot compute (numpy has no bfloat16); both take the same code path in the kernels."""
    pytest.importorskip("triton")
    from nsa.triton_path import BlockTable, TritonSelection

    B, KV, G, Q, D, S, ls, n = 1, 2, 4, 40, 64, 256, 64, 4
    q = torch.randn(B, KV, Q, G, D)
    k, v = (torch.randn(B, KV, S, D) for _ in range(2))
    idx = distinct_selection(B, KV, Q, S - Q, S // ls, ls, n)
    results = []
    for dtype in (torch.float32, torch.float16):
        blocks = [as_blocks(t.to(dtype), ls) for t in (k, v)]
        grad_blocks = [torch.zeros_like(b) for b in blocks]
        if dtype == torch.float32:
            own = torch_path.OwnBlocks.uniform(S - Q, Q, ls, q.device)
            sel, grads = torch_path.Selection(head_major(q), *blocks, idx, own, D**-0.5), grad_blocks
        else:
            sel = TritonSelection(head_major(q.to(dtype)), *(b.flatten(2, 3) for b in blocks),
                                  BlockTable.uniform(S - Q, Q, ls, q.device), idx, S - Q, D**-0.5)
            grads = [g.flatten(2, 3) for g in grad_blocks]
        out, lse = sel.forward()
        dq = sel.backward(torch.ones_like(out), out, lse, *grads)
        results.append([t.float() for t in (out, lse, dq, *grad_blocks)])
        assert (out.dtype, lse.dtype, dq.dtype) == (dtype, torch.float32, dtype)
    for got, ref in zip(*reversed(results), strict=True):
        torch.testing.assert_close(got, ref, rtol=0, atol=2e-3)


@pytest.mark.slow
def test_triton_decode_equals_prefill():
    """The cache path (q_start > 0, the selection reading the whole preallocated cache) on the Triton kernels."""
    pytest.importorskip("triton")
    config = nsa_config()
    compute = ComputeConfig(attention_query_chunk=16)
    layer, rope = make_layer(config, compute=compute)
    x = torch.randn(2, 70, config.dim, dtype=torch.float64)
    with torch.no_grad(), triton_kernels():
        full = run_layer(layer, rope, x)
        layer.setup_cache(2, 70, torch.float64, "cpu")
        steps = [(0, 5), (5, 35)] + [(t, t + 1) for t in range(35, 70)]
        out = torch.cat([run_layer(layer, rope, x[:, a:b], start_pos=a) for a, b in steps], dim=1)
    torch.testing.assert_close(out, full, **F64)
    torch.testing.assert_close(full, run_layer(layer, rope, x), **F64)  # the same as the CPU path


_COMPILE_FOR_GPUS = """
import sys
import triton, triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from nsa import triton_kernels as nt
part, parts = int(sys.argv[1]), int(sys.argv[2])  # this process compiles every parts-th build from the part-th
builds = []
types = dict(LSE="*fp32", DELTA="*fp32", PTR="*i64", PAIR="*i64", UNION="*i32", COUNT="*i32", DO_ROW="*i64",
             N_SEL="i32", IDX="*i64", L_SEL="i32", NO_SLOT="i32", LO="*i32", HI="*i32", QA="*i32", QB="*i32",
             W="*fp32", q_start="i32", NQ="i32", NR="i32", NT="i32", U_MAX="i32", S="i32", NB="i32", NC="i32",
             NS="i32", scale="fp32", START="*i32", END="*i32", C_LO="*i32", C_HI="*i32", BLOCK0="*i32", OWN="*i32",
             KV="i32", START_STRIDE="i32", LO_STRIDE="i32", QA_STRIDE="i32", TABLE_STRIDE="i32")
for D in (64, 128):
    common = dict(G=4, D=D, L_SEL=64, BLOCK_D=D, ACC=tl.float32)
    ranged = dict(D=D, BLOCK_M=64, BLOCK_N=64, BLOCK_D=D, ACC=tl.float32)
    for fn, consts in ((nt.selection_forward_kernel, dict(common, QB=16, BLOCK_R=64, BLOCK_N=16)),
                       (nt.selection_dq_kernel, dict(common, QB=16, BLOCK_R=64, BLOCK_N=16, ADD=True)),
                       (nt.selection_dkdv_kernel, dict(common, QB=16, BLOCK_R=64)),
                       (nt.delta_kernel, dict(D=D, BLOCK_M=64, BLOCK_D=D, ACC=tl.float32)),
                       (nt.range_forward_kernel, ranged), (nt.range_dq_kernel, dict(ranged, ADD=True)),
                       (nt.range_dkdv_kernel, dict(ranged, G=4)),
                       (nt.selection_topn_kernel, dict(G=4, D=D, PER_SEL=4, FIRST=-1, WIDTH=5, J_STEP=15, N_SEL=16,
                                                        BLOCK_M=64, BLOCK_J=16, BLOCK_N=16, BLOCK_C=64, BLOCK_D=D,
                                                        ACC=tl.float32))):
        # bf16 for the H100 (training's dtype); float32 at D = 128, the largest tiles, for the A100 with the
        # 1 pipeline stage nsa.triton_path._precision gives it
        for dtype, arch, stages in (("bf16", 90, 3), ("fp32", 80, 1))[: 2 if D == 128 else 1]:
            builds.append((fn, consts, dtype, arch, stages))
builds.sort(key=lambda build: build[2] != "fp32")  # float32's builds take the longest: dealt out first
for fn, consts, dtype, arch, stages in builds[part::parts]:
    sig = {a: "constexpr" if a in consts else types.get(a, "*" + dtype) for a in fn.arg_names}
    kernel = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts), target=GPUTarget("cuda", arch, 32),
                            options={"num_stages": stages})
    assert kernel.asm["cubin"] and kernel.metadata.shared <= 164 * 1024, (fn, dtype, kernel.metadata.shared)
"""


def run_without_interpreter(args: list[str]) -> subprocess.Popen:
    """python args in a subprocess at the repository root whose Triton compiles for real (no TRITON_INTERPRET),
    started; `.communicate()` waits for it."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"  # Triton 3.9 warns when unset
    return subprocess.Popen([sys.executable, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, cwd=Path(__file__).resolve().parent.parent)


@pytest.mark.slow
def test_triton_kernels_compile_for_gpus():
    """Without a GPU the interpreter checks the kernels' arithmetic, not that they compile: build all eight with
    Triton's own compiler and ptxas (no device needed) in bf16 for sm_90 (H100) at D = 64 and 128, and in float32
    for sm_80 (A100) at D = 128, each within the A100's 164 KB of shared memory; G = 4, l' = 64, n = 16."""
    pytest.importorskip("triton")
    parts = 2  # compiling is single-threaded: one process per core of a 2-core machine
    procs = [run_without_interpreter(["-c", _COMPILE_FOR_GPUS, str(part), str(parts)]) for part in range(parts)]
    for proc in procs:
        _, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, err[-3000:]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="runs the Triton kernels on a CUDA device")
def test_triton_kernels_on_gpu():
    """The real kernels on the GPU (this process runs them in the interpreter): tests/nsa_triton_gpu_check.py
    compares them with the PyTorch path on the same device, float32 and bfloat16, forward and all gradients."""
    pytest.importorskip("triton")
    proc = run_without_interpreter(["tests/nsa_triton_gpu_check.py"])
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, out[-3000:] + err[-3000:]


# ---- memory ----------------------------------------------------------------------------------------------------------


def peak_bound_bytes(config: ModelConfig, chunk: int, B: int, T: int, elem: int, triton: bool = False
                     ) -> tuple[int, int]:
    """(peak bound, largest-tensor bound) in bytes from nsa/attention.py's docstring formula, constants 8 and 6;
    `chunk`: the query chunk; `triton`: the Triton kernels' path, one chunk of all T queries whose chunk part is
    the selection's block lists (about 32 bytes per query, KV head and slot)."""
    H, KV, D, Q = config.n_heads, config.n_kv_heads, config.head_dim, min(chunk, T)
    n_sets = 3 if config.nsa_separate_kv else 1
    n_cmp = num_compressed_blocks(T, config.nsa_block_size, config.nsa_stride)
    linear = T * B * (8 * (H + 2 * n_sets * KV) * D + 5 * H + 2 * config.dim)
    n_sel = config.nsa_num_selected * config.nsa_select_block_size
    chunk = B * Q * (6 * H * n_cmp + 6 * KV * n_sel * D + 6 * H * (Q + config.nsa_window - 1))
    if triton:
        chunk = B * T * KV * config.nsa_num_selected * 32 // elem  # idx, its pairs by block, each tile's union
    largest = B * Q * max(H * n_cmp, KV * n_sel * D, H * (Q + config.nsa_window - 1)) * 4  # float32 softmax
    return (linear + chunk) * elem, max(largest, T * B * max(3 * H, 3 * KV * D, config.dim) * elem)


def test_memory_tracker_16k():
    """One layer, forward + backward at T = 16k: peak within the docstring formula, no tensor as large as one
    head's (T, T/d) score matrix, and the peak grows linearly in T (compared with T = 4k). Paper block geometry
    (l=32, d=16, l'=64); n=4 and w=128 keep the CPU time low (the chunk term of the formula covers any n, w)."""
    config = nsa_config(dim=16, n_heads=2, n_kv_heads=1, head_dim=8, nsa_block_size=32, nsa_stride=16,
                        nsa_select_block_size=64, nsa_num_selected=4, nsa_window=128)
    layer, rope = make_layer(config, torch.float32, ComputeConfig(attention_query_chunk=512))
    peaks = {}
    for T in (4096, 16384):
        x = torch.randn(1, T, config.dim, requires_grad=True)
        cos, sin = rope(T, 0, x.device)
        with LiveBytesTracker() as tracker:
            layer(x, cos, sin).sum().backward()
        bound, largest = peak_bound_bytes(config, 512, 1, T, 4)
        assert tracker.peak <= bound, (T, tracker.peak, bound)
        assert tracker.largest <= largest
        peaks[T] = tracker.peak
    assert tracker.largest < 16384 * (16384 // 16) * 4 // 2  # under half of one head's (T, T/d) fp32 scores
    assert peaks[16384] < 4.5 * peaks[4096], peaks  # 4x the tokens: linear growth plus the (fixed) chunk part


@pytest.mark.slow
@pytest.mark.parametrize("path", ["fused", "triton"])
def test_memory_fake_4b_geometry_131k(path):
    """FakeTensorMode (no real memory): one 4B-geometry layer (dim 2560, 32 q heads, 8 KV heads, head_dim 128) at
    131,072 tokens in bfloat16, forward + backward, stays within the formula, on the fused CPU path and on the
    Triton kernels' path (the kernels are not launched on fake tensors; they allocate nothing but their outputs)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    if path == "triton":
        pytest.importorskip("triton")

    config = ModelConfig.from_preset("4B", attention_type="nsa", context_length=131072)
    T = 131072
    torch.set_default_dtype(torch.bfloat16)  # parameters in bfloat16 (the conftest fixture restores the default)
    with FakeTensorMode():
        layer = NativeSparseAttention(config, ComputeConfig(attention_query_chunk=2048))
        x = torch.randn(1, T, config.dim, dtype=torch.bfloat16, requires_grad=True)
        cos, sin = torch.randn(T, config.head_dim), torch.randn(T, config.head_dim)
        with triton_kernels() if path == "triton" else contextlib.nullcontext(), LiveBytesTracker() as tracker:
            layer(x, cos, sin).sum().backward()
    bound, largest = peak_bound_bytes(config, 2048, 1, T, 2, triton=path == "triton")
    assert tracker.peak <= bound, (tracker.peak, bound)
    assert tracker.largest <= largest
    score_matrix = config.n_heads * T * num_compressed_blocks(T, 32, 16) * 2  # (32, T, T/16) bf16: 64 GiB
    assert tracker.largest <= score_matrix // 16  # the largest: 2 GiB, a full-sequence tensor


# ---- training --------------------------------------------------------------------------------------------------------


def test_tiny_nsa_model_trains():
    config = nsa_config(n_layers=2)
    model = Transformer(config)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    ids = torch.randint(0, config.vocab_size, (2, 16)).repeat(1, 6)  # (2, 96): a repeating pattern to learn
    losses = []
    for _ in range(30):
        loss = model(ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0], losses
    assert all(math.isfinite(v) for v in losses)


def test_the_benchmark_s_u_counts_the_blocks_a_tile_of_queries_walks():
    """benchmarks/bench_nsa_gpu.py's U (the cost model's input): a tile's distinct selected blocks over n, read
    from the Triton path's own union: 1 when a tile's queries agree, qb when they share none."""
    pytest.importorskip("triton")
    import runpy

    from nsa.triton_path import BlockTable, TritonSelection, queries_per_tile

    bench = runpy.run_path(str(Path(__file__).resolve().parent.parent / "benchmarks" / "bench_nsa_gpu.py"))
    G, n, l_sel = 4, 2, 4
    qb = queries_per_tile(G)
    Q = qb  # one tile, every query in the last block (all blocks before it usable)
    q_start = 2 * qb * n * l_sel
    blocks = BlockTable.uniform(q_start, Q, l_sel, torch.device("cpu"))
    q = torch.randn(1, 1, G * Q, 8)
    kv = torch.randn(1, 1, q_start + Q, 8)
    agree = torch.tensor([0, 1]).expand(1, 1, Q, n)
    disjoint = torch.arange(Q * n).view(1, 1, Q, n)
    with bench["union_sizes"]() as sizes:
        for idx in (agree, disjoint):
            TritonSelection(q, kv, kv, blocks, idx.contiguous(), q_start, 1.0)
    assert sizes == [1.0, float(qb)]
