"""Readers for labelled sets in JSON Lines files and for SQuAD-format JSON files.

Each reader turns one file into a list of plain, frozen dataclass records:

  sentiment_rt        {"sentence", "label" (0 neg, 1 pos), "score"}  → ClassificationExample
                      (the same files, label = the mean human rating "score", give the
                      regression task `sentiment_rt_score`)
  nli_vitaminc        {"premise", "hypothesis", "label": "entailment"|"neutral"|"contradiction"}
                      → ClassificationExample, label = index in VITAMINC_LABELS
  mc_cosmosqa         {"context", "question", "options": [2..num_choices str], "label": index}
                      → MultipleChoiceExample, options padded to num_choices, with a mask
  SQuAD v1.1 / v2.0   {"data": [{"title", "paragraphs": [{"context", "qas": [...]}]}]}
                      → SpanExample, one per question

A bad record (a line that is not UTF-8 or not JSON, missing or mistyped field, empty text,
label out of range, SQuAD answer that is not in its context) is skipped and counted in a
ReadStats, by reason, with the location of the first one; a summary is logged whenever anything
was skipped. Nothing is dropped silently. A file that cannot be read as a whole (a SQuAD JSON
file that is truncated or not UTF-8, a JSON Lines file without one UTF-8 line) raises one
ValueError naming the file, the line and the reason.

Reading is bounded (`line_reading.LineLimits`, config.data.max_line_bytes / max_blank_lines): a line
longer than the cap is skipped without being held whole (`line_too_long`), a run of blank lines
past the cap ends the file's read (`blank_run_too_long`, at its line), and a SQuAD JSON file
larger than the line cap is refused: a small gzip that expands to gigabytes costs seconds and
bounded memory, not the host.

The files may be local or on gs://, and gzip'ed (detected from the content, not the file name).
A JSON Lines record's id is `<file stem>-<line index>` (dev.jsonl line 3: `dev-2`); when several
files of a set share a name, `read_files` names them by their folders too (`a/dev-2`,
`b/dev-2`), so that ids stay unique across the set and say which file each record is from.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from typing import Any, Literal, NamedTuple

from albert_jax import files
from albert_jax.data import line_reading
from albert_jax.files import BadRecordError
from albert_jax.tasks.json_records import (
    file_name,
    file_names,
    float_field,
    int_field,
    log_summary,
    read_json,
    read_jsonl,
    text_field,
)
from albert_jax.tasks.records import (
    ClassificationExample,
    MultipleChoiceExample,
    ReadStats,
    SpanAnswer,
    SpanExample,
)

log = logging.getLogger(__name__)

PathLike = str | os.PathLike

# Label order of the NLI tasks in GLUE (MNLI) as TFDS and HF number them, so that a model
# fine-tuned on one can be evaluated on the other without a label map.
VITAMINC_LABELS: tuple[str, ...] = ("entailment", "neutral", "contradiction")
SENTIMENT_LABELS: tuple[str, ...] = ("negative", "positive")
# RACE-style multiple choice: the head scores a fixed number of options per question.
DEFAULT_NUM_CHOICES = 4


# ----------------------------------------------------------------------------- readers
def read_sentiment_rt(
    path: PathLike,
    *,
    stats: ReadStats | None = None,
    name: str | None = None,
    limits: line_reading.LineLimits | None = None,
) -> list[ClassificationExample]:
    """sentiment_rt lines {"sentence", "label" 0|1} → ClassificationExample(label=int)."""

    def parse(example_id: str, record: dict) -> ClassificationExample:
        sentence = text_field(record, "sentence")
        label = int_field(record, "label")
        if not 0 <= label < len(SENTIMENT_LABELS):
            raise BadRecordError("label_out_of_range")
        return ClassificationExample(example_id, sentence, None, label)

    return read_jsonl(path, parse, stats, name, limits)


def read_sentiment_rt_score(
    path: PathLike,
    *,
    stats: ReadStats | None = None,
    name: str | None = None,
    limits: line_reading.LineLimits | None = None,
) -> list[ClassificationExample]:
    """sentiment_rt lines {"sentence", "score"} → ClassificationExample(label=float score).

    score is the mean of ≥20 human ratings on a −4..4 scale: a real single-sentence regression
    target (an STS-B-like task on local data).
    """

    def parse(example_id: str, record: dict) -> ClassificationExample:
        sentence = text_field(record, "sentence")
        return ClassificationExample(example_id, sentence, None, float_field(record, "score"))

    return read_jsonl(path, parse, stats, name, limits)


def read_nli_vitaminc(
    path: PathLike,
    *,
    stats: ReadStats | None = None,
    name: str | None = None,
    limits: line_reading.LineLimits | None = None,
) -> list[ClassificationExample]:
    """nli_vitaminc lines {"premise", "hypothesis", "label": name} → index in VITAMINC_LABELS."""

    def parse(example_id: str, record: dict) -> ClassificationExample:
        premise = text_field(record, "premise")
        hypothesis = text_field(record, "hypothesis")
        label = text_field(record, "label")
        if label not in VITAMINC_LABELS:
            raise BadRecordError("unknown_label")
        return ClassificationExample(example_id, premise, hypothesis, VITAMINC_LABELS.index(label))

    return read_jsonl(path, parse, stats, name, limits)


def read_mc_cosmosqa(
    path: PathLike,
    *,
    stats: ReadStats | None = None,
    name: str | None = None,
    limits: line_reading.LineLimits | None = None,
    num_choices: int = DEFAULT_NUM_CHOICES,
) -> list[MultipleChoiceExample]:
    """mc_cosmosqa lines {"context", "question", "options", "label"} → MultipleChoiceExample.

    Records with 2..num_choices options are kept (the files hold 3 or 4, and one real record
    with 2); the options are padded with "" to num_choices and option_mask marks the real ones.
    """
    if num_choices < 2:
        raise ValueError(f"num_choices must be at least 2, got {num_choices}")

    def parse(example_id: str, record: dict) -> MultipleChoiceExample:
        context = text_field(record, "context")
        question = text_field(record, "question")
        if "options" not in record:
            raise BadRecordError("missing_field:options")
        options = record["options"]
        if not isinstance(options, list) or not all(isinstance(o, str) for o in options):
            raise BadRecordError("bad_type:options")
        if any(not o.strip() for o in options):
            raise BadRecordError("empty_text:options")
        if len(options) < 2:
            raise BadRecordError("too_few_options")
        if len(options) > num_choices:
            raise BadRecordError("too_many_options")
        label = int_field(record, "label")
        if not 0 <= label < len(options):
            raise BadRecordError("label_out_of_range")
        padding = num_choices - len(options)
        return MultipleChoiceExample(
            id=example_id,
            context=context,
            question=question,
            options=tuple(options) + ("",) * padding,
            option_mask=(1,) * len(options) + (0,) * padding,
            label=label,
        )

    return read_jsonl(path, parse, stats, name, limits)


def nearest_occurrence(context: str, text: str, near: int) -> int:
    """Start of the occurrence of text in context closest to `near`, or -1 if there is none
    (the earlier one of two as close). Where a SQuAD answer whose answer_start does not point
    at its text is moved to, by this reader and the TFDS one (tasks/squad.py)."""
    best = -1
    start = context.find(text)
    while start != -1:
        if best == -1 or abs(start - near) < abs(best - near):
            best = start
        start = context.find(text, start + 1)
    return best


def _squad_answers(
    raw_answers: Any, context: str, relocate_answers: bool, stats: ReadStats
) -> tuple[SpanAnswer, ...]:
    """Valid gold answers of one question; bad ones are dropped and counted in stats.adjusted."""
    if not isinstance(raw_answers, list):
        raise BadRecordError("bad_type:answers")
    answers = []
    for raw in raw_answers:
        text = raw.get("text") if isinstance(raw, dict) else None
        start = raw.get("answer_start") if isinstance(raw, dict) else None
        if (
            not isinstance(text, str)
            or not text
            or isinstance(start, bool)
            or not isinstance(start, int)
        ):
            stats.adjusted["answer_dropped:bad_field"] += 1
            continue
        if context[start : start + len(text)] != text:
            # Some real files (e.g. SQuAD-Shifts amazon_reviews) have offsets shifted by a few
            # characters; the answer text itself is in the context, so it is moved there.
            found = nearest_occurrence(context, text, start) if relocate_answers else -1
            if found == -1:
                stats.adjusted["answer_dropped:not_in_context"] += 1
                continue
            stats.adjusted["answer_start_relocated"] += 1
            start = found
        answers.append(SpanAnswer(text, start))
    return tuple(answers)


def read_squad(
    path: PathLike,
    *,
    stats: ReadStats | None = None,
    name: str | None = None,
    limits: line_reading.LineLimits | None = None,
    relocate_answers: bool = True,
) -> list[SpanExample]:
    """A SQuAD v1.1 or v2.0 JSON file (gzip'ed or not) → one SpanExample per question.

    v2.0 questions with `is_impossible: true` get no answers. An answer whose answer_start does
    not point at its text is moved to the nearest occurrence of the text in the context
    (relocate_answers=True) or dropped; a question left without answers that is not impossible
    is skipped. Question ids must be unique (predictions are keyed by them): a repeated one is
    skipped (registry checks them across the files of an eval set). name: what bad-record
    locations call the file (default: its file name).
    """
    dataset = read_json(path, limits)
    if not isinstance(dataset, dict) or not isinstance(dataset.get("data"), list):
        raise ValueError(f"{os.fspath(path)}: not SQuAD JSON: expected a top-level 'data' list")
    base = name or file_name(path)
    file_stats = ReadStats()
    examples: list[SpanExample] = []
    seen_ids: set[str] = set()
    for article_index, article in enumerate(dataset["data"]):
        title = article.get("title", "") if isinstance(article, dict) else ""
        paragraphs = article.get("paragraphs") if isinstance(article, dict) else None
        if not isinstance(paragraphs, list):
            file_stats.read += 1
            file_stats.skip("missing_field:paragraphs", f"{base}:data[{article_index}]")
            continue
        for paragraph_index, paragraph in enumerate(paragraphs):
            where_paragraph = f"{base}:data[{article_index}].paragraphs[{paragraph_index}]"
            qas = paragraph.get("qas") if isinstance(paragraph, dict) else None
            if not isinstance(qas, list):
                file_stats.read += 1
                file_stats.skip("missing_field:qas", where_paragraph)
                continue
            context = paragraph.get("context")
            for qa_index, qa in enumerate(qas):
                file_stats.read += 1
                where = f"{where_paragraph}.qas[{qa_index}]"
                try:
                    if not isinstance(context, str) or not context.strip():
                        raise BadRecordError("missing_field:context")
                    if not isinstance(qa, dict):
                        raise BadRecordError("not_an_object")
                    qid = qa.get("id")
                    if not isinstance(qid, str) or not qid:
                        raise BadRecordError("missing_field:id")
                    where = f"{base}:{qid}"
                    if qid in seen_ids:
                        raise BadRecordError("duplicate_id")
                    question = text_field(qa, "question")
                    is_impossible = qa.get("is_impossible", False)
                    if not isinstance(is_impossible, bool):
                        raise BadRecordError("bad_type:is_impossible")
                    answers: tuple[SpanAnswer, ...] = ()
                    if not is_impossible:
                        answers = _squad_answers(
                            qa.get("answers", []), context, relocate_answers, file_stats
                        )
                        if not answers:
                            raise BadRecordError("no_valid_answer")
                except BadRecordError as bad:
                    file_stats.skip(bad.reason, where)
                    continue
                seen_ids.add(qid)
                examples.append(
                    SpanExample(qid, str(title), question, context, answers, is_impossible)
                )
    file_stats.kept = len(examples)
    log_summary(path, file_stats)
    if stats is not None:
        stats.update(file_stats)
    return examples


# ----------------------------------------------------------------------------- registry
TaskKind = Literal["classification", "regression", "multiple_choice", "span"]


class LocalTask(NamedTuple):
    """How to read and score a local task.

    num_labels: classes (classification), 1 (regression), options per question
    (multiple_choice), 2 = start and end logits (span). metrics: names in
    albert_jax.tasks.metrics.METRIC_FNS, or the SQuAD evaluator's keys for span tasks.
    """

    reader: Callable[..., list]
    kind: TaskKind
    num_labels: int
    metrics: tuple[str, ...]


TASKS: dict[str, LocalTask] = {
    "sentiment_rt": LocalTask(read_sentiment_rt, "classification", 2, ("accuracy",)),
    "sentiment_rt_score": LocalTask(
        read_sentiment_rt_score, "regression", 1, ("pearson", "spearman")
    ),
    "nli_vitaminc": LocalTask(read_nli_vitaminc, "classification", 3, ("accuracy",)),
    "mc_cosmosqa": LocalTask(
        read_mc_cosmosqa, "multiple_choice", DEFAULT_NUM_CHOICES, ("accuracy",)
    ),
    "squad_shifts": LocalTask(read_squad, "span", 2, ("exact_match", "f1")),
}


def read_task(
    name: str,
    paths: PathLike | Sequence[PathLike],
    *,
    stats: ReadStats | None = None,
    limits: line_reading.LineLimits | None = None,
) -> list:
    """All records of a local task from one or more files, in file order: paths, globs or
    comma-separated lists of them, local or gs:// (`files.expand`: a ValueError names a pattern
    that matches no file); limits: the bounds of their lines (default `LINE_LIMITS`)."""
    if name not in TASKS:
        raise ValueError(f"task: unknown local task {name!r}; known: {sorted(TASKS)}")
    per_file = read_files(TASKS[name].reader, files.expand(paths), stats=stats, limits=limits)
    return [example for _, examples in per_file for example in examples]


def read_files(
    reader: Callable[..., list],
    paths: Sequence[PathLike],
    *,
    stats: ReadStats | None = None,
    limits: line_reading.LineLimits | None = None,
) -> list[tuple[str, list]]:
    """(path, records) of each file, in order, read by `reader` (a TASKS reader or read_squad)
    under its `file_names` name: the JSON Lines ids of files that share a name still differ."""
    names = file_names(paths)
    return [
        (os.fspath(path), reader(path, stats=stats, name=name, limits=limits))
        for path, name in zip(paths, names, strict=True)
    ]
