"""Tests for npt/: efficient forward vs a naive per-token dW reference (float64, outputs and gradients), exact
equivalence of additive mode with B = 0, causality, KV-cache decoding, freezing, adapter save/load, folding,
precision, activation offload, full-size memory (FakeTensorMode) and a tiny equivalence-training run.

Notation: B batch, T tokens, C model width, F FFN width, I / O projection input / output width, P targets, r rank.
"""

import copy
import json

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from model import Block, ModelConfig, Transformer
from modeling.config import GiB
from npt.adapters import load_adapters, save_adapters
from npt.convert import (
    convert,
    fold,
    np_blocks,
    np_parameters,
    resolve_layers,
    revert,
    set_mode,
    using_mode,
)
from npt.memory import layer_memory, llama_like_config, offload_memory
from npt.modulated import NPBlock, modulated_linear


def tiny_config(**overrides) -> ModelConfig:
    return ModelConfig.from_preset("tiny", **overrides)


def randomize_np(model: Transformer, std: float = 0.3) -> None:
    """Give every B a non-zero value, so the modulation actually changes the output."""
    with torch.no_grad():
        for block in np_blocks(model).values():
            for B in block.np.B.values():
                B.normal_(std=std)


def naive_np_forward(block: NPBlock, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Reference NPBlock forward that builds every token's dW = A diag(m) B with einsum (tiny shapes only)."""
    a = block.attn(block.attn_norm(x), cos, sin)  # (B, T, C)
    h = x + a if block.residual_mode == "additive" else x
    np_ = block.np
    m = torch.einsum("btc,kc->btk", a, np_.coef.weight).unflatten(-1, (len(np_.targets), np_.rank))  # (B, T, P, r)

    def project(target: str, inp: Tensor) -> Tensor:
        W = getattr(block.mlp, f"{target}_proj").weight.t()  # (I, O)
        if target not in np_.targets:
            return inp @ W
        p = np_.targets.index(target)
        dW = torch.einsum("ir,btr,ro->btio", np_.A[target], m[..., p, :], np_.B[target])  # (B, T, I, O)
        return torch.einsum("bti,btio->bto", inp, W + dW)

    u = block.mlp_norm(h)
    return h + project("down", F.silu(project("gate", u)) * project("up", u))


@pytest.mark.parametrize("residual_mode", ["modulate", "additive"])
@pytest.mark.parametrize("targets", [("gate", "up"), ("gate", "up", "down"), ("down",)])
def test_efficient_matches_naive_float64(residual_mode, targets):
    torch.set_default_dtype(torch.float64)
    cfg = tiny_config()
    block = NPBlock(Block(cfg), rank=4, targets=targets, residual_mode=residual_mode, dtype=torch.float64)
    with torch.no_grad():
        for B in block.np.B.values():
            B.normal_(std=0.3)
    x = torch.randn(2, 9, cfg.dim, requires_grad=True)
    cos, sin = Transformer(cfg).rope(9, 0, x.device)
    grad_out = torch.randn(2, 9, cfg.dim)
    # FFN and NP parameters see float64 all the way; the input, attention and norm weights get their gradient
    # through RMSNorm and RoPE, which compute in float32 by design (layers.py).
    exact = [*block.np.parameters(), *block.mlp.parameters()]
    via_float32 = [x, *block.attn.parameters(), block.attn_norm.weight, block.mlp_norm.weight]

    out = block(x, cos, sin)
    grads = torch.autograd.grad(out, exact + via_float32, grad_out)
    ref = naive_np_forward(block, x, cos, sin)
    ref_grads = torch.autograd.grad(ref, exact + via_float32, grad_out)

    assert out.dtype == torch.float64
    torch.testing.assert_close(out, ref)  # float64 defaults: rtol 1e-7, atol 1e-7
    for k, (g, r) in enumerate(zip(grads, ref_grads, strict=True)):
        if k < len(exact):
            torch.testing.assert_close(g, r)
        else:
            torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-6)  # float32 rounding inside the norms


def test_modulated_linear_gradcheck():
    x = torch.randn(3, 5, dtype=torch.float64, requires_grad=True)
    W = torch.randn(7, 5, dtype=torch.float64, requires_grad=True)
    A = torch.randn(5, 2, dtype=torch.float64, requires_grad=True)
    B = torch.randn(2, 7, dtype=torch.float64, requires_grad=True)
    m = torch.randn(3, 2, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(modulated_linear, (x, W, A, B, m))


def test_delta_sq_norm_matches_naive():
    torch.set_default_dtype(torch.float64)
    block = NPBlock(Block(tiny_config()), rank=3, targets=("gate", "down"))
    with torch.no_grad():
        for B in block.np.B.values():
            B.normal_()
    m = torch.randn(2, 5, 2, 3)  # (B, T, P, r)
    naive = sum(torch.einsum("ir,btr,ro->btio", block.np.A[t], m[..., p, :], block.np.B[t]).square().sum((-2, -1))
                for p, t in enumerate(block.np.targets))
    torch.testing.assert_close(block.np.delta_sq_norm(m), naive.float())


def test_additive_zero_B_equals_original_exactly():
    cfg = tiny_config()
    model = Transformer(cfg)
    reference = copy.deepcopy(model)
    ids = torch.randint(0, cfg.vocab_size, (2, 17))
    convert(model, "all", residual_mode="additive", targets=("gate", "up", "down"))
    assert torch.equal(model(ids).logits, reference(ids).logits)
    with using_mode(model, "original"):
        assert torch.equal(model(ids).logits, reference(ids).logits)


@pytest.mark.parametrize("residual_mode", ["modulate", "additive"])
def test_causality(residual_mode):
    torch.set_default_dtype(torch.float64)
    cfg = tiny_config()
    model = Transformer(cfg)
    convert(model, "all", residual_mode=residual_mode, targets=("gate", "up", "down"))
    randomize_np(model)
    ids = torch.randint(0, cfg.vocab_size, (2, 20))
    changed = ids.clone()
    changed[:, 12:] = torch.randint(0, cfg.vocab_size, (2, 8))
    with torch.no_grad():
        a, b = model(ids).logits, model(changed).logits
    torch.testing.assert_close(a[:, :12], b[:, :12], rtol=0, atol=1e-12)  # float64, same ops on the prefix
    assert not torch.allclose(a[:, 12:], b[:, 12:])


def test_kv_cache_decoding_matches_full_forward():
    cfg = tiny_config()
    model = Transformer(cfg)
    convert(model, [1], targets=("gate", "up", "down"))
    randomize_np(model)
    ids = torch.randint(0, cfg.vocab_size, (2, 10))
    with torch.no_grad():
        full = model(ids).logits
        model.setup_kv_cache(2, 10)
        prefill = model.lm_head(model.hidden_states(ids[:, :6], start_pos=0))
        steps = [model.lm_head(model.hidden_states(ids[:, t:t + 1], start_pos=t)) for t in range(6, 10)]
        model.clear_kv_cache()
    torch.testing.assert_close(torch.cat([prefill, *steps], dim=1), full, rtol=1e-5, atol=1e-5)  # float32


def test_gradient_checkpointing_same_gradients():
    cfg = tiny_config()
    model = Transformer(cfg)
    convert(model, "all", targets=("gate", "up", "down"))
    randomize_np(model)
    twin = copy.deepcopy(model)
    twin.gradient_checkpointing_enable()
    ids = torch.randint(0, cfg.vocab_size, (2, 8))
    model(ids, labels=ids).loss.backward()
    twin(ids, labels=ids).loss.backward()
    for (n, p), q in zip(np_parameters(model).items(), np_parameters(twin).values(), strict=True):
        assert torch.equal(p.grad, q.grad), n


def test_convert_freezes_and_selects_layers():
    cfg = tiny_config(n_layers=4)
    model = Transformer(cfg)
    before = {n: p for n, p in model.named_parameters()}
    assert convert(model, "upper_half", rank=8) == [2, 3]
    assert sorted(np_blocks(model)) == [2, 3]
    assert all(isinstance(model.layers[i], Block) for i in range(4))  # NPBlock is a Block
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == set(np_parameters(model))
    assert trainable == {f"layers.{i}.np.{k}" for i in (2, 3)
                         for k in ("coef.weight", "A.gate", "A.up", "B.gate", "B.up")}
    # The original submodules are reused: same parameter objects under the same names.
    after = dict(model.named_parameters())
    assert all(after[n] is p for n, p in before.items())
    assert model.layers[2].np.A["gate"].shape == (cfg.dim, 8) and model.layers[2].np.B["up"].shape == (8, cfg.ffn_dim)
    with pytest.raises(ValueError, match="already converted"):
        convert(model, [3])
    assert resolve_layers([0, -1], 4) == [0, 3] and resolve_layers("all", 3) == [0, 1, 2]
    for bad in ([4], [], [1, 1], "lower"):
        with pytest.raises(ValueError):
            resolve_layers(bad, 4)
    with pytest.raises(ValueError, match="targets"):
        convert(Transformer(cfg), [0], targets=("gate", "query"))
    with pytest.raises(ValueError, match="rank"):
        convert(Transformer(cfg), [0], rank=0)


def test_convert_model_loaded_from_hf_weights(tmp_path):
    from storage.hf import export_hf_checkpoint, load_hf_checkpoint

    cfg = tiny_config()
    export_hf_checkpoint(Transformer(cfg), tmp_path / "hf")
    reference = load_hf_checkpoint(tmp_path / "hf")
    model = load_hf_checkpoint(tmp_path / "hf")
    assert convert(model, "upper_half", residual_mode="additive") == [1]
    assert model.lm_head.weight is model.embed_tokens.weight  # tying survives; the tied weight is frozen once
    assert {n for n, p in model.named_parameters() if p.requires_grad} == set(np_parameters(model))
    ids = torch.randint(0, cfg.vocab_size, (2, 9))
    assert torch.equal(model(ids).logits, reference(ids).logits)
    assert revert(model) == [1]  # back to the plain model: exportable, loads again
    export_hf_checkpoint(model, tmp_path / "reverted")
    assert torch.equal(load_hf_checkpoint(tmp_path / "reverted")(ids).logits, reference(ids).logits)


def test_base_dtype_casts_only_frozen_weights():
    cfg = tiny_config()
    model = Transformer(cfg)
    convert(model, "all", base_dtype=torch.bfloat16)
    for name, p in model.named_parameters():
        assert p.dtype == (torch.float32 if p.requires_grad else torch.bfloat16), name
    randomize_np(model)
    ids = torch.randint(0, cfg.vocab_size, (2, 8))
    out = model(ids, labels=ids)
    out.loss.backward()
    assert out.logits.dtype == torch.bfloat16
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in np_parameters(model).values())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_close_to_float32(dtype):
    cfg = tiny_config()
    block = NPBlock(Block(cfg), rank=8, targets=("gate", "up", "down"))
    with torch.no_grad():
        for B in block.np.B.values():
            B.normal_(std=0.3)
    low = copy.deepcopy(block)
    for p in low.parameters():  # frozen base in low precision; NP masters stay float32
        if not any(p is q for q in low.np.parameters()):
            p.data = p.data.to(dtype)
    x = torch.randn(2, 8, cfg.dim)
    cos, sin = Transformer(cfg).rope(8, 0, x.device)
    ref = block(x, cos, sin)
    out = low(x.to(dtype), cos, sin)
    assert out.dtype == dtype
    # Half-precision activations: relative error ~1e-2 of the output scale.
    torch.testing.assert_close(out.float(), ref, rtol=3e-2, atol=3e-2)
    out.float().square().sum().backward()
    assert all(torch.isfinite(p.grad).all() and p.grad.dtype == torch.float32 for p in low.np.parameters())


def test_adapter_save_load_round_trip(tmp_path):
    cfg = tiny_config(n_layers=3)
    model = Transformer(cfg)
    fresh = copy.deepcopy(model)
    convert(model, [0, 2], rank=4, targets=("up", "down"), residual_mode="additive")
    randomize_np(model)
    path = tmp_path / "np.safetensors"
    save_adapters(model, path)
    assert load_adapters(fresh, path) == [0, 2]  # converts the plain model as recorded
    ids = torch.randint(0, cfg.vocab_size, (1, 12))
    assert torch.equal(fresh(ids).logits, model(ids).logits)
    assert load_adapters(fresh, path) == [0, 2]  # and loads into an already converted model

    with pytest.raises(ValueError, match="dim=64, ffn_dim=192; this model has dim=32"):
        load_adapters(Transformer(tiny_config(dim=32, n_layers=3)), path)
    with pytest.raises(ValueError, match="only 2 layers"):
        load_adapters(Transformer(tiny_config(n_layers=2)), path)
    other = Transformer(cfg)
    convert(other, [0, 2], rank=8, targets=("up", "down"), residual_mode="additive")
    with pytest.raises(ValueError, match="converted differently"):
        load_adapters(other, path)


@pytest.mark.parametrize("token", [5, (2, 9)])
def test_fold_reproduces_modulated_output(token):
    torch.set_default_dtype(torch.float64)
    cfg = tiny_config()
    model = Transformer(cfg)
    convert(model, "all", targets=("gate", "up", "down"))
    randomize_np(model)
    ids = torch.randint(0, cfg.vocab_size, (1, 12))
    blocks = np_blocks(model)
    before = {i: copy.deepcopy(b) for i, b in blocks.items()}
    inputs, outputs, coefs = {}, {}, {}

    def record(i: int, args: tuple, out: Tensor) -> None:
        inputs[i], outputs[i] = args, out

    hooks = [b.register_forward_hook(lambda _m, args, out, i=i: record(i, args, out)) for i, b in blocks.items()]
    hooks += [b.np.register_forward_hook(lambda _m, _a, out, i=i: coefs.__setitem__(i, out)) for i, b in blocks.items()]
    with torch.no_grad():
        model.hidden_states(ids)
    for h in hooks:
        h.remove()

    fold(model, ids, token)
    set_mode(model, "static")
    start, end = (token, token + 1) if isinstance(token, int) else token
    for i, block in blocks.items():
        with torch.no_grad():
            folded = block(*inputs[i])  # (1, T, C), same layer input as in the plastic pass
            # Plastic layer with every token's coefficients replaced by those of the token / mean over the span.
            m = coefs[i][:, start:end].mean(1, keepdim=True)  # (1, 1, P, r)
            before[i].np.register_forward_hook(lambda _m, _a, out, m=m: m.expand_as(out))
            expected = before[i](*inputs[i])
        torch.testing.assert_close(folded, expected)  # float64 defaults
        if end - start == 1:  # the folded layer reproduces the modulated output at that token
            torch.testing.assert_close(folded[:, start], outputs[i][:, start])


def test_offload_same_results_and_full_size_savings():
    cfg = tiny_config()
    model = Transformer(cfg)
    convert(model, "all", targets=("gate", "up", "down"))
    randomize_np(model)
    twin = copy.deepcopy(model)
    for b in np_blocks(twin).values():
        b.offload = True
    ids = torch.randint(0, cfg.vocab_size, (2, 8))
    model(ids, labels=ids).loss.backward()
    twin(ids, labels=ids).loss.backward()
    for (n, p), q in zip(np_parameters(model).items(), np_parameters(twin).values(), strict=True):
        assert torch.equal(p.grad, q.grad), n
    # At Llama-8B-like width the accelerator keeps almost nothing between forward and backward with offload.
    cfg8 = llama_like_config()
    off = offload_memory(cfg8, n_layers=2, offload=False)
    on = offload_memory(cfg8, n_layers=2, offload=True)
    assert on.bytes_offloaded > 0 and on.host_peak >= on.bytes_offloaded
    assert on.device_after_forward < 0.05 * off.device_after_forward
    assert on.device_peak < off.device_peak


def test_memory_full_size_llama8b_like():
    """B=4, T=512, C=4096, F=11008: a naive per-token dW needs hundreds of GiB; ours < 1 GiB beyond the base layer."""
    mem = layer_memory(llama_like_config(), batch=4, seq_len=512, rank=16, targets=("gate", "up"))
    assert mem.naive_delta_bytes == 2 * 4 * 512 * 4096 * 11008 * 2  # gate + up, bf16
    assert mem.naive_delta_bytes > 300 * GiB
    assert 0 <= mem.extra < 1 * GiB


def test_tiny_equivalence_run_lowers_loss(tmp_path):
    """The entry point end to end on CPU: a tiny corpus, a model whose attention matters (init_std 0.1), the upper
    layer converted in "modulate" mode; the equivalence loss falls, adapters are written and load back."""
    from text.corpus import stdlib_files
    from text.shards import prepare
    from text.tokenizer import Tokenizer
    from train_npt import ADAPTERS_NAME, main

    files = [p for p in stdlib_files() if p.name in {"textwrap.py", "string.py", "shlex.py", "bisect.py"}]
    tok = Tokenizer.train(files, vocab_size=400, model_prefix=tmp_path / "tok")
    prepare(files, tok, tmp_path / "data", progress=False)
    out = tmp_path / "run"
    main(["--config", "configs/npt_tiny.json", "--data_dir", str(tmp_path / "data"), "--tokenizer",
          str(tmp_path / "tok.model"), "--out_dir", str(out), "--context_length", "32", "--batch_size", "4",
          "--max_steps", "20", "--lr", "0.03", "--warmup_steps", "0", "--log_interval", "20"])
    losses = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(losses) == 20
    assert sum(losses[-3:]) < 0.9 * sum(losses[:3])  # last 3 steps vs first 3 (deterministic: seeded data, init)
    model = Transformer(tiny_config(init_std=0.1, context_length=32))
    assert load_adapters(model, out / ADAPTERS_NAME) == [1]


# ---- equivalence training runs on train.py's loop ---------------------------------------------------------------


def _equivalence(data_dir, out, *extra: str) -> dict:
    from train_npt import main

    return main(["--config", "configs/npt_tiny.json", "--data_dir", str(data_dir), "--out_dir", str(out),
                 "--context_length", "32", "--batch_size", "2", "--max_steps", "3", "--warmup_steps", "0",
                 "--checkpoint_interval", "1", *extra])


def test_equivalence_skips_non_finite_steps(data_dir, tmp_path, monkeypatch):
    """The loop's non-finite guard: a NaN equivalence loss skips the update (metrics say so) and the run goes on."""
    import train_npt as te

    calls = {"n": 0}
    real = te.equivalence_loss

    def poisoned(*args, **kwargs):
        calls["n"] += 1
        parts = real(*args, **kwargs)
        return parts._replace(total=parts.total * float("nan")) if calls["n"] == 2 else parts

    monkeypatch.setattr(te, "equivalence_loss", poisoned)
    _equivalence(data_dir, tmp_path)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["skipped"] for r in rows] == [False, True, False]
    assert {"mse", "kl", "l2"} <= set(rows[0])


def test_equivalence_guards_checkpoints_and_memory(data_dir, tmp_path):
    """The loop's checkpoint guard (a second run into the same directory needs --resume) and memory budget."""
    from training.monitor import MemoryBudgetExceeded

    _equivalence(data_dir, tmp_path / "a")
    with pytest.raises(FileExistsError, match="already holds a run .* pass --resume"):
        _equivalence(data_dir, tmp_path / "a")
    assert _equivalence(data_dir, tmp_path / "a", "--resume", "--max_steps", "4")["step"] == 4
    with pytest.raises(MemoryBudgetExceeded, match="exceeds --max_memory"):
        _equivalence(data_dir, tmp_path / "b", "--max_memory", "0.01")
    assert (tmp_path / "b" / "step-1").is_dir()
