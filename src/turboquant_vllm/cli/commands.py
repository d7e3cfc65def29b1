"""The CLI's commands: verify, demo, bench, serve, calibrate, model."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from .arguments import (
    UsageError,
    check_head_dim,
    check_model,
    chosen_preset,
    require_gpu,
    require_vllm,
    serving_settings,
    split_additional_config,
)
from .environment import environment_report, package_check, settings_report


def cmd_verify(args: argparse.Namespace) -> int:
    settings_lines, settings = settings_report(args.additional_config)  # a setting vllm serve refuses: exit 2
    preset = args.preset or settings["preset"]
    check_head_dim(args.head_dim, [preset])
    from ..core.presets import PRESETS
    from ..core.selftest import distortion_table

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
    kernels_ok, kernel_lines, kernels = True, [], None
    if args.kernels:
        from .kernels import kernel_check

        kernels_ok, kernel_lines, kernels = kernel_check(preset, args.head_dim, args.context)
    ok = math_ok and package_ok and kernels_ok
    if args.json:
        print(json.dumps({"head_dim": args.head_dim, "distortion": table, "presets": presets, "package": package,
                          "environment": env, "settings": settings, "math_ok": math_ok,
                          **({"kernels": kernels} if args.kernels else {}),
                          "ok": ok}, indent=1))
        return 0 if ok else 1
    for line in package_lines:
        print(line, file=sys.stdout if line.startswith("package:") else sys.stderr)
    print("\n".join(env_lines + settings_lines))
    print(f"\nTurboQuant-MSE distortion E||x - x_hat||^2 over {args.vectors} random unit vectors, d = {args.head_dim}")
    print(f"{'bits':>4} {'measured':>10} {'optimum':>10} {'ratio':>7} {'gauss lim':>10} {'bound 4^-b':>11}")
    for r in table:
        print(f"{r['bits']:>4} {r['mse']:>10.5f} {r['lloyd_max']:>10.5f} {r['mse'] / r['lloyd_max']:>7.3f} "
              f"{r['gaussian_limit']:>10.5f} {r['bound']:>11.5f}")
    print(f"\npresets at head_dim {args.head_dim} (bf16: {4 * args.head_dim} B per token per KV head)")
    for p in presets:
        print(f"  {p['name']:5s} {p['bytes_per_token_per_head']:4d} B  {p['capacity_vs_bf16']:.2f}x  {p['summary']}")
    if kernel_lines:
        print("\n" + "\n".join(kernel_lines))
    if ok:
        print("\nverify: ok (every bit width within 2% of its optimum, above the bound; this project's package"
              f"{'; kernels within their bounds' if args.kernels else ''})")
    else:
        why = ([] if math_ok else ["distortion off its optimum"])
        why += [] if package_ok else ["not this project's package (see above)"]
        why += [] if kernels_ok else ["kernels off their bounds (see above)"]
        print(f"\nverify: FAILED ({'; '.join(why)})")
    return 0 if ok else 1


def cmd_demo(args: argparse.Namespace) -> int:
    from .demo import run

    return run(args)


def cmd_bench(args: argparse.Namespace) -> int:
    presets = args.presets or [chosen_preset(None)]
    check_head_dim(args.head_dim, presets)
    import functools

    import torch

    from ..core.presets import get_preset

    q_heads, kv_heads = args.heads
    if q_heads % kv_heads:
        raise UsageError(f"--heads {q_heads}/{kv_heads}: query heads must be a multiple of KV heads")
    if not torch.cuda.is_available():
        raise UsageError("bench times the kernels natively and needs a CUDA GPU; none is visible here "
                         "(`turboquant-vllm verify --kernels` runs them on a CPU, through Triton's interpreter)")
    from ..bench import Batch, Shape, copy_bandwidth, flash, flash_available, measure, ours, table

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


def serve_command(model: str, preset: str | None, vllm_args: list[str], environ: dict[str, str]) -> tuple[
        list[str], dict[str, str]]:
    """(`vllm serve` with the CUSTOM backend and the preset in --additional-config, the channel vLLM keys its compile
    cache by; its environment). The user's --additional-config is merged in; the settings are checked by the
    backend's resolver, as vLLM's processes will check them."""
    from ..core.presets import get_preset
    from ..vllm.settings import PRESET_CONFIG_KEY, PRESET_ENV

    config, vllm_args = split_additional_config(vllm_args)
    env = dict(environ)
    if preset:
        given = config.get(PRESET_CONFIG_KEY)
        try:
            agree = given is None or get_preset(str(given)) == get_preset(preset)
        except ValueError:
            agree = False
        if not agree:
            raise UsageError(f"--preset {preset} and --additional-config {PRESET_CONFIG_KEY}={given!r} disagree; "
                             "give the preset once")
        config[PRESET_CONFIG_KEY] = preset
        env.pop(PRESET_ENV, None)  # --preset wins over the environment
    settings = serving_settings(config, env)
    config[PRESET_CONFIG_KEY] = settings.preset.name
    env.pop(PRESET_ENV, None)  # now in --additional-config
    cmd = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", model, "--attention-backend", "CUSTOM",
           "--additional-config", json.dumps(config)]
    return cmd + vllm_args, env


def cmd_serve(args: argparse.Namespace, extra: list[str]) -> int:
    cmd, env = serve_command(args.model, args.preset, extra, dict(os.environ))
    check_model(args.model, need_config=False)
    require_vllm("serve")
    require_gpu("serve")
    sys.stdout.flush()
    os.execvpe(cmd[0], cmd, env)


def cmd_calibrate(args: argparse.Namespace) -> int:
    from ..vllm.settings import PRESET_ENV

    preset = chosen_preset(args.preset)
    check_model(args.model, need_config=True)
    for text in args.text:
        if not Path(text).exists():
            raise UsageError(f"--text {text}: no such file or directory")
    out_dir = Path(args.out).expanduser().resolve().parent
    if not out_dir.is_dir():
        raise UsageError(f"--out {args.out}: directory {out_dir} does not exist")
    require_vllm("calibrate")
    require_gpu("calibrate")
    os.environ.pop(PRESET_ENV, None)  # the preset goes to vLLM through additional_config
    from ..vllm.calibrate import calibrate

    calibrate(args.model, args.text, args.out, preset=preset, max_tokens=args.tokens, window=args.window,
              gpu_memory_utilization=args.gpu_memory_utilization)
    print(f"serve with: TURBOQUANT_KEY_CALIBRATION={args.out} turboquant-vllm serve {args.model} --preset {preset}")
    return 0


def cmd_model(args: argparse.Namespace) -> int:
    from ..hf import gemma3, smollm2

    # name: the module, the model, how long a conversion takes, its wheel option and the other model's
    source, model, minutes, (option, given), (other, stray) = {
        "smollm2": (smollm2, "SmolLM2-135M-Instruct", "about a minute", ("--wheel PATH", {"wheel": args.wheel}),
                    ("--wheel-dir", args.wheel_dir)),
        "gemma3-270m": (gemma3, "Gemma-3-270M", "about a minute", ("--wheel-dir DIR", {"wheel_dir": args.wheel_dir}),
                        ("--wheel", args.wheel)),
    }[args.name]
    if stray:
        raise UsageError(f"{other} is not for {args.name}, which takes {option}")
    missing = source.missing_packages()
    if missing:
        raise UsageError(f"{args.name} needs {', '.join(missing)}, this project's demo extra: pip install '.[demo]' "
                         "in its source tree (PyPI's turboquant-vllm is another project)")
    out = Path(args.out).expanduser() if args.out else source.default_model_dir()
    if not source.is_converted(out):
        print(f"converting {model} from {source.PACKAGE} {source.VERSION} into {out} ({minutes})", file=sys.stderr)
    try:
        path = source.convert(out, **given)
    except source.ModelSourceError as exc:
        raise UsageError(str(exc)) from None
    print(path)
    for line in source.summary(source.read_manifest(path)):
        print(line)
    return 0
