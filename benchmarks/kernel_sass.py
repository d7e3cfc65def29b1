"""Compile a decode attention kernel for sm_90 without a GPU and print its register count and
the instruction mix of its main loop: the per-tile issue cost that bounds decode speed (NOTES.md).

    python -m benchmarks kernel_sass [--kernel decode|general|store] [--preset tq4] [--block-n N] [--warps N]
                                     [--stages N] [--maxnreg N] [--head-dim 128] [--group 4] [--build DIR]

--kernel decode: the decode kernel (one softmax per warp, block-n tokens per block, block-n / warps per warp);
general: the general attention kernel's loop (prefill and chunks; compiled here for one query token);
store: the store kernel with block-n tokens per program (bf16 keys and values), its registers, spills and
compile time. Warps, stages and the register cap default to the decode launch policy's for the preset
(turboquant_vllm.ops.decode_launch), block-n to 32 per warp, as paged_attention launches them.

Prints its findings after a provenance header (logs: benchmarks/results/kernel_sass/); the ttgir / ptx / cubin /
sass go to --build (default build/kernel_sass).

Uses Triton's own ptxas / cuobjdump; the integer arguments get the divisibility-by-16 hints a
real launch gives them, so the cubin is the one the GPU would run for this shape.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import time
from collections import Counter
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from turboquant_vllm.core.layout import CacheLayout
from turboquant_vllm.core.presets import get_preset
from turboquant_vllm.ops import decode_launch, triton_kernels
from turboquant_vllm.ops.constants import kernel_constants
from turboquant_vllm.ops.store import STORE_LARGE_BATCH, store_block_tokens
from turboquant_vllm.ops.utils import next_pow2, page_constants

from . import common

NAME = "kernel_sass"

POINTERS = {"q_ptr": "*fp16", "q_offset_ptr": "*fp32", "cache_ptr": "*u8", "block_table_ptr": "*i32", "qsl_ptr": "*i32",
            "seq_lens_ptr": "*i32", "k_lut_ptr": "*i8", "v_lut_ptr": "*fp16", "o_ptr": "*fp32",
            "part_acc_ptr": "*fp32", "part_ml_ptr": "*fp32"}
DIVISIBLE = set(POINTERS) | {"stride_qt", "stride_qh", "stride_bt", "stride_cblock", "stride_chead"}


def parser() -> argparse.ArgumentParser:
    ap = common.parser(NAME, __doc__)
    ap.add_argument("--kernel", choices=("decode", "general", "store"), default="decode")
    ap.add_argument("--preset", default="tq4")
    ap.add_argument("--block-n", type=int, help="tokens per block (default: 32 per warp; store: its prefill tiles)")
    ap.add_argument("--warps", type=int, help="default: the decode launch policy's (store: 8)")
    ap.add_argument("--stages", type=int, help="default: the decode launch policy's")
    ap.add_argument("--maxnreg", type=int, help="cap on registers per thread (0: ptxas chooses; default: the policy's)")
    ap.add_argument("--head-dim", type=int, default=128, help="store only (attention: 128)")
    ap.add_argument("--group", type=int, default=4, help="decode: query heads a KV head (8 KV heads)")
    ap.add_argument("--build", type=Path, default=Path("build/kernel_sass"),
                    help="where the ttgir / ptx / cubin / sass are written")
    return ap


def launch_options(args, layout: CacheLayout) -> dict:
    """num_warps, num_stages, maxnreg and block_n: the flags, else what paged_attention launches for the layout."""
    policy = decode_launch(layout.preset, layout.head_dim)
    warps = args.warps or policy.num_warps
    regs = policy.max_registers if args.maxnreg is None else args.maxnreg
    return dict(num_warps=warps, num_stages=args.stages or policy.num_stages, block_n=args.block_n or 32 * warps,
                **({"maxnreg": regs} if regs else {}))


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    common.print_header(common.command_line(NAME, argv))
    if args.kernel == "store":
        return store_kernel(args)
    layout = CacheLayout(get_preset(args.preset), 128, 8, 16)  # the benchmark's shape: 32 q / 8 KV heads, d 128
    c = kernel_constants(layout, "cpu")
    consts = dict(NUM_Q_HEADS=8 * args.group, GROUP=args.group, NUM_SPLITS=2, USE_WINDOW=False, USE_SOFTCAP=False,
                  CALIBRATED=False, UPCAST=False,
                  K_ASM=c.key_mma_asm, V_ASM=c.value_lookup_asm, **page_constants(layout))
    options = launch_options(args, layout)
    block_n = options.pop("block_n")
    if args.kernel == "decode":
        # paged_attention's decode launch: query rows padded to 8 or the group's next power of two
        consts.update(ROWS=max(8, next_pow2(args.group)), WARPS=options["num_warps"],
                      WARP_N=block_n // options["num_warps"], V_CHUNKS=2)
    else:
        consts.update(G_PAD=4, BLOCK_Q=1, BLOCK_M=16, BLOCK_N=block_n, DECODE_ONLY=True)
    pointers = dict(POINTERS, k_lut_ptr="*i8" if layout.preset.k_bits == 4 else "*fp16")
    print(f"{args.kernel} {args.preset}: block_n {block_n}, " + ", ".join(f"{k} {v}" for k, v in options.items()))
    kernel, sass, usage = compiled(triton_kernels()[args.kernel], consts, pointers, options, args.build, DIVISIBLE)
    print(usage, f"shared {kernel.metadata.shared} B")
    ins = [(int(a, 16), op, rest) for a, op, rest in
           re.findall(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)([^;]*);", sass)]
    for addr, op, rest in ins:  # a backward branch closes a loop
        target = re.search(r"0x([0-9a-f]+)", rest)
        if op.startswith("BRA") and target and int(target.group(1), 16) < addr:
            full = [o for a, o, _ in ins if int(target.group(1), 16) <= a <= addr]
            body = [o.split(".")[0] for o in full]
            print(f"loop: {len(body)} instructions per warp per tile of {block_n} tokens;",
                  ", ".join(f"{k} {v}" for k, v in Counter(body).most_common(12)))
            memory = Counter(o for o in full if o.startswith(("LD", "ST")))  # widths: LDS.U8 vs LDS.64
            print("  loads / stores:", ", ".join(f"{k} {v}" for k, v in sorted(memory.items())))


def compiled(fn, consts: dict, pointers: dict, options: dict, out: Path, divisible=frozenset()):
    """Compiles fn for sm_90; writes its ttgir / ptx / cubin / sass under out; returns (kernel, sass, usage)."""
    names = fn.arg_names
    floats = ("softcap", "k_step", "q_scale")
    signature = {n: pointers.get(n, "constexpr" if n in consts else "fp32" if n in floats else "i32") for n in names}
    # What the kernel declines to specialize (do_not_specialize[_on_alignment]) compiles without the hint, as it runs.
    kept = {p.name for p in fn.params if not (p.do_not_specialize or p.do_not_specialize_on_alignment)}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if n in divisible and n in kept}
    kernel = triton.compile(ASTSource(fn, signature, consts, attrs), target=GPUTarget("cuda", 90, 32), options=options)
    out.mkdir(parents=True, exist_ok=True)
    for key in ("ttgir", "ptx"):
        (out / f"kernel.{key}").write_text(kernel.asm[key])
    (out / "kernel.cubin").write_bytes(kernel.asm["cubin"])
    tools = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    sass = subprocess.run([tools / "cuobjdump", "-sass", out / "kernel.cubin"], capture_output=True, text=True,
                          check=True).stdout
    (out / "kernel.sass").write_text(sass)
    usage = subprocess.run([tools / "cuobjdump", "--dump-resource-usage", out / "kernel.cubin"],
                           capture_output=True, text=True, check=True).stdout
    return kernel, sass, re.search(r"REG:\d+ STACK:\d+", usage).group(0)


def store_kernel(args) -> None:
    layout = CacheLayout(get_preset(args.preset), args.head_dim, 4, 16)
    # store_kv's launch of a prefill-sized batch unless the flags say otherwise
    block_t, warps = args.block_n or store_block_tokens(STORE_LARGE_BATCH, args.head_dim), args.warps or 8
    consts = dict(CALIBRATED=False, GROUP=4, BLOCK_T=block_t, BLOCK_K=32, INTERPRET=False, **page_constants(layout))
    pointers = {n: "*fp32" for n in ("rot_ptr", "mean_ptr", "scale_ptr", "k_bounds_ptr", "v_bounds_ptr",
                                     "k_values_ptr", "v_values_ptr")}
    pointers.update(key_ptr="*bf16", value_ptr="*bf16", cache_ptr="*u8", slot_ptr="*i64", q_ptr="*bf16",
                    q_out_ptr="*fp16")
    t0 = time.perf_counter()
    kernel, _, usage = compiled(triton_kernels()["store"], consts, pointers, {"num_warps": warps}, args.build)
    print(f"store {args.preset} d {args.head_dim}, {block_t} tokens x {warps} warps: {usage} (bytes of "
          f"spill per thread), shared {kernel.metadata.shared} B, compiled in {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
