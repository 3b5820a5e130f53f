#!/usr/bin/env bash
# The one prepared run for a GPU machine, sized for about 8 minutes on one H200 with 16 cores:
#   bash benchmarks/gpu_check.sh [REPORT_DIR]        (from anywhere; it works in the repository root)
# 1. builds the C++ and CUDA ops in place with the machine's python3, its torch (a CUDA build, as
#    it is there) and nvcc: nothing is installed, the tree is put on PYTHONPATH;
# 2. runs the CUDA tests: the engine and its ops (tests/stages/test_cuda_engine.py), every torch op against its
#    reference and opcheck (tests/stages/test_torch_ops.py), the LoRA op on the
#    GPU (tests/lora/test_lora_merge_op.py), every engine writing the same bytes (tests/stages/test_engines.py),
#    save_pretrained from live FSDP2 models with CUDA tensors (tests/live/test_save_pretrained_cuda.py);
# 3. runs benchmarks/gpu_bench.py: an offline merge of a 3.8 GB fp32 FSDP2 checkpoint with every
#    engine at --dtype keep and bf16 (outputs compared across engines), the device kernel, pinned copies;
#    then benchmarks/live_save.py --device cuda: saving a live 3.5 GB fp32 model on the GPU (one NCCL
#    rank) as a bf16 folder, fsdpfast vs full-state-dict gather + save_pretrained vs DCP + consolidation;
# 4. only if the tests passed, records the engine measured fastest per kind of job where
#    `--engine auto` reads it on this machine (fsdpfast/execute/measurements.py).
# REPORT_DIR (default $OUT, else /tmp/fsdpfast-gpu-report) gets gpu.txt, build.log, tests.log,
# gpu_bench.md, live_save_gpu.md and engine-measurements.json. FSDPFAST_GPU_CHECK_SECONDS (default 480) bounds the whole run.
set -uo pipefail
cd "$(dirname "$0")/.."
START=$SECONDS
BUDGET=${FSDPFAST_GPU_CHECK_SECONDS:-480}
REPORT_DIR=${1:-${OUT:-/tmp/fsdpfast-gpu-report}}
mkdir -p "$REPORT_DIR"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} MAX_JOBS=${MAX_JOBS:-$(nproc)}
step() { echo "=== $1 ($((SECONDS - START)) s) ==="; }
left() { echo $((BUDGET - (SECONDS - START))); }

step "machine"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$REPORT_DIR/gpu.txt"
python3 - <<'PY' 2>&1 | tee -a "$REPORT_DIR/gpu.txt"
import os, setuptools, torch
print(f"torch {torch.__version__} (CUDA {torch.version.cuda}), GPU visible: {torch.cuda.is_available()}, "
      f"setuptools {setuptools.__version__}, {os.cpu_count()} CPUs")
assert torch.version.cuda, "this python3's torch is a CPU build: the CUDA ops cannot be built"
assert int(setuptools.__version__.split(".")[0]) >= 77, "setuptools >= 77 is needed to read pyproject.toml (carry a wheel)"
PY
[ "${PIPESTATUS[0]}" = 0 ] || exit 1

step "build (FSDPFAST_CUDA=1, archs $TORCH_CUDA_ARCH_LIST, $MAX_JOBS jobs)"
# build/ stays: a rerun on the same machine recompiles only what changed (ninja); the modules are relinked.
rm -f fsdpfast/_C*.so fsdpfast/_native*.so fsdpfast/_build_config.py
if ! FSDPFAST_CUDA=1 timeout 300 python3 setup.py build_ext --inplace > "$REPORT_DIR/build.log" 2>&1; then
  tail -40 "$REPORT_DIR/build.log"
  exit 1
fi
grep -i "warning" "$REPORT_DIR/build.log" | sort | uniq -c | head -20
python3 -c "from fsdpfast import _ops; print('native cpu', _ops.native_cpu(), '| CUDA ops', _ops.native_cuda_built(), '| cuda engine usable', _ops.native_cuda())"

step "CUDA tests"
timeout 240 python3 -m pytest -q -p no:cacheprovider -o faulthandler_timeout=200 \
  tests/stages/test_cuda_engine.py tests/stages/test_torch_ops.py tests/lora/test_lora_merge_op.py tests/stages/test_engines.py tests/live/test_save_pretrained_cuda.py 2>&1 | tee "$REPORT_DIR/tests.log" | tail -25
TESTS=${PIPESTATUS[0]}
RECORD=()
if [ "$TESTS" = 0 ]; then
  RECORD=(--record "$(python3 -c 'from fsdpfast.execute.measurements import path; print(path())')")
else
  echo "tests failed (exit $TESTS): the benchmark still runs, but nothing is recorded for --engine auto"
fi

step "benchmark ($(left) s left)"
LIVE_SECONDS=120                    # kept for the live-save benchmark after it
BENCH_SECONDS=$(( $(left) - 90 - LIVE_SECONDS ))   # the rounds stop in time for the kernel figures and the report
[ "$BENCH_SECONDS" -lt 60 ] && BENCH_SECONDS=60
python3 benchmarks/gpu_bench.py --report "$REPORT_DIR/gpu_bench.md" --rounds 3 --seconds "$BENCH_SECONDS" "${RECORD[@]}"
BENCH=$?

step "live save benchmark ($(left) s left)"
# one round of each way in fresh processes: 2048 hidden, 16 layers (0.9 B parameters, 3.5 GB fp32 on the GPU)
timeout "$LIVE_SECONDS" python3 benchmarks/live_save.py --device cuda --world 1 --hidden 2048 --layers 16 \
  --rounds 1 --report "$REPORT_DIR/live_save_gpu.md"
LIVE=$?
[ "${#RECORD[@]}" -gt 0 ] && [ -f "${RECORD[1]}" ] && cp "${RECORD[1]}" "$REPORT_DIR/engine-measurements.json"

step "done: tests exit $TESTS, benchmark exit $BENCH, live save benchmark exit $LIVE"
[ "$TESTS" = 0 ] && [ "$BENCH" = 0 ] && [ "$LIVE" = 0 ]
