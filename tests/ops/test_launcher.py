"""ops.launcher.launch: kernel[grid]'s binary, chosen by the kernel's own specialization, launched directly."""

import pytest
import torch
import triton
import triton.language as tl

from turboquant_vllm.ops import launcher
from turboquant_vllm.ops.launcher import launch


@triton.jit
def _axpy_kernel(x_ptr, y_ptr, out_ptr, n, alpha, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = i < n
    x = tl.load(x_ptr + i, mask=ok)
    y = tl.load(y_ptr + i, mask=ok)
    tl.store(out_ptr + i, (alpha * x.to(tl.float32) + y.to(tl.float32)).to(out_ptr.dtype.element_ty), mask=ok)


def test_interpreted_or_hooked_launches_take_kernel_grid(monkeypatch):
    seen = []

    class Kernel:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: seen.append((grid, args, kwargs))

    monkeypatch.setattr(launcher, "INTERPRETED", True)
    launch(Kernel(), (3, 2), 1, 2, BLOCK=4)
    assert seen == [((3, 2), (1, 2), {"BLOCK": 4})]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_launch_reuses_only_the_binary_of_the_same_specialization(monkeypatch):
    """Sizes of 1, multiples of 16 and others, pointers aligned to 16 bytes and not, two dtypes: each result equals
    the reference, and JITFunction.run (compiling or picking a binary) runs once per specialization, never again."""
    runs = []
    original = triton.runtime.JITFunction.run

    def counting(self, *args, **kwargs):
        runs.append(1)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(triton.runtime.JITFunction, "run", counting)
    base = torch.randn(4096 + 8, device="cuda")
    cases = [(n, offset, dtype) for dtype in (torch.float32, torch.float16) for n in (1, 16, 17, 4096)
             for offset in (0, 1)]

    def check(n, offset, dtype):
        x = base.to(dtype)[offset: offset + n]
        y = base.flip(0).to(dtype)[offset: offset + n]
        out = torch.full_like(x, float("nan"))
        launch(_axpy_kernel, (triton.cdiv(n, 256),), x, y, out, n, 0.5, BLOCK=256)
        torch.testing.assert_close(out, (0.5 * x.float() + y.float()).to(dtype))

    for case in cases:
        check(*case)
    compiled = len(runs)
    for case in cases:
        check(*case)
    assert 0 < compiled <= len(cases) and len(runs) == compiled, (compiled, len(runs))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_attention_through_launch_equals_kernel_grid(monkeypatch):
    """A decode step (store with the query rotation, decode kernel, merge) gives the same bits launched directly as
    through kernel[grid] (forced by a launch hook, as a profiler would set one)."""
    from triton import knobs

    from tests.ops.cases import make_paged_batch
    from turboquant_vllm.ops import paged_attention, store_kv

    gen = torch.Generator().manual_seed(5)
    b = make_paged_batch(gen, "tq4", 128, 2, 16, [300, 17, 1000], torch.bfloat16, "cuda")
    store_kv(b.keys, b.values, b.kv_cache, b.slot_mapping, b.layout)
    query = torch.randn(3, 8, 128, generator=gen).to(torch.bfloat16).cuda()
    qsl = torch.arange(4, dtype=torch.int32, device="cuda")

    def step():
        cache = b.kv_cache.clone()
        last = torch.tensor([299, 316, 1316], device="cuda")
        rotated = store_kv(b.keys[last], b.values[last], cache, b.slot_mapping[last], b.layout, query=query,
                           query_scale=128**-0.5)
        out = torch.full_like(query, float("nan"))
        paged_attention(query, cache, b.layout, b.block_table, qsl, b.seq_lens, max_query_len=1, scale=128**-0.5,
                        out=out, rotated_query=rotated)
        return out

    step()  # compiles
    direct = step()
    monkeypatch.setattr(knobs.runtime, "launch_enter_hook", lambda *args: None)
    through_grid = step()
    assert not direct.isnan().any() and torch.equal(direct, through_grid)
