"""Model weights in and out: the export at the end of a run, and `load_model`, which reads every layout this project
writes or loads.

Layouts `load_model(path)` accepts (detected from the files):
    step-N/                      a training checkpoint (checkpoint.py: DCP shards + train_state.json); only the
                                 model weights are read, the architecture comes from train_state.json
    DIR/model.safetensors +      the project's own export (`export_model` writes it to OUT_DIR/model/): weights
    DIR/config.json              under this project's parameter names (a tied output weight omitted) and the full
                                 ModelConfig; works for every attention type. DIR or the .safetensors file itself
                                 may be given.
    DIR/config.json (HF) +       a Hugging Face Qwen3 / Llama checkpoint (hf.load_hf_checkpoint)
    DIR/*.safetensors

A model keeps its architecture (`ModelConfig`) in every layout; how it computes (`ComputeConfig`) is the caller's
choice, so a long-context model exported with a tiled FFN loads with any compute settings.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

from model import Transformer
from modeling.config import ComputeConfig, ModelConfig
from storage.checkpoint import STATE_NAME, load_model_weights, rank
from storage.hf import (
    CONFIG_NAME,
    WEIGHTS_ONLY,
    ExportInfo,
    check_hf_checkpoint,
    current_name,
    export_hf_checkpoint,
    export_refusal,
    json_object,
    load_hf_checkpoint,
)
from storage.manifest import MANIFEST_NAME, file_records, read_manifest, verify_files, written_directory

WEIGHTS_NAME = "model.safetensors"
FORMAT = "longctx"  # config.json "format" of the project's export (a Hugging Face config.json has "model_type")


def gather_model(model: Transformer, base_only: bool = False) -> Transformer | None:
    """The full model as a plain (unsharded) CPU Transformer on rank 0, None on other ranks (collective).
    `base_only`: keep only the weights a plain Transformer has, leaving out what a fine-tuning mode added (LoRA
    adapters after lora.merge_lora_ folded them into the base); otherwise such weights are an error."""
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank() != 0:
        return None
    if base_only:
        full = {name: t for name, t in full.items() if name in base_parameter_names(model.config)}
    return Transformer.from_weights(model.config, full, model.compute)


def state_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The state-dict names of a plain Transformer of `config` (no fine-tuning parameters) with their shapes, read
    off a meta model."""
    with torch.device("meta"):
        return {name: tuple(t.shape) for name, t in Transformer(config).state_dict().items()}


def base_parameter_names(config: ModelConfig) -> set[str]:
    """The state-dict names of a plain Transformer of `config` (no fine-tuning parameters)."""
    return set(state_shapes(config))


def export_model(model: Transformer, out_dir: str | Path, base_only: bool = False,
                 info: ExportInfo = WEIGHTS_ONLY) -> list[Path]:
    """Write the final weights of `model` (collective under FSDP: every rank calls it): `out_dir/model/`
    (model.safetensors + config.json, the project's layout, any attention type) and `out_dir/hf/` (the Hugging Face
    layout) when the architecture has an equivalent there (`hf.export_refusal`). Each directory is written whole
    or not at all, with a manifest.json that `load_model` checks (checkpoint.written_directory), and holds what
    `info` adds (hf.ExportInfo: the tokenizer, named in model/config.json; the declared context; the dtype).
    Returns the directories written on rank 0, [] elsewhere. `base_only`: see `gather_model`."""
    plain = gather_model(model, base_only)
    if plain is None:
        return []
    out_dir = Path(out_dir)
    config = info.model_config(plain.config)
    state = info.cast({k: v.contiguous() for k, v in plain.state_dict().items()})
    if plain.config.tie_embeddings:
        del state["lm_head.weight"]  # safetensors refuses shared storage; it is embed_tokens.weight
    with written_directory(out_dir / "model") as tmp:
        save_file(state, tmp / WEIGHTS_NAME, metadata={"format": "pt", "model_config": json.dumps(config.to_dict())})
        described = {"format": FORMAT, "model": config.to_dict(), "compute": plain.compute.to_dict()}
        if info.tokenizer is not None:
            described["tokenizer"] = info.tokenizer.record()
        (tmp / CONFIG_NAME).write_text(json.dumps(described, indent=1) + "\n")
        info.write_tokenizer(tmp, config.context_length)
    written = [out_dir / "model"]
    if export_refusal(plain.config) is None:
        export_hf_checkpoint(plain, out_dir / "hf", overwrite=True, info=info)
        written.append(out_dir / "hf")
    return written


def _is_training_checkpoint(path: Path) -> bool:
    return path.is_dir() and (path / STATE_NAME).is_file() and (path / ".metadata").is_file()


def _export_config(path: Path) -> dict | None:
    """The ModelConfig dict of the project's export at `path` (a directory or its model.safetensors), or None
    when `path` is not one."""
    weights = path if path.suffix == ".safetensors" else path / WEIGHTS_NAME
    if not weights.is_file():
        return None
    config_file = weights.with_name(CONFIG_NAME)
    if config_file.is_file():
        try:
            described = json.loads(config_file.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{config_file} is not valid JSON ({e}); re-export the model") from e
        if isinstance(described, dict) and described.get("format") == FORMAT:
            return described["model"]
        if isinstance(described, dict) and "model_type" in described:
            return None  # a Hugging Face directory
    with safe_open(weights, framework="pt") as f:  # an export whose config.json went missing: the metadata has it
        metadata = f.metadata() or {}
    return json.loads(metadata["model_config"]) if "model_config" in metadata else None


class Stored(NamedTuple):
    """What a path holds (`stored`): its layout, "checkpoint" (a training checkpoint step-N/), "export" (the
    project's export: its directory, or its model.safetensors) or "hf" (a Hugging Face directory); the
    architecture, checked against the tensor names and shapes in the file headers; the weights (the checkpoint's
    directory, the export's model.safetensors, the Hugging Face directory); the directory that holds them and what
    is stored with them (a tokenizer: text.tokenizer.tokenizer_file); the records of its files, checked against its
    manifest.json (None: it has none, as a Hugging Face directory from elsewhere). `load_model` takes it in place
    of the path, so a caller that has asked what a path holds reads and checks its files once."""

    layout: str
    config: ModelConfig
    weights: Path
    home: Path
    records: dict[str, dict] | None

    def fingerprint(self) -> str:
        """A checksum of the weight files: SHA-256 over their names, sizes and block CRC-32s (manifest.file_records),
        16 hex digits, from the checked manifest when there is one (nothing read again). Tells whether two runs
        adapt the same base."""
        weights = self.weights
        files = [weights] if weights.is_file() else sorted(p for p in weights.iterdir()
                                                           if p.suffix in (".safetensors", ".distcp"))
        known = self.records or {}
        records = ({p.name: known[p.name] for p in files} if all(p.name in known for p in files)
                   else file_records(files))
        return hashlib.sha256(json.dumps(records, sort_keys=True).encode()).hexdigest()[:16]


def stored(path: str | Path) -> Stored:
    """What is stored at `path`, read from its files' headers and checked against their manifest (when the project
    wrote them) before anything is built; no tensor data is read. FileNotFoundError / ValueError naming `path` and
    every layout when it holds none of them."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist")
    records = verify(path)
    home = path.parent if path.suffix == ".safetensors" else path
    if _is_training_checkpoint(path):
        config = ModelConfig.from_dict(json.loads((path / STATE_NAME).read_text())["model_config"])
        return Stored("checkpoint", config, path, home, records)
    if (described := _export_config(path)) is not None:
        weights = path if path.suffix == ".safetensors" else path / WEIGHTS_NAME
        config = ModelConfig.from_dict(described)
        _check_export_shapes(weights, config)
        return Stored("export", config, weights, home, records)
    if path.is_dir() and "model_type" in json_object(path / CONFIG_NAME):
        return Stored("hf", check_hf_checkpoint(path), path, home, records)
    if (path / "adapter_config.json").is_file() or (path / "adapters.safetensors").is_file():
        raise ValueError(f"{path} holds adapters, not a model: evaluate the model they adapt merged with them (a LoRA "
                         "run with --merge exports it to OUT_DIR/model), or load them on their base with peft "
                         "(docs/finetuning.md)")
    hint = f"; did you mean {path / 'model'} (a run's export)?" if (path / "model" / WEIGHTS_NAME).is_file() else ""
    raise ValueError(f"{path} is not a model: expected a training checkpoint step-N/ ({STATE_NAME} + .metadata), "
                     f"the project's export ({WEIGHTS_NAME} + {CONFIG_NAME} with \"format\": \"{FORMAT}\"), or a "
                     f"Hugging Face directory ({CONFIG_NAME} with \"model_type\" + *.safetensors){hint}")


def stored_config(path: str | Path) -> ModelConfig:
    """The architecture stored at `path` (`stored`)."""
    return stored(path).config


def load_model(path: str | Path | Stored, device: torch.device | str = "cpu", dtype: torch.dtype | None = None,
               compute: ComputeConfig | None = None) -> Transformer:
    """The model stored at `path` (`stored`: a training checkpoint step-N/, the project's export, directory or
    model.safetensors, or a Hugging Face directory; or what `stored` found there, checked already). Weights land on
    `device`, cast to `dtype` when given (default: as stored; a training checkpoint stores float32). `compute`: how
    the model will compute (default ComputeConfig()). Raises FileNotFoundError / ValueError naming `path` when it is
    none of these.
    """
    if dtype is not None and not isinstance(dtype, torch.dtype):
        raise ValueError(f"dtype must be a torch.dtype such as torch.bfloat16, got {dtype!r}")
    if torch.device(device).type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r}: this machine has no CUDA device; use \"cpu\"")
    found = path if isinstance(path, Stored) else stored(path)  # before anything is read or built
    if found.layout == "hf":
        return load_hf_checkpoint(found.weights, device=device, dtype=dtype, compute=compute)
    if found.layout == "checkpoint":
        model = Transformer.from_weights(found.config, None, compute, device)
        load_model_weights(found.weights, model)  # every weight is read from the checkpoint
        return model if dtype is None else model.to(dtype)
    with safe_open(found.weights, framework="pt", device=str(device)) as f:
        state = {current_name(name): f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 (not a dict)
    if dtype is not None:
        state = {name: t.to(dtype) for name, t in state.items()}
    return Transformer.from_weights(found.config, state, compute)


def verify(path: Path) -> dict[str, dict] | None:
    """Check the files of what `path` holds against its manifest.json (manifest.verify_files) and return its records:
    every training checkpoint and every export this project writes has one; a Hugging Face directory from elsewhere
    has none and is read as it is (None)."""
    home = path.parent if path.suffix == ".safetensors" else path
    if _is_training_checkpoint(home) or (home / MANIFEST_NAME).is_file():
        verify_files(home)
        return read_manifest(home)
    return None


def _check_export_shapes(weights: Path, config: ModelConfig) -> None:
    """ValueError unless the tensors in the header of export `weights` are those of `config` (a tied output weight
    omitted), with their shapes; no tensor data is read."""
    expected = state_shapes(config)
    if config.tie_embeddings:
        del expected["lm_head.weight"]
    with safe_open(weights, framework="pt") as f:
        found = {current_name(name): tuple(f.get_slice(name).get_shape()) for name in f.keys()}  # noqa: SIM118
    if found != expected:
        wrong = sorted(set(found) ^ set(expected)) + [n for n in sorted(set(found) & set(expected))
                                                      if found[n] != expected[n]]
        raise ValueError(f"{weights} does not match its config: {wrong[:10]} differ (names or shapes)")


def load_initial_weights(model: Transformer, path: str | Path | Stored,
                         convert: Callable[[dict[str, Tensor]], dict[str, Tensor]] | None = None,
                         fresh: tuple[str, ...] = ()) -> None:
    """Fill `model` (plain, or sharded by FSDP2: collective then) with the weights stored at `path`, which must have
    the same parameter names and shapes (RoPE settings and the context length may differ: they are not weights;
    LoRA adapters are not in the file). Only rank 0 reads the file; under FSDP its full state dict is broadcast and
    each rank keeps its shards (the architecture was built from the file's own config, `stored_config`).
    `path` may be what `stored` found there (its files checked already). `convert`: maps the stored state dict to the
    model's (nsa.from_dense.nsa_state_from_dense); `fresh`: name parts of parameters it leaves to the model's own
    initialisation."""
    source = load_model(path, "cpu", torch.float32) if rank() == 0 else None
    state = source.state_dict() if source is not None else {}
    if convert is not None and state:
        state = convert(state)
    if not dist.is_initialized():
        missing, unexpected = model.load_state_dict(state, strict=False)
        added = set(model.state_dict()) - base_parameter_names(model.config)  # a fine-tuning mode's own
        missing = [name for name in missing if name not in added and not any(part in name for part in fresh)]
        if missing or unexpected:
            where = path.weights if isinstance(path, Stored) else path
            raise ValueError(f"{where} does not fit the model: missing {missing[:10]}, unexpected {unexpected[:10]}")
        return
    set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True,
                                                                strict=False))  # adapters, `fresh`: not stored


