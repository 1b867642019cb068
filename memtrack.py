"""Memory tracking without a GPU: every memory number and memory test of this project comes from this module.

`LiveBytesTracker` is a TorchDispatchMode that counts live tensor storage bytes. Every tensor returned by an op while
the mode is active has its storage registered once, unless it aliases one of the op's inputs (views and in-place
results allocate nothing); the bytes are subtracted when that storage is freed. `peak` is the high-water mark of
bytes allocated under the mode and still alive, i.e. memory *beyond* whatever existed before (inputs, parameters);
the same numbers exist per device type (`live_by_device`, `peak_by_device`), which tells accelerator memory from
host memory when activations are offloaded. Backward is included when `.backward()` runs inside the `with` block
(the CPU autograd engine runs on the caller's thread).

`StageTracker` / `FSDPStageTracker` add what profile_memory.py's table needs on top of the same kind of counting:
the bytes split into parameters, gradients, optimizer state, activations and temporaries, as torch's own
`MemTracker` / `FSDPMemTracker` classify them (through module and optimizer hooks), and the peak of each phase.

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
from collections import defaultdict

import torch
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
from torch.distributed._tools.mem_tracker import MemTracker
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary

CATEGORIES = ("parameters", "gradients", "optimizer", "activations", "temporaries")
# MemTracker's and FSDPMemTracker's reference types, folded into the five categories ("Other": the inputs).
_TRACKER_CATEGORIES = {
    "Parameter": "parameters", "Gradient": "gradients", "Optstate": "optimizer", "Other": "activations",
    "Sharded Param": "parameters", "Unsharded Param": "parameters", "All Gather": "parameters", "Buffer": "parameters",
    "Sharded Grad": "gradients", "Unsharded Grad": "gradients", "Reduce Scatter": "gradients",
    "OptState": "optimizer", "Activation": "activations", "Inputs": "activations", "Temp": "temporaries",
}


class LiveBytesTracker(TorchDispatchMode):
    """Counts bytes of tensor storages created while active. Attributes: `live` (bytes now), `peak` (max of live),
    `largest` (the largest single storage created), `live_by_device` / `peak_by_device` (the same per device
    type, e.g. "cpu", "cuda", or "meta" standing in for an accelerator under FakeTensorMode)."""

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self.largest = 0
        self.live_by_device: dict[str, int] = defaultdict(int)
        self.peak_by_device: dict[str, int] = defaultdict(int)
        self._counted: WeakIdKeyDictionary = WeakIdKeyDictionary()  # storages already counted

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inputs = {id(t.untyped_storage()) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        out = func(*args, **kwargs)
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and id(t.untyped_storage()) not in inputs:  # views/in-place: no new bytes
                self._register(t.untyped_storage(), t.device.type)
        return out

    def _register(self, storage: torch.UntypedStorage, device: str) -> None:
        if storage in self._counted:
            return
        nbytes = storage.nbytes()
        self._counted[storage] = True
        self.live += nbytes
        self.live_by_device[device] += nbytes
        self.peak = max(self.peak, self.live)
        self.peak_by_device[device] = max(self.peak_by_device[device], self.live_by_device[device])
        self.largest = max(self.largest, nbytes)
        weakref.finalize(storage, self._free, device, nbytes)

    def _free(self, device: str, nbytes: int) -> None:
        self.live -= nbytes
        self.live_by_device[device] -= nbytes

    def reset_peak(self) -> None:
        """Restart the high-water marks from the bytes live now (e.g. to measure backward alone)."""
        self.peak = self.live
        self.peak_by_device = defaultdict(int, self.live_by_device)


class _Stages:
    """Mixin for MemTracker / FSDPMemTracker: live bytes by category now and at the highest point of the phase."""

    _curr_mem_snap: dict[torch.device, dict[str, int]]

    def current(self) -> dict[str, int]:
        totals = dict.fromkeys(("total", *CATEGORIES), 0)
        for device_snapshot in self._curr_mem_snap.values():
            for kind, nbytes in device_snapshot.items():
                if kind == "Total":
                    totals["total"] += nbytes
                else:
                    totals[_TRACKER_CATEGORIES[kind.value]] += nbytes
        return totals

    def start_phase(self) -> None:
        self._phase_peak = self.current()

    def phase_peak(self) -> dict[str, int]:
        return dict(self._phase_peak)

    def _update_peak_stats(self, peak_state: object) -> None:
        # MemTracker calls this after every operator. Only the phase's highest snapshot is kept: its own per-module
        # peak bookkeeping (unused here) loops over every module at every operator and costs a quarter of the run.
        now = self.current()
        if now["total"] > self._phase_peak["total"]:
            self._phase_peak = now


class StageTracker(_Stages, MemTracker):
    """One process, no FSDP: `model`, `optimizer` and `inputs` are counted from the start (track_external)."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 inputs: tuple[torch.Tensor, ...]) -> None:
        super().__init__()
        self.track_external(model, optimizer, *inputs)
        self.start_phase()


class FSDPStageTracker(_Stages, FSDPMemTracker):
    """An FSDP2-sharded model: also tells sharded from unsharded parameters and gradients, and collective buffers."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 inputs: tuple[torch.Tensor, ...]) -> None:
        super().__init__(model, optimizer)
        self.track_inputs(inputs)
        self.start_phase()
