"""Options of a training run: `TrainConfig`, read from defaults < a `--config` JSON/TOML file < the command line,
and resolved from the device and the context length (`resolve_config`, `build_model_config`). Every field is a
`--flag`; `python train.py --help` lists them.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import typing
from dataclasses import dataclass, field
from pathlib import Path

import torch

from modeling.config import (
    ATTENTION_TYPES,
    PRESETS,
    ComputeConfig,
    ModelConfig,
    check_effective,
    registered,
    split_overrides,
)
from modeling.objective import FIELDS as OBJECTIVE_FIELDS
from modeling.objective import SCORE_LOSS_OPTIONS, SCORE_LOSS_TARGETS, Objective
from modeling.shard import balanced_spans
from text.synthetic import RECALL_TASKS, SYNTHETIC_TASKS
from training.cli import PLUGIN_HELP, Parser, json_object, numbered
from training.quantize import QUANTIZED
from training.tracking import TRACKERS

LONG_CONTEXT = 32768  # from here on, "auto" options resolve to the long-context recipe (see resolve_config)
BATCH_TOKENS = 4096  # auto batch size: max(1, BATCH_TOKENS // T) sequences per micro-batch
TILED_FFN_CHUNK = 8192  # FFN tile from LONG_CONTEXT on: one tile's (T, ffn_dim) intermediates at a time
DEFAULT_DATA_DIR = "data/stdlib"
TOKENIZER_VOCAB = 8192  # vocabulary of the tokenizer trained for the default corpus
MAX_STEP_TOKENS = 2**28  # tokens of one step per process: their ids and labels (16 bytes each) are held at once
OFFLOAD_SHARE = 0.2  # auto activation offload: when the checkpointed block inputs exceed this share of GPU memory


def option(default: object, help: str) -> typing.Any:
    """A dataclass field with its command-line help (TrainConfig's, and NPTConfig's in train_npt.py)."""
    if isinstance(default, dict):
        return field(default_factory=lambda: dict(default), metadata={"help": help})
    return field(default=default, metadata={"help": help})


# Fine-tuning modes (training/modes.py implements the built-in ones): name -> "module:Class", imported on first use
# (so parsing options imports no model code), or the class itself.
FINETUNE_MODES: dict[str, str | type] = {"full": "training.modes:Full", "lora": "training.modes:LoRA",
                                         "npt": "training.modes:NPT"}


def register_finetune(name: str, cls: str | type) -> None:
    """Make `cls` (a class implementing training.modes.FinetuneMode, or its "module:Class" path) the mode
    `--finetune name`."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"a fine-tuning mode needs a non-empty name, got {name!r}")
    FINETUNE_MODES[name] = cls


def finetune_class(name: str) -> type:
    """The class registered as fine-tuning mode `name` (imported on first use)."""
    if name not in FINETUNE_MODES:
        raise ValueError(f"--finetune must be one of {sorted(FINETUNE_MODES)} (add one with "
                         f"training.options.register_finetune, or --plugin MODULE), got {name!r}")
    return registered(FINETUNE_MODES, name)


@dataclass
class TrainConfig:
    """Every training option; `--name value` on the command line, or a key of the `--config` JSON/TOML file."""

    # model
    model_size: str = option("auto", f"preset: {', '.join(PRESETS)}; 'auto' = "
                                   f"4B on CUDA from {LONG_CONTEXT} tokens of context, else demo")
    attention_type: str = option("auto", f"a registered type (config.ATTENTION_TYPES: 'full', 'nsa', ...) or 'auto' = "
                                       f"nsa from {LONG_CONTEXT} tokens, else full")
    init_from: str | None = option(None, "start from these weights: a Hugging Face Qwen3/Llama directory, an export "
                                         "(OUT_DIR/model) or a step-N; the architecture is theirs (--model_size is "
                                         "ignored), and so is the directory's tokenizer.json unless --tokenizer is "
                                         "given")
    context_length: int = option(256, "T: tokens per training sequence")
    rope_theta: float | None = option(None, "RoPE base (default: the preset's or the --init_from model's); a larger "
                                            "base extends the context")
    rope_scaling: dict = option({}, "RoPE scaling as JSON (default: the preset's or the --init_from model's), e.g. "
                                    "YaRN: '{\"rope_type\": \"yarn\", \"factor\": 4.0, "
                                    "\"original_max_position_embeddings\": 32768}'")
    model_overrides: dict = option({}, "ModelConfig (and ComputeConfig) fields over the preset, as JSON, e.g. "
                                       "'{\"n_layers\": 8}'")
    gradient_checkpointing: bool | None = option(None, f"recompute blocks in backward (default: on from "
                                                     f"{LONG_CONTEXT} tokens)")
    context_parallel: int = option(1, "N: processes that split each sequence (context parallelism; torchrun's "
                                      "processes form groups of N, each rank holding 2 of the sequence's 2N chunks "
                                      "and gathering the keys of the others): the longest context grows with N")
    finetune: str = option("full", "'full': train every weight; 'lora': LoRA adapters, or 'npt': neuro-plastic FFN "
                                   "layers (npt/), on a frozen base (the --init_from weights; bf16 with --dtype "
                                   "bfloat16 for npt); only the adapters are optimised and checkpointed")
    lora_rank: int = option(16, "LoRA rank r")
    lora_alpha: float = option(32.0, "LoRA scale numerator (the update is alpha / r * B A)")
    lora_targets: str = option("q,k,v,o", "comma-separated projections LoRA adapts in every block: q, k, v, o, gate, "
                                          "up, down")
    quantize_base: str | None = option(None, "LoRA: weight-only quantization of the frozen base's block linear layers "
                                             "(torchao): 'int8', 'nf4' (QLoRA's 4 bits) or 'int4'; one process only")
    npt_layers: str = option("upper_half", "NPT: the converted layers: 'upper_half', 'all' or indices such as '4,5'")
    npt_rank: int = option(16, "NPT: rank of the modulation")
    npt_targets: str = option("gate,up", "NPT: the modulated FFN projections, comma-separated from gate, up, down")
    npt_residual_mode: str = option("modulate", "NPT: 'modulate' (the attention output only modulates the FFN) or "
                                                "'additive' (it is also added to the residual stream)")
    adapter: str | None = option(None, "adapters to start from: LoRA, a peft-layout directory (e.g. OUT_DIR/adapter); "
                                       "NPT, an adapters.safetensors (e.g. from train_npt.py)")
    merge: bool = option(False, "LoRA: at the end also fold the adapters into the base and export the merged model "
                                "(OUT_DIR/model, hf/)")
    offload_activations: bool | None = option(None, "keep the tensors blocks save for backward (with checkpointing: "
                                                    "their inputs) in pinned host memory, copied on a side stream "
                                                    "(CUDA); default: on when those inputs would take over "
                                                    f"{OFFLOAD_SHARE:.0%} of the GPU's memory")
    loss: str = option("auto", f"'chunked' (the output layer and loss in chunks: the full logits never exist, see "
                               f"loss.py), 'standard', or 'auto': chunked from {LONG_CONTEXT} tokens, and below when "
                               "the logits would take over 10 GiB")
    ffn_chunk_size: int | None = option(None, f"tokens per FFN tile (tiled FFN, recomputed in backward; 0: untiled; "
                                              f"default: {TILED_FFN_CHUNK} from {LONG_CONTEXT} tokens, else untiled)")
    attention_query_chunk: int | None = option(None, "queries NSA processes together on CPU, in its score loss "
                                                    "and during --nsa_exact_selection_steps (bounds their working "
                                                    "memory; default 512; the Triton kernels take all at once in "
                                                    "training, an eighth at a time without gradients)")
    compile: bool = option(False, "torch.compile each block")
    dtype: str = option("auto", "'float32' or 'bfloat16' (mixed precision: fp32 master weights, bf16 compute, fp32 "
                              "gradient reduction); 'auto' = bfloat16 on CUDA, float32 on CPU")
    # optimisation
    batch_size: int | None = option(None, f"B: sequences per rank per micro-step (default: max(1, {BATCH_TOKENS} "
                                          "// T))")
    gradient_accumulation_steps: int = option(1, "A: micro-steps per optimizer step")
    max_steps: int = option(300, "optimizer steps")
    lr: float | None = option(None, "peak learning rate of AdamW (default: 3e-3 for demo/tiny, 3e-4 for the larger "
                                  "presets, 2e-5 from --init_from weights)")
    warmup_steps: int = option(30, "linear warmup steps (a run shorter than this never reaches --lr), then cosine "
                                   "decay to lr * min_lr_ratio at max_steps")
    min_lr_ratio: float = option(0.1, "final learning rate as a fraction of lr")
    weight_decay: float = option(0.1, "AdamW weight decay of the matrices (norm weights are not decayed)")
    grad_clip: float = option(1.0, "clip the global gradient norm to this (0: no clipping; the norm is still logged)")
    max_bad_steps: int = option(5, "stop after this many consecutive steps with a non-finite loss or gradient norm")
    seed: int = option(0, "seed of the initialisation, the data order and the sample")
    # objective (modeling/objective.py): what the run minimises besides next-token cross-entropy
    z_loss_coef: float = option(0.0, "weight of the z-loss, logsumexp(logits)^2 per predicted token (PaLM uses 1e-4)")
    nsa_score_loss_coef: float = option(0.0, "NSA: weight of the selection-scoring loss (nsa/scoring.py), which "
                                             "teaches the importance scores which blocks to select; the recommended "
                                             "retrieval recipe is --config configs/nsa-retrieval.json")
    nsa_score_loss_stride: int = option(1, "NSA: that loss on every k-th query, from a random offset (1/k of its "
                                           "cost)")
    nsa_score_loss_top: int = option(0, "NSA: that loss over each query's m blocks of highest importance only (0: "
                                        "every block, reading every key)")
    nsa_score_loss_random: int = option(0, "NSA: and over r random other blocks (with --nsa_score_loss_top)")
    nsa_score_loss_target: str = option("scores", "NSA: that loss's target: 'scores' (the blocks' best-key softmax), "
                                                  "'selection' (uniform over the n - 3 blocks it selects) or "
                                                  "'boundary' (a ranking loss: those blocks above the others)")
    nsa_score_loss_temperature: float = option(1.0, "NSA: the 'scores' target is the softmax of the blocks' best-key "
                                                    "logits divided by this (above 1: smoother)")
    nsa_exact_selection_steps: int = option(0, "NSA: for the first K steps select blocks by their best key "
                                               "(nsa.primitive.exact_block_scores: every key read, no sparse "
                                               "saving), while the selection-scoring loss trains the importance "
                                               "scores, then by the scores (a warm-up, as DeepSeek-V3.2 trains its "
                                               "indexer before relying on it)")
    # data
    data_dir: str | None = option(None, f"prepared data (data.py); default: {DEFAULT_DATA_DIR}, this Python's "
                                        "standard library, tokenized there on first use (with another tokenizer: "
                                        f"{DEFAULT_DATA_DIR}-<its hash>)")
    tokenizer: str | None = option(None, "tokenizer: a SentencePiece .model, a tokenizer.json or a directory "
                                         "holding one (default: the one stored with the checkpoint resumed or "
                                         "the --init_from weights, else DATA_DIR's)")
    synthetic_mix: float = option(0.0, "share of training rows replaced by synthetic retrieval documents of "
                                     "--synthetic_task (synthetic.py); deterministic and resumable")
    synthetic_task: str = option("passkey", "'passkey' (a passkey or multi-key needle prompt and its answer), 'mqar' "
                                            "(dense multi-query associative recall over random token ids), "
                                            "'mqar_text' (the same in sentences) or 'copy' (a random sequence "
                                            "written twice: learns an induction head)")
    synthetic_pairs: int | None = option(None, "mqar, mqar_text: key-value pairs in a document, each queried once "
                                               "(default: a third of its slots, 10 at T=64 and 85 at T=512 for "
                                               "mqar); the more pairs, the more keys a query must tell apart")
    answer_loss: bool = option(False, "synthetic rows: loss on their answers only (labels -100 elsewhere)")
    document_mask: bool = option(False, "each token attends only within its own document of the packed rows (a "
                                        "document opens with the end-of-document id that closes the one before); "
                                        "full attention and NSA")
    tracker: str | None = option(None, "also send the metrics to 'tensorboard' (OUT_DIR/tensorboard) or 'wandb' "
                                       "(WANDB_MODE=offline works without an account)")
    export_dtype: str = option("auto", "dtype of the exported weights: 'float32', 'bfloat16', or 'auto' = --dtype's "
                                       "(bf16 training exports bf16)")
    # run
    out_dir: str = option("auto", "run directory: config.json, metrics.jsonl, step-N/, model/, hf/; 'auto' = "
                                  "runs/<model>-<attention>-<T>[-<finetune>], or the next free -2, -3, ... when that "
                                  "holds another run (with --resume: the newest of them)")
    resume: str | None = option(None, "'auto' (or no value): newest complete OUT_DIR/step-N; or a step-N path. "
                                      "The run continues with the options it recorded; those given change it")
    checkpoint_interval: int = option(100, "save every this many steps (0: only at the end)")
    checkpoint_minutes: float = option(0.0, "also save at the first step boundary this many minutes after the last "
                                            "save (0: off); bounds the work a kill or a preemption can lose")
    keep_checkpoints: int = option(3, "complete step-N directories kept (the newest always); older ones are deleted")
    log_interval: int = option(10, "print a metrics line every this many steps")
    heartbeat_seconds: float = option(60.0, "inside a step, print which micro-batch, pass and block runs every this "
                                            "many seconds (0: never)")
    eval_interval: int = option(0, "validation loss every this many steps and at the end (0: never); needs the "
                                 "data's validation split")
    eval_tokens: int = option(32768, "validation tokens per evaluation (whole windows, at least one per rank)")
    max_memory: float | None = option(None, "memory budget in GiB per process (CUDA allocator peak, or RSS on CPU): "
                                            "the cache is freed from 70% of it; past it, a checkpoint and a stop")
    empty_cache_interval: int = option(0, "free the CUDA allocator's cache (CPU: collect garbage) every this many "
                                          "steps (0: never)")
    sample_tokens: int | None = option(None, "tokens to generate from the final model after --sample_prompt (0: "
                                             "none; default: 200, fewer when the context is shorter)")
    sample_prompt: str | None = option(None, "prompt of the final sample (default: 'def ' on the default corpus of "
                                             "Python source, else the start of a document)")
    verbose: bool = option(False, "print the whole resolved configuration at the start, and the traceback of an "
                                  "error")

    def __post_init__(self) -> None:
        choices = {"model_size": [*PRESETS, "auto"], "attention_type": ["auto", *ATTENTION_TYPES],
                   "dtype": ["auto", "float32", "bfloat16"], "export_dtype": ["auto", "float32", "bfloat16"],
                   "finetune": list(FINETUNE_MODES),
                   "npt_residual_mode": ["modulate", "additive"], "loss": ["auto", "standard", "chunked"],
                   "quantize_base": [None, *QUANTIZED], "synthetic_task": list(SYNTHETIC_TASKS),
                   "tracker": [None, *TRACKERS], "nsa_score_loss_target": list(SCORE_LOSS_TARGETS)}
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                plugin = " (one from outside the repository: --plugin MODULE)" if name == "attention_type" else ""
                raise ValueError(f"--{name} must be one of {allowed}{plugin}, got {getattr(self, name)!r}")
        for name, low in MINIMUM.items():
            value = getattr(self, name)
            if value is not None and value < low:
                raise ValueError(f"--{name} must be >= {low}, got {value}")
        if self.synthetic_pairs is not None and self.synthetic_task not in RECALL_TASKS:
            raise ValueError(f"--synthetic_pairs applies to --synthetic_task mqar or mqar_text, not "
                             f"{self.synthetic_task}")
        if self.sample_tokens is not None and self.sample_tokens >= self.context_length:
            raise ValueError(f"--sample_tokens must be less than --context_length ({self.context_length}), the "
                             f"longest sequence the model generates; got {self.sample_tokens}")
        self.check_context_parallel()
        if self.seed > MAX_SEED:
            raise ValueError(f"--seed must be <= {MAX_SEED} (64-bit generators), got {self.seed}")
        for table, zero_allowed in ((POSITIVE, False), (NON_NEGATIVE, True)):
            for name, high in table.items():
                check_real(name, getattr(self, name), high, zero_allowed)
        self.npt_layer_spec()
        try:
            self.objective()
        except ValueError as e:
            raise ValueError(f"--{e}") from None
        if moved := sorted(set(self.model_overrides) & set(OBJECTIVE_FIELDS)):
            raise ValueError(f"--model_overrides may not set {moved[0]}, a term of the training objective: pass "
                             f"--{moved[0]} instead")
        try:
            split_overrides(self.model_overrides)
        except ValueError as e:
            raise ValueError(f"--model_overrides: {e}") from e
        if own := sorted(set(self.model_overrides) & set(OWN_OPTION)):
            raise ValueError(f"--model_overrides may not set {', '.join(own)}: pass {OWN_OPTION[own[0]]} instead (the "
                             "option train.py resolves and checks)")

    def check_context_parallel(self) -> None:
        """ValueError for a --context_parallel the context cannot split (naming the lengths that can), or with
        --compile."""
        if self.context_parallel > 1:
            balanced_spans(self.context_length, self.context_parallel, 0)
            if self.compile:
                raise ValueError("--compile with --context_parallel is not supported (the sequence split's "
                                 "collectives and span loops are untested under torch.compile): leave one out")

    def objective(self) -> Objective:
        """What the run minimises besides cross-entropy: the objective options."""
        return Objective(**{name: getattr(self, name) for name in OBJECTIVE_FIELDS})

    def npt_layer_spec(self) -> str | list[int]:
        """--npt_layers as npt.convert takes it: 'upper_half', 'all' or a list of indices."""
        if self.npt_layers in ("upper_half", "all"):
            return self.npt_layers
        try:
            layers = [int(i) for i in self.npt_layers.split(",")]
        except ValueError:
            layers = [-1]
        if min(layers) < 0:
            raise ValueError(f"--npt_layers must be 'upper_half', 'all' or comma-separated indices from 0 such as "
                             f"'4,5'; got {self.npt_layers!r}")
        return layers


# Fields --model_overrides may not set: the option that sets each.
OWN_OPTION = {"context_length": "--context_length", "attention_type": "--attention_type", "rope_theta": "--rope_theta",
              "rope_scaling": "--rope_scaling"}
# Fields --model_overrides may set unless the option that sets each is given too (the override would win silently).
SHARED_FIELD = {"ffn_chunk_size": "ffn_chunk_size", "attention_query_chunk": "attention_query_chunk",
                "loss_mode": "loss", "loss_rows": "answer_loss", "offload_activations": "offload_activations"}
# Integer options: the smallest value (and the largest, for the seed: torch's generators take 64 bits).
MINIMUM = {"context_length": 2, "batch_size": 1, "gradient_accumulation_steps": 1, "max_steps": 1, "warmup_steps": 0,
           "max_bad_steps": 1, "checkpoint_interval": 0, "log_interval": 1, "eval_interval": 0, "eval_tokens": 1,
           "keep_checkpoints": 1, "lora_rank": 1, "npt_rank": 1, "empty_cache_interval": 0, "sample_tokens": 0,
           "ffn_chunk_size": 0, "attention_query_chunk": 1, "seed": 0, "synthetic_pairs": 1,
           "nsa_score_loss_stride": 1, "nsa_score_loss_top": 0, "nsa_score_loss_random": 0,
           "nsa_exact_selection_steps": 0, "context_parallel": 1}
MAX_SEED = 2**63 - 1
# Real options: finite, in (0, high] (POSITIVE) or [0, high] (NON_NEGATIVE).
POSITIVE = {"lr": 1.0, "max_memory": math.inf, "rope_theta": math.inf, "lora_alpha": math.inf,
            "nsa_score_loss_temperature": math.inf}
NON_NEGATIVE = {"weight_decay": math.inf, "grad_clip": math.inf, "checkpoint_minutes": math.inf,
                "heartbeat_seconds": math.inf, "synthetic_mix": 1.0, "min_lr_ratio": 1.0, "z_loss_coef": math.inf,
                "nsa_score_loss_coef": math.inf}


def check_real(name: str, value: float | None, high: float, zero_allowed: bool) -> None:
    """ValueError naming --name unless `value` (None: unset) is finite, > 0 (>= 0 when `zero_allowed`), <= high."""
    if value is None or (math.isfinite(value) and (value >= 0 if zero_allowed else value > 0) and value <= high):
        return
    low = ">= 0" if zero_allowed else "> 0"
    raise ValueError(f"--{name} must be a finite number {low}" + (f" and <= {high:g}" if high < math.inf else "")
                     + f", got {value}")


# ---- configuration: defaults < file < command line -----------------------------------------------------------


def _field_type(name: str, cls: type = None) -> type:
    """The non-None type of a field of dataclass `cls` (TrainConfig by default; int for `int | None`)."""
    kind = typing.get_type_hints(cls or TrainConfig)[name]
    return next(t for t in typing.get_args(kind) if t is not type(None)) if typing.get_args(kind) else kind


def field_help(f: dataclasses.Field) -> str:
    """A TrainConfig / NPTConfig field's help for argparse: its text ('%' escaped) and its default."""
    default = f.default if f.default is not dataclasses.MISSING else {}
    return f.metadata["help"].replace("%", "%%") + ("" if default is None else f" (default: {default})")


def build_parser() -> argparse.ArgumentParser:
    """Command-line options generated from TrainConfig; options not given are absent from the result."""
    parser = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     argument_default=argparse.SUPPRESS)
    parser.add_argument("--config", help="JSON or TOML file of TrainConfig fields (command-line options win)")
    parser.add_argument("--plugin", action="append", metavar="MODULE", help=PLUGIN_HELP)
    for f in dataclasses.fields(TrainConfig):
        kind = _field_type(f.name)
        kwargs: dict = {"help": field_help(f)}
        if kind is bool:  # --name / --no-name
            kwargs.update(action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS)
        elif kind is dict:
            kwargs.update(type=json_object, metavar="JSON")
        else:
            kwargs["type"] = kind
        if f.name == "resume":
            kwargs.update(nargs="?", const="auto")
        parser.add_argument(f"--{f.name}", **kwargs)
    return parser


def load_config_file(path: str, *classes: type) -> dict:
    """Fields of `classes` (default: TrainConfig) from a JSON (or, on Python 3.11+, TOML) file, type-checked:
    ValueError / FileNotFoundError naming the file."""
    classes = classes or (TrainConfig,)
    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(f"config file {file} " + ("is a directory" if file.is_dir() else "does not exist"))
    try:
        if file.suffix == ".toml":
            import tomllib  # Python 3.11+

            values = tomllib.loads(file.read_text())
        else:
            values = json.loads(file.read_text())
    except ModuleNotFoundError as e:
        raise ValueError(f"{file}: TOML configs need Python 3.11+; use a JSON file") from e
    except ValueError as e:  # JSONDecodeError, TOMLDecodeError
        raise ValueError(f"{file} is not valid {'TOML' if file.suffix == '.toml' else 'JSON'}: {e}") from None
    if not isinstance(values, dict):
        raise ValueError(f"{file} must hold an object of options, got {type(values).__name__}")
    owner = {f.name: cls for cls in classes for f in dataclasses.fields(cls)}
    for key, value in values.items():
        if key not in owner:
            raise ValueError(f"{file}: unknown option {key!r}; valid options: {sorted(owner)}")
        kind = _field_type(key, owner[key])
        ok = value is None and type(None) in typing.get_args(typing.get_type_hints(owner[key])[key])
        ok = ok or (isinstance(value, kind) and not (kind is int and isinstance(value, bool)))
        ok = ok or (kind is float and isinstance(value, int) and not isinstance(value, bool))
        if not ok:
            raise ValueError(f"{file}: option {key!r} must be {kind.__name__}, got {value!r}")
    return values


def parse_config(argv: list[str] | None = None) -> TrainConfig:
    """TrainConfig from the command line; bad options exit with a usage error naming the option."""
    return parse_options(build_parser(), argv)[0]


def parse_run(argv: list[str] | None = None) -> tuple[TrainConfig, frozenset[str]]:
    """(TrainConfig, the options given in --config or on the command line) for train.py: a resumed run takes the
    others from its record (`continue_options`)."""
    cfg, _, given = parse_options(build_parser(), argv)
    return cfg, given


def merged_options(recipe: dict, given: dict, source: str | None) -> dict:
    """The options of a `--config` file (`recipe`) under those of the command line (`given`): a dict-valued option
    (--model_overrides, --rope_scaling) merges key by key, the command line winning per key; each such merge is
    printed (standard error, rank 0), and the merged value is what the run records."""
    values = {**recipe, **given}
    for name in sorted(set(recipe) & set(given)):
        if isinstance(recipe[name], dict) and isinstance(given[name], dict) and recipe[name]:
            values[name] = {**recipe[name], **given[name]}
            if int(os.environ.get("RANK", "0")) == 0:
                kept = sorted(set(recipe[name]) - set(given[name]))
                print(f"--{name} {json.dumps(values[name])}: {', '.join(kept) or 'nothing'} from {source}, "
                      f"{', '.join(sorted(given[name])) or 'nothing'} from the command line", file=sys.stderr)
    return values


def parse_options(parser: argparse.ArgumentParser, argv: list[str] | None = None
                  ) -> tuple[TrainConfig, dict, frozenset[str]]:
    """(TrainConfig, the tool's own options, the TrainConfig options given) from `parser`: build_parser()'s options
    plus those a tool added (profile_memory.py); bad options exit with a usage error naming the option."""
    args = vars(parser.parse_args(argv))
    names = {f.name for f in dataclasses.fields(TrainConfig)}
    own = {k: v for k, v in args.items() if k not in names and k not in ("config", "plugin")}  # plugin: loaded
    try:
        recipe = load_config_file(args["config"]) if "config" in args else {}
        values = merged_options(recipe, {k: v for k, v in args.items() if k in names}, args.get("config"))
        return TrainConfig(**values), own, frozenset(values)
    except (ValueError, FileNotFoundError) as e:
        parser.error(str(e))


# Options that act only beside another: option -> (whether it acts in this run, on this device; what it needs). One
# given where it cannot act is refused (`check_effects`). ModelConfig and ComputeConfig fields (--model_overrides)
# follow modeling.config.EFFECT_NEEDS, and another fine-tuning mode's options training.modes.finetune_mode.
RUN_NEEDS: dict[str, tuple[typing.Callable[[TrainConfig, torch.device], bool], str]] = {
    "synthetic_task": (lambda cfg, device: cfg.synthetic_mix > 0, "--synthetic_mix R (the share of rows it replaces)"),
    "synthetic_pairs": (lambda cfg, device: cfg.synthetic_mix > 0, "--synthetic_mix R"),
    "answer_loss": (lambda cfg, device: cfg.synthetic_mix > 0, "--synthetic_mix R"),
    "sample_prompt": (lambda cfg, device: cfg.sample_tokens != 0, "--sample_tokens N other than 0"),
    "eval_tokens": (lambda cfg, device: cfg.eval_interval > 0, "--eval_interval N"),
    "offload_activations": (lambda cfg, device: device.type == "cuda" or not (
        cfg.offload_activations or cfg.model_overrides.get("offload_activations")),
                            "a GPU: it moves what the blocks save for backward from a GPU to host memory "
                            "(profile_memory.py estimates it for a GPU run)"),
    "export_dtype": (lambda cfg, device: cfg.finetune not in ("lora", "npt") or cfg.merge,
                     "--finetune full, or --merge with LoRA (adapters are saved as they trained)"),
}


def check_mode_options(finetune: str, options: typing.Iterable[str]) -> None:
    """ValueError naming the first of `options` that belongs to other fine-tuning modes only, not to `finetune`."""
    own = set(finetune_class(finetune).options)
    for option in sorted(set(options) - own):
        if owners := sorted(name for name in FINETUNE_MODES if option in finetune_class(name).options):
            raise ValueError(f"--{option} is not an option of --finetune {finetune}: pass --finetune "
                             f"{' or --finetune '.join(owners)}, or leave --{option} out")


def check_effects(cfg: TrainConfig, given: frozenset[str] | None, device: torch.device,
                  log: typing.Callable[[str], None] = print) -> None:
    """ValueError when an option that was given (`given`; None: unknown, nothing is checked) has no effect in this run
    (RUN_NEEDS; offload_activations in --model_overrides counts as the option; another fine-tuning mode's option,
    even at its default value), as it would be silently ignored, or
    when an option and a --model_overrides field set the same thing; a warning line when a --warmup_steps given
    outlasts the run."""
    if given is None:
        return
    for name, option in SHARED_FIELD.items():
        if option in given and name in cfg.model_overrides:
            raise ValueError(f"--model_overrides sets {name} and --{option} sets it too, and the override would "
                             "win: give one of them")
    check_mode_options(cfg.finetune, given)  # another mode's option, even at its default value
    acting = given | ({"offload_activations"} if "offload_activations" in cfg.model_overrides else set())
    for option, (acts, what) in RUN_NEEDS.items():
        if option in acting and not acts(cfg, device):
            raise ValueError(f"--{option} has no effect without {what}: add it, or leave --{option} out")
    if "warmup_steps" in given and cfg.warmup_steps > cfg.max_steps:
        log(f"warning: --warmup_steps {cfg.warmup_steps} is longer than --max_steps {cfg.max_steps}: the learning "
            f"rate never reaches --lr {cfg.lr}")


def resolve_config(cfg: TrainConfig, device: torch.device, log: typing.Callable[[str], None] = print) -> TrainConfig:
    """Replace "auto"/None by concrete values. From LONG_CONTEXT tokens on, attention is NSA and blocks are
    recomputed in backward; on CUDA the model is then the 4B preset (build_model_config adds the tiled FFN and the
    chunked loss at these lengths). Elsewhere the default model is "demo" (said through `log` at these lengths).
    The learning rate follows the model size; the batch size fills BATCH_TOKENS per micro-step."""
    long = cfg.context_length >= LONG_CONTEXT
    cuda = device.type == "cuda"
    auto = {
        "model_size": "4B" if long and cuda else "demo",
        "attention_type": "nsa" if long else "full",
        "dtype": "bfloat16" if cuda else "float32",
    }
    if cfg.export_dtype == "auto":
        auto["export_dtype"] = cfg.dtype if cfg.dtype != "auto" else auto["dtype"]
    if cfg.init_from:  # the architecture is the stored model's (build_model_config)
        del auto["model_size"], auto["attention_type"]
    values = {k: v for k, v in auto.items() if getattr(cfg, k) == "auto"}
    if values.get("model_size") == "demo" and long:
        log(f"--model_size auto: demo (the {LONG_CONTEXT}-token recipe picks 4B on CUDA, and this machine has no "
              "CUDA device; pass --model_size 4B to run it here anyway)")
    if cfg.lr is None:
        small = values.get("model_size", cfg.model_size) in ("demo", "tiny")
        values["lr"] = 2e-5 if cfg.init_from else 3e-3 if small else 3e-4
    if cfg.gradient_checkpointing is None:
        values["gradient_checkpointing"] = long
    if cfg.batch_size is None:
        values["batch_size"] = max(1, BATCH_TOKENS // cfg.context_length)
    step = cfg.gradient_accumulation_steps * values.get("batch_size", cfg.batch_size) * cfg.context_length
    if step > MAX_STEP_TOKENS:
        raise ValueError(f"--gradient_accumulation_steps {cfg.gradient_accumulation_steps} x --batch_size "
                         f"{values.get('batch_size', cfg.batch_size)} x --context_length {cfg.context_length} = "
                         f"{step:,} tokens a step per process, whose ids and labels are held at once: at most "
                         f"{MAX_STEP_TOKENS:,}")
    return dataclasses.replace(cfg, **values)


def default_out_dir(cfg: TrainConfig, log: typing.Callable[[str], None] = print) -> Path:
    """runs/<model>-<attention>-<T>[-<finetune>] (<model>: the preset, or the --init_from directory's name), or the
    first of <name>-2, <name>-3, ... that does not hold a run; with --resume the newest of them that exists."""
    if cfg.init_from:
        source = Path(cfg.init_from).resolve()
        model = source.parent.name if source.name == "model" or source.name.startswith("step-") else source.name
    else:
        model = cfg.model_size
    attention = "" if cfg.attention_type == "auto" else f"-{cfg.attention_type}"
    name = f"{model}{attention}-{cfg.context_length}" + ("" if cfg.finetune == "full" else f"-{cfg.finetune}")
    series = numbered(Path("runs") / name)
    taken: list[Path] = []
    for candidate in series:
        if not (candidate.is_dir() and any(p.name != ".lock" for p in candidate.iterdir())):
            break
        taken.append(candidate)
    if cfg.resume:
        return taken[-1] if taken else candidate
    if taken:
        log(f"{taken[-1]} holds a run: this one goes to {candidate} (pass --out_dir to choose, --resume to continue "
            "that one)")
    return candidate


def build_model_config(cfg: TrainConfig, tokenizer_vocab: int, device_memory: int | None = None,
                       world_size: int = 1, stored: ModelConfig | None = None) -> tuple[ModelConfig, ComputeConfig]:
    """The resolved run's (ModelConfig, ComputeConfig): preset, then context length, attention type, a vocabulary
    that covers the tokenizer (the preset's, or the tokenizer's rounded up to 64 when larger); the compute options
    --loss, --ffn_chunk_size and --attention_query_chunk (and the output layer on target rows only with
    --answer_loss, whose targets are sparse), where from LONG_CONTEXT tokens on "auto" and unset mean the
    chunked loss (at 32k the 10 GiB logits rule of loss_mode="auto" would still pick the standard loss, whose float32
    copies cost ~47 GiB) and a tiled FFN (TILED_FFN_CHUNK tokens per tile); then model_overrides.
    Activation offload left at None is on when the checkpointed block inputs (`checkpointed_bytes`) would exceed
    OFFLOAD_SHARE of `device_memory` (bytes of one GPU; None: not a GPU, never).
    `stored`: the architecture of the --init_from weights, used instead of the preset (its vocabulary kept, its
    attention type unless --attention_type nsa converts full attention; the context length, --rope_theta,
    --rope_scaling and model_overrides applied)."""
    model_overrides, compute_overrides = split_overrides(cfg.model_overrides)
    long = cfg.context_length >= LONG_CONTEXT
    tile = cfg.ffn_chunk_size if cfg.ffn_chunk_size is not None else TILED_FFN_CHUNK if long else 0
    compute = {"ffn_chunk_size": tile or None,
               "loss_mode": "chunked" if cfg.loss == "auto" and long else cfg.loss,
               "loss_rows": "targets" if cfg.answer_loss else "all"}
    if cfg.attention_query_chunk is not None:
        compute["attention_query_chunk"] = cfg.attention_query_chunk
    theta = {"rope_theta": cfg.rope_theta} if cfg.rope_theta else {}
    theta |= {"rope_scaling": cfg.rope_scaling} if cfg.rope_scaling else {}
    if stored is not None:
        check_model_size(cfg, stored)
        attention = stored.attention_type if cfg.attention_type == "auto" else cfg.attention_type
        if attention != stored.attention_type and (stored.attention_type, attention) != ("full", "nsa"):
            raise ValueError(f"--attention_type {cfg.attention_type}: the --init_from model has "
                             f"{stored.attention_type!r} attention; only full -> nsa is converted (nsa/from_dense.py)")
        model_config = dataclasses.replace(stored, context_length=cfg.context_length, attention_type=attention,
                                           **theta, **model_overrides)
    else:
        vocab = max(ModelConfig.from_preset(cfg.model_size).vocab_size, -(-tokenizer_vocab // 64) * 64)
        model_config = ModelConfig.from_preset(cfg.model_size, **{
            "vocab_size": vocab, "context_length": cfg.context_length, "attention_type": cfg.attention_type,
            **theta, **model_overrides})
    offload = cfg.offload_activations
    if offload is None:
        offload = bool(device_memory and cfg.gradient_checkpointing
                       and checkpointed_bytes(model_config, cfg, world_size) > OFFLOAD_SHARE * device_memory)
    compute_config = ComputeConfig(**{**compute, "offload_activations": offload, **compute_overrides})
    chunk = cfg.attention_query_chunk not in (None, ComputeConfig.attention_query_chunk)  # runs recorded 512 as such
    options = {"attention_query_chunk": "--attention_query_chunk"} if chunk else {}
    check_effective(model_config, compute_config, frozenset(cfg.model_overrides) | set(options), options)
    objective = cfg.objective()
    check_objective(model_config, objective, {name for name in OBJECTIVE_FIELDS  # those set: not their default
                                              if getattr(objective, name) != getattr(Objective(), name)})
    if cfg.nsa_exact_selection_steps:
        check_exact_selection(model_config, objective)
    if cfg.finetune == "npt" and cfg.ffn_chunk_size:
        from npt.convert import resolve_layers  # (model code: not loaded to parse the options)

        if len(resolve_layers(cfg.npt_layer_spec(), model_config.n_layers)) == model_config.n_layers:
            raise ValueError(f"--ffn_chunk_size does not tile NPT's converted layers, and --npt_layers "
                             f"{cfg.npt_layers} converts all {model_config.n_layers}: leave it out")
    return model_config, compute_config


def check_exact_selection(model: ModelConfig, objective: Objective) -> None:
    """ValueError naming --nsa_exact_selection_steps when the warm-up cannot act: without NSA, or without the
    selection-scoring loss that trains the importance meanwhile (whose own check refuses a context_length where
    top-n never chooses)."""
    if model.attention_type != "nsa":
        raise ValueError(f"--nsa_exact_selection_steps has no effect without attention_type 'nsa', and this run's "
                         f"is {model.attention_type!r}: leave it out, or pass --attention_type nsa")
    if not objective.nsa_score_loss_coef:
        raise ValueError("--nsa_exact_selection_steps is a warm-up of the importance scores by the selection-scoring "
                         "loss: add --nsa_score_loss_coef > 0")


def check_objective(model: ModelConfig, objective: Objective, given: set[str]) -> None:
    """ValueError, naming the option, when an objective option that was set (`given`) cannot act with `model`: the
    selection-scoring loss without NSA, its options without its weight, or a loss that top-n's choices leave empty
    (nsa.scoring.check_score_loss)."""
    if "nsa_score_loss_coef" in given and model.attention_type != "nsa":
        raise ValueError(f"--nsa_score_loss_coef has no effect without attention_type 'nsa', and this run's is "
                         f"{model.attention_type!r}: leave it out, or pass --attention_type nsa")
    if loose := sorted(given & set(SCORE_LOSS_OPTIONS)) if objective.nsa_score_loss_coef == 0 else []:
        named = ", ".join(f"--{name}" for name in loose)  # all at once: a recipe may set several
        them = "it" if len(loose) == 1 else "them"
        raise ValueError(f"{named} {'has' if len(loose) == 1 else 'have'} no effect without --nsa_score_loss_coef "
                         f"> 0: add it, or leave {them} out (of the command line or the --config file)")
    if objective.nsa_score_loss_coef:
        from nsa.scoring import check_score_loss  # NSA's own rule; parsing options loads no model code

        check_score_loss(model, objective)


def check_model_size(cfg: TrainConfig, stored: ModelConfig) -> None:
    """ValueError unless --model_size is "auto" or the size of the --init_from model (`stored`), whose architecture
    is the one trained."""
    geometry = ("dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "ffn_dim")
    preset = ModelConfig.from_preset(cfg.model_size) if cfg.model_size != "auto" else stored
    if any(getattr(preset, name) != getattr(stored, name) for name in geometry):
        shape = ", ".join(f"{name} {getattr(stored, name)}" for name in geometry)
        raise ValueError(f"--model_size {cfg.model_size}: the --init_from model is another size ({shape}), and its "
                         "architecture is the one trained; leave --model_size out")


def checkpointed_bytes(model_config: ModelConfig, cfg: TrainConfig, world_size: int) -> int:
    """Bytes of the block inputs gradient checkpointing keeps per rank: n_layers x B x T / N x dim (N:
    --context_parallel), in bf16 under FSDP
    with bfloat16 compute, else float32 (a single process keeps fp32 weights and runs under autocast)."""
    element = 2 if world_size > 1 and cfg.dtype == "bfloat16" else 4
    tokens = cfg.context_length // cfg.context_parallel  # a rank's share of each sequence
    return model_config.n_layers * cfg.batch_size * tokens * model_config.dim * element
