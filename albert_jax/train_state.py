"""The training state and the update step that `loop.Loop` runs, for any objective.

- `create_state`: parameters and optimizer state created directly in their sharded layout.
  `eval_shape` gives the boxed abstract params, their logical axes map to mesh shardings
  through `LOGICAL_AXIS_RULES`, and `jax.jit(init, out_shardings=...)` materializes each shard
  on its device. Weights the objective brings from elsewhere (`initial_weights`: init_from, a
  pretrained backbone) are placed as they are; only the rest is initialized.
- `make_step`: gradient accumulation over microbatches, the optimizer update, and the gradient
  / parameter norms; the loop jits it with explicit in/out shardings and the state donated.

Several seeds in one program (`num_seeds` = N > 1, fine-tuning's `config.num_seeds`): every
parameter and optimizer array gets a leading seed axis (logical axis `seeds`, not sharded: each
device holds every seed of its batch rows), seed i initialized from `key(seed + i)` and its
dropout from `key(seed + i + 1)`, exactly as a one-seed run with `seed + i` would; the update
is the one-seed update under `jax.vmap`, so clipping, the optimizer and the norms stay per seed.
The batch holds the N seeds' rows interleaved (row b of seed i at b * N + i: each data shard
keeps all seeds of its rows, so splitting the axis needs no communication).

A sweep group (`albert_jax.sweep.group`) is the same leading axis seen as runs (`Runs`): each run
its own init seed, its own values of the optimizer's per-run fields (`optim.PER_RUN_FIELDS`:
learning rate, warmup, weight decay, ...; traced scalars inside the vmapped update, so one
program serves them all) and, with `shared_batch`, one batch that every run trains on (the
input pipeline runs once for the group).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from albert_jax import optim, trees
from albert_jax.sharding import LOGICAL_AXIS_RULES, batch_sharding

PyTree = Any
SEED_AXIS = "seeds"  # logical axis of the leading seed axis (replicated: see LOGICAL_AXIS_RULES)


@flax.struct.dataclass
class TrainState:
    """step: int32 scalar (updates done); params: plain params tree; opt_state: optax state."""

    step: jax.Array
    params: PyTree
    opt_state: PyTree


@dataclasses.dataclass
class StateLayout:
    """The optimizer, abstract state (ShapeDtypeStructs), state shardings, an initializer
    `initialize(loaded={path: host array}) -> TrainState` that places loaded weights and
    initializes the rest on their devices, the runs, and `tx_for(per-run values)`: one run's
    optimizer."""

    tx: optax.GradientTransformation
    abstract: TrainState
    shardings: TrainState
    initialize: Callable[..., TrainState]
    runs: Runs
    tx_for: Callable[[Mapping[str, jax.Array] | None], optax.GradientTransformation]


@dataclasses.dataclass(frozen=True)
class Runs:
    """The runs one program trains: a leading axis on the state when there are several.

    seeds: each run's seed (init from `key(seed)`, dropout from `key(seed + 1)`).
    labels: each run's metric suffix (`loss/<label>`): "seed_<seed>" for fine-tuning seeds.
    shared_batch: every run trains on the same rows [B, ...] (a sweep group); else the batch
      holds each run's rows interleaved [B * N, ...] (fine-tuning seeds).
    optimizer_values: {field of optim.PER_RUN_FIELDS: [N] values} where the runs differ, or
      None: one optimizer for all.
    """

    seeds: tuple[int, ...]
    labels: tuple[str, ...]
    shared_batch: bool = False
    optimizer_values: Mapping[str, np.ndarray] | None = None

    @classmethod
    def of_seeds(cls, seed: int, num_seeds: int = 1) -> Runs:
        """Seeds `seed, seed + 1, ..., seed + N - 1` (fine-tuning's `num_seeds`)."""
        seeds = tuple(range(int(seed), int(seed) + int(num_seeds)))
        return cls(seeds, tuple(f"seed_{s}" for s in seeds))

    @property
    def n(self) -> int:
        return len(self.seeds)


def seed_keys(seed: int | Sequence[int], num_seeds: int = 1) -> jax.Array:
    """`key(seed)` for one seed; [N] keys `key(seed + i)` for N seeds (run i = the run of
    `seed + i`), or [N] keys of the N seeds given."""
    seeds = list(seed) if isinstance(seed, Sequence) else list(range(seed, seed + num_seeds))
    if len(seeds) == 1:
        return jax.random.key(seeds[0])
    return jax.vmap(jax.random.key)(jnp.asarray(seeds))


def _per_seed(fn: Callable[..., Any], num_seeds: int) -> Callable[..., Any]:
    return fn if num_seeds == 1 else jax.vmap(fn)


def _with_seed_axis(boxed: PyTree) -> PyTree:
    """Boxed params of a vmapped init: the leading axis named `SEED_AXIS`."""
    return jax.tree.map(
        lambda x: x.add_axis(0, {nn.PARTITION_NAME: SEED_AXIS})
        if isinstance(x, nn.Partitioned) else x,
        boxed,
        is_leaf=lambda x: isinstance(x, nn.meta.AxisMetadata),
    )  # fmt: skip


def create_state(
    objective: Any, mesh: Mesh, seed: int, num_seeds: int = 1, runs: Runs | None = None
) -> StateLayout:
    """Sharded state creation for `objective` (its `init_variables` and `make_optimizer`);
    N > 1 `num_seeds` (or `runs` of N > 1): every array with a leading run axis [N, ...].

    Must run under `jax.set_mesh(mesh)` and `nn.logical_axis_rules(LOGICAL_AXIS_RULES)`.
    Abstract until `initialize` is called: nothing runs on a device here (not even the key),
    so the layout can be made for devices this process cannot run on (`albert_jax.plan`'s
    TPU slice compiled from a CPU machine).
    """
    # A sweep group's objective names its runs; fine-tuning's seeds follow from `seed`.
    runs = runs or getattr(objective, "runs", None) or Runs.of_seeds(seed, num_seeds)
    num_seeds = runs.n
    init_variables = _per_seed(objective.init_variables, num_seeds)
    boxed = jax.eval_shape(lambda: init_variables(seed_keys(runs.seeds)))
    if num_seeds > 1:
        boxed = _with_seed_axis(boxed)
    param_shardings = nn.logical_to_mesh_sharding(
        nn.get_partition_spec(boxed), mesh, LOGICAL_AXIS_RULES
    )
    tx = objective.make_optimizer(boxed)
    values = runs.optimizer_values

    def tx_for(per_run: Mapping[str, jax.Array] | None) -> optax.GradientTransformation:
        """The optimizer of one run: its per-run values (traced) in place of the config's."""
        return tx if per_run is None else objective.make_optimizer(boxed, per_run=per_run)

    if values:  # each run's optimizer state holds its own hyperparameters (weight decay, ...)

        def init_opt(params: PyTree) -> PyTree:
            return jax.vmap(lambda v, p: tx_for(v).init(p))(dict(values), params)
    else:
        init_opt = _per_seed(tx.init, num_seeds)
    # `.value`, not nn.meta.unbox: unbox would add a sharding constraint to a ShapeDtypeStruct.
    abstract_params = jax.tree.map(
        lambda x: x.value if isinstance(x, nn.meta.AxisMetadata) else x,
        boxed,
        is_leaf=lambda x: isinstance(x, nn.meta.AxisMetadata),
    )
    abstract_opt = jax.eval_shape(init_opt, abstract_params)
    replicated = NamedSharding(mesh, PartitionSpec())
    # Moments follow their parameter's sharding; counters and hyperparameters are replicated.
    # Outside the mesh: optax finds the moments by running `tx.init` on placeholders, with
    # concrete scalars that the mesh's devices (perhaps a TPU slice being planned) cannot run.
    with jax.set_mesh(None):
        opt_shardings = optax.tree_map_params(
            tx,
            lambda _, sharding: sharding,
            abstract_opt,
            param_shardings,
            transform_non_params=lambda _: replicated,
            is_leaf=lambda x: isinstance(x, NamedSharding),
        )
    shardings = TrainState(step=replicated, params=param_shardings, opt_state=opt_shardings)
    abstract = TrainState(
        step=jax.ShapeDtypeStruct((), jnp.int32), params=abstract_params, opt_state=abstract_opt
    )
    flat_abstract, flat_shardings = trees.flatten(abstract_params), trees.flatten(param_shardings)

    def initialize(loaded: Mapping[str, Any] | None = None) -> TrainState:
        """Fresh state: `loaded` weights as they are (the same for every seed), the others as
        a random init gives them (each seed its own)."""
        loaded = loaded or {}
        missing = [k for k in flat_abstract if k not in loaded]

        def init_missing(r: jax.Array) -> dict[str, jax.Array]:
            # XLA drops the initializers of the weights not returned, so loading a backbone
            # costs no random init of it; each returned weight gets a full init's value.
            flat = trees.flatten(nn.meta.unbox(objective.init_variables(r)))
            return {k: flat[k] for k in missing}

        def place(name: str) -> jax.Array:
            value = np.asarray(loaded[name], flat_abstract[name].dtype)
            shape = flat_abstract[name].shape
            return jax.device_put(np.broadcast_to(value, shape), flat_shardings[name])

        fresh = {}
        if missing:
            out_shardings = {k: flat_shardings[k] for k in missing}
            init_fn = _per_seed(init_missing, num_seeds)
            fresh = jax.jit(lambda: init_fn(seed_keys(runs.seeds)),
                            out_shardings=out_shardings)()  # fmt: skip
        placed = {k: fresh[k] if k in fresh else place(k) for k in flat_abstract}
        params = jax.tree.map(lambda _, x: x, abstract_params, trees.unflatten(placed))
        opt_state = jax.jit(init_opt, out_shardings=opt_shardings)(params)
        return TrainState(jax.device_put(np.int32(0), replicated), params, opt_state)

    return StateLayout(tx, abstract, shardings, initialize, runs, tx_for)


# ----------------------------------------------------------------------------------------------
# Gradient accumulation: one update's gradient as the mean over microbatches of the batch, so
# that a global batch of any size fits any mesh (`config.microbatches`).


def _split_microbatches(batch: PyTree, num_microbatches: int) -> PyTree:
    def split(path, x):
        if jnp.ndim(x) == 0 or x.shape[0] % num_microbatches:
            raise ValueError(
                f"num_microbatches={num_microbatches} must divide the leading batch axis of "
                f"batch[{trees.path_to_str(path)!r}] (shape {jnp.shape(x)})"
            )
        # Microbatch i takes rows i, i+n, i+2n, ...: with the batch sharded in contiguous blocks
        # over the data axis, every device then keeps an equal, local share of each microbatch
        # (a [n, B/n] split would put whole microbatches on a few devices).
        x = x.reshape((x.shape[0] // num_microbatches, num_microbatches) + x.shape[1:])
        return jnp.swapaxes(x, 0, 1)

    return jax.tree_util.tree_map_with_path(split, batch)


def _accumulation_dtype(x: jax.ShapeDtypeStruct) -> jnp.dtype:
    # Sum in float32 whatever the gradient dtype: adding many bf16 microbatch gradients loses
    # the small ones.
    return jnp.float32 if jnp.issubdtype(x.dtype, jnp.floating) else x.dtype


def accumulate_gradients(
    loss_and_grad_fn: Callable[[PyTree, PyTree, jax.Array | None], tuple[tuple[Any, Any], PyTree]],
    params: PyTree,
    batch: PyTree,
    num_microbatches: int,
    rng: jax.Array | None,
) -> tuple[jax.Array, PyTree, PyTree]:
    """Runs `loss_and_grad_fn` on `num_microbatches` slices of the batch and averages.

    Args:
      loss_and_grad_fn: (params, microbatch, rng) -> ((loss, aux), grads), e.g.
        `jax.value_and_grad(loss_fn, has_aux=True)`.
      params: params pytree.
      batch: pytree of arrays with a common leading batch axis B (divisible by num_microbatches).
      num_microbatches: n ≥ 1; each call sees B/n examples, so peak activation memory is 1/n.
      rng: PRNG key or None; microbatch i gets `fold_in(rng, i)`.
    Returns:
      (loss, aux, grads): means over microbatches of loss, floating aux leaves and grads (integer
      aux leaves, e.g. counts, are summed). For a loss that is a mean over examples this equals
      the full-batch result. The official MLM loss Σw·nll/Σw is averaged per microbatch instead,
      as the official TPU code averages it per core.
    """
    if isinstance(num_microbatches, bool) or not isinstance(num_microbatches, int):
        raise ValueError(f"num_microbatches must be an int, got {num_microbatches!r}")
    if num_microbatches < 1:
        raise ValueError(f"num_microbatches must be >= 1, got {num_microbatches}")
    if num_microbatches == 1:
        (loss, aux), grads = loss_and_grad_fn(params, batch, rng)
        return loss, aux, grads

    microbatches = _split_microbatches(batch, num_microbatches)
    first = jax.tree.map(lambda x: x[0], microbatches)
    out_shape = jax.eval_shape(loss_and_grad_fn, params, first, rng)
    zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, _accumulation_dtype(s)), out_shape)

    def step(total, xs):
        index, microbatch = xs
        key = None if rng is None else jax.random.fold_in(rng, index)
        out = loss_and_grad_fn(params, microbatch, key)
        return jax.tree.map(lambda t, o: t + o.astype(t.dtype), total, out), None

    indices = jnp.arange(num_microbatches)
    total, _ = jax.lax.scan(step, zeros, (indices, microbatches))

    def mean(t, s):
        if jnp.issubdtype(s.dtype, jnp.floating):
            return (t / num_microbatches).astype(s.dtype)
        return t

    (loss, aux), grads = jax.tree.map(mean, total, out_shape)
    return loss, aux, grads


def make_step(
    loss_fn: Callable[[PyTree, Any, jax.Array], tuple[jax.Array, dict[str, jax.Array]]],
    tx: optax.GradientTransformation,
    *,
    microbatches: int,
    seed: int,
    num_seeds: int = 1,
    runs: Runs | None = None,
    tx_for: Callable[[Mapping[str, jax.Array] | None], optax.GradientTransformation] | None = None,
) -> Callable[[TrainState, dict[str, jax.Array]], tuple[TrainState, dict[str, jax.Array]]]:
    """(state, batch) → (state after one update, scalar metrics): `loss_fn`'s metrics plus
    `grad_norm`, `param_norm` and `learning_rate`. Dropout keys are `fold_in(key, step)`.

    N > 1 `num_seeds` (or `runs`): the batch is [B * N, ...] (seeds interleaved, see the module
    docstring) or, with `runs.shared_batch`, [B, ...] for every run; the metrics are each run's
    (`"loss/<label>"`, ...) and, under the plain names, their mean over the runs still finite
    (NaN once every run diverged, which stops the loop), with `seeds_diverged` counting the
    others. `tx_for(values)` is one run's optimizer with its `runs.optimizer_values`.
    """
    runs = runs or Runs.of_seeds(seed, num_seeds)
    values = dict(runs.optimizer_values) if runs.optimizer_values else None

    def update(params, opt_state, step, batch, dropout_key, per_run):
        rng = jax.random.fold_in(dropout_key, step)
        grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
        _, metrics, grads = accumulate_gradients(grad_fn, params, batch, microbatches, rng)
        run_tx = tx if per_run is None or tx_for is None else tx_for(per_run)
        updates, opt_state = run_tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        metrics = {
            **metrics,
            "grad_norm": optax.tree.norm(grads),
            "param_norm": optax.tree.norm(params),
            "learning_rate": optim.current_learning_rate(opt_state),
        }
        return params, opt_state, metrics

    def train_step(state: TrainState, batch: dict[str, jax.Array]):
        # Made while tracing (XLA folds them to constants), not closed over: a device array
        # captured by the step is embedded by copying it to the host, which the loop's
        # transfer guard refuses on an accelerator.
        dropout_keys = seed_keys([s + 1 for s in runs.seeds])  # independent of the init keys
        if runs.n == 1:
            params, opt_state, metrics = update(
                state.params, state.opt_state, state.step, batch, dropout_keys, None
            )
        else:
            if runs.shared_batch:
                rows, batch_axis = batch, None
            else:
                rows = {k: v.reshape(v.shape[0] // runs.n, runs.n, *v.shape[1:])
                        for k, v in batch.items()}  # fmt: skip
                batch_axis = 1
            params, opt_state, metrics = jax.vmap(update, in_axes=(0, 0, None, batch_axis, 0, 0))(
                state.params, state.opt_state, state.step, rows, dropout_keys, values
            )
            metrics = seed_metrics(metrics, runs.labels)
        return TrainState(step=state.step + 1, params=params, opt_state=opt_state), metrics

    return train_step


def jit_step(objective: Any, layout: StateLayout, mesh: Mesh, seed: int) -> Callable:
    """The jitted update of `objective` as every run compiles it (`loop.Loop`, and
    `albert_jax.plan` for a TPU slice): the state in its layout's shardings and donated, the
    batch split over (data, fsdp), the metrics replicated."""
    step = make_step(
        objective.loss,
        layout.tx,
        microbatches=objective.microbatches,
        seed=seed,
        runs=layout.runs,
        tx_for=layout.tx_for,
    )
    return jax.jit(
        step,
        in_shardings=(layout.shardings, batch_sharding(mesh)),
        out_shardings=(layout.shardings, NamedSharding(mesh, PartitionSpec())),
        donate_argnums=0,
    )


def seed_metrics(metrics: Mapping[str, jax.Array], labels: Sequence[str]) -> dict[str, jax.Array]:
    """Per-run metrics {name: [N]} → `name/<label i>` scalars, and under `name` the mean over
    the runs whose loss and norms are finite; `seeds_diverged` counts the rest."""
    finite = jnp.isfinite(metrics["loss"])
    for name in ("grad_norm", "param_norm"):
        finite &= jnp.isfinite(metrics[name])
    count = jnp.sum(finite)
    out: dict[str, jax.Array] = {"seeds_diverged": finite.size - count}
    for name, values in metrics.items():
        out[name] = jnp.sum(jnp.where(finite, values, 0.0)) / count  # 0 / 0: NaN, all diverged
        for i, label in enumerate(labels):
            out[f"{name}/{label}"] = values[i]
    return out
