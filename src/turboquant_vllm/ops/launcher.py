"""Launching Triton kernels with less host time than `kernel[grid](...)`.

Steps that mix prefills and decodes run attention eagerly, one layer after another, and there the host's time to
issue the launches is the step's time on a small model (benchmarks/results/layer_step/). `JITFunction.run` spends
most of its ~35 µs a launch outside specialization: options, hooks, device and stream lookups, checks of global
values, launch metadata. `launch` binds and specializes the arguments with the kernel's own binder, so the binary it
finds is the one `kernel[grid]` would pick, and calls that binary's launcher directly. Anything it cannot do that
way (a first call that compiles, the interpreter, launch hooks such as a profiler's, a Triton whose internals differ)
goes through `kernel[grid]`.
"""

from __future__ import annotations

from typing import Any

import triton

from .utils import INTERPRETED

try:  # Triton 3.x internals; without them every launch takes kernel[grid]
    from triton import knobs
    from triton.runtime.driver import driver
    from triton.runtime.jit import compute_cache_key
except ImportError:  # pragma: no cover - other Triton versions
    knobs = None


def launch(kernel: triton.runtime.JITFunction, grid: tuple[int, ...], *args: Any, **kwargs: Any) -> None:
    """kernel[grid](*args, **kwargs), through the compiled binary once there is one for these arguments."""
    if INTERPRETED or knobs is None or knobs.runtime.launch_enter_hook or knobs.runtime.launch_exit_hook:
        kernel[grid](*args, **kwargs)
        return
    # As JITFunction.run sets them: they enter the options, hence the cache key.
    kwargs["debug"] = kwargs.get("debug", kernel.debug) or knobs.runtime.debug
    kwargs["instrumentation_mode"] = knobs.compilation.instrumentation_mode
    device = driver.active.get_current_device()
    kernel_cache, key_cache, _, _, binder = kernel.device_caches[device]
    bound, specialization, options = binder(*args, **kwargs)
    compiled = kernel_cache.get(compute_cache_key(key_cache, specialization, options))
    if compiled is None or hasattr(compiled, "result") or kernel.pre_run_hooks:
        kernel[grid](*args, **kwargs)  # compiles (or waits for an asynchronous compile) and caches it
        return
    compiled.run(grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1,
                 driver.active.get_current_stream(device), compiled.function, compiled.packed_metadata, None,
                 None, None, *bound.values())
