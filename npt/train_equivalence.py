"""Equivalence training: teach the converted layers of a model to reproduce the original model (npt.equivalence).

    python -m npt.train_equivalence --config configs/npt_tiny.json                       # CPU, tiny model, seconds
    python -m npt.train_equivalence --config configs/npt_4b.json --init_from CKPT_DIR    # one GPU, Qwen3-4B weights

Reuses train.py's machinery rather than copying it: the options (every TrainConfig field, plus the NPTConfig
fields below, from a JSON file and the command line: defaults < file < command line), `resolve_config`, the runtime,
the data (default corpus, tokenizer, TokenLoader), `build_model`, `build_optimizer` (AdamW + warmup/cosine), the
DCP checkpoints of checkpoint.py (resume with --resume), `start_run`, `log_step`, `memory_gib`, `stop_on_signals`.
The step is its own: the equivalence loss instead of the LM loss, gradients only for the NP parameters (the base
is frozen, in `base_dtype`). One process (no FSDP: the frozen 4B base in bf16 fits one GPU).

Writes to out_dir: config.json and metrics.jsonl (train.start_run / log_step; metrics add mse, kl, l2),
npt_config.json, step-N/ (full resumable state), adapters.safetensors (only the NP parameters, see npt.adapters).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import time
import typing
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from data import TokenLoader
from npt.adapters import save_adapters
from npt.convert import convert, np_blocks, np_parameters
from npt.equivalence import equivalence_loss
from tokenizer import Tokenizer, check_vocab
from train import (
    Runtime,
    TrainConfig,
    build_model,
    build_model_config,
    build_optimizer,
    build_parser,
    ensure_default_data,
    init_runtime,
    log_step,
    memory_gib,
    resolve_config,
    start_run,
    stop_on_signals,
    tokenizer_path,
)

ADAPTERS_NAME = "adapters.safetensors"


def _opt(default: object, help: str) -> typing.Any:
    return field(default=default, metadata={"help": help})


@dataclass
class NPTConfig:
    """The conversion and the equivalence objective; keys of the same JSON file as the TrainConfig options."""

    layers: str | list = _opt("upper_half", "converted layers: 'upper_half', 'all' or a JSON list such as [4, 5]")
    rank: int = _opt(16, "r: rank of the modulation")
    targets: str = _opt("gate,up", "modulated FFN projections, comma-separated from gate, up, down")
    residual_mode: str = _opt("modulate", "'modulate' (attention only modulates the FFN) or 'additive'")
    base_dtype: str = _opt("auto", "frozen base weights: 'float32', 'bfloat16', or 'auto' = the resolved --dtype")
    offload: bool = _opt(False, "keep tensors saved for backward by converted layers in CPU memory")
    mse_weight: float = _opt(1.0, "weight of the per-layer output MSE")
    kl_weight: float = _opt(1.0, "weight of KL(original || converted) of the next-token distributions")
    l2_weight: float = _opt(1e-4, "weight of the modulation penalty ||dW(token)||_F^2")
    kl_chunk_size: int = _opt(1024, "tokens per chunk of the KL (bounds the logits held at once)")
    init_from: str | None = _opt(None, "Hugging Face checkpoint directory to convert (hf.py); default: a model "
                                       "initialised from --seed as train.py builds it")

    def __post_init__(self) -> None:
        if isinstance(self.layers, str) and self.layers.startswith("["):
            self.layers = json.loads(self.layers)
        if self.base_dtype not in ("auto", "float32", "bfloat16"):
            raise ValueError(f"--base_dtype must be 'auto', 'float32' or 'bfloat16', got {self.base_dtype!r}")
        for name in ("mse_weight", "kl_weight", "l2_weight"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"--{name} must be >= 0, got {getattr(self, name)}")
        if self.kl_chunk_size < 1:
            raise ValueError(f"--kl_chunk_size must be >= 1, got {self.kl_chunk_size}")


def parse_config(argv: list[str] | None = None) -> tuple[TrainConfig, NPTConfig]:
    """(TrainConfig, NPTConfig) from `--config FILE` (a JSON object holding fields of either) and the command line."""
    parser = build_parser()  # every TrainConfig option, and --config
    group = parser.add_argument_group("neuro-plastic conversion and equivalence objective")
    hints = typing.get_type_hints(NPTConfig)
    for f in dataclasses.fields(NPTConfig):
        kind = str if f.name in ("layers", "init_from") else hints[f.name]  # layers: a name or a JSON list
        kwargs = {"action": argparse.BooleanOptionalAction} if kind is bool else {"type": kind}
        group.add_argument(f"--{f.name}", help=f"{f.metadata['help']} (default: {f.default})", **kwargs)
    args = vars(parser.parse_args(argv))
    values = json.loads(Path(args.pop("config")).read_text()) if "config" in args else {}
    values.update(args)
    npt_names = {f.name for f in dataclasses.fields(NPTConfig)}
    try:
        npt_cfg = NPTConfig(**{k: v for k, v in values.items() if k in npt_names})
        cfg = TrainConfig(**{k: v for k, v in values.items() if k not in npt_names})
    except (ValueError, TypeError) as e:  # TypeError: an unknown option in the file
        parser.error(str(e))
    return cfg, npt_cfg


def build_converted_model(cfg: TrainConfig, npt_cfg: NPTConfig, rt: Runtime, vocab_size: int) -> torch.nn.Module:
    """The model (HF weights or train.py's seeded initialisation) with its layers converted and its base frozen."""
    base_dtype = torch.bfloat16 if (npt_cfg.base_dtype == "auto" and cfg.dtype == "bfloat16"
                                    or npt_cfg.base_dtype == "bfloat16") else torch.float32
    if npt_cfg.init_from:
        from hf import load_hf_checkpoint

        model = load_hf_checkpoint(npt_cfg.init_from, rt.device, dtype=base_dtype,
                                   context_length=cfg.context_length)
        model.gradient_checkpointing_enable(cfg.gradient_checkpointing)
    else:
        model = build_model(*build_model_config(cfg, vocab_size), cfg, rt)
    convert(model, npt_cfg.layers, rank=npt_cfg.rank, targets=tuple(npt_cfg.targets.split(",")),
            residual_mode=npt_cfg.residual_mode, base_dtype=base_dtype, offload=npt_cfg.offload)
    return model


def train_equivalence(cfg: TrainConfig, npt_cfg: NPTConfig, rt: Runtime) -> dict:
    """Run (or resume) equivalence training; returns {"first": metrics of step 1 (if run), "last": last step's}."""
    if rt.mesh is not None:
        raise ValueError("equivalence training runs in one process (no FSDP); launch it without torchrun")
    cfg = resolve_config(cfg, rt.device)
    out_dir = Path(cfg.out_dir)
    ensure_default_data(cfg, rt)
    tokenizer = Tokenizer(tokenizer_path(cfg))
    loader = TokenLoader(cfg.data_dir, cfg.context_length, cfg.batch_size, 0, 1, cfg.seed, tokenizer=tokenizer)
    model = build_converted_model(cfg, npt_cfg, rt, tokenizer.vocab_size)
    check_vocab(tokenizer, model.config.vocab_size)
    trainable = list(np_parameters(model).values())
    optimizer, scheduler = build_optimizer(model, cfg)  # frozen parameters get no gradient, hence no update
    step = 0
    resume_from = latest_checkpoint(out_dir) if cfg.resume == "auto" else cfg.resume and Path(cfg.resume)
    if resume_from:
        state = load_checkpoint(resume_from, model, optimizer)
        step = state["step"]
        scheduler.load_state_dict(state["scheduler"])
        loader.load_state_dict(state["loader"])
    start_run(out_dir, cfg, model, 1, resume_from, step)  # config.json, metrics.jsonl trimmed on resume
    npt_state = {**dataclasses.asdict(npt_cfg), "np_parameters": sum(p.numel() for p in trainable)}
    (out_dir / "npt_config.json").write_text(json.dumps(npt_state, indent=1))
    print(f"{npt_state['np_parameters'] / 1e6:.3f}M NP parameters train in layers {sorted(np_blocks(model))}")

    A = cfg.gradient_accumulation_steps
    step_tokens = A * cfg.batch_size * cfg.context_length
    history: dict = {}
    bar = tqdm(total=cfg.max_steps, initial=step, desc="equivalence", unit="step", dynamic_ncols=True)
    with stop_on_signals() as signals:
        while step < cfg.max_steps and not signals["stop"]:
            t0 = time.perf_counter()
            sums = torch.zeros(4, device=rt.device)  # total, mse, kl, l2 over the step's micro-batches
            for _ in range(A):
                input_ids, _labels = next(loader)
                loss = equivalence_loss(model, input_ids.to(rt.device, non_blocking=True), npt_cfg.mse_weight,
                                        npt_cfg.kl_weight, npt_cfg.l2_weight, npt_cfg.kl_chunk_size)
                (loss.total / A).backward()
                sums += torch.stack([loss.total.detach(), loss.mse, loss.kl, loss.l2]) / A
            grad_norm = torch.nn.utils.clip_grad_norm_(trainable, cfg.grad_clip or math.inf)
            total, mse, kl, l2, norm = [*sums.tolist(), grad_norm.item()]  # the step's one host sync
            if math.isfinite(total) and math.isfinite(norm):
                optimizer.step()
            else:
                tqdm.write(f"warning: step {step + 1}: non-finite loss {total} or gradient norm {norm}; skipped")
            optimizer.zero_grad(set_to_none=True)
            lr = scheduler.get_last_lr()[0]
            scheduler.step()
            step += 1
            dt = time.perf_counter() - t0
            mem, mem_peak = memory_gib(rt.device)
            metrics = {"step": step, "loss": total, "mse": mse, "kl": kl, "l2": l2, "lr": lr, "grad_norm": norm,
                       "tokens_per_s": step_tokens / dt, "step_time_s": dt, "mem_gib": mem, "mem_peak_gib": mem_peak}
            log_step(metrics, cfg, out_dir / "metrics.jsonl", bar)
            history.setdefault("first", metrics)
            history["last"] = metrics
            if signals["stop"] or step == cfg.max_steps or (cfg.checkpoint_interval
                                                             and step % cfg.checkpoint_interval == 0):
                train_state = {"step": step, "scheduler": scheduler.state_dict(), "loader": loader.state_dict(),
                               "npt": npt_state, "model_config": model.config.to_dict()}
                tqdm.write(f"saved {save_checkpoint(out_dir, step, model, optimizer, train_state)}")
    bar.close()
    save_adapters(model, out_dir / ADAPTERS_NAME)
    print(f"saved the NP parameters to {out_dir / ADAPTERS_NAME}")
    return history


def main(argv: list[str] | None = None) -> dict:
    cfg, npt_cfg = parse_config(argv)
    return train_equivalence(cfg, npt_cfg, init_runtime())


if __name__ == "__main__":
    main()
