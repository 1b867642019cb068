"""An evaluation task written outside the evaluation package: induction, the accuracy of predicting the second copy
of a random token sequence from the first. It exists to show, and to test, that a new task is one file plus one
registry line; nothing else in the repository names it.

    from evaluation.registry import register_task
    register_task("induction", "examples.eval_task:InductionTask")   # the one registry line
    # then: eval.py CHECKPOINT --tasks induction --lengths 256 512
    # or, without editing anything: eval.py CHECKPOINT --plugin examples.eval_task --tasks induction

A document of T tokens is T/2 random ids (from 8, past the special ones, to the vocabulary's end) repeated once. A
model that copies from its context predicts the second half almost perfectly; one that does not stays near chance.
The result is the accuracy on the second half at each length.

Notation: B documents per batch, T tokens per document, C width.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from evaluation.registry import EvalTask, Setting, register_task
from model import Transformer


class InductionTask(EvalTask):
    """induction: next-token accuracy on the second copy of a repeated random token sequence."""

    reads = ("lengths", "samples", "batch_size", "seed")
    unit = "document"

    def __init__(self, name: str, setting: Setting) -> None:
        super().__init__(name, setting)
        lengths = setting.options.lengths or [setting.context]
        if max(lengths) > setting.context:
            raise ValueError(f"--lengths {max(lengths)} does not fit the context of {setting.context} tokens")
        self.lengths = [n - n % 2 for n in lengths]  # two equal halves

    @property
    def work(self) -> int:
        return len(self.lengths) * self.setting.options.samples

    def run(self, model: Transformer, progress: Callable[[int], None]) -> dict:
        o, device, vocab = self.setting.options, model.embed_tokens.weight.device, self.setting.tokenizer.vocab_size
        accuracy = []
        for length in self.lengths:
            generator = torch.Generator().manual_seed(o.seed * 1_000_003 + length)
            right = 0
            for b0 in range(0, o.samples, o.batch_size):
                n = min(o.batch_size, o.samples - b0)
                half = torch.randint(8, vocab, (n, length // 2), generator=generator)  # (B, T/2)
                ids = torch.cat([half, half], 1).to(device)  # (B, T)
                with torch.no_grad():
                    hidden = model.hidden_states(ids)[:, length // 2 - 1:-1]  # (B, T/2, C): predicts the second half
                    right += (model.logits(hidden).argmax(-1) == ids[:, length // 2:]).sum().item()
                progress(n)
            accuracy.append(right / (o.samples * length // 2))
        return {"lengths": self.lengths, "samples": o.samples, "accuracy": accuracy}

    def table(self, result: dict) -> str:
        lines = [f"induction: second-half accuracy, {result['samples']} documents per length", f"{'length':>8} "
                 f"{'accuracy':>9}"]
        return "\n".join(lines + [f"{n:>8} {a:>9.1%}" for n, a in zip(result["lengths"], result["accuracy"],
                                                                        strict=True)])

    def meaning(self, result: dict) -> str:
        return f"=> {max(result['accuracy']):.0%} at best: how much the model copies from its context"


def register() -> None:
    """What `--plugin examples.eval_task` calls: the one registry line."""
    register_task("induction", InductionTask)
