"""The CLI's arguments: their types and checks, each failing as a UsageError (one line, exit 2)."""

from __future__ import annotations

import argparse
import json
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from ..vllm.requirements import (
    ALLOW_UNSUPPORTED_ENV,
    MIN_COMPUTE_CAPABILITY,
    SUPPORTED_VLLM,
    installed_vllm_version,
    is_supported_vllm,
)

if TYPE_CHECKING:
    from ..vllm.settings import TurboQuantSettings

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
    """argparse type: a preset name, canonical (lower case); the check the settings resolver makes."""
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


def _json_object(text: str) -> dict:
    """argparse type: a JSON object, as vLLM's --additional-config takes it."""
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not JSON ({exc}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object {{\"key\": value, ...}}, got {text!r}")
    return value


def serving_settings(additional_config: Mapping | None = None,
                     environ: Mapping[str, str] | None = None) -> TurboQuantSettings:
    """The settings `vllm serve --attention-backend CUSTOM` resolves from --additional-config and the environment,
    through the backend's own resolver; a bad setting is a UsageError naming it."""
    from ..vllm.settings import resolve_settings

    try:
        return resolve_settings(additional_config, environ)
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def chosen_preset(given: str | None) -> str:
    """--preset if given (its type checked it), else the preset the serving settings choose: $TURBOQUANT_PRESET, else
    tq4."""
    return given or serving_settings().preset.name


ADDITIONAL_CONFIG = "--additional-config"


def config_file_additional_config(vllm_args: list[str]) -> dict:
    """The additional_config of a vLLM `--config FILE` (YAML) among vllm_args, {} without one. vLLM ranks a command
    line's --additional-config above the file's as a whole, so the one serve passes must carry the file's keys."""
    if "--config" not in vllm_args:
        return {}
    at = vllm_args.index("--config")
    if at + 1 == len(vllm_args):
        raise UsageError("--config needs a YAML file")
    path = Path(vllm_args[at + 1]).expanduser()
    try:
        import yaml  # vLLM's own dependency, as is the file's format

        loaded = yaml.safe_load(path.read_text())
    except ImportError:
        raise UsageError(f"--config {path}: reading it needs PyYAML, which vLLM brings: {INSTALL_VLLM}") from None
    except (OSError, yaml.YAMLError) as exc:
        raise UsageError(f"--config {path}: {str(exc).splitlines()[0]}") from None
    found = [v for k, v in (loaded or {}).items() if k.replace("_", "-") == ADDITIONAL_CONFIG[2:]] \
        if isinstance(loaded, dict) else []
    config = found[-1] if found else {}
    if isinstance(config, str):
        try:
            config = _json_object(config)
        except argparse.ArgumentTypeError as exc:
            raise UsageError(f"--config {path}: additional-config: {exc}") from None
    if not isinstance(config, dict):
        raise UsageError(f"--config {path}: additional-config must be a mapping, not {type(config).__name__}")
    return dict(config)


def split_additional_config(vllm_args: list[str]) -> tuple[dict, list[str]]:
    """(vLLM's --additional-config among vllm_args, merged into one object over a --config FILE's; the other
    arguments, --config FILE kept). vLLM takes it as JSON (--additional-config '{"k": v}', or =) or key by key
    (--additional-config.k v, values JSON or text), and reads --additional_config alike."""
    config: dict = config_file_additional_config(vllm_args)
    rest: list[str] = []
    args = iter(vllm_args)
    for arg in args:
        name, eq, value = arg.partition("=")
        head, dot, keys = name.partition(".")
        if head.replace("_", "-") != ADDITIONAL_CONFIG:
            rest.append(arg)
            continue
        if not eq:
            value = next(args, None)
            if value is None:
                raise UsageError(f"{name} needs a value")
        if not dot:
            try:
                config.update(_json_object(value))
            except argparse.ArgumentTypeError as exc:
                raise UsageError(f"{name}: {exc}") from None
            continue
        if keys.endswith("+") or not all(keys.split(".")):
            raise UsageError(f"{name}: give {ADDITIONAL_CONFIG} as one JSON object, or KEY VALUE pairs")
        *parents, last = keys.split(".")
        node = config
        for key in parents:
            if not isinstance(node.get(key), dict):
                node[key] = {}
            node = node[key]
        try:
            node[last] = json.loads(value)
        except ValueError:
            node[last] = value
    return config, rest


def check_head_dim(head_dim: int, presets: list[str]) -> None:
    from ..core.layout import CacheLayout
    from ..core.presets import get_preset

    for name in presets:
        try:
            CacheLayout(get_preset(name), head_dim, 1, 16)
        except ValueError as exc:
            raise UsageError(f"--head-dim {head_dim}: {str(exc).split(';')[0]}") from None


def require_gpu(command: str) -> None:
    """An NVIDIA GPU the backend runs on (compute capability >= 8.0), before vLLM starts and fails without one."""
    import torch

    need = f"{MIN_COMPUTE_CAPABILITY // 10}.{MIN_COMPUTE_CAPABILITY % 10}"
    if not torch.cuda.is_available():
        raise UsageError(f"{command} needs an NVIDIA GPU of compute capability >= {need}, and none is visible here "
                         "(`turboquant-vllm verify --kernels` runs the kernels on a CPU)")
    major, minor = torch.cuda.get_device_capability()
    if major * 10 + minor < MIN_COMPUTE_CAPABILITY:
        raise UsageError(f"{command} needs an NVIDIA GPU of compute capability >= {need}; "
                         f"{torch.cuda.get_device_name()} has {major}.{minor}")


def require_vllm(command: str) -> None:
    version = installed_vllm_version()
    if version is None:
        raise UsageError(f"vLLM is not installed; {command} needs vLLM {SUPPORTED_VLLM}: {INSTALL_VLLM}")
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
