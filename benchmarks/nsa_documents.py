"""Packed documents on NSA's PyTorch path (CPU): one layer's forward + backward with the document mask in one call
(`NativeSparseAttention._attend_packed`, nsa/packing.py) and document by document (`_attend_documents`' loop),
beside the unmasked layer, for one document a row, documents of 256 tokens (rows split alike) and lengths drawn
from [1, 512) (rows split differently). The measurement behind the
layer's choice of the loop on CPU tensors (nsa/layer.py `_packed_blocks`).

    python benchmarks/nsa_documents.py [--context_length 2048] [--batch_size 2] [--rounds 7]   # ~1 min

Demo model's NSA layer (l = 8, d = 4, l' = 16), random inputs; rounds interleave the cases, the table reports each
case's median over the rounds and its ratio to the unmasked layer's.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from unittest import mock

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from model import ModelConfig, Transformer  # noqa: E402
from modeling.documents import document_starts  # noqa: E402
from nsa.layer import NativeSparseAttention  # noqa: E402
from nsa.packing import document_blocks  # noqa: E402
from training.cli import Parser  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    parser = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--context_length", type=int, default=2048)
    parser.add_argument("--batch_size", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args(argv)
    T, B = args.context_length, args.batch_size
    config = ModelConfig.from_preset("demo", attention_type="nsa", context_length=T)
    torch.manual_seed(0)
    layer = NativeSparseAttention(config)
    layer.init_weights()
    cos, sin = Transformer(config).rope(T, 0, torch.device("cpu"))
    x = torch.randn(B, T, config.dim, requires_grad=True)
    one = torch.zeros(B, T, dtype=torch.long)
    short = (torch.arange(T) // 256 * 256).expand(B, T).contiguous()
    g = torch.Generator().manual_seed(0)  # lengths drawn from [1, 512) for each row, as bench_train.py's "mixed"
    opens = [torch.randint(1, 512, (T,), generator=g).cumsum(0) for _ in range(B)]
    mixed = torch.stack([document_starts(torch.zeros(T, dtype=torch.long).index_fill_(0, o[o < T], 1)[None], 1)[0]
                         for o in opens])
    one_call = mock.patch.object(NativeSparseAttention, "_packed_blocks",
                                 lambda self, doc_start, q: document_blocks(doc_start, self.config))
    loop = mock.patch.object(NativeSparseAttention, "_packed_blocks", lambda self, doc_start, q: None)
    cases = {"unmasked": (None, None), "one document a row, one call": (one, one_call),
             "one document a row, loop": (one, loop), "256-token documents, one call": (short, one_call),
             "256-token documents, loop": (short, loop), "mixed lengths, one call": (mixed, one_call),
             "mixed lengths, loop": (mixed, loop)}
    seconds: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(args.rounds + 1):  # the first round warms up
        for name, (doc_start, path) in cases.items():
            with path or contextlib.nullcontext():
                start = time.perf_counter()
                layer(x, cos, sin, doc_start=doc_start).sum().backward()
                seconds[name].append(time.perf_counter() - start)
    base = statistics.median(seconds["unmasked"][1:])
    print(f"NSA layer of the demo model, T={T}, batch {B}, {torch.get_num_threads()} threads, forward + backward, "
          f"median of {args.rounds} interleaved rounds")
    print("| case | seconds | ratio |\n|---|---|---|")
    for name, values in seconds.items():
        median = statistics.median(values[1:])
        print(f"| {name} | {median:.3f} | {median / base:.2f} |")


if __name__ == "__main__":
    main()
