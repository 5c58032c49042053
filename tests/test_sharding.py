"""Logical-axis rules -> PartitionSpecs for every parameter, and meshes."""

import flax.linen as nn
import jax
import pytest
from jax.sharding import PartitionSpec as P

from albert_jax.model.albert import AlbertForPreTraining, init_params
from albert_jax.model.config import ModelConfig
from albert_jax.sharding import LOGICAL_AXIS_RULES, create_mesh, resolve_mesh_shape


def mesh_specs(config: ModelConfig) -> dict[str, P]:
    boxed = jax.eval_shape(lambda: init_params(AlbertForPreTraining(config), jax.random.key(0)))
    specs = nn.logical_to_mesh(nn.get_partition_spec(boxed), LOGICAL_AXIS_RULES)
    flat = jax.tree_util.tree_leaves_with_path(specs, is_leaf=lambda x: isinstance(x, P))
    return {"/".join(k.key for k in path): spec for path, spec in flat}


BLOCK = "params/albert/encoder/group_0/inner_group_0"
# Expected spec of every parameter of an all-shared model (base: E=128 != H, so projection).
EXPECTED_ALL = {
    "params/albert/embeddings/word_embeddings": P("tensor", None),
    "params/albert/embeddings/position_embeddings": P(None, None),
    "params/albert/embeddings/token_type_embeddings": P(None, None),
    "params/albert/embeddings/LayerNorm/scale": P(None),
    "params/albert/embeddings/LayerNorm/bias": P(None),
    "params/albert/encoder/embedding_hidden_mapping_in/kernel": P(None, "fsdp"),
    "params/albert/encoder/embedding_hidden_mapping_in/bias": P("fsdp"),
    f"{BLOCK}/attention/query/kernel": P("fsdp", "tensor", None),
    f"{BLOCK}/attention/query/bias": P("tensor", None),
    f"{BLOCK}/attention/key/kernel": P("fsdp", "tensor", None),
    f"{BLOCK}/attention/key/bias": P("tensor", None),
    f"{BLOCK}/attention/value/kernel": P("fsdp", "tensor", None),
    f"{BLOCK}/attention/value/bias": P("tensor", None),
    f"{BLOCK}/attention/output/kernel": P("tensor", None, "fsdp"),
    f"{BLOCK}/attention/output/bias": P("fsdp"),
    f"{BLOCK}/attention/LayerNorm/scale": P("fsdp"),
    f"{BLOCK}/attention/LayerNorm/bias": P("fsdp"),
    f"{BLOCK}/ffn/intermediate/kernel": P("fsdp", "tensor"),
    f"{BLOCK}/ffn/intermediate/bias": P("tensor"),
    f"{BLOCK}/ffn/output/kernel": P("tensor", "fsdp"),
    f"{BLOCK}/ffn/output/bias": P("fsdp"),
    f"{BLOCK}/ffn/LayerNorm/scale": P("fsdp"),
    f"{BLOCK}/ffn/LayerNorm/bias": P("fsdp"),
    "params/albert/pooler/kernel": P("fsdp", "tensor"),
    "params/albert/pooler/bias": P("tensor"),
    "params/predictions/dense/kernel": P("fsdp", None),
    "params/predictions/dense/bias": P(None),
    "params/predictions/LayerNorm/scale": P(None),
    "params/predictions/LayerNorm/bias": P(None),
    "params/predictions/output_bias": P("tensor"),
    "params/sop_classifier/classifier/kernel": P("fsdp", None),
    "params/sop_classifier/classifier/bias": P(None),
}


def test_every_parameter_of_base_gets_the_expected_spec():
    assert mesh_specs(ModelConfig.preset("base")) == EXPECTED_ALL


def test_attention_shared_variant_stacks_the_ffn_over_an_unsharded_layer_axis():
    specs = mesh_specs(ModelConfig.preset("base", sharing="attention"))
    expected = dict(EXPECTED_ALL)
    for name, spec in EXPECTED_ALL.items():
        if name.startswith(f"{BLOCK}/ffn/"):
            expected[name] = P(None, *spec)  # leading `layers` axis: every device, every layer
    assert specs == expected


def test_mesh_shape_resolution_and_errors():
    assert resolve_mesh_shape((-1, 1, 1), 8) == (8, 1, 1)
    assert resolve_mesh_shape((2, -1, 2), 8) == (2, 2, 2)
    with pytest.raises(ValueError, match="at most one"):
        resolve_mesh_shape((-1, -1, 1), 8)
    with pytest.raises(ValueError, match="divisible"):
        resolve_mesh_shape((3, -1, 1), 8)
    with pytest.raises(ValueError, match="needs 4 devices"):
        resolve_mesh_shape((2, 2, 1), 8)
    mesh = create_mesh((1, 4, 2))
    assert dict(mesh.shape) == {"data": 1, "fsdp": 4, "tensor": 2}
    assert all(t == jax.sharding.AxisType.Auto for t in mesh.axis_types)


def test_mesh_slices_are_checked_against_the_devices_and_processes():
    """config.mesh.slices > 1 on devices without TPU slices makes each process a group: one
    process cannot be two; a negative count is refused; 0 and 1 are the plain mesh."""
    with pytest.raises(ValueError, match=r"config.mesh.slices=2: .* this job has 1"):
        create_mesh((8, 1, 1), slices=2)
    with pytest.raises(ValueError, match=r"config.mesh.slices=-1 must be >= 0"):
        create_mesh((8, 1, 1), slices=-1)
    assert (
        create_mesh((8, 1, 1), slices=1).devices.tolist() == create_mesh((8, 1, 1)).devices.tolist()
    )


# ----------------------------------------------------------------- one reduction per weight


@pytest.mark.parametrize("reduce_dtype,rtol", [("float32", 2e-5), ("bfloat16", 2e-2)])
@pytest.mark.parametrize("shape", [(8, 1, 1), (2, 2, 2), (1, 4, 2)])
def test_per_replica_forward_gives_the_automatic_programs_gradients(shape, reduce_dtype, rtol):
    """`forward_per_replica` (each weight entering the replica once, its gradient summed over
    every use there and reduced once) changes where the sums run, not the gradient: equal to
    the automatic partitioner's on data-parallel, FSDP + tensor and FSDP-only meshes of 8 CPU
    devices; summed in bfloat16, equal to its precision."""
    import jax.numpy as jnp
    import numpy as np

    from albert_jax.sharding import batch_sharding, forward_per_replica

    cfg = ModelConfig(vocab_size=96, embedding_size=16, hidden_size=32, num_hidden_layers=3,
                      num_attention_heads=4, intermediate_size=64,
                      max_position_embeddings=32)  # fmt: skip
    model = AlbertForPreTraining(cfg)
    rng = np.random.default_rng(0)
    batch = {
        "input_ids": rng.integers(5, 96, (16, 12)).astype(np.int32),
        "segment_ids": np.repeat([[0] * 6 + [1] * 6], 16, 0).astype(np.int32),
        "input_mask": np.ones((16, 12), np.int32),
        "masked_lm_positions": rng.integers(1, 11, (16, 4)).astype(np.int32),
    }

    def forward(params, batch, rng):
        del rng  # deterministic: the same program either way
        out = model.apply({"params": params}, **batch)
        return {"mlm": out["mlm_logits"], "sop": out["sop_logits"]}

    def loss(run, params, batch):
        out = run(params, batch, jax.random.key(0))
        return jnp.mean(out["mlm"] ** 2) + jnp.mean(out["sop"] ** 2)

    mesh = create_mesh(shape)
    with jax.set_mesh(mesh), nn.logical_axis_rules(LOGICAL_AXIS_RULES):
        boxed = init_params(model, jax.random.key(0), batch_size=8, seq_len=8)
        shardings = nn.logical_to_mesh_sharding(nn.get_partition_spec(boxed), mesh,
                                                LOGICAL_AXIS_RULES)["params"]  # fmt: skip
        params = jax.device_put(nn.meta.unbox(boxed)["params"], shardings)
        placed = jax.device_put(batch, batch_sharding(mesh))
        per_replica = forward_per_replica(forward, mesh, reduce_dtype)
        grads = {}
        for name, run in (("automatic", forward), ("per_replica", per_replica)):
            grad = jax.grad(lambda p, b, run=run: loss(run, p, b))
            grads[name] = jax.jit(grad, out_shardings=shardings)(params, placed)
    assert per_replica is not forward
    flat = dict(jax.tree_util.tree_leaves_with_path(grads["automatic"]))
    # (the key bias's gradient is zero up to rounding: softmax ignores it; hence one scale)
    scale = max(float(np.abs(np.asarray(g)).max()) for g in flat.values())
    for path, g in jax.tree_util.tree_leaves_with_path(grads["per_replica"]):
        ref = np.asarray(flat[path])
        np.testing.assert_allclose(np.asarray(g), ref, rtol=rtol, atol=rtol * scale,
                                   err_msg=str(path))  # fmt: skip
        assert g.sharding == flat[path].sharding
