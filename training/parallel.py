"""Parallelism, applied in one visible place: the process layout (`init_runtime`), FSDP2 (`fully_shard`) on every
block and on the root, and context parallelism (`context_shard`, its engine for full attention chosen by
`ring_attention_applies`).

The model code knows nothing about parallelism; `apply_fsdp` is the only function that changes how it runs,
`init_sharded_weights` materialises a model that `apply_fsdp` sharded on the meta device, and `context_shard` is
the one object through which a forward reads other ranks' positions of its sequence.

Layout: W processes form a (data x context) mesh of W / N x N ranks, N = --context_parallel, rank = data index x N
+ context index. The N ranks of a context group train on the same sequences, each holding 2 of their 2N equal
chunks (`modeling.shard.balanced_spans`); the W / N groups read different data. FSDP shards parameters, gradients
and optimizer state over all W ranks (the mesh flattened) and sums gradients over them: each rank's loss is its own
targets' share of the step's mean, so the sum is the gradient of that mean.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as dist
from torch import Tensor
from torch.backends.cuda import SDPAParams, can_use_flash_attention
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method

from model import Transformer
from modeling.shard import SequenceShard, balanced_spans
from training.run_directory import exit_with_launcher


@dataclass
class Runtime:
    """Where a process of a run stands: its rank, the number of processes, its device, the mesh FSDP shards over
    (None: one process, no FSDP), and its context group (`context_ranks` processes that split each sequence; None
    when each process holds whole sequences)."""

    rank: int
    world_size: int
    device: torch.device
    mesh: DeviceMesh | None
    context_ranks: int = 1
    context_group: dist.ProcessGroup | None = None

    @property
    def data_rank(self) -> int:
        """Which sequences this process reads: its context group's index."""
        return self.rank // self.context_ranks

    @property
    def data_ranks(self) -> int:
        """How many processes read different sequences: the context groups."""
        return self.world_size // self.context_ranks


def init_runtime(context_parallel: int = 1) -> Runtime:
    """One process per device; under torchrun (WORLD_SIZE > 1) a process group (NCCL on GPU, gloo on CPU), and with
    `context_parallel` N > 1 a (data x context) mesh whose context groups of N ranks split each sequence."""
    exit_with_launcher()  # first: a worker whose torchrun dies stops (saving first once it trains), even mid-rendezvous
    rank, world_size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    if not 0 <= rank < world_size:  # a stray RANK: every error would be left to a rank that prints nothing
        os.environ["RANK"] = "0"  # so that this one line is printed
        raise ValueError(f"RANK={rank} with WORLD_SIZE={world_size}: launch under torchrun, or unset RANK")
    if context_parallel < 1 or world_size % context_parallel:
        raise ValueError(f"--context_parallel {context_parallel} must divide the {world_size} processes (torchrun "
                         f"--nproc_per_node x nodes): pass one of "
                         f"{[n for n in range(1, world_size + 1) if world_size % n == 0]}")
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    mesh, group = None, None
    if world_size > 1:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
        mesh, group = build_mesh(device.type, world_size, context_parallel)
    return Runtime(rank, world_size, device, mesh, context_parallel, group)


def build_mesh(device_type: str, world_size: int, context_parallel: int
               ) -> tuple[DeviceMesh, dist.ProcessGroup | None]:
    """(the mesh FSDP shards over: every rank, the context group of this rank or None) over the initialised process
    group: a (data x context) grid of world_size / N x N ranks flattened for FSDP, N = context_parallel."""
    if context_parallel == 1:
        return init_device_mesh(device_type, (world_size,)), None
    grid = init_device_mesh(device_type, (world_size // context_parallel, context_parallel),
                            mesh_dim_names=("data", "context"))
    return grid._flatten("data_context"), grid.get_group("context")


@dataclass
class Traffic:
    """Bytes a rank sends for context parallelism, counted as a ring sends them (N - 1 times its part per
    collective): all-gathers of keys and values in forward (and in their recomputation under checkpointing), and
    reduce-scatters of their gradients in backward. Ring attention counts its passes of keys and values as gathers
    (N - 1 a pass: one in forward, one in backward) and its passes of their gradients as scatters (N a backward, in
    float32 for half-precision inputs)."""

    gathered: int = 0
    scattered: int = 0
    gathers: int = 0
    scatters: int = 0


def context_shard(rt: Runtime, length: int, traffic: Traffic | None = None, ring: bool | None = None
                  ) -> SequenceShard | None:
    """This process's part of each sequence of `length` tokens under context parallelism
    (`modeling.shard.SequenceShard`, None without): chunks r and 2N - 1 - r of 2N (`balanced_spans`; ValueError
    naming the lengths that split), whose `all_gather` all-gathers over the context group in forward and
    reduce-scatters the gradient in backward, and whose `attention`, with `ring` (default:
    `ring_attention_applies(rt.device)`), is PyTorch's ring attention over the group; traffic counted in `traffic`
    when given."""
    if rt.context_group is None:
        return None
    N = rt.context_ranks
    layouts = tuple(balanced_spans(length, N, rank) for rank in range(N))
    ring = ring_attention_applies(rt.device) if ring is None else ring
    return SequenceShard(length, layouts, rt.rank % N,
                         partial(_AllGather.apply, group=rt.context_group, traffic=traffic),
                         attention=partial(ring_attention, group=rt.context_group, traffic=traffic) if ring else None)


def ring_attention_applies(device: torch.device) -> bool:
    """By device, whether causal full attention over a sequence shard runs on PyTorch's ring attention
    (`ring_attention`) rather than on keys and values all-gathered by the model: on CUDA, where it is PyTorch's own
    context-parallel engine, with the keys and values of one chunk pair in flight at a time and the next pass
    overlapping the current chunk's attention. Elsewhere (gloo on CPUs) the all-gather, the engine the memory
    estimate models. The model gathers also where the ring cannot run (documents, NSA, `ring_attention` None)."""
    return device.type == "cuda"


# The flash kernels the ring runs on each pair of chunks, (forward, backward) by device type, and the CUDA forward's
# results after (out, lse) that its backward takes back, by name (its last, the debug mask, is not). The CPU's
# forward returns (out, lse) alone.
_RING_KERNELS = {
    "cuda": (torch.ops.aten._scaled_dot_product_flash_attention.default,
             torch.ops.aten._scaled_dot_product_flash_attention_backward.default),
    "cpu": (torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
            torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default),
}
_CUDA_STATE = ("cum_seq_q", "cum_seq_k", "max_q", "max_k", "philox_seed", "philox_offset")


def ring_attention(q: Tensor, k: Tensor, v: Tensor, scale: float, group: dist.ProcessGroup,
                   traffic: Traffic | None = None) -> Tensor | None:
    """Causal attention of this rank's queries q (B, H, t, D) over the whole sequence's keys, given this rank's
    keys and values k, v (B, KV, t, D) (KV divides H), the ranks of `group` holding chunks r and 2N - 1 - r of 2N
    in group-rank order (`balanced_spans`, as `context_shard` lays them out): PyTorch's ring attention, each
    rank's keys and values passed round the group and each pair of chunks attended on the device's flash kernel,
    partial outputs merged by log-sum-exp (in float32 for half-precision inputs, otherwise in their dtype);
    backward passes the keys round again and their gradients after them. Exact up to the order of sums. Returns
    (B, H, t, D), or None on CUDA where its flash kernel cannot take the inputs as they are (it needs bfloat16 or
    float16 and a head_dim that is a multiple of 8, at most 256, on a GPU it supports): the caller then gathers."""
    if q.device.type == "cuda" and (q.shape[-1] % 8 or not can_use_flash_attention(
            SDPAParams(q, k, v, None, 0.0, True, q.shape[1] != k.shape[1]))):
        return None
    return _RingAttention.apply(q, k, v, scale, group, traffic)


@contextmanager
def _ring_options(dtype: torch.dtype) -> Iterator[object]:
    """PyTorch's ring functions (their module, private in PyTorch 2.13) with their global options set for this
    layout for the duration: chunks r and 2N - 1 - r (its load balance), keys passed to the next rank (all-to-all,
    not all-gathered), merges in float32 for half precision only; the options restored after."""
    from torch.distributed.tensor.experimental._context_parallel import _attention as ring

    options = ring._cp_options
    saved = (options.enable_load_balance, options.rotate_method, options.convert_to_f32)
    options.enable_load_balance, options.rotate_method = True, ring._RotateMethod.ALL_TO_ALL
    options.convert_to_f32 = dtype.itemsize < 4
    try:
        yield ring
    finally:
        options.enable_load_balance, options.rotate_method, options.convert_to_f32 = saved


class _RingAttention(torch.autograd.Function):
    """`ring_attention`'s forward and backward on PyTorch's templated ring functions."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, scale: float, group: dist.ProcessGroup,
                traffic: Traffic | None) -> Tensor:
        forward_kernel, _ = _RING_KERNELS[q.device.type]
        with _ring_options(q.dtype) as ring:  # out (B, H, t, D) in q's dtype, lse (B, H, t) float32
            out, lse, *state = ring._templated_ring_attention(group, 2, forward_kernel, q, k, v, is_causal=True,
                                                               dropout_p=0.0, scale=scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.scale, ctx.group, ctx.traffic = scale, group, traffic
        ctx.state = dict(zip(_CUDA_STATE, state[:len(_CUDA_STATE)], strict=False))  # empty on the CPU
        if traffic is not None:
            traffic.gathered += (dist.get_world_size(group) - 1) * 2 * k.numel() * k.element_size()
            traffic.gathers += 1
        return out

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        _, backward_kernel = _RING_KERNELS[q.device.type]
        with _ring_options(q.dtype) as ring:  # dq (B, H, t, D), dk, dv (B, KV, t, D) in the inputs' dtypes
            dq, dk, dv, *_ = ring._templated_ring_attention_backward(
                ctx.group, 2, backward_kernel, grad.contiguous(), "grad_out", q, k, v, out, lse, is_causal=True,
                dropout_p=0.0, scale=ctx.scale, **ctx.state)
        if ctx.traffic is not None:
            N, sums = dist.get_world_size(ctx.group), max(k.element_size(), 4)
            ctx.traffic.gathered += (N - 1) * 2 * k.numel() * k.element_size()
            ctx.traffic.scattered += N * 2 * k.numel() * sums
            ctx.traffic.gathers += 1
            ctx.traffic.scatters += 1
        return dq, dk, dv, None, None, None


class _AllGather(torch.autograd.Function):
    """x -> (N, *x.shape): x from every rank of `group`, stacked by rank; backward: each rank's slice of the gradient
    summed over the ranks (reduce-scatter)."""

    @staticmethod
    def forward(ctx, x: Tensor, group: dist.ProcessGroup, traffic: Traffic | None) -> Tensor:
        N = dist.get_world_size(group)
        stacked = x.new_empty(N * x.shape[0], *x.shape[1:])  # one buffer, each rank's x in its rows
        dist.all_gather_single(stacked, x.contiguous(), group=group)
        if traffic is not None:
            traffic.gathered += (N - 1) * x.numel() * x.element_size()
            traffic.gathers += 1
        ctx.group, ctx.traffic = group, traffic
        return stacked.view(N, *x.shape)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, ...]:
        mine = grad.new_empty(grad.shape[1:])
        dist.reduce_scatter_single(mine, grad.reshape(-1, *grad.shape[2:]).contiguous(), group=ctx.group)
        if ctx.traffic is not None:
            ctx.traffic.scattered += (grad.shape[0] - 1) * mine.numel() * mine.element_size()
            ctx.traffic.scatters += 1
        return mine, None, None


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
