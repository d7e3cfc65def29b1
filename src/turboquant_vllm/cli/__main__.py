"""`python -m turboquant_vllm.cli`: the turboquant-vllm command where its console script is not on PATH."""

import sys

from . import main

if __name__ == "__main__":
    sys.exit(main())
