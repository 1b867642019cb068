"""Does a model use its context? Held-out loss by token position, retrieval grids (passkey, multi-key needle) and
dense recall (MQAR) accuracy by key-query distance.

    python eval.py runs/demo-full-256/model                          # a run's export (or step-N/, or a HF dir)
    python eval.py runs/demo-full-256/step-300 --tasks passkey --lengths 256 512 1024 --depths 0 0.25 0.5 0.75 1
    python eval.py runs/recall/model --tasks mqar --lengths 2048     # accuracy by distance: where retrieval stops
    python eval.py runs/pk/passkey1024/model --harness niah_single_1 niah_multikey_2 --lengths 512 1024   # RULER

Tasks (each prints a table and writes a PNG; results go to OUT_DIR/eval.json, rewritten after each task):
- loss: validation loss overall and mean loss by token position in log-spaced buckets [1, 2), [2, 4), ... up to
  the context length, on windows of the held-out split (data.py prepare's DATA_DIR/validation). A model that uses
  its context has lower loss at later positions.
- passkey: a random 5-digit number hidden in filler text at a given depth (0 = start, 1 = end) of a prompt of a
  given length in tokens, asked for at the end. needle: several key-value pairs hidden in filler, the queried one
  at the given depth. For each (length, depth) cell: exact-match accuracy of the greedy continuation (through the
  KV cache, scored by its first number), and two graded scores under teacher forcing that show partial learning:
  the per-token accuracy of the answer's tokens and their mean log-probability.
- mqar, mqar_text: dense multi-query associative recall documents (synthetic.py) of each length, every answer
  scored under teacher forcing; accuracy and mean log-probability by key-query distance in log-spaced buckets.
- documents: the log-likelihood of each document of --documents (.jsonl with a "text" field, or text files), each
  read after the end-of-document id as training shows them, and bits per byte over all. lm-evaluation-harness's
  `loglikelihood_rolling` computes the same numbers on the Hugging Face export (`lm_eval --model hf`), whose
  tokenizer has no bos token (lm_eval then starts a document with eos, as here).
- --harness TASK...: lm-evaluation-harness tasks (evaluation/harness.py), RULER's at each of --lengths, with
  --samples prompts per length; scores under "harness" in eval.json.
Default lengths follow what each task needs and the context (the run's); a length a task cannot hold is skipped with
one line. Filler, keys and values come from a seeded generator (nothing is downloaded); prompts are built from
separately encoded text pieces, so any tokenizer works.

Notation: B prompts or windows per batch, T tokens per window or prompt, A answer tokens, C width, V vocabulary.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from tqdm import tqdm

from evaluation.harness import check_harness_tasks, format_harness, harness_lm, run_harness
from evaluation.tasks import (
    GRID_ROOM,
    GRID_TASKS,
    TASKS,
    document_loglikelihoods,
    format_documents,
    format_grid,
    format_loss,
    format_recall,
    loss_by_position,
    meaning,
    plot,
    read_documents,
    recall_scores,
    retrieval_grid,
    validation_windows,
)
from modeling.config import ComputeConfig
from storage.weights import load_model, stored_config
from text.shards import check_tokenizer, load_index
from text.synthetic import RECALL_TASKS, PromptBuilder, SyntheticDocuments
from text.tokenizer import check_vocab, model_tokenizer
from training.cli import Parser, check_writable, numbered

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


def build_parser() -> argparse.ArgumentParser:
    p = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint", help="a step-N directory, a run's model/ export (or its model.safetensors), or a "
                                      "Hugging Face directory")
    p.add_argument("--tasks", nargs="+", choices=TASKS, help="default: loss passkey needle (none with --harness)")
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
    p.add_argument("--out_dir", help="where eval.json and the plots go (default: RUN_DIR/eval-CHECKPOINT for a "
                                     "run's checkpoint, else eval/CHECKPOINT)")
    return p


def plan_lengths(task: str, asked: list[int] | None, context: int, builder: PromptBuilder, log=print) -> list[int]:
    """The lengths `task` runs at: `asked` (without those the task cannot hold, one line each) or the defaults
    (grids: those of 1/8, 1/4, 1/2 of the context that hold the task's text, and its end; recall: the context);
    ValueError for a length beyond the context."""
    longest = context - (GRID_ROOM if task in GRID_TASKS else 0)
    if asked and max(asked) > longest:
        raise ValueError(f"--lengths {max(asked)} does not fit the context of {context} tokens"
                         + (f" with the {GRID_ROOM} answer tokens {task} generates" if task in GRID_TASKS else ""))
    if task in GRID_TASKS:
        needed = builder.required_length(task)
        lengths = asked or sorted({n for n in (context // 8, context // 4, context // 2) if n >= needed} | {longest})
    else:
        needed = 4 if task == "mqar" else len(builder.tokenizer.encode(" The value of key redfox is 123456.")) * 2 + 8
        lengths = asked or [context]
    for length in (n for n in lengths if n < needed):
        log(f"{task}: length {length} skipped: the task's text needs {needed} tokens")
    return [n for n in lengths if n >= needed]


def main(argv: list[str] | None = None) -> dict:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return evaluate(args)
    except ValueError as e:
        parser.error(str(e))
    except OSError as e:  # ours carry a message; the system's a file name and its reason
        parser.error(str(e) if e.strerror is None else f"{e.filename}: {e.strerror}")


def evaluate(args: argparse.Namespace) -> dict:
    """eval.py's work for parsed arguments; every input is checked (one-line ValueError / FileNotFoundError) before
    the model is loaded, and eval.json is rewritten after each task."""
    checkpoint, tokenizer, data_dir, context, out_dir, ruler = check_inputs(args)
    builder = PromptBuilder(tokenizer)
    plans = {task: plan_lengths(task, args.lengths, context, builder) for task in args.tasks
             if task not in ("loss", "documents")}
    if args.pairs is not None and args.pairs < 1:
        raise ValueError(f"--pairs must be >= 1, got {args.pairs}")
    recall = {task: SyntheticDocuments(task, tokenizer, args.pairs) for task in plans if task in RECALL_TASKS}
    for task, documents in recall.items():
        for length in plans[task] if args.pairs else []:
            try:
                documents.check_length(length)
            except ValueError as e:
                raise ValueError(f"--pairs {args.pairs}: length {e}; use fewer --pairs or longer --lengths") from None
    texts = read_documents(args.documents, tokenizer, context) if "documents" in args.tasks else []

    model = load_model(checkpoint, device=args.device, compute=ComputeConfig()).eval()
    title = f"{checkpoint} ({model.config.attention_type} attention)"
    results: dict = {"checkpoint": str(checkpoint), "attention_type": model.config.attention_type,
                     "context_length": context}

    def write() -> None:
        (out_dir / "eval.json").write_text(json.dumps(results, indent=1))

    if "loss" in args.tasks:
        windows, _ = validation_windows(data_dir, context, args.eval_tokens, args.seed)  # every token, prompts too
        results["loss"] = loss_by_position(model, windows, args.batch_size)
        print(format_loss(results["loss"]), meaning("loss", results["loss"]), sep="\n")
        write()
    if "documents" in args.tasks:
        results["documents"] = document_loglikelihoods(model, tokenizer, texts) | {"file": args.documents}
        print(format_documents(results["documents"]))
        write()
    for task, lengths in plans.items():
        if not lengths:
            print(f"{task}: skipped, no length fits")
            continue
        total = len(lengths) * args.samples * (len(args.depths) if task in GRID_TASKS else 1)
        with tqdm(total=total, desc=task, unit="prompt" if task in GRID_TASKS else "document") as bar:
            if task in GRID_TASKS:
                results[task] = retrieval_grid(model, builder, task, lengths, args.depths, args.samples, args.seed,
                                               args.batch_size, bar)
            else:
                results[task] = recall_scores(model, recall[task], lengths, args.samples, args.seed,
                                              args.batch_size, bar)
        print(format_grid(task, results[task]) if task in GRID_TASKS else format_recall(results[task]),
              meaning(task, results[task]), sep="\n")
        write()
    if args.harness:
        (out_dir / "tokenizer").mkdir(exist_ok=True)
        tokenizer.save(out_dir / "tokenizer", context)  # RULER builds its prompts with it (transformers' format)
        lm = harness_lm(model, tokenizer, context, args.batch_size)
        results["harness"] = run_harness(lm, args.harness, ruler, args.lengths or [context], out_dir / "tokenizer",
                                         args.samples, args.seed)
        if not results["harness"]:
            raise ValueError(f"--harness: no task ran at --lengths {' '.join(map(str, args.lengths or [context]))}, "
                             "each too short for its prompt and answer (see the lines above): pass longer --lengths")
        print(format_harness(results["harness"]))
        write()
    results["plots"] = [str(p) for p in plot(results, out_dir, title)]
    write()
    print(f"wrote {out_dir / 'eval.json'}" + "".join(f", {p}" for p in results["plots"]))
    return results


# The options only some tasks read (READERS; HARNESS_READS: --harness too), refused when none of them runs, and
# the defaults of those that have one.
READERS = {"documents": ["documents"], "pairs": RECALL_TASKS, "depths": GRID_TASKS,
           "eval_tokens": ["loss"], "lengths": [*GRID_TASKS, *RECALL_TASKS], "samples": [*GRID_TASKS, *RECALL_TASKS],
           "batch_size": ["loss", *GRID_TASKS, *RECALL_TASKS], "seed": ["loss", *GRID_TASKS, *RECALL_TASKS]}
HARNESS_READS = ("lengths", "samples", "batch_size", "seed")
DEFAULTS = {"depths": [0.0, 0.25, 0.5, 0.75, 1.0], "eval_tokens": 65536, "samples": 10, "batch_size": 10, "seed": 0}


def check_options(args: argparse.Namespace) -> None:
    """The options on their own, before any file is read: the device, the options only some tasks read (each read
    by one that runs: READERS), numbers in range; fills in the defaults of --tasks and DEFAULTS."""
    args.tasks = args.tasks if args.tasks is not None else [] if args.harness else list(TASKS[:3])
    try:
        device = torch.device(args.device)
    except RuntimeError:
        device = torch.device("meta")  # refused below
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"--device {args.device}: expected cpu, cuda or cuda:N")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {args.device}: this machine has no CUDA device; use --device cpu")
    for name, tasks in READERS.items():
        if getattr(args, name) is not None and not set(tasks) & set(args.tasks) and not (
                args.harness and name in HARNESS_READS):
            harness = " (and --harness)" if name in HARNESS_READS else ""
            raise ValueError(f"--{name} is read only by the task(s) {', '.join(tasks)}{harness}, which this call does "
                             "not run: add one, or leave the option out")
    if "documents" in args.tasks and not args.documents:
        raise ValueError("the documents task needs --documents FILE (.jsonl with a \"text\" field, or text files)")
    for name, default in DEFAULTS.items():
        setattr(args, name, default if getattr(args, name) is None else getattr(args, name))
    if not 0 <= min(args.depths) <= max(args.depths) <= 1:
        raise ValueError(f"--depths must lie in [0, 1], got {args.depths}")
    for name, low in (("samples", 1), ("batch_size", 1), ("eval_tokens", 1), ("context_length", 2), ("seed", 0)):
        if getattr(args, name) is not None and getattr(args, name) < low:
            raise ValueError(f"--{name} must be >= {low}, got {getattr(args, name)}")
    if any(n < 2 for n in args.lengths or []):
        raise ValueError(f"--lengths must be >= 2, got {args.lengths}")


def check_inputs(args: argparse.Namespace) -> tuple[Path, object, str | None, int, Path, set[str]]:
    """(checkpoint, tokenizer, data directory, context length, output directory, the --harness tasks that are
    RULER's) from the arguments, each checked before anything large is read (ValueError / FileNotFoundError naming
    the argument): the options first (`check_options`), then what they name."""
    check_options(args)
    checkpoint = Path(args.checkpoint)
    if not checkpoint.exists():
        raise FileNotFoundError(f"{checkpoint} does not exist")
    if (checkpoint / "metrics.jsonl").is_file():
        raise ValueError(f"{checkpoint} is a run directory, not a model: pass {checkpoint / 'model'} (its export) or "
                         f"{checkpoint / 'step-N'} (a checkpoint)")
    run_dir, run = _run_config(checkpoint)
    data_dir = args.data_dir or run.get("data_dir")
    tokenizer = model_tokenizer(checkpoint, args.tokenizer, (run.get("tokenizer"),
                                                             data_dir and Path(data_dir) / "tokenizer.model"))
    if "loss" in args.tasks and not data_dir:
        raise ValueError("the loss task needs --data_dir (prepared data with a validation split)")
    if args.data_dir and "loss" not in args.tasks and Path(tokenizer.path).parent.resolve() != Path(
            args.data_dir).resolve():
        raise ValueError("--data_dir is read only by the task(s) loss (and for its tokenizer.model when the "
                         "checkpoint holds no tokenizer), which this call does not need: leave it out")
    stored = stored_config(checkpoint)
    check_vocab(tokenizer, stored.vocab_size)
    if "loss" in args.tasks:
        check_tokenizer(load_index(data_dir), tokenizer)  # the data must be this tokenizer's ids
    if args.context_length and args.context_length > stored.context_length:
        raise ValueError(f"--context_length {args.context_length} exceeds the model's context_length "
                         f"{stored.context_length}")
    context = min(args.context_length or run.get("context_length") or 1024, stored.context_length)
    if args.harness and args.lengths and max(args.lengths) > context:
        raise ValueError(f"--lengths {max(args.lengths)} exceeds the context of {context} tokens the harness reads "
                         "(--context_length, the run's, at most the model's)")
    out_dir = Path(args.out_dir) if args.out_dir else next(
        path for path in numbered(run_dir / f"eval-{checkpoint.stem}" if run_dir else Path("eval") / checkpoint.stem)
        if not (path / "eval.json").exists())
    if (out_dir / "eval.json").exists():
        raise ValueError(f"--out_dir {out_dir} holds an earlier evaluation (eval.json): choose another --out_dir, or "
                         "leave it out (each evaluation then gets a new directory)")
    ruler = check_harness_tasks(args.harness) if args.harness else set()  # seconds: lm-eval's task index
    if args.lengths and not ruler and not set(READERS["lengths"]) & set(args.tasks):
        raise ValueError(f"--lengths is read only by the task(s) {', '.join(READERS['lengths'])} and RULER's "
                         "--harness tasks, which this call does not run: leave it out")
    check_writable(out_dir, "--out_dir", directory=True)
    return checkpoint, tokenizer, data_dir, context, out_dir, ruler


if __name__ == "__main__":
    main()
