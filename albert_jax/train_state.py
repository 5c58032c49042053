"""The training state and the update step that `loop.Loop` runs, for any objective.

- `create_state`: parameters and optimizer state created directly in their sharded layout.
  `eval_shape` gives the boxed abstract params, their logical axes map to mesh shardings
  through `LOGICAL_AXIS_RULES`, and `jax.jit(init, out_shardings=...)` materializes each shard
  on its device. Weights the objective brings from elsewhere (`initial_weights`: init_from, a
  pretrained backbone) are placed as they are; only the rest is initialized.
- `make_step`: gradient accumulation over microbatches, the optimizer update, and the gradient
  / parameter norms; the loop jits it with explicit in/out shardings and the state donated.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from albert_jax import optim, trees
from albert_jax.sharding import LOGICAL_AXIS_RULES

PyTree = Any


@flax.struct.dataclass
class TrainState:
    """step: int32 scalar (updates done); params: plain params tree; opt_state: optax state."""

    step: jax.Array
    params: PyTree
    opt_state: PyTree


@dataclasses.dataclass
class StateLayout:
    """The optimizer, abstract state (ShapeDtypeStructs), state shardings and an initializer
    `initialize(loaded={path: host array}) -> TrainState` that places loaded weights and
    initializes the rest on their devices."""

    tx: optax.GradientTransformation
    abstract: TrainState
    shardings: TrainState
    initialize: Callable[..., TrainState]


def create_state(objective: Any, mesh: Mesh, seed: int) -> StateLayout:
    """Sharded state creation for `objective` (its `init_variables` and `make_optimizer`).

    Must run under `jax.set_mesh(mesh)` and `nn.logical_axis_rules(LOGICAL_AXIS_RULES)`.
    """
    rng = jax.random.key(seed)
    boxed = jax.eval_shape(objective.init_variables, rng)
    param_shardings = nn.logical_to_mesh_sharding(
        nn.get_partition_spec(boxed), mesh, LOGICAL_AXIS_RULES
    )
    tx = objective.make_optimizer(boxed)
    # `.value`, not nn.meta.unbox: unbox would add a sharding constraint to a ShapeDtypeStruct.
    abstract_params = jax.tree.map(
        lambda x: x.value if isinstance(x, nn.meta.AxisMetadata) else x,
        boxed,
        is_leaf=lambda x: isinstance(x, nn.meta.AxisMetadata),
    )
    abstract_opt = jax.eval_shape(tx.init, abstract_params)
    replicated = NamedSharding(mesh, PartitionSpec())
    # Moments follow their parameter's sharding; counters and hyperparameters are replicated.
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
        """Fresh state: `loaded` weights as they are, the others as a random init gives them."""
        loaded = loaded or {}
        missing = [k for k in flat_abstract if k not in loaded]

        def init_missing(r: jax.Array) -> dict[str, jax.Array]:
            # XLA drops the initializers of the weights not returned, so loading a backbone
            # costs no random init of it; each returned weight gets a full init's value.
            flat = trees.flatten(nn.meta.unbox(objective.init_variables(r)))
            return {k: flat[k] for k in missing}

        fresh = {}
        if missing:
            out_shardings = {k: flat_shardings[k] for k in missing}
            fresh = jax.jit(init_missing, out_shardings=out_shardings)(rng)
        placed = {
            k: fresh[k] if k in fresh
            else jax.device_put(np.asarray(loaded[k], flat_abstract[k].dtype), flat_shardings[k])
            for k in flat_abstract
        }  # fmt: skip
        params = jax.tree.map(lambda _, x: x, abstract_params, trees.unflatten(placed))
        opt_state = jax.jit(tx.init, out_shardings=opt_shardings)(params)
        return TrainState(jax.device_put(np.int32(0), replicated), params, opt_state)

    return StateLayout(tx, abstract, shardings, initialize)


def make_step(
    loss_fn: Callable[[PyTree, Any, jax.Array], tuple[jax.Array, dict[str, jax.Array]]],
    tx: optax.GradientTransformation,
    *,
    microbatches: int,
    seed: int,
) -> Callable[[TrainState, dict[str, jax.Array]], tuple[TrainState, dict[str, jax.Array]]]:
    """(state, batch) → (state after one update, scalar metrics): `loss_fn`'s metrics plus
    `grad_norm`, `param_norm` and `learning_rate`. Dropout keys are `fold_in(key, step)`."""
    dropout_key = jax.random.key(seed + 1)  # independent of the init key

    def train_step(state: TrainState, batch: dict[str, jax.Array]):
        rng = jax.random.fold_in(dropout_key, state.step)
        grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
        _, metrics, grads = optim.accumulate_gradients(
            grad_fn, state.params, batch, microbatches, rng
        )
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        metrics = {
            **metrics,
            "grad_norm": optax.tree.norm(grads),
            "param_norm": optax.tree.norm(params),
            "learning_rate": optim.current_learning_rate(opt_state),
        }
        return TrainState(step=state.step + 1, params=params, opt_state=opt_state), metrics

    return train_step
