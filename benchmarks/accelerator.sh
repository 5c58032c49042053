#!/usr/bin/env bash
# The accelerator measurements (docs/benchmarks.md) for a GPU machine lent for minutes:
# each benchmark run has its own time limit (LIMIT seconds, cut to what is left of DEADLINE
# seconds from the start), so one that hangs or runs out of memory costs its slot only, and
# every result lands in $OUT as it comes: $OUT/results.jsonl (a line a run: name, exit status,
# seconds, the benchmark's JSON line or null) and $OUT/logs.txt (every run's stderr), two files
# because a lent machine returns few.
#
#   bash benchmarks/accelerator.sh [PART ...]  # PARTs: train_step cudnn speedup seeds attention
#   SIZES="tiny:4" SEQ=64 SPEEDUP_ARGS="--models=bert-large,albert-base --seq_len=64 --batch=2" \
#     bash benchmarks/accelerator.sh              # the same path in minutes on a CPU
#
# train_step: ours vs HF PyTorch (bfloat16 autocast, SDPA) at seq $SEQ for each size:batch of
#   $SIZES, MFU against the device's spec-sheet peak; for the last size the op totals per step
#   of a profiled step.
# cudnn: ours at the last size with XLA's attention and with cuDNN's fused kernel.
# speedup: the paper's Table 2 column in bfloat16.
# seeds: 4 fine-tuning seeds in one program against 4 runs (tiny: end to end; base: the step),
#   on sentiment_rt's files in $TASK_DIR.
# attention: tests/test_attention_impl.py on the accelerator (cuDNN's kernel against ours).
# The training path needs no TensorFlow, TFDS or blingfire. An image without ml_collections (which
# configs/ use) gets it from .device_deps: `pip install --no-deps --target .device_deps
# ml_collections` here, and `cp ../shared/data/tasks/sentiment_rt/*.gz .device_deps/sentiment_rt/`
# for seeds; carry `.device_deps` along (git-ignored).
set -uo pipefail

cd "$(dirname "$0")/.." || exit 1
OUT=${OUT:-/tmp/accelerator_out}
SEQ=${SEQ:-512}
SIZES=${SIZES:-"base:32 large:32 xxlarge:16"}  # size:batch; the last one is profiled
TASK_DIR=${TASK_DIR:-.device_deps/sentiment_rt}
SPEEDUP_ARGS=${SPEEDUP_ARGS:-"--seq_len=512 --batch=32"}
LIMIT=${LIMIT:-120}
DEADLINE=${DEADLINE:-100000}
PYTHON=${PYTHON:-python3}
mkdir -p "$OUT"
export PYTHONPATH="$PWD/.device_deps${PYTHONPATH:+:$PYTHONPATH}"
# train_step runs JAX and torch in one process on one GPU: JAX takes half the memory up front
# (not its default 75%), the rest is torch's.
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.5}

budget() {  # budget NAME SECONDS: SECONDS cut to what is left before DEADLINE (less 10 s to
  # report), or fail (logged) when under 30 s are left
  local left=$((DEADLINE - SECONDS - 10))
  local seconds=$(($2 < left ? $2 : left))
  if ((seconds < 30)); then
    echo "$1: skipped, ${left} s left before the deadline" | tee -a "$OUT/logs.txt" >&2
    return 1
  fi
  echo "=== $1 (limit ${seconds} s)" >>"$OUT/logs.txt"
  echo "$seconds"
}

report() {  # report NAME STATUS START [JSON]: a line of results.jsonl, one of the console
  printf '{"run": "%s", "exit": %d, "seconds": %d, "result": %s}\n' \
    "$1" "$2" "$((SECONDS - $3))" "${4:-null}" >>"$OUT/results.jsonl"
  echo "$1: exit $2 in $((SECONDS - $3)) s"
}

run() {  # run NAME ARGS...: one benchmark, its JSON line to results.jsonl, stderr to logs.txt
  local name=$1 seconds start=$SECONDS json
  shift
  seconds=$(budget "$name" "${RUN_LIMIT:-$LIMIT}") || return 0
  # SIGTERM at the limit, SIGKILL 10 s later: a fine-tuning run takes SIGTERM as a preemption
  # notice (checkpoint, exit) and the benchmark would go on to its next run.
  json=$(timeout -k 10 "$seconds" "$PYTHON" "$@" --json 2>>"$OUT/logs.txt" | tail -n 1)
  local status=$?
  [[ $json == "{"* ]] || json=null
  report "$name" "$status" "$start" "$json"
}

step_args() {  # step_args SIZE:BATCH: train_step.py's arguments for one size, in bfloat16
  echo benchmarks/train_step.py "--size=${1%%:*}" "--batch=${1##*:}" "--seq=$SEQ" \
    --dtype=bfloat16 --no_unrolled --no_kerashub --steps=5 --warmup=2 --peak_size=4096
}

part_train_step() {  # every size against HF PyTorch; the last one profiled
  local last=${SIZES##* } spec args
  for spec in $SIZES; do
    read -ra args <<<"$(step_args "$spec")"
    if [[ $spec == "$last" ]]; then
      run "train_step_${spec%%:*}" "${args[@]}" --profile="/tmp/profile_${spec%%:*}" \
        --profile_steps=2
    else
      run "train_step_${spec%%:*}" "${args[@]}"
    fi
  done
}

part_cudnn() {  # the last size with XLA's attention, then cuDNN's, one after the other
  local last=${SIZES##* } impl args
  read -ra args <<<"$(step_args "$last")"
  for impl in xla cudnn; do
    run "train_step_${last%%:*}_$impl" "${args[@]}" "--attention=$impl" --no_hf
  done
}

part_speedup() {  # six models to compile (117-148 s on an H200): twice the limit
  # shellcheck disable=SC2086  # SPEEDUP_ARGS is a list of flags
  RUN_LIMIT=$((2 * LIMIT)) run speedup benchmarks/speedup.py --dtype=bfloat16 --rounds=3 \
    $SPEEDUP_ARGS
}

part_seeds() {  # base's step first (the figure); then tiny end to end: 5 complete runs, each
  # compiling its own step shapes (14 s each on an H200), so three times the limit (262 s
  # were not enough there)
  run seeds_base benchmarks/finetune_seeds.py --size=base --step_only "--task_dir=$TASK_DIR"
  RUN_LIMIT=$((3 * LIMIT)) run seeds_tiny benchmarks/finetune_seeds.py --size=tiny --steps=100 \
    "--task_dir=$TASK_DIR"
}

part_attention() {  # the tests put JAX on the CPU unless told otherwise: here, the accelerator
  local seconds start=$SECONDS
  seconds=$(budget attention_tests "$LIMIT") || return 0
  JAX_PLATFORMS="" CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0} \
    timeout -k 10 "$seconds" "$PYTHON" -m pytest -q -n 0 -p no:cacheprovider \
    tests/test_attention_impl.py >>"$OUT/logs.txt" 2>&1
  report attention_tests $? "$start"
}

parts=("$@")
[[ ${#parts[@]} -gt 0 ]] || parts=(train_step cudnn speedup seeds attention)
for name in "${parts[@]}"; do  # every name checked before any device time is spent
  if ! declare -F "part_$name" >/dev/null; then
    echo "unknown part '$name': train_step, cudnn, speedup, seeds or attention" >&2
    exit 2
  fi
done
{
  nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv
  "$PYTHON" -c "import jax; print(jax.__version__, jax.devices())"
} >>"$OUT/logs.txt" 2>&1
for name in "${parts[@]}"; do
  "part_$name"
done
