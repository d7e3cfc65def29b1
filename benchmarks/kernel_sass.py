"""Compile a decode attention kernel for sm_90 without a GPU and print its register count and
the instruction mix of its main loop: the per-tile issue cost that bounds decode speed (NOTES.md).

    python benchmarks/kernel_sass.py [--kernel decode|general|store] [--preset tq4] [--block-n 128] [--warps 4]
                                     [--stages 3] [--maxnreg N] [--head-dim 128] [--out DIR]

--kernel decode: _decode_kernel (one softmax per warp, block-n tokens per block, block-n / warps per warp);
general: _attention_kernel's loop (prefill and chunks; compiled here for one query token);
store: _store_kv_kernel with block-n tokens per program (bf16 keys and values), its registers, spills and
compile time.

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
from turboquant_vllm.kernels import attention, store
from turboquant_vllm.kernels.common import page_constants
from turboquant_vllm.kernels.constants import _constants

POINTERS = {"q_ptr": "*fp16", "cache_ptr": "*u8", "block_table_ptr": "*i32", "qsl_ptr": "*i32",
            "seq_lens_ptr": "*i32", "k_lut_ptr": "*i8", "v_lut_ptr": "*fp16", "o_ptr": "*fp32",
            "part_acc_ptr": "*fp32", "part_ml_ptr": "*fp32"}
DIVISIBLE = set(POINTERS) | {"stride_qt", "stride_qh", "stride_bt", "stride_cblock", "stride_chead"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--kernel", choices=("decode", "general", "store"), default="decode")
    ap.add_argument("--preset", default="tq4")
    ap.add_argument("--block-n", type=int, default=128)
    ap.add_argument("--warps", type=int, default=4)
    ap.add_argument("--stages", type=int, default=3)
    ap.add_argument("--maxnreg", type=int, default=0, help="cap on registers per thread (0: ptxas chooses)")
    ap.add_argument("--head-dim", type=int, default=128, help="store only (attention: 128)")
    ap.add_argument("--out", default="build/kernel_sass", help="where the ttgir / ptx / sass are written")
    args = ap.parse_args()
    if args.kernel == "store":
        return store_kernel(args)
    layout = CacheLayout(get_preset(args.preset), 128, 8, 16)  # the benchmark's shape: 32 q / 8 KV heads, d 128
    c = _constants(layout.preset.k_bits, layout.preset.v_bits, 128, "cpu")
    consts = dict(NUM_Q_HEADS=32, GROUP=4, NUM_SPLITS=2, USE_WINDOW=False, USE_SOFTCAP=False, UPCAST=False,
                  K_ASM=c.key_mma_asm, V_ASM=c.value_lookup_asm, **page_constants(layout))
    if args.kernel == "decode":
        fn = attention._decode_kernel
        consts.update(ROWS=8, WARPS=args.warps, WARP_N=args.block_n // args.warps, V_CHUNKS=2)
    else:
        fn = attention._attention_kernel
        consts.update(G_PAD=4, BLOCK_Q=1, BLOCK_M=16, BLOCK_N=args.block_n, DECODE_ONLY=True)
    pointers = dict(POINTERS, k_lut_ptr="*i8" if layout.preset.k_bits == 4 else "*fp16")
    options = {"num_warps": args.warps, "num_stages": args.stages}
    if args.maxnreg:
        options["maxnreg"] = args.maxnreg
    kernel, sass, usage = compiled(fn, consts, pointers, options, Path(args.out), DIVISIBLE)
    print(usage, f"shared {kernel.metadata.shared} B")
    ins = [(int(a, 16), op, rest) for a, op, rest in
           re.findall(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)([^;]*);", sass)]
    for addr, op, rest in ins:  # a backward branch closes a loop
        target = re.search(r"0x([0-9a-f]+)", rest)
        if op.startswith("BRA") and target and int(target.group(1), 16) < addr:
            full = [o for a, o, _ in ins if int(target.group(1), 16) <= a <= addr]
            body = [o.split(".")[0] for o in full]
            print(f"loop: {len(body)} instructions per warp per tile of {args.block_n} tokens;",
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
    consts = dict(CALIBRATED=False, GROUP=4, BLOCK_T=args.block_n, BLOCK_K=32, INTERPRET=False,
                  **page_constants(layout))
    pointers = {n: "*fp32" for n in ("rot_ptr", "mean_ptr", "scale_ptr", "k_bounds_ptr", "v_bounds_ptr",
                                     "k_values_ptr", "v_values_ptr")}
    pointers.update(key_ptr="*bf16", value_ptr="*bf16", cache_ptr="*u8", slot_ptr="*i64", q_ptr="*bf16",
                    q_out_ptr="*fp16")
    t0 = time.perf_counter()
    kernel, _, usage = compiled(store._store_kv_kernel, consts, pointers, {"num_warps": args.warps}, Path(args.out))
    print(f"store {args.preset} d {args.head_dim}, {args.block_n} tokens x {args.warps} warps: {usage} (bytes of "
          f"spill per thread), shared {kernel.metadata.shared} B, compiled in {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
