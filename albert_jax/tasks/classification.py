"""Sentence and sentence-pair featurization for classification / regression (GLUE-style).

  single:  [CLS] a [SEP]              segment ids 0 ... 0
  pair:    [CLS] a [SEP] b [SEP]      segment ids 0 for [CLS] a [SEP], 1 for b [SEP]

A pair longer than `max_seq_length` is cut as the official `_truncate_seq_pair`: one token at a
time from the end of the currently longer side, so the shorter text keeps as much as possible.
Truncated examples are counted by the side that lost tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from albert_jax.tasks.batching import Features, FeatureStats, pad_ids
from albert_jax.tasks.records import ClassificationExample

__all__ = ["truncate_pair", "classification_features"]


def truncate_pair(a: list[int], b: list[int], max_total: int) -> tuple[list[int], list[int]]:
    """Cuts the longer of a / b (ties: b) from the end until len(a) + len(b) <= max_total."""
    if max_total < 0:
        raise ValueError(f"max_total must be >= 0, got {max_total}")
    la, lb = len(a), len(b)
    while la + lb > max_total:  # the official loop, on lengths
        if la > lb:
            la -= 1
        else:
            lb -= 1
    return a[:la], b[:lb]


def classification_features(
    examples: Sequence[ClassificationExample],
    tokenizer: Any,
    max_seq_length: int,
    *,
    regression: bool = False,
) -> Features:
    """Examples -> Features with arrays `input_ids, segment_ids, input_mask` [N,S] int32 and
    `label` [N] (int32, or float32 for regression)."""
    if max_seq_length < 3:
        raise ValueError(f"max_seq_length must be >= 3, got {max_seq_length}")
    stats = FeatureStats(examples=len(examples))
    texts_a = tokenizer.encode_batch([e.text_a for e in examples])
    pairs = [i for i, e in enumerate(examples) if e.text_b is not None]
    texts_b: dict[int, list[int]] = dict(
        zip(pairs, tokenizer.encode_batch([examples[i].text_b for i in pairs]), strict=True)
    )
    n = len(examples)
    input_ids = np.zeros((n, max_seq_length), np.int32)
    segment_ids = np.zeros((n, max_seq_length), np.int32)
    input_mask = np.zeros((n, max_seq_length), np.int32)
    cls, sep = tokenizer.cls_id, tokenizer.sep_id
    for i, a in enumerate(texts_a):
        b = texts_b.get(i)
        if b is None:
            a_cut, b_cut = a[: max_seq_length - 2], None
        else:
            a_cut, b_cut = truncate_pair(a, b, max_seq_length - 3)
        cut = [name for name, x, y in (("text_a", a, a_cut), ("text_b", b, b_cut)) if x != y]
        if cut:
            stats.truncated_examples += 1
            stats.truncated.update(cut)
        ids = [cls, *a_cut, sep]
        segments = [0] * len(ids)
        if b_cut is not None:
            ids += [*b_cut, sep]
            segments += [1] * (len(b_cut) + 1)
        input_ids[i] = pad_ids(ids, max_seq_length, tokenizer.pad_id)
        segment_ids[i] = pad_ids(segments, max_seq_length)
        input_mask[i, : len(ids)] = 1
    label_dtype = np.float32 if regression else np.int32
    arrays = {
        "input_ids": input_ids,
        "segment_ids": segment_ids,
        "input_mask": input_mask,
        "label": np.array([e.label for e in examples], label_dtype).reshape(n),
    }
    stats.features = n
    return Features(arrays, stats)
