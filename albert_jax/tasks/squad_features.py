"""SQuAD featurization: sentencepiece tokens with character offsets, doc-stride windows, labels.

Offsets. ALBERT's tokenizer normalizes text (lower case, accents stripped, NFKD) before
sentencepiece, so pieces do not spell the original context. To return answers as exact
substrings of the original context, every context piece carries the character span
`[start, end)` of the original text it came from:

  1. the context is split at whitespace into words (pieces never cross whitespace: sentencepiece
     splits there too, so encoding word by word yields the same pieces as the whole text);
  2. each word is normalized character by character, remembering which original character each
     normalized character came from;
  3. the word's pieces (their `▁` dropped) are matched against the normalized word left to right;
     a piece that does not spell its text (`<unk>`, or a character sentencepiece's own
     normalizer rewrote) spans up to where the next piece matches. The first piece of a word
     starts at the word start and the last ends at the word end, so the pieces of a word tile it.

A predicted span of pieces `[i, j]` then reads `context[start_i : end_j]`, exactly as written.

Windows. As the official `squad_utils.py` (BERT): `[CLS] question [SEP] context window [SEP]`,
the question cut to `max_query_length` tokens, windows of the context every `doc_stride` tokens.
A token seen in several windows is scored only in the window where it has the most context
on both sides (`token_is_max_context`). `p_mask` is 1 where no answer may start or end (question,
[SEP], padding) and 0 on the context and [CLS] (the target of unanswerable questions, and of
windows that do not contain the answer).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from typing import Any

import numpy as np

from albert_jax.tasks.batching import Features, FeatureStats, pad_ids
from albert_jax.tasks.records import SpanExample

__all__ = [
    "SquadFeatures",
    "align_pieces",
    "tokenize_context",
    "doc_windows",
    "squad_features",
]

_WORD = re.compile(r"\S+")
_MARKER = "▁"  # sentencepiece's word-start marker (U+2581)


@dataclasses.dataclass
class SquadFeatures(Features):
    """SQuAD windows: model inputs and labels in `arrays`, and what decoding needs.

    arrays: input_ids, segment_ids, input_mask, p_mask [F,S] int32; start_positions,
      end_positions, is_impossible [F] int32 (positions index the window; 0 = [CLS]).
    examples: the SpanExamples; example_index [F]: which one each window belongs to.
    token_spans [F,S,2] int32: original-context character span [start, end) of each context
      token, -1 for [CLS], question, [SEP] and padding.
    token_is_max_context [F,S] bool: this window is the best one to predict the token from.
    """

    examples: list[SpanExample] = dataclasses.field(default_factory=list)
    example_index: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, np.int32))
    token_spans: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros((0, 0, 2)))
    token_is_max_context: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros((0, 0)))


# ----------------------------------------------------------------------------------- offsets
def _normalized_chars(word: str, tokenizer: Any) -> tuple[str, list[int]]:
    """The tokenizer's normalization of `word`, and for each of its characters the index of the
    original character it came from."""
    chars: list[str] = []
    owner: list[int] = []
    for index, ch in enumerate(word):
        normalized = tokenizer.normalize(ch) if not ch.isspace() else ""
        chars.append(normalized)
        owner.extend([index] * len(normalized))
    return "".join(chars), owner


def align_pieces(word: str, pieces: Sequence[str], tokenizer: Any) -> list[tuple[int, int]]:
    """Character spans [start, end) in `word` of each of its sentencepiece `pieces`.

    The spans are in order, non-decreasing, start at 0 and end at len(word); a piece that is
    only the word-start marker gets an empty span.
    """
    if not pieces:
        return []
    norm, owner = _normalized_chars(word, tokenizer)
    texts = [p[1:] if p.startswith(_MARKER) else p for p in pieces]
    bounds: list[tuple[int, int]] = []  # in normalized characters
    pos = 0
    for k, (piece, text) in enumerate(zip(pieces, texts, strict=True)):
        if piece.startswith(_MARKER):
            # The marker stands for whitespace that normalization may have put inside the word.
            while pos < len(norm) and norm[pos] == " ":
                pos += 1
        if not text:
            bounds.append((pos, pos))
            continue
        if norm.startswith(text, pos):
            end = pos + len(text)
        else:
            # <unk> or a character rewritten by sentencepiece's normalizer: this piece covers
            # what lies before the next piece's text (or the rest of the word).
            end = len(norm)
            following = next((t for t in texts[k + 1 :] if t), "")
            if following:
                found = norm.find(following, pos + 1)
                if found != -1:
                    end = found
        bounds.append((pos, end))
        pos = end

    # Original character where each piece starts.
    starts = [owner[s] if s < len(owner) else len(word) for s, _ in bounds]
    filled = [e > s for s, e in bounds]
    # The pieces of a word tile it: a piece ends where the next one starts, so characters that
    # normalization dropped (an accent, a zero-width character) stay with the piece before
    # them; the first piece starts at 0 and the last ends at the end of the word.
    spans: list[tuple[int, int]] = [(0, 0)] * len(bounds)
    end = len(word)
    for k in reversed(range(len(bounds))):
        if filled[k]:
            start = min(starts[k], end) if any(filled[:k]) else 0
            spans[k] = (start, end)
            end = start
        else:
            spans[k] = (end, end)
    return spans


def tokenize_context(context: str, tokenizer: Any) -> tuple[list[int], list[tuple[int, int]]]:
    """context -> (piece ids [T], character spans [T] of each piece in `context`)."""
    words = [(m.start(), m.end()) for m in _WORD.finditer(context)]
    word_ids = tokenizer.encode_batch([context[s:e] for s, e in words]) if words else []
    ids: list[int] = []
    spans: list[tuple[int, int]] = []
    for (start, end), wids in zip(words, word_ids, strict=True):
        pieces = [tokenizer.id_to_piece(i) for i in wids]
        for i, (s, e) in zip(
            wids, align_pieces(context[start:end], pieces, tokenizer), strict=True
        ):
            ids.append(i)
            spans.append((start + s, start + e))
    return ids, spans


# ----------------------------------------------------------------------------------- windows
def doc_windows(num_tokens: int, max_tokens: int, doc_stride: int) -> list[tuple[int, int]]:
    """(start, length) of the context windows: every doc_stride tokens until the end is covered."""
    if max_tokens < 1:
        raise ValueError(f"no room for context tokens (max_tokens={max_tokens})")
    if doc_stride < 1:
        raise ValueError(f"doc_stride must be >= 1, got {doc_stride}")
    windows = []
    start = 0
    while True:
        length = min(num_tokens - start, max_tokens)
        windows.append((start, length))
        if start + length >= num_tokens:
            return windows
        start += min(length, doc_stride)


def _max_context(windows: list[tuple[int, int]], index: int, position: int) -> bool:
    """Whether window `index` gives token `position` the most context (official score:
    min(left, right) + 0.01 * window length; first best window wins)."""
    best_score, best = None, None
    for k, (start, length) in enumerate(windows):
        if not start <= position < start + length:
            continue
        left, right = position - start, start + length - 1 - position
        score = min(left, right) + 0.01 * length
        if best_score is None or score > best_score:
            best_score, best = score, k
    return best == index


def _answer_tokens(
    spans: list[tuple[int, int]], char_start: int, char_end: int
) -> tuple[int, int] | None:
    """First and last context token overlapping [char_start, char_end), or None."""
    covering = [t for t, (s, e) in enumerate(spans) if e > char_start and s < char_end and e > s]
    if not covering:
        return None
    return covering[0], covering[-1]


def squad_features(
    examples: Sequence[SpanExample],
    tokenizer: Any,
    max_seq_length: int = 384,
    doc_stride: int = 128,
    max_query_length: int = 64,
) -> SquadFeatures:
    """SpanExamples -> SquadFeatures (one row per context window; see the module docstring).

    The label of a window is the first gold answer's token span when the window contains it
    whole, else [CLS] (0, 0) with `is_impossible = 1`, as in the official code.
    """
    if max_query_length < 1 or max_seq_length < max_query_length + 4:
        raise ValueError(
            f"max_seq_length ({max_seq_length}) must leave room for max_query_length "
            f"({max_query_length}) + 3 special tokens + 1 context token"
        )
    stats = FeatureStats(examples=len(examples))
    cls, sep, pad = tokenizer.cls_id, tokenizer.sep_id, tokenizer.pad_id
    contexts: dict[str, tuple[list[int], list[tuple[int, int]]]] = {}
    for e in examples:
        if e.context not in contexts:
            contexts[e.context] = tokenize_context(e.context, tokenizer)
    queries = tokenizer.encode_batch([e.question for e in examples])

    rows: dict[str, list] = {k: [] for k in ("input_ids", "segment_ids", "p_mask", "spans")}
    labels: dict[str, list] = {
        k: [] for k in ("start", "end", "impossible", "example", "max", "length")
    }
    for index, (example, query) in enumerate(zip(examples, queries, strict=True)):
        if len(query) > max_query_length:
            query = query[:max_query_length]
            stats.truncated["question"] += 1
            stats.truncated_examples += 1
        doc_ids, doc_spans = contexts[example.context]
        answer = None
        if example.answers and not example.is_impossible:
            first = example.answers[0]
            start_char = first.answer_start
            answer = _answer_tokens(doc_spans, start_char, start_char + len(first.text))
            if answer is None:
                stats.truncated["answer_not_in_tokens"] += 1
        windows = doc_windows(len(doc_ids), max_seq_length - len(query) - 3, doc_stride)
        if len(windows) > 1:
            stats.split_into_windows += 1
        offset = len(query) + 2  # [CLS] query [SEP]
        for w, (start, length) in enumerate(windows):
            ids = [cls, *query, sep, *doc_ids[start : start + length], sep]
            segments = [0] * offset + [1] * (length + 1)
            p_mask = [0] + [1] * (len(query) + 1) + [0] * length + [1]
            spans = [(-1, -1)] * offset + doc_spans[start : start + length] + [(-1, -1)]
            is_max = [False] * offset + [_max_context(windows, w, start + t) for t in range(length)]
            if answer is not None and start <= answer[0] and answer[1] < start + length:
                labels["start"].append(answer[0] - start + offset)
                labels["end"].append(answer[1] - start + offset)
                labels["impossible"].append(0)
            else:
                labels["start"].append(0)
                labels["end"].append(0)
                labels["impossible"].append(1)
            rows["input_ids"].append(pad_ids(ids, max_seq_length, pad))
            rows["segment_ids"].append(pad_ids(segments, max_seq_length))
            rows["p_mask"].append(pad_ids(p_mask, max_seq_length, 1))
            rows["spans"].append(spans + [(-1, -1)] * (max_seq_length - len(spans)))
            labels["example"].append(index)
            labels["length"].append(len(ids))
            labels["max"].append(is_max + [False] * (max_seq_length - len(is_max)))

    input_ids = np.array(rows["input_ids"], np.int32).reshape(-1, max_seq_length)
    lengths = np.array(labels["length"], np.int32)
    arrays = {
        "input_ids": input_ids,
        "segment_ids": np.array(rows["segment_ids"], np.int32).reshape(-1, max_seq_length),
        "input_mask": (np.arange(max_seq_length)[None] < lengths[:, None]).astype(np.int32),
        "p_mask": np.array(rows["p_mask"], np.int32).reshape(-1, max_seq_length),
        "start_positions": np.array(labels["start"], np.int32),
        "end_positions": np.array(labels["end"], np.int32),
        "is_impossible": np.array(labels["impossible"], np.int32),
    }
    stats.features = len(input_ids)
    return SquadFeatures(
        arrays,
        stats,
        examples=list(examples),
        example_index=np.array(labels["example"], np.int32),
        token_spans=np.array(rows["spans"], np.int32).reshape(-1, max_seq_length, 2),
        token_is_max_context=np.array(labels["max"], bool).reshape(-1, max_seq_length),
    )
