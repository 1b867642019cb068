"""An NSA export loads in transformers with trust_remote_code: the export carries the project's own modules (their
imports made relative), so `AutoModelForCausalLM` runs the same code on the same weights. Logits are compared
exactly (the same operations in the same order) and greedy generations token for token, on every NSA option:
compressor, separate or shared K/V, block geometry, tied or separate output weights."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest
import torch

from model import Transformer
from modeling.config import ModelConfig
from storage.hf import export_hf_checkpoint, load_hf_checkpoint
from storage.remote_code import MODELING_FILE, PROJECT, remote_code_files

transformers = pytest.importorskip("transformers")

NSA_OPTIONS = {
    "paper": {},  # the tiny preset: MLP compressor, separate K/V
    "mean-shared": {"nsa_compressor": "mean", "nsa_separate_kv": False},
    "blocks": {"nsa_block_size": 8, "nsa_stride": 4, "nsa_select_block_size": 16, "nsa_num_selected": 3,
               "nsa_window": 16, "tie_embeddings": False},
}


def test_the_code_an_export_carries_imports_nothing_of_the_project_by_name():
    """Every carried file imports project modules relatively, and each one it imports is carried: the export
    needs neither this repository nor its installation."""
    files = remote_code_files()
    assert MODELING_FILE in files and "model.py" in files and "nsa_layer.py" in files
    for name, source in files.items():
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.ImportFrom) and node.level == 0:
                assert node.module.split(".")[0] not in PROJECT, f"{name}: from {node.module} import"
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                assert f"{node.module}.py" in files, f"{name} imports {node.module}, which is not carried"


@pytest.mark.parametrize("options", NSA_OPTIONS.values(), ids=NSA_OPTIONS.keys())
def test_transformers_runs_the_nsa_export_as_the_project_does(tmp_path: Path, options: dict):
    model = Transformer(ModelConfig.from_preset("tiny", attention_type="nsa", **options)).eval()
    export_hf_checkpoint(model, tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["architectures"] == ["LongctxForCausalLM"] and config["auto_map"]
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", trust_remote_code=True).eval()
    ids = torch.randint(0, model.config.vocab_size, (2, 70))  # past the window: every branch reads
    with torch.no_grad():
        torch.testing.assert_close(theirs(ids).logits, model(ids).logits, rtol=0, atol=0)
        ours_back = load_hf_checkpoint(tmp_path / "hf")  # the project reads the export too
        torch.testing.assert_close(ours_back(ids).logits, model(ids).logits, rtol=0, atol=0)
    prompt = ids[:1, :40]
    greedy = theirs.generate(prompt, max_new_tokens=12, do_sample=False, attention_mask=torch.ones_like(prompt))
    assert greedy.tolist() == model.generate(prompt, 12, temperature=0.0).tolist()
    with pytest.raises(ValueError, match="takes no padding mask"):
        theirs(ids, attention_mask=torch.tensor([[0] + [1] * 69, [1] * 70]))
    assert (theirs.model.lm_head.weight is theirs.model.embed_tokens.weight) == model.config.tie_embeddings
    theirs.save_pretrained(tmp_path / "again")  # transformers' own save (a tied output weight left out) reads back
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "again", trust_remote_code=True)
    with torch.no_grad():
        torch.testing.assert_close(again(ids).logits, model(ids).logits, rtol=0, atol=0)
        torch.testing.assert_close(load_hf_checkpoint(tmp_path / "again")(ids).logits, model(ids).logits, rtol=0,
                                   atol=0)
