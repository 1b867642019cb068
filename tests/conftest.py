import os

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
