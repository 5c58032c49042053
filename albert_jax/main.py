"""Entry point: `python -m albert_jax.main --config=configs/pretrain.py:size=tiny --workdir=DIR`.

Pretrains (`train.train_and_evaluate`), or fine-tunes when the config has a `task` field
(`finetune.finetune_and_evaluate`). Any config field can be overridden with a dotted flag,
e.g. `--config.batch_size=256 --config.model.dtype=bfloat16`; the config is locked, so a
misspelt field fails at once.

Multi-host: `jax.distributed.initialize()` runs only when several processes take part: on TPU
pods (detected from the TPU runtime environment), when `JAX_COORDINATOR_ADDRESS` is set, or with
`--coordinator_address --num_processes --process_id` (e.g. CPU/GPU hosts or a localhost test).
A run stopped by SIGTERM (or a TPU preemption notice) saves a checkpoint and exits 0; starting
the same command again resumes. On a CPU-only host a fine-tuning run keeps the memory XLA frees
after a step for the next (`process_setup.set_up_process`).

A run that cannot go on (a refused config value, an unreadable file, a failed checkpoint, a
diverged loss, a workdir another run holds) ends with one line `error: <message>` on stderr and
exit status 1, without waiting for checkpoint uploads still pending; `ALBERT_TRACEBACK=1` adds
the traceback (`albert_jax.runtime.cli`).
"""

from __future__ import annotations

import sys

from absl import app, flags, logging
from ml_collections import ConfigDict, config_flags

from albert_jax.runtime import cli, process_setup

FLAGS = flags.FLAGS

config_flags.DEFINE_config_file(
    "config",
    None,
    "Config file with an optional arg, e.g. configs/pretrain.py:size=tiny,objective=sop.",
    lock_config=True,
)
flags.DEFINE_string("workdir", None, "Run directory: checkpoints, metrics, tokenizer, config.")
flags.DEFINE_string(
    "coordinator_address", None, "host:port of process 0 for jax.distributed (multi-host only)."
)
flags.DEFINE_integer("num_processes", None, "Number of processes of a multi-host run.")
flags.DEFINE_integer("process_id", None, "This process's index in a multi-host run.")
flags.mark_flags_as_required(["config", "workdir"])


def initialize_distributed() -> bool:
    """`process_setup.initialize_distributed` with this CLI's flags."""
    try:
        return process_setup.initialize_distributed(
            FLAGS.coordinator_address, FLAGS.num_processes, FLAGS.process_id
        )
    except ValueError as e:
        raise app.UsageError(str(e)) from e


def is_fine_tuning(config: ConfigDict) -> bool:
    """configs/finetune.py's configs name a `task`; pretraining's do not."""
    return "task" in config


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    # Before JAX starts its backend.
    host_memory_kept = process_setup.set_up_process(is_fine_tuning(FLAGS.config))
    initialize_distributed()  # TensorFlow: kept off the accelerators where it is first used
    import jax

    if jax.process_count() == 1:
        cli.stop_on_sigterm()  # a SIGTERM while compiling: one line, no crash dump

    config = FLAGS.config
    logging.info(
        "process %d/%d, %d devices (%s), freed host memory kept for the next step: %s",
        jax.process_index(),
        jax.process_count(),
        jax.device_count(),
        jax.devices()[0].device_kind,
        host_memory_kept,
    )
    if is_fine_tuning(config):
        # Fine-tuning lives in its own module (lazy import: pretraining does not need it).
        from albert_jax.finetune import train as finetune

        result = finetune.finetune_and_evaluate(config, FLAGS.workdir)
    else:
        from albert_jax.pretrain import train

        result = train.train_and_evaluate(config, FLAGS.workdir)
    if isinstance(result, dict) and result.get("preempted"):
        logging.warning("stopped by preemption after saving step %s", result.get("step"))
    logging.info("done: %s", result)
    sys.stdout.flush()


def run() -> None:
    """The CLI: `main` under `cli.run` (an error in one line, then an exit that does not wait
    for checkpoint uploads)."""
    cli.run(main)


if __name__ == "__main__":
    run()
