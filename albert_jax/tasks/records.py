"""The plain records every task reader produces (local files, TFDS GLUE / SQuAD / RACE), and
the ReadStats they count what they read, kept and skipped into.

The records are frozen dataclasses of Python values, independent of any tokenizer: featurizing
them is each task kind's job (`tasks/kinds.py`).
"""

from __future__ import annotations

import collections
import dataclasses


# ----------------------------------------------------------------------------- records
@dataclasses.dataclass(frozen=True)
class ClassificationExample:
    """One sentence (text_b None) or sentence pair; label: class index, or float (regression)."""

    id: str
    text_a: str
    text_b: str | None
    label: int | float


@dataclasses.dataclass(frozen=True)
class MultipleChoiceExample:
    """A question with options padded to num_choices; option_mask[i] is 1 for real options.

    options: [num_choices] str ("" for padding); option_mask: [num_choices] int in {0, 1};
    label: index of the correct option (always a real one).
    """

    id: str
    context: str
    question: str
    options: tuple[str, ...]
    option_mask: tuple[int, ...]
    label: int


@dataclasses.dataclass(frozen=True)
class SpanAnswer:
    """A gold answer: context[answer_start : answer_start + len(text)] == text."""

    text: str
    answer_start: int


@dataclasses.dataclass(frozen=True)
class SpanExample:
    """One SQuAD question. answers is empty exactly when is_impossible (SQuAD v2.0)."""

    id: str
    title: str
    question: str
    context: str
    answers: tuple[SpanAnswer, ...]
    is_impossible: bool


# ----------------------------------------------------------------------------- bookkeeping
@dataclasses.dataclass
class ReadStats:
    """What a reader saw: records read, kept, and skipped by reason.

    read / kept / skipped count records (lines, or SQuAD questions). `adjusted` counts events
    inside records that were kept or skipped: SQuAD answers whose answer_start was moved to
    where their text really is, or answers dropped. `first_skipped` maps each reason to where it
    first happened ("file:line" or "file:question-id"), to find the bad input quickly.
    """

    read: int = 0
    kept: int = 0
    skipped: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    adjusted: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    first_skipped: dict[str, str] = dataclasses.field(default_factory=dict)

    @property
    def skipped_total(self) -> int:
        return sum(self.skipped.values())

    def skip(self, reason: str, where: str) -> None:
        self.skipped[reason] += 1
        self.first_skipped.setdefault(reason, where)

    def update(self, other: ReadStats) -> None:
        """Adds another file's counts to these."""
        self.read += other.read
        self.kept += other.kept
        self.skipped.update(other.skipped)
        self.adjusted.update(other.adjusted)
        for reason, where in other.first_skipped.items():
            self.first_skipped.setdefault(reason, where)
