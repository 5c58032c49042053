"""Pretraining's held-out evaluation: what the loop logs every `eval_every_steps` and the
analysis CLIs (`albert_jax.analysis`) measure on the same batches.

- `make_eval_step`: (params, batch) → weighted sums over the batch (MLM loss / hits /
  predictions, SOP loss / hits, split by label and by kind of pair), so that batches of any
  count and padding rows combine exactly.
- `sum_eval_batches` / `evaluate_batches`: those sums over a list of batches, added on the
  devices and fetched once; `eval_metrics`: the means of the sums, only what was measured.
- `majority_accuracies`: the constant predictors' scores, the baselines the model must beat.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils

from albert_jax.data.instances import PAIR_KINDS
from albert_jax.model import losses
from albert_jax.model.albert import AlbertForPreTraining

PyTree = Any


def model_inputs(batch: Mapping[str, jax.Array]) -> tuple[jax.Array, ...]:
    """The positional inputs of `AlbertForPreTraining` in a pretraining batch."""
    return (
        batch["input_ids"],
        batch["segment_ids"],
        batch["input_mask"],
        batch["masked_lm_positions"],
    )


def make_eval_step(model: AlbertForPreTraining, *, sentence_order: bool) -> Callable:
    """(params, batch) → weighted sums over the batch, so that batches of any count (and
    padding rows, weight 0) combine exactly.

    `batch` is a training batch plus `example_weight [B] float32` (1 real, 0 padding); padding
    rows have no MLM prediction either (`masked_lm_weights` 0). The SOP sums are split by label
    (`sop_sequences_by_label`, `sop_correct_by_label` [2]) and, when the batch has `pair_kind`
    [B], by the kind of pair (`sop_sequences_by_kind`, `sop_correct_by_kind` [K], K =
    len(PAIR_KINDS)); a batch without it gives the totals only.

    `sentence_order`: whether the SOP / NSP head is measured (`config.objective != "none"`;
    the cross-evaluation of `analysis.sop_table` measures an MLM-only model's head too).
    """

    def eval_step(params: PyTree, batch: dict[str, jax.Array]) -> dict[str, jax.Array]:
        outputs = model.apply(
            {"params": params}, *model_inputs(batch), return_sequence_output=False
        )
        weights = batch["masked_lm_weights"].astype(jnp.float32)  # [B, P]
        mlm_nll = -losses.label_log_probs(outputs["mlm_logits"], batch["masked_lm_ids"])
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
            sop_nll = -losses.label_log_probs(outputs["sop_logits"], labels)
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


def evaluate_batches(
    eval_step: Callable[[PyTree, Any], Mapping[str, jax.Array]],
    params: PyTree,
    batches: Iterable[Mapping[str, Any]],
) -> dict[str, float]:
    """`eval_metrics` of the sums of `eval_step` (a `make_eval_step`, jitted; or the loop's
    `Loop.eval_step`) over `batches`: what the training loop logs (`PretrainingData.evaluate`) and
    the analysis CLIs report."""
    return eval_metrics(sum_eval_batches(eval_step, params, batches))


def sum_eval_batches(
    eval_step: Callable[[PyTree, Any], Mapping[str, jax.Array]],
    params: PyTree,
    batches: Iterable[Mapping[str, Any]],
) -> dict[str, np.ndarray]:
    """The sums of `eval_step` over `batches`, added on the devices and fetched once."""
    sums: Mapping[str, jax.Array] | None = None
    for batch in batches:
        out = eval_step(params, batch)
        sums = out if sums is None else jax.tree.map(jnp.add, sums, out)
    if sums is None:
        raise ValueError("evaluate_batches: no batch")
    return {k: np.asarray(v) for k, v in jax.device_get(sums).items()}


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
