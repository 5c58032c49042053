"""LAMB / AdamW against hand-written numpy references of the official update rules."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from albert_jax import optim, train_state

B1, B2, EPS, WD = 0.9, 0.999, 1e-6, 0.01


def flatten(tree, prefix=""):
    """{"a": {"b": x}} -> {"a/b": np.float64 array}."""
    out = {}
    for key, value in tree.items():
        name = f"{prefix}/{key}" if prefix else key
        if isinstance(value, dict):
            out.update(flatten(value, name))
        else:
            out[name] = np.asarray(value, np.float64)
    return out


def reference_optimizer(params, grads_per_step, lrs, *, excluded, trust_ratio, clip=None, eps=EPS):
    """Official LAMB (trust_ratio=True) / AdamWeightDecay (False), no bias correction, in numpy.

    params, grads: flat {"a/b": array}. `excluded`: names without decay and trust ratio.
    Returns the flat params after len(lrs) steps.
    """
    w = {k: v.copy() for k, v in params.items()}
    m = {k: np.zeros_like(v) for k, v in params.items()}
    v = {k: np.zeros_like(x) for k, x in params.items()}
    for grads, lr in zip(grads_per_step, lrs, strict=True):
        grads = {k: g.copy() for k, g in grads.items()}
        if clip is not None:
            global_norm = np.sqrt(sum(np.sum(g**2) for g in grads.values()))
            if global_norm > clip:
                grads = {k: g * clip / global_norm for k, g in grads.items()}
        for k in w:
            m[k] = B1 * m[k] + (1 - B1) * grads[k]
            v[k] = B2 * v[k] + (1 - B2) * grads[k] ** 2
            update = m[k] / (np.sqrt(v[k]) + eps)
            ratio = 1.0
            if k not in excluded:
                update = update + WD * w[k]
                if trust_ratio:
                    w_norm, u_norm = np.linalg.norm(w[k]), np.linalg.norm(update)
                    ratio = w_norm / u_norm if w_norm > 0 and u_norm > 0 else 1.0
            w[k] = w[k] - lr * ratio * update
    return w


def tiny_params():
    rng = np.random.default_rng(0)
    return {
        "encoder": {
            "attention": {"LayerNorm": {"scale": 1.0 + 0.1 * rng.standard_normal(4)}},
            "ffn": {"kernel": rng.standard_normal((4, 3)), "bias": 0.1 * rng.standard_normal(3)},
        },
        "zero": {"kernel": np.zeros((2, 3))},  # ‖w‖ = 0 -> trust ratio 1
        "frozen": {"kernel": np.zeros((2,))},  # ‖w‖ = ‖u‖ = 0 (no gradient) -> ratio 1, no NaN
        "cls": {"output_bias": np.zeros(5)},
    }


def tiny_grads(step):
    rng = np.random.default_rng(100 + step)
    grads = jax.tree.map(lambda p: rng.standard_normal(np.shape(p)), tiny_params())
    grads["frozen"]["kernel"] = np.zeros((2,))
    return grads


EXCLUDED = {"encoder/attention/LayerNorm/scale", "encoder/ffn/bias", "cls/output_bias"}


def run(tx, params, num_steps):
    params = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), params)
    state = tx.init(params)
    update = jax.jit(tx.update)
    for step in range(num_steps):
        grads = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), tiny_grads(step))
        updates, state = update(grads, state, params)
        params = optax.apply_updates(params, updates)
    return params, state


def assert_matches(actual_tree, expected_flat):
    actual = flatten(jax.tree.map(np.asarray, actual_tree))
    assert actual.keys() == expected_flat.keys()
    for key in actual:
        np.testing.assert_allclose(
            actual[key], expected_flat[key], rtol=2e-5, atol=1e-7, err_msg=key
        )


def test_decay_mask_follows_official_exclusions():
    params = {
        "albert": {
            "embeddings": {
                "word_embeddings": {"embedding": 0},
                "LayerNorm": {"scale": 0, "bias": 0},
            },
            "encoder": {"layer": {"ffn": {"kernel": 0, "bias": 0}}},
            "pooler": {"kernel": 0},
        },
        "cls": {"output_bias": 0, "layer_norm": {"scale": 0}},
    }
    flat = flatten(optim.decay_mask(params))
    assert {k for k, v in flat.items() if v} == {
        "albert/embeddings/word_embeddings/embedding",
        "albert/encoder/layer/ffn/kernel",
        "albert/pooler/kernel",
    }


def test_decay_mask_rejects_boxed_params():
    boxed = {"dense": {"kernel": nn.Partitioned(jnp.ones((2, 2)), names=("embed", "mlp"))}}
    with pytest.raises(ValueError, match="unbox"):
        optim.decay_mask(boxed)


def test_lamb_matches_hand_computed_updates():
    lrs = [0.01, 0.009, 0.008]  # warmup 0, total 10: lr·(1 − step/10)
    tx = optim.lamb(optim.warmup_polynomial_decay(0.01, 0, 10))
    params, _ = run(tx, tiny_params(), num_steps=3)
    expected = reference_optimizer(
        flatten(tiny_params()),
        [flatten(tiny_grads(s)) for s in range(3)],
        lrs,
        excluded=EXCLUDED,
        trust_ratio=True,
    )
    assert_matches(params, expected)
    # The trust ratio really acted on the kernel: plain AdamW numbers differ.
    adamw_numbers = reference_optimizer(
        flatten(tiny_params()),
        [flatten(tiny_grads(s)) for s in range(3)],
        lrs,
        excluded=EXCLUDED,
        trust_ratio=False,
    )
    kernel = np.asarray(params["encoder"]["ffn"]["kernel"])
    assert not np.allclose(kernel, adamw_numbers["encoder/ffn/kernel"], rtol=1e-3)


def test_lamb_trust_ratio_is_one_for_zero_norms():
    tx = optim.lamb(0.01)
    params, _ = run(tx, tiny_params(), num_steps=1)
    g = tiny_grads(0)["zero"]["kernel"]
    # First step without bias correction: m = 0.1·g, v = 0.001·g², and w = 0 adds no decay.
    direction = 0.1 * g / (np.sqrt(0.001 * g**2) + EPS)
    np.testing.assert_allclose(params["zero"]["kernel"], -0.01 * direction, rtol=1e-5)
    np.testing.assert_array_equal(params["frozen"]["kernel"], np.zeros(2))


def test_excluded_leaves_get_no_decay():
    # With zero gradients only weight decay could move a parameter.
    params = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32) + 1.0, tiny_params())
    grads = jax.tree.map(jnp.zeros_like, params)
    tx = optim.lamb(0.1)
    updates, _ = jax.jit(tx.update)(grads, tx.init(params), params)
    flat = flatten(jax.tree.map(np.asarray, updates))
    weights = flatten(jax.tree.map(np.asarray, params))
    for name, value in flat.items():
        if name in EXCLUDED:
            np.testing.assert_array_equal(value, 0.0, err_msg=name)
        else:
            # u = wd·w, so r = ‖w‖/‖wd·w‖ = 1/wd and the step is −lr·w.
            np.testing.assert_allclose(value, -0.1 * weights[name], rtol=1e-5, err_msg=name)


def test_adamw_one_step():
    tx = optim.adamw(optim.warmup_linear_decay(2e-3, 0, 100))
    params, _ = run(tx, tiny_params(), num_steps=1)
    expected = reference_optimizer(
        flatten(tiny_params()),
        [flatten(tiny_grads(0))],
        [2e-3],
        excluded=EXCLUDED,
        trust_ratio=False,
    )
    assert_matches(params, expected)


def pretrain_config(**overrides):
    fields = dict(
        optimizer="lamb",
        learning_rate=0.01,
        warmup_steps=1,
        num_train_steps=10,
        weight_decay=WD,
        grad_clip_norm=1.0,
        b1=B1,
        b2=B2,
        eps=EPS,
        lr_poly_power=1.0,
    )
    fields.update(overrides)  # before ConfigDict, which refuses type-changing updates
    return ml_collections.ConfigDict(fields)


@pytest.mark.parametrize("name,trust_ratio", [("lamb", True), ("adamw", False)])
def test_make_optimizer_clips_and_schedules(name, trust_ratio):
    # eps = 1 makes the Adam direction depend on the gradient scale, so clipping shows.
    tx = optim.make_optimizer(pretrain_config(optimizer=name, eps=1.0, grad_clip_norm=1.0))
    params, state = run(tx, tiny_params(), num_steps=3)
    lrs = [0.0, 0.01 * (1 - 1 / 10), 0.01 * (1 - 2 / 10)]  # warmup 1 step, then decay from 0
    grads = [flatten(tiny_grads(s)) for s in range(3)]
    common = dict(excluded=EXCLUDED, trust_ratio=trust_ratio, eps=1.0)
    expected = reference_optimizer(flatten(tiny_params()), grads, lrs, clip=1.0, **common)
    assert_matches(params, expected)
    unclipped = reference_optimizer(flatten(tiny_params()), grads, lrs, **common)
    kernel = np.asarray(params["encoder"]["ffn"]["kernel"])
    assert not np.allclose(kernel, unclipped["encoder/ffn/kernel"], rtol=1e-4)
    np.testing.assert_allclose(optim.current_learning_rate(state), lrs[-1], rtol=1e-6)


def test_stacked_leaf_gets_one_trust_ratio_per_layer():
    rng = np.random.default_rng(1)
    kernels = [s * rng.standard_normal((4, 3)) for s in (0.1, 1.0, 5.0)]
    grads = [rng.standard_normal((4, 3)) for _ in kernels]
    stacked = {"encoder": {"layers": {"kernel": jnp.asarray(np.stack(kernels), jnp.float32)}}}
    stacked_grads = {"encoder": {"layers": {"kernel": jnp.asarray(np.stack(grads), jnp.float32)}}}
    apart = {f"layer_{i}": {"kernel": jnp.asarray(k, jnp.float32)} for i, k in enumerate(kernels)}
    apart_grads = {
        f"layer_{i}": {"kernel": jnp.asarray(g, jnp.float32)} for i, g in enumerate(grads)
    }

    tx = optim.lamb(0.01)
    expected, _ = jax.jit(tx.update)(apart_grads, tx.init(apart), apart)
    expected = np.stack([expected[f"layer_{i}"]["kernel"] for i in range(3)])

    boxed = {
        "encoder": {
            "layers": {
                "kernel": nn.Partitioned(
                    stacked["encoder"]["layers"]["kernel"], names=("layers", "embed", "mlp")
                )
            }
        }
    }
    for spec in (("encoder/layers/",), optim.stacked_from_logical_axes(boxed)):
        tx = optim.lamb(0.01, stacked=spec)
        updates, _ = jax.jit(tx.update)(stacked_grads, tx.init(stacked), stacked)
        np.testing.assert_allclose(updates["encoder"]["layers"]["kernel"], expected, rtol=1e-6)

    # Without the stacked spec one ratio covers all layers, which is a different update.
    tx = optim.lamb(0.01)
    updates, _ = jax.jit(tx.update)(stacked_grads, tx.init(stacked), stacked)
    assert not np.allclose(updates["encoder"]["layers"]["kernel"], expected, rtol=1e-3)


def test_warmup_polynomial_decay_values():
    schedule = optim.warmup_polynomial_decay(1e-3, warmup_steps=10, total_steps=100)
    steps = [0, 5, 9, 10, 50, 99, 100, 150]
    expected = [0.0, 5e-4, 9e-4, 9e-4, 5e-4, 1e-5, 0.0, 0.0]
    np.testing.assert_allclose([schedule(s) for s in steps], expected, rtol=1e-5, atol=1e-12)

    squared = optim.warmup_polynomial_decay(1e-3, 10, 100, power=2.0, end_lr=1e-4)
    np.testing.assert_allclose(squared(50), 0.9e-3 * 0.25 + 1e-4, rtol=1e-6)

    paper = optim.warmup_polynomial_decay(0.00176, 3125, 125000)
    np.testing.assert_allclose(paper(3125), 0.00176 * (1 - 3125 / 125000), rtol=1e-6)
    np.testing.assert_allclose(paper(1000), 0.00176 * 1000 / 3125, rtol=1e-6)

    linear = optim.warmup_linear_decay(2e-5, 10, 100)
    np.testing.assert_allclose(linear(40), 2e-5 * 0.6, rtol=1e-6)


@pytest.mark.parametrize(
    "overrides,field",
    [
        (dict(optimizer="sgd"), "optimizer"),
        (dict(learning_rate=0.0), "learning_rate"),
        (dict(warmup_steps=20), "warmup_steps"),
        (dict(num_train_steps=2.5), "num_train_steps"),
        (dict(weight_decay=-0.1), "weight_decay"),
        (dict(grad_clip_norm=-1.0), "grad_clip_norm"),
        (dict(b2=1.0), "b2"),
        (dict(eps="tiny"), "eps"),
        (dict(lr_poly_power=0.0), "lr_poly_power"),
    ],
)
def test_make_optimizer_rejects_bad_fields(overrides, field):
    with pytest.raises(ValueError, match=field):
        optim.make_optimizer(pretrain_config(**overrides))


def test_make_optimizer_names_missing_field():
    config = pretrain_config()
    del config["lr_poly_power"]
    with pytest.raises(ValueError, match="lr_poly_power"):
        optim.make_optimizer(config)


def linear_loss_and_grad():
    def loss_fn(params, batch, rng):
        del rng
        pred = batch["x"] @ params["w"] + params["b"]
        loss = jnp.mean((pred - batch["y"]) ** 2)
        aux = {"mean_pred": jnp.mean(pred), "count": jnp.asarray(batch["y"].shape[0], jnp.int32)}
        return loss, aux

    return jax.value_and_grad(loss_fn, has_aux=True)


def regression_problem(batch_size):
    rng = np.random.default_rng(3)
    params = {"w": jnp.asarray(rng.standard_normal(5), jnp.float32), "b": jnp.float32(0.3)}
    batch = {
        "x": jnp.asarray(rng.standard_normal((batch_size, 5)), jnp.float32),
        "y": jnp.asarray(rng.standard_normal(batch_size), jnp.float32),
    }
    return params, batch


def test_accumulated_gradient_equals_full_batch():
    fn = linear_loss_and_grad()
    params, batch = regression_problem(16)
    full_loss, full_aux, full_grads = train_state.accumulate_gradients(fn, params, batch, 1, None)
    loss, aux, grads = jax.jit(train_state.accumulate_gradients, static_argnums=(0, 3))(
        fn, params, batch, 4, jax.random.key(0)
    )
    np.testing.assert_allclose(loss, full_loss, rtol=1e-6)
    np.testing.assert_allclose(aux["mean_pred"], full_aux["mean_pred"], rtol=1e-5)
    assert int(aux["count"]) == 16  # integer aux is summed
    for key in params:
        np.testing.assert_allclose(grads[key], full_grads[key], rtol=1e-5, atol=1e-7)


def test_accumulation_on_a_sharded_batch():
    fn = linear_loss_and_grad()
    params, batch = regression_problem(32)
    _, _, full_grads = train_state.accumulate_gradients(fn, params, batch, 1, None)
    mesh = Mesh(np.array(jax.devices()[:8]), ("data",))
    sharded = jax.device_put(batch, NamedSharding(mesh, PartitionSpec("data")))
    step = jax.jit(lambda p, b: train_state.accumulate_gradients(fn, p, b, 2, None)[2])
    grads = step(params, sharded)
    for key in params:
        np.testing.assert_allclose(grads[key], full_grads[key], rtol=1e-5, atol=1e-7)
    # Each device keeps its own rows of every microbatch: no batch data moves between devices.
    hlo = step.lower(params, sharded).compile().as_text()
    assert "all-to-all" not in hlo and "all-gather" not in hlo and "collective-permute" not in hlo


def test_accumulation_rejects_indivisible_batch():
    params, batch = regression_problem(10)
    with pytest.raises(ValueError, match="num_microbatches"):
        train_state.accumulate_gradients(linear_loss_and_grad(), params, batch, 4, None)
