"""Several short examples in one row: training batches of one-sequence kinds without padding.

A sentence-classification batch padded to its longest row (or to its length bucket) is mostly
padding: SST-style sentences average ~30 tokens, a batch's longest is ~60 and its bucket 64
or 128. Packing puts the examples of a batch one after another into `rows` rows of
`row_length` tokens, so the encoder runs over about the real tokens only:

  row 0: [CLS] a1 a2 [SEP] [CLS] b1 b2 b3 [SEP] [CLS] c1 [SEP] pad pad
  row 1: [CLS] d1 ... [SEP] [CLS] e1 ... [SEP] pad ...

`pack_ids` (1, 2, ... per example of a row, 0 for padding) make attention block-diagonal (a
token attends to the tokens of its own example only), `position_ids` restart at 0 for each
example, segment ids are each example's own, and `cls_index` [B] says where each example's
[CLS] is (flat index into rows x slots of `cls_positions`), so the head reads one pooled
vector per example, in the batch's order. Each example thus computes exactly what it computes
alone (masked keys get -10000 before the softmax, whose exp is 0 in float32); labels and the
loss stay per example, [B].

Shapes are bounded: `row_length` is a length bucket of at least `MIN_ROW_LENGTH` tokens (or
max_seq_length), the slots per row are `row_length // TOKENS_PER_SLOT`, and the row count is
on a ladder of `row_granularity` multiples with at most `ROW_COUNTS_PER_OCTAVE` steps from a
power of two to the next, counted in units of the granularity (`round_rows`): at most 8
counts per octave of batch / granularity for each length bucket, and above 16 units at most
1/8 more units than needed. In practice a handful, logged by the caller: a batch of
B examples of about the same length fills between ceil(tokens / row_length) rows and a few
more.

Packing pays when examples are short against max_seq_length. `config.pack_examples=None`
(the default) decides from the first steps' batches: packed if the rows would hold at most
`AUTO_MAX_PACKED_SHARE` of their unpacked tokens (`packed_share`), length buckets otherwise.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import NamedTuple

import numpy as np

from albert_jax.tasks.batching import bucket_length

__all__ = [
    "PackPlan", "plan_packing", "pack_batch", "round_rows", "packed_share", "PACKED_INPUTS",
]  # fmt: skip

# Rows shorter than this hold one or two sentences and fragment badly; attention over a row of
# 128 costs ~3% of a base layer's FLOPs (4·S·H against 24·H² per token), so longer is cheap.
MIN_ROW_LENGTH = 128
# One [CLS] slot per this many tokens of a row: examples have >= 3 tokens, but a slot count
# that follows the row length keeps `cls_positions` small and the shapes tied to the bucket.
TOKENS_PER_SLOT = 16
# Row counts from one power of two (in units of the granularity) to the next: each new count is
# a compilation of the step (seconds; an accelerator's 100 updates cost about as much), each
# row above the needed ones is padding. 8 keeps the padding under 1/8 of the rows and counts
# below 16 units exact (figures: docs/benchmarks.md, "Figures behind constants").
ROW_COUNTS_PER_OCTAVE = 8
# `config.pack_examples=None` (auto) packs when packed rows hold at most this share of the tokens
# the same batches take unpacked (`packed_share`). Packing has costs of its own: several row
# counts to compile, and a step dearer a token at short rows (block-diagonal masks, [CLS]
# gathers): where rows are about full anyway (short max_seq_length), bucketing was faster at
# the same accuracy, and where packing halves the tokens it wins (figures:
# docs/benchmarks.md, "Figures behind constants").
AUTO_MAX_PACKED_SHARE = 0.75
# The first steps whose batches `packed_share` looks at: batches are random draws of the same
# features, so 64 of them give the share of a whole epoch to ~0.01 (sentiment_rt above).
AUTO_SAMPLE_STEPS = 64
# The arrays a packed batch adds (and those it replaces keep their names).
PACKED_INPUTS = ("position_ids", "pack_ids", "cls_positions", "cls_index")


class PackPlan(NamedTuple):
    """The shape of one seed's packed batch."""

    row_length: int  # tokens per row: a length bucket
    rows: int  # rows per seed
    slots: int  # examples a row may hold


def _first_fit(lengths: np.ndarray, row_length: int, slots: int) -> list[list[int]]:
    """Example indices per row: longest first, each into the first row with room (tokens and
    a free slot). Deterministic: ties keep batch order."""
    rows: list[list[int]] = []
    free: list[int] = []
    for i in np.argsort(-lengths, kind="stable"):
        n = int(lengths[i])
        for r, room in enumerate(free):
            if room >= n and len(rows[r]) < slots:
                rows[r].append(int(i))
                free[r] -= n
                break
        else:
            rows.append([int(i)])
            free.append(row_length - n)
    return rows


def _lengths(batch: Mapping[str, np.ndarray]) -> np.ndarray:
    return batch["input_mask"].sum(axis=-1).astype(np.int64)


def plan_packing(
    batches: Sequence[Mapping[str, np.ndarray]], max_seq_length: int, row_granularity: int
) -> tuple[PackPlan, list[list[list[int]]]]:
    """The one packed shape for every seed's batch of a step (one program runs them all).

    Args:
      batches: each seed's batch {input_mask [B,S], ...}, rows padded at the end.
      max_seq_length: S, the longest a row may be.
      row_granularity: rows are a multiple of it (it divides B: the data shards split the
        rows; coarser than 1 bounds the number of compiled shapes).

    Returns:
      The plan, and each batch's placement (example indices per row) for `pack_batch`: the
      plan needs every placement's row count, so they are computed once, here.
    """
    longest = max(int(_lengths(b).max()) for b in batches)
    row_length = bucket_length(max(longest, min(MIN_ROW_LENGTH, max_seq_length)), max_seq_length)
    slots = max(1, row_length // TOKENS_PER_SLOT)
    placements = [_first_fit(_lengths(b), row_length, slots) for b in batches]
    needed = max(len(p) for p in placements)
    batch = max(len(b["input_mask"]) for b in batches)
    return PackPlan(row_length, round_rows(needed, row_granularity, batch), slots), placements


def packed_share(
    steps: Sequence[Sequence[Mapping[str, np.ndarray]]],
    max_seq_length: int,
    row_granularity: int,
    length_buckets: bool,
) -> float:
    """Tokens of the packed rows / tokens of the same batches unpacked (each step's batches cut
    to the length bucket of their longest row, or padded to `max_seq_length` without
    `length_buckets`): what packing saves, in tokens the encoder runs over.

    Args:
      steps: for each step, each seed's batch {input_mask [B,S], ...} as `plan_packing` takes.
      max_seq_length, row_granularity: as for `plan_packing`.
      length_buckets: whether unpacked batches are cut to buckets (config.length_buckets).
    """
    packed = unpacked = 0
    for batches in steps:
        plan, _ = plan_packing(batches, max_seq_length, row_granularity)
        packed += plan.rows * plan.row_length * len(batches)
        longest = max(int(_lengths(b).max()) for b in batches)
        length = bucket_length(longest, max_seq_length) if length_buckets else max_seq_length
        unpacked += sum(len(b["input_mask"]) for b in batches) * length
    return packed / unpacked


def round_rows(needed: int, granularity: int, batch: int) -> int:
    """The rows of a packed shape: `needed` rounded up to a multiple of `granularity` * 2^k,
    k the largest with `ROW_COUNTS_PER_OCTAVE` * 2^k <= ceil(needed / granularity) (so k = 0
    up to 15 units of the granularity, 1 from 16 to 31, ...), and no more than `batch` (a
    multiple of the granularity: one example a row is always enough)."""
    units = math.ceil(needed / granularity)
    step = 1 << max(0, units.bit_length() - 1 - int(math.log2(ROW_COUNTS_PER_OCTAVE)))
    return min(math.ceil(units / step) * step * granularity, batch)


def pack_batch(
    batch: Mapping[str, np.ndarray], plan: PackPlan, placement: Sequence[Sequence[int]]
) -> dict[str, np.ndarray]:
    """One seed's batch {input_ids, segment_ids, input_mask [B,S], label [B], ...} -> packed,
    its examples in the rows that `placement` (from `plan_packing`) gives.

    Returns input_ids, segment_ids, input_mask, position_ids, pack_ids [rows, row_length]
    int32, cls_positions [rows, slots] int32 (unused slots 0), cls_index [B] int32 (example
    b's [CLS] at flat slot cls_index[b] of [rows * slots]) and every other array of `batch`
    ([B, ...], e.g. label) unchanged.
    """
    lengths = _lengths(batch)
    if sorted(i for row in placement for i in row) != list(range(len(lengths))):
        raise ValueError("the placement must hold every example of the batch once")
    if len(placement) > plan.rows:
        raise ValueError(f"{len(placement)} rows needed, the plan has {plan.rows}")
    shape = (plan.rows, plan.row_length)
    packed = {k: np.zeros(shape, np.int32) for k in ("input_ids", "segment_ids", "input_mask")}
    packed["position_ids"] = np.zeros(shape, np.int32)
    packed["pack_ids"] = np.zeros(shape, np.int32)
    packed["cls_positions"] = np.zeros((plan.rows, plan.slots), np.int32)
    packed["cls_index"] = np.zeros(len(lengths), np.int32)
    for r, examples in enumerate(placement):
        start = 0
        for slot, i in enumerate(examples):
            n = int(lengths[i])
            span = slice(start, start + n)
            for k in ("input_ids", "segment_ids", "input_mask"):
                packed[k][r, span] = batch[k][i, :n]
            packed["position_ids"][r, span] = np.arange(n)
            packed["pack_ids"][r, span] = slot + 1
            packed["cls_positions"][r, slot] = start
            packed["cls_index"][i] = r * plan.slots + slot
            start += n
    packed.update({k: v for k, v in batch.items() if k not in packed})
    return packed
