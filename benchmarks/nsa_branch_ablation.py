"""Which NSA branch carries a model's recall, and how much does its block selection lose? Scores synthetic
documents (copying or MQAR, synthetic.py) under teacher forcing, by key-query distance (eval.py's log-spaced
buckets), or eval.py's passkey and needle prompts by exact match of the greedy continuation, by depth: once as the
model is, once with exact block scores (`nsa.primitive.exact_block_scores`: each block scored
by its best token's logit, reading every key: a diagnosis of the block scoring), and once with each branch
switched off: its gate forced to 0 in every layer (sigmoid(-inf) = 0 exactly), the other two gates left as the
model computes them.

    python benchmarks/nsa_branch_ablation.py runs/recall_copy/nsa-seed0/copy-T64/model --task copy --length 64
    python benchmarks/nsa_branch_ablation.py runs/recall_copy/nsa-seed0/T2048-p4/model --length 2048 --pairs 4
    python benchmarks/nsa_branch_ablation.py runs/pk/passkey1024/model --task passkey --length 1014 --samples 10 \
        --json runs/pk/passkey1024/ablation.json        # and the results as JSON

A branch whose removal costs nothing is not needed (the others cover for it); one whose removal drops a bucket to
chance is the only path to those answers. Where exact block scores gain much, the selected blocks would carry the
answer but the compression branch scores the wrong ones. A compressed key summarises a block of l tokens and exists
once the block is complete (block i from position i*d + l - 1 on), so recall through the compression branch is
coarse and misses up to the d - 1 most recent tokens.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import Tensor, nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from evaluation.recall import recall_scores  # noqa: E402
from evaluation.retrieval import GRID_TASKS, check_prompt_options, retrieval_grid  # noqa: E402
from inspect_nsa import check_nsa_model  # noqa: E402
from nsa.layer import NativeSparseAttention  # noqa: E402
from nsa.primitive import exact_block_scores  # noqa: E402
from storage.weights import load_model  # noqa: E402
from text.synthetic import TOKEN_TASKS, PromptBuilder, SyntheticDocuments  # noqa: E402
from training.cli import check_writable  # noqa: E402

BRANCHES = ("compression", "selection", "window")  # the order of branch_gate's 3 outputs per head


@contextmanager
def branch_off(model: nn.Module, branch: int) -> Iterator[None]:
    """Within the block, every NSA layer's gate of `branch` (an index into BRANCHES) is 0."""
    def hook(module: nn.Module, inputs: tuple[Tensor, ...], logits: Tensor) -> Tensor:
        logits = logits.unflatten(-1, (-1, 3)).clone()  # (B, T, H, 3)
        logits[..., branch] = -torch.inf
        return logits.flatten(-2)

    handles = [m.branch_gate.register_forward_hook(hook) for m in model.modules()
               if isinstance(m, NativeSparseAttention)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def ablation(model: nn.Module, score: Callable[[], dict]) -> dict[str, dict]:
    """score() (`recall_scores` or `retrieval_grid` of one length) with every branch ("all"), with exact block scores,
    and without each of BRANCHES."""
    results = {"all": score()}
    with exact_block_scores():
        results["exact block scores"] = score()
    for i, name in enumerate(BRANCHES):
        with branch_off(model, i):
            results[f"without {name}"] = score()
    return results


def report(results: dict[str, dict]) -> str:
    """The table: per distance bucket (documents) or depth (prompts), its answers and the accuracy of each variant;
    the last row all answers."""
    names, first = list(results), results["all"]
    header = ["distance" if "buckets" in first else "depth", "answers", *names]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    if "buckets" in first:
        for i, bucket in enumerate(first["buckets"]):
            cells = [f"{bucket['start']}-{bucket['end'] - 1}", str(bucket["count"]),
                     *(f"{results[n]['buckets'][i]['accuracy']:.1%}" for n in names)]
            lines.append("| " + " | ".join(cells) + " |")
        total = {n: results[n]["accuracy"] for n in names}
        lines.append("| all | " + str(first["answers"]) + " | " + " | ".join(f"{total[n]:.1%}" for n in names) + " |")
        return "\n".join(lines)
    for i, depth in enumerate(first["depths"]):  # one length: accuracy [[per depth]]
        cells = [f"{depth:g}", str(first["samples"]), *(f"{results[n]['accuracy'][0][i]:.0%}" for n in names)]
        lines.append("| " + " | ".join(cells) + " |")
    mean = {n: sum(results[n]["accuracy"][0]) / len(first["depths"]) for n in names}
    lines.append(f"| all | {first['samples'] * len(first['depths'])} | "
                 + " | ".join(f"{mean[n]:.1%}" for n in names) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, dict]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", help="an NSA model: a run's model/ export or a checkpoint")
    p.add_argument("--task", choices=TOKEN_TASKS + GRID_TASKS, default="mqar")
    p.add_argument("--length", type=int, default=512, help="tokens a document or prompt")
    p.add_argument("--pairs", type=int, help="MQAR: key-value pairs a document (default: a third of its slots)")
    p.add_argument("--samples", type=int, default=64, help="documents, or prompts a depth")
    p.add_argument("--depths", type=float, nargs="+", default=[0.0, 0.25, 0.5, 0.75, 1.0],
                   help="passkey, needle: where the needle sits (0 = start, 1 = end)")
    p.add_argument("--batch_size", type=int, default=8)
    p.add_argument("--seed", type=int, default=3000)
    p.add_argument("--tokenizer", help="default: the one stored with the model")
    p.add_argument("--json", metavar="FILE.json", help="also write the results there ({variant: scores})")
    args = p.parse_args(argv)
    try:  # every input checked before the model is loaded; a bad one is a one-line error (exit 2)
        if min(args.samples, args.batch_size) < 1:
            raise ValueError(f"--samples and --batch_size must be at least 1, got {args.samples} and "
                             f"{args.batch_size}")
        if args.json:
            check_writable(Path(args.json), "--json")
        found, tokenizer = check_nsa_model(args.model, args.tokenizer, "switches off NSA's branches", args.length)
        config = found.config
        if args.task in GRID_TASKS:
            builder = PromptBuilder(tokenizer)
            check_prompt_options(builder, args.task, args.length, args.depths, args.pairs, config.context_length)
        else:
            documents = SyntheticDocuments(args.task, tokenizer, args.pairs)
            documents.check_length(args.length)
    except (OSError, ValueError) as e:
        p.error(str(e))
    model = load_model(found).eval()
    if args.task in GRID_TASKS:
        def score() -> dict:
            return retrieval_grid(model, builder, args.task, [args.length], args.depths, args.samples, args.seed,
                                  args.batch_size)
    else:
        def score() -> dict:
            return recall_scores(model, documents, [args.length], args.samples, args.seed, args.batch_size)
    with torch.no_grad():
        results = ablation(model, score)
    print(report(results))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return results


if __name__ == "__main__":
    main()
