"""Side-by-side fwd+bwd of the LM loss: the plain path (full logits), ours (chunked, gradients in forward), and
PyTorch's `torch.nn.functional.linear_cross_entropy` with chunking options, when the installed torch has it.

    python benchmarks/bench_loss.py                      # defaults below; a few minutes on 2 CPU cores

Three measurements, every method on the same inputs (10% of targets ignored):
1. peak bytes beyond the inputs at each token count, under FakeTensorMode with memtrack.LiveBytesTracker (shapes
   only, so any size). Blind to memory inside a torch.library custom op: PyTorch's chunked op runs its fake kernel
   there, so its (chunk, V) work buffer is missing from that column (see 3).
2. time, real tensors, methods interleaved in one process (median of --repeats after a warm-up), reported as a
   ratio to the plain path; token counts where the plain path would exceed --max-real-gib are timed without it.
3. resident-set high-water mark (Linux VmHWM, reset once the inputs exist) of one fwd+bwd in a fresh subprocess,
   minus the RSS at that point: sees everything, PyTorch's internal buffers included, within allocator noise.

Notation: N tokens, C hidden size, V vocabulary size.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root: loss.py, memtrack.py, ...

from modeling.config import GiB  # noqa: E402
from modeling.loss import IGNORE_INDEX, chunked_linear_cross_entropy, standard_linear_cross_entropy  # noqa: E402
from verify_chunked_loss import fake_loss_peak  # noqa: E402


def loss_methods(chunk_size: int) -> dict[str, callable]:
    """name -> fn(hidden (N, C), weight (V, C), targets (N,)) -> scalar mean loss over non-ignored targets."""
    methods = {
        "plain": lambda h, w, t: standard_linear_cross_entropy(h, w, t)[0],
        "ours": lambda h, w, t: chunked_linear_cross_entropy(h, w, t, chunk_size=chunk_size),
    }
    if hasattr(F, "linear_cross_entropy"):
        from torch.nn import LinearCrossEntropyOptions

        # The same chunk size as ours. Its default ("auto" -> aspect_ratio:2 for CPU float32) sizes chunks from
        # N / ceil(V / C): 2-row chunks at C=128, N=4096, tens of times slower here, so it is not compared.
        options = LinearCrossEntropyOptions(batch_chunk_size=chunk_size, chunking_method=None)
        methods["torch"] = lambda h, w, t: F.linear_cross_entropy(h, w, t, ignore_index=IGNORE_INDEX, options=options)
    return methods


def make_inputs(N: int, C: int, V: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(N, C, generator=g).to(dtype).requires_grad_()
    weight = (torch.randn(V, C, generator=g) / C**0.5).to(dtype).requires_grad_()
    targets = torch.randint(0, V, (N,), generator=g)
    targets[torch.rand(N, generator=g) < 0.1] = IGNORE_INDEX
    return hidden, weight, targets


def fwd_bwd(fn, hidden, weight, targets) -> None:
    hidden.grad = weight.grad = None
    fn(hidden, weight, targets).backward()


def proc_status_bytes(field: str) -> int:
    """A memory field of /proc/self/status (Linux), e.g. VmRSS (resident now) or VmHWM (its high-water mark)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024  # reported in kB
    raise KeyError(field)


def rss_worker(args: argparse.Namespace) -> None:
    """Run one fwd+bwd and print the RSS high-water mark above the RSS with the inputs built (bytes)."""
    hidden, weight, targets = make_inputs(args.rss_tokens, args.hidden, args.vocab, getattr(torch, args.dtype))
    Path("/proc/self/clear_refs").write_text("5")  # restart VmHWM from the current RSS
    before = proc_status_bytes("VmRSS")
    fwd_bwd(loss_methods(args.chunk_size)[args.rss_worker], hidden, weight, targets)
    print(proc_status_bytes("VmHWM") - before)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden", type=int, default=128, help="C (the 4B model has 2560; smaller to run on CPU)")
    parser.add_argument("--vocab", type=int, default=151_936)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--chunk-size", type=int, default=1024)
    parser.add_argument("--peak-tokens", type=int, nargs="+", default=[4096, 16_384, 32_768, 131_072])
    parser.add_argument("--time-tokens", type=int, nargs="+", default=[1024, 2048])
    parser.add_argument("--rss-tokens", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-real-gib", type=float, default=6.0, help="skip real runs above this fake peak")
    parser.add_argument("--rss-worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rss_worker:
        return rss_worker(args)

    dtype = getattr(torch, args.dtype)
    methods = loss_methods(args.chunk_size)
    names = list(methods)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; C={args.hidden}, V={args.vocab:,}, "
          f"{args.dtype}, chunk {args.chunk_size}; methods: {', '.join(names)}")

    print("\n1) fwd+bwd peak beyond inputs (FakeTensorMode + LiveBytesTracker), GiB; ratio plain / method")
    print(f"{'N':>8} " + " ".join(f"{n:>18}" for n in names))
    peaks = {}
    for N in args.peak_tokens:
        row = {n: fake_loss_peak(lambda h, w, t, _f=methods[n]: _f(h, w, t), N, args.hidden, args.vocab, dtype)
               for n in names}
        peaks[N] = row
        print(f"{N:>8} " + " ".join(f"{row[n] / GiB:9.3f} ({row['plain'] / row[n]:5.1f}x)" for n in names))

    print(f"\n2) fwd+bwd time, real tensors, interleaved, median of {args.repeats} after a warm-up; ratio to plain")
    print(f"{'N':>8} " + " ".join(f"{n:>18}" for n in names))
    for N in args.time_tokens:
        inputs = make_inputs(N, args.hidden, args.vocab, dtype)
        fits = {n: fake_loss_peak(lambda h, w, t, _f=methods[n]: _f(h, w, t), N, args.hidden, args.vocab, dtype)
                <= args.max_real_gib * GiB for n in names}
        times: dict[str, list[float]] = {n: [] for n in names if fits[n]}
        for repeat in range(args.repeats + 1):
            for n in times:
                start = time.perf_counter()
                fwd_bwd(methods[n], *inputs)
                if repeat:  # the first round is the warm-up
                    times[n].append(time.perf_counter() - start)
        median = {n: statistics.median(t) for n, t in times.items()}
        base = median.get("plain")
        print(f"{N:>8} " + " ".join(
            f"{'skipped (memory)':>18}" if n not in median else
            f"{median[n]:8.2f}s ({median[n] / base:5.2f}x)" if base else f"{median[n]:8.2f}s {'':>8}"
            for n in names))

    print(f"\n3) fwd+bwd RSS high-water mark above the inputs, fresh subprocess each, N={args.rss_tokens}, GiB")
    command = [sys.executable, __file__, "--hidden", str(args.hidden), "--vocab", str(args.vocab), "--dtype",
               args.dtype, "--chunk-size", str(args.chunk_size), "--rss-tokens", str(args.rss_tokens)]
    for n in names:
        out = subprocess.run(command + ["--rss-worker", n], capture_output=True, text=True, check=True).stdout
        print(f"{n:>12}: {int(out.split()[-1]) / GiB:7.3f} GiB")


if __name__ == "__main__":
    main()
