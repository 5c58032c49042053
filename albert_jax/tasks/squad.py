"""SQuAD from the TFDS catalog (`squad/v1.1`, `squad/v2.0`), used as is from a prepared data dir,
and the SQuAD JSON that the official evaluator reads, rebuilt from examples.

TFDS records (`tfds.as_numpy`): `id`, `title`, `context`, `question` (bytes) and `answers`
{"text": [bytes], "answer_start": [int32]}; v2.0 adds `is_impossible` (bool) and
`plausible_answers` (ignored: they are not answers). `squad_example` maps one record to a
`SpanExample`, checking that each answer is where it says in the context; a misplaced answer
is moved to the nearest occurrence of its text (the same rule as the local JSON reader), an
answer not in the context is dropped, and a question left without answers is skipped and
counted.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from albert_jax import files
from albert_jax.files import BadRecordError
from albert_jax.tasks.local import nearest_occurrence
from albert_jax.tasks.records import ReadStats, SpanAnswer, SpanExample

__all__ = ["SQUAD_VERSIONS", "squad_example", "read_squad_tfds", "squad_json"]

SQUAD_VERSIONS = {"v1.1": "squad/v1.1", "v2.0": "squad/v2.0"}


def squad_example(record: Mapping[str, Any], stats: ReadStats | None = None) -> SpanExample:
    """One TFDS SQuAD record -> SpanExample. Raises BadRecordError (a ValueError) for a record
    without id / question / context, or an answerable question without a valid answer;
    relocated or dropped answers are counted in `stats.adjusted`."""
    for field in ("id", "question", "context"):
        if field not in record or not files.text(record[field]).strip():
            raise BadRecordError(f"missing_field:{field}", f"SQuAD record: no {field!r}")
    qid, context = files.text(record["id"]), files.text(record["context"])
    is_impossible = bool(np.asarray(record.get("is_impossible", False)).item())
    answers: list[SpanAnswer] = []
    raw = record.get("answers") or {}
    texts = [files.text(t) for t in np.asarray(raw.get("text", []), dtype=object).reshape(-1)]
    starts = [int(s) for s in np.asarray(raw.get("answer_start", []), dtype=np.int64).reshape(-1)]
    for text, start in zip(texts, starts, strict=False):
        if not text:
            continue
        if context[start : start + len(text)] != text:
            found = nearest_occurrence(context, text, start)
            key = "answer_start_relocated" if found != -1 else "answer_dropped:not_in_context"
            if stats is not None:
                stats.adjusted[key] += 1
            if found == -1:
                continue
            start = found
        answers.append(SpanAnswer(text, start))
    if is_impossible:
        answers = []
    elif not answers:
        raise BadRecordError("no_valid_answer", f"SQuAD question {qid!r}: no valid answer")
    title = files.text(record.get("title", b""))
    return SpanExample(
        qid, title, files.text(record["question"]), context, tuple(answers), is_impossible
    )


def read_squad_tfds(
    version: str,
    split: str,
    *,
    data_dir: str | None = None,
    max_examples: int = 0,
    stats: ReadStats | None = None,
) -> list[SpanExample]:
    """Questions of `squad/<version>` `split` ("train" / "validation") from a prepared TFDS data
    dir (never downloads); max_examples > 0 keeps the first ones."""
    import tensorflow_datasets as tfds

    if version not in SQUAD_VERSIONS:
        raise ValueError(f"version must be one of {sorted(SQUAD_VERSIONS)}, got {version!r}")
    builder = tfds.builder(SQUAD_VERSIONS[version], data_dir=data_dir)
    local = ReadStats()
    examples: list[SpanExample] = []
    for record in tfds.as_numpy(builder.as_dataset(split=split, shuffle_files=False)):
        local.read += 1
        try:
            examples.append(squad_example(record, local))
        except BadRecordError as bad:
            local.skip(bad.reason, f"squad/{version}:{split}:{local.read}")
        if max_examples and len(examples) >= max_examples:
            break
    local.kept = len(examples)
    if stats is not None:
        stats.update(local)
    return examples


def squad_json(examples: Sequence[SpanExample], version: str) -> dict[str, Any]:
    """The official evaluator's input for these questions: one paragraph per question."""
    data = []
    for e in examples:
        qa: dict[str, Any] = {
            "id": e.id,
            "question": e.question,
            "answers": [{"text": a.text, "answer_start": a.answer_start} for a in e.answers],
        }
        if version.lstrip("v").startswith("2"):
            qa["is_impossible"] = e.is_impossible
        data.append({"title": e.title, "paragraphs": [{"context": e.context, "qas": [qa]}]})
    return {"version": version.lstrip("v"), "data": data}
