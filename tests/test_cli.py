"""`runtime.cli`: how the command-line programs end on an error, run as the user runs them
(`python -m ...` in a subprocess): an expected error in one line `error: <message>` that ends
stderr, exit status 1 (plan: 2), the traceback only with ALBERT_TRACEBACK=1; a bug keeps its
traceback; and the process ends even while a thread that never finishes is alive."""

import os
import signal
import subprocess
import sys
import time

import pytest
from conftest import REPO
from test_train import small_overrides, tiny_command

from albert_jax.runtime import cli

# `python -m albert_jax.main` with a thread that never ends and keeps printing to stderr, as
# Orbax's writers do once Cloud Storage stopped answering: the interpreter's shutdown waits for
# such a (non-daemon) thread forever, and its output would come after the error.
_MAIN_BESIDE_A_STUCK_THREAD = """
import sys, threading, time

def stuck_upload():
    while True:
        sys.stderr.write("upload: still waiting for the bucket\\n")
        time.sleep(0.005)

threading.Thread(target=stuck_upload).start()
time.sleep(0.05)
from albert_jax import main
main.run()
"""


def run(*args: str, timeout: float = 120, **env: str) -> subprocess.CompletedProcess:
    """`python ARGS` in the repository on the CPU, `env` added to the environment."""
    inherited = {k: v for k, v in os.environ.items() if k != cli.TRACEBACK_ENV}
    environment = {**inherited, "JAX_PLATFORMS": "cpu", **env}
    return subprocess.run(
        [sys.executable, *args], cwd=REPO, env=environment, capture_output=True, text=True,
        timeout=timeout,
    )  # fmt: skip


def assert_one_line(proc: subprocess.CompletedProcess, message: str, status: int = 1) -> None:
    """`proc` ended with status `status` and the line `error: ...` holding `message` last on
    stderr, the only line that holds it, and no traceback."""
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == status, proc.stderr[-3000:]
    assert lines[-1].startswith("error: ") and message in lines[-1], proc.stderr[-3000:]
    assert sum(message in line for line in lines) == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]


def main_args(tmp_path, *flags: str) -> list[str]:
    return ["-m", "albert_jax.main", "--config=configs/pretrain.py:size=tiny",
            f"--workdir={tmp_path / 'run'}", *flags]  # fmt: skip


def test_refused_config_value_is_one_line(tmp_path):
    proc = run(*main_args(tmp_path, "--config.learning_rate=-1"))
    assert_one_line(proc, "learning_rate must be >= 0.0, got -1.0")
    assert proc.stderr.strip().splitlines()[-1] == "error: learning_rate must be >= 0.0, got -1.0"


def test_traceback_on_request(tmp_path):
    proc = run(*main_args(tmp_path, "--config.learning_rate=-1"), **{cli.TRACEBACK_ENV: "1"})
    assert proc.returncode == 1
    assert "Traceback (most recent call last)" in proc.stderr
    assert 'in _check_number\n    raise ValueError(f"{name} must be' in proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == "error: learning_rate must be >= 0.0, got -1.0"


def test_config_file_error_is_the_config_files_message_in_one_line(tmp_path):
    """ml_collections puts get_config's whole traceback into the flag's error message."""
    proc = run("-m", "albert_jax.main", "--config=configs/pretrain.py:size=huge",
               f"--workdir={tmp_path}")  # fmt: skip
    assert_one_line(proc, "config arg size='huge' is not one of")
    assert "--config=configs/pretrain.py:size=huge" in proc.stderr.strip().splitlines()[-1]


def test_a_bug_keeps_its_traceback(tmp_path):
    """A config file without the model's fields: the code reading them fails with an
    AttributeError, which no CLI expects — Python's traceback, not an `error:` line."""
    config = tmp_path / "no_model.py"
    config.write_text(
        "import ml_collections\n\n\n"
        "def get_config():\n"
        "    return ml_collections.ConfigDict({'seed': 0})\n"
    )
    proc = run("-m", "albert_jax.main", f"--config={config}", f"--workdir={tmp_path / 'run'}")
    assert proc.returncode == 1
    assert "Traceback (most recent call last)" in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("AttributeError: ")
    assert "error: " not in proc.stderr


def test_exit_does_not_wait_for_a_stuck_thread(tmp_path):
    """Before runtime.cli the interpreter waited for the thread forever (the timeout here)."""
    args = main_args(tmp_path, "--config.learning_rate=-1")
    proc = run("-c", _MAIN_BESIDE_A_STUCK_THREAD, *args[2:], timeout=60)
    assert "upload: still waiting" in proc.stderr  # the thread ran beside the error
    assert_one_line(proc, "learning_rate must be >= 0.0, got -1.0")


@pytest.mark.parametrize(
    "args, message, status",
    [
        (["albert_jax.convert", "--from=tf", "--src={tmp}/nowhere", "--dst={tmp}/out"],
         "official TF1 checkpoint: {tmp}/nowhere does not exist", 1),
        (["albert_jax.params", "--config=configs/pretrain.py:size=huge"],
         "config arg size='huge' is not one of", 1),
        (["albert_jax.glue_table", "--init={tmp}/nowhere", "--workdir={tmp}/sweep",
          "--tasks=mnli,nope"], "--tasks: unknown task 'nope'", 1),
        (["albert_jax.analysis.depth", "--init={tmp}/nowhere"],
         "load_pretrained: '{tmp}/nowhere' does not exist", 1),
        (["albert_jax.analysis.sop_table", "--workdirs={tmp}", "--output={tmp}/table"],
         "has no config.json: not a training run", 1),
        (["albert_jax.data.builders", "--sources=documents/x={tmp}/nowhere.jsonl",
          "--data_dir={tmp}/tfds"], "'{tmp}/nowhere.jsonl' does not exist", 1),
        (["albert_jax.plan", "--config=configs/pretrain.py:size=tiny", "--tpu=v3-7"],
         "--tpu='v3-7'", 2),  # plan's documented status for what cannot be planned
    ],
    ids=["convert", "params", "glue_table", "depth", "sop_table", "builders", "plan"],
)  # fmt: skip
def test_each_cli_reports_in_one_line(tmp_path, args, message, status):
    proc = run("-m", *(a.format(tmp=tmp_path) for a in args))
    assert_one_line(proc, message.format(tmp=tmp_path), status)


def test_diverged_run_ends_in_one_line(corpus, tmp_path):
    """A NaN loss at step 3 (TrainingDivergedError, checkpoints being written every 2 steps):
    one line naming the step and the last good checkpoint, status 1."""
    overrides = small_overrides(
        corpus, num_train_steps=4, checkpoint_every_steps=2, **{"debug.nan_at_step": 3}
    )
    args, env = tiny_command(str(tmp_path / "nan"), overrides, 1)
    proc = subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert_one_line(proc, "non-finite loss, grad_norm")
    assert "at step 3 (loss=nan" in proc.stderr.strip().splitlines()[-1]


@pytest.mark.parametrize(
    "workdir, message",
    [("", "--workdir is empty (an unset variable?)"),
     ("gs://", "--workdir=gs:// names no bucket: write gs://BUCKET/PATH"),
     ("gs:///runs/a", "--workdir=gs:///runs/a names no bucket"),
     ("notes.txt", "--workdir=notes.txt is a file, not a directory")],
)  # fmt: skip
def test_an_empty_or_bucketless_workdir_is_refused_and_nothing_is_written(tmp_path, workdir,
                                                                          message):  # fmt: skip
    """`--workdir=$UNSET` used to train into the current directory (the repository root)."""
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    (cwd / "notes.txt").write_text("mine")
    args = ["-m", "albert_jax.main", f"--config={REPO}/configs/pretrain.py:size=tiny",
            f"--workdir={workdir}"]  # fmt: skip
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(REPO)}
    env.pop(cli.TRACEBACK_ENV, None)
    proc = subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert_one_line(proc, message)
    assert [p.name for p in cwd.iterdir()] == ["notes.txt"]


def test_a_file_that_is_no_tokenizer_is_refused_naming_it_and_not_copied(tmp_path):
    """`--config.data.tokenizer=data.csv` used to be copied to WORKDIR/tokenizer.model first,
    and every later run with the right tokenizer was refused until it was deleted by hand."""
    wrong = tmp_path / "data.csv"
    wrong.write_text("id,text\n1,hello\n")
    proc = run(*main_args(tmp_path, f"--config.data.tokenizer={wrong}"))
    assert_one_line(proc, f"config.data.tokenizer: Tokenizer: '{wrong}' is not a sentencepiece")
    assert not (tmp_path / "run" / "tokenizer.model").exists()


# A command whose checkpoint save fails (a real Checkpointer; the OS error of a storage that
# stopped answering) and whose way out then never ends, as closing writers on that storage
# did: a storage outage took 2 minutes from the failed save to the exit (#66 case 9).
_FAILED_SAVE_THEN_A_STUCK_CLEANUP = """
import sys, time
from albert_jax import checkpointing
from albert_jax.runtime import cli

def main(argv):
    checkpointer = checkpointing.Checkpointer(sys.argv[1])
    try:
        with checkpointer._failures(3):
            raise OSError("the bucket stopped answering")
    finally:
        time.sleep(600)  # an upload that never completes

cli.run(main)
"""


def test_the_way_out_after_a_failed_save_is_bounded(tmp_path):
    started = time.monotonic()
    proc = run("-c", _FAILED_SAVE_THEN_A_STUCK_CLEANUP, str(tmp_path / "run"),
               **{cli.EXIT_BOUND_ENV: "3"})  # fmt: skip
    assert time.monotonic() - started < 60, proc.stderr
    assert proc.returncode == 1, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: saving the checkpoint of step 3 to "), last
    assert last.endswith("(the way out took over 3 s; abandoned)"), last
    assert "stopping: saving the checkpoint of step 3" in proc.stderr  # said when it happens


def test_sigterm_before_training_is_one_line_and_leaves_no_workdir(corpus, tmp_path):
    """#66 case 11: SIGTERM while the run sets up (the tokenizer, compilation) killed it with
    the default action (and a crash dump of every thread where libtpu had started). Now it
    unwinds: one line, status 0 as for a preemption, the new workdir removed again."""
    workdir = tmp_path / "run"
    args, env = tiny_command(workdir, small_overrides(corpus, num_train_steps=4), 1)
    env = {**env, "ALBERT_LIBRARY_LOGS": ""}
    proc = subprocess.Popen(args, cwd=REPO, env=env, stderr=subprocess.PIPE, text=True)
    lines = []
    for line in proc.stderr:  # the first lines of the run: its devices, then its setup
        lines.append(line)
        if "main.py" in line:
            proc.send_signal(signal.SIGTERM)
            break
    rest = proc.stderr.read()
    assert proc.wait(timeout=120) == 0, "".join(lines) + rest
    last = rest.strip().splitlines()[-1]
    assert last.startswith("stopped by signal 15 before training began: nothing to save"), rest
    assert "Traceback" not in rest and "Fatal Python error" not in rest, rest
    assert not workdir.exists()
