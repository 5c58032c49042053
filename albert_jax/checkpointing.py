"""Training checkpoints: a thin wrapper over Orbax's V0 `ocp.CheckpointManager`.

Layout (read by `albert_jax.pretrained.load_pretrained` as well):

    WORKDIR/checkpoints/<step>/params     StandardSave of the plain (unboxed) params tree, the
                                          tree that goes under {"params": ...}
    WORKDIR/checkpoints/<step>/opt_state  StandardSave of the optax state
    WORKDIR/checkpoints/<step>/data       JsonSave: input-pipeline state, one per process
    WORKDIR/checkpoints/<step>/meta       JsonSave: {"model_config", "step", ...}
    WORKDIR/tokenizer.model               sentencepiece model of the run

Saves are asynchronous: the arrays are copied to host memory, then written and committed by a
background thread. Orbax writes into a temporary directory and renames it only once every item
is on disk, so a process killed mid-save (even with SIGKILL) leaves the previous checkpoint as
the latest one; the half-written directory is ignored and cleaned up on the next start.

Preemption: on TPU pods (and any multi-process job) JAX's preemption service turns the
scheduler's SIGTERM into a synchronized "save now" step that Orbax's
`PreemptionCheckpointingPolicy` sees. A single process has no such service, so
`PreemptionSignal` catches SIGTERM itself; the loop then saves at the next step boundary, waits
for the save and returns normally, and a restart resumes from there.

This is the one file to change when moving to Orbax V1.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import threading
import time
from collections.abc import Mapping
from types import FrameType
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from absl import logging
from etils import epath
from orbax.checkpoint import checkpoint_managers as policies

CHECKPOINTS_DIR = "checkpoints"
TOKENIZER_FILE = "tokenizer.model"
ITEMS = ("params", "opt_state", "data", "meta")

PyTree = Any


def absolute(path: str) -> str:
    """An absolute local path; object-store paths (gs://...) unchanged."""
    return str(path) if "://" in str(path) else os.path.abspath(path)


def checkpoint_dir(workdir: str) -> str:
    """WORKDIR/checkpoints."""
    return str(epath.Path(absolute(workdir)) / CHECKPOINTS_DIR)


def abstract_like(tree: PyTree, shardings: PyTree | None = None) -> PyTree:
    """ShapeDtypeStructs of `tree` (arrays or ShapeDtypeStructs), carrying `shardings` if given.

    A restore target with shardings makes Orbax read each shard straight onto its device: the
    full array is never assembled on one host or device.
    """
    if shardings is None:
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)
    return jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings
    )


@dataclasses.dataclass
class Restored:
    """What a training checkpoint holds; `opt_state` and `data` are None for params-only loads."""

    step: int
    params: PyTree
    opt_state: PyTree | None
    data: Any
    meta: dict[str, Any]


class Checkpointer:
    """Saves and restores the four items of a training step under WORKDIR/checkpoints.

    Args:
      workdir: the run directory (local, or a `gs://` path).
      every_steps: periodic saves (`FixedIntervalPolicy`); preemption saves come on top.
      keep: how many of the latest checkpoints to keep (`LatestN`).
      async_save: write in a background thread (the step loop goes on meanwhile).
      read_only: open an existing directory without creating or deleting anything.
    """

    def __init__(
        self,
        workdir: str,
        *,
        every_steps: int = 1000,
        keep: int = 3,
        async_save: bool = True,
        read_only: bool = False,
    ):
        if every_steps < 1:
            raise ValueError(f"checkpoint_every_steps must be >= 1, got {every_steps}")
        if keep < 1:
            raise ValueError(f"keep_checkpoints must be >= 1, got {keep}")
        self.directory = checkpoint_dir(workdir)
        options = ocp.CheckpointManagerOptions(
            save_decision_policy=policies.AnySavePolicy(
                [
                    policies.FixedIntervalPolicy(every_steps),
                    policies.PreemptionCheckpointingPolicy(),
                ]
            ),
            preservation_policy=policies.LatestN(keep),
            enable_async_checkpointing=async_save,
            # Removes what a killed save left behind (Orbax never reads it as a checkpoint).
            cleanup_tmp_directories=not read_only,
            read_only=read_only,
            create=not read_only,
        )
        self._manager = ocp.CheckpointManager(self.directory, item_names=ITEMS, options=options)

    # ------------------------------------------------------------------------------ queries
    def latest_step(self) -> int | None:
        """The newest fully committed step, or None."""
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        return sorted(self._manager.all_steps())

    def should_save(self, step: int) -> bool:
        """Periodic step, or the step every process agreed on after a preemption notice."""
        return self._manager.should_save(step)

    def reached_preemption(self, step: int) -> bool:
        """True at the synchronized save step after a preemption notice (multi-process)."""
        return self._manager.reached_preemption(step)

    def step_dir(self, step: int) -> str:
        return str(epath.Path(self.directory) / str(step))

    # ------------------------------------------------------------------------------- saving
    def save(
        self,
        step: int,
        *,
        params: PyTree,
        opt_state: PyTree,
        data: Any,
        meta: Mapping[str, Any],
        force: bool = False,
    ) -> bool:
        """Starts an asynchronous save of one step; returns whether a save was started.

        `force` saves even when the policies would not (end of training, SIGTERM).
        """
        if step in self._manager.all_steps():
            return False  # already saved (e.g. the final step was also a periodic one)
        args = ocp.args.Composite(
            params=ocp.args.StandardSave(params),
            opt_state=ocp.args.StandardSave(opt_state),
            data=ocp.args.JsonSave(data),
            meta=ocp.args.JsonSave(dict(meta)),
        )
        return self._manager.save(step, args=args, force=force)

    def wait(self) -> None:
        """Blocks until every started save is committed."""
        self._manager.wait_until_finished()

    def close(self) -> None:
        self._manager.wait_until_finished()
        self._manager.close()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ----------------------------------------------------------------------------- restoring
    def restore(
        self, step: int, abstract_params: PyTree, abstract_opt_state: PyTree | None
    ) -> Restored:
        """Restores a step directly into the shardings carried by the abstract targets.

        Args:
          step: a committed step.
          abstract_params: ShapeDtypeStructs (with `sharding`) of the params tree.
          abstract_opt_state: same for the optimizer state, or None to skip it (params only).
        """
        items: dict[str, Any] = {
            "params": ocp.args.StandardRestore(abstract_params),
            "meta": ocp.args.JsonRestore(),
        }
        if abstract_opt_state is not None:
            items["opt_state"] = ocp.args.StandardRestore(abstract_opt_state)
            items["data"] = ocp.args.JsonRestore()
        restored = self._manager.restore(step, args=ocp.args.Composite(**items))
        return Restored(
            step=step,
            params=restored["params"],
            opt_state=restored["opt_state"] if abstract_opt_state is not None else None,
            data=restored["data"] if abstract_opt_state is not None else None,
            meta=dict(restored["meta"]),
        )

    def restore_numpy(self, step: int, item: str = "params") -> PyTree:
        """One array item of a step as host numpy arrays, whatever mesh, device count or
        process count saved it (tests, notebooks, fine-tuning init from another run).

        Returns the saved tree (nested dicts / lists as Orbax stores it) with `np.ndarray`
        leaves of the saved shapes and dtypes; nothing is placed on a device.
        """
        if item not in ("params", "opt_state"):
            raise ValueError(f"item must be 'params' or 'opt_state', got {item!r}")
        # The item's own metadata (shapes, dtypes, the saving sharding). The manager's
        # `item_metadata` is None for items it has no handler for yet (a read-only manager
        # before its first restore), so the item directory is read directly.
        handler = ocp.StandardCheckpointHandler()
        try:
            tree = handler.metadata(epath.Path(self.step_dir(step)) / item).tree
        finally:
            handler.close()
        # numpy leaves make Orbax restore with `RestoreArgs(restore_type=np.ndarray)`: each
        # array is read whole onto the host and the saved sharding is never rebuilt (abstract
        # ShapeDtypeStructs without a sharding would fall back to the saved one and fail on
        # another topology). np.empty only reserves memory; Orbax returns new arrays.
        target = jax.tree.map(lambda m: np.empty(m.shape, m.dtype), tree)
        restored = self._manager.restore(
            step, args=ocp.args.Composite(**{item: ocp.args.StandardRestore(target)})
        )
        return restored[item]

    def read_json(self, step: int, item: str) -> Any:
        """The `data` or `meta` item of a step."""
        if item not in ("data", "meta"):
            raise ValueError(f"item must be 'data' or 'meta', got {item!r}")
        return self._manager.restore(
            step, args=ocp.args.Composite(**{item: ocp.args.JsonRestore()})
        )[item]


# ------------------------------------------------------------------------------ resume order
@dataclasses.dataclass(frozen=True)
class ResumePlan:
    """Where a run starts from.

    kind: "workdir" (this run's latest checkpoint, full state), "resume_from" (another run's
    latest checkpoint, full state), "init_from" (params only; step 0, fresh optimizer and data)
    or "scratch". `path` is the directory to read, `step` the checkpoint step (None for
    init_from / scratch).
    """

    kind: str
    path: str | None = None
    step: int | None = None


def latest_committed_step(workdir: str) -> int | None:
    """Latest committed step of another run's workdir, without touching its directory."""
    directory = checkpoint_dir(workdir)
    if not epath.Path(directory).is_dir():
        return None
    manager = ocp.CheckpointManager(
        directory, item_names=ITEMS, options=ocp.CheckpointManagerOptions(read_only=True)
    )
    try:
        return manager.latest_step()
    finally:
        manager.close()


def plan_resume(
    workdir: str, resume_from: str | None = None, init_from: str | None = None
) -> ResumePlan:
    """Resume order: this workdir's latest checkpoint → `resume_from` (another workdir, full
    state) → `init_from` (params only) → scratch.

    Raises:
      ValueError: `resume_from` is given but holds no committed checkpoint (a typo there would
        otherwise silently start from scratch).
    """
    step = latest_committed_step(workdir)
    if step is not None:
        return ResumePlan("workdir", absolute(workdir), step)
    if resume_from:
        step = latest_committed_step(resume_from)
        if step is None:
            raise ValueError(
                f"config.resume_from={resume_from!r} holds no committed checkpoint under "
                f"{checkpoint_dir(resume_from)}; fix the path or unset it"
            )
        return ResumePlan("resume_from", absolute(resume_from), step)
    if init_from:
        return ResumePlan("init_from", init_from)
    return ResumePlan("scratch")


# ---------------------------------------------------------------------------------- SIGTERM
# JAX's preemption service polls for SIGTERM once a second; this wait covers that poll and the
# notice's trip through the coordination service.
NOTICE_PROPAGATION_S = 3.0


def send_preemption_notice() -> None:
    """Debugging hook (`debug.sigterm_after_step`): SIGTERM to process 0 only, as a scheduler
    sends to one host before a preemption.

    With several processes, every process then waits `NOTICE_PROPAGATION_S` for JAX's
    preemption service to pass the notice on to all of them, so that they agree on the step
    they are at: the save step is `sigterm_after_step` itself, not whichever later step the
    notice happened to reach.
    """
    if jax.process_index() == 0:
        os.kill(os.getpid(), signal.SIGTERM)
    if jax.process_count() > 1:
        time.sleep(NOTICE_PROPAGATION_S)


class PreemptionSignal:
    """Turns SIGTERM into a flag that the training loop polls at step boundaries.

    Install it only in single-process runs: with `jax.distributed`, JAX's own preemption
    service owns SIGTERM and Orbax's `reached_preemption` reports the agreed step. Use as a
    context manager; the previous handler is restored on exit.
    """

    def __init__(self, signum: int = signal.SIGTERM):
        self.signum = signum
        self._event = threading.Event()
        self._previous: Any = None
        self._installed = False

    @property
    def requested(self) -> bool:
        return self._event.is_set()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        del frame
        logging.warning(
            "received signal %d: saving a checkpoint at the next step boundary, then exiting",
            signum,
        )
        self._event.set()

    def __enter__(self) -> PreemptionSignal:
        # Signal handlers can only be set from the main thread; elsewhere (e.g. a notebook
        # worker thread) the run simply has no SIGTERM handling.
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(self.signum, self._handle)
            self._installed = True
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._installed:
            signal.signal(self.signum, self._previous)
            self._installed = False
