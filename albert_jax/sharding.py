"""Mesh construction, the one table that maps logical axes to mesh axes, and batches between
the host and the devices.

Mesh axes: `data` (replicas), `fsdp` (parameters and optimizer state sharded, batch split too),
`tensor` (heads / mlp / vocab split). Parameter names (`vocab, embed, embed_factor, mlp, heads,
kv, layers`) and activation names (`act_batch, act_seq, act_embed, act_mlp`) are kept apart so
that FSDP-sharding the `embed` dim of weights never shards the feature dim of activations.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from absl import logging
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
    shape: Sequence[int] = (-1, 1, 1),
    devices: Sequence[jax.Device] | None = None,
    slices: int = 0,
) -> Mesh:
    """A (data, fsdp, tensor) mesh with `AxisType.Auto` axes (Linen logical constraints need
    Auto: on Explicit axes a constraint acts as an assertion and raises).

    `slices` (`config.mesh.slices`; 0: as many as the devices' `slice_index` says) > 1 lays
    the data axis across groups joined by the slower network, fsdp and tensor inside each
    group: TPU slices of a multi-slice job (`slice_mesh`), or, where devices have no slice
    (CPU and GPU hosts), the processes, one group each (`process_is_granule`).

    Raises:
      ValueError: `slices` that the devices' slices or processes or the data axis do not
        match, naming config.mesh.slices.
    """
    devices = list(devices) if devices is not None else jax.devices()
    shape = resolve_mesh_shape(shape, len(devices))
    if int(slices) < 0:
        raise ValueError(f"config.mesh.slices={slices} must be >= 0 (0: as the devices say)")
    found = slice_count(devices)
    slices = int(slices) or found
    if found > 1 and slices != found:
        raise ValueError(
            f"config.mesh.slices={slices} but the devices span {found} TPU slices; set it to "
            f"{found} or 0 (as the devices say)"
        )
    if slices == 1:
        return jax.make_mesh(
            shape, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES), devices=devices
        )
    by_process = found == 1  # no TPU slices: the processes are the groups
    processes = len({d.process_index for d in devices})
    if by_process and processes != slices:
        raise ValueError(
            f"config.mesh.slices={slices}: without TPU slices each group is a process, and "
            f"this job has {processes}"
        )
    mesh = slice_mesh(shape, devices, slices, by_process=by_process)
    if by_process:
        logging.info("mesh %s: the data axis spans %d process groups of %s", shape, slices,
                     (shape[0] // slices, *shape[1:]))  # fmt: skip
    return mesh


def slice_count(devices: Sequence[Any]) -> int:
    """How many TPU slices `devices` span (their `slice_index`; 1 where devices have none:
    CPU, GPU, a single slice)."""
    return len({getattr(d, "slice_index", 0) for d in devices})


def slice_mesh(
    shape: Sequence[int], devices: Sequence[Any], num_slices: int = 1, by_process: bool = False
) -> Mesh:
    """A (data, fsdp, tensor) mesh of `shape` over TPU slice devices, laid on the physical
    torus (`mesh_utils`); with several slices the data axis spans them (over the data-center
    network: one gradient reduction a step) and fsdp / tensor stay inside each slice.
    `by_process`: the groups are the processes, not TPU slices (mesh_utils' process granules:
    CPU and GPU hosts, whose devices have no `slice_index`).

    Raises:
      ValueError: a data size that the slices do not divide.
    """
    from jax.experimental import mesh_utils

    shape = tuple(shape)
    if num_slices == 1:
        grid = mesh_utils.create_device_mesh(shape, devices, allow_split_physical_axes=True)
    else:
        if shape[0] % num_slices:
            raise ValueError(
                f"mesh (data, fsdp, tensor)={shape}: data={shape[0]} must be a multiple of the "
                f"{num_slices} slices (data parallelism spans slices)"
            )
        ici = (shape[0] // num_slices, *shape[1:])
        grid = mesh_utils.create_hybrid_device_mesh(
            ici,
            (num_slices, 1, 1),
            devices,
            process_is_granule=by_process,
            allow_split_physical_axes=True,
        )
    return Mesh(grid, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


def slice_groups(mesh: Mesh, slices: int = 0) -> int:
    """How many groups joined by the slower network the data axis of `mesh` spans: its
    devices' TPU slices, or `slices` (config.mesh.slices: process groups on CPU / GPU)."""
    return max(int(slices), slice_count(list(mesh.devices.flat)))


REDUCTION_DTYPES = ("float32", "bfloat16")  # config.mesh.gradient_reduction_dtype


def forward_per_replica(
    forward: Callable[..., Any], mesh: Mesh, reduce_dtype: str = "float32"
) -> Callable:
    """`forward(params, batch, rng)` → outputs [B, ...], run once per batch shard: manual
    over the batch axes `data` and `fsdp` (`jax.shard_map`; `tensor` stays automatic), where
    the mesh splits the batch; else `forward` itself.

    Why: under the automatic partitioner each use of a weight gets its gradient reduced on
    its own — the shared block once per layer application (inside the scanned backward loop,
    and again in the split-off last layer or in each unrolled layer of fine-tuning), the word
    embeddings in the lookup and the tied decoder — and an FSDP weight is gathered again for
    every application. Here the params enter the replica once (`_enter`): gathered over
    `fsdp` at the boundary, once for the step's forward and backward, so the backward pass
    sums every use inside the replica, and each weight's sum leaves by one all-reduce over
    (data, fsdp), in `reduce_dtype` (config.mesh.gradient_reduction_dtype); the result is
    sliced to the weight's FSDP shard (the TPU compiler makes some of these a reduce-scatter,
    keeps others an all-reduce). The collectives are written as psums: a reduce-scatter or
    all-gather inside the region would first gather the weight whole over the automatic
    `tensor` axis (measured: xxlarge on a v3-512 gathered f32 weights over `tensor`).

    Where `data` spans several slices, the TPU compiler splits each sum over `data` into a
    sum inside each slice and one across slices of each device's share. (Written as a
    reduce-scatter and an all-gather over `data` instead, more crossed: 1.67 against 1.28
    shares of base's gradient on 2 x v5p-32.)

    The loss stays outside, on the global batch: its normalizers (Σ weights) are global and
    the step's numbers those of the automatic program up to the order of sums. Dropout keys
    are folded with the shard's index (the masks differ from one device's, not their law).
    """
    axes = tuple(a for a in ("data", "fsdp") if mesh.shape[a] > 1)
    if not axes:
        return forward
    import flax.linen as nn

    dtype = jax.numpy.dtype(reduce_dtype)
    rounded = None
    if mesh.devices.flat[0].platform == "cpu" and dtype != jax.numpy.float32:
        # XLA:CPU aborts on this all-reduce in bfloat16 (hlo_instruction.cc: "Invalid binary
        # instruction opcode copy"): on CPU devices (tests, a host's run) each partial sum
        # is rounded to bfloat16 and the sum runs in float32.
        dtype, rounded = jax.numpy.dtype(jax.numpy.float32), dtype
    enter = functools.partial(_enter, dtype=dtype, rounded=rounded)

    def replica(params: PyTree, batch: PyTree, rng: jax.Array) -> PyTree:
        rng = jax.random.fold_in(rng, jax.lax.axis_index(axes))
        params = jax.tree.map(enter, params)
        # Inside, data and fsdp are manual: a constraint may name only the automatic axes.
        rules = tuple((name, _without_manual(a)) for name, a in nn.get_logical_axis_rules())
        with nn.logical_axis_rules(rules):
            return forward(params, batch, rng)

    rows = PartitionSpec(("data", "fsdp"))
    return jax.shard_map(replica, mesh=mesh, in_specs=(PartitionSpec(), rows, PartitionSpec()),
                         out_specs=rows, axis_names={"data", "fsdp"})  # fmt: skip


def _enter(param: jax.Array, dtype: Any, rounded: Any = None) -> jax.Array:
    """A whole parameter → the same in every replica (varying over data and fsdp); its
    gradient, summed over the replica's uses, leaves as one sum over (data, fsdp) in `dtype`
    (`rounded`: each partial sum rounded to that dtype first)."""

    def vary(x):
        return jax.lax.pcast(x, ("data", "fsdp"), to="varying")

    def reduce(_, g):
        g = g.astype(dtype) if rounded is None else g.astype(rounded).astype(dtype)
        g = jax.lax.psum(g, ("data", "fsdp"))
        return (g.astype(param.dtype),)

    enter = jax.custom_vjp(vary)
    enter.defvjp(lambda x: (vary(x), None), reduce)
    return enter(param)


def _without_manual(axes: str | tuple[str, ...] | None) -> str | tuple[str, ...] | None:
    if isinstance(axes, tuple):
        kept = tuple(a for a in axes if a not in ("data", "fsdp"))
        return kept if len(kept) > 1 else (kept[0] if kept else None)
    return None if axes in ("data", "fsdp") else axes


# ----------------------------------------------------------------------------------------------
# Which meshes can shard a model, and the one the automatic layout picks

ParamAxes = Mapping[str, tuple[tuple[int, ...], tuple[str | None, ...]]]  # name -> (shape, axes)


def param_axes(boxed: PyTree) -> dict[str, tuple[tuple[int, ...], tuple[str | None, ...]]]:
    """{"a/b/kernel": (shape, logical axis names)} of a boxed (logical-axis annotated) params
    tree, abstract or not."""
    import flax.linen as nn

    out = {}
    leaves = jax.tree_util.tree_leaves_with_path(
        boxed, is_leaf=lambda x: isinstance(x, nn.meta.AxisMetadata)
    )
    for path, leaf in leaves:
        name = "/".join(str(getattr(k, "key", getattr(k, "name", k))) for k in path)
        value = leaf.value if isinstance(leaf, nn.meta.AxisMetadata) else leaf
        names = tuple(leaf.names) if isinstance(leaf, nn.Partitioned) else (None,) * value.ndim
        out[name] = (tuple(value.shape), names)
    return out


def unshardable(params: ParamAxes, mesh_shape: Sequence[int]) -> list[str]:
    """Why `mesh_shape` (data, fsdp, tensor) cannot shard these params evenly: one line per
    parameter dimension whose size its mesh axes do not divide (empty: it can). The logical
    axes map to mesh axes as the state's shardings do (flax, `LOGICAL_AXIS_RULES`)."""
    import flax.linen as nn

    sizes = dict(zip(MESH_AXES, mesh_shape, strict=True))
    problems = []
    for name, (shape, names) in params.items():
        spec = nn.logical_to_mesh_axes(names, LOGICAL_AXIS_RULES)
        for dim, (size, logical, target) in enumerate(zip(shape, names, spec, strict=True)):
            axes = () if target is None else (target,) if isinstance(target, str) else target
            split = int(np.prod([sizes[a] for a in axes])) if axes else 1
            if size % split:
                where = "×".join(f"{a}={sizes[a]}" for a in axes)
                problems.append(
                    f"{name} dimension {dim} ({logical}, size {size}) is not divisible by "
                    f"mesh axis {where}"
                )
    return problems


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def choose_mesh_shape(
    params: ParamAxes,
    num_devices: int,
    batch_rows: int,
    state_bytes_per_param: float,
    hbm_bytes: float | None,
) -> tuple[tuple[int, int, int], str]:
    """The automatic (data, fsdp, tensor) layout of a model on `num_devices` devices, and why.

    The least model parallelism that works: tensor parallelism only as far as the batch
    (`batch_rows`, split over data × fsdp) or the parameters' divisibility need; FSDP only as
    far as memory needs: the training state (`state_bytes_per_param` a parameter: weights,
    gradients, optimizer moments) may take a quarter of `hbm_bytes` per device, the rest is
    left to activations (None: no limit known, e.g. a CPU host). Every sharded dimension must
    split evenly (`unshardable`).

    Raises:
      ValueError: no layout of `num_devices` shards this model and batch.
    """
    total = sum(int(np.prod(shape)) for shape, _ in params.values())
    budget = None if hbm_bytes is None else hbm_bytes / 4
    fallback = None
    for tensor in _divisors(num_devices):
        if batch_rows % (num_devices // tensor):
            continue
        for fsdp in _divisors(num_devices // tensor):
            shape = (num_devices // tensor // fsdp, fsdp, tensor)
            if unshardable(params, shape):
                continue
            per_device = total * state_bytes_per_param / (fsdp * tensor)
            why = (
                f"auto mesh (data, fsdp, tensor)={shape}: training state "
                f"{per_device / 2**30:.2f} GiB a device"
            )
            if budget is None or per_device <= budget:
                limit = "" if budget is None else f" <= 1/4 of {hbm_bytes / 2**30:.2f} GiB HBM"
                return shape, why + limit
            if fallback is None or per_device < fallback[2]:  # the least state a device
                fallback = (shape, why + f" > 1/4 of {hbm_bytes / 2**30:.2f} GiB HBM even "
                            "at the most sharding that divides the model", per_device)  # fmt: skip
    if fallback is not None:
        return fallback[0], fallback[1]
    raise ValueError(
        f"no (data, fsdp, tensor) layout of {num_devices} devices splits a batch of "
        f"{batch_rows} rows and shards every parameter evenly; change batch_size or the slice"
    )


def shard_bytes(tree: PyTree) -> int:
    """Bytes of one device's shard of every array in `tree` (arrays or ShapeDtypeStructs with
    shardings)."""
    total = 0
    for leaf in jax.tree_util.tree_leaves(tree):
        shape = leaf.sharding.shard_shape(leaf.shape)
        total += int(np.prod(shape)) * np.dtype(leaf.dtype).itemsize
    return total


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
