"""A fine-tuning mode written only in the tests, to show that a new mode is one file and one registry line:
train the RMSNorm gains alone (a few hundred parameters of the tiny preset) on a frozen base.

    from training.options import register_finetune
    register_finetune("norms", "examples.norm_finetune:NormsOnly")    # then train.py --finetune norms --init_from ...
    # or, without editing anything: python train.py --plugin examples.norm_finetune --finetune norms ...

What it delivers is a whole model (its base plus the trained gains), exported like a full fine-tune.
"""

from __future__ import annotations

from pathlib import Path

from model import Transformer
from modeling.layers import RMSNorm
from storage.hf import ExportInfo
from storage.weights import export_model
from training.options import TrainConfig, register_finetune


class NormsOnly:
    """Only RMSNorm weights train; checkpoints hold them alone, resume takes the rest from --init_from."""

    name, frozen_base, options, description = "norms", True, (), "RMSNorm gains on a frozen base"

    def __init__(self, cfg: TrainConfig) -> None:
        pass

    def check(self, world_size: int) -> None:
        pass

    def prepare(self, model: Transformer) -> None:
        model.requires_grad_(False)
        for module in model.modules():
            if isinstance(module, RMSNorm):
                module.weight.requires_grad_(True)

    def initialise(self, model: Transformer, seed: int, resuming: bool = False) -> None:
        pass  # the gains start as the base's

    def export(self, model: Transformer, out_dir: Path, info: ExportInfo) -> list[Path]:
        return export_model(model, out_dir, info=info)


def register() -> None:
    """What `--plugin examples.norm_finetune` calls: the one registry line."""
    register_finetune("norms", NormsOnly)
