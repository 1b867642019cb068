"""Equivalence training: teach the converted layers of a model to reproduce the original model (npt.equivalence).

    python train_npt.py --config configs/npt_tiny.json                       # CPU, tiny model, seconds
    python train_npt.py --config configs/npt_4b.json --init_from CKPT_DIR    # one GPU, Qwen3-4B weights

It is train.py's loop with another `train.Task`: the options (every TrainConfig field plus the NPTConfig fields
below, from a JSON file and the command line: defaults < file < command line), the data, AdamW with the warmup +
cosine schedule, checkpoints and resume, the non-finite-step skip, the memory budget, the checkpoint guard and the
signals are train.py's, and so is the model: `--finetune npt` (always, here) converts the `--npt_layers` with the
`--npt_*` options and freezes the base (bf16 with --dtype bfloat16). The task differs in two places: the loss (the
equivalence objective, gradients only for the NP parameters) and the end of the run (the NP parameters saved as
adapters instead of an export). One process (no FSDP: the frozen 4B base in bf16 fits one GPU). Continue from the
adapters with `train.py --finetune npt --adapter OUT_DIR` on the language-modelling loss.

Writes to out_dir: config.json and metrics.jsonl (metrics add mse, kl, l2), npt_config.json, step-N/ (full
resumable state), adapters.safetensors (only the NP parameters, see npt.adapters).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import typing
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from model import Transformer
from modeling.config import ComputeConfig, ModelConfig
from modeling.objective import FIELDS as OBJECTIVE_FIELDS
from npt.adapters import ADAPTERS_NAME, save_adapters
from npt.convert import np_blocks, np_parameters
from npt.equivalence import equivalence_loss
from training.cli import load_plugins
from training.options import (
    TrainConfig,
    build_parser,
    check_real,
    default_out_dir,
    field_help,
    load_config_file,
    merged_options,
    option,
    resolve_config,
)
from training.parallel import Runtime, init_runtime
from training.trainer import Run, Task, build_model, one_line_errors, run_command

# train.py's options of the language-modelling task, which equivalence training does not run.
LANGUAGE_MODELLING = ("loss", "answer_loss", "sample_tokens", "sample_prompt", "nsa_exact_selection_steps",
                      *OBJECTIVE_FIELDS)


@dataclass
class NPTConfig:
    """The equivalence objective; keys of the same JSON file as the TrainConfig options (the conversion: --npt_*)."""

    offload: bool = option(False, "keep tensors saved for backward by converted layers in CPU memory")
    mse_weight: float = option(1.0, "weight of the per-layer output MSE")
    kl_weight: float = option(1.0, "weight of KL(original || converted) of the next-token distributions")
    l2_weight: float = option(1e-4, "weight of the modulation penalty ||dW(token)||_F^2")
    kl_chunk_size: int = option(1024, "tokens per chunk of the KL (bounds the logits held at once)")

    def __post_init__(self) -> None:
        for name in ("mse_weight", "kl_weight", "l2_weight"):
            check_real(name, getattr(self, name), math.inf, zero_allowed=True)
        if self.mse_weight == self.kl_weight == self.l2_weight == 0:  # a run that would change nothing
            raise ValueError("--mse_weight, --kl_weight and --l2_weight are all 0: the objective has no term and the "
                             "adapters would not change; give --mse_weight or --kl_weight a weight > 0")
        if self.kl_chunk_size < 1:
            raise ValueError(f"--kl_chunk_size must be >= 1, got {self.kl_chunk_size}")


def parse_config(argv: list[str] | None = None) -> tuple[TrainConfig, NPTConfig, frozenset[str]]:
    """(TrainConfig, NPTConfig, the options given) from `--config FILE` (JSON or TOML, fields of either) and the
    command line."""
    parser = build_parser()  # every TrainConfig option, and --config
    group = parser.add_argument_group("neuro-plastic conversion and equivalence objective")
    hints = typing.get_type_hints(NPTConfig)
    for f in dataclasses.fields(NPTConfig):
        kind = hints[f.name]
        kwargs = {"action": argparse.BooleanOptionalAction} if kind is bool else {"type": kind}
        group.add_argument(f"--{f.name}", help=field_help(f), **kwargs)
    args = vars(parser.parse_args(argv))  # only what was given (the parser's default is SUPPRESS)
    args.pop("plugin", None)  # loaded by main
    try:
        source = args.pop("config", None)
        given = merged_options(load_config_file(source, TrainConfig, NPTConfig) if source else {}, args, source)
    except (ValueError, FileNotFoundError) as e:
        parser.error(str(e))
    values = {"finetune": "npt", **given}
    if values["finetune"] != "npt":
        parser.error(f"equivalence training trains NPT layers: --finetune must be npt, got {values['finetune']!r}")
    if values.get("document_mask"):
        parser.error("--document_mask: equivalence training matches the dense model on whole rows, its objective "
                     "reads no document starts; leave it out")
    unread = [name for name in LANGUAGE_MODELLING if name in given and (name, values[name]) != ("sample_tokens", 0)]
    if unread:  # (--sample_tokens 0 asks for no sample, as here)
        parser.error(f"--{unread[0]} has no effect here: equivalence training minimises the equivalence loss (no "
                     "labels, no language-modelling loss or its terms, adapters and no sample at the end); leave it "
                     "out")
    if values.get("offload") and not torch.cuda.is_available():
        parser.error("--offload has no effect without a GPU: it moves what converted layers save for backward from "
                     "a GPU to host memory; leave it out")
    npt_names = {f.name for f in dataclasses.fields(NPTConfig)}
    try:
        npt_cfg = NPTConfig(**{k: v for k, v in values.items() if k in npt_names})
        cfg = TrainConfig(**{k: v for k, v in values.items() if k not in npt_names})
    except ValueError as e:
        parser.error(str(e))
    return cfg, npt_cfg, frozenset(given)


def continued_npt_options(cfg: TrainConfig, npt_cfg: NPTConfig, given: frozenset[str], rt: Runtime) -> NPTConfig:
    """For --resume: the equivalence options the run recorded (npt_config.json, which config.json's "npt" repeats),
    but those given (each one that differs from the checkpoint's is announced and recorded: resume.task_changes)."""
    out_dir = Path(cfg.out_dir) if cfg.out_dir != "auto" else default_out_dir(resolve_config(cfg, rt.device,
                                                                                           lambda m: None))
    recorded = json.loads((out_dir / "npt_config.json").read_text()) if (out_dir / "npt_config.json").is_file() \
        else {}
    names = {f.name for f in dataclasses.fields(NPTConfig)}
    return dataclasses.replace(npt_cfg, **{k: v for k, v in recorded.items() if k in names and k not in given})


def equivalence_task(npt_cfg: NPTConfig) -> Task:
    """train.Task of equivalence training: build and convert the model, the equivalence loss, adapters at the end."""

    def build(model_config: ModelConfig, compute: ComputeConfig, cfg: TrainConfig, rt: Runtime) -> Transformer:
        model = build_model(model_config, compute, cfg, rt)  # converted; train() loads --init_from into its base
        for block in np_blocks(model).values():
            block.offload = npt_cfg.offload
        return model

    def loss(model: Transformer, input_ids: Tensor, labels: Tensor, n_tokens: Tensor, n_micro: int
             ) -> tuple[Tensor, dict[str, Tensor]]:
        parts = equivalence_loss(model, input_ids, npt_cfg.mse_weight, npt_cfg.kl_weight, npt_cfg.l2_weight,
                                 npt_cfg.kl_chunk_size)
        return parts.total / n_micro, {"mse": parts.mse / n_micro, "kl": parts.kl / n_micro, "l2": parts.l2 / n_micro}

    def start(model: Transformer, cfg: TrainConfig) -> dict:
        n_params = sum(p.numel() for p in np_parameters(model).values())
        npt_state = {**dataclasses.asdict(npt_cfg), "np_parameters": n_params}
        out_dir = Path(cfg.out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "npt_config.json").write_text(json.dumps(npt_state, indent=1))
        print(f"{npt_state['np_parameters'] / 1e6:.3f}M NP parameters train in layers {sorted(np_blocks(model))}")
        return {"npt": npt_state}

    def finish(run: Run) -> None:
        save_adapters(run.model, run.out_dir / ADAPTERS_NAME, run.export.adapter_metadata())
        print(f"saved the NP parameters to {run.out_dir / ADAPTERS_NAME}")

    return Task(build=build, loss=loss, start=start, finish=finish)


def main(argv: list[str] | None = None) -> dict:
    """Parse the options, run (or resume, with the options it recorded) equivalence training; returns the last
    step's metrics."""
    load_plugins(argv)
    cfg, npt_cfg, given = parse_config(argv)
    if cfg.context_parallel > 1:
        raise ValueError("train_npt.py trains on whole sequences: its equivalence loss compares a sequence's "
                         "outputs with the base's; leave out --context_parallel")
    rt = init_runtime()
    if cfg.resume:
        npt_cfg = continued_npt_options(cfg, npt_cfg, given, rt)
    return run_command(cfg, rt, equivalence_task(npt_cfg), given)


if __name__ == "__main__":
    with one_line_errors("--verbose" in sys.argv[1:]):
        main()
