"""The numeric tests hold on every set of CPU kernels PyTorch dispatches to, not only on this machine's.

PyTorch picks its vectorised CPU kernels at start-up by the instructions the CPU has (AVX-512 on a Xeon, AVX2 on an
AMD EPYC or a laptop, none under ATEN_CPU_CAPABILITY=default); each rounds float32 sums in its own order. A
tolerance tuned to one of them fails on another, so these tests run a sample of the numeric tests (parity with
lm-evaluation-harness, transformers and float64 references, decode against prefill, the chunked loss, RoPE, NSA
against its reference) in a fresh process under each capability this CPU can run besides its own: "avx2" and the
scalar "default"."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
SAMPLE = [
    "tests/test_lm_eval.py::test_lm_eval_scores_the_export_as_the_project_does[full]",
    "tests/test_hf.py::test_load_matches_transformers",
    "tests/test_hf.py::test_rope_scaling_matches_transformers",
    "tests/test_model.py::test_logits_match_float64_reference",
    "tests/test_model.py::test_causality_future_tokens_never_change_past_logits",
    "tests/test_generate.py::test_decode_logits_equal_full_forward",
    "tests/test_loss.py::test_matches_float64_reference",
    "tests/test_loss.py::test_model_chunked_equals_standard_and_rowwise_reference",
    "tests/test_rope.py",
    "tests/test_nsa.py::test_sparse_attention_matches_naive",
    "tests/test_nsa.py::test_chunk_threads_match_naive_and_repeat_bitwise",
]


@pytest.mark.slow
@pytest.mark.parametrize("capability", ["avx2", "default"])
def test_numeric_sample_passes_under_other_cpu_kernels(capability: str):
    env = {**os.environ, "ATEN_CPU_CAPABILITY": capability}
    check = subprocess.run([sys.executable, "-c", "import torch; print(torch.backends.cpu.get_cpu_capability())"],
                           env=env, capture_output=True, text=True, check=True)
    if check.stdout.strip().lower() != capability:
        pytest.skip(f"this CPU cannot run the {capability} kernels (PyTorch chose {check.stdout.strip()})")
    if torch.backends.cpu.get_cpu_capability().lower() == capability:
        pytest.skip(f"the {capability} kernels are this machine's own: the suite itself runs them")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "", *SAMPLE],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
