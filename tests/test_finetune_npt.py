"""train.py --finetune npt: neuro-plastic layers (npt/) on a frozen --init_from base, trained on the language-modelling
loss; only the NP parameters are optimised and checkpointed, resume takes the base from --init_from again (bitwise
equal to a run without the interruption), the adapters come out as npt.adapters' file and --adapter loads them."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_init_from import T
from torch.distributed.checkpoint import FileSystemReader

import train
from npt.adapters import ADAPTERS_NAME
from training import parallel, trainer
from training.modes import finetune_mode
from training.options import TrainConfig, parse_config


def test_npt_run_trains_and_checkpoints_only_the_np_parameters(qwen3, tmp_path: Path):
    model_dir, data_dir = qwen3
    run = ["--init_from", str(model_dir), "--data_dir", str(data_dir), "--context_length", str(T), "--batch_size", "2",
           "--sample_tokens", "4", "--finetune", "npt", "--npt_layers", "1", "--npt_rank", "4", "--lr", "1e-2",
           "--warmup_steps", "1"]
    first = train.main([*run, "--max_steps", "3", "--checkpoint_interval", "2", "--out_dir", str(tmp_path / "a")])
    saved = FileSystemReader(tmp_path / "a" / "step-2").read_metadata().state_dict_metadata
    model_keys = {k.removeprefix("model.") for k in saved if k.startswith("model.")}
    assert model_keys and all(k.startswith("layers.1.np.") for k in model_keys)  # no base weight
    adapters = load_file(tmp_path / "a" / ADAPTERS_NAME)
    assert set(adapters) == model_keys
    # Resume: the base from --init_from again, the NP parameters and AdamW from the checkpoint; bitwise.
    resumed = train.main([*run, "--max_steps", "3", "--out_dir", str(tmp_path / "a"), "--resume",
                          str(tmp_path / "a" / "step-2")])
    straight = train.main([*run, "--max_steps", "3", "--out_dir", str(tmp_path / "b")])
    assert resumed["loss"] == straight["loss"] == first["loss"]
    # --adapter (a run directory or its file) loads them back: with a vanishing learning rate they stay as they were.
    train.main([*run, "--max_steps", "1", "--lr", "1e-12", "--adapter", str(tmp_path / "a"),
                "--out_dir", str(tmp_path / "c")])
    again = load_file(tmp_path / "c" / ADAPTERS_NAME)
    for name, value in adapters.items():
        torch.testing.assert_close(again[name], value, rtol=0, atol=1e-9)
    # A run started from --adapter resumes from its checkpoint after that file is gone: bitwise.
    start = tmp_path / "start.safetensors"
    shutil.copyfile(tmp_path / "a" / ADAPTERS_NAME, start)
    whole = train.main([*run, "--max_steps", "2", "--checkpoint_interval", "1", "--adapter", str(start),
                        "--out_dir", str(tmp_path / "d")])
    start.unlink()
    resumed = train.main([*run, "--max_steps", "2", "--out_dir", str(tmp_path / "d"), "--resume",
                          str(tmp_path / "d" / "step-1")])
    assert resumed["loss"] == whole["loss"]


@pytest.mark.parametrize("options, match", [
    ({"finetune": "full", "adapter": "x"}, "pass --finetune lora or --finetune npt"),
    ({"finetune": "npt", "merge": True}, "--merge is not an option of --finetune npt: pass --finetune lora"),
    ({"finetune": "full", "lora_rank": 8}, "--lora_rank is not an option of --finetune full"),
    ({"finetune": "lora", "npt_layers": "1"}, "--npt_layers is not an option of --finetune lora"),
    ({"finetune": "npt", "npt_layers": "top"}, "--npt_layers must be"),
    ({"finetune": "npt", "npt_targets": "gate,q"}, "--npt_targets must be"),
    ({"finetune": "npt", "npt_residual_mode": "add"}, "--npt_residual_mode must be one of"),
    ({"finetune": "npt", "npt_rank": 0}, "--npt_rank must be >= 1"),
])
def test_npt_options_are_checked(options: dict, match: str):
    with pytest.raises(ValueError, match=match):
        finetune_mode(TrainConfig(**options))


@pytest.mark.parametrize("finetune", ["lora", "npt"])
def test_a_frozen_base_is_stored_in_bf16(qwen3, tmp_path: Path, finetune: str):
    """One process with --dtype bfloat16: the frozen base in bf16 (half the bytes), the adapters in float32 masters,
    and the first loss within 1% of the float32 run's."""
    model_dir, data_dir = qwen3
    run = ["--init_from", str(model_dir), "--data_dir", str(data_dir), "--context_length", str(T), "--batch_size", "2",
           "--sample_tokens", "0", "--finetune", finetune, "--max_steps", "1", "--checkpoint_interval", "0"]
    built = {}

    def build(*args):
        built["model"] = trainer.build_model(*args)
        return built["model"]

    losses = {dtype: trainer.train(parse_config([*run, "--dtype", dtype, "--out_dir", str(tmp_path / dtype)]),
                                 parallel.init_runtime(), trainer.Task(build=build))["loss"]
              for dtype in ("float32", "bfloat16")}
    dtypes = {p.dtype for p in built["model"].parameters() if not p.requires_grad}
    assert dtypes == {torch.bfloat16}
    assert {p.dtype for p in built["model"].parameters() if p.requires_grad} == {torch.float32}
    assert abs(losses["bfloat16"] - losses["float32"]) < 0.01 * losses["float32"]


def test_equivalence_training_is_an_npt_run():
    """train_npt.py runs with --finetune npt (so a resume takes the frozen base from --init_from again, as
    above) and the same --npt_* options; another --finetune is refused."""
    from train_npt import parse_config as parse_equivalence

    cfg, _, given = parse_equivalence(["--config", "configs/npt_tiny.json", "--npt_layers", "0,1"])
    assert "npt_layers" in given and "model_size" in given  # the file's and the command line's
    assert (cfg.finetune, cfg.npt_layer_spec(), cfg.npt_targets) == ("npt", [0, 1], "gate,up")
    with pytest.raises(SystemExit):
        parse_equivalence(["--config", "configs/npt_tiny.json", "--finetune", "lora"])
