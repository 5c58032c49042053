"""Tests for launch/tpu_pod.sh: the gcloud commands it prints or runs, its argument checks, the
remote shell scripts it sends to the workers, and the spot/preemption restart loop.

No Cloud access here: dry runs are checked word by word; the restart loop runs against a small
stand-in `gcloud` on PATH that keeps one TPU's state in a file and plays scripted outcomes; the
remote training command is executed in a sandbox home directory with a real venv.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import tarfile
import textwrap
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "launch" / "tpu_pod.sh"
NAME, ZONE = "albert-pod", "us-central2-b"
COMMON = [f"--name={NAME}", f"--zone={ZONE}"]
CONFIG = "configs/pretrain.py:size=base"
WORKDIR = "gs://my-bucket/runs/base"
DATA_DIR = "gs://my-bucket/tfds"
RUN_FLAGS = [f"--config={CONFIG}", f"--workdir={WORKDIR}", f"--data_dir={DATA_DIR}"]
SSH_ALL = ["gcloud", "compute", "tpus", "tpu-vm", "ssh", NAME, f"--zone={ZONE}", "--worker=all"]
LOCKFILE_REMOVAL = "sudo rm -f /tmp/libtpu_lockfile"


def launch(
    *args: str, env: dict[str, str] | None = None, timeout: int = 60
) -> subprocess.CompletedProcess:
    """Runs tpu_pod.sh with `args`; returns the finished process (stdout/stderr as text)."""
    return subprocess.run(
        ["bash", str(SCRIPT), *args],
        capture_output=True,
        text=True,
        env=env if env is not None else os.environ.copy(),
        timeout=timeout,
    )


def dry_run(*args: str, env: dict[str, str] | None = None) -> list[list[str]]:
    """The gcloud commands a dry run prints, each split into words as a shell would."""
    result = launch("--dry-run", *args, env=env)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines, "a dry run printed nothing"
    assert all(line.startswith("gcloud ") for line in lines), result.stdout
    return [shlex.split(line) for line in lines]


def remote_command(words: list[str]) -> str:
    """The value of the --command= flag of one gcloud ssh command."""
    commands = [w.removeprefix("--command=") for w in words if w.startswith("--command=")]
    assert len(commands) == 1, words
    return commands[0]


# --------------------------------------------------------------------------------------------
# Dry runs


def test_dry_run_run_prints_the_training_command_for_every_worker():
    result = launch("run", "--dry-run", *COMMON, *RUN_FLAGS, "--config.batch_size=4096")
    assert result.returncode == 0, result.stderr
    (line,) = result.stdout.splitlines()
    assert line.startswith(
        f"gcloud compute tpus tpu-vm ssh {NAME} --zone={ZONE} --worker=all --command="
    )
    assert f"python -m albert_jax.main --config={CONFIG} --workdir={WORKDIR}" in line
    assert f"export TFDS_DATA_DIR={DATA_DIR}" in line

    command = remote_command(shlex.split(line))
    # Stale TPU holders are killed and the libtpu lock removed before training starts.
    kill_at = command.index("lsof -t /dev/accel* /dev/vfio/*")
    assert "kill -9" in command
    lock_at = command.index(LOCKFILE_REMOVAL)
    train_at = command.index("python -m albert_jax.main")
    assert kill_at < lock_at < train_at
    assert "--config.batch_size=4096" in command[train_at:]
    # Background by default, with the log where `logs` looks for it.
    assert "nohup python -m albert_jax.main" in command
    assert ">> ~/albert_run.log 2>&1 < /dev/null &" in command


def test_dry_run_run_foreground_streams_and_keeps_the_exit_status():
    (words,) = dry_run("run", "--foreground", *COMMON, *RUN_FLAGS)
    command = remote_command(words)
    assert "nohup" not in command
    assert "set -o pipefail" in command
    assert command.endswith("2>&1 | tee -a ~/albert_run.log")


def test_config_overrides_reach_the_workers_verbatim():
    tricky = '--config.note=it\'s a "test" $HOME'
    (words,) = dry_run("run", *COMMON, *RUN_FLAGS, "--", tricky, "--config.seed=7")
    command = remote_command(words)
    train = command[command.index("python -m albert_jax.main") :].split(" >> ")[0]
    # The remote shell must see exactly the words we were given, quotes and $ included.
    assert shlex.split(train)[-2:] == [tricky, "--config.seed=7"]


CREATE_TPU_VM = ["gcloud", "compute", "tpus", "tpu-vm", "create", NAME, f"--zone={ZONE}"]
CREATE_QUEUED = ["gcloud", "compute", "tpus", "queued-resources", "create"]


@pytest.mark.parametrize(
    "args, expected",
    [
        (
            ["create", "--spot", "--type=v4-32"],
            [
                CREATE_TPU_VM
                + ["--accelerator-type=v4-32", "--version=tpu-ubuntu2204-base", "--spot"]
            ],
        ),
        (
            ["create", "--type=v3-256"],
            [CREATE_TPU_VM + ["--accelerator-type=v3-256", "--version=tpu-ubuntu2204-base"]],
        ),
        (
            ["create", "--queued", "--spot", "--type=v5litepod-16"],
            [
                CREATE_QUEUED
                + [f"{NAME}-qr", f"--node-id={NAME}", f"--zone={ZONE}"]
                + ["--accelerator-type=v5litepod-16", "--runtime-version=v2-alpha-tpuv5-lite"]
                + ["--spot"],
                "queued-resources describe",  # then it waits for the node
                "tpu-vm describe",
            ],
        ),
        (
            ["create", "--queued", "--type=v5p-64", "--qr=my-request", "--runtime=my-image"],
            [
                CREATE_QUEUED
                + ["my-request", f"--node-id={NAME}", f"--zone={ZONE}"]
                + ["--accelerator-type=v5p-64", "--runtime-version=my-image"],
                "queued-resources describe",
                "tpu-vm describe",
            ],
        ),
        (
            ["create", "--type", "v5p-8"],
            [CREATE_TPU_VM + ["--accelerator-type=v5p-8", "--version=v2-alpha-tpuv5"]],
        ),
        (
            ["logs"],
            [SSH_ALL[:-1] + ["--worker=0", "--command=tail -n 100 ~/albert_run.log"]],
        ),
        (
            ["logs", "--worker=3", "--follow", "--lines", "20"],
            [SSH_ALL[:-1] + ["--worker=3", "--command=tail -n 20 -F ~/albert_run.log"]],
        ),
        (
            ["delete"],
            [["gcloud", "compute", "tpus", "tpu-vm", "delete", NAME, f"--zone={ZONE}", "--quiet"]],
        ),
        (
            ["delete", "--queued"],
            [
                ["gcloud", "compute", "tpus", "queued-resources", "delete", f"{NAME}-qr"]
                + [f"--zone={ZONE}", "--force", "--quiet"]
            ],
        ),
    ],
)
def test_dry_run_prints_the_expected_gcloud_commands(args, expected):
    commands = dry_run(*args, *COMMON)
    assert len(commands) == len(expected), commands
    for words, want in zip(commands, expected, strict=True):
        if isinstance(want, str):  # only the verb matters
            assert " ".join(words[:5]).endswith(want), words
        else:
            assert words == want


def test_dry_run_setup_copies_the_code_then_installs_it_everywhere(tmp_path):
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    scp, ssh = dry_run("setup", *COMMON, env=env)
    tarball = tmp_path / f"{NAME}-albert_jax_code.tar.gz"
    assert scp == ["gcloud", "compute", "tpus", "tpu-vm", "scp", str(tarball)] + [
        f"{NAME}:albert_jax_code.tar.gz",
        f"--zone={ZONE}",
        "--worker=all",
    ]
    assert not tarball.exists(), "a dry run must not build the tarball"
    assert ssh[:8] == SSH_ALL
    command = remote_command(ssh)
    assert "tar -xzf ~/albert_jax_code.tar.gz -C ~/albert_jax" in command
    assert "python3 -m venv ~/albert_venv" in command
    assert 'pip install -q -e ".[test,tpu]"' in command


def test_dry_run_kill_stops_training_and_frees_the_tpu():
    (words,) = dry_run("kill", *COMMON)
    assert words[:8] == SSH_ALL
    command = remote_command(words)
    assert "pkill -f 'albert_jax[.](main|sweep)'" in command
    assert "/dev/accel*" in command and "/dev/vfio/*" in command
    assert command.endswith(LOCKFILE_REMOVAL)


def test_project_is_passed_to_every_command():
    for args in (["create", "--type=v4-8"], ["setup"], ["run", *RUN_FLAGS], ["delete"]):
        for words in dry_run(*args, *COMMON, "--project=my-project"):
            assert words[-1] == "--project=my-project", words


def test_remote_scripts_are_valid_shell():
    for args in (["setup"], ["run", *RUN_FLAGS], ["run", "--foreground", *RUN_FLAGS], ["kill"]):
        for words in dry_run(*args, *COMMON):
            if words[4] == "ssh":
                check = subprocess.run(["bash", "-n", "-c", remote_command(words)])
                assert check.returncode == 0, words


# --------------------------------------------------------------------------------------------
# Argument checks


@pytest.mark.parametrize(
    "args, missing",
    [
        (["run", f"--zone={ZONE}", *RUN_FLAGS], "--name"),
        (["run", f"--name={NAME}", *RUN_FLAGS], "--zone"),
        (["run", *COMMON, f"--config={CONFIG}", f"--data_dir={DATA_DIR}"], "--workdir"),
        (["run", *COMMON, f"--workdir={WORKDIR}", f"--data_dir={DATA_DIR}"], "--config"),
        (["run", *COMMON, f"--config={CONFIG}", f"--workdir={WORKDIR}"], "--data_dir"),
        (["create", *COMMON], "--type"),
        (["run", "--restart", *COMMON, *RUN_FLAGS], "--type"),
        (["logs", f"--zone={ZONE}"], "--name"),
        (["delete", f"--name={NAME}"], "--zone"),
    ],
)
def test_missing_required_flag_fails_with_usage(args, missing):
    result = launch("--dry-run", *args)
    assert result.returncode != 0
    assert f"missing required flag {missing}" in result.stderr
    assert "Usage:" in result.stderr
    assert result.stdout == "", "nothing may run when arguments are missing"


@pytest.mark.parametrize(
    "flag, value",
    [
        ("--workdir", "/tmp/albert_run"),
        ("--workdir", "runs/base"),
        ("--data_dir", "/home/me/tensorflow_datasets"),
        ("--workdir", "gs://"),
    ],
)
def test_local_paths_are_refused_for_run(flag, value):
    flags = {f.split("=")[0]: f for f in RUN_FLAGS} | {flag: f"{flag}={value}"}
    result = launch("run", "--dry-run", *COMMON, *flags.values())
    assert result.returncode != 0
    assert f"{flag} must be a gs:// path" in result.stderr
    assert value in result.stderr
    assert result.stdout == ""


@pytest.mark.parametrize(
    "args, message",
    [
        ([], "missing subcommand"),
        (["launch", *COMMON], "unknown subcommand: launch"),
        (["run", *COMMON, *RUN_FLAGS, "--bogus=1"], "unknown flag: --bogus"),
        (["create", *COMMON, "--type=v4"], "--type must look like"),
        (["create", "--name=Bad_Name", f"--zone={ZONE}", "--type=v4-8"], "--name must be"),
        (["logs", *COMMON, "--worker=first"], "--worker must be"),
        (["run", *COMMON, *RUN_FLAGS, "--restart", "--type=v4-8", "--max_restarts=-1"], "--max_r"),
        (["setup", *COMMON, "--config.seed=1"], "only apply to 'run'"),
    ],
)
def test_bad_arguments_fail_clearly(args, message):
    result = launch("--dry-run", *args)
    assert result.returncode != 0
    assert message in result.stderr
    assert result.stdout == ""


def test_help_prints_usage():
    result = launch("--help")
    assert result.returncode == 0
    for subcommand in ("create", "setup", "run", "logs", "kill", "delete"):
        assert f"\n  {subcommand} " in result.stdout


# --------------------------------------------------------------------------------------------
# The remote training command, executed in a sandbox home directory

STAND_IN_MAIN = textwrap.dedent(
    """\
    # Stand-in for albert_jax.main: records how the launcher started it, then exits with the
    # status given by --config.exit_code (what a crash or a finished run would return).
    import json, os, sys
    record = {"argv": sys.argv[1:], "cwd": os.getcwd(), "prefix": sys.prefix,
              "tfds_data_dir": os.environ.get("TFDS_DATA_DIR")}
    print("stand-in training started")
    with open(os.path.join(os.environ["HOME"], "record.json"), "w") as f:
        json.dump(record, f)
    codes = [a.split("=", 1)[1] for a in sys.argv if a.startswith("--config.exit_code=")]
    sys.exit(int(codes[0]) if codes else 0)
    """
)


@pytest.fixture
def sandbox_home(tmp_path: Path) -> Path:
    """A home directory laid out as `setup` leaves a worker: code dir and a real venv."""
    home = tmp_path / "home"
    package = home / "albert_jax" / "albert_jax"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "main.py").write_text(STAND_IN_MAIN)
    subprocess.run(
        [sys.executable, "-m", "venv", "--without-pip", str(home / "albert_venv")], check=True
    )
    return home


def run_on_sandbox(home: Path, *flags: str) -> subprocess.CompletedProcess:
    """Runs the training part of `run`'s remote command (not the TPU kill, which would hit real
    processes on a TPU host) with HOME=home, as a worker's shell would."""
    (words,) = dry_run("run", *COMMON, *RUN_FLAGS, *flags)
    command = remote_command(words)
    training = command.split(LOCKFILE_REMOVAL + "; ", 1)[1]
    env = {"HOME": str(home), "PATH": os.environ["PATH"]}
    return subprocess.run(
        ["bash", "-c", training], capture_output=True, text=True, env=env, timeout=60
    )


def check_record(home: Path, *extra: str) -> None:
    record = json.loads((home / "record.json").read_text())
    assert record["argv"] == [f"--config={CONFIG}", f"--workdir={WORKDIR}", *extra]
    assert record["cwd"] == str(home / "albert_jax")  # relative config paths resolve
    assert record["prefix"] == str(home / "albert_venv")  # the venv is active
    assert record["tfds_data_dir"] == DATA_DIR


def test_foreground_run_on_a_worker_propagates_the_exit_status(sandbox_home):
    result = run_on_sandbox(sandbox_home, "--foreground", "--config.exit_code=3")
    assert result.returncode == 3, result.stderr  # through `| tee`, thanks to pipefail
    assert "stand-in training started" in result.stdout
    assert "stand-in training started" in (sandbox_home / "albert_run.log").read_text()
    check_record(sandbox_home, "--config.exit_code=3")


def test_background_run_on_a_worker_returns_at_once_and_logs(sandbox_home):
    result = run_on_sandbox(sandbox_home, "--config.exit_code=5")
    assert result.returncode == 0, result.stderr
    assert "training started, log in ~/albert_run.log" in result.stdout
    log = sandbox_home / "albert_run.log"
    deadline = time.monotonic() + 10
    while not (sandbox_home / "record.json").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    check_record(sandbox_home, "--config.exit_code=5")
    while "stand-in training started" not in log.read_text() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert "stand-in training started" in log.read_text()


# --------------------------------------------------------------------------------------------
# The restart loop, against a stand-in gcloud

FAKE_GCLOUD = textwrap.dedent(
    """\
    #!/usr/bin/env bash
    # Stand-in for the Cloud SDK. Keeps one TPU node's state (and its queued resource's) in
    # files, records every call, and answers training runs from the scripted outcomes file.
    set -u
    dir=$FAKE_GCLOUD_DIR
    printf '%s\\n' "$*" >> "$dir/calls.log"
    not_found() {
      echo "ERROR: (gcloud.compute.tpus.$1.describe) NOT_FOUND: Resource was not found" >&2
      exit 1
    }
    case "$3 $4" in
      "tpu-vm describe") if [ -f "$dir/node" ]; then cat "$dir/node"; else not_found tpu-vm; fi ;;
      "tpu-vm create") echo READY > "$dir/node" ;;
      "tpu-vm delete") rm -f "$dir/node" ;;
      "queued-resources describe")
        if [ -f "$dir/qr" ]; then cat "$dir/qr"; else not_found queued-resources; fi ;;
      "queued-resources create") echo ACTIVE > "$dir/qr"; echo READY > "$dir/node" ;;
      "queued-resources delete") rm -f "$dir/qr" "$dir/node" ;;
      "tpu-vm scp") cp "$5" "$dir/received.tar.gz" ;;
      "tpu-vm ssh")
        command=""
        for arg in "$@"; do
          case $arg in --command=*) command=${arg#--command=} ;; esac
        done
        bash -n -c "$command" || exit 97
        case $command in
          *albert_jax.main*)
            outcome=$(head -n 1 "$dir/outcomes")
            tail -n +2 "$dir/outcomes" > "$dir/outcomes.rest"
            mv "$dir/outcomes.rest" "$dir/outcomes"
            case $outcome in
              ok) exit 0 ;;
              fail) exit 1 ;;
              preempt)
                echo PREEMPTED > "$dir/node"
                if [ -f "$dir/qr" ]; then echo SUSPENDED > "$dir/qr"; fi
                exit 255 ;;
              *) echo "no scripted outcome left" >&2; exit 98 ;;
            esac ;;
        esac ;;
      *) echo "stand-in gcloud: unexpected call: $*" >&2; exit 99 ;;
    esac
    """
)


@pytest.fixture
def fake_cloud(tmp_path: Path):
    """(env, state dir): PATH starts with a stand-in gcloud whose state lives in the dir."""
    state = tmp_path / "cloud"
    bin_dir = tmp_path / "bin"
    state.mkdir()
    bin_dir.mkdir()
    gcloud = bin_dir / "gcloud"
    gcloud.write_text(FAKE_GCLOUD)
    gcloud.chmod(0o755)
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    env = {
        **os.environ,
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        "FAKE_GCLOUD_DIR": str(state),
        "TMPDIR": str(scratch),
    }
    return env, state


def restart_run(env, *flags: str) -> subprocess.CompletedProcess:
    return launch(
        "run",
        "--restart",
        *COMMON,
        *RUN_FLAGS,
        "--type=v4-32",
        "--spot",
        "--restart_wait_s=0",
        "--poll_s=0",
        *flags,
        env=env,
    )


def call_verbs(state: Path) -> list[str]:
    """Each recorded gcloud call as 'kind verb' (ssh calls as 'ssh run' / 'ssh setup')."""
    verbs = []
    for line in (state / "calls.log").read_text().splitlines():
        words = line.split()
        verb = f"{words[2]} {words[3]}"
        if verb == "tpu-vm ssh":
            verb = "ssh run" if "albert_jax.main" in line else "ssh setup"
        verbs.append(verb)
    return verbs


def test_restart_recreates_a_preempted_tpu_and_resumes(fake_cloud):
    env, state = fake_cloud
    (state / "node").write_text("READY\n")
    (state / "outcomes").write_text("preempt\nok\n")
    result = restart_run(env)
    assert result.returncode == 0, result.stderr
    assert call_verbs(state) == [
        "tpu-vm describe",
        "ssh run",  # preempted mid-run
        "tpu-vm describe",  # PREEMPTED
        "tpu-vm delete",
        "tpu-vm create",
        "tpu-vm describe",  # READY
        "tpu-vm scp",
        "ssh setup",
        "ssh run",  # resumes from the gs:// workdir
    ]
    calls = (state / "calls.log").read_text().splitlines()
    assert calls[4].endswith("--accelerator-type=v4-32 --version=tpu-ubuntu2204-base --spot")
    # The code that was shipped is this repository, without git internals; the local copy is
    # cleaned up.
    names = shipped_files(state)
    assert {"setup.py", "launch/tpu_pod.sh", "tests/test_launch.py"} <= names
    assert not any(n.startswith(".git/") or "__pycache__" in n for n in names)
    assert list(Path(env["TMPDIR"]).iterdir()) == []


def shipped_files(state: Path) -> set[str]:
    """Paths of the regular files in the tarball that `setup` copied to the workers."""
    with tarfile.open(state / "received.tar.gz") as tar:
        return {m.name.removeprefix("./") for m in tar.getmembers() if m.isfile()}


def test_setup_ships_a_checkout_without_git_too(fake_cloud, tmp_path):
    env, state = fake_cloud
    checkout = tmp_path / "checkout"  # e.g. an exported source tree
    (checkout / "launch").mkdir(parents=True)
    (checkout / ".venv" / "bin").mkdir(parents=True)
    (checkout / ".venv" / "bin" / "python").write_text("")
    (checkout / "setup.py").write_text("")
    shutil.copy(SCRIPT, checkout / "launch" / "tpu_pod.sh")
    result = subprocess.run(
        ["bash", str(checkout / "launch" / "tpu_pod.sh"), "setup", *COMMON],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert call_verbs(state) == ["tpu-vm scp", "ssh setup"]
    assert shipped_files(state) == {"setup.py", "launch/tpu_pod.sh"}


def test_restart_gives_up_after_max_restarts(fake_cloud):
    env, state = fake_cloud
    (state / "node").write_text("READY\n")
    (state / "outcomes").write_text("fail\nfail\nfail\n")
    result = restart_run(env, "--max_restarts=1")
    assert result.returncode != 0
    assert "giving up after 1 restarts" in result.stderr
    verbs = call_verbs(state)
    assert verbs.count("ssh run") == 2
    assert "tpu-vm create" not in verbs  # the TPU stayed READY: only the run was retried


def test_restart_with_queued_resources_recreates_the_request(fake_cloud):
    env, state = fake_cloud
    (state / "outcomes").write_text("preempt\nok\n")  # no TPU yet: the loop creates it first
    result = restart_run(env, "--queued")
    assert result.returncode == 0, result.stderr
    assert call_verbs(state) == [
        "queued-resources describe",  # GONE
        "queued-resources create",
        "queued-resources describe",  # ACTIVE
        "tpu-vm describe",  # READY
        "tpu-vm scp",
        "ssh setup",
        "ssh run",  # preempted
        "queued-resources describe",  # SUSPENDED
        "queued-resources delete",
        "queued-resources create",
        "queued-resources describe",
        "tpu-vm describe",
        "tpu-vm scp",
        "ssh setup",
        "ssh run",
    ]
    deletes = [c for c in (state / "calls.log").read_text().splitlines() if " delete " in c]
    assert deletes == [
        f"compute tpus queued-resources delete {NAME}-qr --zone={ZONE} --force --quiet"
    ]


# --------------------------------------------------------------------------------------------
# Lint


def test_shellcheck_passes():
    # The launcher, and the accelerator benchmark script (run on machines lent for minutes).
    shellcheck = shutil.which("shellcheck")
    if shellcheck is None:
        if os.environ.get("CI"):
            pytest.fail("shellcheck is not installed (apt-get install -y shellcheck)")
        pytest.skip("shellcheck is not installed; set CI=1 to make this a failure")
    scripts = [str(SCRIPT), str(REPO / "benchmarks" / "accelerator.sh")]
    result = subprocess.run([shellcheck, *scripts], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


# --------------------------------------------------------------------------------------------
# The plan before a slice is created (#59)

# Tiny at 16k sequences of 512 tokens: the TPU compiler refuses it on v2-8 at once, even with
# every activation recomputed; 2 microbatches fit.
TOO_BIG = [
    "--type=v2-8", "--config=configs/pretrain.py:size=tiny", "--config.batch_size=16384",
    "--config.seq_len=512", "--config.model.max_position_embeddings=512",
    "--config.model.remat_policy=full",
]  # fmt: skip


def test_dry_run_plan_and_create_show_the_plan_first():
    result = launch("plan", "--dry-run", f"--config={CONFIG}", "--type=v3-64", "--num_slices=2",
                    "--config.model.dtype=bfloat16")  # fmt: skip
    assert result.returncode == 0, result.stderr  # no --name / --zone: nothing is created
    assert shlex.split(result.stdout) == [
        "python3", "-m", "albert_jax.plan", f"--config={CONFIG}", "--tpu=v3-64",
        "--num_slices=2", "--config.model.dtype=bfloat16",
    ]  # fmt: skip
    result = launch("create", "--dry-run", *COMMON, "--type=v4-32", f"--config={CONFIG}")
    assert result.returncode == 0, result.stderr
    plan_line, create_line = result.stdout.splitlines()
    assert shlex.split(plan_line)[2:] == [
        "albert_jax.plan",
        f"--config={CONFIG}",
        "--tpu=v4-32",
        "--num_slices=1",
        "--json",
    ]
    assert create_line.startswith(f"gcloud compute tpus tpu-vm create {NAME} ")


def test_create_refuses_a_slice_the_config_does_not_fit(tmp_path):
    pytest.importorskip("libtpu", reason="the plan needs the TPU compiler ([tpu] extra)")
    calls = tmp_path / "gcloud_calls"
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    stand_in = bin_dir / "gcloud"
    stand_in.write_text(f'#!/bin/sh\necho "$@" >> {calls}\n')
    stand_in.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "PYTHON": sys.executable,
           "JAX_PLATFORMS": "cpu"}  # fmt: skip
    refused = launch("create", *COMMON, *TOO_BIG, env=env, timeout=300)  # the options compile
    assert refused.returncode == 1, refused.stderr
    last = refused.stderr.strip().splitlines()[-1]
    assert last.startswith("tpu_pod.sh: error: configs/pretrain.py:size=tiny does not fit v2-8 x1: "
                           "the TPU compiler refused it (RESOURCE_EXHAUSTED"), last  # fmt: skip
    assert "pass --force to create it anyway" in last
    # #67: what would fit, each compiled, cheapest first; then a larger slice.
    assert "what would fit, cheapest first: (1) --config.microbatches=2 (" in last, last
    assert "(2) a larger slice (v2-32) or --num_slices=2" in last, last
    assert not calls.exists()  # nothing was created
    forced = launch("create", *COMMON, *TOO_BIG, "--force", env=env)
    assert forced.returncode == 0, forced.stderr
    assert calls.read_text().startswith(f"compute tpus tpu-vm create {NAME} ")


def test_dry_run_multi_slice_uses_one_queued_resource_of_n_nodes():
    """--num_slices=2: one queued resource of two nodes (Multislice exists only so), reached as
    a whole by setup, run, kill and delete (--node=all); the plan compiles for both slices."""
    flags = [*COMMON, "--type=v5p-256", "--queued", "--num_slices=2"]
    qr = f"{NAME}-qr"
    created = launch("create", "--dry-run", *flags, f"--config={CONFIG}")
    plan, create, describe = created.stdout.splitlines()
    assert "--tpu=v5p-256 --num_slices=2 --json" in plan
    assert shlex.split(create) == [
        "gcloud", "compute", "tpus", "queued-resources", "create", qr, "--node-count=2",
        f"--node-prefix={NAME}", f"--zone={ZONE}", "--accelerator-type=v5p-256",
        "--runtime-version=v2-alpha-tpuv5",
    ]  # fmt: skip
    assert describe.startswith(f"gcloud compute tpus queued-resources describe {qr} ")
    scp, ssh = dry_run("setup", *flags)
    assert scp[:6] == ["gcloud", "compute", "tpus", "queued-resources", "scp", scp[5]]
    assert scp[6] == f"{qr}:albert_jax_code.tar.gz" and "--node=all" in scp
    every_host = ["gcloud", "compute", "tpus", "queued-resources", "ssh", qr, f"--zone={ZONE}",
                  "--node=all", "--worker=all"]  # fmt: skip
    assert ssh[: len(every_host)] == every_host
    (run,) = dry_run("run", *flags, *RUN_FLAGS)
    assert run[: len(every_host)] == every_host and "albert_jax.main" in remote_command(run)
    (kill,) = dry_run("kill", *flags)
    assert kill[: len(every_host)] == every_host
    (delete,) = dry_run("delete", *flags)
    assert delete == ["gcloud", "compute", "tpus", "queued-resources", "delete", qr,
                      f"--zone={ZONE}", "--force", "--quiet"]  # fmt: skip
    refused = launch("create", "--dry-run", *COMMON, "--type=v5p-256", "--num_slices=2")
    assert refused.returncode == 2 and "--num_slices=2 needs --queued" in refused.stderr


def test_dry_run_sweep_runs_the_grid_on_every_worker():
    root = "gs://my-bucket/sweeps/lr"
    flags = [f"--config={CONFIG}", f"--root={root}", f"--data_dir={DATA_DIR}",
             "--sweep.learning_rate=1e-3,2e-3", "--sweep_fn=configs/pretrain.py:sweep",
             "--config.batch_size=512"]  # fmt: skip
    (words,) = dry_run("sweep", *COMMON, *flags)
    command = remote_command(words)
    assert (f"nohup python -m albert_jax.sweep --config={CONFIG} --root={root} "
            "--sweep.learning_rate=1e-3,2e-3 --sweep_fn=configs/pretrain.py:sweep "
            "--config.batch_size=512 >> ~/albert_run.log") in command  # fmt: skip
    # --restart babysits it like a run: in the foreground, the same command after a preemption.
    restarted = launch("sweep", "--dry-run", "--restart", "--type=v4-32", *COMMON, *flags)
    assert restarted.returncode == 0, restarted.stderr
    assert "tee -a ~/albert_run.log" in restarted.stdout
    # `kill` stops sweeps too.
    (kill,) = dry_run("kill", *COMMON)
    assert "albert_jax[.](main|sweep)" in remote_command(kill)


@pytest.mark.parametrize(
    "args, message",
    [
        (["sweep", *COMMON, f"--config={CONFIG}", "--root=/tmp/x", f"--data_dir={DATA_DIR}",
          "--sweep.seed=1,2"], "--root must be a gs:// path"),
        (["sweep", *COMMON, f"--config={CONFIG}", "--root=gs://b/x", f"--data_dir={DATA_DIR}"],
         "'sweep' needs --sweep.FIELD=V1,V2,... or --sweep_fn"),
        (["run", *COMMON, *RUN_FLAGS, "--sweep.seed=1,2"],
         "sweep flags (--sweep.seed=1,2 ...) only apply to 'sweep' and 'plan'"),
    ],
)  # fmt: skip
def test_sweep_arguments_are_checked(args, message):
    result = launch(*args)
    assert result.returncode in (1, 2)
    assert message in result.stderr


def test_plan_of_a_sweep_plans_its_largest_point(tmp_path):
    """`plan` with sweep flags asks the sweep for its largest point and plans that (the plan
    itself stood in for by a script that prints what it was given)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    python = bin_dir / "python"
    python.write_text(textwrap.dedent(f"""\
        #!/bin/sh
        if [ "$2" = albert_jax.plan ]; then echo "PLAN $*"; exit 0; fi
        exec {sys.executable} "$@"
        """))  # fmt: skip
    python.chmod(0o755)
    env = {**os.environ, "PYTHON": str(python), "JAX_PLATFORMS": "cpu"}
    result = launch("plan", "--type=v4-8", "--config=configs/pretrain.py:size=base",
                    "--sweep.model.sharing=all,none", "--sweep.learning_rate=1e-3,2e-3",
                    "--config.batch_size=256", env=env)  # fmt: skip
    assert result.returncode == 0, result.stderr
    (line,) = [x for x in result.stdout.splitlines() if x.startswith("PLAN")]
    assert line.split()[1:] == [
        "-m", "albert_jax.plan", "--config=configs/pretrain.py:size=base", "--tpu=v4-8",
        "--num_slices=1", "--config.batch_size=256", "--config.model.sharing=none",
        "--config.learning_rate=1e-3",
    ]  # fmt: skip
