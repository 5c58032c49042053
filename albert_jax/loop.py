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

What an objective supplies is the `Objective` protocol below: its model and loss, its batches
and their saved position, its evaluation, and what it writes at the end.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import math
import os
import signal
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
from albert_jax.run_config import config_field, write_run_config
from albert_jax.runtime import compile_cache, preemption
from albert_jax.sharding import LOGICAL_AXIS_RULES, batch_sharding, put_batch
from albert_jax.train_state import TrainState, create_state, jit_step

PyTree = Any
Batch = Mapping[str, np.ndarray]


class TrainingDivergedError(FloatingPointError):
    """A non-finite loss, gradient norm or parameter norm; names the step and last checkpoint."""


# ----------------------------------------------------------------------------------------------
# What an objective supplies


class Objective(Protocol):
    """Pretraining (MLM + SOP on the data pipeline) or fine-tuning (a task kind on its
    features): everything the loop does not decide itself."""

    total_steps: int  # updates of the run
    global_batch: int  # rows of one training batch over all processes
    microbatches: int  # gradient accumulation steps per update (1: none)
    num_seeds: int  # runs in one program (train_state.py: a leading seed axis; 1: none)
    flops_per_step: float | None  # model FLOPs of one update (global batch); None: no MFU
    eval_every_steps: int  # evaluate every that many steps (0: only as `final_eval` says)
    final_eval: bool  # evaluate after the last step (at once if nothing is left to train)
    eval_reduces: bool  # eval_fn returns sums over the batch (replicated), not rows
    model_config: Any  # the `ModelConfig` saved with every checkpoint
    task: str | None  # the fine-tuning task (saved in `meta` as "task"); None: pretraining
    # (label, metric key) of the progress line: training metrics, then evaluation results
    progress_fields: tuple[tuple[str, str], ...]
    eval_progress_fields: tuple[tuple[str, str], ...]

    def init_variables(self, rng: jax.Array) -> PyTree:
        """The boxed (logical-axis annotated) params tree of a random init."""

    def make_optimizer(self, boxed_params: PyTree) -> optax.GradientTransformation: ...

    def initial_weights(self, abstract: Mapping[str, jax.ShapeDtypeStruct]) -> dict[str, Any]:
        """{"a/b/c": host array} of weights a fresh run starts from (the rest is initialized);
        {} for a random init. Called only when no checkpoint is restored."""

    def loss(
        self, params: PyTree, batch: Mapping[str, jax.Array], rng: jax.Array
    ) -> tuple[jax.Array, dict[str, jax.Array]]:
        """(scalar loss, scalar metrics incl. "loss") of a training batch; traced in the step."""

    def eval_fn(self, params: PyTree, batch: Mapping[str, jax.Array]) -> dict[str, jax.Array]:
        """Outputs of an eval batch: sums (`eval_reduces`) or per-row arrays [B, ...]."""

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
        """JSON saved with every checkpoint besides the model config and step."""

    def evaluate(
        self,
        params: PyTree,
        put: Callable[[Batch, int], dict[str, jax.Array]],
        eval_step: Callable[[PyTree, Mapping[str, jax.Array]], PyTree],
    ) -> dict[str, Any]:
        """Numeric `eval_*` metrics of `params` (logged with the step's record): `put` places
        this process's rows of a batch of N global rows on the mesh, `eval_step` runs
        `eval_fn` there (outputs stay on the devices)."""

    def close(self) -> None: ...


# ----------------------------------------------------------------------------------------------
# The loop


@dataclasses.dataclass(frozen=True)
class DebugHooks:
    """What the tests do to a run at a step (`config.debug.*`; 0: never): a preemption notice
    after `sigterm_after_step` (process 0 gets SIGTERM, as one host of a pod), the process
    killed right after the save of `sigkill_after_save_at_step` starts or after the one of
    `sigkill_after_commit_at_step` commits."""

    sigterm_after_step: int = 0
    sigkill_after_save_at_step: int = 0
    sigkill_after_commit_at_step: int = 0

    @classmethod
    def from_config(cls, config: Any) -> DebugHooks:
        fields = (f.name for f in dataclasses.fields(cls))
        return cls(**{name: int(config_field(config, f"debug.{name}", 0)) for name in fields})

    def after_step(self, step: int) -> None:
        if step == self.sigterm_after_step:
            preemption.send_preemption_notice()

    def after_save(self, step: int, checkpointer: checkpointing.Checkpointer) -> None:
        if step == self.sigkill_after_save_at_step:
            os.kill(os.getpid(), signal.SIGKILL)
        if step == self.sigkill_after_commit_at_step:
            checkpointer.wait()
            os.kill(os.getpid(), signal.SIGKILL)


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
      config: the run's config; the loop reads `seed`, `log_every_steps`,
        `checkpoint_every_steps` (0: only the final and preemption saves),
        `keep_checkpoints` and `resume_from` / `init_from` (where present).
      workdir: where checkpoints and metrics go (local or gs://).
      mesh: the device mesh; the loop enters it (`jax.set_mesh`) for its whole life.
      peak: (peak FLOP/s of one chip, chips sharing the work) for MFU, or None.
      lease: the run's `workdir_lease` lease (process 0), checked before every save: a run
        whose lease another run took over stops instead of overwriting its checkpoints.
      debug: the tests' kill hooks (`DebugHooks.from_config`), none by default.
    """

    def __init__(
        self,
        objective: Objective,
        config: Any,
        workdir: str,
        mesh: Mesh,
        peak: tuple[float | None, int] | None = None,
        lease: Any = None,
        debug: DebugHooks | None = None,
    ):
        self.objective, self.config, self.workdir, self.mesh = objective, config, workdir, mesh
        self.lease, self.debug = lease, debug or DebugHooks()
        self.total = objective.total_steps
        self.peak, self.chips = peak or (None, 0)
        # Everything the run opens is closed in reverse order by `close()`, or right here
        # when starting fails (a refused resume must not leave the mesh set in the process).
        self._stack = contextlib.ExitStack()
        try:
            self._start(objective, config, workdir, mesh)
        except BaseException:
            self._stack.close()
            raise

    def _start(self, objective: Objective, config: Any, workdir: str, mesh: Mesh) -> None:
        self._stack.callback(objective.close)
        self._stack.enter_context(jax.set_mesh(mesh))
        self._stack.enter_context(nn.logical_axis_rules(LOGICAL_AXIS_RULES))
        self.batch_sharding = batch_sharding(mesh)
        self.replicated = NamedSharding(mesh, PartitionSpec())
        self.layout = create_state(objective, mesh, int(config.seed), objective.num_seeds)
        every = int(config.checkpoint_every_steps) or max(self.total, 1)
        self.checkpointer = checkpointing.Checkpointer(
            workdir, every_steps=every, keep=int(config.keep_checkpoints)
        )
        self._stack.callback(self.checkpointer.close)
        self.writer = metrics_writer.MetricsWriter(workdir, enabled=jax.process_index() == 0)
        self._stack.callback(self.writer.close)
        shardings = self.layout.shardings
        self.train_step = jit_step(objective, self.layout, mesh, int(config.seed))
        self._eval_step = jax.jit(
            objective.eval_fn,
            in_shardings=(shardings.params, self.batch_sharding),
            out_shardings=self.replicated if objective.eval_reduces else self.batch_sharding,
        )
        self._eval_in_flight: collections.deque[PyTree] = collections.deque()  # `eval_step`
        self._clock = compile_cache.CompileClock.get()
        self._compiled_before = (self._clock.seconds, self._clock.programs, self._clock.hits)
        self.state, self.start_step = self._restore_or_initialize()
        # Only a run whose config passed every check (the objective's, the resume's) records
        # it: a refused restart keeps the config.json of the run it would have continued.
        write_run_config(config, workdir)
        self._interval: tuple[int, float] | None = None  # (step, time) where it started
        self._excluded = 0.0  # seconds of evaluation / checkpointing inside the interval
        self.last_record: dict[str, Any] = {}

    # ------------------------------------------------------------------------------ starting
    def _restore_or_initialize(self) -> tuple[TrainState, int]:
        config, objective, layout = self.config, self.objective, self.layout
        plan = checkpointing.plan_resume(
            self.workdir, config.get("resume_from"), config.get("init_from")
        )
        if plan.path is None:
            logging.info("start: from scratch")
        else:
            at = "" if plan.step is None else f" at step {plan.step}"
            logging.info("start: %s %s%s", plan.kind, plan.path, at)
        if plan.step is None:  # init_from / scratch: the objective's weights, the rest fresh
            state = layout.initialize(
                objective.initial_weights(trees.flatten(layout.abstract.params))
            )
            objective.start(0, None, None)
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
                check=lambda step, data, meta: self._check_resumable(plan.path, step, data, meta),
                strict=bool(config_field(config, "resume_strict", False)),
                prune=plan.kind == "workdir",
            )
        state = TrainState(
            step=jax.device_put(np.int32(restored.step), self.replicated),
            params=restored.params,
            opt_state=restored.opt_state,
        )
        objective.start(restored.step, restored.data, restored.meta)
        dropped = self.writer.rewind(restored.step)
        logging.info("resumed at step %d from %s (%s); dropped %d stale metric lines",
                     restored.step, plan.path, plan.kind, dropped)  # fmt: skip
        return state, restored.step

    def _check_resumable(self, path: str, step: int, data: Any, meta: Any) -> None:
        """Refuses a checkpoint of another model (before its arrays are read: they would not
        fit) and one whose data state the objective cannot continue."""
        self._check_same_task(path, step, meta)
        self._check_same_tokenizer(path, step, meta)
        saved = meta.get("model_config") if isinstance(meta, Mapping) else None
        differ = self.objective.model_config.architecture_differences(saved or {})
        if isinstance(saved, Mapping) and differ:
            raise ValueError(
                f"cannot resume {path} at step {step}: its model differs from this config's "
                f"({'; '.join(differ)}); restore the model settings (config.json of that run, "
                "config.model.*, size) or use a new --workdir"
            )
        self.objective.check_resume(data, step)

    def _check_same_tokenizer(self, path: str, step: int, meta: Any) -> None:
        """Refuses checkpoints trained on another vocabulary. The workdir's tokenizer.model
        guards this while it exists; once it is gone, any sentencepiece model of the same size
        would train on (its ids mean other pieces), so the fingerprint saved with every
        checkpoint is what decides."""
        saved = meta.get("tokenizer_fingerprint") if isinstance(meta, Mapping) else None
        ours = self.objective.meta().get("tokenizer_fingerprint")
        if saved is None or ours is None or saved == ours:
            return
        given = config_field(self.config, "data.tokenizer", "") or "found for this run"
        raise ValueError(
            f"cannot resume {path} at step {step}: its checkpoints were trained with another "
            f"tokenizer than this run's ({given}; fingerprints {saved} and {ours}); put the "
            "run's own sentencepiece model back as WORKDIR/tokenizer.model or pass it as "
            "config.data.tokenizer, or start a new --workdir"
        )

    def _check_same_task(self, path: str, step: int, meta: Any) -> None:
        """Refuses checkpoints of another kind of run (pretraining / a fine-tuning task),
        naming both and the way that keeps them: they are healthy, only not this run's."""
        if not isinstance(meta, Mapping):
            return
        saved, ours = meta.get("task"), self.objective.task
        if saved == ours:
            return
        what = f"fine-tuning run of task {saved!r}" if saved else "pretraining run"
        this = f"fine-tunes task {ours!r}" if ours else "pretrains"
        if ours and not saved:
            fix = f"to fine-tune from it, pass --config.init={path} and a new --workdir"
        elif ours:
            fix = f"use a new --workdir (or --config.task={saved} to continue that run)"
        else:
            fix = "pretrain into a new --workdir"
        raise ValueError(
            f"cannot resume {path} at step {step}: it holds the checkpoints of a {what}, and "
            f"this config {this}; {fix}. Its checkpoints are fine: leave them in place"
        )

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
            metrics = self.objective.evaluate(params, self.put, self.eval_step)
        self._eval_in_flight.clear()
        self._excluded += time.perf_counter() - start
        return metrics

    def _eval_due(self, step: int) -> bool:
        every = self.objective.eval_every_steps
        if every and step % every == 0:
            return True
        return step == self.total and (bool(every) or self.objective.final_eval)

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
            if self.objective.final_eval:
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
                host_batch = self.objective.next_batch(step)
                batch = put_batch(host_batch, self.batch_sharding, self.objective.global_batch)
                self.state, metrics = self.train_step(self.state, batch)
                # Step `step` is queued; only now wait for the numbers of the one before.
                if pending is not None:
                    self._finish(pending)
                self.checkpointer.check_for_errors()  # a failed background save stops the run
                pending = _Pending(step, metrics)
                self.debug.after_step(step)
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
                        self.debug.after_save(step, self.checkpointer)
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
                data=self.objective.data_state(step),
                meta=checkpointing.checkpoint_meta(
                    self.objective.model_config, step, **self.objective.meta()
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
        log_step = pending.step % int(self.config.log_every_steps) == 0
        if not (log_step or pending.step == self.total or pending.eval):
            return
        record: dict[str, Any] = dict(values)
        first_step, first_time = self._interval
        rate = mfu = eta = None
        if pending.step > first_step:
            elapsed = max(now - first_time - self._excluded, 1e-9)
            step_time = elapsed / (pending.step - first_step)
            rate = self.objective.global_batch / step_time
            eta = step_time * (self.total - pending.step)
            if self.peak and self.objective.flops_per_step:
                mfu = flops.mfu(self.objective.flops_per_step, step_time, self.chips, self.peak)
        self._interval, self._excluded = (pending.step, now), 0.0
        record["examples_per_sec"] = rate
        if self.objective.flops_per_step is not None:
            record["mfu"] = mfu
        record.update(pending.eval or {})
        self.writer.write(pending.step, record)
        self.last_record = record
        if jax.process_index() == 0:  # one progress line per step for the whole job
            objective = self.objective
            logging.info(metrics_writer.progress_line(
                pending.step, self.total, record, eta, objective.progress_fields,
                objective.eval_progress_fields,
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
