"""The KerasHub contender of benchmarks/train_step.py is like for like with ours: the same
parameter count for the same config, and a step that trains on the same MLM + SOP loss.
Skipped where keras-hub is not installed (it is the optional `[peers]` extra)."""

import argparse
import math

import flax.linen as nn
import jax
import pytest

from albert_jax.model.albert import AlbertForPreTraining
from albert_jax.model.config import model_config_from
from albert_jax.pretrain import model_half
from albert_jax.sharding import LOGICAL_AXIS_RULES, create_mesh
from benchmarks import kerashub_peer, train_step

ARGS = argparse.Namespace(
    size="tiny", batch=2, seq=32, preds=4, remat="", dtype="float32", attention="xla"
)


@pytest.fixture(scope="module")
def setup():
    config = train_step.ours_config(ARGS)
    model_config = model_config_from(config)
    keras_model = kerashub_peer.build_model(model_config)
    if keras_model is None:
        pytest.skip("keras-hub not installed, or Keras already imported on another backend")
    return config, model_config, keras_model


def test_same_parameter_count_as_ours(setup):
    config, model_config, keras_model = setup
    mesh = create_mesh((1, 1, 1), jax.devices()[:1])
    with jax.set_mesh(mesh), nn.logical_axis_rules(LOGICAL_AXIS_RULES):
        _, abstract, _, _ = model_half.create_train_state(
            config, AlbertForPreTraining(model_config), mesh
        )
    ours = sum(math.prod(x.shape) for x in jax.tree.leaves(abstract.params))
    assert kerashub_peer.num_params(keras_model) == ours


def test_step_trains_on_mlm_plus_sop(setup):
    _, model_config, keras_model = setup
    batch = train_step.make_batch(ARGS.batch, ARGS.seq, ARGS.preds, model_config.vocab_size)
    step, state = kerashub_peer.make_train_step(
        keras_model, train_step.peer_adamw(), train_step.peer_loss
    )
    step = jax.jit(step)
    losses = []
    for _ in range(3):
        state, loss = step(state, batch)
        losses.append(float(loss))
    # Freshly initialized (std 0.02) logits are near uniform: MLM ~ log V, SOP ~ log 2.
    assert losses[0] == pytest.approx(math.log(model_config.vocab_size) + math.log(2), abs=0.1)
    assert losses[2] < losses[0]
