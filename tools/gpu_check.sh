#!/usr/bin/env bash
# The GPU path in one run (<= 8 minutes on one H200): CUDA vs CPU logits, bf16 vs fp32 loss,
# TE vs local logits (when TE imports), tokens/s and MFU of the ~1B Llama recipe against a plain
# PyTorch loop, checkpoint save/load GB/s and async stall, an NCCL hang drill (2+ GPUs), then
# `pytest -m gpu`. Prints one JSON summary line at the end (also in $OUT, default gpu_check.json).
#   tools/gpu_check.sh [--dry-run]      --dry-run: the same logic on CPU at toy sizes
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
OUT=${OUT:-gpu_check.json}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

timeout 390 "$PY" tools/gpu_check.py --out "$OUT" "$@"
checks=$?
if [ "${1:-}" = "--dry-run" ]; then
  tests=skipped
else
  # 120 s: the TE tp=2 cases spawn two ranks (two more cases, with SP, on 2+ GPUs).
  timeout 120 "$PY" -m pytest -q -m gpu tests/ >gpu_pytest.log 2>&1
  case $? in 0) tests=passed ;; 5) tests=none_collected ;; *) tests=failed ;; esac
  tail -3 gpu_pytest.log
fi
# One line for the log: the checks' summary plus the pytest outcome.
"$PY" -c 'import json,sys; s=json.load(open(sys.argv[1])); s["pytest_gpu"]=sys.argv[2]; print(json.dumps(s))' "$OUT" "$tests"
[ "$checks" -eq 0 ] && [ "$tests" != failed ]
