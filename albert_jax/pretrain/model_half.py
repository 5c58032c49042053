"""Pretraining's model half (`loop.ModelHalf`): `AlbertForPreTraining`, its init, LAMB with a
per-layer trust ratio for stacked weights, the MLM + SOP loss and the held-out evaluation sums;
what the loop, `albert_jax.plan` and the benchmarks compile.

One step (paper Sec. 4.1): a global batch of masked sequence pairs → `AlbertForPreTraining` →
MLM + SOP (or NSP) loss → global-norm clip → LAMB → new params. The forward pass runs once per
batch shard (`sharding.forward_per_replica`): one gradient reduction per shared weight.

A new pretraining objective (say ELECTRA's replaced-token detection) is another class with
these methods beside this one; docs/architecture.md lists the files it touches.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import optax
from absl import logging
from jax.sharding import Mesh

from albert_jax import metrics_writer, optim, train_state
from albert_jax.model import flops, losses
from albert_jax.model.albert import AlbertForPreTraining, init_params
from albert_jax.pretrain.heldout import make_eval_step, model_inputs
from albert_jax.resume import load_params_only
from albert_jax.sharding import forward_per_replica

PyTree = Any


class PretrainingModel:
    """The model half of pretraining (`loop.ModelHalf`).

    Args:
      model: the `AlbertForPreTraining` to train.
      optimizer: the checked optimizer fields (`optim.optimizer_values`).
      sentence_order: whether the loss has the SOP / NSP term (`config.objective != "none"`).
      masked_lm: whether any token is masked (`config.data.masked_lm_prob > 0`); else no MLM
        term and no mlm_* metrics.
      microbatches: gradient accumulation steps per update.
      flops_per_step: model FLOPs of one update over the global batch (`train_step_flops`).
      init_from: a checkpoint whose params start a fresh run ("" none).
      mesh: the mesh the forward runs on once per batch shard (None: one program; the init's
        dummy batch then has one row).
      reduction_dtype: dtype of the gradient reduction (`config.mesh.gradient_reduction_dtype`).
      runs: a sweep group's runs (`train_state.Runs`) trained as one program: the state gets a
        leading run axis, one held-out pass scores every run, each does a step's FLOPs.
    """

    eval_reduces = True  # eval_fn returns weighted sums over the batch
    task = None  # not a fine-tuning task
    progress_fields = metrics_writer.PRETRAINING_FIELDS

    def __init__(
        self,
        model: AlbertForPreTraining,
        optimizer: Mapping[str, Any],
        *,
        sentence_order: bool = True,
        masked_lm: bool = True,
        microbatches: int = 1,
        flops_per_step: float | None = None,
        init_from: str = "",
        mesh: Mesh | None = None,
        reduction_dtype: str = "float32",
        runs: train_state.Runs | None = None,
    ):
        self.model, self.model_config, self.optimizer = model, model.config, optimizer
        self.sentence_order, self.masked_lm = sentence_order, masked_lm
        self.microbatches, self.flops_per_step = microbatches, flops_per_step
        self.init_from = init_from
        self.init_rows = mesh.shape["data"] * mesh.shape["fsdp"] if mesh is not None else 1
        self._eval_sums = make_eval_step(model, sentence_order=sentence_order)
        self.runs, self.num_seeds = runs, runs.n if runs is not None else 1
        if runs is not None:  # one held-out pass scores every run: sums with a run axis
            self._eval_sums = jax.vmap(self._eval_sums, in_axes=(0, None))
            if flops_per_step is not None:
                self.flops_per_step = flops_per_step * runs.n
        if mesh is not None:  # once per batch shard: one gradient reduction per weight
            self._forward = forward_per_replica(self._forward, mesh, reduction_dtype)

    @classmethod
    def from_settings(
        cls, settings: Any, mesh: Mesh | None = None, runs: train_state.Runs | None = None
    ) -> PretrainingModel:
        """The model half of a validated run (`pretrain.settings.PretrainingSettings`)."""
        return cls(
            AlbertForPreTraining(settings.model_config),
            settings.optimizer,
            sentence_order=settings.data.objective != "none",
            masked_lm=settings.data.masked_lm_prob > 0,
            microbatches=settings.microbatches,
            flops_per_step=train_step_flops(
                settings.model_config,
                settings.data.batch_size,
                settings.data.seq_len,
                settings.data.max_predictions_per_seq,
            ),  # fmt: skip
            init_from=settings.loop.init_from,
            mesh=mesh,
            reduction_dtype=settings.mesh.gradient_reduction_dtype,
            runs=runs,
        )

    @classmethod
    def from_config(
        cls, config: Any, model: AlbertForPreTraining, mesh: Mesh | None = None
    ) -> PretrainingModel:
        """The model half of a config compiled without a run (the benchmarks, the tests)."""
        return cls(
            model,
            optim.optimizer_values(config),
            sentence_order=config.objective != "none",
            masked_lm=float(config.data.masked_lm_prob) > 0,
            microbatches=int(config.microbatches),
            mesh=mesh,
            reduction_dtype=config.mesh.get("gradient_reduction_dtype", "float32"),
        )

    def init_variables(self, rng: jax.Array) -> PyTree:
        return init_params(self.model, rng, batch_size=self.init_rows, seq_len=8)["params"]

    def make_optimizer(
        self, boxed_params: PyTree, per_run: Mapping[str, jax.Array] | None = None
    ) -> optax.GradientTransformation:
        # LAMB's trust ratio is per layer for stacked (unshared) weights, read off the axes.
        stacked = optim.stacked_from_logical_axes(boxed_params)
        return optim.make_optimizer(self.optimizer, stacked=stacked, per_run=per_run)

    def initial_weights(self, abstract: Mapping[str, Any]) -> dict[str, Any]:
        """`init_from`'s params (params-only init), or {} for a random init."""
        if not self.init_from:
            return {}
        logging.info("params initialized from %s", self.init_from)
        return load_params_only(self.init_from, abstract)

    def restored(self, meta: Mapping[str, Any]) -> None:
        del meta  # everything of a resumed run is in its state

    def meta(self) -> dict[str, Any]:
        return {}

    def loss(self, params: PyTree, batch: Mapping[str, jax.Array], rng: jax.Array):
        outputs = self._forward(params, batch, rng)
        return losses.pretraining_loss(
            outputs, batch, sentence_order=self.sentence_order, masked_lm=self.masked_lm
        )

    def _forward(self, params: PyTree, batch: Mapping[str, jax.Array], rng: jax.Array):
        """{"mlm_logits": [B, P, V], "sop_logits": [B, 2]} of a training batch."""
        outputs = self.model.apply(
            {"params": params},
            *model_inputs(batch),
            deterministic=False,
            return_sequence_output=False,  # last layer only where the heads read
            rngs={"dropout": rng},
        )
        return {k: outputs[k] for k in ("mlm_logits", "sop_logits") if k in outputs}

    def eval_fn(self, params: PyTree, batch: Mapping[str, jax.Array]) -> dict[str, jax.Array]:
        """Weighted sums over the batch (`heldout.make_eval_step`)."""
        return self._eval_sums(params, batch)


# ----------------------------------------------------------------------------------------------
# What the benchmarks, `plan` and the tests compile: the loop's state and step


def create_train_state(
    config: Any, model: AlbertForPreTraining, mesh: Mesh
) -> tuple[optax.GradientTransformation, Any, Any, Callable[..., Any]]:
    """(optimizer, abstract state, state shardings, initializer) of the pretraining state, as
    the loop creates it (benchmarks and tests compile the same state). Must run under
    `jax.set_mesh(mesh)` and `nn.logical_axis_rules(LOGICAL_AXIS_RULES)`."""
    half = PretrainingModel.from_config(config, model, mesh)
    layout = train_state.create_state(half, mesh, int(config.seed))
    return layout.tx, layout.abstract, layout.shardings, layout.initialize


def make_train_step(
    config: Any, model: AlbertForPreTraining, tx: optax.GradientTransformation
) -> Callable:
    """(state, batch) → (state after one LAMB update, scalar metrics): the step the loop runs."""
    half = PretrainingModel.from_config(config, model)
    return train_state.make_step(
        half.loss, tx, microbatches=half.microbatches, seed=int(config.seed)
    )


def pretraining_batch_shapes(B: int, S: int, P: int) -> dict[str, tuple[tuple[int, ...], Any]]:
    """{name: (shape, dtype)} of a pretraining batch of B sequences of S tokens with P
    predictions each (the batch contract of the data pipeline)."""
    return {
        "input_ids": ((B, S), jnp.int32),
        "segment_ids": ((B, S), jnp.int32),
        "input_mask": ((B, S), jnp.int32),
        "masked_lm_positions": ((B, P), jnp.int32),
        "masked_lm_ids": ((B, P), jnp.int32),
        "masked_lm_weights": ((B, P), jnp.float32),
        "sentence_order_label": ((B,), jnp.int32),
    }


def train_step_flops(
    model_config: Any, batch_size: int, seq_len: int, max_predictions_per_seq: int
) -> float:
    """Model FLOPs of one `make_train_step` step over the global batch. The step asks for
    `return_sequence_output=False`, so the last layer runs at the 1 + P rows the heads read
    ([CLS] and the masked positions) and is counted there (`albert_jax.model.flops`)."""
    return flops.train_flops_per_step(
        model_config,
        batch_size,
        seq_len,
        max_predictions_per_seq,
        last_layer_positions=1 + max_predictions_per_seq,
    )
