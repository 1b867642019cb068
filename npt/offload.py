"""Activation offload: tensors saved for backward move to CPU memory in forward and come back in backward.

Parameters (and views of them) are never copied: they stay resident anyway, and copying them would only add traffic
and a transient device copy in backward. CPU tensors are kept as they are. Where CUDA exists the host buffers are
pinned and the copies are asynchronous (stream-ordered, like torch.autograd.graph.save_on_cpu).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
from torch import Tensor, nn


@dataclass
class OffloadStats:
    """Bytes moved to CPU memory by `OffloadSavedTensors` (a running count, read without a device sync)."""

    bytes_offloaded: int = 0
    tensors_offloaded: int = 0


def _is_parameter(t: Tensor) -> bool:
    return isinstance(t, nn.Parameter) or isinstance(t._base, nn.Parameter)


class OffloadSavedTensors(torch.autograd.graph.saved_tensors_hooks):
    """Context manager: activations saved for backward inside it live in (pinned) CPU memory until backward."""

    def __init__(self, stats: OffloadStats | None = None) -> None:
        pin = torch.cuda.is_available()
        # A tensor saved by several ops (e.g. a layer input used by a norm and a residual) is copied once: the host
        # copy is found again by (storage, view geometry, version) while that storage is alive.
        copies: dict[tuple, tuple[weakref.ref, Tensor]] = {}

        def pack(t: Tensor) -> Tensor | tuple[torch.device, Tensor]:
            if t.device.type == "cpu" or _is_parameter(t):
                return t
            storage = t.untyped_storage()
            key = (id(storage), t.storage_offset(), tuple(t.shape), t.stride(), t._version)
            hit = copies.get(key)
            if hit is not None and hit[0]() is storage:
                return t.device, hit[1]
            host = torch.empty(t.size(), dtype=t.dtype, layout=t.layout, device="cpu", pin_memory=pin)
            host.copy_(t, non_blocking=pin)
            copies[key] = (weakref.ref(storage), host)
            if stats is not None:
                stats.bytes_offloaded += t.numel() * t.element_size()
                stats.tensors_offloaded += 1
            return t.device, host

        def unpack(packed: Tensor | tuple[torch.device, Tensor]) -> Tensor:
            if isinstance(packed, Tensor):
                return packed
            device, host = packed
            return host.to(device, non_blocking=pin)

        super().__init__(pack, unpack)
