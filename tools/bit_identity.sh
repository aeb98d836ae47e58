#!/usr/bin/env bash
# Train the same interrupted-and-resumed run on a base commit and on this
# working tree, and compare them bit for bit: every metrics row's step, loss,
# grad norm and learning rate as exact strings, and every checkpoint tensor
# (`megaresil ckpt diff`, optimizer moments included).
#
#   tools/bit_identity.sh BASE_SHA OUT_DIR [KEY=VALUE ...]
#
# The run is the one a refactor must not change: tp2 x pp2 x dp2, ZeRO-1,
# asynchronous saves, stopped at step 10 and resumed to step 20; extra
# KEY=VALUE overrides select a variant (model.flavour=llama, train.precision=
# bf16, checkpoint.local.enabled=true). Both trees run under this checkout's
# .venv with PYTHONPATH naming the tree, so the only difference is the code.
# OUT_DIR/base is kept and reused when its recipe is the same.
set -euo pipefail
base_sha=${1:?usage: tools/bit_identity.sh BASE_SHA OUT_DIR [KEY=VALUE ...]}
out=${2:?usage: tools/bit_identity.sh BASE_SHA OUT_DIR [KEY=VALUE ...]}
shift 2
repo=$(cd "$(dirname "$0")/.." && pwd)
python=$repo/.venv/bin/python
mkdir -p "$out"
out=$(cd "$out" && pwd)

recipe=(recipes/gpt-tiny.yaml parallel.tp=2 parallel.pp=2 parallel.dp=2
        optimizer.distributed=true checkpoint.async=true checkpoint.interval=5
        train.steps=20 train.eval_batches=0 "$@")

train_in() {  # TREE RUN_DIR: the run, stopped at step 10, then resumed
    local tree=$1 run=$2
    (cd "$tree" && PYTHONPATH="$tree" OMP_NUM_THREADS=1 "$python" -m megaresil train \
        "${recipe[@]}" train.exit_at_step=10 run.dir="$run" >/dev/null)
    (cd "$tree" && PYTHONPATH="$tree" OMP_NUM_THREADS=1 "$python" -m megaresil train \
        "${recipe[@]}" run.dir="$run" >/dev/null)
}

key=$(printf '%s\n' "$base_sha" "${recipe[@]}" | sha256sum | cut -c1-16)
if [ ! -f "$out/base/$key.done" ]; then
    rm -rf "$out/base" "$out/base-tree"
    git -C "$repo" worktree add -q --detach "$out/base-tree" "$base_sha"
    train_in "$out/base-tree" "$out/base/run"
    git -C "$repo" worktree remove --force "$out/base-tree"
    touch "$out/base/$key.done"
fi
rm -rf "$out/new"
train_in "$repo" "$out/new/run"

"$python" - "$out/base/run" "$out/new/run" <<'EOF'
import json, sys
def rows(run):
    keep = ("step", "loss", "grad_norm", "lr")
    with open(f"{run}/metrics.jsonl") as f:
        return [{k: repr(r.get(k)) for k in keep} for r in map(json.loads, f) if "loss" in r]
base, new = rows(sys.argv[1]), rows(sys.argv[2])
if base != new:
    sys.exit(f"metrics differ:\n base {base}\n new  {new}")
print(f"metrics: {len(new)} rows identical (step, loss, grad_norm, lr)")
EOF
for step in step_0000010 step_0000020; do
    "$python" -m megaresil ckpt diff "$out/base/run/checkpoints/$step" \
        "$out/new/run/checkpoints/$step" >/dev/null
    echo "checkpoint $step: every tensor identical"
done
