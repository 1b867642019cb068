"""weights.py: runs of every attention type end with an export and a sample (single process and 2 gloo ranks), and
`load_model` reads the three layouts (training checkpoint, the project's export, Hugging Face) into models whose
logits equal the trained model's exactly (float32, same weights, same maths)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from distributed import run_distributed

import train
from model import Transformer
from modeling.config import ComputeConfig, ModelConfig
from storage.weights import export_model, load_model

NSA_RUN = ["--model_size", "tiny", "--attention_type", "nsa", "--context_length", "64", "--batch_size", "2",
           "--max_steps", "2", "--warmup_steps", "1", "--checkpoint_interval", "2", "--sample_tokens", "6",
           "--log_interval", "100"]


def _logits(model: Transformer, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits


def test_nsa_run_finishes_with_export_and_sample(data_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture):
    train.main([*NSA_RUN, "--data_dir", str(data_dir), "--out_dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert f"exported {tmp_path / 'model'}, {tmp_path / 'hf'}" in out and "no hf/ directory" not in out
    assert "--- sample (6 tokens" in out
    assert {"modeling_longctx.py", "tokenizer.json", "generation_config.json", "manifest.json"} <= {
        p.name for p in (tmp_path / "hf").iterdir()}  # what a full-attention export holds, and its code
    described = json.loads((tmp_path / "model" / "config.json").read_text())
    assert ModelConfig.from_dict(described["model"]).attention_type == "nsa"
    ids = torch.randint(0, 512, (1, 40))
    from_step, from_export = load_model(tmp_path / "step-2"), load_model(tmp_path / "model")
    torch.testing.assert_close(_logits(from_step, ids), _logits(from_export, ids), rtol=0, atol=0)
    torch.testing.assert_close(_logits(load_model(tmp_path / "hf"), ids), _logits(from_export, ids), rtol=0, atol=0)
    from_file = load_model(tmp_path / "model" / "model.safetensors", compute=ComputeConfig(attention_query_chunk=8))
    torch.testing.assert_close(_logits(from_file, ids), _logits(from_export, ids), rtol=1e-6, atol=1e-6)


@pytest.mark.slow
def test_nsa_run_finishes_on_two_ranks(data_dir: Path, tmp_path: Path):
    run_distributed(train.main, [*NSA_RUN, "--data_dir", str(data_dir), "--out_dir", str(tmp_path)])
    assert (tmp_path / "model" / "model.safetensors").is_file() and (tmp_path / "step-2").is_dir()


def test_three_layouts_load_the_same_model(tmp_path: Path):
    torch.manual_seed(0)
    model = Transformer(ModelConfig.from_preset("tiny"))
    written = export_model(model, tmp_path)
    assert written == [tmp_path / "model", tmp_path / "hf"]
    ids = torch.randint(0, 512, (2, 24))
    want = _logits(model, ids)
    for path in (tmp_path / "model", tmp_path / "model" / "model.safetensors", tmp_path / "hf"):
        loaded = load_model(path)
        assert loaded.lm_head.weight is loaded.embed_tokens.weight, path  # tied again
        torch.testing.assert_close(_logits(loaded, ids), want, rtol=0, atol=0, msg=str(path))
    assert load_model(tmp_path / "model", dtype=torch.bfloat16).embed_tokens.weight.dtype == torch.bfloat16


def test_not_a_model_is_a_clear_error(tmp_path: Path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_model(tmp_path / "missing")
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(ValueError, match="is not a model: expected a training checkpoint step-N/"):
        load_model(tmp_path)
    (tmp_path / "config.json").write_text('{"vocab_size": 10}')  # neither an export's nor a Hugging Face config
    with pytest.raises(ValueError, match="is not a model: expected a training checkpoint step-N/"):
        load_model(tmp_path)


def test_a_run_directory_points_to_its_export(data_dir: Path, tmp_path: Path):
    train.main([*NSA_RUN, "--sample_tokens", "0", "--data_dir", str(data_dir), "--out_dir", str(tmp_path)])
    with pytest.raises(ValueError, match=r"did you mean .*/model \(a run's export\)\?"):
        load_model(tmp_path)  # holds train.py's config.json and step-N/, the weights are in model/
