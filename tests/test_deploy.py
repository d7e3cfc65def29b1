"""The container image and its Podman Quadlet unit agree with the package: the vLLM they build on is the one the
plugin supports, they install what the package needs, and the unit runs that image on local ports only."""

import configparser
import re
from pathlib import Path

from turboquant_vllm.core.presets import PRESETS
from turboquant_vllm.vllm.requirements import SUPPORTED_VLLM, is_supported_vllm

ROOT = Path(__file__).resolve().parents[1]


def containerfile() -> str:
    return (ROOT / "Containerfile").read_text()


def test_image_builds_on_a_supported_vllm_and_the_tested_one():
    tag = re.search(r"^FROM docker\.io/vllm/vllm-openai:v(\S+)$", containerfile(), re.M).group(1)
    assert is_supported_vllm(tag)
    pinned = re.search(r'"vllm==([^"]+)"', (ROOT / "pyproject.toml").read_text()).group(1)
    assert tag == pinned, "the image should run the vLLM the tests pin"


def test_vllm_extra_is_the_supported_range():
    text = (ROOT / "pyproject.toml").read_text()
    extra = re.search(r"^vllm = \[(.*)\]$", text, re.M).group(1)
    assert extra == f'"vllm{SUPPORTED_VLLM}"'


def test_image_copies_what_pip_install_needs_and_serves_through_the_cli():
    text = containerfile()
    for path in re.findall(r"^COPY (.+) /opt/turboquant-vllm/?\S*$", text, re.M):
        for part in path.split():
            assert (ROOT / part).exists(), part
    assert "pyproject.toml" in text and "COPY src " in text
    # the build fails if vLLM would not see the plugin: the entry point the image checks is the package's
    assert "entry_points(group='vllm.general_plugins')" in text
    entry_point = re.search(r'^turboquant = "(\S+)"$', (ROOT / "pyproject.toml").read_text(), re.M).group(1)
    assert entry_point == "turboquant_vllm.plugins:register" and f"e.value == '{entry_point}'" in text
    assert "turboquant-vllm verify" in text
    assert re.search(r'^ENTRYPOINT \["turboquant-vllm", "serve"\]$', text, re.M)
    preset = re.search(r"^ENV TURBOQUANT_PRESET=(\S+)$", text, re.M).group(1)
    assert preset in PRESETS
    ignored = (ROOT / ".containerignore").read_text().split()
    assert ignored[0] == "*" and {"!pyproject.toml", "!README.md", "!LICENSE", "!src"} <= set(ignored)
    assert re.search(r"^COPY .*\bLICENSE\b", text, re.M)  # pyproject's license-files: the build needs it


def test_quadlet_runs_the_image_on_local_ports_with_a_known_preset():
    unit = configparser.ConfigParser(strict=False, interpolation=None, comment_prefixes=("#",))
    unit.optionxform = str  # keys are case-sensitive
    unit.read(ROOT / "deploy" / "turboquant-vllm.container")
    c = unit["Container"]
    assert c["Image"] == "localhost/turboquant-vllm:latest"
    assert "podman build -t turboquant-vllm" in containerfile()
    assert c["PublishPort"].startswith("127.0.0.1:")
    assert c["AddDevice"] == "nvidia.com/gpu=all"
    env = dict(line.split("=", 1) for line in c["Environment"].split("\n"))
    assert env["TURBOQUANT_PRESET"] in PRESETS
    assert c["Exec"].split()[0].count("/") == 1  # a model id first: the entry point is `turboquant-vllm serve`
    assert "/health" in c["HealthCmd"] and unit["Install"]["WantedBy"] == "default.target"
