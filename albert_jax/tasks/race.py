"""RACE from the TFDS catalog (`race/middle`, `race/high`), used as is from a prepared data dir.

A TFDS record is one article with all its questions: `article` (bytes), `questions` [Q],
`answers` [Q] ("A".."D"), `options` [Q, 4] (a tf.RaggedTensor from `tfds.as_numpy`: the spec's
inner dimensions are ragged) and `example_id`. `race_examples` turns it into one
`MultipleChoiceExample` per question (label = index of the answer letter). The official ALBERT
setup trains on middle and high together and reports the accuracy on both.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from albert_jax import files
from albert_jax.files import BadRecordError
from albert_jax.tasks.records import MultipleChoiceExample, ReadStats

__all__ = ["RACE_LEVELS", "RACE_NUM_CHOICES", "race_examples", "read_race"]

RACE_LEVELS = ("middle", "high")
RACE_NUM_CHOICES = 4


def _option_rows(value: Any) -> list[list[Any]]:
    """The [Q, options] field as nested lists. `tfds.as_numpy` leaves it a `tf.RaggedTensor`
    (its inner dimensions are ragged in the feature spec), whose rows iterate as tf.Tensors:
    convert it whole, as numpy arrays and plain lists are."""
    if hasattr(value, "to_list"):  # tf.RaggedTensor / RaggedTensorValue
        return [list(row) for row in value.to_list()]
    if isinstance(value, np.ndarray):
        return [list(row) for row in value.tolist()]
    return [list(row) for row in value]


def race_examples(
    record: Mapping[str, Any], stats: ReadStats | None = None
) -> list[MultipleChoiceExample]:
    """One article record -> its questions. A question with a bad answer letter, an option count
    other than 4 or an empty option is skipped and counted in `stats` (if given)."""
    for field in ("article", "questions", "answers", "options"):
        if field not in record:
            raise BadRecordError(f"missing_field:{field}", f"RACE record: no {field!r}")
    article = files.text(record["article"])
    if not article.strip():
        raise BadRecordError("empty_text:article", "RACE record: empty article")
    article_id = files.text(record.get("example_id", b"")) or "race"
    questions = [files.text(q) for q in np.asarray(record["questions"], dtype=object).reshape(-1)]
    answers = [files.text(a) for a in np.asarray(record["answers"], dtype=object).reshape(-1)]
    options = [[files.text(o) for o in row] for row in _option_rows(record["options"])]
    if not len(questions) == len(answers) == len(options):
        raise BadRecordError(
            "ragged_questions",
            f"RACE {article_id}: {len(questions)} questions, {len(answers)} answers, "
            f"{len(options)} option lists",
        )
    examples = []
    for i, (question, answer, opts) in enumerate(zip(questions, answers, options, strict=True)):
        reason = None
        if len(opts) != RACE_NUM_CHOICES or any(not o.strip() for o in opts):
            reason = "bad_options"
        elif len(answer) != 1 or not 0 <= ord(answer) - ord("A") < RACE_NUM_CHOICES:
            reason = "bad_answer"
        if reason is not None:
            if stats is not None:
                stats.read += 1
                stats.skip(reason, f"{article_id}#{i}")
            continue
        if stats is not None:
            stats.read += 1
        examples.append(
            MultipleChoiceExample(
                id=f"{article_id}-{i}",
                context=article,
                question=question,
                options=tuple(opts),
                option_mask=(1,) * RACE_NUM_CHOICES,
                label=ord(answer) - ord("A"),
            )
        )
    return examples


def read_race(
    split: str,
    *,
    levels: Sequence[str] = RACE_LEVELS,
    data_dir: str | None = None,
    max_examples: int = 0,
    stats: ReadStats | None = None,
) -> list[MultipleChoiceExample]:
    """Questions of `race/<level>` `split` ("train" / "dev" / "test") for each level, in order,
    from a prepared TFDS data dir (never downloads); max_examples > 0 keeps the first ones."""
    import tensorflow_datasets as tfds

    unknown = [level for level in levels if level not in RACE_LEVELS]
    if unknown:
        raise ValueError(f"levels: unknown RACE levels {unknown}; known: {RACE_LEVELS}")
    local = ReadStats()
    examples: list[MultipleChoiceExample] = []
    for level in levels:
        if max_examples and len(examples) >= max_examples:
            break
        builder = tfds.builder(f"race/{level}", data_dir=data_dir)
        for record in tfds.as_numpy(builder.as_dataset(split=split, shuffle_files=False)):
            try:
                examples.extend(race_examples(record, local))
            except BadRecordError as bad:
                local.read += 1
                local.skip(bad.reason, f"race/{level}:{split}")
            if max_examples and len(examples) >= max_examples:
                break
    examples = examples[:max_examples] if max_examples else examples
    local.kept = len(examples)
    if stats is not None:
        stats.update(local)
    return examples
