"""Data loader throughput vs the training throughput of a tiny model, side by side in one process.

Prepares the default corpus (the Python standard library source) with a fresh tokenizer in a temporary directory
(or uses --data_dir), then for each (T, B) times `TokenLoader` batches and, where a CPU step is affordable,
full training steps (forward + backward + AdamW) of the "tiny" preset fed by that loader. The loader must be far
faster than any model it feeds: the ratio column is loader tokens/s over model tokens/s.

    python benchmarks/bench_loader.py [--data_dir DIR] [--seconds 2]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from anywhere

from model import ModelConfig, Transformer  # noqa: E402
from text.corpus import stdlib_files  # noqa: E402
from text.shards import TokenLoader, prepare  # noqa: E402
from text.tokenizer import Tokenizer  # noqa: E402

SHAPES = [(256, 32), (1024, 8), (4096, 2), (32768, 1), (131072, 1)]  # (T, B)
MAX_MODEL_T = 4096  # the tiny model's CPU step is timed only up to this length (attention is O(T^2))


def tokens_per_second(step, tokens_per_step: int, seconds: float) -> float:
    """Run `step()` once to warm up, then repeatedly for about `seconds`; return tokens per second."""
    step()
    n, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < seconds or n < 3:
        step()
        n += 1
    return n * tokens_per_step / elapsed


def bench(data_dir: Path, seconds: float) -> None:
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, data {data_dir}")
    probe = TokenLoader(data_dir, seq_len=2, batch_size=1)
    vocab_size = probe.vocab_size
    print(f"{probe.num_tokens:,} tokens ({probe.index['dtype']}), vocab {vocab_size}\n")
    print(f"| {'T':>6} | {'B':>3} | {'loader tok/s':>13} | {'tiny-model train tok/s':>22} | {'loader / model':>14} |")
    print(f"|{'-' * 8}|{'-' * 5}|{'-' * 15}|{'-' * 24}|{'-' * 16}|")
    for T, B in SHAPES:
        loader = TokenLoader(data_dir, seq_len=T, batch_size=B, seed=0)
        loader_tps = tokens_per_second(lambda loader=loader: next(loader), B * T, seconds)
        model_cell = ratio_cell = "-"
        if T <= MAX_MODEL_T:
            torch.manual_seed(0)
            model = Transformer(ModelConfig.from_preset("tiny", vocab_size=vocab_size, context_length=T))
            model.init_weights()
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

            def train_step(loader=loader, model=model, optimizer=optimizer):
                input_ids, labels = next(loader)
                model(input_ids, labels).loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)

            model_tps = tokens_per_second(train_step, B * T, seconds)
            model_cell, ratio_cell = f"{model_tps:,.0f}", f"{loader_tps / model_tps:,.0f}x"
        print(f"| {T:>6} | {B:>3} | {loader_tps:>13,.0f} | {model_cell:>22} | {ratio_cell:>14} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data_dir", type=Path, help="prepared data; default: prepare the stdlib corpus here")
    parser.add_argument("--vocab_size", type=int, default=4096, help="tokenizer vocabulary when preparing")
    parser.add_argument("--seconds", type=float, default=2.0, help="timing budget per measurement")
    args = parser.parse_args()
    if args.data_dir is not None:
        bench(args.data_dir, args.seconds)
        return
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        files = stdlib_files()
        tokenizer = Tokenizer.train(files, args.vocab_size, Path(tmp) / "tok")
        t1 = time.perf_counter()
        index = prepare(files, tokenizer, Path(tmp) / "data", progress=False)
        t2 = time.perf_counter()
        print(f"stdlib corpus: {len(files)} files, {sum(p.stat().st_size for p in files) / 1e6:.1f} MB -> "
              f"{index['num_documents']} documents, {index['num_tokens']:,} tokens; tokenizer training "
              f"{t1 - t0:.1f} s, prepare {t2 - t1:.1f} s ({index['num_tokens'] / (t2 - t1):,.0f} tok/s)")
        bench(Path(tmp) / "data", args.seconds)


if __name__ == "__main__":
    main()
