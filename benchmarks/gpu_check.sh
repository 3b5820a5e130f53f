#!/usr/bin/env bash
# One run on a GPU machine: build with CUDA, run the CUDA tests, then the GPU benchmark.
#   bash benchmarks/gpu_check.sh [REPORT_DIR]
# Uses the machine's python3 and torch (whatever CUDA build is there) and its nvcc.
set -uo pipefail
cd "$(dirname "$0")/.."
REPORT_DIR=${1:-${OUT:-/tmp/fsdpfast-gpu-report}}
mkdir -p "$REPORT_DIR"
export PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} MAX_JOBS=${MAX_JOBS:-16}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$REPORT_DIR/gpu.txt"

rm -rf build fsdpfast/_C*.so
FSDPFAST_CUDA=1 python3 -m pip install --no-deps --no-build-isolation -e . > "$REPORT_DIR/build.log" 2>&1 \
  || { tail -40 "$REPORT_DIR/build.log"; exit 1; }
python3 -c "from fsdpfast import _ops; print('native cpu', _ops.native_cpu(), 'cuda ops', _ops.native_cuda_built(), 'gpu', _ops.native_cuda())"

python3 -m pytest -q -p no:cacheprovider tests/test_cuda_engine.py tests/test_native_convert.py tests/test_engines.py \
  2>&1 | tee "$REPORT_DIR/tests.log" | tail -15
python3 benchmarks/gpu_bench.py --report "$REPORT_DIR/gpu_bench.md" --rounds 2 2>&1 | tail -40
