"""The losses and metrics of pretraining (MLM / SOP, against numpy) and fine-tuning, and their
one out-of-range label policy (NaN, never a clamped class)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy.special import log_softmax

from albert_jax.model import losses

B, P, V = 3, 4, 11


def mlm_example(seed=0):
    rng = np.random.default_rng(seed)
    logits = rng.normal(scale=3.0, size=(B, P, V)).astype(np.float32)
    ids = rng.integers(0, V, size=(B, P)).astype(np.int32)
    weights = np.array([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]], np.float32)
    # Make a few predictions right so accuracy is neither 0 nor 1.
    ids[0, 0] = logits[0, 0].argmax()
    ids[2, 1] = logits[2, 1].argmax()
    ids[1, 3] = logits[1, 3].argmax()  # padding slot: must not count
    return logits, ids, weights


def numpy_mlm_loss(logits, ids, weights):
    logp = log_softmax(logits.astype(np.float64), axis=-1)
    nll = -np.take_along_axis(logp, ids[..., None], axis=-1)[..., 0]
    return np.sum(weights * nll) / (np.sum(weights) + 1e-5)


def test_masked_lm_loss_matches_official_formula():
    logits, ids, weights = mlm_example()
    loss = losses.masked_lm_loss(jnp.asarray(logits), jnp.asarray(ids), jnp.asarray(weights))
    assert loss.dtype == jnp.float32
    np.testing.assert_allclose(loss, numpy_mlm_loss(logits, ids, weights), rtol=1e-6)


def test_masked_lm_loss_in_float32_for_bfloat16_logits():
    logits, ids, weights = mlm_example(1)
    bf16 = jnp.asarray(logits, jnp.bfloat16)
    loss = losses.masked_lm_loss(bf16, jnp.asarray(ids), jnp.asarray(weights))
    assert loss.dtype == jnp.float32
    # Exact up to f32 rounding on the bf16-rounded inputs: nothing is computed in bf16.
    expected = numpy_mlm_loss(np.asarray(bf16.astype(jnp.float32)), ids, weights)
    np.testing.assert_allclose(loss, expected, rtol=1e-6)
    grads = jax.jit(jax.grad(lambda x: losses.masked_lm_loss(x, ids, weights)))(bf16)
    assert grads.dtype == jnp.bfloat16 and bool(jnp.all(jnp.isfinite(grads)))


def test_padding_slots_never_contribute_but_bad_labels_show():
    logits, ids, weights = mlm_example()
    ids = ids.copy()
    ids[0, 3] = V + 7  # out of range, weight 0 (padding)
    loss = losses.masked_lm_loss(jnp.asarray(logits), jnp.asarray(ids), jnp.asarray(weights))
    ids_ok = ids.copy()
    ids_ok[0, 3] = 0
    np.testing.assert_allclose(loss, numpy_mlm_loss(logits, ids_ok, weights), rtol=1e-6)
    ids[0, 0] = V + 7  # out of range on a real prediction: NaN, not a silent clamp
    loss = losses.masked_lm_loss(jnp.asarray(logits), jnp.asarray(ids), jnp.asarray(weights))
    assert np.isnan(loss)


def test_masked_lm_loss_and_accuracy_without_predictions():
    logits, ids, _ = mlm_example()
    zeros = jnp.zeros((B, P), jnp.float32)
    assert float(losses.masked_lm_loss(logits, ids, zeros)) == 0.0
    assert float(losses.masked_lm_accuracy(logits, ids, zeros)) == 0.0


def test_masked_lm_accuracy_is_weighted():
    logits, ids, weights = mlm_example()
    correct = (logits.argmax(-1) == ids).astype(np.float32)
    expected = np.sum(weights * correct) / np.sum(weights)
    assert 0.0 < expected < 1.0
    accuracy = losses.masked_lm_accuracy(jnp.asarray(logits), jnp.asarray(ids), weights)
    np.testing.assert_allclose(accuracy, expected, rtol=1e-6)


def sop_example():
    logits = np.array([[2.0, -1.0], [0.5, 0.7], [-3.0, 1.0], [0.0, 0.1]], np.float32)
    labels = np.array([0, 0, 1, 0], np.int32)
    return logits, labels


def test_sentence_order_loss_and_accuracy():
    logits, labels = sop_example()
    expected = -np.mean(log_softmax(logits.astype(np.float64), axis=-1)[np.arange(4), labels])
    np.testing.assert_allclose(losses.sentence_order_loss(logits, labels), expected, rtol=1e-6)
    np.testing.assert_allclose(losses.sentence_order_accuracy(logits, labels), 0.5)


def pretraining_inputs():
    logits, ids, weights = mlm_example()
    sop_logits, labels = sop_example()
    outputs = {"mlm_logits": logits, "sop_logits": sop_logits[:B]}
    batch = {"masked_lm_ids": ids, "masked_lm_weights": weights, "sentence_order_label": labels[:B]}
    return outputs, batch


def test_pretraining_loss_is_mlm_plus_sop():
    outputs, batch = pretraining_inputs()
    loss, metrics = jax.jit(losses.pretraining_loss)(outputs, batch)
    assert set(metrics) == {"loss", "mlm_loss", "sop_loss", "mlm_accuracy", "sop_accuracy"}
    mlm = numpy_mlm_loss(outputs["mlm_logits"], batch["masked_lm_ids"], batch["masked_lm_weights"])
    sop_logp = log_softmax(outputs["sop_logits"].astype(np.float64), axis=-1)
    sop = -np.mean(sop_logp[np.arange(B), batch["sentence_order_label"]])
    np.testing.assert_allclose(metrics["mlm_loss"], mlm, rtol=1e-6)
    np.testing.assert_allclose(metrics["sop_loss"], sop, rtol=1e-6)
    np.testing.assert_allclose(loss, mlm + sop, rtol=1e-6)
    assert metrics["loss"] == loss


def test_pretraining_loss_without_sentence_order():
    outputs, batch = pretraining_inputs()
    del outputs["sop_logits"], batch["sentence_order_label"]
    loss, metrics = losses.pretraining_loss(outputs, batch, sentence_order=False)
    np.testing.assert_allclose(loss, metrics["mlm_loss"])
    assert set(metrics) == {"loss", "mlm_loss", "mlm_accuracy"}  # no SOP: absent, not 0


def test_pretraining_loss_without_masked_tokens_has_no_mlm_metrics():
    """masked_lm_prob=0: an MLM loss and accuracy of 0 predictions are not measurements (they
    used to be reported as 0.0); the loss is the SOP term alone."""
    outputs, batch = pretraining_inputs()
    loss, metrics = losses.pretraining_loss(outputs, batch, masked_lm=False)
    assert set(metrics) == {"loss", "sop_loss", "sop_accuracy"}
    np.testing.assert_allclose(loss, metrics["sop_loss"])


@pytest.mark.parametrize("missing", ["masked_lm_weights", "sentence_order_label"])
def test_pretraining_loss_names_missing_batch_key(missing):
    outputs, batch = pretraining_inputs()
    del batch[missing]
    with pytest.raises(ValueError, match=missing):
        losses.pretraining_loss(outputs, batch)


# ---------------------------------------------------------------------------------- fine-tuning
def test_task_losses_match_their_definitions():
    logits = jnp.array([[2.0, 0.0, -1.0], [0.5, 0.5, 0.0]])
    labels = jnp.array([0, 2])
    log_p = jax.nn.log_softmax(logits)
    np.testing.assert_allclose(
        losses.classification_loss(logits, labels), -(log_p[0, 0] + log_p[1, 2]) / 2, rtol=1e-6
    )
    # Padding examples (weight 0) do not count, even when their loss is NaN.
    weighted = losses.classification_loss(
        jnp.array([[2.0, 0.0, -1.0], [jnp.nan, 0, 0]]), labels, jnp.array([1.0, 0.0])
    )
    np.testing.assert_allclose(weighted, -log_p[0, 0], rtol=1e-6)
    np.testing.assert_allclose(
        losses.regression_loss(jnp.array([[1.0], [3.0]]), jnp.array([0.0, 1.0])), (1 + 4) / 2
    )
    s, e = jnp.array([[0.0, 1.0, 2.0]]), jnp.array([[3.0, 0.0, 0.0]])
    expected = -(jax.nn.log_softmax(s)[0, 2] + jax.nn.log_softmax(e)[0, 0]) / 2
    np.testing.assert_allclose(losses.span_loss(s, e, jnp.array([2]), jnp.array([0])), expected)
    out = {
        "start_log_probs": jax.nn.log_softmax(s),
        "end_log_probs": jax.nn.log_softmax(e),
        "cls_logits": jnp.array([0.7]),
    }
    sigmoid_ce = -jnp.log(jax.nn.sigmoid(0.7))
    np.testing.assert_allclose(
        losses.squad_v2_loss(out, jnp.array([2]), jnp.array([0]), jnp.array([1])),
        expected + 0.5 * sigmoid_ce,
        rtol=1e-6,
    )


def test_classification_accuracy_is_weighted():
    logits = jnp.array([[2.0, 0.0], [0.0, 1.0], [3.0, 0.0]])
    labels = jnp.array([0, 0, 1])
    np.testing.assert_allclose(losses.classification_accuracy(logits, labels), 1 / 3, rtol=1e-6)
    weights = jnp.array([1.0, 1.0, 0.0])  # the third row is padding
    np.testing.assert_allclose(losses.classification_accuracy(logits, labels, weights), 0.5)


def test_pick_label_gives_nan_outside_the_classes():
    values = jnp.array([[0.1, 0.2, 0.3]] * 5)
    picked = losses.pick_label(values, jnp.array([0, 2, 3, -1, 100]))
    np.testing.assert_allclose(picked[:2], [0.1, 0.3], rtol=1e-6)
    assert bool(jnp.isnan(picked[2:]).all())  # not 0.3 (clamped) nor, for -1, wrapped to 0.3


def _task_losses(labels, weights=None):
    """Each task loss on two examples whose class / option / position labels are `labels`."""
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.normal(size=(2, 3)), jnp.float32)
    start, end = (jnp.asarray(rng.normal(size=(2, 5)), jnp.float32) for _ in range(2))
    outputs = {
        "start_log_probs": jax.nn.log_softmax(start),
        "end_log_probs": jax.nn.log_softmax(end),
        "cls_logits": jnp.zeros(2),
    }
    other = jnp.array([0, 1])
    return {
        "classification": losses.classification_loss(logits, labels, weights),
        "span_start": losses.span_loss(start, end, labels, other, weights),
        "span_end": losses.span_loss(start, end, other, labels, weights),
        "squad_v2_start": losses.squad_v2_loss(outputs, labels, other, other, weights),
        "squad_v2_end": losses.squad_v2_loss(outputs, other, labels, other, weights),
        "masked_lm": losses.masked_lm_loss(
            logits[None], labels[None], jnp.ones((1, 2)) if weights is None else weights[None]
        ),
        "sentence_order": losses.sentence_order_loss(logits[:, :2], labels),
    }


@pytest.mark.parametrize("bad", [3, 5, 1000, -1])
@pytest.mark.parametrize("jit", [False, True])
def test_out_of_range_label_gives_nan_loss(bad, jit):
    """3 is past the 3 classes, 5 past the 5 span positions: an off-by-one label must show."""
    fn = jax.jit(_task_losses) if jit else _task_losses
    good = fn(jnp.array([1, 0]))
    assert all(bool(jnp.isfinite(v)) for v in good.values()), good
    bad_values = fn(jnp.array([1, bad]))
    # A label of 3 is in range for the 5 span positions; every other case is out of range.
    expected_nan = {k for k in good if bad != 3 or not k.startswith(("span", "squad"))}
    assert {k for k, v in bad_values.items() if bool(jnp.isnan(v))} == expected_nan
    # The same bad label on a padding row (weight 0) does not count.
    padded = fn(jnp.array([1, bad]), jnp.array([1.0, 0.0]))
    finite = {k for k, v in padded.items() if bool(jnp.isfinite(v))}
    assert finite == set(good) - {"sentence_order"}  # SOP takes no weights
