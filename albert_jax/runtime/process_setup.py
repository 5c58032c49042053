"""Process-wide setup: joining the other processes of a multi-host run (what every entry point
does first, before a config is read), keeping TensorFlow off the accelerators, and on a CPU
host keeping the memory XLA frees after a step for the next one. TensorFlow
only reads data (TFDS) and writes TensorBoard files here; the TFDS readers and the metrics
writer hide the accelerators from it just before its first use, so a process that uses neither
(an evaluation-only script, a notebook reading checkpoints) never imports it. No flags here, so
that each CLI (main, glue_table) imports it beside its own."""

from __future__ import annotations

import contextlib
import ctypes
import glob
import importlib.metadata
import importlib.util
import os
import re
import sys


def tpu_pod_environment() -> bool:
    """True on a multi-host TPU slice (the TPU runtime lists more than one worker)."""
    hostnames = os.environ.get("TPU_WORKER_HOSTNAMES", "")
    return len([h for h in hostnames.split(",") if h.strip()]) > 1 or bool(
        os.environ.get("MEGASCALE_COORDINATOR_ADDRESS")
    )


def initialize_distributed(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
) -> bool:
    """Calls `jax.distributed.initialize` when several processes take part (the three
    arguments given, JAX_COORDINATOR_ADDRESS set, or a TPU pod); returns whether it did.
    Single-host runs skip it (it would only add a coordinator to wait for).

    Raises:
      ValueError: some but not all of the three arguments given.
    """
    import jax

    given = (coordinator_address, num_processes, process_id)
    if coordinator_address or num_processes or process_id is not None:
        if None in given:
            raise ValueError("--coordinator_address, --num_processes and --process_id go together")
        jax.distributed.initialize(coordinator_address, num_processes, process_id)
        return True
    if os.environ.get("JAX_COORDINATOR_ADDRESS") or tpu_pod_environment():
        jax.distributed.initialize()  # arguments come from the environment / TPU metadata
        return True
    return False


def hide_accelerators_from_tensorflow() -> None:
    """TensorFlow only reads data here (TFDS); it must not grab GPU memory that JAX needs.
    Imports TensorFlow (when installed): called right where TFDS is about to run it (building
    a dataset, reading TFRecord or a catalog dataset), so a process that reads only prepared
    ArrayRecord data, as a pretraining run on local disk does, never pays the ~6 s import."""
    from albert_jax.runtime import console

    # Its C++ notices come as it loads: only the first call needs them caught.
    loading = "tensorflow" not in sys.modules
    with console.tensorflow_notices_dropped() if loading else contextlib.nullcontext():
        try:
            import tensorflow as tf
        except ImportError:
            return
        try:
            tf.config.set_visible_devices([], "GPU")
            tf.config.set_visible_devices([], "TPU")
        except (RuntimeError, ValueError):  # already initialized, or no such device type
            pass


# glibc's mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD, _M_MMAP_MAX, _M_ARENA_MAX = -1, -4, -8


def jax_has_cpu_only() -> bool:
    """True when JAX can only start its CPU backend: JAX_PLATFORMS=cpu, or no accelerator
    runtime installed (no libtpu, no PJRT plugin under `jax_plugins`). Answered without
    starting a backend, which `keep_freed_host_memory` must run before."""
    platforms = os.environ.get("JAX_PLATFORMS", "")
    if platforms:
        return platforms.strip().lower() == "cpu"
    if tpu_runtime_usable():
        return False
    if importlib.metadata.entry_points(group="jax_plugins"):
        return False
    namespace = importlib.util.find_spec("jax_plugins")
    return namespace is None or not any(
        os.listdir(path) for path in namespace.submodule_search_locations or ()
    )


def tpu_runtime_usable() -> bool:
    """True when JAX could start a TPU backend here: the TPU runtime (libtpu) is installed
    and this host has TPU chips (`/dev/accel*` on v2-v4 / v5e, `/dev/vfio/<n>` on v5p / v6e).
    libtpu alone is the `[tpu]` extra of a CPU machine that compiles for TPU slices
    (`albert_jax.plan`): it must not turn that machine's CPU runs into accelerator runs."""
    if not (os.environ.get("TPU_LIBRARY_PATH") or importlib.util.find_spec("libtpu")):
        return False
    return bool(glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*"))


def skip_absent_tpu() -> None:
    """JAX_PLATFORMS=cpu when libtpu is installed but this host has no TPU chip and no other
    accelerator plugin, so that JAX does not try (and log that it failed) to start a TPU
    backend; set before JAX starts one. Left alone when JAX_PLATFORMS is set."""
    if os.environ.get("JAX_PLATFORMS") or importlib.util.find_spec("libtpu") is None:
        return
    if jax_has_cpu_only():  # no TPU chip here (`tpu_runtime_usable`), no other plugin
        os.environ["JAX_PLATFORMS"] = "cpu"
        if "jax" in sys.modules:  # JAX read the variable when it was imported (a config file)
            sys.modules["jax"].config.update("jax_platforms", "cpu")


def cpu_device_count() -> int:
    """The CPU devices JAX will make, from the environment (`JAX_NUM_CPU_DEVICES`, or XLA's
    `--xla_force_host_platform_device_count`), without starting a backend."""
    count = os.environ.get("JAX_NUM_CPU_DEVICES", "")
    if count.strip().isdigit():
        return int(count)
    forced = re.findall(
        r"--xla_force_host_platform_device_count=(\d+)", os.environ.get("XLA_FLAGS", "")
    )
    return int(forced[-1]) if forced else 1


def glibc() -> ctypes.CDLL | None:
    """The process's C library when it is glibc (whose `mallopt` parameters the setting below
    uses); None for other C libraries (musl, macOS)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return None
    return libc if hasattr(libc, "gnu_get_libc_version") else None


def keep_freed_host_memory() -> bool:
    """On a CPU-only host with glibc, makes the memory XLA frees at the end of a step serve
    the next step instead of going back to the system; returns whether it did.

    XLA:CPU allocates an execution's temporaries as one block (1.1 GB for an ALBERT-base
    fine-tuning step on 32 sentences) and frees it when the step ends. glibc maps a block
    that large on its own and unmaps it on free, so each step faulted every page in again:
    273k page faults a step, 0.1-0.3 s of its 2.3-2.6 s on the 2-core Xeon (strace: one mmap
    and munmap of the block per step). With one malloc arena, no mmap'd blocks and no
    trimming of the heap's top, the block comes from the heap and stays there: 0 faults.

    Must run before JAX starts its CPU backend: a thread keeps the arena of its first
    allocation, and an arena of XLA's own threads (what glibc gives a second thread) cannot
    hold a block over 64 MiB, so glibc maps it anyway. One arena only on a CPU-only host: a
    TPU or GPU host's input pipeline runs many allocating threads, which one arena would
    serialize; and on one CPU device only: several run their executions on many threads at
    once, which one arena would serialize too, and that case was not measured. Other C libraries
    (musl, macOS) and a preloaded tcmalloc / jemalloc are left as they are. `albert_jax.main`
    calls it for fine-tuning runs only (`set_up_process`: it slowed the pretraining step).
    """
    if not jax_has_cpu_only() or cpu_device_count() > 1:
        return False
    libc = glibc()
    if libc is None:
        return False
    settings = ((_M_ARENA_MAX, 1), (_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, -1))
    return all(libc.mallopt(parameter, value) == 1 for parameter, value in settings)


def set_up_process(fine_tuning: bool) -> bool:
    """Before JAX starts: a fine-tuning run keeps the memory XLA frees after a step for the
    next (`keep_freed_host_memory`, a CPU-only host); returns whether it does. Pretraining is
    left under glibc's defaults: there the setting made the step slower although it saved most
    of its page faults, while it made the fine-tuning step faster (docs/benchmarks.md,
    "Figures behind constants"). (A host with
    libtpu but no TPU chip is kept off a TPU backend by every command's `console.quiet`.)
    `albert_jax.main` calls it once its flags are read.
    """
    return fine_tuning and keep_freed_host_memory()
