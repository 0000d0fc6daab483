#!/usr/bin/env bash
# GPU check of the fused loss, for one short session on a lent GPU machine (< 8 minutes):
# builds flashreinforce._C with the CUDA path, runs the CUDA tests (and the CPU loss, error,
# edge-case and contract tests as a sanity check of the same build), then the CUDA benchmark,
# which prints its tables.
#
#   bash scripts/gpu_check.sh            # from the repository root
#
# The GPU machine has no network: nothing is installed; the module is built with the CMake,
# pybind11 and PyTorch already there and placed next to the sources (flashreinforce/_C*.so,
# ignored by git), and Python finds the package through PYTHONPATH.
set -euo pipefail
cd "$(dirname "$0")/.."
# Keep a full log where the device tool returns files ($OUT), or under build/ elsewhere.
LOG_DIR=${OUT:-build}
mkdir -p "$LOG_DIR"
exec > >(tee -a "$LOG_DIR/gpu_check.log") 2>&1
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
ARCHS=${CUDA_ARCHS:-90}   # the lent GPUs are Hopper (sm_90); the default install builds 80;90
BUILD=build/gpu-check
start=$(date +%s)

echo "== machine"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
"$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'device', torch.cuda.get_device_name(0))"
nvcc --version | tail -1

echo "== build (CUDA archs $ARCHS)"
cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DFLASHREINFORCE_CUDA=ON \
  -DCMAKE_CUDA_ARCHITECTURES="$ARCHS" -Dpybind11_DIR="$("$PY" -m pybind11 --cmakedir)" \
  -DPython_EXECUTABLE="$(command -v "$PY")" > "$BUILD.configure.log" 2>&1 || { cat "$BUILD.configure.log"; exit 1; }
cmake --build "$BUILD" -j "$(nproc)" 2>&1 | tail -3
cp "$BUILD"/_C*.so flashreinforce/
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
"$PY" -c "import flashreinforce._C as C; assert C.has_cuda(), 'CUDA path missing'; print('has_cuda', C.has_cuda(), 'cpu isa', C.cpu_isa())"
echo "build done after $(( $(date +%s) - start )) s"

echo "== tests"
status=0
"$PY" -m pytest -q -p no:cacheprovider python_tests/ops/test_fused_cuda.py python_tests/ops/test_fused_loss.py \
  python_tests/ops/test_fused_errors.py python_tests/ops/test_edge_cases.py python_tests/ops/test_contract.py \
  -k "not each_cpu_instruction_set" -x || status=$?
# The learner's chunked log-probabilities on the GPU (pure PyTorch; needs no build).
"$PY" -m pytest -q -p no:cacheprovider python_tests/ops/test_logprobs.py -k cuda || status=$?
echo "tests done after $(( $(date +%s) - start )) s (exit $status)"

echo "== benchmark"
"$PY" benchmarks/bench_loss_cuda.py ${BENCH_ARGS:-} || status=$?
echo "== gpu_check finished after $(( $(date +%s) - start )) s (exit $status)"
exit $status
