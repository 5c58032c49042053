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
