"""Training checkpoints: a thin wrapper over Orbax's V0 `ocp.CheckpointManager`, and every
checkpoint read of the package (`load_pretrained`, fine-tuning inits, tests) in one place.

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

This is the one file to change when moving to Orbax V1.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import re
from collections.abc import Iterator, Mapping
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from absl import logging
from etils import epath
from orbax.checkpoint import checkpoint_managers as policies

from albert_jax import files
from albert_jax.config import ModelConfig
from albert_jax.seeds import seeds_of

CHECKPOINTS_DIR = "checkpoints"
TOKENIZER_FILE = "tokenizer.model"
ITEMS = ("params", "opt_state", "data", "meta")

PyTree = Any


def _save_arrays_from_replica_zero() -> None:
    """Arrays are written by their replica-0 shards, not sliced across replicas. Orbax's
    default (replica-parallel) jits a slice per array and replica at each process's first
    save: 30 replicated arrays on 8 CPU devices took 13.7 s to save against 0.14 s without
    it. The writes it spreads over replicas are small for ALBERT's few, FSDP-sharded arrays;
    its compiles are paid again by every process at every (re)start. Orbax's setting is
    process-wide; registering it logs a warning about the override, silenced here."""
    absl_logger = logging.get_absl_logger()
    level = absl_logger.level  # restored as it was (usually unset, so callers' levels apply)
    absl_logger.setLevel("ERROR")
    try:
        ocp.type_handlers.register_type_handler(
            jax.Array, ocp.type_handlers.ArrayHandler(use_replica_parallel=False), override=True
        )
    finally:
        absl_logger.setLevel(level)


_save_arrays_from_replica_zero()

absolute = files.absolute  # an absolute local path; object-store paths (gs://...) unchanged


def checkpoint_dir(workdir: str) -> str:
    """WORKDIR/checkpoints."""
    return str(files.as_path(workdir) / CHECKPOINTS_DIR)


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
            raise CheckpointError(
                f"saving the checkpoint of {where} failed ({describe_error(e)}); the run stops "
                f"here. Checkpoints intact: {sorted(intact) or 'none'} under {self.directory}"
            ) from e

    def close(self) -> None:
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


def latest_committed_step(workdir: str) -> int | None:
    """Latest committed step of another run's workdir, without touching its directory."""
    directory = checkpoint_dir(workdir)
    if not epath.Path(directory).is_dir():
        return None
    # save_interval_steps / create set as read_only forces them (else Orbax warns it did).
    options = ocp.CheckpointManagerOptions(read_only=True, save_interval_steps=0, create=False)
    manager = ocp.CheckpointManager(directory, item_names=ITEMS, options=options)
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


# ---------------------------------------------------------------------------------- readers
# These read one item directory with its Orbax handler, not a manager or a Checkpointer: a
# step dir (or a model dir's `params/`) may lie anywhere, and on object stores the commit
# marker is the step dir's, not the item's, so a Checkpointer would take the item for an
# unfinished save. `read_step_dir` checks the step dir's commit instead.


def read_item_numpy(item_dir: str | epath.Path) -> PyTree:
    """A StandardSave item (`.../<step>/params`, a model dir's `params/`) as host numpy arrays,
    whatever mesh, device count or process count saved it.

    Returns the saved tree (nested dicts / lists as Orbax stores it) with `np.ndarray` leaves of
    the saved shapes and dtypes; nothing is placed on a device.

    Raises:
      ValueError: naming `item_dir` when it holds no Orbax item.
    """
    directory = files.as_path(item_dir)
    handler = ocp.StandardCheckpointHandler()
    try:
        if not (directory / "_METADATA").exists():
            raise ValueError(f"{item_dir} is not an Orbax checkpoint item (no _METADATA)")
        tree = handler.metadata(directory).tree
        # numpy leaves make Orbax restore with `RestoreArgs(restore_type=np.ndarray)`: each
        # array is read whole onto the host and the saved sharding is never rebuilt (abstract
        # ShapeDtypeStructs without a sharding would fall back to the saved one and fail on
        # another topology). np.empty only reserves memory; Orbax returns new arrays.
        target = jax.tree.map(lambda m: np.empty(m.shape, m.dtype), tree)
        return handler.restore(directory, args=ocp.args.StandardRestore(target))
    finally:
        handler.close()


def write_item_numpy(item_dir: str | epath.Path, tree: PyTree) -> None:
    """Writes a StandardSave item of host arrays (a model dir's `params/`), replacing one that
    is there. A single-process helper: a multi-host run saves through its `Checkpointer`."""
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(files.as_path(item_dir), tree, force=True)
        checkpointer.wait_until_finished()


def read_json_item(item_dir: str | epath.Path) -> Any:
    """A JsonSave item (`.../<step>/meta` or `data`)."""
    directory = files.as_path(item_dir)
    if not directory.is_dir():
        raise ValueError(f"{item_dir} does not exist (no JSON checkpoint item there)")
    handler = ocp.JsonCheckpointHandler()
    try:
        return handler.restore(directory, args=ocp.args.JsonRestore())
    finally:
        handler.close()


def is_step_dir(path: str | epath.Path) -> bool:
    """Whether `path` holds the `params` and `meta` items of one training step."""
    directory = files.as_path(path)
    return all((directory / item).is_dir() for item in ("params", "meta"))


def latest_step_dir(workdir: str) -> str:
    """WORKDIR/checkpoints/<latest committed step>.

    Raises:
      ValueError: naming the directory when it holds no committed checkpoint.
    """
    step = latest_committed_step(workdir)
    if step is None:
        raise ValueError(
            f"{checkpoint_dir(workdir)} holds no finished checkpoint (a run saves its first "
            "one at checkpoint_every_steps); pass a workdir or step dir that has one"
        )
    return str(files.as_path(checkpoint_dir(workdir)) / str(step))


def read_step_dir(
    step_dir: str | epath.Path, run_seed: int | None = None
) -> tuple[dict[str, Any], PyTree]:
    """(meta, params) of one committed step dir, params as host numpy: the inner params tree
    (what goes under `{"params": ...}`) whichever of the two conventions it was saved in; of a
    checkpoint of several seeds, the run of `run_seed` (`run_index`).

    Raises:
      ValueError: naming `step_dir` when it is not a committed step of a training run, or
        holds no run of `run_seed` (see `run_index`).
    """
    directory = files.as_path(step_dir)
    if not is_step_dir(directory):
        raise ValueError(f"{step_dir} is not a training step dir (needs params/ and meta/)")
    if not ocp.step.is_path_finalized(directory):
        raise ValueError(f"{step_dir} is an unfinished save; pass a committed step")
    meta = read_json_item(directory / "meta")
    if not isinstance(meta, dict):
        raise ValueError(f"{step_dir}/meta: expected a JSON object, got {type(meta).__name__}")
    index = run_index(meta, run_seed, str(step_dir))  # before the arrays: errors come first
    params = _read_params(directory)
    if index is None:
        return meta, params
    return meta, jax.tree.map(lambda x: x[index], params)  # [N, ...] -> that run's [...]


def run_index(meta: dict[str, Any], run_seed: int | None, where: str) -> int | None:
    """Where the run of seed `run_seed` lies on the leading seed axis of a checkpoint of
    fine-tuning's `num_seeds` = N > 1 (every array [N, ...], seeds `seed..seed+N-1` of the run
    config in its meta); None for a checkpoint of one run, whose arrays have no seed axis.

    Raises:
      ValueError: naming `where` and the seeds it holds, when it holds several and `run_seed`
        is None, or when `run_seed` is set and is not the seed of one of its runs.
    """
    config = meta.get("config")
    seeds = None  # unknown: a step dir whose meta records no run config
    if isinstance(config, dict) and "seed" in config:
        seeds = seeds_of(config["seed"], config.get("num_seeds", 1))
    several = seeds is not None and len(seeds) > 1
    if run_seed is None and not several:
        return None
    pick = "pick one: load_pretrained(path, run_seed=S), or --config.init_run_seed=S to fine-tune"
    if seeds is None:
        raise ValueError(
            f"{where} holds no run of seed {run_seed}: its meta records no run config (no "
            "seeds); leave run_seed (fine-tuning: config.init_run_seed) unset"
        )
    if run_seed not in seeds:
        what = f"num_seeds={len(seeds)}" if run_seed is None else f"no run of seed {run_seed}"
        raise ValueError(f"{where} holds the runs of seeds {seeds} ({what}); {pick}")
    return seeds.index(run_seed) if several else None


def _read_params(step_dir: epath.Path) -> PyTree:
    """The `params` item of a step dir as the inner tree: loops save that, but a params item
    holding the whole variables tree `{"params": {...}}` is read alike."""
    params = read_item_numpy(step_dir / "params")
    if isinstance(params, dict) and set(params) == {"params"}:
        params = params["params"]
    return params
