"""The cost of NSA's selection-scoring loss (nsa/scoring.py) by sequence length, one layer's call with its backward,
for its forms side by side: the dense target (every key of every contested block), every 8th query, each query's
24 blocks of highest importance and 8 random others, and both.

    python benchmarks/bench_score_loss.py [--lengths 2048 4096 8192 16384] [--rounds 5] [--threads N]
    python benchmarks/bench_score_loss.py --flops [--lengths 8192 32768 131072]

The geometry is the MQAR recipe's (benchmarks/results/recall.md): the demo model's heads (4 query heads, 2 key/value
heads of 32), blocks l = d = l' = 8, n = 18, one sequence. Random inputs (the cost does not depend on their values).
Rounds interleave the forms, so that load changes on the machine hit all of them alike; the table reports each form's
median milliseconds and its ratio to the dense target at the same length.

With --flops it counts instead of timing, on any machine: floating-point operations of one layer's call with its
backward (torch.utils.flop_counter on fake tensors: matrix products only) at the 4B preset's geometry (32 query
heads, 8 key/value heads of 128, the paper's blocks l = 32, d = 16, l' = 64, n = 16), each form's as a share of
full attention's forward and backward at the same length (6 H D T^2 causal: QK^T and PV forward, four products
backward), and how much of the last form is its importance (the compression branch's product, counted by the
difference with a stand-in that has none).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from unittest import mock

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from modeling.config import ComputeConfig, ModelConfig  # noqa: E402
from modeling.objective import Objective  # noqa: E402
from nsa import scoring  # noqa: E402
from nsa.blocks import num_compressed_blocks  # noqa: E402
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
    objective = Objective(nsa_score_loss_coef=0.1, **form)
    start = time.perf_counter()
    selection_score_loss(q, k_cmp, k_slc, config, ComputeConfig(), objective).backward()
    return time.perf_counter() - start


def call_flops(T: int, form: dict, config: ModelConfig) -> int:
    """Floating-point operations (matrix products) of one call of the loss with its backward at length T."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils.flop_counter import FlopCounterMode

    H, KV, D = config.n_heads, config.n_kv_heads, config.head_dim
    objective = Objective(nsa_score_loss_coef=0.1, **form)
    # Fake tensors hold no values: the loss's host draws (a stride's offset, a seed) take their largest value.
    with FakeTensorMode(), FlopCounterMode(display=False) as counter:
        q = torch.empty(1, H, T, D, requires_grad=True)
        k_cmp = torch.empty(1, KV, num_compressed_blocks(T, config.nsa_block_size, config.nsa_stride), D,
                            requires_grad=True)
        k_slc = torch.empty(1, KV, T, D)
        selection_score_loss(q, k_cmp, k_slc, config, ComputeConfig(), objective).backward()  # the default chunk
    return counter.get_total_flops()


def flops_table(lengths: list[int]) -> None:
    """The --flops table (module docstring)."""
    config = ModelConfig.from_preset("4B", attention_type="nsa")
    H, D = config.n_heads, config.head_dim
    print(f"4B geometry: {H} heads, {config.n_kv_heads} KV heads, D = {D}, l = {config.nsa_block_size}, "
          f"d = {config.nsa_stride}, l' = {config.nsa_select_block_size}, n = {config.nsa_num_selected}; "
          "TFLOP of one layer's loss, forward and backward, and its share of full attention's")
    print(f"| T | full attention | {' | '.join(FORMS)} | importance in the last |")
    print(f"|---|---|{'---|' * len(FORMS)}---|")
    last = list(FORMS.values())[-1]
    for T in lengths:
        full = 6 * H * D * T * T
        flops = [call_flops(T, form, config) for form in FORMS.values()]
        with mock.patch.object(scoring, "block_log_importance", flat_log_importance):
            beside_importance = call_flops(T, last, config)
        cells = [f"{f / 1e12:.3g} ({f / full:.1%})" for f in flops]
        print(f"| {T} | {full / 1e12:.3g} | {' | '.join(cells)} | {1 - beside_importance / flops[-1]:.0%} |",
              flush=True)


def flat_log_importance(q: torch.Tensor, k_cmp: torch.Tensor, q_pos: torch.Tensor, l: int, d: int, l_sel: int,
                        n_select: int) -> torch.Tensor:
    """A stand-in for `nsa.blocks.block_log_importance` without a matrix product: equal scores, gradients of
    zero."""
    return (q.sum() * 0 + k_cmp.sum() * 0).expand(q.shape[0], k_cmp.shape[1], q.shape[2], n_select)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", type=int, nargs="+", default=None,
                   help="sequence lengths (default 2048 4096 8192 16384; with --flops 8192 32768 131072)")
    p.add_argument("--flops", action="store_true", help="count operations at the 4B geometry instead of timing")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = p.parse_args(argv)
    if args.flops:
        args.lengths = args.lengths or [8192, 32768, 131072]
        if min(args.lengths) < 2048 or any(T % 64 for T in args.lengths):
            p.error("with --flops, --lengths must be multiples of 64 of at least 2048")
        return flops_table(args.lengths)
    args.lengths = args.lengths or [2048, 4096, 8192, 16384]
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
