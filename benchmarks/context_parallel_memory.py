"""Context parallelism at full size, estimated on a CPU: profile_memory's estimate of one training step of the 4B
preset on 8 GPUs of 80 GB, per GPU, with NSA and full attention at 131,072, 524,288 and 1,048,576 tokens, for two
layouts of the 8 ranks (FSDP 1 x context 8, FSDP 2 x context 4), train.py's automatic recipe (checkpointing, FFN
tiles, chunked loss, activation offload when the checkpointed inputs would take over 20% of the GPU), and the bytes
each rank sends for the sequence split. Then the same step at 131k with 1, 2, 4 and 8 ranks a sequence and offload
off: what forward keeps per rank against 1 / N. Prints two Markdown tables; GiB per GPU.

    python benchmarks/context_parallel_memory.py          # about 15 minutes on 2 cores
    python benchmarks/context_parallel_memory.py --lengths 131072 --attention nsa
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from modeling.config import GiB  # noqa: E402
from training.estimate import StepConfig, estimate  # noqa: E402
from training.fit import check_fit  # noqa: E402

GPUS, GPU_MEMORY = 8, 80.0


def _quiet(message: str) -> None:
    """check_fit's lines (it finds nothing to change when the step fits)."""


def layout_row(attention: str, T: int, context: int) -> str:
    """One row: the per-GPU peak, what offload keeps in host memory, the margin on an 80 GB GPU (2 GiB kept for the
    CUDA context and NCCL), and the bytes a rank sends a step (and a layer)."""
    config = StepConfig.of(model_size="4B", context_length=T, attention_type=attention, world_size=GPUS,
                           context_parallel=context, gradient_checkpointing=True, batch_size=1,
                           gpu_memory_gib=GPU_MEMORY)
    result = estimate(config)
    fit = check_fit(result, GPU_MEMORY, log=_quiet)
    host = max(stage.get("host", 0) for stage in result["stages"].values()) / GiB
    sent = (result["traffic"]["gathered"] + result["traffic"]["scattered"]) / GiB
    layers = config.configs()[0].n_layers
    return (f"| {attention} | {T:,} | {GPUS // context} x {context} | {T // context:,} | "
            f"{result['peak']['total'] / GiB:.1f} | {host:.1f} | {fit['margin_gib']:+.1f} | "
            f"{'yes' if fit['fits'] else 'no'} | {sent:,.0f} ({sent / layers:.1f}) |")


def scan_row(attention: str, T: int, context: int, single: float | None) -> tuple[str, float]:
    """One row of the 1 / N scan: what forward keeps per rank (checkpointed block inputs and the loss's inputs),
    against the one-rank figure divided by N."""
    config = StepConfig.of(model_size="4B", context_length=T, attention_type=attention, world_size=GPUS,
                           context_parallel=context, gradient_checkpointing=True, batch_size=1,
                           offload_activations=False)
    result = estimate(config)
    kept = result["stages"]["after forward"]["activations"] / GiB
    ideal = (single if single is not None else kept) / context
    return (f"| {context} | {T // context:,} | {kept:.2f} | {ideal:.2f} | {kept / ideal:.3f} | "
            f"{result['peak']['total'] / GiB:.1f} |"), kept


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[131072, 524288, 1048576])
    parser.add_argument("--attention", nargs="+", default=["nsa", "full"], choices=["nsa", "full"])
    parser.add_argument("--contexts", type=int, nargs="+", default=[8, 4], help="ranks a sequence, of the 8")
    args = parser.parse_args()
    start = time.perf_counter()
    print(f"| attention | T | FSDP x context | tokens a rank | peak | host (offload) | margin on {GPU_MEMORY:g} GB | "
          "fits | sent a step (a layer) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for attention in args.attention:
        for T in args.lengths:
            for context in args.contexts:
                print(layout_row(attention, T, context), flush=True)
    print(f"\nThe same step at {min(args.lengths):,} tokens ({args.attention[0]}), offload off: what forward keeps "
          "a rank")
    print("| ranks a sequence | tokens a rank | kept after forward | one rank's / N | ratio | peak |")
    print("|---|---|---|---|---|---|")
    single = None
    for context in (1, 2, 4, 8):
        row, kept = scan_row(args.attention[0], min(args.lengths), context, single)
        single = kept if single is None else single
        print(row, flush=True)
    print(f"\n({time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
    main()
