"""Unshare / reshare (`albert_jax.interop.unshare`, `python -m albert_jax.convert
--unshare|--reshare`): the unshared model is the shared one's function bit for bit, pretraining
continues from it at the shared model's loss, and reshare averages the layers and reports how
far outputs moved. Models are tiny and real (random weights in every tensor, biases and
LayerNorms included, so that a mis-mapped weight cannot hide behind a zero or a one);
checkpoints are real Orbax model dirs and training workdirs.
"""

import json
import os

import flax.linen as nn
import jax
import numpy as np
import pytest
from conftest import run_convert
from test_train import SMALL_MODEL, losses_by_step, make_config, small_overrides

from albert_jax.data.tokenizer import Tokenizer
from albert_jax.interop.unshare import (
    REPORT_FILES,
    applied_blocks,
    convert_sharing,
    model_outputs,
    output_difference,
    probe_batch,
    reshare,
    unshare,
)
from albert_jax.interop.weight_names import flatten_params as flatten
from albert_jax.model.albert import AlbertForPreTraining, init_params
from albert_jax.model.config import ModelConfig
from albert_jax.pretrain import train
from albert_jax.pretrain.settings import validate_config
from albert_jax.pretrained import load_pretrained, save_model_dir

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# test_train's pretraining model (vocab of the corpus tokenizer) at 4 layers: every model here
# has its sizes, so the op-by-op runs share their compiled primitives.
TINY = {**SMALL_MODEL, "num_hidden_layers": 4}
BLOCK = "albert/encoder/group_0/inner_group_0/"

# The layouts unshare reads: all-shared, grouped, inner groups, attention- or FFN-only sharing.
SHARED = {
    "all": dict(sharing="all"),
    "groups": dict(sharing="all", num_hidden_groups=2),
    "inner_groups": dict(sharing="all", inner_group_num=2),
    "attention_shared": dict(sharing="attention"),
    "ffn_shared": dict(sharing="ffn", num_hidden_groups=2),
}


def random_params(config: ModelConfig, seed: int):
    """{"params": ...} of numpy float32 arrays, every one random (shapes traced, not compiled)."""
    model = AlbertForPreTraining(config)
    shapes = jax.eval_shape(lambda k: nn.meta.unbox(init_params(model, k)), jax.random.key(0))
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda s: 0.1 * rng.standard_normal(s.shape).astype(np.float32), shapes)


def jit_outputs(params, config, batch):
    out = jax.jit(AlbertForPreTraining(config).apply)(
        params, *(batch[k] for k in ("input_ids", "segment_ids", "input_mask")),
        batch["masked_lm_positions"],
    )  # fmt: skip
    return {k: np.asarray(out[k]) for k in ("mlm_logits", "sop_logits", "sequence_output")}


# ------------------------------------------------------------------------------ in memory
@pytest.mark.parametrize("name", list(SHARED))
def test_unshared_model_is_the_shared_function_bit_for_bit(name):
    config = ModelConfig(**TINY, **SHARED[name])
    params = random_params(config, seed=len(name))
    unshared_params, unshared = unshare(params, config)

    depth = config.num_hidden_layers * config.inner_group_num
    assert (unshared.sharing, unshared.num_hidden_layers) == ("none", depth)
    assert (unshared.num_hidden_groups, unshared.inner_group_num) == (1, 1)
    assert unshared.replace(**{f: getattr(config, f) for f in (
        "sharing", "num_hidden_layers", "num_hidden_groups", "inner_group_num",
    )}) == config  # fmt: skip
    # The tree is the one the unshared model builds, shape for shape.
    expected = flatten(
        jax.eval_shape(
            lambda: nn.meta.unbox(init_params(AlbertForPreTraining(unshared), jax.random.key(0)))
        )
    )
    got = flatten(unshared_params)
    assert {k: v.shape for k, v in got.items()} == {k: v.shape for k, v in expected.items()}
    # Application 3 (of 4 layers; of 8 blocks with inner groups) ran this source weight.
    ran_third = {
        "all": ("group_0/inner_group_0", None),
        "groups": ("group_1/inner_group_0", None),  # layer 3 is in group 1
        "inner_groups": ("group_0/inner_group_1", None),  # layer 1, block 1
        "attention_shared": ("group_0/inner_group_0", None),
        "ffn_shared": ("group_1/inner_group_0", 1),  # group 1's second layer
    }
    block, index = ran_third[name]
    weight = flatten(params)[f"albert/encoder/{block}/attention/query/kernel"]
    np.testing.assert_array_equal(
        got[BLOCK + "attention/query/kernel"][3], weight if index is None else weight[index]
    )

    # Bit for bit, op by op (every primitive on the same inputs); the layers scanned on both
    # sides (unrolled is as exact: checked once, too slow to keep op by op).
    batch = probe_batch(config, seed=1)
    ours = model_outputs(unshared_params, unshared, batch)
    ref = model_outputs(params, config, batch)
    for key in ref:
        np.testing.assert_array_equal(ours[key], ref[key], err_msg=key)
    assert np.abs(ref["mlm_logits"]).max() > 0.1  # not a degenerate model
    if name == "inner_groups":
        # Compiled, the loop over loop-invariant shared weights and the one over per-layer
        # slices are different XLA programs: fp32 rounding may differ in the last bits (up to
        # 1.4e-6 on the unit-scale hidden states on CPU; bounded here with 10x room).
        ours = jit_outputs(unshared_params, unshared, batch)
        for key, ref in jit_outputs(params, config, batch).items():
            np.testing.assert_allclose(ours[key], ref, rtol=0, atol=1e-5, err_msg=key)


def test_reshare_averages_the_layers_and_the_outputs_change():
    # All-shared -> unshared -> reshared gives back the source exactly (a mean of equal copies).
    config = ModelConfig(**TINY)
    params = random_params(config, seed=3)
    back, back_config = reshare(*unshare(params, config))
    assert back_config == config
    jax.tree.map(np.testing.assert_array_equal, back, params)

    # A not-shared model: its one shared block is the mean of its layers; outputs change.
    unshared_config = ModelConfig(**TINY, sharing="none")
    unshared_params = random_params(unshared_config, seed=4)
    shared_params, shared = reshare(unshared_params, unshared_config)
    assert (shared.sharing, shared.num_hidden_layers) == ("all", TINY["num_hidden_layers"])
    layers = flatten(unshared_params)[BLOCK + "ffn/output/kernel"]
    np.testing.assert_array_equal(
        flatten(shared_params)[BLOCK + "ffn/output/kernel"],
        layers.mean(0, dtype=np.float64).astype(np.float32),
    )
    assert len(applied_blocks(shared_params, shared)) == TINY["num_hidden_layers"]
    change = output_difference(
        (unshared_params, unshared_config), (shared_params, shared), probe_batch(shared)
    )
    assert change["mlm_logits_max_abs_diff"] > 1e-2
    assert change["sequence_output_relative_l2"] > 1e-2
    assert 0.0 <= change["mlm_top1_agreement"] < 1.0


def test_nonsense_is_refused_with_the_reason():
    unshared = ModelConfig(**TINY, sharing="none")
    params = random_params(unshared, seed=5)
    with pytest.raises(ValueError, match="already unshared"):
        unshare(params, unshared)
    for sharing in ("all", "attention", "ffn"):
        with pytest.raises(ValueError, match=f"sharing='{sharing}'.*not-shared"):
            reshare(params, unshared.replace(sharing=sharing))
    # Params of another layout than the config says: every misfit named.
    with pytest.raises(ValueError, match="no weights under albert/encoder/group_0/inner_group_1/"):
        unshare(params, ModelConfig(**TINY, inner_group_num=2))
    with pytest.raises(ValueError, match="leading layer axis of 2"):
        unshare(params, ModelConfig(**TINY, sharing="attention", num_hidden_groups=2))
    with pytest.raises(ValueError, match="direction='sideways'"):
        convert_sharing("/nowhere", "/nowhere_too", "sideways")


# --------------------------------------------------------------------- checkpoints and CLI
def test_cli_unshare_then_pretraining_continues_at_the_shared_loss(corpus, tmp_path):
    """A shared model dir -> `--unshare` -> pretraining from it (`init_from`, 1 step): the
    first step's loss is the shared model's loss on that step's batch. Then `--reshare` of the
    continued run's workdir (its layers have moved apart) reports how far the outputs moved."""
    config = ModelConfig(**SMALL_MODEL)
    shared_dir, unshared_dir = str(tmp_path / "shared"), str(tmp_path / "unshared")
    save_model_dir(shared_dir, random_params(config, seed=6), config, corpus["tokenizer"])

    done = run_convert("--unshare", f"--src={shared_dir}", f"--dst={unshared_dir}")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "unshare: sharing='all', 2 layers" in done.stdout
    assert "-> sharing='none', 2 layers" in done.stdout
    assert "mlm_logits_max_abs_diff 0," in done.stdout
    report = json.loads((tmp_path / "unshared" / REPORT_FILES["unshare"]).read_text())
    assert report["result"]["sharing"] == "none"
    difference = report["output_difference"]
    assert difference.pop("mlm_top1_agreement") == 1.0
    assert set(difference.values()) == {0.0}  # every figure exactly 0
    loaded = load_pretrained(unshared_dir)
    assert loaded.config.sharing == "none" and loaded.tokenizer is not None

    # A second unshare is refused, saying why, before anything is written.
    with pytest.raises(ValueError, match="already unshared"):
        convert_sharing(unshared_dir, str(tmp_path / "again"), "unshare")
    assert not (tmp_path / "again").exists()

    # The continued run (1 step from the unshared dir) and the shared model's loss on that run's
    # step-1 batch, computed directly: the batch and the loss are the loop's own
    # (`train.pretraining`: its data half's stream from step 0, `next_batch`; its model half's
    # `loss`).
    overrides = small_overrides(
        corpus, num_train_steps=1, warmup_steps=0, checkpoint_every_steps=100
    )
    run_none = str(tmp_path / "run_none")
    unshared_config = make_config({**overrides, "model.sharing": "none", "init_from": unshared_dir})
    assert train.train_and_evaluate(unshared_config, run_none)["step"] == 1
    continued = losses_by_step(run_none)[1]
    shared_config = make_config({**overrides, "model.sharing": "all", "init_from": shared_dir})
    settings = validate_config(shared_config)
    mesh = settings.mesh.create()
    objective = train.pretraining(settings, mesh, Tokenizer(corpus["tokenizer"]))
    try:
        objective.data.start(0, None, None)
        batch = objective.data.next_batch(1)
    finally:
        objective.data.close()
    shared_params = load_pretrained(shared_dir).params
    # (no dropout in these models: the key is unused)
    shared_loss, _ = jax.jit(objective.model.loss)(shared_params, batch, jax.random.key(0))
    # The same batch through the same function; the two compiled programs (one device here,
    # the run's data-parallel step there) may round the last bits differently (see
    # test_unshared_model_is_the_shared_function_bit_for_bit).
    assert continued == pytest.approx(float(shared_loss), rel=1e-6, abs=0)

    # Reshare of the continued run's workdir (a training checkpoint; its layers moved apart
    # in the update): a model dir, and the report says how far the outputs moved.
    resharded = tmp_path / "reshared"
    report = convert_sharing(str(tmp_path / "run_none"), str(resharded), "reshare")
    assert report == json.loads((resharded / REPORT_FILES["reshare"]).read_text())
    assert report["source"]["sharing"] == "none" and report["result"]["sharing"] == "all"
    assert report["output_difference"]["mlm_logits_max_abs_diff"] > 0
    assert load_pretrained(str(resharded)).config.sharing == "all"
