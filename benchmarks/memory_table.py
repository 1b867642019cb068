"""The "Will it fit?" table of README.md: profile_memory's estimate of one training step of a model preset, per GPU,
at several context lengths, on 1 or 2 GPUs, with full attention and NSA, in three recipes: neither checkpointing nor
FFN tiles, gradient checkpointing, and checkpointing with a tiled FFN (8192 tokens per tile). The loss is train.py's
automatic choice (chunked from 32768 tokens). Prints a Markdown table; GiB per GPU.

    python benchmarks/memory_table.py                       # 4B at 4k, 32k and 131k: about 10 minutes on 2 cores
    python benchmarks/memory_table.py --model_size 0.6B --lengths 4096 32768
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from modeling.config import PRESETS, GiB  # noqa: E402
from modeling.memtrack import CATEGORIES  # noqa: E402
from training.estimate import StepConfig, estimate  # noqa: E402

RECIPES = {"no checkpointing": dict(gradient_checkpointing=False, ffn_chunk_size=0),
           "checkpointing": dict(gradient_checkpointing=True, ffn_chunk_size=0),
           "checkpointing + tiled FFN": dict(gradient_checkpointing=True, ffn_chunk_size=8192)}


def table_row(model_size: str, T: int, gpus: int, attention: str, gpu_memory: float = 80.0, reserve: float = 2.0
              ) -> str:
    """One row of the table: the peaks of the three recipes, the split of the last one's peak, its margin."""
    peaks, last = [], None
    for options in RECIPES.values():
        last = estimate(StepConfig.of(model_size=model_size, context_length=T, world_size=gpus,
                                      attention_type=attention, batch_size=1, **options))
        peaks.append(last["peak"]["total"] / GiB)
    peak = last["peak"]
    state = sum(peak[c] for c in CATEGORIES[:3]) / GiB
    split = f"{state:.1f} / {peak['activations'] / GiB:.1f} / {peak['temporaries'] / GiB:.1f}"
    margin = gpu_memory - reserve - peaks[-1]
    return (f"| {T:,} | {gpus} | {attention} | {last['loss_path']} | " + " | ".join(f"{p:.1f}" for p in peaks)
            + f" | {split} | {margin:+.1f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model_size", default="4B", choices=sorted(PRESETS))
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 32768, 131072])
    parser.add_argument("--gpu_memory", type=float, default=80.0, help="GiB per GPU for the margin column")
    parser.add_argument("--reserve", type=float, default=2.0, help="GiB kept for what the estimate cannot see")
    args = parser.parse_args()
    start = time.perf_counter()
    print(f"| tokens | GPUs | attention | loss | {' | '.join(RECIPES)} | split at the last peak | margin on "
          f"{args.gpu_memory:g} GiB |")
    print("|---|---|---|---|---|---|---|---|---|")
    for T in args.lengths:
        for gpus in (1, 2):
            for attention in ("full", "nsa"):
                print(table_row(args.model_size, T, gpus, attention, args.gpu_memory, args.reserve), flush=True)
    print(f"\n({time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
    main()
