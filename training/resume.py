"""A run's record and its resume: the options as a run records them (`record`: every path absolute), the options a
resumed run continues with (`continue_options`: those given, the others as recorded; what cannot change mid-run
refused with one line), and what a resume changes (`resume_changes`: every other option that differs from the
checkpoint's, announced and recorded by the trainer as a metrics line {"step", "resumed_with"})."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from modeling.objective import FIELDS as OBJECTIVE_FIELDS
from training.options import TrainConfig, finetune_class

PATH_OPTIONS = ("data_dir", "tokenizer", "init_from", "adapter")  # a file or a directory each (and out_dir)
# What a resumed run cannot change: they define its data, and the loader's position is a position in that data
# (its tokenizer is checked against the checkpoint's: run_data.resolve_tokenizer).
DATA_OPTIONS = ("data_dir", "seed", "synthetic_mix", "synthetic_task", "synthetic_pairs", "answer_loss")
# About one invocation, never taken from the record (the process layout is the launcher's: torchrun's processes and
# how they split each sequence).
NOT_CONTINUED = ("resume", "out_dir", "verbose", "context_parallel")
# What a resumed run cannot change either: the geometry of the adapters its checkpoints hold (rank, scale, places).
ADAPTER_OPTIONS = ("finetune", "lora_rank", "lora_alpha", "lora_targets", "npt_rank", "npt_layers", "npt_targets",
                   "npt_residual_mode")
# Nor the adapters it started from: the checkpoint holds them (--adapter's are not read). (A frozen base is read from
# --init_from again, and checked against the one the run recorded: storage.weights.)
START_OPTIONS = ("adapter",)


def absolute_paths(cfg: TrainConfig) -> TrainConfig:
    """cfg with the files and directories it reads (PATH_OPTIONS, and a --resume path) absolute, so that what a
    run records holds from any working directory (`record`)."""
    names = [*PATH_OPTIONS, *(["resume"] if cfg.resume not in (None, "auto") else [])]
    values = {name: str(Path(getattr(cfg, name)).resolve()) for name in names if getattr(cfg, name) is not None}
    return dataclasses.replace(cfg, **values)


def record(cfg: TrainConfig) -> dict:
    """The options as a run records them (config.json, every checkpoint): every path absolute, the run directory
    included."""
    return {**dataclasses.asdict(absolute_paths(cfg)), "out_dir": str(Path(cfg.out_dir).resolve())}


def continue_options(cfg: TrainConfig, given: frozenset[str], recorded: dict) -> TrainConfig:
    """The options of a resumed run: those given (`given`: in --config or on the command line) as they are (a
    dict-valued one merged over the recorded one key by key), the others as the run recorded them (`recorded`: the
    "train" section of its config.json), so that --resume continues a run as it was, from any working directory.
    ValueError, naming the option, when a given one would change the run's data (DATA_OPTIONS), its adapters
    (ADAPTER_OPTIONS), the adapters it started from (START_OPTIONS: a resumed run reads its checkpoint's instead)
    or, where every weight trains, the weights it started from (--init_from: another path only where the recorded
    one no longer exists)."""
    recorded = upgraded_record(recorded)
    names = {f.name for f in dataclasses.fields(TrainConfig)}
    weights = f"a new run from its weights (--init_from {Path(cfg.out_dir) / 'step-N'})"
    for fixed, what, instead in ((DATA_OPTIONS, "its data", weights),
                                 (ADAPTER_OPTIONS, "its adapters as they are", "a new run in another --out_dir"),
                                 (START_OPTIONS, "from its checkpoint's adapters", "a new run in another --out_dir")):
        for name in fixed:
            if name in given and name in recorded and not same_value(name, getattr(cfg, name), recorded[name]):
                raise ValueError(f"--{name} {getattr(cfg, name)}: the run in {cfg.out_dir} trains with "
                                 f"{recorded[name]}, and a resumed run continues {what}; leave --{name} out, or start "
                                 f"{instead}")
    # Where every weight trains, the checkpoint holds them all: --init_from gives only the architecture, tokenizer and
    # export details, and may name another path only where the recorded one is gone (moved). A frozen base is read
    # again, and its checksum checked against the run's (trainer.resume), wherever it lies.
    was = recorded.get("init_from")
    if "init_from" in given and not finetune_class(recorded.get("finetune", cfg.finetune)).frozen_base and \
            not same_value("init_from", cfg.init_from, was) and (was is None or Path(was).exists()):
        raise ValueError(f"--init_from {cfg.init_from}: the run in {cfg.out_dir} started from "
                         f"{was or 'a random initialisation'}, and a resumed run continues from its checkpoint's "
                         f"weights; leave --init_from out, or start {weights}")
    continued = {k: v for k, v in recorded.items() if k in names and k not in given and k not in NOT_CONTINUED}
    merged = {k: {**recorded[k], **getattr(cfg, k)} for k in given  # a dict-valued option: the given keys win
              if isinstance(recorded.get(k), dict) and isinstance(getattr(cfg, k), dict)}
    return dataclasses.replace(cfg, **continued, **merged)


def upgraded_record(recorded: dict) -> dict:
    """A run's recorded options in today's names: the objective's terms, which runs once recorded among their
    --model_overrides (ComputeConfig fields then), become the options of the same names."""
    overrides = recorded.get("model_overrides") or {}
    moved = {name: overrides[name] for name in OBJECTIVE_FIELDS if name in overrides}
    if not moved:
        return recorded
    kept = {name: value for name, value in overrides.items() if name not in moved}
    return {**recorded, **moved, "model_overrides": kept}


def same_value(name: str, value: object, recorded: object) -> bool:
    """Whether an option's value is what the run recorded: the same path (resolved), else equal."""
    if name in PATH_OPTIONS and value is not None and recorded is not None:
        return Path(value).resolve() == Path(recorded).resolve()
    return value == recorded


def task_changes(saved: dict, now: dict) -> dict:
    """{option: [the checkpoint's value, this run's]} of a task's own options (its state's sections, such as
    train_npt.py's "npt": what the checkpoint's train_state recorded, `saved`, against this run's, `now`)."""
    return {name: [saved[section][name], value] for section, options in now.items() if isinstance(options, dict)
            for name, value in options.items()
            if isinstance(saved.get(section), dict) and name in saved[section] and saved[section][name] != value}


def resume_changes(cfg: TrainConfig, saved: dict) -> dict:
    """{option: [the checkpoint's value, this run's]} of every option of `cfg` that differs from the options the
    checkpoint saved (`saved`: its record), but those about one invocation (NOT_CONTINUED). What cannot change
    mid-run never gets here: continue_options refuses it, and the checkpoint refuses another architecture."""
    saved = upgraded_record(saved)
    return {name: [saved[name], value] for name, value in record(cfg).items()
            if name in saved and name not in NOT_CONTINUED and not same_value(name, value, saved[name])}
