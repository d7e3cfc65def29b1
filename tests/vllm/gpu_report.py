"""What the real-vLLM GPU checks (tests/vllm/test_gpu_*.py) share: the Triton kernels of ours that must never compile
inside a request, and running a module's checks as a script on a GPU machine whose image may lack pytest."""

from __future__ import annotations

import json
import sys
from typing import Callable

OUR_KERNELS = ("_store_kv_kernel", "_dequant_kernel", "_attention_kernel", "_decode_kernel", "_rotate_queries_kernel",
               "_merge_and_unrotate_kernel", "_merge_splits_kernel", "_spread_rotation_kernel")


def module_checks(namespace: dict) -> dict[str, Callable[[], object]]:
    """A module's test_* functions by name."""
    return {name: f for name, f in namespace.items() if name.startswith("test_") and callable(f)}


def run_checks(checks: dict[str, Callable[[], object]], words: list[str]) -> dict[str, str]:
    """Each check whose name holds one of words (every check without words): "ok" or "FAIL <error>"."""
    report = {}
    for name, check in checks.items():
        if words and not any(w in name for w in words):
            continue
        try:
            check()
            report[name] = "ok"
        except Exception as exc:  # noqa: BLE001 - a report, not a test runner
            report[name] = f"FAIL {type(exc).__name__}: {str(exc)[:1500]}"
    return report


def exit_with(report: dict[str, str], **details) -> None:
    """Print the report (and details) as JSON; exit 0 only if checks ran and all passed."""
    print(json.dumps({"tests": report, **details}, indent=1))
    sys.exit(0 if report and all(v == "ok" for v in report.values()) else 1)
