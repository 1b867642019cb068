"""Memory (and a time ratio) of neuro-plastic layers vs the original decoder layer.

    python benchmarks/npt_memory.py

1. Per-layer peak bytes of forward + backward at Llama-8B-like sizes, measured on fake tensors (no allocation) with
   a live-storage-bytes tracker (npt.memory), next to what a naive per-token dW would need. Exits 1 if a converted
   layer needs 1 GiB or more beyond the original layer.
2. Activation offload through a stack of converted layers: accelerator bytes with and without it.
3. Frozen-base precision: parameter bytes of the 4B preset with the upper half converted.
4. Time ratio of a converted vs an original layer, forward + backward on this CPU (float32, real tensors).

Notation: B batch, T tokens, C model width, F FFN width, r rank, L layers.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))  # run from anywhere: the repository's modules
from model import Block, ModelConfig, Transformer  # noqa: E402
from modeling.config import GiB  # noqa: E402
from npt.convert import convert, np_parameters  # noqa: E402
from npt.memory import layer_memory, llama_like_config, offload_memory
from npt.modulated import NPBlock  # noqa: E402

MiB = 1024**2


def per_layer_table() -> bool:
    print("## 1. One layer, forward + backward, bf16 activations, frozen base, r = 16 (fake tensors)\n")
    print("| C | F | targets | mode | original peak | converted peak | extra | naive dW, all targets, bf16 |")
    print("|---|---|---|---|---|---|---|---|")
    ok = True
    cases = [(11008, ("gate", "up"), "modulate"), (11008, ("gate", "up"), "additive"),
             (11008, ("gate", "up", "down"), "modulate"), (14336, ("gate", "up"), "modulate")]
    for ffn_dim, targets, mode in cases:
        mem = layer_memory(llama_like_config(ffn_dim=ffn_dim), batch=4, seq_len=512, rank=16, targets=targets,
                           residual_mode=mode)
        ok &= mem.extra < GiB
        print(f"| 4096 | {ffn_dim} | {'+'.join(targets)} | {mode} | {mem.base_peak / MiB:,.0f} MiB | "
              f"{mem.np_peak / MiB:,.0f} MiB | {mem.extra / MiB:,.1f} MiB | {mem.naive_delta_bytes / GiB:,.0f} GiB |")
    per_proj = 4 * 512 * 4096 * 11008
    print(f"\nNaive dW = B*T*I*O elements per modulated projection: at B=4, T=512, C=4096, F=11008 that is "
          f"{per_proj / 1e9:.1f} G elements = {per_proj * 2 / GiB:.0f} GiB in bf16, {per_proj * 4 / GiB:.0f} GiB in "
          f"fp32; at F=14336, {4 * 512 * 4096 * 14336 * 4 / GiB:.0f} GiB in fp32.\n")
    return ok


def offload_table() -> None:
    print("## 2. Activation offload, 4 converted layers, B=4, T=512, C=4096, F=11008, bf16 (fake tensors)\n")
    print("| offload | accelerator peak | accelerator after forward | host peak | bytes offloaded |")
    print("|---|---|---|---|---|")
    for offload in (False, True):
        m = offload_memory(llama_like_config(), n_layers=4, offload=offload)
        print(f"| {'on' if offload else 'off'} | {m.device_peak / MiB:,.0f} MiB | {m.device_after_forward / MiB:,.0f} "
              f"MiB | {m.host_peak / MiB:,.0f} MiB | {m.bytes_offloaded / MiB:,.0f} MiB |")
    print()


def precision_table() -> None:
    print("## 3. Parameter bytes, 4B preset, upper half converted, r = 16 (meta device)\n")
    print("| frozen base dtype | base parameters | NP parameters (fp32) | total |")
    print("|---|---|---|---|")
    for base_dtype in (torch.float32, torch.bfloat16):
        with torch.device("meta"):
            model = Transformer(ModelConfig.from_preset("4B"))
        convert(model, "upper_half", rank=16, base_dtype=None if base_dtype == torch.float32 else base_dtype)
        trainable = {id(p) for p in np_parameters(model).values()}
        params = {id(p): p for p in model.parameters()}.values()
        base = sum(p.numel() * p.element_size() for p in params if id(p) not in trainable)
        extra = sum(p.numel() * p.element_size() for p in np_parameters(model).values())
        print(f"| {str(base_dtype).removeprefix('torch.')} | {base / GiB:.2f} GiB | {extra / MiB:.1f} MiB | "
              f"{(base + extra) / GiB:.2f} GiB |")
    print()


def time_ratio(repeats: int = 11) -> None:
    cfg = ModelConfig(vocab_size=256, dim=1024, n_layers=1, n_heads=16, n_kv_heads=8, head_dim=64, ffn_dim=3072)
    torch.manual_seed(0)
    block = Block(cfg).requires_grad_(False)
    converted = NPBlock(block, rank=16)
    x = torch.randn(2, 256, cfg.dim, requires_grad=True)
    cos, sin = Transformer(ModelConfig.from_preset("tiny", head_dim=64)).rope(256, 0, x.device)

    def once(layer: torch.nn.Module) -> float:
        t0 = time.perf_counter()
        layer(x, cos, sin).square().mean().backward()
        return time.perf_counter() - t0

    once(block), once(converted)  # warm-up
    pairs = [(once(block), once(converted)) for _ in range(repeats)]  # interleaved: both see the same CPU load
    ratios = sorted(t_np / t_base for t_base, t_np in pairs)
    print(f"## 4. Time, forward + backward, B=2, T=256, C=1024, F=3072, r=16, float32, this CPU "
          f"({repeats} interleaved pairs)\n")
    print("| layer | time ratio (median) | ratio range |\n|---|---|---|")
    print(f"| original (frozen) | 1.00 | |\n| converted (gate+up, modulate) | {ratios[repeats // 2]:.2f} | "
          f"{ratios[0]:.2f} - {ratios[-1]:.2f} |\n")


def main() -> int:
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    ok = per_layer_table()
    offload_table()
    precision_table()
    time_ratio()
    if not ok:
        print("FAIL: a converted layer needs >= 1 GiB beyond the original layer")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
