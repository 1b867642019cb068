"""The transformers classes of an export whose architecture has no Hugging Face equivalent (NSA): the project's
own Transformer inside a `PreTrainedModel`, for `AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True)`.

storage/remote_code.py writes this file into the export as modeling_longctx.py, beside the project's modules it
imports (model.py, modeling/, nsa/), each with its imports made relative; nothing here is a second
implementation. The weights are the Transformer's own, under `model.`; config.json holds its ModelConfig under
"longctx_model".

    model = AutoModelForCausalLM.from_pretrained("runs/nsa/hf", trust_remote_code=True)
    model.generate(ids, max_new_tokens=20, do_sample=False)

The standard arguments work as in transformers' own classes: `inputs_embeds`, `output_hidden_states` (the
embeddings and each layer's output, the last after the final norm: n_layers + 1), `return_dict=False`, `labels`
(the mean next-token loss), gradient checkpointing (`gradient_checkpointing_enable`, its kwargs passed to
torch.utils.checkpoint), `resize_token_embeddings` (the inner ModelConfig follows). `generate` refuses up front a
length beyond the context, and decodes through the project's own preallocated caches (`LongctxCache`: the
compressed, selection and window keys of NSA; greedy, sampling and beam search). Padding on the right (training,
scoring) needs nothing: a real token never reads a later one. Padding on the left becomes each row's first
position (`mask_starts`, the model's `doc_start`): each row gives, and generates, what it gives alone (NSA counts
the row's blocks from its first real token).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch
from safetensors import safe_open
from torch import Tensor
from transformers import GenerationConfig, GenerationMixin, PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from model import Transformer
from modeling.attention import FullAttention
from modeling.config import ModelConfig, register_attention
from modeling.documents import padding_starts
from modeling.layers import RotaryEmbedding
from nsa.layer import NativeSparseAttention
from storage.manifest import MANIFEST_NAME, verify_files

register_attention("full", FullAttention)  # the classes themselves: their module paths differ inside an export
register_attention("nsa", NativeSparseAttention)


# config.json's fields that tools read without loading the model -> the ModelConfig field each mirrors.
MIRRORED = {"vocab_size": "vocab_size", "hidden_size": "dim", "num_hidden_layers": "n_layers",
            "num_attention_heads": "n_heads", "max_position_embeddings": "context_length",
            "tie_word_embeddings": "tie_embeddings"}


def check_export(path: Path) -> None:
    """Before transformers builds anything from export directory `path`: its files against its manifest.json
    (sizes, checksums), config.json's mirrored fields against its longctx_model, and the tensors in the weights'
    headers (names, shapes) against the model longctx_model describes. ValueError in one line naming the file and
    what to do; no tensor data is read but for the checksums."""
    if (path / MANIFEST_NAME).is_file():
        verify_files(path)
    config_file = path / "config.json"
    described = json.loads(config_file.read_text())
    inner = described.get("longctx_model") or {}
    for key, field in MIRRORED.items():
        if key in described and field in inner and described[key] != inner[field]:
            raise ValueError(f"{config_file}: {key} {described[key]} disagrees with longctx_model's {field} "
                             f"{inner[field]}, which the weights follow; restore config.json from the export, or "
                             "export the model again")
    with torch.device("meta"):
        model = Transformer(ModelConfig.from_dict(inner))
    expected = {f"model.{name}": tuple(t.shape) for name, t in model.state_dict().items()}
    if model.config.tie_embeddings:
        expected.pop("model.lm_head.weight")
    found = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(file, framework="pt") as f:
            found |= {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}  # noqa: SIM118 (no dict)
    if model.config.tie_embeddings:  # stored once, under the embedding's name, or under both
        found.pop("model.lm_head.weight", None)
    if wrong := sorted(name for name in expected.keys() | found.keys() if expected.get(name) != found.get(name)):
        name = wrong[0]
        raise ValueError(f"{path}: the weights do not fit config.json's longctx_model ({len(wrong)} tensors differ, "
                         f"e.g. {name}: stored {found.get(name)}, described {expected.get(name)}); restore "
                         "config.json from the export, or export the model again")


class LongctxConfig(PretrainedConfig):
    """`longctx_model`: the Transformer's ModelConfig as a dict (ModelConfig.to_dict)."""

    model_type = "longctx"

    def __init__(self, longctx_model: dict | None = None, **kwargs: object) -> None:
        self.longctx_model = longctx_model or {}
        super().__init__(**kwargs)


def mask_starts(attention_mask: Tensor | None, start: int, n_new: int) -> Tensor | None:
    """The first position each of the `n_new` tokens from position `start` may attend to, from transformers'
    attention_mask (B, S >= start + n_new; 1: a real token): None without padding, or with padding on the right only
    (a real token never reads a later one); with padding on the left, each row's first real token (B, n_new) (a pad
    sees itself), which the model's attention takes as `doc_start`. ValueError for zeros between real tokens."""
    if attention_mask is None or bool(attention_mask.all()):
        return None
    mask = attention_mask.bool()
    if bool((mask[:, 1:] <= mask[:, :-1]).all()):  # ones, then zeros: padded on the right
        return None
    if not bool((mask[:, 1:] >= mask[:, :-1]).all()):
        raise ValueError("attention_mask has zeros between real tokens: pad on the left or the right only")
    return padding_starts((~mask).sum(1), start, n_new)  # (B, n_new), from each row's leading pads


class LongctxCache:
    """What transformers' generate carries between steps (as `cache`): the model's own preallocated caches
    (`Transformer.setup_kv_cache`, for `batch_size` rows of up to `max_length` tokens; NSA's hold the compressed,
    selection and window keys) and how many tokens they hold. Beam search reorders their rows (`reorder_cache`)."""

    def __init__(self, model: Transformer, batch_size: int, max_length: int) -> None:
        model.setup_kv_cache(batch_size, max_length)
        self.model, self.length = model, 0

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.length

    def reorder_cache(self, beam_idx: Tensor) -> None:
        self.model.reorder_kv_cache(beam_idx)


class LongctxForCausalLM(PreTrainedModel, GenerationMixin):
    config_class = LongctxConfig
    base_model_prefix = "model"
    main_input_name = "input_ids"
    supports_gradient_checkpointing = True  # each Block: its gradient_checkpointing flag and function
    _no_split_modules = ["Block"]
    _tied_weights_keys = {"model.lm_head.weight": "model.embed_tokens.weight"}  # when tie_word_embeddings

    def __init__(self, config: LongctxConfig) -> None:
        super().__init__(config)
        self.model = Transformer(ModelConfig.from_dict(config.longctx_model))
        self._generation_length: int | None = None  # set by generate: the length its cache is set up for
        self.post_init()

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path: str | Path, *args: object,
                        **kwargs: object) -> LongctxForCausalLM:
        """transformers' from_pretrained, after `check_export` of a local directory (its manifest, its config.json
        against its weights): a damaged or edited export is refused in one line before anything is built."""
        if Path(str(pretrained_model_name_or_path)).is_dir():
            check_export(Path(str(pretrained_model_name_or_path)))
        return super().from_pretrained(pretrained_model_name_or_path, *args, **kwargs)

    def _check_and_adjust_attn_implementation(self, attn_implementation: str | None, *args: object,
                                              **kwargs: object) -> str:
        """The model runs its own attention (NSA's three branches), which no transformers implementation replaces:
        None or "eager" (that attention, as it is); any other is refused, naming what runs."""
        if attn_implementation not in (None, "eager"):
            kind = self.config.longctx_model.get("attention_type", "nsa")
            raise ValueError(f"attn_implementation={attn_implementation!r}: this model runs its own attention "
                             f"(attention_type {kind!r}), which no transformers implementation replaces; leave "
                             "attn_implementation out (or pass \"eager\")")
        return "eager"

    def _init_weights(self, module: torch.nn.Module) -> None:
        """The RoPE tables (not stored: rebuilt on first use). Every weight comes from the checkpoint, whose names
        and shapes the project checked when it wrote them; transformers reports any it lacks."""
        if isinstance(module, RotaryEmbedding):
            module.init_weights()

    def get_input_embeddings(self) -> torch.nn.Module:
        return self.model.embed_tokens

    def set_input_embeddings(self, value: torch.nn.Module) -> None:
        self.model.embed_tokens = value
        self.model._tie_weights()

    def get_output_embeddings(self) -> torch.nn.Module:
        return self.model.lm_head

    def set_output_embeddings(self, value: torch.nn.Module) -> None:
        self.model.lm_head = value

    def resize_token_embeddings(self, *args: object, **kwargs: object) -> torch.nn.Embedding:
        """transformers' resize of the embedding (and the untied output layer), with the inner ModelConfig's
        vocab_size following, so that the new ids are taken."""
        embedding = super().resize_token_embeddings(*args, **kwargs)
        vocab = embedding.weight.shape[0]
        self.model.config = dataclasses.replace(self.model.config, vocab_size=vocab)
        self.config.longctx_model = {**self.config.longctx_model, "vocab_size": vocab}
        return embedding

    def forward(self, input_ids: Tensor | None = None, attention_mask: Tensor | None = None,
                labels: Tensor | None = None, inputs_embeds: Tensor | None = None,
                output_hidden_states: bool | None = None, return_dict: bool | None = None,
                cache: LongctxCache | None = None, **kwargs: object) -> CausalLMOutputWithPast | tuple:
        """input_ids (B, T), or their embeddings inputs_embeds (B, T, C) -> logits (B, T, V) float32; with labels
        (B, T), unshifted as transformers passes them (-100 ignored), the mean next-token loss (and no logits where
        the model's chunked loss ran); with output_hidden_states, n_layers + 1 hidden states (B, T, C). With `cache`
        (generate's, without gradients) the tokens continue the sequence it holds and are appended to it."""
        start = None if cache is None else cache.length
        n_new = (input_ids if input_ids is not None else inputs_embeds).shape[1]
        doc_start = mask_starts(attention_mask, start or 0, n_new)
        hidden = output_hidden_states if output_hidden_states is not None else self.config.output_hidden_states
        layers: list[Tensor] | None = [] if hidden else None
        out = self.model(input_ids, labels=labels, start_pos=start, inputs_embeds=inputs_embeds, layer_outputs=layers,
                         doc_start=doc_start)
        if cache is not None:
            cache.length += (input_ids if input_ids is not None else inputs_embeds).shape[1]
        result = CausalLMOutputWithPast(loss=out.loss, logits=None if out.logits is None else out.logits.float(),
                                        hidden_states=None if layers is None else tuple(layers), cache=cache)
        return result if (return_dict if return_dict is not None else self.config.return_dict) else result.to_tuple()

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False  # generate carries a LongctxCache, made by prepare_inputs_for_generation

    def prepare_inputs_for_generation(self, input_ids: Tensor, cache: LongctxCache | None = None,
                                      use_cache: bool | None = None, **kwargs: object) -> dict:
        """The tokens the model has not read yet: all of them at the first step (the cache then set up for the rows
        and the length `generate` runs to), the new ones after; everything at every step with use_cache=False."""
        if use_cache is not False and cache is None:
            cache = LongctxCache(self.model, input_ids.shape[0], self._generation_length or input_ids.shape[1])
        new = input_ids if cache is None else input_ids[:, cache.length:]
        return {"input_ids": new, "attention_mask": kwargs.get("attention_mask"), "cache": cache}

    def generate(self, inputs: Tensor | None = None, generation_config: GenerationConfig | None = None,
                 **kwargs: object) -> Tensor:
        """GenerationMixin.generate, refused up front (ValueError naming the lengths) when the prompt and the tokens
        to generate exceed the model's context."""
        prompt = inputs if inputs is not None else kwargs.get("input_ids")
        config = generation_config or self.generation_config
        new = kwargs.get("max_new_tokens", config.max_new_tokens)
        total = None if prompt is None else (prompt.shape[-1] + new if new is not None
                                             else kwargs.get("max_length", config.max_length))
        context = self.model.config.context_length
        if total is not None and total > context:
            raise ValueError(f"the prompt of {prompt.shape[-1]} tokens and the tokens to generate make {total}, past "
                             f"the model's context of {context}: shorten the prompt or max_new_tokens")
        self._generation_length = min(total or context, context)  # what the cache holds at most
        try:
            return super().generate(inputs, generation_config, **kwargs)
        finally:
            self._generation_length = None
            self.model.clear_kv_cache()
