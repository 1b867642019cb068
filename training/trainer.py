"""The training run: its setup in one order (`prepare_run`), one optimizer step (`train_step`), the loop (`loop`),
and the builders profile_memory.py shares (`build_model`, `build_optimizer`). train.py is its command line.

Loss normalisation: every micro-batch's summed token loss is divided by the number of predicted tokens in the
whole step (all A micro-batches on all W ranks), and FSDP sums (not averages) gradients over ranks, so the update
is the gradient of the mean token loss of the global batch, however it is split over ranks and micro-steps.

Notation: B sequences per rank per micro-step, T context length, A accumulation steps, W world size.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor
from torch.optim.lr_scheduler import LambdaLR
from tqdm import tqdm

from evaluation.loss import validation_loss, validation_windows
from model import Transformer
from modeling.config import ComputeConfig, GiB, ModelConfig
from modeling.documents import document_starts
from modeling.loss import IGNORE_INDEX, shift_labels
from modeling.shard import SequenceShard
from nsa.from_dense import FRESH, nsa_state_from_dense
from nsa.primitive import exact_block_scores
from storage.checkpoint import (
    SaveFailed,
    checkpoint_to_resume,
    load_checkpoint,
    prune_checkpoints,
    read_train_state,
    save_checkpoint,
)
from storage.hf import ExportInfo, export_refusal
from storage.manifest import damaged_export
from storage.weights import Stored, load_initial_weights, stored
from text.shards import TokenLoader
from text.synthetic import SyntheticMix
from text.tokenizer import HFTokenizer, Tokenizer, check_vocab
from training.cli import exit_with_error
from training.inputs import prepare_data
from training.modes import FinetuneMode, cast_frozen_base, check_adapter_base, finetune_mode, settle_mode
from training.monitor import (
    Clock,
    Heartbeat,
    LeakWatch,
    MemoryBudgetExceeded,
    ThreadPlan,
    TooManyBadSteps,
    flops_per_token,
    free_cache,
    log_step,
    memory_advice,
    memory_gib,
    over_memory_budget,
    peak_flops,
    plot_loss_curve,
    reserved_gib,
    start_run,
    stop_on_signals,
)
from training.options import (
    TrainConfig,
    build_model_config,
    check_effects,
    check_model_size,
    default_out_dir,
    resolve_config,
)
from training.parallel import Runtime, apply_fsdp, context_shard, init_sharded_weights
from training.resume import absolute_paths, continue_options, record, resume_changes, task_changes
from training.run_directory import RunLock, check_run_directory, clear_unstarted, run_record, start_timeline
from training.tracking import check_tracker, tracking

FINISHED_NAME = "finished.json"  # written once a run's end (export, sample) is done

# ---- the model and its optimizer -----------------------------------------------------------------------------


def build_model(model_config: ModelConfig, compute: ComputeConfig, cfg: TrainConfig, rt: Runtime) -> Transformer:
    """The model on its device, identically initialised from cfg.seed in every process layout, prepared by the run's
    fine-tuning mode (finetune.py). With a mesh: built on the meta device, prepared, sharded by apply_fsdp (bf16
    compute when dtype is bfloat16, float32 reduction), then materialised (parallel.init_sharded_weights). A frozen
    base is stored in bf16 in one process when dtype is bfloat16 (only trained weights need float32 masters)."""
    mode = finetune_mode(cfg)
    if rt.mesh is None:
        torch.manual_seed(cfg.seed)
        with rt.device:
            model = Transformer(model_config, compute, cfg.objective())
    else:
        with torch.device("meta"):
            model = Transformer(model_config, compute, cfg.objective())
    mode.prepare(model)
    if mode.frozen_base and rt.mesh is None and cfg.dtype == "bfloat16":
        cast_frozen_base(model, torch.bfloat16)
    model.gradient_checkpointing_enable(cfg.gradient_checkpointing)
    if cfg.compile:
        for block in model.layers:
            block.compile()
    if rt.mesh is not None:
        param_dtype = torch.bfloat16 if cfg.dtype == "bfloat16" else None
        apply_fsdp(model, rt.mesh, param_dtype=param_dtype, reduce_dtype=torch.float32, sum_gradients=True)
        init_sharded_weights(model, rt.device, cfg.seed)
    return model


def apply_optimizer_options(optimizer: torch.optim.Optimizer, scheduler: LambdaLR, cfg: TrainConfig,
                            saved: dict) -> dict:
    """After a resume, make this run's lr, weight decay and schedule take effect over the restored optimizer and
    scheduler state (which would otherwise keep the checkpoint's): the lr follows the new schedule from the restored
    step on. Returns {option: [checkpoint value, new value]} of the options that changed."""
    names = ("lr", "weight_decay", "warmup_steps", "max_steps", "min_lr_ratio", "grad_clip")
    changed = {k: [saved.get(k), getattr(cfg, k)] for k in names if saved.get(k) != getattr(cfg, k)}
    for group in optimizer.param_groups:  # matrices are decayed (build_optimizer)
        group["initial_lr"], group["weight_decay"] = cfg.lr, cfg.weight_decay if group["params"][0].dim() >= 2 else 0.0
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
    groups = [group for group in groups if group["params"]]  # a mode may train only one kind
    optimizer = torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8)

    def lr_factor(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        progress = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.max_steps - cfg.warmup_steps))
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return optimizer, LambdaLR(optimizer, lr_factor)


# ---- the run: everything the loop needs, prepared in one order -------------------------------------------------

Loss = Callable[..., tuple[Tensor, dict[str, Tensor]]]  # (model, input_ids, labels, n_tokens, n_micro[, doc_start])


def lm_loss(model: Transformer, input_ids: Tensor, labels: Tensor, n_tokens: Tensor, n_micro: int,
            doc_start: Tensor | None = None, shard: SequenceShard | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """Language modelling: the micro-batch's summed next-token loss divided by `n_tokens`, the predicted tokens of
    the whole step (all micro-batches on all ranks), plus the attention's training-only terms (as `aux_loss`, the
    one extra metric, when there are any: e.g. --nsa_score_loss_coef 0.1), each a mean over
    its own rows, weighted 1 / (the step's micro-batches on all ranks) whatever the labels. With a `shard`
    (context parallelism) the rows are a shard's part of its sequences (labels already shifted), whose terms add up
    over the ranks that share them: the weight counts the ranks that read other sequences."""
    ranks = dist.get_world_size() if dist.is_initialized() else 1
    if shard is not None:
        ranks //= len(shard.layouts)  # the ranks of a context group hold one sequence together
    out = model(input_ids, labels, loss_normalizer=n_tokens, aux_weight=1 / (n_micro * ranks), doc_start=doc_start,
                **({} if shard is None else {"shard": shard}))
    return out.loss, {} if out.aux_loss is None else {"aux_loss": out.aux_loss}


@dataclass
class Run:
    """A prepared run (`prepare_run`): the resolved options, the process layout, what trains and how, and where
    the run stands (`step`, `bad_steps`: consecutive skipped steps)."""

    cfg: TrainConfig
    rt: Runtime
    task: Task
    mode: FinetuneMode
    tokenizer: Tokenizer | HFTokenizer
    loader: TokenLoader | SyntheticMix
    model: Transformer
    optimizer: torch.optim.Optimizer
    scheduler: LambdaLR
    autocast: contextlib.AbstractContextManager
    resume_from: Path | None
    task_state: dict
    val_windows: tuple[Tensor, Tensor] | None  # (input ids, labels) of the validation windows
    export: ExportInfo  # what the exports carry besides the weights (the tokenizer, the base's metadata)
    base: dict | None = None  # a frozen base: {"path", "checksum"} of --init_from (checkpoints hold no base)
    shard: SequenceShard | None = None  # this rank's part of each sequence under --context_parallel
    step: int = 0
    bad_steps: int = 0

    @property
    def out_dir(self) -> Path:
        return Path(self.cfg.out_dir)

    @property
    def step_tokens(self) -> int:
        """Tokens per optimizer step: W / N data-parallel groups x A micro-steps x B sequences x T tokens (N:
        --context_parallel, the ranks that share a sequence)."""
        return self.rt.data_ranks * self.cfg.gradient_accumulation_steps * self.cfg.batch_size * \
            self.cfg.context_length

    def save_scheduled(self) -> bool:
        """A checkpoint is due at this step: every --checkpoint_interval steps, and at the last."""
        interval = self.cfg.checkpoint_interval
        return self.step == self.cfg.max_steps or bool(interval) and self.step % interval == 0

    def save(self) -> Path:
        """Checkpoint this step (collective), then delete checkpoints beyond --keep_checkpoints."""
        train_state = {"step": self.step, "bad_steps": self.bad_steps, "scheduler": self.scheduler.state_dict(),
                       "loader": self.loader.state_dict(), "config": record(self.cfg),
                       "model_config": self.model.config.to_dict(), "compute": self.model.compute.to_dict(),
                       "world_size": self.rt.world_size, "base": self.base, "tokenizer": self.tokenizer.record(),
                       **self.task_state}
        path = save_checkpoint(self.out_dir, self.step, self.model, self.optimizer, train_state,
                               partial(self.tokenizer.save, model_max_length=self.cfg.context_length))
        prune_checkpoints(self.out_dir, self.cfg.keep_checkpoints, self.resume_from)
        return path


def export_and_sample(run: Run) -> None:
    """The end of a language-modelling run: what the fine-tuning mode exports (the model; LoRA adapters; NP
    parameters), then a sample."""
    written = run.mode.export(run.model, run.out_dir, run.export)
    if run.rt.rank == 0:
        print(f"exported {', '.join(str(p) for p in written)}")
        if (refusal := export_refusal(run.model.config)) and run.mode.name == "full":
            print(f"no hf/ directory: {refusal} (weights.load_model reads {run.out_dir / 'model'})")
    if run.cfg.sample_tokens != 0:
        n, text = generate_sample(run.model, run.tokenizer, run.cfg, run.rt.device, run.autocast)
        if run.rt.rank == 0:
            after = repr(run.cfg.sample_prompt) if run.cfg.sample_prompt else "the start of a document"
            print(f"--- sample ({n} tokens at temperature 0.8 after {after}) ---\n{text}")


@dataclass
class Task:
    """What the loop optimises; the defaults are language modelling. train_npt.py supplies its own.

    build: the model, as `build_model`; loss: one micro-batch's loss to backpropagate, already divided for the
    step, and extra metrics (0-dim tensors, summed over micro-batches and ranks, logged under their names);
    start: called once the model is built, returns extra state for config.json and every checkpoint;
    finish: the end of a completed run (not of a stopped one)."""

    build: Callable[[ModelConfig, ComputeConfig, TrainConfig, Runtime], Transformer] = build_model
    loss: Loss = lm_loss
    start: Callable[[Transformer, TrainConfig], dict] | None = None
    finish: Callable[[Run], None] = export_and_sample


class NothingToTrain(Exception):
    """The checkpoint to resume has already reached --max_steps."""

    def __init__(self, step: int) -> None:
        super().__init__(f"step {step}")
        self.step = step


def resolve_run(cfg: TrainConfig, rt: Runtime, given: frozenset[str] | None = None) -> TrainConfig:
    """The options resolved for this device (resolve_config), and the run directory: --out_dir, or its default,
    decided by rank 0 (the other ranks could see its directory appear). A resumed run continues with the options
    its directory recorded, except those `given` (`continue_options`; None: all are given). Paths are made
    absolute, so that the run's record holds from any working directory."""
    say = print if rt.rank == 0 else (lambda message: None)
    cfg = resolve_config(cfg, rt.device, say)
    if cfg.out_dir == "auto":
        out_dir = [str(default_out_dir(cfg, say)) if rt.rank == 0 else None]
        if dist.is_initialized():
            dist.broadcast_object_list(out_dir, src=0)
        cfg = dataclasses.replace(cfg, out_dir=out_dir[0])
    check_run_directory(Path(cfg.out_dir), cfg.resume, cfg.init_from)
    recorded = run_record(Path(cfg.out_dir)) if cfg.resume else None
    if recorded and given is not None:
        cfg = continue_options(cfg, given, recorded)
    check_effects(cfg, given, rt.device, say)
    if not recorded:  # what the mode's inputs fix, recorded (a resumed run keeps them: --adapter may be gone)
        cfg = settle_mode(cfg, given or frozenset())
    return absolute_paths(cfg)


@contextlib.contextmanager
def run_directory_lock(out_dir: Path, rt: Runtime) -> Iterator[None]:
    """Rank 0 holds the run directory's lock (rundir.RunLock) inside the block; every rank raises the same one-line
    error when another run holds it."""
    lock = RunLock(out_dir)
    outcome: list = [None]
    if rt.rank == 0:
        try:
            if note := lock.acquire():
                print(note)
        except OSError as e:
            outcome = [e]
    if dist.is_initialized():
        dist.broadcast_object_list(outcome, src=0)
    if outcome[0] is not None:
        raise outcome[0]
    try:
        yield
    finally:
        lock.release()


def prepare_run(cfg: TrainConfig, rt: Runtime, task: Task) -> Run:
    """Everything a run needs, in this order (NothingToTrain when the checkpoint to resume has reached --max_steps):
    1. (resolved options, the run directory checked and locked: `resolve_run`, `run_directory_lock`) the
       fine-tuning mode checked (before anything is written or allocated);
    2. what --init_from holds (`storage.weights.stored`: layout, architecture, tokenizer) and the checkpoint to
       resume (`resume_point`), verified before anything is built;
    3. tokenizer and data (`prepare_data`): the tokenizer recorded with those weights, and the vocabulary sizes
       the model;
    4. the model, built and prepared by the mode (adapters exist before FSDP shards them), and the optimizer over
       what trains (the mode froze the rest);
    5. the base weights from --init_from (`load_base`; a frozen base always: checkpoints do not hold it), before
    6. the mode's own initialisation (adapters from the seed, or from --adapter unless a checkpoint is resumed;
       quantization last: it replaces the base weights that step 5 filled), before
    7. resume, which overwrites everything that trains, the optimizer, the schedule and the data position; only
       then are checkpoints moved aside or pruned (`settle_checkpoints`)."""
    if cfg.context_parallel != rt.context_ranks:
        raise ValueError(f"--context_parallel {cfg.context_parallel}, but the processes were set up for "
                         f"{rt.context_ranks} a sequence: build the runtime with init_runtime(cfg.context_parallel)")
    mode = finetune_mode(cfg)
    mode.check(rt.world_size)
    check_tracker(cfg.tracker)
    source = stored(cfg.init_from) if cfg.init_from else None  # what --init_from holds, checked
    stored_config = source.config if source else None
    if stored_config is not None:
        check_model_size(cfg, stored_config)
    resume_from = resume_point(cfg, rt)
    cfg, tokenizer, loader = prepare_data(cfg, rt, resume_from, source)
    base = {"path": str(Path(cfg.init_from).resolve()), "checksum": source.fingerprint()} \
        if mode.frozen_base and source else None
    adapted = {"checksum": base and base["checksum"], "tokenizer": tokenizer.sha256} if mode.frozen_base else None
    if cfg.adapter and not resume_from:  # a resumed run's checkpoint holds the adapters (and records its base)
        check_adapter_base(cfg.adapter, adapted)

    device_memory = torch.cuda.get_device_properties(rt.device).total_memory if rt.device.type == "cuda" else None
    model_config, compute = build_model_config(cfg, tokenizer.vocab_size, device_memory, rt.world_size,
                                               stored_config)

    if cfg.context_parallel > 1 and cfg.document_mask and model_config.attention_type == "nsa":
        raise ValueError("--document_mask with --context_parallel needs full attention: NSA does not split a "
                         "sequence shard into documents")
    model = task.build(model_config, compute, cfg, rt)
    check_vocab(tokenizer, model.config.vocab_size)
    optimizer, scheduler = build_optimizer(model, cfg)
    load_base(model, cfg, source, mode.frozen_base, resume_from, rt)
    mode.initialise(model, cfg.seed, resuming=resume_from is not None)
    run = Run(cfg, rt, task, mode, tokenizer, loader, model, optimizer, scheduler,
              torch.autocast(rt.device.type, dtype=torch.bfloat16) if cfg.dtype == "bfloat16" and rt.mesh is None
              else contextlib.nullcontext(), resume_from, {}, None,
              export_info(cfg, tokenizer, stored_config, adapted), base, shard=context_shard(rt, cfg.context_length))
    changed = resume(run) if resume_from else {}
    settle_checkpoints(cfg, rt, resume_from)

    if rt.device.type == "cuda" and cfg.max_memory:
        torch.cuda.set_per_process_memory_fraction(min(1.0, cfg.max_memory * GiB / device_memory), rt.device)
    run.task_state = task.start(model, cfg) if task.start else {}
    if resume_from:  # a task's own options too (train_npt.py's weights)
        changed |= task_changes(read_train_state(resume_from), run.task_state)
    if cfg.eval_interval:
        run.val_windows = validation_windows(cfg.data_dir, cfg.context_length, cfg.eval_tokens, cfg.seed,
                                             rt.data_rank, rt.data_ranks)
    if rt.rank == 0:
        start_run(run.out_dir, cfg, model, rt.world_size, resume_from, run.step, run.task_state, changed)
    return run


def export_info(cfg: TrainConfig, tokenizer: Tokenizer | HFTokenizer, stored: ModelConfig | None,
                adapted: dict | None = None) -> ExportInfo:
    """What this run's exports carry: its tokenizer; from --init_from, the base's special ids and generation
    config, and its context unless this run trained a longer one (a context extension); --export_dtype; for
    adapters, the frozen base they adapt (`adapted`)."""
    base = None if not cfg.init_from else Path(cfg.init_from) if Path(cfg.init_from).is_dir() else \
        Path(cfg.init_from).parent
    context = max(cfg.context_length, stored.context_length if stored else 0)
    return ExportInfo(tokenizer, base, context, getattr(torch, cfg.export_dtype), adapted)


def resume_point(cfg: TrainConfig, rt: Runtime) -> Path | None:
    """The verified checkpoint to resume (checkpoint_to_resume). NothingToTrain when it has reached --max_steps and
    the run's end is done; a run whose end (export) was interrupted, or whose export is damaged, is resumed to do it
    again. Nothing is moved or deleted here: that waits until the run is known good (`settle_checkpoints`)."""
    resume_from = checkpoint_to_resume(Path(cfg.out_dir), cfg.resume)
    say = print if rt.rank == 0 else (lambda message: None)
    if resume_from and (done := read_train_state(resume_from)["step"]) >= cfg.max_steps:
        damaged = damaged_export(Path(cfg.out_dir)) if done == cfg.max_steps else None
        if damaged:
            say(f"{damaged}: doing the run's end (its export) again")
            return resume_from
        if done > cfg.max_steps or finished_step(Path(cfg.out_dir)) == done:
            say(f"{resume_from} is step {done} of a run that has finished (--max_steps {cfg.max_steps}): nothing to "
                "train; pass a larger --max_steps to continue it")
            raise NothingToTrain(done)
        say(f"{resume_from} is the last step, but the run's end (its export) did not complete: doing it again")
    return resume_from


def settle_checkpoints(cfg: TrainConfig, rt: Runtime, resume_from: Path | None) -> None:
    """Once the run is prepared and its checkpoint loaded (a refused run changes nothing): the checkpoints newer
    than the one resumed move aside (a new timeline), stale and surplus ones are deleted."""
    if resume_from and rt.rank == 0 and (aside := start_timeline(Path(cfg.out_dir), resume_from)):
        print(f"resuming {resume_from.name}: its newer checkpoints, another timeline, moved to {aside}")
    prune_checkpoints(Path(cfg.out_dir), cfg.keep_checkpoints, resume_from)  # stale step-N.tmp, too many step-N


def load_base(model: Transformer, cfg: TrainConfig, source: Stored | None, frozen_base: bool,
              resume_from: Path | None, rt: Runtime) -> None:
    """Fill `model` from --init_from (`source`: what it holds, checked once in `prepare_run`) when the run starts
    from it, and always for a frozen base (checkpoints do not hold it); dense weights into NSA layers through
    nsa.from_dense, the one conversion allowed. Warns about a frozen random base."""
    say = print if rt.rank == 0 else (lambda message: None)
    if source is not None and (frozen_base or not resume_from):
        convert = None if source.config.attention_type == model.config.attention_type else (
            partial(nsa_state_from_dense, config=model.config))
        load_initial_weights(model, source, convert, FRESH if convert else ())
    elif frozen_base:
        say(f"warning: --finetune {cfg.finetune} without --init_from adapts a randomly initialised, frozen base")


def resume(run: Run) -> dict:
    """Load the checkpoint `run.resume_from` into the run (collective); returns what changed since it was saved
    ({option: [checkpoint value, new value]}): the optimizer options, which take effect
    (`apply_optimizer_options`), and what makes a step (batch size, accumulation, ranks)."""
    state = load_checkpoint(run.resume_from, run.model, run.optimizer)
    checksum = {name: base and base["checksum"] for name, base in (("saved", state.get("base")), ("now", run.base))}
    if run.mode.frozen_base and checksum["saved"] != checksum["now"]:  # the weights, wherever they lie now
        def name(base: dict | None) -> str:
            return "a random base (no --init_from)" if not base else f"{base['path']} (checksum {base['checksum']})"
        raise ValueError(f"{run.resume_from} adapts {name(state.get('base'))}, but this run's base is "
                         f"{name(run.base)}: resume with the --init_from it was trained on")
    run.step, run.bad_steps = state["step"], state["bad_steps"]
    run.scheduler.load_state_dict(state["scheduler"])
    run.loader.load_state_dict(state["loader"])
    changed = {**resume_changes(run.cfg, state["config"]),  # every option, announced and recorded
               **apply_optimizer_options(run.optimizer, run.scheduler, run.cfg, state["config"])}
    # What a step is: the tokens it trains on (a checkpoint of W ranks resumes on any number of ranks).
    now = {"batch_size": run.cfg.batch_size, "gradient_accumulation_steps": run.cfg.gradient_accumulation_steps,
           "world_size": run.rt.world_size, "context_parallel": run.cfg.context_parallel}
    saved = {"context_parallel": 1, **state["config"], "world_size": state["world_size"]}
    return {**changed, **{k: [saved.get(k), v] for k, v in now.items() if saved.get(k) != v}}


# ---- one step ------------------------------------------------------------------------------------------------


def forward_backward(model: Transformer, batches: list[list[Tensor]], autocast: contextlib.AbstractContextManager,
                     loss_fn: Loss = lm_loss, shard: SequenceShard | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """Accumulate into `.grad` the gradient of the step's loss from this rank's micro-batches `batches`
    (A x [input_ids, labels] each (B, T), and each row's document starts (B, T) with --document_mask: handed to
    `loss_fn`); return this rank's part of the loss and of the extra metrics (0-dim
    tensors; their sums over ranks are the step's values). The predicted-token count of the whole global batch is
    one all-reduce; FSDP sums the gradients over ranks (apply_fsdp(sum_gradients=True)). With a `shard` (context
    parallelism: `training.parallel.context_shard`), the rank's positions of every tensor are taken first, the
    labels shifted before (a shard's tokens are not contiguous), and handed to `loss_fn` with it."""
    if shard is not None:
        batches = [[shard.take(ids), shard.take(shift_labels(labels)), *map(shard.take, rest)]
                   for ids, labels, *rest in batches]
    n_tokens = sum(((labels if shard is not None else shift_labels(labels)) != IGNORE_INDEX).sum()
                   for _, labels, *_ in batches)
    if dist.is_initialized():
        dist.all_reduce(n_tokens)
    n_tokens = n_tokens.clamp(min=1).float()
    loss_sum, extras = torch.zeros((), device=n_tokens.device), {}
    sharded = {} if shard is None else {"shard": shard}
    for input_ids, labels, *doc_start in batches:
        with autocast:
            loss, metrics = loss_fn(model, input_ids, labels, n_tokens, len(batches), *doc_start, **sharded)
        loss.backward()
        loss_sum += loss.detach()
        for name, value in metrics.items():
            extras[name] = extras.get(name, 0) + value.detach()
    return loss_sum, extras


def train_step(run: Run, batches: list[list[Tensor]], flags: Callable[[], list[bool]]) -> tuple[dict, list[bool]]:
    """One optimizer step on this rank's micro-batches (A x [input_ids, labels]): forward and backward, gradient
    clipping, then the AdamW update, or a skip when the loss or the gradient norm is not finite (the schedule
    advances either way). `flags()`, this rank's requests read once the backward is done (a signal, a save due),
    are summed over ranks in the same all-reduce as the loss. Returns ({step, loss, extra metrics, lr, grad_norm,
    skipped}, each flag raised on any rank)."""
    cfg, model = run.cfg, run.model
    warm_up = exact_block_scores() if run.step < cfg.nsa_exact_selection_steps else contextlib.nullcontext()
    try:
        with warm_up:  # NSA's selection by exact block scores for the first steps (--nsa_exact_selection_steps)
            loss_sum, extras = forward_backward(model, batches, run.autocast, run.task.loss, run.shard)
    except torch.OutOfMemoryError as e:
        raise MemoryBudgetExceeded(f"out of memory at step {run.step + 1}: {memory_advice(cfg)}") from e
    grad_norm = torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad],
                                               cfg.grad_clip or math.inf)
    if isinstance(grad_norm, DTensor):
        grad_norm = grad_norm.full_tensor()
    flags = [float(flag) for flag in flags()]
    stats = torch.cat([loss_sum.reshape(1), torch.tensor(flags, device=run.rt.device),
                       *(value.reshape(1) for value in extras.values())])  # (1 + flags + extras,)
    if run.rt.mesh is not None:
        dist.all_reduce(stats)  # the global loss and metrics; a flag raised on any rank
    loss, *values = torch.cat([stats, grad_norm.reshape(1)]).tolist()  # the one host sync of the step
    flags, extra_values, norm = [bool(v) for v in values[:len(flags)]], values[len(flags):-1], values[-1]
    lr = run.scheduler.get_last_lr()[0]
    finite = math.isfinite(loss) and math.isfinite(norm)
    if finite:
        run.optimizer.step()
        run.bad_steps = 0
    else:
        run.bad_steps += 1
        tqdm.write(f"warning: step {run.step + 1}: non-finite loss {loss} or gradient norm {norm}; update skipped "
                   f"({run.bad_steps} in a row, limit --max_bad_steps {cfg.max_bad_steps})")
    run.optimizer.zero_grad(set_to_none=True)
    with warnings.catch_warnings():  # a skipped update still advances the schedule (no warning about it)
        warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler.step\(\)` before")
        run.scheduler.step()
    run.step += 1
    return {"step": run.step, "loss": loss, **dict(zip(extras, extra_values, strict=True)), "lr": lr,
            "grad_norm": norm, "skipped": not finite}, flags


def check_limits(run: Run, metrics: dict) -> None:
    """Stop a run that cannot go on: too many non-finite steps in a row, or the memory budget exceeded (after a
    checkpoint, so that it can continue with --resume)."""
    cfg = run.cfg
    if run.bad_steps >= cfg.max_bad_steps:
        raise TooManyBadSteps(f"{run.bad_steps} consecutive steps had a non-finite loss or gradient norm (last: step "
                              f"{run.step}); lower --lr (now {cfg.lr}) or --grad_clip, or resume from an earlier "
                              "checkpoint")
    if not cfg.max_memory:
        return
    over = torch.tensor(float(over_memory_budget(cfg, run.rt.device)), device=run.rt.device)
    if run.rt.mesh is not None:
        dist.all_reduce(over)
    if over.item():
        path = run.save()
        raise MemoryBudgetExceeded(f"peak memory {metrics['mem_peak_gib']:.2f} GiB exceeds --max_memory "
                                   f"{cfg.max_memory} GiB (step {run.step}, checkpoint {path}): {memory_advice(cfg)};"
                                   " then continue with --resume")


def observe(run: Run, step_metrics: dict, dt: float, previous: dict, leaks: LeakWatch) -> dict:
    """The step's metrics with throughput, memory (a warning when it keeps growing; the cache freed every
    --empty_cache_interval steps), MFU on GPUs and, every --eval_interval steps and at the end, the validation
    loss."""
    cfg, device = run.cfg, run.rt.device
    mem, mem_peak = memory_gib(device)
    metrics = {**step_metrics, "tokens_per_s": run.step_tokens / dt, "step_time_s": dt, "mem_gib": mem,
               "mem_peak_gib": mem_peak, "mem_growth_gib": mem - previous.get("mem_gib", mem)}
    if (reserved := reserved_gib(device)) is not None:
        metrics["mem_reserved_gib"] = reserved
    if run.rt.rank == 0 and (leak := leaks.update(run.step, mem)):
        tqdm.write(leak)
    if cfg.empty_cache_interval and run.step % cfg.empty_cache_interval == 0:
        free_cache(device)
    if peak := peak_flops(device, cfg.dtype):
        flops = flops_per_token(run.model.config, cfg.context_length)
        metrics["mfu"] = flops * run.step_tokens / dt / run.rt.world_size / peak
    if run.val_windows is not None and (run.step % cfg.eval_interval == 0 or run.step == cfg.max_steps):
        metrics["val_loss"] = validation_loss(run.model, run.val_windows, run.autocast,
                                              run.tokenizer.eod_id if cfg.document_mask else None, run.shard)
        metrics["val_perplexity"] = math.exp(min(metrics["val_loss"], 700))
    return metrics


# ---- the loop ------------------------------------------------------------------------------------------------


def run_command(cfg: TrainConfig, rt: Runtime, task: Task | None = None, given: frozenset[str] | None = None
                ) -> dict:
    """`train` as a command runs it: the process group torn down after (collective when the run succeeded)."""
    try:
        metrics = train(cfg, rt, task, given)
    except BaseException:
        if dist.is_initialized():
            dist.destroy_process_group()  # no barrier: the other ranks may never reach it
        raise
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    return metrics


@contextlib.contextmanager
def one_line_errors(verbose: bool = False) -> Iterator[None]:
    """For a command line (train.py, train_npt.py): a run stopped by its limits (non-finite steps, the
    memory budget, a failed save; saved where possible) exits 1 with one line; a bad input, or a damaged or unsafe
    checkpoint, exits 2 with one line (`verbose`: the traceback instead)."""
    try:
        yield
    except (MemoryBudgetExceeded, TooManyBadSteps, SaveFailed) as e:
        exit_with_error(f"stopped: {e}", code=1)
    except (ValueError, FileNotFoundError, FileExistsError, NotADirectoryError, PermissionError) as e:
        if verbose:
            raise
        exit_with_error(f"error: {e}")


def train(cfg: TrainConfig, rt: Runtime, task: Task | None = None, given: frozenset[str] | None = None) -> dict:
    """Run (or resume) training as configured; returns the last step's metrics. `given`: the options given on the
    command line (a resumed run takes the others from its record); None: all of them."""
    cfg = resolve_run(cfg, rt, given)
    with run_directory_lock(Path(cfg.out_dir), rt):
        try:
            run = prepare_run(cfg, rt, task or Task())
        except NothingToTrain as finished:
            return {"step": finished.step}
        try:
            return loop(run)
        except BaseException:
            if rt.rank == 0 and run.resume_from is None and run.step == 0:
                clear_unstarted(run.out_dir)  # a fresh run that never completed a step leaves nothing behind
            raise
        finally:
            if rt.device.type == "cuda" and cfg.max_memory:  # the budget was this run's, not the process's
                torch.cuda.set_per_process_memory_fraction(1.0, rt.device)


def loop(run: Run) -> dict:
    """The training loop of a prepared run, to --max_steps or a stop signal; returns the last step's metrics."""
    rt = run.rt
    cfg, main_rank, A = run.cfg, rt.rank == 0, run.cfg.gradient_accumulation_steps
    bar = tqdm(total=cfg.max_steps, initial=run.step, desc="training", unit="step", disable=not main_rank or None,
               dynamic_ncols=True)
    metrics: dict = {}
    leaks, last_save, stop, clock = LeakWatch(), time.monotonic(), False, Clock(run.step, cfg.max_steps)
    heartbeat = (Heartbeat(run.model.layers, cfg.heartbeat_seconds, A, cfg.gradient_checkpointing)
                 if main_rank and cfg.heartbeat_seconds else None)
    tracker = cfg.tracker if main_rank else None
    threads = ThreadPlan(rt.device)
    with stop_on_signals() as signals, tracking(tracker, run.out_dir, dataclasses.asdict(cfg), run.step) as track:
        def requests() -> list[bool]:  # read after each backward: a stop signal; a time-based save due
            minutes = (time.monotonic() - last_save) / 60
            return [signals["stop"], bool(cfg.checkpoint_minutes) and minutes >= cfg.checkpoint_minutes]

        while run.step < cfg.max_steps:
            t0 = time.perf_counter()
            if heartbeat:
                heartbeat.begin(run.step + 1)
            batches = [[t.to(rt.device, non_blocking=True) for t in next(run.loader)]  # A x [ids, labels] (B, T)
                       for _ in range(A)]
            if cfg.document_mask:  # each row's document starts (B, T), from its end-of-document ids
                batches = [[ids, labels, document_starts(ids, run.tokenizer.eod_id)] for ids, labels in batches]
            step_metrics, (stop, save_due) = train_step(run, batches, requests)
            if (change := threads.update()) and main_rank:
                tqdm.write(change)
            metrics = {**observe(run, step_metrics, time.perf_counter() - t0, metrics, leaks),
                       **clock.update(run.step)}
            if main_rank:
                log_step(metrics, cfg, run.out_dir / "metrics.jsonl", bar, clock.settled(run.step))
                track(metrics)
            check_limits(run, metrics)
            if stop or save_due or run.save_scheduled():
                path = run.save()
                last_save = time.monotonic()
                if main_rank:
                    tqdm.write(f"saved {path}")
            if stop:
                break
    bar.close()
    if heartbeat:
        heartbeat.remove()
    if not stop:
        run.task.finish(run)
        if main_rank:  # the end is done: a later --resume has nothing left to do
            (run.out_dir / FINISHED_NAME).write_text(json.dumps({"step": run.step}) + "\n")
            try:
                if curve := plot_loss_curve(run.out_dir / "metrics.jsonl", str(run.out_dir)):
                    print(f"wrote {curve} (the loss curve; every step's numbers are in metrics.jsonl)")
            except (OSError, ValueError) as e:  # the run is done: a plot that fails is a line, not an error
                print(f"warning: no loss.png ({type(e).__name__}: {e})")
    return metrics


def finished_step(out_dir: Path) -> int | None:
    """The step whose end (export, sample) a run in `out_dir` completed, or None."""
    try:
        return json.loads((out_dir / FINISHED_NAME).read_text())["step"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def generate_sample(model: Transformer, tokenizer: Tokenizer, cfg: TrainConfig, device: torch.device,
                    autocast: contextlib.AbstractContextManager) -> tuple[int, str]:
    """(tokens, text) of a sample decoded after the prompt: --sample_tokens, or by default up to 200 within the
    context (every rank runs it in lockstep under FSDP; the seed makes them agree)."""
    prompt = torch.tensor([tokenizer.encode(cfg.sample_prompt) or [tokenizer.eod_id]], device=device)  # (1, P)
    n = min(200, cfg.context_length - prompt.shape[1]) if cfg.sample_tokens is None else cfg.sample_tokens
    generator = torch.Generator(device).manual_seed(cfg.seed)
    with autocast:
        out = model.generate(prompt, n, temperature=0.8, top_k=50, eos_id=tokenizer.eod_id, generator=generator)
    return n, tokenizer.decode(out[0].tolist())
