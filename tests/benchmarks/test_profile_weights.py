"""benchmarks.profile_weights without a GPU: kernel classes, the rows' summary and tables, the children's options."""

from benchmarks import profile_weights as pw


def test_kernel_classes():
    assert pw.kernel_class("void marlin::Marlin<1125899906909960l, 128, 1, 4>(int4 const*)") == "gemm"
    assert pw.kernel_class("nvjet_sm90_tst_64x8_64x16_2x1_v_bz_TNT") == "gemm"
    assert pw.kernel_class("void cublasLt::splitKreduce_kernel<32, 16, int, float>") == "gemm"
    assert pw.kernel_class("void cutlass::device_kernel<flash::enable_sm90_or_later<flash::FlashAttnFwdSm90<") == \
        "attention"
    assert pw.kernel_class("void vllm::reshape_and_cache_flash_kernel<__nv_bfloat16>") == "attention"
    assert pw.kernel_class("triton_poi_fused_pow_quartet2_marlin_gemm_relu_1") == "other"  # Inductor's, by op names
    assert pw.kernel_class("triton_red_fused_add_rms_norm_0") == "other"


def row():
    return dict(label="quartet2:marlin", kernel="Marlin FP4 W4A16", step_wall_ms=2.76, kernels={
        "void marlin::Marlin<128>": dict(us=884.0, launches=58.0),
        "void cutlass::device_kernel<flash::FlashAttnFwdSm90<": dict(us=294.0, launches=29.0),
        "triton_red_fused_add_rms_norm_0": dict(us=55.5, launches=29.0)})


def test_summary_and_markdown():
    r = row()
    r.update(pw.summarize(r))
    assert abs(r["kernel_ms"] - 1.2335) < 1e-9 and abs(r["gemm_ms"] - 0.884) < 1e-9
    assert abs(r["attention_ms"] - 0.294) < 1e-9 and abs(r["other_ms"] - 0.0555) < 1e-9 and r["launches"] == 116
    assert [k["cls"] for k in r["top"]] == ["gemm", "attention", "other"]
    args = pw.main.__globals__["argparse"].Namespace(batch=1, context=1024, steps=32)
    model = dict(num_hidden_layers=29, hidden_size=3584, intermediate_size=14336, num_attention_heads=28,
                 num_key_value_heads=7, head_dim=128, vocab_size=32000)
    md = pw.markdown([r, dict(label="bf16", error="timed out")], model, args)
    assert "| quartet2:marlin | Marlin FP4 W4A16 | 2.760 | 1.234 | 0.884 | 0.294 | 0.056 | 116 |" in md
    assert "| bf16 | **failed**: timed out |" in md and "| 884.0 | 58.0 | gemm | `void marlin::Marlin<128>` |" in md


def test_host_ops_are_summarized_when_recorded():
    r = dict(row(), host_ops={"cudaGraphLaunch": dict(us=40.0, calls=1.0), "aten::copy_": dict(us=90.0, calls=6.0)})
    r.update(pw.summarize(r))
    assert [o["name"] for o in r["top_host"]] == ["aten::copy_", "cudaGraphLaunch"]
    args = pw.main.__globals__["argparse"].Namespace(batch=1, context=1024, steps=32)
    md = pw.markdown([r], dict(num_hidden_layers=1, hidden_size=64, intermediate_size=128, num_attention_heads=2,
                               num_key_value_heads=1, head_dim=32, vocab_size=100), args)
    assert "host ops taking the most CPU time" in md and "| 90.0 | 6.0 | `aten::copy_` |" in md
    assert "top_host" not in pw.summarize(row())


def test_child_and_suite_arguments():
    args = pw.main.__globals__["argparse"].Namespace(suite="awq", model="cloverlm-4b", methods="awq_turbomind",
                                                     batch=1, context=512, steps=8, gpu_memory_utilization=0.8,
                                                     layers=8, cpu=True)
    assert pw.child_arguments(args)[-3:] == ["--layers", "8", "--cpu"]
    assert pw.suite_arguments(args) == ["--methods", "awq_turbomind", "--input-len", "512", "--output-len",
                                        str(pw.generated(args)), "--layers", "8"]
    args.suite = "weights"
    assert pw.suite_arguments(args)[-2:] == ["--model", "cloverlm-4b"]
    assert pw.suite("weights").arguments(pw.suite_arguments(args)).method_list == ["awq_turbomind"]
