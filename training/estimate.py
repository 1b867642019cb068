"""The engine of profile_memory.py: memory of one training step, per GPU, stage by stage, estimated on a CPU.

How (`estimate`): the model and optimizer are built by train.py's own builders (`trainer.build_model`,
`trainer.build_optimizer`, from the `TrainConfig` a run with these options would have) under `FakeTensorMode`, so
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
(hours at 131k tokens under fake tensors), is a memory double calibrated on the real function (nsa/memory_stand_in.py).
Under fake tensors RoPE rotates one chunk of positions instead of all (layers._rotate: same peak, far fewer
operators), which keeps the 4B / 131k / NSA estimate to seconds. Not seen by the tracker: the CUDA context
(~0.5-1 GiB), NCCL buffers, allocator rounding and fragmentation, workspaces inside single kernels; `--reserve`
(GiB) keeps room for them when judging the fit.

`--measure` (CUDA only) runs the same step for real on the GPU, reads torch.cuda memory statistics at the same
stages and prints them beside the estimate (with the fake process group, `--world_size N` measures one of N ranks on
a single GPU). With `--nsa_exact_selection_steps`, whose first steps take another attention path, a step of each
kind is estimated and the one of the larger peak shown (and measured).

Categories: parameters (weights, unsharded compute copies, all-gather buffers, buffers), gradients (`.grad`, with
reduce-scatter buffers), optimizer (AdamW moments, and what gradient clipping and the step make), activations (made
in forward, including the inputs and what is saved for backward), temporaries (made in backward: activation
gradients, recomputation). With `--offload_activations`, "host" is the host memory holding offloaded activations,
not part of the total. Sizes are bytes in the returned dicts, GiB in the table (MiB for toy models).

Notation: B batch, T tokens per sequence, H query heads, D head dimension, Q NSA query chunk.
"""

from __future__ import annotations

import dataclasses
import textwrap
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed._tools.fake_collectives  # noqa: F401  (fake c10d collectives: FSDP under FakeTensorMode)
from torch import Tensor
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.testing._internal.distributed.fake_pg import FakeStore

from model import Transformer
from modeling.config import ComputeConfig, GiB, ModelConfig, attention_class
from modeling.memtrack import CATEGORIES, HOST, PHASE_CATEGORIES, LiveBytesTracker, track_training_step
from modeling.offload import simulated
from modeling.shard import SequenceShard
from nsa.primitive import exact_block_scores
from storage.weights import stored_config
from text.tokenizer import load_tokenizer
from training import parallel, trainer
from training.modes import finetune_mode, settle_mode
from training.options import (
    DEFAULT_DATA_DIR,
    TOKENIZER_VOCAB,
    TrainConfig,
    build_model_config,
    resolve_config,
)

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}  # as train.py
PHASES = ("forward", "backward", "optimizer step")
PROFILED_QUANTIZED = ("int8", "nf4")  # --quantize_base kinds whose layout is the same on every device
MAX_CONTEXT = 2**22  # tokens per sequence the estimate accepts (4M: 1024 loss chunks of 4096)
MAX_LAYERS = 512  # layers the estimate runs (each costs about a second at 131k tokens)
MAX_WORLD_SIZE = 1024  # FSDP2 ranks the estimate accepts (its cost grows with the ranks: 1024 take about 30 s)
_HARMLESS_WARNINGS = ("DTensor random operators may not have complete support on cpu device mesh",
                      "FSDP2-wrapped module .* returned a view tensor")


@dataclass(frozen=True)
class StepConfig:
    """One training step to profile: train.py's options (`train`, resolved as on a GPU: "auto" values become what
    train.py picks on CUDA) and the number of FSDP2 ranks. `gpu_memory_gib`: the GPU the run would have, which
    decides train.py's automatic activation offload (None: never automatic)."""

    train: TrainConfig
    world_size: int = 1
    gpu_memory_gib: float | None = None

    @classmethod
    def of(cls, world_size: int = 1, gpu_memory_gib: float | None = None, **options: object) -> StepConfig:
        """From train.py options, e.g. `StepConfig.of(model_size="4B", context_length=131072, world_size=2)`."""
        cfg = settle_mode(resolve_config(TrainConfig(**options), torch.device("cuda"), log=_quiet), options)
        return cls(cfg, world_size, gpu_memory_gib)

    def __post_init__(self) -> None:
        cfg = self.train
        if (not isinstance(self.world_size, int) or isinstance(self.world_size, bool)
                or not 1 <= self.world_size <= MAX_WORLD_SIZE):
            raise ValueError(f"--world_size must be an integer in [1, {MAX_WORLD_SIZE}] (the ranks FSDP2 shards over; "
                             f"the estimate's cost grows with them), got {self.world_size!r}")
        if not cfg.context_length * (cfg.batch_size or 1) <= MAX_CONTEXT:
            raise ValueError(f"--batch_size x --context_length must be at most {MAX_CONTEXT:,} tokens per rank "
                             f"(more would loop over more than {MAX_CONTEXT // 4096:,} loss chunks under fake "
                             f"tensors), got {cfg.batch_size or 1} x {cfg.context_length:,}")
        if cfg.quantize_base not in (None, *PROFILED_QUANTIZED):
            raise ValueError(f"--quantize_base {cfg.quantize_base}: profiled are {', '.join(PROFILED_QUANTIZED)} "
                             "(int4's layout depends on the device: measure it with train.py)")
        finetune_mode(cfg).check(self.world_size)
        if self.world_size % cfg.context_parallel:
            raise ValueError(f"--world_size {self.world_size} must be a multiple of --context_parallel "
                             f"{cfg.context_parallel} (the ranks form groups that split each sequence): pass "
                             f"--world_size {cfg.context_parallel} or a multiple of it")
        if (layers := self.configs()[0].n_layers) > MAX_LAYERS:  # the architecture and compute settings are valid
            raise ValueError(f"--model_overrides n_layers {layers}: the estimate runs every layer under fake tensors, "
                             f"at most {MAX_LAYERS}")

    def configs(self) -> tuple[ModelConfig, ComputeConfig]:
        """(ModelConfig, ComputeConfig) exactly as train.py builds them for this run (train_config.
        build_model_config): the preset or the --init_from architecture, the vocabulary of the tokenizer the run
        would use, and the long-context choices (chunked loss, tiled FFN, offload) where "auto" asks for them.
        The output layer runs on every row (the profile's labels are all targets; --answer_loss data has fewer,
        so this is its upper bound, and a data-dependent row count cannot be traced on fake tensors)."""
        cfg = self.train
        stored = stored_config(cfg.init_from) if cfg.init_from else None
        memory = int(self.gpu_memory_gib * GiB) if self.gpu_memory_gib else None
        model_config, compute = build_model_config(cfg, tokenizer_vocab(cfg), memory, self.world_size, stored)
        return model_config, dataclasses.replace(compute, loss_rows="all")

    def replace(self, world_size: int | None = None, **options: object) -> StepConfig:
        """This step with some train.py options (or the world size) changed."""
        return StepConfig(dataclasses.replace(self.train, **options), world_size or self.world_size,
                          self.gpu_memory_gib)

    def to_dict(self) -> dict:
        return {"train": dataclasses.asdict(self.train), "world_size": self.world_size,
                "gpu_memory_gib": self.gpu_memory_gib}

    @classmethod
    def from_dict(cls, values: dict) -> StepConfig:
        return cls(TrainConfig(**values["train"]), values["world_size"], values["gpu_memory_gib"])

    def describe(self) -> str:
        cfg, (model, compute) = self.train, self.configs()
        mode = finetune_mode(cfg)
        N = cfg.context_parallel
        tokens = f"{cfg.context_length} tokens per rank" if N == 1 else (
            f"{cfg.context_length} tokens per sequence, {cfg.context_length // N} per rank (context parallel {N})")
        return (f"{cfg.model_size if not cfg.init_from else cfg.init_from}, {cfg.batch_size} x {tokens}, "
                f"{model.attention_type} attention, world size {self.world_size}, {cfg.dtype} "
                f"compute, checkpointing {'on' if cfg.gradient_checkpointing else 'off'}"
                + (f", FFN tiles of {compute.ffn_chunk_size}" if compute.ffn_chunk_size else "")
                + (", activations offloaded to host memory" if compute.offload_activations else "")
                + (f", {mode.description}" if mode.description else "")
                + (f" ({cfg.quantize_base})" if cfg.quantize_base else ""))


def _quiet(message: str) -> None:
    """resolve_config's notes are about a training run, not about this estimate."""


def tokenizer_vocab(cfg: TrainConfig) -> int:
    """The vocabulary of the tokenizer train.py would use: --tokenizer, DATA_DIR/tokenizer.model when it exists, or
    the one it trains for the default corpus (TOKENIZER_VOCAB); 0 (the preset's vocabulary) otherwise."""
    path = Path(cfg.tokenizer) if cfg.tokenizer else Path(cfg.data_dir or DEFAULT_DATA_DIR) / "tokenizer.model"
    if path.is_file():
        return load_tokenizer(path).vocab_size
    return TOKENIZER_VOCAB if cfg.data_dir is None and not cfg.init_from else 0


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


def build(config: StepConfig, rt: parallel.Runtime) -> tuple[Transformer, torch.optim.Optimizer]:
    """Model and optimizer built by train.py's own builders (`trainer.build_model`, `trainer.build_optimizer`) for the
    run `config` describes, on the process layout `rt`: with a mesh, on the meta device, sharded by FSDP2 (bf16
    compute copies of fp32 master weights, summed float32 gradient reduction) and materialised on its device;
    without, fp32 on its device (forward then runs under autocast, see `_autocast`)."""
    cfg = config.train
    model = trainer.build_model(*config.configs(), cfg, rt)
    finetune_mode(cfg).initialise(model, cfg.seed)
    return model, trainer.build_optimizer(model, cfg)[0]


def _autocast(config: StepConfig, device: str) -> AbstractContextManager:
    """train.py's forward context: bf16 autocast in a single process, nothing under FSDP (its policy casts)."""
    if config.world_size == 1 and config.train.dtype == "bfloat16":
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
                   autocast: AbstractContextManager, probe: Probe, progress: Callable[[str], None] = _quiet,
                   doc_start: Tensor | None = None, shard: SequenceShard | None = None
                   ) -> tuple[dict[str, dict[str, int]], str]:
    """One training step as train.py runs it (forward + loss under `autocast`, backward, gradient clipping, AdamW
    step, zero_grad) with `probe` read at each stage; `progress` is called with each phase's name as it starts.
    `doc_start` (B, T): the document starts of --document_mask (under fake tensors their values are unknown: full
    attention allocates the same for any split, NSA is measured with one document a row, in one call; real rows
    in one call add up to nsa.layer.PACKED_LENGTH - 1 of the compressed keys and the selection-block tables).
    `shard`: the rank's part of the sequence under context parallelism (input_ids, labels and doc_start are its
    positions).

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
        progress("forward")
        probe.start_phase("forward")
        with autocast:
            output = model(input_ids, labels=labels, doc_start=doc_start, **({"shard": shard} if shard else {}))
        loss, loss_path = output.loss, "standard" if output.logits is not None else "chunked"
        del output  # the logits of the standard path are not kept
        stages["after loss"] = probe.current()
        stages["peak during forward"] = probe.phase_peak()
        progress("backward")
        probe.start_phase("backward")
        loss.backward()
        del loss
        stages["peak during backward"] = probe.phase_peak()
        stages["after backward"] = probe.current()
        progress("optimizer step")
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


def profile_step(config: StepConfig, device: str = "cpu", fake: bool = True, stand_in: bool = True,
                 progress: Callable[[str], None] = _quiet) -> dict:
    """Memory of one steady-state training step of `config` at every stage, per rank: {"stages": {stage: {"total",
    category: bytes}}, "loss_path": "standard" | "chunked", "num_parameters": int, "stand_in": description}.

    device "cpu" with fake=True is the estimate; fake=False runs the step for real (tiny models only). On "cuda"
    with fake=False the memory comes from torch.cuda statistics (totals only), otherwise from the trackers.
    `stand_in` (fake only): enter the attention type's `memory_stand_in` around the step (NSA: a memory double of
    its attention calibrated on the real function, nsa/memory_stand_in.py); without it every operator runs as in
    training.
    `progress` is called with the name of each part as it starts.
    """
    with warnings.catch_warnings(), fake_process_group(config.world_size):
        for message in _HARMLESS_WARNINGS:
            warnings.filterwarnings("ignore", message=message)
        N = config.train.context_parallel
        # The mesh is made outside FakeTensorMode: it reads its rank map.
        mesh, group = parallel.build_mesh(device, config.world_size, N) if config.world_size > 1 else (None, None)
        rt = parallel.Runtime(0, config.world_size, torch.device(device), mesh, N, group)
        traffic = parallel.Traffic()
        with FakeTensorMode() if fake else nullcontext(), ExitStack() as stack:
            model_config, compute = config.configs()
            B, T = config.train.batch_size, config.train.context_length
            # Rank 0 holds the first and the last chunk. Full attention on gathered keys and values, also where
            # training runs PyTorch's ring (CUDA), which holds less: a chunk pair's keys in place of the sequence's.
            shard = parallel.context_shard(rt, T, traffic, ring=False)
            description = f"{model_config.attention_type} attention: runs as in training (no stand-in)"
            if fake and stand_in:
                progress(f"calibrating the {model_config.attention_type} attention's stand-in")
                cls = attention_class(model_config.attention_type)
                description = stack.enter_context(cls.memory_stand_in(
                    model_config, compute, B, T, DTYPES[config.train.dtype], device,
                    **({"spans": shard.spans} if shard else {})))
            progress("building the model and optimizer")
            model, optimizer = build(config, rt)
            _warm_up(model, optimizer, T, device)
            t = T // N  # the rank's tokens of each sequence
            input_ids = torch.randint(0, model.config.vocab_size, (B, t), device=device)  # (B, t)
            labels = torch.randint(0, model.config.vocab_size, (B, t), device=device)  # (B, t)
            if device == "cuda" and not fake:
                probe: Probe = _CudaStats()
            else:
                probe = _Tracked(model, optimizer, (input_ids, labels))
            with probe:
                starts = torch.zeros(B, t, dtype=torch.long, device=device) if config.train.document_mask else None
                stages, loss_path = _training_step(model, optimizer, input_ids, labels, _autocast(config, device),
                                                   probe, progress, starts, shard)
            return {"stages": stages, "loss_path": loss_path, "num_parameters": model.num_parameters(),
                    "stand_in": description, **({"traffic": dataclasses.asdict(traffic)} if shard else {})}


def _summarize(config: StepConfig, profile: dict, seconds: float, method: str) -> dict:
    stages = profile["stages"]
    phase = max(PHASES, key=lambda p: stages[f"peak during {p}"]["total"])
    return {
        "config": config.to_dict(),
        "num_parameters": profile["num_parameters"],
        "loss_path": profile["loss_path"],
        "method": method,
        "stand_in": profile["stand_in"],
        "units": "bytes",
        "stages": stages,
        "peak": {"phase": phase, **stages[f"peak during {phase}"]},
        "seconds": round(seconds, 2),
        **({"traffic": profile["traffic"]} if "traffic" in profile else {}),
        **({"warm_up": profile["warm_up"]} if "warm_up" in profile else {}),
    }


def estimate(config: StepConfig, progress: Callable[[str], None] = _quiet) -> dict:
    """Estimated per-rank memory of one training step of `config`, on the CPU with fake tensors (`progress`: see
    `profile_step`).

    Returns a JSON-ready dict: "config", "num_parameters", "loss_path" ("standard" | "chunked"), "method",
    "stand_in", "stages" {stage: {"total", "parameters", "gradients", "optimizer", "activations", "temporaries"}} in
    bytes and in time order, "peak" (the highest phase peak, with "phase"), "seconds". Can be called repeatedly.
    With --nsa_exact_selection_steps K, two steps are profiled: one of the first K (NSA selecting by exact block
    scores) and a later one; the result is the one of the larger peak, with "warm_up" {"steps": K, "peak",
    "later_peak", "phase_peaks": {phase: the larger of the two steps'}} (bytes).
    """
    start = time.perf_counter()
    profile = profile_step(config, "cpu", fake=True, progress=progress)
    steps = config.train.nsa_exact_selection_steps
    if steps:  # NSA's first steps select by exact block scores, chunk by chunk: another path, its own memory
        progress(f"the first {steps} steps (--nsa_exact_selection_steps)")
        with exact_block_scores():
            first = profile_step(config, "cpu", fake=True, progress=progress)
        peaks = [{phase: p["stages"][f"peak during {phase}"]["total"] for phase in PHASES} for p in (first, profile)]
        warm_up = {"steps": steps, "peak": max(peaks[0].values()), "later_peak": max(peaks[1].values()),
                   "phase_peaks": {phase: max(peaks[0][phase], peaks[1][phase]) for phase in PHASES}}
        profile = {**(first if warm_up["peak"] >= warm_up["later_peak"] else profile), "warm_up": warm_up}
    method = "estimated on this CPU without allocating (fake tensors, every live byte counted)"
    return _summarize(config, profile, time.perf_counter() - start, method)


def warm_up_step(result: dict) -> bool:
    """Whether the estimate `result` is of a step of --nsa_exact_selection_steps (its peak the larger)."""
    warm_up = result.get("warm_up")
    return bool(warm_up) and warm_up["peak"] >= warm_up["later_peak"]


def measure(config: StepConfig, exact: bool = False) -> dict:
    """The same step run for real on the current CUDA device, from torch.cuda memory statistics (totals only);
    `exact`: a step of --nsa_exact_selection_steps (`warm_up_step` of the estimate)."""
    if not torch.cuda.is_available():
        raise ValueError("--measure needs a CUDA device; without one, use the estimate alone")
    start = time.perf_counter()
    with exact_block_scores() if exact else nullcontext():
        profile = profile_step(config, "cuda", fake=False)
    return _summarize(config, profile, time.perf_counter() - start, "measured: torch.cuda.memory_allocated")


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
    config = StepConfig.from_dict(result["config"])
    n = result["num_parameters"]
    size = f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"
    lines = [f"Memory per rank ({_unit(result)[0]}) of one training step: {config.describe()}",
             f"{size} parameters, {result['loss_path']} loss, AdamW; {result['method']} ({result['seconds']:.0f} s)",
             f"Attention counted as: {result['stand_in']}",
             "", format_table(result, measured), ""]
    if traffic := result.get("traffic"):
        N, layers = config.train.context_parallel, config.configs()[0].n_layers
        sent, (name, unit) = traffic["gathered"] + traffic["scattered"], _unit(result)
        lines.append(f"Context parallelism ({N} ranks a sequence, keys and values all-gathered): this rank sends "
                     f"{sent / unit:.2f} {name} a step, {sent / layers / unit:.3f} {name} a layer: "
                     f"{traffic['gathers']} all-gathers in forward and recomputation ({traffic['gathered'] / unit:.2f} "
                     f"{name}), {traffic['scatters']} reduce-scatters of their gradients in backward "
                     f"({traffic['scattered'] / unit:.2f} {name}); counted as a ring sends them, N - 1 times its part")
    if config.train.answer_loss:
        lines.append("--answer_loss: the output layer is counted on every row, its upper bound (which rows carry a "
                     "target depends on the data)")
    if warm_up := result.get("warm_up"):
        (name, unit), first = _unit(result), warm_up["peak"] >= warm_up["later_peak"]
        lines.append(f"The table is the step {'during' if first else 'after'} the first {warm_up['steps']} steps "
                     f"(--nsa_exact_selection_steps: selection by exact block scores), the larger: peak "
                     f"{warm_up['peak'] / unit:.2f} {name} during them, {warm_up['later_peak'] / unit:.2f} {name} "
                     "after")
    if fit is not None:
        peak = result["peak"]["total"] / GiB
        verdict = "fits" if fit["fits"] else "does NOT fit"
        lines.append(f"{verdict} on a {fit['gpu_memory_gib']:g} GiB GPU: peak {peak:.2f} GiB + {fit['reserve_gib']:g} "
                     f"GiB reserve (CUDA context, NCCL, fragmentation); margin {fit['margin_gib']:+.2f} GiB")
        if not fit["fits"]:
            if fit["fitting_config"]:
                lines.append(f"cheapest change that fits: {' '.join(fit['change'])} (peak "
                             f"{fit['fitting_peak_gib']:.2f} GiB, {fit['how']})")
            else:
                lines.append(f"nothing tried fits (tried {'; '.join(fit['tried'])})")
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
    ax.set_title(textwrap.fill(StepConfig.from_dict(result["config"]).describe(), 110), fontsize=9)
    ax.legend()
    plt.setp(ax.get_xticklabels(), rotation=30, ha="right")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
