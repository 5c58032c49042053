"""Fixed-shape numpy batches from featurized examples, and featurization bookkeeping.

`Features.arrays` holds equally long numpy arrays (one row per feature: a sequence, an option
set or a SQuAD window). Training batches are a pure function of `(seed, step)` — an epoch-wise
permutation, remainder dropped — so a resumed run sees exactly the batches an uninterrupted one
would have. Evaluation batches walk the rows in order; the last one is padded to the full batch
size (static shapes: one compilation) and `example_weight` marks the real rows (1) and the
padding (0).
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
from collections.abc import Iterator, Mapping

import numpy as np

__all__ = [
    "FeatureStats", "Features", "train_batch", "eval_batches", "pad_ids", "bucket_length",
    "bucket_lengths", "trim_to_bucket",
]  # fmt: skip

# The shortest length bucket; the others double it up to max_seq_length.
SMALLEST_BUCKET = 32


@dataclasses.dataclass
class FeatureStats:
    """What featurization did: examples in, features out, and what had to be cut.

    `truncated` counts examples by reason (e.g. "text_a", "question", "context"); an example
    cut in two places counts once per reason. `windows_per_example` is > 1 for SQuAD contexts
    split with a document stride (nothing is lost there, it is counted for the record).
    """

    examples: int = 0
    features: int = 0
    truncated: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    truncated_examples: int = 0
    split_into_windows: int = 0

    def as_dict(self) -> dict[str, int | dict[str, int]]:
        return {
            "examples": self.examples,
            "features": self.features,
            "truncated_examples": self.truncated_examples,
            "truncated_by_reason": dict(self.truncated),
            "split_into_windows": self.split_into_windows,
        }


@dataclasses.dataclass
class Features:
    """Featurized examples: `arrays` {name: [N, ...] numpy} and the `stats` of featurization."""

    arrays: dict[str, np.ndarray]
    stats: FeatureStats

    def __post_init__(self) -> None:
        lengths = {name: len(a) for name, a in self.arrays.items()}
        if len(set(lengths.values())) > 1:
            raise ValueError(f"Features.arrays must all have the same length, got {lengths}")

    def __len__(self) -> int:
        return len(next(iter(self.arrays.values()))) if self.arrays else 0

    def fingerprint(self) -> str:
        """sha256 over the names, dtypes, shapes and bytes of the arrays (a resumed run's
        check that it trains on the same features)."""
        digest = hashlib.sha256()
        for name in sorted(self.arrays):
            array = np.ascontiguousarray(self.arrays[name])
            digest.update(f"{name}:{array.dtype.str}:{array.shape};".encode())
            digest.update(array.tobytes())
        return digest.hexdigest()


def pad_ids(ids: list[int], length: int, pad: int = 0) -> list[int]:
    """ids + [pad] * (length - len(ids)); raises if ids is already longer."""
    if len(ids) > length:
        raise ValueError(f"sequence of {len(ids)} ids does not fit in {length}")
    return ids + [pad] * (length - len(ids))


def _epoch_order(num_rows: int, epoch: int, seed: int) -> np.ndarray:
    return np.random.default_rng([seed, epoch]).permutation(num_rows)


def train_batch(
    arrays: Mapping[str, np.ndarray], step: int, batch_size: int, seed: int
) -> dict[str, np.ndarray]:
    """The global training batch of `step`: rows of one epoch-wise permutation.

    Each epoch is a fresh permutation seeded by (seed, epoch); the last `N % batch_size` rows of
    an epoch's order are dropped, so every batch is full. Returns {name: [batch_size, ...]}.
    """
    num_rows = len(next(iter(arrays.values())))
    if num_rows < batch_size:
        raise ValueError(
            f"batch_size={batch_size} exceeds the {num_rows} training features; lower batch_size"
        )
    steps_per_epoch = num_rows // batch_size
    epoch, index = divmod(step, steps_per_epoch)
    rows = _epoch_order(num_rows, epoch, seed)[index * batch_size : (index + 1) * batch_size]
    return {name: a[rows] for name, a in arrays.items()}


def eval_batches(
    arrays: Mapping[str, np.ndarray], batch_size: int
) -> Iterator[dict[str, np.ndarray]]:
    """All rows in order, in batches of exactly `batch_size`.

    The last batch is padded with copies of row 0 (valid inputs, so nothing turns NaN) and
    `example_weight [batch_size]` float32 is 1.0 for real rows, 0.0 for padding.
    """
    num_rows = len(next(iter(arrays.values())))
    for start in range(0, num_rows, batch_size):
        rows = np.arange(start, min(start + batch_size, num_rows))
        real = len(rows)
        rows = np.concatenate([rows, np.zeros(batch_size - real, dtype=rows.dtype)])
        batch = {name: a[rows] for name, a in arrays.items()}
        batch["example_weight"] = (np.arange(batch_size) < real).astype(np.float32)
        yield batch


def bucket_lengths(max_seq_length: int, smallest: int = SMALLEST_BUCKET) -> tuple[int, ...]:
    """Every length a batch may be cut to: smallest·2^k below `max_seq_length`, and
    `max_seq_length` itself (e.g. 32, 64, 128, 256, 512): the bound on compiled shapes."""
    lengths, length = [], smallest
    while length < max_seq_length:
        lengths.append(length)
        length *= 2
    return (*lengths, max_seq_length)


def bucket_length(length: int, max_seq_length: int, smallest: int = SMALLEST_BUCKET) -> int:
    """The shortest of `bucket_lengths(max_seq_length)` that holds `length` tokens."""
    return next(b for b in bucket_lengths(max_seq_length, smallest) if b >= length)


def trim_to_bucket(
    batch: Mapping[str, np.ndarray],
    sequence_keys: tuple[str, ...],
    smallest: int = SMALLEST_BUCKET,
) -> tuple[dict[str, np.ndarray], int]:
    """(batch with its `sequence_keys` arrays cut to the bucket of its longest row, that length).

    Rows are padded at the end (`input_mask` 1 then 0), so dropping trailing columns that no row
    uses loses nothing: masked keys get the official -10000 before the softmax, whose exp is 0
    in float32, and positions are absolute. The cut is decided on the *global* batch (every
    process computes the same one), so all processes agree on its shape.

    Args:
      batch: {name: [B, ..., S] or [B, ...]}; `input_mask` [B, ..., S] marks the real tokens.
      sequence_keys: the arrays whose last axis is the sequence (input_ids, segment_ids,
        input_mask, p_mask, ...).
    """
    mask = batch["input_mask"]
    max_seq_length = mask.shape[-1]
    used = np.flatnonzero(mask.reshape(-1, max_seq_length).any(axis=0))
    longest = int(used[-1]) + 1 if len(used) else 1
    length = bucket_length(longest, max_seq_length, smallest)
    if length == max_seq_length:
        return dict(batch), length
    return {k: v[..., :length] if k in sequence_keys else v for k, v in batch.items()}, length
