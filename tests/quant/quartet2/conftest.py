"""Fixtures of the quartet2 tests."""

import pytest

from tests.conftest import DEVICE


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    """vLLM's weight parameters ask for the tensor-parallel rank: a group of one process, as TP 1 has."""
    from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.distributed.parallel_state import model_parallel_is_initialized

    if not model_parallel_is_initialized():
        with set_current_vllm_config(VllmConfig(device_config=DeviceConfig(device=DEVICE))):
            init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                         distributed_init_method=f"file://{tmp_path_factory.mktemp('pg')}/init")
            initialize_model_parallel(1)
