"""Fine-tuning tasks: what each name reads, how it is featurized, which head it needs and how
its predictions are scored.

  kind             head                              metric
  classification   AlbertForSequenceClassification   GLUE's (accuracy, F1, MCC)
  regression       AlbertForSequenceClassification   Pearson, Spearman (STS-B)
  multiple_choice  AlbertForMultipleChoice           accuracy
  span_v1          AlbertForQuestionAnswering        SQuAD EM / F1
  span_v2          AlbertForQuestionAnsweringV2      SQuAD EM / F1 (+ best threshold)

Sources: local files (`config.data.train_files / eval_files`), or the TFDS catalog
(`glue/*`, `squad/*`, `race/*` from `config.data.data_dir`); squad_v1 / squad_v2 read SQuAD
JSON files instead when files are given.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import numpy as np

from albert_jax.tasks import glue, local, race, squad
from albert_jax.tasks.batching import Features
from albert_jax.tasks.classification import classification_features
from albert_jax.tasks.multiple_choice import multiple_choice_features
from albert_jax.tasks.squad_features import SquadFeatures, squad_features
from albert_jax.tasks.squad_predictions import SquadPredictions, predict_v1, predict_v2

__all__ = ["TaskSpec", "TASKS", "EvalSet", "read_train", "read_eval", "featurize", "score"]

Kind = Literal["classification", "regression", "multiple_choice", "span_v1", "span_v2"]


@dataclasses.dataclass(frozen=True)
class TaskSpec:
    """kind (see module docstring); num_labels: classes, 1 (regression), options per question
    (multiple choice) or 2 (spans); source: "local", "glue", "squad" or "race"."""

    kind: Kind
    num_labels: int
    source: str
    metrics: tuple[str, ...]


def _glue_spec(name: str) -> TaskSpec:
    spec = glue.GLUE_TASKS[name]
    kind: Kind = "regression" if spec.num_labels == 1 else "classification"
    return TaskSpec(kind, spec.num_labels, "glue", _glue_metrics(name))


def _glue_metrics(name: str) -> tuple[str, ...]:
    from albert_jax.tasks.metrics import GLUE_METRICS

    return GLUE_METRICS[name]


def _local_spec(name: str) -> TaskSpec:
    spec = local.TASKS[name]
    kind: Kind = "span_v1" if spec.kind == "span" else spec.kind  # type: ignore[assignment]
    return TaskSpec(kind, spec.num_labels, "local", spec.metrics)


TASKS: dict[str, TaskSpec] = {
    **{name: _glue_spec(name) for name in glue.GLUE_TASKS},
    "squad_v1": TaskSpec("span_v1", 2, "squad", ("exact_match", "f1")),
    "squad_v2": TaskSpec("span_v2", 2, "squad", ("exact_match", "f1")),
    "race": TaskSpec("multiple_choice", race.RACE_NUM_CHOICES, "race", ("accuracy",)),
    **{name: _local_spec(name) for name in local.TASKS},
}


def get_task(name: str) -> TaskSpec:
    if name not in TASKS:
        raise ValueError(f"config.task={name!r} is not a known task; known: {sorted(TASKS)}")
    return TASKS[name]


@dataclasses.dataclass
class EvalSet:
    """One evaluation set: its examples, where they came from (for SQuAD: the evaluator's
    JSON) and the read statistics."""

    name: str
    examples: list
    stats: local.ReadStats
    squad_json: dict[str, Any] | None = None


def _limit(examples: list, max_examples: int) -> list:
    return examples[:max_examples] if max_examples > 0 else examples


def _squad_version(name: str) -> str:
    return "v2.0" if name == "squad_v2" else "v1.1"


def _read(name: str, data: Any, files: str, split: str, max_examples: int) -> EvalSet:
    """Examples of one file set (local / SQuAD JSON) or one TFDS split."""
    spec = get_task(name)
    stats = local.ReadStats()
    squad_dataset = None
    if files:
        if spec.source not in ("local", "squad"):
            raise ValueError(
                f"config.data.*_files is set but task {name!r} reads the TFDS catalog; unset "
                "the files or pick a local task"
            )
        paths = local.expand_paths(files)
        if spec.source == "squad":
            examples = [e for p in paths for e in local.read_squad(p, stats=stats)]
        else:
            examples = local.read_task(name, paths, stats=stats)
        if spec.kind in ("span_v1", "span_v2") and len(paths) == 1 and max_examples <= 0:
            with local.open_text(paths[0]) as f:
                squad_dataset = json.load(f)  # score against the file itself
        label = ",".join(paths)
    elif spec.source == "local":
        raise ValueError(
            f"task {name!r} is a local task: set --config.data.train_files and "
            "--config.data.eval_files"
        )
    else:
        data_dir = data.get("data_dir")
        if spec.source == "glue":
            examples = glue.read_glue(name, split, data_dir=data_dir, stats=stats)
        elif spec.source == "squad":
            examples = squad.read_squad_tfds(
                _squad_version(name), split, data_dir=data_dir, stats=stats
            )
        else:
            levels = [x.strip() for x in data.get("race_levels", "middle,high").split(",")]
            examples = race.read_race(split, levels=levels, data_dir=data_dir, stats=stats)
        label = split
    examples = _limit(examples, max_examples)
    if spec.kind in ("span_v1", "span_v2") and squad_dataset is None:
        squad_dataset = squad.squad_json(examples, _squad_version(name))
    return EvalSet(label, examples, stats, squad_dataset)


def read_train(name: str, data: Mapping[str, Any]) -> EvalSet:
    """The training examples of task `name` as `config.data` says."""
    return _read(
        name,
        data,
        data.get("train_files", ""),
        data.get("train_split", "train"),
        int(data.get("max_train_examples", 0)),
    )


def read_eval(name: str, data: Mapping[str, Any]) -> list[EvalSet]:
    """The evaluation sets: the eval files (one set), or each of the comma-separated splits."""
    max_examples = int(data.get("max_eval_examples", 0))
    files = data.get("eval_files", "")
    if files:
        return [_read(name, data, files, "", max_examples)]
    splits = [s.strip() for s in data.get("eval_split", "validation").split(",") if s.strip()]
    return [_read(name, data, "", split, max_examples) for split in splits]


def featurize(name: str, examples: Sequence, tokenizer: Any, config: Any) -> Features:
    """Examples -> fixed-shape Features for task `name` (config: featurization fields)."""
    spec = get_task(name)
    if spec.kind in ("classification", "regression"):
        return classification_features(
            examples, tokenizer, config.max_seq_length, regression=spec.kind == "regression"
        )
    if spec.kind == "multiple_choice":
        return multiple_choice_features(
            examples, tokenizer, config.max_seq_length, config.max_qa_length
        )
    return squad_features(
        examples, tokenizer, config.max_seq_length, config.doc_stride, config.max_query_length
    )


def score(
    name: str, eval_set: EvalSet, features: Features, outputs: Mapping[str, np.ndarray], config: Any
) -> tuple[dict[str, Any], Any]:
    """Official metrics of the gathered outputs (one row per feature) and the predictions.

    Returns (metrics, predictions): predictions are a list of {"id", "prediction", "label"}
    records, or SquadPredictions for span tasks. Classification-style metrics come with the
    baseline a model must beat: `majority_accuracy` (most frequent eval label) or
    `chance_accuracy` (multiple choice: mean of 1 / options).
    """
    from albert_jax.tasks import squad_eval
    from albert_jax.tasks.metrics import compute_named_metrics

    spec = get_task(name)
    if spec.kind in ("span_v1", "span_v2"):
        assert isinstance(features, SquadFeatures)
        if spec.kind == "span_v1":
            predictions: SquadPredictions = predict_v1(
                features,
                outputs["start_logits"],
                outputs["end_logits"],
                config.n_best_size,
                config.max_answer_length,
            )
            result = squad_eval.evaluate(eval_set.squad_json, predictions.answers)
        else:
            predictions = predict_v2(
                features, outputs, config.n_best_size, config.max_answer_length,
                config.null_threshold,
            )  # fmt: skip
            result = squad_eval.evaluate(
                eval_set.squad_json,
                predictions.best_non_null,
                predictions.na_probs,
                na_prob_thresh=config.null_threshold,
            )
        return result, predictions

    labels = features.arrays["label"]
    if spec.kind == "regression":
        values = outputs["logits"][:, 0]
    else:
        values = np.argmax(outputs["logits"], axis=-1)
    metrics = compute_named_metrics(spec.metrics, values, labels)
    if spec.kind == "classification":
        metrics["majority_accuracy"] = float(np.bincount(labels).max() / len(labels))
    if spec.kind == "multiple_choice":
        metrics["chance_accuracy"] = float(np.mean(1.0 / features.arrays["option_mask"].sum(1)))
    records = [
        {"id": e.id, "prediction": v.item(), "label": e.label}
        for e, v in zip(eval_set.examples, values, strict=True)
    ]
    return metrics, records
