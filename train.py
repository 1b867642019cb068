"""Pretrain the decoder on packed token windows, on one CPU/GPU or sharded with FSDP2 under torchrun.

    python train.py                                               # CPU demo: small model, a few minutes
    python train.py --config configs/tiny.json --max_steps 50     # file < command line
    torchrun --nproc_per_node=2 train.py --context_length 131072  # 2 GPUs: 4B, NSA, checkpointing, chunked loss

Options are the fields of `TrainConfig` (defaults < `--config` file < command line). Values left at "auto"/None are
resolved by `resolve_config` from the device and the context length; the resolved config is printed and saved as
`out_dir/config.json`. Per step, loss / lr / grad norm / tokens/s / memory (/ MFU on GPU) go to the console and to
`out_dir/metrics.jsonl`; checkpoints go to `out_dir/step-N` (see checkpoint.py); the final weights to
`out_dir/model/` (model.safetensors + config.json) and `out_dir/hf/` for full attention (see weights.py).

Notation: B sequences per rank per micro-step, T context length, A accumulation steps, W world size.
Loss normalisation: every micro-batch's summed token loss is divided by the number of predicted tokens in the
whole step (all A micro-batches on all W ranks), and FSDP sums (not averages) gradients over ranks, so the update
is the gradient of the mean token loss of the global batch, however it is split over ranks and micro-steps.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import math
import os
import random
import resource
import signal
import time
import typing
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor
from torch.optim.lr_scheduler import LambdaLR
from tqdm import tqdm

from checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from config import ATTENTION_TYPES, PRESETS, ComputeConfig, ModelConfig, attention_class, split_overrides
from data import INDEX_NAME, TokenLoader, check_tokenizer, iter_documents, prepare, stdlib_files
from loss import IGNORE_INDEX, shift_labels
from model import Transformer
from parallel import apply_fsdp, init_sharded_weights
from tokenizer import Tokenizer, check_vocab
from weights import export_model, hf_export_refusal

GiB = 1024**3
LONG_CONTEXT = 32768  # from here on, "auto" options resolve to the long-context recipe (see resolve_config)
BATCH_TOKENS = 4096  # auto batch size: max(1, BATCH_TOKENS // T) sequences per micro-batch
TILED_FFN_CHUNK = 8192  # FFN tile from LONG_CONTEXT on: one tile's (T, ffn_dim) intermediates at a time
DEFAULT_DATA_DIR = "data/stdlib"
TOKENIZER_VOCAB = 8192  # vocabulary of the tokenizer trained for the default corpus
# Dense bf16 peak FLOP/s per GPU for the MFU estimate, matched against torch.cuda.get_device_name().
PEAK_BF16_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "B200": 2250e12}


def _opt(default: object, help: str) -> typing.Any:
    """A TrainConfig field with its command-line help."""
    if isinstance(default, dict):
        return field(default_factory=lambda: dict(default), metadata={"help": help})
    return field(default=default, metadata={"help": help})


@dataclass
class TrainConfig:
    """Every training option; `--name value` on the command line, or a key of the `--config` JSON/TOML file."""

    # model
    model_size: str = _opt("auto", f"preset: {', '.join(PRESETS)}; 'auto' = "
                                   f"4B on CUDA from {LONG_CONTEXT} tokens of context, else demo")
    attention_type: str = _opt("auto", f"a registered type (config.ATTENTION_TYPES: 'full', 'nsa', ...) or 'auto' = "
                                       f"nsa from {LONG_CONTEXT} tokens, else full")
    context_length: int = _opt(256, "T: tokens per training sequence")
    model_overrides: dict = _opt({}, "ModelConfig fields over the preset, as JSON, e.g. '{\"n_layers\": 8}'")
    gradient_checkpointing: bool | None = _opt(None, f"recompute blocks in backward (default: on from "
                                                     f"{LONG_CONTEXT} tokens)")
    compile: bool = _opt(False, "torch.compile each block")
    dtype: str = _opt("auto", "'float32' or 'bfloat16' (mixed precision: fp32 master weights, bf16 compute, fp32 "
                              "gradient reduction); 'auto' = bfloat16 on CUDA, float32 on CPU")
    # optimisation
    batch_size: int | None = _opt(None, f"B: sequences per rank per micro-step (default: max(1, {BATCH_TOKENS} // T))")
    gradient_accumulation_steps: int = _opt(1, "A: micro-steps per optimizer step")
    max_steps: int = _opt(300, "optimizer steps")
    lr: float | None = _opt(None, "peak learning rate of AdamW (default: 3e-3 for demo/tiny, 3e-4 for the larger "
                                  "presets)")
    warmup_steps: int = _opt(30, "linear warmup steps, then cosine decay to lr * min_lr_ratio at max_steps")
    min_lr_ratio: float = _opt(0.1, "final learning rate as a fraction of lr")
    weight_decay: float = _opt(0.1, "AdamW weight decay of the matrices (norm weights are not decayed)")
    grad_clip: float = _opt(1.0, "clip the global gradient norm to this (0: no clipping; the norm is still logged)")
    max_bad_steps: int = _opt(5, "stop after this many consecutive steps with a non-finite loss or gradient norm")
    seed: int = _opt(0, "seed of the initialisation, the data order and the sample")
    # data
    data_dir: str = _opt(DEFAULT_DATA_DIR, f"prepared data (data.py); {DEFAULT_DATA_DIR} is created if missing")
    tokenizer: str | None = _opt(None, "tokenizer .model file (default: DATA_DIR/tokenizer.model)")
    # run
    out_dir: str = _opt("runs/train", "run directory: config.json, metrics.jsonl, step-N/, model/, hf/")
    resume: str | None = _opt(None, "'auto' (or no value): newest complete OUT_DIR/step-N; or a step-N path")
    checkpoint_interval: int = _opt(100, "save every this many steps (0: only at the end)")
    log_interval: int = _opt(10, "print a metrics line every this many steps")
    max_memory: float | None = _opt(None, "memory budget in GiB per process (CUDA allocator peak, or RSS on CPU)")
    sample_tokens: int = _opt(200, "tokens to generate from the final model (0: none)")
    sample_prompt: str = _opt("def ", "prompt of the final sample")

    def __post_init__(self) -> None:
        choices = {"model_size": [*PRESETS, "auto"], "attention_type": ["auto", *ATTENTION_TYPES],
                   "dtype": ["auto", "float32", "bfloat16"]}
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"--{name} must be one of {allowed}, got {getattr(self, name)!r}")
        minimum = {"context_length": 2, "batch_size": 1, "gradient_accumulation_steps": 1, "max_steps": 1,
                   "warmup_steps": 0, "max_bad_steps": 1, "checkpoint_interval": 0, "log_interval": 1,
                   "sample_tokens": 0}
        for name, low in minimum.items():
            value = getattr(self, name)
            if value is not None and value < low:
                raise ValueError(f"--{name} must be >= {low}, got {value}")
        for name in ("lr", "max_memory"):
            if getattr(self, name) is not None and not getattr(self, name) > 0:
                raise ValueError(f"--{name} must be positive, got {getattr(self, name)}")
        for name in ("weight_decay", "grad_clip"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"--{name} must be >= 0, got {getattr(self, name)}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"--min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        try:
            split_overrides(self.model_overrides)
        except ValueError as e:
            raise ValueError(f"--model_overrides: {e}") from e


# ---- configuration: defaults < file < command line -----------------------------------------------------------


def _field_type(name: str) -> type:
    """The non-None type of a TrainConfig field (int for `int | None`)."""
    kind = typing.get_type_hints(TrainConfig)[name]
    return next(t for t in typing.get_args(kind) if t is not type(None)) if typing.get_args(kind) else kind


def build_parser() -> argparse.ArgumentParser:
    """Command-line options generated from TrainConfig; options not given are absent from the result."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     argument_default=argparse.SUPPRESS)
    parser.add_argument("--config", help="JSON or TOML file of TrainConfig fields (command-line options win)")
    for f in dataclasses.fields(TrainConfig):
        kind, default = _field_type(f.name), f.default if f.default is not dataclasses.MISSING else {}
        kwargs: dict = {"help": f.metadata["help"] + ("" if default is None else f" (default: {default})")}
        if kind is bool:  # --name / --no-name
            kwargs.update(action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS)
        elif kind is dict:
            kwargs.update(type=json.loads, metavar="JSON")
        else:
            kwargs["type"] = kind
        if f.name == "resume":
            kwargs.update(nargs="?", const="auto")
        parser.add_argument(f"--{f.name}", **kwargs)
    return parser


def load_config_file(path: str) -> dict:
    """TrainConfig fields from a JSON (or, on Python 3.11+, TOML) file, type-checked."""
    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(f"config file {file} does not exist")
    if file.suffix == ".toml":
        try:
            import tomllib
        except ModuleNotFoundError as e:
            raise ValueError(f"{file}: TOML configs need Python 3.11+; use a JSON file") from e
        values = tomllib.loads(file.read_text())
    else:
        values = json.loads(file.read_text())
    if not isinstance(values, dict):
        raise ValueError(f"{file} must hold an object of TrainConfig fields")
    names = {f.name for f in dataclasses.fields(TrainConfig)}
    for key, value in values.items():
        if key not in names:
            raise ValueError(f"{file}: unknown option {key!r}; valid options: {sorted(names)}")
        kind = _field_type(key)
        ok = value is None and type(None) in typing.get_args(typing.get_type_hints(TrainConfig)[key])
        ok = ok or (isinstance(value, kind) and not (kind is int and isinstance(value, bool)))
        ok = ok or (kind is float and isinstance(value, int) and not isinstance(value, bool))
        if not ok:
            raise ValueError(f"{file}: option {key!r} must be {kind.__name__}, got {value!r}")
    return values


def parse_config(argv: list[str] | None = None) -> TrainConfig:
    """TrainConfig from the command line; bad options exit with a usage error naming the option."""
    parser = build_parser()
    args = vars(parser.parse_args(argv))
    try:
        values = load_config_file(args.pop("config")) if "config" in args else {}
        return TrainConfig(**{**values, **args})
    except (ValueError, FileNotFoundError) as e:
        parser.error(str(e))


def resolve_config(cfg: TrainConfig, device: torch.device) -> TrainConfig:
    """Replace "auto"/None by concrete values. From LONG_CONTEXT tokens on, attention is NSA and blocks are
    recomputed in backward; on CUDA the model is then the 4B preset (build_model_config adds the tiled FFN and the
    chunked loss at these lengths). Elsewhere the default model is "demo".
    The learning rate follows the model size; the batch size fills BATCH_TOKENS per micro-step."""
    long = cfg.context_length >= LONG_CONTEXT
    cuda = device.type == "cuda"
    auto = {
        "model_size": "4B" if long and cuda else "demo",
        "attention_type": "nsa" if long else "full",
        "dtype": "bfloat16" if cuda else "float32",
    }
    values = {k: v for k, v in auto.items() if getattr(cfg, k) == "auto"}
    if cfg.lr is None:
        values["lr"] = 3e-3 if values.get("model_size", cfg.model_size) in ("demo", "tiny") else 3e-4
    if cfg.gradient_checkpointing is None:
        values["gradient_checkpointing"] = long
    if cfg.batch_size is None:
        values["batch_size"] = max(1, BATCH_TOKENS // cfg.context_length)
    return dataclasses.replace(cfg, **values)


def build_model_config(cfg: TrainConfig, tokenizer_vocab: int) -> tuple[ModelConfig, ComputeConfig]:
    """The resolved run's (ModelConfig, ComputeConfig): preset, then context length, attention type, a vocabulary
    that covers the tokenizer (the preset's, or the tokenizer's rounded up to 64 when larger) and, from LONG_CONTEXT
    tokens on, a tiled FFN (TILED_FFN_CHUNK tokens per tile) and the chunked loss (at 32k the 10 GiB logits rule of
    loss_mode="auto" would still pick the standard loss, whose float32 copies cost ~47 GiB), then model_overrides."""
    model_overrides, compute_overrides = split_overrides(cfg.model_overrides)
    vocab = max(ModelConfig.from_preset(cfg.model_size).vocab_size, -(-tokenizer_vocab // 64) * 64)
    long = {"ffn_chunk_size": TILED_FFN_CHUNK, "loss_mode": "chunked"} if cfg.context_length >= LONG_CONTEXT else {}
    model_config = ModelConfig.from_preset(cfg.model_size, **{
        "vocab_size": vocab, "context_length": cfg.context_length, "attention_type": cfg.attention_type,
        **model_overrides})
    return model_config, ComputeConfig(**{**long, **compute_overrides})


# ---- runtime: devices, processes, data, model ----------------------------------------------------------------


@dataclass
class Runtime:
    rank: int
    world_size: int
    device: torch.device
    mesh: DeviceMesh | None  # None: one process, no FSDP


def init_runtime() -> Runtime:
    """One process per device; under torchrun (WORLD_SIZE > 1) a process group (NCCL on GPU, gloo on CPU)."""
    rank, world_size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    mesh = None
    if world_size > 1:
        # The loss path returns logits as a view; nothing modifies the model's outputs in place.
        warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
        mesh = init_device_mesh(device.type, (world_size,))
    return Runtime(rank, world_size, device, mesh)


def tokenizer_path(cfg: TrainConfig) -> Path:
    return Path(cfg.tokenizer) if cfg.tokenizer else Path(cfg.data_dir) / "tokenizer.model"


def ensure_default_data(cfg: TrainConfig, rt: Runtime) -> None:
    """Make `python train.py` work out of the box: if DEFAULT_DATA_DIR is selected and empty, train the tokenizer
    and tokenize this interpreter's standard library into it (~20 s). Rank 0 works while the others wait."""
    data_dir = Path(cfg.data_dir)
    if rt.rank == 0 and cfg.data_dir == DEFAULT_DATA_DIR and not (data_dir / INDEX_NAME).exists():
        files = stdlib_files()
        tok_file = tokenizer_path(cfg)
        if tok_file.exists():
            tokenizer = Tokenizer(tok_file)
        else:  # the tokenizer trains on a sample of lines: shuffle the sorted files so it sees all packages
            shuffled = random.Random(0).sample(files, len(files))
            tokenizer = Tokenizer.train(iter_documents(shuffled), TOKENIZER_VOCAB, tok_file.with_suffix(""))
        prepare(files, tokenizer, data_dir)
    if dist.is_initialized():
        dist.barrier()


def build_model(model_config: ModelConfig, compute: ComputeConfig, cfg: TrainConfig, rt: Runtime) -> Transformer:
    """The model on its device, identically initialised from cfg.seed in every process layout. With a mesh: built
    on the meta device, sharded by apply_fsdp (bf16 compute when dtype is bfloat16, float32 reduction), then
    materialised (parallel.init_sharded_weights)."""
    if rt.mesh is None:
        torch.manual_seed(cfg.seed)
        with rt.device:
            model = Transformer(model_config, compute)
    else:
        with torch.device("meta"):
            model = Transformer(model_config, compute)
    model.gradient_checkpointing_enable(cfg.gradient_checkpointing)
    if cfg.compile:
        for block in model.layers:
            block.compile()
    if rt.mesh is not None:
        param_dtype = torch.bfloat16 if cfg.dtype == "bfloat16" else None
        apply_fsdp(model, rt.mesh, param_dtype=param_dtype, reduce_dtype=torch.float32, sum_gradients=True)
        init_sharded_weights(model, rt.device, cfg.seed)
    return model


def build_optimizer(model: Transformer, cfg: TrainConfig) -> tuple[torch.optim.AdamW, LambdaLR]:
    """AdamW (weight decay on matrices only) and the warmup + cosine schedule: lr * lr_factor(step)."""
    params = list(model.parameters())  # tied weights appear once
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8)

    def lr_factor(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        progress = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.max_steps - cfg.warmup_steps))
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return optimizer, LambdaLR(optimizer, lr_factor)


# ---- monitoring ------------------------------------------------------------------------------------------------


def flops_per_token(config: ModelConfig, seq_len: int) -> float:
    """Training FLOPs (forward + backward = 3x forward) per token: 6 x the FFN and output-projection weights
    (the output projection counts even when tied; the embedding lookup is free) plus each layer's attention, as its
    type counts it (`AttentionLayer.flops_per_token`: projections, scores and values over its keys)."""
    c = config
    attention = attention_class(c.attention_type).flops_per_token(c, seq_len)
    return 6 * (c.n_layers * 3 * c.dim * c.ffn_dim + c.vocab_size * c.dim) + c.n_layers * attention


def memory_gib(device: torch.device) -> tuple[float, float]:
    """(current, peak) memory of this process in GiB: CUDA allocator live bytes and their peak since the last
    reset; on CPU the resident set size and its lifetime peak."""
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device) / GiB, torch.cuda.max_memory_allocated(device) / GiB
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GiB  # ru_maxrss is in KiB on Linux
    with contextlib.suppress(OSError), open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / GiB, peak
    return peak, peak


def peak_flops(device: torch.device, dtype: str) -> float | None:
    """Dense peak FLOP/s of this GPU in bf16, None when unknown (CPU, float32, an unlisted GPU)."""
    if device.type != "cuda" or dtype != "bfloat16":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_BF16_FLOPS.items() if k in name), None)


class MemoryBudgetExceeded(RuntimeError):
    pass


class TooManyBadSteps(RuntimeError):
    pass


def memory_advice(cfg: TrainConfig) -> str:
    return (f"reduce --batch_size (now {cfg.batch_size}; raise --gradient_accumulation_steps, now "
            f"{cfg.gradient_accumulation_steps}, to keep the global batch) or --context_length (now "
            f"{cfg.context_length})" + ("" if cfg.gradient_checkpointing else ", or add --gradient_checkpointing"))


def over_memory_budget(cfg: TrainConfig, device: torch.device) -> bool:
    """Free cached memory when the step's peak nears the budget (90%); True if the peak still exceeds it.
    CUDA: the allocator's reserved bytes are released; the budget applies to the peak of live tensors, which is
    then reset for the next step. CPU: garbage collection; the budget applies to the peak RSS."""
    budget = cfg.max_memory * GiB
    if device.type == "cuda":
        if torch.cuda.max_memory_reserved(device) > 0.9 * budget:
            torch.cuda.empty_cache()
        over = torch.cuda.max_memory_allocated(device) > budget
        torch.cuda.reset_peak_memory_stats(device)
        return over
    if memory_gib(device)[0] * GiB > 0.9 * budget:
        gc.collect()
    return memory_gib(device)[1] * GiB > budget


@contextlib.contextmanager
def stop_on_signals() -> Iterator[dict]:
    """SIGTERM / SIGINT set flag["stop"]: the loop finishes the step, saves and returns (exit code 0). Repeated
    signals change nothing (under torchrun, Ctrl-C reaches a worker twice: from the terminal and from torchrun);
    SIGKILL or SIGQUIT (Ctrl-\\) stop at once."""
    flag = {"stop": False}

    def handler(signum: int, frame: object) -> None:
        if not flag["stop"]:
            print(f"\n{signal.Signals(signum).name}: finishing this step, saving a checkpoint, exiting", flush=True)
        flag["stop"] = True

    previous = {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield flag
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


# ---- training --------------------------------------------------------------------------------------------------


def start_run(out_dir: Path, cfg: TrainConfig, model: Transformer, world_size: int, resume_from: Path | None,
              step: int) -> None:
    """Rank 0: print the resolved configuration and save it as out_dir/config.json; on resume, drop the metrics
    lines of steps after the checkpoint (written by the interrupted run)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    resolved = {"train": dataclasses.asdict(cfg), "model": model.config.to_dict(),
                "compute": model.compute.to_dict(), "world_size": world_size,
                "parameters": model.num_parameters()}
    print(json.dumps(resolved, indent=1))
    (out_dir / "config.json").write_text(json.dumps(resolved, indent=1))
    metrics_file = out_dir / "metrics.jsonl"
    if resume_from:
        print(f"resumed from {resume_from} (step {step})")
        if metrics_file.exists():
            lines = metrics_file.read_text().splitlines()
            metrics_file.write_text("".join(f"{ln}\n" for ln in lines if json.loads(ln)["step"] <= step))
    elif cfg.resume == "auto":
        print(f"no checkpoint in {out_dir}: starting from scratch")


def log_step(metrics: dict, cfg: TrainConfig, metrics_file: Path, bar: tqdm) -> None:
    """Rank 0: append the step's metrics to metrics.jsonl, advance the progress bar, print a line every
    log_interval steps (and at the first and last)."""
    with metrics_file.open("a") as f:
        f.write(json.dumps(metrics) + "\n")
    step = metrics["step"]
    bar.set_postfix(loss=f"{metrics['loss']:.4f}", tok_s=f"{metrics['tokens_per_s']:.0f}")
    bar.update()
    if step % cfg.log_interval == 0 or step in (1, cfg.max_steps):
        mfu = f" | mfu {metrics['mfu']:.1%}" if "mfu" in metrics else ""
        tqdm.write(f"step {step:>6}/{cfg.max_steps} | loss {metrics['loss']:.4f} | lr {metrics['lr']:.2e} | grad "
                   f"{metrics['grad_norm']:.3f} | {metrics['tokens_per_s']:,.0f} tok/s | mem {metrics['mem_gib']:.2f}"
                   f" GiB (peak {metrics['mem_peak_gib']:.2f}){mfu}")


def forward_backward(model: Transformer, batches: list[list[torch.Tensor]],
                     autocast: contextlib.AbstractContextManager) -> torch.Tensor:
    """Accumulate into `.grad` the gradient of the global batch's mean token loss, from this rank's micro-batches
    `batches` (A x [input_ids, labels], each (B, T)); return this rank's part of that loss (a 0-dim tensor; the sum
    over ranks is the global mean). Each micro-batch's summed loss is divided by the predicted-token count of the
    whole global batch (one all-reduce); FSDP sums the gradients over ranks (apply_fsdp(sum_gradients=True))."""
    n_tokens = sum((shift_labels(labels) != IGNORE_INDEX).sum() for _, labels in batches)
    if dist.is_initialized():
        dist.all_reduce(n_tokens)
    n_tokens = n_tokens.clamp(min=1).float()
    loss_sum = torch.zeros((), device=n_tokens.device)
    for input_ids, labels in batches:
        with autocast:
            loss = model(input_ids, labels, loss_normalizer=n_tokens).loss
        loss.backward()
        loss_sum += loss.detach()
    return loss_sum


def train(cfg: TrainConfig, rt: Runtime) -> dict:
    """Run (or resume) training as configured; returns the last step's metrics."""
    cfg = resolve_config(cfg, rt.device)
    out_dir = Path(cfg.out_dir)
    ensure_default_data(cfg, rt)
    loader = TokenLoader(cfg.data_dir, cfg.context_length, cfg.batch_size, rt.rank, rt.world_size, cfg.seed)
    tokenizer = Tokenizer(tokenizer_path(cfg))
    check_tokenizer(loader.index, tokenizer)
    model_config, compute = build_model_config(cfg, tokenizer.vocab_size)
    check_vocab(tokenizer, model_config.vocab_size)

    resume_from = latest_checkpoint(out_dir) if cfg.resume == "auto" else cfg.resume and Path(cfg.resume)
    if cfg.resume is None and latest_checkpoint(out_dir) is not None:
        raise FileExistsError(f"{out_dir} already holds checkpoints ({latest_checkpoint(out_dir).name}); pass "
                              "--resume to continue that run, or choose another --out_dir")
    model = build_model(model_config, compute, cfg, rt)
    optimizer, scheduler = build_optimizer(model, cfg)
    step, bad_steps = 0, 0
    if resume_from:
        state = load_checkpoint(resume_from, model, optimizer)
        step, bad_steps = state["step"], state["bad_steps"]
        scheduler.load_state_dict(state["scheduler"])
        loader.load_state_dict(state["loader"])

    W, A, B, T = rt.world_size, cfg.gradient_accumulation_steps, cfg.batch_size, cfg.context_length
    step_tokens = W * A * B * T
    flops, peak = flops_per_token(model_config, T), peak_flops(rt.device, cfg.dtype)
    if rt.device.type == "cuda" and cfg.max_memory:
        total = torch.cuda.get_device_properties(rt.device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, cfg.max_memory * GiB / total), rt.device)
    autocast = (torch.autocast(rt.device.type, dtype=torch.bfloat16) if cfg.dtype == "bfloat16" and rt.mesh is None
                else contextlib.nullcontext())
    main_rank = rt.rank == 0
    metrics_file = out_dir / "metrics.jsonl"
    if main_rank:
        start_run(out_dir, cfg, model, W, resume_from, step)
        print(f"{model.num_parameters() / 1e6:.2f}M parameters, {W} process(es) x {A} micro-steps x {B} x {T} "
              f"= {step_tokens} tokens per step, {flops / 1e9:.3f} GFLOP per token")

    def save(at_step: int) -> Path:
        train_state = {"step": at_step, "bad_steps": bad_steps, "scheduler": scheduler.state_dict(),
                       "loader": loader.state_dict(), "config": dataclasses.asdict(cfg),
                       "model_config": model_config.to_dict(), "compute": compute.to_dict(), "world_size": W}
        return save_checkpoint(out_dir, at_step, model, optimizer, train_state)

    bar = tqdm(total=cfg.max_steps, initial=step, desc="training", unit="step", disable=not main_rank or None,
               dynamic_ncols=True)
    metrics: dict = {}
    with stop_on_signals() as signals:
        while step < cfg.max_steps:
            t0 = time.perf_counter()
            batches = [[t.to(rt.device, non_blocking=True) for t in next(loader)] for _ in range(A)]  # A x 2 x (B, T)
            try:
                loss_sum = forward_backward(model, batches, autocast)
            except torch.OutOfMemoryError as e:
                raise MemoryBudgetExceeded(f"out of memory at step {step + 1}: {memory_advice(cfg)}") from e
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip or math.inf)
            if isinstance(grad_norm, DTensor):
                grad_norm = grad_norm.full_tensor()
            stats = torch.stack([loss_sum, torch.tensor(float(signals["stop"]), device=rt.device)])  # (2,)
            if rt.mesh is not None:
                dist.all_reduce(stats)  # global loss; any rank signalled
            loss_value, stop, norm_value = torch.cat([stats, grad_norm.reshape(1)]).tolist()  # the one host sync
            lr = scheduler.get_last_lr()[0]
            finite = math.isfinite(loss_value) and math.isfinite(norm_value)
            if finite:
                optimizer.step()
                bad_steps = 0
            else:
                bad_steps += 1
                tqdm.write(f"warning: step {step + 1}: non-finite loss {loss_value} or gradient norm {norm_value}; "
                           f"update skipped ({bad_steps} in a row, limit --max_bad_steps {cfg.max_bad_steps})")
            optimizer.zero_grad(set_to_none=True)
            with warnings.catch_warnings():  # a skipped update still advances the schedule (no warning about it)
                warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler.step\(\)` before")
                scheduler.step()
            step += 1

            dt = time.perf_counter() - t0
            mem, mem_peak = memory_gib(rt.device)
            metrics = {"step": step, "loss": loss_value, "lr": lr, "grad_norm": norm_value,
                       "tokens_per_s": step_tokens / dt, "step_time_s": dt, "mem_gib": mem, "mem_peak_gib": mem_peak,
                       "skipped": not finite}
            if peak:
                metrics["mfu"] = flops * step_tokens / dt / W / peak
            if main_rank:
                log_step(metrics, cfg, metrics_file, bar)

            if bad_steps >= cfg.max_bad_steps:
                raise TooManyBadSteps(f"{bad_steps} consecutive steps had a non-finite loss or gradient norm (last: "
                                      f"step {step}); lower --lr (now {cfg.lr}) or --grad_clip, or resume from an "
                                      "earlier checkpoint")
            over = torch.tensor(float(bool(cfg.max_memory) and over_memory_budget(cfg, rt.device)))
            if rt.mesh is not None and cfg.max_memory:
                over = over.to(rt.device)
                dist.all_reduce(over)
            if over.item():
                path = save(step)
                raise MemoryBudgetExceeded(f"peak memory {mem_peak:.2f} GiB exceeds --max_memory {cfg.max_memory} "
                                           f"GiB (step {step}, checkpoint {path}): {memory_advice(cfg)}; then "
                                           "continue with --resume")
            if stop or step == cfg.max_steps or (cfg.checkpoint_interval and step % cfg.checkpoint_interval == 0):
                path = save(step)
                if main_rank:
                    tqdm.write(f"saved {path}")
            if stop:
                bar.close()
                return metrics
    bar.close()

    written = export_model(model, out_dir)
    if main_rank:
        print(f"exported {', '.join(str(p) for p in written)}")
        if refusal := hf_export_refusal(model.config):
            print(refusal)
    if cfg.sample_tokens:
        text = generate_sample(model, tokenizer, cfg, rt.device, autocast)
        if main_rank:
            print(f"--- sample ({cfg.sample_tokens} tokens at temperature 0.8 after {cfg.sample_prompt!r}) ---\n{text}")
    return metrics


def generate_sample(model: Transformer, tokenizer: Tokenizer, cfg: TrainConfig, device: torch.device,
                    autocast: contextlib.AbstractContextManager) -> str:
    """Decode a sample from the prompt (every rank runs it in lockstep under FSDP; the seed makes them agree)."""
    prompt = torch.tensor([tokenizer.encode(cfg.sample_prompt) or [tokenizer.eod_id]], device=device)  # (1, P)
    n = min(cfg.sample_tokens, cfg.context_length - prompt.shape[1])
    generator = torch.Generator(device).manual_seed(cfg.seed)
    with autocast:
        out = model.generate(prompt, n, temperature=0.8, top_k=50, eos_id=tokenizer.eod_id, generator=generator)
    return tokenizer.decode(out[0].tolist())


def main(argv: list[str] | None = None) -> dict:
    cfg = parse_config(argv)
    rt = init_runtime()
    try:
        metrics = train(cfg, rt)
    except BaseException:
        if dist.is_initialized():
            dist.destroy_process_group()  # no barrier: the other ranks may never reach it
        raise
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    return metrics


if __name__ == "__main__":
    main()
