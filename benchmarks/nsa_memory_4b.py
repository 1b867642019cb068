"""Peak memory of one 4B-geometry NSA layer (dim 2560, 32/8 heads, head_dim 128, bf16) at T = 131,072 tokens,
forward + backward, under FakeTensorMode (nothing is allocated): on the fused CPU path and on the explicit path for
query chunks 512 / 1024 / 2048, and on the Triton kernels' path (what CUDA runs, all queries one chunk; the kernels
allocate nothing beyond their outputs, and are not launched on fake tensors). Weights and input are excluded.

    python benchmarks/nsa_memory_4b.py    # about 3 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from modeling import flash  # noqa: E402
from modeling.config import ComputeConfig, ModelConfig  # noqa: E402
from modeling.memtrack import LiveBytesTracker  # noqa: E402
from nsa import primitive  # noqa: E402
from nsa.layer import NativeSparseAttention  # noqa: E402

T = 131072


PATHS = {"fused": contextlib.nullcontext, "explicit": flash.explicit_attention,
         "triton": primitive.triton_kernels}


def peak_gib(query_chunk: int, path: str) -> tuple[float, float]:
    """(peak, largest tensor) in GiB of one layer's forward + backward."""
    config = ModelConfig.from_preset("4B", attention_type="nsa", context_length=T)
    torch.set_default_dtype(torch.bfloat16)
    try:
        with FakeTensorMode():
            layer = NativeSparseAttention(config, ComputeConfig(attention_query_chunk=query_chunk))
            x = torch.randn(1, T, config.dim, requires_grad=True)
            cos, sin = torch.randn(T, config.head_dim), torch.randn(T, config.head_dim)
            with PATHS[path](), LiveBytesTracker() as tracker:
                layer(x, cos, sin).sum().backward()
    finally:
        torch.set_default_dtype(torch.float32)
    return tracker.peak / 2**30, tracker.largest / 2**30


def main() -> None:
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    print("| query chunk | fused CPU path | explicit path | largest tensor |")
    print("|---|---|---|---|")
    for chunk in (512, 1024, 2048):
        (fused, largest), (explicit, _) = (peak_gib(chunk, path) for path in ("fused", "explicit"))
        print(f"| {chunk} | {fused:.1f} GiB | {explicit:.1f} GiB | {largest:.1f} GiB |", flush=True)
    triton, largest = peak_gib(512, "triton")
    print(f"\nTriton kernels (CUDA), all queries one chunk: {triton:.1f} GiB (largest tensor {largest:.1f} GiB)")


if __name__ == "__main__":
    main()
