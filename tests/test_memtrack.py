"""memtrack.LiveBytesTracker on real and fake tensors: counts new storages once, ignores views, frees on release,
follows in-place resizes, and labels storages by category (a training step's split included)."""

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from modeling.memtrack import LiveBytesTracker, track_training_step


def test_counts_new_storages_views_and_frees():
    x = torch.ones(1000)  # made before the tracker: not counted
    with LiveBytesTracker() as tracker:
        y = x * 2  # 4000 bytes
        view = y[10:].view(-1, 10)  # a view: nothing new
        y.add_(1)  # in place: nothing new
        z = torch.empty(500, dtype=torch.float64)  # 4000 bytes
        assert tracker.live == tracker.peak == 8000
        del y, view
        assert tracker.live == 4000
        tracker.reset_peak()
        del z
        assert tracker.live == 0 and tracker.peak == 4000


def test_fake_tensors_are_counted_without_allocation():
    with FakeTensorMode(), LiveBytesTracker() as tracker:
        big = torch.empty(1 << 20, 1 << 15)  # 128 GiB, never allocated
        del big
    assert tracker.peak == (1 << 35) * 4 and tracker.live == 0


def test_backward_inside_the_mode_is_counted():
    w = torch.randn(64, 64, requires_grad=True)
    with LiveBytesTracker() as tracker:
        (w @ w).sum().backward()
    assert tracker.peak >= 2 * 64 * 64 * 4  # the product and at least the gradient
    assert tracker.live == 64 * 64 * 4  # w.grad stays


def test_categories_follow_the_tracker_and_track_moves_storages():
    w = torch.zeros(100)  # 400 bytes, made before the tracker
    resize = torch.UntypedStorage.resize_
    with LiveBytesTracker("activations") as tracker:
        tracker.track([w], "parameters")  # counted from now on
        a = w * 2  # 400 bytes of activations
        tracker.category = "temporaries"
        b = torch.empty(50)  # 200 bytes of temporaries
        assert dict(tracker.live_by_category) == {"parameters": 400, "activations": 400, "temporaries": 200}
        tracker.track([a[10:]], "gradients")  # already counted (through a view): moved, not counted twice
        assert tracker.live == 1000 and tracker.live_by_category["gradients"] == 400
        assert tracker.live_by_category["activations"] == 0
        b.untyped_storage().resize_(0)  # freed in place (as FSDP2 frees its unsharded parameters)
        assert tracker.live == 800 and tracker.peak == 1000
        b.untyped_storage().resize_(800)
        assert tracker.live == tracker.peak == 1600 and tracker.largest == 800
        assert tracker.peak_by_category == {"parameters": 400, "activations": 0, "gradients": 400, "temporaries": 800}
    assert torch.UntypedStorage.resize_ is resize  # restored on exit
    del a, b
    assert tracker.live == 400  # w, counted by track, is still alive


def test_training_step_categories():
    model = torch.nn.Linear(8, 4)  # 36 float32 parameters
    optimizer = torch.optim.AdamW(model.parameters())
    x = torch.randn(2, 8)
    model(x).sum().backward()
    optimizer.step()  # AdamW state exists, as in every step after the first
    optimizer.zero_grad(set_to_none=True)
    P = 36 * 4
    with LiveBytesTracker() as tracker, track_training_step(tracker, model, optimizer, [x]):
        assert dict(tracker.live_by_category) == {"parameters": P, "optimizer": 2 * P + 2 * 4, "activations": 64}
        tracker.category = "activations"
        loss = model(x).sum()
        tracker.category = "temporaries"
        loss.backward()
        del loss
        assert tracker.live_by_category["gradients"] == P  # the .grad storages, made in backward
        assert tracker.live == sum(tracker.live_by_category.values())
        tracker.category = "optimizer"
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        assert tracker.live_by_category["gradients"] == 0
