#!/usr/bin/env bash
# One-command multi-host launching of albert_jax on Cloud TPU VMs (single hosts and pods).
#
# Every host of a pod slice runs the same `python -m albert_jax.main` command; jax.distributed
# discovers the other hosts through the TPU runtime, so launching is "the same command on
# --worker=all". Checkpoints and TFDS data must live in Cloud Storage because all hosts must
# see the same directories. See launch/README.md for worked examples.
set -euo pipefail

SCRIPT_NAME=${0##*/}
REPO_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
readonly SCRIPT_NAME REPO_ROOT

# Layout on every worker, in the remote user's home directory (a literal '~' that the workers'
# shell expands).
readonly REMOTE_HOME='~'
readonly REMOTE_CODE_DIR=albert_jax
readonly REMOTE_VENV=albert_venv
readonly REMOTE_LOG=albert_run.log
readonly REMOTE_TARBALL=albert_jax_code.tar.gz

# Kills whatever still holds the TPU (a crashed or orphaned run keeps /dev/accel* on v2-v4 and
# /dev/vfio/* on v5e/v5p/v6e open, and the next run then fails to claim the chips), and removes
# the lock file libtpu leaves behind. Single quotes on purpose: this runs on the workers.
# shellcheck disable=SC2016
readonly REMOTE_KILL_STALE_TPU='pids=$(sudo lsof -t /dev/accel* /dev/vfio/* 2>/dev/null | sort -u); if [ -n "$pids" ]; then echo "$(hostname): killing stale TPU processes" $pids; sudo kill -9 $pids; for _ in 1 2 3 4 5 6 7 8 9 10; do sudo lsof -t /dev/accel* /dev/vfio/* >/dev/null 2>&1 || break; sleep 1; done; fi; sudo rm -f /tmp/libtpu_lockfile'
# SIGTERM first, so a run can finish an in-flight checkpoint (up to 30 s), then the hard kill
# above. The bracket keeps pkill from matching the shell that runs this very command line.
readonly REMOTE_KILL_TRAINING="sudo pkill -f 'albert_jax[.](main|sweep)' && for _ in \$(seq 30); do pgrep -f 'albert_jax[.](main|sweep)' >/dev/null || break; sleep 1; done; ${REMOTE_KILL_STALE_TPU}"

usage() {
  cat <<EOF
Usage: ${SCRIPT_NAME} SUBCOMMAND --name=NAME --zone=ZONE [flags] [--config.KEY=VALUE ...]

Subcommands:
  plan     the TPU compiler's verdict on --config for --type (and --num_slices), on this
           machine (python -m albert_jax.plan; needs the [tpu] extra); no --name/--zone needed
  create   create the TPU VM (--type required; --spot; --queued for a queued resource); with
           --config it plans first and refuses a slice the config does not fit (--force)
  setup    copy this repository to every worker and pip-install it with [tpu] into a venv
  run      kill stale TPU processes, then start training on every worker
           (--config, --workdir=gs://..., --data_dir=gs://... required; in the background with
           the log in ~/${REMOTE_LOG} unless --foreground; --restart for spot/preemptible TPUs)
  sweep    as run, but a sweep (python -m albert_jax.sweep): --root=gs://... instead of
           --workdir, the grid as --sweep.FIELD=V1,V2,... and/or --sweep_fn=FILE:FUNCTION; its
           points run one after the other (or as one program), and the same command resumes
           it after a preemption (--restart babysits it as it does a run). 'plan' with sweep
           flags plans the sweep's largest point
  logs     tail ~/${REMOTE_LOG} on worker 0 (--worker=N|all, --lines=N, --follow)
  kill     kill the training processes on all workers
  delete   delete the TPU VM (or, with --queued, the queued resource and its nodes)

Common flags:
  --name=NAME          TPU VM name (node id)                                      [required]
  --zone=ZONE          Cloud zone, e.g. us-central2-b                             [required]
  --project=PROJECT    Cloud project (default: gcloud's configured project)
  --type=TYPE          accelerator type, e.g. v4-32, v3-256, v5litepod-16, v5p-64
  --runtime=VERSION    TPU software version (default by type: tpu-ubuntu2204-base for v2-v4,
                       v2-alpha-tpuv5-lite for v5e, v2-alpha-tpuv5 for v5p, v2-alpha-tpuv6e for v6e)
  --spot               create Spot TPUs (preemptible at any time, much cheaper)
  --queued             use a queued resource (create/delete/--restart)
  --qr=ID              queued resource id (default: NAME-qr)
  --dry-run            print every gcloud command, one per line, instead of running anything
  --num_slices=N       slices joined by the data-center network (Multislice, v4 and later;
                       default 1): the plan compiles for them, and with --queued create makes
                       one queued resource of N nodes NAME-0..NAME-(N-1), which setup, run,
                       logs and kill then reach all of (--node=all)
  --force              create a slice even when the plan says the config does not fit
  -h, --help           show this help

run flags:
  --config=PATH[:ARGS]  config file and its arguments, e.g. configs/pretrain.py:size=base
  --workdir=gs://...    checkpoints and metrics (shared by all hosts, so Cloud Storage only)
  --data_dir=gs://...   TFDS data dir, exported as TFDS_DATA_DIR on every worker
  --config.KEY=VALUE    config overrides, passed to albert_jax.main as given (also after --)
  --root=gs://...       sweep: the sweep's directory (a workdir per point, sweep.md)
  --sweep.FIELD=V1,...  sweep: a swept field (or --sweep.group=auto|none), passed as given
  --sweep_fn=FILE:FN    sweep: a config file's sweep function
  --foreground          stream the output here instead of running under nohup
  --restart             babysit a spot/preemptible TPU: when the run exits non-zero or the TPU is
                        preempted, wait, re-create the TPU if it is gone/PREEMPTED, set it up
                        again and rerun (training resumes from --workdir); implies --foreground
                        and needs --type
  --max_restarts=N      restarts before giving up (default 10)
  --restart_wait_s=S    seconds to wait before a restart (default 60)
  --poll_s=S            seconds between state polls while a TPU is being provisioned (default 30)
  --ready_timeout_s=S   give up waiting for a TPU to become READY after S seconds (default 7200)

logs flags:
  --worker=N|all  worker whose log to show (default 0)
  --lines=N       lines to show (default 100)
  --follow        keep following the log (tail -F)
EOF
}

log() { # progress notes on stderr; a dry run prints nothing but commands
  if ((!DRY_RUN)); then
    echo "[${SCRIPT_NAME}] $*" >&2
  fi
}

die() {
  echo "${SCRIPT_NAME}: error: $*" >&2
  exit 1
}

usage_error() {
  echo "${SCRIPT_NAME}: error: $*" >&2
  echo >&2
  usage >&2
  exit 2
}

# ----------------------------------------------------------------------------------------------
# Flags

SUBCOMMAND=""
NAME=""
ZONE=""
PROJECT=""
TYPE=""
RUNTIME=""
QR=""
CONFIG=""
NUM_SLICES=1
FORCE=0
WORKDIR=""
DATA_DIR=""
SPOT=0
QUEUED=0
DRY_RUN=0
FOREGROUND=0
RESTART=0
FOLLOW=0
MAX_RESTARTS=10
RESTART_WAIT_S=60
POLL_S=30
READY_TIMEOUT_S=7200
WORKER=0
LINES=100
EXTRA_ARGS=()
SWEEP_ARGS=() # --sweep.* and --sweep_fn: the grid of `sweep` (and of `plan`'s largest point)
ROOT=""

# Sets the value flag $1 (already normalized: no leading dashes, '-' -> '_') to $2.
set_value_flag() {
  case $1 in
    name) NAME=$2 ;;
    zone) ZONE=$2 ;;
    project) PROJECT=$2 ;;
    type | accelerator_type) TYPE=$2 ;;
    runtime | version | runtime_version) RUNTIME=$2 ;;
    qr | queued_resource) QR=$2 ;;
    config) CONFIG=$2 ;;
    workdir) WORKDIR=$2 ;;
    root) ROOT=$2 ;;
    sweep_fn) SWEEP_ARGS+=("--sweep_fn=$2") ;;
    data_dir | tfds_data_dir) DATA_DIR=$2 ;;
    max_restarts) MAX_RESTARTS=$2 ;;
    restart_wait_s) RESTART_WAIT_S=$2 ;;
    poll_s) POLL_S=$2 ;;
    ready_timeout_s) READY_TIMEOUT_S=$2 ;;
    worker) WORKER=$2 ;;
    num_slices) NUM_SLICES=$2 ;;
    lines) LINES=$2 ;;
    *) usage_error "unknown flag: --$1" ;;
  esac
}

# Returns 0 (and sets it) when $1 is a boolean flag name.
set_bool_flag() {
  case $1 in
    dry_run) DRY_RUN=1 ;;
    spot) SPOT=1 ;;
    queued) QUEUED=1 ;;
    foreground) FOREGROUND=1 ;;
    restart) RESTART=1 ;;
    follow) FOLLOW=1 ;;
    force) FORCE=1 ;;
    *) return 1 ;;
  esac
}

parse_args() {
  local arg key
  while (($# > 0)); do
    arg=$1
    shift
    case $arg in
      -h | --help)
        usage
        exit 0
        ;;
      --)
        EXTRA_ARGS+=("$@")
        break
        ;;
      --config.*) EXTRA_ARGS+=("$arg") ;; # a config override for albert_jax.main
      --sweep.*=*) SWEEP_ARGS+=("$arg") ;; # a swept field for albert_jax.sweep
      --*=*)
        key=${arg%%=*}
        key=${key#--}
        set_value_flag "${key//-/_}" "${arg#*=}"
        ;;
      --*)
        key=${arg#--}
        key=${key//-/_}
        if ! set_bool_flag "$key"; then
          (($# > 0)) || usage_error "flag --${key} needs a value"
          set_value_flag "$key" "$1"
          shift
        fi
        ;;
      -*) usage_error "unknown flag: $arg" ;;
      *)
        [[ -z $SUBCOMMAND ]] || usage_error "unexpected argument: $arg"
        SUBCOMMAND=$arg
        ;;
    esac
  done
}

require_flag() { # flag-name value
  [[ -n $2 ]] || usage_error "missing required flag --$1 for '${SUBCOMMAND}'"
}

require_int() { # flag-name value
  [[ $2 =~ ^[0-9]+$ ]] || usage_error "--$1 must be a non-negative integer (got '$2')"
}

require_gcs_path() { # flag-name value why
  local gcs='^gs://[^/]+'
  [[ $2 =~ $gcs ]] || die "--$1 must be a gs:// path (got '$2'): $3"
}

default_runtime() { # accelerator-type -> TPU software version for JAX (cloud.google.com/tpu/docs/runtimes)
  case $1 in
    v5litepod-* | v5e-*) echo v2-alpha-tpuv5-lite ;;
    v5p-*) echo v2-alpha-tpuv5 ;;
    v6e-*) echo v2-alpha-tpuv6e ;;
    *) echo tpu-ubuntu2204-base ;;
  esac
}

validate_args() {
  case $SUBCOMMAND in
    plan | create | setup | run | sweep | logs | kill | delete) ;;
    "") usage_error "missing subcommand" ;;
    *) usage_error "unknown subcommand: ${SUBCOMMAND}" ;;
  esac
  require_int num_slices "$NUM_SLICES"
  ((NUM_SLICES >= 1)) || usage_error "--num_slices must be at least 1"
  if [[ $SUBCOMMAND == plan ]]; then # a local compile: no TPU VM involved
    require_flag config "$CONFIG"
    require_flag type "$TYPE"
    return 0
  fi
  require_flag name "$NAME"
  require_flag zone "$ZONE"
  # TPU names become remote host aliases and file names: enforce the Cloud naming rule early.
  local name_re='^[a-z]([-a-z0-9]*[a-z0-9])?$'
  [[ $NAME =~ $name_re ]] ||
    die "--name must be lowercase letters, digits and hyphens, starting with a letter (got '${NAME}')"
  local zone_re='^[a-z0-9-]+$'
  [[ $ZONE =~ $zone_re ]] || die "--zone must look like us-central2-b (got '${ZONE}')"
  if [[ $SUBCOMMAND == create ]] || ((RESTART)); then
    require_flag type "$TYPE"
  fi
  if ((NUM_SLICES > 1)); then
    # Multislice nodes exist only as a queued resource's (Cloud TPU docs).
    ((QUEUED)) || usage_error "--num_slices=${NUM_SLICES} needs --queued (a multi-slice TPU is a queued resource of that many nodes)"
    ((!RESTART)) || usage_error "--restart re-creates one slice; it does not handle --num_slices"
  fi
  if [[ -n $TYPE ]]; then
    local type_re='^v[0-9][a-z0-9]*-[0-9]+$'
    [[ $TYPE =~ $type_re ]] || die "--type must look like v4-32 or v5litepod-16 (got '${TYPE}')"
  fi
  if ((${#SWEEP_ARGS[@]} > 0)) && [[ $SUBCOMMAND != sweep ]]; then
    usage_error "sweep flags (${SWEEP_ARGS[0]} ...) only apply to 'sweep' and 'plan'"
  fi
  if [[ $SUBCOMMAND == sweep ]]; then
    require_flag config "$CONFIG"
    require_flag root "$ROOT"
    require_flag data_dir "$DATA_DIR"
    ((${#SWEEP_ARGS[@]} > 0)) || usage_error "'sweep' needs --sweep.FIELD=V1,V2,... or --sweep_fn"
    require_gcs_path root "$ROOT" \
      "every TPU host reads and writes the same checkpoints, so the sweep's root must be in Cloud Storage"
    require_gcs_path data_dir "$DATA_DIR" \
      "every TPU host reads the same TFDS datasets, so TFDS_DATA_DIR must be in Cloud Storage"
  elif [[ $SUBCOMMAND == run ]]; then
    require_flag config "$CONFIG"
    require_flag workdir "$WORKDIR"
    require_flag data_dir "$DATA_DIR"
    require_gcs_path workdir "$WORKDIR" \
      "every TPU host reads and writes the same checkpoints, so the workdir must be in Cloud Storage"
    require_gcs_path data_dir "$DATA_DIR" \
      "every TPU host reads the same TFDS datasets, so TFDS_DATA_DIR must be in Cloud Storage"
  elif ((${#EXTRA_ARGS[@]} > 0)) && [[ $SUBCOMMAND != create || -z $CONFIG ]]; then
    usage_error "config overrides (${EXTRA_ARGS[0]} ...) only apply to 'run', 'sweep', 'plan' and 'create --config'"
  fi
  require_int max_restarts "$MAX_RESTARTS"
  require_int restart_wait_s "$RESTART_WAIT_S"
  require_int poll_s "$POLL_S"
  require_int ready_timeout_s "$READY_TIMEOUT_S"
  require_int lines "$LINES"
  [[ $WORKER == all || $WORKER =~ ^[0-9]+$ ]] || usage_error "--worker must be N or all (got '${WORKER}')"
  if [[ -z $RUNTIME ]]; then
    RUNTIME=$(default_runtime "$TYPE")
  fi
  if [[ -z $QR ]]; then
    QR="${NAME}-qr"
  fi
  if ((RESTART)) && ((!FOREGROUND)); then
    # The loop must see the run's exit status, which a nohup'ed background run never reports.
    FOREGROUND=1
  fi
}

# ----------------------------------------------------------------------------------------------
# Running (or printing) gcloud

# Quotes one word for a POSIX shell, leaving plain words (and the name of a --flag=value) bare
# so that printed commands stay readable and can be pasted into a shell as they are.
quote_word() {
  local word=$1 plain='^[A-Za-z0-9_@%+=:,./-]+$' flag_value='^(--[A-Za-z0-9_.-]+=)(.*)$'
  local escaped_quote="'\\''"
  if [[ $word =~ $plain ]]; then
    printf '%s' "$word"
  elif [[ $word =~ $flag_value ]]; then
    local value=${BASH_REMATCH[2]}
    printf "%s'%s'" "${BASH_REMATCH[1]}" "${value//\'/$escaped_quote}"
  else
    printf "'%s'" "${word//\'/$escaped_quote}"
  fi
}

quote_command() { # words... -> one shell line
  local word line=""
  for word in "$@"; do
    line+="${line:+ }$(quote_word "$word")"
  done
  printf '%s\n' "$line"
}

# Runs `gcloud ARGS... [--project=P]`, or with --dry-run prints it on the saved stdout (fd 3, so
# that it shows even from inside a command substitution) and returns success.
gcloud_cmd() {
  local -a cmd=(gcloud "$@")
  if [[ -n $PROJECT ]]; then
    cmd+=("--project=${PROJECT}")
  fi
  if ((DRY_RUN)); then
    quote_command "${cmd[@]}" >&3
    return 0
  fi
  log "+ $(quote_command "${cmd[@]}")"
  "${cmd[@]}"
}

# The plan (python -m albert_jax.plan) of --config for --type x --num_slices, run from the
# repository root; with --dry-run printed like the gcloud commands. Extra words go to the plan.
plan_command() {
  local -a config=("--config=${CONFIG}") overrides=(${EXTRA_ARGS[@]+"${EXTRA_ARGS[@]}"})
  if ((${#SWEEP_ARGS[@]} > 0)); then # a sweep: its largest point's --config and overrides
    local -a largest=("${PYTHON:-python3}" -m albert_jax.sweep "--config=${CONFIG}"
      ${EXTRA_ARGS[@]+"${EXTRA_ARGS[@]}"} "${SWEEP_ARGS[@]}" --largest)
    if ((DRY_RUN)); then
      quote_command "${largest[@]}" >&3
    else
      local -a point
      mapfile -t point < <(cd "$REPO_ROOT" && "${largest[@]}")
      ((${#point[@]} > 0)) || die "the sweep's points could not be listed (its error above)"
      config=("${point[0]}")
      overrides=("${point[@]:1}")
    fi
  fi
  local -a cmd=("${PYTHON:-python3}" -m albert_jax.plan "${config[@]}" "--tpu=${TYPE}"
    "--num_slices=${NUM_SLICES}" "$@" ${overrides[@]+"${overrides[@]}"})
  if ((DRY_RUN)); then
    quote_command "${cmd[@]}" >&3
    return 0
  fi
  log "+ $(quote_command "${cmd[@]}")"
  (cd "$REPO_ROOT" && "${cmd[@]}")
}

# Before `create`: the slice must hold the config (the plan's verdict, its figures named in the
# refusal); --force creates it anyway. Without --config there is nothing to plan.
plan_before_create() {
  if [[ -z $CONFIG ]]; then
    log "no --config: creating ${TYPE} without a plan (pass --config to check that it fits)"
    return 0
  fi
  if ((DRY_RUN)); then
    plan_command --json
    return 0
  fi
  local report status=0
  local -a flags=(--json)
  if ((FORCE)); then
    flags+=(--nooptions) # created anyway: no compiles of what would fit
  fi
  report=$(plan_command "${flags[@]}") || status=$?
  if ((status == 0)); then
    log "plan: $(plan_figures <<<"$report")"
    return 0
  fi
  local why fix
  if ((status == 1)); then
    why="${CONFIG} does not fit ${TYPE} x${NUM_SLICES}: $(plan_figures <<<"$report")"
    fix="$(plan_options <<<"$report")"
  else
    why="the plan of ${CONFIG} for ${TYPE} x${NUM_SLICES} failed (exit ${status}, its error above)"
    fix="fix the config"
  fi
  if ((FORCE)); then
    log "${why}; creating it anyway (--force)"
    return 0
  fi
  die "${why}; ${fix}, or pass --force to create it anyway"
}

plan_figures() { # the plan's JSON on stdin -> its memory figures in one line
  "${PYTHON:-python3}" -c '
import json, sys
r = json.load(sys.stdin)
total, usable, mesh, error = (r.get(k) for k in ("total_gib", "usable_hbm_gib", "mesh", "error"))
if r.get("compiler_accepted"):
    print(f"{total} GiB a device of {usable} usable, mesh {mesh}")
else:  # the compiler refused it: its own figures
    print(f"the TPU compiler refused it ({error}), mesh {mesh}")'
}

plan_options() { # the plan's JSON on stdin -> what would fit, cheapest first, in one line
  "${PYTHON:-python3}" -c '
import json, sys
options = json.load(sys.stdin).get("options") or ["a larger --type or more --num_slices"]
print("what would fit, cheapest first: " + "; ".join(f"({i}) {o}" for i, o in enumerate(options, 1)))'
}

ssh_workers() { # worker command (every slice's with --num_slices > 1)
  if ((NUM_SLICES > 1)); then
    gcloud_cmd compute tpus queued-resources ssh "$QR" --zone="$ZONE" --node=all \
      --worker="$1" --command="$2"
  else
    gcloud_cmd compute tpus tpu-vm ssh "$NAME" --zone="$ZONE" --worker="$1" --command="$2"
  fi
}

sleep_s() {
  if ((!DRY_RUN && $1 > 0)); then
    sleep "$1"
  fi
}

# ----------------------------------------------------------------------------------------------
# TPU lifecycle

create_tpu() {
  local -a spot=()
  if ((SPOT)); then
    spot=(--spot)
  fi
  if ((QUEUED)); then
    local -a nodes=(--node-id="$NAME")
    if ((NUM_SLICES > 1)); then # nodes NAME-0 .. NAME-(N-1), one slice each
      nodes=(--node-count="$NUM_SLICES" --node-prefix="$NAME")
    fi
    gcloud_cmd compute tpus queued-resources create "$QR" "${nodes[@]}" --zone="$ZONE" \
      --accelerator-type="$TYPE" --runtime-version="$RUNTIME" ${spot[@]+"${spot[@]}"} || return
    # A queued resource is only a request: wait until its node exists and is READY.
    wait_until_ready
  else
    gcloud_cmd compute tpus tpu-vm create "$NAME" --zone="$ZONE" --accelerator-type="$TYPE" \
      --version="$RUNTIME" ${spot[@]+"${spot[@]}"}
  fi
}

delete_tpu() {
  if ((QUEUED)); then
    # --force also deletes the queued resource's nodes.
    gcloud_cmd compute tpus queued-resources delete "$QR" --zone="$ZONE" --force --quiet
  else
    gcloud_cmd compute tpus tpu-vm delete "$NAME" --zone="$ZONE" --quiet
  fi
}

# Prints the `value(FIELD)` of a describe command (`describe_state FIELD gcloud-args...`), or
# GONE when the resource does not exist; fails on any other error (network, permissions).
describe_state() {
  local field=$1 out errors
  shift
  if ((DRY_RUN)); then # pretend all is well, so the dry run shows the normal path
    gcloud_cmd "$@" --format="value(${field})"
    if [[ $field == state.state ]]; then echo ACTIVE; else echo READY; fi
    return 0
  fi
  errors=$(mktemp) || return
  if out=$(gcloud_cmd "$@" --format="value(${field})" 2>"$errors"); then
    rm -f "$errors"
    echo "${out:-UNKNOWN}"
    return 0
  fi
  if grep -qE 'NOT_FOUND|was not found' "$errors"; then
    rm -f "$errors"
    echo GONE
    return 0
  fi
  cat "$errors" >&2
  rm -f "$errors"
  return 1
}

# Prints the node state (READY, CREATING, PREEMPTED, ...), GONE, or for a queued resource that
# has no active node yet its request state (WAITING_FOR_RESOURCES, PROVISIONING, SUSPENDED, ...).
tpu_state() {
  local state
  if ((QUEUED)); then
    state=$(describe_state state.state compute tpus queued-resources describe "$QR" --zone="$ZONE") ||
      return
    if [[ $state != ACTIVE || $NUM_SLICES -gt 1 ]]; then
      # An ACTIVE multi-slice request has all of its nodes: it is ready as a whole.
      [[ $state == ACTIVE ]] && state=READY
      echo "$state"
      return 0
    fi
  fi
  describe_state state compute tpus tpu-vm describe "$NAME" --zone="$ZONE"
}

# Whether a TPU in state $1 can never become READY again and must be deleted and re-created.
is_dead_state() {
  case $1 in
    GONE | PREEMPTED | TERMINATED | STOPPED | STOPPING | HIDDEN | HIDING | DELETING | FAILED | \
      SUSPENDED | SUSPENDING) return 0 ;;
    *) return 1 ;;
  esac
}

wait_until_ready() {
  local start=$SECONDS state
  while true; do
    state=$(tpu_state) || state=UNREACHABLE # a describe error is treated as transient
    if [[ $state == READY ]]; then
      return 0
    fi
    if is_dead_state "$state"; then
      log "TPU ${NAME} is ${state}"
      return 1
    fi
    if ((SECONDS - start >= READY_TIMEOUT_S)); then
      log "TPU ${NAME} is still ${state} after ${READY_TIMEOUT_S}s"
      return 1
    fi
    log "TPU ${NAME} is ${state}; polling again in ${POLL_S}s"
    sleep_s "$POLL_S"
  done
}

# ----------------------------------------------------------------------------------------------
# Code and environment on the workers

# Writes a gzipped tar of the repository: tracked files plus untracked ones that git does not
# ignore (so work in progress ships, virtualenvs and local workdirs do not).
make_code_tarball() {
  local out=$1
  if git -C "$REPO_ROOT" rev-parse --is-inside-work-tree >/dev/null 2>&1; then
    git -C "$REPO_ROOT" ls-files -z --cached --others --exclude-standard |
      existing_paths_only |
      tar -czf "$out" -C "$REPO_ROOT" --null -T -
  else
    tar -czf "$out" -C "$REPO_ROOT" --exclude=.git --exclude=__pycache__ --exclude='*.egg-info' \
      --exclude=.venv .
  fi
}

# Drops NUL-separated paths that no longer exist (deleted but not yet committed), which tar
# would otherwise refuse.
existing_paths_only() {
  local path
  while IFS= read -r -d '' path; do
    if [[ -e "${REPO_ROOT}/${path}" ]]; then
      printf '%s\0' "$path"
    fi
  done
}

remote_setup_command() {
  local code="${REMOTE_HOME}/${REMOTE_CODE_DIR}" venv="${REMOTE_HOME}/${REMOTE_VENV}"
  local tarball="${REMOTE_HOME}/${REMOTE_TARBALL}"
  local apt='sudo apt-get -o DPkg::Lock::Timeout=600' # fresh VMs run unattended-upgrades
  # A fresh code dir each time, so files deleted locally do not linger on the workers.
  local script="set -e; rm -rf ${code}; mkdir -p ${code}; tar -xzf ${tarball} -C ${code}"
  script+="; rm -f ${tarball}"
  # Ubuntu images may lack ensurepip; a failed `venv` leaves a dir without pip, hence the check.
  script+="; if [ ! -x ${venv}/bin/pip ]; then rm -rf ${venv}; python3 -m venv ${venv} || {"
  script+=" rm -rf ${venv}; ${apt} update -q; ${apt} install -y -q python3-venv;"
  script+=" python3 -m venv ${venv}; }; fi"
  script+="; cd ${code}; ${venv}/bin/python -m pip install -q -U pip"
  # The [tpu] extra: jax[tpu] at the package's jax version, so the pod runs the libtpu that
  # `python -m albert_jax.plan` compiled with.
  script+="; ${venv}/bin/python -m pip install -q -e \".[test,tpu]\""
  script+="; ${venv}/bin/python -c \"import albert_jax, jax; print('albert_jax', jax.__version__)\""
  printf '%s' "$script"
}

setup_workers() {
  local tarball="${TMPDIR:-/tmp}/${NAME}-${REMOTE_TARBALL}"
  if ((!DRY_RUN)); then
    log "packing ${REPO_ROOT} into ${tarball}"
    make_code_tarball "$tarball" || return
  fi
  local rc=0
  if ((NUM_SLICES > 1)); then
    gcloud_cmd compute tpus queued-resources scp "$tarball" "${QR}:${REMOTE_TARBALL}" \
      --zone="$ZONE" --node=all --worker=all || rc=$?
  else
    gcloud_cmd compute tpus tpu-vm scp "$tarball" "${NAME}:${REMOTE_TARBALL}" --zone="$ZONE" \
      --worker=all || rc=$?
  fi
  if ((!DRY_RUN)); then
    rm -f "$tarball"
  fi
  ((rc == 0)) || return "$rc"
  ssh_workers all "$(remote_setup_command)"
}

# ----------------------------------------------------------------------------------------------
# Training

remote_run_command() {
  local -a main=(python -m albert_jax.main "--config=${CONFIG}" "--workdir=${WORKDIR}")
  if [[ $SUBCOMMAND == sweep ]]; then # the same points, resumed, when it runs again
    main=(python -m albert_jax.sweep "--config=${CONFIG}" "--root=${ROOT}" "${SWEEP_ARGS[@]}")
  fi
  main+=(${EXTRA_ARGS[@]+"${EXTRA_ARGS[@]}"})
  local train env
  train=$(quote_command "${main[@]}")
  env="cd ${REMOTE_HOME}/${REMOTE_CODE_DIR} && . ${REMOTE_HOME}/${REMOTE_VENV}/bin/activate"
  env+=" && export TFDS_DATA_DIR=$(quote_word "$DATA_DIR")"
  # The log is appended to, so the output of a crashed attempt survives the restart after it.
  local log="${REMOTE_HOME}/${REMOTE_LOG}"
  env+=" && echo \"=== \$(date -u) training run ===\" >> ${log}"
  if ((FOREGROUND)); then
    # tee keeps the log current for `logs`; pipefail keeps python's exit status.
    printf '%s' "${REMOTE_KILL_STALE_TPU}; ${env} && set -o pipefail && ${train} 2>&1 | tee -a ${log}"
  else
    # The subshell detaches the nohup'ed run, so ssh returns once every worker has started it.
    printf '%s' "${REMOTE_KILL_STALE_TPU}; ${env} && (nohup ${train} >> ${log} 2>&1 < /dev/null &) && echo \"\$(hostname): training started, log in ~/${REMOTE_LOG}\""
  fi
}

run_training() {
  ssh_workers all "$(remote_run_command)"
}

# One attempt of the babysitting loop: bring the TPU back if it is gone or preempted (and set it
# up again), then run. Called in a `||` context, where `set -e` is off, so every step checks.
recover_and_run() {
  local state
  state=$(tpu_state) || return
  if is_dead_state "$state"; then
    log "TPU ${NAME} is ${state}: re-creating it"
    if [[ $state != GONE ]]; then
      delete_tpu || log "delete failed; trying to create anyway"
    fi
    create_tpu || return
    if ((!QUEUED)); then # (create_tpu already waited for a queued resource)
      wait_until_ready || return
    fi
    setup_workers || return
  elif [[ $state != READY ]]; then
    wait_until_ready || return
  fi
  run_training
}

run_with_restarts() {
  local restarts=0 rc
  while true; do
    rc=0
    recover_and_run || rc=$?
    if ((rc == 0)); then
      log "training finished"
      return 0
    fi
    if ((restarts >= MAX_RESTARTS)); then
      die "giving up after ${restarts} restarts (last attempt exited with status ${rc})"
    fi
    restarts=$((restarts + 1))
    log "attempt exited with status ${rc}; restart ${restarts}/${MAX_RESTARTS} in ${RESTART_WAIT_S}s"
    sleep_s "$RESTART_WAIT_S"
  done
}

tail_log() {
  local follow=""
  if ((FOLLOW)); then
    follow=" -F"
  fi
  ssh_workers "$WORKER" "tail -n ${LINES}${follow} ${REMOTE_HOME}/${REMOTE_LOG}"
}

main() {
  parse_args "$@"
  validate_args
  exec 3>&1 # dry-run output goes here, also from inside command substitutions
  case $SUBCOMMAND in
    plan) plan_command ;;
    create)
      plan_before_create
      create_tpu
      ;;
    setup) setup_workers ;;
    run | sweep)
      if ((RESTART)); then
        run_with_restarts
      else
        run_training
        if ((!FOREGROUND && !DRY_RUN)); then
          log "started; follow with: $0 logs --name=${NAME} --zone=${ZONE}${PROJECT:+ --project=${PROJECT}} --follow"
        fi
      fi
      ;;
    logs) tail_log ;;
    kill) ssh_workers all "$REMOTE_KILL_TRAINING" ;;
    delete) delete_tpu ;;
  esac
}

main "$@"
