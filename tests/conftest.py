import os

import pytest
import torch

# Without a GPU the Triton kernels run through Triton's interpreter; it reads this at import time.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _list_language_builtins_once() -> None:
    """Triton 3.8's interpreter lists triton.language's members (inspect.getmembers) again at every kernel launch to
    wrap its builtins, about a fifth of an interpreted test's time. The list never changes: take it once. Only the
    listing is cached; the wrapping, and its undoing after the launch, stay Triton's."""
    import inspect

    from triton.runtime import interpreter

    patch_attr, is_builtin = getattr(interpreter, "_patch_attr", None), interpreter.tl.core.is_builtin
    if patch_attr is None or not hasattr(interpreter, "_patch_builtin"):
        return  # another Triton: leave it as it is
    builtins: dict[int, list] = {}

    def patch_builtin(pkg, builder, scope):
        members = builtins.get(id(pkg))
        if members is None:
            members = builtins[id(pkg)] = [(n, m) for n, m in inspect.getmembers(pkg) if is_builtin(m)]
        for name, member in members:
            patch_attr(pkg, name, member, builder, scope)

    interpreter._patch_builtin = patch_builtin


def _patch_language_once_per_launch() -> None:
    """A launch patches triton.language for the interpreter and undoes it when the grid is done; Triton 3.8 patches
    it again at every call of a @triton.jit helper inside the kernel (per program, never undone: the launch's undoing
    covers it), a quarter of an interpreted test. A helper called while its modules are already patched runs as is;
    outside a launch, or seeing a module the launch did not patch, it takes Triton's way."""
    import inspect

    from triton.runtime import interpreter

    cls, tl = getattr(interpreter, "InterpretedFunction", None), interpreter.tl
    if cls is None or not hasattr(cls, "rewrite") or not hasattr(interpreter, "_patch_lang"):
        return  # another Triton: leave it as it is
    triton_call, is_builtin = cls.__call__, tl.core.is_builtin
    langs: dict = {}

    def call(self, *args, **kwargs):
        mods = langs.get(self.fn)
        if mods is None:
            mods = langs[self.fn] = [v for v in self.fn.__globals__.values()
                                     if inspect.ismodule(v) and v in (tl, tl.core)]
        if not mods or any(is_builtin(mod.load) for mod in mods):  # unpatched: tl.load is still the builtin
            return triton_call(self, *args, **kwargs)
        fn = self.rewrite()
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            raise interpreter.InterpreterError(repr(e)) from e

    cls.__call__ = call


def _memoize_numpy_dtypes() -> None:
    """The interpreter maps a Triton dtype to numpy's by building a 19-entry dict at each of its many calls (~6% of
    an interpreted test); the mapping is fixed: remember each answer."""
    from triton.runtime import interpreter

    tl, triton_np_dtype, known = interpreter.tl, getattr(interpreter, "_get_np_dtype", None), {}
    if triton_np_dtype is None:
        return  # another Triton: leave it as it is

    def get_np_dtype(tt_dtype):
        # a block's numpy dtype is its element's; pointers' Triton answers at once (neither kind hashes)
        key = tt_dtype.element_ty if isinstance(tt_dtype, tl.block_type) else tt_dtype
        if isinstance(key, tl.pointer_type):
            return triton_np_dtype(key)
        np_dtype = known.get(key)
        if np_dtype is None:
            np_dtype = known[key] = triton_np_dtype(key)
        return np_dtype

    interpreter._get_np_dtype = get_np_dtype


if os.environ.get("TRITON_INTERPRET") == "1":
    _list_language_builtins_once()
    _patch_language_once_per_launch()
    _memoize_numpy_dtypes()

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# The whole randomized kernel matrix runs on the GPU; the CPU (interpreter) runs a subset.
FULL_MATRIX = torch.cuda.is_available() or os.environ.get("TQ_FULL_MATRIX") == "1"


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
    mark_interpreter_tiers(items)


def mark_interpreter_tiers(items) -> None:
    """Under Triton's interpreter a kernel matrix costs minutes, so its cases come in two tiers. A test marked
    `matrix` runs a covering subset by default: the case ids in `matrix(fast=[...])`, else the first case that brings
    each parameter value (every preset, head dim, dtype ... once). Its other cases are marked `slow`: the default run
    (pyproject's addopts `-m "not slow"`) leaves them out, `pytest -m slow` runs them (CI runs both tiers). On a GPU
    every case runs."""
    seen: dict[str, set] = {}
    for item in items:
        mark = item.get_closest_marker("matrix")
        if mark is None:
            continue
        fast = mark.kwargs.get("fast")
        callspec = getattr(item, "callspec", None)
        if fast is not None:
            keep = callspec is not None and callspec.id in {str(case) for case in fast}
        else:
            values = {(name, repr(value)) for name, value in callspec.params.items()} if callspec else {("", "")}
            covered = seen.setdefault(item.nodeid.split("[")[0], set())
            keep = not values <= covered
            covered |= values
        if not keep:
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session")
def one_rank(tmp_path_factory):
    """vLLM's parallel layers and weight parameters ask for the tensor-parallel rank: a group of one process, as
    TP 1 has."""
    from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.distributed.parallel_state import model_parallel_is_initialized

    if not model_parallel_is_initialized():
        with set_current_vllm_config(VllmConfig(device_config=DeviceConfig(device=DEVICE))):
            init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                         distributed_init_method=f"file://{tmp_path_factory.mktemp('pg')}/init")
            initialize_model_parallel(1)
