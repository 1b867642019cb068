"""The documents task: the log-likelihood of each document of --documents (.jsonl with a "text" field, or text
files), each read after the end-of-document id as training shows them, and bits per byte over all.
lm-evaluation-harness's `loglikelihood_rolling` computes the same numbers on the Hugging Face export (`lm_eval --model
hf`), whose tokenizer has no bos token (lm_eval then starts a document with eos, as here).

Notation: T tokens per document, C width, V vocabulary.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

from evaluation.loss import LOSS_CHUNK
from evaluation.registry import EvalTask, Setting
from model import Transformer
from text.corpus import find_input_files, iter_documents
from text.tokenizer import HFTokenizer, Tokenizer


def document_loglikelihoods(model: Transformer, tokenizer: Tokenizer | HFTokenizer, texts: list[str],
                            progress: Callable[[int], None] | None = None) -> dict:
    """Each text's log-likelihood (natural log): the sum over its tokens of log p(token | the end-of-document id
    and the text's earlier tokens), one forward per document, logits for LOSS_CHUNK positions at a time.
    {"documents": [{"tokens", "bytes", "loglikelihood"}], "loglikelihood", "bits_per_byte"} (the totals over all
    documents)."""
    device = model.embed_tokens.weight.device
    documents = []
    with torch.no_grad():
        for text in texts:
            ids = torch.tensor([tokenizer.eod_id, *tokenizer.encode(text)], device=device)  # (T + 1,)
            hidden = model.hidden_states(ids[None, :-1])[0]  # (T, C)
            total = torch.zeros((), dtype=torch.float64, device=device)
            for p0 in range(0, len(hidden), LOSS_CHUNK):  # logits for LOSS_CHUNK positions at a time
                logits = model.logits(hidden[p0:p0 + LOSS_CHUNK])  # (P, V)
                logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
                total -= F.cross_entropy(logits, ids[p0 + 1:p0 + 1 + LOSS_CHUNK], reduction="sum").double()
            documents.append({"tokens": len(ids) - 1, "bytes": len(text.encode("utf-8")),
                              "loglikelihood": total.item()})
            if progress is not None:
                progress(1)
    total = sum(d["loglikelihood"] for d in documents)
    return {"documents": documents, "loglikelihood": total,
            "bits_per_byte": -total / math.log(2) / max(1, sum(d["bytes"] for d in documents))}


def read_documents(path: str, tokenizer: Tokenizer | HFTokenizer, context: int) -> list[str]:
    """The non-empty documents of `path` (text.corpus.find_input_files); ValueError for one whose tokens and the
    end-of-document id before them exceed `context`."""
    texts = [text for text in iter_documents(find_input_files([path])) if text.strip()]
    if not texts:
        raise ValueError(f"--documents {path} holds no non-empty document: nothing to score")
    for i, text in enumerate(texts):
        if (n := len(tokenizer.encode(text))) + 1 > context:
            raise ValueError(f"--documents {path}: document {i} has {n} tokens, more than the context of {context} "
                             "holds after the end-of-document id; shorten it or raise --context_length")
    return texts


def format_documents(result: dict) -> str:
    lines = [f"documents: {len(result['documents'])}, log-likelihood {result['loglikelihood']:.4f}, "
             f"{result['bits_per_byte']:.4f} bits per byte", f"{'document':>8} {'tokens':>7} {'log-likelihood':>15}"]
    lines += [f"{i:>8} {d['tokens']:>7} {d['loglikelihood']:>15.4f}" for i, d in enumerate(result["documents"])]
    return "\n".join(lines)


class DocumentsTask(EvalTask):
    """documents: the log-likelihood and bits per byte of each document of --documents."""

    reads = ("documents",)

    def __init__(self, name: str, setting: Setting) -> None:
        super().__init__(name, setting)
        if not setting.options.documents:
            raise ValueError("the documents task needs --documents FILE (.jsonl with a \"text\" field, or text files)")
        self.texts = read_documents(setting.options.documents, setting.tokenizer, setting.context)

    @property
    def work(self) -> int:
        return len(self.texts)

    def run(self, model: Transformer, progress: Callable[[int], None]) -> dict:
        return document_loglikelihoods(model, self.setting.tokenizer, self.texts, progress) | {
            "file": self.setting.options.documents}

    def table(self, result: dict) -> str:
        return format_documents(result)
