"""`python -m turboquant_vllm.quant.quartet2.kernels.marlin_mma build [NVCC]`: the few-token kernel built once
(native.build)."""

from __future__ import annotations

import sys

from .native import BUILD_COMMAND, build


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args[:1] != ["build"]:
        print(f"usage: {BUILD_COMMAND} [NVCC]", file=sys.stderr)
        return 2
    try:
        print(build(args[1] if len(args) > 1 else None))
    except RuntimeError as e:
        print(f"marlin_mma build: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
