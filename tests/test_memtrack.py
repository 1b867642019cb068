"""memtrack.LiveBytesTracker on real and fake tensors: counts new storages once, ignores views, frees on release."""

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from memtrack import LiveBytesTracker


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
