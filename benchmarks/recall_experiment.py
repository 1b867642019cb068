"""Does an attention type retrieve across its context? Dense associative recall (MQAR, synthetic.py) learned by the
demo model with full attention, with a sliding window (the control: blind beyond what its stacked windows reach)
and with NSA, on the same documents, then scored by key-query distance (eval.py --tasks mqar).

    python benchmarks/recall_experiment.py --out_dir runs/recall                  # the stages and types below
    python benchmarks/recall_experiment.py --types full --stages 64:1200 512:600 --seeds 0 1 2
    python benchmarks/recall_experiment.py --stages 64:20000 512:10000 --batch_tokens 16384 --seeds 0 1 2 --jobs 9
    python benchmarks/recall_experiment.py --stages 64:2000:2 64:1500:4 512:1500:4 --jobs 3 \\
        --model_overrides '{"qk_norm": false}' --out_dir runs/recall_pairs        # 4 keys to tell apart, not 85

Training is a short-to-long curriculum, each stage starting from the previous stage's export: every row an MQAR
document (--synthetic_mix 1.0), the loss on the answers only (--answer_loss), the demo preset's default learning
rate. After each stage the model is scored on fresh documents of the stage's length. Types:
- full: SDPA, every key visible;
- swa: the test-only sliding-window type (tests/sliding_window_attention.py) with a window of 64 keys: the control.
  One layer sees 64 tokens back; the demo's 4 layers can pass a value on through intermediate tokens up to
  4 x 63 = 252 back, so beyond 252 tokens it cannot retrieve at all;
- nsa: compression blocks l = 32 (stride 16), selection blocks l' = 32, n = 6 selected blocks (block 0 and the two
  most recent among them, so 3 free slots), window w = 64: at T = 2048 a query visits on average 64 compressed +
  192 selected + 64 window keys = 320, under a third of full attention's 1024.
A stage LENGTH:STEPS:PAIRS puts PAIRS key-value pairs in each document (default: a third of its 2-token slots, 85
at T = 512): the number of keys a query must tell apart, the task's difficulty (the last command: 2 pairs, then 4).
The third command is for a GPU: --jobs 9 trains the 9 runs (3 types x 3 seeds) side by side, a process each; a model
this small leaves a GPU mostly idle, so more processes run more steps in total (one H200 at T = 512: 3 processes
made 71 steps/s together, 7 made 117). Prints a table, writes OUT_DIR/summary.json and
OUT_DIR/recall_by_distance.png; each stage's run and eval.py results are in OUT_DIR/<type>-seed<s>/T<length>/
(T<length>-p<pairs>/ with a pair count).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))  # the sliding-window control lives with the tests
import eval as evaluation  # noqa: E402
import train  # noqa: E402
from config import register_attention  # noqa: E402

Stage = tuple[int, int, int | None]  # (length, steps, key-value pairs a document or None: the default density)


def parse_stage(text: str) -> Stage:
    """"LENGTH:STEPS" or "LENGTH:STEPS:PAIRS" (positive integers) -> (length, steps, pairs or None)."""
    try:
        parts = [int(x) for x in text.split(":")]
    except ValueError:
        parts = []
    if len(parts) not in (2, 3) or min(parts) < 1:
        raise argparse.ArgumentTypeError(f"a stage is LENGTH:STEPS or LENGTH:STEPS:PAIRS of positive integers, "
                                         f"got {text!r}")
    return parts[0], parts[1], parts[2] if len(parts) == 3 else None


def stage_name(stage: Stage) -> str:
    """The stage's run directory: T<length>, or T<length>-p<pairs> with a pair count."""
    length, _, pairs = stage
    return f"T{length}" + (f"-p{pairs}" if pairs else "")


TYPES = {
    "full": {"attention_type": "full", "model_overrides": {}},
    "swa": {"attention_type": "swa", "model_overrides": {"attention_options": {"window": 64}}},
    "nsa": {"attention_type": "nsa", "model_overrides": {
        "nsa_block_size": 32, "nsa_stride": 16, "nsa_select_block_size": 32, "nsa_num_selected": 6,
        "nsa_window": 64}},
}


def stage_run(kind: str, seed: int, stage: Stage, previous: Path | None, out: Path,
              data_dir: str, overrides: dict, lr: float, batch_tokens: int) -> tuple[Path, float]:
    """Train one stage (skipped when its export exists); returns (its run directory, seconds). `overrides`: model
    fields set on top of the type's own (first stage only; later stages inherit the architecture)."""
    length, steps, pairs = stage
    run_dir = out / f"{kind}-seed{seed}" / stage_name(stage)
    if (run_dir / "model" / "model.safetensors").is_file():
        return run_dir, json.loads((run_dir / "stage.json").read_text())["seconds"]
    args = ["--context_length", str(length), "--max_steps", str(steps), "--synthetic_mix", "1.0",
            "--synthetic_task", "mqar", "--answer_loss", "--lr", str(lr), "--warmup_steps", str(min(30, steps // 10)),
            "--batch_size", str(max(1, batch_tokens // length)), "--checkpoint_interval", "0", "--sample_tokens", "0",
            "--log_interval", "50", "--seed", str(seed),
            "--data_dir", data_dir, "--out_dir", str(run_dir)]
    args += ["--synthetic_pairs", str(pairs)] if pairs else []
    if previous is None:
        spec = TYPES[kind]
        args += ["--model_size", "demo", "--attention_type", spec["attention_type"], "--model_overrides",
                 json.dumps({**spec["model_overrides"], **overrides})]
    else:
        args += ["--init_from", str(previous / "model")]
    start = time.perf_counter()
    train.main(args)
    seconds = time.perf_counter() - start
    (run_dir / "stage.json").write_text(json.dumps({"seconds": seconds, "args": args}))
    return run_dir, seconds


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out_dir", default="runs/recall")
    p.add_argument("--data_dir", default="data/stdlib", help="any prepared data (its rows are all replaced)")
    p.add_argument("--types", nargs="+", choices=list(TYPES), default=list(TYPES))
    p.add_argument("--stages", nargs="+", type=parse_stage,
                   default=[parse_stage(stage) for stage in ("64:1200", "512:600", "2048:300")],
                   help="LENGTH:STEPS[:PAIRS] of each curriculum stage (PAIRS: key-value pairs a document, default "
                        "a third of its 2-token slots)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    p.add_argument("--samples", type=int, default=32, help="documents scored per stage")
    p.add_argument("--model_overrides", type=json.loads, default={}, metavar="JSON",
                   help='model fields for every type, e.g. \'{"qk_norm": false}\'')
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate of every stage")
    p.add_argument("--batch_tokens", type=int, default=4096, help="tokens per step (documents: this // length)")
    p.add_argument("--jobs", type=int, default=1,
                   help="runs (type x seed) trained at once, each in its own process (a GPU runs several small "
                        "models faster side by side than one after another)")
    args = p.parse_args(argv)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("PYTHONHASHSEED", "0")
    runs = [(kind, seed) for kind in args.types for seed in args.seeds]
    if args.jobs == 1:
        summary = {f"{kind}-seed{seed}": curriculum(kind, seed, args.stages, out, args) for kind, seed in runs}
    else:  # one process per run, its output in OUT_DIR/<type>-seed<s>.log
        with ProcessPoolExecutor(args.jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
            futures = {f"{kind}-seed{seed}": pool.submit(curriculum, kind, seed, args.stages, out, args, True)
                       for kind, seed in runs}
            summary = {name: future.result() for name, future in futures.items()}
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    report(summary, out)


def curriculum(kind: str, seed: int, stages: list[Stage], out: Path, args: argparse.Namespace,
               own_process: bool = False) -> list[dict]:
    """Train and score one type and seed through the stages; returns a row per stage. In a process of its own
    (--jobs > 1) the output goes to OUT_DIR/<type>-seed<s>.log and the process takes its share of the CPU threads."""
    if own_process:
        log = os.open(out / f"{kind}-seed{seed}.log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // args.jobs))
    register_attention("swa", "sliding_window_attention:SlidingWindowAttention")
    previous, rows = None, []
    for stage in stages:
        length, steps, pairs = stage
        run_dir, seconds = stage_run(kind, seed, stage, previous, out, args.data_dir,
                                     args.model_overrides, args.lr, args.batch_tokens)
        results = evaluation.main([str(run_dir / "model"), "--tasks", "mqar", "--lengths", str(length),
                                   "--samples", str(args.samples), "--batch_size", "2", "--seed", "1000",
                                   *(["--pairs", str(pairs)] if pairs else [])])
        metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        rows.append({"length": length, "steps": steps, "pairs": pairs, "seconds": seconds, "mqar": results["mqar"],
                     "loss_curve": [(m["step"], m["loss"]) for m in metrics if "loss" in m]})
        previous = run_dir
    return rows


def report(summary: dict, out: Path) -> None:
    """The table (accuracy overall, within 64 tokens and beyond, per stage) and the plot of the last stages."""
    print("\n| run | T | pairs | steps | minutes | accuracy | within 64 tokens | beyond 64 tokens | final loss |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, rows in summary.items():
        for row in rows:
            buckets = row["mqar"]["buckets"]
            near = [b for b in buckets if b["end"] <= 64]
            far = [b for b in buckets if b["start"] >= 64]

            def mean(group: list[dict]) -> str:
                n = sum(b["count"] for b in group)
                return f"{sum(b['accuracy'] * b['count'] for b in group) / n:.1%}" if n else "-"

            print(f"| {name} | {row['length']} | {row.get('pairs') or 'T/6'} | {row['steps']} | "
                  f"{row['seconds'] / 60:.1f} | "
                  f"{row['mqar']['accuracy']:.1%} | {mean(near)} | {mean(far)} | {row['loss_curve'][-1][1]:.3f} |")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    panels = sorted({(row["length"], row.get("pairs") or 0) for rows in summary.values() for row in rows})
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), squeeze=False)
    for ax, (length, pairs) in zip(axes[0], panels, strict=True):
        for name, rows in summary.items():
            for row in rows:
                if (row["length"], row.get("pairs") or 0) == (length, pairs):
                    evaluation.plot_recall(ax, row["mqar"], label=name)
        ax.set_title(f"MQAR, T = {length}" + (f", {pairs} pairs" if pairs else ""))
        ax.axvline(64, color="grey", linestyle=":", linewidth=1)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "recall_by_distance.png")
    plt.close(fig)
    print(f"wrote {out / 'summary.json'} and {out / 'recall_by_distance.png'}")


if __name__ == "__main__":
    main()
