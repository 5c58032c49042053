#!/usr/bin/env bash
# The accelerator measurements (README "On an accelerator") for a GPU machine lent for minutes:
# each benchmark run has its own time limit (LIMIT seconds), so one that hangs or runs out of
# memory costs its slot only, and every result lands in $OUT as it comes.
#
#   bash benchmarks/accelerator.sh [PART ...]     # PARTs: train_step speedup seeds (default all)
#   SIZES="tiny:4" SEQ=64 SPEEDUP_ARGS="--models=bert-large,albert-base --seq_len=64 --batch=2" \
#     bash benchmarks/accelerator.sh              # the same path in minutes on a CPU
#
# train_step: ours vs HF PyTorch (bfloat16 autocast, SDPA) at seq $SEQ for each size:batch of
#   $SIZES, MFU against the device's spec-sheet peak; for the last size also ours with cuDNN
#   fused attention and the op totals per step of a profiled step (train_step_<size>.json).
# speedup: the paper's Table 2 column in bfloat16 (speedup.json).
# seeds: 4 fine-tuning seeds in one program against 4 runs (tiny: end to end; base: the step),
#   on sentiment_rt's files in $TASK_DIR (seeds_<size>.json).
# The training path needs no TensorFlow, TFDS or blingfire. An image without ml_collections (which
# configs/ use) gets it from .device_deps: `pip install --no-deps --target .device_deps
# ml_collections` here, and `cp ../shared/data/tasks/sentiment_rt/*.gz .device_deps/sentiment_rt/`
# for seeds; carry `.device_deps` along (git-ignored).
set -uo pipefail

cd "$(dirname "$0")/.." || exit 1
OUT=${OUT:-/tmp/accelerator_out}
SEQ=${SEQ:-512}
SIZES=${SIZES:-"base:32 large:32 xxlarge:16"}  # size:batch; the last one is profiled
SPEEDUP_ARGS=${SPEEDUP_ARGS:-"--seq_len=512 --batch=8"}
TASK_DIR=${TASK_DIR:-.device_deps/sentiment_rt}
LIMIT=${LIMIT:-120}
mkdir -p "$OUT"
export PYTHONPATH="$PWD/.device_deps${PYTHONPATH:+:$PYTHONPATH}"

run() {  # run NAME ARGS...: one benchmark, its JSON line to $OUT/NAME.json, the rest to .log
  local name=$1
  shift
  local start=$SECONDS
  # SIGTERM at the limit, SIGKILL 10 s later: a fine-tuning run takes SIGTERM as a preemption
  # notice (checkpoint, exit) and the benchmark would go on to its next run.
  timeout -k 10 "${RUN_LIMIT:-$LIMIT}" python "$@" --json >"$OUT/$name.json" 2>"$OUT/$name.log"
  echo "$name: exit $? in $((SECONDS - start)) s"
}

part_train_step() {
  local last=${SIZES##* } spec size batch
  for spec in $SIZES; do
    size=${spec%%:*}
    batch=${spec##*:}
    local args=(benchmarks/train_step.py "--size=$size" "--batch=$batch" "--seq=$SEQ"
      --dtype=bfloat16 --no_unrolled --no_kerashub --steps=5 --warmup=2 --peak_size=4096)
    if [[ $spec == "$last" ]]; then
      run "train_step_$size" "${args[@]}" --profile="/tmp/profile_$size" --profile_steps=2
      run "train_step_${size}_cudnn" "${args[@]}" --attention=cudnn --no_hf
    else
      run "train_step_$size" "${args[@]}"
    fi
  done
}

part_speedup() {
  # shellcheck disable=SC2086  # SPEEDUP_ARGS is a list of flags
  run speedup benchmarks/speedup.py --dtype=bfloat16 --rounds=3 $SPEEDUP_ARGS
}

part_seeds() {  # tiny end to end: 5 complete runs, so twice the limit
  RUN_LIMIT=$((2 * LIMIT)) run seeds_tiny benchmarks/finetune_seeds.py --size=tiny --steps=100 \
    "--task_dir=$TASK_DIR"
  run seeds_base benchmarks/finetune_seeds.py --size=base --step_only "--task_dir=$TASK_DIR"
}

parts=("$@")
[[ ${#parts[@]} -gt 0 ]] || parts=(train_step speedup seeds)
for name in "${parts[@]}"; do  # every name checked before any device time is spent
  if ! declare -F "part_$name" >/dev/null; then
    echo "unknown part '$name': train_step, speedup or seeds" >&2
    exit 2
  fi
done
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv >"$OUT/gpu.csv" 2>&1 || true
python -c "import jax; print(jax.__version__, jax.devices())" >"$OUT/jax.txt" 2>&1
for name in "${parts[@]}"; do
  "part_$name"
done
