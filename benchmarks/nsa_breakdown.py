"""Where NSA's time goes, on CPU: (1) forward and backward seconds of each branch's attention kernel calls
(`attend` / `attend_backward` of modeling/flash.py as nsa/torch_path.py calls them, grouped by the rows per call)
inside one forward+backward of the benchmark layer of bench_nsa.py; (2) the fused CPU flash kernels on selection
tiles of 64 and 128 rows (R = 16 and 32 queries of 4 heads) at equal total rows, the measurement behind
`nsa.torch_path._SMALL_TILE_COST`.

    MALLOC_TRIM_THRESHOLD_=1099511627776 MALLOC_MMAP_THRESHOLD_=33554432 python benchmarks/nsa_breakdown.py   # ~1 min

(the allocator settings of bench_nsa.py; run on an idle machine)

Rows per call identify the branch for the benchmark geometry (G = 4, query chunk 512, l' = 64, window pieces of
128): 64 or 128 selection tiles, 256 own blocks, 512 window pieces, 2048 the compression's backward (its forward is
explicit, not a kernel call) and, in the chunks before n*l' = 1024 keys, the selection as one causal attention over
the prefix. The chunks run on one thread per intra-op thread (nsa/attention.py), each kernel call single-threaded:
kernel seconds are summed over those threads, so they can exceed the wall time of the step.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import bench_nsa  # noqa: E402

from nsa import torch_path  # noqa: E402


def kernel_seconds(T: int) -> tuple[float, dict[tuple[str, int], float]]:
    """(total seconds of one forward+backward at T, kernel seconds per (direction, rows per call))."""
    seconds: collections.Counter = collections.Counter()
    attend, attend_backward = torch_path.attend, torch_path.attend_backward

    def timed(fn, direction: str):
        def call(*args):
            rows = args[0 if direction == "fwd" else 1].shape[2]
            start = time.perf_counter()
            result = fn(*args)
            seconds[direction, rows] += time.perf_counter() - start
            return result
        return call

    args = argparse.Namespace(dim=512, heads=8, kv_heads=2, head_dim=64, query_chunk=512)
    torch.manual_seed(0)
    _, run = bench_nsa.build("nsa", args)
    torch_path.attend, torch_path.attend_backward = timed(attend, "fwd"), timed(attend_backward, "bwd")
    try:
        run(torch.randn(1, 512, 512, requires_grad=True)).square().mean().backward()  # warm-up
        seconds.clear()
        x = torch.randn(1, T, 512, requires_grad=True)
        start = time.perf_counter()
        run(x).square().mean().backward()
        total = time.perf_counter() - start
    finally:
        torch_path.attend, torch_path.attend_backward = attend, attend_backward
    return total, dict(seconds)


def tile_seconds(rows: int, total_rows: int = 131072, keys: int = 64, dim: int = 64, repeats: int = 5) -> float:
    """Mean seconds of one forward + backward of the CPU flash kernels over total_rows query rows in tiles of `rows`."""
    n = total_rows // rows
    q, k, v = torch.randn(n, 1, rows, dim), torch.randn(n, 1, keys, dim), torch.randn(n, 1, keys, dim)
    out, lse = torch_path.attend(q, k, v, None, dim**-0.5)
    grad = torch.randn_like(out)

    def step() -> None:
        torch_path.attend(q, k, v, None, dim**-0.5)
        torch_path.attend_backward(grad, q, k, v, out, lse, None, dim**-0.5)

    step()
    start = time.perf_counter()
    for _ in range(repeats):
        step()
    return (time.perf_counter() - start) / repeats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq-len", type=int, default=32768)
    args = parser.parse_args()
    total, seconds = kernel_seconds(args.seq_len)
    print(f"T={args.seq_len}: forward+backward {total:.2f} s (wall), attention kernels {sum(seconds.values()):.2f} s "
          f"(summed over {torch.get_num_threads()} worker threads)")
    print("| rows per call | forward s | backward s |\n|---|---|---|")
    for rows in sorted({r for _, r in seconds}):
        print(f"| {rows} | {seconds.get(('fwd', rows), 0):.2f} | {seconds.get(('bwd', rows), 0):.2f} |")
    small, large = tile_seconds(64), tile_seconds(128)
    print(f"tiles, 131072 rows, forward+backward: 64-row tiles {small * 1e3:.0f} ms, 128-row tiles "
          f"{large * 1e3:.0f} ms, ratio {small / large:.2f}")


if __name__ == "__main__":
    main()
