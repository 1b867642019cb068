"""lm-evaluation-harness reads a run's Hugging Face export with no extra arguments (its tokenizer, special ids and
context come with it): offline, on a local task of documents from a JSONL file (loglikelihood_rolling), every
document's log-likelihood equals eval.py's documents task to float32 precision.

Both sides compute in float32 with different kernels (transformers' eager attention, ours), so they agree
relatively, not to an absolute number of decimals: a document's log-likelihood is a sum of same-sign per-token
log-probabilities (about -1000 for 300 characters), each from logits that are dot products of width 128 (a few
float32 roundings, eps 6e-8, relative to their magnitude), so the sums agree within a relative 1e-5."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import eval as evaluation
import train
from text.corpus import iter_documents, stdlib_files

pytestmark = pytest.mark.slow
lm_eval = pytest.importorskip("lm_eval")

TASK = """task: longctx_documents
dataset_path: json
dataset_kwargs:
  data_files:
    test: {documents}
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
metric_list:
  - metric: bits_per_byte
    aggregation: bits_per_byte
    higher_is_better: false
"""


def test_lm_eval_scores_the_export_as_eval_py_does(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    train.main(["--model_size", "demo", "--context_length", "128", "--batch_size", "2", "--max_steps", "2",
                "--sample_tokens", "0", "--out_dir", str(tmp_path / "run")])
    documents = tmp_path / "documents.jsonl"
    documents.write_text("".join(json.dumps({"text": text[:300]}) + "\n"
                                 for text in iter_documents(stdlib_files()[100:105])))
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "documents.yaml").write_text(TASK.format(documents=documents))
    hf = tmp_path / "run" / "hf"

    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    theirs = simple_evaluate(model="hf", model_args=f"pretrained={hf}", tasks=["longctx_documents"],
                             task_manager=TaskManager(include_path=str(tmp_path / "tasks")), device="cpu",
                             batch_size=1, log_samples=True)
    ours = evaluation.main([str(hf), "--tasks", "documents", "--documents", str(documents), "--out_dir",
                            str(tmp_path / "eval")])["documents"]
    samples = sorted(theirs["samples"]["longctx_documents"], key=lambda sample: sample["doc_id"])
    assert len(samples) == len(ours["documents"]) == 5
    for sample, document in zip(samples, ours["documents"], strict=True):
        assert sample["resps"][0][0] == pytest.approx(document["loglikelihood"], rel=1e-5, abs=0)
    assert theirs["results"]["longctx_documents"]["bits_per_byte,none"] == pytest.approx(ours["bits_per_byte"],
                                                                                          rel=1e-6)
