"""NSA on a CUDA GPU against full causal attention (SDPA, flash backend): forward and forward+backward time and peak
memory of one attention layer, side by side in one process, bf16, the 4B geometry by default (dim 2560, H=32,
KV=8, D=128). `nsa` runs its three branches and the importance scores on the Triton kernels (nsa/triton_path.py);
`nsa-torch` is the same layer with `ComputeConfig.triton_kernels=False` (the explicit PyTorch path, tiles for the
selection). `nsa+loss` and `nsa+dense-loss` are `nsa` training with the selection-scoring loss (nsa/scoring.py, weight
0.1, its PyTorch path): on candidate blocks (24 of highest importance + 8 random, every 8th query), and the dense
target (every key, every query); their last column is the step's time over `nsa`'s, the loss's share of a step.

    python benchmarks/bench_nsa_gpu.py                               # T = 8k, 32k, 64k
    python benchmarks/bench_nsa_gpu.py --seq-lens 8192 --repeats 10 --impls sdpa nsa
    python benchmarks/bench_nsa_gpu.py --seq-lens 32768 --impls nsa nsa+loss nsa+dense-loss   # the loss's cost
    python benchmarks/bench_nsa_gpu.py --seq-lens 65536 --impls sdpa nsa --profile 65536  # and the top kernels
    python benchmarks/bench_nsa_gpu.py --device cpu --seq-lens 256 --dim 64 --heads 4 --kv-heads 2 --head-dim 16
        # a smoke run of this script without a GPU (Triton's interpreter; times meaningless)

Times are medians over --repeats runs after two warm-up runs; peak memory is torch.cuda.max_memory_allocated
growth over the step (weights and input excluded). U (Triton layers): the distinct blocks a tile of queries
selected, over n, averaged over tiles (`union_sizes`): the forward and dQ kernels' work per tile is U x n blocks, so
U reads the times (on random weights it grows with T; a trained model's queries agree more). "fwd" is the forward
without gradients (inference: NSA's Triton path then runs eight query chunks, `nsa.attention._query_chunk`),
"fwd+bwd" a training step (one chunk).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator

import torch

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import bench_nsa  # noqa: E402

IMPLS = ("sdpa", "nsa", "nsa-torch", "nsa+loss", "nsa+dense-loss")
TRITON_IMPLS = ("nsa", "nsa+loss", "nsa+dense-loss")  # NSA's branches on the Triton kernels
SCORE_LOSS = {"nsa+loss": {"nsa_score_loss_coef": 0.1, "nsa_score_loss_stride": 8, "nsa_score_loss_top": 24,
                           "nsa_score_loss_random": 8},
              "nsa+dense-loss": {"nsa_score_loss_coef": 0.1}}


def build(impl: str, args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> Callable:
    """The layer as a function x (1, T, dim) -> (1, T, dim) on device, in dtype (bench_nsa.py's layers)."""
    layer, run = bench_nsa.build("sdpa" if impl == "sdpa" else "nsa", args, triton_kernels=impl in TRITON_IMPLS,
                                 objective=SCORE_LOSS.get(impl))
    layer.to(device, dtype)
    return run


def training_step(run: Callable, x: torch.Tensor) -> None:
    """Forward and backward of a stand-in loss, with the layer's training-only terms (the score loss) added."""
    from modeling.attention import collect_aux_losses  # after main() sets TRITON_INTERPRET: it imports the kernels

    with collect_aux_losses() as aux:
        loss = run(x).float().square().mean()
    sum(aux, loss).backward()


@contextlib.contextmanager
def union_sizes() -> Iterator[list[float]]:
    """Inside: each selection of the Triton path (`TritonSelection`) appends U, the mean over its query tiles of the
    distinct blocks the tile's queries selected, over n: the forward and dQ kernels walk each tile's union, so their
    work is U times that of one query's n blocks (the cost model's input; 1 when a tile's queries agree)."""
    from nsa import triton_path

    found, init = [], triton_path.TritonSelection.__init__

    def recording(self: triton_path.TritonSelection, *args: object, **kwargs: object) -> None:
        init(self, *args, **kwargs)
        found.append((self.count.float().mean() / self.n).item())

    triton_path.TritonSelection.__init__ = recording
    try:
        yield found
    finally:
        triton_path.TritonSelection.__init__ = init


def timed(step: Callable[[], None], device: torch.device, repeats: int) -> tuple[float, int]:
    """(median seconds of step after two warm-ups, peak bytes allocated above the level before it)."""
    for _ in range(2):
        step()
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated() if device.type == "cuda" else 0
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        sync()
        seconds.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated() - base if device.type == "cuda" else 0
    return statistics.median(seconds), peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[8192, 32768, 65536])
    parser.add_argument("--dim", type=int, default=2560)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--query-chunk", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--impls", nargs="+", default=list(IMPLS[:3]), choices=IMPLS)
    parser.add_argument("--profile", type=int, metavar="T",
                        help="after the table, the profiler's top kernels of one `nsa` forward + backward at T tokens")
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("no CUDA device: this benchmark measures the GPU path (--device cpu only smoke-tests the script)")
    if device.type == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before nsa.triton_path is imported
    from nsa.primitive import triton_kernels

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    print(f"one layer, B=1, dim={args.dim}, heads={args.heads}, kv_heads={args.kv_heads}, head_dim={args.head_dim}, "
          f"{dtype}, {torch.cuda.get_device_name() if device.type == 'cuda' else 'CPU'}; NSA l=32 d=16 l'=64 n=16 "
          f"w=512, query chunk {args.query_chunk}; median of {args.repeats}")
    print("| T | layer | fwd ms | fwd+bwd ms | peak MiB | SDPA fwd / this | SDPA fwd+bwd / this | fwd+bwd / nsa's "
          "| U |")
    print("|---|---|---|---|---|---|---|---|---|")
    for T in args.seq_lens:
        sdpa = nsa = None
        for impl in args.impls:
            run = build(impl, args, device, dtype)
            x = torch.randn(1, T, args.dim, device=device, dtype=dtype, requires_grad=True)
            forced = impl in TRITON_IMPLS and device.type == "cpu"  # the interpreter stands in for the GPU
            with triton_kernels() if forced else contextlib.nullcontext():
                with torch.no_grad():
                    fwd, _ = timed(lambda run=run, x=x: run(x), device, args.repeats)
                both, peak = timed(lambda run=run, x=x: training_step(run, x), device, args.repeats)
                union = "-"
                if impl in TRITON_IMPLS:  # the training step's selection (one query chunk), outside the timing
                    with union_sizes() as sizes:
                        training_step(run, x)
                    union = f"{sizes[0]:.1f}" if sizes else "-"
            del run, x
            sdpa = (fwd, both) if impl == "sdpa" else sdpa
            nsa = both if impl == "nsa" else nsa
            ratios = f"{sdpa[0] / fwd:.2f}x | {sdpa[1] / both:.2f}x" if sdpa else "- | -"
            ratios += f" | {both / nsa:.2f}" if nsa and impl.startswith("nsa") else " | -"
            print(f"| {T} | {impl} | {fwd * 1e3:.1f} | {both * 1e3:.1f} | {peak / 2**20:.0f} | {ratios} | {union} |",
                  flush=True)
    if args.profile:
        print(PROFILE_MARK.format(T=args.profile))
        print(top_kernels(build("nsa", args, device, dtype), args.profile, args.dim, device, dtype))


PROFILE_MARK = "top kernels of one nsa forward + backward at T = {T}:"


def top_kernels(run: Callable, T: int, dim: int, device: torch.device, dtype: torch.dtype, rows: int = 15) -> str:
    """torch.profiler's table of the `rows` operators and kernels with the most device time (self CPU time on a
    CPU) in one training step of `run` at T tokens, after one warm-up step."""
    from torch.profiler import ProfilerActivity, profile

    from nsa.primitive import triton_kernels

    x = torch.randn(1, T, dim, device=device, dtype=dtype, requires_grad=True)
    cuda = device.type == "cuda"
    with contextlib.nullcontext() if cuda else triton_kernels():
        training_step(run, x)
        activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
        with profile(activities=activities) as prof:
            training_step(run, x)
            if cuda:
                torch.cuda.synchronize()
    key = "self_cuda_time_total" if cuda else "self_cpu_time_total"
    return prof.key_averages().table(sort_by=key, row_limit=rows)


if __name__ == "__main__":
    main()
