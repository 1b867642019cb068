"""Does a model use its context? Held-out loss by token position, retrieval grids (passkey, multi-key needle) and
dense recall (MQAR) accuracy by key-query distance.

    python eval.py runs/demo-full-256/model                          # a run's export (or step-N/, or a HF dir)
    python eval.py runs/demo-full-256/step-300 --tasks passkey --lengths 256 512 1024 --depths 0 0.25 0.5 0.75 1
    python eval.py runs/recall/model --tasks mqar --lengths 2048     # accuracy by distance: where retrieval stops
    python eval.py runs/pk/passkey1024/model --harness niah_single_1 niah_multikey_2 --lengths 512 1024   # RULER

Each task prints a table and the line of what it means, and writes a PNG; results go to OUT_DIR/eval.json,
rewritten after each task. The tasks (evaluation/registry.py; each module's docstring describes its task):
{tasks}
Default lengths follow what each task needs and the context (the run's); a length a task cannot hold is skipped with
one line. Filler, keys and values come from a seeded generator (nothing is downloaded); prompts are built from
separately encoded text pieces, so any tokenizer works. Every input is checked, and every task prepared, before the
model is loaded.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from tqdm import tqdm

from evaluation.registry import EVAL_TASKS, EvalTask, Setting, holds_tokenizer, task_class
from evaluation.retrieval import DEPTHS
from modeling.config import ComputeConfig
from storage.weights import Stored, load_model, stored
from text.synthetic import PromptBuilder
from text.tokenizer import check_vocab, model_tokenizer
from training.cli import PLUGIN_HELP, Parser, check_writable, load_plugins, numbered

# ---- command line -------------------------------------------------------------------------------------------------


def _run_config(checkpoint: Path) -> tuple[Path | None, dict]:
    """(the run directory, train.py's options) of the run a checkpoint belongs to (step-N/ or model/ inside OUT_DIR),
    or (None, {})."""
    for run_dir in (checkpoint.parent, checkpoint.parent.parent):
        candidate = run_dir / "config.json"
        if candidate.is_file():
            try:
                values = json.loads(candidate.read_text())
            except ValueError:
                continue
            if isinstance(values, dict) and isinstance(values.get("train"), dict):
                return run_dir, values["train"]
    return None, {}


def task_lines() -> str:
    """One line per task --tasks (or --harness) runs: its names and summary."""
    names: dict[type[EvalTask], list[str]] = {}
    for name in EVAL_TASKS:
        names.setdefault(task_class(name), []).append(name)
    return "\n".join(f"- {cls.summary()}" for cls in names)


def build_parser() -> argparse.ArgumentParser:
    listed = [name for name in EVAL_TASKS if task_class(name).listed]
    default = [name for name in listed if task_class(name).default]
    p = Parser(description=__doc__.format(tasks=task_lines()), formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint", help="a step-N directory, a run's model/ export (or its model.safetensors), or a "
                                      "Hugging Face directory")
    p.add_argument("--tasks", nargs="+", choices=listed, help=f"default: {' '.join(default)} (none with --harness)")
    p.add_argument("--harness", nargs="+", metavar="TASK",
                   help="lm-evaluation-harness tasks scored on this model, e.g. RULER's niah_single_1 niah_multikey_2 "
                        "(at each of --lengths, default the context; they download nothing), or any lm-eval task "
                        "whose data can be reached")
    p.add_argument("--tokenizer", help="a SentencePiece .model, a tokenizer.json or a directory holding one "
                                       "(default: the one stored with the checkpoint, the run's, "
                                       "DATA_DIR/tokenizer.model)")
    p.add_argument("--data_dir", help="prepared data with a validation split (default: the run's)")
    p.add_argument("--documents", help="the documents task's input: a .jsonl with a \"text\" field, a text file or a "
                                       "directory of them")
    p.add_argument("--context_length", type=int, help="tokens per loss window and longest prompt (default: the "
                                                       "run's, else 1024, at most the model's)")
    p.add_argument("--eval_tokens", type=int, help="validation tokens scored by the loss task (default: 65536)")
    p.add_argument("--document_mask", action="store_true", default=None,
                   help="loss: each token attends only within its own document of the packed windows (as train.py "
                        "--document_mask trains); mqar, mqar_text with --after_text: each document only within itself")
    p.add_argument("--after_text", type=int, help="mqar, mqar_text: pack each document after this many tokens of "
                                                  "held-out text (--data_dir) and the end-of-document id, as training "
                                                  "rows pack documents (default: 0, the document alone)")
    p.add_argument("--lengths", type=int, nargs="+", help="prompt / document lengths in tokens (default: what each "
                                                          "task needs, up to the context)")
    p.add_argument("--depths", type=float, nargs="+", help="passkey, needle: where the answer hides, 0 (start) to 1 "
                                                             "(end) (default: 0 0.25 0.5 0.75 1)")
    p.add_argument("--pairs", type=int, help="mqar, mqar_text: key-value pairs in a document (default: a third of "
                                             "its slots, as train.py without --synthetic_pairs)")
    p.add_argument("--samples", type=int, help="prompts per grid cell, documents per recall length, documents per "
                                               "--harness task and length (default: 10)")
    p.add_argument("--batch_size", type=int, help="prompts (or loss windows) per forward (default: 10)")
    p.add_argument("--seed", type=int, help="of the prompts, documents and loss windows drawn (default: 0)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cpu, cuda or cuda:N")
    p.add_argument("--plugin", action="append", metavar="MODULE", help=PLUGIN_HELP)
    p.add_argument("--out_dir", help="where eval.json and the plots go (default: RUN_DIR/eval-CHECKPOINT for a "
                                     "run's checkpoint, else eval/CHECKPOINT)")
    return p


def main(argv: list[str] | None = None) -> dict:
    load_plugins(argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return evaluate(args)
    except ValueError as e:
        parser.error(str(e))
    except OSError as e:  # ours carry a message; the system's a file name and its reason
        parser.error(str(e) if e.strerror is None else f"{e.filename}: {e.strerror}")


def evaluate(args: argparse.Namespace) -> dict:
    """eval.py's work for parsed arguments: every input checked and every task prepared (one-line ValueError /
    FileNotFoundError) before the model is loaded; eval.json rewritten after each task."""
    found, setting = check_inputs(args)
    checkpoint = Path(args.checkpoint)
    tasks = {name: task_class(name)(name, setting) for name in setting.tasks}
    if all(task.work == 0 for task in tasks.values()):  # work that produces nothing is an error, not an empty file
        raise ValueError(f"nothing to score: every length of {', '.join(tasks)} was skipped (the lines above say "
                         f"why); pass --lengths that the task's text and the context of {setting.context} tokens hold")
    check_writable(setting.out_dir, "--out_dir", directory=True)

    model = load_model(found, device=args.device, compute=ComputeConfig()).eval()  # its files checked once
    title = f"{checkpoint} ({model.config.attention_type} attention)"
    results: dict = {"checkpoint": str(checkpoint), "attention_type": model.config.attention_type,
                     "context_length": setting.context}

    def write() -> None:
        (setting.out_dir / "eval.json").write_text(json.dumps(results, indent=1))

    for name, task in tasks.items():
        if task.work == 0:
            print(f"{name}: skipped, nothing it can score fits (see the lines above)")
            continue
        with tqdm(total=task.work, desc=name, unit=task.unit, disable=task.work is None) as bar:
            results[name] = task.run(model, bar.update)
        print(task.table(results[name]), *filter(None, [task.meaning(results[name])]), sep="\n")
        write()
    results["plots"] = [str(p) for p in plot(tasks, results, setting.out_dir, title)]
    write()
    print(f"wrote {setting.out_dir / 'eval.json'}" + "".join(f", {p}" for p in results["plots"]))
    return results


def plot(tasks: dict[str, EvalTask], results: dict, out_dir: Path, title: str) -> list[Path]:
    """Each task's figure of its result, saved in `out_dir`; [] with a note when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("plots skipped: pip install matplotlib (or the project's `plot` extra)")
        return []
    written = []
    for name, task in tasks.items():
        if name in results and (fig := task.figure(results[name], title)) is not None:
            written.append(out_dir / (task.plot_file or f"{name}.png"))
            fig.tight_layout()
            fig.savefig(written[-1])
            plt.close(fig)
    return written


# The defaults of the options only some tasks read (each refused when none of them runs: `readers`).
DEFAULTS = {"depths": list(DEPTHS), "eval_tokens": 65536, "samples": 10, "batch_size": 10, "seed": 0,
            "document_mask": False, "after_text": 0}


def readers() -> dict[str, list[str]]:
    """Each option only some tasks read (EvalTask.reads; --data_dir and --harness have their own rules) -> the
    registered tasks that read it."""
    found: dict[str, list[str]] = {}
    for name in EVAL_TASKS:
        for option in task_class(name).reads:
            if option not in ("data_dir", "harness"):
                found.setdefault(option, []).append("--harness" if name == "harness" else name)
    return found


def check_options(args: argparse.Namespace) -> tuple[str, ...]:
    """The options on their own, before any file is read: the device, the options only some tasks read (each read
    by one that runs: `readers`), numbers in range; fills in the defaults of --tasks and DEFAULTS. Returns the names
    of the tasks this call runs (--harness's included)."""
    args.tasks = args.tasks if args.tasks is not None else [] if args.harness else [
        name for name in EVAL_TASKS if task_class(name).default]
    running = (*args.tasks, *(["harness"] if args.harness else []))
    try:
        device = torch.device(args.device)
    except RuntimeError:
        device = torch.device("meta")  # refused below
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"--device {args.device}: expected cpu, cuda or cuda:N")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {args.device}: this machine has no CUDA device; use --device cpu")
    for name, tasks in readers().items():
        if getattr(args, name) is not None and not any(name in task_class(task).reads for task in running):
            raise ValueError(f"--{name} is read only by the task(s) {', '.join(tasks)}, which this call does not "
                             "run: add one, or leave the option out")
    for name, default in DEFAULTS.items():
        setattr(args, name, default if getattr(args, name) is None else getattr(args, name))
    for name, low in (("samples", 1), ("batch_size", 1), ("eval_tokens", 1), ("context_length", 2), ("seed", 0),
                      ("after_text", 0)):
        if getattr(args, name) is not None and getattr(args, name) < low:
            raise ValueError(f"--{name} must be >= {low}, got {getattr(args, name)}")
    if any(n < 2 for n in args.lengths or []):
        raise ValueError(f"--lengths must be >= 2, got {args.lengths}")
    return running


def check_inputs(args: argparse.Namespace) -> tuple[Stored, Setting]:
    """(what the checkpoint holds, its files checked once: `storage.weights.stored`; what every task is given) from
    the arguments, each checked before anything large is read (ValueError / FileNotFoundError naming the argument):
    the options first (`check_options`), then what they name (the output directory's writability once the tasks
    have checked theirs)."""
    running = check_options(args)
    checkpoint = Path(args.checkpoint)
    if not checkpoint.exists():
        raise FileNotFoundError(f"{checkpoint} does not exist")
    if (checkpoint / "metrics.jsonl").is_file():
        raise ValueError(f"{checkpoint} is a run directory, not a model: pass {checkpoint / 'model'} (its export) or "
                         f"{checkpoint / 'step-N'} (a checkpoint)")
    found = stored(checkpoint)  # what the path holds first: the errors below assume a model
    run_dir, run = _run_config(checkpoint)
    data_dir = args.data_dir or run.get("data_dir")
    tokenizer = model_tokenizer(checkpoint, args.tokenizer, (run.get("tokenizer"),
                                                             data_dir and Path(data_dir) / "tokenizer.model"))
    if args.data_dir and not any("data_dir" in task_class(task).reads for task in running) and \
            not holds_tokenizer(args.data_dir, tokenizer):
        reading = [name for name in EVAL_TASKS if "data_dir" in task_class(name).reads]
        raise ValueError(f"--data_dir is read only by the task(s) {', '.join(reading)} (and for its tokenizer.model "
                         "when the checkpoint holds no tokenizer), which this call does not need: leave it out")
    check_vocab(tokenizer, found.config.vocab_size)
    if args.context_length and args.context_length > found.config.context_length:
        raise ValueError(f"--context_length {args.context_length} exceeds the model's context_length "
                         f"{found.config.context_length}")
    context = min(args.context_length or run.get("context_length") or 1024, found.config.context_length)
    out_dir = Path(args.out_dir) if args.out_dir else next(
        path for path in numbered(run_dir / f"eval-{checkpoint.stem}" if run_dir else Path("eval") / checkpoint.stem)
        if not (path / "eval.json").exists())
    if (out_dir / "eval.json").exists():
        raise ValueError(f"--out_dir {out_dir} holds an earlier evaluation (eval.json): choose another --out_dir, or "
                         "leave it out (each evaluation then gets a new directory)")
    return found, Setting(args, tokenizer, PromptBuilder(tokenizer), context, data_dir, out_dir, running)


if __name__ == "__main__":
    main()
