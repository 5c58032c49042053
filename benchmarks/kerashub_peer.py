"""KerasHub ALBERT as a contender of `benchmarks/train_step.py` (Keras 3 on the JAX backend).

The JAX-native alternative to ours: `keras_hub.models.AlbertBackbone`, a
`keras_hub.layers.MaskedLMHead` on the masked positions (tied to the token embedding, as
`keras_hub.models.AlbertMaskedLM` builds it) and a 2-way `Dense` sentence-order head on the
pooled output, in one functional `keras.Model`. `make_train_step` returns a pure
`train_step(state, batch)` around `model.stateless_call`, so `train_step.py` jits and times it
exactly as it does HF Flax. keras-hub is optional (`pip install -e ".[peers]"`): without it,
or when Keras was already imported on another backend, `build_model` returns None.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any

import jax
import optax

from albert_jax.model.config import ModelConfig


def _import_keras() -> tuple[Any, Any] | None:
    """(keras, keras_hub) on the JAX backend, or None with a note on stderr."""
    # Keras reads its backend once, at its first import: set it before then, and only then.
    if "keras" not in sys.modules:
        os.environ["KERAS_BACKEND"] = "jax"
    try:
        import keras
        import keras_hub
    except ImportError as error:
        print(f"kerashub skipped: {error} (pip install -e '.[peers]')", file=sys.stderr)
        return None
    if keras.backend.backend() != "jax":
        print(
            f"kerashub skipped: Keras runs on {keras.backend.backend()!r}, not JAX "
            "(set KERAS_BACKEND=jax)",
            file=sys.stderr,
        )
        return None
    return keras, keras_hub


def build_model(config: ModelConfig) -> Any | None:
    """The KerasHub pretraining model of `config`: inputs token_ids, segment_ids, padding_mask,
    mask_positions; outputs (MLM logits [B, P, V], SOP logits [B, 2]). None without keras-hub."""
    imported = _import_keras()
    if imported is None:
        return None
    keras, keras_hub = imported
    if config.sharing != "all":
        raise ValueError(f"AlbertBackbone shares whole layers only, not sharing={config.sharing!r}")
    if config.hidden_dropout_prob != config.attention_probs_dropout_prob:
        raise ValueError("AlbertBackbone has one dropout rate for hidden states and attention")
    initializer = keras.initializers.TruncatedNormal(stddev=config.initializer_range)
    backbone = keras_hub.models.AlbertBackbone(
        vocabulary_size=config.vocab_size,
        num_layers=config.num_hidden_layers,
        num_heads=config.num_attention_heads,
        embedding_dim=config.embedding_size,
        hidden_dim=config.hidden_size,
        intermediate_dim=config.intermediate_size,
        # Same sharing semantics as ours (and the official code): G groups of layers, each
        # layer of a group running the group's inner blocks in order.
        num_groups=config.num_hidden_groups,
        num_inner_repetitions=config.inner_group_num,
        dropout=config.hidden_dropout_prob,
        max_sequence_length=config.max_position_embeddings,
        num_segments=config.type_vocab_size,
    )
    mask_positions = keras.Input(shape=(None,), dtype="int32", name="mask_positions")
    features = backbone(backbone.input)
    mlm_logits = keras_hub.layers.MaskedLMHead(
        vocabulary_size=config.vocab_size,
        token_embedding=backbone.token_embedding,
        intermediate_activation=lambda x: keras.activations.gelu(x, approximate=True),
        layer_norm_epsilon=config.layer_norm_eps,
        kernel_initializer=initializer,
        name="mlm_head",
    )(features["sequence_output"], mask_positions)
    sop_logits = keras.layers.Dense(2, kernel_initializer=initializer, name="sop_head")(
        features["pooled_output"]
    )
    return keras.Model(
        inputs={**backbone.input, "mask_positions": mask_positions},
        outputs=(mlm_logits, sop_logits),
    )


def num_params(model: Any) -> int:
    """Trainable parameters (the non-trainable variables are dropout seed states)."""
    return sum(int(v.value.size) for v in model.trainable_variables)


def make_train_step(
    model: Any, tx: Any, loss_fn: Callable[[Any, Any, dict[str, Any]], Any]
) -> tuple[Callable[[Any, dict[str, Any]], Any], Any]:
    """(train_step(state, batch) -> (state, loss), initial state) for `model`, optimizer `tx`
    and `loss_fn(mlm_logits, sop_logits, batch)`; state = (trainable values, optimizer state).

    The batch is the pipeline's layout (`train_step.make_batch`), renamed to KerasHub's inputs.
    """
    params = [v.value for v in model.trainable_variables]
    non_trainable = [v.value for v in model.non_trainable_variables]

    def train_step(state, b):
        params, opt_state = state
        inputs = {
            "token_ids": b["input_ids"],
            "segment_ids": b["segment_ids"],
            "padding_mask": b["input_mask"],
            "mask_positions": b["masked_lm_positions"],
        }

        def loss(p):
            # training=True is Keras' training mode, as a Keras fit() step runs it; dropout is
            # the config's (0.0 for ALBERT v2, as ours).
            (mlm_logits, sop_logits), _ = model.stateless_call(
                p, non_trainable, inputs, training=True
            )
            return loss_fn(mlm_logits, sop_logits, b)

        value, grads = jax.value_and_grad(loss)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), value

    return train_step, (params, tx.init(params))
