"""Mesh construction, the one table that maps logical axes to mesh axes, and batches between
the host and the devices.

Mesh axes: `data` (replicas), `fsdp` (parameters and optimizer state sharded, batch split too),
`tensor` (heads / mlp / vocab split). Parameter names (`vocab, embed, embed_factor, mlp, heads,
kv, layers`) and activation names (`act_batch, act_seq, act_embed, act_mlp`) are kept apart so
that FSDP-sharding the `embed` dim of weights never shards the feature dim of activations.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

PyTree = Any
Batch = Mapping[str, np.ndarray]
MESH_AXES = ("data", "fsdp", "tensor")

# logical axis -> mesh axis (or axes, or None = replicated)
LOGICAL_AXIS_RULES: tuple[tuple[str, str | tuple[str, ...] | None], ...] = (
    # activations
    ("act_batch", ("data", "fsdp")),
    ("act_seq", None),
    ("act_embed", None),
    ("act_mlp", "tensor"),
    # parameters
    ("vocab", "tensor"),
    ("embed", "fsdp"),
    ("embed_factor", None),  # E = 128 is too small to be worth splitting
    ("mlp", "tensor"),
    ("heads", "tensor"),
    ("kv", None),
    ("layers", None),  # stacked unshared weights: every device runs every layer
    ("seeds", None),  # fine-tuning seeds in one program: every device updates every seed
)


def resolve_mesh_shape(shape: Sequence[int], num_devices: int) -> tuple[int, ...]:
    """Fills the single -1 entry of `shape` so that the product equals `num_devices`."""
    shape = tuple(int(s) for s in shape)
    if shape.count(-1) > 1:
        raise ValueError(f"mesh shape {shape}: at most one axis may be -1")
    if any(s == 0 or s < -1 for s in shape):
        raise ValueError(f"mesh shape {shape}: sizes must be positive or -1")
    known = int(np.prod([s for s in shape if s != -1]))
    if -1 in shape:
        if num_devices % known:
            raise ValueError(
                f"mesh shape {shape}: {num_devices} devices are not divisible by {known}"
            )
        shape = tuple(num_devices // known if s == -1 else s for s in shape)
    if int(np.prod(shape)) != num_devices:
        raise ValueError(
            f"mesh shape {shape} needs {int(np.prod(shape))} devices, have {num_devices}"
        )
    return shape


def create_mesh(
    shape: Sequence[int] = (-1, 1, 1), devices: Sequence[jax.Device] | None = None
) -> Mesh:
    """A (data, fsdp, tensor) mesh with `AxisType.Auto` axes (Linen logical constraints need
    Auto: on Explicit axes a constraint acts as an assertion and raises)."""
    devices = list(devices) if devices is not None else jax.devices()
    shape = resolve_mesh_shape(shape, len(devices))
    return jax.make_mesh(
        shape, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES), devices=devices
    )


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Sharding of a [B, ...] input batch: B split over (data, fsdp)."""
    return NamedSharding(mesh, PartitionSpec(("data", "fsdp")))


# ----------------------------------------------------------------------------------------------
# Batches between the host and the devices (the loop and the objectives)


def put_batch(batch: Batch, sharding: NamedSharding, global_batch: int) -> dict[str, jax.Array]:
    """This process's rows [b, ...] → global arrays [global_batch, ...] sharded by `sharding`.

    With several processes each one passes its own rows; `make_array_from_process_local_data`
    puts them in the global rows that the process's devices hold, which the mesh decides: rows
    [p·b, (p+1)·b) for process p when the mesh lists devices in process order, as on CPU.
    The explicit global shape turns a mesh that does not split the batch over the processes
    into an error instead of a silently smaller batch. `global_batch` is the examples' rows;
    arrays of another leading size (packed rows [R, ...] beside labels [B]) are split alike,
    each process holding its 1/n of them.
    """
    n = jax.process_count()
    rows = max(len(v) for v in batch.values())
    if rows * n != global_batch:
        raise ValueError(f"{n} process(es) x {rows} rows is not the batch of {global_batch}")
    if n == 1:
        return jax.device_put(dict(batch), sharding)
    # An explicit transfer; the guard around the loop would count it as implicit.
    with jax.transfer_guard("allow"):
        return {
            k: jax.make_array_from_process_local_data(sharding, v, (len(v) * n, *v.shape[1:]))
            for k, v in batch.items()
        }


def process_rows(batch: Batch) -> dict[str, np.ndarray]:
    """This process's rows [p·B/n, (p+1)·B/n) of a global host batch [B, ...] that every
    process holds whole (fine-tuning features); each array by its own B (packed rows [R, ...]
    and examples [B, ...] alike)."""
    n, p = jax.process_count(), jax.process_index()
    return {k: v[p * (len(v) // n) : (p + 1) * (len(v) // n)] for k, v in batch.items()}


def fetch(tree: PyTree) -> PyTree:
    """Device arrays → host numpy, whole on every process (rows of all processes)."""
    if jax.process_count() == 1:
        return jax.device_get(tree)
    return multihost_utils.process_allgather(tree, tiled=True)
