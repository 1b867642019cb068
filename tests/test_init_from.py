"""train.py --init_from: a tiny Qwen3 saved by transformers, with a Hugging Face tokenizer.json, is trained from its
weights. The first step's loss (before any update) equals the loss transformers computes on the same batch, in one
process and sharded over two gloo ranks (weights read by rank 0 and broadcast); the run's data is tokenized with the
model's own tokenizer, and --rope_theta and the context length change the architecture's RoPE only."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from distributed import run_distributed

import train
from text.shards import TokenLoader
from training import trainer

transformers = pytest.importorskip("transformers")

T, B = 32, 2  # the qwen3 fixture's data (conftest.py) is read in windows of T tokens


def transformers_first_loss(model_dir: Path, data_dir: Path) -> float:
    """transformers' loss on the first batch the run sees (rank 0 of 1 and ranks 0 and 1 of 2 together)."""
    model = transformers.Qwen3ForCausalLM.from_pretrained(model_dir, attn_implementation="eager").float().eval()
    input_ids, labels = next(TokenLoader(data_dir, T, B, 0, 1, 0))
    with torch.no_grad():
        return model(input_ids=input_ids, labels=labels).loss.item()


def run(model_dir: Path, data_dir: Path, out_dir: Path, *extra: str) -> dict:
    return train.main(["--init_from", str(model_dir), "--data_dir", str(data_dir), "--out_dir", str(out_dir),
                       "--context_length", str(T), "--batch_size", str(B), "--max_steps", "1", "--sample_tokens", "4",
                       "--dtype", "float32", *extra])


def test_first_step_loss_equals_transformers(qwen3: tuple[Path, Path], tmp_path: Path):
    model_dir, data_dir = qwen3
    first = run(model_dir, data_dir, tmp_path / "run")
    # float32 in both (different kernels): a mean of per-token losses of about 6, relatively within 1e-5
    assert first["loss"] == pytest.approx(transformers_first_loss(model_dir, data_dir), rel=1e-5, abs=0)
    resolved = json.loads((tmp_path / "run" / "config.json").read_text())
    assert resolved["model"]["vocab_size"] == 448 and resolved["model"]["context_length"] == T
    assert resolved["train"]["tokenizer"] == str(model_dir / "tokenizer.json") and resolved["train"]["lr"] == 2e-5


def _sharded_first_loss(model_dir: str, data_dir: str, out_dir: str, results: str) -> None:
    metrics = run(Path(model_dir), Path(data_dir), Path(out_dir), "--batch_size", "1")
    if os.environ["RANK"] == "0":
        Path(results).write_text(json.dumps(metrics))


@pytest.mark.slow
def test_sharded_start_broadcasts_the_weights(qwen3: tuple[Path, Path], tmp_path: Path):
    """Two ranks x 1 sequence see the single process's batch of 2: the same first loss, the weights read by rank 0
    only and broadcast into FSDP2's shards."""
    model_dir, data_dir = qwen3
    results = tmp_path / "metrics.json"
    run_distributed(_sharded_first_loss, str(model_dir), str(data_dir), str(tmp_path / "run"), str(results))
    loss = json.loads(results.read_text())["loss"]
    assert loss == pytest.approx(transformers_first_loss(model_dir, data_dir), rel=1e-5, abs=0)


def test_rope_theta_and_context_change_only_rope(qwen3: tuple[Path, Path], tmp_path: Path):
    model_dir, data_dir = qwen3
    run(model_dir, data_dir, tmp_path / "run", "--rope_theta", "4e6")
    resolved = json.loads((tmp_path / "run" / "config.json").read_text())["model"]
    assert resolved["rope_theta"] == 4e6 and resolved["n_layers"] == 2 and resolved["head_dim"] == 16
    from modeling.config import ModelConfig
    from training import options as train_config

    cfg = train_config.TrainConfig(init_from=str(model_dir), attention_type="full", context_length=T)
    with pytest.raises(ValueError, match="only full -> nsa is converted"):
        train_config.build_model_config(cfg, 400, stored=ModelConfig.from_preset("tiny", attention_type="nsa"))


def test_extending_the_context_of_an_export_with_yarn(data_dir: Path, tmp_path: Path):
    """The README's CPU recipe: train at 64 tokens, then continue from the export at 256 with YaRN (factor 4)."""
    base = ["--model_size", "tiny", "--data_dir", str(data_dir), "--batch_size", "2", "--max_steps", "2",
            "--sample_tokens", "0"]
    train.main([*base, "--context_length", "64", "--out_dir", str(tmp_path / "short")])
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
    metrics = train.main([*base, "--context_length", "256", "--init_from", str(tmp_path / "short" / "model"),
                          "--rope_scaling", json.dumps(yarn), "--out_dir", str(tmp_path / "long")])
    resolved = json.loads((tmp_path / "long" / "config.json").read_text())["model"]
    assert resolved["rope_scaling"] == yarn and resolved["context_length"] == 256 and metrics["step"] == 2


def test_dense_weights_start_an_nsa_model_close_to_the_dense_one():
    """Within the window the converted layer is the dense layer up to the gates (sigmoid(8) on the window branch);
    beyond it, the window alone differs."""
    import dataclasses

    from model import Transformer
    from modeling.config import ModelConfig
    from nsa.from_dense import FRESH, nsa_state_from_dense

    torch.manual_seed(0)
    dense = Transformer(ModelConfig.from_preset("tiny")).double()
    nsa_config = dataclasses.replace(dense.config, attention_type="nsa")
    nsa = Transformer(nsa_config).double()
    missing, unexpected = nsa.load_state_dict(nsa_state_from_dense(dense.state_dict(), nsa_config), strict=False)
    assert not unexpected and missing and all(any(f in name for f in FRESH) for name in missing)
    inside = torch.randint(0, 512, (2, nsa_config.nsa_window))
    gap = (nsa(inside).logits - dense(inside).logits).abs().max()
    assert gap < 2e-2 * dense(inside).logits.abs().max()
    beyond = torch.randint(0, 512, (2, 8 * nsa_config.nsa_window))
    assert (nsa(beyond).logits - dense(beyond).logits).abs().max() > gap


def test_a_dense_export_continues_as_nsa(data_dir: Path, tmp_path: Path):
    base = ["--model_size", "tiny", "--data_dir", str(data_dir), "--batch_size", "2", "--max_steps", "2",
            "--sample_tokens", "4", "--context_length", "64"]
    train.main([*base, "--out_dir", str(tmp_path / "dense")])
    metrics = train.main([*base, "--init_from", str(tmp_path / "dense" / "model"), "--attention_type", "nsa",
                          "--out_dir", str(tmp_path / "nsa")])
    assert json.loads((tmp_path / "nsa" / "config.json").read_text())["model"]["attention_type"] == "nsa"
    assert metrics["step"] == 2


def test_equivalence_training_starts_from_pretrained_weights(qwen3: tuple[Path, Path], tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch):
    """train_npt.py shares train.py's --init_from: after training, the converted model's frozen base is
    the stored model, weight for weight."""
    from storage.weights import load_model
    from train_npt import main

    loaded = []
    original = trainer.load_initial_weights

    def spy(model, *args, **kwargs):
        loaded.append(model)
        return original(model, *args, **kwargs)

    monkeypatch.setattr(trainer, "load_initial_weights", spy)
    model_dir, data_dir = qwen3
    main(["--config", "configs/npt_tiny.json", "--model_size", "auto", "--init_from", str(model_dir),  # its size
          "--data_dir", str(data_dir),
          "--out_dir", str(tmp_path), "--context_length", str(T), "--batch_size", "2", "--max_steps", "2",
          "--sample_tokens", "0"])
    stored = load_model(model_dir).state_dict()
    trained = loaded[0].state_dict()
    assert all(torch.equal(trained[name], value) for name, value in stored.items())
    assert any(".np." in name for name in trained)
