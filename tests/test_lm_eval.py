"""lm-evaluation-harness on the project's models, offline: the Hugging Face export read by lm-eval's own `hf` model,
and eval.py --harness (evaluation/harness.py), which scores any checkpoint through the project's model.

- On a full-attention export, lm-eval's `hf` model and ours give each document the log-likelihood eval.py's
  documents task computes, each multiple-choice answer the same log-likelihood and greedy flag, and each prompt
  the same greedy generation.
- A dense-to-NSA conversion of that run exports the same way; lm-eval's `hf` model loads it with
  trust_remote_code and agrees with ours on the same tasks.
- RULER's niah_single_1 runs end to end on the tiny preset with the network switched off.

Both sides compute in float32 with different kernels (transformers' eager attention, ours), so they agree
relatively, not to an absolute number of decimals: a document's log-likelihood is a sum of same-sign per-token
log-probabilities (about -1000 for 300 characters), each from logits that are dot products of width 128 (a few
float32 roundings, eps 6e-8, relative to their magnitude), so the sums agree within a relative 1e-5."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import eval as eval_cli
import train
from evaluation import harness
from storage.weights import load_model
from text.corpus import iter_documents, stdlib_files
from text.tokenizer import model_tokenizer

pytestmark = pytest.mark.slow
lm_eval = pytest.importorskip("lm_eval")

OFFLINE = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
DATA = """dataset_path: json
dataset_kwargs:
  data_files:
    test: {file}
test_split: test
"""
TASKS = {
    "documents": """task: longctx_documents
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{text}}"
metric_list:
  - metric: bits_per_byte
    aggregation: bits_per_byte
    higher_is_better: false
""",
    "choices": """task: longctx_choices
output_type: multiple_choice
doc_to_text: "{{context}}"
doc_to_choice: "{{choices}}"
doc_to_target: 0
metric_list:
  - metric: acc
""",
    "generate": """task: longctx_generate
output_type: generate_until
doc_to_text: "{{context}}"
doc_to_target: "{{answer}}"
generation_kwargs:
  until: ["\\n\\n"]
  max_gen_toks: 8
  do_sample: false
metric_list:
  - metric: exact_match
""",
}


COMMON = ["--context_length", "128", "--batch_size", "2", "--sample_tokens", "0"]


@pytest.fixture(scope="module")
def full_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A full-attention demo run, with model/ and hf/."""
    out = tmp_path_factory.mktemp("full") / "run"
    train.main(["--model_size", "demo", "--max_steps", "2", *COMMON, "--out_dir", str(out)])
    return out


@pytest.fixture(scope="module")
def nsa_run(full_run: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """That run converted to NSA (one step), with model/ and hf/."""
    out = tmp_path_factory.mktemp("nsa") / "run"
    train.main(["--init_from", str(full_run / "model"), "--attention_type", "nsa", "--max_steps", "1", *COMMON,
                "--out_dir", str(out)])
    return out


@pytest.fixture(scope="module")
def task_files(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """lm-eval task files over JSONL data from standard-library documents: rolling log-likelihood, multiple choice
    (the true continuation and two from other documents) and greedy generation."""
    root = tmp_path_factory.mktemp("tasks")
    texts = [text for text in iter_documents(stdlib_files()[100:110]) if len(text) > 300][:5]
    rows = {
        "documents": [{"text": text[:300]} for text in texts],
        "choices": [{"context": text[:150], "choices": [text[150:190], *(other[150:190] for other in texts
                                                                          if other is not text)][:3]}
                    for text in texts],
        "generate": [{"context": text[:200], "answer": text[200:220]} for text in texts],
    }
    for name, task in TASKS.items():
        (root / f"{name}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows[name]))
        (root / f"{name}.yaml").write_text(task + DATA.format(file=root / f"{name}.jsonl"))
    return root


@pytest.fixture(scope="module")
def tasks(task_files: Path) -> tuple[Path, object]:
    """(the task files' directory, lm-eval's task index with them), the index built once for the module."""
    from lm_eval.tasks import TaskManager

    return task_files, TaskManager(include_path=str(task_files))


def samples(out: dict, task: str) -> list:
    """Each document's responses, in document order."""
    return [sample["resps"] for sample in sorted(out["samples"][task], key=lambda s: s["doc_id"])]


def evaluate(model: object, tasks: tuple[Path, object], names: list[str], **kwargs: object) -> dict:
    from lm_eval import simple_evaluate

    return simple_evaluate(model=model, tasks=names, task_manager=tasks[1], log_samples=True, **kwargs)


def ours(run: Path, tasks: tuple[Path, object], names: list[str]) -> dict:
    model = load_model(run / "model")
    lm = harness.harness_lm(model, model_tokenizer(run / "model", None, ()), model.config.context_length, 4)
    return evaluate(lm, tasks, names)


def assert_same_responses(theirs: dict, ours: dict, task: str) -> None:
    for mine, other in zip(samples(ours, task), samples(theirs, task), strict=True):
        for (ll, greedy), (their_ll, their_greedy) in zip((r[0] for r in mine), (r[0] for r in other), strict=True):
            assert ll == pytest.approx(their_ll, rel=1e-5, abs=0) and greedy == their_greedy


@pytest.mark.parametrize("kind", ["full", "nsa"])
def test_lm_eval_scores_the_export_as_the_project_does(request, tasks, kind, monkeypatch):
    """lm-eval's `hf` model on RUN/hf (trust_remote_code for NSA) and our harness model on RUN/model give the same
    log-likelihoods, greedy flags and generations; both give each document eval.py's log-likelihood."""
    for name, value in OFFLINE.items():
        monkeypatch.setenv(name, value)
    run = request.getfixturevalue(f"{kind}_run")
    names = ["longctx_documents", "longctx_choices", "longctx_generate"]
    theirs = evaluate("hf", tasks, names, model_args=f"pretrained={run / 'hf'},trust_remote_code=True",
                      device="cpu", batch_size=1)
    mine = ours(run, tasks, names)
    documents = eval_cli.main([str(run / "model"), "--tasks", "documents", "--documents",
                                 str(tasks[0] / "documents.jsonl"), "--out_dir", str(run / "eval")])["documents"]
    for out in (theirs, mine):
        rolling = [resps[0][0] for resps in samples(out, "longctx_documents")]
        assert rolling == pytest.approx([d["loglikelihood"] for d in documents["documents"]], rel=1e-5, abs=0)
        assert out["results"]["longctx_documents"]["bits_per_byte,none"] == pytest.approx(
            documents["bits_per_byte"], rel=1e-5)
    assert_same_responses(theirs, mine, "longctx_choices")
    assert samples(mine, "longctx_generate") == samples(theirs, "longctx_generate")
    assert all(resps[0][0] for resps in samples(mine, "longctx_generate"))  # something was generated


@pytest.fixture(scope="module")
def ruler_run(data_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny NSA run at 512 tokens (one step), with model/ and hf/."""
    out = tmp_path_factory.mktemp("ruler") / "run"
    train.main(["--model_size", "tiny", "--attention_type", "nsa", "--context_length", "512", "--batch_size", "1",
                "--max_steps", "1", "--sample_tokens", "0", "--data_dir", str(data_dir), "--out_dir", str(out)])
    return out


def test_ruler_runs_offline_through_eval_py(ruler_run, monkeypatch, capsys):
    """RULER's niah_single_1 builds its prompts from the run's tokenizer and scores an NSA tiny model at a short
    length, with the network off; its score lands in eval.json and the table."""
    for name, value in OFFLINE.items():
        monkeypatch.setenv(name, value)
    results = eval_cli.main([str(ruler_run / "model"), "--harness", "niah_single_1", "--lengths", "448",
                             "--samples", "2"])
    assert list(results["harness"]) == ["niah_single_1"]
    assert 0 <= results["harness"]["niah_single_1"]["448"] <= 1
    written = json.loads((ruler_run / "eval-model" / "eval.json").read_text())
    assert written["harness"] == results["harness"]
    assert "niah_single_1" in capsys.readouterr().out


def test_ruler_at_batch_size_4_equals_batch_size_1(ruler_run, monkeypatch, tmp_path):
    """RULER's niah_single_1 at 448 tokens, 6 prompts of different token lengths: lm-eval's `hf` model on the NSA
    export (its generate pads on the left) and ours (eval.py --harness's) each generate at batch size 4 what they
    generate at batch size 1, and the two agree."""
    from lm_eval import simple_evaluate

    for name, value in OFFLINE.items():
        monkeypatch.setenv(name, value)
    model = load_model(ruler_run / "model")
    tokenizer = model_tokenizer(ruler_run / "model", None, ())
    (tmp_path / "tokenizer").mkdir()
    tokenizer.save(tmp_path / "tokenizer", 512)
    metadata = {"tokenizer": str(tmp_path / "tokenizer"), "max_seq_lengths": [448]}
    hf_args = f"pretrained={ruler_run / 'hf'},tokenizer={tmp_path / 'tokenizer'},trust_remote_code=True"

    def responses(batch_size: int, export: bool) -> list:
        lm = "hf" if export else harness.harness_lm(model, tokenizer, 512, batch_size)
        kwargs = {"model_args": hf_args, "batch_size": batch_size, "device": "cpu"} if export else {}
        with harness.no_downloads(["niah_single_1"]):
            out = simple_evaluate(model=lm, tasks=["niah_single_1"], limit=6, metadata=metadata, log_samples=True,
                                  **kwargs)
        found = sorted(out["samples"]["niah_single_1"], key=lambda s: s["doc_id"])
        assert len({len(tokenizer.encode(s["arguments"][0][0])) for s in found}) > 1  # so batches are padded
        return [s["resps"] for s in found]

    ours_1 = responses(1, export=False)
    assert responses(4, export=False) == ours_1
    assert responses(4, export=True) == responses(1, export=True) == ours_1
