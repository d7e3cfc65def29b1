"""tests.vllm.gpu_report: the GPU checks' script mode (a report per check, the exit status)."""

import json

import pytest

from tests.vllm.gpu_report import exit_with, module_checks, run_checks


def test_checks_run_by_name_and_report(capsys):
    def passes():
        pass

    def fails():
        raise ValueError("boom")

    checks = module_checks({"test_a": passes, "test_b": fails, "test_c": passes, "helper": passes, "test_x": 3})
    assert list(checks) == ["test_a", "test_b", "test_c"]
    report = run_checks(checks, ["a", "b"])
    assert report == {"test_a": "ok", "test_b": "FAIL ValueError: boom"}
    for got, status in ((report, 1), ({}, 1), ({"test_a": "ok"}, 0)):  # no check run is a failure too
        with pytest.raises(SystemExit) as stop:
            exit_with(got, logs="/tmp/x")
        assert stop.value.code == status
        assert json.loads(capsys.readouterr().out) == {"tests": got, "logs": "/tmp/x"}
