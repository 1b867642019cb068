"""Chunked vs standard loss: correctness against a float64 reference, the memory claims, and model path selection.

Notation: N tokens, C width, V vocabulary, c chunk rows. Tolerances: float32 1e-5 relative, bf16 2e-2 relative
(bf16 inputs are rounded once; the reference is float64 on the same rounded values).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from model import ComputeConfig, ModelConfig, Objective, Transformer
from modeling.config import GiB
from modeling.loss import IGNORE_INDEX, chunked_linear_cross_entropy, shift_labels, standard_linear_cross_entropy
from verify_chunked_loss import fake_loss_peak, float64_reference


def rel_err(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30)).item()


def make_inputs(N, C, V, dtype, ignore_frac=0.3, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, C, generator=g).to(dtype).requires_grad_()
    weight = (torch.randn(V, C, generator=g) / C**0.5).to(dtype).requires_grad_()
    targets = torch.randint(0, V, (N,), generator=g)
    targets[torch.rand(N, generator=g) < ignore_frac] = IGNORE_INDEX
    return hidden, weight, targets


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk_size", [1, 7, 64, 100])  # N=61: non-dividing, one chunk, chunk larger than N
@pytest.mark.parametrize("z_loss_coef,softcap", [(0.0, None), (1e-3, None), (0.0, 5.0), (1e-2, 3.0)])
def test_matches_float64_reference(dtype, chunk_size, z_loss_coef, softcap):
    hidden, weight, targets = make_inputs(61, 24, 97, dtype)
    loss = chunked_linear_cross_entropy(hidden, weight, targets, chunk_size=chunk_size, z_loss_coef=z_loss_coef,
                                        softcap=softcap)
    assert loss.dtype == torch.float32 and loss.shape == ()
    grads = torch.autograd.grad(loss, (hidden, weight))
    assert grads[0].dtype == dtype and grads[1].dtype == dtype
    h64, w64 = (hidden.detach().double().requires_grad_(), weight.detach().double().requires_grad_())
    ref = float64_reference(h64, w64, targets, z_loss_coef=z_loss_coef, softcap=softcap)
    ref_grads = torch.autograd.grad(ref, (h64, w64))
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert abs(loss.item() - ref.item()) <= tol * abs(ref.item())
    for got, want in zip(grads, ref_grads, strict=True):
        assert rel_err(got, want) < tol


def test_matches_standard_path_and_gradcheck():
    hidden, weight, targets = make_inputs(40, 8, 33, torch.float32)
    loss_s, _ = standard_linear_cross_entropy(hidden, weight, targets, z_loss_coef=1e-3, softcap=4.0)
    loss_c = chunked_linear_cross_entropy(hidden, weight, targets, chunk_size=9, z_loss_coef=1e-3, softcap=4.0)
    torch.testing.assert_close(loss_c, loss_s, rtol=1e-6, atol=1e-6)
    for a, b in zip(torch.autograd.grad(loss_c, (hidden, weight)), torch.autograd.grad(loss_s, (hidden, weight)),
                    strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    h64, w64 = (t.detach().double().requires_grad_() for t in (hidden[:12], weight))
    assert torch.autograd.gradcheck(
        lambda h, w: chunked_linear_cross_entropy(h, w, targets[:12], chunk_size=5, z_loss_coef=0.1, softcap=2.0),
        (h64, w64))


def test_all_ignored_gives_connected_zero():
    hidden, weight, targets = make_inputs(20, 8, 30, torch.float32, ignore_frac=1.0)
    assert (targets == IGNORE_INDEX).all()
    loss = chunked_linear_cross_entropy(hidden, weight, targets, chunk_size=6)
    assert loss.item() == 0.0 and loss.requires_grad
    loss.backward()
    assert torch.equal(hidden.grad, torch.zeros_like(hidden)) and torch.equal(weight.grad, torch.zeros_like(weight))


def test_grad_output_normalizer_and_partial_requires_grad():
    hidden, weight, targets = make_inputs(30, 8, 40, torch.float32)
    (2.5 * chunked_linear_cross_entropy(hidden, weight, targets, chunk_size=7, normalizer=11.0)).backward()
    h64, w64 = (t.detach().double().requires_grad_() for t in (hidden, weight))
    (2.5 * float64_reference(h64, w64, targets, normalizer=11.0)).backward()
    assert rel_err(hidden.grad, h64.grad) < 1e-5 and rel_err(weight.grad, w64.grad) < 1e-5

    frozen = weight.detach()  # only hidden needs a gradient: no (V, C) gradient is computed or kept
    with torch.autograd.graph.saved_tensors_hooks(*_byte_counter(saved := [])):
        loss = chunked_linear_cross_entropy(hidden, frozen, targets, chunk_size=7, normalizer=11.0)
    assert sum(saved) == hidden.numel() * 4
    (g,) = torch.autograd.grad(loss, (hidden,))
    assert rel_err(g, h64.grad / 2.5) < 1e-5
    with torch.no_grad():
        assert not chunked_linear_cross_entropy(hidden, weight, targets).requires_grad


def test_bad_inputs_raise_value_error():
    hidden, weight, targets = make_inputs(10, 8, 20, torch.float32)
    with pytest.raises(ValueError, match="same C"):
        chunked_linear_cross_entropy(hidden, weight[:, :4], targets)
    with pytest.raises(ValueError, match="targets"):
        chunked_linear_cross_entropy(hidden, weight, targets[:5])
    with pytest.raises(ValueError, match="chunk_size"):
        chunked_linear_cross_entropy(hidden, weight, targets, chunk_size=0)
    with pytest.raises(ValueError, match="dtype"):
        chunked_linear_cross_entropy(hidden, weight.double(), targets)


# ---- memory ------------------------------------------------------------------------------------------------------


def _byte_counter(sink: list[int]):
    """saved_tensors_hooks pair recording each saved tensor's storage bytes (once per storage)."""
    seen: set[int] = set()

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in seen:
            seen.add(st.data_ptr())
            sink.append(st.nbytes())
        return t

    return pack, lambda t: t


def test_saved_for_backward_is_gradients_only():
    """Kept for backward: grad_hidden (N, C) and grad_weight (V, C), nothing of size chunk x V per chunk. The plain
    Python loop over chunks, shown for contrast, keeps every chunk's log-softmax (N x V in all)."""
    N, C, V, chunk = 512, 16, 2000, 64
    hidden, weight, targets = make_inputs(N, C, V, torch.float32)
    h_in, w_in = hidden.detach(), weight.detach()
    saved: list[int] = []
    with torch.autograd.graph.saved_tensors_hooks(*_byte_counter(saved)):
        chunked_linear_cross_entropy(hidden, weight, targets, chunk_size=chunk)
    assert sum(saved) == (N * C + V * C) * 4 < chunk * V * 4

    naive: list[int] = []
    with torch.autograd.graph.saved_tensors_hooks(*_byte_counter(naive)):
        sum(F.cross_entropy(hidden[i:i + chunk] @ weight.t(), targets[i:i + chunk], reduction="sum")
            for i in range(0, N, chunk))
    assert sum(naive) >= N * V * 4 and h_in.data_ptr() == hidden.data_ptr() and w_in.data_ptr() == weight.data_ptr()


def test_full_size_peak_4b_131k_tokens():
    N, C, V = 131_072, 2560, 151_936
    chunked = fake_loss_peak(chunked_linear_cross_entropy, N, C, V, chunk_size=4096)
    standard = fake_loss_peak(standard_linear_cross_entropy, N, C, V)
    assert chunked < 8 * GiB, chunked / GiB
    assert standard > 100 * GiB, standard / GiB


def test_peak_is_one_chunk_whatever_the_token_count():
    """Beyond the two gradients (N x C, float32 V x C), the peak is at most two (c, V) buffers (float32 logits
    and their bf16 cast), independently of N."""
    C, V, chunk = 256, 32_000, 1024
    for N in (1024, 8192, 32_768):
        peak = fake_loss_peak(chunked_linear_cross_entropy, N, C, V, chunk_size=chunk)
        grads = N * C * 2 + V * C * 4
        assert peak - grads <= chunk * V * (4 + 2) + N * 16, (N, peak - grads)


# ---- model wiring ------------------------------------------------------------------------------------------------


def test_auto_selection_from_shapes_and_forced_modes(monkeypatch):
    calls = []
    for name in ("_compute_loss_chunked", "_compute_loss_standard"):
        original = getattr(Transformer, name)
        monkeypatch.setattr(Transformer, name, lambda self, *a, _n=name, _o=original, **k: calls.append(_n) or
                            _o(self, *a, **k))
    V = 512
    threshold = 2 * 16 * V * 4  # exactly the float32 logits of B=2, T=16
    for mode, T, want in (("auto", 16, "_compute_loss_standard"), ("auto", 17, "_compute_loss_chunked"),
                          ("chunked", 4, "_compute_loss_chunked"), ("standard", 64, "_compute_loss_standard")):
        model = Transformer(ModelConfig.from_preset("tiny"),
                            ComputeConfig(loss_mode=mode, loss_chunk_threshold_bytes=threshold))
        assert model.config.vocab_size == V
        ids = torch.randint(0, V, (2, T))
        calls.clear()
        out = model(ids, labels=ids)
        assert calls == [want], (mode, T, calls)
        assert (out.logits is None) == (want == "_compute_loss_chunked")
    # loss_rows "targets": the output layer sees only the rows with a target (here 2 x 8 of 2 x 17), so "auto"
    # decides from those rows, and no logits are returned
    model = Transformer(ModelConfig.from_preset("tiny"),
                        ComputeConfig(loss_chunk_threshold_bytes=threshold, loss_rows="targets"))
    ids = torch.randint(0, V, (2, 17))
    calls.clear()
    out = model(ids, labels=ids.masked_fill(torch.arange(17) % 2 == 0, IGNORE_INDEX))
    assert calls == ["_compute_loss_standard"] and out.logits is None
    auto = Transformer(ModelConfig.from_preset("tiny"), ComputeConfig(loss_chunk_threshold_bytes=threshold))
    assert auto.use_chunked_loss(2 * 17, torch.float32)
    assert not auto.use_chunked_loss(2 * 17, torch.bfloat16)  # the compute dtype's element size counts


@pytest.mark.parametrize("tie", [True, False])
def test_model_chunked_equals_standard_and_rowwise_reference(tie):
    """B=2 with ignored labels: both paths, on all rows or on the target rows only (loss_rows), give the same loss
    and parameter gradients (tied or untied output weight), equal to a per-row float64 reference that shifts each
    row on its own (no mixing across rows)."""
    torch.manual_seed(0)
    cfg = ModelConfig.from_preset("tiny", tie_embeddings=tie)
    ids = torch.randint(0, cfg.vocab_size, (2, 23))
    labels = ids.clone()
    labels[0, :4] = IGNORE_INDEX
    labels[1, -3:] = IGNORE_INDEX
    labels[1, 5:12:2] = IGNORE_INDEX
    results = {}
    for mode in ("chunked", "standard"):
        for rows in ("all", "targets"):
            torch.manual_seed(1)
            model = Transformer(cfg, ComputeConfig(loss_mode=mode, loss_chunk_size=5, loss_rows=rows),
                                Objective(z_loss_coef=1e-3))
            loss = model(ids, labels=labels).loss
            loss.backward()
            results[mode, rows] = (loss, {n: p.grad for n, p in model.named_parameters()})
    reference = results["standard", "all"]
    for key, (loss, grads) in results.items():
        torch.testing.assert_close(loss, reference[0], rtol=1e-6, atol=1e-6, msg=str(key))
        for name, grad in reference[1].items():
            torch.testing.assert_close(grads[name], grad, rtol=1e-4, atol=1e-6, msg=f"{key} {name}")

    with torch.no_grad():
        hidden = model.hidden_states(ids).double()  # (B, T, C)
        weight = model.output_weight.double()
        terms = []
        for b in range(2):
            for t in range(22):
                if labels[b, t + 1] != IGNORE_INDEX:
                    lse = torch.logsumexp(hidden[b, t] @ weight.t(), dim=-1)
                    terms.append(lse - hidden[b, t] @ weight[labels[b, t + 1]] + 1e-3 * lse**2)
    for loss, _ in results.values():
        assert abs(loss.item() - torch.stack(terms).mean().item()) < 1e-5
    assert torch.equal(shift_labels(labels)[:, -1], torch.full((2,), IGNORE_INDEX))


def test_verify_chunked_loss_refuses_unknown_options(capsys):
    import verify_chunked_loss

    with pytest.raises(SystemExit) as exit_info:
        verify_chunked_loss.main(["--bogus"])
    assert exit_info.value.code == 2 and "unrecognized arguments: --bogus" in capsys.readouterr().err
