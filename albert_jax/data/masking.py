"""Whole-word n-gram masking (ALBERT `create_masked_lm_predictions`), vectorized over a batch.

The algorithm is the reference one, token for token:

1. Candidates are the non-special tokens; consecutive pieces form one word unless a piece is a
   word start (`Tokenizer.word_start`); the first candidate always starts a word. [CLS]/[SEP]
   are skipped without closing the current word (as in the reference loop).
2. `num_to_predict = min(P, max(1, round(len(tokens) * masked_lm_prob)))` (Python rounding,
   half to even; `len` counts [CLS]/[SEP], not padding).
3. Span starts are visited in a uniformly random order (the reference shuffles its n-gram list);
   for each start, n ∈ {1..ngram} is drawn with p(n) ∝ 1/n (6/11, 3/11, 2/11 for ngram=3); near
   the end of the sequence an n-gram covers only the words left.
4. While the span would exceed the budget, shorter n are tried (n-1, ..., 1); if even one word
   is too long the start is skipped; a span that overlaps an earlier one is skipped.
5. Stop once the budget is reached or all starts were visited.
6. Each selected token independently: 80% `[MASK]`, 10% kept, 10% a uniformly random id of the
   whole vocabulary (special pieces included).

Randomness comes only from the `numpy.random.Generator` passed in. Vectorization: step `t`
handles the t-th visited start of every row still under budget at once; the random visiting
order is drawn lazily by a batched Fisher-Yates shuffle, so no full permutation is sorted.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class MaskingSettings:
    """What a run's masking is given, as one value (`DataConfig.masking`): at most
    `max_predictions` masked tokens a sequence, `masked_lm_prob` of its tokens, whole-word
    n-grams up to `ngram`."""

    max_predictions: int = 20
    masked_lm_prob: float = 0.15
    ngram: int = 3


def ngram_probabilities(ngram: int = 3, favor_shorter: bool = True) -> np.ndarray:
    """p(n) for n = 1..ngram: ∝ 1/n (reversed when favor_shorter=False, as the reference)."""
    p = 1.0 / np.arange(1, ngram + 1)
    p /= p.sum()
    return p if favor_shorter else p[::-1].copy()


def num_to_predict(lengths: np.ndarray, max_predictions: int, masked_lm_prob: float) -> np.ndarray:
    """`min(P, max(1, round(len * prob)))` per row; np.rint rounds half to even like `round`."""
    budget = np.rint(np.asarray(lengths, np.float64) * masked_lm_prob).astype(np.int64)
    return np.minimum(max_predictions, np.maximum(1, budget))


@dataclass
class MaskedBatch:
    """Result of `mask_whole_word_ngrams`.

    input_ids: [B,S] ids after replacement; positions/ids: [B,P] int32 (sorted positions, padded
    with 0); weights: [B,P] float32 (1 real, 0 pad); sampled_ngrams / accepted_ngrams: [ngram]
    counts of the n drawn at every visited start and of the word length of accepted spans.
    """

    input_ids: np.ndarray
    positions: np.ndarray
    ids: np.ndarray
    weights: np.ndarray
    sampled_ngrams: np.ndarray
    accepted_ngrams: np.ndarray


def mask_whole_word_ngrams(
    input_ids: np.ndarray,
    lengths: np.ndarray,
    word_start: np.ndarray,
    rng: np.random.Generator,
    *,
    max_predictions: int,
    masked_lm_prob: float = 0.15,
    mask_id: int = 4,
    special_ids: tuple[int, ...] = (2, 3),
    ngram: int = 3,
    favor_shorter_ngram: bool = True,
) -> MaskedBatch:
    """Masks a padded batch `input_ids [B,S]` whose rows have `lengths [B]` real tokens.

    `word_start [V]` (bool) is the whole-word table of the vocabulary; random replacements are
    drawn from `range(V)`.
    """
    ids = np.asarray(input_ids)
    B, S = ids.shape
    P = max_predictions
    V = len(word_start)
    lengths = np.asarray(lengths, np.int64)
    pos = np.arange(S)
    candidate = pos[None, :] < lengths[:, None]
    for s in special_ids:
        candidate &= ids != s

    out_ids = ids.copy()
    positions = np.zeros((B, P), np.int32)
    labels = np.zeros((B, P), np.int32)
    weights = np.zeros((B, P), np.float32)
    sampled = np.zeros(ngram, np.int64)
    accepted = np.zeros(ngram, np.int64)
    if masked_lm_prob == 0 or B == 0:
        return MaskedBatch(out_ids, positions, labels, weights, sampled, accepted)

    # --- words (numbered from 1 in each row; 0 = before the first word) ------------------
    starts = word_start[ids] & candidate
    has_candidate = candidate.any(axis=1)
    first = np.argmax(candidate, axis=1)
    starts[np.flatnonzero(has_candidate), first[has_candidate]] = True
    word = np.cumsum(starts, axis=1, dtype=np.int32)  # [B,S] word number of each piece
    num_words = word[:, -1].astype(np.int64)  # [B]
    # cum_len[b*stride + w] = candidate pieces in words 1..w-1 of row b (w = 1..nw+1). Flat
    # arrays, one row = `stride` slots; pieces per word by one bincount (a non-candidate goes
    # to a spare last bin).
    stride = S + 2
    row_off = np.arange(B, dtype=np.int64) * stride
    key = np.where(candidate, row_off[:, None] + word, B * stride)
    word_len = np.bincount(key.ravel(), minlength=B * stride + 1)[:-1].reshape(B, stride)
    cum_len = np.zeros((B, stride), np.int64)
    np.cumsum(word_len[:, :-1], axis=1, out=cum_len[:, 1:])
    cum_len = cum_len.ravel()

    budget = num_to_predict(lengths, P, masked_lm_prob)
    cdf = np.cumsum(ngram_probabilities(ngram, favor_shorter_ngram))[:-1]

    # --- greedy span selection ---------------------------------------------------------------
    order = np.tile(np.arange(stride, dtype=np.int64), B)  # lazily shuffled visiting order
    covered = np.zeros(B * stride + ngram, bool)  # selected words (+ slack for w+j lookups)
    # Per active row (compacted as rows finish): offset, number of words, budget left.
    rows = np.flatnonzero((num_words > 0) & (budget > 0))
    off, nw, room = row_off[rows], num_words[rows], budget[rows].copy()
    drawn_log, accepted_log = [], []
    t = 1
    while rows.size:
        # Fisher-Yates step t: the t-th start, uniform among the words not visited yet.
        u = rng.random((2, rows.size))
        swap = off + t + (u[0] * (nw - t + 1)).astype(np.int64)
        w = order[swap]
        order[swap] = order[off + t]
        order[off + t] = w
        n_drawn = 1 + np.searchsorted(cdf, u[1], side="right")
        drawn_log.append(n_drawn)

        base = cum_len[off + w]
        n_eff = np.zeros(rows.size, np.int64)
        span_len = np.zeros(rows.size, np.int64)
        for n in range(1, ngram + 1):  # largest n' <= n_drawn whose span fits the budget
            length = cum_len[off + np.minimum(w + n, nw + 1)] - base
            ok = (n <= n_drawn) & (length <= room)
            n_eff[ok] = n
            span_len[ok] = length[ok]
        end = np.minimum(w + n_eff, nw + 1)  # words [w, end) are the span
        overlap = covered[off + w] & (n_eff > 0)
        for j in range(1, ngram):
            overlap |= (w + j < end) & covered[off + w + j]
        take = (n_eff > 0) & ~overlap
        if take.any():
            first_word = off[take] + w[take]
            span_words = end[take] - w[take]
            for j in range(ngram):
                covered[first_word[span_words > j] + j] = True
            room[take] -= span_len[take]
            accepted_log.append(span_words)
        keep = (room > 0) & (t < nw)
        t += 1
        if not keep.all():
            rows, off, nw, room = rows[keep], off[keep], nw[keep], room[keep]
    if drawn_log:
        sampled += np.bincount(np.concatenate(drawn_log) - 1, minlength=ngram)
    if accepted_log:
        accepted += np.bincount(np.concatenate(accepted_log) - 1, minlength=ngram)

    # --- replacement -------------------------------------------------------------------------
    selected = candidate & covered[row_off[:, None] + word]
    b_idx, s_idx = np.nonzero(selected)  # row-major: positions come out sorted per row
    original = ids[b_idx, s_idx]
    u = rng.random((2, b_idx.size))
    random_ids = rng.integers(0, V, size=b_idx.size)
    replaced = np.where(u[0] < 0.8, mask_id, np.where(u[1] < 0.5, original, random_ids))
    out_ids[b_idx, s_idx] = replaced
    counts = selected.sum(axis=1)
    row_start = np.cumsum(counts) - counts
    rank = np.arange(b_idx.size) - row_start[b_idx]
    positions[b_idx, rank] = s_idx
    labels[b_idx, rank] = original
    weights[b_idx, rank] = 1.0
    return MaskedBatch(out_ids, positions, labels, weights, sampled, accepted)
