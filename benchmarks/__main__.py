"""python -m benchmarks <name> [args...]: run one benchmark; without a name (or with --help), list them."""

from __future__ import annotations

import importlib
import sys

from . import BENCHMARKS


def usage() -> str:
    width = max(map(len, BENCHMARKS))
    lines = ["usage: python -m benchmarks <name> [args...]   (python -m benchmarks <name> --help: its options)", "",
             "benchmarks:"]
    lines += [f"  {name:{width}s}  {what}" for name, what in BENCHMARKS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage())
        return 0
    name, rest = argv[0].removesuffix(".py"), argv[1:]
    if name not in BENCHMARKS:
        print(f"unknown benchmark {name!r}\n\n{usage()}", file=sys.stderr)
        return 2
    importlib.import_module(f"benchmarks.{name}").main(rest)
    return 0


if __name__ == "__main__":
    sys.exit(main())
