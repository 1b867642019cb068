"""Synthetic retrieval documents: passkey and multi-key recall prompts, built to an exact token length from text
pieces encoded separately (so any tokenizer works), and `SyntheticMix`, which mixes them into a training stream.

The same builder makes eval.py's test prompts. A training document is a prompt with its answer appended: the model
learns to find a number hidden at a random depth of filler text (passkey) or the value of one of several keys
(associative recall, MQAR-style), the skill eval.py's grids measure.

Notation: B rows per batch, T tokens per row.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass

import torch

from modeling.loss import IGNORE_INDEX
from text.shards import TokenLoader
from text.tokenizer import Tokenizer

FILLER = ("The grass is green.", "The sky is blue.", "The sun is yellow.", "Here we go.", "There and back again.",
          "The river flows to the sea.", "A bird sings in the tree.", "The road goes on and on.")
TASKS = ("passkey", "needle")


@dataclass
class Prompt:
    ids: list[int]  # exactly the requested number of tokens
    answer: str  # the digits the model should continue with
    needle_start: int  # token position where the queried needle begins
    text_tokens: int  # tokens that are not filler: the shortest prompt that holds the task
    needle_end: int  # token position just past the queried needle


class PromptBuilder:
    """Builds passkey and multi-key needle prompts of an exact token length from text pieces encoded separately."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._filler = [tokenizer.encode(" " + sentence) for sentence in FILLER]
        self._required: dict[str, int] = {}

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    def filler(self, n_tokens: int, rng: random.Random) -> list[int]:
        """n_tokens ids of filler sentences in a seeded random order (the last one cut)."""
        return self._sentences(n_tokens, rng)[0]

    def _sentences(self, n_tokens: int, rng: random.Random) -> tuple[list[int], list[int]]:
        """(`filler`'s ids, the positions where its sentences start; n_tokens too when the last one is whole)."""
        ids: list[int] = []
        starts: list[int] = []
        while len(ids) < n_tokens:
            starts.append(len(ids))
            ids += rng.choice(self._filler)
        return ids[:n_tokens], starts + [n_tokens] * (len(ids) == n_tokens)

    def _assemble(self, length: int, head: list[int], needles: list[tuple[float, list[int]]], question: list[int],
                  rng: random.Random) -> tuple[list[int], list[int], int]:
        """head + filler with each (depth, needle) inserted before the filler sentence that starts nearest that
        depth of the filler (never inside a sentence, nor after the cut last one), + question, `length` tokens;
        returns (ids, start positions of the needles in input order, tokens that are not filler)."""
        n_filler = length - len(head) - len(question) - sum(len(n) for _, n in needles)
        if n_filler < 0:
            raise ValueError(f"a prompt of {length} tokens cannot hold the task's text ({length - n_filler} "
                             "tokens)")
        filler, bounds = self._sentences(n_filler, rng)
        order = sorted(range(len(needles)), key=lambda i: needles[i][0])
        ids, starts, cut = list(head), [0] * len(needles), 0
        for i in order:
            depth, needle = needles[i]
            at = min((b for b in bounds if b >= cut), key=lambda b: abs(b - depth * n_filler), default=cut)
            ids += filler[cut:at]
            starts[i] = len(ids)
            ids += needle
            cut = at
        return ids + filler[cut:] + question, starts, length - n_filler

    def required_length(self, task: str) -> int:
        """Tokens a `task` ("passkey" | "needle") prompt needs besides filler (the longest of 32 seeded prompts)."""
        if task not in self._required:
            make = self.passkey if task == "passkey" else self.needle
            self._required[task] = max(make(4096, 0.5, random.Random(i)).text_tokens for i in range(32))
        return self._required[task]

    def passkey(self, length: int, depth: float, rng: random.Random) -> Prompt:
        key = str(rng.randrange(10_000, 100_000))
        head = self._encode("There is a pass key hidden inside a lot of irrelevant text. Find it and memorize it.")
        needle = self._encode(f" The pass key is {key}. Remember it. {key} is the pass key.")
        question = self._encode(" What is the pass key? The pass key is")
        ids, (start,), text = self._assemble(length, head, [(depth, needle)], question, rng)
        return Prompt(ids, key, start, text, start + len(needle))

    def needle(self, length: int, depth: float, rng: random.Random, n_keys: int = 4) -> Prompt:
        keys = rng.sample([f"{a}{b}" for a in ("red", "blue", "green", "gold", "grey", "pink") for b in
                           ("fox", "owl", "cat", "elk", "bee", "ant")], n_keys)
        values = [str(rng.randrange(100_000, 1_000_000)) for _ in keys]
        head = self._encode("Some keys and their values are hidden inside a lot of irrelevant text. Memorize them.")
        needles = [(depth if i == 0 else rng.random(), self._encode(f" The value of key {k} is {v}."))
                   for i, (k, v) in enumerate(zip(keys, values, strict=True))]
        question = self._encode(f" What is the value of key {keys[0]}? The value of key {keys[0]} is")
        ids, starts, text = self._assemble(length, head, needles, question, rng)
        return Prompt(ids, values[0], starts[0], text, starts[0] + len(needles[0][1]))


# ---- dense recall: multi-query associative recall (MQAR, Arora et al. 2023, "Zoology") -------------------------

@dataclass
class RecallDocument:
    """A dense recall document: key-value pairs, queries of earlier keys, each followed by its value, and noise."""

    ids: list[int]  # exactly the requested number of tokens
    answers: list[int]  # positions of the answer tokens (a queried key's value): the targets
    distances: list[int]  # per answer token: the position of its query minus that of the key's pair
    queries: list[int]  # per answer token: an id of the query it answers (an answer may span several tokens)


class RecallVocabulary:
    """Disjoint ranges of token ids for MQAR's keys, values and noise, inside any tokenizer's vocabulary (ids below
    16 and the tokenizer's special ids are left out): keys and values up to 512 each, noise the rest."""

    def __init__(self, vocab_size: int, reserved: tuple[int, ...] = ()) -> None:
        usable = [i for i in range(16, vocab_size) if i not in set(reserved)]
        size = min(512, len(usable) // 3)
        if size < 8:
            raise ValueError(f"a vocabulary of {vocab_size} tokens is too small for MQAR (needs at least 40)")
        self.keys, self.values, self.noise = usable[:size], usable[size:2 * size], usable[2 * size:]
        self.usable = usable  # keys, values and noise together

    @classmethod
    def of(cls, tokenizer: Tokenizer) -> RecallVocabulary:
        special = {getattr(tokenizer, name, None) for name in ("bos_id", "eos_id", "pad_id", "eod_id")}
        return cls(tokenizer.vocab_size, tuple(i for i in special if isinstance(i, int) and i >= 0))


Piece = tuple[list[int], list[int], list[int]]  # (ids before the answer, answer ids, ids after)


def _recall_document(length: int, rng: random.Random, pair: Callable[[int], Piece], query: Callable[[int], Piece],
                     noise: Callable[[], list[int]], n_keys: int, unit: int, pairs: int | None = None
                     ) -> RecallDocument:
    """The MQAR layout of both forms, `length` tokens cut into slots of about `unit` tokens, each holding a pair, a
    query or noise. `pairs` slots (default: a third of them; at most half) get pairs of distinct keys (at most
    `n_keys`; the more pairs, the more keys a query must tell apart), each with one query later
    at a distance drawn log-uniformly in [1, slots) slots, so the distances cover every scale of the context
    (placed longest first in random free slots; a pair that finds no room after 20 tries is left out). Answers cut
    off by the end of the document are dropped."""
    slots = max(2, length // unit)
    if pairs is not None and pairs > n_keys:
        raise ValueError(f"{pairs} key-value pairs need {pairs} distinct keys; this form has {n_keys}")
    if pairs is not None and pairs > slots // 2:
        raise ValueError(f"{pairs} key-value pairs do not fit {length} tokens: at most {slots // 2} (a pair and its "
                         f"query take 2 slots of {unit} tokens)")
    n_pairs = min(n_keys, max(1, slots // 3) if pairs is None else pairs)
    gaps = sorted((round(math.exp(rng.uniform(0, math.log(slots - 1)))) for _ in range(n_pairs)), reverse=True)
    layout: list[tuple[str, int] | None] = [None] * slots
    for key, gap in zip(rng.sample(range(n_keys), n_pairs), gaps, strict=True):
        for _ in range(20):
            at = rng.randrange(slots - gap)
            if layout[at] is None and layout[at + gap] is None:
                layout[at], layout[at + gap] = ("pair", key), ("query", key)
                break
    ids: list[int] = []
    answers: list[int] = []
    distances: list[int] = []
    queries: list[int] = []
    pair_at: dict[int, int] = {}
    for slot, event in enumerate(layout):
        if event is None:
            while len(ids) < (slot + 1) * unit:  # to the slot's end: noise longer than a slot does not add up
                ids += noise()
            continue
        kind, key = event
        if kind == "pair":
            pair_at[key] = len(ids)
            before, answer, after = pair(key)
        else:
            before, answer, after = query(key)
            answers += range(len(ids) + len(before), len(ids) + len(before) + len(answer))
            distances += [len(ids) - pair_at[key]] * len(answer)  # from the pair's first token to the query's
            queries += [slot] * len(answer)
        ids += before + answer + after
    while len(ids) < length:
        ids += noise()
    kept = [i for i, position in enumerate(answers) if position < length]
    return RecallDocument(ids[:length], [answers[i] for i in kept], [distances[i] for i in kept],
                          [queries[i] for i in kept])


def mqar_document(length: int, vocab: RecallVocabulary, rng: random.Random, pairs: int | None = None
                  ) -> RecallDocument:
    """Token-level MQAR of exactly `length` tokens: `key value` pairs of random ids (distinct keys, random values;
    `pairs` of them, default a third of the length's 2-token slots), later `key value` queries of earlier keys
    (each query's value is an answer), and random noise tokens."""
    values: dict[int, int] = {}

    def pair(key: int) -> Piece:
        values[key] = rng.choice(vocab.values)
        return [vocab.keys[key], values[key]], [], []

    return _recall_document(length, rng, pair, lambda key: ([vocab.keys[key]], [values[key]], []),
                            lambda: [rng.choice(vocab.noise)], len(vocab.keys), 2, pairs)


KEY_WORDS = [f"{a}{b}" for a in ("red", "blue", "green", "gold", "grey", "pink", "teal", "tan", "jade", "ruby",
                                 "navy", "lime")
             for b in ("fox", "owl", "cat", "elk", "bee", "ant", "yak", "emu", "cod", "ram", "eel", "bat")]


def mqar_text_document(builder: PromptBuilder, length: int, rng: random.Random, pairs: int | None = None
                       ) -> RecallDocument:
    """Natural-language MQAR of exactly `length` tokens, from the needle task's pieces: statements " The value of
    key redfox is 123456." (`pairs` of them, default a third of the slots), questions " What is the value of key
    redfox? 123456." of earlier keys (the value's tokens are the answers) and filler sentences as noise."""
    encode, values = builder.tokenizer.encode, {}

    def pair(key: int) -> Piece:
        values[key] = str(rng.randrange(100_000, 1_000_000))
        return encode(f" The value of key {KEY_WORDS[key]} is {values[key]}."), [], []

    def query(key: int) -> Piece:
        return encode(f" What is the value of key {KEY_WORDS[key]}?"), encode(f" {values[key]}"), encode(".")

    unit = len(encode(" The value of key redfox is 123456.")) + 2
    return _recall_document(length, rng, pair, query, lambda: rng.choice(builder._filler), len(KEY_WORDS), unit,
                            pairs)


def passkey_document(builder: PromptBuilder, length: int, rng: random.Random) -> RecallDocument:
    """`length` tokens: a passkey or multi-key needle prompt (chosen by `rng`, needle at a random depth, of a random
    length, so the answer's position varies), its answer and a full stop (the targets: the stop teaches a model where
    a generated answer ends), then filler. ValueError when `length` cannot hold the prompt's text."""
    task = rng.choice(TASKS)
    longest = length - len(builder.tokenizer.encode(" 000000."))  # room for the longest answer (6 digits)
    shortest = min(longest, builder.required_length(task) + 8)  # 8 to spare for a rarer longer text
    make = builder.passkey if task == "passkey" else builder.needle
    prompt = make(rng.randint(shortest, longest), rng.random(), rng)
    answer = builder.tokenizer.encode(f" {prompt.answer}") + builder.tokenizer.encode(".")
    ids = (prompt.ids + answer + builder.filler(length, rng))[:length]
    positions = list(range(len(prompt.ids), len(prompt.ids) + len(answer)))
    return RecallDocument(ids, positions, [len(prompt.ids) - prompt.needle_start] * len(answer), [0] * len(answer))


def copy_document(length: int, vocab: RecallVocabulary, rng: random.Random) -> RecallDocument:
    """`length` tokens: a random sequence of L ids (any of the vocabulary's usable ids; L drawn from
    [length/4, length/2]) written twice, with random ids before, between and after (the three lengths random). The
    answers are the second copy from its second token on (its first follows unrelated noise); each is L + gap tokens
    from its source. The copies' distance varies, so only content-based copying predicts it (an induction head,
    Olsson et al. 2022), not copying from a fixed offset: the copying a passkey's digits need."""
    if length < 4:
        raise ValueError("a copy document needs at least 4 tokens (2 copied twice)")
    n = rng.randint(max(2, length // 4), length // 2)
    prefix, gap = sorted(rng.randint(0, length - 2 * n) for _ in range(2))
    gap -= prefix  # noise before, between and after: prefix, gap, the rest
    sequence = [rng.choice(vocab.usable) for _ in range(n)]
    noise = [rng.choice(vocab.usable) for _ in range(length - 2 * n)]
    ids = noise[:prefix] + sequence + noise[prefix:prefix + gap] + sequence + noise[prefix + gap:]
    second = prefix + n + gap
    answers = list(range(second + 1, second + n))
    return RecallDocument(ids, answers, [n + gap] * len(answers), answers)


def answer_labels(doc: RecallDocument) -> torch.Tensor:
    """Labels (T,) that put the loss on `doc`'s answers only: its ids there, IGNORE_INDEX (-100) elsewhere."""
    labels = torch.full((len(doc.ids),), IGNORE_INDEX)
    labels[doc.answers] = torch.tensor(doc.ids)[doc.answers]
    return labels


SYNTHETIC_TASKS = ("passkey", "mqar", "mqar_text", "copy")
RECALL_TASKS = ("mqar", "mqar_text")  # the tasks with key-value pairs
TOKEN_TASKS = ("mqar", "copy")  # documents of random token ids (RecallVocabulary), no text


class SyntheticDocuments:
    """Documents of one synthetic task for one tokenizer: "passkey" (a passkey or needle prompt and its answer),
    "mqar" (token-level multi-query associative recall), "mqar_text" (its natural-language form) or "copy" (a random
    sequence written twice); `pairs`: the key-value pairs of a recall document (None: a third of its slots)."""

    def __init__(self, task: str, tokenizer: Tokenizer, pairs: int | None = None) -> None:
        if task not in SYNTHETIC_TASKS:
            raise ValueError(f"synthetic task must be one of {SYNTHETIC_TASKS}, got {task!r}")
        if pairs is not None and task not in RECALL_TASKS:
            raise ValueError(f"a number of key-value pairs applies to the recall tasks (mqar, mqar_text), not {task}")
        if pairs is not None and pairs < 1:
            raise ValueError(f"the number of key-value pairs must be positive, got {pairs}")
        self.task, self.builder, self.pairs = task, PromptBuilder(tokenizer), pairs
        self.vocab = RecallVocabulary.of(tokenizer) if task in TOKEN_TASKS else None

    def __call__(self, length: int, rng: random.Random) -> RecallDocument:
        if self.task == "mqar":
            return mqar_document(length, self.vocab, rng, self.pairs)
        if self.task == "copy":
            return copy_document(length, self.vocab, rng)
        if self.task == "mqar_text":
            return mqar_text_document(self.builder, length, rng, self.pairs)
        return passkey_document(self.builder, length, rng)

    def check_length(self, length: int, samples: int = 256) -> None:
        """ValueError "LENGTH is too short for ... (why)" when documents of `length` tokens cannot be made: checked
        on the longest text of `samples` seeded documents, with 8 tokens to spare in the text forms for rarer longer
        encodings of their numbers (the token-level tasks, TOKEN_TASKS, have none)."""
        margin = 0 if self.task in TOKEN_TASKS else 8
        try:
            for i in range(samples):
                if not self(max(1, length - margin), random.Random(i)).answers:
                    raise ValueError("no answer fits")
        except ValueError as e:
            raise ValueError(f"{length} is too short for synthetic {self.task} documents ({e})") from None


class SyntheticMix:
    """A TokenLoader whose rows are replaced, each with probability `rate`, by a synthetic document of `task`
    (SyntheticDocuments, `pairs` key-value pairs in a recall document) of the same length. Labels equal the ids (the
    model shifts them), or with `answer_loss` are IGNORE_INDEX (-100) except at a synthetic row's answers, so the
    loss is taken on answers only (a corpus row keeps every label). Which rows and what they hold depend only on
    (seed, epoch, step, rank, row), so the mix is deterministic and resumes exactly with the loader's own state
    (`state_dict` / `load_state_dict`)."""

    def __init__(self, loader: TokenLoader, tokenizer: Tokenizer, rate: float, seed: int = 0, task: str = "passkey",
                 answer_loss: bool = False, pairs: int | None = None) -> None:
        if not 0 <= rate <= 1:
            raise ValueError(f"synthetic_mix must be in [0, 1], got {rate}")
        self.loader, self.rate, self.seed, self.answer_loss = loader, rate, seed, answer_loss
        self.documents = SyntheticDocuments(task, tokenizer, pairs)
        try:
            self.documents.check_length(loader.seq_len)
        except ValueError as e:
            fewer = ", fewer --synthetic_pairs" if pairs else ""
            raise ValueError(f"--context_length {e}; use a longer context{fewer} or --synthetic_mix 0") from None

    def __iter__(self) -> SyntheticMix:
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        loader = self.loader
        epoch, step = (loader.epoch + 1, 0) if loader.step == loader.steps_per_epoch else (loader.epoch, loader.step)
        input_ids, labels = next(loader)  # (B, T) each
        for row in range(input_ids.shape[0]):
            rng = random.Random(f"{self.seed}-{epoch}-{step}-{loader.rank}-{row}")
            if rng.random() < self.rate:
                doc = self.documents(loader.seq_len, rng)
                input_ids[row] = torch.tensor(doc.ids)
                labels[row] = answer_labels(doc) if self.answer_loss else input_ids[row]
        return input_ids, labels

    def state_dict(self) -> dict:
        return self.loader.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.loader.load_state_dict(state)

    @property
    def index(self) -> dict:
        return self.loader.index
