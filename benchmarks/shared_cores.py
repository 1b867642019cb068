"""Two trainings started together on one machine: each one's tokens/s against one run alone, with the CPU thread
plan (`training.monitor.ThreadPlan`, the default: threads follow the cores other processes leave) and with the
threads fixed at the core count (OMP_NUM_THREADS set, which turns the plan off).

    python benchmarks/shared_cores.py                                   # NSA, demo model, T = 256
    python benchmarks/shared_cores.py --attention_type full --seconds 60

Each run is train.py on the default corpus for --seconds, in a fresh process; a run's speed is
its tokens over the steps it finished after its first 15 s (the plan measures every 10 s), from metrics.jsonl.
Prints a table: the setting, each run's tokens/s, and their share of the single run's.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def start(out_dir: Path, args: argparse.Namespace, fixed: bool) -> subprocess.Popen:
    env = {**os.environ, **({"OMP_NUM_THREADS": str(os.cpu_count())} if fixed else {})}
    if not fixed:
        env.pop("OMP_NUM_THREADS", None)
    command = [sys.executable, str(ROOT / "train.py"), "--model_size", "demo", "--attention_type",
               args.attention_type, "--context_length", str(args.context_length), "--batch_size", str(args.batch_size),
               "--max_steps", "100000", "--checkpoint_interval", "0", "--sample_tokens", "0", "--log_interval", "1000",
               "--out_dir", str(out_dir)]
    return subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def speed(out_dir: Path, skip: float) -> float:
    """Tokens/s over the steps logged after `skip` seconds of the run."""
    steps = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [s for s in steps if "tokens_per_s" in s and s["elapsed_s"] > skip]
    tokens = sum(s["tokens_per_s"] * s["step_time_s"] for s in steps)
    return tokens / sum(s["step_time_s"] for s in steps) if steps else float("nan")


def run_together(count: int, args: argparse.Namespace, fixed: bool, root: Path) -> list[float]:
    dirs = [root / f"run{i}" for i in range(count)]
    for d in dirs:
        shutil.rmtree(d, ignore_errors=True)
    processes = [start(d, args, fixed) for d in dirs]
    time.sleep(args.seconds)
    for p in processes:
        p.terminate()  # train.py finishes the step and saves
    for p in processes:
        p.wait()
    return [speed(d, 15.0) for d in dirs]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--attention_type", default="nsa", choices=["full", "nsa"])
    p.add_argument("--context_length", type=int, default=256)
    p.add_argument("--batch_size", type=int, default=8)
    p.add_argument("--seconds", type=float, default=75.0, help="how long each setting runs (model building included)")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        alone = run_together(1, args, fixed=False, root=root)[0]
        rows = [("one run alone (plan)", [alone])]
        rows.append(("two together, threads fixed at the cores", run_together(2, args, fixed=True, root=root)))
        rows.append(("two together, thread plan (default)", run_together(2, args, fixed=False, root=root)))
    print(f"\n{args.attention_type}, demo model, T = {args.context_length}, batch {args.batch_size}, "
          f"{os.cpu_count()} cores\n")
    print("| setting | tokens/s of each run | share of one run alone |")
    print("|---|---|---|")
    for name, speeds in rows:
        print(f"| {name} | {', '.join(f'{s:,.0f}' for s in speeds)} | "
              f"{', '.join(f'{s / alone:.0%}' for s in speeds)} |")


if __name__ == "__main__":
    main()
