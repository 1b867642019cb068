"""The transformers classes of an export whose architecture has no Hugging Face equivalent (NSA): the project's
own Transformer inside a `PreTrainedModel`, for `AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True)`
(also `AutoModel`: the final hidden states, and `AutoModelForSequenceClassification`).

storage/remote_code.py writes this file into the export as modeling_longctx.py, beside the project's modules it
imports (model.py, modeling/, nsa/), each with its imports made relative; nothing here is a second
implementation. The weights are the Transformer's own, under `model.`; config.json holds its ModelConfig under
"longctx_model" (and the standard fields tools read, mirrored from it: `check_export` refuses a copy that disagrees).

    model = AutoModelForCausalLM.from_pretrained("runs/nsa/hf", trust_remote_code=True)
    model.generate(ids, max_new_tokens=20, do_sample=False)

The standard arguments work as in transformers' own classes: `inputs_embeds`, `output_hidden_states` (the
embeddings and each layer's output, the last after the final norm: n_layers + 1), `return_dict=False`, `labels`
(the mean next-token loss, or the sum over `num_items_in_batch`, as Trainer's gradient accumulation passes it),
`position_ids` (restarts at 0 mark packed sequences, each read alone: DataCollatorWithFlattening), `use_cache` and
`cache` (`LongctxCache`, a transformers Cache over the model's own preallocated caches: NSA's compressed, selection
and window keys), gradient checkpointing, `resize_token_embeddings`. `generate` refuses up front a length beyond the
context and decodes through that cache (greedy, sampling, beam search, assisted generation and prompt lookup,
`inputs_embeds`). Padding on the right needs nothing: a real token never reads a later one. Padding on the left
becomes each row's first position (`mask_starts`, the model's `doc_start`): each row gives, and generates, what it
gives alone. `output_attentions` has no maps to give (no attention matrix is formed): a warning and ().
"""

from __future__ import annotations

import dataclasses
import json
import weakref
from pathlib import Path

import torch
from safetensors import safe_open
from torch import Tensor
from transformers import Cache, GenerationConfig, GenerationMixin, PretrainedConfig, PreTrainedModel
from transformers.generation.utils import GenerationMode
from transformers.modeling_outputs import (
    BaseModelOutputWithPast,
    CausalLMOutputWithPast,
    SequenceClassifierOutputWithPast,
)
from transformers.utils import logging

from model import Transformer
from modeling.attention import FullAttention
from modeling.config import ModelConfig, register_attention
from modeling.documents import padding_starts
from modeling.layers import RotaryEmbedding
from nsa.layer import NativeSparseAttention
from storage.manifest import MANIFEST_NAME, verify_files

register_attention("full", FullAttention)  # the classes themselves: their module paths differ inside an export
register_attention("nsa", NativeSparseAttention)
logger = logging.get_logger(__name__)


# config.json's fields that tools read without loading the model -> the ModelConfig field each mirrors.
MIRRORED = {"vocab_size": "vocab_size", "hidden_size": "dim", "num_hidden_layers": "n_layers",
            "num_attention_heads": "n_heads", "num_key_value_heads": "n_kv_heads", "head_dim": "head_dim",
            "intermediate_size": "ffn_dim", "rms_norm_eps": "norm_eps", "rope_theta": "rope_theta",
            "rope_scaling": "rope_scaling", "max_position_embeddings": "context_length",
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
    index, found = path / "model.safetensors.index.json", {}
    names = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file() else \
        ["model.safetensors"]
    for file in (path / name for name in names if (path / name).is_file()):  # a missing one: its tensors differ
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


def position_starts(position_ids: Tensor | None, attention_mask: Tensor | None, start: int, rows: int,
                    cached: bool) -> Tensor | None:
    """The first position each of the tokens from `start` may attend to, from transformers' position_ids (B or 1,
    n_new): None when they count on as the model does (from `start`, or from each row's first real token after
    left padding, as transformers computes them from the attention_mask); where they restart at 0 (sequences packed
    in a row, as DataCollatorWithFlattening lays them out, and without a cache: `cached`), each token's sequence
    start (B, n_new), so that each is read alone. Positions of pads (attention_mask 0) are not read. ValueError (one
    line) for any other layout, which the model's RoPE (by position in the row) cannot honour."""
    if position_ids is None:
        return None
    positions = position_ids.to(torch.long).expand(rows, -1)  # (B, n_new)
    n_new = positions.shape[1]
    real, pads = torch.ones_like(positions, dtype=torch.bool), torch.zeros(rows, 1, dtype=torch.long)
    if attention_mask is not None:
        real = attention_mask[:, start:start + n_new].bool()
        pads = (attention_mask.cumsum(1) == 0).sum(1, keepdim=True).to(positions.device)  # (B, 1) leading pads
    counted = torch.arange(start, start + n_new, device=positions.device) - pads  # (B, n_new)
    if bool(((positions == counted) | ~real).all()):
        return None
    previous = torch.cat([positions.new_full((rows, 1), -1), positions[:, :-1]], 1)
    if cached or not bool(((positions == 0) | (positions == previous + 1) | ~real).all()):
        raise ValueError("position_ids must count up by one from the cache's length (or each row's first real "
                         "token), restarting at 0 only where a packed sequence starts and only without a cache: the "
                         "model rotates each token by its position in the row")
    index = torch.arange(n_new, device=positions.device).expand_as(positions)
    return torch.where((positions == 0) & real, index, 0).cummax(1).values  # (B, n_new)


def first_positions(*starts: Tensor | None) -> Tensor | None:
    """The latest of several first positions a token may attend to (each (B, n_new) or None)."""
    given = [s for s in starts if s is not None]
    return None if not given else given[0] if len(given) == 1 else torch.maximum(*torch.broadcast_tensors(*given))


def _release(model: weakref.ref, owner: object) -> None:
    """Free the model's cache buffers when the LongctxCache that set them up is gone (and no later one took them)."""
    if (alive := model()) is not None and getattr(alive, "cache_owner", None) is owner:
        alive.clear_kv_cache()


class LongctxCache(Cache):
    """What a forward with use_cache, and generate, carry between steps (`cache`): the model's own preallocated
    caches (`Transformer.setup_kv_cache`, for `batch_size` rows of up to `max_length` tokens; NSA's hold the
    compressed, selection and window keys) and how many tokens they hold. One model holds one: a new LongctxCache
    starts it again, and the last one's buffers are freed with it. Beam search reorders its rows, assisted
    generation crops its last tokens."""

    def __init__(self, model: Transformer, batch_size: int, max_length: int) -> None:
        super().__init__(layers=[])
        model.setup_kv_cache(batch_size, max_length)
        self.model, self.length, self.rows, self.max_length = model, 0, batch_size, max_length
        model.cache_owner = self.owner = object()  # the buffers are this cache's until another is made
        self.ids_offset = 0  # prompt tokens generate gave as embeddings, absent from its input_ids
        weakref.finalize(self, _release, weakref.ref(model), self.owner)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.length

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return self.max_length

    def reorder_cache(self, beam_idx: Tensor) -> None:
        self.model.reorder_kv_cache(beam_idx)

    def crop(self, tokens_to_remove: int) -> None:
        """Forget the last -tokens_to_remove tokens (<= 0, as transformers passes it): the next ones overwrite them.
        ValueError beyond what every layer's cache can rewind (NSA's rings: NSACache.REWIND tokens)."""
        n = -tokens_to_remove
        limit = min(getattr(block.attn.cache, "rewind", n) for block in self.model.layers)
        if not 0 <= n <= limit:
            raise ValueError(f"this cache forgets 0 to {limit} of its last tokens (crop(-n)), not {n}")
        self.length = max(0, self.length - n)

    def reset(self) -> None:
        self.length = 0

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise NotImplementedError("LongctxCache keeps its rows as set up; generate's beams and returned sequences "
                                  "are rows from the start (the modes that repeat rows later are not supported)")

    def batch_select_indices(self, indices: Tensor) -> None:
        raise NotImplementedError("LongctxCache keeps its rows as set up (reorder_cache reorders them)")

    @property
    def batch_size(self) -> int:
        return self.rows

    @property
    def is_compileable(self) -> bool:
        return False

    @property
    def is_croppable(self) -> bool:
        return True

    @property
    def is_initialized(self) -> bool:
        return True


class LongctxPreTrainedModel(PreTrainedModel):
    """What the export's classes share: the project's Transformer as `model` (the weights' `model.` names), the
    checked load, the attention the model runs, and the preparation of a forward's inputs (`_inputs`)."""

    config_class = LongctxConfig
    base_model_prefix = "model"
    main_input_name = "input_ids"
    supports_gradient_checkpointing = True  # each Block: its gradient_checkpointing flag and function
    _no_split_modules = ["Block"]
    _tied_weights_keys = {"model.lm_head.weight": "model.embed_tokens.weight"}  # when tie_word_embeddings

    def __init__(self, config: LongctxConfig) -> None:
        super().__init__(config)
        self.model = Transformer(ModelConfig.from_dict(config.longctx_model))
        self.add_heads(config)
        self.post_init()

    def add_heads(self, config: LongctxConfig) -> None:
        """The modules a class adds on the Transformer (none: the causal LM's head is its own lm_head)."""

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path: str | Path, *args: object,
                        **kwargs: object) -> LongctxPreTrainedModel:
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
        """The RoPE tables (not stored: rebuilt on first use) and a head the checkpoint lacks (a classifier's
        score); every other weight comes from the checkpoint, whose names and shapes check_export checked."""
        if isinstance(module, RotaryEmbedding):
            module.init_weights()
        elif isinstance(module, torch.nn.Linear) and module is getattr(self, "score", None):
            torch.nn.init.normal_(module.weight, std=self.model.config.init_std)

    def get_input_embeddings(self) -> torch.nn.Module:
        return self.model.embed_tokens

    def set_input_embeddings(self, value: torch.nn.Module) -> None:
        self.model.embed_tokens = value
        self.model._tie_weights()

    def _inputs(self, input_ids: Tensor | None, inputs_embeds: Tensor | None, attention_mask: Tensor | None,
                position_ids: Tensor | None, cache: Cache | None, use_cache: bool | None,
                output_attentions: bool | None) -> tuple[LongctxCache | None, int | None, Tensor | None]:
        """(the cache the tokens continue, or None; its length, the tokens' first position; each token's first
        position to attend to, or None) from a forward's arguments. An empty transformers Cache (DynamicCache()) or
        use_cache=True gives a new LongctxCache; a cache holding another model's tokens is refused."""
        rows, n_new = (input_ids if input_ids is not None else inputs_embeds).shape[:2]
        if output_attentions:
            logger.warning_once("output_attentions: this model forms no attention matrix (NSA reads blocks, and "
                                "the attention runs fused); attentions is an empty tuple")
        if isinstance(cache, LongctxCache) and getattr(cache.model, "cache_owner", None) is not cache.owner:
            raise ValueError("this cache's buffers were taken by a newer one (another use_cache=True forward or a "
                             "generate on this model, which holds one at a time): pass the newest cache, or start "
                             "again")
        if cache is not None and not isinstance(cache, LongctxCache):
            if cache.get_seq_length() > 0:
                raise ValueError(f"a {type(cache).__name__} holding {cache.get_seq_length()} tokens cannot continue "
                                 "here: this model decodes through its own cache (LongctxCache); pass the cache its "
                                 "forward returned, or none")
            cache = None
            use_cache = True
        if cache is None and use_cache:
            cache = LongctxCache(self.model, rows, self.model.config.context_length)
        start = None if cache is None else cache.length
        doc_start = first_positions(mask_starts(attention_mask, start or 0, n_new),
                                    position_starts(position_ids, attention_mask, start or 0, rows, cache is not None))
        return cache, start, doc_start


class LongctxModel(LongctxPreTrainedModel):
    """AutoModel: the final hidden states (after the last norm), as transformers' base models give them."""

    def forward(self, input_ids: Tensor | None = None, attention_mask: Tensor | None = None,
                position_ids: Tensor | None = None, inputs_embeds: Tensor | None = None, cache: Cache | None = None,
                use_cache: bool | None = None, output_hidden_states: bool | None = None,
                output_attentions: bool | None = None, return_dict: bool | None = None,
                **kwargs: object) -> BaseModelOutputWithPast | tuple:
        """input_ids (B, T) or inputs_embeds (B, T, C) -> last_hidden_state (B, T, C); the other arguments as
        LongctxForCausalLM.forward's."""
        cache = kwargs.get("past_key_values") if cache is None else cache  # its name before transformers 5.x
        cache, start, doc_start = self._inputs(input_ids, inputs_embeds, attention_mask, position_ids, cache,
                                               use_cache, output_attentions)
        layers: list[Tensor] | None = [] if (output_hidden_states or self.config.output_hidden_states) else None
        hidden = self.model.hidden_states(input_ids, start, inputs_embeds, layers, doc_start)
        if cache is not None:
            cache.length += hidden.shape[1]
        result = BaseModelOutputWithPast(last_hidden_state=hidden, cache=cache, attentions=() if output_attentions
                                         else None, hidden_states=None if layers is None else tuple(layers))
        return result if (return_dict if return_dict is not None else self.config.return_dict) else result.to_tuple()


class LongctxForCausalLM(LongctxPreTrainedModel, GenerationMixin):
    """AutoModelForCausalLM: logits, the next-token loss, generate."""

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
        self.config.vocab_size = vocab
        return embedding

    def forward(self, input_ids: Tensor | None = None, attention_mask: Tensor | None = None,
                position_ids: Tensor | None = None, labels: Tensor | None = None, inputs_embeds: Tensor | None = None,
                cache: Cache | None = None, use_cache: bool | None = None, output_hidden_states: bool | None = None,
                output_attentions: bool | None = None, return_dict: bool | None = None,
                num_items_in_batch: Tensor | int | None = None, **kwargs: object) -> CausalLMOutputWithPast | tuple:
        """input_ids (B, T), or their embeddings inputs_embeds (B, T, C) -> logits (B, T, V) in the model's dtype;
        with labels (B, T), unshifted as transformers passes them (-100 ignored), the next-token loss: the mean, or
        the sum over `num_items_in_batch` (Trainer's count over the accumulated batches); with output_hidden_states,
        n_layers + 1 hidden states (B, T, C). With a `cache` (or use_cache=True: a new one, returned; decoding runs
        without gradients) the tokens continue the sequence it holds and are appended to it; `position_ids` that
        restart at 0 read each packed sequence alone."""
        cache = kwargs.get("past_key_values") if cache is None else cache  # its name before transformers 5.x
        cache, start, doc_start = self._inputs(input_ids, inputs_embeds, attention_mask, position_ids, cache,
                                               use_cache, output_attentions)
        layers: list[Tensor] | None = [] if (output_hidden_states or self.config.output_hidden_states) else None
        normalizer = None if labels is None or num_items_in_batch is None else num_items_in_batch
        out = self.model(input_ids, labels=labels, start_pos=start, inputs_embeds=inputs_embeds, layer_outputs=layers,
                         doc_start=doc_start, loss_normalizer=normalizer)
        if cache is not None:
            cache.length += (input_ids if input_ids is not None else inputs_embeds).shape[1]
        result = CausalLMOutputWithPast(loss=out.loss, logits=out.logits, cache=cache,
                                        attentions=() if output_attentions else None,
                                        hidden_states=None if layers is None else tuple(layers))
        return result if (return_dict if return_dict is not None else self.config.return_dict) else result.to_tuple()

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False  # generate carries a LongctxCache (_prepare_cache_for_generation)

    def _prepare_cache_for_generation(self, generation_config: GenerationConfig, model_kwargs: dict,
                                      generation_mode: object, batch_size: int, max_cache_length: int) -> None:
        """generate's cache: a LongctxCache for every row it runs (beams, returned sequences) and the length it
        runs to; an empty transformers Cache given is replaced by one (a filled one is refused by forward)."""
        given = model_kwargs.get("cache")
        if generation_config.use_cache is False or isinstance(given, LongctxCache) or \
                given is not None and given.get_seq_length() > 0:
            return
        rows = max(generation_config.num_beams or 1, generation_config.num_return_sequences or 1) * batch_size
        drafts = generation_config.is_assistant or generation_mode == GenerationMode.ASSISTED_GENERATION
        context = self.model.config.context_length  # drafts may run past max_length, an assistant's calls grow
        length = context if drafts else min(max_cache_length + 2, context)
        model_kwargs["cache"] = LongctxCache(self.model, rows, length)

    def prepare_inputs_for_generation(self, input_ids: Tensor, cache: LongctxCache | None = None,
                                      inputs_embeds: Tensor | None = None, **kwargs: object) -> dict:
        """The tokens the model has not read yet: all of them at the first step (the prompt's embeddings when
        generate was given inputs_embeds), the new ones after (input_ids then lack the embedded prompt: the cache's
        ids_offset); all of input_ids when they are a chunk of a prefill in chunks (fewer than the cache holds);
        everything at every step without a cache (use_cache=False)."""
        mask = kwargs.get("attention_mask")
        if inputs_embeds is not None and (cache is None or cache.length == 0):
            if cache is not None and input_ids.shape[1] == 0:
                cache.ids_offset = inputs_embeds.shape[1]
            embeds = inputs_embeds if cache is not None or input_ids.shape[1] == 0 else \
                torch.cat([inputs_embeds, self.model.embed_tokens(input_ids)], 1)
            return {"inputs_embeds": embeds, "attention_mask": mask, "cache": cache}
        if cache is None:
            return {"input_ids": input_ids, "attention_mask": mask, "cache": None}
        seen = cache.length - cache.ids_offset  # of input_ids
        new = input_ids[:, seen:] if input_ids.shape[1] > seen else input_ids
        return {"input_ids": new, "attention_mask": mask, "cache": cache}

    def generate(self, inputs: Tensor | None = None, generation_config: GenerationConfig | None = None,
                 **kwargs: object) -> Tensor:
        """GenerationMixin.generate, refused up front (ValueError naming the lengths) when the prompt and the tokens
        to generate exceed the model's context."""
        prompt = inputs if inputs is not None else kwargs.get("input_ids", kwargs.get("inputs_embeds"))
        config = generation_config or self.generation_config
        new = kwargs.get("max_new_tokens", config.max_new_tokens)
        length = None if prompt is None else prompt.shape[1]
        total = None if length is None else (length + new if new is not None
                                             else kwargs.get("max_length", config.max_length))
        context = self.model.config.context_length
        lookup = kwargs.get("prompt_lookup_num_tokens", config.prompt_lookup_num_tokens) or 0  # drafts past the end
        if total is not None and total + lookup > context:
            raise ValueError(f"the prompt of {length} tokens and the tokens to generate make {total}"
                             + (f" (+ {lookup} drafted by prompt lookup)" if lookup else "") + f", past the model's "
                             f"context of {context}: shorten the prompt or max_new_tokens")
        return super().generate(inputs, generation_config, **kwargs)  # its cache's buffers go with the cache


class LongctxForSequenceClassification(LongctxPreTrainedModel):
    """AutoModelForSequenceClassification: a linear score (config.num_labels) of each row's last real token's final
    hidden state, as transformers' decoder classifiers (Qwen3's) compute it."""

    def add_heads(self, config: LongctxConfig) -> None:
        self.score = torch.nn.Linear(self.model.config.dim, config.num_labels, bias=False)

    def forward(self, input_ids: Tensor | None = None, attention_mask: Tensor | None = None,
                position_ids: Tensor | None = None, labels: Tensor | None = None, inputs_embeds: Tensor | None = None,
                output_hidden_states: bool | None = None, return_dict: bool | None = None,
                **kwargs: object) -> SequenceClassifierOutputWithPast | tuple:
        """-> logits (B, num_labels) of each row's last real token (attention_mask's last 1, else the last token
        that is not config.pad_token_id, else the last); with labels, transformers' classification loss."""
        _, _, doc_start = self._inputs(input_ids, inputs_embeds, attention_mask, position_ids, None, False, None)
        layers: list[Tensor] | None = [] if (output_hidden_states or self.config.output_hidden_states) else None
        hidden = self.model.hidden_states(input_ids, None, inputs_embeds, layers, doc_start)  # (B, T, C)
        pad = getattr(self.config, "pad_token_id", None)
        if attention_mask is not None:
            real = attention_mask.bool()
        elif input_ids is not None and pad is not None:
            real = input_ids != pad
        elif hidden.shape[0] == 1:
            real = torch.ones(hidden.shape[:2], dtype=torch.bool, device=hidden.device)
        else:
            raise ValueError("rows of a batch end where their padding starts: pass attention_mask, or set "
                             "config.pad_token_id (as transformers' classifiers require for batches over 1)")
        index = torch.arange(hidden.shape[1], device=hidden.device)
        last = (index * real).argmax(-1)  # (B,) each row's last real token
        pooled = self.score(hidden[torch.arange(hidden.shape[0], device=hidden.device), last])  # (B, num_labels)
        loss = None if labels is None else self.loss_function(logits=pooled, labels=labels, pooled_logits=pooled,
                                                               config=self.config)
        result = SequenceClassifierOutputWithPast(loss=loss, logits=pooled,
                                                  hidden_states=None if layers is None else tuple(layers))
        return result if (return_dict if return_dict is not None else self.config.return_dict) else result.to_tuple()
