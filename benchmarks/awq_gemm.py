"""AWQ int4 GEMM (group 128) on the GPU: TurboMind's kernels (the `turbomind` wheel) against vLLM's own AWQ kernels
(the kernel vLLM's AWQ method picks on this GPU, Marlin, vLLM's Triton AWQ GEMM) and the bf16 / fp16 dense matmul,
over the linear layers of a 7-8B model and token counts 1 .. 4096.

Every path gets the same AutoAWQ tensors (round-to-nearest codes of a random weight, quant.awq_turbomind.awq_format)
and the same activations; vLLM's paths go through its own linear methods (create_weights, the checkpoint's tensors
copied in, process_weights_after_loading, apply), so they run what `vllm serve -q awq` runs. Times: CUDA-graph replay
(median); a path that cannot be captured is timed launched and marked. Error: relative Frobenius error against the
fp32 product x @ dequantize(W).

    python -m benchmarks awq_gemm [--shapes K,N;...] [--tokens 1,16,64,256,1024,4096] [--dtypes float16,bfloat16]
        [--out PATH]

Writes benchmarks/results/awq_gemm/<gpu>-g128.{json,md}.
"""

from __future__ import annotations

import torch

from . import common

NAME = "awq_gemm"
GROUP = 128
# Llama-3-8B / Qwen2.5-7B-like layers: fused QKV, attention output, fused gate/up, down (K, N)
SHAPES = "4096,6144;4096,4096;4096,28672;14336,4096"
TOKENS = "1,16,64,256,1024,4096"


def awq_weight(k: int, n: int, gen: torch.Generator):
    from turboquant_vllm.quant.awq_turbomind import awq_format

    w = torch.randn(k, n, generator=gen, device="cuda") * 0.02
    return awq_format.quantize(w, GROUP)


def vllm_layer(w, k: int, n: int, dtype: torch.dtype, kernel: str | None):
    """vLLM's AWQ linear method over w: kernel None -> AutoAWQLinearMethod (Triton AWQ GEMM), "auto" -> the kernel
    vLLM's AWQ Marlin method chooses here, else that MPLinearKernel class by name. Returns (apply, kernel name)."""
    from vllm.model_executor.kernels import linear as kernels
    from vllm.model_executor.layers.quantization.auto_awq import (AutoAWQConfig, AutoAWQLinearMethod,
                                                                  AutoAWQMarlinLinearMethod)

    config = AutoAWQConfig(4, GROUP, True, False)
    layer = torch.nn.Module()
    with torch.device("cuda"):
        if kernel is None:
            method = AutoAWQLinearMethod(config)
        else:
            method = AutoAWQMarlinLinearMethod(config)
        method.create_weights(layer, k, [n], k, n, dtype, weight_loader=lambda *a, **kw: None)
    if kernel not in (None, "auto"):
        cls = getattr(kernels, kernel)
        method.kernel = cls(method.kernel.config, w_q_param_name="qweight", w_s_param_name="scales",
                            w_zp_param_name="qzeros")
    layer.qweight.data.copy_(w.qweight)
    layer.qzeros.data.copy_(w.qzeros)
    layer.scales.data.copy_(w.scales.to(dtype))
    method.process_weights_after_loading(layer)
    name = "AutoAWQLinearMethod (Triton)" if kernel is None else type(method.kernel).__name__
    return (lambda x: method.apply(layer, x)), name


def vllm_process_group() -> None:
    """vLLM's linear methods ask for the tensor-parallel group: a one-process group, as an engine of TP 1 has."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel

    with set_current_vllm_config(VllmConfig()):
        init_distributed_environment(world_size=1, rank=0, local_rank=0,
                                     distributed_init_method="tcp://127.0.0.1:29517", backend="nccl")
        initialize_model_parallel(1)


def turbomind_layer(w, k: int, n: int):
    import turbomind

    lin = turbomind.Linear(k, n, quant_method="awq", w_bit=4, group_size=GROUP)
    lin.qweight.copy_(w.qweight)
    lin.qzeros.copy_(w.qzeros)
    lin.scales.copy_(w.scales)
    lin.post_init()
    return lin.forward, f"turbomind {turbomind.__version__ if hasattr(turbomind, '__version__') else ''}".strip()


def timed(fn) -> tuple[float, bool]:
    """(ms, captured): CUDA-graph replay, else launched."""
    try:
        return common.time_ms(fn), True
    except Exception:  # noqa: BLE001 - a path that cannot be captured is timed launched
        torch.cuda.synchronize()
        return common.time_ms(fn, cuda_graph=False), False


def run(k: int, n: int, tokens: list[int], dtypes: list[torch.dtype], gen: torch.Generator) -> list[dict]:
    from turboquant_vllm.quant.awq_turbomind import awq_format

    w = awq_weight(k, n, gen)
    dense = awq_format.dequantize(w)  # fp32 (K, N)
    rows = []
    for dtype in dtypes:
        paths = {"dense": None}
        builders = {"turbomind": lambda: turbomind_layer(w, k, n),
                    "vllm_auto": lambda: vllm_layer(w, k, n, dtype, "auto"),
                    "vllm_marlin": lambda: vllm_layer(w, k, n, dtype, "MarlinLinearKernel"),
                    "vllm_awq_triton": lambda: vllm_layer(w, k, n, dtype, None)}
        names = {"dense": f"torch matmul {dtype}".replace("torch.", "")}
        for path, build in builders.items():
            try:
                paths[path], names[path] = build()
            except Exception as e:  # noqa: BLE001 - a path that cannot build is a result too
                paths[path] = None
                names[path] = f"failed: {type(e).__name__}: {str(e)[:200]}"
        w_t = dense.t().contiguous().to(dtype)  # nn.Linear's (N, K)
        for m in tokens:
            x = torch.randn(m, k, generator=gen, device="cuda").to(dtype)
            ref = x.float() @ dense
            for path in ["dense", *builders]:
                row = dict(K=k, N=n, tokens=m, dtype=str(dtype).replace("torch.", ""), path=path, kernel=names[path])
                fn = (lambda x=x: torch.nn.functional.linear(x, w_t)) if path == "dense" else paths[path]
                if fn is None:
                    rows.append(row)
                    continue
                if path == "turbomind" and dtype != torch.float16:
                    fn = (lambda x=x, f=fn: f(x.half()).to(dtype))  # fp16 kernels: cast at the boundary
                else:
                    fn = (lambda x=x, f=fn: f(x))
                try:
                    out = fn()
                    torch.cuda.synchronize()
                    ms, graph = timed(fn)
                except Exception as e:  # noqa: BLE001
                    rows.append(dict(row, error=f"{type(e).__name__}: {str(e)[:200]}"))
                    print(row, rows[-1]["error"], flush=True)
                    continue
                err = ((out.float() - ref).norm() / ref.norm()).item()
                weight_bytes = k * n // 2 + (k // GROUP) * n * 2.5 if path != "dense" else k * n * 2
                rows.append(dict(row, time_ms=ms, cuda_graph=graph, rel_error=err, nan=bool(out.isnan().any()),
                                 tflops=2 * m * k * n / ms / 1e9, weight_gbps=weight_bytes / ms / 1e6))
                print(line(rows[-1]), flush=True)
    return rows


def line(r: dict) -> str:
    head = f"| {r['K']}x{r['N']} | {r['tokens']} | {r['dtype']} | {r['path']} |"
    if "time_ms" not in r:
        return f"{head} {r.get('error') or r['kernel']} | | | |"
    return (f"{head} {r['time_ms']:.4f}{'' if r['cuda_graph'] else ' (launched)'} | {r['weight_gbps']:.0f} | "
            f"{r['tflops']:.1f} | {r['rel_error']:.2e}{' NaN' if r['nan'] else ''} |")


def markdown(rows: list[dict]) -> str:
    kernels = sorted({f"{r['path']}: {r['kernel']}" for r in rows})
    out = ["AWQ int4 GEMM, group 128, random weights (RTN codes) and activations.", "",
           "Paths: " + "; ".join(kernels), "",
           "| K x N | tokens | activations | path | time (ms) | weight GB/s | TFLOP/s | rel. error |",
           "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    out += [line(r) for r in rows]
    # speed-up of turbomind over every other path, per row group
    out += ["", "Time of the other path / turbomind's (> 1: turbomind faster):", "",
            "| K x N | tokens | activations | vs vllm_auto | vs vllm_marlin | vs dense |",
            "| --- | --- | --- | --- | --- | --- |"]
    keyed = {(r["K"], r["N"], r["tokens"], r["dtype"], r["path"]): r.get("time_ms") for r in rows}
    for (k, n, m, dt, path), ms in keyed.items():
        if path != "turbomind" or not ms:
            continue
        ratio = [keyed.get((k, n, m, dt, p)) for p in ("vllm_auto", "vllm_marlin", "dense")]
        out.append(f"| {k}x{n} | {m} | {dt} | " + " | ".join(f"{o / ms:.2f}x" if o else "-" for o in ratio) + " |")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = common.parser(NAME, __doc__)
    ap.add_argument("--shapes", default=SHAPES, help="K,N;... (in_features, out_features)")
    ap.add_argument("--tokens", default=TOKENS)
    ap.add_argument("--dtypes", default="float16,bfloat16")
    common.add_out_argument(ap, "benchmarks/results/awq_gemm/<gpu>-g128")
    args = ap.parse_args(argv)
    meta = common.print_header(common.command_line(NAME, argv))
    gen = torch.Generator(device="cuda").manual_seed(0)
    try:
        vllm_process_group()
    except Exception as e:  # noqa: BLE001 - vLLM's paths then fail with their own message
        print(f"vLLM's process group: {type(e).__name__}: {e}", flush=True)
    tokens = [int(t) for t in args.tokens.split(",")]
    dtypes = [getattr(torch, d) for d in args.dtypes.split(",")]
    rows = []
    for spec in args.shapes.split(";"):
        k, n = map(int, spec.split(","))
        rows += run(k, n, tokens, dtypes, gen)
        torch.cuda.empty_cache()
    stem = common.stem_of(args.out) if args.out else common.result_stem(NAME, f"g{GROUP}")
    common.write_json(common.with_ext(stem, ".json"), {"rows": rows}, meta)
    common.write_markdown(common.with_ext(stem, ".md"), markdown(rows), meta)
    print(f"wrote {stem}.json / .md", flush=True)


if __name__ == "__main__":
    main()
