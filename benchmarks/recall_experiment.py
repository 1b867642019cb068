"""Does an attention type retrieve across its context? Dense associative recall (MQAR, synthetic.py) learned by the
demo model with full attention, with a sliding window (the control) and with NSA, on the same documents, then
scored by key-query distance (eval.py --tasks mqar).

    python benchmarks/recall_experiment.py --model_overrides '{"qk_norm": false}' --out_dir runs/recall_copy
    python benchmarks/recall_experiment.py --types full --stages copy:64:1000 64:600 512:600 --out_dir runs/dense \
        --model_overrides '{"qk_norm": false}'                   # MQAR at its default density: 85 pairs at T = 512
    python benchmarks/recall_experiment.py --seeds 0 1 2 --jobs 9 --model_overrides '{"qk_norm": false}' \
        --out_dir runs/gpuc                                      # on a GPU: 9 runs side by side

Training is a curriculum, each stage starting from the previous stage's export, every row a synthetic document
(--synthetic_mix 1.0) with the loss on the answers only (--answer_loss). The default: copying first (copy:64:1000,
a random sequence written twice at a random distance: it teaches a content-based induction head, which MQAR needs
and learns slowly on its own), then MQAR with 4 key-value pairs a document at T = 64, 512 and 2048, the last stage
at a tenth of the learning rate. After each MQAR stage the model is scored on fresh documents of the stage's length.
A stage is LENGTH:STEPS (MQAR, a third of the 2-token slots holding pairs: 85 at T = 512), LENGTH:STEPS:PAIRS (MQAR
with PAIRS pairs, the number of keys a query must tell apart) or copy:LENGTH:STEPS, each optionally with @LR, its
peak learning rate (default --lr). A stage whose directory holds a finished run with the same train.py arguments
(its stage.json) is reused; one with other arguments is an error. Types:
- full: SDPA, every key visible;
- swa: the example sliding-window type (examples/sliding_window_attention.py) with a window of 64 keys: the control.
  After copying it looks keys up directly and is blind beyond 64 tokens; trained on MQAR alone, its 4 layers can
  also pass a value on through intermediate tokens, up to 4 x 63 = 252 back;
- nsa: compression blocks l = 32 (stride 16), selection blocks l' = 32, n = 6 selected blocks (block 0 and the two
  most recent among them, so 3 free slots), window w = 64: over the positions of a 2048-token document a query
  visits 309 keys on average (compressed + selected + window), under a third of full attention's 1024.
  `--model_overrides` changes it (e.g. '{"qk_norm": false, "nsa_num_selected": 12}'; the variant that recalls
  best when it learns to copy (2 of 3 CPU seeds did) averages each block's keys over one key/value set, with
  blocks of 8 and 18 of them selected, 32% of full attention's keys: '{"qk_norm": false, "nsa_separate_kv": false,
  "nsa_compressor": "mean", "nsa_block_size": 8, "nsa_stride": 8, "nsa_select_block_size": 8,
  "nsa_num_selected": 18}'; copying with the default blocks instead, `--copy_overrides '{"nsa_block_size": 32,
  "nsa_stride": 16, "nsa_select_block_size": 32, "nsa_num_selected": 6}'`, copies on every seed but recalls fewer
  far pairs at T = 2048: 74% against 84% beyond 64 tokens on the two seeds that copy with blocks of 8; over three
  seeds 72% against 67%, as one seed does not copy from scratch).
  `--score_loss COEF` adds the selection-scoring loss (nsa/scoring.py), which trains the block scores toward each
  block's best key, to NSA's MQAR stages long enough for top-n to choose (longer than n l'); `--score_loss_stride`,
  `--score_loss_top` and `--score_loss_random` make it cheaper; `--score_loss_temperature TAU` smooths its target;
  `--exact_selection_steps K` selects by exact block scores for a stage's first K steps; `--score_loss_target
  selection` trains the scores toward the set of blocks the best keys select.
--jobs N trains N runs (type x seed) side by side, a process each: a model this small leaves a GPU mostly idle, so
more processes run more steps in total; on 2 CPU cores, --jobs 2 (a thread each) runs 14-16% more steps than one
run at a time on both cores. --control_seeds N trains the control with the first N seeds only: it shows where a
missing path leaves recall, which its seeds agree on within 2 points. Prints a table of every run and one of each
type's mean and spread over the seeds, writes OUT_DIR/summary.json and OUT_DIR/recall_by_distance.png; each
stage's run and eval.py results are in OUT_DIR/<type>-seed<s>/<stage>/ (T<length>, T<length>-p<pairs> or
copy-T<length>).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import multiprocessing
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Literal, NamedTuple

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import eval as eval_cli  # noqa: E402
import train  # noqa: E402
from evaluation.recall import plot_recall  # noqa: E402
from modeling.config import NSA_FIELDS, ModelConfig, register_attention  # noqa: E402
from nsa.blocks import first_choosing_position  # noqa: E402
from storage.checkpoint import checkpoint_to_resume  # noqa: E402
from storage.weights import state_shapes  # noqa: E402
from training.cli import Parser, check_writable, json_object  # noqa: E402
from training.options import MAX_SEED  # noqa: E402
from training.trainer import finished_step  # noqa: E402


class Stage(NamedTuple):
    """One curriculum stage: `steps` steps of `task` documents of `length` tokens (`pairs`: key-value pairs an MQAR
    document holds, None for the default density of a third of its 2-token slots)."""

    task: Literal["mqar", "copy"]
    length: int
    steps: int
    pairs: int | None
    lr: float | None  # peak learning rate; None: --lr


def parse_stage(text: str) -> Stage:
    """"LENGTH:STEPS[:PAIRS]" (an MQAR stage) or "copy:LENGTH:STEPS" (a copying stage) of positive integers, either
    with an optional "@LR" (the stage's peak learning rate, a positive float) -> the Stage; an ArgumentTypeError
    otherwise."""
    task, rest = ("copy", text.removeprefix("copy:")) if text.startswith("copy:") else ("mqar", text)
    rest, at, lr = rest.partition("@")
    try:
        parts = [int(x) for x in rest.split(":")]
        peak = float(lr) if at else None
    except ValueError:
        parts, peak = [], None
    good_lr = not at or (peak is not None and math.isfinite(peak) and peak > 0)
    if len(parts) not in ((2,) if task == "copy" else (2, 3)) or min(parts) < 1 or not good_lr:
        raise argparse.ArgumentTypeError(f"a stage is LENGTH:STEPS, LENGTH:STEPS:PAIRS or copy:LENGTH:STEPS of "
                                         f"positive integers, optionally with @LR (a positive float), got {text!r}")
    return Stage(task, parts[0], parts[1], parts[2] if len(parts) == 3 else None, peak)


def stage_name(stage: Stage) -> str:
    """The stage's run directory: T<length>, T<length>-p<pairs> with a pair count, copy-T<length> for copying."""
    if stage.task == "copy":
        return f"copy-T{stage.length}"
    return f"T{stage.length}" + (f"-p{stage.pairs}" if stage.pairs else "")


TYPES = {
    "full": {"attention_type": "full", "model_overrides": {}},
    "swa": {"attention_type": "swa", "model_overrides": {"attention_options": {"window": 64}}},
    "nsa": {"attention_type": "nsa", "model_overrides": {
        "nsa_block_size": 32, "nsa_stride": 16, "nsa_select_block_size": 32, "nsa_num_selected": 6,
        "nsa_window": 64}},
}


def register_control() -> None:
    """Make the test-only sliding-window control the attention type "swa" (in each process that builds one)."""
    register_attention("swa", "examples.sliding_window_attention:SlidingWindowAttention")


def model_fields(kind: str, stage: Stage, args: argparse.Namespace) -> dict:
    """The model fields a stage trains with: the type's, then --model_overrides; then in a copying stage
    --copy_overrides, in any other the demo preset's value of each field that only --copy_overrides sets."""
    shared = {k: v for k, v in args.model_overrides.items() if kind == "nsa" or k not in NSA_FIELDS}  # NSA's alone
    fields = {**TYPES[kind]["model_overrides"], **shared}
    if stage.task == "copy":
        return {**fields, **args.copy_overrides}
    preset = dataclasses.asdict(ModelConfig.from_preset("demo"))
    return {**fields, **{name: preset[name] for name in args.copy_overrides if name not in fields}}


def override_problem(kind: str, stages: list[Stage], args: argparse.Namespace) -> str | None:
    """Why the type's model cannot be built with its stages' fields (a field the stages or types set themselves
    included), or why a copying stage and an MQAR stage of the curriculum could not pass weights to each other
    (their state-dict shapes differ); None when neither holds."""
    for option, fields in (("--model_overrides", args.model_overrides), ("--copy_overrides", args.copy_overrides)):
        fixed = sorted({"context_length", "attention_type"} & fields.keys())
        if fixed:
            return f"{option} sets {', '.join(fixed)}: the stages set the length and --types the attention"
    shapes = {}
    for task in {stage.task for stage in stages}:
        fields = model_fields(kind, Stage(task, 64, 1, None, None), args)
        try:
            config = ModelConfig.from_preset("demo", attention_type=TYPES[kind]["attention_type"], **fields)
        except (TypeError, ValueError) as error:
            return f"{kind}: {error}"
        shapes[task] = state_shapes(config)
    if len(shapes) < 2:
        return None
    copy, mqar = shapes["copy"], shapes["mqar"]
    changed = sorted(name for name in copy.keys() | mqar.keys() if copy.get(name) != mqar.get(name))
    if changed:
        names = ", ".join(changed[:3]) + (", ..." if len(changed) > 3 else "")
        return (f"{kind}: --copy_overrides changes the weights ({names}), so copying and MQAR stages could not pass "
                f"them on: override only fields that keep them")
    return None


def stage_args(kind: str, seed: int, stage: Stage, previous: tuple[Stage, Path] | None, out: Path,
               args: argparse.Namespace) -> tuple[Path, list[str]]:
    """The stage's run directory and its train.py arguments (`stage.lr` resolved). The first stage builds the
    type's model with `model_fields`; a later one starts from the export of `previous` (its stage and run
    directory) and inherits its architecture, but for the model fields that differ between the two stages."""
    run_dir = out / f"{kind}-seed{seed}" / stage_name(stage)
    argv = ["--context_length", str(stage.length), "--max_steps", str(stage.steps), "--synthetic_mix", "1.0",
            "--synthetic_task", stage.task, "--answer_loss", "--lr", str(stage.lr),
            "--warmup_steps", str(min(30, stage.steps // 10)),
            "--batch_size", str(max(1, args.batch_tokens // stage.length)),
            "--checkpoint_interval", "0", "--sample_tokens", "0", "--log_interval", "50", "--seed", str(seed),
            "--data_dir", args.data_dir, "--out_dir", str(run_dir)]
    argv += ["--synthetic_pairs", str(stage.pairs)] if stage.pairs else []
    fields = model_fields(kind, stage, args)
    # The loss has rows only where top-n chooses (`nsa.blocks.contested_blocks`): a stage too short for that leaves
    # it out, and so shares its arguments (and a reused run) with the same stage trained without the loss.
    first = first_choosing_position(fields.get("nsa_select_block_size", 0), fields.get("nsa_num_selected", 0))
    scored = kind == "nsa" and stage.task == "mqar" and args.score_loss and first is not None and stage.length > first
    score = {"nsa_score_loss_coef": args.score_loss} if scored else {}  # train.py's objective options
    score |= {"nsa_score_loss_stride": args.score_loss_stride} if scored and args.score_loss_stride > 1 else {}
    score |= {"nsa_score_loss_top": args.score_loss_top} if scored and args.score_loss_top else {}
    score |= {"nsa_score_loss_random": args.score_loss_random} if scored and args.score_loss_random else {}
    score |= {"nsa_score_loss_target": args.score_loss_target} if scored and args.score_loss_target != "scores" else {}
    tau = args.score_loss_temperature
    score |= {"nsa_score_loss_temperature": tau} if scored and tau != 1 else {}
    score |= {"nsa_exact_selection_steps": args.exact_selection_steps} if scored and args.exact_selection_steps else {}
    argv += [arg for name, value in score.items() for arg in (f"--{name}", str(value))]
    if previous is None:
        argv += ["--model_size", "demo", "--attention_type", TYPES[kind]["attention_type"], *override_args(fields)]
    else:
        before, before_dir = previous
        argv += ["--init_from", str(before_dir / "model")]
        argv += override_args(fields if fields != model_fields(kind, before, args) else {})
    return run_dir, argv


def override_args(fields: dict) -> list[str]:
    """train.py's arguments for these model fields: RoPE's own options for its fields, --model_overrides for the
    rest."""
    rope = [arg for name in ("rope_theta", "rope_scaling") if name in fields
            for arg in (f"--{name}", json.dumps(fields[name]) if name == "rope_scaling" else str(fields[name]))]
    rest = {name: value for name, value in fields.items() if name not in ("rope_theta", "rope_scaling")}
    return rope + (["--model_overrides", json.dumps(rest)] if rest else [])


def stale_stages(kind: str, seed: int, stages: list[Stage], out: Path, args: argparse.Namespace) -> list[Path]:
    """The finished stages of this run whose recorded train.py arguments differ from what `stages` asks for now."""
    stale, previous = [], None
    for stage in stages:
        run_dir, argv = stage_args(kind, seed, stage, previous, out, args)
        record = run_dir / "stage.json"
        if record.is_file() and json.loads(record.read_text())["args"] != argv:
            stale.append(run_dir)
        previous = stage, run_dir
    return stale


def stage_run(kind: str, seed: int, stage: Stage, previous: tuple[Stage, Path] | None, out: Path,
              args: argparse.Namespace) -> tuple[Path, float]:
    """Train one stage, or reuse it when it finished before with the same arguments (`stale_stages` has ruled out
    others); returns (its run directory, seconds of training)."""
    run_dir, argv = stage_args(kind, seed, stage, previous, out, args)
    record = run_dir / "stage.json"
    if record.is_file() and (run_dir / "model" / "model.safetensors").is_file():
        return run_dir, json.loads(record.read_text())["seconds"]
    start = time.perf_counter()
    resume = ["--resume"] if checkpoint_to_resume(run_dir, "auto") else []  # a stage stopped before its end
    train.main(argv + resume)
    if finished_step(run_dir) is None:  # a stop signal ended it: saved, not finished
        sys.exit(f"recall_experiment: {run_dir} stopped before its end (saved at its last step); the same command "
                 "resumes it")
    seconds = time.perf_counter() - start
    record.write_text(json.dumps({"seconds": seconds, "args": argv}))
    return run_dir, seconds



def score_loss_problem(args: argparse.Namespace) -> str | None:
    """What is wrong with the score-loss options (each names its option), or None."""
    if args.score_loss_stride < 1 or (args.score_loss_stride > 1 and not args.score_loss):
        return f"--score_loss_stride must be >= 1 and goes with --score_loss, got {args.score_loss_stride}"
    if args.score_loss_top < 0 or (args.score_loss_top and not args.score_loss):
        return f"--score_loss_top must be >= 0 and goes with --score_loss, got {args.score_loss_top}"
    if args.score_loss_random < 0 or (args.score_loss_random and not args.score_loss_top):
        return f"--score_loss_random must be >= 0 and goes with --score_loss_top, got {args.score_loss_random}"
    if args.score_loss_target != "scores" and not args.score_loss:
        return "--score_loss_target goes with --score_loss"
    if not (math.isfinite(args.score_loss_temperature) and args.score_loss_temperature > 0) or (
            args.score_loss_temperature != 1 and not args.score_loss):
        return (f"--score_loss_temperature must be a finite number > 0 and goes with --score_loss, got "
                f"{args.score_loss_temperature}")
    if args.score_loss_temperature != 1 and args.score_loss_target != "scores":
        return "--score_loss_temperature shapes the 'scores' target only: leave it at 1 with --score_loss_target"
    if args.exact_selection_steps < 0 or (args.exact_selection_steps and not args.score_loss):
        return f"--exact_selection_steps must be >= 0 and goes with --score_loss, got {args.exact_selection_steps}"
    if not (math.isfinite(args.score_loss) and args.score_loss >= 0):
        return f"--score_loss must be a finite number >= 0, got {args.score_loss}"
    if args.score_loss and "nsa" not in args.types:
        return "--score_loss trains NSA's selection scores: add nsa to --types, or leave --score_loss out"
    return None


def main(argv: list[str] | None = None) -> None:
    p = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out_dir", default="runs/recall")
    p.add_argument("--data_dir", default="data/stdlib", help="any prepared data (its rows are all replaced)")
    p.add_argument("--types", nargs="+", choices=list(TYPES), default=list(TYPES))
    p.add_argument("--stages", nargs="+", type=parse_stage,
                   default=[parse_stage(s) for s in ("copy:64:1000", "64:600:4", "512:400:4", "2048:400:4@3e-4")],
                   help="the curriculum: LENGTH:STEPS[:PAIRS] for MQAR (PAIRS: key-value pairs a document, default a "
                        "third of its 2-token slots) or copy:LENGTH:STEPS for copying, each with an optional @LR")
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    p.add_argument("--control_seeds", type=int, default=None, metavar="N",
                   help="train the window control (swa) with the first N of --seeds only (default: all of them)")
    p.add_argument("--samples", type=int, default=32, help="documents scored per stage")
    p.add_argument("--model_overrides", type=json_object, default={}, metavar="JSON",
                   help='ModelConfig fields for every type, e.g. \'{"qk_norm": false}\'')
    p.add_argument("--copy_overrides", type=json_object, default={}, metavar="JSON",
                   help="model fields of every type's copying stages only, over --model_overrides; the stage after "
                        "one goes back to the type's fields and --model_overrides (the demo preset's value where "
                        "they set none). The weights must fit both, as NSA's block sizes do with the parameter-free "
                        '"mean" compressor')
    p.add_argument("--score_loss", type=float, default=0.0, metavar="COEF",
                   help="NSA's MQAR stages add the selection-scoring loss (nsa/scoring.py) with this weight per layer "
                        "(train.py's --nsa_score_loss_coef; default 0: off)")
    p.add_argument("--score_loss_stride", type=int, default=1, metavar="K",
                   help="that loss on every K-th query, from a random offset (train.py's --nsa_score_loss_stride; "
                        "an unbiased estimate at 1/K of its cost)")
    p.add_argument("--score_loss_top", type=int, default=0, metavar="M",
                   help="that loss over each query's M blocks of highest importance only (train.py's "
                        "--nsa_score_loss_top; default 0: every block, reading every key)")
    p.add_argument("--score_loss_random", type=int, default=0, metavar="R",
                   help="and over R random other blocks (train.py's --nsa_score_loss_random; with --score_loss_top)")
    p.add_argument("--score_loss_target", choices=("scores", "selection", "boundary"), default="scores",
                   help="that loss's target: each block's best-key softmax (default), uniform over the blocks the "
                        "best keys select, or a ranking of those blocks above the others (train.py's "
                        "--nsa_score_loss_target)")
    p.add_argument("--score_loss_temperature", type=float, default=1.0, metavar="TAU",
                   help="that loss's target softmax at temperature TAU (train.py's --nsa_score_loss_temperature)")
    p.add_argument("--exact_selection_steps", type=int, default=0, metavar="K",
                   help="in the stages with that loss, select by exact block scores for the first K steps while it "
                        "trains the scores (train.py's --nsa_exact_selection_steps)")
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate of a stage without @LR")
    p.add_argument("--batch_tokens", type=int, default=4096, help="tokens per step (documents: this // length)")
    p.add_argument("--jobs", type=int, default=1,
                   help="runs (type x seed) trained at once, each in its own process (a GPU runs several small "
                        "models faster side by side than one after another)")
    args = p.parse_args(argv)
    if bad := [seed for seed in args.seeds if not 0 <= seed <= MAX_SEED]:
        p.error(f"--seeds must lie in [0, {MAX_SEED}], got {bad[0]}")
    if args.control_seeds is not None and not 1 <= args.control_seeds <= len(args.seeds):
        p.error(f"--control_seeds must lie between 1 and the {len(args.seeds)} of --seeds, got {args.control_seeds}")
    if args.control_seeds is not None and "swa" not in args.types:
        p.error("--control_seeds applies to the window control: add swa to --types, or leave --control_seeds out")
    if args.copy_overrides and not any(stage.task == "copy" for stage in args.stages):
        p.error("--copy_overrides applies to copying stages: add one (copy:LENGTH:STEPS) to --stages, or leave it out")
    if problem := score_loss_problem(args):
        p.error(problem)
    register_control()
    for problem in filter(None, (override_problem(kind, args.stages, args) for kind in args.types)):
        p.error(problem)
    out = Path(args.out_dir)
    try:
        check_writable(out, "--out_dir", directory=True)
    except ValueError as e:
        p.error(str(e))
    os.environ.setdefault("PYTHONHASHSEED", "0")
    args.stages = [stage._replace(lr=args.lr) if stage.lr is None else stage for stage in args.stages]
    runs = [(kind, seed) for kind in args.types
            for seed in (args.seeds[: args.control_seeds] if kind == "swa" else args.seeds)]
    stale = [str(d) for kind, seed in runs for d in stale_stages(kind, seed, args.stages, out, args)]
    if stale:
        p.error(f"{', '.join(stale)} finished with other arguments than these stages ask for (stage.json holds "
                f"them): give another --out_dir, or delete those directories")
    if args.jobs == 1:
        summary = {f"{kind}-seed{seed}": curriculum(kind, seed, args.stages, out, args) for kind, seed in runs}
    else:  # one process per run, its output in OUT_DIR/<type>-seed<s>.log
        # NSA's runs, the longest, start first, so the runs still going at the end are short ones
        with ProcessPoolExecutor(args.jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
            futures = {(kind, seed): pool.submit(curriculum, kind, seed, args.stages, out, args, True)
                       for kind, seed in sorted(runs, key=lambda run: run[0] != "nsa")}
            summary = {f"{kind}-seed{seed}": futures[kind, seed].result() for kind, seed in runs}
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    report(summary, out)


def curriculum(kind: str, seed: int, stages: list[Stage], out: Path, args: argparse.Namespace,
               own_process: bool = False) -> list[dict]:
    """Train and score one type and seed through the stages; returns a row per stage (its loss curve: the
    cross-entropy on the answers, without the scoring loss of --score_loss). In a process of its own
    (--jobs > 1) the output goes to OUT_DIR/<type>-seed<s>.log and the process takes its share of the CPU threads."""
    if own_process:
        log = os.open(out / f"{kind}-seed{seed}.log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // args.jobs))
    register_control()
    previous, rows = None, []
    for stage in stages:
        run_dir, seconds = stage_run(kind, seed, stage, previous, out, args)
        mqar = None if stage.task == "copy" else eval_cli.main(
            [str(run_dir / "model"), "--tasks", "mqar", "--lengths", str(stage.length), "--samples", str(args.samples),
             "--batch_size", "2", "--seed", "1000", *(["--pairs", str(stage.pairs)] if stage.pairs else [])])["mqar"]
        metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        rows.append({**stage._asdict(), "seconds": seconds, "mqar": mqar,
                     "loss_curve": [(m["step"], m["loss"] - m.get("aux_loss", 0)) for m in metrics if "loss" in m]})
        previous = stage, run_dir
    return rows


def scores(mqar: dict) -> tuple[float, float | None, float | None]:
    """An eval.py MQAR result -> (accuracy, accuracy within 64 tokens, beyond 64 tokens; None without answers)."""
    def mean(group: list[dict]) -> float | None:
        n = sum(b["count"] for b in group)
        return sum(b["accuracy"] * b["count"] for b in group) / n if n else None

    buckets = mqar["buckets"]
    return (mqar["accuracy"], mean([b for b in buckets if b["end"] <= 64]),
            mean([b for b in buckets if b["start"] >= 64]))


def spread(values: list[float | None]) -> str:
    """The mean of the values (fractions; None skipped) in percent, followed by their sample standard deviation in
    points in parentheses when there are several; "-" when none is left."""
    values = [v for v in values if v is not None]
    if not values:
        return "-"
    mean = sum(values) / len(values)
    if len(values) == 1:
        return f"{mean:.1%}"
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))
    return f"{mean:.1%} ({100 * sd:.1f})"


def report(summary: dict, out: Path) -> None:
    """The table of every run (accuracy overall, within 64 tokens and beyond, per stage), the mean and spread over
    seeds of each type, and the plot of the last stages."""
    print("\n| run | T | pairs | steps | minutes | accuracy | within 64 tokens | beyond 64 tokens | final loss |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, rows in summary.items():
        for row in rows:
            if row["mqar"] is None:  # a copying stage: nothing to score
                print(f"| {name} | {row['length']} | copying | {row['steps']} | {row['seconds'] / 60:.1f} | - | - | "
                      f"- | {row['loss_curve'][-1][1]:.3f} |")
                continue
            cells = " | ".join("-" if v is None else f"{v:.1%}" for v in scores(row["mqar"]))
            print(f"| {name} | {row['length']} | {row['pairs'] or 'T/6'} | {row['steps']} | "
                  f"{row['seconds'] / 60:.1f} | {cells} | {row['loss_curve'][-1][1]:.3f} |")
    if not any(row["mqar"] for rows in summary.values() for row in rows):  # copying stages only
        return
    by_type: dict[str, list[list[dict]]] = {}
    for name, rows in summary.items():
        by_type.setdefault(name.rsplit("-seed", 1)[0], []).append(rows)  # names are <type>-seed<s>
    print("\nMean over seeds (sample standard deviation, points):\n")
    print("| type | seeds | T | pairs | accuracy | within 64 tokens | beyond 64 tokens |")
    print("|---|---|---|---|---|---|---|")
    for kind, runs in by_type.items():
        for i, row in enumerate(runs[0]):
            if row["mqar"] is not None:
                columns = zip(*(scores(rows[i]["mqar"]) for rows in runs), strict=True)
                print(f"| {kind} | {len(runs)} | {row['length']} | {row['pairs'] or 'T/6'} | "
                      f"{' | '.join(spread(list(c)) for c in columns)} |")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    panels = sorted({(row["length"], row["pairs"] or 0) for rows in summary.values() for row in rows if row["mqar"]})
    if not panels:  # copying stages only
        return
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), squeeze=False)
    for ax, (length, pairs) in zip(axes[0], panels, strict=True):
        for name, rows in summary.items():
            for row in rows:
                if row["mqar"] and (row["length"], row["pairs"] or 0) == (length, pairs):
                    plot_recall(ax, row["mqar"], label=name)
        ax.set_title(f"MQAR, T = {length}" + (f", {pairs} pairs" if pairs else ""))
        ax.axvline(64, color="grey", linestyle=":", linewidth=1)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "recall_by_distance.png")
    plt.close(fig)
    print(f"wrote {out / 'summary.json'} and {out / 'recall_by_distance.png'}")


if __name__ == "__main__":
    main()
