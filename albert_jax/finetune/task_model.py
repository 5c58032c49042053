"""Fine-tuning's model half (`loop.ModelHalf`): the task kind's model, its init (a pretrained
checkpoint merged into it), the optimizer and the loss, as `finetune.train` trains them and
`albert_jax.plan` compiles them (for a slice, from the config alone: no data, no checkpoint).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
import optax
from absl import logging
from jax.sharding import Mesh

from albert_jax import optim
from albert_jax.finetune.backbone_init import InitReport, merge_pretrained
from albert_jax.finetune.settings import optimizer_config
from albert_jax.sharding import forward_per_replica

PyTree = Any


class TaskModel:
    """The task model, its loss and optimizer (`loop.ModelHalf`).

    Args:
      config: the fine-tuning config (the optimizer's fields, `task`, `init`).
      kind: the task's kind (tasks/kinds.py); `model`: its head on the backbone.
      init_batch: {name: [rows, ...]} the init runs on.
      total_steps: the schedule's length; `num_seeds`: seeds in one program.
      mesh: the mesh the forward runs on once per batch shard (`lay_on`).
      num_labels: the task's labels (saved in `meta`).
      checkpoint: the pretrained checkpoint (`backbone_init.read_init`) or None (scratch);
        `dont_load`: the patterns of its weights not to load (`config.init_dont_load`).
    """

    microbatches = 1
    flops_per_step = None
    eval_reduces = False  # eval_fn returns per-row outputs, scored on the host
    runs = None  # a sweep group's `train_state.Runs` (`sweep.group`)
    progress_fields = (("loss", "loss"), ("acc", "accuracy"))  # regression: the loss alone

    def __init__(
        self,
        config: Any,
        kind: Any,
        model: Any,
        init_batch: Mapping[str, np.ndarray],
        total_steps: int,
        num_seeds: int,
        mesh: Mesh,
        *,
        num_labels: int | None = None,
        checkpoint: Any = None,
        dont_load: Any = (),
    ):
        self.config, self.kind, self.model = config, kind, model
        self.model_config = model.config
        self.task = str(config.task)
        self.init_batch, self.total_steps, self.num_seeds = init_batch, total_steps, num_seeds
        self.num_labels, self.checkpoint, self.dont_load = num_labels, checkpoint, dont_load
        self.report: dict[str, Any] | None = None  # InitReport.as_dict()
        self.lay_on(mesh)

    @classmethod
    def for_plan(
        cls, config: Any, kind: Any, model: Any, batch_shapes: Mapping[str, Any], mesh: Mesh
    ) -> TaskModel:
        """The task model of `config` on `mesh` without its data: the init batch is zeros of
        the kind's shapes ({name: (shape [B, ...], dtype)}) at a row per (data, fsdp) shard;
        the schedule runs `config.num_train_steps`."""
        rows = mesh.shape["data"] * mesh.shape["fsdp"]
        batch = {k: np.zeros((rows, *s[1:]), d) for k, (s, d) in batch_shapes.items()}
        steps = max(int(config.num_train_steps), 1)
        return cls(config, kind, model, batch, steps, int(config.num_seeds), mesh)

    def init_variables(self, rng: jax.Array) -> PyTree:
        return self.kind.init_variables(self.model, rng, self.init_batch)["params"]

    def make_optimizer(
        self, boxed_params: PyTree, per_run: Mapping[str, jax.Array] | None = None
    ) -> optax.GradientTransformation:
        del boxed_params  # AdamW / LAMB with one trust ratio per array
        config = optimizer_config(self.config, self.total_steps)
        return optim.make_optimizer(config, per_run=per_run)

    def initial_weights(self, abstract: Mapping[str, Any]) -> dict[str, Any]:
        """The checkpoint's weights the task model has (reported: loaded / missing, which the
        loop initializes / unexpected)."""
        if self.checkpoint is None:
            self.report = InitReport("", "scratch", [], sorted(abstract), []).as_dict()
            return {}
        if self.num_seeds > 1:  # every seed starts from the same checkpoint weights
            abstract = {k: jax.ShapeDtypeStruct(v.shape[1:], v.dtype) for k, v in abstract.items()}
        loaded, missing, unexpected = merge_pretrained(
            abstract, self.checkpoint.weights, self.dont_load
        )
        source, path = self.checkpoint.source, self.config.init
        self.report = InitReport(path, source, list(loaded), missing, unexpected).as_dict()
        logging.info("init from %s checkpoint %s: %d weights loaded", source, path, len(loaded))
        if missing:
            logging.warning(
                "initialized %d weights the checkpoint lacks: %s", len(missing), missing
            )
        if unexpected:
            logging.warning("%d checkpoint weights unused: %s", len(unexpected), unexpected)
        return loaded

    def restored(self, meta: Mapping[str, Any]) -> None:
        """A resumed run keeps the init report of its first start."""
        self.report = meta.get("init") if isinstance(meta, Mapping) else None

    def meta(self) -> dict[str, Any]:
        from albert_jax.model import heads

        return {"task": self.task, "head": heads.head_name(self.model),
                "num_labels": self.num_labels, "init": self.report}  # fmt: skip

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
