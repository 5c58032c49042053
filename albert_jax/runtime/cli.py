"""How the package's command-line programs end on an error: `run`, around absl's `app.run`.

Every CLI (`python -m albert_jax.main`, `.convert`, `.glue_table`, `.plan`, `.params`, the
`albert_jax.analysis` programs, `.tasks.squad_eval`, `.data.tokenizer`, `.data.builders`)
starts through `run`. An expected error — a flag or config value that is refused, a file that
is missing or cannot be read, a checkpoint that cannot be written or read, a run whose loss
diverged, a workdir another run holds (`is_expected`) — ends the program with one line on
stderr,

    error: learning_rate must be >= 0.0, got -1.0

and exit status 1 (`albert_jax.plan`: 2, its "cannot be planned"). The traceback under such a
message only lists library frames; set the environment variable `ALBERT_TRACEBACK=1` to have
it printed above the line anyway. Any other exception is a bug, and keeps its traceback.

Either way the process then ends at once (`os._exit`), not through the interpreter's shutdown:
that waits for every non-daemon thread, and Orbax's checkpoint writers are such threads, which
never finish once Cloud Storage stopped answering; the run would hang after its error. Threads
still running may print tracebacks of their own meanwhile; the error line (or a bug's traceback)
is written last, with nothing after it. A run that succeeds exits normally.
"""

from __future__ import annotations

import os
import re
import signal
import sys
import threading
import traceback
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

from absl import app, flags, logging

from albert_jax.runtime import console

TRACEBACK_ENV = "ALBERT_TRACEBACK"

# The package's own errors for a run that cannot go on, looked up among the modules already
# imported instead of imported here: an error of one of these classes exists only once its
# module ran, and a CLI that never touches checkpoints must not load Orbax and JAX to sort
# its error. By name, so a module added later (or not present in a checkout) costs nothing.
PROJECT_ERRORS = (
    ("albert_jax.checkpointing", "CheckpointError"),
    ("albert_jax.loop", "TrainingDivergedError"),
    ("albert_jax.runtime.workdir_lease", "WorkdirInUseError"),
)
# Refused values (the package raises ValueError naming the field or file, files.py's
# UnreadableFileError among them), files and connections (OSError: FileNotFoundError,
# PermissionError, TimeoutError), and flags absl cannot parse.
EXPECTED_ERRORS: tuple[type[BaseException], ...] = (ValueError, OSError, flags.Error)


def _no_credentials(error: BaseException) -> str:
    first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return (
        f"no Google Cloud credentials to reach gs:// ({first.rstrip('.')}): run "
        "`gcloud auth application-default login`, or set GOOGLE_APPLICATION_CREDENTIALS to a "
        "service-account key file"
    )


def _storage_error(error: BaseException) -> str:
    """TensorFlow's file-system errors (epath's gs:// client): their message is an HTTP
    exchange over several lines; the path, and for a 404 what is missing, is what to say."""
    text = str(getattr(error, "message", "") or error)
    path = re.search(r"gs://[^\s'\"]+", text)
    first = text.strip().splitlines()[0] if text.strip() else type(error).__name__
    if path is None:
        return f"{type(error).__name__}: {first}"
    url = path.group(0).rstrip(".,;")
    if type(error).__name__ == "NotFoundError":
        bucket = url[len("gs://") :].split("/", 1)[0]
        return (
            f"{url}: not found: the bucket gs://{bucket} does not exist, or this account "
            "cannot see it"
        )
    return f"{url}: {type(error).__name__}: {first}"


# Other libraries' errors that are the environment's, not a bug: (module, class, the one line
# that says it). Looked up like PROJECT_ERRORS, among the modules already imported.
LIBRARY_ERRORS = (
    ("google.auth.exceptions", "DefaultCredentialsError", _no_credentials),
    ("tensorflow.python.framework.errors_impl", "OpError", _storage_error),
)


def _library_error(error: BaseException) -> Callable[[BaseException], str] | None:
    for module, name, describe in LIBRARY_ERRORS:
        kind = getattr(sys.modules.get(module), name, None)
        if isinstance(kind, type) and isinstance(error, kind):
            return describe
    return None


# Seconds a command may spend on its way out after an error that ends it (`bound_the_way_out`).
EXIT_BOUND_ENV, DEFAULT_EXIT_BOUND_S = "ALBERT_EXIT_BOUND_S", 60.0
_running = False  # set by `run`: this process is a command, which may end itself


def bound_the_way_out(error: BaseException) -> None:
    """After `error`, which ends the run, the cleanup it unwinds through (closing checkpoint
    writers, TensorBoard files, the lease on a storage that stopped answering) gets at most
    ALBERT_EXIT_BOUND_S seconds (60); then the process ends with the error line regardless
    (status 1). Only in a command (`run`): a notebook or test calling the library keeps its
    process."""
    if not _running:
        return
    try:
        bound = float(os.environ.get(EXIT_BOUND_ENV, "") or DEFAULT_EXIT_BOUND_S)
    except ValueError:
        bound = DEFAULT_EXIT_BOUND_S
    logging.warning("stopping: %s (at most %.0f s for the way out)", one_line(error), bound)

    def expire() -> None:
        end(f"error: {one_line(error)} (the way out took over {bound:.0f} s; abandoned)\n", 1)

    timer = threading.Timer(bound, expire)
    timer.daemon = True
    timer.start()


class StoppedBySignal(BaseException):
    """SIGTERM before the training loop took the signal over: a BaseException, so that no
    `except Exception` swallows it on its way out (a failed sweep point, a cleanup)."""


def _stop(signum: int, frame: Any) -> None:
    del frame
    raise StoppedBySignal(f"stopped by signal {signum} before training began: nothing to save")


def stop_on_sigterm() -> None:
    """Until the training loop installs its own handler (save at the next step boundary, exit
    0), SIGTERM ends the setup (data, tokenizer, compilation) at once: `StoppedBySignal`
    unwinds it (a run that had not trained leaves its workdir as found), and `run` ends the
    process with one line and status 0, as a preempted run does. Without it the default action
    killed the process mid-compilation with a crash dump of every thread. Single-process runs
    only: with `jax.distributed`, JAX's preemption service owns SIGTERM."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _stop)


def is_expected(error: BaseException, extra: tuple[type[BaseException], ...] = ()) -> bool:
    """Whether `error` is a user's or the environment's, reported in one line: one of
    `EXPECTED_ERRORS`, `PROJECT_ERRORS`, `LIBRARY_ERRORS` or `extra` (a CLI's own)."""
    project = [getattr(sys.modules.get(m), name, None) for m, name in PROJECT_ERRORS]
    kinds = EXPECTED_ERRORS + extra + tuple(k for k in project if isinstance(k, type))
    return isinstance(error, kinds) or _library_error(error) is not None


def one_line(error: BaseException) -> str:
    """The message of `error` on one line. ml_collections puts the whole traceback of a config
    file's `get_config` in the message of the flag error; the config's own error stands for it.
    The lines of a longer message are joined with "; " (a space after a line ending in ':')."""
    if (describe := _library_error(error)) is not None:
        return describe(error)
    text = str(error)
    marker = ": Error whilst parsing config file"
    if isinstance(error, flags.Error) and marker in text:
        cause = error
        while cause.__context__ is not None:  # the ValueError get_config raised is the last
            cause = cause.__context__
        text = f"{text.split(marker, 1)[0]}: {cause}"
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if not lines:
        return type(error).__name__
    joined = lines[0]
    for line in lines[1:]:
        joined += (" " if joined.endswith(":") else "; ") + line
    return joined


def parse_flags(argv: list[str]) -> list[str]:
    """absl's flag parsing; a `--config.` override of a field the config does not have raises
    ValueError naming it (`unknown_override_message`) instead of ml_collections' bare
    AttributeError / KeyError."""
    try:
        return flags.FLAGS(argv)
    except (AttributeError, KeyError) as e:
        message = unknown_override_message(argv, e)
        if message is None:  # no override's: a config file's own bug
            raise
        raise ValueError(message) from e


def unknown_override_message(argv: list[str], error: BaseException) -> str | None:
    """`config: unknown field 'lerning_rate' in --config.lerning_rate=1; did you mean
    'learning_rate'?` from ml_collections' error for an unknown override; None when no
    `--config.` argument of `argv` names the missing field. The one rewrite of that error:
    `parse_flags` (main.py's command line) and `glue_table.task_config` (its overrides)."""
    text = str(error.args[0]) if error.args else str(error)
    match = re.search(r'Did you mean "([^"]+)" instead of "([^"]+)"', text)
    key = match.group(2) if match else text.strip("'\"").splitlines()[0].strip("'\"")
    flag = next(
        (a for a in argv if a.startswith("--config.") and key in a.split("=")[0].split(".")),
        None,
    )
    if flag is None:
        return None
    hint = f"; did you mean {match.group(1)!r}?" if match else ""
    return f"config: unknown field {key!r} in {flag}{hint}"


def override_config(config: Any, overrides: Sequence[str], where: str = "") -> Any:
    """`config` with `--config.X=V` overrides, parsed by ml_collections against the config's
    fields and types (the config locked), as main.py's command line parses them.

    Raises:
      ValueError: an unknown field (named, with the nearest) or a value that does not parse
        for the field's type; prefixed by `where` ("task sst2: ").
    """
    from ml_collections import config_flags

    if not overrides:
        return config
    bad = [o for o in overrides if not o.startswith("--config.") or "=" not in o]
    if bad:
        raise ValueError(f"{where}write overrides as --config.FIELD=VALUE, got {bad}")
    # A private FlagValues: config_flags reads the override names from `sys_argv`. An unknown
    # field fails in the definition, a bad value in the parse.
    argv = [sys.argv[0] if sys.argv else "albert_jax", *overrides]
    values = flags.FlagValues()
    try:
        config_flags.DEFINE_config_dict(
            "config", config, flag_values=values, lock_config=True, sys_argv=argv
        )
        values(argv)
    except flags.Error as e:  # a bad value: the message names the flag
        raise ValueError(f"{where}{one_line(e)}") from e
    except (AttributeError, KeyError) as e:  # an unknown field: named as main.py names it
        message = unknown_override_message(list(overrides), e)
        if message is None:  # no override's: a config file's own bug
            raise
        raise ValueError(f"{where}{message}") from e
    return values.config


def run(
    main: Callable[[list[str]], Any],
    flags_parser: Callable[[list[str]], Any] = parse_flags,
    *,
    error_status: int = 1,
    expected: tuple[type[BaseException], ...] = (),
) -> None:
    """`app.run(main, flags_parser=flags_parser)`, ending the process as the module docstring
    says when the parser or `main` raises: `error_status` for an expected error (`is_expected`,
    with the CLI's own `expected` types), 1 for any other. absl's usage errors
    (`app.UsageError`: usage and the message) and exits (`SystemExit`) are left to absl."""

    def guarded(function: Callable[[list[str]], Any]) -> Callable[[list[str]], Any]:
        def call(argv: list[str]) -> Any:
            try:
                return function(argv)
            except app.UsageError:
                raise
            except StoppedBySignal as e:
                end(f"{e}; the same command starts the run again\n", 0)
            except Exception as e:
                if flags.FLAGS.is_parsed() and app.PDB_POST_MORTEM.value:
                    raise  # absl's --pdb_post_mortem debugs the exception
                if not is_expected(e, expected):  # a bug: its traceback, as Python prints it
                    end("".join(traceback.format_exception(e)), 1)
                text = f"error: {one_line(e)}\n"
                if os.environ.get(TRACEBACK_ENV, "") not in ("", "0"):
                    text = "".join(traceback.format_exception(e)) + text
                end(text, error_status)

        return call

    console.quiet()
    global _running
    _running = True
    app.run(guarded(main), flags_parser=guarded(flags_parser))


def end(text: str, status: int) -> NoReturn:
    """Writes `text` to stderr and ends the process with `status`, abandoning its other threads
    (pending checkpoint uploads among them: waiting for them is what hangs; a restarted run
    resumes from the last committed checkpoint). What was written to stdout, stderr and absl's
    log is flushed first. Then stderr's descriptor is pointed at /dev/null for everyone else
    before `text` is written: a thread still running cannot print after it, so it ends the
    output."""
    try:
        logging.flush()
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        data = text.encode(sys.stderr.encoding or "utf-8", "backslashreplace")
        stderr = os.dup(2)
        os.dup2(os.open(os.devnull, os.O_WRONLY), 2)
        while data:
            data = data[os.write(stderr, data) :]
    finally:
        os._exit(status)
