"""#66: the console shows the run, not its libraries.

The README's commands, run as a user runs them (no JAX_PLATFORMS, the `[tpu]` extra installed
on this CPU machine): pretraining prints about one line per progress step plus a short header
and footer, and so do fine-tuning and the plan CLI; none prints libtpu's `E0000` / `ABORTED`
lines or a library's INFO lines. `ALBERT_LIBRARY_LOGS=1` brings those back.
"""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys

import pytest
from test_train import REPO

from albert_jax.runtime import console

# What a machine without a TPU printed before: libtpu's initialisation and JAX's failed start
# of a TPU backend.
FORBIDDEN = re.compile(
    r"^E\d{4}|ABORTED|INVALID_ARGUMENT|Unable to initialize backend|InitGoogle|libtpu"
    r"|Failed to find host bounds",
    re.MULTILINE,
)
# absl's line prefix: `I1129 05:44:03.696639 140376348375936 main.py:71] ...`
SOURCE = re.compile(r"^[IWEF]\d{4} [\d:.]+ +\d+ ([\w.]+\.py):\d+\]", re.MULTILINE)
PROGRESS = re.compile(r"\] step \d+/\d+ \|")
OWN_FILES = {
    name
    for top in ("albert_jax", "configs")
    for _, _, names in os.walk(os.path.join(REPO, top))
    for name in names
    if name.endswith(".py")
}


def _user_env(**extra: str) -> dict[str, str]:
    """The environment of a user's shell: none of the test session's JAX settings."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "XLA_"))}
    env.pop(console.LIBRARY_LOGS_ENV, None)
    return {**env, **extra}


def _run(args: list[str], **extra: str) -> str:
    proc = subprocess.run(
        [sys.executable, "-m", *args], cwd=REPO, env=_user_env(**extra),
        capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]
    return output


def _check_quiet(output: str, extra_lines: int) -> None:
    """No libtpu line, no library's line, and at most `extra_lines` besides the progress."""
    assert not FORBIDDEN.search(output), output[:3000]
    foreign = sorted(set(SOURCE.findall(output)) - OWN_FILES)
    assert not foreign, (foreign, output[:3000])
    lines = output.strip().splitlines()
    progress = [line for line in lines if PROGRESS.search(line)]
    assert progress, output[-3000:]
    assert len(lines) - len(progress) <= extra_lines, output


@pytest.mark.slow
def test_readme_commands_print_the_run_not_the_libraries(tmp_path, shared_data):
    pretrained, finetuned = tmp_path / "pretrain", tmp_path / "finetune"
    data_dir = f"--config.data.data_dir={tmp_path / 'tfds'}"
    output = _run([
        "albert_jax.main", "--config=configs/pretrain.py:size=tiny", f"--workdir={pretrained}",
        "--config.num_train_steps=200", data_dir,
    ])  # fmt: skip
    # The header (devices, cache, the demo source built, the tokenizer, start, data, steps,
    # compilation) and the footer (curve, done): 2 checkpoints' worth of Orbax lines before.
    _check_quiet(output, extra_lines=14)

    tasks = os.path.join(shared_data, "tasks", "sentiment_rt")
    output = _run([
        "albert_jax.main", f"--config=configs/finetune.py:task=sentiment_rt,init={pretrained}",
        f"--config.data.train_files={tasks}/train.jsonl.gz",
        f"--config.data.eval_files={tasks}/dev.jsonl.gz",
        f"--workdir={finetuned}", "--config.num_train_steps=100", "--config.pack_examples=False",
    ])  # fmt: skip
    _check_quiet(output, extra_lines=16)

    # Library logs on demand: Orbax's checkpoint lines are back.
    output = _run(
        ["albert_jax.main", "--config=configs/pretrain.py:size=tiny", f"--workdir={pretrained}",
         "--config.num_train_steps=210", data_dir],
        **{console.LIBRARY_LOGS_ENV: "1"},
    )  # fmt: skip
    assert set(SOURCE.findall(output)) - OWN_FILES, output[:3000]


def test_the_plan_prints_its_report_only():
    output = _run(["albert_jax.plan", "--config=configs/pretrain.py:size=tiny", "--tpu=v4-8"])
    assert not FORBIDDEN.search(output), output
    assert not SOURCE.findall(output), output
    # The slice and shape, memory, the verdict, a line per kind of collective, the gradient
    # traffic, the FLOPs bound.
    assert "v4-8" in output and len(output.strip().splitlines()) <= 10, output


def test_library_records_pass_from_warning_up_and_the_packages_always():
    """The filter on absl's handler, record by record."""
    run_only = console.RunOnly()

    def record(path: str, level: int, msg: str = "m") -> logging.LogRecord:
        return logging.LogRecord("absl", level, path, 1, msg, None, None)

    orbax = "/site-packages/orbax/checkpoint/_src/path/atomicity.py"
    own = os.path.join(REPO, "albert_jax", "loop.py")
    assert run_only.filter(record(own, logging.INFO))
    assert run_only.filter(record(os.path.join(REPO, "configs", "pretrain.py"), logging.INFO))
    assert not run_only.filter(record(orbax, logging.INFO))
    assert run_only.filter(record(orbax, logging.WARNING))
    assert run_only.filter(record(orbax, logging.ERROR))
    assert not run_only.filter(record(orbax, logging.WARNING, "Given directory is read only=x"))


def test_a_corpus_build_error_ends_the_output_on_its_own_line(tmp_path):
    """#66 case 11: a TFDS progress-bar residue shared the `error:` line of a corpus-building
    error. Building shows no progress bar now, and the error is the last line, alone."""
    corpus = tmp_path / "utf16.txt"
    corpus.write_bytes("A document in UTF-16.\n\nAnother one.\n".encode("utf-16"))
    proc = subprocess.run(
        [sys.executable, "-m", "albert_jax.main", "--config=configs/pretrain.py:size=tiny",
         f"--workdir={tmp_path / 'run'}", f"--config.data.sources=documents/u16={corpus}",
         f"--config.data.data_dir={tmp_path / 'tfds'}"],
        cwd=REPO, env=_user_env(), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 1, proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert lines[-1].startswith(f"error: {corpus}: a UTF-16LE file"), lines[-1]
    assert len(lines) <= 6 and not FORBIDDEN.search(proc.stderr), proc.stderr
    assert not set(SOURCE.findall(proc.stderr)) - OWN_FILES, proc.stderr
