"""What the pretraining pipeline is given: its settings (`DataConfig`) and its documents
(`DocumentSource`, or a spec of `albert_jax.data.sources` through `sources_from_spec`)."""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

from albert_jax import files
from albert_jax.data.instances import OBJECTIVES, SINGLE_SEGMENT_MODES
from albert_jax.data.masking import MaskingSettings

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
    # "random_b" (the reference: B from another document, label 1). See instances.py.
    sop_single_segment: str = "split"
    seed: int = 0
    short_seq_prob: float = 0.1
    masked_lm_prob: float = 0.15
    ngram: int = 3  # longest masked n-gram (whole words)
    sources: str = ""  # spec for albert_jax.data.sources.parse_sources
    data_dir: str | None = None  # TFDS data dir
    # Tokenized cache, local or gs://; default: <data_dir>/albert_jax_cache for a local data
    # dir, else the per-host ~/.cache/albert_jax/albert_jax_cache (see data/cache.py).
    cache_dir: str | None = None
    num_workers: int = 0  # batch/tokenization worker processes (0 = in this process)
    prefetch: int = 2  # batches in flight per worker
    # Data shards (0 = one per process). Fixing it makes the global batch independent of the
    # number of processes; it must be a multiple of the process count and divide batch_size.
    num_shards: int = 0

    @classmethod
    def from_config(cls, config: Any, *, process_count: int = 1, **overrides: Any) -> DataConfig:
        """Reads a config-like object (ml_collections / dataclass / dict) and validates it for
        a run of `process_count` processes: the one place a run builds and checks its data
        settings (`pretrain.settings.validate_config`); the iterators take them as they are.

        Each field has one place (`FIELDS`): seq_len, max_predictions_per_seq, batch_size,
        objective and seed at the top level; the sources, the masking (masked_lm_prob,
        max_ngram), short_seq_prob, sop_single_segment and the workers in `config.data`.
        A field the config lacks keeps its default.
        """
        data = _get(config, "data")
        values: dict[str, Any] = {}
        for name, (section, key) in FIELDS.items():
            value = _get(data if section == "data" else config, key)
            if value is not None:
                values[name] = value
        values.update(overrides)
        cfg = cls(**values)
        cfg.validate(process_count)
        return cfg

    @property
    def masking(self) -> MaskingSettings:
        """The masking fields, as `batches.build_batch` takes them."""
        return MaskingSettings(self.max_predictions_per_seq, self.masked_lm_prob, self.ngram)

    def semantic(self) -> dict[str, Any]:
        """The fields that determine the batches (not where files live, how many workers build
        them, or `num_shards`: the shard index and count are fingerprinted on their own)."""
        return {k: v for k, v in asdict(self).items() if k not in _NOT_SEMANTIC}

    def shard_count(self, process_count: int = 1) -> int:
        """Number of data shards of a run with `process_count` processes."""
        return self.num_shards or process_count

    def validate(self, process_count: int = 1) -> None:
        """Raises ValueError naming the first bad field (for a run of `process_count`
        processes: the shard layout of `check_shards`)."""
        if self.objective not in OBJECTIVES:
            raise ValueError(f"objective must be one of {OBJECTIVES} (got {self.objective!r})")
        if self.sop_single_segment not in SINGLE_SEGMENT_MODES:
            raise ValueError(
                f"sop_single_segment must be one of {SINGLE_SEGMENT_MODES} "
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
        if self.num_workers < 0:
            raise ValueError(f"num_workers must be >= 0 (got {self.num_workers})")
        check_shards(self.shard_count(process_count), process_count, self.batch_size)


#: {DataConfig field: (where in a run's config: "top" or "data", the config's name)}.
FIELDS: dict[str, tuple[str, str]] = {
    **{name: ("top", name) for name in (
        "seq_len", "max_predictions_per_seq", "batch_size", "objective", "seed")},
    **{name: ("data", name) for name in (
        "sop_single_segment", "short_seq_prob", "masked_lm_prob", "sources", "data_dir",
        "cache_dir", "num_workers", "prefetch", "num_shards")},
    "ngram": ("data", "max_ngram"),
}  # fmt: skip


def check_shards(num_shards: int, process_count: int, batch_size: int) -> None:
    """Raises ValueError unless `num_shards` data shards can be shared evenly by
    `process_count` processes and split a global batch of `batch_size` sequences evenly."""
    if num_shards < 1 or num_shards % process_count:
        raise ValueError(
            f"num_shards={num_shards} must be a multiple of process_count={process_count}: "
            "every process reads the same number of data shards"
        )
    if batch_size < 1 or batch_size % num_shards:
        raise ValueError(
            f"batch_size={batch_size} must be a positive multiple of the number of data shards "
            f"{num_shards} (process_count={process_count})"
        )


def _get(obj: Any, name: str) -> Any:
    if obj is None:
        return None
    if isinstance(obj, Mapping):
        return obj.get(name)
    try:
        return getattr(obj, name)
    except (AttributeError, KeyError):
        return None


@dataclass(frozen=True)
class DocumentSource:
    """A named, weighted document collection.

    `documents(split, shard_index, shard_count)` yields `{"title", "text"}` dicts of one shard;
    shards of different indices must be disjoint. `name` plus `cache_key` must identify the
    content: they key the tokenized cache. `build_identity()`, when given, names the build
    the documents come from now (a prepared dataset's build id; None where it is not
    prepared): a cache entry tokenized from another build is tokenized again.
    """

    name: str
    weight: float
    documents: Callable[[str, int, int], Iterable[dict]]
    cache_key: str = ""
    build_identity: Callable[[], str | None] | None = None


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

        # The same name may be built from other files or live in another data dir. Local paths
        # are made absolute and gs:// paths kept as they are: the key never depends on the cwd.
        key = json.dumps(
            [[files.absolute(f) for f in src.files], files.absolute(data_dir) if data_dir else None]
        )
        # Called at cache lookup; it never builds (a cache entry needs no dataset to be read).
        identity = functools.partial(tfds_sources.build_identity, src, data_dir)
        out.append(
            DocumentSource(
                src.name, float(src.weight), documents, cache_key=key, build_identity=identity
            )
        )
    return out
