"""Load and export checkpoints in the Hugging Face layout (`config.json` + `*.safetensors`, optionally sharded with
`model.safetensors.index.json`) for the Qwen3 and Llama families, without needing `transformers`.

    model = load_hf_checkpoint("path/to/Qwen3-0.6B", dtype=torch.bfloat16)   # -> Transformer
    export_hf_checkpoint(model, "out/qwen3-finetuned")                       # -> Qwen3ForCausalLM layout

NSA models have no transformers class: their export carries the project's modeling code (remote_code.py) and
loads with `AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True)`; its tensors are ours under
`model.` (`stored_name`), and this module reads it back like the others.

Family mapping: Qwen3 = qk_norm on, Llama = qk_norm off; everything else (GQA, SwiGLU, RMSNorm, rotate-half RoPE,
optional tied embeddings, Llama 3.1 "llama3" rope scaling) is shared. Parameter names differ only in a few path
segments (see `_OURS_TO_HF`) and the `model.` prefix.

Notation: V vocabulary size, C model width, H query heads, KV key/value heads, D head dimension, F FFN width.

References: Hugging Face safetensors sharding https://huggingface.co/docs/safetensors, Qwen3
https://huggingface.co/Qwen/Qwen3-0.6B/blob/main/config.json, Llama 3.2
https://huggingface.co/meta-llama/Llama-3.2-1B/blob/main/config.json.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor

from model import Transformer
from modeling.config import YARN_OPTIONAL_KEYS, ComputeConfig, ModelConfig, check_fields
from storage.manifest import written_directory
from storage.remote_code import AUTO_MAP, remote_code_files

ARCHITECTURES = {"qwen3": "Qwen3ForCausalLM", "llama": "LlamaForCausalLM"}
REMOTE_TYPES = ("nsa",)  # attention types exported with their modeling code (remote_code.py)
CONFIG_NAME = "config.json"
GENERATION_CONFIG = "generation_config.json"
SPECIAL_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")
SINGLE_FILE = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
# Path segments that differ between our parameter names and the Hugging Face ones (a bijection; all other
# segments are shared, and HF adds a `model.` prefix to everything except `lm_head`).
_OURS_TO_HF = {"attn": "self_attn", "attn_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm"}
_HF_TO_OURS = {hf: ours for ours, hf in _OURS_TO_HF.items()}
# Derived buffers some older checkpoints stored; recomputed from the config, never loaded.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


# ---- names ---------------------------------------------------------------------------------------------------------


def hf_name(name: str) -> str:
    """Our parameter name -> the Hugging Face one, e.g. layers.0.attn.q_proj.weight ->
    model.layers.0.self_attn.q_proj.weight."""
    hf = ".".join(_OURS_TO_HF.get(part, part) for part in name.split("."))
    return hf if name.startswith("lm_head.") else "model." + hf


def stored_name(name: str, config: ModelConfig) -> str:
    """Our parameter name -> its name in an export of `config`: `hf_name`, or for an export that carries its
    modeling code (REMOTE_TYPES) our own name under `model.`."""
    return "model." + name if config.attention_type in REMOTE_TYPES else hf_name(name)


def our_name(name: str) -> str:
    """Inverse of `hf_name` and `stored_name` (for names that passed the key check)."""
    name = current_name(name).removeprefix("model.")
    return ".".join(_HF_TO_OURS.get(part, part) for part in name.split("."))


# Names older versions stored, read as today's: NSA's branch gate was `attn.gate_proj`, a name the MLP's gate shares.
LEGACY_NAMES = ((".attn.gate_proj.", ".attn.branch_gate."),)


def current_name(name: str) -> str:
    """A stored tensor name as this version names it (`LEGACY_NAMES`)."""
    for old, new in LEGACY_NAMES:
        name = name.replace(old, new)
    return name


# ---- config --------------------------------------------------------------------------------------------------------

class SavedTokenizer(Protocol):
    """What an export needs of a tokenizer (text.tokenizer's Tokenizer and HFTokenizer): its special ids, a record
    of it for config.json, and its files written beside the weights."""

    eod_id: int
    pad_id: int

    def record(self) -> dict: ...

    def save(self, directory: Path, model_max_length: int | None = None) -> None: ...


ADAPTED_KEY = "longctx_base"  # adapter files: the base they were trained on (ExportInfo.adapted)


@dataclass(frozen=True)
class ExportInfo:
    """What an export carries besides the weights.

    tokenizer: the run's, written beside the weights (`save`) so that the directory is complete for every tool.
    base: the --init_from directory; a Hugging Face export keeps its special-token ids and generation_config.json.
    context_length: the context the export declares (`max_position_embeddings`): the base's, or the context
        trained when that is longer (a context extension); None: the model config's.
    dtype: of the weights written; None: as the model holds them.
    adapted: for adapters on a frozen base, that base: {"checksum": of its weights (None: a random base),
        "tokenizer": its tokenizer's sha256}, written into the adapter file's metadata under ADAPTED_KEY, so that
        `--adapter` can refuse another base.
    """

    tokenizer: SavedTokenizer | None = None
    base: Path | None = None
    context_length: int | None = None
    dtype: torch.dtype | None = None
    adapted: dict | None = None

    def adapter_metadata(self) -> dict[str, str]:
        """What an adapter file's safetensors metadata records of its base (`adapted`)."""
        return {ADAPTED_KEY: json.dumps(self.adapted)} if self.adapted is not None else {}

    def model_config(self, config: ModelConfig) -> ModelConfig:
        """`config` with the context length this export declares."""
        return dataclasses.replace(config, context_length=self.context_length or config.context_length)

    def cast(self, state: dict[str, Tensor]) -> dict[str, Tensor]:
        """`state` in the export's dtype (floating-point tensors only)."""
        if self.dtype is None:
            return state
        return {name: t.to(self.dtype) if t.is_floating_point() else t for name, t in state.items()}

    def write_tokenizer(self, directory: Path, context_length: int) -> None:
        if self.tokenizer is not None:
            self.tokenizer.save(directory, context_length)

    def special_ids(self) -> dict[str, int | list[int]]:
        """bos/eos/pad ids for config.json: the base's when it is a Hugging Face directory, else the tokenizer's
        (the model starts a document after the end-of-document id, so that is its bos)."""
        base = json_object(self.base / CONFIG_NAME) if self.base and self.base.is_dir() else {}
        if any(base.get(key) is not None for key in SPECIAL_IDS):
            return {key: base[key] for key in SPECIAL_IDS if base.get(key) is not None}
        if self.tokenizer is None:
            return {}
        ids = {"bos_token_id": self.tokenizer.eod_id, "eos_token_id": self.tokenizer.eod_id,
               "pad_token_id": self.tokenizer.pad_id}
        return {key: value for key, value in ids.items() if value >= 0}

    def write_generation_config(self, directory: Path) -> None:
        """generation_config.json: the base's, with the special ids it lacks (the eos id makes `generate` stop)."""
        config = json_object(self.base / GENERATION_CONFIG) if self.base and self.base.is_dir() else {}
        config |= {key: value for key, value in self.special_ids().items() if config.get(key) is None}
        if config:
            (directory / GENERATION_CONFIG).write_text(json.dumps(config, indent=2) + "\n")


WEIGHTS_ONLY = ExportInfo()  # an export with nothing besides the weights


def json_object(file: Path) -> dict:
    """The JSON object in `file`, or {} when it is absent or not an object."""
    try:
        value = json.loads(file.read_text())
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def _require(hf_config: dict, key: str, where: str = "config.json") -> object:
    if hf_config.get(key) is None:
        raise ValueError(f"{where} lacks the required field {key!r}")
    return hf_config[key]


def _rope_from_hf(hf_config: dict) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling) from either the transformers>=5 `rope_parameters` dict or the older top-level
    `rope_theta` + `rope_scaling` fields (what the published checkpoints use)."""
    params = hf_config.get("rope_parameters") or hf_config.get("rope_scaling") or {}
    if any(isinstance(value, dict) for value in params.values()):
        raise ValueError(f"per-layer-type rope parameters are not supported, got {params!r}")
    theta = float(params.get("rope_theta", hf_config.get("rope_theta", 10000.0)))
    partial = params.get("partial_rotary_factor", hf_config.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise ValueError(f"partial_rotary_factor={partial} is not supported (RoPE rotates the whole head)")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return theta, None
    where = "config.json rope scaling"
    if rope_type == "yarn":
        if params.get("mscale") or params.get("mscale_all_dim"):
            raise ValueError("yarn rope scaling with mscale / mscale_all_dim (DeepSeek's variant) is not supported")
        scaling = {"rope_type": "yarn", "factor": float(_require(params, "factor", where)),
                   "original_max_position_embeddings": int(params.get("original_max_position_embeddings")
                                                           or _require(hf_config, "max_position_embeddings"))}
        scaling |= {k: params[k] for k in YARN_OPTIONAL_KEYS if params.get(k) is not None}
        return theta, scaling
    if rope_type != "llama3":
        raise ValueError(f"rope scaling type {rope_type!r} is not supported; only 'llama3' (Llama 3.1/3.2) and "
                         "'yarn' (Qwen3) are")
    scaling = {
        "rope_type": "llama3",
        "factor": float(_require(params, "factor", where)),
        "low_freq_factor": float(_require(params, "low_freq_factor", where)),
        "high_freq_factor": float(_require(params, "high_freq_factor", where)),
        "original_max_position_embeddings": int(params.get("original_max_position_embeddings")
                                                or _require(hf_config, "max_position_embeddings")),
    }
    return theta, scaling


def config_from_hf(hf_config: dict, **overrides: object) -> ModelConfig:
    """A Hugging Face `config.json` dict (model_type "qwen3" or "llama") -> ModelConfig, with `overrides` (any
    ModelConfig field, e.g. context_length or attention_type) applied on top. Features the Transformer lacks (biases,
    sliding windows, other activations or rope scalings) raise ValueError."""
    model_type = hf_config.get("model_type")
    if model_type == "longctx":  # an export with its modeling code: the ModelConfig whole
        check_fields(ModelConfig, overrides)
        return ModelConfig.from_dict({**_require(hf_config, "longctx_model"), **overrides})
    if model_type not in ARCHITECTURES:
        raise ValueError(f"unsupported model_type {model_type!r}; supported: {sorted(ARCHITECTURES)}")
    for key in ("attention_bias", "mlp_bias"):
        if hf_config.get(key):
            raise ValueError(f"{key}=true is not supported: Transformer projections have no bias")
    if hf_config.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act {hf_config['hidden_act']!r} is not supported; the FFN is SwiGLU (silu)")
    layer_types = hf_config.get("layer_types") or []
    if hf_config.get("use_sliding_window") or any(kind != "full_attention" for kind in layer_types):
        raise ValueError("sliding-window attention layers are not supported; every layer must be full attention")
    dim, n_heads = _require(hf_config, "hidden_size"), _require(hf_config, "num_attention_heads")
    head_dim = hf_config.get("head_dim")
    if head_dim is None:  # older Llama configs: derived
        if dim % n_heads:
            raise ValueError(f"config.json has no head_dim and hidden_size {dim} is not divisible by "
                             f"num_attention_heads {n_heads}")
        head_dim = dim // n_heads
    rope_theta, rope_scaling = _rope_from_hf(hf_config)
    fields = dict(
        vocab_size=_require(hf_config, "vocab_size"), dim=dim, n_layers=_require(hf_config, "num_hidden_layers"),
        n_heads=n_heads, n_kv_heads=hf_config.get("num_key_value_heads") or n_heads, head_dim=head_dim,
        ffn_dim=_require(hf_config, "intermediate_size"), norm_eps=float(hf_config.get("rms_norm_eps", 1e-6)),
        rope_theta=rope_theta, rope_scaling=rope_scaling,
        context_length=_require(hf_config, "max_position_embeddings"),
        tie_embeddings=bool(hf_config.get("tie_word_embeddings", False)),  # the default of both HF config classes
        qk_norm=model_type == "qwen3", init_std=float(hf_config.get("initializer_range", 0.02)),
    )
    check_fields(ModelConfig, overrides)
    return ModelConfig(**{**fields, **overrides})


def export_refusal(config: ModelConfig) -> str | None:
    """Why `config` cannot be written in the Hugging Face layout, or None when it can: full attention as Qwen3 or
    Llama, NSA with its modeling code (REMOTE_TYPES, remote_code.py)."""
    if config.attention_type not in ("full", *REMOTE_TYPES):
        return (f"attention_type {config.attention_type!r} has no Hugging Face equivalent; full attention and "
                f"{', '.join(REMOTE_TYPES)} models can be exported in that layout")
    return None


def standard_fields(config: ModelConfig, dtype: torch.dtype) -> dict:
    """The fields of config.json that transformers' decoders share and tools read without loading the model."""
    return {
        "vocab_size": config.vocab_size, "hidden_size": config.dim, "intermediate_size": config.ffn_dim,
        "num_hidden_layers": config.n_layers, "num_attention_heads": config.n_heads,
        "num_key_value_heads": config.n_kv_heads, "head_dim": config.head_dim,
        "max_position_embeddings": config.context_length, "rms_norm_eps": config.norm_eps,
        "rope_theta": config.rope_theta, "rope_scaling": config.rope_scaling,
        "rope_parameters": {"rope_type": "default", "rope_theta": config.rope_theta, **(config.rope_scaling or {})},
        "tie_word_embeddings": config.tie_embeddings, "dtype": str(dtype).removeprefix("torch."),
        "torch_dtype": str(dtype).removeprefix("torch."),  # the name before transformers 5
    }


def remote_config(config: ModelConfig, dtype: torch.dtype) -> dict:
    """config.json of an export that carries its modeling code (remote_code.py): the ModelConfig whole, and the
    standard fields (`standard_fields`) mirrored from it."""
    return {"architectures": ["LongctxForCausalLM"], "model_type": "longctx", "auto_map": AUTO_MAP,
            "longctx_model": config.to_dict(), **standard_fields(config, dtype), "use_cache": True}


def config_to_hf(config: ModelConfig, dtype: torch.dtype = torch.float32) -> dict:
    """ModelConfig -> a Hugging Face config.json dict: Qwen3ForCausalLM when qk_norm, else LlamaForCausalLM.
    Rope settings are written both as `rope_theta` + `rope_scaling` (read by every transformers version and by
    serving engines) and as transformers>=5 `rope_parameters`."""
    if config.attention_type != "full":
        raise ValueError(f"attention_type {config.attention_type!r} has no Qwen3 or Llama equivalent"
                         + ("; export_hf_checkpoint writes it with its modeling code (remote_config)"
                            if config.attention_type in REMOTE_TYPES else ""))
    model_type = "qwen3" if config.qk_norm else "llama"
    hf_config = {
        "architectures": [ARCHITECTURES[model_type]], "model_type": model_type, **standard_fields(config, dtype),
        "hidden_act": "silu", "attention_bias": False, "attention_dropout": 0.0, "initializer_range": config.init_std,
    }
    hf_config |= {"use_sliding_window": False} if model_type == "qwen3" else {"mlp_bias": False}
    return hf_config


# ---- loading -------------------------------------------------------------------------------------------------------


def read_hf_config(path: str | Path) -> dict:
    """The parsed `config.json` of checkpoint directory `path` (FileNotFoundError when absent)."""
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"checkpoint directory {path} does not exist")
    config_file = path / CONFIG_NAME
    if not config_file.is_file():
        raise FileNotFoundError(f"{path} has no {CONFIG_NAME}; expected a Hugging Face checkpoint directory")
    return _read_json_object(config_file)


def _read_json_object(file: Path) -> dict:
    """The JSON object in `file`; ValueError naming the file when it is not valid JSON or not an object."""
    try:
        value = json.loads(file.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"{file} is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{file} must hold a JSON object, got {type(value).__name__}")
    return value


def _weight_map(index_file: Path) -> dict[str, str]:
    """The `weight_map` (tensor name -> shard file name) of a sharded checkpoint's index; shard names must be plain
    file names in the checkpoint directory (no paths, no '..')."""
    weight_map = _read_json_object(index_file).get("weight_map")
    if not isinstance(weight_map, dict):
        raise ValueError(f"{index_file} has no weight_map object")
    for name in set(weight_map.values()):
        if not isinstance(name, str) or Path(name).name != name or name in ("", ".", ".."):
            raise ValueError(f"{index_file} names the shard {name!r}, which is not a file name in "
                             f"{index_file.parent}: shards must lie in the checkpoint directory")
    return weight_map


def _checkpoint_files(path: Path) -> list[Path]:
    """The safetensors files holding the weights: those named by the sharded index, else model.safetensors, else
    every *.safetensors in the directory."""
    index_file = path / INDEX_NAME
    if index_file.is_file():
        files = [path / name for name in sorted(set(_weight_map(index_file).values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(f"{index_file} names shard files that are absent: {missing}")
        return files
    if (path / SINGLE_FILE).is_file():
        return [path / SINGLE_FILE]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path} holds no *.safetensors weights (PyTorch .bin checkpoints are not supported)")
    return files


def _check_tokenizer_vocab(path: Path, vocab_size: int) -> None:
    """ValueError when the directory's tokenizer.json has token ids the embedding cannot hold. (The embedding may be
    larger than the tokenizer: vocabularies are padded.)"""
    tokenizer_file = path / "tokenizer.json"
    if not tokenizer_file.is_file():
        return
    tokenizer = _read_json_object(tokenizer_file)
    vocab = (tokenizer.get("model") or {}).get("vocab") or {}
    ids = list(vocab.values()) if isinstance(vocab, dict) else list(range(len(vocab)))  # Unigram: a list
    ids += [token["id"] for token in tokenizer.get("added_tokens") or []]
    n_tokens = max(ids, default=-1) + 1
    if n_tokens > vocab_size:
        raise ValueError(f"{tokenizer_file} uses token ids up to {n_tokens - 1} but the model's vocab_size is "
                         f"{vocab_size}: tokenizer and weights do not belong together")


def _read_headers(path: Path, files: list[Path]) -> dict[str, tuple[Path, tuple[int, ...]]]:
    """HF tensor name -> (file, shape), from the safetensors headers only (no tensor data is read)."""
    found: dict[str, tuple[Path, tuple[int, ...]]] = {}
    for file in files:
        with _open_safetensors(file) as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                if name in found:
                    raise ValueError(f"tensor {name!r} appears in both {found[name][0].name} and {file.name}")
                found[name] = (file, tuple(f.get_slice(name).get_shape()))
    index_file = path / INDEX_NAME
    if index_file.is_file():
        indexed = set(_weight_map(index_file))
        if indexed != set(found):
            raise ValueError(f"{index_file.name} and its shard files disagree: only in the index "
                             f"{sorted(indexed - set(found))[:10]}, only in the shards "
                             f"{sorted(set(found) - indexed)[:10]}")
    return found


@contextlib.contextmanager
def _open_safetensors(file: Path, device: str = "cpu") -> Iterator[object]:
    """safe_open(file), with an error naming the file when its header is unreadable (truncated, not safetensors)."""
    try:
        handle = safe_open(file, framework="pt", device=device)
    except Exception as e:  # safetensors raises its own SafetensorError
        raise ValueError(f"{file} is not a readable safetensors file ({e}); it may be truncated: download it "
                         "again") from None
    with handle as f:
        yield f


def _get_tensor(f: object, name: str, file: Path) -> Tensor:
    """Tensor `name` of the open safetensors `f`, with an error naming the file when its data is cut short."""
    try:
        return f.get_tensor(name)
    except Exception as e:
        raise ValueError(f"{file}: tensor {name!r} is unreadable ({e}); the file may be truncated: download it "
                         "again") from None


def _check_keys(found: dict[str, tuple[Path, tuple[int, ...]]], model: Transformer, path: Path) -> None:
    """ValueError counting the missing, unexpected and wrongly shaped tensors and naming (HF names) the first ten
    of each, before any tensor data is read."""
    expected = {stored_name(name, model.config): tuple(t.shape) for name, t in model.state_dict().items()}
    found = {current_name(name): entry for name, entry in found.items()}
    if model.config.tie_embeddings:  # the output weight may be absent; checked against the embedding if present
        head = stored_name("lm_head.weight", model.config)
        expected.pop(head)
        found = {name: entry for name, entry in found.items() if name != head}
    found = {name: entry for name, entry in found.items() if not name.endswith(_IGNORED_SUFFIXES)}
    missing = sorted(set(expected) - set(found))
    unexpected = sorted(set(found) - set(expected))
    mismatched = [f"{name}: checkpoint {found[name][1]} vs model {expected[name]}"
                  for name in sorted(set(expected) & set(found)) if found[name][1] != expected[name]]
    if missing or unexpected or mismatched:
        raise ValueError(f"checkpoint {path} does not fit its config ({len(missing)} missing, {len(unexpected)} "
                         f"unexpected, {len(mismatched)} mis-shaped tensors): missing {missing[:10]}, unexpected "
                         f"{unexpected[:10]}, shape mismatches {mismatched[:10]}")


def check_hf_checkpoint(path: str | Path, **config_overrides: object) -> ModelConfig:
    """The architecture of Hugging Face directory `path`, after checking every tensor name and shape in the
    safetensors headers against it (ValueError otherwise); no tensor data is read, nothing is allocated."""
    path = Path(path)
    config = config_from_hf(read_hf_config(path), **config_overrides)
    _check_tokenizer_vocab(path, config.vocab_size)
    with torch.device("meta"):
        _check_keys(_read_headers(path, _checkpoint_files(path)), Transformer(config), path)
    return config


def load_hf_checkpoint(path: str | Path, device: torch.device | str = "cpu", dtype: torch.dtype | None = None,
                       compute: ComputeConfig | None = None, **config_overrides: object) -> Transformer:
    """Build a Transformer from the Hugging Face checkpoint directory `path` (Qwen3, Llama, or the project's export
    with its modeling code).

    The model is built on the meta device and the safetensors tensors are assigned to it directly on `device`, so
    peak memory is one copy of the weights (plus one tensor in its stored dtype when casting). `dtype` None keeps
    the stored dtype (that of the embedding); the RoPE tables stay float32. `config_overrides` are ModelConfig
    fields applied over config.json (see `config_from_hf`); `compute` how the model runs (default ComputeConfig()).
    Every tensor name and shape is checked against the config before any tensor data is read.
    """
    path = Path(path)
    config = check_hf_checkpoint(path, **config_overrides)
    found = _read_headers(path, _checkpoint_files(path))

    state: dict[str, Tensor] = {}
    for file in sorted({file for file, _ in found.values()}):
        with _open_safetensors(file, str(torch.device(device))) as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                if not name.endswith(_IGNORED_SUFFIXES):
                    tensor = _get_tensor(f, name, file)
                    state[our_name(name)] = tensor if dtype is None else tensor.to(dtype)
    dtype = dtype or state["embed_tokens.weight"].dtype
    state = {name: tensor.to(dtype) for name, tensor in state.items()}  # a no-op unless the file mixes dtypes
    if config.tie_embeddings:
        stored_head = state.pop("lm_head.weight", None)
        if stored_head is not None and not torch.equal(stored_head, state["embed_tokens.weight"]):
            raise ValueError(f"{path}: tie_word_embeddings is true but lm_head.weight differs from the embedding")
    return Transformer.from_weights(config, state, compute)


# ---- export --------------------------------------------------------------------------------------------------------


def hf_state_dict(model: Transformer) -> dict[str, Tensor]:
    """The model's tensors under Hugging Face names (detached; no output weight when tied, as transformers saves
    it: the embedding is stored once). An export with its own modeling code holds the Transformer under `model.`."""
    state = {stored_name(name, model.config): tensor.detach() for name, tensor in model.state_dict().items()}
    if model.config.tie_embeddings:
        del state["model.lm_head.weight" if model.config.attention_type in REMOTE_TYPES else "lm_head.weight"]
    return state


def _plan_shards(state: dict[str, Tensor], max_shard_bytes: int) -> list[list[str]]:
    """Group tensor names, in order, into shards of at most max_shard_bytes (a larger tensor gets its own)."""
    shards: list[list[str]] = [[]]
    size = 0
    for name, tensor in state.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


def export_hf_checkpoint(model: Transformer, path: str | Path, max_shard_bytes: int = 5 * 10**9,
                         overwrite: bool = False, info: ExportInfo = WEIGHTS_ONLY) -> None:
    """Write `model` to directory `path` in the Hugging Face layout (loadable by `load_hf_checkpoint` and by
    transformers' `AutoModelForCausalLM.from_pretrained`): config.json plus model.safetensors, or shards of at most
    `max_shard_bytes` named model-0000i-of-0000n.safetensors with model.safetensors.index.json.

    Everything is written to a temporary sibling directory first, with a manifest.json of sizes and checksums, and
    renamed into place (checkpoint.written_directory), so `path` never holds a half-written checkpoint. An existing
    non-empty `path` is an error unless `overwrite`. `info` (ExportInfo): the tokenizer files, the special ids and
    generation_config.json, the declared context and the dtype of the weights.
    """
    path = Path(path)
    if max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
    if path.exists() and not overwrite and (not path.is_dir() or any(path.iterdir())):
        raise FileExistsError(f"{path} exists and is not empty; pass overwrite=True to replace it")
    state = info.cast(hf_state_dict(model))
    config = info.model_config(model.config)
    remote = config.attention_type in REMOTE_TYPES
    dtype = next(iter(state.values())).dtype
    hf_config = (remote_config if remote else config_to_hf)(config, dtype) | info.special_ids()
    shards = _plan_shards(state, max_shard_bytes)
    names = [SINGLE_FILE] if len(shards) == 1 else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
                                                    for i in range(len(shards))]

    with written_directory(path) as tmp:
        (tmp / CONFIG_NAME).write_text(json.dumps(hf_config, indent=2) + "\n")
        for file_name, shard in zip(names, shards, strict=True):
            tensors = {name: state[name].to("cpu").contiguous() for name in shard}
            save_file(tensors, tmp / file_name, metadata={"format": "pt"})
        if len(shards) > 1:
            weight_map = {name: file_name for file_name, shard in zip(names, shards, strict=True) for name in shard}
            total_size = sum(t.numel() * t.element_size() for t in state.values())
            index = {"metadata": {"total_size": total_size}, "weight_map": weight_map}
            (tmp / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
        for file_name, source in (remote_code_files() if remote else {}).items():
            (tmp / file_name).write_text(source)
        info.write_generation_config(tmp)
        info.write_tokenizer(tmp, config.context_length)
