"""Every loss and training metric: pretraining (masked LM, sentence order) and fine-tuning
(classification / multiple choice, regression, SQuAD v1 spans, SQuAD v2).

Pretraining follows the official `run_pretraining.py`: the MLM loss is the weighted mean
negative log-likelihood over the gathered prediction slots, Σ w·nll / (Σ w + 1e-5), the SOP loss
the batch mean cross-entropy, and the total their unweighted sum. Fine-tuning follows the
official `classifier_utils.py`, `squad_utils.py` and `race_utils.py`: mean cross-entropy
(classes, options, span starts and ends), mean squared error for STS-B, and for SQuAD 2.0 the
XLNet loss with its answerability term; the fine-tuning losses take optional example weights
[B] (0 for the padding rows of a batch).

Log-softmax runs in float32 whatever the logits dtype: in bfloat16 a 30k-way log-sum-exp keeps
only ~3 significant digits, enough to bias the loss and its gradient.

Labels go through one picker, `pick_label`, with one policy: a label outside [0, C) (too large
or negative) gives NaN, never a clamped or wrapped-around class, so a bad label with a non-zero
weight makes the loss NaN on purpose (the training loop stops on a non-finite loss). Padding
slots and rows (weight 0) never contribute, whatever their label.
"""

from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp
import optax

__all__ = [
    "MLM_WEIGHT_EPS",
    "pick_label",
    "masked_lm_loss",
    "masked_lm_accuracy",
    "sentence_order_loss",
    "sentence_order_accuracy",
    "pretraining_loss",
    "classification_loss",
    "classification_accuracy",
    "regression_loss",
    "span_loss",
    "squad_v2_loss",
]

Array = jax.Array

# Official denominator offset: keeps a batch without any prediction from dividing by zero.
MLM_WEIGHT_EPS = 1e-5


def pick_label(values: Array, labels: Array) -> Array:
    """values[..., label] in float32: values [..., C] (e.g. log-probabilities), integer labels
    [...] -> [...].

    The one label picker of every loss here: a label outside [0, C) gives NaN (not a clamped
    class, nor, for a negative label, one counted from the end).
    """
    values = values.astype(jnp.float32)
    labels = labels.astype(jnp.int32)
    in_range = (labels >= 0) & (labels < values.shape[-1])
    safe = jnp.where(in_range, labels, 0)[..., None]
    picked = jnp.take_along_axis(values, safe, axis=-1)[..., 0]
    return jnp.where(in_range, picked, jnp.nan)


def label_log_probs(logits: Array, labels: Array) -> Array:
    """log p(label) for logits [..., C] and integer labels [...] -> float32 [...] (NaN for an
    out-of-range label, `pick_label`)."""
    return pick_label(jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1), labels)


def _weighted_mean(values: Array, weights: Array | None) -> Array:
    """Mean of values [B] with example weights [B] (padding examples weigh 0) -> float32."""
    values = values.astype(jnp.float32)
    if weights is None:
        return jnp.mean(values)
    weights = weights.astype(jnp.float32)
    # `where`, not a product: a NaN in a padding example must not leak into the mean.
    total = jnp.sum(jnp.where(weights > 0, weights * values, 0.0))
    return total / jnp.maximum(jnp.sum(weights), 1e-12)


def masked_lm_loss(logits: Array, label_ids: Array, weights: Array) -> Array:
    """Σ w·nll / (Σ w + 1e-5).

    Args:
      logits: [B, P, V] MLM logits at the gathered positions (any float dtype).
      label_ids: [B, P] int original token ids.
      weights: [B, P] float, 1.0 for a real prediction, 0.0 for padding.
    Returns:
      float32 scalar.
    """
    weights = weights.astype(jnp.float32)
    nll = -label_log_probs(logits, label_ids)
    # `where`, not a product: 0·NaN from an ignored padding slot would still be NaN.
    weighted = jnp.where(weights != 0, weights * nll, 0.0)
    return jnp.sum(weighted) / (jnp.sum(weights) + MLM_WEIGHT_EPS)


def masked_lm_accuracy(logits: Array, label_ids: Array, weights: Array) -> Array:
    """Weighted fraction of prediction slots whose argmax is the label (0 if no weight).

    Args:
      logits: [B, P, V]; label_ids: [B, P] int; weights: [B, P] float.
    Returns:
      float32 scalar in [0, 1].
    """
    weights = weights.astype(jnp.float32)
    correct = (jnp.argmax(logits, axis=-1) == label_ids).astype(jnp.float32)
    total = jnp.sum(weights)
    return jnp.where(total > 0, jnp.sum(weights * correct) / jnp.maximum(total, 1e-30), 0.0)


def sentence_order_loss(logits: Array, labels: Array) -> Array:
    """Batch-mean cross-entropy of the SOP (or NSP) head.

    Args:
      logits: [B, 2] (0 = in order / next, 1 = swapped / random).
      labels: [B] int.
    Returns:
      float32 scalar.
    """
    return -jnp.mean(label_log_probs(logits, labels))


def sentence_order_accuracy(logits: Array, labels: Array) -> Array:
    """Fraction of the batch where argmax(logits [B, 2]) equals labels [B]; float32 scalar."""
    return jnp.mean((jnp.argmax(logits, axis=-1) == labels).astype(jnp.float32))


def pretraining_loss(
    outputs: Mapping[str, Array],
    batch: Mapping[str, Array],
    *,
    sentence_order: bool = True,
    masked_lm: bool = True,
) -> tuple[Array, dict[str, Array]]:
    """Total pretraining loss = MLM + SOP (equal weights, as in the official code).

    Args:
      outputs: model outputs with `mlm_logits` [B, P, V] and, when `sentence_order`,
        `sop_logits` [B, 2].
      batch: with `masked_lm_ids` [B, P], `masked_lm_weights` [B, P] and, when `sentence_order`,
        `sentence_order_label` [B].
      sentence_order: False for the MLM-only objective ("none"): no SOP term and no `sop_*`
        metrics.
      masked_lm: False when nothing is masked (`masked_lm_prob=0`): no MLM term and no `mlm_*`
        metrics. A metric with no denominator is left out, never reported as a measured 0.
    Returns:
      (loss, metrics) with metrics keys `loss` and, per term present, `mlm_loss,
      mlm_accuracy` / `sop_loss, sop_accuracy` (float32 scalars).
    """
    needed_outputs = (("mlm_logits",) if masked_lm else ()) + (
        ("sop_logits",) if sentence_order else ()
    )
    for key in needed_outputs:
        if key not in outputs:
            raise ValueError(f"outputs is missing {key!r}")
    needed = (("masked_lm_ids", "masked_lm_weights") if masked_lm else ()) + (
        ("sentence_order_label",) if sentence_order else ()
    )
    for key in needed:
        if key not in batch:
            raise ValueError(f"batch is missing {key!r}")

    loss = jnp.zeros((), jnp.float32)
    metrics: dict[str, Array] = {}
    if masked_lm:
        logits, ids = outputs["mlm_logits"], batch["masked_lm_ids"]
        weights = batch["masked_lm_weights"]
        metrics["mlm_loss"] = masked_lm_loss(logits, ids, weights)
        metrics["mlm_accuracy"] = masked_lm_accuracy(logits, ids, weights)
        loss = loss + metrics["mlm_loss"]
    if sentence_order:
        labels = batch["sentence_order_label"]
        metrics["sop_loss"] = sentence_order_loss(outputs["sop_logits"], labels)
        metrics["sop_accuracy"] = sentence_order_accuracy(outputs["sop_logits"], labels)
        loss = loss + metrics["sop_loss"]
    return loss, {"loss": loss, **metrics}


# ---------------------------------------------------------------------------------- fine-tuning
def classification_loss(logits: Array, labels: Array, weights: Array | None = None) -> Array:
    """Mean cross-entropy; logits [B,C] (options or classes), labels [B] int, optional example
    weights [B] -> float32 scalar (NaN if a weighted label is outside [0, C))."""
    return _weighted_mean(-label_log_probs(logits, labels), weights)


def classification_accuracy(logits: Array, labels: Array, weights: Array | None = None) -> Array:
    """Fraction of examples whose argmax(logits [B,C]) is the label [B], weighted by the
    optional example weights [B] (padding rows weigh 0) -> float32 scalar."""
    return _weighted_mean(jnp.argmax(logits, axis=-1) == labels, weights)


def regression_loss(logits: Array, labels: Array, weights: Array | None = None) -> Array:
    """Mean squared error (official STS-B); logits [B,1], labels [B] float, optional example
    weights [B] -> float32 scalar."""
    diff = logits[:, 0].astype(jnp.float32) - labels.astype(jnp.float32)
    return _weighted_mean(jnp.square(diff), weights)


def span_loss(
    start_logits: Array,
    end_logits: Array,
    start_positions: Array,
    end_positions: Array,
    weights: Array | None = None,
) -> Array:
    """SQuAD v1: (CE(start) + CE(end)) / 2; logits [B,S], positions [B] int, optional example
    weights [B] -> float32 scalar (NaN if a weighted position is outside [0, S))."""
    start = -label_log_probs(start_logits, start_positions)
    end = -label_log_probs(end_logits, end_positions)
    return _weighted_mean((start + end) / 2.0, weights)


def squad_v2_loss(
    outputs: Mapping[str, Array],
    start_positions: Array,
    end_positions: Array,
    is_impossible: Array,
    weights: Array | None = None,
) -> Array:
    """Official v2 loss: (CE(start) + CE(end)) / 2 + 0.5 * sigmoid-CE(cls_logits, is_impossible).

    outputs: the training outputs of `heads.AlbertForQuestionAnsweringV2` (log-probs
    `start_log_probs`, `end_log_probs` [B,S], `cls_logits` [B]); positions [B] int (0 = [CLS]
    for unanswerable; NaN loss if a weighted one is outside [0, S)); is_impossible [B] in
    {0,1}; optional example weights [B]. Returns a float32 scalar.
    """
    start = -pick_label(outputs["start_log_probs"], start_positions)
    end = -pick_label(outputs["end_log_probs"], end_positions)
    answerability = optax.sigmoid_binary_cross_entropy(
        outputs["cls_logits"].astype(jnp.float32), is_impossible.astype(jnp.float32)
    )
    return _weighted_mean((start + end) / 2.0, weights) + 0.5 * _weighted_mean(
        answerability, weights
    )
