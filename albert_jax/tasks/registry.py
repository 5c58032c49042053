"""Fine-tuning tasks: what each name reads, and which kind of task it is.

A task's kind (tasks/kinds.py: classification, regression, multiple_choice, span_v1, span_v2)
decides its head, featurization, loss, scoring and prediction files; this module only maps task
names to a kind, a label count, a source and metric names, and reads the examples.

Sources: local files (`config.data.train_files / eval_files`), or the TFDS catalog
(`glue/*`, `squad/*`, `race/*` from `config.data.data_dir`); squad_v1 / squad_v2 read SQuAD
JSON files instead when files are given.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from albert_jax import files as file_io
from albert_jax import process_setup
from albert_jax.tasks import glue, local, race, squad
from albert_jax.tasks.batching import Features
from albert_jax.tasks.kinds import get_kind

__all__ = ["TaskSpec", "TASKS", "get_task", "EvalSet", "read_train", "read_eval", "featurize"]


@dataclasses.dataclass(frozen=True)
class TaskSpec:
    """kind: a name in tasks/kinds.KINDS; num_labels: classes, 1 (regression), options per
    question (multiple choice) or 2 (spans); source: "local", "glue", "squad" or "race";
    metrics: names in tasks/metrics.METRIC_FNS, or the SQuAD evaluator's keys."""

    kind: str
    num_labels: int
    source: str
    metrics: tuple[str, ...]

    def __post_init__(self) -> None:
        get_kind(self.kind)  # an unknown kind fails when the task is defined


def _glue_spec(name: str) -> TaskSpec:
    spec = glue.GLUE_TASKS[name]
    kind = "regression" if spec.num_labels == 1 else "classification"
    return TaskSpec(kind, spec.num_labels, "glue", _glue_metrics(name))


def _glue_metrics(name: str) -> tuple[str, ...]:
    from albert_jax.tasks.metrics import GLUE_METRICS

    return GLUE_METRICS[name]


# local.TASKS names the span kind "span" (its files are SQuAD v1.1 JSON).
_LOCAL_KINDS = {"span": "span_v1"}


def _local_spec(name: str) -> TaskSpec:
    spec = local.TASKS[name]
    kind = _LOCAL_KINDS.get(spec.kind, spec.kind)
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


def _read(name: str, data: Any, files: str, split: str, max_examples: int) -> EvalSet:
    """Examples of one file set (local / SQuAD JSON) or one TFDS split; span kinds also get
    the evaluator's JSON (`EvalSet.squad_json`)."""
    spec = get_task(name)
    squad_version = get_kind(spec.kind).squad_version
    stats = local.ReadStats()
    squad_dataset = None
    if files:
        if spec.source not in ("local", "squad"):
            raise ValueError(
                f"config.data.*_files is set but task {name!r} reads the TFDS catalog; unset "
                "the files or pick a local task"
            )
        paths = file_io.expand(files)
        if spec.source == "squad":
            examples = [e for p in paths for e in local.read_squad(p, stats=stats)]
        else:
            examples = local.read_task(name, paths, stats=stats)
        if squad_version and len(paths) == 1 and max_examples <= 0:
            squad_dataset = local.read_json(paths[0])  # score against the file itself
        label = ",".join(paths)
    elif spec.source == "local":
        raise ValueError(
            f"task {name!r} is a local task: set --config.data.train_files and "
            "--config.data.eval_files"
        )
    else:
        process_setup.hide_accelerators_from_tensorflow()  # TFDS reads through TensorFlow
        data_dir = data.get("data_dir")
        if spec.source == "glue":
            examples = glue.read_glue(name, split, data_dir=data_dir, stats=stats)
        elif spec.source == "squad":
            examples = squad.read_squad_tfds(squad_version, split, data_dir=data_dir, stats=stats)
        else:
            levels = [x.strip() for x in data.get("race_levels", "middle,high").split(",")]
            examples = race.read_race(split, levels=levels, data_dir=data_dir, stats=stats)
        label = split
    examples = _limit(examples, max_examples)
    if squad_version and squad_dataset is None:
        squad_dataset = squad.squad_json(examples, squad_version)
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
    """Examples -> fixed-shape Features for task `name` (its kind's `featurize`; config: the
    featurization fields)."""
    spec = get_task(name)
    return get_kind(spec.kind).featurize(examples, tokenizer, config, spec)
