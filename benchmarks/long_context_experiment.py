"""NSA against full attention on a CPU: the same demo-size model, data, seed and token budget, trained once with each
attention type, then compared on validation loss, loss by position, and the passkey / multi-key needle grids.

    python benchmarks/long_context_experiment.py --out_dir runs/experiment            # the defaults below
    python benchmarks/long_context_experiment.py --context_length 4096 --max_steps 600 --out_dir runs/exp4k

The NSA geometry is scaled to the context so that each query visits at least 4x fewer keys than full attention does
on average: at T = 2048, l = 32, d = 16, l' = 32, n = 4, w = 64 gives 64 compressed + 128 selected + 64 window = 256
keys against full attention's 1024. Training mixes in synthetic retrieval documents (--synthetic_mix) so that a
small model can learn the skill the grids measure. Prints a table and writes OUT_DIR/summary.json and
OUT_DIR/validation_loss.png; each run's eval.py results are in OUT_DIR/<type>/eval-model/.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from training.cli import check_writable, numbered  # noqa: E402


def nsa_geometry(context_length: int) -> dict[str, int]:
    """Paper-shaped NSA blocks scaled so a query visits >= 4x fewer keys than full attention's (T+1)/2."""
    geometry = {"nsa_block_size": 32, "nsa_stride": 16, "nsa_select_block_size": 32, "nsa_num_selected": 4,
                "nsa_window": 64}
    keys = context_length / 2 / 16 + 4 * 32 + 64
    if keys * 4 > (context_length + 1) / 2:
        raise ValueError(f"at T = {context_length} NSA would visit {keys:.0f} keys per query, not 4x fewer than "
                         f"full attention's {(context_length + 1) / 2:.0f}; use T >= 2048")
    return geometry


def run(args: list[str]) -> None:
    print("+", " ".join(args), flush=True)
    subprocess.run([sys.executable, *args], cwd=ROOT, check=True, env={**os.environ, "PYTHONPATH": str(ROOT)})


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out_dir", default="runs/experiment")
    p.add_argument("--data_dir", default="data/stdlib", help="prepared data with a validation split")
    p.add_argument("--context_length", type=int, default=2048)
    p.add_argument("--batch_size", type=int, default=2)
    p.add_argument("--max_steps", type=int, default=300)
    p.add_argument("--synthetic_mix", type=float, default=0.3)
    p.add_argument("--eval_interval", type=int, default=50)
    p.add_argument("--samples", type=int, default=10, help="prompts per grid cell")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    out = Path(args.out_dir)
    try:
        check_writable(out, "--out_dir", directory=True)
    except ValueError as e:
        p.error(str(e))
    T = args.context_length
    lengths = [str(n) for n in (T // 4, T // 2, 3 * T // 4, T - 16)]
    summary = {}
    for attention in ("full", "nsa"):
        run_dir = out / attention
        overrides = nsa_geometry(T) if attention == "nsa" else {}
        if not (run_dir / "model" / "model.safetensors").is_file():
            run(["train.py", "--model_size", "demo", "--attention_type", attention, "--context_length", str(T),
                 "--batch_size", str(args.batch_size), "--max_steps", str(args.max_steps), "--warmup_steps", "20",
                 "--synthetic_mix", str(args.synthetic_mix), "--eval_interval", str(args.eval_interval),
                 "--eval_tokens", str(8 * T), "--checkpoint_interval", "0", "--sample_tokens", "0",
                 "--seed", str(args.seed), "--data_dir", args.data_dir, "--out_dir", str(run_dir),
                 "--model_overrides", json.dumps(overrides)])
        evaluation = next(path for path in numbered(run_dir / "eval-model") if not (path / "eval.json").exists())
        run(["eval.py", str(run_dir / "model"), "--lengths", *lengths, "--samples", str(args.samples),
             "--eval_tokens", str(16 * T), "--batch_size", "5", "--out_dir", str(evaluation)])
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        results = json.loads((evaluation / "eval.json").read_text())
        summary[attention] = {
            "val_curve": [(r["step"], r["val_loss"]) for r in rows if "val_loss" in r],
            "val_loss": results["loss"]["loss"], "buckets": results["loss"]["buckets"],
            "passkey": results["passkey"]["accuracy"], "needle": results["needle"]["accuracy"], "lengths": lengths,
            "seconds_per_step": sorted(r["step_time_s"] for r in rows)[len(rows) // 2],
        }
    full, nsa = summary["full"], summary["nsa"]
    summary["nsa_vs_full_val_loss"] = nsa["val_loss"] / full["val_loss"] - 1
    summary["passkey_at_longest_points"] = 100 * (sum(nsa["passkey"][-1]) - sum(full["passkey"][-1])) / len(
        full["passkey"][-1])
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(f"\n| | full | nsa |\n|---|---|---|\n| validation loss | {full['val_loss']:.4f} | {nsa['val_loss']:.4f} "
          f"({summary['nsa_vs_full_val_loss']:+.1%}) |")
    for task in ("passkey", "needle"):
        for length, a, b in zip(lengths, full[task], nsa[task], strict=True):
            print(f"| {task} accuracy at {length} tokens (mean over depths) | {sum(a) / len(a):.0%} | "
                  f"{sum(b) / len(b):.0%} |")
    print(f"| median step time (s) | {full['seconds_per_step']:.2f} | {nsa['seconds_per_step']:.2f} |")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    for attention in ("full", "nsa"):
        steps, losses = zip(*summary[attention]["val_curve"], strict=True)
        ax.plot(steps, losses, marker="o", label=attention)
    ax.set(xlabel="step", ylabel="validation loss", title=f"demo model, T = {T}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "validation_loss.png")
    print(f"wrote {out / 'summary.json'} and {out / 'validation_loss.png'}")


if __name__ == "__main__":
    main()
