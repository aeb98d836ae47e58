#!/usr/bin/env bash
# The README's "Seeing a run" figures: two chaos runs of the 3D CPU demo
# (tp2 x pp2 x dp2, 8 ranks) beside their fault-free reference, each with its
# `megaresil report`, copied (pictures, page, summary, chaos result) under
# bench/results/observe/. The run directories stay under $ROOT.
# Other work shared the 2-core machine while these ran: the times are slow and
# noisy; the ratios within one report are what to read.
set -euo pipefail
ROOT=${ROOT:-/tmp/megaresil-observe-bench}
OUT=bench/results/observe
COMMON=(train.steps=30 train.eval_interval=10 checkpoint.interval=10 logging.straggler_interval=5)
mkdir -p "$OUT"
python -m megaresil chaos recipes/gpt-tiny.yaml "${COMMON[@]}" run.dir="$ROOT/slow" \
  --scenario slow-rank | tee "$OUT/slow-rank.txt"
python -m megaresil chaos recipes/gpt-tiny.yaml "${COMMON[@]}" run.dir="$ROOT/kill" \
  --scenario kill-rank --reference "$ROOT/slow/reference" | tee "$OUT/kill-rank.txt"
for name in slow kill; do
  scenario=$([ $name = slow ] && echo slow-rank || echo kill-rank)
  rm -rf "$OUT/$scenario"
  cp -r "$ROOT/$name/faulted-$scenario/report" "$OUT/$scenario"
  cp "$ROOT/$name/faulted-$scenario/goodput.json" "$ROOT/$name/chaos-$scenario.json" "$OUT/$scenario/"
done
