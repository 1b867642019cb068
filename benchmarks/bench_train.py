"""Training-step throughput of train.py's step (forward_backward + clip + AdamW) for a few variants, side by side.

    python benchmarks/bench_train.py [--model_size demo] [--context_length 256] [--batch_size 16] [--rounds 5]
                                     [--threads N]
    python benchmarks/bench_train.py --attention_type full nsa --variants default --context_length 2048 --batch_size 2
    python benchmarks/bench_train.py --attention_type full nsa --variants default compile --memory
    python benchmarks/bench_train.py --variants sparse_labels answer_loss --context_length 64 --batch_size 64
    python benchmarks/bench_train.py --attention_type nsa --variants answer_loss score_loss --context_length 2048 \
        --batch_size 2 --model_overrides '{"nsa_block_size": 8, "nsa_stride": 8, "nsa_select_block_size": 8}'

Variants (same tokens per step), for each `--attention_type`: the default step; gradient checkpointing; 2
accumulation micro-steps of half the batch; bf16 autocast; torch.compile of each block (train.py --compile); sparse
labels (one target in 6, the rest -100, as MQAR documents with --answer_loss have), with the output layer on every
row ("sparse_labels") or on the target rows only ("answer_loss": what train.py --answer_loss runs); that answer_loss
step with NSA's selection-scoring loss at weight 0.1 ("score_loss", nsa/scoring.py; for NSA only, with full
attention it is the answer_loss step), with that loss on every 8th query ("score_loss_stride8"), over each query's
24 blocks of highest importance and 8 random others ("score_loss_top24_random8") and both
("score_loss_top24_random8_stride8"); --document_mask with one document a row ("document_mask": the mask's cost
over plain causal attention), with documents of 256 tokens ("document_mask_256") and with documents of lengths
drawn uniformly from [1, 512) per row ("document_mask_mixed"; rows split differently). Random token
ids (the data pipeline is measured in data.py's benchmark). Rounds interleave the variants so that load changes on
the machine hit all of them alike; the table reports the median step time per variant, tokens/s, the time ratio to
the first variant, and the first step's time (for compile: the compilation). With --memory, each variant also runs
alone in a fresh process: the growth of its peak RSS, over two steps, above its RSS before the model was built
(weights, optimizer state and activations; for compile also the compiler's own memory).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from modeling.loss import IGNORE_INDEX  # noqa: E402
from training import options as train_config  # noqa: E402
from training import (
    parallel,  # noqa: E402
    trainer,  # noqa: E402
)
from training.cli import json_object  # noqa: E402


def make_step(cfg: train_config.TrainConfig, rt: parallel.Runtime, vocab: int, sparse_labels: bool = False,
              document: int | str | None = None):
    """A closure running one optimizer step of `cfg` on random tokens (with `sparse_labels`, one target in 6; with
    --document_mask, documents of `document` tokens, "mixed" lengths (`mixed_starts`), or one a row)."""
    model = trainer.build_model(*train_config.build_model_config(cfg, vocab), cfg, rt)
    optimizer, _ = trainer.build_optimizer(model, cfg)
    A, B, T = cfg.gradient_accumulation_steps, cfg.batch_size, cfg.context_length
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (A, B, T), generator=gen)  # (A, B, T)
    labels = ids.masked_fill(torch.arange(T) % 6 != 0, IGNORE_INDEX) if sparse_labels else ids  # (A, B, T)
    batches = [list(pair) for pair in zip(ids, labels, strict=True)]  # A x 2 x (B, T)
    if cfg.document_mask:  # each row's document starts (B, T)
        if document == "mixed":  # lengths uniform in [1, 512), drawn per row: rows split differently
            starts = torch.stack([mixed_starts(T, gen) for _ in range(B)])
        else:
            starts = (torch.arange(T) // (document or T) * (document or T)).expand(B, T)
        batches = [[*batch, starts] for batch in batches]
    autocast = torch.autocast("cpu", dtype=torch.bfloat16) if cfg.dtype == "bfloat16" else contextlib.nullcontext()

    def step() -> None:
        trainer.forward_backward(model, batches, autocast)
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def mixed_starts(T: int, generator: torch.Generator) -> torch.Tensor:
    """(T,) document starts of a row packed with documents of lengths drawn uniformly from [1, 512) (mean 256)."""
    lengths = torch.randint(1, 512, (T,), generator=generator)
    firsts = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])  # (T + 1,) document starts
    firsts = firsts[firsts < T]
    return torch.repeat_interleave(firsts, torch.diff(firsts, append=torch.tensor([T])))


# NSA's selection-scoring loss at weight 0.1 (nsa/scoring.py) on the answer-loss step, in its forms
SCORE_LOSS = {"score_loss": {}, "score_loss_stride8": {"nsa_score_loss_stride": 8},
              "score_loss_top24_random8": {"nsa_score_loss_top": 24, "nsa_score_loss_random": 8},
              "score_loss_top24_random8_stride8": {"nsa_score_loss_top": 24, "nsa_score_loss_random": 8,
                                                   "nsa_score_loss_stride": 8}}
DOCUMENTS = {"document_mask": None, "document_mask_256": 256,  # --document_mask: tokens per document (None: a row)
             "document_mask_mixed": "mixed"}  # lengths drawn per row (`mixed_starts`)
VARIANTS = ("default", "checkpointing", "microsteps", "bf16", "compile", "sparse_labels", "answer_loss", *SCORE_LOSS,
            *DOCUMENTS)
SPARSE = ("sparse_labels", "answer_loss", *SCORE_LOSS)  # labels keep one target in 6


def variant_config(base: train_config.TrainConfig, variant: str) -> train_config.TrainConfig:
    """`base` changed as `variant` says (one of VARIANTS)."""
    if variant in SCORE_LOSS:
        return dataclasses.replace(base, answer_loss=True, nsa_score_loss_coef=0.1, **SCORE_LOSS[variant])
    changes = {"default": {}, "checkpointing": {"gradient_checkpointing": True},
               "microsteps": {"batch_size": base.batch_size // 2, "gradient_accumulation_steps": 2},
               "bf16": {"dtype": "bfloat16"}, "compile": {"compile": True}, "sparse_labels": {},
               "answer_loss": {"answer_loss": True}, **dict.fromkeys(DOCUMENTS, {"document_mask": True})}[variant]
    return dataclasses.replace(base, **changes)


def _status_bytes(field: str) -> int:
    """A size field of /proc/self/status (VmRSS, VmHWM), in bytes."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))


def peak_rss_growth(argv: list[str], attention: str, variant: str) -> int:
    """Bytes by which a fresh process's peak RSS grows over two steps of one variant (`--child`)."""
    cmd = [sys.executable, __file__, *argv, "--child", attention, variant]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])["peak_growth"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model_size", default="demo")
    parser.add_argument("--context_length", type=int, default=256)
    parser.add_argument("--batch_size", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--model_overrides", type=json_object, default={}, metavar="JSON",
                        help="ModelConfig/ComputeConfig fields of every variant, as train.py's")
    parser.add_argument("--attention_type", nargs="+", default=["full"], help="one or more of full, nsa")
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS[:4]))
    parser.add_argument("--memory", action="store_true", help="add each variant's peak RSS growth (fresh process)")
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args, argv = parser.parse_args(), sys.argv[1:]
    if args.threads:
        torch.set_num_threads(args.threads)
    rt = parallel.Runtime(0, 1, torch.device("cpu"), None)

    def config(attention: str, variant: str) -> train_config.TrainConfig:
        base = train_config.TrainConfig(model_size=args.model_size, context_length=args.context_length,
                                        batch_size=args.batch_size, attention_type=attention,
                                        model_overrides=args.model_overrides)
        return variant_config(train_config.resolve_config(base, rt.device), variant)

    if args.child:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # the peak RSS (VmHWM) restarts from the current RSS: imports do not count
        rss_before = _status_bytes("VmRSS")
        step = make_step(config(*args.child), rt, args.vocab, args.child[1] in SPARSE, DOCUMENTS.get(args.child[1]))
        step()
        step()
        growth = _status_bytes("VmHWM") - rss_before
        print(json.dumps({"peak_growth": growth}))
        return
    names = {(a, v): f"{a}: {v}" for a in args.attention_type for v in args.variants}
    steps = {name: make_step(config(*key), rt, args.vocab, key[1] in SPARSE, DOCUMENTS.get(key[1]))
             for key, name in names.items()}
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
    memory = {name: peak_rss_growth(argv, *key) for key, name in names.items()} if args.memory else {}
    tokens = args.batch_size * args.context_length
    ref = statistics.median(next(iter(times.values())))
    print(f"model {args.model_size}, T={args.context_length}, {tokens} tokens per step, {torch.get_num_threads()} "
          f"threads, median of {args.rounds} interleaved rounds")
    print("| variant | step time (s) | tokens/s | time ratio | first step (s) |" + (" peak RSS growth (MiB) |"
                                                                                  if memory else ""))
    print("|---|---|---|---|---|" + ("---|" if memory else ""))
    for name, ts in times.items():
        t = statistics.median(ts)
        mib = f" {memory[name] / 2**20:.0f} |" if memory else ""
        print(f"| {name} | {t:.3f} | {tokens / t:,.0f} | {t / ref:.2f} | {first[name]:.1f} |{mib}")


if __name__ == "__main__":
    main()
