"""NVFP4 weight GEMM (W4A16) on the GPU, per layer shape and token count: quartet2's marlin path against the bf16
dense matmul of the same weight's values.

Paths, each over the same NVFP4 weight (a random bf16 weight quantized by the 4/6 rule) and the same activations:
- dense: torch's matmul of the exact NVFP4 values stored as bf16 (what a bf16 checkpoint of them costs);
- marlin: vLLM's Marlin FP4 kernel alone (quartet2's marlin path with its other GEMMs off);
- mma: the native few-token kernel (quartet2.kernels.marlin_mma, 1-8 tokens, over Marlin's layout; rows only where it is
  built);
- decode+cublas: the weight decoded from Marlin's layout into bf16, then cuBLAS (quartet2.kernels.marlin_dequant), every
  token count;
- policy: what quartet2's marlin path runs (mma up to marlin_mma.POLICY_TOKENS tokens where built, Marlin below
  DENSE_MIN_TOKENS tokens, decode+cublas from there);
- decode: the decoder alone (its row: the time to write the bf16 weight, GB/s of codes read + bf16 written).
Times: CUDA-graph replay, median (benchmarks.common.time_ms). A layer's rows repeat one weight, which stays in L2 if
it fits (50 MB on an H100): small layers at few tokens read as faster than a model's pass over them. The block rows
do not: one model block's layers in a row over COPIES copies of their weights (each layer read from HBM), the time
per block.
Error: relative Frobenius error against the float64 product with the exact NVFP4 weight.

    python -m benchmarks nvfp4_gemm [--model cloverlm-4b|llama3-8b] [--tokens 1,16,...] [--out PATH]

Writes benchmarks/results/nvfp4_gemm/<gpu>-<model>.{json,md}.
"""

from __future__ import annotations

import torch

from . import common

NAME = "nvfp4_gemm"
# (K, N) of each model's linear layers: fused QKV, attention output, MLP up (CloverLM: no gate), MLP down
MODELS = {
    "cloverlm-4b": [(3584, 5376), (3584, 3584), (3584, 14336), (14336, 3584)],
    "llama3-8b": [(4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096)],
}
TOKENS = "1,16,64,128,256,512,1024,2048,4096,8192"
BLOCK_TOKENS = (1, 2, 4, 8, 16)
PATHS = ("dense", "marlin", "mma", "decode+cublas", "policy")
COPIES = 4  # a block's weights, COPIES times: more than an H100's or H200's L2 even for CloverLM's NVFP4 block


def paths(m) -> dict:
    """path -> fn(x) over the prepared Marlin weight m (the dense path apart)."""
    from turboquant_vllm.quant.quartet2.kernels import marlin, marlin_mma

    fns = {"marlin": lambda x: marlin.marlin_linear(x, m._replace(dense_min_tokens=0, mma_max_tokens=0)),
           "decode+cublas": lambda x: marlin.marlin_linear(x, m._replace(dense_min_tokens=1, mma_max_tokens=0)),
           "policy": lambda x: marlin.marlin_linear(x, m)}
    if m.mma_max_tokens:
        fns["mma"] = lambda x: marlin.marlin_linear(x, m._replace(dense_min_tokens=0,
                                                                  mma_max_tokens=marlin_mma.MAX_TOKENS))
    return fns


def applies(fns: dict, path: str, tokens: int) -> bool:
    from turboquant_vllm.quant.quartet2.kernels import marlin_mma

    return path == "dense" or (path in fns and (path != "mma" or tokens <= marlin_mma.MAX_TOKENS))


def run(k: int, n: int, tokens: list[int], gen: torch.Generator) -> list[dict]:
    from turboquant_vllm.quant.quartet2.kernels import marlin, marlin_dequant, quantize
    from turboquant_vllm.quant.quartet2.kernels.dequantize.naive import unscaled_values

    w = quantize.quantize_weight((torch.randn(n, k, generator=gen, device="cuda") * 0.02).to(torch.bfloat16))
    exact = unscaled_values(w.packed, w.scales).double() * w.tensor_scale.double()
    dense = exact.to(torch.bfloat16)  # exact: at most 7 significant bits
    m = marlin.prepare(w, torch.bfloat16)
    out = marlin_dequant.reserve_scratch(n * k, "cuda", torch.bfloat16)
    ms = common.time_ms(lambda: marlin_dequant.dequantize(m.weight, m.weight_scale, n, k, out))
    nvfp4_bytes = n * k // 2 + n * k // 16
    rows = [dict(K=k, N=n, tokens=0, path="decode", time_ms=ms, weight_gbps=(nvfp4_bytes + 2 * n * k) / ms / 1e6)]
    print(line(rows[-1]), flush=True)
    for tokens_ in tokens:
        x = torch.randn(tokens_, k, generator=gen, device="cuda").to(torch.bfloat16)
        ref = x.double() @ exact.t()
        fns = {"dense": lambda x: torch.nn.functional.linear(x, dense), **paths(m)}
        for path in [p for p in PATHS if applies(fns, p, tokens_)]:
            y = fns[path](x)
            ms = common.time_ms(lambda x=x, fn=fns[path]: fn(x))
            weight_bytes = 2 * n * k if path == "dense" else nvfp4_bytes
            rows.append(dict(K=k, N=n, tokens=tokens_, path=path, time_ms=ms, weight_gbps=weight_bytes / ms / 1e6,
                             tflops=2 * tokens_ * k * n / ms / 1e9, nan=bool(y.isnan().any()),
                             rel_error=((y.double() - ref).norm() / ref.norm()).item()))
            print(line(rows[-1]), flush=True)
    return rows


def block(model: str, gen: torch.Generator, tokens: tuple[int, ...]) -> list[dict]:
    """One block's layers in a row over COPIES copies of their weights: ms per block per path."""
    from turboquant_vllm.quant.quartet2.kernels import marlin, quantize
    from turboquant_vllm.quant.quartet2.kernels.dequantize.naive import unscaled_values

    shapes = MODELS[model]
    copies = []
    for _ in range(COPIES):
        layer = []
        for k, n in shapes:
            w = quantize.quantize_weight((torch.randn(n, k, generator=gen, device="cuda") * 0.02).to(torch.bfloat16))
            dense = (unscaled_values(w.packed, w.scales) * w.tensor_scale).to(torch.bfloat16)
            layer.append((paths(marlin.prepare(w, torch.bfloat16)), dense))
        copies.append(layer)
    nvfp4_bytes = sum(n * k // 2 + n * k // 16 for k, n in shapes)
    dense_bytes = sum(2 * n * k for k, n in shapes)
    rows = []
    for tokens_ in tokens:
        xs = [torch.randn(tokens_, k, generator=gen, device="cuda").to(torch.bfloat16) for k, _ in shapes]
        for path in [p for p in PATHS if applies(copies[0][0][0], p, tokens_)]:
            def step(path=path):
                for layer in copies:
                    for x, (fns, dense) in zip(xs, layer):
                        if path == "dense":
                            torch.nn.functional.linear(x, dense)
                        else:
                            fns[path](x)

            ms = common.time_ms(step) / COPIES
            weight_bytes = dense_bytes if path == "dense" else nvfp4_bytes
            rows.append(dict(block=model, tokens=tokens_, path=path, time_ms=ms, weight_gbps=weight_bytes / ms / 1e6))
            print(block_line(rows[-1]), flush=True)
    return rows


def block_line(r: dict) -> str:
    return f"| {r['tokens']} | {r['path']} | {r['time_ms'] * 1e3:.1f} | {r['weight_gbps']:.0f} |"


def line(r: dict) -> str:
    if r["path"] == "decode":
        return f"| {r['K']}x{r['N']} | - | decode | {r['time_ms']:.4f} | {r['weight_gbps']:.0f} | - | - |"
    return (f"| {r['K']}x{r['N']} | {r['tokens']} | {r['path']} | {r['time_ms']:.4f} | {r['weight_gbps']:.0f} | "
            f"{r['tflops']:.1f} | {r['rel_error']:.2e}{' NaN' if r['nan'] else ''} |")


def markdown(rows: list[dict], blocks: list[dict], model: str, dense_min_tokens: int, policy_tokens: int) -> str:
    out = [f"NVFP4 weight GEMM (W4A16, bf16 activations), {model}'s linear layers (K x N), random weights quantized by "
           f"the 4/6 rule. policy: the native few-token kernel (mma) up to {policy_tokens} tokens where built, Marlin "
           f"below {dense_min_tokens} tokens, the weight decoded for cuBLAS from there. "
           "decode rows: the decoder alone (GB/s: codes and scales read + bf16 written). Weight GB/s: the path's "
           "weight bytes (NVFP4: 0.5625 B a weight; dense: 2) / time.", ""]
    if blocks:
        out += [f"One block's {len(MODELS[model])} layers in a row, each read from HBM ({COPIES} copies of the "
                "weights), time per block:", "", "| tokens | path | µs / block | weight GB/s |",
                "| --- | --- | --- | --- |"]
        out += [block_line(r) for r in blocks]
        out.append("")
    if not rows:
        return "\n".join(out) + "\n"
    out += ["One layer, its weight repeated (L2-resident when it fits):", "",
            "| K x N | tokens | path | time (ms) | weight GB/s | TFLOP/s | rel. error |",
            "| --- | --- | --- | --- | --- | --- | --- |"]
    out += [line(r) for r in rows]
    out += ["", "Speed against dense bf16 (dense's time / the path's, > 1 faster):", "",
            "| K x N | tokens | " + " | ".join(PATHS[1:]) + " |", "| --- | --- |" + " --- |" * (len(PATHS) - 1)]
    keyed = {(r["K"], r["N"], r["tokens"], r["path"]): r["time_ms"] for r in rows}
    for (k, n, m, path), ms in keyed.items():
        if path == "dense":
            out.append(f"| {k}x{n} | {m} | " + " | ".join(f"{ms / keyed[(k, n, m, p)]:.2f}x" if (k, n, m, p) in keyed
                                                          else "-" for p in PATHS[1:]) + " |")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = common.parser(NAME, __doc__)
    ap.add_argument("--model", choices=list(MODELS), default="cloverlm-4b")
    ap.add_argument("--tokens", default=TOKENS)
    common.add_out_argument(ap, "benchmarks/results/nvfp4_gemm/<gpu>-<model>")
    args = ap.parse_args(argv)
    meta = common.print_header(common.command_line(NAME, argv))
    from benchmarks.awq_gemm import vllm_process_group
    from turboquant_vllm.quant.quartet2.kernels import marlin, marlin_mma

    vllm_process_group()
    gen = torch.Generator(device="cuda").manual_seed(0)
    blocks = block(args.model, gen, BLOCK_TOKENS)
    torch.cuda.empty_cache()
    rows = []
    for k, n in MODELS[args.model]:
        rows += run(k, n, [int(t) for t in args.tokens.split(",")], gen)
        torch.cuda.empty_cache()
    stem = common.stem_of(args.out) if args.out else common.result_stem(NAME, args.model)
    doc = {"rows": rows, "blocks": blocks, "meta": {"model": args.model, "dense_min_tokens": marlin.dense_threshold(),
                                                    "policy_tokens": marlin_mma.POLICY_TOKENS}}
    common.write_json(common.with_ext(stem, ".json"), doc, meta)
    text = markdown(rows, blocks, args.model, marlin.dense_threshold(), marlin_mma.POLICY_TOKENS)
    common.write_markdown(common.with_ext(stem, ".md"), text, meta)
    print(f"wrote {stem}.json / .md", flush=True)


if __name__ == "__main__":
    main()
