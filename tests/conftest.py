import os

import pytest
import torch

if not torch.cuda.is_available():  # Triton kernels (nsa_triton.py) run in Triton's interpreter; read at their import
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def _seed_and_restore_dtype():
    """Every test starts from the same RNG state and leaves the global default dtype untouched."""
    torch.manual_seed(0)
    dtype = torch.get_default_dtype()
    yield
    torch.set_default_dtype(dtype)
