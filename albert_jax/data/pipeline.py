"""Deterministic, resumable, per-host pretraining batches.

The data is cut into `num_shards` shards (`config.data.num_shards`; 0 = one per process). The
global batch of step `s` is the concatenation, in shard order, of the shards' batches, and the
batch of shard `i` is a pure function of `(seed, s, i, num_shards)` (and of the config and
data). Process `p` of `n` reads the contiguous shards `[p·k, (p+1)·k)`, `k = num_shards / n`
(`ShardedIterator`), so the global batch does not depend on the number of processes: one
process with two shards sees exactly the batches that two processes with one shard each see
together, and a checkpoint of one layout resumes in the other.

One shard (`PretrainingIterator`, shard `shard_index` of `num_shards`):

* **Tokenized cache** (`cache.py`). Each source's documents of the shard
  (`iter_documents(..., shard_index=i, shard_count=num_shards)`, so shards hold disjoint
  documents) are sentence-split and tokenized once into `.npy` files under
  `cache_dir/<source>.<inputs hash>.<split>.<i>-of-<n>.<tokenizer hash>.v<version>/`, local or
  `gs://` (a marker file written last commits an entry: racing processes are safe). Later runs
  memory-map them.
* **Epochs.** Source `k`'s instance stream is the concatenation of epochs; epoch `e` is
  `instances.create_instances` with a generator seeded by `(seed, k, i, e)`, i.e. new
  instance boundaries, SOP swaps and random B segments each epoch (like `dupe_factor`, but
  unbounded), shuffled.
* **Mixture.** Example slot `j = s * b + r` (b = per-shard batch) draws its source from a
  generator seeded per block of 65536 slots with `(seed, i, block)`; so the number of examples
  each source has served before any step is computable without replaying the run.
* **Masking.** The n-gram masks of step `s` are drawn from a generator seeded by
  `(seed, i, s)`: every visit of an instance gets a fresh mask, and the batch does not depend on
  the number of worker processes (a worker builds whole batches).

The position is the iterator's own: `ShardedIterator.get_state()` is `{"step", "num_shards",
"shards": {"<i>": state of shard i}}`, a small JSON-able dict (per shard the next step, and per
source the examples served and the current epoch and its first position, so a restore does not
rebuild earlier epochs). The processes' states merged (`merge_states`) are what a checkpoint
saves, and `ShardedIterator.restore` positions a run from one, on any number of processes that
can share its shards. Without a usable state, `start_step=k` reaches the same position by
counting (it rebuilds the epoch tables up to there, which is cheap for small corpora).

Held-out batches (`EvalBatches`) come from the same machinery with another seed; a shard
without held-out documents (more shards than validation documents) yields padding rows with
`example_weight` 0, so every process runs the same number of evaluation steps.

Modules: `data_config` (DataConfig, DocumentSource), `cache` (the tokenized cache), `streams`
(instance streams, mixture), `shard` (PretrainingIterator, BatchBuilder), and this one (the
process's shards and their position, evaluation batches).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
from absl import logging

from albert_jax.data import cache
from albert_jax.data.data_config import DataConfig, DocumentSource, check_shards, sources_from_spec
from albert_jax.data.shard import PretrainingIterator

if TYPE_CHECKING:
    from albert_jax.data.tokenizer import Tokenizer

_EVAL_SEED_OFFSET = 0x5EED


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

    Process `process_index` of `process_count` reads shards `owned_shards(...)` of `num_shards`
    (default: `cfg.shard_count(process_count)`; a resumed run keeps its checkpoint's, see
    `restore`); each batch holds `batch_size / process_count` sequences, rows of shard i before
    those of shard i+1. The global batch (all processes' batches in process order) depends on
    `num_shards`, never on `process_count`. `cfg` is taken as validated
    (`DataConfig.from_config`).

    `get_state()` is `{"step", "num_shards", "shards": {"<i>": state of shard i}}` for the
    owned shards; `merge_states` of every process's is the state a checkpoint saves.
    `set_state` accepts such a state holding (at least) the owned shards.
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
        num_shards: int = 0,
        start_step: int = 0,
        seed: int | None = None,
    ):
        self.num_shards = num_shards or cfg.shard_count(process_count)
        check_shards(self.num_shards, process_count, cfg.batch_size)
        self.shards = owned_shards(self.num_shards, process_index, process_count)
        self.batch_size = cfg.batch_size // process_count
        # Worker processes are split between the shards (each shard builds whole batches).
        workers_per_shard = -(-cfg.num_workers // len(self.shards)) if cfg.num_workers else 0
        self._iterators: list[PretrainingIterator] = []
        try:
            for shard_index in self.shards:
                self._iterators.append(
                    PretrainingIterator(
                        cfg,
                        tokenizer,
                        sources,
                        split=split,
                        shard_index=shard_index,
                        num_shards=self.num_shards,
                        num_workers=workers_per_shard,
                        start_step=start_step,
                        seed=seed,
                    )
                )
        except BaseException:
            self.close()
            raise
        self._batches = 0

    @classmethod
    def restore(
        cls,
        cfg: DataConfig,
        tokenizer: Tokenizer,
        sources: Sequence[DocumentSource],
        *,
        step: int,
        saved: Any,
        process_index: int = 0,
        process_count: int = 1,
    ) -> ShardedIterator:
        """The training iterator of a run after `step` steps, from `saved`: the data state of
        its checkpoint (None for a fresh run).

        The number of shards is `cfg.num_shards` when set, else the checkpoint's when the
        processes can share it (so that a run resumed on another number of processes keeps its
        data order), else one per process. The position comes from the saved shard states
        when they fit (O(1)); otherwise (another data config, another shard count, no state)
        it is counted at `step`, which gives the same batches (the batch of a step is a pure
        function of the step).

        `saved` is a state of `get_state`'s format; anything else (the list-of-states formats
        early checkpoints held among them) is counted, which resumes on the same batches.
        """
        state = _as_state(saved)
        num_shards = _num_shards(
            cfg, state["num_shards"] if state else None, process_count=process_count
        )
        where = dict(process_index=process_index, process_count=process_count)
        iterator = cls(cfg, tokenizer, sources, num_shards=num_shards, **where)
        if state is None and step == 0:
            return iterator  # a fresh run
        if state is not None and state["num_shards"] == num_shards:
            try:
                iterator.set_state(state)
                if iterator.step == step:
                    return iterator
                logging.warning("saved data state is at step %d, not %d", iterator.step, step)
            except ValueError as e:
                logging.warning("saved data state not usable (%s)", e)
        logging.warning("recomputing the input position of step %d", step)
        iterator.close()
        return cls(cfg, tokenizer, sources, num_shards=num_shards, start_step=step, **where)

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


def merge_states(states: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """The `ShardedIterator` states of every process of a run -> one state of all its shards
    (what a checkpoint saves; every process must be at the same step).

    Raises:
      ValueError: the states disagree on the number of shards or the step.
    """
    states = list(states)
    layouts = {(s["num_shards"], s["step"]) for s in states}
    if len(layouts) != 1:
        raise ValueError(f"merge_states: (num_shards, step) differ: {sorted(layouts)}")
    shards: dict[str, Any] = {}
    for state in states:
        shards.update(state["shards"])
    [(num_shards, step)] = layouts
    ordered = sorted(shards.items(), key=lambda item: int(item[0]))
    return {"step": step, "num_shards": num_shards, "shards": dict(ordered)}


def _as_state(saved: Any) -> dict[str, Any] | None:
    """A checkpoint's data item as a `ShardedIterator` state, or None when it holds none of
    `get_state`'s format (the position is then counted: the same batches)."""
    if isinstance(saved, Mapping) and saved.get("shards") and saved.get("num_shards"):
        return dict(saved)
    return None


def _num_shards(cfg: DataConfig, saved: int | None, *, process_count: int) -> int:
    """The number of data shards of a run (see `ShardedIterator.restore`)."""
    if cfg.num_shards:
        if saved and saved != cfg.num_shards:
            logging.warning(
                "config.data.num_shards=%d but the checkpoint's data has %d shards: the data "
                "order changes from here on", cfg.num_shards, saved
            )  # fmt: skip
        return cfg.num_shards
    if not saved:
        return process_count
    try:
        check_shards(saved, process_count, cfg.batch_size)
        return saved
    except ValueError as e:
        logging.warning(
            "the checkpoint's data has %d shards, which this run cannot use (%s): using %d "
            "shards, one per process, so the data order changes from here on (set "
            "config.data.num_shards to a multiple of the process count that divides the batch "
            "size to avoid this)", saved, e, process_count
        )  # fmt: skip
        return process_count


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

    `config_like` is a `DataConfig` or a config `DataConfig.from_config` reads; `sources`
    overrides the spec in `config.data.sources` (otherwise read through
    `albert_jax.data.sources`).
    """
    cfg = _data_config(config_like, process_count)
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
    prediction (`masked_lm_weights` 0), `pair_kind` -1 (no kind of `instances.PAIR_KINDS`)
    and `example_weight` 0, in the batch contract's dtypes."""
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
        "pair_kind": np.full((B,), -1, np.int32),
        "example_weight": np.zeros((B,), np.float32),
    }


class EvalBatches:
    """A fixed list of `num_batches` held-out batches of one process: every iteration yields
    the same ones.

    Like `ShardedIterator` (same shards, another seed; `num_shards` 0:
    `cfg.shard_count(process_count)`), built in this process (eval is small, and this keeps no
    worker pool alive between evaluations), plus `example_weight [B] float32`: 1 for a real
    sequence, 0 for padding. A shard whose split holds no document of a source reads the
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
        num_shards: int = 0,
    ):
        if num_batches < 1:
            raise ValueError(f"num_batches must be >= 1 (got {num_batches})")
        self.num_batches = num_batches
        num_shards = num_shards or cfg.shard_count(process_count)
        check_shards(num_shards, process_count, cfg.batch_size)
        self.shards = owned_shards(num_shards, process_index, process_count)
        self._padding = padding_batch(
            cfg.batch_size // num_shards, cfg.seq_len, cfg.max_predictions_per_seq, tokenizer.cls_id
        )
        self._iterators: list[PretrainingIterator | None] = []
        for shard_index in self.shards:

            def make(shard_sources: Sequence[DocumentSource], shard_index: int = shard_index):
                return PretrainingIterator(
                    cfg,
                    tokenizer,
                    shard_sources,
                    split=split,
                    shard_index=shard_index,
                    num_shards=num_shards,
                    num_workers=0,
                    seed=cfg.seed + _EVAL_SEED_OFFSET,
                )

            try:
                self._iterators.append(make(sources))
            except cache.EmptyShardError:
                present = [
                    src
                    for src in (sources if len(sources) > 1 else ())
                    if _has_documents(src, tokenizer, cfg, split, shard_index, num_shards)
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
    source: DocumentSource,
    tokenizer: Tokenizer,
    cfg: DataConfig,
    split: str,
    shard_index: int,
    num_shards: int,
) -> bool:
    """Whether `source` has a non-empty document in shard `shard_index` of `num_shards` of
    `split` (cached)."""
    try:
        cache.load_tokenized(
            source,
            tokenizer,
            split=split,
            shard_index=shard_index,
            shard_count=num_shards,
            cache_dir=cache.cache_dir_for(cfg.cache_dir, cfg.data_dir),
        )
    except cache.EmptyShardError:
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
    """Held-out batches (same shapes as training), identical on every call/iteration;
    `config_like` and `sources` as in `make_pretraining_iterator`."""
    cfg = _data_config(config_like, process_count)
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


def _data_config(config_like: Any, process_count: int) -> DataConfig:
    if isinstance(config_like, DataConfig):
        return config_like
    return DataConfig.from_config(config_like, process_count=process_count)
