"""GPU: a short soak of `vllm serve` on tq4 under vLLM's own `vllm bench serve` (benchmarks.serving_soak's quick
settings, 200 requests; skipped without CUDA, the converted SmolLM2-135M-Instruct directory or text data): no failed
request, preemptions, GPU memory flat after the warm-up, the same greedy tokens after the load, the cache idle and the
server healthy after it. The full soak of every KV cache, with its latency table against bf16, is the benchmark:
python -m benchmarks serving_soak --model DIR.

    TURBOQUANT_SMOLLM2_DIR=DIR python -m pytest -m gpu tests/serving/test_gpu_soak.py
"""

import os

import pytest

from benchmarks import serving_common as sc
from benchmarks import serving_soak as soak

pytestmark = pytest.mark.gpu


def test_short_soak(tmp_path):
    model = os.environ.get(sc.MODEL_ENV)
    why = sc.missing_model(model) or sc.missing_text_data()
    if why:
        pytest.skip(why)
    args = soak.parse_args(["--quick", "--kv", "tq4", "--requests", "200", "--model", model,
                            "--logs", str(tmp_path / "logs")])
    (row,) = soak.run(args, "pytest tests/serving/test_gpu_soak.py", write=False)
    assert row["passed"], {k: row.get(k) for k in ("checks", "error", "failed", "preemptions", "memory")}
