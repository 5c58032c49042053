"""Test setup: 8 virtual CPU devices, set before JAX is imported anywhere."""

import os
import sys


def xla_flags(devices: int, optimize: bool = False) -> str:
    """XLA_FLAGS of every test process, this one and the JAX processes the tests start:
    `devices` virtual CPU devices, and LLVM's lowest optimization level for the CPU backend
    unless `optimize`. The tests' models are tiny, so compiling is most of their time: at level
    0 a compile-bound file took 44% less CPU time (test_model -k last_layer, 203 -> 113 s). A
    long run is the other way round: four sentiment_rt seeds, 500 steps on one device, 103 s at
    level 0 and ~65 s optimized (train-step compiles 3.8 -> 8 s, steps 2.2x faster). Processes
    whose results a test compares exactly must share the flags (codegen may round
    differently), hence one place."""
    level = "" if optimize else " --xla_backend_optimization_level=0"
    return f"--xla_force_host_platform_device_count={devices}{level}"


os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + xla_flags(8)).strip()
# TensorFlow is only used for TFDS building and TF1 checkpoints: keep it off any GPU and quiet.
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHARED_DATA = os.environ.get(
    "ALBERT_SHARED_DATA", os.path.join(os.path.dirname(REPO), "shared", "data")
)
if REPO not in sys.path:
    sys.path.insert(0, REPO)

import pathlib  # noqa: E402
from collections.abc import Callable  # noqa: E402

import filelock  # noqa: E402
import jax  # noqa: E402
import pytest  # noqa: E402
from gcs import start as start_gcs_emulator  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)


def session_dir(tmp_path_factory) -> pathlib.Path:
    """The directory every process of this test session shares. pytest-xdist gives each worker
    a base temp of its own (BASE/popen-gwN), so what a session builds once lives in BASE."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def build_once(path: pathlib.Path, build: Callable[[], object], done=None) -> None:
    """Runs `build()` unless `done()` (default: `path` exists), in one process of the session:
    the others wait at a file lock beside `path` and then find it built. The session's data and
    training runs go through this, or each xdist worker would build its own (minutes each).
    `done()` is only asked under the lock: a run half-way may already look finished."""
    done = done or path.exists
    path.parent.mkdir(parents=True, exist_ok=True)
    with filelock.FileLock(f"{path}.lock"):
        if not done():
            build()


def main_command(
    config_arg: str,
    workdir,
    flags: dict,
    devices: int,
    optimize: bool = False,
    runner: tuple[str, ...] = ("-m", "albert_jax.main"),
    **env: str,
) -> tuple[list[str], dict[str, str]]:
    """(argv, environment) of `python -m albert_jax.main --config=CONFIG_ARG --workdir=WORKDIR`
    with `--config.K=V` for each of `flags`, in a process of `devices` CPU devices
    (`xla_flags(devices, optimize)`); `runner` replaces `-m albert_jax.main` (e.g. a `-c`
    wrapper that runs it), `env` adds variables. The one place the tests build that command."""
    argv = [sys.executable, *runner, f"--config={config_arg}", f"--workdir={workdir}"]
    argv += [f"--config.{k}={v}" for k, v in flags.items()]
    xla = {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": xla_flags(devices, optimize)}
    return argv, {**os.environ, **xla, **env}


def run_cli(module: str, *args: str, **env: str):
    """`python -m albert_jax.MODULE ARGS` on the CPU (`env` added to the environment),
    finished: a CompletedProcess with text output."""
    import subprocess

    return subprocess.run(
        [sys.executable, "-m", f"albert_jax.{module}", *args],
        cwd=REPO, env={**os.environ, "JAX_PLATFORMS": "cpu", **env}, capture_output=True,
        text=True, timeout=300,
    )  # fmt: skip


def run_convert(*args: str):
    """`python -m albert_jax.convert ARGS` (`run_cli`)."""
    return run_cli("convert", *args)


def run_main(config, config_arg: str, workdir, devices: int = 1, optimize: bool = False) -> None:
    """`main_command` with a flag for each field where `config` differs from CONFIG_ARG's (e.g.
    "configs/finetune.py:task=sentiment_rt,init=DIR"), run to its end: a run is ~1.8x faster
    a step on one device than SPMD over the tests' 8, and goes through the command users type.
    What a test compares exactly with such a run (predictions) must run the same way;
    in-process runs compare within tolerances."""
    import importlib
    import subprocess

    path, _, arg = config_arg.partition(":")
    module = importlib.import_module(path.removesuffix(".py").replace("/", "."))
    base, wanted = _leaves(module.get_config(arg).to_dict()), _leaves(config.to_dict())
    assert base.keys() == wanted.keys(), set(base) ^ set(wanted)
    flags = {}
    for key, value in wanted.items():
        if value != base[key]:
            if not isinstance(value, str | int | float | bool):
                raise TypeError(f"config.{key}={value!r}: not expressible as a flag here")
            flags[key] = value
    command, env = main_command(config_arg, workdir, flags, devices, optimize)
    proc = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    if proc.returncode:
        raise AssertionError(f"{' '.join(command)} failed:\n{proc.stderr[-4000:]}")


def _leaves(tree: dict, prefix: str = "") -> dict:
    """{"a.b": leaf} of a nested dict. Not `albert_jax.trees.flatten`: a pytree drops None
    fields and splits tuples into elements, neither of which a `--config.a.b` flag can set."""
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(_leaves(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


# A persistent compilation cache for this session only (set before anything compiles; child
# processes such as the notebook kernel and the pytest-xdist workers, started by the controller
# after it imported this file, inherit it): programs that several tests compile
# identically (a fine-tuning run, its resumed restart, an eval-only replay) compile once. A
# fresh directory per session keeps the tests hermetic; a cache set by the caller is kept.
if not os.environ.get("JAX_COMPILATION_CACHE_DIR"):
    import atexit
    import shutil
    import tempfile

    _jax_cache = tempfile.mkdtemp(prefix="albert_jax_test_cache_")
    atexit.register(shutil.rmtree, _jax_cache, True)
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _jax_cache
    jax.config.update("jax_compilation_cache_dir", _jax_cache)


# The files that take minutes (training runs, multi-process jobs), longest first (CI's
# --durations), run before all others: pytest-xdist's loadfile hands files out in collection
# order, two queued per worker, so a long file collected late (test_seeds, test_train) keeps
# one worker busy while the other has run out of files.
LONG_FILES = (
    "test_seeds.py", "test_distributed.py", "test_train.py", "test_sweep.py",
    "test_length_buckets.py",
    "test_distributed_finetune.py", "test_gcs_journey.py", "test_finetune.py",
    "test_mixed_precision.py", "test_resume_safety.py", "test_notebook.py",
)  # fmt: skip


# Files of a minute or more that need not run first: with LONG_FILES, what `-m "not slow"` leaves
# out (each of their tests gets the `slow` marker).
MINUTE_FILES = (
    "test_hf_export.py", "test_serving.py", "test_ship_journey.py", "test_onnx_export.py",
    "test_plan.py", "test_unshare.py",
)  # fmt: skip


def pytest_collection_modifyitems(config, items) -> None:
    """LONG_FILES first, in that order; the other files (and every file's tests) keep theirs.
    The tests of LONG_FILES and MINUTE_FILES are marked `slow`."""
    rank = {name: i for i, name in enumerate(LONG_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))
    for item in items:
        if item.path.name in LONG_FILES or item.path.name in MINUTE_FILES:
            item.add_marker(pytest.mark.slow)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config) -> None:
    """Collect the session's garbage, then freeze what is left out of later collections. pytest
    ends a process with 5 full collections (to report exceptions in finalizers), which on a
    worker's heap (1.6-1.9M objects: TF, torch, JAX) took 1-2 s each; execnet gives a worker
    5 s to end before it sends the worker SIGINT, whose KeyboardInterrupt then landed in
    JAX's gc callback as a PytestUnraisableExceptionWarning. Collecting until a round finds
    nothing (at most 5 rounds, as pytest's own) keeps that check whole (finalizers run while
    pytest's hook still records them); the frozen rest makes pytest's own collections take
    milliseconds."""
    import gc

    for _ in range(5):
        if not gc.collect():
            break
    gc.freeze()


@pytest.fixture(scope="session")
def shared_data() -> str:
    """Path of ../shared/data (real corpora and labelled sets)."""
    if not os.path.isdir(SHARED_DATA):
        pytest.fail(f"shared data not found at {SHARED_DATA}; set ALBERT_SHARED_DATA")
    return SHARED_DATA


@pytest.fixture(scope="session")
def tokenizer(tmp_path_factory, shared_data):
    """A real unigram model (vocab 3000) on Brown + Austen text, trained once per session and
    shared by the data tests (test_heads defines its own, smaller one)."""
    import itertools

    from albert_jax.data import corpus, sentences
    from albert_jax.data.tokenizer import Tokenizer, train_tokenizer

    path = session_dir(tmp_path_factory) / "albert_spm" / "spm"

    def build() -> None:
        texts = []
        for name in ("brown", "austen"):
            docs = corpus.iter_jsonl_documents(
                os.path.join(shared_data, "corpora", f"{name}.jsonl.gz")
            )
            for doc in itertools.islice(docs, 60):
                texts.extend(sentences.split_sentences(doc["text"]))
        train_tokenizer(texts, str(path), vocab_size=3000, max_sentences=15000)

    build_once(path.with_suffix(".model"), build)
    return Tokenizer(str(path) + ".model")


@pytest.fixture(scope="session")
def gcs():
    """A local Cloud Storage emulator (tests/gcs.py) with one bucket, `gcs.bucket`, for the
    whole session; this process's environment points every client at it (tensorstore, gcsfs,
    tf.io.gfile and so TFDS / TensorBoard / epath, array_record) until the session ends.
    `gcs.url(path)` is "gs://bucket/path"; child processes inherit the environment, or get
    `gcs.subprocess_env()`. TF's GCS file system reads its environment once per process, so
    request this fixture before anything in the session touches gs://."""
    emulator = start_gcs_emulator()
    emulator.activate()
    try:
        yield emulator
    finally:
        emulator.stop()


@pytest.fixture(scope="session")
def corpus(tmp_path_factory, shared_data):
    """TFDS data dir with Austen built as `documents/austen`, and a 1000-piece tokenizer: the
    data of the pretraining runs (test_train, test_resume_safety, test_degenerate_runs)."""
    import gzip
    import json

    from albert_jax.data import sentences, sources
    from albert_jax.data.tokenizer import train_tokenizer

    root = session_dir(tmp_path_factory) / "corpus"
    austen = os.path.join(shared_data, "corpora", "austen.jsonl.gz")
    spec = f"documents/austen={austen}"
    data_dir = str(root / "tfds")
    tokenizer = root / "spm.model"  # written last

    def build() -> None:
        sources.build_source(sources.parse_sources(spec)[0], data_dir=data_dir)
        texts = []
        with gzip.open(austen, "rt", encoding="utf-8") as f:
            for line in f:
                texts.extend(sentences.split_sentences(json.loads(line)["text"]))
                if len(texts) > 6000:
                    break
        train_tokenizer(texts, str(root / "spm"), vocab_size=1000, max_sentences=6000)

    build_once(tokenizer, build)
    return {
        "sources": spec,
        "data_dir": data_dir,
        "tokenizer": str(tokenizer),
        "austen": austen,
    }


def local_or_gcs_workdir(where: str, request, tmp_path, name: str) -> tuple[str, dict[str, str]]:
    """A fresh workdir on local disk (`where="local"`) or in the emulator's bucket ("gs", under
    NAME/), and what a subprocess's environment needs to reach it."""
    if where == "gs":
        import time

        gcs = request.getfixturevalue("gcs")
        return gcs.url(f"{name}/{time.monotonic_ns()}"), dict(gcs.env)
    return str(tmp_path / "run"), {}
