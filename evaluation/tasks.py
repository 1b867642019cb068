"""What eval.py scores, as functions of a model: held-out loss by token position, retrieval grids (passkey,
needle) with exact and graded scores, dense recall (MQAR) accuracy by key-query distance, document
log-likelihoods; and their tables and plots. eval.py is the command line (its docstring describes each task).

Notation: B prompts or windows per batch, T tokens per window or prompt, A answer tokens, C width, V vocabulary.
"""

from __future__ import annotations

import math
import random
import re
from contextlib import AbstractContextManager
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from tqdm import tqdm

from model import Transformer
from modeling.loss import IGNORE_INDEX, shift_labels
from text.corpus import find_input_files, iter_documents
from text.shards import TokenLoader, validation_dir
from text.synthetic import RECALL_TASKS, PromptBuilder, SyntheticDocuments
from text.tokenizer import HFTokenizer, Tokenizer

TASKS = ("loss", "passkey", "needle", "mqar", "mqar_text", "documents")
GRID_TASKS = ("passkey", "needle")
GRID_ROOM = 10  # tokens a grid prompt leaves in the context for generation: the answer and two more
LOSS_CHUNK = 512  # positions whose logits exist at a time when scoring windows


def check_prompt_options(builder: PromptBuilder, task: str, length: int, depths: list[float], pairs: int | None,
                         context_length: int) -> None:
    """ValueError naming the option when a `task` ("passkey" | "needle") prompt of `length` tokens cannot be built
    for a model of `context_length`: --pairs given, a depth outside [0, 1], a length shorter than the task's text
    or leaving less than GRID_ROOM tokens of the context for generation."""
    if pairs is not None or not all(0 <= d <= 1 for d in depths):
        raise ValueError(f"--task {task} takes no --pairs and --depths between 0 and 1")
    longest = context_length - GRID_ROOM
    if not builder.required_length(task) <= length <= longest:
        raise ValueError(f"--length for {task} must be at least {builder.required_length(task)} (its text) and at "
                         f"most {longest} (the context of {context_length} less {GRID_ROOM} generated tokens), "
                         f"got {length}")


# ---- loss by position -------------------------------------------------------------------------------------------


def loss_by_position(model: Transformer, windows: torch.Tensor, batch_size: int = 4) -> dict:
    """Next-token loss of `windows` (N, T) by position: {"loss", "perplexity", "tokens", "positions" (T - 1 per-
    position means), "buckets" [{"start", "end", "loss"}] (log-spaced: [1, 2), [2, 4), ...)}. Position p is the
    prediction of token p + 1 from tokens 0..p; logits exist for LOSS_CHUNK positions at a time."""
    N, T = windows.shape
    device = model.embed_tokens.weight.device
    sums = torch.zeros(T - 1, dtype=torch.float64)
    with torch.no_grad():
        for b0 in range(0, N, batch_size):
            ids = windows[b0:b0 + batch_size].to(device)  # (B, T)
            hidden = model.hidden_states(ids)  # (B, T, C)
            for p0 in range(0, T - 1, LOSS_CHUNK):
                p1 = min(p0 + LOSS_CHUNK, T - 1)
                logits = model.logits(hidden[:, p0:p1])  # (B, P, V)
                logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
                loss = F.cross_entropy(logits.flatten(0, 1), ids[:, p0 + 1:p1 + 1].flatten(), reduction="none")
                sums[p0:p1] += loss.view(ids.shape[0], -1).sum(0).double().cpu()
    per_position = sums / N  # (T - 1,)
    edges = [2**i for i in range(int(math.log2(T - 1)) + 1)] + [T]  # 1, 2, 4, ..., T
    buckets = [{"start": a - 1, "end": min(b, T) - 1, "loss": per_position[a - 1:min(b, T) - 1].mean().item()}
               for a, b in zip(edges, edges[1:], strict=False) if a < T]
    mean = per_position.mean().item()
    return {"loss": mean, "perplexity": math.exp(mean), "tokens": N * (T - 1), "positions": per_position.tolist(),
            "buckets": buckets}


def validation_windows(data_dir: str | Path, seq_len: int, max_tokens: int, seed: int = 0, rank: int = 0,
                       world_size: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's share (input ids, labels), each (N, T), of about `max_tokens` tokens of whole windows of seq_len
    tokens of `data_dir`'s held-out split, in the loader's seeded order: the same windows every call, as many on
    every rank (collectives under FSDP stay in step), at least one. Labels are the ids but where the data's loss
    mask leaves a token out (-100: the prompts of prompt/response data)."""
    loader = TokenLoader(validation_dir(data_dir), seq_len, 1, seed=seed)
    per_rank = min(max(1, max_tokens // seq_len // world_size), loader.num_windows // world_size)
    if per_rank == 0:
        raise ValueError(f"the validation split of {data_dir} holds {loader.num_windows} windows of {seq_len} "
                         "tokens, fewer than one per rank; use shorter windows or prepare the data with a larger "
                         "--validation_fraction")
    batches = [next(loader) for _ in range(per_rank * world_size)]
    ids, labels = (torch.cat(parts)[rank::world_size] for parts in zip(*batches, strict=True))  # (N, T) each
    return ids, labels


def validation_loss(model: Transformer, windows: tuple[torch.Tensor, torch.Tensor],
                    autocast: AbstractContextManager) -> float:
    """Mean next-token loss over the predicted tokens of every rank's validation windows (input ids, labels), each
    (N, T), through the model's own loss path (chunked at long T). Reads neither the torch RNG nor a training
    loader, so evaluating during training changes nothing."""
    device = model.embed_tokens.weight.device
    stats = torch.zeros(2, device=device)  # summed token loss, predicted tokens
    with torch.no_grad(), autocast:
        for row, labels in zip(*(w.to(device) for w in windows), strict=True):
            stats[0] += model(row[None], labels[None], loss_normalizer=1.0).loss.float()
            stats[1] += (shift_labels(labels[None]) != IGNORE_INDEX).sum()
    if dist.is_initialized():
        dist.all_reduce(stats)
    return (stats[0] / stats[1].clamp(min=1)).item()


# ---- retrieval: exact match and graded scores --------------------------------------------------------------------


def first_number(text: str) -> str | None:
    """The first run of digits in `text`, or None."""
    match = re.search(r"\d+", text)
    return match.group() if match else None


def is_correct(continuation: str, answer: str) -> bool:
    """Whether the model's continuation answers `answer`: its first number is exactly the answer."""
    return first_number(continuation) == answer


def score_answers(model: Transformer, ids: torch.Tensor, positions: list[list[int]]) -> list[list[tuple[bool, float]]]:
    """Teacher forcing: for each row of `ids` (B, L) and each of its answer positions p, (whether the greedy
    prediction from position p - 1 is ids[p], its log-probability). Logits exist only at those positions."""
    with torch.no_grad():
        hidden = model.hidden_states(ids)  # (B, L, C)
        scores = []
        for row, where in enumerate(positions):
            logits = model.logits(hidden[row, [p - 1 for p in where]])  # (A, V)
            log_probs = logits.to(torch.promote_types(logits.dtype, torch.float32)).log_softmax(-1)
            targets = ids[row, where]  # (A,)
            right = (log_probs.argmax(-1) == targets).tolist()
            scores.append(list(zip(right, log_probs.gather(-1, targets[:, None]).squeeze(-1).tolist(), strict=True)))
    return scores


def retrieval_cell(model: Transformer, builder: PromptBuilder, task: str, length: int, depth: float, samples: int,
                   seed: int, batch_size: int) -> dict:
    """One grid cell: `samples` prompts of `length` tokens with the needle at `depth`: {"accuracy" (exact match of
    the greedy continuation), "token_accuracy", "answer_logprob" (teacher forcing on the answer's tokens),
    "example"}."""
    device = model.embed_tokens.weight.device
    make = builder.passkey if task == "passkey" else builder.needle
    rng = random.Random(f"{seed}-{task}-{length}-{depth}")
    prompts = [make(length, depth, rng) for _ in range(samples)]
    correct, scores, example = 0, [], None
    for b0 in range(0, samples, batch_size):
        batch = prompts[b0:b0 + batch_size]
        answers = [builder.tokenizer.encode(" " + p.answer) for p in batch]
        n_new = max(len(a) for a in answers) + 2
        ids = torch.tensor([p.ids for p in batch], device=device)  # (B, T)
        out = model.generate(ids, n_new, temperature=0)  # (B, T + n_new): one prefill, then the cache
        texts = [builder.tokenizer.decode(row) for row in out[:, length:].tolist()]
        correct += sum(is_correct(t, p.answer) for t, p in zip(texts, batch, strict=True))
        example = example or {"answer": batch[0].answer, "continuation": texts[0]}
        padded = torch.tensor([p.ids + a + [0] * (n_new - len(a)) for p, a in zip(batch, answers, strict=True)],
                              device=device)  # (B, T + n_new): prompt, answer, padding
        scores += score_answers(model, padded, [list(range(length, length + len(a))) for a in answers])
    tokens = [s for row in scores for s in row]
    return {"accuracy": correct / samples, "token_accuracy": sum(r for r, _ in tokens) / len(tokens),
            "answer_logprob": sum(lp for _, lp in tokens) / len(tokens), "example": example}


def retrieval_grid(model: Transformer, builder: PromptBuilder, task: str, lengths: list[int], depths: list[float],
                   samples: int, seed: int, batch_size: int, bar: tqdm | None = None) -> dict:
    """Every (length, depth) cell of `task` ("passkey" | "needle"): {"lengths", "depths", "samples", "accuracy",
    "token_accuracy", "answer_logprob" ([[per depth] per length] each), "examples" (one continuation per cell)}."""
    result: dict = {"lengths": lengths, "depths": depths, "samples": samples, "accuracy": [], "token_accuracy": [],
                    "answer_logprob": [], "examples": []}
    for length in lengths:
        cells = []
        for depth in depths:
            cells.append(retrieval_cell(model, builder, task, length, depth, samples, seed, batch_size))
            result["examples"].append({"length": length, "depth": depth, **cells[-1]["example"]})
            if bar is not None:
                bar.update(samples)
        for name in ("accuracy", "token_accuracy", "answer_logprob"):
            result[name].append([cell[name] for cell in cells])
    return result


# ---- dense recall: accuracy by key-query distance ------------------------------------------------------------------


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
                  batch_size: int, bar: tqdm | None = None) -> dict:
    """`samples` recall documents of each length, every answer token scored under teacher forcing: {"task", "pairs"
    (None: the default density), "lengths", "samples", "answers", "accuracy", "query_accuracy" (every token of the
    answer right), "answer_logprob", "by_length" [{"length", "accuracy", ...}], "buckets" (by distance, all lengths
    together)}."""
    device = model.embed_tokens.weight.device
    distances, right, log_probs, per_query, by_length = [], [], [], {}, []
    for length in lengths:
        rng = random.Random(f"{seed}-{documents.task}-{length}")
        docs = [documents(length, rng) for _ in range(samples)]
        first = len(right)
        for b0 in range(0, samples, batch_size):
            batch = docs[b0:b0 + batch_size]
            ids = torch.tensor([d.ids for d in batch], device=device)  # (B, T)
            for i, (doc, row) in enumerate(zip(batch, score_answers(model, ids, [d.answers for d in batch]),
                                                strict=True)):
                distances += doc.distances
                right += [r for r, _ in row]
                log_probs += [lp for _, lp in row]
                for query, (r, _) in zip(doc.queries, row, strict=True):
                    key = (length, b0 + i, query)
                    per_query[key] = per_query.get(key, True) and r
            if bar is not None:
                bar.update(len(batch))
        n = len(right) - first
        by_length.append({"length": length, "answers": n, "accuracy": sum(right[first:]) / n,
                          "answer_logprob": sum(log_probs[first:]) / n})
    return {"task": documents.task, "pairs": documents.pairs, "lengths": lengths, "samples": samples,
            "answers": len(right), "accuracy": sum(right) / len(right),
            "query_accuracy": sum(per_query.values()) / len(per_query),
            "answer_logprob": sum(log_probs) / len(log_probs), "by_length": by_length,
            "buckets": distance_buckets(distances, right, log_probs)}


def document_loglikelihoods(model: Transformer, tokenizer: Tokenizer | HFTokenizer, texts: list[str]) -> dict:
    """Each text's log-likelihood (natural log): the sum over its tokens of log p(token | the end-of-document id
    and the text's earlier tokens), one forward per document, logits for LOSS_CHUNK positions at a time.
    {"documents": [{"tokens", "bytes", "loglikelihood"}], "loglikelihood", "bits_per_byte"} (the totals over all
    documents)."""
    device = model.embed_tokens.weight.device
    documents = []
    with torch.no_grad():
        for text in texts:
            ids = torch.tensor([tokenizer.eod_id, *tokenizer.encode(text)], device=device)  # (T + 1,)
            hidden = model.hidden_states(ids[None, :-1])[0]  # (T, C)
            total = torch.zeros((), dtype=torch.float64, device=device)
            for p0 in range(0, len(hidden), LOSS_CHUNK):  # logits for LOSS_CHUNK positions at a time
                logits = model.logits(hidden[p0:p0 + LOSS_CHUNK])  # (P, V)
                logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
                total -= F.cross_entropy(logits, ids[p0 + 1:p0 + 1 + LOSS_CHUNK], reduction="sum").double()
            documents.append({"tokens": len(ids) - 1, "bytes": len(text.encode("utf-8")),
                              "loglikelihood": total.item()})
    total = sum(d["loglikelihood"] for d in documents)
    return {"documents": documents, "loglikelihood": total,
            "bits_per_byte": -total / math.log(2) / max(1, sum(d["bytes"] for d in documents))}


def read_documents(path: str, tokenizer: Tokenizer | HFTokenizer, context: int) -> list[str]:
    """The non-empty documents of `path` (data.find_input_files); ValueError for one whose tokens and the
    end-of-document id before them exceed `context`."""
    texts = [text for text in iter_documents(find_input_files([path])) if text.strip()]
    if not texts:
        raise ValueError(f"--documents {path} holds no non-empty document: nothing to score")
    for i, text in enumerate(texts):
        if (n := len(tokenizer.encode(text))) + 1 > context:
            raise ValueError(f"--documents {path}: document {i} has {n} tokens, more than the context of {context} "
                             "holds after the end-of-document id; shorten it or raise --context_length")
    return texts


# ---- reporting ----------------------------------------------------------------------------------------------------


def format_loss(result: dict) -> str:
    lines = [f"validation loss {result['loss']:.4f} (perplexity {result['perplexity']:.2f}) over {result['tokens']:,} "
             f"predicted tokens", f"{'positions':>17} {'mean loss':>10}"]
    lines += [f"{b['start']:>8}-{b['end'] - 1:<8} {b['loss']:>10.4f}" for b in result["buckets"]]
    return "\n".join(lines)


def format_documents(result: dict) -> str:
    lines = [f"documents: {len(result['documents'])}, log-likelihood {result['loglikelihood']:.4f}, "
             f"{result['bits_per_byte']:.4f} bits per byte", f"{'document':>8} {'tokens':>7} {'log-likelihood':>15}"]
    lines += [f"{i:>8} {d['tokens']:>7} {d['loglikelihood']:>15.4f}" for i, d in enumerate(result["documents"])]
    return "\n".join(lines)


def format_grid(name: str, result: dict) -> str:
    """Exact-match accuracy per cell, with the per-token accuracy and mean answer log-probability beside it."""
    lines = [f"{name}: exact match / answer-token accuracy / mean answer log-probability, {result['samples']} "
             "prompts per cell", f"{'length / depth':>15}" + "".join(f"{d:>22.2f}" for d in result["depths"])]
    for i, length in enumerate(result["lengths"]):
        cells = [f"{a:>5.0%} /{t:>5.0%} /{lp:>7.2f}" for a, t, lp in zip(
            result["accuracy"][i], result["token_accuracy"][i], result["answer_logprob"][i], strict=True)]
        lines.append(f"{length:>15}" + "".join(f"{c:>22}" for c in cells))
    return "\n".join(lines)


def format_recall(result: dict) -> str:
    pairs = f" of {result['pairs']} pairs" if result.get("pairs") else ""
    lines = [f"{result['task']}: {result['answers']:,} answers in {result['samples']} documents{pairs} per length; "
             f"accuracy {result['accuracy']:.1%}, whole answers {result['query_accuracy']:.1%}, mean answer "
             f"log-probability {result['answer_logprob']:.3f}",
             f"{'key-query distance':>20} {'answers':>8} {'accuracy':>9} {'log-prob':>9}"]
    lines += [f"{b['start']:>9}-{b['end'] - 1:<10} {b['count']:>8} {b['accuracy']:>9.1%} {b['answer_logprob']:>9.3f}"
              for b in result["buckets"]]
    return "\n".join(lines)


def meaning(task: str, result: dict) -> str:
    """One line under a task's table: what it says about this model."""
    if task == "loss":
        first, last = result["buckets"][0], result["buckets"][-1]
        where = f"positions {last['start']}-{last['end'] - 1}"
        if first["loss"] - last["loss"] > 0.05 * first["loss"]:
            return (f"=> the model uses its context: its loss falls from {first['loss']:.2f} on the first token to "
                    f"{last['loss']:.2f} at {where}")
        return (f"=> the loss does not fall with context ({first['loss']:.2f} on the first token, {last['loss']:.2f} "
                f"at {where}): the model predicts no better with it")
    if task in GRID_TASKS:
        cells = [value for row in result["accuracy"] for value in row]
        if not any(cells):
            return (f"=> no {task} was read back: this model does not retrieve one fact from its context (small, "
                    "briefly trained models rarely do; the loss by position says whether it uses its context at all)")
        return (f"=> {sum(cells) / len(cells):.0%} of the {task} prompts read back exactly, from "
                f"{min(cells):.0%} to {max(cells):.0%} by length and depth")
    return (f"=> {result['accuracy']:.1%} of the answers recalled; the rows say how far back the model still finds "
            "a key")


def plot(results: dict, out_dir: Path, title: str) -> list[Path]:
    """loss_by_position.png, one heatmap per retrieval grid and one accuracy-by-distance curve per recall task;
    [] with a note when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("plots skipped: pip install matplotlib (or the project's `plot` extra)")
        return []
    written = []

    def save(fig: object, name: str) -> None:
        written.append(out_dir / name)
        fig.tight_layout()
        fig.savefig(written[-1])
        plt.close(fig)

    if "loss" in results:
        fig, ax = plt.subplots(figsize=(6, 4))
        buckets = results["loss"]["buckets"]
        ax.plot([b["start"] + 1 for b in buckets], [b["loss"] for b in buckets], marker="o")  # 1, 2, 4, ...
        ax.set(xscale="log", xlabel="tokens of context before the predicted one", ylabel="mean validation loss")
        ax.set_title(title, fontsize=9)
        save(fig, "loss_by_position.png")
    for task in (t for t in GRID_TASKS if t in results):
        grid = results[task]
        fig, ax = plt.subplots(figsize=(1.2 * len(grid["depths"]) + 2, 0.6 * len(grid["lengths"]) + 2))
        image = ax.imshow(np.array(grid["accuracy"]), vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
        ax.set_xticks(range(len(grid["depths"])), [f"{d:.0%}" for d in grid["depths"]])
        ax.set_yticks(range(len(grid["lengths"])), [str(n) for n in grid["lengths"]])
        ax.set(xlabel="needle depth", ylabel="prompt length (tokens)")
        ax.set_title(f"{task}: {title}\neach cell: exact match, and below it answer-token accuracy", fontsize=9)
        for i, row in enumerate(grid["accuracy"]):
            for j, value in enumerate(row):
                ax.text(j, i, f"{value:.0%}\n{grid['token_accuracy'][i][j]:.0%}", ha="center", va="center",
                        fontsize=7, color="white" if value < 0.3 or value > 0.8 else "black")  # dark ends
        fig.colorbar(image, ax=ax, label="exact match")
        save(fig, f"{task}.png")
    for task in (t for t in RECALL_TASKS if t in results):
        fig, ax = plt.subplots(figsize=(6, 4))
        plot_recall(ax, results[task], label=results.get("attention_type"))
        ax.set_title(f"{task}: {title}", fontsize=9)
        save(fig, f"{task}.png")
    return written


def plot_recall(ax: object, result: dict, label: str | None = None) -> None:
    """Accuracy by key-query distance (log scale) of one recall result on matplotlib axes `ax`."""
    buckets = result["buckets"]
    ax.plot([b["start"] for b in buckets], [b["accuracy"] for b in buckets], marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set(xlabel="key-query distance (tokens)", ylabel="answer accuracy", ylim=(-0.02, 1.02))
