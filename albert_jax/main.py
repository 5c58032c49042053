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
after a step for the next (`set_up_process`).
"""

from __future__ import annotations

import re
import sys

from absl import app, flags, logging
from ml_collections import ConfigDict, config_flags

from albert_jax import process_setup

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


def set_up_process(config: ConfigDict) -> bool:
    """Before JAX starts: a fine-tuning run keeps the memory XLA frees after a step for the
    next (`process_setup.keep_freed_host_memory`, a CPU-only host); returns whether it does.
    Pretraining is left under glibc's defaults: there the setting made the step slower
    although it saved 70% of its page faults (ALBERT-base, 8 x 128, 2-core Xeon: 1.05x, the
    median of 13 pairs of processes run alternately with and without it, slower in 11), while
    it made the base fine-tuning step 1.03x faster (the median of 6 such pairs, faster in 5).
    A host with libtpu (the `[tpu]` extra, for `albert_jax.plan`) but no TPU chip runs on the
    CPU without trying a TPU backend first (`process_setup.skip_absent_tpu`)."""
    process_setup.skip_absent_tpu()
    return is_fine_tuning(config) and process_setup.keep_freed_host_memory()


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    host_memory_kept = set_up_process(FLAGS.config)  # before JAX starts its backend
    initialize_distributed()  # TensorFlow: kept off the accelerators where it is first used
    import jax

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
        from albert_jax import finetune

        result = finetune.finetune_and_evaluate(config, FLAGS.workdir)
    else:
        from albert_jax import train

        result = train.train_and_evaluate(config, FLAGS.workdir)
    if isinstance(result, dict) and result.get("preempted"):
        logging.warning("stopped by preemption after saving step %s", result.get("step"))
    logging.info("done: %s", result)
    sys.stdout.flush()


def parse_flags(argv: list[str]) -> list[str]:
    """absl's flag parsing, with a misspelt `--config.` override reported in one line.

    ml_collections raises a bare AttributeError / KeyError (a traceback) for a field the
    config does not have; this names the override and the closest known field instead.
    """
    try:
        return FLAGS(argv)
    except flags.Error as e:  # absl's own usage errors, reported as absl reports them
        sys.stderr.write(f"FATAL Flags parsing error: {e}\n")
        sys.stderr.write("Pass --helpshort or --helpfull to see help on flags.\n")
        sys.exit(1)
    except (AttributeError, KeyError) as e:
        sys.stderr.write(unknown_override_message(argv, e) + "\n")
        sys.exit(1)


def unknown_override_message(argv: list[str], error: BaseException) -> str:
    """`config: unknown field 'lerning_rate' in --config.lerning_rate=1; did you mean
    'learning_rate'?` from ml_collections' error for an unknown override."""
    text = str(error.args[0]) if error.args else str(error)
    match = re.search(r'Did you mean "([^"]+)" instead of "([^"]+)"', text)
    key = match.group(2) if match else text.strip("'\"").splitlines()[0].strip("'\"")
    flag = next(
        (a for a in argv if a.startswith("--config.") and key in a.split("=")[0].split(".")),
        None,
    )
    where = f" in {flag}" if flag else ""
    hint = f"; did you mean {match.group(1)!r}?" if match else ""
    return f"config: unknown field {key!r}{where}{hint}"


def run() -> None:
    app.run(main, flags_parser=parse_flags)


if __name__ == "__main__":
    run()
