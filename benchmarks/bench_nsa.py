"""Forward+backward time and peak memory of one attention layer: our NSA (nsa/layer.py), full causal
SDPA (attention.FullAttention) and lucidrains' `native-sparse-attention-pytorch` (if installed; benchmark-only,
never a dependency), on CPU.

Each (implementation, T) runs in a fresh subprocess: time of one forward+backward (after a warm-up at T=512),
and peak memory as the growth of the process's peak RSS over its RSS before the measured step (inputs and weights
excluded). A failure (import error, out of memory, exception) is reported in the table instead of a number.
With `--repeats k` every cell is measured k times, the implementations interleaved, and the fastest run is kept
(the machine's noise only ever adds time).

Allocator: every child runs with glibc's malloc told not to hand freed memory back to the kernel
(MALLOC_TRIM_THRESHOLD_ and MALLOC_MMAP_THRESHOLD_ at their largest), the same for every implementation. By default
glibc returns large freed blocks and page-faults them in again on the next allocation; NSA allocates chunk-sized
temporaries over and over and pays for that (up to 40% of its time here), SDPA's one fused kernel does not. CUDA's
caching allocator never returns memory. `--default-malloc` measures with glibc's defaults.

    python benchmarks/bench_nsa.py                       # T = 2k, 8k, 16k, 32k
    python benchmarks/bench_nsa.py --seq-lens 2048 8192  # a subset
    python benchmarks/bench_nsa.py --impls sdpa nsa --repeats 3
    python benchmarks/bench_nsa.py --impls sdpa nsa --load   # beside another job busy on every core

`--load` starts, for the whole run, a second process that multiplies 1024 x 1024 float32 matrices in a loop with
PyTorch's default threads (one per core), as another training job on a shared machine would.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import subprocess
import sys
import time

IMPLS = ("sdpa", "nsa", "lucidrains")


def build(impl: str, args: argparse.Namespace, objective: dict | None = None, **compute: object):
    """(layer, the layer as a function x (1, T, dim) -> (1, T, dim)); `objective`: Objective fields (NSA's training
    terms), `compute`: ComputeConfig fields."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
    from modeling.attention import FullAttention
    from modeling.config import ComputeConfig, ModelConfig
    from modeling.layers import RotaryEmbedding

    cfg = ModelConfig(dim=args.dim, n_heads=args.heads, n_kv_heads=args.kv_heads, head_dim=args.head_dim,
                      n_layers=1, attention_type="nsa" if impl == "nsa" else "full", context_length=65536)
    computing = ComputeConfig(attention_query_chunk=args.query_chunk, **compute)
    rope = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, 1024)
    if impl == "lucidrains":
        from native_sparse_attention_pytorch import SparseAttention

        layer = SparseAttention(dim=cfg.dim, dim_head=cfg.head_dim, heads=cfg.n_heads, kv_heads=cfg.n_kv_heads,
                                sliding_window_size=cfg.nsa_window, compress_block_size=cfg.nsa_block_size,
                                compress_block_sliding_stride=cfg.nsa_stride,
                                selection_block_size=cfg.nsa_select_block_size,
                                num_selected_blocks=cfg.nsa_num_selected, causal=True, use_triton_kernel=False)
        return layer, layer
    if impl == "nsa":
        from modeling.objective import Objective
        from nsa.layer import NativeSparseAttention

        layer = NativeSparseAttention(cfg, computing)
        layer.objective = Objective(**(objective or {}))
    else:
        layer = FullAttention(cfg, computing)
    layer.init_weights()

    def run(x):
        cos, sin = rope(x.shape[1], 0, x.device)
        return layer(x, cos, sin)

    return layer, run


def measure(impl: str, T: int, args: argparse.Namespace) -> dict:
    """Runs in the child process: one warm-up at T=512, then one timed forward+backward at T."""
    import torch

    torch.manual_seed(0)
    layer, run = build(impl, args)
    for length in (512, T):
        x = torch.randn(1, length, args.dim, requires_grad=True)
        layer.zero_grad(set_to_none=True)
        rss_before = _rss_bytes()
        start = time.perf_counter()
        run(x).square().mean().backward()
        seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - rss_before
    return {"seconds": seconds, "peak_bytes": max(peak, 0)}


KEEP_FREED_MEMORY = {"MALLOC_TRIM_THRESHOLD_": str(2**40), "MALLOC_MMAP_THRESHOLD_": str(32 * 2**20)}  # glibc's max


def _run_child(cmd: list[str], timeout: float, env: dict[str, str]) -> dict | str:
    """One measurement in a fresh process: its result, or why it failed."""
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return f"timeout > {timeout:.0f} s"
    if proc.returncode == 0:
        return json.loads(proc.stdout.strip().splitlines()[-1])
    lines = (proc.stderr.strip() or f"exit code {proc.returncode}").splitlines()
    return f"failed: {lines[-1][:60]}"


LOAD = "import torch\na = torch.randn(1024, 1024)\nwhile True:\n    a @ a"


@contextlib.contextmanager
def busy_machine(enabled: bool):
    """While the block runs, a second process keeps every core busy with matrix products (`--load`)."""
    if not enabled:
        yield
        return
    load = subprocess.Popen([sys.executable, "-c", LOAD])
    try:
        time.sleep(2.0)  # imported and multiplying
        yield
    finally:
        load.kill()
        load.wait()


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _measure_all(args: argparse.Namespace, base_cmd: list[str], env: dict[str, str],
                 results: dict[tuple[str, int], dict | str]) -> None:
    """Every (implementation, T) cell, `--repeats` times interleaved; each cell keeps its fastest run, or with
    `--statistic median` its median run (by time)."""
    for T in args.seq_lens:
        runs: dict[str, list[dict]] = {impl: [] for impl in args.impls}
        for _ in range(args.repeats):
            for impl in args.impls:
                if isinstance(results.get((impl, T)), str):
                    continue  # failed once: do not retry
                result = _run_child(base_cmd + ["--child", impl, str(T)], args.timeout, env)
                print(f"  T={T} {impl}: {result}", file=sys.stderr, flush=True)
                if isinstance(result, str):
                    results[impl, T] = result
                else:
                    runs[impl].append(result)
        for impl, done in runs.items():
            if done and not isinstance(results.get((impl, T)), str):
                done.sort(key=lambda r: r["seconds"])
                results[impl, T] = done[0] if args.statistic == "min" else done[(len(done) - 1) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[2048, 8192, 16384, 32768])
    parser.add_argument("--impls", nargs="+", default=list(IMPLS), choices=IMPLS)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--query-chunk", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=1, help="runs per cell; the fastest is kept")
    parser.add_argument("--statistic", choices=("min", "median"), default="min",
                        help="which of a cell's runs the table shows (median: for a loaded machine, whose noise is "
                             "part of what is measured)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per measurement")
    parser.add_argument("--default-malloc", action="store_true", help="glibc's default allocator settings")
    parser.add_argument("--load", action="store_true", help="measure beside a process busy on every core")
    parser.add_argument("--child", nargs=2, metavar=("IMPL", "T"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.child[0], int(args.child[1]), args)))
        return

    import torch

    print(f"one layer, B=1, dim={args.dim}, heads={args.heads}, kv_heads={args.kv_heads}, head_dim={args.head_dim}, "
          f"float32, CPU threads={torch.get_num_threads()}; NSA l=32 d=16 l'=64 n=16 w=512, "
          f"query chunk {args.query_chunk}, {'fastest' if args.statistic == 'min' else 'median'} of {args.repeats} "
          f"run(s) per cell, "
          f"{'default glibc malloc' if args.default_malloc else 'glibc malloc keeping freed memory'}"
          f"{', beside a process busy on every core' if args.load else ''}")
    env = dict(os.environ) if args.default_malloc else {**os.environ, **KEEP_FREED_MEMORY}
    base_cmd = [sys.executable, __file__, "--dim", str(args.dim), "--heads", str(args.heads), "--kv-heads",
                str(args.kv_heads), "--head-dim", str(args.head_dim), "--query-chunk", str(args.query_chunk)]
    results: dict[tuple[str, int], dict | str] = {}
    with busy_machine(args.load):
        _measure_all(args, base_cmd, env, results)

    header = "| T | " + " | ".join(f"{i} fwd+bwd s | {i} peak MiB" for i in args.impls)
    header += " | SDPA time / NSA time |" if {"sdpa", "nsa"} <= set(args.impls) else " |"
    print(header)
    print("|" + "---|" * (header.count("|") - 1))
    for T in args.seq_lens:
        cells = []
        for impl in args.impls:
            r = results[impl, T]
            cells += [f"{r['seconds']:.2f}", f"{r['peak_bytes'] / 2**20:.0f}"] if isinstance(r, dict) else [r, "-"]
        row = f"| {T} | " + " | ".join(cells)
        sdpa, ours = results.get(("sdpa", T)), results.get(("nsa", T))
        if isinstance(sdpa, dict) and isinstance(ours, dict):
            row += f" | {sdpa['seconds'] / ours['seconds']:.2f}x"
        print(row + " |")


if __name__ == "__main__":
    main()
