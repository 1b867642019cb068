"""The figures the README's first screen and its "Will it fit?" print, and the memory table of docs/memory.md, are
what the code computes now, within 1%: a stale figure fails here. (Times, and what was measured on a GPU, are
measurements named with their machine and command in benchmarks/results/, which a CPU cannot rerun.)"""

from __future__ import annotations

import math
import re
import sys
from pathlib import Path

import pytest
import torch

from model import Transformer
from modeling.config import GiB, ModelConfig
from training import estimate as pm
from training.options import BATCH_TOKENS, LONG_CONTEXT, OFFLOAD_SHARE, TILED_FFN_CHUNK, TOKENIZER_VOCAB, TrainConfig

ROOT = Path(__file__).resolve().parent.parent
README = " ".join((ROOT / "README.md").read_text().split())  # figures may wrap lines
HEADLINE = dict(context_length=131072, world_size=2, gpu_memory_gib=80)
ONE_GPU = dict(model_size="4B", context_length=131072, attention_type="nsa")


def figure(pattern: str) -> float:
    """The number the README prints where `pattern` (a regex with one group) matches, once."""
    found = re.findall(pattern, README)
    assert len(found) == 1, f"{pattern!r} matches {len(found)} times in README.md: the test is stale"
    return float(found[0].replace(",", ""))


def test_the_first_screens_figures():
    defaults = TrainConfig()
    with torch.device("meta"):
        demo = Transformer(ModelConfig.from_preset("demo", vocab_size=TOKENIZER_VOCAB))
    checks = [
        (r"\(([\d.]+) GiB in bf16 at 131k tokens otherwise\)", 131072 * 151936 * 2 / GiB),
        (r"trains an (\d+)-token SentencePiece tokenizer", TOKENIZER_VOCAB),
        (r"trains the `demo` model \(([\d.]+)M parameters\)", demo.num_parameters() / 1e6),
        (r"for (\d+) steps of \d+ x \d+ tokens", defaults.max_steps),
        (r"steps of (\d+) x \d+ tokens", BATCH_TOKENS // defaults.context_length),
        (r"steps of \d+ x (\d+) tokens", defaults.context_length),
        (r"the loss starts at ([\d.]+) = ln 8192", math.log(TOKENIZER_VOCAB)),
        (r"from (\d+)k tokens train.py turns on NSA", LONG_CONTEXT / 1024),
        (r"FFN tiles of (\d+) and the chunked loss", TILED_FFN_CHUNK),
        (r"when they would take over (\d+)% of the GPU", OFFLOAD_SHARE * 100),
    ]
    for pattern, value in checks:
        assert figure(pattern) == pytest.approx(value, rel=0.01, abs=0.005), pattern


@pytest.mark.slow
def test_will_it_fit_figures():
    """The headline's estimate (2 GPUs of 80 GB: offload on) and the one-GPU 4B estimate, as the README's
    commands print them."""
    headline = pm.estimate(pm.StepConfig.of(**HEADLINE))
    one_gpu = pm.estimate(pm.StepConfig.of(**ONE_GPU))
    assert figure(r"needs \*\*([\d.]+) GiB\*\* per GPU") == pytest.approx(headline["peak"]["total"] / GiB, rel=0.01)
    assert figure(r"pinned host memory \(([\d.]+) GiB per GPU\)") == pytest.approx(
        headline["peak"]["host"] / GiB, rel=0.01)
    assert figure(r"On one GPU the same model needs ([\d.]+) GiB without offload") == pytest.approx(
        one_gpu["peak"]["total"] / GiB, rel=0.01)


@pytest.mark.slow
def test_memory_table_rows_are_what_memory_table_prints():
    """A sample of docs/memory.md's table (benchmarks/memory_table.py regenerates all of it): every recipe of the
    4,096-token full-attention row on one GPU, within 1% (the table rounds to 0.1 GiB). The README's one-GPU
    figure above is the 131k NSA row's last recipe."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import memory_table

    table = (ROOT / "docs" / "memory.md").read_text()
    row = memory_table.table_row("4B", 4096, 1, "full")
    printed = next(line for line in table.splitlines() if line.startswith("| 4,096 | 1 | full |"))
    ours, theirs = ([float(c) for c in line.strip("| ").split(" | ")[4:7]] for line in (row, printed))
    assert theirs == pytest.approx(ours, rel=0.01, abs=0.05), (printed, row)
