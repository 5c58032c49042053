"""GLUE from the TFDS catalog (`glue/<task>`), used as is from a prepared TFDS data dir.

TFDS records (`tfds.as_numpy`) hold the task's text fields as bytes, `label` (a class index, or
a float for STS-B; -1 on the unlabelled test splits) and `idx`. `glue_example` maps one record
to a `ClassificationExample`; records without a usable label are skipped and counted.

| task | text fields | labels | eval splits |
|---|---|---|---|
| cola | sentence | unacceptable, acceptable | validation |
| sst2 | sentence | negative, positive | validation |
| mrpc | sentence1, sentence2 | not_equivalent, equivalent | validation |
| qqp | question1, question2 | not_duplicate, duplicate | validation |
| stsb | sentence1, sentence2 | float score 0..5 (regression) | validation |
| mnli | premise, hypothesis | entailment, neutral, contradiction | validation_(mis)matched |
| qnli | question, sentence | entailment, not_entailment | validation |
| rte | sentence1, sentence2 | entailment, not_entailment | validation |
| wnli | sentence1, sentence2 | not_entailment, entailment | validation |
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import numpy as np

from albert_jax import files
from albert_jax.files import BadRecordError
from albert_jax.tasks.records import ClassificationExample, ReadStats

__all__ = ["BadRecordError", "GlueTask", "GLUE_TASKS", "glue_example", "read_glue"]


class GlueTask(NamedTuple):
    """How a GLUE task is stored in TFDS: text fields (a, b), label count (1 = regression)."""

    tfds_name: str
    text_a: str
    text_b: str | None
    num_labels: int
    eval_splits: tuple[str, ...]


GLUE_TASKS: dict[str, GlueTask] = {
    "cola": GlueTask("glue/cola", "sentence", None, 2, ("validation",)),
    "sst2": GlueTask("glue/sst2", "sentence", None, 2, ("validation",)),
    "mrpc": GlueTask("glue/mrpc", "sentence1", "sentence2", 2, ("validation",)),
    "qqp": GlueTask("glue/qqp", "question1", "question2", 2, ("validation",)),
    "stsb": GlueTask("glue/stsb", "sentence1", "sentence2", 1, ("validation",)),
    "mnli": GlueTask(
        "glue/mnli", "premise", "hypothesis", 3, ("validation_matched", "validation_mismatched")
    ),
    "qnli": GlueTask("glue/qnli", "question", "sentence", 2, ("validation",)),
    "rte": GlueTask("glue/rte", "sentence1", "sentence2", 2, ("validation",)),
    "wnli": GlueTask("glue/wnli", "sentence1", "sentence2", 2, ("validation",)),
}


def glue_example(task: str, record: Mapping[str, Any], split: str = "") -> ClassificationExample:
    """One TFDS GLUE record -> ClassificationExample (id "<split>-<idx>").

    Raises BadRecordError (a ValueError naming the field) when a text is missing or empty, or
    when the label is absent or -1 (unlabelled test split); `read_glue` skips and counts those.
    """
    if task not in GLUE_TASKS:
        raise ValueError(f"task: unknown GLUE task {task!r}; known: {sorted(GLUE_TASKS)}")
    spec = GLUE_TASKS[task]
    texts = []
    for field in (spec.text_a, spec.text_b):
        if field is None:
            texts.append(None)
            continue
        if field not in record:
            raise BadRecordError(f"missing_field:{field}", f"glue/{task}: no field {field!r}")
        text = files.text(record[field])
        if not text.strip():
            raise BadRecordError(f"empty_text:{field}", f"glue/{task}: empty {field!r}")
        texts.append(text)
    if "label" not in record:
        raise BadRecordError("missing_field:label", f"glue/{task}: no field 'label'")
    raw = np.asarray(record["label"]).item()
    if spec.num_labels == 1:
        label: int | float = float(raw)
        if not np.isfinite(label) or label < 0:
            raise BadRecordError("unlabelled", f"glue/{task}: no score (label={raw!r})")
    else:
        label = int(raw)
        if not 0 <= label < spec.num_labels:
            raise BadRecordError("unlabelled", f"glue/{task}: no class (label={raw!r})")
    idx = int(np.asarray(record.get("idx", -1)).item())
    return ClassificationExample(f"{split}-{idx}", texts[0], texts[1], label)


def read_glue(
    task: str,
    split: str,
    *,
    data_dir: str | None = None,
    max_examples: int = 0,
    stats: ReadStats | None = None,
) -> list[ClassificationExample]:
    """All labelled examples of `glue/<task>` `split` from a prepared TFDS data dir (never
    downloads). max_examples > 0 keeps the first ones."""
    import tensorflow_datasets as tfds

    spec = GLUE_TASKS.get(task)
    if spec is None:
        raise ValueError(f"task: unknown GLUE task {task!r}; known: {sorted(GLUE_TASKS)}")
    builder = tfds.builder(spec.tfds_name, data_dir=data_dir)
    dataset = builder.as_dataset(split=split, shuffle_files=False)
    local = ReadStats()
    examples: list[ClassificationExample] = []
    for record in tfds.as_numpy(dataset):
        local.read += 1
        try:
            examples.append(glue_example(task, record, split))
        except BadRecordError as bad:
            local.skip(bad.reason, f"glue/{task}:{split}:{local.read}")
        if max_examples and len(examples) >= max_examples:
            break
    local.kept = len(examples)
    if stats is not None:
        stats.update(local)
    return examples
