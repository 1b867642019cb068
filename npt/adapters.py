"""Save and load only the NP parameters (safetensors), with the conversion recorded in the metadata.

File layout: tensors named as in the model (`layers.{i}.np.coef.weight`, `layers.{i}.np.A.gate`, ...), metadata
{format, layers (JSON list), rank, targets (comma-separated), residual_mode, dim, ffn_dim}. Loading checks the
metadata and every shape against the model before touching a parameter, and fails with a ValueError naming the
mismatch.
"""

from __future__ import annotations

import json
import os

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from model import Transformer
from npt.convert import convert, np_blocks, np_parameters

FORMAT = "npt-adapters-v1"
ADAPTERS_NAME = "adapters.safetensors"  # the file a run writes into its out_dir


def adapter_metadata(model: Transformer) -> dict[str, str]:
    """The conversion of `model` as safetensors metadata (all values strings)."""
    blocks = np_blocks(model)
    if not blocks:
        raise ValueError("the model has no converted layers: nothing to save")
    first = next(iter(blocks.values()))
    if any(b.np.rank != first.np.rank or b.np.targets != first.np.targets
           or b.residual_mode != first.residual_mode for b in blocks.values()):
        raise ValueError("converted layers differ in rank, targets or residual_mode; one adapter file records one "
                         "setting")
    return {"format": FORMAT, "layers": json.dumps(sorted(blocks)), "rank": str(first.np.rank),
            "targets": ",".join(first.np.targets), "residual_mode": first.residual_mode,
            "dim": str(model.config.dim), "ffn_dim": str(model.config.ffn_dim)}


def save_adapters(model: Transformer, path: str | os.PathLike, base: dict[str, str] | None = None) -> None:
    """Write the NP parameters of `model` (only those) to `path` (.safetensors); `base`: more metadata (the base
    they adapt: hf.ExportInfo.adapter_metadata)."""
    meta = {**adapter_metadata(model), **(base or {})}
    tensors = {name: p.detach().contiguous().cpu() for name, p in np_parameters(model).items()}
    save_file(tensors, str(path), metadata=meta)


def load_adapters(model: Transformer, path: str | os.PathLike) -> list[int]:
    """Load NP parameters from `path` into `model`, in place; returns the converted layer indices.

    A model without converted layers is first converted as recorded (frozen base). A model that is already
    converted must match the recorded layers, rank, targets and residual mode. Raises ValueError on any mismatch of
    model shape, conversion or tensor shape, before any parameter is written.
    """
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
        if meta.get("format") != FORMAT:
            raise ValueError(f"{path} is not an NP adapter file (metadata format {meta.get('format')!r}, "
                             f"expected {FORMAT!r})")
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open has no __iter__)
    cfg = model.config
    if (int(meta["dim"]), int(meta["ffn_dim"])) != (cfg.dim, cfg.ffn_dim):
        raise ValueError(f"adapters in {path} were made for dim={meta['dim']}, ffn_dim={meta['ffn_dim']}; this model "
                         f"has dim={cfg.dim}, ffn_dim={cfg.ffn_dim}")
    layers = json.loads(meta["layers"])
    if max(layers) >= cfg.n_layers:
        raise ValueError(f"adapters in {path} cover layers {layers}; this model has only {cfg.n_layers} layers")
    rank, targets, mode = int(meta["rank"]), tuple(meta["targets"].split(",")), meta["residual_mode"]
    if not np_blocks(model):
        convert(model, layers, rank=rank, targets=targets, residual_mode=mode)
    elif (have := adapter_metadata(model)) != {k: meta.get(k) for k in have}:  # the conversion; not other keys
        diff = {k: (have[k], meta.get(k)) for k in have if have[k] != meta.get(k)}
        raise ValueError(f"model is converted differently from {path}: (model, file) = {diff}")
    params = np_parameters(model)
    if set(params) != set(tensors):
        raise ValueError(f"adapter tensors do not match the model's NP parameters: missing "
                         f"{sorted(set(params) - set(tensors))}, unexpected {sorted(set(tensors) - set(params))}")
    for name, t in tensors.items():
        if t.shape != params[name].shape:
            raise ValueError(f"{name}: file has shape {tuple(t.shape)}, model expects {tuple(params[name].shape)}")
    with torch.no_grad():
        for name, t in tensors.items():
            params[name].copy_(t)
    return layers
