"""The loss task: validation loss overall and mean loss by token position, in log-spaced buckets [1, 2), [2, 4), ...
up to the context length, on windows of the held-out split (data.py prepare's DATA_DIR/validation); and the
validation loss train.py reports during training. A model that uses its context has lower loss at later positions.

Notation: N windows, B windows per batch, T tokens per window, C width, V vocabulary.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from evaluation.registry import EvalTask, Setting
from model import Transformer
from modeling.documents import document_starts
from modeling.loss import IGNORE_INDEX, shift_labels
from modeling.objective import Objective
from modeling.shard import SequenceShard
from text.shards import TokenLoader, check_tokenizer, load_index, validation_dir

LOSS_CHUNK = 512  # positions whose logits exist at a time when scoring windows


def loss_by_position(model: Transformer, windows: torch.Tensor, batch_size: int = 4,
                     progress: Callable[[int], None] | None = None, eod_id: int | None = None) -> dict:
    """Next-token loss of `windows` (N, T) by position: {"loss", "perplexity", "tokens", "positions" (T - 1 per-
    position means), "buckets" [{"start", "end", "loss"}] (log-spaced: [1, 2), [2, 4), ...)}. Position p is the
    prediction of token p + 1 from tokens 0..p (with `eod_id`, those of its own document only: --document_mask);
    logits exist for LOSS_CHUNK positions at a time."""
    N, T = windows.shape
    device = model.embed_tokens.weight.device
    sums = torch.zeros(T - 1, dtype=torch.float64)
    with torch.no_grad():
        for b0 in range(0, N, batch_size):
            ids = windows[b0:b0 + batch_size].to(device)  # (B, T)
            starts = None if eod_id is None else document_starts(ids, eod_id)  # (B, T): within each document
            hidden = model.hidden_states(ids, doc_start=starts)  # (B, T, C)
            for p0 in range(0, T - 1, LOSS_CHUNK):
                p1 = min(p0 + LOSS_CHUNK, T - 1)
                logits = model.logits(hidden[:, p0:p1])  # (B, P, V)
                logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
                loss = F.cross_entropy(logits.flatten(0, 1), ids[:, p0 + 1:p1 + 1].flatten(), reduction="none")
                sums[p0:p1] += loss.view(ids.shape[0], -1).sum(0).double().cpu()
            if progress is not None:
                progress(len(ids))
    per_position = sums / N  # (T - 1,)
    edges = [2**i for i in range(int(math.log2(T - 1)) + 1)] + [T]  # 1, 2, 4, ..., T
    buckets = [{"start": a - 1, "end": min(b, T) - 1, "loss": per_position[a - 1:min(b, T) - 1].mean().item()}
               for a, b in zip(edges, edges[1:], strict=False) if a < T]
    mean = per_position.mean().item()
    return {"loss": mean, "perplexity": math.exp(mean), "tokens": N * (T - 1), "positions": per_position.tolist(),
            "buckets": buckets}


def validation_windows(data_dir: str | Path, seq_len: int, max_tokens: int, seed: int = 0, rank: int = 0,
                       world_size: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's share (input ids, labels), each (N, T), of about `max_tokens` tokens of whole windows of seq_len
    tokens of `data_dir`'s held-out split, in the loader's seeded order: the same windows every call, as many on
    every rank (collectives under FSDP stay in step), at least one. Labels are the ids but where the data's loss
    mask leaves a token out (-100: the prompts of prompt/response data)."""
    loader = TokenLoader(validation_dir(data_dir), seq_len, 1, seed=seed)
    per_rank = min(max(1, max_tokens // seq_len // world_size), loader.num_windows // world_size)
    if per_rank == 0:
        raise ValueError(f"the validation split of {data_dir} holds {loader.num_windows} windows of {seq_len} "
                         "tokens, fewer than one per rank; use shorter windows or prepare the data with a larger "
                         "--validation_fraction")
    batches = [next(loader) for _ in range(per_rank * world_size)]
    ids, labels = (torch.cat(parts)[rank::world_size] for parts in zip(*batches, strict=True))  # (N, T) each
    return ids, labels


def validation_loss(model: Transformer, windows: tuple[torch.Tensor, torch.Tensor],
                    autocast: AbstractContextManager, eod_id: int | None = None,
                    shard: SequenceShard | None = None) -> float:
    """Mean next-token loss over the predicted tokens of every rank's validation windows (input ids, labels), each
    (N, T), through the model's own loss path (chunked at long T); with `eod_id`, each token attends within its
    document only (train.py --document_mask); with `shard` (context parallelism), each rank computes its
    positions of its group's windows. The next-token loss alone: a training objective's extra terms (the z-loss)
    are left out. Reads neither the torch RNG nor a training loader, so evaluating during training changes
    nothing."""
    device = model.embed_tokens.weight.device
    stats = torch.zeros(2, device=device)  # summed token loss, predicted tokens
    with torch.no_grad(), autocast, _next_token_loss_only(model):
        for row, labels in zip(*(w.to(device) for w in windows), strict=True):
            starts = None if eod_id is None else document_starts(row[None], eod_id)  # (1, T)
            targets = shift_labels(labels[None])  # (1, T)
            if shard is None:
                loss = model(row[None], labels[None], loss_normalizer=1.0, doc_start=starts).loss
            else:  # this rank's positions, the targets shifted first
                targets = shard.take(targets)
                loss = model(shard.take(row[None]), targets, loss_normalizer=1.0, shard=shard,
                             doc_start=None if starts is None else shard.take(starts)).loss
            stats[0] += loss.float()
            stats[1] += (targets != IGNORE_INDEX).sum()
    if dist.is_initialized():
        dist.all_reduce(stats)
    return (stats[0] / stats[1].clamp(min=1)).item()


@contextmanager
def _next_token_loss_only(model: Transformer) -> Iterator[None]:
    """Within the block the model's objective is the next-token loss alone (no z-loss term); its own after."""
    objective, model.objective = model.objective, Objective()
    try:
        yield
    finally:
        model.objective = objective


def format_loss(result: dict) -> str:
    lines = [f"validation loss {result['loss']:.4f} (perplexity {result['perplexity']:.2f}) over {result['tokens']:,} "
             f"predicted tokens", f"{'positions':>17} {'mean loss':>10}"]
    lines += [f"{b['start']:>8}-{b['end'] - 1:<8} {b['loss']:>10.4f}" for b in result["buckets"]]
    return "\n".join(lines)


class LossTask(EvalTask):
    """loss: validation loss by token position on held-out windows (needs --data_dir or the run's data)."""

    reads = ("data_dir", "eval_tokens", "batch_size", "seed", "document_mask")
    default = True
    unit = "window"
    plot_file = "loss_by_position.png"

    def __init__(self, name: str, setting: Setting) -> None:
        super().__init__(name, setting)
        if not setting.data_dir:
            raise ValueError("the loss task needs --data_dir (prepared data with a validation split)")
        check_tokenizer(load_index(setting.data_dir), setting.tokenizer)  # the data must be this tokenizer's ids
        options = setting.options
        self.windows, _ = validation_windows(setting.data_dir, setting.context, options.eval_tokens, options.seed)
        eod = setting.tokenizer.eod_id
        if options.document_mask and not bool((self.windows[:, :-2] == eod).any()):  # an end before a scored token
            raise ValueError(f"--document_mask: no window of {setting.data_dir}'s validation split holds the end of "
                             "a document before a token it scores, so the mask keeps nothing apart; leave "
                             "--document_mask out")

    @property
    def work(self) -> int:
        return len(self.windows)

    def run(self, model: Transformer, progress: Callable[[int], None]) -> dict:
        eod = self.setting.tokenizer.eod_id if self.setting.options.document_mask else None
        return loss_by_position(model, self.windows, self.setting.options.batch_size, progress, eod)  # prompts too

    def table(self, result: dict) -> str:
        return format_loss(result)

    def meaning(self, result: dict) -> str:
        first, last = result["buckets"][0], result["buckets"][-1]
        where = f"positions {last['start']}-{last['end'] - 1}"
        if first["loss"] - last["loss"] > 0.05 * first["loss"]:
            return (f"=> the model uses its context: its loss falls from {first['loss']:.2f} on the first token to "
                    f"{last['loss']:.2f} at {where}")
        return (f"=> the loss does not fall with context ({first['loss']:.2f} on the first token, {last['loss']:.2f} "
                f"at {where}): the model predicts no better with it")

    def figure(self, result: dict, title: str) -> object:
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 4))
        buckets = result["buckets"]
        ax.plot([b["start"] + 1 for b in buckets], [b["loss"] for b in buckets], marker="o")  # 1, 2, 4, ...
        ax.set(xscale="log", xlabel="tokens of context before the predicted one", ylabel="mean validation loss")
        ax.set_title(title, fontsize=9)
        return fig
