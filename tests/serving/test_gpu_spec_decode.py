"""GPU: speculative decoding on tq4 (n-gram, decode CUDA graphs) gives greedy decoding's tokens, within the rounding
control (benchmarks.serving_spec_decode's quick comparison, with the FLASH_ATTN bf16 and fp8 controls; skipped without
CUDA, the converted SmolLM2-135M-Instruct directory or text data). The report over presets and methods, with
acceptance rates and speed-ups, is the benchmark: python -m benchmarks serving_spec_decode --model DIR.

    TURBOQUANT_SMOLLM2_DIR=DIR python -m pytest -m gpu tests/serving/test_gpu_spec_decode.py
"""

import os

import pytest

from benchmarks import serving_common as sc
from benchmarks import serving_spec_decode as spec

pytestmark = pytest.mark.gpu


def test_spec_decode_matches_greedy_quick(tmp_path):
    model = os.environ.get(sc.MODEL_ENV)
    why = sc.missing_model(model) or sc.missing_text_data()
    if why:
        pytest.skip(why)
    args = spec.parse_args(["--quick", "--kv", "tq4", "--model", model, "--logs", str(tmp_path / "logs")])
    entries = spec.run(args, "pytest tests/serving/test_gpu_spec_decode.py", write=False)
    ours = [e for e in entries if e["kv"] not in spec.CONTROLS]
    assert ours, entries
    for e in ours:  # a refusal at startup names its reason; a run gives greedy's tokens
        assert e["passed"] or (e["refused_at_startup"] and e["error"]), (
            spec.summary_entry(e, ""), [spec.summary_entry(c, "") for c in entries if c["kv"] in spec.CONTROLS])
