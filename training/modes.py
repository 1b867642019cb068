"""Fine-tuning modes: what a run trains and how it stores it, behind one interface (`FinetuneMode`) and a registry
(`FINETUNE_MODES`), as attention types are behind `attention.AttentionLayer` and `config.ATTENTION_TYPES`.

    full   every weight trains; checkpoints and the export hold the whole model
    lora   LoRA adapters (lora.py) on a frozen base, optionally quantized (quantize.py); the export is the adapters
           in peft's layout (OUT_DIR/adapter), and with --merge also the merged model
    npt    neuro-plastic FFN layers (npt/) on a frozen base; the export is the NP parameters (adapters.safetensors)

A mode is a class built from the run's TrainConfig. train.prepare_run calls it in this order:
`check` (before anything is built), `prepare` (on the meta device, before FSDP shards the model: new parameters
must exist to be sharded), base weights from --init_from, `initialise` (after the base weights, which it may
quantize or start adapters from; before resume, which overwrites what trains), resume, training, `export`.
A checkpoint always holds the parameters that train (requires_grad) and the optimizer state; with `frozen_base`
that is not the whole model, and resume rebuilds the base from --init_from.

`training.options.register_finetune("name", "module:Class")` adds a mode without editing this file
(examples/norm_finetune.py is a complete example: train only the RMSNorm gains).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Collection
from pathlib import Path
from typing import ClassVar, Protocol, runtime_checkable

import torch
from safetensors import safe_open

from model import Transformer
from npt.adapters import ADAPTERS_NAME, load_adapters, save_adapters
from npt.convert import convert
from storage.hf import ADAPTED_KEY, ExportInfo
from storage.weights import export_model
from training.lora import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    TARGETS,
    apply_lora,
    init_lora,
    load_adapter,
    merge_lora_,
    save_adapter,
)
from training.options import TrainConfig, check_mode_options, finetune_class
from training.quantize import quantize_base


@runtime_checkable
class FinetuneMode(Protocol):
    """What a fine-tuning mode implements. Class attributes:
    name: the --finetune value; frozen_base: the base does not train (checkpoints hold the trained parameters
    only, resume takes the base from --init_from, and with --dtype bfloat16 one process stores it in bf16);
    options: TrainConfig fields only this mode reads (another mode refuses them when they differ from the default);
    description: a phrase for summaries ("LoRA on a frozen base"). Optionally a static `settle(cfg, given)`: the
    options as the mode runs them (what its inputs fix, such as an adapter's rank), ValueError when one given (by
    name in `given`, even at its default value) conflicts; `settle_mode` calls it where a run's options are resolved
    (trainer.resolve_run, profile_memory.py), so the run records them and a resumed run keeps them."""

    name: ClassVar[str]
    frozen_base: ClassVar[bool]
    options: ClassVar[tuple[str, ...]]
    description: ClassVar[str]

    def __init__(self, cfg: TrainConfig) -> None: ...

    def check(self, world_size: int) -> None:
        """ValueError, before anything is built, when the mode cannot run on `world_size` processes."""

    def prepare(self, model: Transformer) -> None:
        """Add the mode's parameters (uninitialised is fine: the model may be on the meta device) and freeze what
        does not train."""

    def initialise(self, model: Transformer, seed: int, resuming: bool = False) -> None:
        """After the base weights are in place: give the mode's parameters their starting values (from `seed`, the
        same on every rank, or from --adapter) and change the frozen base where the mode does (quantization).
        `resuming`: a checkpoint restores the trained parameters next, so files they would start from (--adapter)
        are not read: they may be gone."""

    def export(self, model: Transformer, out_dir: Path, info: ExportInfo) -> list[Path]:
        """Write what a finished run delivers under `out_dir` (collective under FSDP), each directory with what
        `info` adds (the tokenizer; see hf.ExportInfo); the paths written on rank 0, [] elsewhere."""


class Full:
    """Every weight trains; the export is the whole model (weights.export_model)."""

    name, frozen_base, options, description = "full", False, (), ""

    def __init__(self, cfg: TrainConfig) -> None:
        pass

    def check(self, world_size: int) -> None:
        pass

    def prepare(self, model: Transformer) -> None:
        pass

    def initialise(self, model: Transformer, seed: int, resuming: bool = False) -> None:
        pass

    def export(self, model: Transformer, out_dir: Path, info: ExportInfo) -> list[Path]:
        return export_model(model, out_dir, info=info)


class LoRA:
    """LoRA adapters on the --lora_targets of every block (lora.py), the base frozen and optionally quantized."""

    name, frozen_base, description = "lora", True, "LoRA on a frozen base"
    options = ("lora_rank", "lora_alpha", "lora_targets", "quantize_base", "merge", "adapter")

    def __init__(self, cfg: TrainConfig) -> None:  # cfg settled (`settle_mode`): with --adapter, its geometry
        self.rank, self.alpha, self.targets = cfg.lora_rank, cfg.lora_alpha, tuple(cfg.lora_targets.split(","))
        self.quantize, self.merge, self.adapter, self.base = cfg.quantize_base, cfg.merge, cfg.adapter, cfg.init_from
        if self.quantize and self.merge:
            raise ValueError("--merge folds the adapters into the base, which --quantize_base keeps quantized: "
                             "merge with a float base (--adapter DIR --merge, without --quantize_base)")

    @staticmethod
    def settle(cfg: TrainConfig, given: Collection[str]) -> TrainConfig:
        """The options as this mode runs them: with an --adapter directory, its rank, alpha and targets, which the
        run records; ValueError when --lora_rank, --lora_alpha or --lora_targets differs from them and was given
        (even at its default value) or is not at its default."""
        if not (cfg.adapter and (Path(cfg.adapter) / ADAPTER_CONFIG).is_file()):
            return cfg
        rank, alpha, targets = adapter_geometry(Path(cfg.adapter), cfg, given)
        return dataclasses.replace(cfg, lora_rank=rank, lora_alpha=alpha, lora_targets=",".join(targets))

    def check(self, world_size: int) -> None:
        if self.quantize and world_size > 1:
            raise ValueError(f"--quantize_base runs in one process, and this run has {world_size} (torchrun's "
                             "processes, or profile_memory.py's --world_size): use one")

    def prepare(self, model: Transformer) -> None:
        apply_lora(model, self.rank, self.alpha, self.targets)

    def initialise(self, model: Transformer, seed: int, resuming: bool = False) -> None:
        init_lora(model, seed)
        if self.adapter and not resuming:
            load_adapter(model, self.adapter)
        if self.quantize:
            quantize_base(model, self.quantize)

    def export(self, model: Transformer, out_dir: Path, info: ExportInfo) -> list[Path]:
        written = [save_adapter(model, out_dir / "adapter", self.base, info)]
        if self.merge:
            merge_lora_(model)
            written += export_model(model, out_dir, base_only=True, info=info)
        return [p for p in written if p is not None]


def adapter_geometry(path: Path, cfg: TrainConfig, given: Collection[str] = ()) -> tuple[int, float, tuple[str, ...]]:
    """(rank, alpha, targets) of the peft adapter directory `path`; ValueError when --lora_rank, --lora_alpha or
    --lora_targets differs from them and is either named in `given` or not at its default value."""
    config = json.loads((path / ADAPTER_CONFIG).read_text())
    short = {module.rsplit(".", 1)[1]: name for name, module in TARGETS.items()}  # q_proj -> q
    try:
        found = (int(config["r"]), float(config["lora_alpha"]),
                 tuple(sorted(short[m] for m in config["target_modules"])))
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{path / ADAPTER_CONFIG} does not describe LoRA adapters this model has ({e!r})") from None
    defaults = {f.name: f.default for f in dataclasses.fields(cfg)}
    values = {"lora_rank": cfg.lora_rank, "lora_alpha": cfg.lora_alpha, "lora_targets": cfg.lora_targets}
    stored = {"lora_rank": found[0], "lora_alpha": found[1], "lora_targets": ",".join(found[2])}
    for name, value in values.items():
        same = sorted(value.split(",")) == sorted(stored[name].split(",")) if name == "lora_targets" else \
            value == stored[name]
        if (name in given or value != defaults[name]) and not same:
            raise ValueError(f"--{name} {value} differs from the adapters in {path} ({stored[name]}); leave it out "
                             "to take theirs")
    return found


class NPT:
    """Neuro-plastic FFN layers in --npt_layers (npt/convert.py), the base frozen; one process."""

    name, frozen_base, description = "npt", True, "NPT layers on a frozen base"
    options = ("npt_layers", "npt_rank", "npt_targets", "npt_residual_mode", "adapter")

    def __init__(self, cfg: TrainConfig) -> None:
        self.layers, self.rank = cfg.npt_layer_spec(), cfg.npt_rank
        self.targets, self.residual_mode, self.adapter = tuple(cfg.npt_targets.split(",")), cfg.npt_residual_mode, \
            cfg.adapter
        if not self.targets or not set(self.targets) <= {"gate", "up", "down"}:
            raise ValueError(f"--npt_targets must be comma-separated names from gate, up, down; got "
                             f"{cfg.npt_targets!r}")

    def check(self, world_size: int) -> None:
        if world_size > 1:
            raise ValueError(f"--finetune npt runs in one process, and this run has {world_size} (torchrun's "
                             "processes, or profile_memory.py's --world_size): use one")

    def prepare(self, model: Transformer) -> None:
        convert(model, self.layers, self.rank, self.targets, self.residual_mode)

    def initialise(self, model: Transformer, seed: int, resuming: bool = False) -> None:
        if self.adapter and not resuming:  # the NP parameters were initialised by convert
            adapter = Path(self.adapter)
            load_adapters(model, adapter / ADAPTERS_NAME if adapter.is_dir() else adapter)

    def export(self, model: Transformer, out_dir: Path, info: ExportInfo) -> list[Path]:
        save_adapters(model, out_dir / ADAPTERS_NAME, info.adapter_metadata())  # beside the run's config.json
        return [out_dir / ADAPTERS_NAME]


def adapter_base(path: str | Path) -> dict | None:
    """The base that the adapters at `path` (a LoRA directory, an NPT run directory or adapter file) were trained
    on, as their file records it (hf.ExportInfo.adapted); None when it records none (peft's own adapters)."""
    path = Path(path)
    file = next((f for f in (path / ADAPTER_WEIGHTS, path / ADAPTERS_NAME, path) if f.is_file()), None)
    if file is None:
        return None
    with safe_open(str(file), framework="pt") as f:
        recorded = (f.metadata() or {}).get(ADAPTED_KEY)
    return json.loads(recorded) if recorded else None


def check_adapter_base(path: str | Path, base: dict) -> None:
    """ValueError, one line, unless the adapters at `path` were trained on `base` ({"checksum", "tokenizer"}: this
    run's frozen base) or record no base."""
    recorded = adapter_base(path)
    if recorded is None or recorded == base:
        return

    def name(record: dict) -> str:
        weights = f"weights {record['checksum']}" if record.get("checksum") else "a random base"
        return f"{weights}, tokenizer {str(record.get('tokenizer'))[:12]}"
    raise ValueError(f"--adapter {path} was trained on another base ({name(recorded)}) than this run's "
                     f"({name(base)}): pass the --init_from (and tokenizer) it was trained on")


def settle_mode(cfg: TrainConfig, given: Collection[str] = ()) -> TrainConfig:
    """`cfg` with what its fine-tuning mode's inputs fix (the mode's optional `settle`: an --adapter's rank, alpha
    and targets), ValueError when an option in `given` conflicts with them."""
    settle = getattr(finetune_class(cfg.finetune), "settle", None)
    return settle(cfg, given) if settle else cfg


def finetune_mode(cfg: TrainConfig) -> FinetuneMode:
    """The run's mode, built from its options; ValueError naming an option that belongs to another mode only."""
    defaults = {f.name: f.default for f in dataclasses.fields(cfg)}
    check_mode_options(cfg.finetune, (name for name, default in defaults.items() if getattr(cfg, name) != default))
    return finetune_class(cfg.finetune)(cfg)


def cast_frozen_base(model: Transformer, dtype: torch.dtype) -> None:
    """Store the parameters that do not train in `dtype` (only trained weights need float32 masters)."""
    for p in model.parameters():
        if not p.requires_grad:
            p.data = p.data.to(dtype)  # tied weights are one Parameter: cast once
