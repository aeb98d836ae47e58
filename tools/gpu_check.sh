#!/usr/bin/env bash
# The GPU path in one call (<= 7 minutes on one H200): CUDA vs CPU logits, bf16 vs fp32 loss,
# TE vs local logits (when TE imports), tokens/s and MFU of the ~1B Llama recipe against a plain
# PyTorch loop, checkpoint save/load GB/s and async stall, the hang drill, then the GPU tests.
# Writes $OUT/gpu_check.json after each check (OUT: a directory, made if missing; default
# gpu_check_out), keeps every log under $OUT and prints a short table last.
#   tools/gpu_check.sh [--dry-run]      --dry-run: the same logic on CPU at toy sizes
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
OUT=${OUT:-gpu_check_out}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# cuBLAS reads it once per process, at the first GEMM: the deterministic checks need it set now.
export CUBLAS_WORKSPACE_CONFIG=${CUBLAS_WORKSPACE_CONFIG:-:4096:8}

# Budget (seconds): checks 300 + GPU tests 90 = 390 of the 420 a call may take here; each runs
# in a session of its own and timeout kills the whole group (-k: then SIGKILL).
timeout -k 10 300 setsid "$PY" tools/gpu_check.py --out "$OUT" "$@" 2>"$OUT/gpu_check.stderr.log"
checks=$?
if [ "${1:-}" = "--dry-run" ]; then
  tests=skipped
else
  # The GPU test files only: collecting the whole suite imports packages the device lacks.
  timeout -k 10 90 setsid "$PY" -m pytest -q -m gpu tests/test_gpu_path.py tests/test_te_gpu.py \
    >"$OUT/gpu_pytest.log" 2>&1
  case $? in 0) tests=passed ;; 5) tests=none_collected ;; *) tests=failed ;; esac
  tail -3 "$OUT/gpu_pytest.log"
fi
echo "pytest -m gpu: $tests   (checks exit $checks; details in $OUT/gpu_check.json)"
[ "$checks" -eq 0 ] && [ "$tests" != failed ]
