"""The Flax ALBERT model: config validation, sharing strategies, scan == loop, gradients."""

import json

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from albert_jax.model.albert import AlbertForPreTraining, AlbertModel, init_params
from albert_jax.model.config import ModelConfig
from albert_jax.model.layers import Dense
from albert_jax.sharding import LOGICAL_AXIS_RULES, create_mesh

TINY = dict(
    vocab_size=97,
    embedding_size=16,
    hidden_size=32,
    num_hidden_layers=4,
    num_attention_heads=4,
    intermediate_size=64,
    max_position_embeddings=32,
)


def tiny(**overrides) -> ModelConfig:
    return ModelConfig(**{**TINY, **overrides})


def make_batch(cfg: ModelConfig, batch: int = 3, seq: int = 12, preds: int = 4, seed: int = 0):
    rng = np.random.default_rng(seed)
    ids = rng.integers(5, cfg.vocab_size, (batch, seq)).astype(np.int32)
    mask = np.ones((batch, seq), np.int32)
    mask[1, 8:] = 0  # a padded sequence
    ids[1, 8:] = 0
    segments = np.zeros((batch, seq), np.int32)
    segments[:, seq // 2 :] = 1
    positions = np.stack([rng.choice(np.arange(1, 8), preds, replace=False) for _ in range(batch)])
    return dict(
        input_ids=jnp.asarray(ids),
        segment_ids=jnp.asarray(segments),
        input_mask=jnp.asarray(mask),
        masked_lm_positions=jnp.asarray(positions.astype(np.int32)),
    )


def init(cfg: ModelConfig, seed: int = 0):
    return nn.meta.unbox(init_params(AlbertForPreTraining(cfg), jax.random.key(seed)))


# ------------------------------------------------------------------------------- config
@pytest.mark.parametrize(
    "overrides, field",
    [
        (dict(hidden_size=30), "hidden_size"),
        (dict(num_hidden_groups=3), "num_hidden_groups"),
        (dict(sharing="some"), "sharing"),
        (dict(hidden_act="gelu2"), "hidden_act"),
        (dict(remat_policy="sometimes"), "remat_policy"),
        (dict(dtype="float8"), "dtype"),
        (dict(vocab_size=0), "vocab_size"),
        (dict(hidden_dropout_prob=1.5), "hidden_dropout_prob"),
    ],
)
def test_config_errors_name_the_field(overrides, field):
    with pytest.raises(ValueError, match=field):
        tiny(**overrides)


def test_presets_are_the_official_sizes():
    expected = {
        "base": (768, 12, 12, 3072),
        "large": (1024, 24, 16, 4096),
        "xlarge": (2048, 24, 16, 8192),
        "xxlarge": (4096, 12, 64, 16384),
    }
    for name, (h, layers, heads, inter) in expected.items():
        c = ModelConfig.preset(name)
        assert (c.hidden_size, c.num_hidden_layers, c.num_attention_heads) == (h, layers, heads)
        assert (c.intermediate_size, c.embedding_size, c.vocab_size) == (inter, 128, 30000)
    assert ModelConfig.preset("base", sharing="ffn").sharing == "ffn"
    with pytest.raises(ValueError, match="size"):
        ModelConfig.preset("huge")


def test_from_json_official_and_hf(tmp_path):
    official = {
        "attention_probs_dropout_prob": 0,
        "hidden_act": "gelu",
        "hidden_dropout_prob": 0,
        "embedding_size": 128,
        "hidden_size": 4096,
        "initializer_range": 0.02,
        "intermediate_size": 16384,
        "max_position_embeddings": 512,
        "num_attention_heads": 64,
        "num_hidden_layers": 12,
        "num_hidden_groups": 1,
        "net_structure_type": 0,
        "gap_size": 0,
        "num_memory_blocks": 0,
        "inner_group_num": 1,
        "down_scale_factor": 1,
        "type_vocab_size": 2,
        "vocab_size": 30000,
    }
    (tmp_path / "albert_config.json").write_text(json.dumps(official))
    c = ModelConfig.from_json(str(tmp_path / "albert_config.json"))
    assert c == ModelConfig.preset("xxlarge")  # TF "gelu" is the tanh form == gelu_new
    hf = {**official, "model_type": "albert", "hidden_act": "gelu", "layer_norm_eps": 1e-12}
    (tmp_path / "config.json").write_text(json.dumps(hf))
    c = ModelConfig.from_json(str(tmp_path / "config.json"))
    assert c.hidden_act == "gelu" and c.always_project_embeddings


# ----------------------------------------------------------------------- forward pass
def test_output_shapes_and_gathered_mlm_logits():
    cfg = tiny()
    params = init(cfg)
    batch = make_batch(cfg)
    model = AlbertForPreTraining(cfg)
    out = model.apply(params, **batch)
    assert out["sequence_output"].shape == (3, 12, 32)
    assert out["pooled_output"].shape == (3, 32)
    assert out["mlm_logits"].shape == (3, 4, 97)
    assert out["sop_logits"].shape == (3, 2)
    full = model.apply(params, **{**batch, "masked_lm_positions": None})["mlm_logits"]
    gathered = np.take_along_axis(
        np.asarray(full), np.asarray(batch["masked_lm_positions"])[..., None], axis=1
    )
    np.testing.assert_allclose(out["mlm_logits"], gathered, atol=1e-5)


def test_dense_matches_dot_general_and_rejects_a_mismatched_input():
    """`Dense` runs [rows, K] . [K, N]; the result is the plain contraction over in_shape."""
    cfg = tiny()
    dense = Dense((4, 8), (32,), ("heads", "kv", "embed"), cfg)
    x = jax.random.normal(jax.random.key(1), (3, 5, 4, 8))
    variables = dense.init(jax.random.key(0), x)
    kernel = nn.unbox(variables)["params"]["kernel"]
    expected = jnp.einsum("bsnd,ndh->bsh", x, kernel)
    np.testing.assert_allclose(dense.apply(variables, x), expected, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dense.apply(variables, x[0, 0]), expected[0, 0], atol=1e-5)
    with pytest.raises(ValueError, match=r"does not end in \(4, 8\)"):
        dense.apply(variables, x.reshape(3, 5, 32))


def test_padding_does_not_leak_into_real_tokens():
    cfg = tiny()
    params = init(cfg)
    batch = make_batch(cfg)
    out = AlbertForPreTraining(cfg).apply(params, **batch)
    ids = np.asarray(batch["input_ids"]).copy()
    ids[1, 8:] = 42  # change only padded tokens
    out2 = AlbertForPreTraining(cfg).apply(params, **{**batch, "input_ids": jnp.asarray(ids)})
    np.testing.assert_allclose(
        out["sequence_output"][1, :8], out2["sequence_output"][1, :8], atol=1e-5
    )


def test_all_shared_parameter_count_does_not_grow_with_depth():
    def count(layers):
        shapes = jax.eval_shape(lambda: init(tiny(num_hidden_layers=layers)))
        return sum(np.prod(x.shape) for x in jax.tree_util.tree_leaves(shapes))

    assert count(2) == count(4) == count(48)
    none = lambda layers: sum(  # noqa: E731
        np.prod(x.shape)
        for x in jax.tree_util.tree_leaves(
            jax.eval_shape(lambda: init(tiny(num_hidden_layers=layers, sharing="none")))
        )
    )
    assert none(4) > none(2)


@pytest.mark.parametrize(
    "overrides",
    [
        dict(sharing="all"),
        dict(sharing="attention"),
        dict(sharing="ffn"),
        dict(sharing="none"),
        dict(sharing="all", num_hidden_groups=2, inner_group_num=2),
        dict(sharing="attention", num_hidden_groups=2, inner_group_num=2),
    ],
)
def test_scan_equals_python_loop(overrides):
    cfg = tiny(**overrides)
    params = init(cfg)
    batch = make_batch(cfg)
    scanned = AlbertForPreTraining(cfg).apply(params, **batch)
    looped = AlbertForPreTraining(cfg.replace(scan_layers=False)).apply(params, **batch)
    for key in ("sequence_output", "mlm_logits", "sop_logits"):
        np.testing.assert_allclose(scanned[key], looped[key], atol=2e-5, err_msg=key)


# One case per distinct branch of SharedEncoder's split-off last application (each case is
# a few compiles, so branches are combined rather than crossed):
@pytest.mark.parametrize(
    "overrides",
    [
        # scan + remat, unshared sub-blocks: the split-off block selects layer L-1's weights
        dict(sharing="none", remat_policy="dots"),
        # unrolled (scan_layers=False), attention shared and FFN stacked
        dict(sharing="ffn", scan_layers=False),
        # scan, two groups of two inner blocks, remat "full": the split is in group_1 only
        dict(sharing="attention", num_hidden_groups=2, inner_group_num=2, remat_policy="full"),
        # one layer per group: the scan of length 0 is skipped, `blocks` runs on the scanned
        # (and rematerialized) module alone
        dict(sharing="all", num_hidden_groups=4, remat_policy="dots"),
    ],
)
def test_last_layer_at_read_rows_only_gives_the_same_heads_and_gradients(overrides):
    """return_sequence_output=False (the pretraining step) runs the last layer at [CLS] and
    the masked positions only: same logits, same gradients as the full last layer."""
    cfg = tiny(**overrides)
    params = init(cfg)
    batch = make_batch(cfg)
    model = AlbertForPreTraining(cfg)

    def heads(p, full: bool):
        out = model.apply(p, **batch, return_sequence_output=full)
        assert ("sequence_output" in out) == full
        return out["mlm_logits"], out["sop_logits"]

    # Compiled, not eager: op-by-op dispatch of these programs costs more than compiling them.
    compiled = jax.jit(heads, static_argnums=1)
    for a, b in zip(compiled(params, True), compiled(params, False), strict=True):
        np.testing.assert_allclose(a, b, atol=2e-5)

    def loss(p, full: bool):
        mlm, sop = heads(p, full)
        return jnp.sum(mlm**2) * 1e-3 + jnp.sum(sop**2)

    grad = jax.jit(jax.grad(loss), static_argnums=1)
    full_grads, read_grads = (grad(params, f) for f in (True, False))
    leaves = jax.tree_util.tree_leaves_with_path(full_grads)
    assert len(leaves) == len(jax.tree_util.tree_leaves(read_grads))
    for (path, a), b in zip(leaves, jax.tree_util.tree_leaves(read_grads), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6, err_msg=str(path))
    with pytest.raises(ValueError, match="masked_lm_positions"):
        inputs = {k: v for k, v in batch.items() if k != "masked_lm_positions"}
        model.apply(params, **inputs, return_sequence_output=False)


def test_sharing_strategies_have_the_right_parameter_layout():
    layers = TINY["num_hidden_layers"]
    for sharing, attn_stacked, ffn_stacked in [
        ("all", False, False),
        ("attention", False, True),
        ("ffn", True, False),
        ("none", True, True),
    ]:
        p = init(tiny(sharing=sharing))["params"]["albert"]["encoder"]["group_0"]["inner_group_0"]
        q = p["attention"]["query"]["kernel"]
        w = p["ffn"]["intermediate"]["kernel"]
        assert (q.shape[0] == layers) == attn_stacked and q.ndim == 3 + attn_stacked, sharing
        assert (w.shape[0] == layers) == ffn_stacked and w.ndim == 2 + ffn_stacked, sharing


def test_groups_follow_official_semantics():
    """L=4, G=2, inner=2: layers 0,1 run group_0's two blocks, layers 2,3 run group_1's."""
    cfg = tiny(num_hidden_groups=2, inner_group_num=2)
    params = init(cfg)
    enc = params["params"]["albert"]["encoder"]
    assert sorted(k for k in enc if k.startswith("group_")) == ["group_0", "group_1"]
    assert sorted(enc["group_0"]) == ["inner_group_0", "inner_group_1"]
    batch = make_batch(cfg)

    # Reference: apply the blocks by hand, in the official order.
    model = AlbertModel(cfg)
    x = model.apply(
        {"params": params["params"]["albert"]},
        batch["input_ids"],
        batch["segment_ids"],
        batch["input_mask"],
        method=_embed_and_project,
    )
    from albert_jax.model.albert import AlbertLayer

    mask = batch["input_mask"].astype(bool)[:, None, None, :]
    for layer_idx in range(cfg.num_hidden_layers):
        g = int(layer_idx / cfg.num_hidden_layers * cfg.num_hidden_groups)
        for i in range(cfg.inner_group_num):
            block = {"params": enc[f"group_{g}"][f"inner_group_{i}"]}
            x = AlbertLayer(cfg).apply(block, x, mask, None, True)
    out = model.apply(
        {"params": params["params"]["albert"]},
        batch["input_ids"],
        batch["segment_ids"],
        batch["input_mask"],
    )
    np.testing.assert_allclose(out["sequence_output"], x, atol=2e-5)


def _embed_and_project(self, input_ids, segment_ids, input_mask):
    x = self.embeddings(input_ids, segment_ids, True)
    p = self.encoder.variables["params"]["embedding_hidden_mapping_in"]
    return x @ p["kernel"] + p["bias"]


def _loss(cfg, params, batch):
    out = AlbertForPreTraining(cfg).apply(params, **batch)
    return jnp.sum(out["mlm_logits"] ** 2) * 1e-3 + jnp.sum(out["sop_logits"] ** 2)


def test_shared_gradient_is_the_sum_of_per_layer_gradients():
    cfg = tiny()
    params = init(cfg)
    batch = make_batch(cfg)
    # Compiled value_and_grad: the loss and gradient of one program, not eager op dispatch.
    shared_loss, shared_grads = jax.jit(jax.value_and_grad(lambda p: _loss(cfg, p, batch)))(params)

    # The same network unrolled with one (identical) weight copy per layer.
    unrolled = cfg.replace(sharing="none", scan_layers=False)
    layers = cfg.num_hidden_layers
    tile = lambda x: jnp.broadcast_to(x, (layers, *x.shape))  # noqa: E731
    block = params["params"]["albert"]["encoder"]["group_0"]
    stacked = jax.tree_util.tree_map(tile, block)
    unrolled_params = jax.tree_util.tree_map(lambda x: x, params)
    unrolled_params["params"]["albert"]["encoder"]["group_0"] = stacked
    unrolled_loss, per_layer = jax.jit(jax.value_and_grad(lambda p: _loss(unrolled, p, batch)))(
        unrolled_params
    )
    np.testing.assert_allclose(shared_loss, unrolled_loss, rtol=1e-5)
    summed = jax.tree_util.tree_map(
        lambda g: g.sum(0), per_layer["params"]["albert"]["encoder"]["group_0"]
    )
    expected = shared_grads["params"]["albert"]["encoder"]["group_0"]
    flat_sum = jax.tree_util.tree_leaves_with_path(summed)
    flat_exp = dict(jax.tree_util.tree_leaves_with_path(expected))
    assert len(flat_sum) == len(flat_exp) == 16
    for path, g in flat_sum:
        np.testing.assert_allclose(g, flat_exp[path], rtol=2e-4, atol=1e-6, err_msg=str(path))
        assert float(jnp.abs(g).max()) > 0


@pytest.mark.parametrize("policy", ["full", "minimal"])
def test_remat_policies_preserve_values_and_gradients(policy):
    cfg = tiny(sharing="attention")
    params = init(cfg)
    batch = make_batch(cfg)
    ref_loss, ref_grads = jax.value_and_grad(lambda p: _loss(cfg, p, batch))(params)
    remat = cfg.replace(remat_policy=policy)
    loss, grads = jax.jit(jax.value_and_grad(lambda p: _loss(remat, p, batch)))(params)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    for a, b in zip(
        jax.tree_util.tree_leaves(grads), jax.tree_util.tree_leaves(ref_grads), strict=True
    ):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_bfloat16_compute_keeps_float32_params():
    cfg = tiny(dtype="bfloat16")
    params = init(cfg)
    assert all(x.dtype == jnp.float32 for x in jax.tree_util.tree_leaves(params))
    out = AlbertForPreTraining(cfg).apply(params, **make_batch(cfg))
    assert out["sequence_output"].dtype == jnp.bfloat16
    ref = AlbertForPreTraining(cfg.replace(dtype="float32")).apply(params, **make_batch(cfg))
    np.testing.assert_allclose(
        np.asarray(out["sop_logits"], np.float32), ref["sop_logits"], atol=0.1
    )


def test_dropout_is_active_only_when_not_deterministic():
    cfg = tiny(hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1)
    params = init(cfg)
    batch = make_batch(cfg)
    model = AlbertForPreTraining(cfg)
    a = model.apply(params, **batch)["sequence_output"]
    b = model.apply(params, **batch)["sequence_output"]
    np.testing.assert_array_equal(a, b)
    rngs = lambda s: {"dropout": jax.random.key(s)}  # noqa: E731
    c = model.apply(params, **batch, deterministic=False, rngs=rngs(1))["sequence_output"]
    d = model.apply(params, **batch, deterministic=False, rngs=rngs(2))["sequence_output"]
    assert float(jnp.abs(c - a).max()) > 1e-3 and float(jnp.abs(c - d).max()) > 1e-3


def test_every_parameter_has_logical_axes_and_shards_on_a_mesh():
    cfg = tiny(sharing="attention", vocab_size=96)  # vocab split over tensor=2
    boxed = jax.eval_shape(lambda: init_params(AlbertForPreTraining(cfg), jax.random.key(0)))
    leaves = jax.tree_util.tree_leaves(boxed, is_leaf=lambda x: isinstance(x, nn.Partitioned))
    assert leaves and all(isinstance(x, nn.Partitioned) for x in leaves)
    for x in leaves:
        assert len(x.names) == len(x.value.shape)
    mesh = create_mesh((2, 2, 2))
    shardings = nn.logical_to_mesh_sharding(nn.get_partition_spec(boxed), mesh, LOGICAL_AXIS_RULES)
    ffn = shardings["params"]["albert"]["encoder"]["group_0"]["inner_group_0"]["ffn"]
    assert ffn["intermediate"]["kernel"].spec == jax.sharding.PartitionSpec(None, "fsdp", "tensor")

    params = init(cfg)
    batch = make_batch(cfg, batch=4)
    ref = AlbertForPreTraining(cfg).apply(params, **batch)["sop_logits"]
    sharded = jax.device_put(params, nn.meta.unbox(shardings))
    with jax.set_mesh(mesh), nn.logical_axis_rules(LOGICAL_AXIS_RULES):
        out = jax.jit(lambda p, b: AlbertForPreTraining(cfg).apply(p, **b)["sop_logits"])(
            sharded, batch
        )
    np.testing.assert_allclose(out, ref, atol=1e-5)
