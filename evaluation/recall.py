"""The mqar and mqar_text tasks: dense multi-query associative recall documents (text/synthetic.py) of each
length, every answer scored under teacher forcing; accuracy and mean log-probability by key-query distance in
log-spaced buckets: where retrieval stops.

Notation: B documents per batch, T tokens per document.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import torch

from evaluation.loss import validation_windows
from evaluation.registry import EvalTask, Setting, holds_tokenizer, task_class
from evaluation.retrieval import score_answers
from model import Transformer
from modeling.documents import document_starts
from text.shards import check_tokenizer, load_index
from text.synthetic import SyntheticDocuments


def distance_buckets(distances: list[int], right: list[bool], log_probs: list[float]) -> list[dict]:
    """Answers grouped by key-query distance in log-spaced buckets [1, 2), [2, 4), ...: {"start", "end", "count",
    "accuracy", "answer_logprob"} for each non-empty bucket."""
    groups: dict[int, list[int]] = {}
    for i, d in enumerate(distances):
        groups.setdefault(max(1, d).bit_length() - 1, []).append(i)
    return [{"start": 2**k, "end": 2**(k + 1), "count": len(members),
             "accuracy": sum(right[i] for i in members) / len(members),
             "answer_logprob": sum(log_probs[i] for i in members) / len(members)}
            for k, members in sorted(groups.items())]


def recall_scores(model: Transformer, documents: SyntheticDocuments, lengths: list[int], samples: int, seed: int,
                  batch_size: int, progress: Callable[[int], None] | None = None, before: torch.Tensor | None = None,
                  eod_id: int | None = None, mask: bool = False) -> dict:
    """`samples` recall documents of each length, every answer token scored under teacher forcing: {"task", "pairs"
    (None: the default density), "lengths", "samples", "answers", "accuracy", "query_accuracy" (every token of the
    answer right), "answer_logprob", "by_length" [{"length", "accuracy", ...}], "buckets" (by distance, all lengths
    together)}. With `before` (N, P) token ids of other text, document i is packed after row i % N of it and the
    end-of-document id `eod_id`, as training rows pack documents; `mask`: each token then attends only within its
    own document (`modeling.documents.document_starts`)."""
    device = model.embed_tokens.weight.device
    distances, right, log_probs, per_query, by_length = [], [], [], {}, []
    for length in lengths:
        rng = random.Random(f"{seed}-{documents.task}-{length}")
        docs = [documents(length, rng) for _ in range(samples)]
        first = len(right)
        for b0 in range(0, samples, batch_size):
            batch = docs[b0:b0 + batch_size]
            ids = torch.tensor([d.ids for d in batch], device=device)  # (B, T)
            answers, starts = [d.answers for d in batch], None
            if before is not None:
                rows = before[torch.arange(b0, b0 + len(batch)) % before.shape[0]].to(device)  # (B, P)
                eod = torch.full((len(batch), 1), eod_id, device=device)
                ids = torch.cat([rows, eod, ids], dim=1)  # (B, P + 1 + T)
                answers = [[p + rows.shape[1] + 1 for p in where] for where in answers]
                starts = document_starts(ids, eod_id) if mask else None
            for i, (doc, row) in enumerate(zip(batch, score_answers(model, ids, answers, starts), strict=True)):
                distances += doc.distances
                right += [r for r, _ in row]
                log_probs += [lp for _, lp in row]
                for query, (r, _) in zip(doc.queries, row, strict=True):
                    key = (length, b0 + i, query)
                    per_query[key] = per_query.get(key, True) and r
            if progress is not None:
                progress(len(batch))
        n = len(right) - first
        by_length.append({"length": length, "answers": n, "accuracy": sum(right[first:]) / n,
                          "answer_logprob": sum(log_probs[first:]) / n})
    return {"task": documents.task, "pairs": documents.pairs, "lengths": lengths, "samples": samples,
            "answers": len(right), "accuracy": sum(right) / len(right),
            "query_accuracy": sum(per_query.values()) / len(per_query),
            "answer_logprob": sum(log_probs) / len(log_probs), "by_length": by_length,
            "buckets": distance_buckets(distances, right, log_probs)}


def format_recall(result: dict) -> str:
    pairs = f" of {result['pairs']} pairs" if result.get("pairs") else ""
    lines = [f"{result['task']}: {result['answers']:,} answers in {result['samples']} documents{pairs} per length; "
             f"accuracy {result['accuracy']:.1%}, whole answers {result['query_accuracy']:.1%}, mean answer "
             f"log-probability {result['answer_logprob']:.3f}",
             f"{'key-query distance':>20} {'answers':>8} {'accuracy':>9} {'log-prob':>9}"]
    lines += [f"{b['start']:>9}-{b['end'] - 1:<10} {b['count']:>8} {b['accuracy']:>9.1%} {b['answer_logprob']:>9.3f}"
              for b in result["buckets"]]
    return "\n".join(lines)


def plot_recall(ax: object, result: dict, label: str | None = None) -> None:
    """Accuracy by key-query distance (log scale) of one recall result on matplotlib axes `ax`."""
    buckets = result["buckets"]
    ax.plot([b["start"] for b in buckets], [b["accuracy"] for b in buckets], marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set(xlabel="key-query distance (tokens)", ylabel="answer accuracy", ylim=(-0.02, 1.02))


class RecallTask(EvalTask):
    """mqar, mqar_text: dense key-value recall documents, accuracy by key-query distance."""

    reads = ("lengths", "pairs", "samples", "batch_size", "seed", "after_text", "document_mask", "data_dir")

    def __init__(self, name: str, setting: Setting) -> None:
        super().__init__(name, setting)
        options = setting.options
        context = setting.context - (options.after_text + 1 if options.after_text else 0)  # room for a document
        if options.pairs is not None and options.pairs < 1:
            raise ValueError(f"--pairs must be >= 1, got {options.pairs}")
        self.documents = SyntheticDocuments(name, setting.tokenizer, options.pairs)
        needed = 4 if name == "mqar" else len(setting.tokenizer.encode(" The value of key redfox is 123456.")) * 2 + 8
        if options.after_text and context < needed:
            raise ValueError(f"--after_text {options.after_text} leaves {max(context, 0)} of the context's "
                             f"{setting.context} tokens for a document; {name} needs {needed}: use a smaller "
                             "--after_text or a longer --context_length")
        if options.lengths and max(options.lengths) > context:
            after = f" after --after_text {options.after_text} + 1" if options.after_text else ""
            raise ValueError(f"--lengths {max(options.lengths)} does not fit the context of {setting.context} "
                             f"tokens{after}")
        self.before = None  # other text each document is packed after (--after_text)
        if options.after_text:
            if not setting.data_dir:
                raise ValueError("--after_text: the text before each document is held-out text of --data_dir "
                                 "(prepared data with a validation split)")
            check_tokenizer(load_index(setting.data_dir), setting.tokenizer)
            self.before, _ = validation_windows(setting.data_dir, options.after_text,
                                                options.after_text * options.samples, options.seed)
        else:  # options only --after_text makes these tasks read, refused unless another task reads them
            why = {"document_mask": "a document alone has no other document to keep apart from",
                   "data_dir": "the held-out text packed before each document"}
            for option, reason in why.items():
                given = getattr(options, option) and not (
                    option == "data_dir" and holds_tokenizer(options.data_dir, setting.tokenizer))
                if given and not any(task_class(task) is not RecallTask and option in task_class(task).reads
                                     for task in setting.tasks):
                    raise ValueError(f"--{option}: mqar and mqar_text read it only with --after_text ({reason}): "
                                     "add --after_text N, or leave it out")
        for length in (n for n in options.lengths or [] if n < needed):
            print(f"{name}: length {length} skipped: the task's text needs {needed} tokens")
        self.lengths = [n for n in options.lengths or [context] if n >= needed]
        for length in self.lengths if options.pairs else []:
            try:
                self.documents.check_length(length)
            except ValueError as e:
                raise ValueError(f"--pairs {options.pairs}: length {e}; use fewer --pairs or longer --lengths"
                                 ) from None

    @property
    def work(self) -> int:
        return len(self.lengths) * self.setting.options.samples

    def run(self, model: Transformer, progress: Callable[[int], None]) -> dict:
        o = self.setting.options
        return recall_scores(model, self.documents, self.lengths, o.samples, o.seed, o.batch_size, progress,
                             self.before, self.setting.tokenizer.eod_id, o.document_mask)

    def table(self, result: dict) -> str:
        return format_recall(result)

    def meaning(self, result: dict) -> str:
        return (f"=> {result['accuracy']:.1%} of the answers recalled; the rows say how far back the model still "
                "finds a key")

    def figure(self, result: dict, title: str) -> object:
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 4))
        plot_recall(ax, result)
        ax.set_title(f"{self.name}: {title}", fontsize=9)
        return fig
