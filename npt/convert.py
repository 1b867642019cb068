"""Turn chosen decoder layers of a `model.Transformer` into neuro-plastic layers, switch their mode, and fold a
token's modulation permanently into the base FFN weights.

Notation: B batch, T tokens, C model width, F FFN width, I / O input / output width of a projection, r rank.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
from torch import Tensor, nn

from model import Transformer
from npt.modulated import Mode, NPBlock, ResidualMode

LayerSpec = str | Sequence[int]


def resolve_layers(layers: LayerSpec, n_layers: int) -> list[int]:
    """Sorted layer indices for `layers`: explicit indices (negative count from the end), "upper_half" (the last
    n_layers // 2 layers, at least one) or "all"."""
    if layers == "all":
        return list(range(n_layers))
    if layers == "upper_half":
        return list(range(n_layers // 2, n_layers))
    if isinstance(layers, str):
        raise ValueError(f"layers must be a list of indices, 'upper_half' or 'all', got {layers!r}")
    out = []
    for i in layers:
        if not isinstance(i, int) or isinstance(i, bool) or not -n_layers <= i < n_layers:
            raise ValueError(f"layer index {i!r} out of range for a model with {n_layers} layers")
        out.append(i % n_layers)
    if not out or len(set(out)) != len(out):
        raise ValueError(f"layers must be a non-empty list of distinct indices, got {list(layers)}")
    return sorted(out)


def np_blocks(model: Transformer) -> dict[int, NPBlock]:
    """The converted layers of `model`, by layer index."""
    return {i: b for i, b in enumerate(model.layers) if isinstance(b, NPBlock)}


def np_parameters(model: Transformer) -> dict[str, nn.Parameter]:
    """The NP parameters by name, relative to the model (`layers.{i}.np.A.gate`, ...)."""
    return {f"layers.{i}.np.{name}": p for i, b in np_blocks(model).items() for name, p in b.np.named_parameters()}


def convert(model: Transformer, layers: LayerSpec = "upper_half", rank: int = 16,
            targets: Sequence[str] = ("gate", "up"), residual_mode: ResidualMode = "modulate",
            freeze_base: bool = True, base_dtype: torch.dtype | None = None,
            np_dtype: torch.dtype | None = torch.float32, offload: bool = False) -> list[int]:
    """Replace `model.layers[i]` by an `NPBlock` reusing its submodules, for every selected layer, in place.

    Args:
        layers: indices, "upper_half" or "all". rank: r. targets: FFN projections to modulate ("gate", "up",
            "down"). residual_mode: "modulate" or "additive" (see npt.modulated).
        freeze_base: every parameter except the new NP parameters gets requires_grad=False.
        base_dtype: if given, the frozen parameters are cast to it (e.g. torch.bfloat16 halves their memory and
            makes it the compute dtype); requires freeze_base.
        np_dtype: dtype of the NP parameters (float32 masters by default; None = that of the FFN weights). They
            are cast to the compute dtype in forward.
        offload: tensors saved for backward by converted layers go to CPU memory (offload.py).
    Returns:
        The converted layer indices.
    """
    idx = resolve_layers(layers, len(model.layers))
    already = sorted(set(idx) & set(np_blocks(model)))
    if already:
        raise ValueError(f"layers {already} are already converted")
    if base_dtype is not None and not freeze_base:
        raise ValueError("base_dtype casts the frozen base weights; it needs freeze_base=True")
    for i in idx:
        block = NPBlock(model.layers[i], rank, tuple(targets), residual_mode, dtype=np_dtype)
        block.offload = offload
        model.layers[i] = block
    if freeze_base:
        trainable = {id(p) for p in np_parameters(model).values()}
        for p in model.parameters():
            if id(p) not in trainable:
                p.requires_grad_(False)
                if base_dtype is not None:
                    p.data = p.data.to(base_dtype)  # tied weights are one Parameter: cast once
    return idx


def revert(model: Transformer) -> list[int]:
    """Put the original `Block`s (the same submodules, folded weights included) back in place of the converted
    layers, in place, and return their indices. The model then has exactly the original parameter names, e.g. for
    `hf.export_hf_checkpoint`. It computes what the converted layers compute in "original" mode (which equals
    "static" mode for residual_mode "additive"); the NP parameters are dropped: save them first (npt.adapters)."""
    reverted = sorted(np_blocks(model))
    for i in reverted:
        block = model.layers[i]
        block.original.gradient_checkpointing = block.gradient_checkpointing
        model.layers[i] = block.original
    return reverted


def set_mode(model: Transformer, mode: Mode) -> None:
    """Set every converted layer to "plastic", "static" or "original" (see NPBlock)."""
    if mode not in ("plastic", "static", "original"):
        raise ValueError(f"mode must be 'plastic', 'static' or 'original', got {mode!r}")
    for block in np_blocks(model).values():
        block.mode = mode


@contextmanager
def using_mode(model: Transformer, mode: Mode) -> Iterator[None]:
    """Run converted layers in `mode` inside the block; restores each layer's previous mode on exit."""
    before = {i: b.mode for i, b in np_blocks(model).items()}
    set_mode(model, mode)
    try:
        yield
    finally:
        for i, b in np_blocks(model).items():
            b.mode = before[i]


@contextmanager
def capture_outputs(modules: dict[int, nn.Module]) -> Iterator[dict[int, Tensor]]:
    """Collect each module's forward output under its key (the latest call wins)."""
    outputs: dict[int, Tensor] = {}
    handles = [mod.register_forward_hook(lambda _m, _in, out, k=k: outputs.__setitem__(k, out))
               for k, mod in modules.items()]
    try:
        yield outputs
    finally:
        for h in handles:
            h.remove()


@torch.no_grad()
def fold(model: Transformer, input_ids: Tensor, token: int | tuple[int, int]) -> None:
    """Permanent update: W <- W + dW for every converted layer and target, in place.

    dW = A diag(m) B with m the coefficients of position `token` of `input_ids` (1, T), or their mean over the span
    `token = (start, end)` (dW is linear in m, so this is the mean dW). The coefficients come from one plastic forward
    of the current model. Run the folded layers in "static" mode to use the folded weights without further
    modulation: given the same layer input, a static folded layer reproduces the plastic layer's output at `token`.
    """
    if input_ids.dim() != 2 or input_ids.shape[0] != 1:
        raise ValueError(f"fold takes one sequence, input_ids of shape (1, T); got {tuple(input_ids.shape)}")
    T = input_ids.shape[1]
    start, end = token if isinstance(token, tuple) else (token % T, token % T + 1)
    if not 0 <= start < end <= T:
        raise ValueError(f"token {token!r} is not a position or a non-empty span within {T} tokens")
    blocks = np_blocks(model)
    if not blocks:
        raise ValueError("the model has no converted layers to fold")
    with using_mode(model, "plastic"), capture_outputs({i: b.np for i, b in blocks.items()}) as coefs:
        model.hidden_states(input_ids)
    for i, block in blocks.items():
        m = coefs[i][0, start:end].float().mean(0)  # (P, r)
        for p, t in enumerate(block.np.targets):
            weight = getattr(block.mlp, f"{t}_proj").weight  # (O, I)
            delta = block.np.delta_weight(t, m[p])  # (I, O)
            weight.copy_((weight.float() + delta.t()).to(weight.dtype))


def set_offload(model: Transformer, enabled: bool = True) -> None:
    """Turn activation offload (offload.py) on or off for every converted layer."""
    for block in np_blocks(model).values():
        block.offload = enabled
