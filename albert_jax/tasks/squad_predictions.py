"""From per-window SQuAD outputs to answer texts: n-best search (v1.1) and the XLNet-style beam
with a null score (v2.0).

A candidate span [i, j] of one window is valid when both ends are context tokens, the window is
the token's max-context window for i, j >= i and j - i + 1 <= max_answer_length; its text is
`context[start_char(i) : end_char(j)]`, an exact substring of the original context (see
`squad_features`). Candidates of all windows of a question compete; texts are de-duplicated.

  v1.1 score = start_logit + end_logit (top `n_best_size` starts x ends of each window).
  v2.0 score = start_log_prob + end_log_prob over the model's start_n_top x end_n_top beam;
       the null score of a question is the smallest answerability logit over its windows
       (official `score_null = min(cls_logits)`), reported as na_prob = sigmoid(null score);
       the question is answered "" when na_prob > null_threshold.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

import numpy as np

from albert_jax.tasks.squad_features import SquadFeatures

__all__ = ["Candidate", "SquadPredictions", "predict_v1", "predict_v2"]


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One answer candidate: its text, score and the character span in the context."""

    text: str
    score: float
    start_char: int
    end_char: int


@dataclasses.dataclass
class SquadPredictions:
    """Per question: `answers` {qid: text} as the official evaluator reads them (v2: "" where
    the question is judged unanswerable), `best_non_null` {qid: best span text}, `nbest`
    {qid: [Candidate]}; v2 only: `na_probs` {qid: P(no answer)}."""

    answers: dict[str, str]
    best_non_null: dict[str, str]
    nbest: dict[str, list[Candidate]]
    na_probs: dict[str, float] | None = None

    def nbest_json(self) -> dict[str, list[dict]]:
        """n-best lists with softmax probabilities over each question's candidates."""
        out: dict[str, list[dict]] = {}
        for qid, candidates in self.nbest.items():
            scores = np.array([c.score for c in candidates], np.float64)
            probs = np.exp(scores - scores.max()) if len(scores) else scores
            probs = probs / probs.sum() if len(scores) else probs
            out[qid] = [
                {"text": c.text, "score": c.score, "probability": float(p)}
                for c, p in zip(candidates, probs, strict=True)
            ]
        return out


def _sigmoid(x: float) -> float:
    """1 / (1 + e^-x) without overflow for large |x|."""
    if x >= 0:
        return 1.0 / (1.0 + math.exp(-x))
    z = math.exp(x)
    return z / (1.0 + z)


def _check_rows(features: SquadFeatures, **arrays: np.ndarray) -> None:
    for name, array in arrays.items():
        if len(array) != len(features):
            raise ValueError(
                f"{name} has {len(array)} rows but there are {len(features)} SQuAD windows"
            )


def _candidate(
    features: SquadFeatures, row: int, start: int, end: int, max_answer_length: int
) -> tuple[int, int] | None:
    """(start_char, end_char) of the span [start, end] of window `row`, or None if invalid."""
    spans = features.token_spans[row]
    seq_len = spans.shape[0]
    if not (0 <= start < seq_len and 0 <= end < seq_len):
        return None
    if spans[start, 0] < 0 or spans[end, 0] < 0:
        return None  # [CLS], question, [SEP] or padding
    if not features.token_is_max_context[row, start]:
        return None
    if end < start or end - start + 1 > max_answer_length:
        return None
    start_char, end_char = int(spans[start, 0]), int(spans[end, 1])
    return (start_char, end_char) if end_char > start_char else None


def _rows_by_example(features: SquadFeatures) -> dict[int, list[int]]:
    rows: dict[int, list[int]] = {}
    for row, example in enumerate(features.example_index):
        rows.setdefault(int(example), []).append(row)
    return rows


def _best_texts(
    features: SquadFeatures,
    scored_spans: Mapping[int, list[tuple[float, int, int]]],
    n_best_size: int,
) -> tuple[dict[str, str], dict[str, list[Candidate]]]:
    """Ranks each question's (score, start_char, end_char) candidates into distinct texts."""
    best: dict[str, str] = {}
    nbest: dict[str, list[Candidate]] = {}
    for index, example in enumerate(features.examples):
        seen: set[str] = set()
        kept: list[Candidate] = []
        for score, start_char, end_char in sorted(scored_spans.get(index, []), reverse=True):
            text = example.context[start_char:end_char]
            if text in seen:
                continue
            seen.add(text)
            kept.append(Candidate(text, float(score), start_char, end_char))
            if len(kept) == n_best_size:
                break
        best[example.id] = kept[0].text if kept else ""
        nbest[example.id] = kept
    return best, nbest


def predict_v1(
    features: SquadFeatures,
    start_logits: np.ndarray,
    end_logits: np.ndarray,
    n_best_size: int = 20,
    max_answer_length: int = 30,
) -> SquadPredictions:
    """SQuAD v1.1 answers from start_logits, end_logits [F,S] (one row per window)."""
    _check_rows(features, start_logits=start_logits, end_logits=end_logits)
    spans: dict[int, list[tuple[float, int, int]]] = {}
    for example, rows in _rows_by_example(features).items():
        for row in rows:
            starts = np.argsort(-start_logits[row], kind="stable")[:n_best_size]
            ends = np.argsort(-end_logits[row], kind="stable")[:n_best_size]
            for i in starts:
                for j in ends:
                    chars = _candidate(features, row, int(i), int(j), max_answer_length)
                    if chars is not None:
                        score = float(start_logits[row, i] + end_logits[row, j])
                        spans.setdefault(example, []).append((score, *chars))
    best, nbest = _best_texts(features, spans, n_best_size)
    return SquadPredictions(answers=dict(best), best_non_null=best, nbest=nbest)


def predict_v2(
    features: SquadFeatures,
    outputs: Mapping[str, np.ndarray],
    n_best_size: int = 20,
    max_answer_length: int = 30,
    null_threshold: float = 0.5,
) -> SquadPredictions:
    """SQuAD v2.0 answers from the inference outputs of `AlbertForQuestionAnsweringV2`.

    outputs: start_top_log_probs, start_top_index [F,K]; end_top_log_probs, end_top_index
    [F,K*Ke] (entry i*Ke+j: j-th end of the i-th start); cls_logits [F].
    """
    start_lp, start_ix = outputs["start_top_log_probs"], outputs["start_top_index"]
    end_lp, end_ix = outputs["end_top_log_probs"], outputs["end_top_index"]
    cls_logits = outputs["cls_logits"]
    _check_rows(features, start_top_index=start_ix, end_top_index=end_ix, cls_logits=cls_logits)
    k = start_ix.shape[1]
    if end_ix.shape[1] % k:
        raise ValueError(f"end_top_index width {end_ix.shape[1]} is not a multiple of K={k}")
    k_end = end_ix.shape[1] // k
    spans: dict[int, list[tuple[float, int, int]]] = {}
    null_scores: dict[int, float] = {}
    for example, rows in _rows_by_example(features).items():
        null_scores[example] = min(float(cls_logits[row]) for row in rows)
        for row in rows:
            for i in range(k):
                for j in range(k_end):
                    start, end = int(start_ix[row, i]), int(end_ix[row, i * k_end + j])
                    chars = _candidate(features, row, start, end, max_answer_length)
                    if chars is not None:
                        score = float(start_lp[row, i] + end_lp[row, i * k_end + j])
                        spans.setdefault(example, []).append((score, *chars))
    best, nbest = _best_texts(features, spans, n_best_size)
    na_probs: dict[str, float] = {}
    answers: dict[str, str] = {}
    for index, example in enumerate(features.examples):
        na_prob = _sigmoid(null_scores.get(index, 0.0))
        na_probs[example.id] = na_prob
        answers[example.id] = "" if na_prob > null_threshold else best[example.id]
    return SquadPredictions(answers=answers, best_non_null=best, nbest=nbest, na_probs=na_probs)
