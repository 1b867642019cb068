"""Fine-tuning modes behind one interface (finetune.FinetuneMode) and a registry: every registered mode implements
it, a mode written only in the tests (norm_finetune.py, registered with one line) trains through train.main,
checkpoints only what it trains, resumes bitwise with the base from --init_from, and exports; options of another
mode are refused with the fix named."""

from __future__ import annotations

import json

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader

import train
from modeling.layers import RMSNorm
from storage.weights import load_model
from training.modes import FinetuneMode, finetune_mode
from training.options import FINETUNE_MODES, TrainConfig, finetune_class


def test_registered_modes_implement_the_protocol(norms):
    for name in FINETUNE_MODES:
        cls = finetune_class(name)
        assert isinstance(cls(TrainConfig(finetune=name)), FinetuneMode), name
        assert cls.name == name and isinstance(cls.frozen_base, bool) and isinstance(cls.options, tuple)
    with pytest.raises(ValueError, match="--finetune must be one of .*'norms'.*register_finetune"):
        finetune_class("bitfit")


def test_another_modes_options_are_refused():
    with pytest.raises(ValueError, match="--quantize_base is not an option of --finetune npt: pass --finetune lora"):
        finetune_mode(TrainConfig(finetune="npt", quantize_base="int8"))  # each mode checks its options


def test_a_mode_from_the_tests_trains_checkpoints_resumes_and_exports(norms, data_dir, tmp_path, capsys):
    common = ["--model_size", "tiny", "--context_length", "32", "--batch_size", "2", "--warmup_steps", "1",
              "--sample_tokens", "0", "--data_dir", str(data_dir)]
    train.main([*common, "--max_steps", "2", "--out_dir", str(tmp_path / "base")])
    base = tmp_path / "base" / "model"
    run = [*common, "--init_from", str(base), "--finetune", "norms", "--lr", "1e-2"]
    straight = train.main([*run, "--max_steps", "4", "--out_dir", str(tmp_path / "straight")])
    train.main([*run, "--max_steps", "2", "--checkpoint_interval", "2", "--out_dir", str(tmp_path / "resumed")])
    saved = FileSystemReader(tmp_path / "resumed" / "step-2").read_metadata().state_dict_metadata
    model_keys = {k.removeprefix("model.") for k in saved if k.startswith("model.")}
    before = load_model(base)
    norm_names = {f"{name}.weight" for name, m in before.named_modules() if isinstance(m, RMSNorm)}
    assert model_keys == norm_names  # the gains alone: the base is not in the checkpoint
    resumed = train.main([*run, "--max_steps", "4", "--out_dir", str(tmp_path / "resumed"), "--resume"])
    assert resumed["loss"] == straight["loss"]  # bitwise: the base came from --init_from again
    after = load_model(tmp_path / "straight" / "model")
    for name, p in after.state_dict().items():
        changed = not torch.equal(p, before.state_dict()[name])
        assert changed == (name in norm_names and "rope" not in name), name
    assert json.loads((tmp_path / "straight" / "config.json").read_text())["train"]["finetune"] == "norms"
