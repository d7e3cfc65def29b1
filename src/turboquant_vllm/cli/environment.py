"""What `turboquant-vllm verify` reports besides the math: is the turboquant_vllm Python imports this project's
(PyPI's "turboquant-vllm" is another project with the same import name), which vLLM, which GPU, and what `vllm serve`
would make of the TurboQuant settings found."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
from pathlib import Path

from .. import PROJECT_MARK, __version__
from ..vllm.requirements import MIN_COMPUTE_CAPABILITY, SUPPORTED_VLLM, installed_vllm_version, is_supported_vllm
from .arguments import INSTALL_VLLM, UsageError, serving_settings

DIST_NAME = "turboquant-vllm"
# pyproject's description starts so; PyPI's "turboquant-vllm" (another project, same import name) says otherwise.
SUMMARY_PREFIX = "TurboQuant-compressed KV cache for vLLM"
ENTRY_POINT = "turboquant_vllm.plugins:register"  # our one vllm.general_plugins entry point


def is_ours(package_dir: Path) -> bool:
    """This project's package directory: its __init__.py carries PROJECT_MARK (read, never imported)."""
    try:
        text = (package_dir / "__init__.py").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return False
    return f"PROJECT_MARK = {PROJECT_MARK!r}" in text or f'PROJECT_MARK = "{PROJECT_MARK}"' in text


def imported_package_dir() -> Path | None:
    """Where `python` started here (this interpreter, directory and environment) finds turboquant_vllm: what vLLM's
    processes and `python -m` import; the current directory comes first there, unlike in a console script."""
    probe = ("import importlib.util as u; s = u.find_spec('turboquant_vllm'); "
             "print(s.origin if s is not None and s.origin else '')")
    try:
        out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    origin = out.stdout.strip()
    return Path(origin).resolve().parent if origin else None


def package_check() -> tuple[bool, list[str], dict]:
    """(ok, report lines, JSON record) on the package Python imports and the distribution metadata vLLM reads."""
    here = Path(__file__).resolve().parents[1]  # the turboquant_vllm package
    lines, problems, notes = [], [], []
    foreign_hint = ("PyPI's turboquant-vllm is a different project with the same import name: uninstall it "
                    "(pip uninstall turboquant-vllm) or take it off the path, then install this project from its "
                    "source tree or wheel")
    imported = imported_package_dir()
    if not is_ours(here):
        problems.append(f"the turboquant_vllm package at {here} is not this project's (its __init__.py lacks this "
                        f"project's mark: files of another project over it?); {foreign_hint}")
    if imported is None:
        notes.append("could not ask a fresh `python` which turboquant_vllm it imports")
    elif imported != here:
        if is_ours(imported):
            notes.append(f"`python` here imports another copy of turboquant-vllm, at {imported} (this one: {here})")
        else:
            problems.append(f"the turboquant_vllm that `python` imports here is not this project's: {imported}; "
                            f"{foreign_hint}")
    try:
        dist = importlib.metadata.distribution(DIST_NAME)
    except importlib.metadata.PackageNotFoundError:
        dist = None
        notes.append(f"no installed {DIST_NAME} distribution (a source tree on the path?): vLLM finds the plugin "
                     "only through an installed package's entry point (pip install -e .)")
    if dist is not None:
        summary = dist.metadata.get("Summary") or ""
        where = dist.locate_file("")
        if not summary.startswith(SUMMARY_PREFIX):
            home = dist.metadata.get("Home-page") or dist.metadata.get("Project-URL") or ""
            problems.append(f"the installed {DIST_NAME} distribution is not this project's: version {dist.version} "
                            f"at {where} ({summary!r}{', ' + home if home else ''}); {foreign_hint}")
        elif not any(e.group == "vllm.general_plugins" and e.value == ENTRY_POINT for e in dist.entry_points):
            problems.append(f"the installed {DIST_NAME} {dist.version} at {where} has no vllm.general_plugins "
                            f"entry point {ENTRY_POINT}: reinstall it (pip install -e . or the wheel)")
    version = dist.version if dist is not None else __version__
    if not problems:
        lines.append(f"package: turboquant-vllm {version} at {here} (this project's)")
    lines += [f"error: {p}" for p in problems] + [f"note: {n}" for n in notes]
    record = {"version": version, "location": str(here), "imported": str(imported) if imported else None,
              "ok": not problems, "problems": problems, "notes": notes}
    return not problems, lines, record


def environment_report() -> tuple[list[str], dict]:
    """vLLM, GPU and the optional native kernel: what serving needs, reported by verify (never a failure: verify runs
    anywhere)."""
    import torch

    version = installed_vllm_version()
    if version is None:
        vllm_line = f"vLLM: not installed (serve and calibrate need vLLM {SUPPORTED_VLLM}: {INSTALL_VLLM})"
    elif is_supported_vllm(version):
        vllm_line = f"vLLM: {version} (supported: {SUPPORTED_VLLM})"
    else:
        vllm_line = f"vLLM: {version}, NOT supported (turboquant-vllm supports {SUPPORTED_VLLM})"
    need = f"{MIN_COMPUTE_CAPABILITY // 10}.{MIN_COMPUTE_CAPABILITY % 10}"
    gpu = None
    if torch.cuda.is_available():
        cap = torch.cuda.get_device_capability()
        gpu = {"name": torch.cuda.get_device_name(), "compute_capability": f"{cap[0]}.{cap[1]}",
               "supported": cap[0] * 10 + cap[1] >= MIN_COMPUTE_CAPABILITY}
        gpu_line = (f"GPU: {gpu['name']}, compute capability {gpu['compute_capability']} "
                    f"({'supported' if gpu['supported'] else f'NOT supported: serving needs >= {need}'})")
    else:
        gpu_line = (f"GPU: none visible (demo runs the kernels in Triton's interpreter; serving needs an NVIDIA GPU "
                    f"of compute capability >= {need})")
    # no Triton import: verify --kernels may yet need its interpreter
    from ..quant.quartet2.kernels.marlin_mma import native

    library = native.library_path()
    native = str(library) if library.exists() else None
    native_line = (f"quartet2 few-token kernel: built ({library})" if native else
                   "quartet2 few-token kernel: not built (optional, -q quartet2's GEMMs of 1-8 tokens (decode steps); "
                   "python -m turboquant_vllm.quant.quartet2.kernels.marlin_mma build, with nvcc)")
    return [vllm_line, gpu_line, native_line], {"vllm": version,
                                                "vllm_supported": bool(version and is_supported_vllm(version)),
                                                "gpu": gpu, "quartet2_few_token_kernel": native}


def settings_report(additional_config: dict | None) -> tuple[list[str], dict]:
    """The settings `vllm serve --attention-backend CUSTOM` would take from the environment and additional_config (its
    --additional-config), through the backend's resolver: (report lines, JSON record); a UsageError where vllm serve
    would refuse them (the layer indices and head sizes wait for a model)."""
    settings = serving_settings(additional_config)
    record = {"preset": settings.preset.name, "preset_source": settings.preset_source,
              "layer_presets": None, "key_calibration": settings.calibration_path}
    if settings.layer_presets is not None:
        record["layer_presets"] = {text: name for text, _, name in settings.layer_presets.entries}
    if settings.calibration_path:
        from ..core.calibration import load_calibration

        try:
            load_calibration(settings.calibration_path)
        except ValueError as exc:
            raise UsageError(f"{settings.calibration_source}: {exc}") from None
    return [f"serve settings: {settings.describe()}"], record
