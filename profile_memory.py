"""Will it fit? Memory of one training step, per GPU, stage by stage, estimated on a CPU-only machine.

    python profile_memory.py --model_size 4B --context_length 131072 --attention_type nsa
    python profile_memory.py --model_size 4B --context_length 131072 --world_size 2 --gradient_checkpointing \
        --gpu_memory 80
    python profile_memory.py --model_size 4B --context_length 32768 --gradient_checkpointing --finetune lora \
        --quantize_base nf4

How (`estimate`): the model and optimizer are built by train.py's own builders (`train.build_model`,
`train.build_optimizer`, from the `TrainConfig` a run with these options would have) under `FakeTensorMode`, so
every tensor has its real shape, dtype and storage size and nothing is allocated. With `--world_size N > 1`: meta
device, FSDP2 (bf16 compute copies of fp32 master weights, summed float32 gradients), materialised, on a fake
process group (`FakeStore`: collectives do nothing) over a CPU device mesh of N ranks, so the numbers are one
rank's. With world size 1: fp32 weights, forward under bf16 autocast, no FSDP (train.py's single-process path).
memtrack's LiveBytesTracker (a TorchDispatchMode; storages labelled by `memtrack.track_training_step`) reads each
stage of one steady-state step (optimizer state present, as in every step after the first): forward (embedding,
first block, all blocks), loss, backward, gradient clipping + AdamW. AdamW runs its per-parameter loop here
(PyTorch's default for CPU tensors); on CUDA its default multi-tensor path adds step temporaries that the estimate
does not show.

Stand-ins, named in the output, come from the attention type (`AttentionLayer.memory_stand_in`): full attention
runs the CPU flash SDPA kernel's fake implementation, which, like the CUDA flash/cuDNN kernels, keeps only the
output and log-sum-exp for backward (no T x T matrix); NSA's attention, hundreds of operators per query chunk
(hours at 131k tokens under fake tensors), is a memory double calibrated on the real function (nsa/memory.py).
Under fake tensors RoPE rotates one chunk of positions instead of all (layers._rotate: same peak, far fewer
operators), which keeps the 4B / 131k / NSA estimate to seconds. Not seen by the tracker: the CUDA context
(~0.5-1 GiB), NCCL buffers, allocator rounding and fragmentation, workspaces inside single kernels; `--reserve`
(GiB) keeps room for them when judging the fit.

`--measure` (CUDA only) runs the same step for real on the GPU, reads torch.cuda memory statistics at the same
stages and prints them beside the estimate (with the fake process group, `--world_size N` measures one of N ranks on
a single GPU).

Categories: parameters (weights, unsharded compute copies, all-gather buffers, buffers), gradients (`.grad`, with
reduce-scatter buffers), optimizer (AdamW moments, and what gradient clipping and the step make), activations (made
in forward, including the inputs and what is saved for backward), temporaries (made in backward: activation
gradients, recomputation). With `--offload_activations`, "host" is the host memory holding offloaded activations,
not part of the total. Sizes are bytes in the returned dicts, GiB in the table (MiB for toy models).

Notation: B batch, T tokens per sequence, H query heads, D head dimension, Q NSA query chunk.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
import warnings
from collections.abc import Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed._tools.fake_collectives  # noqa: F401  (fake c10d collectives: FSDP under FakeTensorMode)
from torch import Tensor
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.testing._internal.distributed.fake_pg import FakeStore

import train
import train_config
from config import ATTENTION_TYPES, PRESETS, ComputeConfig, ModelConfig, attention_class
from memtrack import CATEGORIES, HOST, PHASE_CATEGORIES, LiveBytesTracker, track_training_step
from model import Transformer
from offload import simulated
from quantize import quantize_base

GiB = 1024**3
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}  # as train.py
TILED_FFN_CHUNK = 8192  # the tile --gpu_memory tries for long sequences
PHASES = ("forward", "backward", "optimizer step")
PROFILED_QUANTIZED = ("int8", "nf4")  # --quantize_base kinds whose layout is the same on every device
MAX_CONTEXT = 2**22  # tokens per sequence the estimate accepts (4M: 1024 loss chunks of 4096)
_HARMLESS_WARNINGS = ("DTensor random operators may not have complete support on cpu device mesh",
                      "FSDP2-wrapped module .* returned a view tensor")


@dataclass(frozen=True)
class StepConfig:
    """One training step to profile: the model preset and everything that changes the memory of a step."""

    model_size: str = "4B"
    context_length: int = 4096  # tokens per sequence
    attention_type: str = "full"  # a name in config.ATTENTION_TYPES
    batch_size: int = 1  # sequences per rank
    world_size: int = 1  # FSDP2 ranks; parameters, gradients and optimizer state are sharded over them
    gradient_checkpointing: bool = False
    loss: str = "auto"  # "auto" | "standard" | "chunked" (ComputeConfig.loss_mode)
    dtype: str = "bfloat16"  # compute dtype; master weights, gradients and AdamW state stay float32
    ffn_chunk_size: int | None = None  # tiled MLP (ComputeConfig.ffn_chunk_size); None: untiled
    query_chunk: int = 512  # ComputeConfig.attention_query_chunk
    offload_activations: bool = False  # ComputeConfig.offload_activations: saved block inputs in host memory
    # "full"; or on a frozen base with train.py's defaults, "lora" (rank-16 adapters on q, k, v, o) or "npt"
    # (rank-16 neuro-plastic layers in the upper half; the base in the compute dtype)
    finetune: str = "full"
    quantize_base: str | None = None  # LoRA: the frozen block linear layers in "int8" or "nf4" (quantize.py)

    def __post_init__(self) -> None:
        if self.model_size not in PRESETS:
            raise ValueError(f"unknown model_size {self.model_size!r}; available: {sorted(PRESETS)}")
        for name in ("context_length", "batch_size", "world_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if not 2 <= self.context_length <= MAX_CONTEXT:
            raise ValueError(f"context_length must be in [2, {MAX_CONTEXT:,}] (next-token targets; longer sequences "
                             f"would loop over more than {MAX_CONTEXT // 4096:,} loss chunks under fake tensors), got "
                             f"{self.context_length:,}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.quantize_base not in (None, *PROFILED_QUANTIZED):
            raise ValueError(f"quantize_base must be one of {PROFILED_QUANTIZED} (int4's layout depends on the device: "
                             f"measure it with train.py), got {self.quantize_base!r}")
        if self.quantize_base and self.finetune != "lora":
            raise ValueError("quantize_base is for finetune 'lora'")
        if (self.finetune == "npt" or self.quantize_base) and self.world_size != 1:
            raise ValueError("NPT and a quantized base run in one process: world_size must be 1")
        self.train_config()  # validate finetune
        self.model_config(), self.compute_config()  # validate attention_type and loss

    def model_config(self) -> ModelConfig:
        return ModelConfig.from_preset(self.model_size, context_length=self.context_length,
                                       attention_type=self.attention_type)

    def compute_config(self) -> ComputeConfig:
        return ComputeConfig(loss_mode=self.loss, ffn_chunk_size=self.ffn_chunk_size,
                             attention_query_chunk=self.query_chunk, offload_activations=self.offload_activations)

    def train_config(self) -> train_config.TrainConfig:
        """The train.py options of this step (what train.build_model and build_optimizer read)."""
        return train_config.TrainConfig(model_size=self.model_size, attention_type=self.attention_type,
                                        context_length=self.context_length, batch_size=self.batch_size,
                                        gradient_checkpointing=self.gradient_checkpointing, dtype=self.dtype,
                                        finetune=self.finetune, quantize_base=self.quantize_base)

    def describe(self) -> str:
        return (f"{self.model_size}, {self.batch_size} x {self.context_length} tokens per rank, {self.attention_type} "
                f"attention, world size {self.world_size}, {self.dtype} compute, checkpointing "
                f"{'on' if self.gradient_checkpointing else 'off'}"
                + (", activations offloaded to host memory" if self.offload_activations else "")
                + {"full": "", "lora": ", LoRA on a frozen base", "npt": ", NPT layers on a frozen base"}[self.finetune]
                + (f" ({self.quantize_base})" if self.quantize_base else ""))


# ---- memory probes: the same interface over the trackers (fake or real tensors) and over torch.cuda statistics ----

class _CudaStats:
    """torch.cuda.memory_allocated / max_memory_allocated at the same stages (totals only, no categories)."""

    def __enter__(self) -> _CudaStats:
        torch.cuda.synchronize()
        return self

    def __exit__(self, *args: object) -> None:
        torch.cuda.synchronize()

    def current(self) -> dict[str, int]:
        return {"total": torch.cuda.memory_allocated()}

    def start_phase(self, phase: str) -> None:
        torch.cuda.reset_peak_memory_stats()

    def phase_peak(self) -> dict[str, int]:
        return {"total": torch.cuda.max_memory_allocated()}


class _Tracked:
    """memtrack's LiveBytesTracker over the step, its storages labelled in CATEGORIES (`track_training_step`):
    the model, optimizer state and `inputs` are counted from the start."""

    def __init__(self, model: Transformer, optimizer: torch.optim.Optimizer, inputs: tuple[Tensor, ...]) -> None:
        self.tracker = LiveBytesTracker()
        self._stack = ExitStack()
        self._labels = track_training_step(self.tracker, model, optimizer, inputs)

    def __enter__(self) -> _Tracked:
        self._stack.enter_context(self._labels)
        self._stack.enter_context(self.tracker)
        # Offloaded activations: their host copies count as host memory, apart from the device's total.
        self._stack.enter_context(simulated(lambda host: self.tracker.track([host], "activations", HOST)))
        return self

    def __exit__(self, *args: object) -> None:
        self._stack.__exit__(*args)

    def current(self) -> dict[str, int]:
        return {"total": self.tracker.live, **{c: self.tracker.live_by_category[c] for c in CATEGORIES},
                "host": self.tracker.live_by_device[HOST]}

    def start_phase(self, phase: str) -> None:
        self.tracker.category = PHASE_CATEGORIES[phase]
        self.tracker.reset_peak()

    def phase_peak(self) -> dict[str, int]:
        return {"total": self.tracker.peak, **{c: self.tracker.peak_by_category.get(c, 0) for c in CATEGORIES},
                "host": self.tracker.peak_by_device[HOST]}


Probe = _Tracked | _CudaStats


# ---- the step ---------------------------------------------------------------------------------------------------

@contextmanager
def fake_process_group(world_size: int) -> Iterator[None]:
    """A fake process group of `world_size` ranks (this process is rank 0; collectives do nothing), torn down after.
    Does nothing for world size 1 (train.py runs one process without a process group)."""
    if world_size == 1:
        yield
        return
    if dist.is_initialized():
        raise RuntimeError("profile_memory starts its own fake process group; call it outside torch.distributed")
    dist.init_process_group("fake", rank=0, world_size=world_size, store=FakeStore())
    try:
        yield
    finally:
        dist.destroy_process_group()


def build(config: StepConfig, device: str, mesh: DeviceMesh | None) -> tuple[Transformer, torch.optim.Optimizer]:
    """Model and optimizer built by train.py's own builders (`train.build_model`, `train.build_optimizer`) for the
    run `config` describes: with a mesh, on the meta device, sharded by FSDP2 (bf16 compute copies of fp32 master
    weights, summed float32 gradient reduction) and materialised on `device`; without, fp32 on `device` (forward
    then runs under autocast, see `_autocast`)."""
    cfg = train_config.resolve_config(config.train_config(), torch.device(device))
    rt = train.Runtime(rank=0, world_size=config.world_size, device=torch.device(device), mesh=mesh)
    model = train.build_model(config.model_config(), config.compute_config(), cfg, rt)
    if config.quantize_base:
        quantize_base(model, config.quantize_base)
    return model, train.build_optimizer(model, cfg)[0]


def _autocast(config: StepConfig, device: str) -> AbstractContextManager:
    """train.py's forward context: bf16 autocast in a single process, nothing under FSDP (its policy casts)."""
    if config.world_size == 1 and config.dtype == "bfloat16":
        return torch.autocast(device, dtype=torch.bfloat16)
    return nullcontext()


def _warm_up(model: Transformer, optimizer: torch.optim.Optimizer, seq_len: int, device: str) -> None:
    """Bring the model to the state of every step after the first: AdamW moments exist, RoPE tables are built.

    Under FSDP this also fills DTensor's sharding-propagation cache: on a miss, DTensor builds global-size tensors
    in the active FakeTensorMode to infer output shapes, which the tracker would count as memory (they are not)."""
    for p in model.parameters():
        if p.requires_grad:
            p.grad = torch.zeros_like(p)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    model.rope(seq_len, 0, torch.device(device))


def _training_step(model: Transformer, optimizer: torch.optim.Optimizer, input_ids: Tensor, labels: Tensor,
                   autocast: AbstractContextManager, probe: Probe) -> tuple[dict[str, dict[str, int]], str]:
    """One training step as train.py runs it (forward + loss under `autocast`, backward, gradient clipping, AdamW
    step, zero_grad) with `probe` read at each stage.

    Returns ({stage: {"total": bytes, category: bytes, ...}} in time order with the peak of each phase, the loss
    path taken: "standard" or "chunked").
    """
    stages = {"parameters": probe.current()}

    def mark(stage: str):  # forward hook recording the first time a module finishes its forward
        def hook(module: torch.nn.Module, args: object, output: Tensor) -> None:
            stages.setdefault(stage, probe.current())
        return hook

    handles = [model.embed_tokens.register_forward_hook(mark("after embedding")),
               model.layers[0].register_forward_hook(mark("after first layer")),
               model.norm.register_forward_hook(mark("after forward"))]
    try:
        probe.start_phase("forward")
        with autocast:
            output = model(input_ids, labels=labels)
        loss, loss_path = output.loss, "standard" if output.logits is not None else "chunked"
        del output  # the logits of the standard path are not kept
        stages["after loss"] = probe.current()
        stages["peak during forward"] = probe.phase_peak()
        probe.start_phase("backward")
        loss.backward()
        del loss
        stages["peak during backward"] = probe.phase_peak()
        stages["after backward"] = probe.current()
        probe.start_phase("optimizer step")
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        stages["after optimizer step"] = probe.current()
        stages["peak during optimizer step"] = probe.phase_peak()
        optimizer.zero_grad(set_to_none=True)
    finally:
        for handle in handles:
            handle.remove()
    return stages, loss_path


def profile_step(config: StepConfig, device: str = "cpu", fake: bool = True, stand_in: bool = True) -> dict:
    """Memory of one steady-state training step of `config` at every stage, per rank: {"stages": {stage: {"total",
    category: bytes}}, "loss_path": "standard" | "chunked", "num_parameters": int, "stand_in": description}.

    device "cpu" with fake=True is the estimate; fake=False runs the step for real (tiny models only). On "cuda"
    with fake=False the memory comes from torch.cuda statistics (totals only), otherwise from the trackers.
    `stand_in` (fake only): enter the attention type's `memory_stand_in` around the step (NSA: a memory double of
    its attention calibrated on the real function, nsa/memory.py); without it every operator runs as in training.
    """
    with warnings.catch_warnings(), fake_process_group(config.world_size):
        for message in _HARMLESS_WARNINGS:
            warnings.filterwarnings("ignore", message=message)
        # The mesh is made outside FakeTensorMode: it reads its rank map.
        mesh = init_device_mesh(device, (config.world_size,)) if config.world_size > 1 else None
        with FakeTensorMode() if fake else nullcontext(), ExitStack() as stack:
            description = f"{config.attention_type} attention: runs as in training (no stand-in)"
            if fake and stand_in:
                cls = attention_class(config.attention_type)
                description = stack.enter_context(cls.memory_stand_in(
                    config.model_config(), config.compute_config(), config.batch_size, config.context_length,
                    DTYPES[config.dtype], device))
            B, T = config.batch_size, config.context_length
            model, optimizer = build(config, device, mesh)
            _warm_up(model, optimizer, T, device)
            input_ids = torch.randint(0, model.config.vocab_size, (B, T), device=device)  # (B, T)
            labels = torch.randint(0, model.config.vocab_size, (B, T), device=device)  # (B, T)
            if device == "cuda" and not fake:
                probe: Probe = _CudaStats()
            else:
                probe = _Tracked(model, optimizer, (input_ids, labels))
            with probe:
                stages, loss_path = _training_step(model, optimizer, input_ids, labels, _autocast(config, device),
                                                   probe)
            return {"stages": stages, "loss_path": loss_path, "num_parameters": model.num_parameters(),
                    "stand_in": description}


def _summarize(config: StepConfig, profile: dict, seconds: float, method: str) -> dict:
    stages = profile["stages"]
    phase = max(PHASES, key=lambda p: stages[f"peak during {p}"]["total"])
    return {
        "config": dataclasses.asdict(config),
        "num_parameters": profile["num_parameters"],
        "loss_path": profile["loss_path"],
        "method": method,
        "stand_in": profile["stand_in"],
        "units": "bytes",
        "stages": stages,
        "peak": {"phase": phase, **stages[f"peak during {phase}"]},
        "seconds": round(seconds, 2),
    }


def estimate(config: StepConfig) -> dict:
    """Estimated per-rank memory of one training step of `config`, on the CPU with fake tensors.

    Returns a JSON-ready dict: "config", "num_parameters", "loss_path" ("standard" | "chunked"), "method",
    "stand_in", "stages" {stage: {"total", "parameters", "gradients", "optimizer", "activations", "temporaries"}} in
    bytes and in time order, "peak" (the highest phase peak, with "phase"), "seconds". Can be called repeatedly.
    """
    start = time.perf_counter()
    profile = profile_step(config, "cpu", fake=True)
    method = "estimate: fake tensors on CPU, memtrack.LiveBytesTracker"
    return _summarize(config, profile, time.perf_counter() - start, method)


def measure(config: StepConfig) -> dict:
    """The same step run for real on the current CUDA device, from torch.cuda memory statistics (totals only)."""
    if not torch.cuda.is_available():
        raise ValueError("--measure needs a CUDA device; without one, use the estimate alone")
    start = time.perf_counter()
    profile = profile_step(config, "cuda", fake=False)
    return _summarize(config, profile, time.perf_counter() - start, "measured: torch.cuda.memory_allocated")


# ---- will it fit? -----------------------------------------------------------------------------------------------

def _cheaper_steps(config: StepConfig, result: dict) -> Iterator[tuple[str, StepConfig]]:
    """Changes that lower memory, cheapest first, each on top of the previous ones: chunked loss (almost free),
    checkpointing (~1/3 more compute), a tiled FFN (one more FFN forward), activation offload (host memory and
    PCIe traffic, overlapped with compute), more GPUs (shards parameters, gradients
    and optimizer state), a smaller batch (fewer tokens per step unless accumulated), a shorter context (changes the
    task)."""
    if result["loss_path"] == "standard":
        config = dataclasses.replace(config, loss="chunked")
        yield "--loss chunked", config
    if not config.gradient_checkpointing:
        config = dataclasses.replace(config, gradient_checkpointing=True)
        yield "--gradient_checkpointing", config
    if config.ffn_chunk_size is None and config.context_length > TILED_FFN_CHUNK:
        config = dataclasses.replace(config, ffn_chunk_size=TILED_FFN_CHUNK)
        yield f"--ffn_chunk_size {TILED_FFN_CHUNK}", config
    if not config.offload_activations:
        config = dataclasses.replace(config, offload_activations=True)
        yield "--offload_activations", config
    for _ in range(6):
        config = dataclasses.replace(config, world_size=config.world_size * 2)
        yield f"--world_size {config.world_size}", config
    while config.batch_size > 1:
        config = dataclasses.replace(config, batch_size=config.batch_size // 2)
        yield f"--batch_size {config.batch_size}", config
    while config.context_length > 1024:
        config = dataclasses.replace(config, context_length=config.context_length // 2)
        yield f"--context_length {config.context_length}", config


def check_fit(result: dict, gpu_memory_gib: float, reserve_gib: float = 2.0, log=print) -> dict:
    """Whether the step of `result` fits a GPU of `gpu_memory_gib` GiB, keeping `reserve_gib` for what the tracker
    does not see. If not, re-run the estimate along `_cheaper_steps` until it fits and report the changes."""
    budget = (gpu_memory_gib - reserve_gib) * GiB
    report = {"gpu_memory_gib": gpu_memory_gib, "reserve_gib": reserve_gib, "fits": result["peak"]["total"] <= budget,
              "margin_gib": (budget - result["peak"]["total"]) / GiB, "changes": [], "fitting_config": None}
    if report["fits"]:
        return report
    config, current = StepConfig(**result["config"]), result
    for flag, candidate in _cheaper_steps(config, result):
        if candidate.world_size > current["config"]["world_size"]:
            # Sharding more only shrinks parameters, gradients and optimizer state: skip when the rest cannot fit.
            unshardable = current["peak"]["total"] - sum(current["peak"][k] for k in CATEGORIES[:3])
            if unshardable > budget:
                report["changes"].append(flag)
                continue
        report["changes"].append(flag)
        current = estimate(candidate)
        log(f"  trying {' '.join(report['changes'])}: peak {current['peak']['total'] / GiB:.2f} GiB")
        if current["peak"]["total"] <= budget:
            report["fitting_config"] = current["config"]
            report["fitting_peak_gib"] = current["peak"]["total"] / GiB
            return report
    return report


# ---- output -------------------------------------------------------------------------------------------------------

def _unit(result: dict) -> tuple[str, int]:
    """GiB, or MiB for toy models whose peak is under 1 GiB."""
    return ("GiB", GiB) if result["peak"]["total"] >= GiB else ("MiB", 1024**2)


def format_table(result: dict, measured: dict | None = None) -> str:
    """Aligned per-stage table in GiB (MiB for toy models); with `measured`, its totals in an extra column."""
    unit_name, unit = _unit(result)
    host = any(values.get("host") for values in result["stages"].values())
    columns = ["total", *(["measured"] if measured else []), *CATEGORIES, *(["host"] if host else [])]
    width = max(len(s) for s in result["stages"]) + 2
    lines = [f"{'stage':<{width}}" + "".join(f"{c:>13}" for c in columns)]
    rows = [*result["stages"].items(), (f"peak ({result['peak']['phase']})", result["peak"])]
    for stage, values in rows:
        cells = []
        for column in columns:
            if column == "measured":
                value = measured["peak"] if stage.startswith("peak (") else measured["stages"][stage]
                nbytes = value["total"]
            else:
                nbytes = values.get(column, 0)
            cells.append(f"{nbytes / unit:13.2f}")
        lines.append(f"{stage:<{width}}" + "".join(cells))
    return "\n".join(lines)


def report_text(result: dict, measured: dict | None = None, fit: dict | None = None) -> str:
    config = StepConfig(**result["config"])
    n = result["num_parameters"]
    size = f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"
    lines = [f"Memory per rank ({_unit(result)[0]}) of one training step: {config.describe()}",
             f"{size} parameters, {result['loss_path']} loss, AdamW; {result['method']} ({result['seconds']:.0f} s)",
             f"Stand-in: {result['stand_in']}",
             "", format_table(result, measured), ""]
    if fit is not None:
        peak = result["peak"]["total"] / GiB
        verdict = "fits" if fit["fits"] else "does NOT fit"
        lines.append(f"{verdict} on a {fit['gpu_memory_gib']:g} GiB GPU: peak {peak:.2f} GiB + {fit['reserve_gib']:g} "
                     f"GiB reserve (CUDA context, NCCL, fragmentation); margin {fit['margin_gib']:+.2f} GiB")
        if not fit["fits"]:
            if fit["fitting_config"]:
                lines.append(f"cheapest change that fits: {' '.join(fit['changes'])} (peak "
                             f"{fit['fitting_peak_gib']:.2f} GiB)")
            else:
                lines.append(f"nothing tried fits (tried {' '.join(fit['changes'])})")
    lines.append("Not included: CUDA context, NCCL buffers, allocator fragmentation, kernel workspaces.")
    return "\n".join(lines)


def plot(result: dict, path: str) -> None:
    """Stacked bar chart of the categories at each stage, saved to `path` (needs matplotlib: the `plot` extra)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise SystemExit("--plot needs matplotlib: pip install matplotlib (or the project's `plot` extra)") from e
    stages = list(result["stages"])
    fig, ax = plt.subplots(figsize=(10, 5))
    bottom = [0.0] * len(stages)
    for category in CATEGORIES:
        heights = [result["stages"][s][category] / GiB for s in stages]
        ax.bar(stages, heights, bottom=bottom, label=category)
        bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
    ax.set_ylabel("GiB per rank")
    ax.set_title(StepConfig(**result["config"]).describe(), fontsize=9)
    ax.legend()
    plt.setp(ax.get_xticklabels(), rotation=30, ha="right")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model_size", default="4B", choices=sorted(PRESETS))
    p.add_argument("--context_length", type=int, default=4096, help="tokens per sequence")
    p.add_argument("--attention_type", default="full", choices=sorted(ATTENTION_TYPES))
    p.add_argument("--batch_size", type=int, default=1, help="sequences per rank")
    p.add_argument("--world_size", type=int, default=1, help="FSDP2 ranks; numbers are per rank")
    p.add_argument("--gradient_checkpointing", action="store_true", help="recompute each block in backward")
    p.add_argument("--loss", default="auto", choices=["auto", "standard", "chunked"])
    p.add_argument("--ffn_chunk_size", type=int, default=None, help="tokens per FFN tile (tiled MLP); default untiled")
    p.add_argument("--query_chunk", type=int, default=512, help="queries an attention processes at a time (NSA)")
    p.add_argument("--finetune", default="full", choices=["full", "lora", "npt"],
                   help="on a frozen base, lora: train.py's LoRA adapters (rank 16 on q, k, v, o); npt: its "
                        "neuro-plastic layers (rank 16, upper half)")
    p.add_argument("--quantize_base", default=None, choices=PROFILED_QUANTIZED,
                   help="with --finetune lora: the frozen block linear layers quantized (train.py --quantize_base)")
    p.add_argument("--offload_activations", action="store_true",
                   help="keep the tensors blocks save for backward in host memory (with checkpointing: the inputs)")
    p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES), help="compute dtype (master weights fp32)")
    p.add_argument("--gpu_memory", type=float, default=None, help="GiB per GPU: say whether it fits, else what would")
    p.add_argument("--reserve", type=float, default=2.0, help="GiB of the GPU kept for what the tracker cannot see")
    p.add_argument("--measure", action="store_true", help="also run the step for real on CUDA and print both")
    p.add_argument("--json", action="store_true", help="print the result as JSON (bytes)")
    p.add_argument("--plot", metavar="FILE.png", default=None, help="save a stacked bar chart (needs matplotlib)")
    return p


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.gpu_memory is not None and not 0 <= args.reserve < args.gpu_memory:
        parser.error(f"--reserve must be in [0, --gpu_memory), got {args.reserve} and {args.gpu_memory}")
    if args.plot and not os.path.isdir(os.path.dirname(os.path.abspath(args.plot))):
        parser.error(f"--plot {args.plot}: directory {os.path.dirname(os.path.abspath(args.plot))} does not exist")
    try:
        config = StepConfig(args.model_size, args.context_length, args.attention_type, args.batch_size,
                            args.world_size, args.gradient_checkpointing, args.loss, args.dtype, args.ffn_chunk_size,
                            args.query_chunk, args.offload_activations, args.finetune, args.quantize_base)
    except ValueError as e:
        parser.error(str(e))
    if args.measure and not torch.cuda.is_available():
        parser.error("--measure needs a CUDA device")
    result = estimate(config)
    measured = measure(config) if args.measure else None
    log = (lambda msg: print(msg, file=sys.stderr)) if args.json else print
    fit = check_fit(result, args.gpu_memory, args.reserve, log) if args.gpu_memory is not None else None
    if args.plot:
        plot(result, args.plot)
    if args.json:
        print(json.dumps({**result, "measured": measured, "fit": fit}, indent=2))
    else:
        print(report_text(result, measured, fit))


if __name__ == "__main__":
    main()
