"""NSA's attention on the Triton kernels against the PyTorch path on the same GPU: run by
tests/test_nsa.py::test_triton_kernels_on_gpu in a subprocess without TRITON_INTERPRET, so the kernels really run.
On a machine without CUDA it checks itself at smaller sizes in Triton's interpreter (set TRITON_INTERPRET=1).

Paper block geometry (l=32, d=16, l'=64, w=512). Checks, forward and the gradients of all eight inputs:
- float32, T = 1000 with n = 16 (every block selected, so the two paths choose the same blocks whatever the rounding
  of the importance scores): relative error ||got - want|| / ||want|| <= 1e-5 for every tensor (IEEE float32 products
  on both paths, different summation orders);
- bfloat16 against that float32 result: relative error <= 1e-2 (bf16 operands);
- float32, T = 3000 (top-16 of 47 blocks, so near-ties in the scores may be broken differently): 99.5% of the
  query rows equal within the float32 tolerance.
Prints what it compared; exits non-zero on a mismatch.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from modeling.config import ComputeConfig, ModelConfig  # noqa: E402
from nsa.attention import sparse_attention  # noqa: E402
from nsa.blocks import num_compressed_blocks  # noqa: E402
from nsa.primitive import triton_kernels  # noqa: E402


def run(config: ModelConfig, chunk: int, inputs: list[torch.Tensor], grad: torch.Tensor, triton: bool
        ) -> list[torch.Tensor]:
    """(output, gradients of the inputs) of sparse_attention on the Triton kernels or on the PyTorch path."""
    compute = ComputeConfig(attention_query_chunk=chunk, triton_kernels=triton)
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    forced = triton and not inputs[0].is_cuda  # CPU: the interpreter stands in for the GPU
    with triton_kernels() if forced else contextlib.nullcontext():
        out = sparse_attention(*leaves, config, compute=compute)
        out.backward(grad)
    return [out.detach()] + [leaf.grad for leaf in leaves]


def random_inputs(config: ModelConfig, T: int, H: int, KV: int, D: int, device: str) -> list[torch.Tensor]:
    n_cmp = num_compressed_blocks(T, config.nsa_block_size, config.nsa_stride)
    shapes = [(1, H, T, D), (1, KV, n_cmp, D), (1, KV, n_cmp, D)] + [(1, KV, T, D)] * 4
    return [torch.randn(s, device=device) for s in shapes] + [torch.rand(1, H, T, 3, device=device)]


def main() -> None:
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    base = dataclasses.replace(ModelConfig.from_preset("tiny", attention_type="nsa"), nsa_block_size=32,
                               nsa_stride=16, nsa_select_block_size=64, nsa_window=512)
    H, KV, D, chunk = (32, 8, 128, 512) if device == "cuda" else (4, 2, 16, 128)
    sizes = (1000, 3000) if device == "cuda" else (300, 450)
    failures = []

    def check(name: str, got: torch.Tensor, want: torch.Tensor, rel: float, rows: float | None = None):
        """Whole tensors: relative error ||got - want|| / ||want|| <= rel (a gradient summed over thousands of
        queries has large entries, so an elementwise atol says little). rows: instead, the share of query rows
        equal within float32's tolerance (top-n choosing, where a near-tie may pick another block)."""
        got, want = got.double(), want.double()
        error = ((got - want).norm() / want.norm()).item()
        close = torch.isclose(got, want, rtol=1e-4, atol=1e-5).flatten(0, -2).all(-1).double().mean().item()
        print(f"{name}: relative error {error:.2e} (limit {rel:g}), {close:.4%} of rows within atol 1e-5 rtol 1e-4, "
              f"max abs err {(got - want).abs().max().item():.2e}")
        if not torch.isfinite(got).all() or (close < rows if rows is not None else error > rel):
            failures.append(name)

    names = ["out", "dq", "dk_cmp", "dv_cmp", "dk_slc", "dv_slc", "dk_win", "dv_win", "dgates"]
    # every block selected: n >= the number of blocks
    config = dataclasses.replace(base, nsa_num_selected=max(16, -(-sizes[0] // 64)))
    inputs = random_inputs(config, sizes[0], H, KV, D, device)
    grad = torch.randn(1, H, sizes[0], D, device=device)
    reference = run(config, chunk, inputs, grad, triton=False)
    for name, got, want in zip(names, run(config, chunk, inputs, grad, triton=True), reference, strict=True):
        check(f"float32 T={sizes[0]} {name}", got, want, rel=1e-5)
    if device == "cuda":  # bfloat16: the interpreter cannot compute it
        low = run(config, chunk, [t.bfloat16() for t in inputs], grad.bfloat16(), triton=True)
        for name, got, want in zip(names, low, reference, strict=True):
            check(f"bfloat16 T={sizes[0]} {name}", got, want, rel=1e-2)
    # top-n really choosing: forward rows only (a differently broken near-tie changes a row's blocks)
    config = dataclasses.replace(base, nsa_num_selected=16 if device == "cuda" else 4)
    inputs = random_inputs(config, sizes[1], H, KV, D, device)
    grad = torch.randn(1, H, sizes[1], D, device=device)
    got, want = run(config, chunk, inputs, grad, triton=True)[0], run(config, chunk, inputs, grad, triton=False)[0]
    check(f"float32 T={sizes[1]} out (top-n choosing)", got, want, rel=1e-5, rows=0.995)
    if failures:
        sys.exit(f"mismatch: {failures}")


if __name__ == "__main__":
    main()
