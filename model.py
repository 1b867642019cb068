"""A decoder-only transformer for long-context research (Qwen3 geometry): GQA, QK-norm, RoPE, SwiGLU, RMSNorm,
full (SDPA) or Native Sparse Attention, an opt-in preallocated KV cache, gradient checkpointing, and a loss that
switches to a chunked computation when the logits would be too large to hold.

Notation: B batch, T new tokens, S cached tokens (keys visible to a query), C model width (`dim`), H query heads,
KV key/value heads, D head dimension, V vocabulary size.

References: Qwen3 https://arxiv.org/abs/2505.09388, GQA https://arxiv.org/abs/2305.13245,
NSA https://arxiv.org/abs/2502.11089 (see nsa/).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from functools import partial
from typing import NamedTuple

import torch
from torch import Tensor, nn
from torch._subclasses.fake_tensor import is_fake
from torch.utils.checkpoint import checkpoint

from modeling.attention import collect_aux_losses
from modeling.config import PRESETS, ComputeConfig, ModelConfig, attention_class
from modeling.documents import padding_starts
from modeling.layers import FeedForward, RMSNorm, RotaryEmbedding
from modeling.loss import (
    IGNORE_INDEX,
    chunked_linear_cross_entropy,
    shift_labels,
    softcap_logits,
    standard_linear_cross_entropy,
)
from modeling.objective import Objective
from modeling.offload import OffloadSavedTensors
from modeling.shard import SequenceShard

__all__ = ["PRESETS", "ComputeConfig", "ModelConfig", "ModelOutput", "Block", "Objective", "Transformer",
           "sample_next_token"]

class ModelOutput(NamedTuple):
    loss: Tensor | None  # float32 scalar when labels were given
    logits: Tensor | None  # (B, T, V); None when the loss was computed without materialising them
    aux_loss: Tensor | None = None  # the attention's training-only terms included in loss (detached); None: none ran


class Block(nn.Module):
    """Pre-norm decoder block: x + attn(norm(x)), then + mlp(norm(.)). Optionally recomputed in backward."""

    def __init__(self, config: ModelConfig, compute: ComputeConfig | None = None) -> None:
        super().__init__()
        compute = compute or ComputeConfig()
        self.attn_norm = RMSNorm(config.dim, config.norm_eps)
        self.attn = attention_class(config.attention_type)(config, compute)  # an attention.AttentionLayer
        self.mlp_norm = RMSNorm(config.dim, config.norm_eps)
        self.mlp = FeedForward(config.dim, config.ffn_dim, compute.ffn_chunk_size)
        # Recomputed in backward when on, through this function (transformers' names: its
        # gradient_checkpointing_enable sets both)
        self.gradient_checkpointing = False
        self._gradient_checkpointing_func: Callable = partial(checkpoint, use_reentrant=False)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, start_pos: int | None = None,
                doc_start: Tensor | None = None, shard: SequenceShard | None = None) -> Tensor:
        if self.gradient_checkpointing and torch.is_grad_enabled():
            return self._gradient_checkpointing_func(self._forward, x, cos, sin, start_pos, doc_start, shard)
        return self._forward(x, cos, sin, start_pos, doc_start, shard)

    def _forward(self, x: Tensor, cos: Tensor, sin: Tensor, start_pos: int | None,
                 doc_start: Tensor | None = None, shard: SequenceShard | None = None) -> Tensor:
        h = x + self.attend(x, cos, sin, start_pos, doc_start, shard)
        return h + self.mlp(self.mlp_norm(h))

    def attend(self, x: Tensor, cos: Tensor, sin: Tensor, start_pos: int | None, doc_start: Tensor | None,
               shard: SequenceShard | None) -> Tensor:
        """The attention branch, attn(attn_norm(x)) (B, T, C); doc_start and shard are passed only when given (an
        attention type of an older protocol takes neither)."""
        extra = {name: value for name, value in (("doc_start", doc_start), ("shard", shard)) if value is not None}
        return self.attn(self.attn_norm(x), cos, sin, start_pos, **extra)

    def init_weights(self, config: ModelConfig) -> None:
        self.attn_norm.init_weights()
        self.mlp_norm.init_weights()
        self.attn.init_weights()
        self.mlp.init_weights(config.init_std, config.init_std / math.sqrt(2 * config.n_layers))


class Transformer(nn.Module):
    """The decoder. Build on `torch.device("meta")`, then `to_empty(device=...)` and `init_weights()` for large
    models (the flow FSDP2 uses), or build directly on a device (weights are initialised in `__init__`).
    `config` is what the weights mean; `compute` (default: ComputeConfig()) how the forward runs; `objective`
    (default: Objective(), plain cross-entropy) what a forward with labels minimises, settable later."""

    def __init__(self, config: ModelConfig, compute: ComputeConfig | None = None,
                 objective: Objective | None = None) -> None:
        super().__init__()
        self.config = config
        self.compute = compute = compute or ComputeConfig()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList(Block(config, compute) for _ in range(config.n_layers))
        self.norm = RMSNorm(config.dim, config.norm_eps)
        self.lm_head = nn.Linear(config.dim, config.vocab_size, bias=False)
        self._tie_weights()
        self.rope = RotaryEmbedding(config.head_dim, config.rope_theta, config.context_length,
                                    config.rope_scaling)
        self.objective = objective or Objective()
        if self.embed_tokens.weight.device.type != "meta":
            self.init_weights()

    @property
    def objective(self) -> Objective:
        """What a forward with labels minimises beyond cross-entropy: the z-loss here, and the terms of an attention
        type that declares an `objective` attribute of its own (NSA's selection-scoring loss), which setting this
        sets too."""
        return self._objective

    @objective.setter
    def objective(self, objective: Objective) -> None:
        self._objective = objective
        for block in self.layers:
            if hasattr(block.attn, "objective"):
                block.attn.objective = objective

    @classmethod
    def from_weights(cls, config: ModelConfig, state: dict[str, Tensor] | None = None,
                     compute: ComputeConfig | None = None, device: torch.device | str | None = None) -> Transformer:
        """The model holding `state` without a second copy: built on the meta device, then the tensors of `state`
        are assigned as they are (device and dtype kept; a tied output weight may be absent). `state` None: the
        weights are left uninitialised on `device`, for a loader that writes them in place (DCP). Either way the
        output layer is then tied to the embedding and the RoPE tables are built lazily on the weights' device.
        ValueError naming the tensors when `state` does not fit `config`. Every loader builds models this way."""
        with torch.device("meta"):
            model = cls(config, compute)
        if state is None:
            model.to_empty(device=device)
        else:
            if config.tie_embeddings and "embed_tokens.weight" in state:
                state = {**state, "lm_head.weight": state["embed_tokens.weight"]}
            missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
            if missing or unexpected:
                raise ValueError(f"the weights do not fit the config: missing {sorted(missing)[:10]}, unexpected "
                                 f"{sorted(unexpected)[:10]}")
        model.finish_loading()
        return model

    def finish_loading(self) -> None:
        """After weights were assigned or materialised (`to_empty`): share the embedding with the output layer again
        (both lost the tie) and reset the RoPE tables, to be rebuilt on the device of the first input."""
        self._tie_weights()
        self.rope.to_empty(device=self.embed_tokens.weight.device)
        self.rope.init_weights()

    @property
    def output_weight(self) -> Tensor:
        """The live output projection (V, C): `lm_head.weight`, which is the embedding when tied."""
        return self.lm_head.weight

    def _tie_weights(self) -> None:
        if self.config.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    @torch.no_grad()
    def init_weights(self) -> None:
        """Deterministic (given the torch RNG state) initialisation of every parameter, in module order.
        Re-ties the output weight to the embedding, since `to_empty` gives each module its own new parameter."""
        if self.lm_head.weight is not self.embed_tokens.weight:
            self._tie_weights()
        std = self.config.init_std
        nn.init.normal_(self.embed_tokens.weight, std=std)
        for block in self.layers:
            block.init_weights(self.config)
        self.norm.init_weights()
        if not self.config.tie_embeddings:
            nn.init.normal_(self.lm_head.weight, std=std)
        self.rope.init_weights()

    def num_parameters(self, exclude_embeddings: bool = False) -> int:
        """Parameter count, tied weights once; `exclude_embeddings` drops the embedding and output matrices."""
        params = {id(p): p for p in self.parameters()}
        if exclude_embeddings:
            params.pop(id(self.embed_tokens.weight), None)
            params.pop(id(self.lm_head.weight), None)
        return sum(p.numel() for p in params.values())

    def gradient_checkpointing_enable(self, enabled: bool = True) -> None:
        """Recompute each block in backward (non-reentrant checkpointing); only the block inputs are kept."""
        for block in self.layers:
            block.gradient_checkpointing = enabled

    def setup_kv_cache(self, batch_size: int, max_seq_len: int, dtype: torch.dtype | None = None,
                       device: torch.device | str | None = None) -> None:
        """Preallocate every layer's cache for `batch_size` sequences of up to `max_seq_len` tokens."""
        if max_seq_len > self.config.context_length:
            raise ValueError(f"max_seq_len {max_seq_len} exceeds context_length {self.config.context_length}")
        weight = self.embed_tokens.weight
        for block in self.layers:
            block.attn.setup_cache(batch_size, max_seq_len, dtype or weight.dtype, device or weight.device)

    def clear_kv_cache(self) -> None:
        for block in self.layers:
            block.attn.clear_cache()

    @torch.no_grad()
    def reorder_kv_cache(self, index: Tensor) -> None:
        """Rows of every layer's cache taken from rows `index` (B,) of it (beam search keeps the beams it extends).
        Each attention type keeps its cache as the module `attn.cache`, every buffer of it batch-first."""
        for block in self.layers:
            cache = getattr(block.attn, "cache", None)
            if not isinstance(cache, nn.Module):
                raise ValueError(f"{type(block.attn).__name__} has no cache set up to reorder (setup_kv_cache first)")
            for buffer in cache.buffers():
                buffer.copy_(buffer.index_select(0, index.to(buffer.device)))

    def hidden_states(self, input_ids: Tensor | None, start_pos: int | None = None,
                      inputs_embeds: Tensor | None = None, layer_outputs: list[Tensor] | None = None,
                      doc_start: Tensor | None = None, shard: SequenceShard | None = None) -> Tensor:
        """Final-norm hidden states (B, T, C) for `input_ids` (B, T), or for their embeddings `inputs_embeds`
        (B, T, C) given instead, at positions [start_pos or 0, +T). `layer_outputs`, a list, receives the embeddings
        and each block's output, the last one after the final norm: n_layers + 1 tensors (B, T, C), as transformers'
        output_hidden_states. `doc_start` (B, T) long: the first position each token may attend to (its packed
        document's start: `modeling.documents.document_starts`); None: every earlier one. `shard`
        (`modeling.shard.SequenceShard`, context parallelism): the tokens are the shard's positions of a longer
        sequence (T = shard.tokens; doc_start then holds their starts), whose other positions other processes
        hold; no KV cache."""
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass input_ids or inputs_embeds, one of them")
        if inputs_embeds is not None:
            if inputs_embeds.dim() != 3 or inputs_embeds.shape[-1] != self.config.dim:
                raise ValueError(f"inputs_embeds must be (B, T, {self.config.dim}), got {tuple(inputs_embeds.shape)}")
        elif input_ids.dim() != 2 or input_ids.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"input_ids must be an integer tensor of shape (B, T), got {tuple(input_ids.shape)} "
                             f"{input_ids.dtype}")
        T = (input_ids if input_ids is not None else inputs_embeds).shape[1]
        if T == 0:
            raise ValueError("the input holds no tokens (T = 0)")
        if input_ids is not None:
            check_token_range("input_ids", input_ids, self.config.vocab_size)
        offset = start_pos or 0
        length = offset + T if shard is None else shard.length
        if length > self.config.context_length:
            raise ValueError(f"sequence of {length} positions exceeds context_length "
                             f"{self.config.context_length}; raise ModelConfig.context_length")
        if start_pos is not None and torch.is_grad_enabled():
            raise RuntimeError("KV-cache decoding (start_pos given) runs without gradients: use torch.no_grad()")
        if shard is not None and (start_pos is not None or shard.tokens != T):
            raise ValueError(f"a sequence shard of {shard.tokens} tokens takes as many input tokens (got {T}) and no "
                             "KV cache (start_pos)")
        x = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds  # (B, T, C)
        cos, sin = self.rope(length - offset, offset, x.device)  # (T, D) each; the whole sequence's with a shard
        if shard is not None:
            shard = shard.with_rope(cos, sin)
            cos, sin = shard.take(cos, 0), shard.take(sin, 0)  # (t, D): the shard's positions
        offload = self.compute.offload_activations and torch.is_grad_enabled()
        with OffloadSavedTensors(resident=(cos, sin)) if offload else contextlib.nullcontext():
            for block in self.layers:
                if layer_outputs is not None:
                    layer_outputs.append(x)
                x = block(x, cos, sin, start_pos, doc_start, shard)
        x = self.norm(x)
        if layer_outputs is not None:
            layer_outputs.append(x)
        return x

    def forward(self, input_ids: Tensor | None, labels: Tensor | None = None, start_pos: int | None = None,
                loss_normalizer: Tensor | float | None = None, aux_weight: float = 1.0,
                inputs_embeds: Tensor | None = None, layer_outputs: list[Tensor] | None = None,
                doc_start: Tensor | None = None, shard: SequenceShard | None = None) -> ModelOutput:
        """input_ids (B, T) (or their embeddings inputs_embeds (B, T, C) instead; `layer_outputs`, `doc_start`,
        `shard`: as `hidden_states`); labels (B, T) unshifted (the model shifts them; -100 is ignored). With a
        `shard`, whose tokens are not contiguous, labels are already shifted: the shard's part of the whole
        sequence's targets (`shard.take(shift_labels(labels))`).

        Returns ModelOutput(loss, logits, aux_loss): loss is the summed next-token cross-entropy over non-ignored
        targets divided by `loss_normalizer` (default: their count, i.e. the mean; a trainer passes the global count
        over ranks and accumulation steps), None without labels; logits (B, T, V) are None when the chunked loss ran
        or compute.loss_rows is "targets". With gradients enabled, the attention's training-only loss terms
        (`attention.add_aux_loss`, e.g. NSA's selection-scoring loss: each a mean over its own rows, whatever the
        labels) are added to loss times `aux_weight`, and returned as aux_loss. A trainer passes 1 / (micro-batches
        x ranks) of the step, so that the step's term is the mean over its equal-sized micro-batches.
        """
        shape = (input_ids if input_ids is not None else inputs_embeds[..., 0]).shape
        if labels is not None and labels.shape != shape:
            raise ValueError(f"labels {tuple(labels.shape)} must have the shape of the input {tuple(shape)}")
        if labels is not None:
            check_token_range("labels", labels, self.config.vocab_size, ignore=IGNORE_INDEX)
        with collect_aux_losses() as aux:
            h = self.hidden_states(input_ids, start_pos, inputs_embeds, layer_outputs, doc_start, shard)
        if labels is None:
            return ModelOutput(None, self.logits(h))
        loss, logits = self.compute_loss(h, labels, loss_normalizer, shifted=shard is not None)
        if not aux:
            return ModelOutput(loss, logits)
        aux_loss = torch.stack(aux).sum() * aux_weight
        return ModelOutput(loss + aux_loss, logits, aux_loss.detach())

    def logits(self, hidden: Tensor) -> Tensor:
        """Next-token logits (..., V) from final-norm hidden states (..., C), soft-capped when the config says so
        (in float32 then, as the loss paths do)."""
        logits, cap = self.lm_head(hidden), self.config.logit_softcap
        return logits if cap is None else softcap_logits(logits.float(), cap)

    # ---- loss: every path goes through compute_loss --------------------------------------------------------

    def use_chunked_loss(self, num_tokens: int, dtype: torch.dtype) -> bool:
        """Whether the loss for `num_tokens` tokens of hidden states in `dtype` takes the chunked path.
        Decided from shapes only: chunked when the logits (tokens x V x element size) would exceed the threshold."""
        mode = self.compute.loss_mode
        if mode != "auto":
            return mode == "chunked"
        logits_bytes = num_tokens * self.config.vocab_size * torch.finfo(dtype).bits // 8
        return logits_bytes > self.compute.loss_chunk_threshold_bytes

    def compute_loss(self, hidden: Tensor, labels: Tensor, loss_normalizer: Tensor | float | None = None,
                     shifted: bool = False) -> tuple[Tensor, Tensor | None]:
        """hidden (B, T, C), labels (B, T) unshifted (`shifted`: already each position's target) -> (loss, logits
        (B, T, V) or None). The summed loss is divided by `loss_normalizer` (default: the number of non-ignored
        targets). With compute.loss_rows "targets" the output layer sees only the positions that have a target, and
        no logits are returned."""
        B, T, C = hidden.shape
        targets = labels if shifted else shift_labels(labels)  # (B, T)
        if self.compute.loss_rows == "targets":
            targets = targets.reshape(B * T)  # (N,)
            rows = (targets != IGNORE_INDEX).nonzero().squeeze(1)  # (K,): a data-dependent shape (a GPU syncs here)
            hidden = hidden.reshape(B * T, C).index_select(0, rows)[None]  # (1, K, C)
            targets = targets.index_select(0, rows)[None]  # (1, K)
        if self.use_chunked_loss(hidden.shape[0] * hidden.shape[1], hidden.dtype):
            return self._compute_loss_chunked(hidden, targets, self.compute.loss_chunk_size, loss_normalizer)
        loss, logits = self._compute_loss_standard(hidden, targets, loss_normalizer)
        return loss, logits if self.compute.loss_rows == "all" else None

    def _compute_loss_standard(self, hidden: Tensor, targets: Tensor,
                               loss_normalizer: Tensor | float | None = None) -> tuple[Tensor, Tensor]:
        """hidden (B, T, C), targets (B, T) already shifted -> (loss, logits (B, T, V))."""
        return standard_linear_cross_entropy(  # logits (B, T, V), their own tensor (an FSDP root returns no view)
            hidden, self.output_weight, targets, z_loss_coef=self.objective.z_loss_coef,
            softcap=self.config.logit_softcap, normalizer=loss_normalizer)

    def _compute_loss_chunked(self, hidden: Tensor, targets: Tensor, chunk_size: int = 4096,
                              loss_normalizer: Tensor | float | None = None) -> tuple[Tensor, None]:
        """Same loss and gradients as the standard path, never holding more than one chunk of logits
        (see loss.chunked_linear_cross_entropy). hidden (B, T, C), targets (B, T) already shifted."""
        B, T, C = hidden.shape
        loss = chunked_linear_cross_entropy(
            hidden.reshape(B * T, C), self.output_weight, targets.reshape(B * T),
            chunk_size=chunk_size, z_loss_coef=self.objective.z_loss_coef, softcap=self.config.logit_softcap,
            normalizer=loss_normalizer)
        return loss, None

    # ---- generation ------------------------------------------------------------------------------------------

    @torch.no_grad()
    def generate(self, input_ids: Tensor, max_new_tokens: int, temperature: float = 1.0, top_k: int | None = None,
                 top_p: float | None = None, eos_id: int | None = None,
                 generator: torch.Generator | None = None) -> Tensor:
        """Prefill `input_ids` (B, T) into a preallocated KV cache, then decode `max_new_tokens` tokens one at a
        time. temperature 0 is greedy. Rows that emit `eos_id` keep emitting it; decoding stops early once every row
        has. Returns (B, T + generated) token ids. Prompts of different lengths (a list of lists) are padded on the
        left to the longest with id 0, and each row attends from its first real token on (`doc_start`); each row then
        generates what it generates alone."""
        pads = None
        if not isinstance(input_ids, Tensor):
            if not input_ids or min(len(row) for row in input_ids) == 0:
                raise ValueError("every prompt needs at least one token")
            longest = max(len(row) for row in input_ids)
            pads = torch.tensor([longest - len(row) for row in input_ids], device=self.embed_tokens.weight.device)
            input_ids = torch.tensor([[0] * (longest - len(row)) + list(row) for row in input_ids],
                                     device=self.embed_tokens.weight.device)  # (B, T), padded on the left
            pads = pads if bool(pads.any()) else None
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        check_sampling(temperature, top_k, top_p)
        if eos_id is not None and not 0 <= eos_id < self.config.vocab_size:
            raise ValueError(f"eos_id must be a token id in [0, {self.config.vocab_size}), got {eos_id}")
        if input_ids.dim() != 2 or input_ids.shape[1] == 0:
            raise ValueError(f"input_ids must be a non-empty prompt of shape (B, T), got {tuple(input_ids.shape)}")
        B, T = input_ids.shape
        if T + max_new_tokens > self.config.context_length:
            raise ValueError(f"prompt ({T}) + max_new_tokens ({max_new_tokens}) exceeds context_length "
                             f"{self.config.context_length}")
        self.setup_kv_cache(B, T + max_new_tokens)
        try:
            out = [input_ids]
            finished = torch.zeros(B, dtype=torch.bool, device=input_ids.device)
            starts = None if pads is None else padding_starts(pads, 0, T)  # (B, T)
            logits = self.logits(self.hidden_states(input_ids, start_pos=0, doc_start=starts)[:, -1])  # (B, V)
            for i in range(max_new_tokens):
                token = sample_next_token(logits, temperature, top_k, top_p, generator)  # (B,)
                if eos_id is not None:
                    token = torch.where(finished, torch.full_like(token, eos_id), token)
                    finished |= token == eos_id
                out.append(token[:, None])
                if i == max_new_tokens - 1 or (eos_id is not None and bool(finished.all())):
                    break
                starts = None if pads is None else padding_starts(pads, T + i, 1)  # (B, 1)
                logits = self.logits(self.hidden_states(token[:, None], start_pos=T + i, doc_start=starts)[:, -1])
        finally:
            self.clear_kv_cache()
        return torch.cat(out, dim=1)


def check_token_range(name: str, ids: Tensor, vocab_size: int, ignore: int | None = None) -> None:
    """ValueError naming `name` when a token id of `ids` is negative or >= vocab_size (`ignore` is allowed).
    Checked on CPU tensors outside torch.compile only: on an accelerator the check would stall the host every
    call, and the embedding reports a bad id itself (the trainer's ids come from data whose tokenizer is checked
    against the vocabulary)."""
    if ids.device.type != "cpu" or ids.numel() == 0 or is_fake(ids) or torch.compiler.is_compiling():
        return  # (compiled: the embedding refuses a bad id itself, without breaking the graph)
    bad = (ids < 0) | (ids >= vocab_size)
    if ignore is not None:
        bad &= ids != ignore
    if bad.any():
        first = ids[bad][0].item()
        raise ValueError(f"{name} holds {int(bad.sum())} id(s) outside [0, {vocab_size}) (vocab_size), e.g. {first}"
                         + (f"; {ignore} marks an ignored target" if ignore is not None else ""))


def check_sampling(temperature: float, top_k: int | None, top_p: float | None) -> None:
    """ValueError naming the argument unless temperature is finite and >= 0 (0: greedy), top_k >= 1 and
    0 < top_p <= 1."""
    if not 0 <= temperature < math.inf:  # also refuses NaN
        raise ValueError(f"temperature must be finite and >= 0 (0 is greedy), got {temperature}")
    if top_k is not None and not (isinstance(top_k, int) and top_k >= 1):
        raise ValueError(f"top_k must be None or an integer >= 1, got {top_k!r}")
    if top_p is not None and not 0 < top_p <= 1:
        raise ValueError(f"top_p must be None or in (0, 1], got {top_p}")


def sample_next_token(logits: Tensor, temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None,
                      generator: torch.Generator | None = None) -> Tensor:
    """Next token per row from logits (B, V): greedy when temperature == 0, else sampled from the
    temperature-scaled distribution restricted to the top_k tokens and the top_p nucleus. Returns (B,) long."""
    check_sampling(temperature, top_k, top_p)
    if temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits.float() / temperature
    if top_k is not None:
        kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]  # (B, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)  # (B, V)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop = cum - sorted_logits.softmax(-1) > top_p  # keep the smallest prefix whose mass reaches top_p
        logits = logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
    probs = logits.softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
