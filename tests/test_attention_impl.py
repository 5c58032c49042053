"""`ModelConfig.attention_impl`: our einsum attention ("xla"), `jax.nn.dot_product_attention`
("dot_product") and cuDNN's fused kernel ("cudnn", GPU only) compute the same model; a backend
without the kernel is an error naming the field, raised while tracing (before compilation)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_model import init, make_batch, tiny

from albert_jax.model import layers
from albert_jax.model.albert import AlbertForPreTraining

IMPLS = ["dot_product"] + (["cudnn"] if jax.default_backend() == "gpu" else [])


def _outputs(cfg, params, batch, **kwargs):
    return AlbertForPreTraining(cfg).apply(params, **batch, **kwargs)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype, tol", [("float32", 2e-5), ("bfloat16", 3e-2)])
def test_implementations_compute_the_same_model(impl, dtype, tol):
    if impl == "cudnn" and dtype == "float32":
        pytest.skip("cuDNN's fused attention takes bf16 / fp16")
    cfg = tiny(dtype=dtype)
    params = init(cfg)
    batch = make_batch(cfg)
    # Padding: the last four positions of the second row are masked.
    batch["input_mask"] = batch["input_mask"].at[1, -4:].set(0)
    other_cfg = dataclasses.replace(cfg, attention_impl=impl)

    @jax.jit
    def outputs_and_grads(params):
        def loss(p, c):  # the training step differentiates through attention too
            out = _outputs(c, p, batch)
            return jnp.sum(out["mlm_logits"].astype(jnp.float32) ** 2), out

        return [jax.grad(loss, has_aux=True)(params, c)[::-1] for c in (cfg, other_cfg)]

    (ours, g_ours), (other, g_other) = outputs_and_grads(params)
    for name in ("sequence_output", "pooled_output", "mlm_logits", "sop_logits"):
        np.testing.assert_allclose(
            np.asarray(other[name], np.float32), np.asarray(ours[name], np.float32),
            rtol=tol, atol=tol, err_msg=name,
        )  # fmt: skip
    # Gradients within the tolerance of the largest gradient entry.
    leaves_ours = [np.asarray(x, np.float32) for x in jax.tree.leaves(g_ours)]
    leaves_other = [np.asarray(x, np.float32) for x in jax.tree.leaves(g_other)]
    scale = max(float(np.abs(x).max()) for x in leaves_ours)
    for a, b in zip(leaves_ours, leaves_other, strict=True):
        assert float(np.abs(a - b).max()) <= tol * scale


@pytest.mark.parametrize("rows, keys", [(21, 64), (8, 13), (5, 5)])
def test_even_lengths_keep_the_attention_and_its_gradients(rows, keys):
    """cuDNN's inputs (`layers.even_lengths`: odd lengths padded, the mask whole) give the same
    attention, and the same gradients, as the inputs themselves; computed here by JAX's own
    implementation, which takes both (the kernel itself is compared on a GPU, above)."""
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.normal(size=(2, 3, n, 8)), jnp.float32) for n in (rows, keys, keys))
    mask = jnp.asarray(rng.random((2, 1, 1, keys)) < 0.8).at[:, :, :, 0].set(True)

    def attention(q, k, v, even):
        out_rows = q.shape[2]
        if even:
            q, k, v, m = layers.even_lengths(q, k, v, mask)
            assert q.shape[2] % 2 == 0 and k.shape[2] % 2 == 0 and m.shape[2] == q.shape[2]
        else:
            m = mask
        q, k, v = (jnp.swapaxes(t, 1, 2) for t in (q, k, v))
        return jax.nn.dot_product_attention(q, k, v, mask=m)[:, :out_rows]

    def loss(q, k, v, even):
        return jnp.sum(jnp.sin(attention(q, k, v, even)))

    np.testing.assert_allclose(attention(q, k, v, True), attention(q, k, v, False), atol=1e-6)
    grads = [jax.grad(loss, argnums=(0, 1, 2))(q, k, v, even) for even in (True, False)]
    for padded, plain in zip(*grads, strict=True):
        np.testing.assert_allclose(padded, plain, atol=1e-6)


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="the GPU has the kernel")
def test_cudnn_without_a_gpu_names_the_field():
    cfg = tiny(attention_impl="cudnn")
    with pytest.raises(ValueError, match=r"model.attention_impl='cudnn' needs a GPU; the target"):
        jax.eval_shape(lambda: init(cfg))  # traced, nothing compiled


def test_config_refuses_unknown_implementations_and_probs_dropout():
    with pytest.raises(ValueError, match=r"ModelConfig.attention_impl='flash' is not one of"):
        tiny(attention_impl="flash")
    with pytest.raises(ValueError, match=r"attention_impl='dot_product' has no dropout"):
        tiny(attention_impl="dot_product", attention_probs_dropout_prob=0.1)
