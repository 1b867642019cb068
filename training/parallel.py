"""Parallelism, applied in one visible place: the process layout (`init_runtime`), and FSDP2 (`fully_shard`) on
every block and on the root.

The model code knows nothing about parallelism; `apply_fsdp` is the only function that changes how it runs, and
`init_sharded_weights` materialises a model that `apply_fsdp` sharded on the meta device.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method

from model import Transformer
from training.run_directory import exit_with_launcher


@dataclass
class Runtime:
    """Where a process of a run stands: its rank, the number of processes, its device, and the mesh FSDP shards
    over (None: one process, no FSDP)."""

    rank: int
    world_size: int
    device: torch.device
    mesh: DeviceMesh | None


def init_runtime() -> Runtime:
    """One process per device; under torchrun (WORLD_SIZE > 1) a process group (NCCL on GPU, gloo on CPU)."""
    exit_with_launcher()  # first: a worker whose torchrun dies stops (saving first once it trains), even mid-rendezvous
    rank, world_size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    if not 0 <= rank < world_size:  # a stray RANK: every error would be left to a rank that prints nothing
        os.environ["RANK"] = "0"  # so that this one line is printed
        raise ValueError(f"RANK={rank} with WORLD_SIZE={world_size}: launch under torchrun, or unset RANK")
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    mesh = None
    if world_size > 1:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
        mesh = init_device_mesh(device.type, (world_size,))
    return Runtime(rank, world_size, device, mesh)


def apply_fsdp(model: Transformer, mesh: DeviceMesh, param_dtype: torch.dtype | None = None,
               reduce_dtype: torch.dtype | None = torch.float32, sum_gradients: bool = False) -> Transformer:
    """Shard `model` in place over `mesh` (ZeRO-3: parameters, gradients and optimizer state split across ranks).

    One `fully_shard` per block gives one all-gather / reduce-scatter per block; the root group holds the
    embedding, the final norm and the output weight (tied or not), which the loss reads through the root module.
    `param_dtype` is the compute dtype (e.g. bf16) while the sharded master weights stay float32; gradients are
    reduced in `reduce_dtype`. By default FSDP averages gradients over ranks; `sum_gradients=True` makes the
    reduction a plain sum, which is right when each rank's loss is already divided by the global token count
    (train.py). `model.generate` is registered as a forward method, so every rank can sample from the sharded model.
    Call on a model built on the meta device, then `init_sharded_weights`.
    """
    # cast_forward_inputs=False: the float inputs stay as given: the float32 RoPE tables of each block (bf16 would
    # round cos/sin to 3 digits) and the float32 loss normaliser of the root. Activations are bf16 anyway, since
    # the embedding weight they come from is.
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype, cast_forward_inputs=False)
    for block in model.layers:
        fully_shard(block, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    if sum_gradients:
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_gradient_divide_factor(1.0)
                module.set_force_sum_reduction_for_comms(True)  # plain SUM on every backend (gloo has no PREMUL_SUM)
    register_fsdp_forward_method(model, "generate")  # all-gather the root's weights (embedding, lm_head) for it
    return model


def init_sharded_weights(model: Transformer, device: torch.device, seed: int) -> None:
    """Materialise `model` (sharded on the meta device by `apply_fsdp`) on `device` and initialise it
    deterministically from `seed`, consistently across ranks.

    On CUDA, DTensor random ops give each shard its own slice of one Philox stream seeded identically on every
    rank, so `to_empty` + `init_weights` is rank-consistent without communication. CPU generators have no such
    offsets: every rank would draw the same numbers for its own shard (duplicated rows). On CPU, every rank
    therefore initialises the full model from the seed and keeps its shard, which reproduces the single-process
    initialisation `torch.manual_seed(seed); Transformer(config)` exactly. Parameters a plain Transformer does not
    have (LoRA adapters) are left to their owner to initialise (lora.init_lora).
    """
    model.to_empty(device=device)
    torch.manual_seed(seed)
    if device.type == "cuda":
        model.init_weights()
        return
    full = Transformer(model.config, model.compute)  # built on the CPU and initialised in __init__ from the seeded RNG
    set_model_state_dict(model, full.state_dict(), options=StateDictOptions(full_state_dict=True, strict=False))
    model.finish_loading()  # to_empty left the (non-persistent) RoPE tables uninitialised
