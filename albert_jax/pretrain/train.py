"""ALBERT pretraining, the whole objective in one module: `train_and_evaluate(config, workdir)`
= the one loop (`albert_jax.loop`) + the `Pretraining` objective.

One step (paper Sec. 4.1): a global batch of masked sequence pairs → `AlbertForPreTraining` →
MLM + SOP (or NSP) loss → global-norm clip → LAMB with a per-layer trust ratio → new params.

In the order a run uses them:
- `train_config.validate_config`: the config is checked before anything is built or compiled
  (it also builds the data pipeline's `DataConfig`, once).
- `prepare`: local TFDS sources are built and the tokenizer trained or found (process 0).
- `Pretraining` (this module): what the loop cannot decide itself. Its model half
  (`PretrainingModel`: the model, its init, LAMB, the MLM + SOP loss, the evaluation sums)
  is what `plan`, the benchmarks and `create_train_state` / `make_train_step` compile; the
  rest is the training stream (its position saved in every checkpoint, so restarts are
  bit-exact), a fixed held-out set with its majority baselines, params-only init
  (`init_from`), and the learning curve at the end.
- `loop.Loop`: sharded state, the jitted step, metrics, divergence, saves and resume.

Evaluation (`make_eval_step`, `evaluate_batches`, `eval_metrics`, `majority_accuracies`) is
shared with the analysis CLIs (`albert_jax.analysis`), which measure checkpoints on the same
held-out batches.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import logging
from jax.experimental import multihost_utils
from jax.sharding import Mesh

from albert_jax import checkpointing, files, metrics_writer, optim, train_state
from albert_jax.loop import DebugHooks, Loop
from albert_jax.model import flops, losses
from albert_jax.model.albert import AlbertForPreTraining, init_params
from albert_jax.model.config import ModelConfig
from albert_jax.pretrain.heldout import (
    evaluate_batches,
    majority_accuracies,
    make_eval_step,
    model_inputs,
)
from albert_jax.pretrain.prepare import build_sources, prepare_tokenizer
from albert_jax.pretrain.settings import RunLayout, validate_config
from albert_jax.resume import load_params_only
from albert_jax.run_config import config_field
from albert_jax.runtime import compile_cache, workdir_lease
from albert_jax.sharding import create_mesh, forward_per_replica

PyTree = Any


def train_and_evaluate(
    config: Any, workdir: str, make_objective: Callable[..., Pretraining] | None = None
) -> dict[str, Any]:
    """Pretrains ALBERT as `config` says; writes checkpoints, metrics and the tokenizer to
    `workdir` (local or gs://). Returns the metrics of the last logged step (plus `eval_*` of
    the last evaluation) and `preempted` (True when SIGTERM / a preemption notice stopped the
    run after saving; the caller should exit 0 so that a restart resumes). A notice that arrives
    during the last step does not stop anything: that step's save is the final one, and the
    run ends normally (`preempted` False).

    `make_objective(config, workdir, layout, mesh, tokenizer)` builds the objective:
    `Pretraining` by default, a sweep group's several runs (`sweep_group.GroupedPretraining`).

    Raises:
      ValueError: a bad config (before anything is compiled).
      loop.TrainingDivergedError: a non-finite loss, gradient norm or parameter norm.
      workdir_lease.WorkdirInUseError: another run holds `workdir` (WORKDIR/run.lease).
    """
    layout = validate_config(config)
    workdir = files.run_directory(workdir)
    with workdir_lease.hold(workdir) as lease:  # one run per workdir, before it is written
        return _train(config, workdir, layout, lease, make_objective or Pretraining)


def _train(
    config: Any, workdir: str, layout: RunLayout, lease: Any, make_objective: Callable[..., Any]
) -> dict[str, Any]:
    """`train_and_evaluate` once the config is valid and the workdir leased."""
    compile_cache.use_for_run(config_field(config, "compilation_cache_dir", ""), workdir)
    model_config = layout.model_config
    build_sources(config)
    tokenizer = prepare_tokenizer(config, workdir, (config.resume_from, config.init_from))
    if tokenizer.vocab_size != model_config.vocab_size:
        raise ValueError(
            f"config.model.vocab_size={model_config.vocab_size} but the tokenizer "
            f"{workdir}/{checkpointing.TOKENIZER_FILE} has {tokenizer.vocab_size} pieces: set "
            f"--config.model.vocab_size={tokenizer.vocab_size} or use another tokenizer"
        )
    slices = int(config_field(config, "mesh.slices", 0))
    mesh = create_mesh(layout.mesh_shape, devices=layout.devices, slices=slices)
    objective = make_objective(config, workdir, layout, mesh, tokenizer)
    peak = _peak_flops(model_config, mesh)
    debug = DebugHooks.from_config(config)
    loop = Loop(objective, config, workdir, mesh, peak=peak, lease=lease, debug=debug)
    try:
        result = loop.run()
        if not result["preempted"]:
            objective.finish(loop, result)
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


# ----------------------------------------------------------------------------------------------
# The objective: its model half (`PretrainingModel`) and the run around it (`Pretraining`)


class PretrainingModel:
    """The model half of the pretraining objective: `AlbertForPreTraining`, its init, LAMB
    (per-layer trust ratio for stacked weights) and the MLM + SOP loss; what `loop.Loop`
    compiles. `mesh` sizes the init's dummy batch so that it splits over the data axes."""

    num_seeds = 1  # one run per program (seeds in one program are for fine-tuning)

    def __init__(self, config: Any, model: AlbertForPreTraining, mesh: Mesh | None = None):
        self.config, self.model = config, model
        self.init_rows = mesh.shape["data"] * mesh.shape["fsdp"] if mesh is not None else 1
        self.sentence_order = config.objective != "none"
        self.masked_lm = float(config.data.masked_lm_prob) > 0  # else no MLM term, no mlm_*
        self.microbatches = int(config.microbatches)
        self._eval_sums = make_eval_step(config, model)
        if mesh is not None:  # once per batch shard: one gradient reduction per weight
            dtype = config_field(config, "mesh.gradient_reduction_dtype", "float32")
            self._forward = forward_per_replica(self._forward, mesh, dtype)

    def init_variables(self, rng: jax.Array) -> PyTree:
        return init_params(self.model, rng, batch_size=self.init_rows, seq_len=8)["params"]

    def make_optimizer(
        self, boxed_params: PyTree, per_run: Mapping[str, jax.Array] | None = None
    ) -> optax.GradientTransformation:
        # LAMB's trust ratio is per layer for stacked (unshared) weights, read off the axes.
        stacked = optim.stacked_from_logical_axes(boxed_params)
        return optim.make_optimizer(self.config, stacked=stacked, per_run=per_run)

    def loss(self, params: PyTree, batch: Mapping[str, jax.Array], rng: jax.Array):
        outputs = self._forward(params, batch, rng)
        return losses.pretraining_loss(
            outputs, batch, sentence_order=self.sentence_order, masked_lm=self.masked_lm
        )

    def _forward(self, params: PyTree, batch: Mapping[str, jax.Array], rng: jax.Array):
        """{"mlm_logits": [B, P, V], "sop_logits": [B, 2]} of a training batch."""
        outputs = self.model.apply(
            {"params": params},
            *model_inputs(batch),
            deterministic=False,
            return_sequence_output=False,  # last layer only where the heads read
            rngs={"dropout": rng},
        )
        return {k: outputs[k] for k in ("mlm_logits", "sop_logits") if k in outputs}

    def eval_fn(self, params: PyTree, batch: Mapping[str, jax.Array]) -> dict[str, jax.Array]:
        return self._eval_sums(params, batch)


class Pretraining(PretrainingModel):
    """The pretraining objective of `loop.Loop`: the model and loss of `PretrainingModel`, the
    sharded training stream, a fixed held-out set and params-only init. `layout` is what
    `train_config.validate_config` derived from `config`: the model config and the data
    pipeline's settings, built and validated there once."""

    final_eval = False  # evaluation only every `eval_every_steps` (and then at the end)
    task = None  # not a fine-tuning task
    progress_fields = metrics_writer.PRETRAINING_FIELDS
    eval_progress_fields = tuple((label, f"eval_{key}") for label, key in progress_fields)
    eval_reduces = True  # eval_fn returns weighted sums over the batch

    def __init__(self, config: Any, workdir: str, layout: RunLayout, mesh: Mesh, tokenizer: Any):
        model_config = layout.model_config
        super().__init__(config, AlbertForPreTraining(model_config), mesh)
        self.workdir, self.model_config, self.tokenizer = workdir, model_config, tokenizer
        self.data = layout.data
        self.total_steps = int(config.num_train_steps)
        self.global_batch = int(config.batch_size)
        self.eval_every_steps = int(config.eval_every_steps)
        self.flops_per_step = train_step_flops(
            model_config, config.batch_size, config.seq_len, config.max_predictions_per_seq
        )
        self.nan_at = int(config_field(config, "debug.nan_at_step", 0))
        self.iterator: Any = None
        self.eval_batches: list[dict[str, np.ndarray]] = []
        self.placed_eval_batches: list[dict[str, jax.Array]] | None = None  # on the devices
        self.baselines: dict[str, float] = {}

    # ------------------------------------------------------------------------------ starting
    def initial_weights(self, abstract: Mapping[str, Any]) -> dict[str, Any]:
        if not self.config.init_from:
            return {}
        logging.info("params initialized from %s", self.config.init_from)
        return load_params_only(self.config.init_from, abstract)

    def check_resume(self, saved_data: Any, step: int) -> None:
        del saved_data, step  # any data state works: a mismatch recounts the position

    def start(self, step: int, saved_data: Any, meta: Mapping[str, Any] | None) -> None:
        """Builds the training stream at `step` and the held-out set. The number of data
        shards fixes the batches; a resumed run keeps its checkpoint's."""
        from albert_jax.data import pipeline
        from albert_jax.data.data_config import sources_from_spec

        del meta
        config, data, processes = self.config, self.data, jax.process_count()
        doc_sources = sources_from_spec(data.sources, data.data_dir)
        where = dict(process_index=jax.process_index(), process_count=processes)
        self.iterator = pipeline.ShardedIterator.restore(
            data, self.tokenizer, doc_sources, step=step, saved=saved_data, **where
        )
        num_shards = self.iterator.num_shards
        logging.info("data: %d shards, %d per process", num_shards, num_shards // processes)
        if self.eval_every_steps > 0:
            self.eval_batches = list(
                pipeline.EvalBatches(
                    data, self.tokenizer, doc_sources, split=config.data.eval_split,
                    num_batches=config.eval_batches, num_shards=num_shards, **where,
                )
            )  # fmt: skip
            self.baselines = majority_accuracies(self.eval_batches, self.model_config.vocab_size)
            if config.objective == "none":  # no SOP prediction to compare with the baseline
                self.baselines.pop("eval_sop_majority_accuracy", None)
            if "eval_mlm_majority_accuracy" not in self.baselines:
                # (the baselines count every process's tokens: all processes agree)
                logging.warning(
                    "evaluation: split %r of %s has no real token to predict (%d batches of "
                    "padding only); no eval_mlm_* metric and no eval_loss will be recorded",
                    config.data.eval_split, data.sources, len(self.eval_batches),
                )  # fmt: skip

    # ----------------------------------------------------------------------------- per step
    def next_batch(self, step: int) -> dict[str, np.ndarray]:
        batch = next(self.iterator)
        del batch["pair_kind"]  # for evaluation diagnostics: the step never reads it
        if step == self.nan_at:  # debugging hook: NaN weights make the MLM loss NaN
            weights = np.full_like(batch["masked_lm_weights"], np.nan)
            batch = {**batch, "masked_lm_weights": weights}
        return batch

    def data_state(self, step: int) -> Any:
        """The training stream's position: every process's shard states, merged (the
        checkpoint's `data` item is written by process 0 only)."""
        from albert_jax.data.pipeline import merge_states

        del step  # the iterator is at the step being saved
        return merge_states(_every_process(self.iterator.get_state()))

    def meta(self) -> dict[str, Any]:
        return {
            "tokenizer_fingerprint": self.tokenizer.fingerprint,
            "config": json.loads(self.config.to_json_best_effort()),
        }

    def evaluate(self, params: Any, put: Any, eval_step: Any) -> dict[str, float]:
        if self.placed_eval_batches is None:  # the held-out set goes to the devices once
            batches = self.eval_batches
            self.placed_eval_batches = [put(b, self.global_batch) for b in batches]
        metrics = evaluate_batches(eval_step, params, self.placed_eval_batches)
        return {**metrics, **self.baselines}  # only what was measured

    def finish(self, loop: Loop, result: Mapping[str, Any]) -> None:
        """After the last step (not after a preemption): the learning curve of a run that
        trained."""
        del result
        if loop.start_step < self.total_steps and jax.process_index() == 0:
            metrics_writer.plot_learning_curve(self.workdir)

    def close(self) -> None:
        if self.iterator is not None:
            self.iterator.close()


# ----------------------------------------------------------------------------------------------
# What the benchmarks, `plan` and the tests compile: the loop's state and step


def create_train_state(
    config: Any, model: AlbertForPreTraining, mesh: Mesh
) -> tuple[optax.GradientTransformation, Any, Any, Callable[..., Any]]:
    """(optimizer, abstract state, state shardings, initializer) of the pretraining state, as
    the loop creates it (benchmarks and tests compile the same state). Must run under
    `jax.set_mesh(mesh)` and `nn.logical_axis_rules(LOGICAL_AXIS_RULES)`."""
    layout = train_state.create_state(PretrainingModel(config, model, mesh), mesh, int(config.seed))
    return layout.tx, layout.abstract, layout.shardings, layout.initialize


def make_train_step(
    config: Any, model: AlbertForPreTraining, tx: optax.GradientTransformation
) -> Callable:
    """(state, batch) → (state after one LAMB update, scalar metrics): the step the loop runs."""
    objective = PretrainingModel(config, model)
    return train_state.make_step(
        objective.loss, tx, microbatches=objective.microbatches, seed=int(config.seed)
    )


def pretraining_batch_shapes(B: int, S: int, P: int) -> dict[str, tuple[tuple[int, ...], Any]]:
    """{name: (shape, dtype)} of a pretraining batch of B sequences of S tokens with P
    predictions each (the batch contract of the data pipeline)."""
    return {
        "input_ids": ((B, S), jnp.int32),
        "segment_ids": ((B, S), jnp.int32),
        "input_mask": ((B, S), jnp.int32),
        "masked_lm_positions": ((B, P), jnp.int32),
        "masked_lm_ids": ((B, P), jnp.int32),
        "masked_lm_weights": ((B, P), jnp.float32),
        "sentence_order_label": ((B,), jnp.int32),
    }


def train_step_flops(
    model_config: Any, batch_size: int, seq_len: int, max_predictions_per_seq: int
) -> float:
    """Model FLOPs of one `make_train_step` step over the global batch. The step asks for
    `return_sequence_output=False`, so the last layer runs at the 1 + P rows the heads read
    ([CLS] and the masked positions) and is counted there (`albert_jax.model.flops`)."""
    return flops.train_flops_per_step(
        model_config,
        batch_size,
        seq_len,
        max_predictions_per_seq,
        last_layer_positions=1 + max_predictions_per_seq,
    )


def _every_process(value: Any) -> list[Any]:
    """A JSON-able value of every process, in process order (just `[value]` in one process)."""
    if jax.process_count() == 1:
        return [value]
    encoded = np.frombuffer(json.dumps(value).encode(), np.uint8)
    length = int(np.max(multihost_utils.process_allgather(np.int32(len(encoded)))))
    padded = np.zeros(length, np.uint8)
    padded[: len(encoded)] = encoded
    rows = np.asarray(multihost_utils.process_allgather(padded))
    return [json.loads(bytes(row).rstrip(b"\0").decode()) for row in rows]
