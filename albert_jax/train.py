"""ALBERT pretraining loop: `train_and_evaluate(config, workdir)`.

One step (paper Sec. 4.1): a global batch of masked sequence pairs → `AlbertForPreTraining` →
MLM + SOP (or NSP) loss → global-norm clip → LAMB with a per-layer trust ratio → new params.

How the pieces fit (one module each, in the order a run uses them):
- `train_config.validate_config`: the config is checked before anything is built or compiled.
- `prepare`: local TFDS sources are built and the tokenizer trained or found (process 0).
- `train_step.create_train_state`: parameters and optimizer state are created directly in
  their sharded layout: `eval_shape` gives the boxed abstract params, their logical axes map to
  mesh shardings through `LOGICAL_AXIS_RULES`, and `jax.jit(init, out_shardings=...)`
  materializes each shard on its device (no host or single-device copy of the model exists).
- `train_step.make_train_step`: one `jax.jit` with explicit in/out shardings, state donated.
- `resume`: params-only init from another model and the data pipeline's saved position.
- This module, the loop:
- Metrics are fetched one step late: the host dispatches step s+1 before it waits for the
  numbers of step s, so the device never idles on Python. A non-finite loss, gradient norm or
  parameter norm stops the run; checkpoints are only written for states already checked finite.
- `jax.transfer_guard("disallow")` around the loop turns any implicit host↔device copy (a
  silent slowdown) into an error; batches are put on devices explicitly.
- Restarts are bit-exact: params, optimizer state and the input-pipeline position are restored,
  and randomness is `fold_in(key, step)`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import signal
import time
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from absl import logging
from etils import epath
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from albert_jax import checkpointing, flops, metrics_writer
from albert_jax.config import ModelConfig, model_config_from
from albert_jax.model import AlbertForPreTraining
from albert_jax.prepare import build_sources, prepare_tokenizer
from albert_jax.resume import (
    data_state_for_save,
    load_params_only,
    positioned_iterator,
    resolve_num_shards,
    saved_num_shards,
)
from albert_jax.sharding import LOGICAL_AXIS_RULES, batch_sharding, create_mesh
from albert_jax.train_config import config_field, validate_config
from albert_jax.train_step import (
    TrainState,
    create_train_state,
    eval_metrics,
    majority_accuracies,
    make_eval_step,
    make_train_step,
    put_batch,
    train_step_flops,
)

PyTree = Any

# The loop's building blocks live in train_config / prepare / train_step / resume; these names
# are re-exported because users and tools import them from here.
__all__ = [
    "TrainState",
    "TrainingDivergedError",
    "create_train_state",
    "majority_accuracies",
    "make_eval_step",
    "make_train_step",
    "model_config_from",
    "prepare_tokenizer",
    "train_and_evaluate",
    "train_step_flops",
    "validate_config",
]


class TrainingDivergedError(FloatingPointError):
    """A non-finite loss, gradient norm or parameter norm; names the step and last checkpoint."""


@dataclasses.dataclass
class _Pending:
    """Metrics of a dispatched step, fetched one step later."""

    step: int
    metrics: dict[str, jax.Array]
    eval: dict[str, float] | None = None


def train_and_evaluate(config: Any, workdir: str) -> dict[str, Any]:
    """Pretrains ALBERT as `config` says; writes checkpoints, metrics and the tokenizer to
    `workdir`. Returns the metrics of the last logged step (plus `eval_*` of the last
    evaluation) and `preempted` (True when SIGTERM / a preemption notice stopped the run after
    saving; the caller should exit 0 so that a restart resumes). A notice that arrives during
    the last step does not stop anything: that step's save is the final one, and the run ends
    normally (`preempted` False).

    Raises:
      ValueError: a bad config (before anything is compiled).
      TrainingDivergedError: a non-finite loss, gradient norm or parameter norm.
    """
    layout = validate_config(config)
    model_config = layout.model_config
    workdir = checkpointing.absolute(workdir)
    if jax.process_index() == 0:
        epath.Path(workdir).mkdir(parents=True, exist_ok=True)
        (epath.Path(workdir) / "config.json").write_text(
            config.to_json_best_effort(indent=2, sort_keys=True) + "\n"
        )

    plan = checkpointing.plan_resume(workdir, config.resume_from, config.init_from)
    logging.info("start: %s", plan)
    build_sources(config)
    tokenizer = prepare_tokenizer(config, workdir, (config.resume_from, config.init_from))
    if tokenizer.vocab_size != model_config.vocab_size:
        raise ValueError(
            f"config.model.vocab_size={model_config.vocab_size} but the tokenizer "
            f"{workdir}/{checkpointing.TOKENIZER_FILE} has {tokenizer.vocab_size} pieces: set "
            f"--config.model.vocab_size={tokenizer.vocab_size} or use another tokenizer"
        )
    mesh = create_mesh(layout.mesh_shape, devices=layout.devices)
    with jax.set_mesh(mesh), nn.logical_axis_rules(LOGICAL_AXIS_RULES):
        return _run(config, workdir, model_config, mesh, tokenizer, plan)


def _run(
    config: Any,
    workdir: str,
    model_config: ModelConfig,
    mesh: Mesh,
    tokenizer: Any,
    plan: checkpointing.ResumePlan,
) -> dict[str, Any]:
    trainer = _Trainer(config, workdir, model_config, mesh, tokenizer, plan)
    try:
        return trainer.run()
    finally:
        trainer.close()


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


class _Trainer:
    """One run: state, compiled functions, data, checkpoints and metrics, between steps.

    Built and run under `jax.set_mesh(mesh)` and `nn.logical_axis_rules(LOGICAL_AXIS_RULES)`.
    """

    LOG_KEYS = ("loss", "mlm_loss", "sop_loss", "mlm_accuracy", "sop_accuracy",
                "learning_rate", "grad_norm", "param_norm")  # fmt: skip

    def __init__(
        self,
        config: Any,
        workdir: str,
        model_config: ModelConfig,
        mesh: Mesh,
        tokenizer: Any,
        plan: checkpointing.ResumePlan,
    ):
        from albert_jax.data import pipeline

        self.config, self.workdir, self.model_config = config, workdir, model_config
        self.total_steps = config.num_train_steps
        model = AlbertForPreTraining(model_config)
        self.tx, self.abstract, self.shardings, self._initialize = create_train_state(
            config, model, mesh
        )
        self.batch_sharding = batch_sharding(mesh)
        self.replicated = NamedSharding(mesh, PartitionSpec())
        self.tokenizer_fingerprint = tokenizer.fingerprint

        self.checkpointer = checkpointing.Checkpointer(
            workdir, every_steps=config.checkpoint_every_steps, keep=config.keep_checkpoints
        )

        # --- data: training stream and a fixed held-out set (already on the devices). The
        # number of data shards fixes the batches; a resumed run keeps its checkpoint's.
        processes = jax.process_count()
        data_cfg = pipeline.DataConfig.from_config(config)
        num_shards = resolve_num_shards(
            data_cfg.num_shards, saved_num_shards(self._saved_data_state(plan)), processes
        )
        data_cfg = dataclasses.replace(data_cfg, num_shards=num_shards)
        data_cfg.validate(processes)
        logging.info("data: %d shards, %d per process", num_shards, num_shards // processes)
        doc_sources = pipeline.sources_from_spec(data_cfg.sources, data_cfg.data_dir)
        where = dict(process_index=jax.process_index(), process_count=processes)
        self._make_iterator = lambda start_step: pipeline.ShardedIterator(
            data_cfg, tokenizer, doc_sources, split="train", start_step=start_step, **where
        )
        self.eval_batches: list[dict[str, jax.Array]] = []
        self.baselines: dict[str, float] = {}
        if config.eval_every_steps > 0:
            held_out = list(
                pipeline.make_eval_iterator(
                    data_cfg, tokenizer, split=config.data.eval_split,
                    num_batches=config.eval_batches, sources=doc_sources, **where,
                )
            )  # fmt: skip
            self.baselines = majority_accuracies(held_out, model_config.vocab_size)
            self.eval_batches = [
                put_batch(b, self.batch_sharding, config.batch_size) for b in held_out
            ]

        # --- metrics and the starting state
        self.writer = metrics_writer.MetricsWriter(workdir, enabled=jax.process_index() == 0)
        self.iterator: Any = None
        self.state, self.start_step = self._restore_or_initialize(plan)

        # --- the compiled step and evaluation
        self.train_step = jax.jit(
            make_train_step(config, model, self.tx),
            in_shardings=(self.shardings, self.batch_sharding),
            out_shardings=(self.shardings, self.replicated),
            donate_argnums=0,
        )
        self.eval_step = jax.jit(
            make_eval_step(config, model),
            in_shardings=(self.shardings.params, self.batch_sharding),
            out_shardings=self.replicated,
        )

        # --- throughput bookkeeping
        self.flops_per_step = train_step_flops(
            model_config, config.batch_size, config.seq_len, config.max_predictions_per_seq
        )
        self.peak, self.chips = _peak_flops(model_config, mesh)
        self._interval: tuple[int, float] | None = None  # (step, time) where it started
        self._excluded = 0.0  # seconds of eval / checkpointing inside the interval
        self._last_record: dict[str, Any] = {}

    # ------------------------------------------------------------------------------ starting
    def _saved_data_state(self, plan: checkpointing.ResumePlan) -> Any:
        """The `data` item of the checkpoint the run resumes from (None without one)."""
        if plan.kind == "workdir" and plan.step is not None:
            return self.checkpointer.read_json(plan.step, "data")
        if plan.kind == "resume_from" and plan.step is not None and plan.path:
            with checkpointing.Checkpointer(plan.path, read_only=True) as other:
                return other.read_json(plan.step, "data")
        return None

    def _restore_or_initialize(self, plan: checkpointing.ResumePlan) -> tuple[TrainState, int]:
        if plan.kind == "init_from":
            params = load_params_only(plan.path or "", self.abstract.params, self.shardings.params)
            self.writer.rewind(0)
            self.iterator = self._make_iterator(0)
            logging.info("params initialized from %s", plan.path)
            return self._initialize(params), 0
        if plan.kind == "scratch":
            self.writer.rewind(0)  # lines of an earlier attempt that never checkpointed
            self.iterator = self._make_iterator(0)
            return self._initialize(), 0
        targets = (
            checkpointing.abstract_like(self.abstract.params, self.shardings.params),
            checkpointing.abstract_like(self.abstract.opt_state, self.shardings.opt_state),
        )
        assert plan.step is not None and plan.path is not None
        if plan.kind == "workdir":
            restored = self.checkpointer.restore(plan.step, *targets)
        else:  # resume_from: another run's full state; we go on saving into our workdir
            with checkpointing.Checkpointer(plan.path, read_only=True) as other:
                restored = other.restore(plan.step, *targets)
        state = TrainState(
            step=jax.device_put(np.int32(restored.step), self.replicated),
            params=restored.params,
            opt_state=restored.opt_state,
        )
        self.iterator = positioned_iterator(self._make_iterator, restored.data, restored.step)
        dropped = self.writer.rewind(restored.step)
        logging.info("resumed at step %d from %s (%s); dropped %d stale metric lines",
                     restored.step, plan.path, plan.kind, dropped)  # fmt: skip
        return state, restored.step

    # ----------------------------------------------------------------------------------- loop
    def run(self) -> dict[str, Any]:
        config, total = self.config, self.total_steps
        sigterm_after = int(config_field(config, "debug.sigterm_after_step", 0))
        sigkill_after_save = int(config_field(config, "debug.sigkill_after_save_at_step", 0))
        nan_at = int(config_field(config, "debug.nan_at_step", 0))
        single_process = jax.process_count() == 1
        if self.start_step >= total:
            logging.info("nothing to do: step %d >= num_train_steps %d", self.start_step, total)
            records = metrics_writer.read_metrics(self.workdir)
            return {**(records[-1] if records else {}), "step": self.start_step,
                    "preempted": False}  # fmt: skip

        preempted = False
        pending: _Pending | None = None
        signal_flag = checkpointing.PreemptionSignal() if single_process else None
        logging.info("training steps %d..%d", self.start_step + 1, total)
        with signal_flag or contextlib.nullcontext(), jax.transfer_guard("disallow"):
            for step in range(self.start_step + 1, total + 1):  # `step` = updates done after it
                host_batch = next(self.iterator)
                if step == nan_at:  # debugging hook: NaN weights make the MLM loss NaN
                    weights = np.full_like(host_batch["masked_lm_weights"], np.nan)
                    host_batch = {**host_batch, "masked_lm_weights": weights}
                batch = put_batch(host_batch, self.batch_sharding, config.batch_size)
                self.state, metrics = self.train_step(self.state, batch)
                # Step `step` is queued; only now wait for the numbers of the one before.
                if pending is not None:
                    self._finish(pending)
                pending = _Pending(step, metrics)
                if self._eval_due(step):
                    pending.eval = self._evaluate()
                if step == sigterm_after:
                    checkpointing.send_preemption_notice()
                preempted = signal_flag is not None and signal_flag.requested
                if preempted or step == total or self.checkpointer.should_save(step):
                    self._finish(pending)  # never checkpoint a state not checked finite
                    pending = None
                    self._save(step, force=preempted or step == total)
                    if step == sigkill_after_save:
                        os.kill(os.getpid(), signal.SIGKILL)
                if not single_process and self.checkpointer.reached_preemption(step):
                    preempted = True
                if preempted:
                    if step < total:
                        logging.warning("preempted: checkpoint of step %d saved, exiting", step)
                        break
                    preempted = False  # the last step: its save is the final one; finish normally
            if pending is not None:
                self._finish(pending)
        self.checkpointer.wait()
        if not preempted and jax.process_index() == 0:
            metrics_writer.plot_learning_curve(self.workdir)
        return {**self._last_record, "step": step, "preempted": preempted,
                "checkpoint_step": self.checkpointer.latest_step()}  # fmt: skip

    def _eval_due(self, step: int) -> bool:
        every = self.config.eval_every_steps
        return bool(every) and (step % every == 0 or step == self.total_steps)

    def _evaluate(self) -> dict[str, float]:
        jax.block_until_ready(self.state.params)  # the training step is not eval time
        start = time.perf_counter()
        sums: dict[str, jax.Array] | None = None
        for batch in self.eval_batches:
            out = self.eval_step(self.state.params, batch)
            sums = out if sums is None else jax.tree.map(jnp.add, sums, out)
        values = {k: float(v) for k, v in jax.device_get(sums).items()}
        self._excluded += time.perf_counter() - start
        return {**eval_metrics(values), **self.baselines}

    def _save(self, step: int, force: bool) -> None:
        start = time.perf_counter()
        meta = {
            "model_config": self.model_config.to_dict(),
            "step": step,
            "tokenizer_fingerprint": self.tokenizer_fingerprint,
            "config": json.loads(self.config.to_json_best_effort()),
        }
        # Gathering the per-process data states is an explicit, rare transfer.
        with jax.transfer_guard("allow"):
            self.checkpointer.save(
                step,
                params=self.state.params,
                opt_state=self.state.opt_state,
                data=data_state_for_save(self.iterator),
                meta=meta,
                force=force,
            )
        self._excluded += time.perf_counter() - start

    def _finish(self, pending: _Pending) -> None:
        """Fetches a step's metrics, stops on non-finite values, logs on log steps."""
        values = {k: float(v) for k, v in jax.device_get(pending.metrics).items()}
        bad = [k for k in ("loss", "grad_norm", "param_norm") if not math.isfinite(values[k])]
        if bad:
            self._diverged(pending.step, values, bad)
        now = time.perf_counter()
        if self._interval is None:  # the first step includes compilation: start timing after it
            self._interval = (pending.step, now)
            self._excluded = 0.0
        is_log_step = pending.step % self.config.log_every_steps == 0
        if not (is_log_step or pending.step == self.total_steps or pending.eval):
            return
        record: dict[str, Any] = {k: values[k] for k in self.LOG_KEYS}
        first_step, first_time = self._interval
        rate = mfu = eta = None
        if pending.step > first_step:
            step_time = max(now - first_time - self._excluded, 1e-9) / (pending.step - first_step)
            rate = self.config.batch_size / step_time
            eta = step_time * (self.total_steps - pending.step)
            if self.peak:
                mfu = flops.mfu(self.flops_per_step, step_time, self.chips, self.peak)
        self._interval, self._excluded = (pending.step, now), 0.0
        record["examples_per_sec"] = rate
        record["mfu"] = mfu
        record.update(pending.eval or {})
        self.writer.write(pending.step, record)
        self._last_record = record
        if jax.process_index() == 0:  # one progress line per step for the whole job
            logging.info(metrics_writer.progress_line(pending.step, self.total_steps, record, eta))

    def _diverged(self, step: int, values: dict[str, float], bad: list[str]) -> None:
        self.checkpointer.wait()  # the last good checkpoint must be committed before we name it
        last = self.checkpointer.latest_step()
        where = (
            f"{self.checkpointer.step_dir(last)} (step {last})"
            if last is not None
            else "none (no checkpoint was saved before it)"
        )
        self.writer.write(step, {k: values[k] for k in self.LOG_KEYS})
        raise TrainingDivergedError(
            f"non-finite {', '.join(bad)} at step {step} (loss={values['loss']}, "
            f"grad_norm={values['grad_norm']}, param_norm={values['param_norm']}); last good "
            f"checkpoint: {where}. Lower config.learning_rate (or check the data) and restart."
        )

    def close(self) -> None:
        if self.iterator is not None:
            self.iterator.close()
        self.checkpointer.close()
        self.writer.close()
