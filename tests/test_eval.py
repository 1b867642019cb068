"""eval.py: the scorer on known answers, prompts of exact length with the needle at the asked depth, loss by position
against a plain full-logits computation, and the command end to end on runs of every attention type (the test-only
sliding-window type included) in all three checkpoint layouts."""

from __future__ import annotations

import contextlib
import json
import math
import random
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import eval as eval_cli
import train
from evaluation import loss, recall, retrieval
from model import ModelConfig, Transformer
from storage.weights import load_model
from text.synthetic import PromptBuilder, SyntheticDocuments
from text.tokenizer import Tokenizer


def test_scorer_reads_the_first_number():
    assert retrieval.is_correct(" 48213. Remember", "48213")
    assert retrieval.is_correct("48213", "48213")
    assert not retrieval.is_correct(" 4821", "48213")  # a prefix is wrong
    assert not retrieval.is_correct(" 482130", "48213")  # so is a longer number
    assert not retrieval.is_correct(" 11 and 48213", "48213")  # only the first number counts
    assert not retrieval.is_correct(" the pass key", "48213")


@pytest.fixture(scope="module")
def builder(data_dir: Path) -> PromptBuilder:
    return PromptBuilder(Tokenizer(data_dir / "tokenizer.model"))


@pytest.mark.parametrize("task", ["passkey", "needle"])
def test_prompts_have_the_exact_length_and_the_needle_at_its_depth(builder, task):
    make = builder.passkey if task == "passkey" else builder.needle
    for depth in (0.0, 0.5, 1.0):
        a, b = make(300, depth, random.Random(1)), make(300, depth, random.Random(1))
        assert a == b and len(a.ids) == 300  # deterministic from the seed
        text_after = builder.tokenizer.decode(a.ids[a.needle_start:])
        assert a.answer in text_after.split("?")[0]  # the queried needle starts at needle_start
        before = builder.tokenizer.decode(a.ids[:a.needle_start])
        assert a.answer not in before
        assert before.endswith((".", "it.", "them.")), before[-30:]  # between sentences, never inside a word
    early, middle, late = (make(300, depth, random.Random(2)) for depth in (0.0, 0.5, 1.0))
    assert early.needle_start < 100 < middle.needle_start < 200 < late.needle_start  # filler before and after
    with pytest.raises(ValueError, match="cannot hold the task's text"):
        make(20, 0.5, random.Random(0))


def test_loss_by_position_matches_full_logits():
    model = Transformer(ModelConfig.from_preset("tiny")).to(torch.float64).eval()
    windows = torch.randint(0, 512, (3, 700))  # more positions than one LOSS_CHUNK
    result = loss.loss_by_position(model, windows, batch_size=2)
    with torch.no_grad():
        logits = model(windows).logits  # (3, 700, V)
    want = F.cross_entropy(logits[:, :-1].flatten(0, 1), windows[:, 1:].flatten(), reduction="none").view(3, -1)
    torch.testing.assert_close(torch.tensor(result["positions"], dtype=torch.float64), want.mean(0),
                               rtol=1e-10, atol=1e-10)
    assert [(b["start"], b["end"]) for b in result["buckets"]][:3] == [(0, 1), (1, 3), (3, 7)]
    assert result["buckets"][-1]["end"] == 699 and result["tokens"] == 3 * 699


@pytest.mark.slow
@pytest.mark.parametrize("attention", ["full", "nsa", "swa"])
def test_eval_runs_on_every_attention_type(attention, swa, data_dir, tmp_path):
    train.main(["--model_size", "tiny", "--attention_type", attention, "--context_length", "512", "--batch_size", "2",
                "--max_steps", "1", "--sample_tokens", "0", "--data_dir", str(data_dir), "--out_dir", str(tmp_path)])
    layouts = [tmp_path / "model", tmp_path / "step-1"] + ([tmp_path / "hf"] if attention == "full" else [])
    for checkpoint in layouts:
        out = tmp_path / f"eval-{checkpoint.name}"
        args = [str(checkpoint), "--lengths", "320", "496", "--depths", "0", "1", "--samples", "3", "--batch_size",
                "2", "--eval_tokens", "1100", "--out_dir", str(out)]
        if checkpoint.name == "hf":
            args += ["--data_dir", str(data_dir)]
        results = eval_cli.main(args)
        assert results == json.loads((out / "eval.json").read_text())
        assert results["attention_type"] == attention and results["loss"]["tokens"] == 2 * 511
        for task in ("passkey", "needle"):
            grid = results[task]
            assert len(grid["accuracy"]) == 2 and all(0 <= a <= 1 for row in grid["accuracy"] for a in row)
            assert (out / f"{task}.png").read_bytes()[:4] == b"\x89PNG"
        assert (out / "loss_by_position.png").is_file()


class CopyOracle:
    """Stands in for a model in eval's scorers: at each position it predicts the token that followed the latest
    earlier occurrence of the current token within `window` positions (an induction head with a reach), else token
    0; logits are 10 x one-hot. Its scores are known exactly."""

    def __init__(self, vocab: int, window: int = 10**9) -> None:
        self.vocab, self.window = vocab, window
        self.embed_tokens = torch.nn.Embedding(1, 1)

    def hidden_states(self, ids: torch.Tensor, doc_start: None = None) -> torch.Tensor:
        B, T = ids.shape
        guess = torch.zeros(B, T, dtype=torch.long)
        for b in range(B):
            last: dict[int, int] = {}
            for t in range(T):
                token = ids[b, t].item()
                if token in last and t - last[token] <= self.window:
                    guess[b, t] = ids[b, last[token] + 1]
                last[token] = t
        return F.one_hot(guess, self.vocab).double()  # (B, T, V)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return 10 * hidden


def test_graded_scores_on_known_answers():
    ids = torch.tensor([[5, 6, 7, 5, 6, 7, 9]])  # the second 5 6 7 repeats the first
    scores = retrieval.score_answers(CopyOracle(16), ids, [[4, 5, 6]])[0]
    right_log_prob = -math.log(1 + 15 * math.exp(-10))  # one-hot logits of 10 over 16 tokens
    assert [r for r, _ in scores] == [True, True, False]  # 9 was never seen after a 7
    assert scores[0][1] == pytest.approx(right_log_prob, abs=1e-12)
    assert scores[2][1] == pytest.approx(-10 + right_log_prob, abs=1e-12)
    buckets = recall.distance_buckets([1, 3, 3, 100], [True, False, True, True], [-1.0, -2.0, -4.0, -0.5])
    assert [(b["start"], b["count"], b["accuracy"], b["answer_logprob"]) for b in buckets] == [
        (1, 1, 1.0, -1.0), (2, 2, 0.5, -3.0), (64, 1, 1.0, -0.5)]


def test_mqar_accuracy_by_distance_sees_an_oracles_reach(data_dir):
    """A copy oracle that reaches back 63 tokens scores 100% on answers up to its reach and 0% beyond: the
    instrument the recall experiment reads."""
    documents = SyntheticDocuments("mqar", Tokenizer(data_dir / "tokenizer.model"))
    full = recall.recall_scores(CopyOracle(512), documents, [1024], samples=4, seed=0, batch_size=2)
    assert full["accuracy"] == 1.0 and full["query_accuracy"] == 1.0
    assert [b["start"] for b in full["buckets"]][-1] >= 256  # distances span the document
    near = recall.recall_scores(CopyOracle(512, window=63), documents, [1024], samples=4, seed=0, batch_size=2)
    for bucket in near["buckets"]:
        assert bucket["accuracy"] == (1.0 if bucket["end"] <= 64 else 0.0), bucket


@pytest.mark.parametrize("attention", ["full", "nsa"])
def test_a_recall_document_packed_after_other_text_with_the_mask_scores_as_alone(data_dir, attention):
    """--after_text: each document packed after held-out text and the end-of-document id. With --document_mask its
    answers score exactly as the document opened by that id alone (float64; RoPE's tables at other absolute
    positions round differently, relative 2^-24 per entry: 1e-6 allowed, as tests/test_documents.py); without the
    mask the text before it changes them (by 3e-4 relative here: an untrained model)."""
    tokenizer = Tokenizer(data_dir / "tokenizer.model")
    documents = SyntheticDocuments("mqar", tokenizer)
    torch.manual_seed(0)
    model = Transformer(ModelConfig.from_preset("tiny", vocab_size=tokenizer.vocab_size, context_length=256,
                                                attention_type=attention)).double().eval()
    text = torch.randint(16, tokenizer.vocab_size, (3, 90))  # (N, P): another text before each document
    common = {"lengths": [120], "samples": 4, "seed": 0, "batch_size": 2, "eod_id": tokenizer.eod_id}
    alone = recall.recall_scores(model, documents, before=text[:, :0], **common)
    masked = recall.recall_scores(model, documents, before=text, mask=True, **common)
    plain = recall.recall_scores(model, documents, before=text, **common)
    assert masked["answers"] == alone["answers"] > 0
    assert masked["answer_logprob"] == pytest.approx(alone["answer_logprob"], rel=1e-6)
    assert masked["accuracy"] == alone["accuracy"]
    assert plain["answer_logprob"] != pytest.approx(alone["answer_logprob"], rel=1e-5)


@pytest.fixture(scope="module")
def demo_run(data_dir, tmp_path_factory) -> Path:
    """A run at the demo's context (256 tokens) on the tiny preset: its export."""
    out = tmp_path_factory.mktemp("demo_run")
    train.main(["--model_size", "tiny", "--context_length", "256", "--batch_size", "2", "--max_steps", "1",
                "--sample_tokens", "0", "--data_dir", str(data_dir), "--out_dir", str(out)])
    return out


def test_defaults_fit_the_run_and_short_lengths_are_skipped(demo_run, capsys):
    results = eval_cli.main([str(demo_run / "model"), "--samples", "2", "--depths", "0.5", "--eval_tokens", "600"])
    out = capsys.readouterr().out
    assert results["passkey"]["lengths"][-1] == 246 and results["needle"]["lengths"]  # the context, answer room kept
    assert "skipped" not in out  # the default lengths are all ones the tasks hold
    assert json.loads((demo_run / "eval-model" / "eval.json").read_text()) == results  # beside model/, not in it
    results = eval_cli.main([str(demo_run / "model"), "--tasks", "passkey", "mqar", "--lengths", "16", "128",
                               "--samples", "2", "--depths", "0.5"])
    out = capsys.readouterr().out
    assert "passkey: length 16 skipped: the task's text needs" in out and results["passkey"]["lengths"] == [128]
    assert results["mqar"]["lengths"] == [16, 128] and 0 <= results["mqar"]["accuracy"] <= 1


def test_eval_json_is_written_after_each_task(demo_run, monkeypatch, tmp_path):
    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("the recall task failed")

    monkeypatch.setattr(recall, "recall_scores", broken)
    with pytest.raises(RuntimeError):
        eval_cli.main([str(demo_run / "model"), "--tasks", "passkey", "mqar", "--lengths", "128", "--samples", "1",
                         "--depths", "0", "--out_dir", str(tmp_path)])
    assert "passkey" in json.loads((tmp_path / "eval.json").read_text())  # the finished task is kept


def test_validation_loss_is_the_next_token_loss_without_the_z_loss():
    """A model trained with a z-loss is validated on the next-token loss alone (the z-loss term is a training
    objective's), and keeps its objective afterwards."""
    from modeling.objective import Objective

    torch.manual_seed(0)
    model = Transformer(ModelConfig.from_preset("tiny"), objective=Objective(z_loss_coef=0.5)).double().eval()
    ids = torch.randint(0, 512, (2, 32))
    got = loss.validation_loss(model, (ids, ids), contextlib.nullcontext())
    assert model.objective.z_loss_coef == 0.5
    with torch.no_grad():
        logits = model(ids).logits  # (2, 32, V)
    want = F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten()).item()
    assert got == pytest.approx(want, rel=1e-6)  # validation_loss sums in float32; the z-loss would add ~20


def test_document_loglikelihoods_are_the_model_loss_after_the_end_of_document_id(demo_run, data_dir, tmp_path):
    documents = tmp_path / "documents.jsonl"
    texts = ["def f(x):\n    return x + 1\n", "import os\nprint(os.getcwd())"]
    documents.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    result = eval_cli.main([str(demo_run / "model"), "--tasks", "documents", "--documents", str(documents),
                              "--out_dir", str(tmp_path / "eval")])["documents"]
    model, tokenizer = load_model(demo_run / "model", dtype=torch.float64), Tokenizer(data_dir / "tokenizer.model")
    for text, document in zip(texts, result["documents"], strict=True):
        ids = torch.tensor([[tokenizer.eod_id, *tokenizer.encode(text)]])
        mean_loss = F.cross_entropy(model(ids[:, :-1]).logits[0], ids[0, 1:]).item()
        assert document["loglikelihood"] == pytest.approx(-mean_loss * (ids.shape[1] - 1), rel=1e-5)
        assert (document["tokens"], document["bytes"]) == (ids.shape[1] - 1, len(text.encode()))
    long = tmp_path / "long.txt"
    long.write_text("x = 1\n" * 400)
    with pytest.raises(SystemExit):
        eval_cli.main([str(demo_run / "model"), "--tasks", "documents", "--documents", str(long)])


@pytest.mark.parametrize("args, message", [
    (["--lengths", "250"], "--lengths 250 does not fit the context of 256 tokens"),
    (["--depths", "1.5"], "--depths must lie in [0, 1]"),
    (["--samples", "0"], "--samples must be >= 1"),
    (["--context_length", "5000"], "exceeds the model's context_length"),
    (["--tokenizer", "missing.model"], "--tokenizer missing.model does not exist"),
    (["--tasks", "mqar", "--lengths", "64", "--pairs", "40"], "--pairs 40: length 64 is too short for synthetic"),
    (["--tasks", "mqar", "--pairs", "0"], "--pairs must be >= 1"),
    (["--tasks", "mqar", "--document_mask"], "--document_mask: mqar and mqar_text read it only with --after_text"),
    (["--tasks", "mqar", "--data_dir", "tests"], "--data_dir: mqar and mqar_text read it only with --after_text"),
    (["--tasks", "mqar", "--after_text", "200", "--lengths", "64"],
     "--lengths 64 does not fit the context of 256 tokens after --after_text 200 + 1"),
    (["--tasks", "mqar", "--after_text", "300"], "--after_text 300 leaves 0 of the context's 256 tokens"),
])
def test_bad_input_is_one_line_with_exit_code_2(demo_run, args, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        eval_cli.main([str(demo_run / "model"), "--tasks", "passkey", *args])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and message in err and "Traceback" not in err
    with pytest.raises(SystemExit):
        eval_cli.main([str(demo_run / "nothing")])
    assert "does not exist" in capsys.readouterr().err


@pytest.mark.parametrize("given, tasks", [(["--tasks", "mqar", "--tokenizer", "DATA/tokenizer.model"], ["mqar"]),
                                          (["--tasks", "mqar", "loss"], ["mqar", "loss"])],
                         ids=["its-tokenizer", "another-task"])
def test_mqar_takes_data_dir_for_its_tokenizer_or_for_another_task(demo_run, data_dir, given, tasks, tmp_path):
    """--data_dir with mqar and no --after_text is accepted where something reads it: the tokenizer used lies there,
    or another task that runs reads the data (every task prepared, nothing run)."""
    from evaluation.registry import task_class

    argv = [str(demo_run / "model"), "--data_dir", str(data_dir), "--out_dir", str(tmp_path / "out"),
            *(arg.replace("DATA", str(data_dir)) for arg in given)]
    _, setting = eval_cli.check_inputs(eval_cli.build_parser().parse_args(argv))
    assert [task_class(name)(name, setting).name for name in setting.tasks] == tasks


def test_a_task_is_one_file_plus_its_registration(demo_run, monkeypatch, tmp_path, capsys):
    """examples/eval_task.py, registered from here: eval.py lists it, refuses an option it does not read, runs it
    (its table, its line of meaning, its result in eval.json) beside a built-in task."""
    from evaluation import registry

    monkeypatch.setitem(registry.EVAL_TASKS, "induction", "examples.eval_task:InductionTask")
    assert "- induction: next-token accuracy on the second copy" in eval_cli.build_parser().format_help()
    with pytest.raises(SystemExit):
        eval_cli.main([str(demo_run / "model"), "--tasks", "induction", "--depths", "0.5"])
    assert "--depths is read only by the task(s) passkey, needle" in capsys.readouterr().err
    results = eval_cli.main([str(demo_run / "model"), "--tasks", "induction", "mqar", "--lengths", "64", "--samples",
                             "3", "--batch_size", "2", "--out_dir", str(tmp_path / "out")])
    out = capsys.readouterr().out
    assert "induction: second-half accuracy, 3 documents per length" in out and "=> " in out
    assert results["induction"]["lengths"] == [64] and 0 <= results["induction"]["accuracy"][0] <= 1
    assert json.loads((tmp_path / "out" / "eval.json").read_text())["induction"] == results["induction"]
    assert results["mqar"]["lengths"] == [64]
