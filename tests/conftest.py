import os
from pathlib import Path

import pytest
import torch

# The Triton kernels (nsa/kernels.py) run in Triton's interpreter in this process, on any machine (read when the module
# is imported); on a GPU, test_triton_kernels_on_gpu runs them for real in a subprocess.
os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def _seed_and_restore_dtype():
    """Every test starts from the same RNG state and leaves the global default dtype untouched."""
    torch.manual_seed(0)
    dtype = torch.get_default_dtype()
    yield
    torch.set_default_dtype(dtype)


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 512-token tokenizer (the tiny preset's vocabulary) and ~30 standard-library files of tokens."""
    from data import iter_documents, prepare, stdlib_files
    from tokenizer import Tokenizer

    root = tmp_path_factory.mktemp("data")
    files = stdlib_files()[:30]
    tokenizer = Tokenizer.train(iter_documents(files), 512, root / "tokenizer", max_train_bytes=300_000)
    prepare(files, tokenizer, root, progress=False)
    return root


@pytest.fixture
def swa():
    """The test-only sliding-window attention registered as "swa" for one test (removed after)."""
    from config import ATTENTION_TYPES, attention_class, register_attention

    register_attention("swa", "sliding_window_attention:SlidingWindowAttention")
    yield attention_class("swa")
    del ATTENTION_TYPES["swa"]
