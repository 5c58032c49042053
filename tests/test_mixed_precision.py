"""bf16 compute with fp32 parameters (`model.dtype=bfloat16`): what runs in which precision,
read off the traced training computation, and a tiny pretraining run against the fp32 one."""

from __future__ import annotations

import collections
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_model import init, make_batch, tiny
from test_train import make_config, small_overrides

from albert_jax.model import layers, losses
from albert_jax.model.albert import AlbertForPreTraining
from albert_jax.pretrain import train

# Float32 in bf16 runs: exponentials and logs (softmax, log-softmax), their max-subtraction,
# LayerNorm's rsqrt; every sum over a bf16 array would be a bf16 accumulation.
_FLOAT32_OPS = ("exp", "log", "reduce_max", "rsqrt")


def _primitives(jaxpr, found) -> None:
    """(primitive name, input dtypes) of every equation, sub-jaxprs (scan, remat) included."""
    for eqn in jaxpr.eqns:
        found[(eqn.primitive.name, tuple(str(v.aval.dtype) for v in eqn.invars))] += 1
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            _primitives(sub, found)


def test_bf16_runs_matmuls_in_bf16_and_reductions_in_fp32():
    cfg = tiny(dtype="bfloat16")
    params = init(cfg)
    batch = make_batch(cfg)
    labels = jnp.zeros(batch["masked_lm_positions"].shape, jnp.int32)

    def loss(p):
        out = AlbertForPreTraining(cfg).apply(p, **batch, deterministic=True)
        mlm = losses.masked_lm_loss(out["mlm_logits"], labels, jnp.ones(labels.shape))
        return mlm + losses.sentence_order_loss(out["sop_logits"], labels[:, 0])

    found: collections.Counter = collections.Counter()
    _primitives(jax.make_jaxpr(jax.value_and_grad(loss))(params).jaxpr, found)
    dots = {dtypes for (name, dtypes) in found if name == "dot_general"}
    assert dots == {("bfloat16", "bfloat16")}, dots  # forward and backward matmuls
    for name in _FLOAT32_OPS:
        dtypes = {d for (n, d) in found if n == name}
        assert dtypes and all(d == ("float32",) for d in dtypes), (name, dtypes)
    sums = {d for (n, d) in found if n == "reduce_sum"}
    assert ("bfloat16",) not in sums, "a sum accumulates in bfloat16 (bias gradients?)"
    # Parameters stay float32 (LAMB / AdamW state follows them).
    assert {x.dtype for x in jax.tree.leaves(params)} == {jnp.dtype("float32")}
    value, grads = jax.jit(jax.value_and_grad(loss))(params)
    assert value.dtype == jnp.float32
    assert {x.dtype for x in jax.tree.leaves(grads)} == {jnp.dtype("float32")}


def test_bf16_tiny_run_reaches_the_fp32_eval_accuracy(corpus, tmp_path):
    """test_train's 120-step run in fp32 and in bf16: eval MLM accuracy within a point."""
    overrides = small_overrides(
        corpus,
        **{"model.hidden_size": 64, "model.intermediate_size": 128, "model.embedding_size": 32,
           "seq_len": 64, "max_predictions_per_seq": 10, "batch_size": 32,
           "num_train_steps": 120, "warmup_steps": 10, "learning_rate": 0.02,
           "log_every_steps": 40, "eval_every_steps": 120, "eval_batches": 4,
           "checkpoint_every_steps": 1000, "mesh.data": 8, "mesh.fsdp": 1, "mesh.tensor": 1},
    )  # fmt: skip
    results = {}
    for dtype in ("float32", "bfloat16"):
        config = make_config({**overrides, "model.dtype": dtype})
        results[dtype] = train.train_and_evaluate(config, str(tmp_path / dtype))
    fp32, bf16 = (results[d]["eval_mlm_accuracy"] for d in ("float32", "bfloat16"))
    print("eval MLM accuracy: fp32", fp32, "bf16", bf16)
    assert abs(bf16 - fp32) <= 0.01, (fp32, bf16)
    assert np.isfinite(results["bfloat16"]["eval_mlm_loss"])


def _upcasts(fn, *args) -> list[str]:
    """Lines of fn's optimized CPU HLO that convert an array to float32: on XLA:CPU, the
    operands of a bf16 dot that runs in fp32."""
    hlo = jax.jit(fn).lower(*args).compile().as_text()
    return re.findall(r"= f32\[[\d,]*\]\S* convert\(.*", hlo)


def test_bf16_matmul_gradients_match_fp32_and_run_in_bf16_on_cpu():
    """`layers.matmul` in bf16: y, dx and dW within bf16 rounding of the fp32 matmul's, and on
    a CPU whose XLA has bf16 matmuls (a plain bf16 x . w with f32 accumulation compiles with
    no upcast) none of the three is upcast to fp32."""
    kx, kw, kg = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(kx, (256, 96), jnp.bfloat16)
    w = jax.random.normal(kw, (96, 160), jnp.bfloat16)
    g = jax.random.normal(kg, (256, 160), jnp.bfloat16)

    def forward_backward(x, w, g):  # -> y [256, 160], dx [256, 96], dW [96, 160], all bf16
        y, vjp = jax.vjp(layers.matmul, x, w)
        return (y, *vjp(g))

    got = jax.jit(forward_backward)(x, w, g)
    f32 = [a.astype(jnp.float32) for a in (x, w, g)]
    y, vjp = jax.vjp(jnp.matmul, *f32[:2])
    for name, ours, ref in zip(("y", "dx", "dW"), got, (y, *vjp(f32[2])), strict=True):
        assert ours.dtype == jnp.bfloat16, name
        scale = float(jnp.max(jnp.abs(ref)))
        np.testing.assert_allclose(ours.astype(jnp.float32), ref, atol=0.01 * scale, err_msg=name)

    if jax.default_backend() != "cpu":
        return
    plain = lambda x, w: jax.lax.dot(x, w, preferred_element_type=jnp.float32)  # noqa: E731
    if _upcasts(plain, x, w):
        pytest.skip("this CPU's XLA runs every bf16 matmul in fp32")
    # Autodiff's own backward upcasts the weight gradient (x^T . dy); ours does not.
    assert _upcasts(lambda x, w, g: jax.vjp(jnp.matmul, x, w)[1](g), x, w, g)
    assert not _upcasts(forward_backward, x, w, g)
