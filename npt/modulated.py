"""Neuro-plastic decoder layers: the attention output of each token modulates that token's FFN weights.

For every modulated projection of the SwiGLU FFN (written y = x W in the maths; nn.Linear stores W as (O, I)):

    m = a W_m                               per-token coefficients from the attention output a, (B, T, r)
    y = x (W + dW(token)),   dW(token) = A diag(m) B,   A (I, r), B (r, O)
      = x W + ((x A) * m) B                 the form computed: dW is never built

so the extra work is two thin matmuls and the extra memory O(N * r). Residual modes: "modulate" drops the attention
output from the residual stream (it only modulates the FFN); "additive" keeps the original residual, so with B = 0 a
converted layer computes exactly what the original layer did.

Notation: B batch, T tokens, N = B * T, C model width (d_model), F FFN width (d_ffn), I / O input / output width of a
projection (C / F for gate and up, F / C for down), P modulated projections, r rank.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from model import Block, ModelConfig
from modeling.offload import OffloadSavedTensors, OffloadStats
from modeling.shard import SequenceShard

TARGETS = ("gate", "up", "down")
ResidualMode = Literal["modulate", "additive"]
Mode = Literal["plastic", "static", "original"]


def modulated_linear(x: Tensor, weight: Tensor, A: Tensor, B: Tensor, m: Tensor) -> Tensor:
    """`x W + ((x A) * m) B` without forming the per-token weight.

    Args:
        x: `(..., I)`; weight: `(O, I)` (nn.Linear layout); A: `(I, r)`; B: `(r, O)`; m: `(..., r)`.
        All in the compute dtype.
    Returns:
        `(..., O)` in x's dtype. The coefficient product is formed in float32 (float64 for float64 inputs), and
        the low-rank term is added by addmm, so base + update is summed in the GEMM's float32 accumulator and
        rounded once.
    """
    acc = torch.promote_types(x.dtype, torch.float32)  # float32, or float64 for float64 inputs
    x2 = x.reshape(-1, x.shape[-1])  # (N, I)
    z = (x2 @ A).to(acc) * m.reshape(-1, m.shape[-1]).to(acc)  # (N, r)
    y = F.linear(x2, weight)  # (N, O)
    y = y.addmm_(z.to(x.dtype), B)  # (N, O); in place: the base output is not needed by its backward
    return y.view(*x.shape[:-1], y.shape[-1])  # (..., O)


class NPComponent(nn.Module):
    """Per-token modulation coefficients from the attention output, and the low-rank factors they scale.

    Parameters: `coef.weight` (P * r, C) stacks W_m of every target; `A[t]` (I, r) and `B[t]` (r, O) per target `t`
    in `targets` ("gate", "up", "down"). B starts at zero, so a fresh component leaves the FFN unchanged.
    """

    def __init__(self, dim: int, ffn_dim: int, rank: int, targets: tuple[str, ...],
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
            raise ValueError(f"rank must be a positive integer, got {rank!r}")
        if not targets or len(set(targets)) != len(targets) or not set(targets) <= set(TARGETS):
            raise ValueError(f"targets must be distinct names from {TARGETS}, got {targets!r}")
        self.rank = rank
        self.targets = tuple(t for t in TARGETS if t in targets)  # canonical order
        kw = dict(device=device, dtype=dtype)
        self.coef = nn.Linear(dim, len(self.targets) * rank, bias=False, **kw)
        shapes = {"gate": (dim, ffn_dim), "up": (dim, ffn_dim), "down": (ffn_dim, dim)}  # (I, O)
        self.A = nn.ParameterDict({t: nn.Parameter(torch.empty(shapes[t][0], rank, **kw)) for t in self.targets})
        self.B = nn.ParameterDict({t: nn.Parameter(torch.empty(rank, shapes[t][1], **kw)) for t in self.targets})
        if self.coef.weight.device.type != "meta":
            self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """coef and A ~ N(0, 1 / fan_in) (unit-scale coefficients and projections), B = 0 (no modulation yet)."""
        nn.init.normal_(self.coef.weight, std=self.coef.in_features**-0.5)
        for t in self.targets:
            nn.init.normal_(self.A[t], std=self.A[t].shape[0] ** -0.5)
            nn.init.zeros_(self.B[t])

    def forward(self, a: Tensor) -> Tensor:
        """a `(B, T, C)` attention output -> m `(B, T, P, r)` coefficients in a's dtype (the compute dtype)."""
        m = F.linear(a, self.coef.weight.to(a.dtype))  # (B, T, P*r)
        return m.unflatten(-1, (len(self.targets), self.rank))  # (B, T, P, r)

    def project(self, target: str, x: Tensor, weight: Tensor, m: Tensor) -> Tensor:
        """x `(B, T, I)` through the frozen weight `(O, I)` modulated by m `(B, T, P, r)` -> `(B, T, O)`."""
        p = self.targets.index(target)
        dtype = x.dtype
        return modulated_linear(x, weight.to(dtype), self.A[target].to(dtype), self.B[target].to(dtype), m[..., p, :])

    def delta_weight(self, target: str, m: Tensor) -> Tensor:
        """The update dW = A diag(m) B `(I, O)` in float32 for one coefficient vector m `(r,)` (used for folding)."""
        return (self.A[target].float() * m.float()) @ self.B[target].float()  # (I, r) * (r,) @ (r, O) -> (I, O)

    def delta_sq_norm(self, m: Tensor) -> Tensor:
        """||dW(token)||_F^2 summed over targets, `(B, T)` float32, from m `(B, T, P, r)` without forming dW.

        ||A diag(m) B||_F^2 = m^T G m with G = (A^T A) * (B B^T) (elementwise), an (r, r) Gram product.
        """
        total = m.new_zeros(m.shape[:-2], dtype=torch.float32)  # (B, T)
        for p, t in enumerate(self.targets):
            A, B = self.A[t].float(), self.B[t].float()
            gram = (A.t() @ A) * (B @ B.t())  # (r, r)
            mp = m[..., p, :].float()  # (B, T, r)
            total = total + ((mp @ gram) * mp).sum(-1)
        return total


class NPBlock(Block):
    """A decoder Block whose FFN weights are modulated per token by its attention output.

    It reuses the original block's submodules (`attn_norm`, `attn`, `mlp_norm`, `mlp`: same parameters, same names)
    and adds `np` (an NPComponent). `mode` selects the computation:
      "plastic"  W + dW(token) on the targets (the converted layer);
      "static"   the converted wiring (residual mode) with the plain FFN weights, e.g. after folding;
      "original" exactly `Block._forward` (the unconverted layer; the teacher in equivalence training).
    With `offload` set, tensors saved for backward go to CPU memory (offload.py).
    """

    def __init__(self, block: Block, rank: int = 16, targets: tuple[str, ...] = ("gate", "up"),
                 residual_mode: ResidualMode = "modulate", dtype: torch.dtype | None = None) -> None:
        nn.Module.__init__(self)
        if residual_mode not in ("modulate", "additive"):
            raise ValueError(f"residual_mode must be 'modulate' or 'additive', got {residual_mode!r}")
        self.attn_norm, self.attn, self.mlp_norm, self.mlp = block.attn_norm, block.attn, block.mlp_norm, block.mlp
        self.gradient_checkpointing = block.gradient_checkpointing
        self._gradient_checkpointing_func = block._gradient_checkpointing_func
        # The replaced Block, kept for npt.convert.revert. Not a submodule: its children are ours (no duplicate names).
        object.__setattr__(self, "original", block)
        gate = self.mlp.gate_proj.weight  # (F, C)
        self.np = NPComponent(gate.shape[1], gate.shape[0], rank, targets, device=gate.device,
                              dtype=dtype or gate.dtype)
        self.residual_mode = residual_mode
        self.mode: Mode = "plastic"
        self.offload = False
        self.offload_stats = OffloadStats()

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, start_pos: int | None = None,
                doc_start: Tensor | None = None, shard: SequenceShard | None = None) -> Tensor:
        offload = self.offload and torch.is_grad_enabled()
        with OffloadSavedTensors(self.offload_stats) if offload else nullcontext():
            return super().forward(x, cos, sin, start_pos, doc_start, shard)

    def _forward(self, x: Tensor, cos: Tensor, sin: Tensor, start_pos: int | None,
                 doc_start: Tensor | None = None, shard: SequenceShard | None = None) -> Tensor:
        if self.mode == "original":
            return super()._forward(x, cos, sin, start_pos, doc_start, shard)
        if self.mode not in ("plastic", "static"):
            raise ValueError(f"NPBlock.mode must be 'plastic', 'static' or 'original', got {self.mode!r}")
        a = self.attend(x, cos, sin, start_pos, doc_start, shard)  # (B, T, C)
        h = x + a if self.residual_mode == "additive" else x
        m = self.np(a) if self.mode == "plastic" else None  # (B, T, P, r)
        u = self.mlp_norm(h)
        hidden = F.silu(self._project("gate", u, m)) * self._project("up", u, m)  # (B, T, F)
        return h + self._project("down", hidden, m)

    def _project(self, target: str, x: Tensor, m: Tensor | None) -> Tensor:
        linear = getattr(self.mlp, f"{target}_proj")
        if m is None or target not in self.np.targets:
            return linear(x)
        return self.np.project(target, x, linear.weight, m)

    def init_weights(self, config: ModelConfig) -> None:
        super().init_weights(config)
        self.np.init_weights()
