"""Activation offload: tensors saved for backward move to host memory in forward and come back in backward.

With gradient checkpointing the tensors a block saves are its inputs, so offloading them leaves the accelerator
holding one block's activations at a time (`ComputeConfig.offload_activations`; NPT layers use it too).

Parameters (and views of them) and the tensors named `resident` (the RoPE tables) are never copied: they stay in
accelerator memory anyway. A tensor saved several times is copied once per `with`. On CUDA the host buffers are
pinned and the device-to-host copies run on a side stream, overlapped with the forward compute; the copies back are
stream-ordered before use. CPU tensors stay where they are, unless `simulated()` says to treat the CPU as the
accelerator (the tests and profile_memory's estimate, which runs on CPU fake tensors).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor, nn


@dataclass
class OffloadStats:
    """Bytes moved to host memory by `OffloadSavedTensors` (a running count, read without a device sync)."""

    bytes_offloaded: int = 0
    tensors_offloaded: int = 0


def _is_parameter(t: Tensor) -> bool:
    return isinstance(t, nn.Parameter) or isinstance(t._base, nn.Parameter)


class OffloadSavedTensors(torch.autograd.graph.saved_tensors_hooks):
    """Context manager: activations saved for backward inside it live in (pinned) host memory until backward."""

    # Set by `simulated()`: copy CPU tensors as if the CPU were the accelerator, and report each host copy.
    _simulate: ClassVar[bool] = False
    _observe: ClassVar[Callable[[Tensor], None] | None] = None

    def __init__(self, stats: OffloadStats | None = None, resident: tuple[Tensor, ...] = ()) -> None:
        """`resident`: tensors that stay in accelerator memory anyway (the RoPE tables): never copied."""
        pin = torch.cuda.is_available()
        kept = [t.untyped_storage() for t in resident]
        simulate, observe = OffloadSavedTensors._simulate, OffloadSavedTensors._observe
        side = torch.cuda.Stream() if pin else None
        # (storage, view geometry, version) -> (storage, host copy): a tensor saved by several ops is copied once.
        copies: dict[tuple, tuple[weakref.ref, Tensor]] = {}

        def pack(t: Tensor) -> Tensor | tuple[torch.device, Tensor]:
            storage = t.untyped_storage()
            if (t.device.type == "cpu" and not simulate) or _is_parameter(t) or any(storage is k for k in kept):
                return t
            key = (id(storage), t.storage_offset(), tuple(t.shape), t.stride(), t._version)
            hit = copies.get(key)
            if hit is not None and hit[0]() is storage:
                return t.device, hit[1]
            host = torch.empty(t.size(), dtype=t.dtype, layout=t.layout, device="cpu", pin_memory=pin)
            if side is not None and t.is_cuda:
                side.wait_stream(torch.cuda.current_stream(t.device))  # t is computed
                with torch.cuda.stream(side):
                    host.copy_(t, non_blocking=True)
                t.record_stream(side)  # t's memory is not reused before the copy has read it
            else:
                host.copy_(t)
            copies[key] = (weakref.ref(storage), host)
            if observe is not None:
                observe(host)
            if stats is not None:
                stats.bytes_offloaded += t.numel() * t.element_size()
                stats.tensors_offloaded += 1
            return t.device, host

        def unpack(packed: Tensor | tuple[torch.device, Tensor]) -> Tensor:
            if isinstance(packed, Tensor):
                return packed
            device, host = packed
            if side is not None and device.type == "cuda":
                torch.cuda.current_stream(device).wait_stream(side)  # the copy to the host has finished
                return host.to(device, non_blocking=True)
            return host.clone() if device.type == "cpu" else host.to(device)

        super().__init__(pack, unpack)


@contextlib.contextmanager
def simulated(observe: Callable[[Tensor], None] | None = None) -> Iterator[None]:
    """Within: OffloadSavedTensors treats CPU tensors as accelerator tensors (copies them) and calls `observe` on
    every host copy (profile_memory labels them host memory). For tests and CPU estimates."""
    previous = OffloadSavedTensors._simulate, OffloadSavedTensors._observe
    OffloadSavedTensors._simulate, OffloadSavedTensors._observe = True, observe
    try:
        yield
    finally:
        OffloadSavedTensors._simulate, OffloadSavedTensors._observe = previous
