"""Why does an NSA model miss a far pair? For MQAR documents (synthetic.mqar_document), each answer beyond the
sliding window is looked up through the selection branch: the query's key token must select the block holding the
pair's value (whose hidden state carries the key). This script scores every answer under teacher forcing and asks,
layer by layer, whether that block was among the blocks the query's position selected (any KV group), using
nsa.inspection's recomputation of the selection.

    python benchmarks/nsa_recall_selection.py runs/recall_pairs/nsa-seed0/T512-p4/model --length 512 --pairs 4

Prints, per key-query distance bucket: the answers, their accuracy, and per layer the share whose pair's block
was selected, with the accuracy of the answers whose block was selected in the last layer and of those whose block
was not. Selection blocks: the model's nsa_select_block_size; block 0 and the two most recent are always selected.
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from evaluation.tasks import score_answers  # noqa: E402
from nsa.inspection import check_nsa_model, inspect  # noqa: E402
from storage.weights import load_model  # noqa: E402
from text.synthetic import SyntheticDocuments  # noqa: E402


def selection_hits(model: torch.nn.Module, length: int, samples: int, seed: int,
                   documents: SyntheticDocuments) -> list[dict]:
    """One row per answer: {"distance", "right", "hits" (per layer: the pair's value block was selected at the
    query's position by any KV group)}."""
    rng = random.Random(f"{seed}-selection-{length}")
    block = model.config.nsa_select_block_size
    rows = []
    for _ in range(samples):
        doc = documents(length, rng)
        ids = torch.tensor([doc.ids])  # (1, T)
        layers = inspect(model, ids)  # per layer: "selected" (1, KV, T, n)
        scores = score_answers(model, ids, [doc.answers])[0]
        for answer, distance, (right, _) in zip(doc.answers, doc.distances, scores, strict=True):
            query, value = answer - 1, answer - distance  # the query's key token; the pair's value token
            hits = [bool((found["selected"][0, :, query] == value // block).any()) for found in layers]
            rows.append({"distance": distance, "right": right, "hits": hits})
    return rows


def report(rows: list[dict], window: int) -> str:
    """The table by distance bucket (powers of two)."""
    n_layers = len(rows[0]["hits"])
    header = ["distance", "answers", "accuracy", *(f"selected, layer {i}" for i in range(n_layers)),
              "accuracy if selected (last layer)", "accuracy if not"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    buckets: dict[int, list[dict]] = {}
    for row in rows:
        buckets.setdefault(max(1, row["distance"]).bit_length() - 1, []).append(row)

    def share(group: list[bool]) -> str:
        return f"{sum(group) / len(group):.1%}" if group else "-"

    for k, group in sorted(buckets.items()):
        hit = [r["right"] for r in group if r["hits"][-1]]
        miss = [r["right"] for r in group if not r["hits"][-1]]
        cells = [f"{2**k}-{2**(k + 1) - 1}", str(len(group)), share([r["right"] for r in group]),
                 *(share([r["hits"][i] for r in group]) for i in range(n_layers)), share(hit), share(miss)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + f"\n(the sliding window covers distances up to {window})"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", help="an NSA model: a run's model/ export or a checkpoint")
    p.add_argument("--length", type=int, default=512)
    p.add_argument("--pairs", type=int, help="key-value pairs a document (default: a third of its slots)")
    p.add_argument("--samples", type=int, default=64, help="documents")
    p.add_argument("--seed", type=int, default=2000)
    p.add_argument("--tokenizer", help="default: the one stored with the model")
    args = p.parse_args(argv)
    try:  # every input checked before the model is loaded; a bad one is a one-line error (exit 2)
        if args.samples < 1:
            raise ValueError(f"--samples must be at least 1, got {args.samples}")
        config, tokenizer = check_nsa_model(args.model, args.tokenizer, "recomputes NSA's selection", args.length)
        documents = SyntheticDocuments("mqar", tokenizer, args.pairs)
        documents.check_length(args.length)
    except (OSError, ValueError) as e:
        p.error(str(e))
    model = load_model(args.model).eval()
    print(report(selection_hits(model, args.length, args.samples, args.seed, documents), config.nsa_window))


if __name__ == "__main__":
    main()
