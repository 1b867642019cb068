"""A full-attention model's weights as the starting point of an NSA model (train.py --attention_type nsa with a
full-attention --init_from): everything but the attention is copied; in every layer the query and output
projections and the QK-norms are the dense ones, the key/value projection of each branch (compression, selection,
window) is the dense key/value projection, the compressors (the "mlp" ones; "mean" has none) are left to their fresh
initialisation, and the gates are biased to the window branch: sigmoid(+GATE_BIAS) on it and sigmoid(-GATE_BIAS)
on the other two, with zero gate weights. Within the window (T <= nsa_window) the converted layer then computes the
dense layer's output times sigmoid(GATE_BIAS) = 0.99966, plus 0.03% of each other branch; beyond it, training
teaches the compressed and selected branches what the window misses.
"""

from __future__ import annotations

import torch
from torch import Tensor

from modeling.config import ModelConfig

GATE_BIAS = 8.0
FRESH = ("k_compress.", "v_compress.")  # parameter names the conversion leaves to the NSA model's initialisation


def nsa_state_from_dense(state: dict[str, Tensor], config: ModelConfig) -> dict[str, Tensor]:
    """The NSA model's state dict (`config`: attention_type "nsa", same geometry) from the full-attention model's
    `state`, without the compressor weights (FRESH)."""
    if config.attention_type != "nsa":
        raise ValueError(f"converting to NSA needs an NSA config, got attention_type {config.attention_type!r}")
    n_sets = 3 if config.nsa_separate_kv else 1
    out = dict(state)
    for i in range(config.n_layers):
        prefix = f"layers.{i}.attn."
        for kind in ("k_proj", "v_proj"):
            dense = state[prefix + kind + ".weight"]  # (KV*D, C)
            out[prefix + kind + ".weight"] = torch.cat([dense] * n_sets, dim=0)  # (sets*KV*D, C), set-major
        template = state[prefix + "q_proj.weight"]
        out[prefix + "branch_gate.weight"] = template.new_zeros(3 * config.n_heads, config.dim)
        bias = template.new_full((config.n_heads, 3), -GATE_BIAS)  # (H, 3): compression, selection, window
        bias[:, 2] = GATE_BIAS
        out[prefix + "branch_gate.bias"] = bias.reshape(-1)
    return out
