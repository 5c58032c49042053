"""Gradient accumulation: one update's gradient as the mean over microbatches of the batch, so
that a global batch of any size fits any mesh (`config.microbatches`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from albert_jax.trees import path_to_str

PyTree = Any


def _split_microbatches(batch: PyTree, num_microbatches: int) -> PyTree:
    def split(path, x):
        if jnp.ndim(x) == 0 or x.shape[0] % num_microbatches:
            raise ValueError(
                f"num_microbatches={num_microbatches} must divide the leading batch axis of "
                f"batch[{path_to_str(path)!r}] (shape {jnp.shape(x)})"
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
