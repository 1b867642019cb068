"""lora.py and train.py --finetune lora: an adapted model starts equal to its base, merging changes no output, only
the adapters train and are checkpointed, the adapters are written in peft's layout (peft itself reads them into the
transformers model and gives our logits), and --adapter loads only them."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from distributed import run_distributed
from safetensors.torch import load_file
from test_init_from import T
from torch.distributed.checkpoint import FileSystemReader

import train
from model import Transformer
from modeling.config import ModelConfig
from training.lora import apply_lora, init_lora, lora_layers, merge_lora_
from training.modes import settle_mode
from training.options import TrainConfig


def test_adapters_start_at_the_base_and_merge_exactly():
    torch.manual_seed(0)
    model = Transformer(ModelConfig.from_preset("tiny")).double()
    ids = torch.randint(0, 512, (2, 24))
    base = model(ids).logits
    adapted = apply_lora(model, rank=4, alpha=8, targets=("q", "v", "down"))
    assert adapted[:3] == ["layers.0.attn.q_proj", "layers.0.attn.v_proj", "layers.0.mlp.down_proj"]
    init_lora(model, seed=0)
    assert torch.equal(model(ids).logits, base)  # B = 0
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == {f"{m}.lora_{x}.weight" for m in adapted for x in "AB"}
    for layer in lora_layers(model).values():
        layer.lora_B.weight.data.normal_(std=0.1)
    before = model(ids).logits
    assert (before - base).abs().max() > 1e-3
    merge_lora_(model)
    torch.testing.assert_close(model(ids).logits, before, rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="non-empty subset"):
        apply_lora(Transformer(ModelConfig.from_preset("tiny")), targets=("qq",))


def test_lora_run_trains_and_checkpoints_only_the_adapters(qwen3, tmp_path: Path):
    model_dir, data_dir = qwen3
    run = ["--init_from", str(model_dir), "--data_dir", str(data_dir), "--context_length", str(T), "--batch_size", "2",
           "--sample_tokens", "4", "--finetune", "lora", "--lr", "1e-2", "--warmup_steps", "1"]
    train.main([*run, "--max_steps", "3", "--checkpoint_interval", "2", "--out_dir", str(tmp_path / "a")])
    saved = FileSystemReader(tmp_path / "a" / "step-2").read_metadata().state_dict_metadata
    model_keys = {k.removeprefix("model.") for k in saved if k.startswith("model.")}
    assert model_keys and all(".lora_" in k for k in model_keys)  # no base weight in the checkpoint
    adapter = load_file(tmp_path / "a" / "adapter" / "adapter_model.safetensors")
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in adapter
    assert adapter["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"].shape == (16, 64)
    config = json.loads((tmp_path / "a" / "adapter" / "adapter_config.json").read_text())
    assert (config["peft_type"], config["r"], config["lora_alpha"]) == ("LORA", 16, 32.0)
    assert config["target_modules"] == ["k_proj", "o_proj", "q_proj", "v_proj"]
    # Resume: the base comes from --init_from again, the adapters and AdamW from the checkpoint; bitwise.
    resumed = train.main([*run, "--max_steps", "3", "--out_dir", str(tmp_path / "a"), "--resume",
                          str(tmp_path / "a" / "step-2")])
    straight = train.main([*run, "--max_steps", "3", "--out_dir", str(tmp_path / "b")])
    assert resumed["loss"] == straight["loss"]
    # --adapter loads only the adapters onto the base: the merged export equals the adapted model.
    train.main([*run, "--max_steps", "1", "--lr", "1e-12", "--adapter", str(tmp_path / "a" / "adapter"), "--merge",
                "--out_dir", str(tmp_path / "c")])
    merged = load_file(tmp_path / "c" / "model" / "model.safetensors")
    assert not any(".lora_" in k for k in merged)
    # The adapters' own rank, alpha and targets are read from adapter_config.json; a different one given is refused.
    geometry = ["--lora_rank", "4", "--lora_alpha", "8", "--lora_targets", "q,v,up"]
    train.main([*run, "--max_steps", "1", *geometry, "--out_dir", str(tmp_path / "d")])
    tuned = train.main([*run, "--max_steps", "1", "--adapter", str(tmp_path / "d" / "adapter"),
                        "--out_dir", str(tmp_path / "e")])
    assert tuned["step"] == 1
    config = json.loads((tmp_path / "e" / "adapter" / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["target_modules"]) == (4, 8.0, ["q_proj", "up_proj", "v_proj"])
    with pytest.raises(ValueError, match="--lora_rank 8 differs from the adapters in .* \\(4\\); leave it out"):
        settle_mode(TrainConfig(finetune="lora", lora_rank=8, adapter=str(tmp_path / "d" / "adapter")))
    with pytest.raises(ValueError, match="--lora_rank 16 differs from the adapters in .* \\(4\\)"):  # its default
        train.main([*run, "--max_steps", "1", "--lora_rank", "16", "--adapter", str(tmp_path / "d" / "adapter"),
                    "--out_dir", str(tmp_path / "f")])
    assert not (tmp_path / "f").exists()


def _lora_run(model_dir: str, data_dir: str, out_dir: str, batch: str, results: str | None = None) -> None:
    metrics = train.main(["--init_from", model_dir, "--data_dir", data_dir, "--context_length", str(T), "--batch_size",
                          batch, "--sample_tokens", "4", "--finetune", "lora", "--lr", "1e-2", "--warmup_steps", "1",
                          "--max_steps", "3", "--merge", "--out_dir", out_dir])
    if results and os.environ.get("RANK", "0") == "0":
        Path(results).write_text(json.dumps(metrics))


@pytest.mark.slow
def test_lora_under_fsdp_matches_one_process(qwen3, tmp_path: Path):
    """Two gloo ranks x 1 sequence against one process x 2: the adapters train the same (losses within float32
    summation order) and the merged exports agree."""
    model_dir, data_dir = (str(p) for p in qwen3)
    _lora_run(model_dir, data_dir, str(tmp_path / "one"), "2", str(tmp_path / "one.json"))
    run_distributed(_lora_run, model_dir, data_dir, str(tmp_path / "two"), "1", str(tmp_path / "two.json"))
    one, two = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("one", "two"))
    assert two["loss"] == pytest.approx(one["loss"], rel=1e-5, abs=0)
    a, b = (load_file(tmp_path / n / "model" / "model.safetensors") for n in ("one", "two"))
    assert all(torch.allclose(a[k], b[k], atol=1e-5) for k in a)


@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated")
def test_peft_reads_our_adapters(qwen3, tmp_path: Path):
    """transformers + peft load the base and our adapter directory and compute our adapted model's logits."""
    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    model_dir, data_dir = qwen3
    train.main(["--init_from", str(model_dir), "--data_dir", str(data_dir), "--context_length", str(T),
                "--batch_size", "2", "--sample_tokens", "0", "--finetune", "lora", "--lr", "1e-2", "--warmup_steps",
                "1", "--max_steps", "2", "--merge", "--out_dir", str(tmp_path)])
    hf = transformers.Qwen3ForCausalLM.from_pretrained(model_dir, attn_implementation="eager").float().eval()
    adapted = peft.PeftModel.from_pretrained(hf, tmp_path / "adapter").eval()  # adapts hf in place
    merged = transformers.Qwen3ForCausalLM.from_pretrained(tmp_path / "hf", attn_implementation="eager").float()
    ids = torch.randint(0, 400, (1, T))
    with torch.no_grad():
        torch.testing.assert_close(adapted(input_ids=ids).logits, merged.eval()(input_ids=ids).logits, rtol=0,
                                   atol=1e-4)
        base = transformers.Qwen3ForCausalLM.from_pretrained(model_dir, attn_implementation="eager").float().eval()
        assert (adapted(input_ids=ids).logits - base(input_ids=ids).logits).abs().max() > 1e-4  # adapters matter


@pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning")
@pytest.mark.parametrize("kind, share", [("int8", 0.27), ("nf4", 0.14), ("int4", 0.31)])
def test_a_quantized_base_is_smaller_and_close(kind: str, share: float):
    """Block linear weights to `share` of their float32 bytes (int8 per channel; nf4 two per byte in blocks of 64;
    int4 in groups of 32, kept one per byte on the CPU by torchao), the loss within 1% of the float base's, and
    gradients for the adapters only."""
    pytest.importorskip("torchao")
    from training.quantize import parameter_bytes, quantize_base

    torch.manual_seed(0)
    model = Transformer(ModelConfig.from_preset("tiny", dim=128, ffn_dim=384, head_dim=32))
    apply_lora(model)
    init_lora(model, seed=0)
    for layer in lora_layers(model).values():
        layer.lora_B.weight.data.normal_(std=0.02)
    ids = torch.randint(0, 512, (2, 32))
    reference = model(ids, labels=ids).loss
    blocks = parameter_bytes(model.layers) - sum(p.numel() * 4 for n, p in model.layers.named_parameters()
                                                 if ".lora_" in n or "norm" in n)
    quantize_base(model, kind)
    quantized = parameter_bytes(model.layers) - sum(p.numel() * 4 for n, p in model.layers.named_parameters()
                                                    if ".lora_" in n or "norm" in n)
    assert quantized <= share * blocks
    loss = model(ids, labels=ids).loss
    assert abs(loss.item() - reference.item()) < 0.01 * reference.item()
    loss.backward()
    assert {n for n, p in model.named_parameters() if p.grad is not None} == {
        n for n in dict(model.named_parameters()) if ".lora_" in n}


@pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning")
def test_lora_runs_on_a_quantized_base(qwen3, tmp_path: Path):
    """train.py on an int8 and an nf4 base: the first losses within 1% of the float base's, adapters saved."""
    pytest.importorskip("torchao")
    model_dir, data_dir = qwen3
    run = ["--init_from", str(model_dir), "--data_dir", str(data_dir), "--context_length", str(T), "--batch_size", "2",
           "--sample_tokens", "4", "--finetune", "lora", "--max_steps", "2", "--warmup_steps", "1"]
    full = train.main([*run, "--out_dir", str(tmp_path / "float")])
    for kind in ("int8", "nf4"):
        quantized = train.main([*run, "--quantize_base", kind, "--out_dir", str(tmp_path / kind)])
        assert abs(quantized["loss"] - full["loss"]) < 0.01 * full["loss"]
        assert (tmp_path / kind / "adapter" / "adapter_model.safetensors").is_file()
    with pytest.raises(ValueError, match="--merge folds the adapters into the base"):  # needs a float base
        train.main([*run, "--quantize_base", "int8", "--merge", "--out_dir", str(tmp_path / "x")])
