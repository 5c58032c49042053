"""GLUE metrics against sklearn / scipy (test-only dependencies) on random and degenerate inputs."""

import math
import warnings

import numpy as np
import pytest
import scipy.stats
import sklearn.metrics

from albert_jax.tasks import metrics
from albert_jax.tasks.local import TASKS


def _reference(fn, *args):
    # sklearn / scipy warn on the degenerate cases (constant input, 0/0 F1); the values are
    # what we compare against, the warnings are not.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return float(fn(*args))


def _assert_same(ours: float, reference: float) -> None:
    if math.isnan(reference):
        assert math.isnan(ours), f"expected NaN, got {ours}"
    else:
        assert ours == pytest.approx(reference, abs=1e-12)


@pytest.mark.parametrize("seed", range(40))
def test_classification_metrics_match_sklearn(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 60))
    # Skewed class probabilities make constant vectors and empty classes common.
    p1 = rng.choice([0.0, 0.02, 0.3, 0.5, 0.9, 1.0])
    labels = (rng.random(n) < p1).astype(np.int64)
    predictions = (rng.random(n) < rng.choice([0.0, 0.5, 1.0])).astype(np.int64)
    _assert_same(
        metrics.accuracy(predictions, labels),
        _reference(sklearn.metrics.accuracy_score, labels, predictions),
    )
    _assert_same(
        metrics.f1_score(predictions, labels),
        _reference(sklearn.metrics.f1_score, labels, predictions),
    )
    _assert_same(
        metrics.matthews_corrcoef(predictions, labels),
        _reference(sklearn.metrics.matthews_corrcoef, labels, predictions),
    )
    # Three classes (MNLI / AX): Matthews correlation in its multi-class form.
    labels3 = rng.integers(0, 3, n)
    predictions3 = np.where(rng.random(n) < 0.6, labels3, rng.integers(0, 3, n))
    _assert_same(
        metrics.matthews_corrcoef(predictions3, labels3),
        _reference(sklearn.metrics.matthews_corrcoef, labels3, predictions3),
    )


@pytest.mark.parametrize("seed", range(40))
def test_correlations_match_scipy_with_ties(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(2, 80))
    # Values on a coarse grid (as STS-B's 0..5 in steps of 0.2) produce many ties.
    labels = np.round(rng.uniform(0, 5, n) * rng.choice([1, 5])) / rng.choice([1, 5])
    predictions = labels + rng.normal(0, rng.choice([0.1, 1.0, 5.0]), n)
    if seed % 3 == 0:
        predictions = np.round(predictions)  # ties on both sides
    if seed % 10 == 1:
        predictions = np.full(n, 2.5)  # constant: undefined correlation
    _assert_same(
        metrics.pearson(predictions, labels),
        _reference(lambda a, b: scipy.stats.pearsonr(a, b)[0], predictions, labels),
    )
    _assert_same(
        metrics.spearman(predictions, labels),
        _reference(lambda a, b: scipy.stats.spearmanr(a, b)[0], predictions, labels),
    )
    np.testing.assert_array_equal(metrics.average_ranks(labels), scipy.stats.rankdata(labels))


def test_degenerate_inputs():
    ones = [1, 1, 1, 1]
    assert metrics.matthews_corrcoef(ones, [0, 1, 0, 1]) == 0.0
    assert metrics.matthews_corrcoef([0, 1, 0, 1], ones) == 0.0
    assert metrics.f1_score([0, 0, 0], [0, 0, 0]) == 0.0  # 0/0 → 0, as sklearn
    assert math.isnan(metrics.pearson(ones, [1.0, 2.0, 3.0, 4.0]))
    assert math.isnan(metrics.spearman([1.0, 2.0, 3.0, 4.0], ones))
    assert math.isnan(metrics.pearson([1.0], [2.0]))  # fewer than two points
    assert math.isnan(metrics.spearman([1.0, float("nan"), 3.0], [1.0, 2.0, 3.0]))
    assert metrics.pearson([1, 2, 3], [2, 4, 6]) == pytest.approx(1.0)
    assert metrics.spearman([1, 2, 3], [30, 20, 10]) == pytest.approx(-1.0)
    np.testing.assert_array_equal(metrics.average_ranks([10, 20, 20, 30]), [1, 2.5, 2.5, 4])


def test_bad_inputs_raise_naming_the_field():
    with pytest.raises(ValueError, match="same length"):
        metrics.accuracy([0, 1], [0, 1, 1])
    with pytest.raises(ValueError, match="predictions is empty"):
        metrics.accuracy([], [])
    with pytest.raises(ValueError, match="labels must be a 1-D"):
        metrics.accuracy([0, 1], [[0, 1]])
    with pytest.raises(ValueError, match="labels for binary F1"):
        metrics.f1_score([0, 1, 1], [0, 2, 1])
    with pytest.raises(ValueError, match="unknown task"):
        metrics.compute_metrics("glue_foo", [0], [0])
    with pytest.raises(ValueError, match="unknown metric"):
        metrics.compute_named_metrics(["auc"], [0], [0])
    with pytest.raises(ValueError, match="squad_eval"):
        metrics.compute_metrics("squad_shifts", [0], [0])


def test_glue_table_and_compute_metrics():
    assert metrics.GLUE_METRICS["cola"] == ("matthews_corrcoef",)
    assert metrics.GLUE_METRICS["mrpc"] == ("accuracy", "f1")
    assert metrics.GLUE_METRICS["qqp"] == ("accuracy", "f1")
    assert metrics.GLUE_METRICS["stsb"] == ("pearson", "spearman")
    for task in ("sst2", "mnli", "mnli_matched", "mnli_mismatched", "qnli", "rte", "wnli"):
        assert metrics.GLUE_METRICS[task] == ("accuracy",)
    for names in metrics.GLUE_METRICS.values():
        assert set(names) <= set(metrics.METRIC_FNS)

    # MRPC by hand: TP=2, FP=1, FN=1, TN=1 → accuracy 3/5, F1 = 4 / (4 + 1 + 1).
    result = metrics.compute_metrics("mrpc", [1, 1, 1, 0, 0], [1, 1, 0, 1, 0])
    assert result == {"accuracy": pytest.approx(0.6), "f1": pytest.approx(4 / 6)}
    stsb = metrics.compute_metrics("stsb", [0.1, 0.4, 0.35, 0.8], [0.0, 1.0, 2.0, 3.0])
    assert set(stsb) == {"pearson", "spearman"} and stsb["spearman"] == pytest.approx(0.8)

    # Local tasks are scored by the metric names of their registry entry.
    for name, task in TASKS.items():
        if task.kind != "span":
            assert metrics.task_metric_names(name) == task.metrics
            assert set(task.metrics) <= set(metrics.METRIC_FNS)
    assert metrics.compute_metrics("nli_vitaminc", [0, 2, 1], [0, 2, 2]) == {
        "accuracy": pytest.approx(2 / 3)
    }
