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

import contextlib
import dataclasses
import math
import os
import random
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor
from torch.optim.lr_scheduler import LambdaLR
from tqdm import tqdm

from checkpoint import (
    DamagedCheckpoint,
    UnsafeCheckpoint,
    checkpoint_to_resume,
    latest_checkpoint,
    load_checkpoint,
    prune_checkpoints,
    read_train_state,
    save_checkpoint,
)
from config import ComputeConfig, ModelConfig
from data import INDEX_NAME, TokenLoader, check_tokenizer, iter_documents, prepare, stdlib_files
from eval import validation_loss, validation_windows
from hf import export_refusal
from lora import apply_lora, init_lora, load_adapter, merge_lora_, save_adapter
from loss import IGNORE_INDEX, shift_labels
from model import Transformer
from monitor import (
    Heartbeat,
    LeakWatch,
    MemoryBudgetExceeded,
    TooManyBadSteps,
    flops_per_token,
    free_cache,
    log_step,
    memory_advice,
    memory_gib,
    over_memory_budget,
    peak_flops,
    reserved_gib,
    start_run,
    stop_on_signals,
)
from npt.adapters import ADAPTERS_NAME, load_adapters, save_adapters
from npt.convert import convert
from nsa.convert import FRESH, nsa_state_from_dense
from parallel import apply_fsdp, init_sharded_weights
from quantize import quantize_base
from synthetic import SyntheticMix
from tokenizer import Tokenizer, check_vocab, load_tokenizer
from train_config import (
    DEFAULT_DATA_DIR,
    TOKENIZER_VOCAB,
    TrainConfig,
    build_model_config,
    parse_config,
    resolve_config,
)
from weights import export_model, load_initial_weights, stored_config

GiB = 1024**3


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


def resolve_tokenizer(cfg: TrainConfig) -> TrainConfig:
    """With --init_from a directory holding tokenizer.json and no --tokenizer: that tokenizer. A tokenizer given
    with the default data directory gets a default data directory of its own (DEFAULT_DATA_DIR-<sha256[:12]>)."""
    if cfg.init_from and not cfg.tokenizer and (Path(cfg.init_from) / "tokenizer.json").is_file():
        cfg = dataclasses.replace(cfg, tokenizer=str(Path(cfg.init_from) / "tokenizer.json"))
    if cfg.tokenizer and cfg.data_dir == DEFAULT_DATA_DIR:
        cfg = dataclasses.replace(cfg, data_dir=f"{DEFAULT_DATA_DIR}-{load_tokenizer(cfg.tokenizer).sha256[:12]}")
    return cfg


def ensure_default_data(cfg: TrainConfig, rt: Runtime) -> None:
    """Make `python train.py` work out of the box: if the default data directory (DEFAULT_DATA_DIR, or its
    per-tokenizer variant) is selected and empty, tokenize this interpreter's standard library into it (~20 s), with
    the tokenizer given or one trained for it. Rank 0 works while the others wait."""
    data_dir = Path(cfg.data_dir)
    if rt.rank == 0 and cfg.data_dir.startswith(DEFAULT_DATA_DIR) and not (data_dir / INDEX_NAME).exists():
        files = stdlib_files()
        tok_file = tokenizer_path(cfg)
        if tok_file.exists():
            tokenizer = load_tokenizer(tok_file)
        else:  # the tokenizer trains on a sample of lines: shuffle the sorted files so it sees all packages
            shuffled = random.Random(0).sample(files, len(files))
            tokenizer = Tokenizer.train(iter_documents(shuffled), TOKENIZER_VOCAB, tok_file.with_suffix(""))
        prepare(files, tokenizer, data_dir)
    if dist.is_initialized():
        dist.barrier()


def build_model(model_config: ModelConfig, compute: ComputeConfig, cfg: TrainConfig, rt: Runtime) -> Transformer:
    """The model on its device, identically initialised from cfg.seed in every process layout. With a mesh: built
    on the meta device, sharded by apply_fsdp (bf16 compute when dtype is bfloat16, float32 reduction), then
    materialised (parallel.init_sharded_weights). --finetune lora / npt: adapters on a frozen base, which in one
    process is stored in bf16 when dtype is bfloat16 (only trained weights need float32 masters)."""
    if cfg.finetune == "npt" and rt.mesh is not None:
        raise ValueError("--finetune npt runs in one process: launch without torchrun")
    if rt.mesh is None:
        torch.manual_seed(cfg.seed)
        with rt.device:
            model = Transformer(model_config, compute)
    else:
        with torch.device("meta"):
            model = Transformer(model_config, compute)
    if cfg.finetune == "lora":
        apply_lora(model, cfg.lora_rank, cfg.lora_alpha, tuple(cfg.lora_targets.split(",")))
    elif cfg.finetune == "npt":
        convert(model, cfg.npt_layer_spec(), cfg.npt_rank, tuple(cfg.npt_targets.split(",")), cfg.npt_residual_mode)
    if cfg.finetune != "full" and rt.mesh is None and cfg.dtype == "bfloat16":  # no fp32 master for frozen weights
        for p in model.parameters():
            if not p.requires_grad:
                p.data = p.data.to(torch.bfloat16)  # tied weights are one Parameter: cast once
    model.gradient_checkpointing_enable(cfg.gradient_checkpointing)
    if cfg.compile:
        for block in model.layers:
            block.compile()
    if rt.mesh is not None:
        param_dtype = torch.bfloat16 if cfg.dtype == "bfloat16" else None
        apply_fsdp(model, rt.mesh, param_dtype=param_dtype, reduce_dtype=torch.float32, sum_gradients=True)
        init_sharded_weights(model, rt.device, cfg.seed)
    return model


def check_run_directory(out_dir: Path, resume: str | None) -> None:
    """FileExistsError (one line, naming what to pass) unless starting or resuming into `out_dir` leaves every other
    run's files alone: a fresh run needs a directory without a run (config.json, metrics.jsonl or step-N), and a
    checkpoint resumed from another directory may not be continued in one that holds a run."""
    if out_dir.exists() and not out_dir.is_dir():
        raise NotADirectoryError(f"--out_dir {out_dir} is a file; pass a directory")
    holds_run = any((out_dir / name).exists() for name in ("config.json", "metrics.jsonl")) or latest_checkpoint(
        out_dir) is not None
    if resume is None and holds_run:
        what = latest_checkpoint(out_dir).name if latest_checkpoint(out_dir) else "a run without a checkpoint"
        raise FileExistsError(f"{out_dir} already holds a run ({what}); pass --resume to continue it (from scratch "
                              "when it has no checkpoint), or choose another --out_dir")
    if resume not in (None, "auto") and holds_run and Path(resume).resolve().parent != out_dir.resolve():
        raise FileExistsError(f"{out_dir} holds another run: continuing {resume} there would rewrite its files; "
                              "choose an empty --out_dir")


def apply_optimizer_options(optimizer: torch.optim.Optimizer, scheduler: LambdaLR, cfg: TrainConfig,
                            saved: dict) -> dict:
    """After a resume, make this run's lr, weight decay and schedule take effect over the restored optimizer and
    scheduler state (which would otherwise keep the checkpoint's): the lr follows the new schedule from the restored
    step on. Returns {option: [checkpoint value, new value]} of the options that changed."""
    names = ("lr", "weight_decay", "warmup_steps", "max_steps", "min_lr_ratio", "grad_clip")
    changed = {k: [saved.get(k), getattr(cfg, k)] for k in names if saved.get(k) != getattr(cfg, k)}
    for group, decay in zip(optimizer.param_groups, (cfg.weight_decay, 0.0), strict=True):
        group["initial_lr"], group["weight_decay"] = cfg.lr, decay
    scheduler.base_lrs = [cfg.lr] * len(optimizer.param_groups)
    for group, factor in zip(optimizer.param_groups, scheduler.lr_lambdas, strict=True):
        group["lr"] = cfg.lr * factor(scheduler.last_epoch)  # what scheduler.step() computes
    scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]
    return changed


def build_optimizer(model: Transformer, cfg: TrainConfig) -> tuple[torch.optim.AdamW, LambdaLR]:
    """AdamW over the trainable parameters (weight decay on matrices only) and the warmup + cosine schedule:
    lr * lr_factor(step)."""
    params = [p for p in model.parameters() if p.requires_grad]  # tied weights appear once
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8)

    def lr_factor(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        progress = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.max_steps - cfg.warmup_steps))
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return optimizer, LambdaLR(optimizer, lr_factor)


# ---- the loop ------------------------------------------------------------------------------------------------

Loss = Callable[[Transformer, Tensor, Tensor, Tensor, int], tuple[Tensor, dict[str, Tensor]]]


def lm_loss(model: Transformer, input_ids: Tensor, labels: Tensor, n_tokens: Tensor, n_micro: int
            ) -> tuple[Tensor, dict[str, Tensor]]:
    """Language modelling: the micro-batch's summed next-token loss divided by `n_tokens`, the predicted tokens of
    the whole step (all micro-batches on all ranks); no extra metrics."""
    return model(input_ids, labels, loss_normalizer=n_tokens).loss, {}


def export_and_sample(model: Transformer, tokenizer: Tokenizer, cfg: TrainConfig, rt: Runtime,
                      autocast: contextlib.AbstractContextManager) -> None:
    """The end of a language-modelling run: export the weights (weights.export_model; a LoRA run: its adapters in
    peft's layout, and with --merge the merged model; an NPT run: its NP parameters, npt.adapters) and print a
    sample."""
    if cfg.finetune == "npt":
        written = [Path(cfg.out_dir) / ADAPTERS_NAME]
        save_adapters(model, written[0])
    elif cfg.finetune == "lora":
        written = [save_adapter(model, Path(cfg.out_dir) / "adapter", cfg.init_from)]
        if cfg.merge:
            merge_lora_(model)
            written += export_model(model, Path(cfg.out_dir), drop_adapters=True)
    else:
        written = export_model(model, Path(cfg.out_dir))
    if rt.rank == 0:
        print(f"exported {', '.join(str(p) for p in written)}")
        if refusal := export_refusal(model.config):
            print(f"no hf/ directory: {refusal} (weights.load_model reads {Path(cfg.out_dir) / 'model'})")
    if cfg.sample_tokens:
        text = generate_sample(model, tokenizer, cfg, rt.device, autocast)
        if rt.rank == 0:
            print(f"--- sample ({cfg.sample_tokens} tokens at temperature 0.8 after {cfg.sample_prompt!r}) ---\n{text}")


@dataclass
class Task:
    """What the loop optimises; the defaults are language modelling. npt/train_equivalence.py supplies its own.

    build: the model, as `build_model`; loss: one micro-batch's loss to backpropagate, already divided for the
    step, and extra metrics (0-dim tensors, summed over micro-batches and ranks, logged under their names);
    start: called once the model is built, returns extra state for config.json and every checkpoint;
    finish: the end of a completed run (not of a stopped one)."""

    build: Callable[[ModelConfig, ComputeConfig, TrainConfig, Runtime], Transformer] = build_model
    loss: Loss = lm_loss
    start: Callable[[Transformer, TrainConfig], dict] | None = None
    finish: Callable[[Transformer, Tokenizer, TrainConfig, Runtime, contextlib.AbstractContextManager], None] = (
        export_and_sample)


def forward_backward(model: Transformer, batches: list[list[Tensor]], autocast: contextlib.AbstractContextManager,
                     loss_fn: Loss = lm_loss) -> tuple[Tensor, dict[str, Tensor]]:
    """Accumulate into `.grad` the gradient of the step's loss from this rank's micro-batches `batches`
    (A x [input_ids, labels], each (B, T)); return this rank's part of the loss and of the extra metrics (0-dim
    tensors; their sums over ranks are the step's values). The predicted-token count of the whole global batch is
    one all-reduce; FSDP sums the gradients over ranks (apply_fsdp(sum_gradients=True))."""
    n_tokens = sum((shift_labels(labels) != IGNORE_INDEX).sum() for _, labels in batches)
    if dist.is_initialized():
        dist.all_reduce(n_tokens)
    n_tokens = n_tokens.clamp(min=1).float()
    loss_sum, extras = torch.zeros((), device=n_tokens.device), {}
    for input_ids, labels in batches:
        with autocast:
            loss, metrics = loss_fn(model, input_ids, labels, n_tokens, len(batches))
        loss.backward()
        loss_sum += loss.detach()
        for name, value in metrics.items():
            extras[name] = extras.get(name, 0) + value.detach()
    return loss_sum, extras


def train(cfg: TrainConfig, rt: Runtime, task: Task | None = None) -> dict:
    """Run (or resume) training as configured; returns the last step's metrics."""
    task = task or Task()
    cfg = resolve_config(cfg, rt.device)
    out_dir = Path(cfg.out_dir)
    check_run_directory(out_dir, cfg.resume)
    cfg = resolve_tokenizer(cfg)
    ensure_default_data(cfg, rt)
    loader = TokenLoader(cfg.data_dir, cfg.context_length, cfg.batch_size, rt.rank, rt.world_size, cfg.seed)
    tokenizer = load_tokenizer(tokenizer_path(cfg))
    check_tokenizer(loader.index, tokenizer)
    if cfg.synthetic_mix:
        loader = SyntheticMix(loader, tokenizer, cfg.synthetic_mix, cfg.seed)
    device_memory = torch.cuda.get_device_properties(rt.device).total_memory if rt.device.type == "cuda" else None
    stored = stored_config(cfg.init_from) if cfg.init_from else None
    model_config, compute = build_model_config(cfg, tokenizer.vocab_size, device_memory, rt.world_size, stored)

    resume_from = checkpoint_to_resume(out_dir, cfg.resume)
    if resume_from and read_train_state(resume_from)["step"] >= cfg.max_steps:
        step = read_train_state(resume_from)["step"]
        if rt.rank == 0:
            print(f"{resume_from} is step {step} of a run that has finished (--max_steps {cfg.max_steps}): nothing "
                  "to train; pass a larger --max_steps to continue it")
        return {"step": step}
    prune_checkpoints(out_dir, cfg.keep_checkpoints, resume_from)  # stale step-N.tmp, too many step-N
    model = task.build(model_config, compute, cfg, rt)
    check_vocab(tokenizer, model.config.vocab_size)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer, scheduler = build_optimizer(model, cfg)
    step, bad_steps, changed = 0, 0, {}
    if cfg.init_from and (not resume_from or cfg.finetune != "full"):  # an adapter checkpoint holds no base
        if stored.attention_type == model.config.attention_type:
            load_initial_weights(model, cfg.init_from)
        else:  # full -> nsa (build_model_config allows only that)
            load_initial_weights(model, cfg.init_from, partial(nsa_state_from_dense, config=model.config), FRESH)
    if cfg.finetune != "full" and not cfg.init_from and rt.rank == 0:
        print(f"warning: --finetune {cfg.finetune} without --init_from adapts a randomly initialised, frozen base")
    if cfg.finetune == "lora":
        init_lora(model, cfg.seed)
        if cfg.adapter:
            load_adapter(model, cfg.adapter)
    if cfg.finetune == "npt" and cfg.adapter:
        adapter = Path(cfg.adapter)
        load_adapters(model, adapter / ADAPTERS_NAME if adapter.is_dir() else adapter)
    if cfg.quantize_base:
        if rt.mesh is not None:
            raise ValueError("--quantize_base runs in one process: launch without torchrun")
        quantize_base(model, cfg.quantize_base)
    if resume_from:
        state = load_checkpoint(resume_from, model, optimizer)
        step, bad_steps = state["step"], state["bad_steps"]
        scheduler.load_state_dict(state["scheduler"])
        loader.load_state_dict(state["loader"])
        changed = apply_optimizer_options(optimizer, scheduler, cfg, state["config"])

    W, A, B, T = rt.world_size, cfg.gradient_accumulation_steps, cfg.batch_size, cfg.context_length
    step_tokens = W * A * B * T
    flops, peak = flops_per_token(model.config, T), peak_flops(rt.device, cfg.dtype)
    if rt.device.type == "cuda" and cfg.max_memory:
        total = torch.cuda.get_device_properties(rt.device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, cfg.max_memory * GiB / total), rt.device)
    autocast = (torch.autocast(rt.device.type, dtype=torch.bfloat16) if cfg.dtype == "bfloat16" and rt.mesh is None
                else contextlib.nullcontext())
    main_rank = rt.rank == 0
    metrics_file = out_dir / "metrics.jsonl"
    task_state = task.start(model, cfg) if task.start else {}
    val_windows = (validation_windows(cfg.data_dir, cfg.context_length, cfg.eval_tokens, cfg.seed, rt.rank,
                                      rt.world_size) if cfg.eval_interval else None)
    if main_rank:
        start_run(out_dir, cfg, model, W, resume_from, step, task_state, changed)
        print(f"{model.num_parameters() / 1e6:.2f}M parameters, {W} process(es) x {A} micro-steps x {B} x {T} "
              f"= {step_tokens} tokens per step, {flops / 1e9:.3f} GFLOP per token")

    def save(at_step: int) -> Path:
        train_state = {"step": at_step, "bad_steps": bad_steps, "scheduler": scheduler.state_dict(),
                       "loader": loader.state_dict(), "config": dataclasses.asdict(cfg),
                       "model_config": model.config.to_dict(), "compute": model.compute.to_dict(), "world_size": W,
                       **task_state}
        path = save_checkpoint(out_dir, at_step, model, optimizer, train_state)
        prune_checkpoints(out_dir, cfg.keep_checkpoints, resume_from)
        return path

    bar = tqdm(total=cfg.max_steps, initial=step, desc="training", unit="step", disable=not main_rank or None,
               dynamic_ncols=True)
    metrics: dict = {}
    leaks = LeakWatch()
    last_save = time.monotonic()
    heartbeat = (Heartbeat(model.layers, cfg.heartbeat_seconds, A, cfg.gradient_checkpointing)
                 if main_rank and cfg.heartbeat_seconds else None)
    with stop_on_signals() as signals:
        while step < cfg.max_steps:
            t0 = time.perf_counter()
            if heartbeat:
                heartbeat.begin(step + 1)
            batches = [[t.to(rt.device, non_blocking=True) for t in next(loader)] for _ in range(A)]  # A x 2 x (B, T)
            try:
                loss_sum, extras = forward_backward(model, batches, autocast, task.loss)
            except torch.OutOfMemoryError as e:
                raise MemoryBudgetExceeded(f"out of memory at step {step + 1}: {memory_advice(cfg)}") from e
            grad_norm = torch.nn.utils.clip_grad_norm_(trainable, cfg.grad_clip or math.inf)
            if isinstance(grad_norm, DTensor):
                grad_norm = grad_norm.full_tensor()
            due = bool(cfg.checkpoint_minutes) and time.monotonic() - last_save >= 60 * cfg.checkpoint_minutes
            flags = torch.tensor([float(signals["stop"]), float(due)], device=rt.device)
            stats = torch.stack([loss_sum, *flags, *extras.values()])  # (3 + extras,)
            if rt.mesh is not None:
                dist.all_reduce(stats)  # global loss and metrics; any rank signalled, or its save clock ran out
            loss_value, stop, due, *extra_values, norm_value = torch.cat([stats, grad_norm.reshape(1)]).tolist()
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
            metrics = {"step": step, "loss": loss_value, **dict(zip(extras, extra_values, strict=True)), "lr": lr,
                       "grad_norm": norm_value, "tokens_per_s": step_tokens / dt, "step_time_s": dt, "mem_gib": mem,
                       "mem_peak_gib": mem_peak, "mem_growth_gib": mem - metrics.get("mem_gib", mem),
                       "skipped": not finite}
            if (reserved := reserved_gib(rt.device)) is not None:
                metrics["mem_reserved_gib"] = reserved
            if main_rank and (leak := leaks.update(step, mem)):
                tqdm.write(leak)
            if cfg.empty_cache_interval and step % cfg.empty_cache_interval == 0:
                free_cache(rt.device)
            if peak:
                metrics["mfu"] = flops * step_tokens / dt / W / peak
            if val_windows is not None and (step % cfg.eval_interval == 0 or step == cfg.max_steps):
                metrics["val_loss"] = validation_loss(model, val_windows, autocast)
                metrics["val_perplexity"] = math.exp(min(metrics["val_loss"], 700))
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
            if (stop or due or step == cfg.max_steps
                    or (cfg.checkpoint_interval and step % cfg.checkpoint_interval == 0)):
                path = save(step)
                last_save = time.monotonic()
                if main_rank:
                    tqdm.write(f"saved {path}")
            if stop:
                break
    bar.close()
    if heartbeat:
        heartbeat.remove()
    if stop:
        return metrics
    task.finish(model, tokenizer, cfg, rt, autocast)
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
    try:
        main()
    except (FileExistsError, NotADirectoryError, UnsafeCheckpoint, DamagedCheckpoint) as e:  # not a bug: one line
        raise SystemExit(f"error: {e}") from None
    except (MemoryBudgetExceeded, TooManyBadSteps) as e:  # a checkpoint is saved where possible: one line
        raise SystemExit(f"stopped: {e}") from None
