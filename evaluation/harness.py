"""lm-evaluation-harness on any model eval.py reads: `HarnessLM` is an lm-eval `LM` backed by the project's
Transformer and tokenizer (full attention or NSA), and `run_harness` scores lm-eval tasks with it, RULER's
synthetic tasks at the lengths asked for.

    python eval.py runs/pk/passkey1024/model --harness niah_single_1 niah_multikey_2 --lengths 512 1024

The three request types, as lm-eval's own `hf` model computes them:
- loglikelihood (context, continuation): log p(continuation | context) summed over the continuation's tokens, and
  whether greedy decoding would produce it. Trailing spaces of the context move to the continuation; an empty
  context is the end-of-document id. Inputs longer than the context keep their last `max_length` tokens. Rows are
  batched longest first and padded on the right, which a causal model never reads.
- loglikelihood_rolling (text,): the whole text's log-likelihood in windows of `max_length` tokens, the first
  conditioned on the end-of-document id (lm_eval.utils.get_rolling_token_windows).
- generate_until (context, {"until", "max_gen_toks", ...}): greedy decoding through the model's KV cache, cut at the
  first stop string or the end-of-document id: max_gen_toks tokens, the prompt keeping its last max_length -
  max_gen_toks tokens (counted in one line when some are cut). Prompts are batched longest first and padded on
  the left (`Transformer.generate`), each row generating what it generates alone.

eval.py runs it as the task "harness" (`HarnessTask`), chosen by --harness TASK... rather than --tasks.

Notation: B rows per batch, T tokens per row, V vocabulary.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
from collections.abc import Callable, Iterator
from pathlib import Path
from unittest import mock

import torch
import torch.nn.functional as F

from evaluation.registry import EvalTask, Setting, task_class
from model import Transformer
from text.tokenizer import HFTokenizer, Tokenizer

# RULER's tasks that build their prompts from repeated text or from needles alone, so need no download.
OFFLINE_RULER = ("niah_single_1", "niah_multikey_2", "niah_multikey_3")


def harness_installed() -> bool:
    """Whether lm-evaluation-harness can be imported."""
    return importlib.util.find_spec("lm_eval") is not None


@functools.cache
def task_manager() -> object:
    """lm-eval's index of its tasks (seconds to build: built once per process, for the checks; a run builds its
    own with RULER's metadata)."""
    from lm_eval.tasks import TaskManager

    return TaskManager()


def check_harness_tasks(tasks: list[str]) -> set[str]:
    """The tasks of `tasks` that are RULER's (their prompts sized by --lengths); ValueError naming the fix when
    lm-eval is not installed or a task is not one of its tasks. Reads lm-eval's task index only (no model)."""
    if not harness_installed():
        raise ValueError("--harness needs lm-evaluation-harness: pip install -e '.[eval]'")
    index = task_manager().task_index
    if unknown := [task for task in tasks if task not in index]:
        raise ValueError(f"--harness: lm-eval has no task {', '.join(unknown)} (e.g. {', '.join(OFFLINE_RULER)}; "
                         "`lm_eval ls tasks` lists them)")
    def folder(entry: object) -> str:  # the task's YAML folder (an Entry, or a dict before lm-eval 0.4.10)
        path = entry.get("yaml_path") if isinstance(entry, dict) else getattr(entry, "yaml_path", None)
        return Path(path).parent.name if path else ""

    return {task for task in tasks if folder(index[task]) == "ruler"}


class ModelLM:
    """The methods of an lm-eval LM for `model` and `tokenizer`, reading at most `max_length` tokens at a time
    (`harness_lm` puts lm-eval's LM class under it)."""

    def __init__(self, model: Transformer, tokenizer: Tokenizer | HFTokenizer, max_length: int,
                 batch_size: int = 8) -> None:
        super().__init__()
        self.model, self.tokenizer = model.eval(), tokenizer
        self.max_length, self.batch_size = max_length, batch_size
        self.model_device = model.embed_tokens.weight.device

    # ---- log-likelihoods -------------------------------------------------------------------------------

    def encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        """(context ids, continuation ids) as lm-eval's hf model splits them: the continuation's ids are those the
        whole text adds after the context's; an empty context is the end-of-document id. ValueError for an empty
        continuation or one longer than the context (nothing, or not all of it, could be scored)."""
        spaces = len(context) - len(context.rstrip())
        if spaces:
            context, continuation = context[:-spaces], context[-spaces:] + continuation
        if not context:
            head, tail = [self.tokenizer.eod_id], self.tokenizer.encode(continuation)
        else:
            whole, head = self.tokenizer.encode(context + continuation), self.tokenizer.encode(context)
            tail = whole[len(head):]
        if not 1 <= len(tail) <= self.max_length:
            raise ValueError(f"harness: a continuation of {len(tail)} tokens ({continuation[:40]!r}...) cannot be "
                             f"scored in a context of {self.max_length}; it needs 1 to {self.max_length} tokens")
        return head, tail

    def loglikelihood(self, requests: list, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        """For each request (context, continuation): (log p(continuation | context), whether greedy decoding
        produces it)."""
        return self.score([self.encode_pair(*request.args) for request in requests])

    def loglikelihood_rolling(self, requests: list, disable_tqdm: bool = False) -> list[float]:
        """For each request (text,): log p(text) after the end-of-document id, in windows of max_length tokens
        (every window of every text scored in batches)."""
        from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

        windows = [[make_disjoint_window(window) for window in get_rolling_token_windows(
            self.tokenizer.encode(request.args[0]), prefix_token=self.tokenizer.eod_id,
            max_seq_len=self.max_length, context_len=1)] for request in requests]
        scores = iter(self.score([window for text in windows for window in text]))
        return [sum(next(scores)[0] for _ in text) for text in windows]

    def score(self, pairs: list[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        """(sum of log p(continuation | context), whether it is the greedy continuation) for each pair, reading at
        most the last max_length tokens before each continuation token."""
        rows = [(context + continuation)[-(self.max_length + 1):][:-1] for context, continuation in pairs]
        order = sorted(range(len(pairs)), key=lambda i: -len(rows[i]))
        results: list[tuple[float, bool]] = [(0.0, False)] * len(pairs)
        with torch.no_grad():
            for b0 in range(0, len(order), self.batch_size):
                batch = order[b0:b0 + self.batch_size]
                T = len(rows[batch[0]])
                ids = torch.zeros(len(batch), T, dtype=torch.long)  # (B, T), padded on the right
                for b, i in enumerate(batch):
                    ids[b, :len(rows[i])] = torch.tensor(rows[i])
                hidden = self.model.hidden_states(ids.to(self.model_device))  # (B, T, C)
                for b, i in enumerate(batch):
                    target = torch.tensor(pairs[i][1], device=self.model_device)  # (A,)
                    end = len(rows[i])
                    logits = self.model.logits(hidden[b, end - len(target):end])  # (A, V)
                    logprobs = F.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), -1)
                    results[i] = (logprobs.gather(1, target[:, None]).double().sum().item(),
                                  bool((logprobs.argmax(-1) == target).all()))
        return results

    # ---- generation ------------------------------------------------------------------------------------

    def generate_until(self, requests: list, disable_tqdm: bool = False) -> list[str]:
        """For each request (context, generation options): the greedy continuation, cut at the first stop string
        or the end-of-document id. As lm-eval's hf model: max_gen_toks tokens (or its aliases; default 256), the
        prompt keeping its last max_length - max_gen_toks tokens (counted in one line when some are cut)."""
        from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs

        options = [normalize_gen_kwargs(dict(request.args[1]), 256) for request in requests]
        for option in options:
            if option["do_sample"]:
                raise ValueError("harness: a task asks for sampling (do_sample); this model decodes greedily")
            if not 0 < option["max_gen_toks"] < self.max_length:
                raise ValueError(f"harness: max_gen_toks {option['max_gen_toks']} leaves no room for a prompt in "
                                 f"the context of {self.max_length} tokens")
        prompts = [self.tokenizer.encode(request.args[0]) or [self.tokenizer.eod_id] for request in requests]
        room = [self.max_length - option["max_gen_toks"] for option in options]
        if cut := sum(len(prompt) > keep for prompt, keep in zip(prompts, room, strict=True)):
            print(f"harness: {cut} of {len(prompts)} prompts are longer than the context leaves beside their "
                  "generated tokens and keep only their last tokens")
        prompts = [prompt[-keep:] for prompt, keep in zip(prompts, room, strict=True)]
        results: list[str] = [""] * len(requests)
        groups: dict[int, list[int]] = {}  # one max_gen_toks: batches of it, longest prompts first
        for i in sorted(range(len(requests)), key=lambda i: -len(prompts[i])):
            groups.setdefault(options[i]["max_gen_toks"], []).append(i)
        for new, group in groups.items():
            for b0 in range(0, len(group), self.batch_size):
                batch = group[b0:b0 + self.batch_size]
                out = self.model.generate([prompts[i] for i in batch], new, temperature=0.0,
                                          eos_id=self.tokenizer.eod_id)  # padded on the left to the longest
                for i, row in zip(batch, out[:, len(prompts[batch[0]]):].tolist(), strict=True):
                    if self.tokenizer.eod_id in row:
                        row = row[:row.index(self.tokenizer.eod_id)]
                    results[i] = cut_at(self.tokenizer.decode(row), handle_stop_sequences(options[i]["until"], None))
        return results


def harness_lm(model: Transformer, tokenizer: Tokenizer | HFTokenizer, max_length: int,
               batch_size: int = 8) -> ModelLM:
    """An lm-eval LM of `model` (see the module docstring); lm-eval is imported here, not when this module is."""
    from lm_eval.api.model import LM

    return type("HarnessLM", (ModelLM, LM), {})(model, tokenizer, max_length, batch_size)


def cut_at(text: str, until: list[str]) -> str:
    """`text` up to the first of the stop strings `until`."""
    for stop in until:
        if stop and stop in text:
            text = text[:text.index(stop)]
    return text


@contextlib.contextmanager
def no_downloads(tasks: list[str]) -> Iterator[None]:
    """For OFFLINE_RULER tasks alone: lm-eval's RULER module asks nltk for its punkt_tab data when imported and
    downloads it when missing, though these tasks never split sentences; nltk is told the data is there."""
    if not set(tasks) <= set(OFFLINE_RULER) or importlib.util.find_spec("nltk") is None:
        yield
        return
    import nltk.data

    find = nltk.data.find

    def found(resource: str, *args: object, **kwargs: object) -> object:
        try:
            return find(resource, *args, **kwargs)
        except LookupError:
            if resource == "tokenizers/punkt_tab":
                return resource
            raise

    with mock.patch.object(nltk.data, "find", found):
        yield


def run_harness(lm: object, tasks: list[str], ruler: set[str], lengths: list[int], tokenizer_dir: Path,
                limit: int | None, seed: int, log: Callable[[str], None] = print) -> dict:
    """lm-eval's scores of `lm` on `tasks`: {task: {metric: value}}. RULER's tasks (`ruler`) generate 500 prompts
    of each of `lengths` tokens with the tokenizer saved in `tokenizer_dir` and score the first `limit`, one lm-eval
    run per length (its limit takes the first documents), their metric named by the length; a length too short for
    a task's prompt and answer is skipped with one line. Other tasks score their first `limit` documents once."""
    from lm_eval import simple_evaluate

    results: dict[str, dict] = {}
    for task in tasks:
        for length in lengths if task in ruler else [None]:
            metadata = {"tokenizer": str(tokenizer_dir)} | ({"max_seq_lengths": [length]} if length else {})
            try:
                with no_downloads(tasks):
                    out = simple_evaluate(model=lm, tasks=[task], limit=limit, metadata=metadata, random_seed=seed,
                                          numpy_random_seed=seed, torch_random_seed=seed, fewshot_random_seed=seed)
            except ValueError as e:
                if "Could not generate any sample" not in str(e):
                    raise
                log(f"{task}: length {length} skipped: its prompt and answer need more tokens")
                continue
            for name, scores in out["results"].items():
                results.setdefault(name, {}).update(
                    {metric.removesuffix(",none"): value for metric, value in scores.items()
                     if isinstance(value, float | int) and metric != "sample_len" and "_stderr" not in metric
                     and not (metric.split(",")[0].isdigit() and value == -1)})  # RULER lengths not asked for
    return results


def format_harness(results: dict) -> str:
    """The table eval.py prints: one line per task, its metrics (RULER's named by the prompt length)."""
    lines = ["lm-evaluation-harness"]
    for task, scores in results.items():
        lines.append(f"  {task:24s} " + "  ".join(f"{metric} {value:.4g}" for metric, value in scores.items()))
    return "\n".join(lines)


class HarnessTask(EvalTask):
    """harness: lm-evaluation-harness tasks (--harness), RULER's at each of --lengths."""

    reads = ("harness", "lengths", "samples", "batch_size", "seed")
    listed = False

    def __init__(self, name: str, setting: Setting) -> None:
        super().__init__(name, setting)
        options = setting.options
        if options.lengths and max(options.lengths) > setting.context:
            raise ValueError(f"--lengths {max(options.lengths)} exceeds the context of {setting.context} tokens the "
                             "harness reads (--context_length, the run's, at most the model's)")
        self.ruler = check_harness_tasks(options.harness)  # seconds: lm-eval's task index
        others = [task for task in setting.tasks if task != name and "lengths" in task_class(task).reads]
        if options.lengths and not self.ruler and not others:
            raise ValueError("--lengths is read only by RULER's --harness tasks among those this call runs: leave it "
                             "out")

    def run(self, model: Transformer, progress: Callable[[int], None]) -> dict:
        s, o = self.setting, self.setting.options
        (s.out_dir / "tokenizer").mkdir(exist_ok=True)
        s.tokenizer.save(s.out_dir / "tokenizer", s.context)  # RULER builds its prompts with it (transformers' format)
        lm = harness_lm(model, s.tokenizer, s.context, o.batch_size)
        lengths = o.lengths or [s.context]
        result = run_harness(lm, o.harness, self.ruler, lengths, s.out_dir / "tokenizer", o.samples, o.seed)
        if not result:
            raise ValueError(f"--harness: no task ran at --lengths {' '.join(map(str, lengths))}, each too short for "
                             "its prompt and answer (see the lines above): pass longer --lengths")
        return result

    def table(self, result: dict) -> str:
        return format_harness(result)
