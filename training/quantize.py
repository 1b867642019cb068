"""Weight-only quantization of a frozen base (train.py --quantize_base, for --finetune lora), with torchao.

torchao rather than bitsandbytes: it is PyTorch's own library, pure tensor subclasses that run on the CPU (so the
tests run here) and on CUDA, and it composes with autograd for the activations (the frozen weights get no gradient).
Only the linear layers inside the blocks are quantized (attention projections, FFN); the embedding, the output
layer, the norms and the LoRA adapters stay as they are.
- "int8": per-channel int8 weights (Int8WeightOnlyConfig): a quarter of float32, half of bf16.
- "nf4": QLoRA's 4-bit NormalFloat (torchao's NF4Tensor): blocks of 64 values, two per byte on every device, with
  their scales quantized again to int8; about 26% of bf16. The weight is dequantized to the activations' dtype for
  each matmul.
- "int4": 4-bit integer weights in groups of 32 with a scale each. On CUDA torchao packs two per byte
  (Int4WeightOnlyConfig, bf16 activations); on the CPU, torchao 0.18 keeps each 4-bit value in its own byte
  (IntxWeightOnlyConfig), so the memory there is int8's.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from model import Transformer

QUANTIZED = ("int8", "nf4", "int4")
NF4_BLOCK = 64  # values sharing one NF4 scale


@contextlib.contextmanager
def _quiet_loggers(*names: str) -> Iterator[None]:
    """Only errors from these loggers inside the block."""
    loggers = [logging.getLogger(name) for name in names]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)


def quantize_base(model: Transformer, kind: str) -> None:
    """Quantize the frozen linear layers of `model`'s blocks in place to `kind` (one of QUANTIZED). Call after the
    base weights are loaded; the model must not be sharded (FSDP2)."""
    if kind not in QUANTIZED:
        raise ValueError(f"--quantize_base must be one of {QUANTIZED}, got {kind!r}")
    try:
        with _quiet_loggers("torchao", "torch.utils._pytree"):  # its optional CUDA kernels, an enum registration
            from torchao import quantization as ao
            from torchao.quantization.granularity import PerGroup
    except ImportError as e:
        raise ImportError("--quantize_base needs torchao: pip install torchao") from e

    def frozen_linear(module: nn.Module, name: str) -> bool:  # LoRA's own A and B train: left as they are
        return isinstance(module, nn.Linear) and not module.weight.requires_grad

    if kind == "nf4":
        targets = {f"layers.{name}": module for name, module in model.layers.named_modules()
                   if frozen_linear(module, name)}
        for name, module in targets.items():
            if module.weight.numel() % NF4_BLOCK:
                raise ValueError(f"--quantize_base nf4 quantizes blocks of {NF4_BLOCK} values, and {name}.weight has "
                                 f"{module.weight.numel()}: use int8 for this model")
        for module in targets.values():  # scales quantized in groups of 256 blocks (fewer if they do not divide)
            scaler_block = math.gcd(module.weight.numel() // NF4_BLOCK, 256)
            nf4 = ao.to_nf4(module.weight.detach(), NF4_BLOCK, scaler_block)
            module.weight = nn.Parameter(nf4, requires_grad=False)
        return
    device = next(model.parameters()).device
    if kind == "int8":
        config = ao.Int8WeightOnlyConfig()
    elif device.type == "cuda":
        config = ao.Int4WeightOnlyConfig(group_size=32)
    else:
        config = ao.IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(32))
    ao.quantize_(model.layers, config, filter_fn=frozen_linear)


def parameter_bytes(module: nn.Module) -> int:
    """Bytes of the storages holding `module`'s parameters, quantized ones included (a tensor subclass is counted
    through the tensors it is made of)."""
    def nbytes(t: torch.Tensor) -> int:
        if hasattr(t, "__tensor_flatten__"):
            names, _ = t.__tensor_flatten__()
            return sum(nbytes(getattr(t, n)) for n in names if isinstance(getattr(t, n), torch.Tensor))
        return t.untyped_storage().nbytes()
    return sum(nbytes(p) for p in module.parameters())
