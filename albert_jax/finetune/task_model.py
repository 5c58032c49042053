"""Fine-tuning's model half for the one loop (`albert_jax.loop`): the task kind's model, its
init, the optimizer and the loss, as `finetune.FineTuning` trains them and `albert_jax.plan`
compiles them (for a slice, from the config alone: no data, no checkpoint read).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
import optax
from jax.sharding import Mesh

from albert_jax import optim
from albert_jax.finetune.settings import optimizer_config
from albert_jax.sharding import forward_per_replica

PyTree = Any


class TaskModel:
    """The task model, its loss and optimizer (`loop.Objective`'s model half).

    Reads, set by the subclass or `for_plan`: `config`, `kind` (tasks/kinds.py), `model` (its
    head on the backbone), `init_batch` ({name: [rows, ...]} the init runs on), `total_steps`
    (the schedule's length) and `num_seeds`.
    """

    microbatches = 1
    config: Any
    kind: Any
    model: Any
    init_batch: Mapping[str, np.ndarray]
    total_steps: int
    num_seeds: int

    def init_variables(self, rng: jax.Array) -> PyTree:
        return self.kind.init_variables(self.model, rng, self.init_batch)["params"]

    def make_optimizer(
        self, boxed_params: PyTree, per_run: Mapping[str, jax.Array] | None = None
    ) -> optax.GradientTransformation:
        del boxed_params  # AdamW / LAMB with one trust ratio per array
        config = optimizer_config(self.config, self.total_steps)
        return optim.make_optimizer(config, per_run=per_run)

    def loss(self, params: PyTree, batch: Mapping[str, jax.Array], rng: jax.Array):
        return self.kind.loss(self._forward(params, batch, rng), batch)

    def _forward(self, params: PyTree, batch: Mapping[str, jax.Array], rng: jax.Array):
        """The kind's training outputs, rows [B, ...]."""
        return self.kind.apply(self.model, params, batch, train=True, rng=rng)

    def lay_on(self, mesh: Mesh) -> None:
        """The forward pass runs once per batch shard (one gradient reduction per weight:
        `sharding.forward_per_replica`), except on packed batches: their `cls_index` [B]
        points into the rows of the whole batch, which one shard does not hold, so those
        keep the automatic program (each use of a weight reduced on its own)."""
        dtype = self.config.get("mesh", {}).get("gradient_reduction_dtype", "float32")
        whole, per_shard = self._forward, forward_per_replica(self._forward, mesh, dtype)

        def forward(params: PyTree, batch: Mapping[str, jax.Array], rng: jax.Array):
            return (whole if "cls_index" in batch else per_shard)(params, batch, rng)

        self._forward = forward

    def eval_fn(self, params: PyTree, batch: Mapping[str, jax.Array]) -> dict[str, jax.Array]:
        """The kind's outputs [B, ...]; N seeds: [B, N, ...] (rows stay the sharded axis)."""
        predict = lambda p: self.kind.apply(self.model, p, batch, train=False)  # noqa: E731
        return predict(params) if self.num_seeds == 1 else jax.vmap(predict, out_axes=1)(params)

    @classmethod
    def for_plan(
        cls, config: Any, kind: Any, model: Any, batch_shapes: Mapping[str, Any], mesh: Mesh
    ) -> TaskModel:
        """The task model of `config` on `mesh` without its data: the init batch is zeros of
        the kind's shapes ({name: (shape [B, ...], dtype)}) at a row per (data, fsdp) shard;
        the schedule runs `config.num_train_steps`."""
        self = cls()
        self.config, self.kind, self.model = config, kind, model
        self.lay_on(mesh)
        rows = mesh.shape["data"] * mesh.shape["fsdp"]
        self.init_batch = {k: np.zeros((rows, *s[1:]), d) for k, (s, d) in batch_shapes.items()}
        self.total_steps = max(int(config.num_train_steps), 1)
        self.num_seeds = int(config.num_seeds)
        return self
