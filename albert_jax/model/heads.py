"""Fine-tuning heads over `AlbertModel`: classification / regression, SQuAD v1 and v2 span
prediction, multiple choice. Modules only: their losses live in `albert_jax.model.losses`.

Every model takes the inputs of `AlbertModel` (`input_ids, segment_ids, input_mask`, [B,S]; for
multiple choice [B,C,S]) plus `deterministic`, and keeps the backbone under the name `albert`,
so `params["albert"]` of a pretraining checkpoint drops in unchanged:

  AlbertForSequenceClassification  {"albert", "classifier"}    -> logits [B, num_labels]
  AlbertForQuestionAnswering       {"albert", "qa_outputs"}    -> start/end logits [B,S]
  AlbertForQuestionAnsweringV2     {"albert", "squad_v2"}      -> XLNet-style beam outputs
  AlbertForMultipleChoice          {"albert", "classifier"}    -> logits [B,C]

Heads follow the official google-research/albert fine-tuning code (`classifier_utils.py`,
`squad_utils.py`, `race_utils.py`): truncated-normal(0.02) kernels, zero biases, dropout 0.1 on
the classifier input, the SQuAD v2 head of XLNet with `start_n_top = end_n_top = 5`. Head
outputs are float32 whatever the compute dtype, since they feed softmaxes and the n-best search.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from albert_jax.model.albert import AlbertModel
from albert_jax.model.config import ModelConfig
from albert_jax.model.layers import Dense, LayerNorm

__all__ = [
    "HEAD_NAMES",
    "AlbertForSequenceClassification",
    "AlbertForQuestionAnswering",
    "AlbertForQuestionAnsweringV2",
    "AlbertForMultipleChoice",
    "head_name",
]

Array = jax.Array

# Logit given to positions / options that may not be chosen. The official code uses
# `logits * (1 - mask) - 1e30 * mask`, i.e. exactly -1e30 at masked positions.
MASKED_LOGIT = -1e30

#: Name of the head sub-tree of each model's parameters (next to "albert").
HEAD_NAMES: dict[str, str] = {
    "AlbertForSequenceClassification": "classifier",
    "AlbertForQuestionAnswering": "qa_outputs",
    "AlbertForQuestionAnsweringV2": "squad_v2",
    "AlbertForMultipleChoice": "classifier",
}


def _mask_logits(logits: Array, allowed: Array) -> Array:
    """logits [...] float32, allowed [...] (nonzero = may be chosen) -> masked float32."""
    return jnp.where(allowed.astype(bool), logits, MASKED_LOGIT)


def _classifier(config: ModelConfig, num_outputs: int) -> Dense:
    """Dense [H, num_outputs]: the official `output_weights` (stored transposed) / `output_bias`."""
    return Dense((config.hidden_size,), (num_outputs,), ("embed", None), config)


class AlbertForSequenceClassification(nn.Module):
    """[CLS]-pooled classification (num_labels >= 2) or regression (num_labels == 1, STS-B).

    pooled_output [B,H] -> dropout(classifier_dropout) -> dense [H, num_labels] -> [B, num_labels].
    """

    config: ModelConfig
    num_labels: int
    classifier_dropout: float = 0.1

    def setup(self) -> None:
        if self.num_labels < 1:
            raise ValueError(f"num_labels must be >= 1, got {self.num_labels}")
        self.albert = AlbertModel(self.config)
        self.dropout = nn.Dropout(self.classifier_dropout)
        self.classifier = _classifier(self.config, self.num_labels)

    def __call__(
        self,
        input_ids: Array,
        segment_ids: Array | None = None,
        input_mask: Array | None = None,
        deterministic: bool = True,
        position_ids: Array | None = None,
        pack_ids: Array | None = None,
        cls_positions: Array | None = None,
        cls_index: Array | None = None,
    ) -> Array:
        """input_ids [B,S] -> logits [B, num_labels] float32.

        Packed rows (tasks/packing.py): input_ids, position_ids, pack_ids [R,S], cls_positions
        [R,Q] and cls_index [B] -> logits [B, num_labels] of the B examples, in batch order.
        """
        # pooled_only: the last layer runs at [CLS] only, the one row the head reads.
        pooled = self.albert(
            input_ids, segment_ids, input_mask, deterministic, pooled_only=True,
            position_ids=position_ids, pack_ids=pack_ids, cls_positions=cls_positions,
        )["pooled_output"]  # fmt: skip
        if cls_index is not None:  # [R,Q,H] -> the examples' [B,H], in the batch's order
            pooled = jnp.take(pooled.reshape(-1, pooled.shape[-1]), cls_index, axis=0)
        # Dropout on [B,H] in batch order: the same mask however the examples were packed.
        pooled = self.dropout(pooled, deterministic=deterministic)
        return self.classifier(pooled).astype(jnp.float32)


class AlbertForQuestionAnswering(nn.Module):
    """SQuAD v1.1 span head: dense [H,2] on every position -> start / end logits.

    Positions with `input_mask == 0` (padding) get logit -1e30, so neither the loss nor the
    n-best search can pick them. (The official v1 head has no dropout.)
    """

    config: ModelConfig

    def setup(self) -> None:
        self.albert = AlbertModel(self.config)
        h = self.config.hidden_size
        self.qa_outputs = Dense((h,), (2,), ("embed", None), self.config)

    def __call__(
        self,
        input_ids: Array,
        segment_ids: Array | None = None,
        input_mask: Array | None = None,
        deterministic: bool = True,
    ) -> dict[str, Array]:
        """input_ids [B,S] -> {"start_logits" [B,S], "end_logits" [B,S]} float32."""
        if input_mask is None:
            input_mask = jnp.ones_like(input_ids)
        seq = self.albert(input_ids, segment_ids, input_mask, deterministic)["sequence_output"]
        logits = self.qa_outputs(seq).astype(jnp.float32)  # [B,S,2]
        return {
            "start_logits": _mask_logits(logits[..., 0], input_mask),
            "end_logits": _mask_logits(logits[..., 1], input_mask),
        }


class _EndLogits(nn.Module):
    """XLNet end-position scorer: dense_0(concat(h, h_start)) -> tanh -> LayerNorm -> dense_1."""

    config: ModelConfig

    @nn.compact
    def __call__(self, seq: Array, start_features: Array) -> Array:
        """seq [..., S, H], start_features [..., S, H] (broadcast start) -> logits [..., S]."""
        cfg, h = self.config, self.config.hidden_size
        x = jnp.concatenate([seq, start_features.astype(seq.dtype)], axis=-1)
        x = jnp.tanh(Dense((2 * h,), (h,), ("embed", "mlp"), cfg, name="dense_0")(x))
        x = LayerNorm(h, "mlp", cfg, name="LayerNorm")(x)
        x = Dense((h,), (1,), ("mlp", None), cfg, name="dense_1")(x)
        return x[..., 0].astype(jnp.float32)


class _AnswerClass(nn.Module):
    """Answerability logit on concat(start-weighted feature, [CLS] feature); no bias at the end."""

    config: ModelConfig
    dropout_rate: float

    @nn.compact
    def __call__(self, start_feature: Array, cls_feature: Array, deterministic: bool) -> Array:
        """start_feature, cls_feature [B,H] -> logit [B] float32 (> 0: "no answer" likelier)."""
        cfg, h = self.config, self.config.hidden_size
        x = jnp.concatenate([start_feature, cls_feature], axis=-1)
        x = jnp.tanh(Dense((2 * h,), (h,), ("embed", "mlp"), cfg, name="dense_0")(x))
        x = nn.Dropout(self.dropout_rate)(x, deterministic=deterministic)
        x = Dense((h,), (1,), ("mlp", None), cfg, use_bias=False, name="dense_1")(x)
        return x[..., 0].astype(jnp.float32)


class _SquadV2Head(nn.Module):
    """The official ALBERT SQuAD 2.0 head (XLNet's), parameter names as the TF scopes."""

    config: ModelConfig
    start_n_top: int
    end_n_top: int
    dropout_rate: float

    @nn.compact
    def __call__(
        self,
        seq: Array,
        p_mask: Array,
        start_positions: Array | None,
        deterministic: bool,
    ) -> dict[str, Array]:
        cfg, h = self.config, self.config.hidden_size
        allowed = 1 - p_mask.astype(jnp.int32)  # [B,S]
        start_dense = Dense((h,), (1,), ("embed", None), cfg, name="start_logits")
        start_logits = _mask_logits(start_dense(seq)[..., 0].astype(jnp.float32), allowed)
        start_log_probs = jax.nn.log_softmax(start_logits, axis=-1)  # [B,S]
        end_scorer = _EndLogits(cfg, name="end_logits")
        out: dict[str, Array] = {}
        if start_positions is not None:
            # Training: the end is scored given the gold start (teacher forcing).
            start_index = start_positions.astype(jnp.int32)[:, None, None]  # [B,1,1]
            start_features = jnp.take_along_axis(seq, start_index, axis=1)  # [B,1,H]
            end_logits = end_scorer(seq, jnp.broadcast_to(start_features, seq.shape))
            out["start_log_probs"] = start_log_probs
            out["end_log_probs"] = jax.nn.log_softmax(_mask_logits(end_logits, allowed), axis=-1)
        else:
            # Inference: beam over the top start_n_top starts, then top end_n_top ends of each.
            k, kend = self.start_n_top, self.end_n_top
            start_top_log_probs, start_top_index = jax.lax.top_k(start_log_probs, k)  # [B,K]
            start_features = jnp.take_along_axis(seq, start_top_index[..., None], axis=1)
            b, s = seq.shape[0], seq.shape[1]
            seq_k = jnp.broadcast_to(seq[:, None], (b, k, s, h))  # [B,K,S,H]
            start_k = jnp.broadcast_to(start_features[:, :, None], (b, k, s, h))
            end_logits = _mask_logits(end_scorer(seq_k, start_k), allowed[:, None])  # [B,K,S]
            end_log_probs = jax.nn.log_softmax(end_logits, axis=-1)
            end_top_log_probs, end_top_index = jax.lax.top_k(end_log_probs, kend)  # [B,K,Ke]
            out["start_top_log_probs"] = start_top_log_probs
            out["start_top_index"] = start_top_index
            out["end_top_log_probs"] = end_top_log_probs.reshape(b, k * kend)
            out["end_top_index"] = end_top_index.reshape(b, k * kend)
        # Answerability: no dependency on the end, so there is one logit per feature.
        start_p = jax.nn.softmax(start_logits, axis=-1)  # [B,S]
        start_feature = jnp.einsum("bsh,bs->bh", seq.astype(jnp.float32), start_p)
        cls_feature = seq[:, 0]
        answer_class = _AnswerClass(cfg, self.dropout_rate, name="answer_class")
        out["cls_logits"] = answer_class(
            start_feature.astype(seq.dtype), cls_feature, deterministic
        )
        return out


class AlbertForQuestionAnsweringV2(nn.Module):
    """SQuAD 2.0 head of the official code (from XLNet), with an answerability classifier.

    `p_mask [B,S]` is 1 where an answer may not start or end (question, [SEP], padding) and 0 on
    the context and on [CLS] (the target of unanswerable questions).

    With `start_positions [B]` (training) returns {"start_log_probs" [B,S], "end_log_probs" [B,S],
    "cls_logits" [B]}, the end scored from the gold start. Without it (inference) returns
    {"start_top_log_probs" [B,K], "start_top_index" [B,K], "end_top_log_probs" [B,K*Ke],
    "end_top_index" [B,K*Ke], "cls_logits" [B]}, where entry i*Ke+j of the end arrays is the
    j-th best end for the i-th best start (K = start_n_top, Ke = end_n_top).
    """

    config: ModelConfig
    start_n_top: int = 5
    end_n_top: int = 5
    classifier_dropout: float = 0.1

    def setup(self) -> None:
        for name in ("start_n_top", "end_n_top"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        self.albert = AlbertModel(self.config)
        self.squad_v2 = _SquadV2Head(
            self.config, self.start_n_top, self.end_n_top, self.classifier_dropout
        )

    def __call__(
        self,
        input_ids: Array,
        segment_ids: Array | None = None,
        input_mask: Array | None = None,
        p_mask: Array | None = None,
        start_positions: Array | None = None,
        deterministic: bool = True,
    ) -> dict[str, Array]:
        if input_mask is None:
            input_mask = jnp.ones_like(input_ids)
        if p_mask is None:
            p_mask = 1 - input_mask.astype(jnp.int32)
        seq_len = input_ids.shape[-1]
        if self.start_n_top > seq_len or self.end_n_top > seq_len:
            raise ValueError(
                f"start_n_top={self.start_n_top} / end_n_top={self.end_n_top} exceed the "
                f"sequence length {seq_len}"
            )
        seq = self.albert(input_ids, segment_ids, input_mask, deterministic)["sequence_output"]
        return self.squad_v2(seq, p_mask, start_positions, deterministic)


class AlbertForMultipleChoice(nn.Module):
    """RACE-style multiple choice: each option is its own `[CLS] passage [SEP] q+option [SEP]`
    sequence; pooled -> dropout -> dense [H,1] gives one score per option; softmax over options.

    Inputs are [B,C,S]; `option_mask [B,C]` (1 real, 0 padding) gives padding options logit
    -1e30, for questions with fewer than C options.
    """

    config: ModelConfig
    classifier_dropout: float = 0.1

    def setup(self) -> None:
        self.albert = AlbertModel(self.config)
        self.dropout = nn.Dropout(self.classifier_dropout)
        self.classifier = _classifier(self.config, 1)

    def __call__(
        self,
        input_ids: Array,
        segment_ids: Array | None = None,
        input_mask: Array | None = None,
        option_mask: Array | None = None,
        deterministic: bool = True,
    ) -> Array:
        """input_ids [B,C,S] -> logits [B,C] float32."""
        if input_ids.ndim != 3:
            raise ValueError(f"input_ids must be [B, C, S], got shape {input_ids.shape}")
        b, c, s = input_ids.shape
        flat = lambda x: None if x is None else x.reshape(b * c, s)
        pooled = self.albert(
            flat(input_ids), flat(segment_ids), flat(input_mask), deterministic, pooled_only=True
        )
        pooled = self.dropout(pooled["pooled_output"], deterministic=deterministic)
        logits = self.classifier(pooled).astype(jnp.float32).reshape(b, c)
        if option_mask is not None:
            logits = _mask_logits(logits, option_mask)
        return logits


def head_name(model: Any) -> str:
    """The name of `model`'s head sub-tree (e.g. "classifier")."""
    return HEAD_NAMES[type(model).__name__]
