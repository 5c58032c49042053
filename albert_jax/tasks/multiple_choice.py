"""RACE-style multiple-choice featurization (official `race_utils.py`).

Each option becomes its own sequence

  [CLS] passage [SEP] question+option [SEP]     segment ids 0 ... 0 | 1 ... 1

where question+option is the question with its blank "_" filled by the option when it has one
(RACE cloze questions), else "question option". The question+option side keeps its *last*
`max_qa_length` tokens (official: the option, at the end, matters most); the passage is cut from
its end to fit what is left. Truncated examples are counted by side. Padding options (mask 0)
are featurized like real ones with an empty option, so every row holds valid inputs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from albert_jax.tasks.batching import Features, FeatureStats, pad_ids
from albert_jax.tasks.records import MultipleChoiceExample

__all__ = ["question_with_option", "multiple_choice_features"]


def question_with_option(question: str, option: str) -> str:
    """Fills a RACE cloze blank ("_") with the option, else appends the option."""
    if "_" in question:
        return question.replace("_", option)
    return f"{question} {option}"


def multiple_choice_features(
    examples: Sequence[MultipleChoiceExample],
    tokenizer: Any,
    max_seq_length: int,
    max_qa_length: int = 128,
) -> Features:
    """Examples (options padded to C) -> Features with `input_ids, segment_ids, input_mask`
    [N,C,S] int32, `option_mask` [N,C] int32 and `label` [N] int32."""
    if max_seq_length < 4:
        raise ValueError(f"max_seq_length must be >= 4, got {max_seq_length}")
    if not 0 < max_qa_length <= max_seq_length - 3:
        raise ValueError(
            f"max_qa_length must be in [1, max_seq_length - 3 = {max_seq_length - 3}], "
            f"got {max_qa_length}"
        )
    choices = {len(e.options) for e in examples}
    if len(choices) > 1:
        raise ValueError(f"examples must have the same number of (padded) options, got {choices}")
    num_choices = choices.pop() if choices else 0
    n = len(examples)
    stats = FeatureStats(examples=n)
    contexts = tokenizer.encode_batch([e.context for e in examples])
    qa_texts = [question_with_option(e.question, o) for e in examples for o in e.options]
    qas = tokenizer.encode_batch(qa_texts)
    shape = (n, num_choices, max_seq_length)
    input_ids = np.zeros(shape, np.int32)
    segment_ids = np.zeros(shape, np.int32)
    input_mask = np.zeros(shape, np.int32)
    cls, sep = tokenizer.cls_id, tokenizer.sep_id
    for i, context in enumerate(contexts):
        cut: set[str] = set()
        for c in range(num_choices):
            qa = qas[i * num_choices + c]
            if len(qa) > max_qa_length:
                qa = qa[-max_qa_length:]
                cut.add("question_option")
            room = max_seq_length - len(qa) - 3
            ctx = context[:room]
            if len(ctx) < len(context):
                cut.add("context")
            ids = [cls, *ctx, sep, *qa, sep]
            segments = [0] * (len(ctx) + 2) + [1] * (len(qa) + 1)
            input_ids[i, c] = pad_ids(ids, max_seq_length, tokenizer.pad_id)
            segment_ids[i, c] = pad_ids(segments, max_seq_length)
            input_mask[i, c, : len(ids)] = 1
        if cut:
            stats.truncated_examples += 1
            stats.truncated.update(cut)
    stats.features = n
    arrays = {
        "input_ids": input_ids,
        "segment_ids": segment_ids,
        "input_mask": input_mask,
        # reshape(n, C), not (n, -1): no examples (an evaluation-only run's training set)
        # gives an empty [0, 0] mask instead of an error.
        "option_mask": np.array([e.option_mask for e in examples], np.int32).reshape(
            n, num_choices
        ),
        "label": np.array([e.label for e in examples], np.int32).reshape(n),
    }
    return Features(arrays, stats)
