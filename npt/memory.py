"""Memory accounting for neuro-plastic layers at full size, without allocating: memtrack's live-storage-bytes
tracker (split by device), run under FakeTensorMode with the "meta" device standing in for the accelerator.

`layer_memory` compares one original decoder layer with its converted NPBlock (forward + backward, frozen base,
input requiring grad as inside a network) and gives what a naive per-token dW would need. `offload_memory` runs a
stack of converted layers with and without activation offload and reports accelerator-side and host-side peaks.

The tracker sees every tensor an op returns (backward included when it runs inside the mode); it is blind to
workspaces inside a single kernel and to allocator fragmentation (see memtrack.py).

Notation: B batch, T tokens, C model width, F FFN width, r rank, L layers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor
from torch._subclasses.fake_tensor import FakeTensorMode

from model import Block, ModelConfig
from modeling.memtrack import LiveBytesTracker
from npt.modulated import NPBlock

ACCELERATOR = "meta"  # device type of the stand-in accelerator under FakeTensorMode


@dataclass
class LayerMemory:
    """Bytes for one layer's forward + backward at the given shapes."""

    base_peak: int  # original Block, frozen weights
    np_peak: int  # converted NPBlock (frozen base, trainable NP parameters incl. their gradients)
    naive_delta_bytes: int  # per-token dW of every target in the compute dtype: B * T * I * O * elem each

    @property
    def extra(self) -> int:
        return self.np_peak - self.base_peak


def llama_like_config(dim: int = 4096, ffn_dim: int = 11008, n_heads: int = 32, n_kv_heads: int = 8,
                      head_dim: int = 128) -> ModelConfig:
    """A one-layer config of the given widths (Llama-8B-like by default; vocabulary irrelevant here)."""
    return ModelConfig(vocab_size=256, dim=dim, n_layers=1, n_heads=n_heads, n_kv_heads=n_kv_heads,
                       head_dim=head_dim, ffn_dim=ffn_dim, qk_norm=False)


def _fwd_bwd_peak(layers: list[Block], x: Tensor, cos: Tensor, sin: Tensor) -> tuple[LiveBytesTracker, dict[str, int]]:
    """Track forward + backward through `layers`; returns the tracker and the live bytes between the two."""
    grad_out = torch.ones_like(x)
    with LiveBytesTracker() as tracker:
        y = x
        for layer in layers:
            y = layer(y, cos, sin)
        after_forward = dict(tracker.live_by_device)
        y.backward(grad_out)
        del y
    return tracker, after_forward


def _inputs(cfg: ModelConfig, batch: int, seq_len: int, dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
    x = torch.randn(batch, seq_len, cfg.dim, dtype=dtype, device=ACCELERATOR, requires_grad=True)
    cos = torch.randn(seq_len, cfg.head_dim, device=ACCELERATOR)  # (T, D) float32, values irrelevant
    return x, cos, cos.clone()


def _frozen_block(cfg: ModelConfig, dtype: torch.dtype) -> Block:
    block = Block(cfg).requires_grad_(False)  # built under torch.device(ACCELERATOR)
    for p in block.parameters():
        p.data = p.data.to(dtype)  # (fake tensors cannot be swapped by Module.to)
    return block


def layer_memory(cfg: ModelConfig, batch: int = 4, seq_len: int = 512, rank: int = 16,
                 targets: tuple[str, ...] = ("gate", "up"), residual_mode: str = "modulate",
                 dtype: torch.dtype = torch.bfloat16) -> LayerMemory:
    """Peak bytes of forward + backward of one original vs one converted layer, measured on fake tensors."""
    with FakeTensorMode(), torch.device(ACCELERATOR):
        block = _frozen_block(cfg, dtype)
        x, cos, sin = _inputs(cfg, batch, seq_len, dtype)
        base = _fwd_bwd_peak([block], x, cos, sin)[0].peak_by_device[ACCELERATOR]
        x.grad = None
        converted = NPBlock(block, rank, targets, residual_mode, dtype=torch.float32)
        plastic = _fwd_bwd_peak([converted], x, cos, sin)[0].peak_by_device[ACCELERATOR]
    elem = torch.finfo(dtype).bits // 8
    naive = len(targets) * batch * seq_len * cfg.dim * cfg.ffn_dim * elem
    return LayerMemory(base, plastic, naive)


@dataclass
class OffloadMemory:
    """Bytes for forward + backward through a stack of converted layers."""

    device_peak: int  # accelerator peak over forward + backward
    device_after_forward: int  # accelerator bytes held between forward and backward (mostly saved activations)
    host_peak: int  # CPU peak (offloaded activations)
    bytes_offloaded: int  # as counted by the offload hooks


def offload_memory(cfg: ModelConfig, n_layers: int = 4, batch: int = 4, seq_len: int = 512, rank: int = 16,
                   offload: bool = True, dtype: torch.dtype = torch.bfloat16) -> OffloadMemory:
    """Forward + backward through `n_layers` converted layers, with or without activation offload, on fake
    tensors."""
    with FakeTensorMode(), torch.device(ACCELERATOR):
        layers = []
        for _ in range(n_layers):
            layer = NPBlock(_frozen_block(cfg, dtype), rank, dtype=torch.float32)
            layer.offload = offload
            layers.append(layer)
        x, cos, sin = _inputs(cfg, batch, seq_len, dtype)
        tracker, after_forward = _fwd_bwd_peak(layers, x, cos, sin)
    return OffloadMemory(tracker.peak_by_device[ACCELERATOR], after_forward.get(ACCELERATOR, 0),
                         tracker.peak_by_device["cpu"], sum(layer.offload_stats.bytes_offloaded for layer in layers))
