"""The cost of NSA's selection-scoring loss (nsa/scoring.py) by sequence length, one layer's call with its backward,
for its forms side by side: the dense target (every key of every contested block), every 8th query, each query's
24 blocks of highest importance and 8 random others, and both.

    python benchmarks/bench_score_loss.py [--lengths 2048 4096 8192 16384] [--rounds 5] [--threads N]

The geometry is the MQAR recipe's (benchmarks/RESULTS.md): the demo model's heads (4 query heads, 2 key/value heads
of 32), blocks l = d = l' = 8, n = 18, one sequence. Random inputs (the cost does not depend on their values).
Rounds interleave the forms, so that load changes on the machine hit all of them alike; the table reports each
form's median milliseconds and its ratio to the dense target at the same length.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from modeling.config import ComputeConfig, ModelConfig  # noqa: E402
from nsa.scoring import selection_score_loss  # noqa: E402

FORMS = {"dense target": {}, "every 8th query": {"nsa_score_loss_stride": 8},
         "top 24 + 8 random": {"nsa_score_loss_top": 24, "nsa_score_loss_random": 8},
         "top 24 + 8 random, every 8th": {"nsa_score_loss_top": 24, "nsa_score_loss_random": 8,
                                          "nsa_score_loss_stride": 8}}
GEOMETRY = {"qk_norm": False, "nsa_separate_kv": False, "nsa_compressor": "mean", "nsa_block_size": 8,
            "nsa_stride": 8, "nsa_select_block_size": 8, "nsa_num_selected": 18}


def call_seconds(T: int, form: dict, seed: int) -> float:
    """Seconds of one call of the loss with its backward at length T."""
    config = ModelConfig.from_preset("demo", attention_type="nsa", context_length=T, **GEOMETRY)
    H, KV, D = config.n_heads, config.n_kv_heads, config.head_dim
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, H, T, D, generator=g, requires_grad=True)
    k_cmp = torch.randn(1, KV, T // config.nsa_stride, D, generator=g, requires_grad=True)
    k_slc = torch.randn(1, KV, T, D, generator=g)
    compute = ComputeConfig(nsa_score_loss_coef=0.1, **form)
    start = time.perf_counter()
    selection_score_loss(q, k_cmp, k_slc, config, compute).backward()
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 8192, 16384])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = p.parse_args(argv)
    if min(args.lengths) < 256 or any(T % 8 for T in args.lengths) or args.rounds < 1:
        p.error("--lengths must be multiples of 8 of at least 256, --rounds at least 1")
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.rounds} rounds, medians")
    print(f"| T | {' | '.join(FORMS)} |")
    print(f"|---|{'---|' * len(FORMS)}")
    for T in args.lengths:
        for form in FORMS.values():
            call_seconds(T, form, 0)  # warm-up
        times = {name: [] for name in FORMS}
        for r in range(args.rounds):
            for name, form in FORMS.items():
                times[name].append(call_seconds(T, form, r))
        medians = {name: statistics.median(t) for name, t in times.items()}
        dense = medians["dense target"]
        cells = [f"{1e3 * m:.0f} ms ({m / dense:.2f})" for m in medians.values()]
        print(f"| {T} | {' | '.join(cells)} |", flush=True)


if __name__ == "__main__":
    main()
