"""Pretraining batches: instance rows (`instances.py`) of one or more corpora -> one
fixed-shape batch, `[CLS] A [SEP] B [SEP]` + segment ids + padding, then whole-word n-gram
masking (`masking.mask_whole_word_ngrams`) drawn from the generator passed in."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from albert_jax.data import masking
from albert_jax.data.corpus import TokenizedCorpus
from albert_jax.data.instances import KIND, LABEL


def assemble(
    corpora: Sequence[TokenizedCorpus],
    source_index: np.ndarray,
    rows: np.ndarray,
    seq_len: int,
    *,
    cls_id: int = 2,
    sep_id: int = 3,
    pad_id: int = 0,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Instance rows [B,6] (of `corpora[source_index[b]]`) -> input_ids, segment_ids [B,S]
    int32 and lengths [B]. Layout `[CLS] A [SEP] B [SEP]` (or `[CLS] A [SEP]` if B is empty)."""
    # A plain loop of slice copies: measured faster than a vectorized [B,S] gather here.
    B = len(rows)
    input_ids = np.full((B, seq_len), pad_id, np.int32)
    segment_ids = np.zeros((B, seq_len), np.int32)
    lengths = np.zeros(B, np.int64)
    token_arrays = [c.tokens for c in corpora]
    for b, (k, (a_lo, a_hi, b_lo, b_hi)) in enumerate(
        zip(np.asarray(source_index).tolist(), np.asarray(rows)[:, :4].tolist(), strict=True)
    ):
        tokens = token_arrays[k]
        la, lb = a_hi - a_lo, b_hi - b_lo
        n = 2 + la + (lb + 1 if lb else 0)
        if n > seq_len:
            raise ValueError(f"instance of {n} tokens does not fit seq_len={seq_len}")
        row = input_ids[b]
        row[0] = cls_id
        row[1 : 1 + la] = tokens[a_lo:a_hi]
        row[1 + la] = sep_id
        if lb:
            row[2 + la : 2 + la + lb] = tokens[b_lo:b_hi]
            row[2 + la + lb] = sep_id
            segment_ids[b, 2 + la : n] = 1
        lengths[b] = n
    return input_ids, segment_ids, lengths


def build_batch(
    corpora: Sequence[TokenizedCorpus],
    source_index: np.ndarray,
    rows: np.ndarray,
    rng: np.random.Generator,
    *,
    seq_len: int,
    masking_settings: masking.MaskingSettings,
    word_start: np.ndarray,
    cls_id: int = 2,
    sep_id: int = 3,
    mask_id: int = 4,
    pad_id: int = 0,
) -> dict[str, np.ndarray]:
    """Instance rows -> one fixed-shape batch (the batch contract of `albert_jax.data.pipeline`).

    Returns input_ids, segment_ids, input_mask [B,S] int32; masked_lm_positions,
    masked_lm_ids [B,P] int32; masked_lm_weights [B,P] float32; sentence_order_label [B] int32;
    pair_kind [B] int32 (how B was chosen: a code of `instances.PAIR_KINDS`; for evaluation
    diagnostics, training does not read it).
    """
    input_ids, segment_ids, lengths = assemble(
        corpora, source_index, rows, seq_len, cls_id=cls_id, sep_id=sep_id, pad_id=pad_id
    )
    masked = masking.mask_whole_word_ngrams(
        input_ids,
        lengths,
        word_start,
        rng,
        max_predictions=masking_settings.max_predictions,
        masked_lm_prob=masking_settings.masked_lm_prob,
        mask_id=mask_id,
        special_ids=(cls_id, sep_id),
        ngram=masking_settings.ngram,
    )
    input_mask = (np.arange(seq_len)[None, :] < lengths[:, None]).astype(np.int32)
    return {
        "input_ids": masked.input_ids,
        "segment_ids": segment_ids,
        "input_mask": input_mask,
        "masked_lm_positions": masked.positions,
        "masked_lm_ids": masked.ids,
        "masked_lm_weights": masked.weights,
        "sentence_order_label": rows[:, LABEL].astype(np.int32),
        "pair_kind": rows[:, KIND].astype(np.int32),
    }
