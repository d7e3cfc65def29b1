"""The serving summary, benchmarks/results/serving/soak.json, that two GPU scripts fill:

    {"rows": [{"kv", "requests", "failed", "preemptions", "ttft_p99_ms", "tpot_p50_ms", "output_tok_s", ...}],
     "spec_decode": [{"kv", "method", "prompts", "identical", "acceptance_rate", ...}],
     "meta": {"rows": <provenance of the soak run>, "spec_decode": <provenance of the spec-decode run>}}

test_gpu_soak writes "rows" (one per KV cache), test_gpu_spec_decode "spec_decode" (one per KV cache and method);
each merges its part into the file, keeping the other's and its own entries of other keys (merge_summary). Also the
Prometheus counters both read from /metrics text.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from tests.serving.test_gpu_openai_server import metric_values

PARTS = {"rows": ("kv",), "spec_decode": ("kv", "method")}
KV_ORDER = ("tq4", "tq3", "bf16")


def summary_path() -> Path:
    from benchmarks import common

    return common.RESULTS / "serving" / "soak.json"


def entry_key(part: str, entry: dict) -> tuple:
    return tuple(entry.get(k) for k in PARTS[part])


def entry_order(entry: dict) -> tuple:
    kv = entry.get("kv")
    return (KV_ORDER.index(kv) if kv in KV_ORDER else len(KV_ORDER), str(kv), str(entry.get("method", "")))


def merge_summary(doc: dict | None, part: str, entries: list[dict], meta: dict | None = None) -> dict:
    """doc (soak.json as read, or None) with `entries` in `part`: an entry replaces the one of its key (kv; kv and
    method), the rest of the part and the other part stay; `meta` becomes meta[part]."""
    if part not in PARTS:
        raise ValueError(f"unknown part {part!r}; one of {sorted(PARTS)}")
    for e in entries:
        missing = [k for k in PARTS[part] if e.get(k) is None]
        if missing:
            raise ValueError(f"{part} entry without {missing}: {e}")
    doc = {"rows": [], "spec_decode": [], **(doc or {})}
    new = {entry_key(part, e): e for e in entries}
    kept = [e for e in doc[part] if entry_key(part, e) not in new]
    doc[part] = sorted(kept + list(new.values()), key=entry_order)
    if meta is not None:
        doc["meta"] = {**doc.get("meta", {}), part: meta}
    return doc


def read_summary(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.exists() else None


def write_summary(path: Path, part: str, entries: list[dict], meta: dict | None = None) -> dict:
    """Merge entries into the summary file at path (read just before writing) and write it whole via a temporary
    file, so a concurrent reader never sees half a file."""
    doc = merge_summary(read_summary(path), part, entries, meta)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(doc, indent=1) + "\n")
    tmp.replace(path)
    return doc


def counter(text: str, name: str, **labels: str) -> float:
    """A counter's value summed over engines (and other labels): name as Prometheus exposes it (..._total)."""
    return sum(metric_values(text, name, **labels))
