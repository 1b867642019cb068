"""Packed documents: each token attends only within its own document (`doc_start`, modeling/documents.py). A packed
sequence gives, for every document, the logits, loss and gradients of that document run alone (float64; RoPE's
scores depend on relative positions only, so the one difference is the rounding of its float32 tables at other
absolute positions: relative 2^-24 per entry, 1e-6 of the values' scale allowed); a future token never changes a
past output; no (T, T) tensor exists on the path (fake tensors at 32k)."""

from __future__ import annotations

import contextlib
import math

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from model import ModelConfig, Transformer
from modeling.documents import document_starts
from modeling.flash import document_attention, explicit_attention
from modeling.memtrack import LiveBytesTracker
from nsa.packing import document_blocks, document_windows

EOD = 1


def test_a_document_starts_at_the_end_of_document_id_before_it():
    ids = torch.tensor([[5, 6, EOD, 7, 8, 9, EOD, EOD, 4], [EOD, 3, 3, 3, 3, 3, 3, 3, 3]])
    assert document_starts(ids, EOD).tolist() == [[0, 0, 2, 2, 2, 2, 6, 7, 7], [0] * 9]


def naive_document_attention(q, k, v, starts):
    """Softmax over the allowed keys of an explicit (T, T) mask, float64: the oracle."""
    G, T = q.shape[1] // k.shape[1], q.shape[2]
    pos = torch.arange(T)
    allowed = (pos >= starts[:, :, None]) & (pos <= pos[:, None])  # (B, T, T)
    logits = q @ k.repeat_interleave(G, 1).transpose(-1, -2) / math.sqrt(q.shape[-1])
    return logits.masked_fill(~allowed[:, None], -math.inf).softmax(-1) @ v.repeat_interleave(G, 1)


@pytest.mark.parametrize("explicit", [False, True], ids=["fused CPU kernels", "explicit (as on CUDA)"])
@pytest.mark.parametrize("mask_bytes", [2**26, 600], ids=["one chunk", "many chunks"])
def test_document_attention_matches_an_explicit_mask(explicit, mask_bytes, monkeypatch):
    import modeling.flash

    monkeypatch.setattr(modeling.flash, "_DOCUMENT_MASK_BYTES", mask_bytes)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, h, 37, 8, dtype=torch.float64, generator=g, requires_grad=True) for h in (4, 2, 2))
    starts = torch.tensor([[0] * 10 + [10] * 15 + [25] * 12, [0] * 3 + [3] * 30 + [33] * 4])
    with explicit_attention() if explicit else torch.enable_grad():
        out = document_attention(q, k, v, starts, 0, 8**-0.5)
    expected = naive_document_attention(q, k, v, starts)
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
    grad = torch.randn_like(out)
    for got, want in zip(torch.autograd.grad(out, (q, k, v), grad), torch.autograd.grad(expected, (q, k, v), grad),
                         strict=True):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def reference_varlen(q, k, v, cu_q, cu_k, max_q, max_k, *, scale, window_size, enable_gqa):
    """PyTorch's flash varlen kernel (CUDA only) by its documented contract: each [cu[i], cu[i + 1]) of the packed
    (N, heads, D) rows one sequence, causal for window (-1, 0), K/V heads shared by groups of query heads."""
    assert window_size == (-1, 0) and torch.equal(cu_q, cu_k) and cu_q.dtype == torch.int32
    outs = []
    for a, b in zip(cu_q[:-1].tolist(), cu_q[1:].tolist(), strict=True):
        assert 0 < b - a <= max_q == max_k
        qs, ks, vs = (x[a:b].transpose(0, 1) for x in (q, k, v))  # (heads, n, D)
        out = torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale,
                                                               enable_gqa=enable_gqa)
        outs.append(out.transpose(0, 1))
    return torch.cat(outs)  # (N, H, D)


def test_full_attention_runs_documents_as_varlen_sequences_where_the_kernel_is(monkeypatch):
    """Where PyTorch's flash varlen kernel runs (CUDA, half precision), full attention's document mask sends every
    document of every row as one sequence of a single call (`modeling.flash.packed_attention`): the same output and
    q, k, v gradients as `document_attention`, float64, GQA, rows split differently. The kernel is stood in for by
    its contract here (`reference_varlen`); gpu_check.py runs the real one."""
    import modeling.attention
    import modeling.flash
    from modeling.attention import FullAttention

    calls = []

    def varlen(*args, **kwargs):
        calls.append(args[3].tolist())
        return reference_varlen(*args, **kwargs)

    monkeypatch.setattr(modeling.flash, "varlen_attn", varlen)
    monkeypatch.setattr(modeling.attention, "varlen_ready", lambda q: True)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, h, 37, 8, dtype=torch.float64, generator=g, requires_grad=True) for h in (4, 2, 2))
    starts = torch.tensor([[0] * 10 + [10] * 15 + [25] * 12, [0] * 3 + [3] * 30 + [33] * 4])
    layer = FullAttention(ModelConfig.from_preset("tiny", n_heads=4, n_kv_heads=2, head_dim=8))
    out = layer.attend(q, k, v, 0, starts)
    assert calls == [[0, 10, 25, 37, 40, 70, 74]]  # both rows' documents in one call
    expected = document_attention(q, k, v, starts, 0, 8**-0.5)
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
    grad = torch.randn_like(out)
    for got, want in zip(torch.autograd.grad(out, (q, k, v), grad), torch.autograd.grad(expected, (q, k, v), grad),
                         strict=True):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="runs PyTorch's flash varlen kernel on CUDA")
def test_full_attention_on_the_varlen_kernel_on_cuda():
    """The real varlen kernel (bf16, 4B head geometry, three rows split differently, 4096 tokens) against
    `document_attention` in float32 on the same device: output and q, k, v gradients within bf16's relative error
    (norms, 1e-2). gpu_check.py's `documents` section runs it."""
    from modeling.attention import FullAttention
    from modeling.flash import varlen_ready

    g = torch.Generator(device="cuda").manual_seed(0)
    T = 4096
    q, k, v = (torch.randn(3, h, T, 128, device="cuda", generator=g) for h in (32, 8, 8))
    starts = torch.zeros(3, T, dtype=torch.long, device="cuda")
    starts[1, 1000:], starts[1, 3000:] = 1000, 3000
    starts[2] = torch.arange(T, device="cuda") // 7 * 7  # many short documents
    layer = FullAttention(ModelConfig.from_preset("4B"))
    low = [t.bfloat16().requires_grad_() for t in (q, k, v)]
    assert varlen_ready(low[0])
    out = layer.attend(*low, 0, starts)
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    expected = document_attention(*full, starts, 0, 128**-0.5)
    grad = torch.randn_like(expected)
    got = [out, *torch.autograd.grad(out, low, grad.bfloat16())]
    want = [expected, *torch.autograd.grad(expected, full, grad)]
    for a, b in zip(got, want, strict=True):
        assert ((a.float() - b).norm() / b.norm()).item() < 1e-2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="runs NSA's Triton kernels on CUDA")
def test_nsa_packed_documents_in_one_call_on_cuda(monkeypatch):
    """NSA on the real Triton kernels (float32, IEEE products): two rows split differently into documents of every
    kind, in one call (`_attend_packed`, the choice on CUDA) against the loop over documents on the same kernels:
    logits and parameter gradients within float32 rounding (norms, 1e-4). gpu_check.py's `documents` section runs
    it."""
    pytest.importorskip("triton")
    from nsa.layer import NativeSparseAttention

    torch.manual_seed(0)
    config = ModelConfig.from_preset("tiny", context_length=1024, attention_type="nsa", nsa_select_block_size=16)
    model = Transformer(config).cuda()
    rows = [packed(lengths, config.vocab_size, seed=i)[0] for i, lengths in enumerate(([300, 0, 5, 500, 150],
                                                                                       [700, 255]))]
    ids = torch.cat([row[:, :957] for row in rows]).cuda()
    starts = document_starts(ids, EOD)
    results = []
    for one_call in (True, False):
        if not one_call:
            monkeypatch.setattr(NativeSparseAttention, "_packed_blocks", lambda self, starts, q: None)
        out = model(ids, ids, doc_start=starts)
        out.loss.backward()
        results.append([out.logits.detach(), *(p.grad.clone() for p in model.parameters())])
        model.zero_grad()
    for a, b in zip(*results, strict=True):
        assert ((a - b).norm() / b.norm()).item() < 1e-4


def packed(lengths: list[int], vocab: int, seed: int = 0) -> tuple[torch.Tensor, list[tuple[int, int]]]:
    """A row of documents end to end, each but the first (a window that begins inside one) opened by the
    end-of-document id; and each document's (first, end) positions."""
    g = torch.Generator().manual_seed(seed)
    ids, spans = [], []
    for i, n in enumerate(lengths):
        body = torch.randint(2, vocab, (n,), generator=g).tolist()
        doc = body if i == 0 else [EOD, *body]
        spans.append((len(ids), len(ids) + len(doc)))
        ids += doc
    return torch.tensor([ids]), spans


BODIES = {"full": [11, 6, 23, 9, 17],  # tokens after each opening id
          # NSA (l = 8, d = 4, l' = 16, n = 4, w = 32): one-token documents (the id alone), documents shorter than
          # a compressed block, and two past n l' = 64 tokens, where top-n chooses and the window slides
          "nsa": [11, 0, 70, 5, 0, 0, 90, 3]}


@pytest.mark.parametrize("attention", ["full", "nsa"])
def test_a_packed_row_gives_each_document_what_it_gives_alone(attention):
    """Float64, documents not aligned to any block: logits, summed loss and gradients of the packed row equal those
    of each document alone (its own row, positions from 0)."""
    torch.manual_seed(0)
    model = Transformer(ModelConfig.from_preset("tiny", context_length=256, attention_type=attention)).double()
    ids, spans = packed(BODIES[attention], model.config.vocab_size)
    starts = document_starts(ids, EOD)
    labels = ids.clone()
    labels[0, [first for first, _ in spans[1:]]] = -100  # no document predicts the next one's opening id
    out = model(ids, labels, loss_normalizer=1.0, doc_start=starts)
    out.loss.backward()
    packed_grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()
    total, scale = 0.0, out.logits.abs().max().item()
    for first, end in spans:
        alone = model(ids[:, first:end], labels[:, first:end], loss_normalizer=1.0)
        total = total + alone.loss
        torch.testing.assert_close(out.logits[:, first:end], alone.logits, rtol=0, atol=1e-6 * scale)
    total.backward()
    torch.testing.assert_close(out.loss, total, rtol=1e-6, atol=0)
    for name, p in model.named_parameters():
        torch.testing.assert_close(packed_grads[name], p.grad, rtol=0, atol=1e-6 * p.grad.abs().max().item(), msg=name)
    unmasked = model(ids).logits  # without the mask a document reads the ones before it: the test can tell
    assert (unmasked[:, spans[2][0]:] - out.logits[:, spans[2][0]:]).abs().max() > 1e-3 * scale


@pytest.mark.parametrize("attention", ["full", "nsa"])
def test_a_future_token_never_changes_a_past_output(attention):
    torch.manual_seed(0)
    model = Transformer(ModelConfig.from_preset("tiny", context_length=128, attention_type=attention)).double().eval()
    ids, _ = packed([20, 15, 30], model.config.vocab_size)
    changed = ids.clone()
    changed[0, 40:] = (changed[0, 40:] + 5) % model.config.vocab_size
    with torch.no_grad():
        a = model(ids, doc_start=document_starts(ids, EOD)).logits
        b = model(changed, doc_start=document_starts(changed, EOD)).logits
    torch.testing.assert_close(a[:, :40], b[:, :40], rtol=0, atol=0)


@pytest.mark.slow
def test_no_square_tensor():
    """One layer's document attention at T = 32768 under fake tensors, forward and backward: no storage exceeds one
    chunk's mask (`_DOCUMENT_MASK_BYTES`), and the peak stays below a quarter of a (T, T) bool mask."""
    import modeling.flash

    T = 32768
    with FakeTensorMode():
        q = torch.empty(1, 4, T, 16, requires_grad=True)
        k, v = (torch.empty(1, 2, T, 16, requires_grad=True) for _ in range(2))
        starts = torch.zeros(1, T, dtype=torch.long)
        with LiveBytesTracker() as tracker:
            out = document_attention(q, k, v, starts, 0, 0.25)
            out.sum().backward()
    assert tracker.largest <= modeling.flash._DOCUMENT_MASK_BYTES, tracker.largest
    assert tracker.peak < T * T / 4, tracker.peak


def test_nsa_rows_of_different_documents_and_the_score_loss():
    """NSA, two rows packed differently (and one alike, run together with the first): each row's logits are those of
    the row alone; the selection-scoring loss of the batch is the mean over every choosing row of every document,
    the documents' own losses weighted by their rows."""
    from modeling.objective import Objective

    torch.manual_seed(0)
    model = Transformer(ModelConfig.from_preset("tiny", context_length=256, attention_type="nsa")).double()
    model.objective = Objective(nsa_score_loss_coef=1.0)
    a, spans_a = packed([80, 0, 30, 75], model.config.vocab_size, seed=1)
    b, spans_b = packed([100, 88], model.config.vocab_size, seed=2)
    b = b[:, : a.shape[1]]
    spans_b[-1] = (spans_b[-1][0], a.shape[1])
    ids = torch.cat([a, b, a])
    out = model(ids, ids, doc_start=document_starts(ids, EOD))
    scale = out.logits.abs().max().item()
    for row in range(3):
        alone = model(ids[row:row + 1], doc_start=document_starts(ids[row:row + 1], EOD))
        torch.testing.assert_close(out.logits[row:row + 1], alone.logits, rtol=0, atol=1e-6 * scale)
    first = 4 * 16  # n l': where top-n starts to choose
    weighted, rows = 0.0, 0
    for row_ids, spans in ((a, spans_a), (b, spans_b), (a, spans_a)):
        for s, e in spans:
            if e - s > first:
                weighted += model(row_ids[:, s:e], row_ids[:, s:e]).aux_loss * (e - s - first)
                rows += e - s - first
    torch.testing.assert_close(out.aux_loss, weighted / rows, rtol=1e-6, atol=0)  # RoPE tables: module docstring


def test_nsa_refuses_starts_that_do_not_split_documents():
    model = Transformer(ModelConfig.from_preset("tiny", attention_type="nsa"))
    ids = torch.randint(2, 64, (1, 40))
    sliding = (torch.arange(40) - 7).clamp(min=0)[None]  # a window, not documents
    with pytest.raises(ValueError, match="doc_start must split each row into documents"):
        model(ids, doc_start=sliding)


def test_train_and_eval_take_the_document_mask(data_dir, tmp_path):
    """train.py --document_mask: the first step's loss is the model's loss on the same batch with each row's document
    starts (and differs from the loss without them, the batch holding several documents); eval.py's loss task takes
    the same option; NSA refuses it up front."""
    import json

    import eval as eval_cli
    import train
    from text.shards import TokenLoader, prepare
    from text.tokenizer import Tokenizer

    tokenizer = Tokenizer(data_dir / "tokenizer.model")
    documents = [f"def f{i}(x):\n    return x * {i} + {i * i}\n" * (1 + i % 3) for i in range(400)]
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": text}) + "\n" for text in documents))
    short = tmp_path / "short"
    prepare([tmp_path / "docs.jsonl"], tokenizer, short, progress=False, validation_fraction=0.1)
    args = ["--model_size", "tiny", "--context_length", "512", "--batch_size", "2", "--max_steps", "1",
            "--sample_tokens", "0", "--data_dir", str(short)]
    first = train.main([*args, "--document_mask", "--out_dir", str(tmp_path / "run")])
    record = json.loads((tmp_path / "run" / "config.json").read_text())
    torch.manual_seed(0)
    model = Transformer(ModelConfig.from_dict(record["model"]))
    ids, labels = next(TokenLoader(short, 512, 2, 0, 1, 0))
    eod = tokenizer.eod_id
    assert (ids == eod).sum() >= 2  # documents to keep apart
    with torch.no_grad():
        masked = model(ids, labels, doc_start=document_starts(ids, eod)).loss.item()
        unmasked = model(ids, labels).loss.item()
    assert first["loss"] == pytest.approx(masked, rel=1e-5) and abs(masked - unmasked) > 1e-4
    results = eval_cli.main([str(tmp_path / "run" / "model"), "--tasks", "loss", "--document_mask", "--eval_tokens",
                             "1024", "--out_dir", str(tmp_path / "eval")])
    assert results["loss"]["tokens"] > 0
    nsa = train.main([*args, "--attention_type", "nsa", "--document_mask", "--out_dir", str(tmp_path / "nsa")])
    assert math.isfinite(nsa["loss"])
    results = eval_cli.main([str(tmp_path / "nsa" / "model"), "--tasks", "loss", "--document_mask", "--eval_tokens",
                             "1024", "--out_dir", str(tmp_path / "nsa_eval")])
    assert results["loss"]["tokens"] > 0


def test_bf16_under_autocast_keeps_forward_and_backward_consistent():
    """The explicit path (CUDA's) under a bf16 autocast, bf16 inputs, starts differing inside chunks: output and
    gradients within two bf16 roundings (2 x 2^-8, relative norm) of the float64 oracle, as without autocast (its
    logits stay float32, so backward rebuilds the probabilities forward used; bf16 logits in forward and float32
    ones in backward measured 0.9-1.1% here)."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, 512, 32, generator=g).bfloat16().requires_grad_() for h in (4, 2, 2))
    starts = torch.tensor([[0] * 100 + [100] * 212 + [312] * 200])
    exact = [t.detach().double().requires_grad_() for t in (q, k, v)]
    want = naive_document_attention(*exact, starts)
    grad = torch.randn(want.shape, generator=g, dtype=torch.float64)
    want_grads = torch.autograd.grad(want, exact, grad)
    with explicit_attention(), torch.autocast("cpu", dtype=torch.bfloat16):
        out = document_attention(q, k, v, starts, 0, 32**-0.5)
    grads = torch.autograd.grad(out, (q, k, v), grad.to(out.dtype))
    for got, expected in zip((out, *grads), (want, *want_grads), strict=True):
        assert (got.double() - expected).norm() <= 2 * 2**-8 * expected.norm()


def test_nsa_documents_take_no_more_memory_than_the_whole_row():
    """One NSA layer, forward and backward on real tensors, a row of 1024 tokens split into documents of every kind
    (one token, shorter than a block, past n l'): the peak of live bytes stays at or below the unmasked row's plus
    O(T) (the starts and the spans' bookkeeping)."""
    from modeling.config import ComputeConfig
    from nsa.layer import NativeSparseAttention

    config = ModelConfig.from_preset("tiny", context_length=1024, attention_type="nsa")
    torch.manual_seed(0)
    layer = NativeSparseAttention(config, ComputeConfig(attention_query_chunk=128))
    model = Transformer(config)
    ids, _ = packed([300, 0, 0, 5, 200, 7, 400, 200], config.vocab_size)
    ids = ids[:, :1024]
    starts = document_starts(ids, EOD)
    cos, sin = model.rope(1024, 0, ids.device)
    x = torch.randn(1, 1024, config.dim, requires_grad=True)
    peaks = []
    for doc_start in (None, starts):
        with LiveBytesTracker() as tracker:  # under a dispatch mode the chunks run on one worker
            layer(x, cos, sin, doc_start=doc_start).sum().backward()
        peaks.append(tracker.peak)
    assert peaks[1] <= peaks[0] + 64 * 1024, peaks


def test_nsa_one_token_documents_with_one_token_blocks():
    """l = d = 1: a one-token document already sees one compressed block (itself), so it runs through the kernels,
    not the closed form of longer blocks; packed = alone (float64)."""
    torch.manual_seed(0)
    config = ModelConfig.from_preset("tiny", context_length=64, attention_type="nsa", nsa_block_size=1,
                                     nsa_stride=1, nsa_select_block_size=4)
    model = Transformer(config).double().eval()
    ids, spans = packed([4, 0, 0, 6], config.vocab_size)
    with torch.no_grad():
        out = model(ids, doc_start=document_starts(ids, EOD)).logits
        for first, end in spans:
            alone = model(ids[:, first:end]).logits
            torch.testing.assert_close(out[:, first:end], alone, rtol=0, atol=1e-6 * alone.abs().max().item())


def test_document_starts_made_under_inference_mode():
    """Inference tensors keep no version counter: their spans are read each time, not cached."""
    model = Transformer(ModelConfig.from_preset("tiny", attention_type="nsa")).eval()
    ids, _ = packed([20, 15], model.config.vocab_size)
    with torch.inference_mode():
        out = model(ids, doc_start=document_starts(ids, EOD)).logits
    with torch.no_grad():
        torch.testing.assert_close(out, model(ids, doc_start=document_starts(ids, EOD)).logits)


def test_the_layers_of_a_forward_read_the_document_starts_once(monkeypatch):
    """NSA's layers share one host read of doc_start per tensor (`document_spans` for the loop over documents,
    `nsa.packing.document_blocks` for the one call); a change in place is read again."""
    import modeling.documents
    import nsa.packing
    from nsa.primitive import triton_kernels

    pytest.importorskip("triton")
    reads = []
    read_spans, read_blocks = modeling.documents._read_spans, nsa.packing._blocks
    monkeypatch.setattr(modeling.documents, "_read_spans", lambda *a: reads.append("spans") or read_spans(*a))
    monkeypatch.setattr(nsa.packing, "_blocks", lambda *a, **k: reads.append("blocks") or read_blocks(*a, **k))
    model = Transformer(ModelConfig.from_preset("tiny", attention_type="nsa", n_layers=3))
    # on CPU tensors the loop; on the Triton kernels one call, but the loop for 20 one-token documents more
    for kernels, many, want in ((False, [], ["spans"]), (True, [], ["blocks"]), (True, [0] * 20, ["blocks", "spans"])):
        ids = packed([20, 15, 30, *many], model.config.vocab_size)[0]
        starts = document_starts(ids, EOD)
        reads.clear()
        with torch.no_grad(), triton_kernels() if kernels else contextlib.nullcontext():
            model(ids, doc_start=starts)
        assert reads == want, (kernels, many, reads)
    starts[:, 30:] = 30  # another split, in place
    assert modeling.documents.document_spans(starts)[0][-1] == (30, ids.shape[1]) and reads[-1] == "spans"
    blocks = nsa.packing.document_blocks(starts, model.config)  # documents of 20, 10 and 57 tokens: 2 + 1 + 4 blocks
    assert blocks.n_blocks == 7 and reads[-1] == "blocks"


# ---- NSA's packed documents in one call: nsa/packing.py, the reference and the Triton kernels ----------------------


def nsa_packed_inputs(rows: list[list[int]], config: ModelConfig, H: int = 4, KV: int = 2, D: int = 8):
    """Random float64 NSA inputs for rows of documents of the given lengths (each row the same total T): q, the
    compressed keys/values of each row's documents one after another (B, KV, Ne, D), the selection and window
    keys/values, gates, doc_start (B, T) and the rows' `DocumentBlocks`."""
    starts = []
    for lengths in rows:
        starts.append(torch.cat([torch.full((n,), sum(lengths[:i])) for i, n in enumerate(lengths)]))
    doc_start = torch.stack(starts)
    B, T = doc_start.shape
    blocks = document_blocks(doc_start, config)
    Ne = blocks.cmp_start.shape[1]
    q = torch.randn(B, H, T, D, dtype=torch.float64)
    k_cmp, v_cmp = (torch.randn(B, KV, Ne, D, dtype=torch.float64) for _ in range(2))
    kv = [torch.randn(B, KV, T, D, dtype=torch.float64) for _ in range(4)]
    gates = torch.rand(B, H, T, 3, dtype=torch.float64)
    return (q, k_cmp, v_cmp, *kv, gates), doc_start, blocks


# l = 8, d = 4, l' = 16, n = 4, w = 32: one-token documents, documents shorter than a compressed block, and long
# ones where top-n chooses among more than n blocks and the window slides; no document aligned to a block
PACKED_ROWS = [[11, 1, 70, 5, 1, 1, 46], [90, 3, 42]]


def test_the_reference_attends_each_packed_document_as_if_alone():
    """nsa/reference.py with doc_start gives each document of each row what it gives alone (its own sequence from
    position 0, its own compressed blocks), exactly: the same operations on the same numbers."""
    from nsa.reference import naive_nsa

    config = ModelConfig.from_preset("tiny", attention_type="nsa")
    inputs, doc_start, blocks = nsa_packed_inputs(PACKED_ROWS, config)
    q, k_cmp, v_cmp, k_slc, v_slc, k_win, v_win, gates = inputs
    out = naive_nsa(*inputs, config, doc_start=doc_start)
    l, d = config.nsa_block_size, config.nsa_stride
    for row, lengths in enumerate(PACKED_ROWS):
        first, c0 = 0, 0
        for n in lengths:
            end, nc = first + n, max(0, (n - l) // d + 1)
            alone = [x[row:row + 1, :, first:end] for x in (q, k_slc, v_slc, k_win, v_win, gates)]
            cmp = [x[row:row + 1, :, c0:c0 + nc] for x in (k_cmp, v_cmp)]
            want = naive_nsa(alone[0], *cmp, *alone[1:], config)
            torch.testing.assert_close(out[row:row + 1, :, first:end], want, rtol=0, atol=0)
            first, c0 = end, c0 + nc


def test_document_blocks_count_each_document_from_its_first_token():
    """`nsa.packing.document_blocks` for hand-checked rows (l' = 16, d = 4, l = 8): each document's selection
    blocks start at its first token and every l' tokens after, ending at its end; its complete compressed blocks
    start every d tokens from its first token; their virtual slots follow the documents' block-aligned starts."""
    config = ModelConfig.from_preset("tiny", attention_type="nsa")
    doc_start = torch.tensor([[0] * 20 + [20] * 3 + [23] * 9])  # documents of 20, 3 and 9 tokens
    blocks = document_blocks(doc_start, config)
    assert blocks.block_start.tolist() == [[0, 16, 20, 23]] and blocks.block_end.tolist() == [[16, 20, 23, 32]]
    assert blocks.virtual[0, [0, 19, 20, 22, 23, 31]].tolist() == [0, 19, 32, 34, 48, 56]
    assert blocks.cmp_start.tolist() == [[0, 4, 8, 12, 23]]  # a 20-token document: blocks at 0, 4, 8, 12
    assert blocks.cmp_slot.tolist() == [[0, 1, 2, 3, 12]]  # the third document starts at virtual 48 = slot 12
    assert (blocks.n_blocks, blocks.n_compressed) == (4, 15)  # virtual length 64
    short = document_blocks(torch.tensor([[0] * 5 + [5] * 6]), config)  # 5 and 6 tokens: no block complete (l = 8)
    assert short.cmp_start.shape == (1, 0)
    assert document_windows(torch.zeros(1, 2, 11, 4), short, 8).shape == (1, 2, 0, 8, 4)


@pytest.mark.parametrize("path,chunk", [("torch", 24), ("torch", 200),
                                        pytest.param("triton", 24, marks=pytest.mark.slow)])
def test_packed_documents_in_one_call_match_the_reference(path, chunk):
    """sparse_attention with `documents`, two rows packed differently, one call, against nsa/reference.py with
    doc_start (float64): the output, and the gradients of every input against autograd through the reference. On
    PyTorch operators in query chunks of 24 (chunks cut documents and blocks) and of 200 (one chunk, the window in
    two pieces of 128 queries), and on the Triton kernels (Triton's interpreter)."""
    from modeling.config import ComputeConfig
    from nsa.attention import sparse_attention
    from nsa.packing import on_virtual_axis
    from nsa.primitive import triton_kernels
    from nsa.reference import naive_nsa

    if path == "triton":
        pytest.importorskip("triton")
    config = ModelConfig.from_preset("tiny", attention_type="nsa")
    inputs, doc_start, blocks = nsa_packed_inputs(PACKED_ROWS, config)
    leaves = [x.requires_grad_() for x in inputs]
    want = naive_nsa(*leaves, config, doc_start=doc_start)
    grad = torch.randn_like(want)
    want_grads = torch.autograd.grad(want, leaves, grad)
    q, k_cmp, v_cmp, *rest = leaves
    with triton_kernels() if path == "triton" else contextlib.nullcontext():
        got = sparse_attention(q, on_virtual_axis(k_cmp, blocks), on_virtual_axis(v_cmp, blocks), *rest, config,
                               compute=ComputeConfig(attention_query_chunk=chunk), documents=blocks)
        got_grads = torch.autograd.grad(got, leaves, grad)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    with torch.no_grad(), triton_kernels() if path == "triton" else contextlib.nullcontext():  # Triton: 8 chunks
        again = sparse_attention(q, on_virtual_axis(k_cmp, blocks), on_virtual_axis(v_cmp, blocks), *rest, config,
                                 compute=ComputeConfig(attention_query_chunk=8), documents=blocks)
    torch.testing.assert_close(again, want, rtol=0, atol=1e-12)
    for name, g, w in zip(("q", "k_cmp", "v_cmp", "k_slc", "v_slc", "k_win", "v_win", "gates"), got_grads,
                          want_grads, strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-11, msg=name)


@pytest.mark.parametrize("compressor", ["mlp", "mean"])
@pytest.mark.parametrize("path", ["torch", pytest.param("triton", marks=pytest.mark.slow)])
def test_nsa_layer_packs_documents_in_one_call(compressor, path, monkeypatch):
    """The model runs packed documents in one call (`_attend_packed`: compressed keys gathered per document and
    placed on the virtual axis), on PyTorch operators or the Triton kernels (interpreter), and gives the logits and
    parameter gradients of the document-by-document loop (`_attend_documents`' loop, PyTorch), float64."""
    from nsa import layer as nsa_layer
    from nsa.layer import NativeSparseAttention
    from nsa.primitive import triton_kernels

    if path == "triton":
        pytest.importorskip("triton")

    torch.manual_seed(0)
    config = ModelConfig.from_preset("tiny", context_length=256, attention_type="nsa", nsa_compressor=compressor,
                                     n_layers=1)
    model = Transformer(config).double()
    rows = [packed(lengths, config.vocab_size, seed=i)[0] for i, lengths in enumerate(([40, 0, 70, 4], [100, 17]))]
    ids = torch.cat([row[:, :117] for row in rows])  # 117 and 118 tokens
    starts = document_starts(ids, EOD)
    results = []
    for one_call in (False, True):
        calls = []

        def blocks(self: NativeSparseAttention, starts: torch.Tensor, q: torch.Tensor, calls: list = calls,
                   one_call: bool = one_call):  # one call even on CPU tensors and for these short documents
            calls.append(nsa_layer.document_blocks(starts, self.config) if one_call else None)
            return calls[-1]

        monkeypatch.setattr(NativeSparseAttention, "_packed_blocks", blocks)
        with triton_kernels() if path == "triton" and one_call else contextlib.nullcontext():
            out = model(ids, ids, doc_start=starts)
            out.loss.backward()
        assert calls and all((b is not None) == one_call for b in calls)
        results.append((out.logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
        model.zero_grad()
    (loop_logits, loop_grads), (call_logits, call_grads) = results
    torch.testing.assert_close(call_logits, loop_logits, rtol=0, atol=1e-10 * loop_logits.abs().max().item())
    for name, g in loop_grads.items():
        torch.testing.assert_close(call_grads[name], g, rtol=0, atol=1e-10 * g.abs().max().item(), msg=name)


@pytest.mark.slow
@pytest.mark.parametrize("path", ["torch", "triton"])
def test_nsa_packed_documents_add_only_indices_to_the_peak_at_131k(path, monkeypatch):
    """FakeTensorMode, one 4B-geometry NSA layer at 131,072 tokens in bfloat16, forward + backward, on PyTorch
    operators (query chunks of 8192: 16 chunks, not 64, to keep the test short) and on the Triton kernels' path (not
    launched on fake tensors): with a document mask (one call, `_attend_packed`) the peak of live bytes exceeds the
    unmasked layer's by at most 256 bytes a position (the starts, the virtual axis's tables, each query's ranges and
    the window's mask a row: O(T)), and no tensor is larger than the unmasked path's largest."""
    if path == "triton":
        pytest.importorskip("triton")
    from modeling.config import ComputeConfig
    from nsa.layer import NativeSparseAttention
    from nsa.primitive import triton_kernels

    def one_call(self: NativeSparseAttention, starts: torch.Tensor, q: torch.Tensor):
        return document_blocks(starts, self.config)

    monkeypatch.setattr(NativeSparseAttention, "_packed_blocks", one_call)  # on CPU tensors too (`_packed_blocks`)

    config = ModelConfig.from_preset("4B", attention_type="nsa", context_length=131072)
    T = 131072
    torch.set_default_dtype(torch.bfloat16)  # parameters in bfloat16 (the conftest fixture restores the default)
    results = []
    with FakeTensorMode():
        layer = NativeSparseAttention(config, ComputeConfig(attention_query_chunk=8192 if path == "torch" else 2048))
        x = torch.randn(1, T, config.dim, dtype=torch.bfloat16, requires_grad=True)
        cos, sin = torch.randn(T, config.head_dim), torch.randn(T, config.head_dim)
        for doc_start in (None, torch.zeros(1, T, dtype=torch.long)):
            with triton_kernels() if path == "triton" else contextlib.nullcontext(), LiveBytesTracker() as tracker:
                layer(x, cos, sin, doc_start=doc_start).sum().backward()
            results.append((tracker.peak, tracker.largest))
    (peak, largest), (packed_peak, packed_largest) = results
    assert packed_peak <= peak + 256 * T, (packed_peak - peak) / T
    assert packed_largest <= largest, (packed_largest, largest)


def test_nsa_chooses_the_one_call_or_the_loop():
    """Packed documents run in one call on the Triton kernels while the virtual axis (each document padded to whole
    l'-blocks) is at most `PACKED_LENGTH` times the row: one-token documents padded to l' = 16 exceed it. On CPU
    tensors without the kernels the loop runs rows split alike, the one call rows split differently
    (benchmarks/nsa_documents.py)."""
    pytest.importorskip("triton")
    from nsa.layer import PACKED_LENGTH, NativeSparseAttention
    from nsa.primitive import triton_kernels

    config = ModelConfig.from_preset("tiny", context_length=256, attention_type="nsa")
    layer = NativeSparseAttention(config)
    long_docs, _ = packed([60, 90], config.vocab_size)  # 60 + 91 tokens: 160 virtual positions, 1.06 T
    short_docs, _ = packed([20] + [0] * 30, config.vocab_size)  # 20 + 30 one-token documents: 496 of them, 9.9 T
    for ids, one_call in ((long_docs, True), (short_docs, False)):
        starts = document_starts(ids, EOD)
        q = torch.zeros(1, config.n_heads, ids.shape[1], config.head_dim)
        with triton_kernels():
            assert (layer._packed_blocks(starts, q) is not None) == one_call
        assert (document_blocks(starts, config).virtual_length(16) <= PACKED_LENGTH * ids.shape[1]) == one_call
        assert layer._packed_blocks(starts.expand(2, -1), q.expand(2, -1, -1, -1)) is None  # CPU, rows alike
    other, _ = packed([100, 50], config.vocab_size)
    rows = document_starts(torch.cat([long_docs, other]), EOD)  # two rows split differently
    assert layer._packed_blocks(rows, torch.zeros(2, config.n_heads, rows.shape[1], config.head_dim)) is not None
