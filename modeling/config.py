"""The model's configuration, in two parts: `ModelConfig`, what the weights mean (geometry, attention type, RoPE),
and `ComputeConfig`, how a forward runs (tiling, query chunks, kernels, the loss path). A checkpoint is bound to its
ModelConfig; any ComputeConfig can run it, and changing one never changes the weights' meaning (results agree to
floating-point rounding; `z_loss_coef` and `nsa_score_loss_coef` are its training-objective knobs).

Attention types are looked up by name in `ATTENTION_TYPES`: "full" (attention.py) and "nsa" (nsa/layer.py); the
interface a type implements is `attention.AttentionLayer`. `register_attention` adds one at run time, e.g. from a
test or a research script, without editing this file.

Presets are looked up by exact name (`ModelConfig.from_preset("4B", attention_type="nsa")`).
"""

from __future__ import annotations

import dataclasses
import importlib
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

GiB = 1024**3

# name -> "module:Class", imported on first use (so this module imports no model code), or the class itself.
ATTENTION_TYPES: dict[str, str | type] = {
    "full": "modeling.attention:FullAttention",
    "nsa": "nsa.layer:NativeSparseAttention",
}


def register_attention(name: str, cls: str | type) -> None:
    """Make `cls` (a class implementing attention.AttentionLayer, or its "module:Class" path) the attention type
    `name`, usable as `ModelConfig(attention_type=name)` and `train.py --attention_type name`."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"an attention type needs a non-empty name, got {name!r}")
    ATTENTION_TYPES[name] = cls


def attention_class(name: str) -> type:
    """The class registered as attention type `name` (imported on first use)."""
    if name not in ATTENTION_TYPES:
        raise ValueError(f"unknown attention_type {name!r}; registered: {sorted(ATTENTION_TYPES)} (add one with "
                         "config.register_attention, or on the command line --plugin MODULE)")
    return registered(ATTENTION_TYPES, name)


def registered(registry: dict[str, str | type], name: str) -> type:
    """`registry[name]`, a class or its "module:Class" path, imported on first use and kept (the attention types
    here, training's fine-tuning modes, evaluation's tasks)."""
    entry = registry[name]
    if isinstance(entry, str):
        module, _, cls = entry.partition(":")
        entry = registry[name] = getattr(importlib.import_module(module), cls)
    return entry


def _is_real(value: object) -> bool:
    """An int or float, not a bool or a string."""
    return isinstance(value, int | float) and not isinstance(value, bool)


def _positive_int(owner: str, name: str, value: object, optional: bool = False, minimum: int = 1) -> None:
    """A ValueError naming the field unless `value` is an integer >= minimum (or None where optional)."""
    if optional and value is None:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        what = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
        raise ValueError(f"{owner}.{name} must be {'None or ' if optional else ''}{what}, got {value!r}")


@dataclass
class ModelConfig:
    """What the weights mean: everything a checkpoint must match. Bad values raise ValueError naming the field,
    before anything is allocated. Derived: `n_rep`."""

    vocab_size: int = 151936
    dim: int = 2560
    n_layers: int = 36
    n_heads: int = 32
    n_kv_heads: int = 8
    head_dim: int = 128  # Qwen3 keeps 128 even where dim / n_heads differs (0.6B: 16 x 128 > 1024)
    ffn_dim: int = 9728
    norm_eps: float = 1e-6
    rope_theta: float = 1e6
    # None, or Llama 3.1 frequency scaling: {"rope_type": "llama3", "factor", "low_freq_factor", "high_freq_factor",
    # "original_max_position_embeddings"} (the Hugging Face config.json keys; see layers.RotaryEmbedding).
    rope_scaling: dict[str, float | int | str] | None = None
    context_length: int = 40960  # longest sequence (prompt + generated tokens) a forward accepts
    tie_embeddings: bool = True
    qk_norm: bool = True  # RMSNorm over each head of q and k before RoPE (Qwen3)
    logit_softcap: float | None = None  # cap * tanh(logits / cap) before the softmax
    attention_type: str = "full"  # a name in ATTENTION_TYPES
    # Native Sparse Attention (paper defaults, section 4.1); read when attention_type == "nsa".
    nsa_block_size: int = 32  # l: compression block length
    nsa_stride: int = 16  # d: compression stride
    nsa_select_block_size: int = 64  # l': selection block length
    nsa_num_selected: int = 16  # n: selected blocks per query, including block 0 and the 2 most recent
    nsa_window: int = 512  # w: sliding-window length, counting the query's own token
    nsa_separate_kv: bool = True  # independent K/V projections per branch (paper section 3.3.3)
    nsa_compressor: str = "mlp"  # phi: "mlp" (paper Eq. 7) or "mean" (mean of the block's rotated keys and values)
    # Options of a registered attention type that has no fields of its own here (checked by its check_config).
    attention_options: dict[str, Any] = field(default_factory=dict)
    init_std: float = 0.02

    def __post_init__(self) -> None:
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "ffn_dim",
                     "context_length", "nsa_block_size", "nsa_stride", "nsa_select_block_size", "nsa_num_selected",
                     "nsa_window"):
            _positive_int("ModelConfig", name, getattr(self, name))
        for name in ("norm_eps", "rope_theta", "init_std"):
            if not (_is_real(getattr(self, name)) and 0 < getattr(self, name) < math.inf):
                raise ValueError(f"ModelConfig.{name} must be a positive finite number, got {getattr(self, name)!r}")
        for name in ("tie_embeddings", "qk_norm", "nsa_separate_kv"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"ModelConfig.{name} must be true or false, got {getattr(self, name)!r}")
        if not isinstance(self.attention_type, str):
            raise ValueError(f"ModelConfig.attention_type must be a name, got {self.attention_type!r}")
        if self.rope_scaling is not None:
            validate_rope_scaling(self.rope_scaling)
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"ModelConfig.n_heads ({self.n_heads}) must be divisible by n_kv_heads "
                             f"({self.n_kv_heads}); valid n_kv_heads: "
                             f"{[d for d in range(1, self.n_heads + 1) if self.n_heads % d == 0]}")
        if self.head_dim % 2:
            raise ValueError(f"ModelConfig.head_dim must be even (RoPE rotates pairs), got {self.head_dim}")
        if self.logit_softcap is not None and not (_is_real(self.logit_softcap) and 0 < self.logit_softcap < math.inf):
            raise ValueError(f"ModelConfig.logit_softcap must be None or positive, got {self.logit_softcap}")
        if not isinstance(self.attention_options, dict):
            raise ValueError(f"ModelConfig.attention_options must be a dict, got {self.attention_options!r}")
        attention_class(self.attention_type).check_config(self)

    @property
    def n_rep(self) -> int:
        """Query heads per key/value head (the GQA group size)."""
        return self.n_heads // self.n_kv_heads

    @classmethod
    def from_preset(cls, name: str, **overrides: object) -> ModelConfig:
        """The preset called exactly `name` with `overrides` applied, e.g. `from_preset("4B", attention_type="nsa")`."""
        if name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; available: {sorted(PRESETS)}")
        check_fields(cls, overrides)
        return cls(**{**PRESETS[name], **overrides})

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> ModelConfig:
        """A ModelConfig from `to_dict()` output (a saved config.json), with a clear error on unknown fields."""
        check_fields(cls, values)
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass
class ComputeConfig:
    """How the model computes: memory/speed knobs that never change what the weights mean nor what training
    minimises (that is modeling.objective.Objective), free to change between runs (resume, load, eval). The defaults
    suit short sequences; train.py picks the long-context values."""

    ffn_chunk_size: int | None = None  # tokens per FFN tile (tiled MLP, recomputed in backward); None: untiled
    attention_query_chunk: int = 512  # queries NSA's PyTorch path and score loss process together (their memory)
    triton_kernels: bool = True  # CUDA tensors: run NSA's branches on nsa/triton_path.py when Triton is installed
    # Loss: "auto" chunks when B*T*V*element_size would exceed the threshold (decided from shapes only).
    loss_mode: Literal["auto", "chunked", "standard"] = "auto"
    loss_chunk_threshold_bytes: int = 10 * GiB
    loss_chunk_size: int = 4096
    # Rows of the output layer: "all" positions, or only "targets" (those whose label is not ignored: a
    # data-dependent shape, one host sync on a GPU), which saves most of its cost when few tokens carry a loss.
    loss_rows: Literal["all", "targets"] = "all"
    offload_activations: bool = False  # tensors the blocks save for backward live in host memory (offload.py)

    def __post_init__(self) -> None:
        _positive_int("ComputeConfig", "ffn_chunk_size", self.ffn_chunk_size, optional=True)
        for name in ("attention_query_chunk", "loss_chunk_threshold_bytes", "loss_chunk_size"):
            _positive_int("ComputeConfig", name, getattr(self, name))
        if self.loss_mode not in ("auto", "chunked", "standard"):
            raise ValueError(f"ComputeConfig.loss_mode must be 'auto', 'chunked' or 'standard', got "
                             f"{self.loss_mode!r}")
        if self.loss_rows not in ("all", "targets"):
            raise ValueError(f"ComputeConfig.loss_rows must be 'all' or 'targets', got {self.loss_rows!r}")

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> ComputeConfig:
        check_fields(cls, values)
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


NSA_FIELDS = ("nsa_block_size", "nsa_stride", "nsa_select_block_size", "nsa_num_selected", "nsa_window",
              "nsa_separate_kv", "nsa_compressor")
_NSA = ("attention_type", lambda value: value == "nsa", "attention_type 'nsa'")
# Fields that act only beside another: name -> (that field, whether its value lets the name act, what it needs).
# `check_effective` refuses one set where it cannot act; every other field acts on its own.
EFFECT_NEEDS: dict[str, tuple[str, Callable[[Any], bool], str]] = {
    **dict.fromkeys((*NSA_FIELDS, "triton_kernels", "attention_query_chunk"), _NSA),
    "attention_options": ("attention_type", lambda value: value not in ("full", "nsa"),
                          "a registered attention type that reads them (full and nsa read none)"),
    "loss_chunk_size": ("loss_mode", lambda value: value != "standard", "loss_mode 'auto' or 'chunked'"),
    "loss_chunk_threshold_bytes": ("loss_mode", lambda value: value == "auto", "loss_mode 'auto'"),
}


def check_effective(model: ModelConfig, compute: ComputeConfig, names: set[str] | frozenset[str],
                    spelled: dict[str, str] | None = None) -> None:
    """ValueError, naming why, when a field of `names` (those a user set; `spelled`: how, for fields set by an option
    of their own) cannot act in this pair of configs (EFFECT_NEEDS)."""
    value = {**dataclasses.asdict(model), **dataclasses.asdict(compute)}
    for name in sorted(names & set(EFFECT_NEEDS)):
        other, acts, needs = EFFECT_NEEDS[name]
        if not acts(value[other]):
            given = (spelled or {}).get(name, name)
            raise ValueError(f"{given} has no effect without {needs}, and this run's {other} is {value[other]!r}: "
                             f"leave {given} out, or set {other}")


def check_fields(cls: type, values: dict[str, Any]) -> None:
    """ValueError naming the keys of `values` that are not fields of dataclass `cls`."""
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - fields)
    if unknown:
        raise ValueError(f"unknown {cls.__name__} field(s) {unknown}; valid fields: {sorted(fields)}")


def split_overrides(values: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Split a dict of overrides into (ModelConfig fields, ComputeConfig fields); ValueError on any other key."""
    model_fields = {f.name for f in dataclasses.fields(ModelConfig)}
    compute_fields = {f.name for f in dataclasses.fields(ComputeConfig)}
    unknown = sorted(set(values) - model_fields - compute_fields)
    if unknown:
        raise ValueError(f"unknown field(s) {unknown}; valid: ModelConfig {sorted(model_fields)}, ComputeConfig "
                         f"{sorted(compute_fields)}")
    return ({k: v for k, v in values.items() if k in model_fields},
            {k: v for k, v in values.items() if k in compute_fields})


LLAMA3_ROPE_KEYS = ("rope_type", "factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
YARN_ROPE_KEYS = ("rope_type", "factor", "original_max_position_embeddings")  # required
YARN_OPTIONAL_KEYS = ("beta_fast", "beta_slow", "attention_factor", "truncate")


def validate_rope_scaling(scaling: object) -> None:
    """ValueError unless `scaling` is a well-formed rope_scaling dict: rope_type "llama3" (Llama 3.1) with exactly
    LLAMA3_ROPE_KEYS, or "yarn" (Qwen3's long-context setting) with YARN_ROPE_KEYS and any of YARN_OPTIONAL_KEYS."""
    kind = scaling.get("rope_type") if isinstance(scaling, dict) else None
    if kind not in ("llama3", "yarn"):
        raise ValueError(f"ModelConfig.rope_scaling must be None or a dict with rope_type 'llama3' or 'yarn', got "
                         f"{scaling!r}")
    required, optional = (LLAMA3_ROPE_KEYS, ()) if kind == "llama3" else (YARN_ROPE_KEYS, YARN_OPTIONAL_KEYS)
    if not set(required) <= set(scaling) <= set(required) | set(optional):
        raise ValueError(f"ModelConfig.rope_scaling ({kind}) needs the keys {list(required)}"
                         + (f" and may have {list(optional)}" if optional else "") + f", got {sorted(scaling)}")
    numbers = [k for k in (*required, *optional) if k in scaling and k not in ("rope_type", "truncate")]
    if not isinstance(scaling.get("truncate", True), bool):
        raise ValueError(f"ModelConfig.rope_scaling truncate must be true or false, got {scaling['truncate']!r}")
    if not all(_is_real(scaling[k]) and math.isfinite(scaling[k]) for k in numbers):
        raise ValueError(f"ModelConfig.rope_scaling values must be finite numbers, got {scaling!r}")
    factor, original_length = scaling["factor"], scaling["original_max_position_embeddings"]
    if not factor >= 1:
        raise ValueError(f"ModelConfig.rope_scaling needs factor >= 1, got {factor}")
    if kind == "llama3" and not 0 < scaling["low_freq_factor"] < scaling["high_freq_factor"]:
        raise ValueError(f"ModelConfig.rope_scaling needs 0 < low_freq_factor < high_freq_factor, got "
                         f"{scaling['low_freq_factor']}, {scaling['high_freq_factor']}")
    if kind == "yarn" and not scaling.get("beta_fast", 32) > scaling.get("beta_slow", 1) > 0:
        raise ValueError(f"ModelConfig.rope_scaling needs beta_fast > beta_slow > 0, got {scaling}")
    if not isinstance(original_length, int) or isinstance(original_length, bool) or original_length <= 0:
        raise ValueError(f"ModelConfig.rope_scaling original_max_position_embeddings must be a positive integer, "
                         f"got {original_length!r}")


# Qwen3 geometry (values from the Hugging Face config.json of each model). "tiny" is for tests: small enough for a
# CPU step in milliseconds, with NSA blocks small enough that short sequences exercise every branch. "demo" is tiny
# widened to a model that visibly learns Python in a few CPU minutes (train.py's CPU default).
PRESETS: dict[str, dict[str, object]] = {
    "tiny": dict(vocab_size=512, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, ffn_dim=192,
                 context_length=1024, nsa_block_size=8, nsa_stride=4, nsa_select_block_size=16,
                 nsa_num_selected=4, nsa_window=32),
    "demo": dict(vocab_size=512, dim=128, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=32, ffn_dim=384,
                 context_length=1024, nsa_block_size=8, nsa_stride=4, nsa_select_block_size=16,
                 nsa_num_selected=4, nsa_window=32),
    "0.6B": dict(dim=1024, n_layers=28, n_heads=16, n_kv_heads=8, ffn_dim=3072),
    "1.7B": dict(dim=2048, n_layers=28, n_heads=16, n_kv_heads=8, ffn_dim=6144),
    "4B": dict(dim=2560, n_layers=36, n_heads=32, n_kv_heads=8, ffn_dim=9728),
    "8B": dict(dim=4096, n_layers=36, n_heads=32, n_kv_heads=8, ffn_dim=12288, tie_embeddings=False),
}
