#!/usr/bin/env bash
# GPU check, for one short session on a lent GPU machine. The build always runs; then the stage
# groups named in GPU_CHECK_STAGES (default: all, about 10 minutes on one H200; the 2026-11-30 run of
# kernel, toy, learner and cpu took 281 s):
#
#   kernel    the CUDA tests (python_tests/ops/test_fused_cuda.py, the chunked log-probs on CUDA) and
#             the CUDA benchmark of the fused loss (benchmarks/bench_loss_cuda.py);
#   toy       a GPU training smoke run: `train --preset toy --device cuda --train.max_steps 100` next to
#             the same run on the CPU, compared on the training reward (it must rise on both);
#   learner   the learner step with the fused loss against the eager PyTorch loss, with its model
#             TFLOP/s and MFU (benchmarks/bench_learner_step.py), toy model and Qwen2.5-0.5B shape, the
#             latter with one step profiled (GPU time by category, busy share, heaviest kernels), then
#             again with bf16 operands for the output projection (train.head_operand_dtype bf16);
#   attention per-document attention on CUDA: its tests (varlen flash backend against SDPA and float64,
#             packed against padded) and the packed / padded / shared-prefix learner forward
#             (benchmarks/bench_packed_forward.py --device cuda);
#   engine    the hf engine's decode rate against its memory roofline, Qwen2.5-0.5B shape, bf16 and
#             float32 weights, the bf16 one with and without the preallocated KV cache and the
#             grouped decode attention (benchmarks/bench_engine_decode.py);
#   lora      the LoRA learner beside full fine-tuning at the Qwen2.5-0.5B shape (needs PEFT's wheel carried
#             in build/wheels);
#   train     `flashreinforce train --device cuda` on a Qwen2.5-0.5B-shaped model, 50 updates: tokens/s,
#             MFU, learner and worker shares (benchmarks/bench_train_throughput.py);
#   cpu       last, as a sanity check of the same build, the CPU loss, error, edge-case and contract tests.
#
# One device command may run 10 minutes and a session has 15 minutes of device time, start-up
# included, so "all" does not fit in one call. Correctness first (the CUDA kernel shares headers
# with the CPU one, which changed after its last GPU run on 2026-11-30: the float32 KL, the
# polynomials, the log_ratio gate metric), then what has never run on a GPU; a plan that fits (each
# call builds again, about 1-2 minutes for one architecture):
#   call 1: GPU_CHECK_STAGES="kernel attention" (the CUDA tests and loss benchmark, per-document attention)
#   call 2: GPU_CHECK_STAGES="learner engine" (the profiled Qwen2.5 steps, decode roofline and rollout engines)
#   call 3, if time is left: GPU_CHECK_STAGES="lora train"
#
#   bash scripts/gpu_check.sh                                   # from the repository root: everything
#   GPU_CHECK_STAGES="attention engine train" bash scripts/gpu_check.sh   # what has never run on a GPU
#   GPU_CHECK_KERNEL_ONLY=1 bash scripts/gpu_check.sh           # = GPU_CHECK_STAGES=kernel (after a kernel change)
#
# Each stage has its own time limit, and a failing stage does not stop the later ones; the exit
# status is that of the first failure. The GPU machine has no network: nothing is installed; the
# module is built with the CMake, pybind11 and PyTorch already there and placed next to the
# sources (flashreinforce/_C*.so, ignored by git), and Python finds the package through PYTHONPATH.
set -uo pipefail
cd "$(dirname "$0")/.."
# Keep a full log where the device tool returns files ($OUT), or under build/ elsewhere.
LOG_DIR=${OUT:-build}
mkdir -p "$LOG_DIR"
exec > >(tee -a "$LOG_DIR/gpu_check.log") 2>&1
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
ARCHS=${CUDA_ARCHS:-90}   # the lent GPUs are Hopper (sm_90); the default install builds 80;90
BUILD=build/gpu-check
mkdir -p build
start=$(date +%s)
status=0
STAGES=" ${GPU_CHECK_STAGES:-all} "
[ -n "${GPU_CHECK_KERNEL_ONLY:-}" ] && STAGES=" kernel "
# want GROUP: whether the stage group runs.
want() { [[ "$STAGES" == *" all "* || "$STAGES" == *" $1 "* ]]; }
elapsed() { echo "$(( $(date +%s) - start )) s"; }
# stage NAME LIMIT_S COMMAND...: run one stage under a time limit, remember the first failure.
stage() {
  local name=$1 limit=$2; shift 2
  echo; echo "== $name (limit ${limit} s, at $(elapsed))"
  timeout --signal=TERM --kill-after=10 "$limit" "$@"
  local rc=$?
  if [ $rc -ne 0 ]; then
    echo "!! $name failed (exit $rc$([ $rc -eq 124 ] && echo ', time limit'))"
    [ $status -eq 0 ] && status=$rc
  fi
  return 0
}

echo "== machine"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
"$PY" -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'device', torch.cuda.get_device_name(0), 'transformers', transformers.__version__)"
nvcc --version | tail -1
lscpu | grep -m1 'Model name' || true

echo "== build (CUDA archs $ARCHS)"
cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DFLASHREINFORCE_CUDA=ON \
  -DCMAKE_CUDA_ARCHITECTURES="$ARCHS" -Dpybind11_DIR="$("$PY" -m pybind11 --cmakedir)" \
  -DPython_EXECUTABLE="$(command -v "$PY")" > "$BUILD.configure.log" 2>&1 || { cat "$BUILD.configure.log"; exit 1; }
cmake --build "$BUILD" -j "$(nproc)" > "$BUILD.build.log" 2>&1 || { tail -40 "$BUILD.build.log"; exit 1; }
cp "$BUILD"/_C*.so flashreinforce/
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
"$PY" -c "import flashreinforce._C as C; assert C.has_cuda(), 'CUDA path missing'; print('has_cuda', C.has_cuda(), 'cpu isa', C.cpu_isa())" || exit 1
echo "build done after $(elapsed)"

echo "stage groups:$STAGES"

if want kernel; then
stage "CUDA tests" 150 "$PY" -m pytest -q -p no:cacheprovider -rs python_tests/ops/test_fused_cuda.py
stage "chunked log-probs on CUDA" 60 "$PY" -m pytest -q -p no:cacheprovider python_tests/ops/test_logprobs.py -k cuda
stage "CUDA benchmark of the fused loss" 200 "$PY" benchmarks/bench_loss_cuda.py ${BENCH_ARGS:-}
fi

if want toy; then
# GPU training smoke run, next to the same run on the CPU (same seed, same preset).
TOY=build/gpu-check-toy
rm -rf "$TOY"
for device in cuda cpu; do
  stage "toy training on $device" 150 "$PY" -m flashreinforce.cli train --preset toy --device "$device" \
    --train.max_steps 100 --no_progress --output "$TOY/$device"
done
stage "toy reward: cuda vs cpu" 30 "$PY" - "$TOY" <<'EOF'
import json, sys
from pathlib import Path
root = Path(sys.argv[1])
rows, ok = [], True
for device in ("cuda", "cpu"):
    path = root / device / "summary.json"
    if not path.exists():
        print(f"{device}: no summary.json (the run failed)"); ok = False; continue
    s = json.loads(path.read_text())
    ev = s.get("final_eval") or {}
    rise = (s["reward_last"] or 0) - (s["reward_first"] or 0)
    ok &= s["status"] == "completed" and rise >= 0.3
    rows.append(f"| {device:4} | {s['status']} | {s['step']} | {s['reward_first']:.3f} | {s['reward_last']:.3f} | "
                f"{ev.get('eval_success_rate', float('nan')):.3f} | {s['training_wall_s']:.1f} |")
print("| device | status | updates | reward, first 10 updates | reward, last 10 updates | eval success | training s |")
print("|---|---|---|---|---|---|---|")
print("\n".join(rows))
print("reward rises on both devices" if ok else "FAILED: the reward did not rise by >= 0.3 on every device")
sys.exit(0 if ok else 1)
EOF
cp "$TOY/cuda/summary.json" "$LOG_DIR/toy_cuda_summary.json" 2>/dev/null || true
cp "$TOY/cuda/metrics.jsonl" "$LOG_DIR/toy_cuda_metrics.jsonl" 2>/dev/null || true
fi

if want learner; then
stage "learner step, toy model" 90 "$PY" benchmarks/bench_learner_step.py --device cuda --shape tiny \
  --batch 128 --mean-len 24 --steps 20
stage "learner step, Qwen2.5-0.5B shape" 180 "$PY" benchmarks/bench_learner_step.py --device cuda \
  --shape qwen2.5-0.5b --batch 64 --mean-len 1024 --steps 5 --profile
stage "learner step, Qwen2.5-0.5B shape, bf16 output-projection operands" 120 "$PY" benchmarks/bench_learner_step.py \
  --device cuda --shape qwen2.5-0.5b --batch 64 --mean-len 1024 --steps 5 --skip-eager --head-operand-dtype bf16 --profile
fi

if want attention; then
stage "per-document attention on CUDA" 90 "$PY" -m pytest -q -p no:cacheprovider -rs python_tests/models/test_attention_cuda.py
stage "packed forward on CUDA" 240 "$PY" benchmarks/bench_packed_forward.py --device cuda --threads 4 \
  --shapes qwen2.5-0.5b --layers 24 --batches equal:16384 lognormal:16384 agentic:16384 lognormal:65536 \
  --modes padded dense packed shared --max-dense-tokens 16384 --repeats 3
fi

if want engine; then
# Batch 256, prompts of 96-128 tokens (padded, so attention gets a mask, as in rollouts): the
# preallocated KV cache and the grouped decode attention against transformers' DynamicCache and SDPA
# attention (four rows, the last is the engine before both changes).
stage "hf engine decode, bf16" 150 "$PY" benchmarks/bench_engine_decode.py --device cuda --shape qwen2.5-0.5b \
  --dtype bf16 --batch 256 --prompt-len 128 --prompt-spread 32 --new-tokens 128 --repeats 2 \
  --kv-cache preallocated dynamic --decode-attention on off
stage "hf engine decode, float32" 60 "$PY" benchmarks/bench_engine_decode.py --device cuda --shape qwen2.5-0.5b \
  --dtype fp32 --batch 256 --prompt-len 128 --prompt-spread 32 --new-tokens 128 --repeats 2 --kv-cache preallocated
# Rollout throughput against the decode floor, start and weight-sync times, per engine (vLLM is skipped,
# with the reason, where it is not installed: the lent machine has no vLLM).
stage "rollout engines" 200 "$PY" benchmarks/bench_rollout_engines.py --device cuda --shape qwen2.5-0.5b --dtype bf16 \
  --requests 32 256 --new-tokens 128 --repeats 2 --sync-repeats 2
fi

if want lora; then
# The LoRA learner beside full fine-tuning at the Qwen2.5-0.5B shape: step time, model TFLOP/s against a
# measured bf16 GEMM peak, peak memory, adapter bytes per sync. Needs PEFT: the lent machine has no network,
# so carry its wheel (pip download --no-deps peft -d build/wheels) and it is installed from there.
if ! "$PY" -c "import peft" 2>/dev/null && ls build/wheels/peft-*.whl >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-deps build/wheels/peft-*.whl || true
fi
stage "LoRA learner vs full, Qwen2.5-0.5B shape" 240 "$PY" benchmarks/bench_learner_mfu.py --device cuda \
  --shape qwen2.5-0.5b --dtype bf16 --lora-rank 16 --batch 64 --mean-len 1024 --micro-batch-tokens 16384 --steps 3
fi

if want train; then
stage "train on cuda, Qwen2.5-0.5B shape" 300 "$PY" benchmarks/bench_train_throughput.py \
  --output build/gpu-check-train --device cuda --shape qwen2.5-0.5b --updates 50 --batch 128 --new-tokens 128
cp build/gpu-check-train/metrics.jsonl "$LOG_DIR/train_cuda_metrics.jsonl" 2>/dev/null || true
fi

if want cpu; then
stage "CPU loss tests (same build)" 150 "$PY" -m pytest -q -p no:cacheprovider python_tests/ops/test_fused_loss.py \
  python_tests/ops/test_fused_errors.py python_tests/ops/test_edge_cases.py python_tests/ops/test_contract.py \
  -k "not each_cpu_instruction_set"
fi

echo; echo "== gpu_check finished after $(elapsed) (exit $status)"
exit $status
