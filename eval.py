"""Does a model use its context? Held-out loss by token position, and passkey / multi-key needle retrieval grids.

    python eval.py runs/train/model                                  # the export of a run (or step-N/, or a HF dir)
    python eval.py runs/train/step-300 --tasks passkey --lengths 256 512 1024 --depths 0 0.25 0.5 0.75 1

Tasks (each prints a table and writes a PNG; everything goes to OUT_DIR/eval.json):
- loss: validation loss overall and mean loss by token position in log-spaced buckets [1, 2), [2, 4), ... up to
  the context length, on windows of the held-out split (data.py prepare's DATA_DIR/validation). A model that uses
  its context has lower loss at later positions.
- passkey: a random 5-digit number hidden in filler text at a given depth (0 = start, 1 = end) of a prompt of a
  given length in tokens, asked for at the end; accuracy over the grid of lengths x depths.
- needle: several key-value pairs hidden in filler, the queried one at the given depth, the others at random
  depths; the model is asked for one value. Same grid.
Answers are greedy continuations through the KV cache (`Transformer.generate`: one prefill per prompt, prompts of
one grid cell batched, all of the same token length), scored by the first number in the decoded continuation.
Filler, keys and values come from a seeded generator (nothing is downloaded); prompts are built from separately
encoded text pieces, so any tokenizer works.

Notation: B prompts or windows per batch, T tokens per window or prompt, V vocabulary.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import re
from contextlib import AbstractContextManager
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from tqdm import tqdm

from config import ComputeConfig
from data import TokenLoader, validation_dir
from model import Transformer
from synthetic import PromptBuilder
from tokenizer import Tokenizer
from weights import load_model

TASKS = ("loss", "passkey", "needle")
LOSS_CHUNK = 512  # positions whose logits exist at a time when scoring windows


# ---- loss by position -------------------------------------------------------------------------------------------


def loss_by_position(model: Transformer, windows: torch.Tensor, batch_size: int = 4) -> dict:
    """Next-token loss of `windows` (N, T) by position: {"loss", "perplexity", "tokens", "positions" (T - 1 per-
    position means), "buckets" [{"start", "end", "loss"}] (log-spaced: [1, 2), [2, 4), ...)}. Position p is the
    prediction of token p + 1 from tokens 0..p; logits exist for LOSS_CHUNK positions at a time."""
    N, T = windows.shape
    device = model.embed_tokens.weight.device
    sums = torch.zeros(T - 1, dtype=torch.float64)
    with torch.no_grad():
        for b0 in range(0, N, batch_size):
            ids = windows[b0:b0 + batch_size].to(device)  # (B, T)
            hidden = model.hidden_states(ids)  # (B, T, C)
            for p0 in range(0, T - 1, LOSS_CHUNK):
                p1 = min(p0 + LOSS_CHUNK, T - 1)
                logits = model.logits(hidden[:, p0:p1])  # (B, P, V)
                logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
                loss = F.cross_entropy(logits.flatten(0, 1), ids[:, p0 + 1:p1 + 1].flatten(), reduction="none")
                sums[p0:p1] += loss.view(ids.shape[0], -1).sum(0).double().cpu()
    per_position = sums / N  # (T - 1,)
    edges = [2**i for i in range(int(math.log2(T - 1)) + 1)] + [T]  # 1, 2, 4, ..., T
    buckets = [{"start": a - 1, "end": min(b, T) - 1, "loss": per_position[a - 1:min(b, T) - 1].mean().item()}
               for a, b in zip(edges, edges[1:], strict=False) if a < T]
    mean = per_position.mean().item()
    return {"loss": mean, "perplexity": math.exp(mean), "tokens": N * (T - 1), "positions": per_position.tolist(),
            "buckets": buckets}


def validation_windows(data_dir: str | Path, seq_len: int, max_tokens: int, seed: int = 0, rank: int = 0,
                       world_size: int = 1) -> torch.Tensor:
    """This rank's share (N, T) of about `max_tokens` tokens of whole windows of seq_len tokens of `data_dir`'s
    held-out split, in the loader's seeded order: the same windows every call, as many on every rank (collectives
    under FSDP stay in step), at least one."""
    loader = TokenLoader(validation_dir(data_dir), seq_len, 1, seed=seed)
    per_rank = min(max(1, max_tokens // seq_len // world_size), loader.num_windows // world_size)
    if per_rank == 0:
        raise ValueError(f"the validation split of {data_dir} holds {loader.num_windows} windows of {seq_len} "
                         "tokens, fewer than one per rank; use shorter windows or prepare the data with a larger "
                         "--validation_fraction")
    windows = torch.cat([next(loader)[0] for _ in range(per_rank * world_size)])  # (N * W, T)
    return windows[rank::world_size]


def validation_loss(model: Transformer, windows: torch.Tensor, autocast: AbstractContextManager) -> float:
    """Mean next-token loss over every rank's validation windows (N, T), through the model's own loss path (chunked
    at long T). Reads neither the torch RNG nor a training loader, so evaluating during training changes nothing."""
    device = model.embed_tokens.weight.device
    total = torch.zeros((), device=device)
    with torch.no_grad(), autocast:
        for row in windows.to(device):
            total += model(row[None], row[None]).loss.float()  # each window's mean token loss
    stats = torch.stack([total, torch.tensor(float(len(windows)), device=device)])
    if dist.is_initialized():
        dist.all_reduce(stats)
    return (stats[0] / stats[1]).item()


# ---- retrieval prompts ------------------------------------------------------------------------------------------


def first_number(text: str) -> str | None:
    """The first run of digits in `text`, or None."""
    match = re.search(r"\d+", text)
    return match.group() if match else None


def is_correct(continuation: str, answer: str) -> bool:
    """Whether the model's continuation answers `answer`: its first number is exactly the answer."""
    return first_number(continuation) == answer


def retrieval_grid(model: Transformer, builder: PromptBuilder, task: str, lengths: list[int], depths: list[float],
                   samples: int, seed: int, batch_size: int, bar: tqdm | None = None) -> dict:
    """Accuracy of `task` ("passkey" | "needle") at every (length, depth): {"lengths", "depths", "samples",
    "accuracy": [[per depth] per length], "examples": one decoded continuation per cell}."""
    device = model.embed_tokens.weight.device
    make = builder.passkey if task == "passkey" else builder.needle
    accuracy, examples = [], []
    for length in lengths:
        row = []
        for d, depth in enumerate(depths):
            rng = random.Random(f"{seed}-{task}-{length}-{d}")
            prompts = [make(length, depth, rng) for _ in range(samples)]
            n_new = len(builder.tokenizer.encode(" " + prompts[0].answer)) + 2
            if length + n_new > model.config.context_length:
                raise ValueError(f"--lengths {length} + {n_new} answer tokens exceed the model's context_length "
                                 f"{model.config.context_length}")
            correct = 0
            for b0 in range(0, samples, batch_size):
                batch = prompts[b0:b0 + batch_size]
                ids = torch.tensor([p.ids for p in batch], device=device)  # (B, T)
                out = model.generate(ids, n_new, temperature=0)  # (B, T + n_new): one prefill, then the cache
                texts = [builder.tokenizer.decode(row_ids) for row_ids in out[:, length:].tolist()]
                correct += sum(is_correct(t, p.answer) for t, p in zip(texts, batch, strict=True))
                if b0 == 0:
                    examples.append({"length": length, "depth": depth, "answer": batch[0].answer,
                                     "continuation": texts[0]})
                if bar is not None:
                    bar.update(len(batch))
            row.append(correct / samples)
        accuracy.append(row)
    return {"lengths": lengths, "depths": depths, "samples": samples, "accuracy": accuracy, "examples": examples}


# ---- reporting ----------------------------------------------------------------------------------------------------


def format_loss(result: dict) -> str:
    lines = [f"validation loss {result['loss']:.4f} (perplexity {result['perplexity']:.2f}) over {result['tokens']:,} "
             f"predicted tokens", f"{'positions':>17} {'mean loss':>10}"]
    lines += [f"{b['start']:>8}-{b['end'] - 1:<8} {b['loss']:>10.4f}" for b in result["buckets"]]
    return "\n".join(lines)


def format_grid(name: str, result: dict) -> str:
    lines = [f"{name} accuracy, {result['samples']} prompts per cell",
             f"{'length / depth':>15}" + "".join(f"{d:>7.2f}" for d in result["depths"])]
    lines += [f"{length:>15}" + "".join(f"{a:>7.0%}" for a in accs)
              for length, accs in zip(result["lengths"], result["accuracy"], strict=True)]
    return "\n".join(lines)


def plot(results: dict, out_dir: Path, title: str) -> list[Path]:
    """loss_by_position.png and one heatmap per retrieval task; [] with a note when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("plots skipped: pip install matplotlib (or the project's `plot` extra)")
        return []
    written = []
    if "loss" in results:
        fig, ax = plt.subplots(figsize=(6, 4))
        buckets = results["loss"]["buckets"]
        ax.plot([max(1, b["start"]) for b in buckets], [b["loss"] for b in buckets], marker="o")
        ax.set(xscale="log", xlabel="token position", ylabel="mean validation loss", title=title)
        written.append(out_dir / "loss_by_position.png")
        fig.tight_layout()
        fig.savefig(written[-1])
        plt.close(fig)
    for task in ("passkey", "needle"):
        if task not in results:
            continue
        grid = results[task]
        fig, ax = plt.subplots(figsize=(1.2 * len(grid["depths"]) + 2, 0.6 * len(grid["lengths"]) + 2))
        image = ax.imshow(np.array(grid["accuracy"]), vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
        ax.set_xticks(range(len(grid["depths"])), [f"{d:.0%}" for d in grid["depths"]])
        ax.set_yticks(range(len(grid["lengths"])), [str(n) for n in grid["lengths"]])
        ax.set(xlabel="needle depth", ylabel="prompt length (tokens)", title=f"{task}: {title}")
        for i, row in enumerate(grid["accuracy"]):
            for j, value in enumerate(row):
                ax.text(j, i, f"{value:.0%}", ha="center", va="center", fontsize=8)
        fig.colorbar(image, ax=ax, label="accuracy")
        written.append(out_dir / f"{task}.png")
        fig.tight_layout()
        fig.savefig(written[-1])
        plt.close(fig)
    return written


# ---- command line -------------------------------------------------------------------------------------------------


def _run_config(checkpoint: Path) -> dict:
    """train.py's config.json of the run a checkpoint belongs to (step-N/ or model/ inside OUT_DIR), or {}."""
    for candidate in (checkpoint.parent / "config.json", checkpoint.parent.parent / "config.json"):
        if candidate.is_file():
            values = json.loads(candidate.read_text())
            if isinstance(values, dict) and "train" in values:
                return values["train"]
    return {}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint", help="a step-N directory, a run's model/ export (or its model.safetensors), or a "
                                      "Hugging Face directory")
    p.add_argument("--tasks", nargs="+", choices=TASKS, default=list(TASKS))
    p.add_argument("--tokenizer", help="SentencePiece .model (default: the run's, or DATA_DIR/tokenizer.model)")
    p.add_argument("--data_dir", help="prepared data with a validation split (default: the run's)")
    p.add_argument("--context_length", type=int, help="tokens per loss window (default: the run's, else 1024)")
    p.add_argument("--eval_tokens", type=int, default=65536, help="validation tokens scored by the loss task")
    p.add_argument("--lengths", type=int, nargs="+", help="prompt lengths in tokens (default: 4 up to the context)")
    p.add_argument("--depths", type=float, nargs="+", default=[0.0, 0.25, 0.5, 0.75, 1.0])
    p.add_argument("--samples", type=int, default=10, help="prompts per grid cell")
    p.add_argument("--batch_size", type=int, default=10, help="prompts (or loss windows) per forward")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out_dir", help="where eval.json and the plots go (default: CHECKPOINT's directory /eval)")
    return p


def main(argv: list[str] | None = None) -> dict:
    parser = build_parser()
    args = parser.parse_args(argv)
    checkpoint = Path(args.checkpoint)
    run = _run_config(checkpoint)
    data_dir = args.data_dir or run.get("data_dir")
    tokenizer_file = args.tokenizer or run.get("tokenizer") or (data_dir and Path(data_dir) / "tokenizer.model")
    if not tokenizer_file or not Path(tokenizer_file).is_file():
        parser.error(f"no tokenizer found for {checkpoint}: pass --tokenizer FILE.model (or --data_dir)")
    if "loss" in args.tasks and not data_dir:
        parser.error("the loss task needs --data_dir (prepared data with a validation split)")
    if not 0 <= min(args.depths) <= max(args.depths) <= 1 or args.samples < 1 or args.batch_size < 1:
        parser.error("--depths must lie in [0, 1]; --samples and --batch_size must be >= 1")
    model = load_model(checkpoint, device=args.device, compute=ComputeConfig()).eval()
    tokenizer = Tokenizer(tokenizer_file)
    if tokenizer.vocab_size > model.config.vocab_size:
        parser.error(f"tokenizer {tokenizer_file} has {tokenizer.vocab_size} tokens, more than the model's "
                     f"vocab_size {model.config.vocab_size}: they do not belong together")
    context = min(args.context_length or run.get("context_length") or 1024, model.config.context_length)
    lengths = args.lengths or sorted({max(64, context // 8), context // 4, context // 2, context - 16})
    home = checkpoint if checkpoint.is_dir() else checkpoint.parent
    out_dir = Path(args.out_dir) if args.out_dir else home / "eval"
    out_dir.mkdir(parents=True, exist_ok=True)
    title = f"{checkpoint} ({model.config.attention_type} attention)"

    results: dict = {"checkpoint": str(checkpoint), "attention_type": model.config.attention_type}
    if "loss" in args.tasks:
        windows = validation_windows(data_dir, context, args.eval_tokens, args.seed)
        results["loss"] = loss_by_position(model, windows, args.batch_size)
        print(format_loss(results["loss"]))
    builder = PromptBuilder(tokenizer)
    grids = [t for t in ("passkey", "needle") if t in args.tasks]
    with tqdm(total=len(grids) * len(lengths) * len(args.depths) * args.samples, desc="retrieval", unit="prompt",
              disable=not grids) as bar:
        for task in grids:
            results[task] = retrieval_grid(model, builder, task, lengths, args.depths, args.samples, args.seed,
                                           args.batch_size, bar)
    for task in grids:
        print(format_grid(task, results[task]))
    results["plots"] = [str(p) for p in plot(results, out_dir, title)]
    (out_dir / "eval.json").write_text(json.dumps(results, indent=1))
    print(f"wrote {out_dir / 'eval.json'}" + "".join(f", {p}" for p in results["plots"]))
    return results


if __name__ == "__main__":
    main()
