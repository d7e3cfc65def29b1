#!/bin/bash
# Device side of the GPU kit.
#   bash .gpukit/bin/kit.sh gather   take the carried piece(s), unpack every complete archive into /tmp/site;
#                                    prints "kit: ready" once torch, triton, vllm and the deps are in, and
#                                    "kit: G ready" for each optional group (fa2, moe, smollm2, turbomind,
#                                    gemma3) in
#   bash .gpukit/bin/kit.sh check    versions, CUDA, a matmul, turbomind if carried, and the carried requirements
# GPUKIT_SITE (default /tmp/site), GPUKIT_SPOOL (default /tmp/gpukit) and GPUKIT_MODELS (default /tmp/gpukit-models,
# the smollm2 and gemma3 wheels) move the roots, for a local trial.
set -euo pipefail
BIN="$(cd "$(dirname "$0")" && pwd)"
SITE="${GPUKIT_SITE:-/tmp/site}"
case "${1:-}" in
gather)
  # The image's python, without the kit on its path: kit.py finds the image's nvidia libraries.
  env -u PYTHONPATH python3 "$BIN/kit.py"
  mkdir -p "$SITE/bin"
  printf '#!/bin/sh\nexec python3 -m vllm.entrypoints.cli.main "$@"\n' >"$SITE/bin/vllm"
  chmod +x "$SITE/bin/vllm" ;;
check)
  # shellcheck source=/dev/null
  source "$BIN/env.sh"
  python3 "$BIN/check.py" ;;
*) echo "usage: $0 gather|check" >&2; exit 2 ;;
esac
