"""The CLI's arguments: their types and checks, each failing as a UsageError (one line, exit 2)."""

from __future__ import annotations

import argparse
import os
import re
from pathlib import Path

from ..vllm.requirements import ALLOW_UNSUPPORTED_ENV, SUPPORTED_VLLM, installed_vllm_version, is_supported_vllm

INSTALL_VLLM = f'pip install "vllm{SUPPORTED_VLLM}" (or, in this project\'s source tree, pip install ".[vllm]")'


class UsageError(Exception):
    """A bad argument or setting: main() prints it as one line and returns 2."""


class Parser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse's usage errors: one line too, no usage block
        raise UsageError(f"{self.prog}: error: {message} (see {self.prog} --help)")


# ----------------------------------------------------------------------------------------------------------------
# Arguments
# ----------------------------------------------------------------------------------------------------------------

def preset_names() -> list[str]:
    from ..core.presets import PRESETS

    return list(PRESETS)


def _preset(text: str) -> str:
    """argparse type: a preset name, canonical (lower case)."""
    from ..core.presets import get_preset

    try:
        return get_preset(text).name
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _presets(text: str) -> list[str]:
    return [_preset(name) for name in text.split(",")]


def _positive(kind):
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            what = "an integer" if kind is int else "a number"
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if not value > 0:
            raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
        return value
    return parse


def _fraction(text: str) -> float:
    value = _positive(float)(text)
    if value > 1:
        raise argparse.ArgumentTypeError(f"expected a fraction in (0, 1], got {text!r}")
    return value


def _int_pairs(sep: str, what: str):
    """argparse type: "AxB[,CxD...]" (sep "x") or "A/B" (sep "/") of positive integers, with a usage error otherwise."""
    def parse(text: str) -> list[tuple[int, int]] | tuple[int, int]:
        try:
            pairs = [tuple(int(x) for x in item.split(sep)) for item in text.split(",")]
            if any(len(p) != 2 or min(p) < 1 for p in pairs):
                raise ValueError
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        return pairs if sep == "x" else pairs[0]
    return parse


def resolve_preset(given: str | None) -> str:
    """--preset if given, else $TURBOQUANT_PRESET, else tq4; an unknown name in the environment is a usage error."""
    from ..core.presets import DEFAULT_PRESET
    from ..vllm.settings import PRESET_ENV

    if given:
        return given
    env = os.environ.get(PRESET_ENV, "").strip()
    if not env:
        return DEFAULT_PRESET
    try:
        return _preset(env)
    except argparse.ArgumentTypeError as exc:
        raise UsageError(f"{PRESET_ENV}={env!r}: {exc}") from None


def check_head_dim(head_dim: int, presets: list[str]) -> None:
    from ..core.layout import CacheLayout
    from ..core.presets import get_preset

    for name in presets:
        try:
            CacheLayout(get_preset(name), head_dim, 1, 16)
        except ValueError as exc:
            raise UsageError(f"--head-dim {head_dim}: {str(exc).split(';')[0]}") from None


def require_vllm(command: str) -> None:
    version = installed_vllm_version()
    if version is None:
        raise UsageError(f"vLLM is not installed; {command} needs vLLM 0.25 ({SUPPORTED_VLLM}): {INSTALL_VLLM}")
    if not is_supported_vllm(version) and os.environ.get(ALLOW_UNSUPPORTED_ENV) != "1":
        raise UsageError(f"vLLM {version} is installed; turboquant-vllm supports vLLM {SUPPORTED_VLLM}: "
                         f'pip install "vllm{SUPPORTED_VLLM}" ({ALLOW_UNSUPPORTED_ENV}=1 skips this check)')


def looks_like_path(model: str) -> bool:
    """A hub id is ORG/NAME or NAME; anything else (./x, /x, ~/x, a/b/c, a\\b, x/) is a local path."""
    return (model.startswith((".", "/", "~")) or model.count("/") > 1 or "\\" in model or model.endswith("/")
            or re.match(r"^[A-Za-z]:", model) is not None)


def check_model(model: str, need_config: bool) -> None:
    path = Path(model).expanduser()
    if path.exists():
        if need_config and path.is_dir() and not ((path / "config.json").exists() or (path / "params.json").exists()):
            raise UsageError(f"model {model}: the directory has no config.json; give a model directory or a "
                             "Hugging Face hub id (ORG/NAME)")
        return
    if looks_like_path(model):
        raise UsageError(f"model {model}: no such file or directory; give a local model directory (with "
                         "config.json) or a Hugging Face hub id (ORG/NAME)")
