"""Task kinds (albert_jax/tasks/kinds.py) on real examples: every task resolves to a kind whose
model inputs its featurizer produces, and each kind's head, loss, scoring and prediction files
fit together on a tiny model."""

from __future__ import annotations

import functools
import json
import os

import flax.linen as nn
import jax
import numpy as np
import pytest

from albert_jax import ModelConfig
from albert_jax.tasks import kinds, registry
from configs.finetune import get_config

# Real examples for each kind, read from the local sets under shared/data/tasks (the catalog
# tasks, GLUE / SQuAD / RACE, share their example types). span_v2 featurizes SQuAD v1.1 data.
EXAMPLES_OF_KIND = {
    "classification": ("sentiment_rt", "sentiment_rt/dev.jsonl.gz"),
    "regression": ("sentiment_rt_score", "sentiment_rt/dev.jsonl.gz"),
    "multiple_choice": ("mc_cosmosqa", "mc_cosmosqa/dev.jsonl.gz"),
    "span_v1": ("squad_shifts", "squad_shifts/amazon_reviews_v1.0.json.gz"),
    "span_v2": ("squad_shifts", "squad_shifts/amazon_reviews_v1.0.json.gz"),
}
NUM_EXAMPLES = 6


@functools.cache
def _eval_set(shared_data: str, kind: str) -> registry.EvalSet:
    task, path = EXAMPLES_OF_KIND[kind]
    data = {
        "eval_files": os.path.join(shared_data, "tasks", path),
        "max_eval_examples": NUM_EXAMPLES,
    }
    (eval_set,) = registry.read_eval(task, data)
    return eval_set


def _config():
    """Featurization and head settings (the same fields for every task), small sequences."""
    config = get_config("task=sentiment_rt")
    config.max_seq_length, config.max_qa_length = 64, 32
    config.max_query_length, config.doc_stride = 16, 24
    return config


def test_every_kind_has_examples():
    assert set(EXAMPLES_OF_KIND) == set(kinds.KINDS)


@pytest.mark.parametrize("task", sorted(registry.TASKS))
def test_every_task_featurizes_its_model_inputs(task, tokenizer, shared_data):
    spec = registry.get_task(task)
    kind = kinds.get_kind(spec.kind)
    assert kind.name == spec.kind
    assert set(kind.predict_inputs) < set(kind.model_inputs)
    eval_set = _eval_set(shared_data, spec.kind)
    features = registry.featurize(task, eval_set.examples, tokenizer, _config())
    assert len(features) >= NUM_EXAMPLES
    missing = set(kind.model_inputs) - set(features.arrays)
    assert not missing, f"{task}: {kind} inputs {sorted(missing)} not featurized"


@pytest.mark.parametrize("name", sorted(kinds.KINDS))
def test_kind_trains_scores_and_writes_on_a_tiny_model(name, tokenizer, shared_data, tmp_path):
    kind = kinds.get_kind(name)
    task = next(t for t, s in sorted(registry.TASKS.items()) if s.kind == name)
    spec, config = registry.get_task(task), _config()
    eval_set = _eval_set(shared_data, name)
    features = kind.featurize(eval_set.examples, tokenizer, config, spec)
    model_config = ModelConfig.preset(
        "tiny", vocab_size=tokenizer.vocab_size, hidden_size=32, embedding_size=16,
        num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
    )  # fmt: skip
    model = kind.build_model(model_config, spec, config)
    batch = {k: features.arrays[k] for k in kind.model_inputs}
    # Jitted: an eager init runs the whole model op by op (seconds even for this one).
    init = jax.jit(lambda rng: nn.meta.unbox(kind.init_variables(model, rng, batch)["params"]))
    params = init(jax.random.key(0))

    def loss_of(p):
        return kind.loss(kind.apply(model, p, batch, train=True, rng=jax.random.key(1)), batch)

    (loss, metrics), grads = jax.jit(jax.value_and_grad(loss_of, has_aux=True))(params)
    assert np.isfinite(float(loss)) and float(metrics["loss"]) == float(loss)
    assert all(np.isfinite(g).all() for g in jax.tree.leaves(grads))

    predict = {k: features.arrays[k] for k in kind.predict_inputs}
    outputs = jax.jit(lambda p, b: kind.apply(model, p, b, train=False))(params, predict)
    outputs = jax.tree.map(np.asarray, outputs)
    assert all(len(v) == len(features) for v in outputs.values())
    scores, predictions = kind.score(eval_set, features, outputs, config, spec)
    assert set(spec.metrics) <= set(scores), (spec.metrics, scores)

    written = kind.write_predictions(str(tmp_path), "_0", eval_set, predictions)
    assert written and all(os.path.basename(p).endswith(("_0.json", "_0.jsonl")) for p in written)
    with open(written[0], encoding="utf-8") as f:  # predictions: one per question / example
        text = f.read()
    rows = json.loads(text) if written[0].endswith(".json") else text.splitlines()
    assert len(rows) == NUM_EXAMPLES


def test_unknown_kind_names_the_known_ones():
    with pytest.raises(ValueError, match="'span_v3'.*classification.*span_v2"):
        kinds.get_kind("span_v3")
    with pytest.raises(ValueError, match="known kinds"):
        registry.TaskSpec("ranking", 2, "local", ("accuracy",))
