#!/usr/bin/env bash
# The CUDA checks to run where a GPU machine is lent (.library/device): the Triton paged-attention backend's
# tests on the GPU (tests/attention/test_triton_paged.py: against dense attention, then the engine against the
# reference backend), then its speed against the reference backend (benchmarks/bench_attention_cuda.py).
# Needs a CUDA build of PyTorch, Triton and heron's Python dependencies (carry the missing ones as wheels, as the
# device tool's README says). From the repository root:
#
#     bash benchmarks/gpu_check.sh [OUT_DIR]     # results also copied to OUT_DIR (e.g. the device's $OUT)
set -uo pipefail
out=${1:-}
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
python3 -c "import torch, triton; assert torch.cuda.is_available(), 'no GPU'; \
print(torch.cuda.get_device_name(), 'torch', torch.__version__, 'triton', triton.__version__)" || exit 1
status=0
python3 -m pytest -q -p no:cacheprovider tests/attention/test_triton_paged.py || status=1
name=attention_cuda_$(date +%Y%m%d_%H%M)
python3 -m benchmarks.bench_attention_cuda --name "$name" || status=1
if [ -n "$out" ]; then cp "benchmarks/results/$name.json" "$out/" 2>/dev/null || true; fi
exit $status
