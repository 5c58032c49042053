#!/usr/bin/env bash
# The accelerator measurements (README "Training-step throughput", GPU rows) in one command, for
# a GPU machine lent for a few minutes: each benchmark has its own time limit, so one that hangs
# or runs out of memory costs its slot only, and every result lands in $OUT as it comes.
#
#   bash benchmarks/accelerator.sh            # writes $OUT (default /tmp/accelerator_out)
#   SIZES="tiny:8" SEQ=64 SPEEDUP_ARGS="--models=bert-large,albert-base --seq_len=64" \
#     bash benchmarks/accelerator.sh          # the same path in a minute on a CPU
#
# Output: train_step_<size>.json (ours vs HF PyTorch in bfloat16 autocast with SDPA, MFU
# against the device's spec-sheet peak; for the last size also cuDNN fused attention and the
# op totals of a profiled step), speedup.json (the paper's Table 2 column), a .log per run.
# The training path needs no TensorFlow, TFDS or blingfire; ml_collections (configs/) may be
# missing on an accelerator image: install it beside the repo first, `pip install --no-deps
# --target .device_deps ml_collections`, and carry `.device_deps` along (it is git-ignored).
set -uo pipefail

cd "$(dirname "$0")/.." || exit 1
OUT=${OUT:-/tmp/accelerator_out}
SEQ=${SEQ:-512}
SIZES=${SIZES:-"base:32 large:32 xxlarge:16"}  # size:batch, the last one profiled
SPEEDUP_ARGS=${SPEEDUP_ARGS:-"--seq_len=512 --batch=8"}
LIMIT=${LIMIT:-150}  # seconds per benchmark run
mkdir -p "$OUT"
export PYTHONPATH="$PWD/.device_deps${PYTHONPATH:+:$PYTHONPATH}"

nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv >"$OUT/gpu.csv" 2>&1 || true
python -c "import jax; print(jax.__version__, jax.devices())" >"$OUT/jax.txt" 2>&1

run() {  # run NAME ARGS...: one benchmark, its JSON line to $OUT/NAME.json, the rest to .log
  local name=$1
  shift
  local start=$SECONDS
  timeout "$LIMIT" python "$@" --json >"$OUT/$name.json" 2>"$OUT/$name.log"
  echo "$name: exit $? in $((SECONDS - start)) s"
}

last=${SIZES##* }
for spec in $SIZES; do
  size=${spec%%:*}
  batch=${spec##*:}
  args=(benchmarks/train_step.py "--size=$size" "--batch=$batch" "--seq=$SEQ"
    --dtype=bfloat16 --no_unrolled --no_kerashub --steps=5 --warmup=2 --peak_size=4096)
  if [[ $spec == "$last" ]]; then
    run "train_step_$size" "${args[@]}" --profile="/tmp/profile_$size" --profile_steps=2
    run "train_step_${size}_cudnn" "${args[@]}" --attention=cudnn --no_hf
  else
    run "train_step_$size" "${args[@]}"
  fi
done
# shellcheck disable=SC2086  # SPEEDUP_ARGS is a list of flags
run speedup benchmarks/speedup.py --dtype=bfloat16 --rounds=3 $SPEEDUP_ARGS
