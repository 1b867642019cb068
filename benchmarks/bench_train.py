"""Training-step throughput of train.py's step (forward_backward + clip + AdamW) for a few variants, side by side.

    python benchmarks/bench_train.py [--model_size demo] [--context_length 256] [--batch_size 16] [--rounds 5]
                                     [--threads N]

    python benchmarks/bench_train.py --attention_type nsa --context_length 1024 --batch_size 4 --compile

Variants (same tokens per step): the default step; gradient checkpointing; 2 accumulation micro-steps of half the
batch; bf16 autocast; with --compile, torch.compile of each block (train.py --compile). Random token ids (the data
pipeline is measured in data.py's benchmark). Rounds interleave the variants so that load changes on the machine
hit all of them alike; the table reports the median step time per variant, tokens/s, the time ratio to the default
step, and the first step's time (for --compile: the compilation).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import parallel  # noqa: E402
import train  # noqa: E402
import train_config  # noqa: E402


def make_step(cfg: train_config.TrainConfig, rt: parallel.Runtime, vocab: int):
    """A closure running one optimizer step of `cfg` on random tokens."""
    model = train.build_model(*train_config.build_model_config(cfg, vocab), cfg, rt)
    optimizer, _ = train.build_optimizer(model, cfg)
    A, B, T = cfg.gradient_accumulation_steps, cfg.batch_size, cfg.context_length
    gen = torch.Generator().manual_seed(0)
    batches = [[ids, ids] for ids in torch.randint(0, vocab, (A, B, T), generator=gen)]  # A x 2 x (B, T)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16) if cfg.dtype == "bfloat16" else contextlib.nullcontext()

    def step() -> None:
        train.forward_backward(model, batches, autocast)
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model_size", default="demo")
    parser.add_argument("--context_length", type=int, default=256)
    parser.add_argument("--batch_size", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--attention_type", default="full", help="full or nsa")
    parser.add_argument("--compile", action="store_true", help="add the torch.compile variant")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    rt = parallel.Runtime(0, 1, torch.device("cpu"), None)
    base = train_config.TrainConfig(model_size=args.model_size, context_length=args.context_length,
                                    batch_size=args.batch_size, attention_type=args.attention_type)
    base = train_config.resolve_config(base, rt.device)
    variants = {
        "default (fp32)": base,
        "gradient checkpointing": dataclasses.replace(base, gradient_checkpointing=True),
        f"2 micro-steps x {args.batch_size // 2}": dataclasses.replace(base, batch_size=args.batch_size // 2,
                                                                        gradient_accumulation_steps=2),
        "bf16 autocast": dataclasses.replace(base, dtype="bfloat16"),
        **({"torch.compile (per block)": dataclasses.replace(base, compile=True)} if args.compile else {}),
    }
    steps = {name: make_step(cfg, rt, args.vocab) for name, cfg in variants.items()}
    first: dict[str, float] = {}
    for name, step in steps.items():  # warm-up: allocator, optimizer state, compilation
        t0 = time.perf_counter()
        step()
        first[name] = time.perf_counter() - t0
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(args.rounds):
        for name, step in steps.items():
            t0 = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - t0)
    tokens = args.batch_size * args.context_length
    ref = statistics.median(times["default (fp32)"])
    print(f"model {args.model_size}, {args.attention_type} attention, T={args.context_length}, {tokens} tokens per "
          f"step, {torch.get_num_threads()} threads, median of {args.rounds} interleaved rounds")
    print("| variant | step time (s) | tokens/s | time ratio | first step (s) |\n|---|---|---|---|---|")
    for name, ts in times.items():
        t = statistics.median(ts)
        print(f"| {name} | {t:.3f} | {tokens / t:,.0f} | {t / ref:.2f} | {first[name]:.1f} |")


if __name__ == "__main__":
    main()
