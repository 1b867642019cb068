"""The evaluation tasks eval.py runs, by name, and what a task is.

A task is a subclass of `EvalTask`, registered under a name in `EVAL_TASKS` as "module:Class" (imported on first
use). The built-in ones: loss (evaluation/loss.py), passkey and needle (retrieval.py), mqar and mqar_text
(recall.py), documents (documents.py), harness (harness.py, chosen by --harness). `register_task` adds one at run
time, from a research script or a test, without editing this file: adding a task is one file plus that line
(examples/eval_task.py).

What eval.py does with a task, in this order:
1. `cls(name, setting)`: the task checks what it reads (ValueError naming the option) and prepares what it needs
   before any model is loaded (prompt plans, documents read from disk). `setting` holds the checked inputs and
   eval.py's options with their defaults filled in.
2. `run(model, progress)`: the result, a JSON-serialisable dict written to eval.json under the task's name.
   `progress(n)` advances the progress bar over `work` units (prompts, documents, windows); a task with no work
   (`work` 0: no length fits) is skipped with one line.
3. `table(result)` and `meaning(result)`: the lines printed; `figure(result, title)`: a matplotlib figure saved as
   OUT_DIR/`plot_file` (None: no plot).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from model import Transformer
from modeling.config import registered
from text.synthetic import PromptBuilder
from text.tokenizer import HFTokenizer, Tokenizer

EVAL_TASKS: dict[str, str | type[EvalTask]] = {
    "loss": "evaluation.loss:LossTask",
    "passkey": "evaluation.retrieval:GridTask",
    "needle": "evaluation.retrieval:GridTask",
    "mqar": "evaluation.recall:RecallTask",
    "mqar_text": "evaluation.recall:RecallTask",
    "documents": "evaluation.documents:DocumentsTask",
    "harness": "evaluation.harness:HarnessTask",
}


def register_task(name: str, cls: str | type[EvalTask]) -> None:
    """Make `cls` (an EvalTask subclass, or its "module:Class" path) the evaluation task `name`, runnable as
    `eval.py --tasks name`."""
    if not isinstance(name, str) or not name.isidentifier():
        raise ValueError(f"an evaluation task needs a name made of letters, digits and _, got {name!r}")
    EVAL_TASKS[name] = cls


def task_class(name: str) -> type[EvalTask]:
    """The class registered as evaluation task `name` (imported on first use)."""
    if name not in EVAL_TASKS:
        raise ValueError(f"unknown evaluation task {name!r}; registered: {sorted(EVAL_TASKS)} (add one with "
                         "evaluation.registry.register_task)")
    return registered(EVAL_TASKS, name)


@dataclass(frozen=True)
class Setting:
    """What every task is given, checked before any model is loaded.

    options: eval.py's parsed options, defaults filled in (eval.DEFAULTS; an option without one that no running task
        reads is None).
    tokenizer: the model's; builder: passkey and needle prompts from it.
    context: tokens per loss window and the longest prompt (the run's, at most the model's).
    data_dir: prepared data with a validation split, or None.
    out_dir: where eval.json and the plots go.
    tasks: the names of every task this call runs.
    """

    options: argparse.Namespace
    tokenizer: Tokenizer | HFTokenizer
    builder: PromptBuilder
    context: int
    data_dir: str | None
    out_dir: Path
    tasks: tuple[str, ...]


def holds_tokenizer(data_dir: str | Path, tokenizer: Tokenizer | HFTokenizer) -> bool:
    """Whether `data_dir` is the directory the tokenizer was read from (a --data_dir given only for its
    tokenizer.model, when the checkpoint holds none)."""
    return Path(tokenizer.path).parent.resolve() == Path(data_dir).resolve()


class EvalTask:
    """One evaluation of a model. Subclasses set the class attributes they need and implement `run` and `table`.

    reads: eval.py options the task reads (e.g. "lengths", "samples"); each is refused when no task that runs
        reads it, and filled with its default (eval.DEFAULTS) when one does.
    default: runs when --tasks is not given (and --harness is not).
    listed: a choice of --tasks (the harness is chosen by --harness instead).
    unit: what `work` counts, for the progress bar.
    plot_file: the file name of its figure (default NAME.png).
    """

    reads: tuple[str, ...] = ()
    default = False
    listed = True
    unit = "document"
    plot_file: str | None = None

    def __init__(self, name: str, setting: Setting) -> None:
        """Check what the task reads and prepare what it needs (ValueError naming the option)."""
        self.name, self.setting = name, setting

    @property
    def work(self) -> int | None:
        """Units of work `run` reports through `progress`; 0: nothing to do (eval.py skips the task with a line);
        None: not counted (no progress bar)."""
        return None

    def run(self, model: Transformer, progress: Callable[[int], None]) -> dict:
        """The task's result: a JSON-serialisable dict."""
        raise NotImplementedError

    def table(self, result: dict) -> str:
        """The lines eval.py prints for `result`."""
        raise NotImplementedError

    def meaning(self, result: dict) -> str:
        """One line under the table: what the result says about the model ("" for none)."""
        return ""

    def figure(self, result: dict, title: str) -> object | None:
        """A matplotlib figure of `result` (eval.py selects the Agg backend and saves it), or None."""
        return None

    @classmethod
    def summary(cls) -> str:
        """The first line of the class docstring: --tasks' help lists it."""
        return (cls.__doc__ or "").strip().split("\n")[0]
