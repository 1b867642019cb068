"""Greedy generation of an NSA model's Hugging Face export in transformers (`generate`, with and without its cache)
against the project's own cached `Transformer.generate`, on one model in one process: the ratio of each to the
project's time.

    python benchmarks/bench_hf_generate.py [--model_size demo] [--prompt 300] [--new 40] [--rounds 5] [--threads 1]

The model is randomly initialised (the time does not depend on the weights); the prompt is random ids. Rounds
interleave the three, so that load changes on the machine hit all of them alike; the table reports the median
seconds of each and its ratio to the project's. Every run generates the same tokens (checked).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from model import Transformer  # noqa: E402
from modeling.config import PRESETS, ModelConfig  # noqa: E402
from storage.hf import export_hf_checkpoint  # noqa: E402


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model_size", default="demo", choices=list(PRESETS))
    p.add_argument("--prompt", type=int, default=300, help="prompt tokens")
    p.add_argument("--new", type=int, default=40, help="tokens generated")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    if min(args.prompt, args.new, args.rounds, args.threads) < 1:
        p.error("--prompt, --new, --rounds and --threads must be at least 1")
    import transformers

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    config = ModelConfig.from_preset(args.model_size, attention_type="nsa",
                                     context_length=max(1024, args.prompt + args.new))
    model = Transformer(config).eval()
    prompt = torch.randint(0, config.vocab_size, (1, args.prompt))
    with tempfile.TemporaryDirectory() as tmp:
        export_hf_checkpoint(model, Path(tmp) / "hf")
        theirs = transformers.AutoModelForCausalLM.from_pretrained(Path(tmp) / "hf", trust_remote_code=True).eval()
    runs = {"project's generate (cache)": lambda: model.generate(prompt, args.new, temperature=0.0),
            "transformers generate, cache": lambda: theirs.generate(prompt, max_new_tokens=args.new, do_sample=False),
            "transformers generate, no cache": lambda: theirs.generate(prompt, max_new_tokens=args.new,
                                                                       do_sample=False, use_cache=False)}
    seconds: dict[str, list[float]] = {name: [] for name in runs}
    outputs = {}
    for _ in range(args.rounds):
        for name, run in runs.items():
            start = time.perf_counter()
            outputs[name] = run().tolist()
            seconds[name].append(time.perf_counter() - start)
    if len({str(out) for out in outputs.values()}) != 1:
        raise SystemExit("the three generated different tokens")
    base = statistics.median(seconds["project's generate (cache)"])
    rows = [{"run": name, "seconds": statistics.median(s), "ratio": statistics.median(s) / base}
            for name, s in seconds.items()]
    print(f"{args.model_size} NSA, {args.prompt} + {args.new} tokens, {args.threads} thread(s), median of "
          f"{args.rounds} rounds")
    print(f"{'run':<34} {'seconds':>8} {'x project':>10}")
    for row in rows:
        print(f"{row['run']:<34} {row['seconds']:>8.3f} {row['ratio']:>10.2f}")
    return rows


if __name__ == "__main__":
    main()
