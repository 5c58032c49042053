"""Process-wide setup: joining the other processes of a multi-host run (what every entry point
does first, before a config is read), and keeping TensorFlow off the accelerators. TensorFlow
only reads data (TFDS) and writes TensorBoard files here; the TFDS readers and the metrics
writer hide the accelerators from it just before its first use, so a process that uses neither
(an evaluation-only script, a notebook reading checkpoints) never imports it. No flags here, so
that each CLI (main, glue_table) imports it beside its own."""

from __future__ import annotations

import os


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
    try:
        import tensorflow as tf
    except ImportError:
        return
    try:
        tf.config.set_visible_devices([], "GPU")
        tf.config.set_visible_devices([], "TPU")
    except (RuntimeError, ValueError):  # already initialized, or no such device type
        pass
