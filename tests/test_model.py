"""Decoder core: configuration, initialisation, loss contract, attention against a float64 reference, causality,
gradient checkpointing. Tolerances: float64 comparisons at 1e-10; float32 model vs float64 reference at 1e-5."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils._pytree import tree_leaves

from model import ComputeConfig, ModelConfig, Objective, Transformer
from modeling.config import GiB


def tiny(**overrides) -> ModelConfig:
    return ModelConfig.from_preset("tiny", **overrides)


def naive_forward(model: Transformer, input_ids: torch.Tensor) -> torch.Tensor:
    """Independent float64 re-implementation of the decoder (explicit T x T mask, repeated KV heads, complex RoPE)."""
    cfg = model.config
    sd = {k: v.double() for k, v in model.state_dict().items()}
    B, T = input_ids.shape
    D = cfg.head_dim

    def rms(x, w):
        return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + cfg.norm_eps) * w

    inv_freq = 1.0 / cfg.rope_theta ** (torch.arange(0, D, 2, dtype=torch.float64) / D)
    rot = torch.polar(torch.ones(T, D // 2, dtype=torch.float64), torch.outer(torch.arange(T).double(), inv_freq))

    def rope(x):  # (B, H, T, D), rotate-half layout: pairs are (i, i + D/2)
        xc = torch.complex(x[..., : D // 2], x[..., D // 2:]) * rot
        return torch.cat([xc.real, xc.imag], dim=-1)

    x = sd["embed_tokens.weight"][input_ids]
    mask = torch.ones(T, T, dtype=torch.bool).tril()
    for i in range(cfg.n_layers):
        p = f"layers.{i}."
        h = rms(x, sd[p + "attn_norm.weight"])
        q = (h @ sd[p + "attn.q_proj.weight"].T).view(B, T, cfg.n_heads, D).transpose(1, 2)
        k = (h @ sd[p + "attn.k_proj.weight"].T).view(B, T, cfg.n_kv_heads, D).transpose(1, 2)
        v = (h @ sd[p + "attn.v_proj.weight"].T).view(B, T, cfg.n_kv_heads, D).transpose(1, 2)
        q = rope(rms(q, sd[p + "attn.q_norm.weight"]))
        k = rope(rms(k, sd[p + "attn.k_norm.weight"]))
        k = k.repeat_interleave(cfg.n_rep, dim=1)
        v = v.repeat_interleave(cfg.n_rep, dim=1)
        att = (q @ k.transpose(-1, -2) / math.sqrt(D)).masked_fill(~mask, float("-inf")).softmax(-1)
        y = (att @ v).transpose(1, 2).reshape(B, T, -1) @ sd[p + "attn.o_proj.weight"].T
        x = x + y
        h = rms(x, sd[p + "mlp_norm.weight"])
        g = F.silu(h @ sd[p + "mlp.gate_proj.weight"].T) * (h @ sd[p + "mlp.up_proj.weight"].T)
        x = x + g @ sd[p + "mlp.down_proj.weight"].T
    x = rms(x, sd["norm.weight"])
    return x @ sd["lm_head.weight"].T


class OutputShapes(torch.utils._python_dispatch.TorchDispatchMode):
    """Records the shape of every tensor an aten op returns while active (forward and backward)."""

    def __init__(self) -> None:
        super().__init__()
        self.shapes: list[torch.Size] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.shapes.extend(t.shape for t in tree_leaves(out) if isinstance(t, torch.Tensor))
        return out


# ---- configuration ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("overrides, field", [
    (dict(n_heads=6, n_kv_heads=4), "n_heads"),
    (dict(dim=0), "dim"),
    (dict(n_layers=-1), "n_layers"),
    (dict(attention_type="linear"), "attention_type"),
    (dict(head_dim=15), "head_dim"),
    (dict(attention_type="nsa", nsa_block_size=10, nsa_stride=4), "nsa_stride"),
    (dict(attention_type="nsa", nsa_num_selected=2), "nsa_num_selected"),
    (dict(attention_type="nsa", nsa_compressor="max"), "nsa_compressor"),
    (dict(logit_softcap=-1.0), "logit_softcap"),
    (dict(hidden_size=3), "hidden_size"),
])
def test_invalid_config_names_the_field(overrides, field):
    with pytest.raises(ValueError, match=field):
        tiny(**overrides)


@pytest.mark.parametrize("overrides, field", [
    (dict(loss_mode="fast"), "loss_mode"),
    (dict(ffn_chunk_size=0), "ffn_chunk_size"),
    (dict(attention_query_chunk=-1), "attention_query_chunk"),
])
def test_invalid_compute_config_names_the_field(overrides, field):
    with pytest.raises(ValueError, match=field):
        ComputeConfig(**overrides)


def test_invalid_objective_names_the_field():
    with pytest.raises(ValueError, match="z_loss_coef must be a finite number >= 0"):
        Objective(z_loss_coef=-1.0)


def test_unknown_preset_lists_the_valid_ones():
    with pytest.raises(ValueError, match="4B"):
        ModelConfig.from_preset("4b")


@pytest.mark.parametrize("name, published", [("0.6B", 0.596e9), ("1.7B", 1.721e9), ("4B", 4.022e9), ("8B", 8.191e9)])
def test_presets_have_qwen3_parameter_counts(name, published):
    cfg = ModelConfig.from_preset(name)
    D, hd, q, kv = cfg.dim, cfg.head_dim, cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    per_layer = D * q + 2 * D * kv + q * D + 3 * D * cfg.ffn_dim + 2 * D + 2 * hd  # attn, mlp, 2 norms, qk-norm
    non_embedding = cfg.n_layers * per_layer + D  # + final norm
    embedding = cfg.vocab_size * D * (1 if cfg.tie_embeddings else 2)
    with torch.device("meta"):
        model = Transformer(cfg)
    assert all(p.is_meta for p in model.parameters())  # built on meta: no memory, no init
    assert model.num_parameters() == non_embedding + embedding
    assert model.num_parameters(exclude_embeddings=True) == non_embedding
    assert model.num_parameters() == pytest.approx(published, rel=1e-3)


def test_4b_geometry():
    cfg = ModelConfig.from_preset("4B")
    assert (cfg.dim, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.ffn_dim, cfg.vocab_size) == (
        2560, 36, 32, 8, 128, 9728, 151936)
    assert cfg.rope_theta == 1e6 and cfg.tie_embeddings and cfg.qk_norm and cfg.norm_eps == 1e-6
    assert ComputeConfig().loss_chunk_threshold_bytes == 10 * GiB


def test_meta_init_flow_is_deterministic_and_matches_eager_init():
    eager = Transformer(tiny())
    torch.manual_seed(1)
    eager.init_weights()
    with torch.device("meta"):
        meta = Transformer(tiny())
    meta.to_empty(device="cpu")
    torch.manual_seed(1)
    meta.init_weights()
    for (name, a), (_, b) in zip(eager.state_dict().items(), meta.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    assert meta.lm_head.weight is meta.embed_tokens.weight  # tying survives to_empty


# ---- forward and loss ---------------------------------------------------------------------------------------------

def test_logits_match_float64_reference():
    model = Transformer(tiny())
    ids = torch.randint(0, 512, (2, 48))
    logits = model(ids).logits
    torch.testing.assert_close(logits.double(), naive_forward(model, ids), rtol=1e-5, atol=1e-5)


def test_loss_is_shifted_mean_over_non_ignored_tokens():
    model = Transformer(tiny(tie_embeddings=False)).double()
    ids = torch.randint(0, 512, (3, 20))
    labels = ids.clone()
    labels[0, :7] = -100
    labels[2, 5] = -100
    out = model(ids, labels=labels)
    ref = naive_forward(model, ids)[:, :-1].reshape(-1, 512)
    target = labels[:, 1:].reshape(-1)
    expected = F.cross_entropy(ref, target, ignore_index=-100, reduction="sum") / (target != -100).sum()
    torch.testing.assert_close(out.loss.double(), expected, rtol=1e-10, atol=1e-10)
    assert out.logits.shape == (3, 20, 512)


def test_all_ignored_labels_give_zero_loss_and_zero_grads():
    model = Transformer(tiny())
    ids = torch.randint(0, 512, (2, 16))
    out = model(ids, labels=torch.full_like(ids, -100))
    assert out.loss.item() == 0.0 and out.loss.requires_grad
    out.loss.backward()
    for p in model.parameters():
        assert torch.isfinite(p.grad).all() and not p.grad.any()


def test_labels_must_match_input_shape():
    model = Transformer(tiny())
    with pytest.raises(ValueError, match="labels"):
        model(torch.zeros(2, 8, dtype=torch.long), labels=torch.zeros(2, 7, dtype=torch.long))


@pytest.mark.parametrize("chunked", [False, True], ids=["standard_loss", "chunked_loss"])
def test_out_of_range_ids_and_empty_input_name_the_argument(chunked):
    model = Transformer(tiny(), ComputeConfig(loss_mode="chunked" if chunked else "standard"))
    V, ids = model.config.vocab_size, torch.tensor([[1, 2, 3]])
    for bad in (V, -1):
        with pytest.raises(ValueError, match=rf"input_ids holds 1 id\(s\) outside \[0, {V}\).*e.g. {bad}"):
            model(torch.tensor([[1, bad, 3]]))
        with pytest.raises(ValueError, match=rf"labels holds 1 id\(s\) outside \[0, {V}\)"):
            model(ids, labels=torch.tensor([[1, 2, bad if bad != -1 else -7]]))
    assert model(ids, labels=torch.tensor([[-100, 2, 3]])).loss.isfinite()  # -100 is an ignored target
    with pytest.raises(ValueError, match=r"holds no tokens \(T = 0\)"):
        model(torch.zeros(1, 0, dtype=torch.long), labels=torch.zeros(1, 0, dtype=torch.long))


def test_context_longer_than_config_is_refused():
    model = Transformer(tiny(context_length=32))
    with pytest.raises(ValueError, match="context_length"):
        model(torch.zeros(1, 33, dtype=torch.long))


def test_loss_path_choice_from_shapes():
    with torch.device("meta"):
        model = Transformer(ModelConfig.from_preset("4B"))
    assert not model.use_chunked_loss(4096, torch.bfloat16)  # 1.16 GiB of logits
    assert model.use_chunked_loss(40_000, torch.bfloat16)  # 11.32 GiB
    assert model.use_chunked_loss(131_072, torch.bfloat16)  # 37.09 GiB
    assert model.use_chunked_loss(20_000, torch.float32) and not model.use_chunked_loss(20_000, torch.bfloat16)


def test_causality_future_tokens_never_change_past_logits():
    model = Transformer(tiny())
    ids = torch.randint(0, 512, (1, 40))
    base = model(ids).logits
    for t in (0, 7, 8, 23, 38):
        changed = ids.clone()
        changed[0, t + 1:] = torch.randint(0, 512, (39 - t,))
        torch.testing.assert_close(model(changed).logits[:, : t + 1], base[:, : t + 1], rtol=0, atol=1e-6)


# ---- gradient checkpointing ---------------------------------------------------------------------------------------

def test_gradient_checkpointing_gives_identical_loss_and_grads():
    torch.manual_seed(3)
    ref = Transformer(tiny())
    ckpt = Transformer(tiny())
    ckpt.load_state_dict(ref.state_dict())
    ckpt.gradient_checkpointing_enable()
    ids = torch.randint(0, 512, (2, 24))
    losses = []
    for model in (ref, ckpt):
        loss = model(ids, labels=ids).loss
        loss.backward()
        losses.append(loss)
    assert torch.equal(losses[0], losses[1])
    for (name, a), b in zip(ref.named_parameters(), ckpt.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad), name


def test_training_forward_never_creates_a_kv_cache():
    model = Transformer(tiny())
    model.gradient_checkpointing_enable()
    cache_len = model.config.context_length
    ids = torch.randint(0, 512, (2, 16))
    with OutputShapes() as spy:
        model(ids, labels=ids).loss.backward()
    assert not [shape for shape in spy.shapes if len(shape) == 4 and shape[2] == cache_len]
    assert all(block.attn.cache is None for block in model.layers)


def test_decoding_with_gradients_is_refused():
    model = Transformer(tiny())
    model.setup_kv_cache(1, 16)
    with pytest.raises(RuntimeError, match="no_grad"):
        model(torch.zeros(1, 4, dtype=torch.long), start_pos=0)


def test_full_attention_never_materialises_t_by_t():
    """Forward + backward at T=2048: no tensor anywhere (outputs of every aten op) reaches T*T/4 elements."""
    model = Transformer(tiny(n_layers=1, vocab_size=64, context_length=4096))
    T = 2048
    ids = torch.randint(0, 64, (1, T))
    with OutputShapes() as spy:
        model(ids, labels=ids).loss.backward()
    assert max(shape.numel() for shape in spy.shapes) < T * T // 4


# ---- tiled FFN --------------------------------------------------------------------------------------------------

def test_tiled_ffn_equals_untiled_with_gradients():
    from modeling.layers import FeedForward

    plain = FeedForward(16, 48).double()
    tiled = FeedForward(16, 48, chunk_size=5).double()
    tiled.load_state_dict(plain.state_dict())
    x = torch.randn(2, 23, 16, dtype=torch.float64, requires_grad=True)
    outs, grads = [], []
    for ffn in (plain, tiled):
        y = ffn(x)
        (g,) = torch.autograd.grad((y * torch.arange(23.0, dtype=torch.float64)[:, None]).sum(), x)
        outs.append(y)
        grads.append(g)
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-12, atol=1e-12)
    with torch.no_grad():
        torch.testing.assert_close(tiled(x), outs[0], rtol=1e-12, atol=1e-12)


def test_tiled_ffn_never_holds_more_than_one_tile_of_intermediates():
    """Forward + backward of a model with ffn_chunk_size=256 at T=4096: no (., ffn_dim) tensor beyond one tile."""
    model = Transformer(tiny(n_layers=1, vocab_size=64, context_length=4096), ComputeConfig(ffn_chunk_size=256))
    model.gradient_checkpointing_enable()
    ffn_dim = model.config.ffn_dim
    ids = torch.randint(0, 64, (1, 4096))
    with OutputShapes() as spy:
        model(ids, labels=ids).loss.backward()
    assert max(shape.numel() for shape in spy.shapes if shape[-1:] == (ffn_dim,)) == 256 * ffn_dim


def test_softcap_applies_to_every_logit_the_model_returns():
    """forward without labels and generate use the capped logits the loss is computed from."""
    model = Transformer(tiny(logit_softcap=2.0)).to(torch.float64)
    ids = torch.randint(0, 512, (2, 12))
    plain = model(ids).logits
    assert plain.abs().max() <= 2.0
    torch.testing.assert_close(plain, model(ids, labels=ids).logits.to(plain.dtype), rtol=0, atol=0)


@pytest.mark.slow
@pytest.mark.parametrize("attention, documents", [("full", False), ("nsa", False), ("nsa", True)])
def test_compiled_block_graph_breaks_and_matches_eager(attention, documents):
    """train.py --compile compiles each block: full attention traces as one graph; NSA breaks only at
    `sparse_attention`, which runs eagerly (its chunk loop and threads), and with document starts only at
    `_attend_documents` (its loop over each row's documents). Compiled (aot_eager: the traced graphs, forward and
    backward) equals eager."""
    torch._dynamo.reset()
    model = Transformer(tiny(attention_type=attention, n_layers=1)).double()
    block, ids = model.layers[0], torch.randint(0, 512, (2, 40))
    x = model.embed_tokens(ids).detach().requires_grad_()
    cos, sin = model.rope(40, 0, x.device)
    starts = torch.tensor([[0] * 15 + [15] * 25, [0] * 30 + [30] * 10]) if documents else None
    reasons = [r.reason for r in torch._dynamo.explain(block)(x, cos, sin, None, starts).break_reasons]
    where = "NativeSparseAttention._attend_documents" if documents else "function sparse_attention"
    assert all(where in r for r in reasons)  # the only break, NSA's attention
    assert bool(reasons) == (attention == "nsa")
    compiled = torch.compile(block, backend="aot_eager")
    outs = [f(x, cos, sin, None, starts) for f in (block, compiled)]
    grads = [torch.autograd.grad(out.square().sum(), [x, *block.parameters()]) for out in outs]
    torch.testing.assert_close(outs[1], outs[0], rtol=0, atol=1e-12)
    for eager, comp in zip(*grads, strict=True):
        torch.testing.assert_close(comp, eager, rtol=0, atol=1e-12)
