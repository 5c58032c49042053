"""One data shard's batches: `PretrainingIterator` plans each step's rows (streams + mixture)
and `BatchBuilder` turns them into a masked batch, in this process or in worker processes."""

from __future__ import annotations

import hashlib
import json
from collections import Counter, deque
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from albert_jax.data import cache, workers
from albert_jax.data.batches import build_batch
from albert_jax.data.corpus import TokenizedCorpus
from albert_jax.data.data_config import check_shards
from albert_jax.data.streams import TAG_MASK, InstanceStream, Mixture, stable_id

if TYPE_CHECKING:
    from albert_jax.data.data_config import DataConfig, DocumentSource
    from albert_jax.data.tokenizer import Tokenizer

# What `PretrainingIterator.stats()` counts (dropped, repaired or truncated items included): the
# cache build's (`corpus.tokenize_documents`, plus `tokens`), the epochs' instances
# (`instances.create_instances`) and the epochs built.
COUNTERS = (
    "documents",
    "documents_empty",
    "documents_one_sentence",
    "non_utf8_replaced",
    "sentences",
    "sentences_empty_dropped",
    "long_sentences_chunked",
    "tokens",
    "instances",
    "instances_truncated",
    "instances_random_b",
    "instances_split_sentence",
    "instances_unsplittable",
    "epochs",
)


class BatchBuilder:
    """Picklable: (step, source index [B], instance rows [B,6]) -> batch dict.

    Holds the (local) cache directories, not the arrays: a worker process memory-maps them.
    """

    def __init__(
        self,
        cfg: DataConfig,
        tokenizer: Tokenizer,
        corpus_dirs: Sequence[str],
        *,
        mask_key: tuple[int, ...],
        corpora: list[TokenizedCorpus] | None = None,
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
        # The corpora already in memory (this process's), else loaded from `corpus_dirs` on
        # first use (an input worker: a pickled builder carries the dirs, not the arrays).
        self._corpora: list[TokenizedCorpus] | None = corpora

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_corpora"] = None
        return state

    @property
    def corpora(self) -> list[TokenizedCorpus]:
        if self._corpora is None:
            self._corpora = [cache.load_corpus(d) for d in self.corpus_dirs]
        return self._corpora

    def __call__(self, task: tuple[int, np.ndarray, np.ndarray]) -> dict[str, np.ndarray]:
        step, source_index, rows = task
        rng = np.random.default_rng([*self.mask_key, step])
        return build_batch(
            self.corpora,
            source_index,
            rows,
            rng,
            seq_len=self.cfg.seq_len,
            masking_settings=self.cfg.masking,
            word_start=self.word_start,
            **self.ids,
        )


class PretrainingIterator:
    """Endless iterator of the batches of data shard `shard_index` of `num_shards` (the batch
    contract of `data.pipeline`); `ShardedIterator` runs one per shard of a process. Each batch
    holds `batch_size / num_shards` sequences. `cfg` is taken as validated
    (`DataConfig.from_config`); its `num_shards` and `num_workers` are the run's settings, the
    shard and its workers (`num_workers`, default `cfg.num_workers`) are given here.

    `get_state()` returns a JSON-able dict (the shard's part of a `ShardedIterator` state);
    `set_state(state)` makes the next batch the one an uninterrupted run would produce after it.

    Raises:
      cache.EmptyShardError: a source has no document in this shard of `split`.
    """

    def __init__(
        self,
        cfg: DataConfig,
        tokenizer: Tokenizer,
        sources: Sequence[DocumentSource],
        *,
        split: str = "train",
        shard_index: int = 0,
        num_shards: int = 1,
        num_workers: int | None = None,
        start_step: int = 0,
        seed: int | None = None,
    ):
        check_shards(num_shards, 1, cfg.batch_size)
        if not sources:
            raise ValueError("sources is empty: set config.data.sources")
        if not 0 <= shard_index < num_shards:
            raise ValueError(f"shard_index={shard_index} not in [0, {num_shards})")
        if start_step < 0:
            raise ValueError(f"start_step must be >= 0 (got {start_step})")
        names = [s.name for s in sources]
        if len(set(names)) != len(names):
            raise ValueError(f"source names must be unique (got {names})")
        self.cfg = cfg
        self.split = split
        self.shard_index = shard_index
        self.num_shards = num_shards
        self.num_workers = cfg.num_workers if num_workers is None else num_workers
        self.batch_size = cfg.batch_size // num_shards
        self.seed = cfg.seed if seed is None else seed
        self.source_names = names
        cache_dir = cache.cache_dir_for(cfg.cache_dir, cfg.data_dir)
        corpora, dirs, self._build_counters = [], [], []
        for src in sources:
            corpus, counters, path = cache.load_tokenized(
                src,
                tokenizer,
                split=split,
                shard_index=shard_index,
                shard_count=num_shards,
                cache_dir=cache_dir,
                num_workers=self.num_workers,
            )
            corpora.append(corpus)
            dirs.append(path)
            self._build_counters.append(counters)
        self._streams = [
            InstanceStream(
                c, cfg, seed=self.seed, source_id=stable_id(s.name), shard_index=shard_index
            )
            for c, s in zip(corpora, sources, strict=True)
        ]
        self._mixture = Mixture(
            [s.weight for s in sources], seed=self.seed, shard_index=shard_index
        )
        self._builder = BatchBuilder(
            cfg, tokenizer, dirs, mask_key=(self.seed, TAG_MASK, shard_index), corpora=corpora
        )
        self._fingerprint = hashlib.sha256(
            json.dumps(
                [
                    cfg.semantic() | {"seed": self.seed},
                    names,
                    split,
                    shard_index,
                    num_shards,
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
        if self.num_workers == 0:
            task, self._state = self._plan(self._state)
            self._plan_state = self._state
            batch = self._builder(task)
        else:
            if self._pool is None:
                self._pool = workers.WorkerPool(self._builder, self.num_workers)
            while len(self._pending) < self.num_workers * self.cfg.prefetch:
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
        out: Counter = Counter({k: 0 for k in COUNTERS})
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
