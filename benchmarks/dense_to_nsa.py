"""Dense to NSA: the held-out loss of a full-attention model, of the NSA model converted from it (nsa/from_dense.py)
before any training, and of both after the same N further steps, on a CPU.

    python benchmarks/dense_to_nsa.py                      # demo model, 300 dense steps at T=512, then 100 more each
    python benchmarks/dense_to_nsa.py --dense_steps 50 --more_steps 20 --context_length 256    # a quick look

Everything runs through train.py (its default corpus, data/stdlib, with its validation split); the losses are
eval.validation_loss over the same held-out windows.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import train  # noqa: E402
from evaluation.loss import validation_loss, validation_windows  # noqa: E402
from model import Transformer  # noqa: E402
from nsa.from_dense import nsa_state_from_dense  # noqa: E402
from storage.weights import load_model  # noqa: E402


def held_out(model_dir: Path, windows) -> float:
    return validation_loss(load_model(model_dir), windows, contextlib.nullcontext())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--context_length", type=int, default=512)
    parser.add_argument("--dense_steps", type=int, default=300)
    parser.add_argument("--more_steps", type=int, default=100)
    parser.add_argument("--eval_tokens", type=int, default=65536)
    args = parser.parse_args()
    T = args.context_length
    common = ["--model_size", "demo", "--context_length", str(T), "--sample_tokens", "0", "--checkpoint_interval", "0",
              "--log_interval", "50"]
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        runs = Path(tmp)
        train.main([*common, "--max_steps", str(args.dense_steps), "--out_dir", str(runs / "dense")])
        windows = validation_windows(train.DEFAULT_DATA_DIR, T, args.eval_tokens)
        more = [*common, "--max_steps", str(args.more_steps), "--warmup_steps", "10", "--lr", "1e-3", "--init_from",
                str(runs / "dense" / "model")]
        train.main([*more, "--out_dir", str(runs / "dense-more")])
        train.main([*more, "--attention_type", "nsa", "--out_dir", str(runs / "nsa-more")])
        dense = load_model(runs / "dense" / "model")
        nsa_config = dataclasses.replace(dense.config, attention_type="nsa")
        torch.manual_seed(0)  # the compressors' fresh initialisation
        converted = Transformer(nsa_config)
        converted.load_state_dict(nsa_state_from_dense(dense.state_dict(), nsa_config), strict=False)
        n, m = args.dense_steps, args.dense_steps + args.more_steps
        rows = [("dense", n, validation_loss(dense, windows, contextlib.nullcontext())),
                ("NSA converted from it, before training", n,
                 validation_loss(converted, windows, contextlib.nullcontext())),
                ("dense, continued", m, held_out(runs / "dense-more" / "model", windows)),
                ("NSA, continued", m, held_out(runs / "nsa-more" / "model", windows))]
    print(f"\ndemo model, T = {T}, {len(windows)} held-out windows; {time.perf_counter() - t0:.0f} s\n")
    print("| model | steps | held-out loss |\n|---|---|---|")
    for name, steps, loss in rows:
        print(f"| {name} | {steps} | {loss:.4f} |")


if __name__ == "__main__":
    main()
