"""Fine-tuning tasks: what each name reads, and which kind of task it is.

A task's kind (tasks/kinds.py: classification, regression, multiple_choice, span_v1, span_v2)
decides its head, featurization, loss, scoring and prediction files; this module only maps task
names to a kind, a label count, a source and metric names, and reads the examples.

Sources: local files (`config.data.train_files / eval_files`), or the TFDS catalog
(`glue/*`, `squad/*`, `race/*` from `config.data.data_dir`); squad_v1 / squad_v2 read SQuAD
JSON files instead when files are given.

All the files of `config.data.eval_files` form one eval set, scored together, so their example
ids must be unique across the set (predictions are keyed by them): a SQuAD question id in two
files is a ValueError naming both (JSON Lines ids already differ: tasks/local.py). Each example
remembers its file (`EvalSet.sources`), which its line of predictions.jsonl names.

`max_train_examples` / `max_eval_examples` = N keep a random N of the examples (`subset`).
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from albert_jax import files as file_io
from albert_jax.data import line_reading
from albert_jax.runtime import process_setup
from albert_jax.tasks import glue, json_records, local, race, squad
from albert_jax.tasks.batching import Features
from albert_jax.tasks.kinds import get_kind

__all__ = [
    "TaskSpec", "TASKS", "get_task", "EvalSet", "subset", "read_train", "read_eval", "featurize",
]  # fmt: skip


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
    """One evaluation set: its examples [N], where they came from (`name`: the files joined
    by commas, or the TFDS split; `sources` [N]: each example's file, None when all come from
    `name`; for SQuAD: the evaluator's JSON) and the read statistics."""

    name: str
    examples: list
    stats: local.ReadStats
    squad_json: dict[str, Any] | None = None
    sources: list[str] | None = None

    def example_sources(self) -> list[str]:
        """[N]: the file (or TFDS split) each example was read from."""
        if self.sources is None:
            return [self.name] * len(self.examples)
        return self.sources


# Fixed, not config.seed: runs with different seeds (and a resumed run) keep the same examples,
# so that their scores compare.
SUBSET_SEED = 0


def subset(count: int, max_examples: int) -> np.ndarray:
    """Indices [min(count, max_examples)] of the examples that max_examples > 0 keeps out of
    `count` (all of them for 0): a random choice without replacement from
    np.random.default_rng(SUBSET_SEED), in file order. Not the first N: files sorted by label
    (or topic, or source) would give a one-class subset."""
    if max_examples <= 0 or max_examples >= count:
        return np.arange(count)
    chosen = np.random.default_rng(SUBSET_SEED).choice(count, size=max_examples, replace=False)
    return np.sort(chosen)


def _unique_ids(per_file: list[tuple[str, list]], field: str) -> None:
    """Raises a ValueError naming both files and the id when an example id is in two files of
    an eval set: one's predictions would overwrite the other's, scored as one."""
    first_file: dict[str, str] = {}
    for path, examples in per_file:
        for example in examples:
            other = first_file.setdefault(example.id, path)
            if other != path:
                raise ValueError(
                    f"config.data.{field}: id {example.id!r} is in both {other} and {path}; "
                    "the files of an eval set are scored together, keyed by id, so ids must "
                    "be unique across them: give the examples distinct ids, or evaluate each "
                    "file in a run of its own"
                )


def _read_files(
    name: str, files: str, field: str, stats: local.ReadStats, limits: line_reading.LineLimits
) -> tuple[list[str], list, list[str]]:
    """(paths, examples [N], each example's path [N]) of the files `files` (config.data.<field>),
    their lines bounded by `limits`; the files of an eval set must have unique ids."""
    spec = get_task(name)
    if spec.source not in ("local", "squad"):
        raise ValueError(
            f"config.data.{field} is set but task {name!r} reads the TFDS catalog; unset "
            "the files or pick a local task"
        )
    paths = file_io.expand(files, f"config.data.{field}")
    if field == "eval_files":
        # One file twice would pass the id check (each id from one file) and count twice.
        repeated = [p for p, n in collections.Counter(paths).items() if n > 1]
        if repeated:
            raise ValueError(f"config.data.{field} lists {repeated[0]} more than once")
    reader = local.read_squad if spec.source == "squad" else local.TASKS[name].reader
    per_file = local.read_files(reader, paths, stats=stats, limits=limits)
    if field == "eval_files":  # training has no predictions: repeated ids do no harm there
        _unique_ids(per_file, field)
    examples = [e for _, file_examples in per_file for e in file_examples]
    sources = [path for path, file_examples in per_file for _ in file_examples]
    return paths, examples, sources


def _read(name: str, data: Any, files: str, field: str, split: str, max_examples: int) -> EvalSet:
    """Examples of one file set (local / SQuAD JSON: config.data.<field>) or one TFDS split,
    `subset` to max_examples; span kinds also get the evaluator's JSON (`EvalSet.squad_json`)."""
    spec = get_task(name)
    squad_version = get_kind(spec.kind).squad_version
    stats = local.ReadStats()
    squad_dataset = None
    sources = None
    if files:
        limits = line_reading.LineLimits.from_config(data, "config.data", json_records.LINE_LIMITS)
        paths, examples, sources = _read_files(name, files, field, stats, limits)
        if squad_version and len(paths) == 1 and max_examples <= 0:
            squad_dataset = json_records.read_json(
                paths[0], limits
            )  # score against the file itself
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
    kept = subset(len(examples), max_examples)
    examples = [examples[i] for i in kept]
    sources = None if sources is None else [sources[i] for i in kept]
    if squad_version and squad_dataset is None:  # the kept questions, or those of several files
        squad_dataset = squad.squad_json(examples, squad_version)
    return EvalSet(label, examples, stats, squad_dataset, sources)


def read_train(name: str, data: Mapping[str, Any]) -> EvalSet:
    """The training examples of task `name` as `config.data` says."""
    return _read(
        name,
        data,
        data.get("train_files", ""),
        "train_files",
        data.get("train_split", "train"),
        int(data.get("max_train_examples", 0)),
    )


def read_eval(name: str, data: Mapping[str, Any]) -> list[EvalSet]:
    """The evaluation sets: the eval files (one set), or each of the comma-separated splits."""
    max_examples = int(data.get("max_eval_examples", 0))
    files = data.get("eval_files", "")
    if files:
        return [_read(name, data, files, "eval_files", "", max_examples)]
    splits = [s.strip() for s in data.get("eval_split", "validation").split(",") if s.strip()]
    return [_read(name, data, "", "", split, max_examples) for split in splits]


def featurize(name: str, examples: Sequence, tokenizer: Any, config: Any) -> Features:
    """Examples -> fixed-shape Features for task `name` (its kind's `featurize`; config: the
    featurization fields)."""
    spec = get_task(name)
    return get_kind(spec.kind).featurize(examples, tokenizer, config, spec)
