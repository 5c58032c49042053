"""Accelerator images often have no TensorFlow / TFDS / blingfire (they only build data here):
everything but data building must import and run without them. A subprocess where `import
tensorflow`, `import tensorflow_datasets` and `import blingfire` fail runs the model, LAMB and
the jitted training step, and imports the train-step and speed-up benchmarks."""

from __future__ import annotations

import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Blocks the imports before anything else runs (a None entry in sys.modules makes `import`
# raise ImportError), then trains a tiny model two LAMB steps through the loop's own step.
_SCRIPT = r"""
import sys
BLOCKED = ("tensorflow", "tensorflow_datasets", "blingfire")
for name in BLOCKED:
    sys.modules[name] = None
import json

import flax.linen as nn
import jax
import numpy as np

from albert_jax import convert, glue_table, loop, main, pretrained
from albert_jax.finetune import train as finetune
from albert_jax.pretrain import model_half
from albert_jax.model.config import model_config_from
from albert_jax.model.albert import AlbertForPreTraining
from albert_jax.sharding import LOGICAL_AXIS_RULES, create_mesh
from benchmarks import speedup, train_step as train_step_benchmark  # what a GPU run imports
from configs import pretrain

config = pretrain.get_config("size=tiny")
config.model.hidden_size, config.model.intermediate_size = 32, 64
config.model.num_attention_heads, config.model.num_hidden_layers = 2, 2
config.model.embedding_size, config.model.vocab_size = 16, 100
config.batch_size, config.seq_len, config.max_predictions_per_seq = 4, 16, 3
config.warmup_steps = 0
assert config.optimizer == "lamb"
model = AlbertForPreTraining(model_config_from(config))
mesh = create_mesh((1, 1, 1), jax.devices()[:1])
rng = np.random.default_rng(0)
ids = rng.integers(5, 100, size=(4, 16)).astype(np.int32)
positions = np.tile(np.array([1, 5, 9], np.int32), (4, 1))
batch = dict(
    input_ids=ids, segment_ids=np.zeros_like(ids), input_mask=np.ones_like(ids),
    masked_lm_positions=positions, masked_lm_ids=np.take_along_axis(ids, positions, 1),
    masked_lm_weights=np.ones((4, 3), np.float32),
    sentence_order_label=np.array([0, 1, 0, 1], np.int32),
)
with jax.set_mesh(mesh), nn.logical_axis_rules(LOGICAL_AXIS_RULES):
    tx, _, shardings, initialize = model_half.create_train_state(config, model, mesh)
    step = jax.jit(
        model_half.make_train_step(config, model, tx),
        in_shardings=(shardings, None), out_shardings=(shardings, None), donate_argnums=0,
    )
    state = initialize()
    losses = []
    for _ in range(2):
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
for name in BLOCKED:
    try:
        __import__(name)
        raise AssertionError(name + " imported")
    except ImportError:
        pass
print(json.dumps({"losses": losses, "step": int(state.step)}))
"""


def test_model_lamb_and_step_run_without_tensorflow():
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "", "PYTHONPATH": REPO}
    proc = subprocess.run(
        [sys.executable, "-c", _SCRIPT], cwd=REPO, env=env, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["step"] == 2 and all(map(lambda x: x == x and x > 0, out["losses"]))
    assert out["losses"][1] != out["losses"][0]  # the first update changed the model
