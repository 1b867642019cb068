"""NSA's selection-scoring loss: an auxiliary training loss that teaches the importance scores, which choose the
selected blocks (paper Eqs. 8-11), to rank blocks by their best-matching key.

Top-n selection has no gradient, so the importance scores (the compression branch's attention probabilities,
pooled onto selection blocks and summed over a GQA group) learn only through the compression branch's own output:
nothing tells them which block the selection branch should have read. The loss supplies that signal, as
SeerAttention (Gao et al. 2024, arXiv 2410.13276) distils block-level attention into its gate, here applied to NSA's
own scores. For each query where top-n really chooses (`nsa.blocks.contested_blocks`: more blocks between block 0
and its previous block than the n - 3 slots those forced blocks leave; the query's block c >= n), over those
blocks j (1 .. c - 2):

    target  t_j  = best-token scores (`nsa.blocks.best_token_scores`, what `nsa.primitive.exact_block_scores`
                   selects by): per query head, softmax over those blocks of max_{s in j} q . k_s / sqrt(D),
                   averaged over the group's heads; no gradient;
    predict p_j  = importance of block j (`nsa.blocks.block_importance`), renormalised over the same blocks, as
                   log p_j from the log importance (`nsa.blocks.block_log_importance`, log space throughout, so
                   a block far below the row's best keeps its gradient where its probability underflows);
    loss         = KL(t || p) = sum_j t_j (log t_j - log p_j).

With `Objective.nsa_score_loss_target` "selection", t is instead the set selection by t would take: uniform
over the n - 3 blocks t ranks highest (`nsa.blocks.selection_target`). Top-n needs a block's rank, not its share:
t often puts nearly all its mass on one or two blocks, so a block it ranks fifth weighs almost nothing in KL(t || p)
though selection by t takes it; the set weighs each of the n - 3 alike. The loss is then the cross-entropy of p on
the set, less log(n - 3). With "boundary", the loss ranks rather than matches: per row, softplus(max log p_j over
the contested blocks outside that set - min log p_j over the set), a smooth hinge that pushes the weakest block
selection by t would take above the strongest it would leave (top-n reads only which side of the boundary a
block falls on); rows with blocks on one side only contribute 0.

The loss is averaged over those (batch, KV head, query) rows: a mean over the rows that choose, so the coefficient
means the same at every length, and independent of the labels. Computed in at least float32 with autocast off (a bf16
autocast run and a float32 one train the same objective). Gradients reach the queries and the compressed keys (so
the projections and, with the "mlp" compressor, its MLP), not the target's keys. It is a training objective,
weighted by `Objective.nsa_score_loss_coef` (off by default) and added by nsa/layer.py through
`attention.add_aux_loss`.

Cost and memory: the target reads every key of the prefix (a chunk's best-token logits are Q x T in tiles of keys),
so each NSA layer pays one full-attention score product (QK^T) more per step (two with gradient checkpointing, which
recomputes the forward). Two options make it cheaper:
- `Objective.nsa_score_loss_stride` k scores every k-th row from a random offset and scales their sum by k: an
  unbiased estimate of the same mean, and of its gradients, at 1/k of the cost, still O(T^2 / k);
- `Objective.nsa_score_loss_top` m > 0 takes t and p over each row's own candidates only: its m blocks of
  highest importance (the n - 3 it selects among them when m >= n - 3) and `nsa_score_loss_random` r others drawn
  uniformly from the rest (`nsa.blocks.candidate_blocks`), so the target reads (m + r) l' keys a query: O(T (m + r)
  l') work, linear in T. It is another loss, not an estimate of the dense one (equal to it on rows with at most m
  contested blocks): it ranks each row's best blocks among those it would select or nearly select, and the random
  blocks let a block it never considers enter. What remains quadratic is the importance itself, the compression
  branch's own O(T^2 / d) product.
Like
loss.py's chunked cross-entropy, the loss computes its gradients during forward, chunk by chunk of Q =
`ComputeConfig.attention_query_chunk` queries, and keeps only the gradients of q and the compressed keys for
backward: no chunk's logits outlive it.

Notation: B batch, H query heads, KV key/value heads, D head dimension, T queries, Q queries of a chunk, Nc
compressed blocks, Ns selection blocks. Block geometry: l (`nsa_block_size`), d (`nsa_stride`), l'
(`nsa_select_block_size`).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor
from torch._subclasses.fake_tensor import is_fake

from nsa.blocks import (
    NO_IMPORTANCE,
    as_blocks,
    best_token_scores,
    block_log_importance,
    candidate_blocks,
    candidate_token_scores,
    contested_blocks,
    first_choosing_position,
    num_compressed_blocks,
    selection_target,
)

if TYPE_CHECKING:
    from modeling.config import ComputeConfig, ModelConfig
    from modeling.objective import Objective
    from modeling.shard import SequenceShard


def _as_is(t: Tensor) -> Tensor:
    return t


def _chunk_kl(q: Tensor, k_cmp: Tensor, k_blocks: Tensor, q_pos: Tensor, last: int, config: ModelConfig, top: int,
              random: int, generator: torch.Generator | None, target_kind: str, temperature: float) -> Tensor:
    """Summed loss of one chunk's rows: queries q (B, H, Q, D) at the ascending positions q_pos (Q,), the last of
    them `last`, the compressed keys k_cmp (B, KV, Nc', D) they can see, the key blocks k_blocks (B, KV, Ns', l',
    D). Over every contested block (top = 0), or over each row's `top` blocks by importance and `random` others
    (`nsa.blocks.candidate_blocks`, drawn from `generator`). `target_kind` "scores": KL(t || p); "selection": the
    target made uniform over the n - 3 blocks it ranks highest (`nsa.blocks.selection_target`); "boundary":
    softplus(max log p over the blocks outside that set - min log p over the set), for rows with blocks on both
    sides. The target's softmax at `temperature`. Rows where top-n does not choose contribute 0."""
    l, d, l_sel = config.nsa_block_size, config.nsa_stride, config.nsa_select_block_size
    G = q.shape[1] // k_cmp.shape[1]
    n_select = last // l_sel + 1  # blocks up to the last query's own
    contested = contested_blocks(q_pos, l_sel, n_select, config.nsa_num_selected)  # (Q, Ns)
    log_importance = block_log_importance(q, k_cmp, q_pos, l, d, l_sel, n_select)  # (B, KV, Q, Ns)
    with torch.no_grad():
        if top:
            idx, valid = candidate_blocks(log_importance, contested, top, random, generator)  # (B, KV, Q, K)
            target = candidate_token_scores(q, k_blocks, idx, valid, temperature) / G  # (B, KV, Q, K): sum 1 or 0
        else:
            target = best_token_scores(q, k_blocks, q_pos, n_select, contested, temperature) / G  # (B, KV, Q, Ns)
        if target_kind != "scores":
            target = selection_target(target, valid if top else contested, config.nsa_num_selected - 3)
    scored = log_importance.gather(-1, idx) if top else log_importance
    kept = valid if top else contested.expand_as(scored)
    if target_kind == "boundary":  # the weakest block of the set against the strongest outside it
        chosen = (target > 0) & kept
        rest = kept & ~chosen
        weakest = torch.where(chosen, scored, math.inf).amin(-1)  # (B, KV, Q)
        strongest = torch.where(rest, scored, -math.inf).amax(-1)
        both = chosen.any(-1) & rest.any(-1)
        return torch.where(both, F.softplus(torch.where(both, strongest - weakest, 0)), 0).sum()
    scored = torch.where(kept, scored, NO_IMPORTANCE)  # log p over the kept blocks: a log-softmax, never a log of 0
    log_p = scored - scored.logsumexp(-1, keepdim=True)
    return torch.where(kept, torch.xlogy(target, target) - target * log_p, 0).sum()


class _SelectionScoreLoss(torch.autograd.Function):
    """`selection_score_loss`: gradients computed in forward, chunk by chunk; backward scales them."""

    @staticmethod
    def forward(ctx, q: Tensor, k_cmp: Tensor, k_slc: Tensor, config: ModelConfig, chunk: int, stride: int,
                offset: int, top: int, random: int, seed: int, target_kind: str, temperature: float,
                pieces: tuple[tuple[int, int, int], ...], length: int, peak_only: bool) -> Tensor:
        B = q.shape[0]
        KV, l, d, l_sel = k_cmp.shape[1], config.nsa_block_size, config.nsa_stride, config.nsa_select_block_size
        first = first_choosing_position(l_sel, config.nsa_num_selected) or length
        rows = B * KV * score_loss_queries(config, length)
        acc = torch.promote_types(q.dtype, torch.float32)
        k_blocks = as_blocks(k_slc, l_sel)  # (B, KV, Ns, l', D) in k_slc's dtype: cast to acc a tile at a time
        total = q.new_zeros((), dtype=acc)
        generator = torch.Generator(q.device).manual_seed(seed) if random else None
        grad_q, grad_k = torch.zeros_like(q, dtype=acc), torch.zeros_like(k_cmp, dtype=acc)  # k's summed over chunks
        for local, span_first, span_end in pieces:
            start = first + offset  # every stride-th row from there: each with probability 1 / stride
            if span_first > start:
                start += -(-(span_first - start) // stride) * stride  # the same rows' first in the span
            scored = range(start, span_end, stride)
            chunks = range(0, len(scored), chunk)
            for c0 in chunks[-3:] if peak_only else chunks:
                positions = scored[c0:c0 + chunk]
                q_pos = torch.arange(positions.start, positions.stop, positions.step, device=q.device)  # (Q,)
                n_cmp = num_compressed_blocks(positions[-1] + 1, l, d)
                # The chunk's own graph lives only in this block: its tensors bypass an enclosing checkpoint's or
                # offload's saved-tensor hooks (a checkpoint would recompute the whole block to unpack them).
                # Autocast is off: the loss runs in `acc` in every set-up.
                with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(_as_is, _as_is), \
                        torch.autocast(q.device.type, enabled=False):
                    q_c = q.index_select(2, q_pos - span_first + local).detach().to(acc).requires_grad_()
                    k_c = k_cmp[:, :, :n_cmp].detach().to(acc).requires_grad_()  # (B, H, Q, D) and (B, KV, n, D)
                    kl = _chunk_kl(q_c, k_c, k_blocks, q_pos, positions[-1], config, top, random, generator,
                                   target_kind, temperature)
                    dq, dk = torch.autograd.grad(kl, (q_c, k_c))
                total += kl.detach()
                grad_q.index_copy_(2, q_pos - span_first + local, dq)
                grad_k[:, :, :n_cmp] += dk
        scale = stride / max(rows, 1)  # the sampled rows' sum, scaled to an unbiased estimate of the mean
        ctx.save_for_backward(grad_q.mul_(scale).to(q.dtype), grad_k.mul_(scale).to(k_cmp.dtype))
        return total * scale

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_output: Tensor) -> tuple[Tensor | None, ...]:
        grad_q, grad_k = ctx.saved_tensors
        return (grad_q * grad_output.to(grad_q.dtype), grad_k * grad_output.to(grad_k.dtype),
                *([None] * 13))


@torch.compiler.disable  # opaque to torch.compile: a Python loop of chunks with an autograd pass each
def selection_score_loss(q: Tensor, k_cmp: Tensor, k_slc: Tensor, config: ModelConfig, compute: ComputeConfig,
                         objective: Objective, shard: SequenceShard | None = None, peak_only: bool = False) -> Tensor:
    """The mean KL(target || importance) over the rows where top-n chooses (module docstring).

    Args:
        q: `(B, H, T, D)` rotated queries at positions [0, T); with `shard` (`modeling.shard.SequenceShard`) the
            shard's queries (B, H, t, D), and the result is their summed loss over the whole sequence's row count
            (the shards' results add up to the mean), every shard drawing the same stride offset.
        k_cmp: `(B, KV, Nc, D)` compressed keys (all blocks complete within the T positions; with a shard, the
            whole sequence's).
        k_slc: `(B, KV, S, D)` the selection branch's keys at positions [0, S), S >= T; no gradient reaches them
            through the target.
        config: block geometry (`nsa_*` fields).
        compute: `attention_query_chunk` queries are scored at a time.
        objective: with `nsa_score_loss_stride` k > 1, every
            k-th of the rows from a random offset (the CPU generator's, so a resumed run and a checkpoint's
            recomputation draw the same), their sum times k over the rows' count: an unbiased estimate of the mean
            at 1/k of the cost; with `nsa_score_loss_top` m > 0, each row's target and prediction over its m
            blocks of highest importance and `nsa_score_loss_random` random others (a seed drawn from the same
            generator) only; with `nsa_score_loss_target` "selection", the target uniform over the n - 3 blocks
            it ranks highest, with "boundary" the ranking loss at that set's edge; with
            `nsa_score_loss_temperature` tau, the target's softmax of the best-key logits divided by tau.
        peak_only: score only the last three query chunks of each span, for a memory estimate under fake tensors
            (nsa/memory_stand_in.py): the same allocations at the same peak in a fraction of the time, as no
            chunk's working set exceeds the last two's (a later chunk sees at least as many blocks; the last may
            hold fewer queries), and the third leaves alive during them what an earlier chunk leaves; the value
            and gradients are those chunks' only.
    Returns:
        A 0-dim tensor in at least float32 (0 when T <= n l': no query chooses yet), differentiable in q and
        k_cmp.
    """
    stride, top, random = objective.nsa_score_loss_stride, objective.nsa_score_loss_top, objective.nsa_score_loss_random
    offset = _host_draw(stride) if stride > 1 else 0
    seed = _host_draw(2**62) if random else 0
    pieces = ((0, 0, q.shape[2]),) if shard is None else tuple(shard.pieces())
    return _SelectionScoreLoss.apply(q, k_cmp, k_slc, config, compute.attention_query_chunk, stride, offset, top,
                                     random, seed, objective.nsa_score_loss_target,
                                     objective.nsa_score_loss_temperature, pieces,
                                     q.shape[2] if shard is None else shard.length, peak_only)


def _host_draw(high: int) -> int:
    """A draw from [0, high) of the CPU generator: a host read, no device sync. Under fake tensors (a memory
    estimate, where nothing has a value) high - 1: as the stride's offset, the latest rows, whose chunks see the
    most blocks."""
    draw = torch.randint(high, (), device="cpu")
    return high - 1 if is_fake(draw) else int(draw)


def score_loss_queries(config: ModelConfig, length: int | None = None) -> int:
    """Queries of a sequence of `length` tokens (default: context_length) at which top-n really chooses, and so the
    selection-scoring loss has a target (from `nsa.blocks.first_choosing_position` on)."""
    first = first_choosing_position(config.nsa_select_block_size, config.nsa_num_selected)
    return 0 if first is None else max(0, (length or config.context_length) - first)


def check_score_loss(config: ModelConfig, objective: Objective) -> None:
    """ValueError naming the option when the selection-scoring loss `objective` sets would be 0 on every step of
    `config` (top-n never chooses at its context_length) or on most (a stride beyond the queries that choose)."""
    if objective.nsa_score_loss_coef == 0:
        return
    queries, first = score_loss_queries(config), config.nsa_num_selected * config.nsa_select_block_size
    if queries == 0:
        raise ValueError(f"--nsa_score_loss_coef: top-n never chooses at context_length {config.context_length} (only "
                         f"from n x l' = {first} tokens on, with nsa_num_selected >= 4), so the loss would be 0 on "
                         f"every step: train at a context_length above {first}, or leave it out")
    candidates = objective.nsa_score_loss_top + objective.nsa_score_loss_random
    if objective.nsa_score_loss_target == "boundary" and objective.nsa_score_loss_top and \
            candidates <= config.nsa_num_selected - 3:
        raise ValueError(f"--nsa_score_loss_target boundary ranks the n - 3 = {config.nsa_num_selected - 3} blocks "
                         f"the best keys select above the rest, and {candidates} candidate blocks leave no rest: "
                         f"raise --nsa_score_loss_top (+ --nsa_score_loss_random) above {config.nsa_num_selected - 3}")
    if objective.nsa_score_loss_stride > queries:
        raise ValueError(f"--nsa_score_loss_stride {objective.nsa_score_loss_stride} exceeds the {queries} queries "
                         f"where top-n chooses (context_length {config.context_length} - n x l' {first}), so most "
                         f"steps would score none: pass at most {queries}")
