"""The transformers classes of an export whose architecture has no Hugging Face equivalent (NSA): the project's
own Transformer inside a `PreTrainedModel`, for `AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True)`.

storage/remote_code.py writes this file into the export as modeling_longctx.py, beside the project's modules it
imports (model.py, modeling/, nsa/), each with its imports made relative; nothing here is a second
implementation. The weights are the Transformer's own, under `model.`; config.json holds its ModelConfig under
"longctx_model".

    model = AutoModelForCausalLM.from_pretrained("runs/nsa/hf", trust_remote_code=True)
    model.generate(ids, max_new_tokens=20, do_sample=False)

`generate` recomputes the whole sequence for every new token (the project's KV cache is not a transformers Cache);
eval.py and `Transformer.generate` decode through the cache. The model takes no padding mask: an attention_mask
with a zero is refused.
"""

from __future__ import annotations

import torch
from torch import Tensor
from transformers import GenerationMixin, PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from model import Transformer
from modeling.attention import FullAttention
from modeling.config import ModelConfig, register_attention
from modeling.layers import RotaryEmbedding
from nsa.layer import NativeSparseAttention

register_attention("full", FullAttention)  # the classes themselves: their module paths differ inside an export
register_attention("nsa", NativeSparseAttention)


class LongctxConfig(PretrainedConfig):
    """`longctx_model`: the Transformer's ModelConfig as a dict (ModelConfig.to_dict)."""

    model_type = "longctx"

    def __init__(self, longctx_model: dict | None = None, **kwargs: object) -> None:
        self.longctx_model = longctx_model or {}
        super().__init__(**kwargs)


class LongctxForCausalLM(PreTrainedModel, GenerationMixin):
    config_class = LongctxConfig
    base_model_prefix = "model"
    main_input_name = "input_ids"
    _no_split_modules = ["Block"]
    _tied_weights_keys = {"model.lm_head.weight": "model.embed_tokens.weight"}  # when tie_word_embeddings

    def __init__(self, config: LongctxConfig) -> None:
        super().__init__(config)
        self.model = Transformer(ModelConfig.from_dict(config.longctx_model))
        self.post_init()

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

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None, labels: Tensor | None = None,
                **kwargs: object) -> CausalLMOutputWithPast:
        """input_ids (B, T) -> logits (B, T, V) float32; with labels (B, T), unshifted as transformers passes them
        (-100 ignored), the mean next-token loss (and no logits where the model's chunked loss ran)."""
        if attention_mask is not None and not bool(attention_mask.all()):
            raise ValueError("this model takes no padding mask: pass prompts of one length (batch size 1, or no "
                             "padding)")
        out = self.model(input_ids, labels=labels)
        return CausalLMOutputWithPast(loss=out.loss, logits=None if out.logits is None else out.logits.float())

    def prepare_inputs_for_generation(self, input_ids: Tensor, **kwargs: object) -> dict:
        return {"input_ids": input_ids, "attention_mask": kwargs.get("attention_mask")}
