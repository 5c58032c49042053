"""Checkpoint directories: where a run's checkpoints lie (WORKDIR/checkpoints/<step>/<item>),
which step is committed, and reading a step directory without a manager — every checkpoint
read of the package outside the training loop (`load_pretrained`, fine-tuning inits, tests).
The manager that writes them is `checkpointing.Checkpointer`.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from albert_jax import files
from albert_jax.finetune.seeds import seeds_of

CHECKPOINTS_DIR = "checkpoints"
ITEMS = ("params", "opt_state", "data", "meta")

PyTree = Any


def checkpoint_dir(workdir: str) -> str:
    """WORKDIR/checkpoints."""
    return str(files.as_path(workdir) / CHECKPOINTS_DIR)


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
