"""offload.py and ComputeConfig.offload_activations: offloading the tensors blocks save for backward changes no
number (loss and every gradient bitwise equal, with and without checkpointing), moves exactly the checkpointed block
inputs to host memory (the RoPE tables stay), and profile_memory's estimate counts them there."""

from __future__ import annotations

import pytest
import torch

from model import Transformer
from modeling.config import ComputeConfig, ModelConfig
from modeling.offload import simulated
from training import estimate as pm


def loss_and_grads(offload: bool, checkpointing: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor], list]:
    torch.manual_seed(0)
    model = Transformer(ModelConfig.from_preset("tiny", n_layers=3), ComputeConfig(offload_activations=offload))
    model.gradient_checkpointing_enable(checkpointing)
    ids = torch.randint(0, model.config.vocab_size, (2, 32))
    copies: list[torch.Tensor] = []
    with simulated(copies.append):
        loss = model(ids, labels=ids).loss
        loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}, copies


@pytest.mark.parametrize("checkpointing", [True, False], ids=["checkpointing", "no_checkpointing"])
def test_offload_changes_no_number(checkpointing: bool):
    loss, grads, copies = loss_and_grads(offload=True, checkpointing=checkpointing)
    reference, reference_grads, none = loss_and_grads(offload=False, checkpointing=checkpointing)
    assert not none and copies
    assert torch.equal(loss, reference)
    assert all(torch.equal(grads[n], reference_grads[n]) for n in grads)
    if checkpointing:  # each block's input (the RoPE tables are resident anyway)
        assert [tuple(c.shape) for c in copies] == [(2, 32, 64)] * 3


def test_the_estimate_counts_offloaded_inputs_as_host_memory():
    config = pm.StepConfig.of(model_size="tiny", context_length=256, batch_size=2, gradient_checkpointing=True,
                              dtype="float32")
    off, on = pm.estimate(config), pm.estimate(config.replace(offload_activations=True))
    L, C = 2, 64  # tiny: layers, width
    block_inputs = L * 2 * 256 * C * 4
    assert on["stages"]["after forward"]["host"] == block_inputs
    assert off["stages"]["after forward"]["total"] - on["stages"]["after forward"]["total"] == block_inputs
    assert on["stages"]["after backward"]["host"] == 0  # freed once backward has used them
    assert on["peak"]["total"] <= off["peak"]["total"]  # here the logits set the peak; at 131k the inputs do


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned host memory and a side stream need CUDA")
def test_offload_on_cuda_changes_no_number():
    torch.manual_seed(0)
    config = ModelConfig.from_preset("tiny")
    results = []
    for offload in (False, True):
        torch.manual_seed(0)
        model = Transformer(config, ComputeConfig(offload_activations=offload)).cuda()
        model.gradient_checkpointing_enable()
        ids = torch.randint(0, config.vocab_size, (2, 64), device="cuda")
        model(ids, labels=ids).loss.backward()
        results.append([p.grad for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*results, strict=True))
