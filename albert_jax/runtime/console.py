"""What a command prints: the run's own lines, not its libraries'.

A pretraining run on the tiny config logged ~1,000 lines, six of Orbax's, TFDS's and JAX's INFO
lines for each progress line of its own (`atomicity.py`, `checkpoint_manager.py`, ...), and
on a machine with the `[tpu]` extra but no TPU it started with libtpu's `E0000` errors. Every
command line program (`albert_jax.runtime.cli.run`) therefore sets up its console with `quiet`:

- Log records of the libraries go through only from WARNING up; the package's own (`albert_jax`,
  `configs`) keep INFO. All of them share absl's handler (Orbax and TFDS log through absl
  too), so the filter sits on that handler and reads where a record comes from.
  `ALBERT_LIBRARY_LOGS=1` lets everything through again.
- A few warnings that only describe what the package asked for are dropped (`BENIGN`), and
  the notices TensorFlow's C++ code prints when it loads (`tensorflow_notices_dropped`: this
  TensorFlow ignores `TF_CPP_MIN_LOG_LEVEL`).
- JAX starts no TPU backend where there is no TPU chip (`process_setup.skip_absent_tpu`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
import tempfile
from collections.abc import Iterator

LIBRARY_LOGS_ENV = "ALBERT_LIBRARY_LOGS"

_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # albert_jax/
_OWN_DIRS = (_PACKAGE + os.sep, os.path.join(os.path.dirname(_PACKAGE), "configs") + os.sep)

# Library warnings about a state the package chose: the read-only CheckpointManager it opens
# to look at a workdir's steps, the dataset folder it checks before building it, the builder
# config of a local source.
BENIGN = re.compile(
    r"Given directory is read only|has no dataset_info\.json|Using custom data configuration"
)


class RunOnly(logging.Filter):
    """Passes the package's records, and the libraries' from WARNING up (less the `BENIGN`)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if os.path.abspath(record.pathname).startswith(_OWN_DIRS):
            return True
        if record.levelno < logging.WARNING:
            return False
        return not BENIGN.search(record.getMessage())


_FILTER = RunOnly()


def library_logs_wanted() -> bool:
    return os.environ.get(LIBRARY_LOGS_ENV, "") not in ("", "0")


def quiet() -> None:
    """Sets up the console of a command (idempotent; see the module docstring)."""
    from absl import logging as absl_logging

    from albert_jax.runtime import process_setup

    process_setup.skip_absent_tpu()
    if library_logs_wanted():
        return
    handler = absl_logging.get_absl_handler()
    if _FILTER not in handler.filters:
        handler.addFilter(_FILTER)


# What TensorFlow's C++ libraries print to stderr when they load and first see the CPU: INFO
# lines (`I0000 ... port.cc] oneDNN custom operations are on`, `cpu_feature_guard.cc`), the
# second line of the latter, and absl's notice that it logs before being initialized.
_TF_NOTICE = re.compile(
    r"^(I\d{4} \S+ +\d+ \S+\.cc:\d+\]|WARNING: All log messages before absl::InitializeLog"
    r"|To enable the following instructions: )"
)


@contextlib.contextmanager
def tensorflow_notices_dropped() -> Iterator[None]:
    """Around TensorFlow's import: what its C++ code writes to stderr (file descriptor 2) goes
    to a temporary file, and every line but its load-time notices is written back after."""
    if library_logs_wanted():
        yield
        return
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as captured:
        os.dup2(captured.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            captured.seek(0)
            kept = [
                line
                for line in captured.read().decode("utf-8", "replace").splitlines(keepends=True)
                if not _TF_NOTICE.match(line)
            ]
            if kept:
                sys.stderr.write("".join(kept))
                sys.stderr.flush()
