"""LoRA adapters on a frozen base (https://arxiv.org/abs/2106.09685): y = W x + (alpha / r) B A x, with A (r, in)
and B (out, r) trained and W frozen. B starts at zero, so an adapted model starts equal to its base.

Names and files follow peft, so peft and transformers read the adapters this project writes:
    OUT_DIR/adapter/adapter_model.safetensors   base_model.model.<Hugging Face module name>.lora_A.weight / lora_B
    OUT_DIR/adapter/adapter_config.json         {"peft_type": "LORA", "r", "lora_alpha", "target_modules", ...}
In the model the LoRA weights are `<linear>.lora_A.weight` / `<linear>.lora_B.weight` beside the base `weight`,
whose name does not change (so base checkpoints load as they are).

Notation: r the rank, alpha the scale numerator; in / out the features of the adapted linear layer.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import Tensor, nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
from torch.distributed.tensor import DTensor, distribute_tensor

from model import Transformer
from storage.checkpoint import rank
from storage.hf import WEIGHTS_ONLY, ExportInfo, hf_name, our_name
from storage.manifest import MANIFEST_NAME, verify_files, written_directory

TARGETS = {"q": "attn.q_proj", "k": "attn.k_proj", "v": "attn.v_proj", "o": "attn.o_proj",
           "gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj"}  # short name -> path in a block
ADAPTER_WEIGHTS, ADAPTER_CONFIG = "adapter_model.safetensors", "adapter_config.json"
_PEFT_PREFIX = "base_model.model."


class LoRALinear(nn.Linear):
    """A bias-free linear layer whose frozen `weight` is adapted by `lora_B(lora_A(x)) * alpha / r`. Built from an
    existing layer, sharing its weight; the adapter weights are allocated uninitialised (`init_lora`)."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float) -> None:
        nn.Module.__init__(self)
        if base.bias is not None:
            raise ValueError("LoRA adapts bias-free linear layers only")
        self.in_features, self.out_features, self.rank, self.scale = base.in_features, base.out_features, rank, \
            alpha / rank
        self.weight = base.weight
        self.register_parameter("bias", None)
        kwargs = {"device": base.weight.device, "dtype": base.weight.dtype}
        self.lora_A = nn.Linear(self.in_features, rank, bias=False, **kwargs)
        self.lora_B = nn.Linear(rank, self.out_features, bias=False, **kwargs)

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, self.weight) + self.lora_B(self.lora_A(x)) * self.scale


def apply_lora(model: Transformer, rank: int = 16, alpha: float = 32.0, targets: tuple[str, ...] = ("q", "k", "v", "o")
               ) -> list[str]:
    """Replace the `targets` (keys of TARGETS) of every block by LoRALinear and freeze everything else. Works on the
    meta device (before FSDP); the adapter weights are initialised by `init_lora`. Returns the adapted module names."""
    unknown = sorted(set(targets) - set(TARGETS))
    if unknown or not targets:
        raise ValueError(f"LoRA targets must be a non-empty subset of {sorted(TARGETS)}, got {list(targets)}")
    if rank < 1 or not alpha > 0:
        raise ValueError(f"LoRA needs rank >= 1 and alpha > 0, got rank {rank}, alpha {alpha}")
    model.requires_grad_(False)
    adapted = []
    for i, block in enumerate(model.layers):
        for target in targets:
            parent_path, attr = TARGETS[target].split(".")
            parent = getattr(block, parent_path)
            if not isinstance(getattr(parent, attr, None), nn.Linear):
                raise ValueError(f"layers.{i}.{TARGETS[target]} is not a linear layer: LoRA target {target!r} does "
                                 f"not apply to {type(parent).__name__}")
            base = getattr(parent, attr)
            if rank > min(base.in_features, base.out_features):
                raise ValueError(f"--lora_rank {rank} exceeds the smaller side of layers.{i}.{TARGETS[target]} "
                                 f"({base.in_features} -> {base.out_features}): a rank above it adds parameters and no "
                                 f"capacity; use at most {min(base.in_features, base.out_features)}")
            layer = LoRALinear(base, rank, alpha)
            layer.weight.requires_grad_(False)
            setattr(parent, attr, layer)
            adapted.append(f"layers.{i}.{TARGETS[target]}")
    return adapted


def lora_layers(model: nn.Module) -> dict[str, LoRALinear]:
    return {name: m for name, m in model.named_modules() if isinstance(m, LoRALinear)}


def init_lora(model: nn.Module, seed: int) -> None:
    """Initialise every adapter as peft does (A: Kaiming-uniform, like nn.Linear; B: zero), from `seed` alone, the
    same on every rank: full tensors are made on the CPU and loaded (into FSDP2's shards when sharded)."""
    generator = torch.Generator().manual_seed(seed)
    state = {}
    for name, layer in lora_layers(model).items():
        bound = 1 / math.sqrt(layer.in_features)  # kaiming_uniform_(a=sqrt(5)) of an (r, in) weight
        uniform = torch.rand(layer.rank, layer.in_features, generator=generator)  # (r, in)
        state[f"{name}.lora_A.weight"] = (uniform * 2 - 1) * bound
        state[f"{name}.lora_B.weight"] = torch.zeros(layer.out_features, layer.rank)
    _load(model, state)


def _load(model: nn.Module, state: dict[str, Tensor]) -> None:
    """Load full (unsharded) `state` entries into `model`, plain or FSDP2-sharded; other parameters are left."""
    set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True, strict=False))


def save_adapter(model: nn.Module, path: str | Path, base: str | None = None,
                 info: ExportInfo = WEIGHTS_ONLY) -> Path | None:
    """Write the adapters of `model` in peft's layout to directory `path` (collective under FSDP; rank 0 writes).
    `base`: recorded as base_model_name_or_path; `info`: the tokenizer written beside them. Returns the directory
    on rank 0."""
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True,
                                                                 ignore_frozen_params=True))
    if rank() != 0:
        return None
    layers = lora_layers(model)
    if not layers:
        raise ValueError("the model has no LoRA adapters to save")
    any_layer = next(iter(layers.values()))
    path = Path(path)
    tensors = {_PEFT_PREFIX + hf_name(name): t.contiguous() for name, t in state.items() if ".lora_" in name}
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": any_layer.rank,
              "lora_alpha": any_layer.scale * any_layer.rank, "lora_dropout": 0.0, "bias": "none",
              "target_modules": sorted({name.rsplit(".", 1)[1] for name in layers}), "fan_in_fan_out": False,
              "base_model_name_or_path": base, "inference_mode": True}
    with written_directory(path) as tmp:  # whole or not at all, with a manifest.json
        save_file(tensors, tmp / ADAPTER_WEIGHTS, metadata={"format": "pt", **info.adapter_metadata()})
        (tmp / ADAPTER_CONFIG).write_text(json.dumps(config, indent=1) + "\n")
        info.write_tokenizer(tmp, info.model_config(model.config).context_length)
    return path


def load_adapter(model: nn.Module, path: str | Path) -> None:
    """Load only the adapter tensors of peft-layout directory `path` into the LoRA layers of `model` (plain or
    sharded; every rank reads the small file). The adapted modules, rank and alpha must match."""
    path = Path(path)
    file, config_file = path / ADAPTER_WEIGHTS, path / ADAPTER_CONFIG
    for f in (file, config_file):
        if not f.is_file():
            raise FileNotFoundError(f"{f} does not exist: --adapter takes a directory written by a LoRA run "
                                    "(OUT_DIR/adapter) or by peft")
    if (path / MANIFEST_NAME).is_file():  # written by this project: checked; peft's own directories have none
        verify_files(path)
    config, layers = json.loads(config_file.read_text()), lora_layers(model)
    any_layer = next(iter(layers.values()), None)
    if any_layer is None or config.get("r") != any_layer.rank or config.get("lora_alpha") != any_layer.scale * \
            any_layer.rank:
        raise ValueError(f"{config_file}: r={config.get('r')}, lora_alpha={config.get('lora_alpha')} but the model "
                         + ("has no LoRA layers" if any_layer is None else
                            f"has r={any_layer.rank}, lora_alpha={any_layer.scale * any_layer.rank}")
                         + ": pass the same --lora_rank, --lora_alpha and --lora_targets")
    state = {our_name(name.removeprefix(_PEFT_PREFIX)): t for name, t in load_file(file).items()}
    expected = {f"{name}.lora_{x}.weight" for name in layers for x in "AB"}
    if set(state) != expected:
        raise ValueError(f"{file} adapts other modules than the model: only in the file "
                         f"{sorted(set(state) - expected)[:5]}, only in the model {sorted(expected - set(state))[:5]}")
    _load(model, state)


@torch.no_grad()
def merge_lora_(model: nn.Module) -> None:
    """Fold every adapter into its base weight in place, W += (alpha / r) B A, and zero B: the model computes what
    it computed, as base weights alone (export them with `weights.export_model(..., base_only=True)`). Plain
    or FSDP2-sharded (collective then: one layer's full update at a time)."""
    for layer in lora_layers(model).values():
        A, B, W = layer.lora_A.weight, layer.lora_B.weight, layer.weight
        if isinstance(W, DTensor):
            delta = (B.full_tensor() @ A.full_tensor()) * layer.scale  # (out, in)
            W.add_(distribute_tensor(delta, W.device_mesh, W.placements))
        else:
            W.add_((B @ A) * layer.scale)
        B.zero_()
