"""Deterministic, resumable, per-host pretraining batches.

The data is cut into `num_shards` shards (`config.data.num_shards`; 0 = one per process). The
global batch of step `s` is the concatenation, in shard order, of the shards' batches, and the
batch of shard `i` is a pure function of `(seed, s, i, num_shards)` (and of the config and
data). Process `p` of `n` reads the contiguous shards `[p·k, (p+1)·k)`, `k = num_shards / n`
(`ShardedIterator`), so the global batch does not depend on the number of processes: one
process with two shards sees exactly the batches that two processes with one shard each see
together, and a checkpoint of one layout resumes in the other.

One shard (`PretrainingIterator`, whose `process_index` / `process_count` name the shard):

* **Tokenized cache.** Each source's documents of the shard
  (`iter_documents(..., shard_index=i, shard_count=num_shards)`, so shards hold disjoint
  documents) are sentence-split and tokenized once into `.npy` files under
  `cache_dir/<source>.<inputs hash>.<split>.<i>-of-<n>.<tokenizer hash>.v<version>/` (written
  to a temp dir and renamed: racing processes are safe). Later runs memory-map them.
* **Epochs.** Source `k`'s instance stream is the concatenation of epochs; epoch `e` is
  `pretraining.create_instances` with a generator seeded by `(seed, k, i, e)`, i.e. new
  instance boundaries, SOP swaps and random B segments each epoch (like `dupe_factor`, but
  unbounded), shuffled.
* **Mixture.** Example slot `j = s * b + r` (b = per-shard batch) draws its source from a
  generator seeded per block of 65536 slots with `(seed, i, block)`; so the number of examples
  each source has served before any step is computable without replaying the run.
* **Masking.** The n-gram masks of step `s` are drawn from a generator seeded by
  `(seed, i, s)`: every visit of an instance gets a fresh mask, and the batch does not depend on
  the number of worker processes (a worker builds whole batches).

State (`get_state()`) is a small JSON-able dict: the next step plus, per source, the examples
served and the current epoch and its first position, so a restore does not rebuild earlier
epochs. `PretrainingIterator(..., start_step=k)` without a state reaches the same position by
counting (it rebuilds the epoch tables up to there, which is cheap for small corpora).
`ShardedIterator` states hold one such state per shard.

Held-out batches (`EvalBatches`) come from the same machinery with another seed; a shard
without held-out documents (more shards than validation documents) yields padding rows with
`example_weight` 0, so every process runs the same number of evaluation steps.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
import zlib
from collections import Counter, deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, fields
from typing import TYPE_CHECKING, Any

import numpy as np

from albert_jax.data import pretraining, workers
from albert_jax.data.pretraining import TokenizedCorpus

if TYPE_CHECKING:
    from albert_jax.data.tokenizer import Tokenizer

CACHE_VERSION = 1
MIX_BLOCK = 1 << 16
# Stream tags keep the generators of different purposes independent.
_TAG_EPOCH, _TAG_MIX, _TAG_MASK = 1, 2, 3
_EVAL_SEED_OFFSET = 0x5EED
# Not part of a shard's fingerprint: where files live, how many workers build batches, and
# `num_shards` (the shard index and count are fingerprinted on their own).
_NOT_SEMANTIC = ("sources", "data_dir", "cache_dir", "num_workers", "prefetch", "num_shards")


@dataclass(frozen=True)
class DataConfig:
    """What the pipeline needs from a config (see `from_config` for where each is read)."""

    seq_len: int = 512  # tokens per sequence S
    max_predictions_per_seq: int = 20  # P
    batch_size: int = 4096  # global batch; each of the `num_shards` shards makes batch/n
    objective: str = "sop"  # sop | nsp | none
    # SOP's one-sentence chunks: "split" (cut the sentence in two; balanced labels) or
    # "random_b" (the reference: B from another document, label 1). See pretraining.py.
    sop_single_segment: str = "split"
    seed: int = 0
    short_seq_prob: float = 0.1
    masked_lm_prob: float = 0.15
    ngram: int = 3  # longest masked n-gram (whole words)
    sources: str = ""  # spec for albert_jax.data.sources.parse_sources
    data_dir: str | None = None  # TFDS data dir
    cache_dir: str | None = None  # tokenized cache; default <data_dir>/albert_jax_cache
    num_workers: int = 0  # batch/tokenization worker processes (0 = in this process)
    prefetch: int = 2  # batches in flight per worker
    # Data shards (0 = one per process). Fixing it makes the global batch independent of the
    # number of processes; it must be a multiple of the process count and divide batch_size.
    num_shards: int = 0

    # (config field, DataConfig field): looked up in `config.data` first, then `config`.
    _ALIASES = {"max_ngram": "ngram"}

    @classmethod
    def from_config(cls, config: Any, **overrides: Any) -> DataConfig:
        """Reads a config-like object (ml_collections / dataclass / dict).

        Top-level: seq_len, max_predictions_per_seq, batch_size, objective, seed. In `data`
        (or top-level): sources, data_dir, cache_dir, short_seq_prob, masked_lm_prob,
        max_ngram (or ngram), sop_single_segment, num_workers, prefetch, num_shards.
        """
        values: dict[str, Any] = {}
        data = _get(config, "data")
        names = {f.name for f in fields(cls)}
        for name in names:
            for where in (data, config):
                if where is None:
                    continue
                for alias in [name, *[a for a, n in cls._ALIASES.items() if n == name]]:
                    value = _get(where, alias)
                    if value is not None and name not in values:
                        values[name] = value
        values.update(overrides)
        cfg = cls(**values)
        cfg.validate()
        return cfg

    def shard_count(self, process_count: int = 1) -> int:
        """Number of data shards of a run with `process_count` processes."""
        return self.num_shards or process_count

    def validate(self, process_count: int = 1) -> None:
        if self.objective not in pretraining.OBJECTIVES:
            raise ValueError(
                f"objective must be one of {pretraining.OBJECTIVES} (got {self.objective!r})"
            )
        if self.sop_single_segment not in pretraining.SINGLE_SEGMENT_MODES:
            raise ValueError(
                f"sop_single_segment must be one of {pretraining.SINGLE_SEGMENT_MODES} "
                f"(got {self.sop_single_segment!r})"
            )
        if self.seq_len < 5:
            raise ValueError(f"seq_len must be >= 5 (got {self.seq_len})")
        if self.max_predictions_per_seq < 1:
            raise ValueError(
                f"max_predictions_per_seq must be >= 1 (got {self.max_predictions_per_seq})"
            )
        if not 0.0 <= self.short_seq_prob <= 1.0:
            raise ValueError(f"short_seq_prob must be in [0, 1] (got {self.short_seq_prob})")
        if not 0.0 <= self.masked_lm_prob <= 1.0:
            raise ValueError(f"masked_lm_prob must be in [0, 1] (got {self.masked_lm_prob})")
        if self.ngram < 1:
            raise ValueError(f"ngram (max_ngram) must be >= 1 (got {self.ngram})")
        if self.num_shards < 0:
            raise ValueError(
                f"num_shards must be >= 0 (0 = one per process), got {self.num_shards}"
            )
        shards = self.shard_count(process_count)
        if shards % process_count:
            raise ValueError(
                f"num_shards={self.num_shards} must be a multiple of process_count="
                f"{process_count}: every process reads the same number of data shards"
            )
        if self.batch_size < 1 or self.batch_size % shards:
            raise ValueError(
                f"batch_size={self.batch_size} must be a positive multiple of the number of data "
                f"shards {shards} (num_shards={self.num_shards}, process_count={process_count})"
            )
        if self.num_workers < 0:
            raise ValueError(f"num_workers must be >= 0 (got {self.num_workers})")


def _get(obj: Any, name: str) -> Any:
    if obj is None:
        return None
    if isinstance(obj, Mapping):
        return obj.get(name)
    try:
        return getattr(obj, name)
    except (AttributeError, KeyError):
        return None


class EmptyShardError(ValueError):
    """A data shard holds no non-empty document (more shards than documents in a split)."""


@dataclass(frozen=True)
class DocumentSource:
    """A named, weighted document collection.

    `documents(split, shard_index, shard_count)` yields `{"title", "text"}` dicts of one shard;
    shards of different indices must be disjoint. `name` plus `cache_key` must identify the
    content: they key the tokenized cache.
    """

    name: str
    weight: float
    documents: Callable[[str, int, int], Iterable[dict]]
    cache_key: str = ""


def sources_from_spec(spec: str, data_dir: str | None = None) -> list[DocumentSource]:
    """`albert_jax.data.sources` spec -> DocumentSources reading TFDS."""
    from albert_jax.data import sources as tfds_sources

    out = []
    for src in tfds_sources.parse_sources(spec):

        def documents(split: str, shard_index: int, shard_count: int, _src=src) -> Iterable:
            return tfds_sources.iter_documents(
                _src,
                split=split,
                data_dir=data_dir,
                shard_index=shard_index,
                shard_count=shard_count,
            )

        # The same name may be built from other files or live in another data dir.
        key = json.dumps([list(src.files), os.path.abspath(data_dir) if data_dir else None])
        out.append(DocumentSource(src.name, float(src.weight), documents, cache_key=key))
    return out


# --------------------------------------------------------------------------------------------
# Tokenized cache
# --------------------------------------------------------------------------------------------


class _TokenizeChunk:
    """Picklable worker: a list of documents -> (tokenized documents, counters)."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer

    def __call__(self, docs: list) -> tuple[list[list[list[int]]], Counter]:
        counters: Counter = Counter()
        return [pretraining.tokenize_one(d, self.tokenizer, counters) for d in docs], counters


def _chunks(items: Iterable, size: int) -> Iterator[list]:
    chunk: list = []
    for item in items:
        chunk.append(item)
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def cache_path(
    cache_dir: str,
    source: DocumentSource,
    split: str,
    shard_index: int,
    shard_count: int,
    tokenizer: Tokenizer,
) -> str:
    """`<cache_dir>/<source>[.<key hash>].<split>.<i>-of-<n>.<tokenizer hash>.v<version>`."""
    name = re.sub(r"[^A-Za-z0-9_.=-]+", "_", source.name)
    if source.cache_key:
        name += "." + hashlib.sha256(source.cache_key.encode()).hexdigest()[:8]
    split_name = re.sub(r"[^A-Za-z0-9_.=-]+", "_", split)
    key = f"{name}.{split_name}.{shard_index}-of-{shard_count}.{tokenizer.fingerprint}"
    return os.path.join(cache_dir, f"{key}.v{CACHE_VERSION}")


def load_tokenized(
    source: DocumentSource,
    tokenizer: Tokenizer,
    *,
    split: str,
    shard_index: int,
    shard_count: int,
    cache_dir: str,
    num_workers: int = 0,
) -> tuple[TokenizedCorpus, dict[str, int], str]:
    """Tokenized corpus of one source shard, built once and then memory-mapped.

    Returns (corpus, build counters, cache directory).
    """
    path = cache_path(cache_dir, source, split, shard_index, shard_count, tokenizer)
    if not os.path.exists(os.path.join(path, "stats.json")):
        os.makedirs(cache_dir, exist_ok=True)
        tmp = tempfile.mkdtemp(dir=cache_dir, prefix=os.path.basename(path) + ".tmp")
        try:
            counters: Counter = Counter()
            docs = source.documents(split, shard_index, shard_count)

            def tokenized() -> Iterator[list[list[int]]]:
                for encoded, c in workers.ordered_map(
                    _TokenizeChunk(tokenizer), _chunks(docs, 64), num_workers=num_workers
                ):
                    counters.update(c)
                    yield from encoded

            corpus = pretraining.concat_documents(tokenized(), tokenizer.vocab_size)
            if corpus.num_documents == 0:
                raise EmptyShardError(
                    f"source {source.name!r} split {split!r} shard {shard_index}/{shard_count} "
                    f"has no non-empty document ({dict(counters)}); use fewer data shards "
                    "(config.data.num_shards, processes) or more data"
                )
            counters["tokens"] = len(corpus.tokens)
            corpus.save(tmp)
            with open(os.path.join(tmp, "stats.json"), "w") as f:
                json.dump(dict(counters), f)
            try:
                os.rename(tmp, path)
            except OSError:
                # Another process finished the same cache first; keep theirs.
                if not os.path.exists(os.path.join(path, "stats.json")):
                    raise
        finally:
            if os.path.exists(tmp):
                shutil.rmtree(tmp, ignore_errors=True)
    with open(os.path.join(path, "stats.json")) as f:
        counters = json.load(f)
    return TokenizedCorpus.load(path), counters, path


# --------------------------------------------------------------------------------------------
# Instance streams and the source mixture
# --------------------------------------------------------------------------------------------


def _cache_dir(cfg: DataConfig) -> str:
    """`cfg.cache_dir`, else `<data_dir>/albert_jax_cache` (`~/.cache/albert_jax/...` without)."""
    return cfg.cache_dir or os.path.join(
        cfg.data_dir or os.path.join(os.path.expanduser("~"), ".cache", "albert_jax"),
        "albert_jax_cache",
    )


def _stable_id(name: str) -> int:
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
        process_index: int,
    ):
        self.corpus = corpus
        self.cfg = cfg
        self._key = (seed, _TAG_EPOCH, source_id, process_index)
        self._tables: dict[int, np.ndarray] = {}
        self.counters: Counter = Counter()

    def epoch(self, e: int) -> np.ndarray:
        """Instance table [N_e, 6] of epoch `e` (the last two are kept)."""
        if e not in self._tables:
            rng = np.random.default_rng([*self._key, e])
            self._tables[e] = pretraining.create_instances(
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

    def __init__(self, weights: Sequence[float], *, seed: int, process_index: int):
        w = np.asarray(weights, np.float64)
        if len(w) == 0 or np.any(~np.isfinite(w)) or np.any(w <= 0):
            raise ValueError(f"source weights must be positive and finite (got {list(weights)})")
        self.num_sources = len(w)
        self._cdf = np.cumsum(w / w.sum())[:-1]
        self._key = (seed, _TAG_MIX, process_index)
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


# --------------------------------------------------------------------------------------------
# Batches
# --------------------------------------------------------------------------------------------


class BatchBuilder:
    """Picklable: (step, source index [B], instance rows [B,6]) -> batch dict.

    Holds the cache directories, not the arrays: a worker process memory-maps them.
    """

    def __init__(
        self,
        cfg: DataConfig,
        tokenizer: Tokenizer,
        corpus_dirs: Sequence[str],
        *,
        mask_key: tuple[int, ...],
    ):
        self.cfg = cfg
        self.corpus_dirs = list(corpus_dirs)
        self.word_start = tokenizer.word_start
        self.ids = dict(
            cls_id=tokenizer.cls_id,
            sep_id=tokenizer.sep_id,
            mask_id=tokenizer.mask_id,
            pad_id=tokenizer.pad_id,
        )
        self.mask_key = tuple(mask_key)
        self._corpora: list[TokenizedCorpus] | None = None

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_corpora"] = None
        return state

    @property
    def corpora(self) -> list[TokenizedCorpus]:
        if self._corpora is None:
            self._corpora = [TokenizedCorpus.load(d) for d in self.corpus_dirs]
        return self._corpora

    def __call__(self, task: tuple[int, np.ndarray, np.ndarray]) -> dict[str, np.ndarray]:
        step, source_index, rows = task
        rng = np.random.default_rng([*self.mask_key, step])
        return pretraining.build_batch(
            self.corpora,
            source_index,
            rows,
            rng,
            seq_len=self.cfg.seq_len,
            max_predictions_per_seq=self.cfg.max_predictions_per_seq,
            word_start=self.word_start,
            masked_lm_prob=self.cfg.masked_lm_prob,
            ngram=self.cfg.ngram,
            **self.ids,
        )


class PretrainingIterator:
    """Endless iterator of one data shard's batches (DESIGN.md batch contract).

    `process_index` / `process_count` name the shard and the number of shards: with one shard
    per process (the default) that is the process; `ShardedIterator` gives a process several.
    Each batch holds `batch_size / process_count` sequences.

    `get_state()` returns a JSON-able dict to save with a checkpoint; `set_state(state)` makes
    the next batch the one an uninterrupted run would produce after that checkpoint.

    Raises:
      EmptyShardError: a source has no document in this shard of `split`.
    """

    def __init__(
        self,
        cfg: DataConfig,
        tokenizer: Tokenizer,
        sources: Sequence[DocumentSource],
        *,
        split: str = "train",
        process_index: int = 0,
        process_count: int = 1,
        start_step: int = 0,
        seed: int | None = None,
    ):
        cfg.validate(process_count)
        if cfg.num_shards and cfg.num_shards != process_count:
            raise ValueError(
                f"PretrainingIterator reads one shard of process_count={process_count} shards but "
                f"num_shards={cfg.num_shards}: use ShardedIterator for a process's shards"
            )
        if not sources:
            raise ValueError("sources is empty: set config.data.sources")
        if not 0 <= process_index < process_count:
            raise ValueError(f"process_index={process_index} not in [0, {process_count})")
        if start_step < 0:
            raise ValueError(f"start_step must be >= 0 (got {start_step})")
        names = [s.name for s in sources]
        if len(set(names)) != len(names):
            raise ValueError(f"source names must be unique (got {names})")
        self.cfg = cfg
        self.split = split
        self.process_index = process_index
        self.process_count = process_count
        self.batch_size = cfg.batch_size // process_count
        self.seed = cfg.seed if seed is None else seed
        self.source_names = names
        cache_dir = _cache_dir(cfg)
        corpora, dirs, self._build_counters = [], [], []
        for src in sources:
            corpus, counters, path = load_tokenized(
                src,
                tokenizer,
                split=split,
                shard_index=process_index,
                shard_count=process_count,
                cache_dir=cache_dir,
                num_workers=cfg.num_workers,
            )
            corpora.append(corpus)
            dirs.append(path)
            self._build_counters.append(counters)
        self._streams = [
            InstanceStream(
                c, cfg, seed=self.seed, source_id=_stable_id(s.name), process_index=process_index
            )
            for c, s in zip(corpora, sources, strict=True)
        ]
        self._mixture = Mixture(
            [s.weight for s in sources], seed=self.seed, process_index=process_index
        )
        self._builder = BatchBuilder(
            cfg, tokenizer, dirs, mask_key=(self.seed, _TAG_MASK, process_index)
        )
        self._builder._corpora = corpora
        # What determines the batches (not where files live or how many workers build them).
        semantic = {k: v for k, v in asdict(cfg).items() if k not in _NOT_SEMANTIC}
        self._fingerprint = hashlib.sha256(
            json.dumps(
                [
                    semantic | {"seed": self.seed},
                    names,
                    split,
                    process_index,
                    process_count,
                    tokenizer.fingerprint,
                ],
                sort_keys=True,
            ).encode()
        ).hexdigest()[:16]
        self._pool: workers.WorkerPool | None = None
        self._pending: deque = deque()
        self._batches = 0
        self._state = self._state_at(start_step)
        self._plan_state = self._state

    # -- state ----------------------------------------------------------------------------------
    def _state_at(self, step: int) -> dict[str, Any]:
        """State before `step`, computed from scratch (counts slots, walks epoch sizes)."""
        consumed = self._mixture.counts_before(step * self.batch_size)
        epoch, start = [], []
        for stream, c in zip(self._streams, consumed, strict=True):
            _, cursor = stream.take((0, 0), int(c), 0)
            epoch.append(cursor[0])
            start.append(cursor[1])
        return {
            "step": step,
            "consumed": [int(c) for c in consumed],
            "epoch": epoch,
            "epoch_start": start,
            "fingerprint": self._fingerprint,
        }

    def get_state(self) -> dict[str, Any]:
        """JSON-able position: the step of the next batch and per-source stream cursors."""
        return json.loads(json.dumps(self._state))

    def set_state(self, state: Mapping[str, Any]) -> None:
        if state.get("fingerprint") != self._fingerprint:
            raise ValueError(
                "set_state: the state was saved by a pipeline with another config, sources, "
                "split, process layout or tokenizer (fingerprint mismatch)"
            )
        k = len(self._streams)
        for key in ("consumed", "epoch", "epoch_start"):
            if len(state.get(key, ())) != k:
                raise ValueError(f"set_state: state[{key!r}] must have {k} entries")
        self._drain()
        self._state = {
            "step": int(state["step"]),
            "consumed": [int(x) for x in state["consumed"]],
            "epoch": [int(x) for x in state["epoch"]],
            "epoch_start": [int(x) for x in state["epoch_start"]],
            "fingerprint": self._fingerprint,
        }
        self._plan_state = self._state

    @property
    def step(self) -> int:
        return self._state["step"]

    # -- planning and building ------------------------------------------------------------------
    def _plan(self, state: dict[str, Any]):
        """Task for the batch at `state` and the state after it."""
        step = state["step"]
        B = self.batch_size
        source_index = self._mixture.sources(step * B, B)
        rows = np.zeros((B, 6), np.int64)
        new = {
            **state,
            "consumed": list(state["consumed"]),
            "epoch": list(state["epoch"]),
            "epoch_start": list(state["epoch_start"]),
            "step": step + 1,
        }
        for k, stream in enumerate(self._streams):
            where = np.flatnonzero(source_index == k)
            if where.size == 0:
                continue
            cursor = (new["epoch"][k], new["epoch_start"][k])
            rows[where], cursor = stream.take(cursor, new["consumed"][k], where.size)
            new["consumed"][k] += where.size
            new["epoch"][k], new["epoch_start"][k] = cursor
        return (step, source_index, rows), new

    def _drain(self) -> None:
        self._pending.clear()

    def __iter__(self) -> PretrainingIterator:
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        if self.cfg.num_workers == 0:
            task, self._state = self._plan(self._state)
            self._plan_state = self._state
            batch = self._builder(task)
        else:
            if self._pool is None:
                self._pool = workers.WorkerPool(self._builder, self.cfg.num_workers)
            while len(self._pending) < self.cfg.num_workers * self.cfg.prefetch:
                task, self._plan_state = self._plan(self._plan_state)
                self._pending.append((self._pool.submit(task), self._plan_state))
            future, after = self._pending.popleft()
            batch = future.get()
            self._state = after
        self._batches += 1
        return batch

    def stats(self) -> dict[str, int]:
        """Counters: cache build (documents, documents_empty, documents_one_sentence,
        sentences, sentences_empty_dropped, long_sentences_chunked, non_utf8_replaced, tokens)
        and instances of the epochs built so far (instances, instances_truncated,
        instances_random_b, instances_split_sentence, instances_unsplittable, epochs), summed
        over sources, plus `<source>/<counter>`."""
        out: Counter = Counter({k: 0 for k in pretraining.COUNTERS})
        for name, built, stream in zip(
            self.source_names, self._build_counters, self._streams, strict=True
        ):
            for key, value in {**built, **stream.counters}.items():
                out[key] += int(value)
                if len(self.source_names) > 1:
                    out[f"{name}/{key}"] = int(value)
        out["batches"] = self._batches
        return dict(out)

    def close(self) -> None:
        self._drain()
        if self._pool is not None:
            self._pool.close()
            self._pool = None

    def __del__(self) -> None:
        pool = getattr(self, "_pool", None)
        if pool is not None:
            # At interpreter exit the pool's machinery (and `contextlib`) may be gone already.
            try:  # noqa: SIM105
                pool.close()
            except Exception:
                pass


def _concat(batches: Sequence[Mapping[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """Batches of the shards, in shard order -> one batch (along the leading axis)."""
    if len(batches) == 1:
        return dict(batches[0])
    return {k: np.concatenate([b[k] for b in batches]) for k in batches[0]}


def owned_shards(num_shards: int, process_index: int, process_count: int) -> range:
    """The contiguous shards process `process_index` of `process_count` reads.

    Contiguous, so that the processes' batches concatenated in process order (the order of the
    rows of a batch-sharded global array) are the shards' batches in shard order.
    """
    if num_shards < 1 or num_shards % process_count:
        raise ValueError(
            f"num_shards={num_shards} must be a positive multiple of process_count={process_count}"
        )
    if not 0 <= process_index < process_count:
        raise ValueError(f"process_index={process_index} not in [0, {process_count})")
    per_process = num_shards // process_count
    return range(process_index * per_process, (process_index + 1) * per_process)


class ShardedIterator:
    """Endless iterator of one process's batches: its shards' batches concatenated.

    Process `process_index` of `process_count` reads shards `owned_shards(...)` of
    `cfg.shard_count(process_count)`; each batch holds `batch_size / process_count` sequences,
    rows of shard i before those of shard i+1. The global batch (all processes' batches in
    process order) depends on `num_shards`, never on `process_count`.

    `get_state()` is `{"step", "num_shards", "shards": {"<i>": state of shard i}}` for the
    owned shards; `set_state` accepts such a state holding (at least) the owned shards, e.g.
    the union of every process's states that a checkpoint keeps.
    """

    def __init__(
        self,
        cfg: DataConfig,
        tokenizer: Tokenizer,
        sources: Sequence[DocumentSource],
        *,
        split: str = "train",
        process_index: int = 0,
        process_count: int = 1,
        start_step: int = 0,
        seed: int | None = None,
    ):
        cfg.validate(process_count)
        self.num_shards = cfg.shard_count(process_count)
        self.shards = owned_shards(self.num_shards, process_index, process_count)
        self.batch_size = cfg.batch_size // process_count
        # Worker processes are split between the shards (each shard builds whole batches).
        workers_per_shard = -(-cfg.num_workers // len(self.shards)) if cfg.num_workers else 0
        shard_cfg = DataConfig(
            **{**asdict(cfg), "num_shards": self.num_shards, "num_workers": workers_per_shard}
        )
        self._iterators: list[PretrainingIterator] = []
        try:
            for shard in self.shards:
                self._iterators.append(
                    PretrainingIterator(
                        shard_cfg,
                        tokenizer,
                        sources,
                        split=split,
                        process_index=shard,
                        process_count=self.num_shards,
                        start_step=start_step,
                        seed=seed,
                    )
                )
        except BaseException:
            self.close()
            raise
        self._batches = 0

    @property
    def step(self) -> int:
        """The step of the next batch."""
        return self._iterators[0].step

    def get_state(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "num_shards": self.num_shards,
            "shards": {
                str(i): it.get_state() for i, it in zip(self.shards, self._iterators, strict=True)
            },
        }

    def set_state(self, state: Mapping[str, Any]) -> None:
        """Positions every owned shard at its saved state (all must be at the same step)."""
        if state.get("num_shards") != self.num_shards:
            raise ValueError(
                f"set_state: the state is of {state.get('num_shards')} data shards, this "
                f"iterator reads {self.num_shards}"
            )
        shard_states = state.get("shards") or {}
        missing = [i for i in self.shards if str(i) not in shard_states]
        if missing:
            raise ValueError(f"set_state: no state for shard(s) {missing}")
        steps = {int(shard_states[str(i)]["step"]) for i in self.shards}
        if len(steps) != 1:
            raise ValueError(f"set_state: the shards are at different steps {sorted(steps)}")
        for i, it in zip(self.shards, self._iterators, strict=True):
            it.set_state(shard_states[str(i)])

    def __iter__(self) -> ShardedIterator:
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        batch = _concat([next(it) for it in self._iterators])
        self._batches += 1
        return batch

    def stats(self) -> dict[str, int]:
        """`PretrainingIterator.stats()` summed over the owned shards."""
        out: Counter = Counter()
        for it in self._iterators:
            out.update(it.stats())
        out["batches"] = self._batches
        return dict(out)

    def close(self) -> None:
        for it in self._iterators:
            it.close()


def make_pretraining_iterator(
    config_like: Any,
    tokenizer: Tokenizer,
    *,
    split: str = "train",
    process_index: int = 0,
    process_count: int = 1,
    start_step: int = 0,
    sources: Sequence[DocumentSource] | None = None,
) -> ShardedIterator:
    """Training batches for this host: `next(it)` is the batch of step `it.step`.

    `config_like` is read by `DataConfig.from_config`; `sources` overrides the spec in
    `config.data.sources` (otherwise read through `albert_jax.data.sources`).
    """
    cfg = (
        config_like if isinstance(config_like, DataConfig) else DataConfig.from_config(config_like)
    )
    if sources is None:
        sources = sources_from_spec(cfg.sources, cfg.data_dir)
    return ShardedIterator(
        cfg,
        tokenizer,
        sources,
        split=split,
        process_index=process_index,
        process_count=process_count,
        start_step=start_step,
    )


def padding_batch(
    batch_size: int, seq_len: int, max_predictions_per_seq: int, cls_id: int
) -> dict[str, np.ndarray]:
    """A batch of `batch_size` padding rows: a lone [CLS] (so attention has a key), no
    prediction (`masked_lm_weights` 0) and `example_weight` 0, in the batch contract's dtypes."""
    B, S, P = batch_size, seq_len, max_predictions_per_seq
    input_ids = np.zeros((B, S), np.int32)
    input_ids[:, 0] = cls_id
    input_mask = np.zeros((B, S), np.int32)
    input_mask[:, 0] = 1
    return {
        "input_ids": input_ids,
        "segment_ids": np.zeros((B, S), np.int32),
        "input_mask": input_mask,
        "masked_lm_positions": np.zeros((B, P), np.int32),
        "masked_lm_ids": np.zeros((B, P), np.int32),
        "masked_lm_weights": np.zeros((B, P), np.float32),
        "sentence_order_label": np.zeros((B,), np.int32),
        "example_weight": np.zeros((B,), np.float32),
    }


class EvalBatches:
    """A fixed list of `num_batches` held-out batches of one process: every iteration yields
    the same ones.

    Like `ShardedIterator` (same shards, another seed), plus `example_weight [B] float32`: 1 for
    a real sequence, 0 for padding. A shard whose split holds no document of a source reads the
    other sources only; one with no document at all yields padding rows. So every process runs
    `num_batches` evaluation steps whatever its shards hold, and weighted sums over the steps
    count real sequences only.
    """

    def __init__(
        self,
        cfg: DataConfig,
        tokenizer: Tokenizer,
        sources: Sequence[DocumentSource],
        *,
        split: str,
        num_batches: int,
        process_index: int,
        process_count: int,
    ):
        if num_batches < 1:
            raise ValueError(f"num_batches must be >= 1 (got {num_batches})")
        cfg.validate(process_count)
        self.num_batches = num_batches
        num_shards = cfg.shard_count(process_count)
        self.shards = owned_shards(num_shards, process_index, process_count)
        # In-process building: eval is small, and this keeps no pool alive between evals.
        eval_cfg = DataConfig(**{**asdict(cfg), "num_workers": 0, "num_shards": num_shards})
        self._padding = padding_batch(
            cfg.batch_size // num_shards, cfg.seq_len, cfg.max_predictions_per_seq, tokenizer.cls_id
        )
        self._iterators: list[PretrainingIterator | None] = []
        for shard in self.shards:

            def make(shard_sources: Sequence[DocumentSource], shard: int = shard):
                return PretrainingIterator(
                    eval_cfg,
                    tokenizer,
                    shard_sources,
                    split=split,
                    process_index=shard,
                    process_count=num_shards,
                    seed=cfg.seed + _EVAL_SEED_OFFSET,
                )

            try:
                self._iterators.append(make(sources))
            except EmptyShardError:
                present = [
                    src
                    for src in (sources if len(sources) > 1 else ())
                    if _has_documents(src, tokenizer, eval_cfg, split, shard)
                ]
                self._iterators.append(make(present) if present else None)
        self._starts = [it.get_state() if it else None for it in self._iterators]

    def __len__(self) -> int:
        return self.num_batches

    def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
        for it, start in zip(self._iterators, self._starts, strict=True):
            if it is not None:
                it.set_state(start)
        for _ in range(self.num_batches):
            parts = []
            for it in self._iterators:
                if it is None:
                    parts.append(self._padding)
                    continue
                batch = next(it)
                parts.append(
                    {**batch, "example_weight": np.ones(len(batch["input_ids"]), np.float32)}
                )
            yield _concat(parts)

    def stats(self) -> dict[str, int]:
        out: Counter = Counter()
        for it in self._iterators:
            if it is not None:
                out.update(it.stats())
        out["padding_shards"] = sum(it is None for it in self._iterators)
        return dict(out)


def _has_documents(
    source: DocumentSource, tokenizer: Tokenizer, cfg: DataConfig, split: str, shard: int
) -> bool:
    """Whether `source` has a non-empty document in shard `shard` of `split` (cached)."""
    try:
        load_tokenized(
            source,
            tokenizer,
            split=split,
            shard_index=shard,
            shard_count=cfg.shard_count(),
            cache_dir=_cache_dir(cfg),
        )
    except EmptyShardError:
        return False
    return True


def make_eval_iterator(
    config_like: Any,
    tokenizer: Tokenizer,
    *,
    split: str,
    num_batches: int,
    process_index: int = 0,
    process_count: int = 1,
    sources: Sequence[DocumentSource] | None = None,
) -> EvalBatches:
    """Held-out batches (same shapes as training), identical on every call/iteration."""
    cfg = (
        config_like if isinstance(config_like, DataConfig) else DataConfig.from_config(config_like)
    )
    if sources is None:
        sources = sources_from_spec(cfg.sources, cfg.data_dir)
    return EvalBatches(
        cfg,
        tokenizer,
        sources,
        split=split,
        num_batches=num_batches,
        process_index=process_index,
        process_count=process_count,
    )
