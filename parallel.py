"""Parallelism, applied in one visible place: FSDP2 (`fully_shard`) on every block and on the root.

The model code knows nothing about parallelism; `apply_fsdp` is the only function that changes how it runs.
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from model import Transformer


def apply_fsdp(model: Transformer, mesh: DeviceMesh, param_dtype: torch.dtype | None = None,
               reduce_dtype: torch.dtype | None = torch.float32) -> Transformer:
    """Shard `model` in place over `mesh` (ZeRO-3: parameters, gradients and optimizer state split across ranks).

    One `fully_shard` per block gives one all-gather / reduce-scatter per block; the root group holds the
    embedding, the final norm and the output weight (tied or not), which the loss reads through the root module.
    `param_dtype` is the compute dtype (e.g. bf16) while the sharded master weights stay float32; gradients are
    reduced in `reduce_dtype`. Call on a model built on the meta device, then `to_empty` + `init_weights`.
    """
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    for block in model.layers:
        fully_shard(block, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    return model
