"""Training checkpoints: a thin wrapper over Orbax's V0 `ocp.CheckpointManager` (`Checkpointer`:
saves, restores, failures) and the resume order; reading a step directory without a manager
(`load_pretrained`, fine-tuning inits, tests) is `checkpoint_dirs`.

Layout (WORKDIR local or `gs://`; Orbax reads and writes object stores with its own client):

    WORKDIR/checkpoints/<step>/params     StandardSave of the plain (unboxed) params tree, the
                                          tree that goes under {"params": ...}
    WORKDIR/checkpoints/<step>/opt_state  StandardSave of the optax state
    WORKDIR/checkpoints/<step>/data       JsonSave: input-pipeline state, one per process
    WORKDIR/checkpoints/<step>/meta       JsonSave: {"model_config", "step", ...}
    WORKDIR/tokenizer.model               sentencepiece model of the run

Saves are asynchronous: the arrays are copied to host memory, then written and committed by a
background thread. Orbax writes into a temporary directory and renames it only once every item
is on disk (on object stores, which cannot rename, it writes in place and commits with a marker
file), so a process killed mid-save (even with SIGKILL) leaves the previous checkpoint as the
latest one; the half-written directory is ignored and cleaned up on the next start.

Preemption saves are decided with Orbax's `PreemptionCheckpointingPolicy`; the SIGTERM side
lives in `preemption.py`. A save that fails (a full disk, a refused write) raises
`CheckpointError` naming the step and its directory, at the latest at the next step boundary
(`check_for_errors`); the checkpoints before it stay intact.

This file and `checkpoint_dirs` are the ones to change when moving to Orbax V1.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import re
from collections.abc import Iterator, Mapping
from typing import Any

import jax
import orbax.checkpoint as ocp
from absl import logging
from etils import epath
from orbax.checkpoint import checkpoint_managers as policies

from albert_jax import files
from albert_jax.model.config import ModelConfig
from albert_jax.runtime import cli
from albert_jax.runtime.checkpoint_dirs import (
    ITEMS,
    checkpoint_dir,
    latest_committed_step,
    read_item_numpy,
    read_json_item,
)

TOKENIZER_FILE = "tokenizer.model"

PyTree = Any


@functools.cache
def _save_arrays_from_replica_zero() -> None:
    """Arrays are written by their replica-0 shards, not sliced across replicas. Orbax's
    default (replica-parallel) jits a slice per array and replica at each process's first
    save (seconds of compiles for ALBERT's ~30 arrays), paid again by every process at every
    (re)start, for writes that are small for its few, FSDP-sharded arrays. Orbax's setting is
    process-wide, so it is set when the first `Checkpointer` opens (a training run), not on
    import: `load_pretrained` in a user's program leaves Orbax as it was. Registering it logs
    a warning about the override, silenced here."""
    absl_logger = logging.get_absl_logger()
    level = absl_logger.level  # restored as it was (usually unset, so callers' levels apply)
    absl_logger.setLevel("ERROR")
    try:
        ocp.type_handlers.register_type_handler(
            jax.Array, ocp.type_handlers.ArrayHandler(use_replica_parallel=False), override=True
        )
    finally:
        absl_logger.setLevel(level)


def checkpoint_meta(config: ModelConfig, step: int, /, **extra: Any) -> dict[str, Any]:
    """The `meta` item of a training checkpoint: `{"model_config", "step", **extra}`
    (`load_pretrained` rebuilds the model from `model_config`)."""
    return {"model_config": config.to_dict(), "step": int(step), **extra}


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


class CheckpointError(RuntimeError):
    """A checkpoint that could not be written or read; names the step and its directory."""


# Debugging payloads TensorStore appends to an error (`[tensorstore_spec='{...}']`: the whole
# JSON spec of the array; `[source locations='...']`): they can push the OS's reason, which
# comes just before them, out of a one-line summary.
_TENSORSTORE_PAYLOADS = re.compile(r"\s*\[(?:tensorstore_spec|source locations)='.*?'\]", re.S)


def describe_error(error: BaseException, limit: int = 400) -> str:
    """`"Type: first line of the message"` in at most `limit` characters: the reason of a failed
    save or restore in one line (Orbax / TensorStore messages run to many lines). TensorStore's
    debugging payloads are dropped, and a longer line keeps its start and its end, where
    TensorStore puts the OS's reason ("File too large [os_error_code='27']")."""
    message = _TENSORSTORE_PAYLOADS.sub("", str(error))
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    text = f"{type(error).__name__}: {lines[0] if lines else ''}".rstrip(": ")
    if len(text) <= limit:
        return text
    half = (limit - 5) // 2
    return f"{text[:half]} ... {text[-half:]}"


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
        if not read_only:
            _save_arrays_from_replica_zero()
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
        self._last_save: int | None = None  # step of the last save started (errors name it)
        self._failed = False  # a failed save was reported

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
        # Orbax waits for the previous save before it starts one anyway; waiting here names a
        # failure of that save as its own.
        self.wait()
        with self._failures(step):
            started = self._manager.save(step, args=args, force=force)
        self._last_save = step if started else self._last_save
        return started

    def delete(self, step: int) -> None:
        """Removes a committed step (one that cannot be restored)."""
        self._manager.delete(step)

    def check_for_errors(self) -> None:
        """Raises `CheckpointError` (naming the step and its directory) if a save writing in
        the background has failed; a few attribute reads when none has."""
        if self._last_save is not None:
            with self._failures(self._last_save):
                self._manager.check_for_errors()

    def wait(self) -> None:
        """Blocks until every started save is committed; raises `CheckpointError` if one
        failed."""
        with self._failures(self._last_save):
            self._manager.wait_until_finished()
            self._manager.check_for_errors()

    @contextlib.contextmanager
    def _failures(self, step: int | None) -> Iterator[None]:
        """Turns an Orbax / TensorStore / OS error of the save of `step` into one
        `CheckpointError` naming the step, its directory and the checkpoints still intact."""
        try:
            yield
        except Exception as e:
            if self._failed:  # more of a failure already reported (the run is stopping)
                logging.warning("after the failed save: %s", describe_error(e))
                return
            self._failed = True
            # The failed save's abandoned write coroutines, closed now rather than at
            # interpreter exit (where each one prints a traceback as its cleanup fails).
            gc.collect()
            where = f"step {step} to {self.step_dir(step)}" if step is not None else self.directory
            intact = [s for s in self._manager.all_steps() if s != step]
            error = CheckpointError(
                f"saving the checkpoint of {where} failed ({describe_error(e)}); the run stops "
                f"here. Checkpoints intact: {sorted(intact) or 'none'} under {self.directory}"
            )
            # A storage that stopped answering also stalls the way out (other uploads,
            # TensorBoard, the lease): a command gets a bounded time for it.
            cli.bound_the_way_out(error)
            raise error from e

    def close(self) -> None:
        """Waits for the started saves and closes the manager; after a failed save neither
        (its other writes may never finish: the run is ending with the error)."""
        if self._failed:
            return
        try:
            self.wait()
        finally:
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
        return read_item_numpy(epath.Path(self.step_dir(step)) / item)

    def read_json(self, step: int, item: str) -> Any:
        """The `data` or `meta` item of a step."""
        if item not in ("data", "meta"):
            raise ValueError(f"item must be 'data' or 'meta', got {item!r}")
        return read_json_item(epath.Path(self.step_dir(step)) / item)


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
        return ResumePlan("workdir", files.absolute(workdir), step)
    if resume_from:
        step = latest_committed_step(resume_from)
        if step is None:
            raise ValueError(
                f"config.resume_from={resume_from!r} holds no committed checkpoint under "
                f"{checkpoint_dir(resume_from)}; fix the path or unset it"
            )
        return ResumePlan("resume_from", files.absolute(resume_from), step)
    if init_from:
        return ResumePlan("init_from", init_from)
    return ResumePlan("scratch")
