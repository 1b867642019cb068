"""The passkey beyond NSA's window over seeds and lengths, as one script: benchmarks/results/recall.md's recipe ("The
passkey with the loss": a copying model, the passkey at 256 tokens with the selection-scoring loss, then the passkey
at each length) for NSA with a training form's options and for full attention, then eval.py's passkey grid. Prints
a row per (type, length, seed): the passkey read beyond the window (depths 0-0.75: the needle more than a window
before the question), at the question's end (depth 1), at 256 tokens, the stage's answer loss (the mean over its
last 50 steps of the loss less the score loss), and for NSA the passkey beyond the window with each block judged by
its best key (benchmarks/nsa_branch_ablation.py: the ceiling of its selection); writes OUT_DIR/grid.json.

    python benchmarks/passkey_grid.py --dry_run                              # the commands, nothing run
    python benchmarks/passkey_grid.py --lengths 4096 8192 --seeds 0 1 2 3 4  # on one H200: minutes a run
    python benchmarks/passkey_grid.py --lengths 4096 --form --nsa_score_loss_coef 0.1   # another form: the dense
                                                                                        # target alone, at lr 3e-3
    python benchmarks/passkey_grid.py --lengths 4096 --steps 400 --batch_size 2 --types nsa  # on 2 CPU cores:
                                                                            # 8k tokens a step, as at 1024 tokens

The NSA model is recall_experiment.py's best-reading variant (one K/V set, mean compressor, blocks of 8, 18 selected;
copying learned with blocks of 32); `--form` passes its options to NSA's long stages (default: the recommended form
of docs/nsa.md, configs/nsa-retrieval.json's: the score loss at 0.1 on candidate blocks of every 8th query, with
exact selection for the first 200 steps, at lr 1e-3). A stage whose run directory holds a finished run (its model
export) is reused, so an interrupted grid continues. Long stages run 400 steps of 8 sequences (`--steps`,
`--batch_size`) at lr 3e-3, or the form's (1e-3 by default).
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from training.cli import check_writable  # noqa: E402
from training.options import parse_config  # noqa: E402
from training.resume import same_value, upgraded_record  # noqa: E402

BLOCKS = {"nsa_block_size": 8, "nsa_stride": 8, "nsa_select_block_size": 8, "nsa_num_selected": 18}
NSA = {"qk_norm": False, "nsa_separate_kv": False, "nsa_compressor": "mean", **BLOCKS}
COPY = {"nsa_block_size": 32, "nsa_stride": 16, "nsa_select_block_size": 32, "nsa_num_selected": 6}
MODEL = Path("model") / "config.json"  # a finished run's export
FORM = ["--nsa_score_loss_coef", "0.1", "--nsa_score_loss_stride", "8", "--nsa_score_loss_top", "24",  # docs/nsa.md's
        "--nsa_score_loss_random", "8", "--nsa_exact_selection_steps", "200", "--lr", "1e-3"]
PROMPT_SEED = 1000  # the prompts scored: a seed no training run draws (their seeds are the grid's, below 1000)
PASSKEY = ["--synthetic_mix", "1.0", "--synthetic_task", "passkey", "--answer_loss", "--checkpoint_interval", "0",
           "--sample_tokens", "0", "--lr", "3e-3"]


def plan(args: argparse.Namespace) -> list[tuple[Path, list[str]]]:
    """(the file whose presence marks the step done, command) of every step, in order."""
    out, py = Path(args.out_dir), sys.executable
    steps = []
    for kind in args.types:
        overrides = dict(NSA) if kind == "nsa" else {"qk_norm": False}
        form = args.form if kind == "nsa" else []
        for seed in args.seeds:  # every stage with the run's seed: no result rests on one shared early model
            base = out / "base"
            copied = base / f"{kind}-seed{seed}" / "copy-T64" / "model"
            steps.append((copied / "config.json", [
                py, "benchmarks/recall_experiment.py", "--types", kind, "--seeds", str(seed), "--stages",
                "copy:64:1000", "--samples", "64", "--out_dir", str(base), "--model_overrides", json.dumps(overrides),
                *(["--copy_overrides", json.dumps(COPY)] if kind == "nsa" else [])]))
            short = out / f"{kind}-passkey256-seed{seed}"
            steps.append((short / MODEL, [
                py, "train.py", "--init_from", str(copied), "--context_length", "256", "--max_steps", "600",
                "--batch_size", "32", *PASSKEY, "--seed", str(seed), "--out_dir", str(short),
                *(["--nsa_score_loss_coef", "0.1", "--model_overrides", json.dumps(BLOCKS)] if kind == "nsa" else [])]))
            for T in args.lengths:
                run = out / f"{kind}-T{T}-seed{seed}"
                steps.append((run / MODEL, [
                    py, "train.py", "--init_from", str(short / "model"), "--context_length", str(T), "--max_steps",
                    str(args.steps), "--batch_size", str(args.batch_size), "--warmup_steps", "20", *PASSKEY, "--seed",
                    str(seed), "--out_dir", str(run), *form]))
                steps.append((run / "eval-model" / "eval.json", [
                    py, "eval.py", str(run / "model"), "--tasks", "passkey", "--lengths", "256", str(T - 10),
                    "--samples", str(args.samples), "--seed", str(PROMPT_SEED)]))
                if kind == "nsa":  # the same passkey with each block judged by its best key: the ceiling
                    steps.append((run / "eval-model" / "ablation.json", [
                        py, "benchmarks/nsa_branch_ablation.py", str(run / "model"), "--task", "passkey", "--length",
                        str(T - 10), "--samples", str(args.samples), "--seed", str(PROMPT_SEED), "--json",
                        str(run / "eval-model" / "ablation.json")]))
    return steps


def answer_loss(run: Path, last: int = 50) -> float:
    """The mean over a run's last `last` steps of its loss less the score loss (metrics.jsonl)."""
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "loss" in r and "grad_norm" in r][-last:]
    return statistics.mean(r["loss"] - r.get("aux_loss", 0.0) for r in steps)


def row(kind: str, T: int, seed: int, run: Path) -> dict:
    """One line of the grid from a run's eval.json, metrics.jsonl and (NSA) eval-model/ablation.json: its passkey
    with exact block scores beyond the window, the ceiling of what its selection could read (None for full
    attention)."""
    passkey = json.loads((run / "eval-model" / "eval.json").read_text())["passkey"]
    short, long = passkey["accuracy"]  # (depths,) at 256 and at T - 10
    exact, ablation = None, run / "eval-model" / "ablation.json"
    if ablation.is_file():  # accuracy (lengths, depths) of the variant
        exact = statistics.mean(json.loads(ablation.read_text())["exact block scores"]["accuracy"][0][:-1])
    return {"type": kind, "T": T, "seed": seed, "beyond_window": statistics.mean(long[:-1]), "at_end": long[-1],
            "at_256": statistics.mean(short), "answer_loss": answer_loss(run), "exact_beyond_window": exact}


def changed(run: Path, argv: list[str]) -> str | None:
    """The first option of the train.py command line `argv` that the finished `run` recorded with another value, as
    "--name RECORDED, not GIVEN", or None."""
    recorded = upgraded_record(json.loads((run / "config.json").read_text())["train"])  # in today's names
    given = parse_config(argv)
    for word in argv:
        name = word.removeprefix("--")
        if word.startswith("--") and name != "out_dir":
            value, was = getattr(given, name), recorded.get(name)
            if not same_value(name, value, was):
                return f"--{name} {was}, not {value}"
    return None


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out_dir", default="runs/passkey_grid")
    p.add_argument("--types", nargs="+", choices=("nsa", "full"), default=["nsa", "full"])
    p.add_argument("--lengths", type=int, nargs="+", default=[4096])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    p.add_argument("--steps", type=int, default=400, help="steps of each long stage")
    p.add_argument("--batch_size", type=int, default=8, help="sequences a step of each long stage")
    p.add_argument("--samples", type=int, default=10, help="prompts a cell of the passkey grid")
    p.add_argument("--dry_run", action="store_true", help="print the commands, run nothing")
    p.add_argument("--form", nargs=argparse.REMAINDER, default=None,
                   help="train.py options of NSA's stages after copying, to the end of the line (default: "
                        f"{shlex.join(FORM)})")
    args = p.parse_args(argv)
    if min(args.lengths) <= 256 or min(args.steps, args.batch_size, args.samples) < 1:
        p.error("--lengths must be above 256 (the short passkey stage); --steps, --batch_size, --samples positive")
    if not all(0 <= seed < PROMPT_SEED for seed in args.seeds):
        p.error(f"--seeds must lie in [0, {PROMPT_SEED}): seed {PROMPT_SEED} draws the prompts every run is scored on")
    if args.form is not None and "nsa" not in args.types:
        p.error("--form applies to NSA's stages: add nsa to --types, or leave --form out")
    own = {name for action in p._actions for name in action.option_strings}
    if swallowed := [word for word in args.form or [] if word.split("=")[0] in own]:
        p.error(f"--form takes train.py's options to the end of the line, and {swallowed[0]} is this script's: put "
                "--form last")
    args.form = FORM if args.form is None else args.form
    if not args.dry_run:
        try:
            check_writable(Path(args.out_dir), "--out_dir", directory=True)
        except ValueError as e:
            p.error(str(e))
    steps = plan(args)
    for marker, command in steps:
        if marker.is_file() and command[1] == "train.py" and (stale := changed(marker.parent.parent, command[2:])):
            p.error(f"{marker.parent.parent} was trained with {stale}: pass another --out_dir, or remove that run")
    for marker, command in steps:
        if args.dry_run or marker.is_file():
            print(("would run: " if args.dry_run else "done: ") + shlex.join(command), flush=True)
            continue
        print("running: " + shlex.join(command), flush=True)
        subprocess.run(command, cwd=ROOT, check=True)
    if args.dry_run:
        return []
    rows = [row(kind, T, seed, Path(args.out_dir) / f"{kind}-T{T}-seed{seed}")
            for kind in args.types for T in args.lengths for seed in args.seeds]
    print("| type | T | seed | beyond the window | at the end | 256 tokens | answer loss | beyond, exact scores |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        exact = "-" if r["exact_beyond_window"] is None else f"{r['exact_beyond_window']:.0%}"
        print(f"| {r['type']} | {r['T']} | {r['seed']} | {r['beyond_window']:.0%} | {r['at_end']:.0%} | "
              f"{r['at_256']:.0%} | {r['answer_loss']:.2f} | {exact} |")
    (Path(args.out_dir) / "grid.json").write_text(json.dumps(rows, indent=1))
    return rows


if __name__ == "__main__":
    main()
