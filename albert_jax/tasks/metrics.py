"""Official GLUE metrics, in numpy: accuracy, F1, Matthews correlation, Pearson, Spearman.

The definitions are those the GLUE benchmark reports (Wang et al. 2019, Table 1): CoLA is scored
with the Matthews correlation coefficient, MRPC and QQP with accuracy and F1 of the positive
class, STS-B with Pearson and Spearman correlation, every other task with accuracy. The values
returned here are fractions in [0, 1] (or [-1, 1] for correlations), as sklearn and scipy return
them; the GLUE leaderboard prints them multiplied by 100.

Degenerate inputs follow sklearn / scipy, so that numbers agree with the usual reference code:
  * F1 with no positive prediction and no positive label (0 / 0) is 0.0 (sklearn's
    `zero_division` default).
  * Matthews correlation is 0.0 when either the predictions or the labels are constant
    (sklearn: the denominator is zero).
  * Pearson and Spearman are NaN when either vector is constant (scipy's
    `ConstantInputWarning` case), when there are fewer than two points (where scipy's `pearsonr`
    raises, we return NaN: the correlation is undefined, and an evaluation loop should report
    that rather than crash), and when any value is NaN (scipy's `nan_policy="propagate"`).

sklearn and scipy are used only by the tests, to check these functions.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import numpy.typing as npt

ArrayLike = npt.ArrayLike

# Which metrics GLUE reports for each task. MNLI is evaluated on two dev sets; the two names
# `mnli_matched` / `mnli_mismatched` let an evaluation loop report both under distinct keys,
# `mnli` is the same metric for callers that evaluate one split at a time. AX (the diagnostic
# set) is scored by GLUE with R3, the Matthews correlation over the three NLI classes.
GLUE_METRICS: dict[str, tuple[str, ...]] = {
    "cola": ("matthews_corrcoef",),
    "sst2": ("accuracy",),
    "mrpc": ("accuracy", "f1"),
    "qqp": ("accuracy", "f1"),
    "stsb": ("pearson", "spearman"),
    "mnli": ("accuracy",),
    "mnli_matched": ("accuracy",),
    "mnli_mismatched": ("accuracy",),
    "qnli": ("accuracy",),
    "rte": ("accuracy",),
    "wnli": ("accuracy",),
    "ax": ("matthews_corrcoef",),
}


def _paired_vectors(predictions: ArrayLike, labels: ArrayLike) -> tuple[np.ndarray, np.ndarray]:
    """Both inputs as 1-D arrays [N] of equal, non-zero length, or a ValueError naming the field."""
    p = np.asarray(predictions)
    y = np.asarray(labels)
    for name, a in (("predictions", p), ("labels", y)):
        if a.ndim != 1:
            raise ValueError(f"{name} must be a 1-D array [N], got shape {a.shape}")
        if a.size == 0:
            raise ValueError(f"{name} is empty: metrics need at least one example")
    if p.shape != y.shape:
        raise ValueError(
            f"predictions and labels must have the same length, got {p.shape[0]} and {y.shape[0]}"
        )
    return p, y


def accuracy(predictions: ArrayLike, labels: ArrayLike) -> float:
    """Fraction of examples whose prediction equals the label. predictions, labels: [N]."""
    p, y = _paired_vectors(predictions, labels)
    return float(np.mean(p == y))


def f1_score(predictions: ArrayLike, labels: ArrayLike) -> float:
    """Binary F1 of the positive class 1: 2·TP / (2·TP + FP + FN); 0.0 when that is 0 / 0.

    predictions, labels: [N] with values in {0, 1} (anything else raises: binary F1 of a
    multi-class task would silently mean something else).
    """
    p, y = _paired_vectors(predictions, labels)
    for name, a in (("predictions", p), ("labels", y)):
        if not np.isin(a, (0, 1)).all():
            raise ValueError(f"{name} for binary F1 must be 0 or 1, got values {np.unique(a)}")
    tp = int(np.sum((p == 1) & (y == 1)))
    fp = int(np.sum((p == 1) & (y == 0)))
    fn = int(np.sum((p == 0) & (y == 1)))
    denominator = 2 * tp + fp + fn
    return 2.0 * tp / denominator if denominator else 0.0


def matthews_corrcoef(predictions: ArrayLike, labels: ArrayLike) -> float:
    """Matthews correlation coefficient (Gorodkin's K-class form; the usual MCC for 2 classes).

    With C the confusion matrix, t_k / p_k the true / predicted counts of class k, c = trace(C)
    and s = N:  MCC = (c·s − Σ t_k p_k) / sqrt((s² − Σ p_k²)(s² − Σ t_k²)); 0.0 when the
    denominator is zero (constant predictions or constant labels). predictions, labels: [N].
    """
    p, y = _paired_vectors(predictions, labels)
    classes, encoded = np.unique(np.concatenate([y, p]), return_inverse=True)
    y_idx, p_idx = encoded[: y.size], encoded[y.size :]
    k = classes.size
    # float64 (as sklearn): the products below are ~N², which int32 counts would overflow.
    true_counts = np.bincount(y_idx, minlength=k).astype(np.float64)
    pred_counts = np.bincount(p_idx, minlength=k).astype(np.float64)
    correct = float(np.sum(y_idx == p_idx))
    s = float(y.size)
    cov_true_pred = correct * s - true_counts @ pred_counts
    cov_pred_pred = s * s - pred_counts @ pred_counts
    cov_true_true = s * s - true_counts @ true_counts
    if cov_pred_pred * cov_true_true == 0.0:
        return 0.0
    return float(cov_true_pred / np.sqrt(cov_true_true * cov_pred_pred))


def _correlation_inputs(predictions: ArrayLike, labels: ArrayLike) -> tuple[np.ndarray, np.ndarray]:
    p, y = _paired_vectors(predictions, labels)
    return p.astype(np.float64), y.astype(np.float64)


def _pearson(x: np.ndarray, y: np.ndarray) -> float:
    """Pearson r of two float64 vectors [N]; NaN where undefined (see module docstring)."""
    if x.size < 2 or np.isnan(x).any() or np.isnan(y).any():
        return float("nan")
    if (x == x[0]).all() or (y == y[0]).all():
        return float("nan")
    xm = x - x.mean()
    ym = y - y.mean()
    # Normalising each centred vector before the dot product (rather than dividing the raw
    # covariance) keeps r accurate when the values are large or nearly constant.
    r = float(np.dot(xm / np.linalg.norm(xm), ym / np.linalg.norm(ym)))
    return max(-1.0, min(1.0, r))


def pearson(predictions: ArrayLike, labels: ArrayLike) -> float:
    """Pearson correlation coefficient r of predictions [N] and labels [N]."""
    return _pearson(*_correlation_inputs(predictions, labels))


def average_ranks(values: ArrayLike) -> np.ndarray:
    """Ranks 1..N of values [N], tied values sharing the mean of their ranks → float64 [N].

    E.g. [10, 20, 20, 30] → [1, 2.5, 2.5, 4] (scipy.stats.rankdata's default "average").
    """
    v = np.asarray(values)
    _, inverse, counts = np.unique(v, return_inverse=True, return_counts=True)
    last_rank = np.cumsum(counts)  # rank of the last copy of each distinct value
    mean_rank = last_rank - (counts - 1) / 2.0
    return mean_rank[inverse.reshape(-1)].astype(np.float64)


def spearman(predictions: ArrayLike, labels: ArrayLike) -> float:
    """Spearman rank correlation ρ: Pearson r of the average ranks of predictions and labels."""
    x, y = _correlation_inputs(predictions, labels)
    if np.isnan(x).any() or np.isnan(y).any():
        return float("nan")
    return _pearson(average_ranks(x), average_ranks(y))


METRIC_FNS: dict[str, Callable[[ArrayLike, ArrayLike], float]] = {
    "accuracy": accuracy,
    "f1": f1_score,
    "matthews_corrcoef": matthews_corrcoef,
    "pearson": pearson,
    "spearman": spearman,
}


def compute_named_metrics(
    names: Sequence[str], predictions: ArrayLike, labels: ArrayLike
) -> dict[str, float]:
    """{name: value} for each metric name in METRIC_FNS; predictions, labels: [N]."""
    unknown = [n for n in names if n not in METRIC_FNS]
    if unknown:
        raise ValueError(f"unknown metric names {unknown}; known: {sorted(METRIC_FNS)}")
    return {name: METRIC_FNS[name](predictions, labels) for name in names}


def task_metric_names(task: str) -> tuple[str, ...]:
    """Metric names of a GLUE task or of a local labelled task (albert_jax.tasks.local.TASKS)."""
    if task in GLUE_METRICS:
        return GLUE_METRICS[task]
    # Imported here: the local readers are not needed by callers that only score GLUE.
    from albert_jax.tasks.local import TASKS

    if task in TASKS:
        spec = TASKS[task]
        if spec.kind == "span":
            raise ValueError(
                f"task {task!r} is a span (SQuAD-style) task: score it with "
                "albert_jax.tasks.squad_eval.evaluate(dataset_json, predictions)"
            )
        return spec.metrics
    raise ValueError(
        f"unknown task {task!r}; known GLUE tasks {sorted(GLUE_METRICS)}, "
        f"local tasks {sorted(TASKS)}"
    )


def compute_metrics(task: str, predictions: ArrayLike, labels: ArrayLike) -> dict[str, float]:
    """The task's official metrics, e.g. compute_metrics("mrpc", p, y) → {"accuracy", "f1"}.

    predictions: [N] class ids (classification, multiple choice) or floats (regression);
    labels: [N] of the same kind.
    """
    return compute_named_metrics(task_metric_names(task), predictions, labels)
