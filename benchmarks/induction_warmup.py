"""Is forming an induction head what makes MQAR slow to learn? Two arms from the same initialisation, same steps:
- warm-up: --copy_steps steps of copying (each row a random sequence of T/2 token ids written twice, the loss on
  the second copy, which an induction head predicts perfectly), then MQAR documents (synthetic.mqar_document, the
  loss on the answers) for the remaining steps;
- baseline: MQAR documents for every step.
Then both are scored under teacher forcing on the same fresh MQAR documents, by key-query distance
(eval.recall_scores). If the warm-up arm ends far ahead, the induction circuit was the bottleneck; if not, the lookup
itself is.

    python benchmarks/induction_warmup.py                                  # demo shape, T = 64, 300 + 600 steps
    python benchmarks/induction_warmup.py --steps 1500 --copy_steps 300 --model_overrides '{"qk_norm": true}'

A plain loop (AdamW, constant lr, gradient clipping at 1), not train.py: both arms see exactly the same optimiser.
Prints the loss of each arm every 50 steps and a table of the final scores.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from config import ModelConfig  # noqa: E402
from eval import recall_scores  # noqa: E402
from loss import IGNORE_INDEX  # noqa: E402
from model import Transformer  # noqa: E402
from synthetic import RecallDocument, RecallVocabulary, answer_labels, mqar_document  # noqa: E402


def copy_batch(B: int, T: int, vocab_size: int, rng: random.Random) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, labels) (B, T): a random sequence of T/2 ids (16 and up) twice; labels only where the second copy is
    predictable (from its second token on: its first follows the first copy's last token, which says nothing)."""
    half = torch.tensor([[rng.randrange(16, vocab_size) for _ in range(T // 2)] for _ in range(B)])  # (B, T/2)
    ids = torch.cat([half, half], dim=1)  # (B, T)
    labels = torch.full_like(ids, IGNORE_INDEX)
    labels[:, T // 2 + 1:] = ids[:, T // 2 + 1:]
    return ids, labels


class MqarDocuments:
    """Token-level MQAR documents from the vocabulary size alone, with what eval.recall_scores reads of a
    synthetic.SyntheticDocuments (no tokenizer: the ids are random)."""

    task = "mqar"

    def __init__(self, vocab_size: int) -> None:
        self.vocab = RecallVocabulary(vocab_size)

    def __call__(self, length: int, rng: random.Random) -> RecallDocument:
        return mqar_document(length, self.vocab, rng)


def mqar_batch(B: int, T: int, documents: MqarDocuments, rng: random.Random) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, labels) (B, T) of MQAR documents, the labels at the answers only."""
    docs = [documents(T, rng) for _ in range(B)]
    return torch.tensor([d.ids for d in docs]), torch.stack([answer_labels(d) for d in docs])  # (B, T) each


def train_arm(config: ModelConfig, copy_steps: int, steps: int, B: int, T: int, lr: float, seed: int,
              curve: dict[int, float]) -> Transformer:
    """Train one arm; records its loss every 50 steps into `curve`."""
    torch.manual_seed(seed)
    model = Transformer(config)
    model.init_weights()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    documents, rng = MqarDocuments(config.vocab_size), random.Random(seed)
    for step in range(1, steps + 1):
        ids, labels = (copy_batch(B, T, config.vocab_size, rng) if step <= copy_steps else
                       mqar_batch(B, T, documents, rng))
        loss = model(ids, labels).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if step % 50 == 0:
            curve[step] = loss.item()
    return model


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=900, help="optimizer steps of each arm")
    p.add_argument("--copy_steps", type=int, default=300, help="the warm-up arm's first steps, on copying")
    p.add_argument("--context_length", type=int, default=64)
    p.add_argument("--batch_size", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--vocab_size", type=int, default=8192)
    p.add_argument("--model_overrides", type=json.loads, default={"qk_norm": False}, metavar="JSON",
                   help="fields over the demo preset (default: '{\"qk_norm\": false}')")
    p.add_argument("--documents", type=int, default=256, help="MQAR documents scored per arm")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if not 0 <= args.copy_steps < args.steps:
        p.error(f"--copy_steps must be in [0, --steps), got {args.copy_steps} of {args.steps}")
    config = ModelConfig.from_preset("demo", vocab_size=args.vocab_size, **args.model_overrides)
    T, arms = args.context_length, {"warm-up": args.copy_steps, "baseline": 0}
    curves: dict[str, dict[int, float]] = {name: {} for name in arms}
    results = {}
    for name, copy_steps in arms.items():
        start = time.perf_counter()
        model = train_arm(config, copy_steps, args.steps, args.batch_size, T, args.lr, args.seed, curves[name])
        scores = recall_scores(model, MqarDocuments(args.vocab_size), [T], args.documents, seed=1000, batch_size=32)
        results[name] = {**scores, "seconds": time.perf_counter() - start}
    print("| step | " + " | ".join(f"{name} loss" for name in arms) + " |")
    print("|---|" + "---|" * len(arms))
    for step in curves["baseline"]:
        print(f"| {step} | " + " | ".join(f"{curves[name][step]:.3f}" for name in arms) + " |")
    groups = [(2, 8), (8, 16), (16, T)]
    print("\n| arm | minutes | answers | accuracy | " + " | ".join(f"{a}-{b - 1}" for a, b in groups)
          + " | mean log-prob. |")
    print("|---|---|---|---|" + "---|" * len(groups) + "---|")
    for name, r in results.items():
        cells = []
        for a, b in groups:
            group = [x for x in r["buckets"] if a <= x["start"] and x["end"] <= b]
            n = sum(x["count"] for x in group)
            cells.append(f"{sum(x['accuracy'] * x['count'] for x in group) / n:.1%}" if n else "-")
        print(f"| {name} | {r['seconds'] / 60:.1f} | {r['answers']} | {r['accuracy']:.1%} | " + " | ".join(cells)
              + f" | {r['answer_logprob']:.2f} |")


if __name__ == "__main__":
    main()
