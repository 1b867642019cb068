"""The passkey and needle tasks: retrieval grids. passkey: a random 5-digit number hidden in filler text at a given
depth (0 = start, 1 = end) of a prompt of a given length in tokens, asked for at the end. needle: several key-value
pairs hidden in filler, the queried one at the given depth. For each (length, depth) cell: exact-match accuracy of
the greedy continuation (through the KV cache, scored by its first number), and two graded scores under teacher
forcing that show partial learning: the per-token accuracy of the answer's tokens and their mean log-probability.

Notation: B prompts per batch, T tokens per prompt, A answer tokens, C width, V vocabulary.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable

import numpy as np
import torch

from evaluation.registry import EvalTask, Setting
from model import Transformer
from text.synthetic import PromptBuilder

GRID_TASKS = ("passkey", "needle")
GRID_ROOM = 10  # tokens a grid prompt leaves in the context for generation: the answer and two more
DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)  # --depths' default


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


def first_number(text: str) -> str | None:
    """The first run of digits in `text`, or None."""
    match = re.search(r"\d+", text)
    return match.group() if match else None


def is_correct(continuation: str, answer: str) -> bool:
    """Whether the model's continuation answers `answer`: its first number is exactly the answer."""
    return first_number(continuation) == answer


def score_answers(model: Transformer, ids: torch.Tensor, positions: list[list[int]],
                  doc_start: torch.Tensor | None = None) -> list[list[tuple[bool, float]]]:
    """Teacher forcing: for each row of `ids` (B, L) and each of its answer positions p, (whether the greedy
    prediction from position p - 1 is ids[p], its log-probability). Logits exist only at those positions.
    doc_start (B, L): the model's document starts (None: every earlier token visible)."""
    with torch.no_grad():
        hidden = model.hidden_states(ids, doc_start=doc_start)  # (B, L, C)
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
                   samples: int, seed: int, batch_size: int, progress: Callable[[int], None] | None = None) -> dict:
    """Every (length, depth) cell of `task` ("passkey" | "needle"): {"lengths", "depths", "samples", "accuracy",
    "token_accuracy", "answer_logprob" ([[per depth] per length] each), "examples" (one continuation per cell)}."""
    result: dict = {"lengths": lengths, "depths": depths, "samples": samples, "accuracy": [], "token_accuracy": [],
                    "answer_logprob": [], "examples": []}
    for length in lengths:
        cells = []
        for depth in depths:
            cells.append(retrieval_cell(model, builder, task, length, depth, samples, seed, batch_size))
            result["examples"].append({"length": length, "depth": depth, **cells[-1]["example"]})
            if progress is not None:
                progress(samples)
        for name in ("accuracy", "token_accuracy", "answer_logprob"):
            result[name].append([cell[name] for cell in cells])
    return result


def format_grid(name: str, result: dict) -> str:
    """Exact-match accuracy per cell, with the per-token accuracy and mean answer log-probability beside it."""
    lines = [f"{name}: exact match / answer-token accuracy / mean answer log-probability, {result['samples']} "
             "prompts per cell", f"{'length / depth':>15}" + "".join(f"{d:>22.2f}" for d in result["depths"])]
    for i, length in enumerate(result["lengths"]):
        cells = [f"{a:>5.0%} /{t:>5.0%} /{lp:>7.2f}" for a, t, lp in zip(
            result["accuracy"][i], result["token_accuracy"][i], result["answer_logprob"][i], strict=True)]
        lines.append(f"{length:>15}" + "".join(f"{c:>22}" for c in cells))
    return "\n".join(lines)


class GridTask(EvalTask):
    """passkey, needle: exact-match and graded recall of a fact hidden at each depth of prompts of each length."""

    reads = ("lengths", "depths", "samples", "batch_size", "seed")
    default = True
    unit = "prompt"

    def __init__(self, name: str, setting: Setting) -> None:
        super().__init__(name, setting)
        options = setting.options
        if not 0 <= min(options.depths) <= max(options.depths) <= 1:
            raise ValueError(f"--depths must lie in [0, 1], got {options.depths}")
        longest = setting.context - GRID_ROOM
        if options.lengths and max(options.lengths) > longest:
            raise ValueError(f"--lengths {max(options.lengths)} does not fit the context of {setting.context} tokens "
                             f"with the {GRID_ROOM} answer tokens {name} generates")
        needed = setting.builder.required_length(name)
        lengths = options.lengths or sorted({n for n in (setting.context // 8, setting.context // 4,
                                                         setting.context // 2) if n >= needed} | {longest})
        for length in (n for n in lengths if n < needed):
            print(f"{name}: length {length} skipped: the task's text needs {needed} tokens")
        self.lengths = [n for n in lengths if n >= needed]  # default: the context's 1/8, 1/4, 1/2 that hold it, its end

    @property
    def work(self) -> int:
        return len(self.lengths) * len(self.setting.options.depths) * self.setting.options.samples

    def run(self, model: Transformer, progress: Callable[[int], None]) -> dict:
        o = self.setting.options
        return retrieval_grid(model, self.setting.builder, self.name, self.lengths, o.depths, o.samples, o.seed,
                              o.batch_size, progress)

    def table(self, result: dict) -> str:
        return format_grid(self.name, result)

    def meaning(self, result: dict) -> str:
        cells = [value for row in result["accuracy"] for value in row]
        if not any(cells):
            return (f"=> no {self.name} was read back: this model does not retrieve one fact from its context (small, "
                    "briefly trained models rarely do; the loss by position says whether it uses its context at all)")
        return (f"=> {sum(cells) / len(cells):.0%} of the {self.name} prompts read back exactly, from "
                f"{min(cells):.0%} to {max(cells):.0%} by length and depth")

    def figure(self, result: dict, title: str) -> object:
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(1.2 * len(result["depths"]) + 2, 0.6 * len(result["lengths"]) + 2))
        image = ax.imshow(np.array(result["accuracy"]), vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
        ax.set_xticks(range(len(result["depths"])), [f"{d:.0%}" for d in result["depths"]])
        ax.set_yticks(range(len(result["lengths"])), [str(n) for n in result["lengths"]])
        ax.set(xlabel="needle depth", ylabel="prompt length (tokens)")
        ax.set_title(f"{self.name}: {title}\neach cell: exact match, and below it answer-token accuracy", fontsize=9)
        for i, row in enumerate(result["accuracy"]):
            for j, value in enumerate(row):
                ax.text(j, i, f"{value:.0%}\n{result['token_accuracy'][i][j]:.0%}", ha="center", va="center",
                        fontsize=7, color="white" if value < 0.3 or value > 0.8 else "black")  # dark ends
        fig.colorbar(image, ax=ax, label="exact match")
        return fig
