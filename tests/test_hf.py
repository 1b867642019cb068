"""hf.py against transformers itself: random tiny Qwen3/Llama models are saved with `save_pretrained`, read by our
loader and compared logit by logit (float32, atol 1e-5); our exports are read back by both our loader and
`from_pretrained`. Nothing is downloaded."""

import copy
import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from model import ModelConfig, Transformer
from storage.hf import config_from_hf, config_to_hf, export_hf_checkpoint, load_hf_checkpoint

ATOL = 1e-5  # float32 logits of two independent implementations (ours: SDPA; transformers: eager attention)
LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 32}
# Qwen3's long-context setting (factor 4 over 32k), here over 16 positions so that the test's sequences go past it.
YARN_SCALING = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}
# head_dim 32 != hidden / heads in the Qwen3 case: the q/o projections are not square, as in Qwen3-0.6B.
FAMILIES = {
    "qwen3": (Qwen3ForCausalLM, Qwen3Config, dict(head_dim=32, num_key_value_heads=2, tie_word_embeddings=True,
                                                  rope_theta=1e6, rms_norm_eps=1e-6)),
    "llama": (LlamaForCausalLM, LlamaConfig, dict(head_dim=16, num_key_value_heads=1, tie_word_embeddings=False,
                                                  rope_theta=5e5, rms_norm_eps=1e-5)),
    "llama3": (LlamaForCausalLM, LlamaConfig, dict(head_dim=16, num_key_value_heads=2, tie_word_embeddings=True,
                                                   rope_theta=5e5, rms_norm_eps=1e-5, rope_scaling=LLAMA3_SCALING)),
    "qwen3_yarn": (Qwen3ForCausalLM, Qwen3Config, dict(head_dim=32, num_key_value_heads=2, tie_word_embeddings=True,
                                                       rope_theta=1e6, rms_norm_eps=1e-6, rope_scaling=YARN_SCALING)),
}


def make_hf_model(family: str) -> torch.nn.Module:
    """A random tiny transformers model; norm weights are randomised too so that a swapped norm would show."""
    model_cls, config_cls, extra = FAMILIES[family]
    # rope_theta / rope_scaling: the published-config keywords, accepted by transformers 4.x and 5.x alike.
    # (Deep-copied: transformers adds keys to the rope_scaling dict it is given.)
    config = config_cls(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                        num_attention_heads=4, max_position_embeddings=256, **copy.deepcopy(extra))
    config._attn_implementation = "eager"
    model = model_cls(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(std=0.1)
    return model


def hf_logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits


def our_logits(model: Transformer, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits


@pytest.fixture
def ids() -> torch.Tensor:
    return torch.randint(0, 256, (2, 80))  # 80 > original_max_position_embeddings: the llama3 scaling matters


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_load_matches_transformers(tmp_path, family, ids):
    hf_model = make_hf_model(family)
    sharded = family == "llama"
    hf_model.save_pretrained(tmp_path, max_shard_size="40KB" if sharded else "1GB")
    assert (tmp_path / "model.safetensors.index.json").is_file() == sharded

    model = load_hf_checkpoint(tmp_path)
    assert model.config.qk_norm == (family == "qwen3")
    assert (model.lm_head.weight is model.embed_tokens.weight) == hf_model.config.tie_word_embeddings
    assert model.num_parameters() == sum(p.numel() for p in hf_model.parameters())
    torch.testing.assert_close(our_logits(model, ids), hf_logits(hf_model, ids), atol=ATOL, rtol=0)


@pytest.mark.parametrize("family,scaling", [("llama3", LLAMA3_SCALING), ("qwen3_yarn", YARN_SCALING)])
def test_rope_scaling_matches_transformers(tmp_path, ids, family, scaling):
    hf_model = make_hf_model(family)
    hf_model.save_pretrained(tmp_path)
    model = load_hf_checkpoint(tmp_path)
    assert {k: model.config.rope_scaling[k] for k in scaling} == scaling

    T = ids.shape[1]
    x = torch.zeros(1, T, 64)
    hf_cos, hf_sin = hf_model.model.rotary_emb(x, torch.arange(T)[None])  # (1, T, D)
    cos, sin = model.rope(T, 0, torch.device("cpu"))  # (T, D)
    torch.testing.assert_close(cos, hf_cos[0], atol=1e-6, rtol=0)
    torch.testing.assert_close(sin, hf_sin[0], atol=1e-6, rtol=0)
    expected = hf_logits(hf_model, ids)
    torch.testing.assert_close(our_logits(model, ids), expected, atol=ATOL, rtol=0)
    # The comparison has power: without the scaling the logits are far off.
    unscaled = load_hf_checkpoint(tmp_path, rope_scaling=None)
    assert (our_logits(unscaled, ids) - expected).abs().max() > 1e-2


@pytest.mark.parametrize("family,max_shard_bytes", [("qwen3", 10**9), ("llama", 30_000), ("llama3", 10**9),
                                                    ("qwen3_yarn", 10**9)])
def test_export_roundtrip(tmp_path, family, max_shard_bytes, ids):
    hf_model = make_hf_model(family)
    hf_model.save_pretrained(tmp_path / "src")
    model = load_hf_checkpoint(tmp_path / "src")
    export_hf_checkpoint(model, tmp_path / "out", max_shard_bytes=max_shard_bytes)

    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["architectures"] == [type(hf_model).__name__]
    assert config_from_hf(config) == model.config
    index = tmp_path / "out" / "model.safetensors.index.json"
    assert index.is_file() == (max_shard_bytes < 10**9)
    if index.is_file():
        shards = [load_file(tmp_path / "out" / s) for s in set(json.loads(index.read_text())["weight_map"].values())]
        assert len(shards) > 1
        for shard in shards:  # within the limit, or a single tensor larger than it
            assert len(shard) == 1 or sum(t.numel() * t.element_size() for t in shard.values()) <= max_shard_bytes

    reloaded = load_hf_checkpoint(tmp_path / "out")
    assert reloaded.config == model.config
    assert (reloaded.lm_head.weight is reloaded.embed_tokens.weight) == model.config.tie_embeddings
    for (name, a), (_, b) in zip(model.state_dict().items(), reloaded.state_dict().items(), strict=True):
        assert torch.equal(a, b), name

    hf_reloaded = type(hf_model).from_pretrained(tmp_path / "out", attn_implementation="eager").eval()
    torch.testing.assert_close(hf_logits(hf_reloaded, ids), our_logits(model, ids), atol=ATOL, rtol=0)


def test_export_native_model_to_transformers(tmp_path):
    """A model trained here (random init, tiny preset: Qwen3 geometry) opens in transformers with the same logits."""
    model = Transformer(ModelConfig.from_preset("tiny"))
    export_hf_checkpoint(model, tmp_path / "out")
    hf_model = Qwen3ForCausalLM.from_pretrained(tmp_path / "out", attn_implementation="eager").eval()
    ids = torch.randint(0, model.config.vocab_size, (2, 40))
    torch.testing.assert_close(hf_logits(hf_model, ids), our_logits(model, ids), atol=ATOL, rtol=0)


def test_dtype(tmp_path):
    export_hf_checkpoint(Transformer(ModelConfig.from_preset("tiny")), tmp_path / "f32")
    model = load_hf_checkpoint(tmp_path / "f32", dtype=torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    export_hf_checkpoint(model, tmp_path / "bf16")
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert {t.dtype for t in load_file(tmp_path / "bf16" / "model.safetensors").values()} == {torch.bfloat16}
    reloaded = load_hf_checkpoint(tmp_path / "bf16")  # dtype None keeps the stored one
    assert {p.dtype for p in reloaded.parameters()} == {torch.bfloat16}
    assert reloaded.rope(4, 0, torch.device("cpu"))[0].dtype == torch.float32


def test_config_from_hf_legacy_fields():
    """Published configs: top-level rope_theta + rope_scaling (with the old "type" key), head_dim absent."""
    hf_config = dict(model_type="llama", vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                     num_attention_heads=4, max_position_embeddings=256, rms_norm_eps=1e-5, rope_theta=5e5,
                     rope_scaling={"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                   "original_max_position_embeddings": 32})
    config = config_from_hf(hf_config, context_length=1024)
    assert (config.head_dim, config.n_kv_heads, config.rope_theta) == (16, 4, 5e5)
    assert config.rope_scaling == LLAMA3_SCALING and config.context_length == 1024
    assert not config.tie_embeddings and not config.qk_norm
    assert config_from_hf(config_to_hf(config)) == config


# The config.json of published checkpoints (https://huggingface.co/Qwen/Qwen3-0.6B, https://huggingface.co/meta-llama/Llama-3.2-1B).
QWEN3_0_6B = dict(architectures=["Qwen3ForCausalLM"], attention_bias=False, attention_dropout=0.0, bos_token_id=151643,
                  eos_token_id=151645, head_dim=128, hidden_act="silu", hidden_size=1024, initializer_range=0.02,
                  intermediate_size=3072, max_position_embeddings=40960, max_window_layers=28, model_type="qwen3",
                  num_attention_heads=16, num_hidden_layers=28, num_key_value_heads=8, rms_norm_eps=1e-06,
                  rope_scaling=None, rope_theta=1000000, sliding_window=None, tie_word_embeddings=True,
                  torch_dtype="bfloat16", use_cache=True, use_sliding_window=False, vocab_size=151936)
LLAMA_3_2_1B = dict(architectures=["LlamaForCausalLM"], attention_bias=False, attention_dropout=0.0,
                    bos_token_id=128000, eos_token_id=128001, head_dim=64, hidden_act="silu", hidden_size=2048,
                    initializer_range=0.02, intermediate_size=8192, max_position_embeddings=131072, mlp_bias=False,
                    model_type="llama", num_attention_heads=32, num_hidden_layers=16, num_key_value_heads=8,
                    pretraining_tp=1, rms_norm_eps=1e-05, rope_theta=500000.0, tie_word_embeddings=True,
                    torch_dtype="bfloat16", use_cache=True, vocab_size=128256,
                    rope_scaling={"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                                  "original_max_position_embeddings": 8192, "rope_type": "llama3"})


def test_published_configs():
    assert config_from_hf(QWEN3_0_6B) == ModelConfig.from_preset("0.6B")
    config = config_from_hf(LLAMA_3_2_1B)
    assert config.rope_scaling["factor"] == 32.0 and not config.qk_norm and config.tie_embeddings
    with torch.device("meta"):
        assert Transformer(config).num_parameters() == 1_235_814_400  # the published count


def test_stored_rope_buffers_are_ignored(tmp_path):
    """Older Llama checkpoints also stored each layer's rotary_emb.inv_freq; it is derived, so it is skipped."""
    model = Transformer(ModelConfig.from_preset("tiny", qk_norm=False))
    export_hf_checkpoint(model, tmp_path / "ckpt")
    tensors = load_file(tmp_path / "ckpt" / "model.safetensors")
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)
    save_file(tensors, tmp_path / "ckpt" / "model.safetensors", metadata={"format": "pt"})
    ids = torch.randint(0, 512, (1, 16))
    torch.testing.assert_close(our_logits(load_hf_checkpoint(tmp_path / "ckpt"), ids), our_logits(model, ids),
                               atol=0, rtol=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_load_to_cuda_holds_one_copy(tmp_path):
    """Loaded straight onto the GPU, built on meta: peak memory is the weights once (plus allocator rounding)."""
    config = ModelConfig.from_preset("tiny", vocab_size=32768, dim=512, ffn_dim=2048, n_heads=8, head_dim=64)
    model = Transformer(config).to(torch.bfloat16)
    export_hf_checkpoint(model, tmp_path / "ckpt")
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    loaded = load_hf_checkpoint(tmp_path / "ckpt", device="cuda")
    weight_bytes = sum(p.numel() * p.element_size() for p in loaded.parameters())
    assert torch.cuda.max_memory_allocated() - before <= weight_bytes + 2**20
    assert loaded.lm_head.weight is loaded.embed_tokens.weight
    for (name, a), (_, b) in zip(model.state_dict().items(), loaded.state_dict().items(), strict=True):
        assert b.device.type == "cuda" and torch.equal(a, b.cpu()), name
    assert loaded(torch.zeros(1, 8, dtype=torch.long, device="cuda")).logits.isfinite().all()


# ---- clear errors --------------------------------------------------------------------------------------------------


@pytest.fixture
def tiny_dir(tmp_path):
    export_hf_checkpoint(Transformer(ModelConfig.from_preset("tiny", tie_embeddings=False)), tmp_path / "ckpt")
    return tmp_path / "ckpt"


def edit_config(path, **changes):
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, **changes}))


def test_missing_directory_and_config(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_hf_checkpoint(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        load_hf_checkpoint(tmp_path)


@pytest.mark.parametrize("changes,match", [
    (dict(model_type="mistral"), "unsupported model_type 'mistral'"),
    (dict(attention_bias=True), "attention_bias=true is not supported"),
    (dict(mlp_bias=True), "mlp_bias=true is not supported"),
    (dict(hidden_act="gelu"), "hidden_act 'gelu' is not supported"),
    (dict(rope_parameters={"rope_type": "dynamic", "rope_theta": 1e6, "factor": 4.0}), "'dynamic' is not supported"),
    (dict(rope_parameters=None, rope_scaling={"rope_type": "llama3", "factor": 8.0}), "lacks .*'low_freq_factor'"),
    (dict(intermediate_size=100), r"6 mis-shaped tensors.*mlp.down_proj.weight: checkpoint \(64, 192\) vs model "
                                  r"\(64, 100\)"),
    (dict(tie_word_embeddings=True), r"lm_head.weight differs from the embedding"),
], ids=["model_type", "attention_bias", "mlp_bias", "hidden_act", "dynamic", "llama3_incomplete", "shape",
        "tied_mismatch"])
def test_bad_config(tiny_dir, changes, match):
    edit_config(tiny_dir, **changes)
    with pytest.raises(ValueError, match=match):
        load_hf_checkpoint(tiny_dir)


@pytest.mark.parametrize("text,match", [("[1, 2]", "must hold a JSON object, got list"),
                                        ("{bad", "is not valid JSON")], ids=["list", "malformed"])
def test_unreadable_config_names_the_file(tiny_dir, text, match):
    (tiny_dir / "config.json").write_text(text)
    with pytest.raises(ValueError, match=rf"config.json {match}"):
        load_hf_checkpoint(tiny_dir)


def test_truncated_safetensors_names_the_file(tiny_dir):
    file = tiny_dir / "model.safetensors"
    file.write_bytes(file.read_bytes()[:-100])
    with pytest.raises(ValueError, match=r"model.safetensors is not a readable safetensors file.*truncated"):
        load_hf_checkpoint(tiny_dir)


@pytest.mark.parametrize("shard", ["../other/model.safetensors", "/etc/model.safetensors", ".."])
def test_shard_names_outside_the_directory_are_refused(tiny_dir, shard):
    names = list(load_file(tiny_dir / "model.safetensors"))
    (tiny_dir / "model.safetensors.index.json").write_text(json.dumps({"weight_map": dict.fromkeys(names, shard)}))
    with pytest.raises(ValueError, match="shards must lie in the checkpoint directory"):
        load_hf_checkpoint(tiny_dir)


def test_missing_and_unexpected_tensors(tiny_dir):
    tensors = load_file(tiny_dir / "model.safetensors")
    tensors["model.layers.0.self_attn.extra.weight"] = tensors.pop("model.layers.1.mlp.up_proj.weight")
    save_file(tensors, tiny_dir / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"1 missing, 1 unexpected.*'model.layers.1.mlp.up_proj.weight'.*"
                                         r"'model.layers.0.self_attn.extra.weight'"):
        load_hf_checkpoint(tiny_dir)


def test_tokenizer_vocab_mismatch(tiny_dir):
    tokenizer = {"model": {"type": "BPE", "vocab": {"a": 0, "b": 1}}, "added_tokens": [{"id": 600, "content": "x"}]}
    (tiny_dir / "tokenizer.json").write_text(json.dumps(tokenizer))
    with pytest.raises(ValueError, match="token ids up to 600 but the model's vocab_size is 512"):
        load_hf_checkpoint(tiny_dir)


def test_export_refuses_to_clobber(tiny_dir):
    model = load_hf_checkpoint(tiny_dir)
    with pytest.raises(FileExistsError, match="overwrite=True"):
        export_hf_checkpoint(model, tiny_dir)
    export_hf_checkpoint(model, tiny_dir, max_shard_bytes=100_000, overwrite=True)
    assert (tiny_dir / "model.safetensors.index.json").is_file() and not (tiny_dir / "model.safetensors").exists()
    assert [p.name for p in tiny_dir.parent.iterdir()] == ["ckpt"]  # no temporary directories left behind
    with pytest.raises(ValueError, match="no Qwen3 or Llama equivalent; export_hf_checkpoint writes it with its "
                                         "modeling code"):
        config_to_hf(ModelConfig.from_preset("tiny", attention_type="nsa"))


def test_rope_scaling_validation():
    with pytest.raises(ValueError, match="rope_type 'llama3' or 'yarn'"):
        ModelConfig.from_preset("tiny", rope_scaling={"rope_type": "dynamic", "factor": 4.0})
    with pytest.raises(ValueError, match=r"\(yarn\) needs the keys .*original_max_position_embeddings"):
        ModelConfig.from_preset("tiny", rope_scaling={"rope_type": "yarn", "factor": 4.0})
    with pytest.raises(ValueError, match="beta_fast > beta_slow"):
        ModelConfig.from_preset("tiny", rope_scaling={**YARN_SCALING, "beta_fast": 1, "beta_slow": 2})
    with pytest.raises(ValueError, match="low_freq_factor < high_freq_factor"):
        ModelConfig.from_preset("tiny", rope_scaling={**LLAMA3_SCALING, "low_freq_factor": 4.0})
