"""A decoder-only transformer for long-context research (Qwen3 geometry): GQA, QK-norm, RoPE, SwiGLU, RMSNorm,
full (SDPA) or Native Sparse Attention, an opt-in preallocated KV cache, gradient checkpointing, and a loss that
switches to a chunked computation when the logits would be too large to hold.

Notation: B batch, T new tokens, S cached tokens (keys visible to a query), C model width (`dim`), H query heads,
KV key/value heads, D head dimension, V vocabulary size.

References: Qwen3 https://arxiv.org/abs/2505.09388, GQA https://arxiv.org/abs/2305.13245,
NSA https://arxiv.org/abs/2502.11089 (see nsa.py).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Literal, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from layers import FeedForward, RMSNorm, RotaryEmbedding, apply_rope
from loss import chunked_linear_cross_entropy, shift_labels, standard_linear_cross_entropy
from nsa import NativeSparseAttention

GiB = 1024**3


@dataclass
class ModelConfig:
    """Everything that defines the network. Derived fields are checked in `__post_init__`; bad values raise
    ValueError naming the field before anything is allocated."""

    vocab_size: int = 151936
    dim: int = 2560
    n_layers: int = 36
    n_heads: int = 32
    n_kv_heads: int = 8
    head_dim: int = 128  # Qwen3 keeps 128 even where dim / n_heads differs (0.6B: 16 x 128 > 1024)
    ffn_dim: int = 9728
    ffn_chunk_size: int | None = None  # tokens per FFN tile (tiled MLP, recomputed in backward); None: untiled
    norm_eps: float = 1e-6
    rope_theta: float = 1e6
    # None, or Llama 3.1 frequency scaling: {"rope_type": "llama3", "factor", "low_freq_factor", "high_freq_factor",
    # "original_max_position_embeddings"} (the Hugging Face config.json keys; see layers.RotaryEmbedding).
    rope_scaling: dict[str, float | int | str] | None = None
    context_length: int = 40960  # longest sequence (prompt + generated tokens) a forward accepts
    tie_embeddings: bool = True
    qk_norm: bool = True  # RMSNorm over each head of q and k before RoPE (Qwen3)
    attention_type: Literal["full", "nsa"] = "full"
    # Loss: "auto" chunks when B*T*V*element_size would exceed the threshold (decided from shapes only).
    loss_mode: Literal["auto", "chunked", "standard"] = "auto"
    loss_chunk_threshold_bytes: int = 10 * GiB
    loss_chunk_size: int = 4096
    z_loss_coef: float = 0.0
    logit_softcap: float | None = None
    # Native Sparse Attention (paper defaults, section 4.1); used when attention_type == "nsa".
    nsa_block_size: int = 32  # l: compression block length
    nsa_stride: int = 16  # d: compression stride
    nsa_select_block_size: int = 64  # l': selection block length
    nsa_num_selected: int = 16  # n: selected blocks per query, including block 0 and the 2 most recent
    nsa_window: int = 512  # w: sliding-window length, counting the query's own token
    nsa_separate_kv: bool = True  # independent K/V projections per branch (paper section 3.3.3)
    nsa_query_chunk: int = 512  # queries processed together; bounds the selection branch's working memory
    nsa_triton: bool = True  # CUDA tensors: run the branches on nsa_triton.py's kernels when Triton is installed
    init_std: float = 0.02

    def __post_init__(self) -> None:
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "ffn_dim",
                     "context_length", "loss_chunk_threshold_bytes", "loss_chunk_size", "nsa_block_size",
                     "nsa_stride", "nsa_select_block_size", "nsa_num_selected", "nsa_window", "nsa_query_chunk"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"ModelConfig.{name} must be a positive integer, got {value!r}")
        chunk = self.ffn_chunk_size
        if chunk is not None and (not isinstance(chunk, int) or isinstance(chunk, bool) or chunk <= 0):
            raise ValueError(f"ModelConfig.ffn_chunk_size must be None or a positive integer, got {chunk!r}")
        for name in ("norm_eps", "rope_theta", "init_std"):
            if not getattr(self, name) > 0:
                raise ValueError(f"ModelConfig.{name} must be positive, got {getattr(self, name)!r}")
        if self.rope_scaling is not None:
            validate_rope_scaling(self.rope_scaling)
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"ModelConfig.n_heads ({self.n_heads}) must be divisible by n_kv_heads "
                             f"({self.n_kv_heads}); valid n_kv_heads: "
                             f"{[d for d in range(1, self.n_heads + 1) if self.n_heads % d == 0]}")
        if self.head_dim % 2:
            raise ValueError(f"ModelConfig.head_dim must be even (RoPE rotates pairs), got {self.head_dim}")
        if self.attention_type not in ("full", "nsa"):
            raise ValueError(f"ModelConfig.attention_type must be 'full' or 'nsa', got {self.attention_type!r}")
        if self.loss_mode not in ("auto", "chunked", "standard"):
            raise ValueError(f"ModelConfig.loss_mode must be 'auto', 'chunked' or 'standard', got {self.loss_mode!r}")
        if self.z_loss_coef < 0:
            raise ValueError(f"ModelConfig.z_loss_coef must be >= 0, got {self.z_loss_coef}")
        if self.logit_softcap is not None and not self.logit_softcap > 0:
            raise ValueError(f"ModelConfig.logit_softcap must be None or positive, got {self.logit_softcap}")
        l, d, l_sel = self.nsa_block_size, self.nsa_stride, self.nsa_select_block_size
        if l % d or l_sel % d or l > l_sel:
            raise ValueError(f"NSA blocks need nsa_stride | nsa_block_size, nsa_stride | nsa_select_block_size and "
                             f"nsa_block_size <= nsa_select_block_size; got l={l}, d={d}, l'={l_sel}")
        if self.nsa_num_selected < 3:
            raise ValueError(f"ModelConfig.nsa_num_selected must be >= 3 (block 0 and the two most recent blocks "
                             f"are always selected), got {self.nsa_num_selected}")

    @property
    def n_rep(self) -> int:
        """Query heads per key/value head (the GQA group size)."""
        return self.n_heads // self.n_kv_heads

    @classmethod
    def from_preset(cls, name: str, **overrides: object) -> ModelConfig:
        """The preset called exactly `name` with `overrides` applied, e.g. `from_preset("4B", attention_type="nsa")`."""
        if name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; available: {sorted(PRESETS)}")
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(overrides) - fields)
        if unknown:
            raise ValueError(f"unknown ModelConfig field(s) {unknown}; valid fields: {sorted(fields)}")
        return cls(**{**PRESETS[name], **overrides})

    def to_dict(self) -> dict[str, object]:
        return dataclasses.asdict(self)


LLAMA3_ROPE_KEYS = ("rope_type", "factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def validate_rope_scaling(scaling: object) -> None:
    """ValueError unless `scaling` is a well-formed llama3 rope_scaling dict (the only scaling supported)."""
    if not isinstance(scaling, dict) or scaling.get("rope_type") != "llama3":
        raise ValueError(f"ModelConfig.rope_scaling must be None or a dict with rope_type 'llama3' (the only "
                         f"supported scaling), got {scaling!r}")
    if sorted(scaling) != sorted(LLAMA3_ROPE_KEYS):
        raise ValueError(f"ModelConfig.rope_scaling needs exactly the keys {list(LLAMA3_ROPE_KEYS)}, "
                         f"got {sorted(scaling)}")
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    original_length = scaling["original_max_position_embeddings"]
    if not (factor >= 1 and 0 < low < high):
        raise ValueError(f"ModelConfig.rope_scaling needs factor >= 1 and 0 < low_freq_factor < high_freq_factor, "
                         f"got factor={factor}, low_freq_factor={low}, high_freq_factor={high}")
    if not isinstance(original_length, int) or isinstance(original_length, bool) or original_length <= 0:
        raise ValueError(f"ModelConfig.rope_scaling original_max_position_embeddings must be a positive integer, "
                         f"got {original_length!r}")


# Qwen3 geometry (values from the Hugging Face config.json of each model). "tiny" is for tests: small enough for a
# CPU step in milliseconds, with NSA blocks small enough that short sequences exercise every branch.
PRESETS: dict[str, dict[str, object]] = {
    "tiny": dict(vocab_size=512, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, ffn_dim=192,
                 context_length=1024, nsa_block_size=8, nsa_stride=4, nsa_select_block_size=16,
                 nsa_num_selected=4, nsa_window=32, nsa_query_chunk=64),
    "0.6B": dict(dim=1024, n_layers=28, n_heads=16, n_kv_heads=8, ffn_dim=3072),
    "1.7B": dict(dim=2048, n_layers=28, n_heads=16, n_kv_heads=8, ffn_dim=6144),
    "4B": dict(dim=2560, n_layers=36, n_heads=32, n_kv_heads=8, ffn_dim=9728),
    "8B": dict(dim=4096, n_layers=36, n_heads=32, n_kv_heads=8, ffn_dim=12288, tie_embeddings=False),
}


class ModelOutput(NamedTuple):
    loss: Tensor | None  # float32 scalar when labels were given
    logits: Tensor | None  # (B, T, V); None when the loss was computed without materialising them


class KVCache(nn.Module):
    """Preallocated keys and values (B, KV, S_max, D), written in place; non-persistent (never in the state_dict)."""

    def __init__(self, batch_size: int, n_kv_heads: int, max_seq_len: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str | None) -> None:
        super().__init__()
        shape = (batch_size, n_kv_heads, max_seq_len, head_dim)
        self.register_buffer("k", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v", torch.zeros(shape, dtype=dtype, device=device), persistent=False)

    def update(self, start_pos: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Write k, v (B, KV, T, D) at positions [start_pos, start_pos + T); return all keys/values so far
        (B, KV, start_pos + T, D)."""
        end = start_pos + k.shape[2]
        if end > self.k.shape[2]:
            raise ValueError(f"KV cache holds {self.k.shape[2]} positions; writing up to {end} does not fit")
        if k.shape[0] != self.k.shape[0]:
            raise ValueError(f"KV cache was set up for batch {self.k.shape[0]}, got batch {k.shape[0]}")
        self.k[:, :, start_pos:end] = k
        self.v[:, :, start_pos:end] = v
        return self.k[:, :, :end], self.v[:, :, :end]


class Attention(nn.Module):
    """Causal grouped-query attention through `scaled_dot_product_attention` (flash-style: no T x T tensor)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        c, h, kv, d = config.dim, config.n_heads, config.n_kv_heads, config.head_dim
        self.q_proj = nn.Linear(c, h * d, bias=False)
        self.k_proj = nn.Linear(c, kv * d, bias=False)
        self.v_proj = nn.Linear(c, kv * d, bias=False)
        self.o_proj = nn.Linear(h * d, c, bias=False)
        self.q_norm = RMSNorm(d, config.norm_eps) if config.qk_norm else nn.Identity()
        self.k_norm = RMSNorm(d, config.norm_eps) if config.qk_norm else nn.Identity()
        self.cache: KVCache | None = None

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, start_pos: int | None = None) -> Tensor:
        """x (B, T, C); cos, sin (T, D) for positions [start_pos or 0, +T). start_pos None: full causal forward
        without cache; an int: decode against the KV cache. Returns (B, T, C)."""
        cfg = self.config
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, cfg.n_heads, cfg.head_dim).transpose(1, 2)  # (B, H, T, D)
        k = self.k_proj(x).view(B, T, cfg.n_kv_heads, cfg.head_dim).transpose(1, 2)  # (B, KV, T, D)
        v = self.v_proj(x).view(B, T, cfg.n_kv_heads, cfg.head_dim).transpose(1, 2)  # (B, KV, T, D)
        q = apply_rope(self.q_norm(q), cos, sin)
        k = apply_rope(self.k_norm(k), cos, sin)
        mask = None
        if start_pos is not None:
            if self.cache is None:
                raise RuntimeError("start_pos was given but no KV cache is set up; call model.setup_kv_cache()")
            k, v = self.cache.update(start_pos, k, v)  # (B, KV, S, D), S = start_pos + T
            if start_pos > 0 and T > 1:
                # Continuing a cache with several tokens: query i sees keys <= start_pos + i. (T, S), small T.
                pos_q = torch.arange(start_pos, start_pos + T, device=x.device)
                mask = pos_q[:, None] >= torch.arange(start_pos + T, device=x.device)[None, :]  # (T, S)
        is_causal = mask is None and T > 1
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal,
                                           enable_gqa=cfg.n_rep > 1)  # (B, H, T, D)
        y = y.transpose(1, 2).reshape(B, T, cfg.n_heads * cfg.head_dim)  # (B, T, H*D)
        return self.o_proj(y)

    def setup_cache(self, batch_size: int, max_seq_len: int, dtype: torch.dtype,
                    device: torch.device | str | None) -> None:
        cfg = self.config
        self.cache = KVCache(batch_size, cfg.n_kv_heads, max_seq_len, cfg.head_dim, dtype, device)

    def clear_cache(self) -> None:
        self.cache = None

    def init_weights(self) -> None:
        std = self.config.init_std
        for proj in (self.q_proj, self.k_proj, self.v_proj):
            nn.init.normal_(proj.weight, std=std)
        nn.init.normal_(self.o_proj.weight, std=std / math.sqrt(2 * self.config.n_layers))
        for norm in (self.q_norm, self.k_norm):
            if isinstance(norm, RMSNorm):
                norm.init_weights()


class Block(nn.Module):
    """Pre-norm decoder block: x + attn(norm(x)), then + mlp(norm(.)). Optionally recomputed in backward."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(config.dim, config.norm_eps)
        self.attn = NativeSparseAttention(config) if config.attention_type == "nsa" else Attention(config)
        self.mlp_norm = RMSNorm(config.dim, config.norm_eps)
        self.mlp = FeedForward(config.dim, config.ffn_dim, config.ffn_chunk_size)
        self.checkpointing = False

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, start_pos: int | None = None) -> Tensor:
        if self.checkpointing and torch.is_grad_enabled():
            return checkpoint(self._forward, x, cos, sin, start_pos, use_reentrant=False)
        return self._forward(x, cos, sin, start_pos)

    def _forward(self, x: Tensor, cos: Tensor, sin: Tensor, start_pos: int | None) -> Tensor:
        h = x + self.attn(self.attn_norm(x), cos, sin, start_pos)
        return h + self.mlp(self.mlp_norm(h))

    def init_weights(self, config: ModelConfig) -> None:
        self.attn_norm.init_weights()
        self.mlp_norm.init_weights()
        self.attn.init_weights()
        self.mlp.init_weights(config.init_std, config.init_std / math.sqrt(2 * config.n_layers))


class Transformer(nn.Module):
    """The decoder. Build on `torch.device("meta")`, then `to_empty(device=...)` and `init_weights()` for large
    models (the flow FSDP2 uses), or build directly on a device (weights are initialised in `__init__`)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList(Block(config) for _ in range(config.n_layers))
        self.norm = RMSNorm(config.dim, config.norm_eps)
        self.lm_head = nn.Linear(config.dim, config.vocab_size, bias=False)
        self._tie_weights()
        self.rope = RotaryEmbedding(config.head_dim, config.rope_theta, config.context_length,
                                    config.rope_scaling)
        if self.embed_tokens.weight.device.type != "meta":
            self.init_weights()

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
            block.checkpointing = enabled

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

    def hidden_states(self, input_ids: Tensor, start_pos: int | None = None) -> Tensor:
        """Final-norm hidden states (B, T, C) for `input_ids` (B, T) at positions [start_pos or 0, +T)."""
        if input_ids.dim() != 2 or input_ids.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"input_ids must be an integer tensor of shape (B, T), got {tuple(input_ids.shape)} "
                             f"{input_ids.dtype}")
        T = input_ids.shape[1]
        offset = start_pos or 0
        if offset + T > self.config.context_length:
            raise ValueError(f"sequence of {offset + T} positions exceeds context_length "
                             f"{self.config.context_length}; raise ModelConfig.context_length")
        if start_pos is not None and torch.is_grad_enabled():
            raise RuntimeError("KV-cache decoding (start_pos given) runs without gradients: use torch.no_grad()")
        x = self.embed_tokens(input_ids)  # (B, T, C)
        cos, sin = self.rope(T, offset, x.device)  # (T, D) each
        for block in self.layers:
            x = block(x, cos, sin, start_pos)
        return self.norm(x)

    def forward(self, input_ids: Tensor, labels: Tensor | None = None, start_pos: int | None = None,
                loss_normalizer: Tensor | float | None = None) -> ModelOutput:
        """input_ids (B, T); labels (B, T) unshifted (the model shifts them; -100 is ignored).

        Returns ModelOutput(loss, logits): loss is the summed next-token cross-entropy over non-ignored targets
        divided by `loss_normalizer` (default: their count, i.e. the mean; a trainer passes the global count over
        ranks and accumulation steps), None without labels; logits (B, T, V) are None when the chunked loss ran.
        """
        if labels is not None and labels.shape != input_ids.shape:
            raise ValueError(f"labels {tuple(labels.shape)} must have the shape of input_ids {tuple(input_ids.shape)}")
        h = self.hidden_states(input_ids, start_pos)
        if labels is None:
            return ModelOutput(None, self.lm_head(h))
        loss, logits = self.compute_loss(h, labels, loss_normalizer)
        return ModelOutput(loss, logits)

    # ---- loss: every path goes through compute_loss --------------------------------------------------------

    def use_chunked_loss(self, num_tokens: int, dtype: torch.dtype) -> bool:
        """Whether the loss for `num_tokens` tokens of hidden states in `dtype` takes the chunked path.
        Decided from shapes only: chunked when the logits (tokens x V x element size) would exceed the threshold."""
        mode = self.config.loss_mode
        if mode != "auto":
            return mode == "chunked"
        logits_bytes = num_tokens * self.config.vocab_size * torch.finfo(dtype).bits // 8
        return logits_bytes > self.config.loss_chunk_threshold_bytes

    def compute_loss(self, hidden: Tensor, labels: Tensor,
                     loss_normalizer: Tensor | float | None = None) -> tuple[Tensor, Tensor | None]:
        """hidden (B, T, C), labels (B, T) unshifted -> (loss, logits (B, T, V) or None). The summed loss is
        divided by `loss_normalizer` (default: the number of non-ignored targets)."""
        B, T, _ = hidden.shape
        if self.use_chunked_loss(B * T, hidden.dtype):
            return self._compute_loss_chunked(hidden, labels, self.config.loss_chunk_size, loss_normalizer)
        return self._compute_loss_standard(hidden, labels, loss_normalizer)

    def _compute_loss_standard(self, hidden: Tensor, labels: Tensor,
                               loss_normalizer: Tensor | float | None = None) -> tuple[Tensor, Tensor]:
        return standard_linear_cross_entropy(  # logits (B, T, V), their own tensor (an FSDP root returns no view)
            hidden, self.output_weight, shift_labels(labels), z_loss_coef=self.config.z_loss_coef,
            softcap=self.config.logit_softcap, normalizer=loss_normalizer)

    def _compute_loss_chunked(self, hidden: Tensor, labels: Tensor, chunk_size: int = 4096,
                              loss_normalizer: Tensor | float | None = None) -> tuple[Tensor, None]:
        """Same loss and gradients as the standard path, never holding more than one chunk of logits
        (see loss.chunked_linear_cross_entropy)."""
        B, T, C = hidden.shape
        loss = chunked_linear_cross_entropy(
            hidden.reshape(B * T, C), self.output_weight, shift_labels(labels).reshape(B * T),
            chunk_size=chunk_size, z_loss_coef=self.config.z_loss_coef, softcap=self.config.logit_softcap,
            normalizer=loss_normalizer)
        return loss, None

    # ---- generation ------------------------------------------------------------------------------------------

    @torch.no_grad()
    def generate(self, input_ids: Tensor, max_new_tokens: int, temperature: float = 1.0, top_k: int | None = None,
                 top_p: float | None = None, eos_id: int | None = None,
                 generator: torch.Generator | None = None) -> Tensor:
        """Prefill `input_ids` (B, T) into a preallocated KV cache, then decode `max_new_tokens` tokens one at a
        time. temperature 0 is greedy. Rows that emit `eos_id` keep emitting it; decoding stops early once every row
        has. Returns (B, T + generated) token ids. All rows must share one prompt length (a tensor guarantees it;
        left-padding is not supported because the model takes no attention mask)."""
        if not isinstance(input_ids, Tensor):
            lengths = {len(row) for row in input_ids}
            if len(lengths) > 1:
                raise ValueError(f"prompts of different lengths {sorted(lengths)} are not supported in one batch: "
                                 "generate them separately (the model takes no padding mask)")
            input_ids = torch.tensor(input_ids, device=self.embed_tokens.weight.device)
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        B, T = input_ids.shape
        if T + max_new_tokens > self.config.context_length:
            raise ValueError(f"prompt ({T}) + max_new_tokens ({max_new_tokens}) exceeds context_length "
                             f"{self.config.context_length}")
        self.setup_kv_cache(B, T + max_new_tokens)
        try:
            out = [input_ids]
            finished = torch.zeros(B, dtype=torch.bool, device=input_ids.device)
            logits = self.lm_head(self.hidden_states(input_ids, start_pos=0)[:, -1])  # (B, V)
            for i in range(max_new_tokens):
                token = sample_next_token(logits, temperature, top_k, top_p, generator)  # (B,)
                if eos_id is not None:
                    token = torch.where(finished, torch.full_like(token, eos_id), token)
                    finished |= token == eos_id
                out.append(token[:, None])
                if i == max_new_tokens - 1 or (eos_id is not None and bool(finished.all())):
                    break
                logits = self.lm_head(self.hidden_states(token[:, None], start_pos=T + i)[:, -1])  # (B, V)
        finally:
            self.clear_kv_cache()
        return torch.cat(out, dim=1)


def sample_next_token(logits: Tensor, temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None,
                      generator: torch.Generator | None = None) -> Tensor:
    """Next token per row from logits (B, V): greedy when temperature == 0, else sampled from the
    temperature-scaled distribution restricted to the top_k tokens and the top_p nucleus. Returns (B,) long."""
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
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
