"""What an NSA model looks at: for a prompt, the selection blocks each KV group chose for each query and the gate
values of the three branches, layer by layer (inspect_nsa.py is the command line).

Selection scores are recomputed explicitly from the layer's own queries and compressed keys (Eqs. 8-10, as in
nsa/reference.py), so this is for prompts of up to a few thousand tokens. Nothing of the attention's arithmetic is
changed: the layer's inputs are captured at its `sparse_attention` seam while the model runs normally.

Notation: L layers, KV key/value heads, H query heads, T prompt tokens, n selected blocks, Nc compressed blocks.
"""

from __future__ import annotations

import torch
from torch import Tensor

from model import Transformer
from nsa.blocks import as_blocks, best_token_scores, block_importance, contested_blocks, select_blocks
from nsa.layer import NativeSparseAttention


def selected_blocks(q: Tensor, k_cmp: Tensor, config: object, k_slc: Tensor | None = None) -> Tensor:
    """Selection blocks (B, KV, T, n) chosen for queries q (B, H, T, D) at positions 0..T-1 from compressed keys
    k_cmp (B, KV, Nc, D): compression probabilities over the visible blocks, summed over each GQA group and pooled
    onto selection blocks (Eq. 9), then top-n with block 0 and the two most recent forced in. With the selection
    keys k_slc (B, KV, T, D): the blocks exact block scores select instead (`nsa.primitive.exact_block_scores`: each
    block by its best key, reading every key). Slots beyond the blocks that exist yet hold -1."""
    T = q.shape[2]
    l, d, l_sel, n = config.nsa_block_size, config.nsa_stride, config.nsa_select_block_size, config.nsa_num_selected
    positions, n_select = torch.arange(T, device=q.device), (T - 1) // l_sel + 1
    if k_slc is None:
        scores = block_importance(q, k_cmp, positions, l, d, l_sel, n_select)  # (B, KV, T, Ns)
    else:
        scores = best_token_scores(q, as_blocks(k_slc, l_sel), positions, n_select)
    idx, valid = select_blocks(scores, positions, l_sel, n)
    return idx.masked_fill(~valid, -1).sort(-1).values


def score_loss_target(q: Tensor, k_slc: Tensor, config: object) -> Tensor:
    """The selection-scoring loss's target t (nsa/scoring.py, "scores") for queries q (B, H, T, D) at positions
    0..T-1 and the selection keys k_slc (B, KV, T, D): (B, KV, T, Ns), each row a distribution over the blocks top-n
    chooses among, zero where it chooses none."""
    T, G = q.shape[2], q.shape[1] // k_slc.shape[1]
    l_sel, n = config.nsa_select_block_size, config.nsa_num_selected
    positions, n_select = torch.arange(T, device=q.device), (T - 1) // l_sel + 1
    contested = contested_blocks(positions, l_sel, n_select, n)  # (T, Ns)
    return best_token_scores(q, as_blocks(k_slc, l_sel), positions, n_select, contested) / G


def inspect(model: Transformer, input_ids: Tensor, exact: bool = False) -> list[dict[str, Tensor]]:
    """Per NSA layer: {"gates": (B, H, T, 3) compression/selection/window gates, "selected": (B, KV, T, n) selection
    blocks} for `input_ids` (B, T), from one forward of the model; `exact` adds "exact" (B, KV, T, n), the blocks
    exact block scores select, and "target" (B, KV, T, Ns), the score loss's target (`score_loss_target`)."""
    found: list[dict[str, Tensor]] = []

    def capture(layer: NativeSparseAttention):
        def attend(q: Tensor, k_cmp: Tensor, v_cmp: Tensor, k_slc: Tensor, v_slc: Tensor, k_win: Tensor,
                   v_win: Tensor, gates: Tensor, config: object, *args: object, **kwargs: object) -> Tensor:
            found.append({"gates": gates.detach().float(), "selected": selected_blocks(q, k_cmp, config)})
            if exact:
                found[-1] |= {"exact": selected_blocks(q, k_cmp, config, k_slc),
                              "target": score_loss_target(q, k_slc, config)}
            return NativeSparseAttention.sparse_attention(q, k_cmp, v_cmp, k_slc, v_slc, k_win, v_win, gates, config,
                                                          *args, **kwargs)
        return attend

    layers = [m for m in model.modules() if isinstance(m, NativeSparseAttention)]
    if not layers:
        raise ValueError(f"the model has no NSA layers (attention_type {model.config.attention_type!r})")
    for layer in layers:
        layer.sparse_attention = capture(layer)  # an instance attribute shadows the class's seam
    try:
        with torch.no_grad():
            model(input_ids)
    finally:
        for layer in layers:
            del layer.sparse_attention
    return found


def report(found: list[dict[str, Tensor]], positions: list[int], select_block_size: int,
           needle_blocks: set[int] | None = None) -> str:
    """Text: per layer, the mean gates over heads and tokens, then for each query position the blocks each KV group
    selected (marked * where they hold the needle) and that position's gates averaged over heads."""
    lines = []
    for i, layer in enumerate(found):
        gates, selected = layer["gates"][0], layer["selected"][0]  # (H, T, 3), (KV, T, n)
        mean = gates.mean((0, 1)).tolist()
        lines.append(f"layer {i}: mean gates compression {mean[0]:.2f} selection {mean[1]:.2f} window {mean[2]:.2f}")
        for t in positions:
            t = t % gates.shape[1]
            g = gates[:, t].mean(0).tolist()
            groups = []
            for kv in range(selected.shape[0]):
                blocks = [b for b in selected[kv, t].tolist() if b >= 0]
                groups.append(" ".join(f"{b}{'*' if needle_blocks and b in needle_blocks else ''}" for b in blocks))
            lines.append(f"  query {t:>6} (block {t // select_block_size}): gates {g[0]:.2f}/{g[1]:.2f}/{g[2]:.2f}; "
                         f"selected " + " | ".join(groups))
    return "\n".join(lines)
