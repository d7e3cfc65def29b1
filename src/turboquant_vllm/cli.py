"""turboquant-vllm: verify the math, demo and bench the kernels, serve a model with the compressed KV cache.

Every option that takes a preset defaults to $TURBOQUANT_PRESET, else tq4. A usage error is one line on stderr and
exit status 2; a failed check (verify, demo) exits 1.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

from . import PROJECT_MARK, __version__
from .vllm.requirements import ALLOW_UNSUPPORTED_ENV, MIN_COMPUTE_CAPABILITY, SUPPORTED_VLLM, is_supported_vllm

DIST_NAME = "turboquant-vllm"
# pyproject's description starts so; PyPI's "turboquant-vllm" (another project, same import name) says otherwise.
SUMMARY_PREFIX = "TurboQuant-compressed KV cache for vLLM"
ENTRY_POINT = "turboquant_vllm.plugins:register"  # our one vllm.general_plugins entry point
INSTALL_VLLM = f'pip install "vllm{SUPPORTED_VLLM}" (or, in this project\'s source tree, pip install ".[vllm]")'
ATTENTION_TOLERANCE = 1e-2  # the kernels' bf16 tolerance against the float32 reference (tests/ops)
KEY_ERROR_SLACK = 1.1  # demo: key error at most this times the Lloyd-Max optimum's sqrt(distortion)


class UsageError(Exception):
    """A bad argument or setting: main() prints it as one line and returns 2."""


class Parser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse's usage errors: one line too, no usage block
        raise UsageError(f"{self.prog}: error: {message} (see {self.prog} --help)")


# ----------------------------------------------------------------------------------------------------------------
# Arguments
# ----------------------------------------------------------------------------------------------------------------

def preset_names() -> list[str]:
    from .core.presets import PRESETS

    return list(PRESETS)


def _preset(text: str) -> str:
    """argparse type: a preset name, canonical (lower case)."""
    from .core.presets import get_preset

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
    from .core.presets import DEFAULT_PRESET
    from .vllm.settings import PRESET_ENV

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
    from .core.layout import CacheLayout
    from .core.presets import get_preset

    for name in presets:
        try:
            CacheLayout(get_preset(name), head_dim, 1, 16)
        except ValueError as exc:
            raise UsageError(f"--head-dim {head_dim}: {str(exc).split(';')[0]}") from None


def installed_vllm() -> str | None:
    """vLLM's version if it is importable here, else None; imports nothing."""
    try:
        if importlib.util.find_spec("vllm") is None:
            return None
    except (ImportError, ValueError):  # ValueError: sys.modules["vllm"] is None (imports of it are blocked)
        return None
    try:
        return importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def require_vllm(command: str) -> None:
    version = installed_vllm()
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


# ----------------------------------------------------------------------------------------------------------------
# Is the turboquant_vllm Python imports this project's?
# ----------------------------------------------------------------------------------------------------------------

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
    here = Path(__file__).resolve().parent
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
    """vLLM and GPU: what serving needs, reported by verify (never a failure: verify runs anywhere)."""
    import torch

    version = installed_vllm()
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
    return [vllm_line, gpu_line], {"vllm": version, "vllm_supported": bool(version and is_supported_vllm(version)),
                                   "gpu": gpu}


# ----------------------------------------------------------------------------------------------------------------
# Commands
# ----------------------------------------------------------------------------------------------------------------

def cmd_verify(args: argparse.Namespace) -> int:
    from .core.presets import DEFAULT_PRESET

    check_head_dim(args.head_dim, [DEFAULT_PRESET])
    from .core.presets import PRESETS
    from .core.selftest import distortion_table

    package_ok, package_lines, package = package_check()
    env_lines, env = environment_report()
    table = distortion_table(dim=args.head_dim, num_vectors=args.vectors)
    presets = [
        {"name": p.name, "head_dim": args.head_dim,
         "bytes_per_token_per_head": p.bytes_per_token_per_head(args.head_dim),
         "capacity_vs_bf16": round(p.capacity_vs_bf16(args.head_dim), 4), "summary": p.summary}
        for p in PRESETS.values()
    ]
    math_ok = all(abs(r["mse"] / r["lloyd_max"] - 1) < 0.02 and r["mse"] > r["bound"] for r in table)
    ok = math_ok and package_ok
    if args.json:
        print(json.dumps({"head_dim": args.head_dim, "distortion": table, "presets": presets, "package": package,
                          "environment": env, "math_ok": math_ok, "ok": ok}, indent=1))
        return 0 if ok else 1
    for line in package_lines:
        print(line, file=sys.stdout if line.startswith("package:") else sys.stderr)
    print("\n".join(env_lines))
    print(f"\nTurboQuant-MSE distortion E||x - x_hat||^2 over {args.vectors} random unit vectors, d = {args.head_dim}")
    print(f"{'bits':>4} {'measured':>10} {'optimum':>10} {'ratio':>7} {'gauss lim':>10} {'bound 4^-b':>11}")
    for r in table:
        print(f"{r['bits']:>4} {r['mse']:>10.5f} {r['lloyd_max']:>10.5f} {r['mse'] / r['lloyd_max']:>7.3f} "
              f"{r['gaussian_limit']:>10.5f} {r['bound']:>11.5f}")
    print(f"\npresets at head_dim {args.head_dim} (bf16: {4 * args.head_dim} B per token per KV head)")
    for p in presets:
        print(f"  {p['name']:5s} {p['bytes_per_token_per_head']:4d} B  {p['capacity_vs_bf16']:.2f}x  {p['summary']}")
    if ok:
        print("\nverify: ok (every bit width within 2% of its optimum, above the bound; this project's package)")
    else:
        why = ([] if math_ok else ["distortion off its optimum"])
        why += [] if package_ok else ["not this project's package (see above)"]
        print(f"\nverify: FAILED ({'; '.join(why)})")
    return 0 if ok else 1


def demo_verdict(att_err: float, k_err: float, k_bound: float, k_bits: int) -> tuple[bool, str]:
    att_ok, k_ok = att_err < ATTENTION_TOLERANCE, k_err < k_bound
    return att_ok and k_ok, (f"demo: {'ok' if att_ok and k_ok else 'FAILED'} (attention error "
                             f"{'<' if att_ok else '>='} {ATTENTION_TOLERANCE:.0e}, key error {'<' if k_ok else '>='} "
                             f"{k_bound:.4f} = {KEY_ERROR_SLACK} x the {k_bits}-bit Lloyd-Max optimum)")


def cmd_demo(args: argparse.Namespace) -> int:
    preset_name = resolve_preset(args.preset)
    check_head_dim(args.head_dim, [preset_name])
    import torch

    on_gpu = torch.cuda.is_available()
    if not on_gpu:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the kernels' import
    from .core.codebook import lloyd_max
    from .core.layout import CacheLayout
    from .core.presets import get_preset
    from .ops import paged_attention, store_kv
    from .ops.attention.naive import paged_attention_reference
    from .ops.dequant.naive import read_kv_reference

    device = "cuda" if on_gpu else "cpu"
    gen = torch.Generator().manual_seed(0)
    d, kv_heads, q_heads, bs = args.head_dim, 2, 8, 16
    seq_lens = [args.context, args.context // 2 + 1]
    layout = CacheLayout(get_preset(preset_name), d, kv_heads, bs)
    blocks = [math.ceil(n / bs) for n in seq_lens]
    table = torch.arange(sum(blocks), dtype=torch.int32).split(blocks)
    block_table = torch.nn.utils.rnn.pad_sequence(list(table), batch_first=True).to(device)
    cache = torch.zeros(layout.cache_shape(sum(blocks)), dtype=torch.uint8, device=device)
    keys = torch.randn(sum(seq_lens), kv_heads, d, generator=gen).to(torch.bfloat16).to(device)
    values = torch.randn(sum(seq_lens), kv_heads, d, generator=gen).to(torch.bfloat16).to(device)
    slots = torch.cat([table[i].long().repeat_interleave(bs)[:n] * bs + torch.arange(n) % bs
                       for i, n in enumerate(seq_lens)]).to(device)
    store_kv(keys, values, cache, slots, layout)
    k_hat, _ = read_kv_reference(cache, block_table[0], seq_lens[0], layout)
    k_err = ((k_hat - keys[: seq_lens[0]].float()).norm() / keys[: seq_lens[0]].float().norm()).item()
    query = torch.randn(2, q_heads, d, generator=gen).to(torch.bfloat16).to(device)
    qsl = torch.tensor([0, 1, 2], dtype=torch.int32, device=device)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    out = torch.empty_like(query)
    paged_attention(query, cache, layout, block_table, qsl, lens, max_query_len=1, scale=d**-0.5, out=out)
    ref = paged_attention_reference(query, cache, layout, block_table, qsl, lens, d**-0.5)
    att_err = ((out.float() - ref).norm() / ref.norm()).item()
    k_bound = KEY_ERROR_SLACK * math.sqrt(lloyd_max(layout.preset.k_bits, d).distortion)
    where = "GPU (native Triton kernels)" if on_gpu else "CPU (Triton interpreter)"
    print(f"turboquant-vllm demo on {where}: preset {layout.preset.name}, head_dim {d}, contexts {seq_lens}")
    print(f"  KV cache: {layout.bytes_per_token_per_head} B per token per KV head vs {4 * d} B bf16 "
          f"-> {layout.preset.capacity_vs_bf16(d):.2f}x compression")
    print(f"  key reconstruction relative error (quantization): {k_err:.4f} (bound {k_bound:.4f})")
    print(f"  decode attention vs float32 reference over the same compressed cache: relative error {att_err:.2e} "
          f"(bound {ATTENTION_TOLERANCE:.0e})")
    ok, verdict = demo_verdict(att_err, k_err, k_bound, layout.preset.k_bits)
    print(verdict)
    return 0 if ok else 1


def cmd_bench(args: argparse.Namespace) -> int:
    presets = args.presets or [resolve_preset(None)]
    check_head_dim(args.head_dim, presets)
    import functools

    import torch

    from .core.presets import get_preset

    q_heads, kv_heads = args.heads
    if q_heads % kv_heads:
        raise UsageError(f"--heads {q_heads}/{kv_heads}: query heads must be a multiple of KV heads")
    if not torch.cuda.is_available():
        raise UsageError("bench times the kernels natively and needs a CUDA GPU; none is visible here "
                         "(`turboquant-vllm demo` runs them on a CPU, through Triton's interpreter)")
    from .bench import Batch, Shape, copy_bandwidth, flash, flash_available, measure, ours, table

    peak = copy_bandwidth()
    no_flash = flash_available()
    gen = torch.Generator().manual_seed(0)
    rows = []
    for batch, context in args.shapes:
        b = Batch(Shape(batch, context, q_heads, kv_heads, args.head_dim), gen)
        kernels = {} if no_flash else {"fa3_bf16": functools.partial(flash, b, False),
                                       "fa3_fp8": functools.partial(flash, b, True)}
        kernels.update({p: functools.partial(ours, b, p) for p in presets})
        rows += measure(b, kernels, peak, log=lambda line: print(line, file=sys.stderr))
        del b
        torch.cuda.empty_cache()
    device = torch.cuda.get_device_name()
    if args.json:
        print(json.dumps({"device": device, "copy_bandwidth_tbps": peak / 1e12, "baselines": no_flash or "ok",
                          "rows": rows}, indent=1))
        return 0 if rows else 1
    print(f"Decode attention on {device} (copy bandwidth {peak / 1e12:.2f} TB/s): {q_heads} query / {kv_heads} KV "
          f"heads, head_dim {args.head_dim}, one query token per sequence, CUDA-graph replay")
    if no_flash:
        print(f"FlashAttention baselines left out: {no_flash}")
    print("\n".join(table(rows)))
    for p in presets:
        preset = get_preset(p)
        print(f"{p}: {preset.bytes_per_token_per_head(args.head_dim)} B per token per KV head, "
              f"{preset.capacity_vs_bf16(args.head_dim):.2f}x the tokens of a bf16 cache")
    return 0 if rows else 1


def cmd_serve(args: argparse.Namespace, extra: list[str]) -> int:
    preset = resolve_preset(args.preset)
    check_model(args.model, need_config=False)
    require_vllm("serve")
    env = dict(os.environ, TURBOQUANT_PRESET=preset)
    cmd = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", args.model, "--attention-backend", "CUSTOM"]
    sys.stdout.flush()
    os.execvpe(cmd[0], cmd + extra, env)


def cmd_calibrate(args: argparse.Namespace) -> int:
    from .vllm.settings import PRESET_ENV

    preset = resolve_preset(args.preset)
    check_model(args.model, need_config=True)
    for text in args.text:
        if not Path(text).exists():
            raise UsageError(f"--text {text}: no such file or directory")
    out_dir = Path(args.out).expanduser().resolve().parent
    if not out_dir.is_dir():
        raise UsageError(f"--out {args.out}: directory {out_dir} does not exist")
    require_vllm("calibrate")
    os.environ[PRESET_ENV] = preset
    from .vllm.calibrate import calibrate

    calibrate(args.model, args.text, args.out, max_tokens=args.tokens, window=args.window,
              gpu_memory_utilization=args.gpu_memory_utilization)
    print(f"serve with: TURBOQUANT_KEY_CALIBRATION={args.out} turboquant-vllm serve {args.model} --preset {preset}")
    return 0


# ----------------------------------------------------------------------------------------------------------------
# Parser
# ----------------------------------------------------------------------------------------------------------------

def build_parser() -> Parser:
    from .core.presets import DEFAULT_PRESET
    from .vllm.settings import PRESET_ENV

    names = ", ".join(preset_names())
    preset_help = f"KV-cache preset: {names} (default: ${PRESET_ENV}, else {DEFAULT_PRESET})"
    head_dim_help = "head dimension: a multiple of 16 in [32, 256] (5-bit keys: >= 96); default %(default)s"
    ap = Parser(prog="turboquant-vllm", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--version", action="version", version=f"turboquant-vllm {__version__}")
    sub = ap.add_subparsers(dest="command", required=True, metavar="COMMAND")

    v = sub.add_parser("verify", help="check the install (package, vLLM, GPU) and the quantizer's distortion",
                       description="Check that the turboquant_vllm Python imports is this project's (PyPI's "
                       "turboquant-vllm is another project), report vLLM and the GPU, measure the quantizer's "
                       "distortion against the Lloyd-Max optimum and list the presets' bytes. Exit 1 on a failed "
                       "check. Needs neither vLLM nor a GPU.")
    v.add_argument("--json", action="store_true", help="print one JSON object instead of the report")
    v.add_argument("--head-dim", type=_positive(int), default=128, help=head_dim_help)
    v.add_argument("--vectors", type=_positive(int), default=20000,
                   help="random unit vectors per bit width (default %(default)s)")

    d = sub.add_parser("demo", help="run the store and attention kernels once; report compression, error, verdict",
                       description="Store random keys and values into a compressed paged cache with the Triton "
                       "kernels, run decode attention over it and compare with the float32 reference. On a CPU the "
                       "kernels run through Triton's interpreter. Ends with 'demo: ok' or 'demo: FAILED' (exit 1).")
    d.add_argument("--preset", type=_preset, help=preset_help)
    d.add_argument("--head-dim", type=_positive(int), default=128, help=head_dim_help)
    d.add_argument("--context", type=_positive(int), default=200,
                   help="tokens of the longer of the two sequences (default %(default)s)")

    b = sub.add_parser("bench", help="time decode attention on this GPU: presets vs FlashAttention-3 bf16 / fp8",
                       description="Time decode attention (CUDA-graph replay) over the compressed cache against "
                       "FlashAttention-3 on bf16 and fp8 caches. Needs a CUDA GPU.")
    b.add_argument("--presets", type=_presets, help=f"comma-separated presets of {names} "
                   f"(default: ${PRESET_ENV}, else {DEFAULT_PRESET})")
    b.add_argument("--shapes", type=_int_pairs("x", "BATCHxCONTEXT[,BATCHxCONTEXT...], e.g. 64x8192"),
                   default="64x8192,32x32768",
                   help="BATCHxCONTEXT,... one query token per sequence (default %(default)s)")
    b.add_argument("--heads", type=_int_pairs("/", "QUERY_HEADS/KV_HEADS, e.g. 32/8"), default="32/8",
                   help="QUERY_HEADS/KV_HEADS (default %(default)s)")
    b.add_argument("--head-dim", type=_positive(int), default=128, help=head_dim_help)
    b.add_argument("--json", action="store_true", help="print one JSON object instead of the table")

    s = sub.add_parser("serve", help="vllm serve MODEL --attention-backend CUSTOM with a preset",
                       usage="turboquant-vllm serve [-h] [--preset PRESET] MODEL [VLLM_ARGS...]", allow_abbrev=False,
                       description="Run `vllm serve MODEL --attention-backend CUSTOM` with the preset set. Every "
                       "other argument goes to vLLM unchanged (see `vllm serve --help`), e.g. "
                       "turboquant-vllm serve Qwen/Qwen2.5-7B-Instruct --preset tq3 --max-model-len 32768. "
                       f"Needs vLLM {SUPPORTED_VLLM} and an NVIDIA GPU of compute capability >= 8.0.")
    s.add_argument("model", metavar="MODEL", help="Hugging Face hub id (ORG/NAME) or local model directory")
    s.add_argument("--preset", type=_preset, help=preset_help)

    c = sub.add_parser("calibrate", help="fit a key calibration (mean and scale per layer and KV head) on text",
                       description="Run MODEL over text with the compressed cache and fit a key calibration (mean "
                       "and scale per layer and KV head), written as .safetensors; serve with "
                       f"TURBOQUANT_KEY_CALIBRATION=FILE. Needs vLLM {SUPPORTED_VLLM} and a GPU.")
    c.add_argument("model", metavar="MODEL", help="Hugging Face hub id (ORG/NAME) or local model directory")
    c.add_argument("--text", nargs="+", required=True, help="text files, or directories of *.txt")
    c.add_argument("--out", required=True, help="the .safetensors file to write")
    c.add_argument("--tokens", type=_positive(int), default=262_144,
                   help="calibration tokens at most (default %(default)s)")
    c.add_argument("--window", type=_positive(int), default=2048, help="tokens per prompt (default %(default)s)")
    c.add_argument("--preset", type=_preset, help=preset_help + "; the cache the calibration run stores into")
    c.add_argument("--gpu-memory-utilization", type=_fraction, default=0.5,
                   help="fraction of GPU memory vLLM may take (default %(default)s)")
    return ap


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv == ["--version"]:  # without the parser, which imports torch (the preset names)
        print(f"turboquant-vllm {__version__}")
        return 0
    ap = build_parser()
    try:
        args, extra = ap.parse_known_args(argv)
        prog = f"{ap.prog} {args.command}"
        if args.command != "serve" and extra:
            raise UsageError(f"{prog}: error: unrecognized arguments: {' '.join(extra)} (see {prog} --help)")
        try:
            if args.command == "serve":
                return cmd_serve(args, extra)
            return {"verify": cmd_verify, "demo": cmd_demo, "bench": cmd_bench,
                    "calibrate": cmd_calibrate}[args.command](args)
        except UsageError as exc:
            raise UsageError(f"{prog}: error: {exc}") from None
    except UsageError as exc:
        print(exc, file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
