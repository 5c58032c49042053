"""THE training loop: pretraining and fine-tuning both run `Loop(objective, ...).run()`.

What the loop owns (one place each):
- State and step (`train_state.py`): parameters and optimizer state created directly in their
  sharded layout; one `jax.jit` of the update with explicit in/out shardings, the state donated.
- Metrics are fetched one step late: the host dispatches step s+1 before it waits for the
  numbers of step s, so the device never idles on Python. One divergence policy: a non-finite
  loss, gradient norm or parameter norm raises `TrainingDivergedError` naming the step and the
  last good checkpoint; checkpoints are only written for states already checked finite.
- Saves: periodic, final and preemption saves (a single process catches SIGTERM itself;
  several agree on the save step through JAX's preemption service, which Orbax reports).
- Resume: this workdir's latest checkpoint → `resume_from` → params-only init → scratch
  (`checkpointing.plan_resume`), refusing a checkpoint of another model and falling back past
  one that does not restore (`resume.restore_newest_intact`); the objective positions its data
  at the restored step. `config.json` is written once every check has accepted the config.
- One metrics writer (process 0), rewound to the restored step.
- `jax.transfer_guard("disallow")` around the steps turns any implicit host↔device copy (a
  silent slowdown) into an error; batches are put on devices explicitly.

An objective is two halves (`Objective`): a model half (`ModelHalf`: init, optimizer, loss,
evaluation function, the weights a fresh run starts from; what `albert_jax.plan` compiles) and
a data half (`DataHalf`: batches and their saved position, the resume check, the evaluation
over its eval set). What the loop reads of the config is its section, `run_config.LoopSettings`.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import json
import math
import time
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import flax.linen as nn
import jax
import numpy as np
import optax
from absl import logging
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from albert_jax import checkpointing, metrics_writer, resume, trees
from albert_jax.model import flops
from albert_jax.run_config import LoopSettings, write_run_config
from albert_jax.runtime import compile_cache, preemption
from albert_jax.sharding import LOGICAL_AXIS_RULES, batch_sharding, put_batch
from albert_jax.train_state import TrainState, create_state, jit_step

PyTree = Any
Batch = Mapping[str, np.ndarray]


class TrainingDivergedError(FloatingPointError):
    """A non-finite loss, gradient norm or parameter norm; names the step and last checkpoint."""


# ----------------------------------------------------------------------------------------------
# What an objective supplies


class ModelHalf(Protocol):
    """The model, its loss and optimizer: what `albert_jax.plan` compiles without any data."""

    model_config: Any  # the `ModelConfig` saved with every checkpoint
    num_seeds: int  # runs in one program (train_state.py: a leading seed axis; 1: none)
    runs: Any  # a sweep group's `train_state.Runs`, or None (`num_seeds` seeds)
    microbatches: int  # gradient accumulation steps per update (1: none)
    flops_per_step: float | None  # model FLOPs of one update (global batch); None: no MFU
    eval_reduces: bool  # eval_fn returns sums over the batch (replicated), not rows
    task: str | None  # the fine-tuning task (saved in `meta` as "task"); None: pretraining
    progress_fields: tuple[tuple[str, str], ...]  # (label, metric key) of the progress line

    def init_variables(self, rng: jax.Array) -> PyTree:
        """The boxed (logical-axis annotated) params tree of a random init."""

    def make_optimizer(self, boxed_params: PyTree) -> optax.GradientTransformation: ...

    def initial_weights(self, abstract: Mapping[str, jax.ShapeDtypeStruct]) -> dict[str, Any]:
        """{"a/b/c": host array} of weights a fresh run starts from (the rest is initialized);
        {} for a random init. Called only when no checkpoint is restored."""

    def restored(self, meta: Mapping[str, Any]) -> None:
        """A checkpoint was restored instead (its `meta`)."""

    def loss(
        self, params: PyTree, batch: Mapping[str, jax.Array], rng: jax.Array
    ) -> tuple[jax.Array, dict[str, jax.Array]]:
        """(scalar loss, scalar metrics incl. "loss") of a training batch; traced in the step."""

    def eval_fn(self, params: PyTree, batch: Mapping[str, jax.Array]) -> dict[str, jax.Array]:
        """Outputs of an eval batch: sums (`eval_reduces`) or per-row arrays [B, ...]."""

    def meta(self) -> dict[str, Any]:
        """JSON saved with every checkpoint (with the data half's, the model config and step)."""


class DataHalf(Protocol):
    """The batches of every step, their saved position and the evaluation over an eval set."""

    total_steps: int  # updates of the run
    global_batch: int  # rows of one training batch over all processes
    final_eval: bool  # evaluate after the last step (at once if nothing is left to train)
    eval_progress_fields: tuple[tuple[str, str], ...]  # (label, key) of evaluation results

    def check_resume(self, saved_data: Any, step: int) -> None:
        """Refuses (ValueError) a checkpoint's data state that this run cannot continue."""

    def start(self, step: int, saved_data: Any, meta: Mapping[str, Any] | None) -> None:
        """Positions the training data after `step` updates (`saved_data` / `meta` of the
        restored checkpoint, None for a fresh run)."""

    def next_batch(self, step: int) -> dict[str, np.ndarray]:
        """This process's rows of the batch of update `step` (1-based) [global_batch / n, ...]."""

    def data_state(self, step: int) -> Any:
        """JSON saved with the checkpoint of `step`: what fixes the batches after it."""

    def meta(self) -> dict[str, Any]:
        """JSON saved with every checkpoint (e.g. the tokenizer's fingerprint)."""

    def evaluate(
        self,
        params: PyTree,
        put: Callable[[Batch, int], dict[str, jax.Array]],
        eval_step: Callable[[PyTree, Mapping[str, jax.Array]], PyTree],
    ) -> dict[str, Any]:
        """Numeric `eval_*` metrics of `params` (logged with the step's record): `put` places
        this process's rows of a batch of N global rows on the mesh, `eval_step` runs the
        model half's `eval_fn` there (outputs stay on the devices)."""

    def close(self) -> None: ...


@dataclasses.dataclass(frozen=True)
class Objective:
    """Pretraining (`pretrain.model_half` + `pretrain.data_half`) or fine-tuning
    (`finetune.task_model` + `finetune.train.FineTuningData`): everything the loop does not
    decide itself."""

    model: ModelHalf
    data: DataHalf

    def meta(self) -> dict[str, Any]:
        return {**self.model.meta(), **self.data.meta()}


# ----------------------------------------------------------------------------------------------
# The loop


@dataclasses.dataclass
class _Pending:
    """Metrics of a dispatched step, fetched one step later."""

    step: int
    metrics: dict[str, jax.Array]
    eval: dict[str, Any] | None = None


class Loop:
    """One run of `objective`: state, compiled functions, checkpoints and metrics.

    Args:
      objective: see `Objective`.
      settings: the loop's section of the run's config (`run_config.LoopSettings`): seed,
        logging, checkpointing, resume_from / init_from, the debug hooks, the config.json.
      workdir: where checkpoints and metrics go (local or gs://).
      mesh: the device mesh; the loop enters it (`jax.set_mesh`) for its whole life.
      peak: (peak FLOP/s of one chip, chips sharing the work) for MFU, or None.
      lease: the run's `workdir_lease` lease (process 0), checked before every save: a run
        whose lease another run took over stops instead of overwriting its checkpoints.
    """

    def __init__(
        self,
        objective: Objective,
        settings: LoopSettings,
        workdir: str,
        mesh: Mesh,
        peak: tuple[float | None, int] | None = None,
        lease: Any = None,
    ):
        self.objective, self.settings, self.workdir, self.mesh = objective, settings, workdir, mesh
        self.model, self.data = objective.model, objective.data
        self.lease = lease
        self.total = objective.data.total_steps
        self.peak, self.chips = peak or (None, 0)
        # Everything the run opens is closed in reverse order by `close()`, or right here
        # when starting fails (a refused resume must not leave the mesh set in the process).
        self._stack = contextlib.ExitStack()
        try:
            self._start(settings, workdir, mesh)
        except BaseException:
            self._stack.close()
            raise

    def _start(self, settings: LoopSettings, workdir: str, mesh: Mesh) -> None:
        model = self.model
        self._stack.callback(self.data.close)
        self._stack.enter_context(jax.set_mesh(mesh))
        self._stack.enter_context(nn.logical_axis_rules(LOGICAL_AXIS_RULES))
        self.batch_sharding = batch_sharding(mesh)
        self.replicated = NamedSharding(mesh, PartitionSpec())
        self.layout = create_state(model, mesh, settings.seed, model.num_seeds)
        every = settings.checkpoint_every_steps or max(self.total, 1)
        self.checkpointer = checkpointing.Checkpointer(
            workdir, every_steps=every, keep=settings.keep_checkpoints
        )
        self._stack.callback(self.checkpointer.close)
        self.writer = metrics_writer.MetricsWriter(workdir, enabled=jax.process_index() == 0)
        self._stack.callback(self.writer.close)
        shardings = self.layout.shardings
        self.train_step = jit_step(model, self.layout, mesh, settings.seed)
        self._eval_step = jax.jit(
            model.eval_fn,
            in_shardings=(shardings.params, self.batch_sharding),
            out_shardings=self.replicated if model.eval_reduces else self.batch_sharding,
        )
        self._eval_in_flight: collections.deque[PyTree] = collections.deque()  # `eval_step`
        self._clock = compile_cache.CompileClock.get()
        self._compiled_before = (self._clock.seconds, self._clock.programs, self._clock.hits)
        self._config = json.loads(settings.config_json)  # saved in every checkpoint's meta
        self.state, self.start_step = self._restore_or_initialize()
        # Only a run whose config passed every check (the objective's, the resume's) records
        # it: a refused restart keeps the config.json of the run it would have continued.
        write_run_config(settings.config_json, workdir)
        self._interval: tuple[int, float] | None = None  # (step, time) where it started
        self._excluded = 0.0  # seconds of evaluation / checkpointing inside the interval
        self.last_record: dict[str, Any] = {}

    # ------------------------------------------------------------------------------ starting
    def _restore_or_initialize(self) -> tuple[TrainState, int]:
        settings, model, data, layout = self.settings, self.model, self.data, self.layout
        plan = checkpointing.plan_resume(self.workdir, settings.resume_from, settings.init_from)
        if plan.path is None:
            logging.info("start: from scratch")
        else:
            at = "" if plan.step is None else f" at step {plan.step}"
            logging.info("start: %s %s%s", plan.kind, plan.path, at)
        if plan.step is None:  # init_from / scratch: the objective's weights, the rest fresh
            state = layout.initialize(model.initial_weights(trees.flatten(layout.abstract.params)))
            data.start(0, None, None)
            self.writer.rewind(0)  # lines of an earlier attempt that never checkpointed
            return state, 0
        assert plan.path is not None
        with contextlib.ExitStack() as stack:
            source = self.checkpointer
            if plan.kind == "resume_from":  # another run's full state; we save into ours
                source = stack.enter_context(checkpointing.Checkpointer(plan.path, read_only=True))
            restored = resume.restore_newest_intact(
                source,
                plan.step,
                checkpointing.abstract_like(layout.abstract.params, layout.shardings.params),
                checkpointing.abstract_like(layout.abstract.opt_state, layout.shardings.opt_state),
                check=lambda step, saved, meta: resume.check_resumable(
                    self.objective, self.settings, plan.path, step, saved, meta
                ),
                strict=settings.resume_strict,
                prune=plan.kind == "workdir",
            )
        state = TrainState(
            step=jax.device_put(np.int32(restored.step), self.replicated),
            params=restored.params,
            opt_state=restored.opt_state,
        )
        model.restored(restored.meta)
        data.start(restored.step, restored.data, restored.meta)
        dropped = self.writer.rewind(restored.step)
        logging.info("resumed at step %d from %s (%s); dropped %d stale metric lines",
                     restored.step, plan.path, plan.kind, dropped)  # fmt: skip
        return state, restored.step

    # --------------------------------------------------------------------------- evaluation
    def put(self, local_batch: Batch, global_batch: int) -> dict[str, jax.Array]:
        """This process's rows of a batch → global arrays [global_batch, ...] on the mesh."""
        return put_batch(local_batch, self.batch_sharding, global_batch)

    def eval_step(self, params: PyTree, batch: Mapping[str, jax.Array]) -> PyTree:
        """The objective's `eval_fn` on a batch placed by `put`; outputs stay on the devices.
        At most two run at a time, as the training steps (see `run`: a deep queue of
        multi-device programs can starve XLA:CPU's rendezvous until it aborts the process)."""
        out = self._eval_step(params, batch)
        self._eval_in_flight.append(out)
        if len(self._eval_in_flight) > 2:
            jax.block_until_ready(self._eval_in_flight.popleft())
        return out

    def _evaluate(self, params: PyTree) -> dict[str, Any]:
        jax.block_until_ready(params)  # the training step is not evaluation time
        start = time.perf_counter()
        with jax.transfer_guard("allow"):  # evaluation gathers outputs on the host
            metrics = self.data.evaluate(params, self.put, self.eval_step)
        self._eval_in_flight.clear()
        self._excluded += time.perf_counter() - start
        return metrics

    def _eval_due(self, step: int) -> bool:
        every = self.settings.eval_every_steps
        if every and step % every == 0:
            return True
        return step == self.total and (bool(every) or self.data.final_eval)

    # ----------------------------------------------------------------------------------- run
    def run(self) -> dict[str, Any]:
        """Trains from the restored step to `total_steps`. Returns the last logged record plus
        `step`, `preempted` (a notice stopped the run after saving; the caller should exit 0
        so that a restart resumes; a notice during the last step just ends the run normally)
        and `checkpoint_step`.

        Raises:
          TrainingDivergedError: a non-finite loss, gradient norm or parameter norm.
        """
        total, start = self.total, self.start_step
        if self.lease is not None:  # from here on, a failure keeps what the run wrote
            self.lease.started = True
        if start >= total:
            logging.info("nothing to train: step %d >= %d steps", start, total)
            if self.data.final_eval:
                self.last_record = self._evaluate(self.state.params)
                self.writer.write(start, self.last_record)
                if self.checkpointer.latest_step() is None:  # evaluation only: keep the model
                    self._save(start, force=True)
            else:  # a finished run: its last record, as the run itself returned it
                records = metrics_writer.read_metrics(self.workdir)
                self.last_record = records[-1] if records else {}
            self.checkpointer.wait()
            return {**self.last_record, "step": start, "preempted": False,
                    "checkpoint_step": self.checkpointer.latest_step()}  # fmt: skip
        single_process = jax.process_count() == 1
        # Single process: SIGTERM sets a flag read at step boundaries. Several: JAX's
        # preemption service owns SIGTERM and the processes agree on the save step (Orbax).
        signal_flag = preemption.PreemptionSignal() if single_process else None
        preempted, step = False, start
        pending: _Pending | None = None
        # Nothing else may be in flight when the steps start, and at most two steps are.
        # (XLA:CPU runs the collectives of virtual devices on a shared thread pool; a deep
        # queue of multi-device programs can starve a rendezvous until it aborts the process.)
        jax.block_until_ready(self.state)
        logging.info("training steps %d..%d", start + 1, total)
        with signal_flag or contextlib.nullcontext(), jax.transfer_guard("disallow"):
            for step in range(start + 1, total + 1):  # `step` = updates done after it
                host_batch = self.data.next_batch(step)
                batch = put_batch(host_batch, self.batch_sharding, self.data.global_batch)
                self.state, metrics = self.train_step(self.state, batch)
                # Step `step` is queued; only now wait for the numbers of the one before.
                if pending is not None:
                    self._finish(pending)
                self.checkpointer.check_for_errors()  # a failed background save stops the run
                pending = _Pending(step, metrics)
                self.settings.debug.after_step(step)
                preempted = signal_flag is not None and signal_flag.requested
                save = preempted or step == total or self.checkpointer.should_save(step)
                if save or self._eval_due(step):
                    # Never checkpoint or evaluate a state not checked finite. The step's
                    # record (with its evaluation) is on disk before its checkpoint can
                    # commit: a resume continues after that step and would never write it.
                    values = self._check(pending)
                    force = preempted or step == total
                    if self._eval_due(step):
                        try:
                            pending.eval = self._evaluate(self.state.params)
                        except BaseException:
                            if save:  # a failing evaluation must not lose the trained state
                                self._save(step, force=force)
                            raise
                    self._log(pending, values)
                    pending = None
                    if save:
                        self._save(step, force=force)
                        self.settings.debug.after_save(step, self.checkpointer)
                if not single_process and self.checkpointer.reached_preemption(step):
                    preempted = True
                if preempted:
                    if step < total:
                        logging.warning("preempted: checkpoint of step %d saved, exiting", step)
                        break
                    preempted = False  # the last step: its save is the final one
            if pending is not None:
                self._finish(pending)
        self.checkpointer.wait()
        return {**self.last_record, "step": step, "preempted": preempted,
                "checkpoint_step": self.checkpointer.latest_step()}  # fmt: skip

    def _save(self, step: int, force: bool) -> None:
        if self.lease is not None:
            self.lease.check()
        start = time.perf_counter()
        # Gathering the per-process data states is an explicit, rare transfer.
        with jax.transfer_guard("allow"):
            self.checkpointer.save(
                step,
                params=self.state.params,
                opt_state=self.state.opt_state,
                data=self.data.data_state(step),
                meta=checkpointing.checkpoint_meta(
                    self.model.model_config, step, config=self._config, **self.objective.meta()
                ),
                force=force,
            )
        self._excluded += time.perf_counter() - start

    def _finish(self, pending: _Pending) -> None:
        self._log(pending, self._check(pending))

    def _check(self, pending: _Pending) -> dict[str, float]:
        """Fetches a step's metrics; stops on non-finite values."""
        values = {k: float(v) for k, v in jax.device_get(pending.metrics).items()}
        bad = [k for k in ("loss", "grad_norm", "param_norm") if not math.isfinite(values[k])]
        if bad:
            self._diverged(pending.step, values, bad)
        if self._interval is None:  # the first step includes compilation: start timing after it
            self._interval = (pending.step, time.perf_counter())
            self._excluded = 0.0
            seconds, programs, hits = self._compiled_before
            clock = self._clock
            logging.info("compilation: %d programs in %.2f s (%d read from the persistent cache)",
                         clock.programs - programs, clock.seconds - seconds,
                         clock.hits - hits)  # fmt: skip
        return values

    def _log(self, pending: _Pending, values: dict[str, float]) -> None:
        """Writes the record of a log step (or of a step with evaluation results)."""
        now = time.perf_counter()
        log_step = pending.step % self.settings.log_every_steps == 0
        if not (log_step or pending.step == self.total or pending.eval):
            return
        record: dict[str, Any] = dict(values)
        first_step, first_time = self._interval
        rate = mfu = eta = None
        if pending.step > first_step:
            elapsed = max(now - first_time - self._excluded, 1e-9)
            step_time = elapsed / (pending.step - first_step)
            rate = self.data.global_batch / step_time
            eta = step_time * (self.total - pending.step)
            if self.peak and self.model.flops_per_step:
                mfu = flops.mfu(self.model.flops_per_step, step_time, self.chips, self.peak)
        self._interval, self._excluded = (pending.step, now), 0.0
        record["examples_per_sec"] = rate
        if self.model.flops_per_step is not None:
            record["mfu"] = mfu
        record.update(pending.eval or {})
        self.writer.write(pending.step, record)
        self.last_record = record
        if jax.process_index() == 0:  # one progress line per step for the whole job
            logging.info(metrics_writer.progress_line(
                pending.step, self.total, record, eta, self.model.progress_fields,
                self.data.eval_progress_fields,
            ))  # fmt: skip

    def _diverged(self, step: int, values: dict[str, float], bad: list[str]) -> None:
        self.checkpointer.wait()  # the last good checkpoint must be committed before we name it
        last = self.checkpointer.latest_step()
        where = (
            f"{self.checkpointer.step_dir(last)} (step {last})"
            if last is not None
            else "none (no checkpoint was saved before it)"
        )
        self.writer.write(step, values)
        raise TrainingDivergedError(
            f"non-finite {', '.join(bad)} at step {step} (loss={values['loss']}, "
            f"grad_norm={values['grad_norm']}, param_norm={values['param_norm']}); last good "
            f"checkpoint: {where}. Lower config.learning_rate (or check the data) and restart."
        )

    def close(self) -> None:
        """Waits for saves, closes the writer and the objective's data, leaves the mesh."""
        self._stack.close()
