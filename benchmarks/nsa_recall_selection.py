"""Why does an NSA model miss a far answer? Beyond the sliding window an answer is looked up through the selection
branch: the answering query must select a block that holds what it looks for. For MQAR documents
(synthetic.mqar_document) that is the block of the pair's value (whose hidden state carries the key); for eval.py's
passkey and needle prompts (`--task passkey|needle`, the needle at `--depths`), the blocks of the needle that hold
the answer's tokens, looked up by the prompt's last token. This script scores every answer under teacher forcing
and asks, layer by layer, whether those blocks were all among the blocks the query's position selected (each by
some KV group), whether exact block scores (each block by its best key, `nsa.primitive.exact_block_scores`) would
have selected them, and what weight the selection-scoring loss's target (nsa/scoring.py) gives them (the most of
any KV group), using nsa.inspection's recomputation of the selection.

    python benchmarks/nsa_recall_selection.py runs/recall_pairs/nsa-seed0/T512-p4/model --length 512 --pairs 4
    python benchmarks/nsa_recall_selection.py runs/pk/passkey1024/model --task passkey --length 1014 \\
        --depths 0 0.25 0.5 0.75 --samples 16

Prints, per key-query distance bucket: the answers, their accuracy, per layer the share whose block was selected /
would be by exact block scores / the loss target's mean weight on it, and the accuracy of the answers whose block
was selected in the last layer and of those whose block was not. Where exact block scores select the block but the
target gives it little weight, the loss hardly teaches the selection to take it (its "selection" target weighs
each of the blocks exact scores select alike). Selection blocks: the model's nsa_select_block_size; block 0 and the
two most recent are always selected.
"""

from __future__ import annotations

import argparse
import random
import sys
from collections.abc import Iterator
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from evaluation.retrieval import GRID_TASKS, check_prompt_options, score_answers  # noqa: E402
from inspect_nsa import check_nsa_model
from nsa.inspection import inspect  # noqa: E402
from storage.weights import load_model  # noqa: E402
from text.synthetic import PromptBuilder, SyntheticDocuments  # noqa: E402

Lookup = tuple[range, int, list[int]]  # an answer's token positions, its key-query distance, the blocks holding it


def mqar_lookups(documents: SyntheticDocuments, length: int, samples: int, seed: int,
                 block: int) -> Iterator[tuple[list[int], list[Lookup]]]:
    """(ids, lookups) per MQAR document: every answer token, and the block of its pair's value."""
    rng = random.Random(f"{seed}-selection-{length}")
    for _ in range(samples):
        doc = documents(length, rng)
        yield doc.ids, [(range(a, a + 1), dist, [(a - dist) // block])
                        for a, dist in zip(doc.answers, doc.distances, strict=True)]


def prompt_lookups(builder: PromptBuilder, task: str, length: int, depths: list[float], samples: int, seed: int,
                   block: int) -> Iterator[tuple[list[int], list[Lookup]]]:
    """(ids, lookups) per passkey or needle prompt (eval.py's builder), its answer appended: one lookup, of the
    answer's tokens, whose query is the prompt's last token, and the blocks of the needle that hold the answer's
    tokens (its digits; a passkey needle holds them twice)."""
    make = builder.passkey if task == "passkey" else builder.needle
    for depth in depths:
        rng = random.Random(f"{seed}-{task}-{length}-{depth}")
        for _ in range(samples):
            prompt = make(length, depth, rng)
            answer = builder.tokenizer.encode(" " + prompt.answer)
            digits = set(builder.tokenizer.encode(prompt.answer))
            needle = range(prompt.needle_start, prompt.needle_end)
            held = sorted({p // block for p in needle if prompt.ids[p] in digits})
            yield prompt.ids + answer, [(range(length, length + len(answer)), length - prompt.needle_start, held)]


def selection_hits(model: torch.nn.Module, items: Iterator[tuple[list[int], list[Lookup]]]) -> list[dict]:
    """One row per lookup: {"distance", "right" (every answer token predicted under teacher forcing), and per layer
    "hits" (every block holding it was selected at the query's position, the answer's first token's, each by some
    KV group), "exact" (would be by exact block scores), "weight" (the loss target's weight on those blocks, the most
    of any KV group)}."""
    rows = []
    for ids, lookups in items:
        x = torch.tensor([ids])  # (1, T)
        layers = inspect(model, x, exact=True)  # per layer: "selected", "exact" (1, KV, T, n); "target" (.., Ns)
        scores = iter(score_answers(model, x, [[p for answer, _, _ in lookups for p in answer]])[0])
        for answer, distance, blocks in lookups:
            query, needed = answer[0] - 1, torch.tensor(blocks)
            rows.append({"distance": distance, "right": all([next(scores)[0] for _ in answer]),
                         "hits": [bool(torch.isin(needed, f["selected"][0, :, query].flatten()).all()) for f in layers],
                         "exact": [bool(torch.isin(needed, f["exact"][0, :, query].flatten()).all()) for f in layers],
                         "weight": [float(f["target"][0, :, query, needed].sum(-1).max()) for f in layers]})
    return rows


def report(rows: list[dict], window: int) -> str:
    """The table by distance bucket (powers of two)."""
    n_layers = len(rows[0]["hits"])
    header = ["distance", "answers", "accuracy",
              *(f"layer {i}: selected / by best keys / target weight" for i in range(n_layers)),
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
        layers = [f"{share([r['hits'][i] for r in group])} / {share([r['exact'][i] for r in group])} / "
                  f"{sum(r['weight'][i] for r in group) / len(group):.2f}" for i in range(n_layers)]
        cells = [f"{2**k}-{2**(k + 1) - 1}", str(len(group)), share([r["right"] for r in group]), *layers,
                 share(hit), share(miss)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + f"\n(the sliding window covers distances up to {window})"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", help="an NSA model: a run's model/ export or a checkpoint")
    p.add_argument("--task", choices=("mqar", *GRID_TASKS), default="mqar")
    p.add_argument("--length", type=int, default=512, help="tokens a document or prompt")
    p.add_argument("--pairs", type=int, help="MQAR: key-value pairs a document (default: a third of its slots)")
    p.add_argument("--depths", type=float, nargs="+", default=[0.0, 0.25, 0.5, 0.75, 1.0],
                   help="passkey, needle: where the needle sits (0 = start, 1 = end)")
    p.add_argument("--samples", type=int, default=64, help="documents, or prompts a depth")
    p.add_argument("--seed", type=int, default=2000)
    p.add_argument("--tokenizer", help="default: the one stored with the model")
    args = p.parse_args(argv)
    try:  # every input checked before the model is loaded; a bad one is a one-line error (exit 2)
        if args.samples < 1:
            raise ValueError(f"--samples must be at least 1, got {args.samples}")
        found, tokenizer = check_nsa_model(args.model, args.tokenizer, "recomputes NSA's selection", args.length)
        config = found.config
        block = config.nsa_select_block_size
        if args.task == "mqar":
            documents = SyntheticDocuments("mqar", tokenizer, args.pairs)
            documents.check_length(args.length)
            items = mqar_lookups(documents, args.length, args.samples, args.seed, block)
        else:
            builder = PromptBuilder(tokenizer)
            check_prompt_options(builder, args.task, args.length, args.depths, args.pairs, config.context_length)
            items = prompt_lookups(builder, args.task, args.length, args.depths, args.samples, args.seed, block)
    except (OSError, ValueError) as e:
        p.error(str(e))
    model = load_model(found).eval()
    print(report(selection_hits(model, items), config.nsa_window))


if __name__ == "__main__":
    main()
