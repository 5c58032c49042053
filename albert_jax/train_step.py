"""Pretraining's model half for the one loop (`albert_jax.loop`): the model, its init, LAMB,
the MLM + SOP loss, the evaluation sums, and the step's FLOPs.

One step (paper Sec. 4.1): a global batch of masked sequence pairs → `AlbertForPreTraining`
→ MLM + SOP (or NSP) loss → global-norm clip → LAMB with a per-layer trust ratio → new
params. `create_train_state` / `make_train_step` give benchmarks and tests the state and step
the loop compiles.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.experimental import multihost_utils
from jax.sharding import Mesh

from albert_jax import flops, losses, optim, train_state
from albert_jax.data.instances import PAIR_KINDS
from albert_jax.model import AlbertForPreTraining, init_params
from albert_jax.sharding import forward_per_replica

PyTree = Any


def majority_accuracies(
    batches: list[Mapping[str, np.ndarray]], vocab_size: int
) -> dict[str, float]:
    """Accuracy of always predicting the most frequent masked token / SOP label of these
    batches: an upper bound on any constant predictor, the baseline the model must beat.

    Counts every process's batches (the counts are summed over processes) and only real
    sequences (`example_weight` > 0, padding rows have no prediction either).
    """
    ids = np.concatenate([b["masked_lm_ids"].ravel() for b in batches])
    weights = np.concatenate([b["masked_lm_weights"].ravel() for b in batches])
    labels = np.concatenate([b["sentence_order_label"] for b in batches])
    real = np.concatenate(
        [b.get("example_weight", np.ones(len(b["sentence_order_label"]))) for b in batches]
    )
    token_counts = np.bincount(ids[weights > 0], minlength=vocab_size)[:vocab_size]
    label_counts = np.bincount(labels[real > 0], minlength=2)[:2]
    counts = np.concatenate([token_counts, label_counts]).astype(np.int64)
    if jax.process_count() > 1:
        counts = np.asarray(multihost_utils.process_allgather(counts)).sum(axis=0)
    token_counts, label_counts = counts[:vocab_size], counts[vocab_size:]
    baselines = {}  # none from padding alone
    if token_counts.sum():
        baselines["eval_mlm_majority_accuracy"] = float(token_counts.max() / token_counts.sum())
    if label_counts.sum():
        baselines["eval_sop_majority_accuracy"] = float(label_counts.max() / label_counts.sum())
    return baselines


# ----------------------------------------------------------------------------------------------
# Model, loss and evaluation


class PretrainingModel:
    """The model half of the pretraining objective: `AlbertForPreTraining`, its init, LAMB
    (per-layer trust ratio for stacked weights) and the MLM + SOP loss; what `loop.Loop`
    compiles. `mesh` sizes the init's dummy batch so that it splits over the data axes."""

    num_seeds = 1  # one run per program (seeds in one program are for fine-tuning)

    def __init__(self, config: Any, model: AlbertForPreTraining, mesh: Mesh | None = None):
        self.config, self.model = config, model
        self.init_rows = mesh.shape["data"] * mesh.shape["fsdp"] if mesh is not None else 1
        self.sentence_order = config.objective != "none"
        self.microbatches = int(config.microbatches)
        self._eval_sums = make_eval_step(config, model)
        if mesh is not None:  # across slices: once per data replica (one gradient reduction)
            slices = int(config.get("mesh", {}).get("slices", 0))
            self._forward = forward_per_replica(self._forward, mesh, slices)

    def init_variables(self, rng: jax.Array) -> PyTree:
        return init_params(self.model, rng, batch_size=self.init_rows, seq_len=8)["params"]

    def make_optimizer(self, boxed_params: PyTree) -> optax.GradientTransformation:
        # LAMB's trust ratio is per layer for stacked (unshared) weights, read off the axes.
        stacked = optim.stacked_from_logical_axes(boxed_params)
        return optim.make_optimizer(self.config, stacked=stacked)

    def loss(self, params: PyTree, batch: Mapping[str, jax.Array], rng: jax.Array):
        outputs = self._forward(params, batch, rng)
        return losses.pretraining_loss(outputs, batch, sentence_order=self.sentence_order)

    def _forward(self, params: PyTree, batch: Mapping[str, jax.Array], rng: jax.Array):
        """{"mlm_logits": [B, P, V], "sop_logits": [B, 2]} of a training batch."""
        outputs = self.model.apply(
            {"params": params},
            *_model_inputs(batch),
            deterministic=False,
            return_sequence_output=False,  # last layer only where the heads read
            rngs={"dropout": rng},
        )
        return {k: outputs[k] for k in ("mlm_logits", "sop_logits") if k in outputs}

    def eval_fn(self, params: PyTree, batch: Mapping[str, jax.Array]) -> dict[str, jax.Array]:
        return self._eval_sums(params, batch)


def create_train_state(
    config: Any, model: AlbertForPreTraining, mesh: Mesh
) -> tuple[optax.GradientTransformation, Any, Any, Callable[..., Any]]:
    """(optimizer, abstract state, state shardings, initializer) of the pretraining state, as
    the loop creates it (benchmarks and tests compile the same state). Must run under
    `jax.set_mesh(mesh)` and `nn.logical_axis_rules(LOGICAL_AXIS_RULES)`."""
    layout = train_state.create_state(PretrainingModel(config, model, mesh), mesh, int(config.seed))
    return layout.tx, layout.abstract, layout.shardings, layout.initialize


def make_train_step(
    config: Any, model: AlbertForPreTraining, tx: optax.GradientTransformation
) -> Callable:
    """(state, batch) → (state after one LAMB update, scalar metrics): the step the loop runs."""
    objective = PretrainingModel(config, model)
    return train_state.make_step(
        objective.loss, tx, microbatches=objective.microbatches, seed=int(config.seed)
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


def _model_inputs(batch: Mapping[str, jax.Array]) -> tuple[jax.Array, ...]:
    return (
        batch["input_ids"],
        batch["segment_ids"],
        batch["input_mask"],
        batch["masked_lm_positions"],
    )


def train_step_flops(
    model_config: Any, batch_size: int, seq_len: int, max_predictions_per_seq: int
) -> float:
    """Model FLOPs of one `make_train_step` step over the global batch. The step asks for
    `return_sequence_output=False`, so the last layer runs at the 1 + P rows the heads read
    ([CLS] and the masked positions) and is counted there (`albert_jax.flops`)."""
    return flops.train_flops_per_step(
        model_config,
        batch_size,
        seq_len,
        max_predictions_per_seq,
        last_layer_positions=1 + max_predictions_per_seq,
    )


def _label_log_probs(logits: jax.Array, labels: jax.Array) -> jax.Array:
    """log p(label) in float32 for logits [..., C] and labels [...] → [...] (NaN for an
    out-of-range label, as `losses` does: a bad label must not pass as a clamped class)."""
    log_probs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    picked = jnp.take_along_axis(log_probs, labels.astype(jnp.int32)[..., None], -1, mode="fill")
    return picked[..., 0]


def make_eval_step(
    config: Any, model: AlbertForPreTraining, *, sentence_order: bool | None = None
) -> Callable:
    """(params, batch) → weighted sums over the batch, so that batches of any count (and
    padding rows, weight 0) combine exactly.

    `batch` is a training batch plus `example_weight [B] float32` (1 real, 0 padding); padding
    rows have no MLM prediction either (`masked_lm_weights` 0). The SOP sums are split by label
    (`sop_sequences_by_label`, `sop_correct_by_label` [2]) and, when the batch has `pair_kind`
    [B], by the kind of pair (`sop_sequences_by_kind`, `sop_correct_by_kind` [K], K =
    len(PAIR_KINDS)); a batch without it gives the totals only.

    `sentence_order`: whether the SOP / NSP head is measured (default: when the objective has
    one); the cross-evaluation of `analysis.sop_table` measures an MLM-only model's head too.
    """
    if sentence_order is None:
        sentence_order = config.objective != "none"

    def eval_step(params: PyTree, batch: dict[str, jax.Array]) -> dict[str, jax.Array]:
        outputs = model.apply(
            {"params": params}, *_model_inputs(batch), return_sequence_output=False
        )
        weights = batch["masked_lm_weights"].astype(jnp.float32)  # [B, P]
        mlm_nll = -_label_log_probs(outputs["mlm_logits"], batch["masked_lm_ids"])
        mlm_hit = jnp.argmax(outputs["mlm_logits"], axis=-1) == batch["masked_lm_ids"]
        example = batch["example_weight"].astype(jnp.float32)  # [B]
        sums = {
            # `where`, not a product: a padding slot's value never reaches the sums.
            "mlm_loss": jnp.sum(jnp.where(weights > 0, weights * mlm_nll, 0.0)),
            "mlm_correct": jnp.sum(jnp.where(mlm_hit, weights, 0.0)),
            "predictions": jnp.sum(weights),
            "sequences": jnp.sum(example),
        }
        if sentence_order:  # MLM only: no SOP sums, and so no SOP metric from nothing
            labels = batch["sentence_order_label"]
            sop_nll = -_label_log_probs(outputs["sop_logits"], labels)
            sop_hit = jnp.argmax(outputs["sop_logits"], axis=-1) == labels
            sums["sop_loss"] = jnp.sum(jnp.where(example > 0, example * sop_nll, 0.0))
            sums["sop_correct"] = jnp.sum(jnp.where(sop_hit, example, 0.0))
            splits = {"by_label": (labels, 2)}
            if "pair_kind" in batch:
                splits["by_kind"] = (batch["pair_kind"], len(PAIR_KINDS))
            for name, (group, size) in splits.items():
                # One-hot rows [B, size] weighted by `example`: padding (and a kind of -1)
                # falls in no group.
                member = jnp.where(group[:, None] == jnp.arange(size), example[:, None], 0.0)
                sums[f"sop_sequences_{name}"] = jnp.sum(member, axis=0)
                sums[f"sop_correct_{name}"] = jnp.sum(
                    jnp.where(sop_hit[:, None], member, 0.0), axis=0
                )
        return sums

    return eval_step


# Names of the SOP label split (index = label) in the eval metrics.
LABEL_SPLITS = ("label_0", "label_1")


def eval_metrics(sums: Mapping[str, Any]) -> dict[str, float]:
    """Means of the eval sums (scalars; the split sums [2] / [K]) over what was really there:
    MLM metrics only if a token was predicted, SOP metrics only if the objective has them
    (`sop_*` sums) and a sequence was seen, `eval_loss` only when every term of the objective
    was measured. A set that is all padding gives {}: no metric is ever reported from padding
    alone.

    The SOP accuracy is also split, from counts (never a mean of means):
    `eval_sop_accuracy_label_0` / `_label_1` and `eval_sop_accuracy_<kind>` for each kind of
    `PAIR_KINDS`, each with its number of sequences `eval_sop_sequences_<split>`, only for the
    splits that have sequences.
    """
    metrics = {}
    if sums["predictions"] > 0:
        metrics["eval_mlm_loss"] = float(sums["mlm_loss"] / sums["predictions"])
        metrics["eval_mlm_accuracy"] = float(sums["mlm_correct"] / sums["predictions"])
    has_sop = "sop_loss" in sums
    if has_sop and sums["sequences"] > 0:
        metrics["eval_sop_loss"] = float(sums["sop_loss"] / sums["sequences"])
        metrics["eval_sop_accuracy"] = float(sums["sop_correct"] / sums["sequences"])
        for key, names in (("by_label", LABEL_SPLITS), ("by_kind", PAIR_KINDS)):
            if f"sop_sequences_{key}" not in sums:  # e.g. batches without `pair_kind`
                continue
            seen = np.asarray(sums[f"sop_sequences_{key}"], np.float64)
            correct = np.asarray(sums[f"sop_correct_{key}"], np.float64)
            for name, n, c in zip(names, seen.tolist(), correct.tolist(), strict=True):
                if n > 0:
                    metrics[f"eval_sop_accuracy_{name}"] = c / n
                    metrics[f"eval_sop_sequences_{name}"] = n
    if "eval_mlm_loss" in metrics and (not has_sop or "eval_sop_loss" in metrics):
        metrics["eval_loss"] = metrics["eval_mlm_loss"] + metrics.get("eval_sop_loss", 0.0)
    return metrics
