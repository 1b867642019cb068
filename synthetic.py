"""Synthetic retrieval documents: passkey and multi-key recall prompts, built to an exact token length from text
pieces encoded separately (so any tokenizer works), and `SyntheticMix`, which mixes them into a training stream.

The same builder makes eval.py's test prompts. A training document is a prompt with its answer appended: the model
learns to find a number hidden at a random depth of filler text (passkey) or the value of one of several keys
(associative recall, MQAR-style), the skill eval.py's grids measure.

Notation: B rows per batch, T tokens per row.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from data import TokenLoader
from tokenizer import Tokenizer

FILLER = ("The grass is green.", "The sky is blue.", "The sun is yellow.", "Here we go.", "There and back again.",
          "The river flows to the sea.", "A bird sings in the tree.", "The road goes on and on.")
TASKS = ("passkey", "needle")


@dataclass
class Prompt:
    ids: list[int]  # exactly the requested number of tokens
    answer: str  # the digits the model should continue with
    needle_start: int  # token position where the queried needle begins


class PromptBuilder:
    """Builds passkey and multi-key needle prompts of an exact token length from text pieces encoded separately."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._filler = [tokenizer.encode(" " + sentence) for sentence in FILLER]

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    def filler(self, n_tokens: int, rng: random.Random) -> list[int]:
        """n_tokens ids of filler sentences in a seeded random order (the last one cut)."""
        ids: list[int] = []
        while len(ids) < n_tokens:
            ids += rng.choice(self._filler)
        return ids[:n_tokens]

    def _assemble(self, length: int, head: list[int], needles: list[tuple[float, list[int]]], question: list[int],
                  rng: random.Random) -> tuple[list[int], list[int]]:
        """head + filler with each (depth, needle) inserted at that depth of the filler + question, `length` tokens;
        returns (ids, start positions of the needles in input order)."""
        n_filler = length - len(head) - len(question) - sum(len(n) for _, n in needles)
        if n_filler < 0:
            raise ValueError(f"a prompt of {length} tokens cannot hold the task's text ({length - n_filler} tokens); "
                             f"use longer --lengths")
        filler = self.filler(n_filler, rng)
        order = sorted(range(len(needles)), key=lambda i: needles[i][0])
        ids, starts, cut = list(head), [0] * len(needles), 0
        for i in order:
            depth, needle = needles[i]
            at = round(depth * n_filler)
            ids += filler[cut:at]
            starts[i] = len(ids)
            ids += needle
            cut = at
        return ids + filler[cut:] + question, starts

    def passkey(self, length: int, depth: float, rng: random.Random) -> Prompt:
        key = str(rng.randrange(10_000, 100_000))
        head = self._encode("There is a pass key hidden inside a lot of irrelevant text. Find it and memorize it.")
        needle = self._encode(f" The pass key is {key}. Remember it. {key} is the pass key.")
        question = self._encode(" What is the pass key? The pass key is")
        ids, (start,) = self._assemble(length, head, [(depth, needle)], question, rng)
        return Prompt(ids, key, start)

    def needle(self, length: int, depth: float, rng: random.Random, n_keys: int = 4) -> Prompt:
        keys = rng.sample([f"{a}{b}" for a in ("red", "blue", "green", "gold", "grey", "pink") for b in
                           ("fox", "owl", "cat", "elk", "bee", "ant")], n_keys)
        values = [str(rng.randrange(100_000, 1_000_000)) for _ in keys]
        head = self._encode("Some keys and their values are hidden inside a lot of irrelevant text. Memorize them.")
        needles = [(depth if i == 0 else rng.random(), self._encode(f" The value of key {k} is {v}."))
                   for i, (k, v) in enumerate(zip(keys, values, strict=True))]
        question = self._encode(f" What is the value of key {keys[0]}? The value of key {keys[0]} is")
        ids, starts = self._assemble(length, head, needles, question, rng)
        return Prompt(ids, values[0], starts[0])


def training_document(builder: PromptBuilder, length: int, rng: random.Random) -> list[int]:
    """`length` token ids: a passkey or multi-key recall prompt (chosen by `rng`, needle at a random depth) followed
    by its answer and a full stop."""
    task = rng.choice(TASKS)
    answer_len = len(builder.tokenizer.encode(" 000000."))  # the longest answer (6 digits)
    make = builder.passkey if task == "passkey" else builder.needle
    prompt = make(length - answer_len, rng.random(), rng)
    answer = builder.tokenizer.encode(f" {prompt.answer}.")
    return (prompt.ids + answer + builder.filler(answer_len, rng))[:length]


class SyntheticMix:
    """A TokenLoader whose rows are replaced, each with probability `rate`, by a synthetic retrieval document of the
    same length. Which rows and what they hold depend only on (seed, epoch, step, rank, row), so the mix is
    deterministic and resumes exactly with the loader's own state (`state_dict` / `load_state_dict`)."""

    def __init__(self, loader: TokenLoader, tokenizer: Tokenizer, rate: float, seed: int = 0) -> None:
        if not 0 <= rate <= 1:
            raise ValueError(f"synthetic_mix must be in [0, 1], got {rate}")
        self.loader, self.rate, self.seed = loader, rate, seed
        self.builder = PromptBuilder(tokenizer)
        training_document(self.builder, loader.seq_len, random.Random(0))  # ValueError now if T is too short

    def __iter__(self) -> SyntheticMix:
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        loader = self.loader
        epoch, step = (loader.epoch + 1, 0) if loader.step == loader.steps_per_epoch else (loader.epoch, loader.step)
        input_ids, _ = next(loader)  # (B, T)
        for row in range(input_ids.shape[0]):
            rng = random.Random(f"{self.seed}-{epoch}-{step}-{loader.rank}-{row}")
            if rng.random() < self.rate:
                input_ids[row] = torch.tensor(training_document(self.builder, loader.seq_len, rng))
        return input_ids, input_ids.clone()

    def state_dict(self) -> dict:
        return self.loader.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.loader.load_state_dict(state)

    @property
    def index(self) -> dict:
        return self.loader.index
