"""Deterministic peak-memory measurement without a GPU: a TorchDispatchMode that counts live tensor storage bytes.

Every tensor returned by an op while the mode is active has its storage registered once, unless it aliases one
of the op's inputs (views and in-place results allocate nothing); the bytes are subtracted when that storage is
freed. `peak` is the high-water mark of bytes allocated under the mode and still alive, i.e. memory *beyond*
whatever existed before (inputs, parameters). Backward is included when `.backward()` runs inside the `with`
block (the CPU autograd engine runs on the caller's thread).

Under `torch._subclasses.fake_tensor.FakeTensorMode` nothing is allocated, so full-size shapes (e.g. 131,072 x
151,936 logits) are measured in milliseconds:

    with FakeTensorMode():
        hidden = torch.empty(131072, 2560, dtype=torch.bfloat16, requires_grad=True)
        ...
        with LiveBytesTracker() as tracker:
            loss_fn(hidden, ...).backward()
    print(tracker.peak)

Blind spots: memory an op allocates internally and frees before returning (kernel workspaces, the body of a
torch.library custom op, which runs only its fake implementation under FakeTensorMode), allocator caching and
fragmentation, and storages resized in place after creation.
"""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary


class LiveBytesTracker(TorchDispatchMode):
    """Counts bytes of tensor storages created while active. Attributes: `live` (bytes now), `peak` (max of live),
    `largest` (the largest single storage created)."""

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self.largest = 0
        self._sizes: WeakIdKeyDictionary = WeakIdKeyDictionary()  # storage -> bytes counted for it

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inputs = {id(t.untyped_storage()) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        out = func(*args, **kwargs)
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and id(t.untyped_storage()) not in inputs:  # views/in-place: no new bytes
                self._register(t.untyped_storage())
        return out

    def _register(self, storage: torch.UntypedStorage) -> None:
        if storage in self._sizes:
            return
        nbytes = storage.nbytes()
        self._sizes[storage] = nbytes
        self.live += nbytes
        self.peak = max(self.peak, self.live)
        self.largest = max(self.largest, nbytes)
        weakref.finalize(storage, self._free, nbytes)

    def _free(self, nbytes: int) -> None:
        self.live -= nbytes

    def reset_peak(self) -> None:
        """Restart the high-water mark from the bytes live now (e.g. to measure backward alone)."""
        self.peak = self.live
