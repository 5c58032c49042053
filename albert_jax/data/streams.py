"""Which instance fills each example slot of a data shard: per-source instance streams, epoch
after epoch (`InstanceStream`), and the source mixture (`Mixture`). See `pipeline` for the
seeding rules; both are pure functions of their seeds, so any position is computable."""

from __future__ import annotations

import zlib
from collections import Counter
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from albert_jax.data.corpus import TokenizedCorpus
from albert_jax.data.instances import create_instances

if TYPE_CHECKING:
    from albert_jax.data.data_config import DataConfig

MIX_BLOCK = 1 << 16
# Stream tags keep the generators of different purposes independent.
TAG_EPOCH, TAG_MIX, TAG_MASK = 1, 2, 3


def stable_id(name: str) -> int:
    """A source's id in its generators' seeds: crc32 of the name (Python's `hash` of a str
    changes from run to run)."""
    return zlib.crc32(name.encode("utf-8"))


class InstanceStream:
    """Source `k`'s endless sequence of instances (epoch after epoch)."""

    def __init__(
        self,
        corpus: TokenizedCorpus,
        cfg: DataConfig,
        *,
        seed: int,
        source_id: int,
        shard_index: int,
    ):
        self.corpus = corpus
        self.cfg = cfg
        self._key = (seed, TAG_EPOCH, source_id, shard_index)
        self._tables: dict[int, np.ndarray] = {}
        self.counters: Counter = Counter()

    def epoch(self, e: int) -> np.ndarray:
        """Instance table [N_e, 6] of epoch `e` (the last two are kept)."""
        if e not in self._tables:
            rng = np.random.default_rng([*self._key, e])
            self._tables[e] = create_instances(
                self.corpus,
                rng,
                max_seq_length=self.cfg.seq_len,
                short_seq_prob=self.cfg.short_seq_prob,
                objective=self.cfg.objective,
                single_segment=self.cfg.sop_single_segment,
                counters=self.counters,
            )
            self.counters["epochs"] += 1
            for old in [k for k in self._tables if k < e - 1]:
                del self._tables[old]
        return self._tables[e]

    def take(
        self, cursor: tuple[int, int], position: int, n: int
    ) -> tuple[np.ndarray, tuple[int, int]]:
        """Rows for stream positions [position, position + n).

        `cursor = (epoch, first position of that epoch)` must not be past `position`; returns
        (rows [n, 6], the cursor of the epoch holding position + n).
        """
        epoch, start = cursor
        out = []
        while n > 0 or position >= start + len(self.epoch(epoch)):
            table = self.epoch(epoch)
            if position >= start + len(table):
                epoch, start = epoch + 1, start + len(table)
                continue
            lo = position - start
            hi = min(len(table), lo + n)
            out.append(table[lo:hi])
            n -= hi - lo
            position += hi - lo
        rows = np.concatenate(out) if out else np.zeros((0, 6), np.int64)
        return rows, (epoch, start)


class Mixture:
    """Which source each example slot reads from: p(source k) = weight_k / sum(weights)."""

    def __init__(self, weights: Sequence[float], *, seed: int, shard_index: int):
        w = np.asarray(weights, np.float64)
        if len(w) == 0 or np.any(~np.isfinite(w)) or np.any(w <= 0):
            raise ValueError(f"source weights must be positive and finite (got {list(weights)})")
        self.num_sources = len(w)
        self._cdf = np.cumsum(w / w.sum())[:-1]
        self._key = (seed, TAG_MIX, shard_index)
        self._block: tuple[int, np.ndarray] | None = None

    def block(self, b: int) -> np.ndarray:
        if self._block is None or self._block[0] != b:
            u = np.random.default_rng([*self._key, b]).random(MIX_BLOCK)
            self._block = (b, np.searchsorted(self._cdf, u, side="right").astype(np.int32))
        return self._block[1]

    def sources(self, first_slot: int, n: int) -> np.ndarray:
        """Source index of slots [first_slot, first_slot + n), [n] int32."""
        if self.num_sources == 1:
            return np.zeros(n, np.int32)
        out = []
        slot = first_slot
        while n > 0:
            b, lo = divmod(slot, MIX_BLOCK)
            take = min(n, MIX_BLOCK - lo)
            out.append(self.block(b)[lo : lo + take])
            slot, n = slot + take, n - take
        return np.concatenate(out) if out else np.zeros(0, np.int32)

    def counts_before(self, slot: int) -> np.ndarray:
        """How many of slots [0, slot) each source served, [K] int64."""
        counts = np.zeros(self.num_sources, np.int64)
        if self.num_sources == 1:
            counts[0] = slot
            return counts
        full, rest = divmod(slot, MIX_BLOCK)
        for b in range(full):
            counts += np.bincount(self.block(b), minlength=self.num_sources)
        if rest:
            counts += np.bincount(self.block(full)[:rest], minlength=self.num_sources)
        return counts
