"""Task kinds: everything fine-tuning does differently per kind of task, one object each.

  kind             head (heads.py)                   featurizer                  metrics
  classification   AlbertForSequenceClassification   classification_features     GLUE's
  regression       AlbertForSequenceClassification   classification_features     Pearson, Spearman
  multiple_choice  AlbertForMultipleChoice           multiple_choice_features    accuracy
  span_v1          AlbertForQuestionAnswering        squad_features              SQuAD EM / F1
  span_v2          AlbertForQuestionAnsweringV2      squad_features              SQuAD EM / F1

A kind owns its head (`build_model`), which feature arrays go to the devices (`model_inputs`)
and how the model runs on them (`init_variables`, `apply`), the training loss and metrics
(`loss`, computed by `albert_jax.model.losses`), featurization (`featurize`), the official metrics
and predictions (`score`) and the prediction files (`write_predictions`). `TaskSpec.kind`
(tasks/registry.py) names one of `KINDS`; `get_kind(name)` looks it up. Adding a kind is a
subclass and an entry in `KINDS`.

Shapes: B batch rows, S sequence length, C options, N examples, F features (SQuAD windows).
"""

from __future__ import annotations

import abc
import json
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import flax.linen as nn
import jax
import numpy as np

from albert_jax import files
from albert_jax.model import heads, losses
from albert_jax.model.config import ModelConfig
from albert_jax.tasks import squad_eval
from albert_jax.tasks.batching import Features
from albert_jax.tasks.classification import classification_features
from albert_jax.tasks.metrics import compute_named_metrics
from albert_jax.tasks.multiple_choice import multiple_choice_features
from albert_jax.tasks.packing import PACKED_INPUTS
from albert_jax.tasks.squad_features import SquadFeatures, squad_features
from albert_jax.tasks.squad_predictions import SquadPredictions, predict_v1, predict_v2

if TYPE_CHECKING:  # registry imports this module
    from albert_jax.tasks.registry import EvalSet, TaskSpec

__all__ = ["TaskKind", "KINDS", "get_kind"]

PyTree = Any
Batch = Mapping[str, Any]  # {name: [B, ...] numpy or jax array}
# The encoder inputs every head takes first: input_ids, segment_ids, input_mask [B,S] (or [B,C,S]).
_ENCODER_INPUTS = ("input_ids", "segment_ids", "input_mask")


class TaskKind(abc.ABC):
    """One kind of task. Instances are stateless (the task's settings come in as `spec` and
    `config`), so one shared instance per kind serves every task and run."""

    #: The kind's name, as `TaskSpec.kind` spells it.
    name: ClassVar[str]
    #: Feature arrays the training step needs on the devices (the rest, e.g. SQuAD offsets,
    #: stay on the host for `score`).
    model_inputs: ClassVar[tuple[str, ...]]
    #: Those of `model_inputs` only the loss reads; prediction leaves them on the host.
    labels: ClassVar[tuple[str, ...]]
    #: Inputs whose last axis is the sequence ([B,S] or [B,C,S]): cut to a batch's length
    #: bucket (`batching.trim_to_bucket`).
    sequence_inputs: ClassVar[tuple[str, ...]] = _ENCODER_INPUTS
    #: Prediction outputs whose last axis is the sequence ([B,S]): padded back to
    #: max_seq_length with `heads.MASKED_LOGIT` after a cut batch, as the head masks padding.
    sequence_outputs: ClassVar[tuple[str, ...]] = ()
    #: SQuAD evaluator version ("v1.1" / "v2.0") of span kinds, whose eval sets carry the
    #: evaluator's JSON (`EvalSet.squad_json`); None for the others.
    squad_version: ClassVar[str | None] = None
    #: Whether training batches may pack several examples into a row (tasks/packing.py): the
    #: head then reads each example's [CLS] from `head_inputs`' packing arrays.
    packable: ClassVar[bool] = False

    def __repr__(self) -> str:
        return f"<task kind {self.name}>"

    @property
    def predict_inputs(self) -> tuple[str, ...]:
        """Feature arrays prediction (`apply(train=False)`) needs on the devices."""
        return tuple(k for k in self.model_inputs if k not in self.labels)

    # ------------------------------------------------------------------------------- model
    @abc.abstractmethod
    def build_model(self, model_config: ModelConfig, spec: TaskSpec, config: Any) -> nn.Module:
        """The task model (heads.py) with the config's head settings (`classifier_dropout`,
        `start_n_top`, ...)."""

    def batch_shapes(self, rows: int, seq_len: int, spec: TaskSpec) -> dict[str, Any]:
        """{name: (shape, dtype)} of a training batch's `model_inputs`, unpacked, as
        `featurize` makes them: [rows, seq_len] for `sequence_inputs`, [rows] for the rest."""
        del spec
        return {k: ((rows, seq_len) if k in self.sequence_inputs else (rows,), np.int32)
                for k in self.model_inputs}  # fmt: skip

    def head_inputs(self, batch: Batch, *, train: bool) -> dict[str, Any]:
        """Keyword inputs of the head beyond the encoder inputs (none by default)."""
        del batch, train
        return {}

    def init_variables(self, model: nn.Module, rng: jax.Array, batch: Batch) -> PyTree:
        """Variables of `model`, initialized on `batch` (a dummy batch of the real shapes)."""
        inputs = [batch[k] for k in _ENCODER_INPUTS]
        return model.init(rng, *inputs, **self.head_inputs(batch, train=False))

    def apply(
        self,
        model: nn.Module,
        params: PyTree,
        batch: Batch,
        *,
        train: bool,
        rng: jax.Array | None = None,
    ) -> dict[str, jax.Array]:
        """Runs the model on a batch: dropout with `rng` when `train`. Returns a dict of outputs
        always (`{"logits": ...}` for heads that return one array)."""
        kwargs: dict[str, Any] = {
            "deterministic": not train,
            **self.head_inputs(batch, train=train),
        }
        if train:
            kwargs["rngs"] = {"dropout": rng}
        inputs = [batch[k] for k in _ENCODER_INPUTS]
        out = model.apply({"params": params}, *inputs, **kwargs)
        return out if isinstance(out, dict) else {"logits": out}

    @abc.abstractmethod
    def loss(
        self, outputs: Mapping[str, jax.Array], batch: Batch
    ) -> tuple[jax.Array, dict[str, jax.Array]]:
        """(scalar loss, {"loss", ... scalar training metrics}) of the training outputs of a
        batch; rows with `example_weight` 0 (if the batch has it) do not count."""

    # -------------------------------------------------------------------------------- data
    @abc.abstractmethod
    def featurize(
        self, examples: Sequence[Any], tokenizer: Any, config: Any, spec: TaskSpec
    ) -> Features:
        """Examples -> fixed-shape Features holding at least `model_inputs` (config: the
        featurization fields, e.g. `max_seq_length`)."""

    @abc.abstractmethod
    def score(
        self,
        eval_set: EvalSet,
        features: Features,
        outputs: Mapping[str, np.ndarray],
        config: Any,
        spec: TaskSpec,
    ) -> tuple[dict[str, Any], Any]:
        """(official metrics, predictions) of the prediction outputs gathered over `features`
        (one row per feature, in order)."""

    def write_predictions(
        self, workdir: str, suffix: str, eval_set: EvalSet, predictions: Any
    ) -> list[str]:
        """Writes `predictions{suffix}.jsonl`: one {"id", "prediction", "label", "eval_set"}
        line per example (the records of `score`, in example order), "eval_set" naming the
        file (or TFDS split) the example was read from, not the set's list of files, so that
        each line traces back to its file. Returns the paths written."""
        sources = eval_set.example_sources()
        lines = [
            json.dumps({**record, "eval_set": source}) + "\n"
            for record, source in zip(predictions, sources, strict=True)
        ]
        path = _join(workdir, f"predictions{suffix}.jsonl")
        files.write_atomic(path, "".join(lines))
        return [path]


def _join(workdir: str, name: str) -> str:
    return str(files.as_path(workdir) / name)


def _records(eval_set: EvalSet, values: np.ndarray) -> list[dict[str, Any]]:
    """One {"id", "prediction", "label"} per example; values [N]."""
    return [
        {"id": e.id, "prediction": v.item(), "label": e.label}
        for e, v in zip(eval_set.examples, values, strict=True)
    ]


# ------------------------------------------------------------------- one label per example
class Classification(TaskKind):
    """Sentence (pair) classification: logits [B, num_labels] from [CLS], cross-entropy."""

    name = "classification"
    model_inputs = ("input_ids", "segment_ids", "input_mask", "label")
    labels = ("label",)
    packable = True

    def head_inputs(self, batch: Batch, *, train: bool) -> dict[str, Any]:
        """A packed batch's positions, example ids and [CLS] slots (none otherwise)."""
        del train
        return {k: batch[k] for k in PACKED_INPUTS if k in batch}

    def build_model(self, model_config: ModelConfig, spec: TaskSpec, config: Any) -> nn.Module:
        return heads.AlbertForSequenceClassification(
            model_config, spec.num_labels, config.classifier_dropout
        )

    def loss(
        self, outputs: Mapping[str, jax.Array], batch: Batch
    ) -> tuple[jax.Array, dict[str, jax.Array]]:
        """logits [B,K], label [B] int -> cross-entropy and accuracy."""
        logits, label, weights = outputs["logits"], batch["label"], batch.get("example_weight")
        loss = losses.classification_loss(logits, label, weights)
        accuracy = losses.classification_accuracy(logits, label, weights)
        return loss, {"loss": loss, "accuracy": accuracy}

    def featurize(
        self, examples: Sequence[Any], tokenizer: Any, config: Any, spec: TaskSpec
    ) -> Features:
        """input_ids, segment_ids, input_mask [N,S] int32; label [N] (int32)."""
        return classification_features(examples, tokenizer, config.max_seq_length)

    def score(
        self,
        eval_set: EvalSet,
        features: Features,
        outputs: Mapping[str, np.ndarray],
        config: Any,
        spec: TaskSpec,
    ) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """The task's metrics of argmax(logits [N,K]), and `majority_accuracy` (the most
        frequent eval label's share: the baseline a model must beat)."""
        labels = features.arrays["label"]
        values = np.argmax(outputs["logits"], axis=-1)
        metrics = compute_named_metrics(spec.metrics, values, labels)
        metrics["majority_accuracy"] = float(np.bincount(labels).max() / len(labels))
        return metrics, _records(eval_set, values)


class Regression(Classification):
    """Sentence (pair) regression (STS-B): one output [B,1] from [CLS], mean squared error."""

    name = "regression"

    def batch_shapes(self, rows: int, seq_len: int, spec: TaskSpec) -> dict[str, Any]:
        """Classification's, with the label a float32 score."""
        return {**super().batch_shapes(rows, seq_len, spec), "label": ((rows,), np.float32)}

    def loss(
        self, outputs: Mapping[str, jax.Array], batch: Batch
    ) -> tuple[jax.Array, dict[str, jax.Array]]:
        """logits [B,1], label [B] float -> mean squared error."""
        loss = losses.regression_loss(
            outputs["logits"], batch["label"], batch.get("example_weight")
        )
        return loss, {"loss": loss}

    def featurize(
        self, examples: Sequence[Any], tokenizer: Any, config: Any, spec: TaskSpec
    ) -> Features:
        """input_ids, segment_ids, input_mask [N,S] int32; label [N] float32."""
        return classification_features(examples, tokenizer, config.max_seq_length, regression=True)

    def score(
        self,
        eval_set: EvalSet,
        features: Features,
        outputs: Mapping[str, np.ndarray],
        config: Any,
        spec: TaskSpec,
    ) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """The task's metrics (Pearson, Spearman) of the outputs logits [N,1]."""
        values = outputs["logits"][:, 0]
        metrics = compute_named_metrics(spec.metrics, values, features.arrays["label"])
        return metrics, _records(eval_set, values)


class MultipleChoice(TaskKind):
    """RACE-style multiple choice: one score per option [B,C] (padding options masked),
    cross-entropy over the options."""

    name = "multiple_choice"
    model_inputs = ("input_ids", "segment_ids", "input_mask", "option_mask", "label")
    labels = ("label",)

    def build_model(self, model_config: ModelConfig, spec: TaskSpec, config: Any) -> nn.Module:
        return heads.AlbertForMultipleChoice(model_config, config.classifier_dropout)

    def head_inputs(self, batch: Batch, *, train: bool) -> dict[str, Any]:
        """option_mask [B,C] (1 real option, 0 padding)."""
        return {"option_mask": batch["option_mask"]}

    def batch_shapes(self, rows: int, seq_len: int, spec: TaskSpec) -> dict[str, Any]:
        """Encoder inputs [rows, C, seq_len] and option_mask [rows, C] for C =
        `spec.num_labels` options; label [rows]."""
        C = spec.num_labels
        shapes = {k: ((rows, C, seq_len), np.int32) for k in _ENCODER_INPUTS}
        return {**shapes, "option_mask": ((rows, C), np.int32), "label": ((rows,), np.int32)}

    # The loss and metrics of classification, over options instead of classes.
    loss = Classification.loss

    def featurize(
        self, examples: Sequence[Any], tokenizer: Any, config: Any, spec: TaskSpec
    ) -> Features:
        """input_ids, segment_ids, input_mask [N,C,S] int32; option_mask [N,C]; label [N]."""
        return multiple_choice_features(
            examples, tokenizer, config.max_seq_length, config.max_qa_length
        )

    def score(
        self,
        eval_set: EvalSet,
        features: Features,
        outputs: Mapping[str, np.ndarray],
        config: Any,
        spec: TaskSpec,
    ) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """The task's metrics of argmax(logits [N,C]), and `chance_accuracy` (mean of
        1 / options: the baseline of guessing)."""
        values = np.argmax(outputs["logits"], axis=-1)
        metrics = compute_named_metrics(spec.metrics, values, features.arrays["label"])
        metrics["chance_accuracy"] = float(np.mean(1.0 / features.arrays["option_mask"].sum(1)))
        return metrics, _records(eval_set, values)


# ---------------------------------------------------------------------------- SQuAD spans
class _Span(TaskKind):
    """SQuAD-style extractive QA on doc-stride windows, scored by the official evaluator
    against `EvalSet.squad_json`."""

    model_inputs = _ENCODER_INPUTS + ("start_positions", "end_positions")
    labels = ("start_positions", "end_positions")

    def featurize(
        self, examples: Sequence[Any], tokenizer: Any, config: Any, spec: TaskSpec
    ) -> SquadFeatures:
        """input_ids, segment_ids, input_mask, p_mask [F,S] int32; start_positions,
        end_positions, is_impossible [F] int32; plus the host-side decoding arrays."""
        return squad_features(
            examples, tokenizer, config.max_seq_length, config.doc_stride, config.max_query_length
        )

    def write_predictions(
        self, workdir: str, suffix: str, eval_set: EvalSet, predictions: SquadPredictions
    ) -> list[str]:
        """The official files: `predictions{suffix}.json` {question id: answer},
        `nbest_predictions{suffix}.json` and (v2) `na_probs{suffix}.json` {id: P(no answer)}."""
        contents = {
            f"predictions{suffix}.json": predictions.answers,
            f"nbest_predictions{suffix}.json": predictions.nbest_json(),
        }
        if predictions.na_probs is not None:
            contents[f"na_probs{suffix}.json"] = predictions.na_probs
        return [files.write_json(_join(workdir, name), c) for name, c in contents.items()]


class SpanV1(_Span):
    """SQuAD v1.1: start / end logits [B,S]; every question has an answer."""

    name = "span_v1"
    squad_version = "v1.1"
    sequence_outputs = ("start_logits", "end_logits")

    def build_model(self, model_config: ModelConfig, spec: TaskSpec, config: Any) -> nn.Module:
        return heads.AlbertForQuestionAnswering(model_config)

    def loss(
        self, outputs: Mapping[str, jax.Array], batch: Batch
    ) -> tuple[jax.Array, dict[str, jax.Array]]:
        """start_logits, end_logits [B,S]; start_positions, end_positions [B] -> mean CE."""
        loss = losses.span_loss(
            outputs["start_logits"], outputs["end_logits"], batch["start_positions"],
            batch["end_positions"], batch.get("example_weight"),
        )  # fmt: skip
        return loss, {"loss": loss}

    def score(
        self,
        eval_set: EvalSet,
        features: Features,
        outputs: Mapping[str, np.ndarray],
        config: Any,
        spec: TaskSpec,
    ) -> tuple[dict[str, Any], SquadPredictions]:
        """EM / F1 of the n-best answers from start_logits, end_logits [F,S]."""
        assert isinstance(features, SquadFeatures)
        predictions = predict_v1(
            features, outputs["start_logits"], outputs["end_logits"], config.n_best_size,
            config.max_answer_length,
        )  # fmt: skip
        return squad_eval.evaluate(eval_set.squad_json, predictions.answers), predictions


class SpanV2(_Span):
    """SQuAD v2.0: XLNet-style beam over starts and ends plus an answerability logit; the
    model sees the gold start in training (the end is scored from it)."""

    name = "span_v2"
    squad_version = "v2.0"
    model_inputs = _ENCODER_INPUTS + ("p_mask", "start_positions", "end_positions", "is_impossible")
    labels = ("start_positions", "end_positions", "is_impossible")
    sequence_inputs = _ENCODER_INPUTS + ("p_mask",)  # its outputs are beams: [B,K] whatever S

    def build_model(self, model_config: ModelConfig, spec: TaskSpec, config: Any) -> nn.Module:
        return heads.AlbertForQuestionAnsweringV2(
            model_config, config.start_n_top, config.end_n_top, config.classifier_dropout
        )

    def head_inputs(self, batch: Batch, *, train: bool) -> dict[str, Any]:
        """p_mask [B,S] (1 = no answer may start or end there); start_positions [B] in
        training only (without them the head returns its inference beam)."""
        return {
            "p_mask": batch["p_mask"],
            "start_positions": batch["start_positions"] if train else None,
        }

    def loss(
        self, outputs: Mapping[str, jax.Array], batch: Batch
    ) -> tuple[jax.Array, dict[str, jax.Array]]:
        """start/end_log_probs [B,S], cls_logits [B]; positions, is_impossible [B] -> the
        official v2 loss."""
        loss = losses.squad_v2_loss(
            outputs, batch["start_positions"], batch["end_positions"], batch["is_impossible"],
            batch.get("example_weight"),
        )  # fmt: skip
        return loss, {"loss": loss}

    def score(
        self,
        eval_set: EvalSet,
        features: Features,
        outputs: Mapping[str, np.ndarray],
        config: Any,
        spec: TaskSpec,
    ) -> tuple[dict[str, Any], SquadPredictions]:
        """EM / F1 (+ best threshold) of the beam outputs (start_top_* [F,K], end_top_*
        [F,K*Ke], cls_logits [F]); answered "" where P(no answer) > null_threshold."""
        assert isinstance(features, SquadFeatures)
        predictions = predict_v2(
            features, outputs, config.n_best_size, config.max_answer_length, config.null_threshold
        )
        result = squad_eval.evaluate(
            eval_set.squad_json,
            predictions.best_non_null,
            predictions.na_probs,
            na_prob_thresh=config.null_threshold,
        )
        return result, predictions


KINDS: dict[str, TaskKind] = {
    kind.name: kind
    for kind in (Classification(), Regression(), MultipleChoice(), SpanV1(), SpanV2())
}


def get_kind(name: str) -> TaskKind:
    """The kind called `name`; ValueError naming the known kinds otherwise."""
    if name not in KINDS:
        raise ValueError(f"unknown task kind {name!r}; known kinds: {sorted(KINDS)}")
    return KINDS[name]
