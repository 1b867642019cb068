"""What a training run reports and watches: memory, FLOPs and MFU, the per-step metrics line and metrics.jsonl,
the memory budget, and the signals that stop a run cleanly.
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import json
import math
import os
import resource
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from tqdm import tqdm

from modeling.config import GiB, ModelConfig, attention_class
from training.options import TrainConfig
from training.resume import record

# Dense bf16 peak FLOP/s per GPU for the MFU estimate, matched against torch.cuda.get_device_name().
PEAK_BF16_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "B200": 2250e12}


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


def reserved_gib(device: torch.device) -> float | None:
    """GiB the CUDA caching allocator holds (live tensors and its cache); None on CPU (RSS is what the OS sees)."""
    return torch.cuda.memory_reserved(device) / GiB if device.type == "cuda" else None


def free_cache(device: torch.device) -> None:
    """Give cached memory back: the CUDA allocator's unused blocks, or Python's garbage on CPU."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


FREE_CACHE_AT = 0.7  # share of --max_memory at which the cache is freed


def over_memory_budget(cfg: TrainConfig, device: torch.device) -> bool:
    """Free cached memory once the step's memory passes FREE_CACHE_AT of the budget; True if the peak exceeds the
    budget itself. CUDA: the reserved bytes are compared and released, the budget applies to the peak of live
    tensors, which is then reset for the next step. CPU: garbage collection; the budget applies to the peak RSS."""
    budget = cfg.max_memory * GiB
    if device.type == "cuda":
        if torch.cuda.max_memory_reserved(device) > FREE_CACHE_AT * budget:
            free_cache(device)
        over = torch.cuda.max_memory_allocated(device) > budget
        torch.cuda.reset_peak_memory_stats(device)
        return over
    if memory_gib(device)[0] * GiB > FREE_CACHE_AT * budget:
        free_cache(device)
    return memory_gib(device)[1] * GiB > budget


class LeakWatch:
    """Warns when memory rises steadily: after `warmup` steps, if the current memory grew in at least 90% of the
    last `window` steps by more than `min_gib` in all. Memory that plateaus (caches, allocator growth) does not
    trigger it; a tensor kept from every step (a loss appended without .detach()) does."""

    def __init__(self, window: int = 20, warmup: int = 5, min_gib: float = 1 / 16) -> None:
        self.window, self.warmup, self.min_gib = window, warmup, min_gib
        self.history: list[float] = []
        self.warned_at = -window

    def update(self, step: int, current_gib: float) -> str | None:
        """Record the step's memory; returns a warning line when the last window looks like a leak."""
        if step <= self.warmup:
            return None
        self.history = [*self.history, current_gib][-(self.window + 1):]
        if len(self.history) <= self.window or step - self.warned_at < self.window:
            return None
        rises = sum(b > a for a, b in itertools.pairwise(self.history))
        total = self.history[-1] - self.history[0]
        if rises < 0.9 * self.window or total < self.min_gib:
            return None
        self.warned_at = step
        return (f"warning: memory rose in {rises} of the last {self.window} steps, by {total:.3f} GiB "
                f"({total / self.window * 1024:.1f} MiB per step): something keeps tensors from every step (e.g. a "
                "loss stored without .item() or .detach())")


def process_cpus() -> set[int]:
    """The CPUs this process may run on (its affinity where the OS reports one, else all of them)."""
    return os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))


def busy_core_seconds(cpus: set[int]) -> float | None:
    """Core-seconds the CPUs `cpus` spent busy since boot, from /proc/stat (Linux); None where it cannot be read."""
    try:
        lines = Path("/proc/stat").read_text().splitlines()
    except OSError:
        return None
    ticks = 0
    for line in lines:
        name, *fields = line.split()
        if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cpus:
            user, nice, system, _idle, _iowait, irq, softirq, steal = (int(f) for f in fields[:8])
            ticks += user + nice + system + irq + softirq + steal
    return ticks / os.sysconf("SC_CLK_TCK")


class ThreadPlan:
    """On CPU, PyTorch's intra-op threads (NSA's chunk workers follow them) sized to the cores that other processes
    leave free, measured every `interval` seconds: the busy time of this process's CPUs (/proc/stat) less this
    process's own. Several threads per process on cores that other jobs hold wait at every operator's barrier for
    a thread that lost its core, so two runs on two cores each slow down many times; one thread each keeps their
    sum. Never more threads than the run started with; fixed (no plan) when OMP_NUM_THREADS is set, on GPUs, and
    where /proc/stat cannot be read. The thread count changes the order of some float sums, so a run on a machine
    whose load changes is not bitwise repeatable (set OMP_NUM_THREADS for that)."""

    def __init__(self, device: torch.device, interval: float = 10.0) -> None:
        self.cpus = process_cpus()
        self.most, self.interval = torch.get_num_threads(), interval
        self.enabled = (device.type == "cpu" and "OMP_NUM_THREADS" not in os.environ and self.most > 1
                        and busy_core_seconds(self.cpus) is not None)
        self.mark = self._sample() if self.enabled else None

    def _sample(self) -> tuple[float, float, float]:
        return time.monotonic(), busy_core_seconds(self.cpus) or 0.0, time.process_time()

    def update(self) -> str | None:
        """Set the threads for what the last interval showed; a line saying so when the number changes."""
        if not self.enabled or time.monotonic() - self.mark[0] < self.interval:
            return None
        (t0, busy0, own0), (t1, busy1, own1) = self.mark, self._sample()
        self.mark = (t1, busy1, own1)
        others = max(0.0, (busy1 - busy0) - (own1 - own0)) / (t1 - t0)  # cores other processes kept busy
        threads = max(1, min(self.most, math.floor(len(self.cpus) - others + 0.25)))  # busy cores: fewer threads
        if threads == torch.get_num_threads():
            return None
        torch.set_num_threads(threads)
        return (f"CPU threads: {threads} (other processes kept {others:.1f} of {len(self.cpus)} cores busy; "
                "OMP_NUM_THREADS fixes the number)")


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


class Heartbeat:
    """Rank 0: a progress line inside long steps (a 131k step takes minutes): every `seconds`, the micro-batch, the
    pass (forward, or the backward's recomputation of a checkpointed block) and the block running. Forward
    pre-hooks only; nothing is synchronised."""

    def __init__(self, blocks: torch.nn.ModuleList, seconds: float, micro_steps: int, checkpointing: bool) -> None:
        self.seconds, self.micro_steps, self.n_layers = seconds, micro_steps, len(blocks)
        self.passes = 2 if checkpointing else 1  # checkpointed blocks run again in backward
        self.step, self.calls, self.start, self.last = 0, 0, 0.0, 0.0
        # On each block's attention: checkpointing recomputes a block by calling its function, not the block
        # module, so a hook on the block itself would not see the recomputation.
        self.handles = [block.attn.register_forward_pre_hook(self._make_hook(i)) for i, block in enumerate(blocks)]

    def begin(self, step: int) -> None:
        self.step, self.calls = step, 0
        self.start = self.last = time.monotonic()

    def _make_hook(self, index: int):
        def hook(module: torch.nn.Module, args: object) -> None:
            if not torch.is_grad_enabled():
                return  # evaluation or sampling, not the step
            self.calls += 1
            now = time.monotonic()
            if now - self.last < self.seconds:
                return
            self.last = now
            call = (self.calls - 1) // self.n_layers  # passes over the blocks so far
            micro, backward = call // self.passes, call % self.passes == 1
            tqdm.write(f"step {self.step}: micro-batch {min(micro, self.micro_steps - 1) + 1}/{self.micro_steps}, "
                       f"{'backward (recomputing)' if backward else 'forward'} block {index + 1}/{self.n_layers}, "
                       f"{now - self.start:.0f} s into the step")
        return hook

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def strict_json(metrics: dict) -> dict:
    """`metrics` with non-finite floats (a skipped step's NaN loss) as null, so every line is strict JSON."""
    return {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in metrics.items()}


def _json_line(line: str) -> dict | None:
    """A metrics.jsonl line as a dict; None for a line cut short by a kill (or otherwise unreadable)."""
    try:
        row = json.loads(line)
    except ValueError:
        return None
    return row if isinstance(row, dict) else None


def duration(seconds: float) -> str:
    """`seconds` as 12s, 3m05s or 2h07m."""
    seconds = round(seconds)
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


class Clock:
    """Time since this process started training and the time to --max_steps, from the mean time of the steps it
    has run (the first one, with its warm-up, left out once there are others)."""

    def __init__(self, first_step: int, max_steps: int) -> None:
        self.start, self.first_step, self.max_steps = time.monotonic(), first_step, max_steps
        self.after_first: float | None = None

    def update(self, step: int) -> dict:
        """{"elapsed_s", "eta_s"} after `step` (after the first, its time with its warm-up: see `settled`)."""
        now = time.monotonic()
        if step == self.first_step + 1:
            self.after_first = now
        done = step - self.first_step - 1
        per_step = (now - self.after_first) / done if done else now - self.start
        return {"elapsed_s": round(now - self.start, 1), "eta_s": round(per_step * (self.max_steps - step), 1)}

    def settled(self, step: int) -> bool:
        """Whether the ETA after `step` rests on steps after the first (whose warm-up makes it several times too
        long), or `step` is the last."""
        return step > self.first_step + 1 or step == self.max_steps


def log_step(metrics: dict, cfg: TrainConfig, metrics_file: Path, bar: tqdm, eta_settled: bool = True) -> None:
    """Rank 0: append the step's metrics to metrics.jsonl, advance the progress bar, print a line every
    log_interval steps (and at the first and last), with the elapsed time and the estimated time to the end (once
    `eta_settled`: Clock.settled)."""
    with metrics_file.open("a") as f:
        f.write(json.dumps(strict_json(metrics), allow_nan=False) + "\n")
    step = metrics["step"]
    bar.set_postfix(loss=f"{metrics['loss']:.4f}", tok_s=f"{metrics['tokens_per_s']:.0f}")
    bar.update()
    if step % cfg.log_interval == 0 or step in (1, cfg.max_steps):
        mfu = f" | mfu {metrics['mfu']:.1%}" if "mfu" in metrics else ""
        tqdm.write(f"step {step:>6}/{cfg.max_steps} | loss {metrics['loss']:.4f} | lr {metrics['lr']:.2e} | grad "
                   f"{metrics['grad_norm']:.3f} | {metrics['tokens_per_s']:,.0f} tok/s | mem {metrics['mem_gib']:.2f}"
                   f" GiB (peak {metrics['mem_peak_gib']:.2f}"
                   + (f", reserved {metrics['mem_reserved_gib']:.2f}" if "mem_reserved_gib" in metrics else "")
                   + f"){mfu} | {duration(metrics['elapsed_s'])} elapsed, ETA "
                   + (duration(metrics["eta_s"]) if eta_settled else "after the next step"))
    if "val_loss" in metrics:
        tqdm.write(f"step {step:>6}/{cfg.max_steps} | validation loss {metrics['val_loss']:.4f} | perplexity "
                   f"{metrics['val_perplexity']:.2f}")


def summary(cfg: TrainConfig, model: torch.nn.Module, world_size: int) -> str:
    """One line: the model, the tokens of a step, the length of the run, the devices, and where the outputs go."""
    c = model.config
    name, threads = cfg.init_from or cfg.model_size, torch.get_num_threads()
    devices = f"{world_size} GPU{'s' if world_size > 1 else ''}" if torch.cuda.is_available() else (
        f"{world_size} CPU process{'es' if world_size > 1 else ''} (up to {threads} thread{'s' * (threads > 1)} each)")
    groups, N = world_size // cfg.context_parallel, cfg.context_parallel  # each sequence split over N processes
    tokens = groups * cfg.gradient_accumulation_steps * cfg.batch_size * cfg.context_length
    readers = f"{world_size} process{'es' if world_size > 1 else ''}" if N == 1 else (
        f"{groups} group{'s' if groups > 1 else ''} of {N} processes, each sequence split over a group")
    return (f"{name}: {model.num_parameters() / 1e6:,.1f}M parameters, {c.attention_type} attention, "
            f"{cfg.finetune} fine-tune, {cfg.dtype}; {cfg.max_steps} steps of {tokens:,} tokens "
            f"({readers} x {cfg.gradient_accumulation_steps} "
            f"accumulated x {cfg.batch_size} sequences x {cfg.context_length} tokens) on "
            f"{devices}; writing {cfg.out_dir} (config.json holds every option; --verbose prints them)")


def start_run(out_dir: Path, cfg: TrainConfig, model: torch.nn.Module, world_size: int, resume_from: Path | None,
              step: int, task_state: dict, changed: dict) -> None:
    """Rank 0: print a summary of the run (the resolved configuration with --verbose) and save the configuration
    (with the task's state) as out_dir/config.json; on
    resume, drop the metrics lines of steps after the checkpoint (written by the interrupted run) and any line a
    kill cut short, and record the options that changed (`changed`: {option: [checkpoint value, new value]}) as a
    metrics line {"step", "resumed_with"}. A run started without a checkpoint begins a fresh metrics.jsonl."""
    out_dir.mkdir(parents=True, exist_ok=True)
    resolved = {"train": record(cfg), "model": model.config.to_dict(),
                "compute": model.compute.to_dict(), "world_size": world_size,
                "parameters": model.num_parameters(), **task_state}
    print(json.dumps(resolved, indent=1) if cfg.verbose else summary(cfg, model, world_size))
    (out_dir / "config.json").write_text(json.dumps(resolved, indent=1))
    metrics_file = out_dir / "metrics.jsonl"
    if resume_from:
        print(f"resumed from {resume_from} (step {step})")
        if metrics_file.exists():
            lines = metrics_file.read_text().splitlines()
            kept = [ln for ln in lines if (row := _json_line(ln)) is not None and row.get("step", step + 1) <= step]
            metrics_file.write_text("".join(f"{ln}\n" for ln in kept))
        for name, (old, new) in changed.items():
            option = "world size" if name == "world_size" else f"--{name}"  # ranks: not an option
            print(f"{option} {new} takes effect from step {step + 1} (the checkpoint was trained with {old})")
        if changed:
            with metrics_file.open("a") as f:
                f.write(json.dumps({"step": step, "resumed_with": changed}) + "\n")
    else:
        if cfg.resume == "auto":
            print(f"no checkpoint in {out_dir}: starting from scratch")
        metrics_file.unlink(missing_ok=True)


def plot_loss_curve(metrics_file: Path, title: str) -> Path | None:
    """loss.png beside `metrics_file` (metrics.jsonl): the training loss by step, and the validation loss where the
    run measured it; None when matplotlib is not installed (the `plot` extra) or nothing was logged."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    rows = [row for line in metrics_file.read_text().splitlines() if (row := _json_line(line)) is not None]
    train = [(r["step"], r["loss"]) for r in rows if "loss" in r]
    val = [(r["step"], r["val_loss"]) for r in rows if "val_loss" in r]
    if not train:
        return None
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(*zip(*train, strict=True), label="training loss", linewidth=1)
    if val:
        ax.plot(*zip(*val, strict=True), marker="o", label="validation loss")
    ax.set(xlabel="step", ylabel="loss (nats per token)")
    ax.set_title(title, fontsize=9)
    ax.legend()
    fig.tight_layout()
    path = metrics_file.with_name("loss.png")
    fig.savefig(path)
    plt.close(fig)
    return path
