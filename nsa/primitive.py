"""The switches that choose how NSA's branches run, context managers for tests, estimates and experiments:
`triton_kernels` (nsa/triton_path.py's branches on every device) and `exact_block_scores` (selection by each block's
best key instead of the compression branch). Their primitive, attention with log-sum-exp, and its own switch
(`explicit_attention`: the explicit path on every device) are modeling/flash.py's.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager

from torch import Tensor
from torch._subclasses.fake_tensor import is_fake

from modeling.config import ComputeConfig

# set by `triton_kernels` and `exact_block_scores`
_forced = {"triton": False, "exact": False}


@contextmanager
def _forcing(name: str) -> Iterator[None]:
    previous, _forced[name] = _forced[name], True
    try:
        yield
    finally:
        _forced[name] = previous


def triton_kernels() -> AbstractContextManager[None]:
    """Within the block, the branches run on the Triton kernels (nsa/triton_path.py) on every device, as they do on
    CUDA: on CPU tensors in Triton's interpreter (TRITON_INTERPRET=1 before nsa.triton_kernels is imported), for
    tests; on fake tensors without launching them (their outputs are allocated; Triton need not be installed), for
    profile_memory.py's estimates."""
    return _forcing("triton")


def exact_block_scores() -> AbstractContextManager[None]:
    """Within the block, selection blocks are scored by their best token instead of the compression branch: a
    query head's score for a past block j (before its own and the previous block, which are always selected) is
    softmax over those blocks of max_{s in j} q . k_s / sqrt(D), with the selection branch's keys, summed over the
    group's heads as Eq. 10 sums the compression probabilities (`nsa.blocks.best_token_scores`). It reads every key
    of the prefix, so it is no sparse attention: it measures the recall the model reaches with its n and l' when
    each block is judged by its best-matching key (a heuristic, not an upper bound;
    benchmarks/nsa_branch_ablation.py)."""
    return _forcing("exact")


def exact_scores_active() -> bool:
    """Whether `exact_block_scores` holds: the selection scores blocks by their best token."""
    return _forced["exact"]


def triton_installed() -> bool:
    """Whether Triton can be imported here (nsa/triton_kernels.py needs it to launch a kernel)."""
    return importlib.util.find_spec("triton") is not None


def triton_ready(t: Tensor, compute: ComputeConfig) -> bool:
    """Whether the Triton kernels' path runs for t: real CUDA tensors when `compute.triton_kernels` and Triton is
    installed; under `triton_kernels()` any tensors, real ones only with Triton installed (fake ones launch nothing,
    so they need no Triton: nsa/triton_path.py)."""
    if _forced["triton"]:
        return is_fake(t) or triton_installed()
    return compute.triton_kernels and t.is_cuda and not is_fake(t) and triton_installed()
