import os

import pytest
import torch

# Without a GPU the Triton kernels run through Triton's interpreter; it reads this at import time.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# The whole randomized kernel matrix runs on the GPU; the CPU (interpreter) runs a subset.
FULL_MATRIX = torch.cuda.is_available() or os.environ.get("TQ_FULL_MATRIX") == "1"


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
