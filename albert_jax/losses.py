"""ALBERT pretraining losses and metrics: masked LM (MLM) and sentence-order prediction (SOP).

Follows the official `run_pretraining.py`: the MLM loss is the weighted mean negative
log-likelihood over the gathered prediction slots, Σ w·nll / (Σ w + 1e-5), the SOP loss the batch
mean cross-entropy, and the total their unweighted sum.

Log-softmax runs in float32 whatever the logits dtype: in bfloat16 a 30k-way log-sum-exp keeps
only ~3 significant digits, enough to bias the loss and its gradient.

An out-of-range label with a non-zero weight makes the loss NaN on purpose (the training loop
stops on a non-finite loss) instead of being clamped to a wrong class; padding slots (weight 0)
never contribute, whatever their label.
"""

from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp

# Official denominator offset: keeps a batch without any prediction from dividing by zero.
MLM_WEIGHT_EPS = 1e-5


def _label_log_probs(logits: jax.Array, labels: jax.Array) -> jax.Array:
    """log p(label) for logits [..., C] and integer labels [...] -> float32 [...].

    Out-of-range labels give NaN (gather "fill" mode) rather than a clamped class.
    """
    log_probs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    labels = labels.astype(jnp.int32)[..., None]
    return jnp.take_along_axis(log_probs, labels, axis=-1, mode="fill")[..., 0]


def masked_lm_loss(logits: jax.Array, label_ids: jax.Array, weights: jax.Array) -> jax.Array:
    """Σ w·nll / (Σ w + 1e-5).

    Args:
      logits: [B, P, V] MLM logits at the gathered positions (any float dtype).
      label_ids: [B, P] int original token ids.
      weights: [B, P] float, 1.0 for a real prediction, 0.0 for padding.
    Returns:
      float32 scalar.
    """
    weights = weights.astype(jnp.float32)
    nll = -_label_log_probs(logits, label_ids)
    # `where`, not a product: 0·NaN from an ignored padding slot would still be NaN.
    weighted = jnp.where(weights != 0, weights * nll, 0.0)
    return jnp.sum(weighted) / (jnp.sum(weights) + MLM_WEIGHT_EPS)


def masked_lm_accuracy(logits: jax.Array, label_ids: jax.Array, weights: jax.Array) -> jax.Array:
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


def sentence_order_loss(logits: jax.Array, labels: jax.Array) -> jax.Array:
    """Batch-mean cross-entropy of the SOP (or NSP) head.

    Args:
      logits: [B, 2] (0 = in order / next, 1 = swapped / random).
      labels: [B] int.
    Returns:
      float32 scalar.
    """
    return -jnp.mean(_label_log_probs(logits, labels))


def sentence_order_accuracy(logits: jax.Array, labels: jax.Array) -> jax.Array:
    """Fraction of the batch where argmax(logits [B, 2]) equals labels [B]; float32 scalar."""
    return jnp.mean((jnp.argmax(logits, axis=-1) == labels).astype(jnp.float32))


def pretraining_loss(
    outputs: Mapping[str, jax.Array],
    batch: Mapping[str, jax.Array],
    *,
    sentence_order: bool = True,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Total pretraining loss = MLM + SOP (equal weights, as in the official code).

    Args:
      outputs: model outputs with `mlm_logits` [B, P, V] and, when `sentence_order`,
        `sop_logits` [B, 2].
      batch: with `masked_lm_ids` [B, P], `masked_lm_weights` [B, P] and, when `sentence_order`,
        `sentence_order_label` [B].
      sentence_order: False for the MLM-only objective ("none"): no SOP term, and `sop_loss` /
        `sop_accuracy` are reported as 0 so every log line has the same keys.
    Returns:
      (loss, metrics) with metrics keys `loss, mlm_loss, sop_loss, mlm_accuracy, sop_accuracy`
      (float32 scalars).
    """
    for key in ("mlm_logits",) + (("sop_logits",) if sentence_order else ()):
        if key not in outputs:
            raise ValueError(f"outputs is missing {key!r}")
    required = ("masked_lm_ids", "masked_lm_weights")
    for key in required + (("sentence_order_label",) if sentence_order else ()):
        if key not in batch:
            raise ValueError(f"batch is missing {key!r}")

    mlm_logits = outputs["mlm_logits"]
    ids, weights = batch["masked_lm_ids"], batch["masked_lm_weights"]
    mlm_loss = masked_lm_loss(mlm_logits, ids, weights)
    mlm_accuracy = masked_lm_accuracy(mlm_logits, ids, weights)
    if sentence_order:
        labels = batch["sentence_order_label"]
        sop_loss = sentence_order_loss(outputs["sop_logits"], labels)
        sop_accuracy = sentence_order_accuracy(outputs["sop_logits"], labels)
    else:
        sop_loss = sop_accuracy = jnp.zeros((), jnp.float32)
    loss = mlm_loss + sop_loss
    metrics = {
        "loss": loss,
        "mlm_loss": mlm_loss,
        "sop_loss": sop_loss,
        "mlm_accuracy": mlm_accuracy,
        "sop_accuracy": sop_accuracy,
    }
    return loss, metrics
