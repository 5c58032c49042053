"""ALBERT pretraining: `train_and_evaluate(config, workdir)` = the one loop (`albert_jax.loop`)
+ the pretraining objective, composed of its model half and its data half.

In the order a run uses them:
- `settings.validate_config`: the config is checked before anything is built or compiled, and
  read once into frozen sections (`PretrainingSettings`); nothing after it reads the config.
- `prepare`: local TFDS sources are built and the tokenizer trained or found (process 0).
- `model_half.PretrainingModel`: the model, its init, LAMB, the MLM + SOP loss and the
  evaluation sums; what `plan`, the benchmarks and the loop compile.
- `data_half.PretrainingData`: the training stream (its position saved in every checkpoint,
  so restarts are bit-exact) and a fixed held-out set with its majority baselines (`heldout`,
  shared with the analysis CLIs).
- `loop.Loop`: sharded state, the jitted step, metrics, divergence, saves and resume; then the
  learning curve.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
from absl import logging
from jax.sharding import Mesh

from albert_jax import checkpointing, files, metrics_writer
from albert_jax.loop import Loop, Objective
from albert_jax.model import flops
from albert_jax.model.config import ModelConfig
from albert_jax.pretrain.data_half import PretrainingData
from albert_jax.pretrain.model_half import PretrainingModel
from albert_jax.pretrain.prepare import build_sources, prepare_tokenizer
from albert_jax.pretrain.settings import PretrainingSettings, validate_config
from albert_jax.runtime import compile_cache, workdir_lease


def pretraining(settings: PretrainingSettings, mesh: Mesh, tokenizer: Any) -> Objective:
    """The pretraining objective of a validated run: `PretrainingModel` + `PretrainingData`."""
    return Objective(
        PretrainingModel.from_settings(settings, mesh), PretrainingData(settings, tokenizer)
    )


def train_and_evaluate(
    config: Any, workdir: str, make_objective: Callable[..., Objective] | None = None
) -> dict[str, Any]:
    """Pretrains ALBERT as `config` says; writes checkpoints, metrics and the tokenizer to
    `workdir` (local or gs://). Returns the metrics of the last logged step (plus `eval_*` of
    the last evaluation) and `preempted` (True when SIGTERM / a preemption notice stopped the
    run after saving; the caller should exit 0 so that a restart resumes). A notice that arrives
    during the last step does not stop anything: that step's save is the final one, and the
    run ends normally (`preempted` False).

    `make_objective(settings, mesh, tokenizer)` builds the objective: `pretraining` by default,
    a sweep group's several runs (`sweep.group.grouped_pretraining`). After the last step its
    data half's `finish(loop)`, where it has one, writes what the run leaves besides the
    learning curve (a group: each point's workdir).

    Raises:
      ValueError: a bad config (before anything is compiled).
      loop.TrainingDivergedError: a non-finite loss, gradient norm or parameter norm.
      workdir_lease.WorkdirInUseError: another run holds `workdir` (WORKDIR/run.lease).
    """
    settings = validate_config(config)
    workdir = files.run_directory(workdir)
    with workdir_lease.hold(workdir) as lease:  # one run per workdir, before it is written
        return _train(settings, workdir, lease, make_objective or pretraining)


def _train(
    settings: PretrainingSettings, workdir: str, lease: Any, make_objective: Callable[..., Any]
) -> dict[str, Any]:
    """`train_and_evaluate` once the config is valid and the workdir leased."""
    compile_cache.use_for_run(settings.loop.compilation_cache_dir, workdir)
    model_config = settings.model_config
    build_sources(settings.prepare)
    source_runs = (settings.loop.resume_from, settings.loop.init_from)
    tokenizer = prepare_tokenizer(settings.prepare, workdir, source_runs)
    if tokenizer.vocab_size != model_config.vocab_size:
        raise ValueError(
            f"config.model.vocab_size={model_config.vocab_size} but the tokenizer "
            f"{workdir}/{checkpointing.TOKENIZER_FILE} has {tokenizer.vocab_size} pieces: set "
            f"--config.model.vocab_size={tokenizer.vocab_size} or use another tokenizer"
        )
    mesh = settings.mesh.create()
    objective = make_objective(settings, mesh, tokenizer)
    peak = _peak_flops(model_config, mesh)
    loop = Loop(objective, settings.loop, workdir, mesh, peak=peak, lease=lease)
    try:
        result = loop.run()
        if not result["preempted"]:
            finish = getattr(objective.data, "finish", None)
            if finish is not None:  # a sweep group's points
                finish(loop)
            if loop.start_step < objective.data.total_steps and jax.process_index() == 0:
                metrics_writer.plot_learning_curve(workdir)  # of a run that trained
    finally:
        loop.close()
    return result


def _peak_flops(model_config: ModelConfig, mesh: Mesh) -> tuple[float | None, int]:
    """(peak FLOP/s of one chip or None if unknown, number of chips that share the work)."""
    device = mesh.devices.flat[0]
    dtype = "bfloat16" if model_config.dtype == "bfloat16" else "float32"
    if device.platform == "cpu" and jax.process_count() > 1:
        # The CPU peak is a matmul timed on one local device, which the global mesh of a
        # multi-process job does not allow; such jobs are tests of the multi-host code.
        logging.info("no MFU: several CPU processes")
        return None, 0
    try:
        peak = flops.device_peak_flops(device, dtype)
    except ValueError as e:
        logging.warning("no MFU: %s", e)
        return None, 0
    # Virtual CPU devices of one process share the same cores: the host is the "chip".
    chips = jax.process_count() if device.platform == "cpu" else mesh.size
    return peak, chips
