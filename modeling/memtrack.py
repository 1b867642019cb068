"""Memory tracking without a GPU: every memory number and memory test of this project comes from this module.

`LiveBytesTracker` is a TorchDispatchMode that counts live tensor storage bytes. Every tensor returned by an op while
the mode is active has its storage registered once, unless it aliases one of the op's inputs (views and in-place
results allocate nothing); the bytes are subtracted when that storage is freed, and follow it when it is resized in
place (`UntypedStorage.resize_`, as FSDP2 does to free and refill its unsharded parameters). `peak` is the high-water
mark of the bytes counted and still alive, i.e. memory *beyond* whatever existed before (inputs, parameters) unless
those are counted with `track`; the same numbers exist per device type (`live_by_device`, `peak_by_device`), which
tells accelerator memory from host memory when activations are offloaded. Storages labelled HOST (the host copies
of offloaded activations, see offload.simulated) count only under `live_by_device[HOST]`, not in `live` or `peak`.
Backward is included when `.backward()` runs inside the `with` block (the CPU autograd engine runs on the caller's
thread).

Every counted storage carries a category: new storages get the tracker's current `category` (set it at each phase),
`track(tensors, category)` counts existing tensors or moves counted ones to a category, and the buffers of FSDP's
collectives are labelled by the collective (all-gather outputs "parameters", reduce-scatter buffers "gradients").
`live_by_category` is the split now and `peak_by_category` the split at the moment of `peak`.
`track_training_step` labels one training step the way profile_memory.py's table reads it (CATEGORIES).

DTensors (FSDP2) are seen through their local tensors; DTensor's sharding propagation, which builds global-size
tensors under its own FakeTensorMode, is not counted.

Under `torch._subclasses.fake_tensor.FakeTensorMode` nothing is allocated, so full-size shapes (e.g. 131,072 x
151,936 logits) are measured in milliseconds:

    with FakeTensorMode():
        hidden = torch.empty(131072, 2560, dtype=torch.bfloat16, requires_grad=True)
        ...
        with LiveBytesTracker() as tracker:
            loss_fn(hidden, ...).backward()
    print(tracker.peak)

Blind spots: memory an op allocates internally and frees before returning (kernel workspaces, the body of a
torch.library custom op, which runs only its fake implementation under FakeTensorMode), allocator caching, rounding
and fragmentation.
"""

from __future__ import annotations

import weakref
from collections import defaultdict
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import torch
from torch._guards import active_fake_mode
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary

CATEGORIES = ("parameters", "gradients", "optimizer", "activations", "temporaries")
# The category of storages each phase of a training step makes (track_training_step).
PHASE_CATEGORIES = {"forward": "activations", "backward": "temporaries", "optimizer step": "optimizer"}
HOST = "host"  # device label of offloaded activations' host copies (`track(..., device=HOST)`)
_c10d = torch.ops.c10d
# Collectives whose buffers get a category: {op: (category, positions of the buffers in the op's arguments)}.
_COLLECTIVE_BUFFERS = {_c10d._allgather_base_.default: ("parameters", (0,)),
                       _c10d._reduce_scatter_base_.default: ("gradients", (0, 1))}
# Ops whose output is their input (the fake implementation returns a new tensor): nothing new.
_ALIASING_OPS = {torch.ops._c10d_functional.wait_tensor.default}


class _Storage:
    """What is counted for one storage: its bytes now, device type and category."""

    __slots__ = ("nbytes", "device", "category")

    def __init__(self, nbytes: int, device: str, category: str) -> None:
        self.nbytes, self.device, self.category = nbytes, device, category


def _storages(t: torch.Tensor) -> list[torch.UntypedStorage]:
    """The storages holding `t`'s data: its own, or its inner tensors' for a wrapper subclass (DTensor)."""
    if is_traceable_wrapper_subclass(t):
        attrs, _ = t.__tensor_flatten__()
        inner = (getattr(t, attr) for attr in attrs)
        return [s for x in inner if isinstance(x, torch.Tensor) for s in _storages(x)]
    return [t.untyped_storage()]


class LiveBytesTracker(TorchDispatchMode):
    """Counts bytes of tensor storages created while active (and of those given to `track`). Attributes: `live`
    (bytes now), `peak` (max of live), `largest` (the largest single storage), `live_by_device` / `peak_by_device`
    (the same per device type, e.g. "cpu", "cuda", or "meta" standing in for an accelerator under FakeTensorMode),
    `live_by_category` / `peak_by_category` (the split by category now and when `peak` was reached), `category`
    (the category of storages created from now on)."""

    def __init__(self, category: str = "new") -> None:
        super().__init__()
        self.category = category
        self.live = 0
        self.peak = 0
        self.largest = 0
        self.live_by_device: dict[str, int] = defaultdict(int)
        self.peak_by_device: dict[str, int] = defaultdict(int)
        self.live_by_category: dict[str, int] = defaultdict(int)
        self.peak_by_category: dict[str, int] = {}
        self._counted: WeakIdKeyDictionary = WeakIdKeyDictionary()  # storage -> _Storage
        self._fake_mode = None  # the FakeTensorMode active on entry (None on real tensors)
        self._resize = torch.UntypedStorage.resize_

    def __enter__(self) -> LiveBytesTracker:
        self._fake_mode = active_fake_mode()
        self._resize = torch.UntypedStorage.resize_
        resize = self._resize

        def tracked_resize(storage: torch.UntypedStorage, size: int) -> torch.UntypedStorage:
            out = resize(storage, size)
            self._resized(storage)
            return out

        # resize_ does not reach TorchDispatchMode: follow it while active (torch's MemTracker does the same).
        torch.UntypedStorage.resize_ = tracked_resize
        return super().__enter__()

    def __exit__(self, *args: object) -> None:
        torch.UntypedStorage.resize_ = self._resize
        super().__exit__(*args)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # DTensor runs its local ops, which come back here
        kwargs = kwargs or {}
        inputs = {id(t.untyped_storage()) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        out = func(*args, **kwargs)
        if active_fake_mode() is not self._fake_mode or func in _ALIASING_OPS:
            return out  # DTensor's sharding propagation (its own fake mode), or no new memory
        if func in _COLLECTIVE_BUFFERS:
            category, positions = _COLLECTIVE_BUFFERS[func]
            self.track([args[i] for i in positions], category)
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and id(t.untyped_storage()) not in inputs:  # views/in-place: no new bytes
                storage = t.untyped_storage()
                if storage not in self._counted:
                    self._register(storage, t.device.type, self.category)
        return out

    def track(self, tensors: Iterable[torch.Tensor], category: str, device: str | None = None) -> None:
        """Count the storages of `tensors` under `category`: made before the tracker (weights, optimizer state,
        inputs), they are counted from now on; already counted, they move to `category`. `device` relabels their
        device type: HOST for the host copies of offloaded activations, counted apart from `live` and `peak`."""
        for t in tensors:
            for storage in _storages(t):
                record = self._counted.get(storage)
                if record is None:
                    self._register(storage, device or t.device.type, category)
                elif record.category != category or (device and record.device != device):
                    nbytes = record.nbytes
                    self._add(record, None)
                    record.category, record.device = category, device or record.device
                    self._add(record, nbytes)

    def reset_peak(self) -> None:
        """Restart the high-water marks from the bytes live now (e.g. to measure backward alone)."""
        self.peak = self.live
        self.peak_by_device = defaultdict(int, self.live_by_device)
        self.peak_by_category = dict(self.live_by_category)

    def _register(self, storage: torch.UntypedStorage, device: str, category: str) -> None:
        record = _Storage(0, device, category)
        self._counted[storage] = record
        self._add(record, storage.nbytes())
        weakref.finalize(storage, self._add, record, None)

    def _resized(self, storage: torch.UntypedStorage) -> None:
        record = self._counted.get(storage)
        if record is not None:
            self._add(record, storage.nbytes() - record.nbytes)

    def _add(self, record: _Storage, nbytes: int | None) -> None:
        """Add `nbytes` to the storage of `record` (None: it is freed)."""
        nbytes = -record.nbytes if nbytes is None else nbytes
        record.nbytes += nbytes
        self.largest = max(self.largest, record.nbytes)
        self.live_by_device[record.device] += nbytes
        if self.live_by_device[record.device] > self.peak_by_device[record.device]:
            self.peak_by_device[record.device] = self.live_by_device[record.device]
        if record.device == HOST:
            return
        self.live += nbytes
        self.live_by_category[record.category] += nbytes
        if self.live > self.peak:
            self.peak = self.live
            self.peak_by_category = dict(self.live_by_category)


@contextmanager
def track_training_step(tracker: LiveBytesTracker, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                        inputs: Iterable[torch.Tensor]) -> Iterator[None]:
    """Label the storages of a training step of `model` in CATEGORIES while inside: parameters (weights, buffers,
    FSDP's unsharded copies and all-gather buffers), gradients (`.grad`, reduce-scatter buffers), optimizer (its
    state), activations (`inputs`); set `tracker.category` from PHASE_CATEGORIES at each phase for the rest."""
    tracker.track([*model.parameters(), *model.buffers()], "parameters")
    tracker.track([v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)],
                  "optimizer")
    tracker.track(inputs, "activations")
    handles = []
    hooked: WeakIdKeyDictionary = WeakIdKeyDictionary()

    def label_gradient(param: torch.Tensor) -> None:
        tracker.track([param.grad], "gradients")

    def label_parameters(module: torch.nn.Module, args: object) -> None:
        # Under FSDP a module holds its unsharded parameters from its pre-forward hook on (forward, recomputation);
        # an FSDP unit gathers those of all its submodules at once.
        for param in module.parameters():
            tracker.track([param], "parameters")
            if param.requires_grad and param not in hooked:
                hooked[param] = True
                handles.append(param.register_post_accumulate_grad_hook(label_gradient))

    label_parameters(model, ())
    handles += [module.register_forward_pre_hook(label_parameters) for module in model.modules()]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
