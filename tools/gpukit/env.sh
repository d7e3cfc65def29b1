# Source on the GPU machine once `kit.sh gather` has said "kit: ready": the kit's torch, triton and vLLM
# come before the image's.
GPUKIT_SITE="${GPUKIT_SITE:-/tmp/site}"
export PYTHONPATH="$GPUKIT_SITE${PYTHONPATH:+:$PYTHONPATH}"
export PATH="$GPUKIT_SITE/bin:$PATH"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
# The image has cuDNN 9.19, torch 2.14 was built with 9.24; cuDNN is only checked when used.
export PYTORCH_SKIP_CUDNN_COMPATIBILITY_CHECK=1
# flashinfer does not travel: vLLM's own top-k/top-p sampler.
export VLLM_USE_FLASHINFER_SAMPLER=0
