"""Document sources for pretraining: names -> TFDS datasets of `{"title", "text"}` documents.

A *source* is a named TFDS dataset with a mixture weight. Names:

| name | dataset | inputs |
|---|---|---|
| `demo` | the corpus shipped in albert_jax/data/demo (builder `albert_demo`) | none |
| `documents[/CONFIG]` | our `documents` builder: JSONL, or one document per text file | files |
| `raw_text[/CONFIG]` | `documents`, official BERT/ALBERT raw-text format (note 1) | files |
| `books[/CONFIG]` | our `books` builder: one document per book `.txt` | files |
| `wikipedia_dump[/CONFIG]` | our `wikipedia_dump` builder: MediaWiki XML dumps | files |
| other, e.g. `wikipedia/20230601.en` | the TFDS catalog dataset, used as is (note 2) | none |

Notes: (1) one sentence per line, a blank line between documents; (2) never downloaded here.

CONFIG names the prepared dataset (its folder `<data_dir>/<builder>/<CONFIG>/1.0.0`); it
defaults to `default` (`raw_text` for `raw_text`). A prepared local dataset remembers the
files it was built from and their fingerprints (size, modification time, content hash of
small files: `builders.prepared`): asking for the same name with other files, or with files
that changed since, raises a ValueError instead of silently reading stale data;
`build_source(..., rebuild=True)` (`python -m albert_jax.data.builders --rebuild`) builds it
again from the files as they are now.

Mixture specs (`parse_sources`): comma-separated `NAME[=FILES][:WEIGHT]`, FILES being
`;`-separated paths, globs or directories, e.g.

    "demo"
    "wikipedia/20230601.en:0.5,books:0.5"
    "books=/data/bookcorpus/*.txt:1,wikipedia_dump=/data/enwiki-latest-pages-articles.xml.bz2:3"

and presets: `wiki_books`, the paper's pretraining data (ALBERT §4.1 and BERT §3.1: English
Wikipedia + BookCorpus). Its weights are proportional to the corpus sizes BERT reports
(Wikipedia 2,500M words, BookCorpus 800M words), i.e. 0.758 / 0.242: the authors trained on
the two corpora concatenated, so each one's share of the training sequences was its share of
the words; drawing each example's source with these weights (as the pipeline does)
reproduces that. Wikipedia is the catalog's `wikipedia/20230601.en`; BookCorpus is not in the
catalog, so `books` must be built from your files first (`build_source(Source("books"),
files=...)`, or the spec `books=/path/*.txt` alongside).

The data dir is the `data_dir` argument, else `$TFDS_DATA_DIR` (read at call time), else
TFDS's default `~/tensorflow_datasets`; it may be local or `gs://`. Our builders write
ArrayRecord into a local data dir and TFRecord into a `gs://` one (ArrayRecord's writer opens
local files only); both read the same documents in the same order. With several hosts, build
once (e.g. process 0, or `python -m albert_jax.data.builders`) before the others read.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from collections.abc import Iterator, Sequence

import tensorflow_datasets as tfds
from absl import logging
from tensorflow_datasets.core.dataset_info import DatasetInfoFileError

from albert_jax import files
from albert_jax.data.builders.base import LocalTextBuilder, counters
from albert_jax.data.builders.books import Books, BooksConfig
from albert_jax.data.builders.demo import Demo
from albert_jax.data.builders.documents import Documents, DocumentsConfig
from albert_jax.data.builders.prepared import (
    build_lock,
    check_inputs,
    delete_prepared,
    recorded_files,
)
from albert_jax.data.builders.text_files import resolve_files
from albert_jax.data.builders.wikipedia_dump import WikipediaDump, WikipediaDumpConfig
from albert_jax.data.line_reading import DEFAULT_LINE_LIMITS, LineLimits
from albert_jax.runtime.process_setup import hide_accelerators_from_tensorflow

CATALOG_WIKIPEDIA = "wikipedia/20230601.en"
# BERT §3.1: "BooksCorpus (800M words) and English Wikipedia (2,500M words)".
PRESETS: dict[str, tuple[tuple[str, float], ...]] = {
    "wiki_books": ((CATALOG_WIKIPEDIA, 2500.0), ("books", 800.0)),
}
DEFAULT_CONFIG = "default"
_READ_CHUNK = 256  # documents fetched per random-access call


@dataclasses.dataclass(frozen=True)
class _Local:
    """How one of our source names maps to a builder."""

    builder: type[LocalTextBuilder]
    config_cls: type | None  # None: the builder has its own fixed config (demo)
    default_config: str
    config_fields: tuple[tuple[str, str], ...] = ()


_LOCAL: dict[str, _Local] = {
    "demo": _Local(Demo, None, DEFAULT_CONFIG),
    "documents": _Local(Documents, DocumentsConfig, DEFAULT_CONFIG),
    "raw_text": _Local(
        Documents, DocumentsConfig, "raw_text", (("text_format", "sentence_per_line"),)
    ),
    "books": _Local(Books, BooksConfig, DEFAULT_CONFIG),
    "wikipedia_dump": _Local(WikipediaDump, WikipediaDumpConfig, DEFAULT_CONFIG),
}
LOCAL_SOURCES = tuple(_LOCAL)

_NUMBER = re.compile(r"[+-]?(\d+(\.\d*)?|\.\d+)([eE][+-]?\d+)?")
_CONFIG_NAME = re.compile(r"[A-Za-z0-9_.-]+")


@dataclasses.dataclass(frozen=True)
class Source:
    """One document source of a pretraining mixture.

    Attributes:
      name: `demo`, `documents[/CONFIG]`, `raw_text[/CONFIG]`, `books[/CONFIG]`,
        `wikipedia_dump[/CONFIG]`, or a TFDS catalog name such as `wikipedia/20230601.en`.
      weight: sampling weight (> 0); `parse_sources` normalizes a mixture's weights to sum 1.
      files: input paths / globs / directories for our builders (used when the dataset is not
        prepared yet); empty for `demo` and catalog datasets.
    """

    name: str
    weight: float = 1.0
    files: tuple[str, ...] = ()

    def __post_init__(self):
        if isinstance(self.files, str):
            object.__setattr__(self, "files", (self.files,))
        else:
            object.__setattr__(self, "files", tuple(os.fspath(f) for f in self.files))
        if not self.name or self.name != self.name.strip():
            raise ValueError(f"name: must be a non-empty name without spaces, got {self.name!r}")
        if not (math.isfinite(self.weight) and self.weight > 0):
            raise ValueError(
                f"weight of {self.name!r} must be a finite number > 0, got {self.weight}"
            )

    @property
    def is_local(self) -> bool:
        """True for our builders (built from local files), False for TFDS catalog datasets."""
        return self.name.split("/", 1)[0] in _LOCAL


def _split_local_name(name: str) -> tuple[_Local, str]:
    base, _, config = name.partition("/")
    local = _LOCAL[base]
    if not config:
        return local, local.default_config
    if local.config_cls is None:
        raise ValueError(f"source {name!r}: {base!r} has no configs; use {base!r}")
    if not _CONFIG_NAME.fullmatch(config):
        raise ValueError(
            f"source {name!r}: config name {config!r} may only use letters, digits, '_', '.', '-'"
        )
    return local, config


def _check_catalog_name(name: str) -> None:
    """Raises ValueError unless `name` is a TFDS catalog dataset (and config) name."""
    dataset, _, config = name.partition(":")[0].partition("/")
    try:
        builder_cls = tfds.builder_cls(dataset)
    except tfds.core.registered.DatasetNotFoundError:
        raise ValueError(
            f"unknown source {name!r}: not one of ours {sorted(_LOCAL)}, a preset "
            f"{sorted(PRESETS)}, or a TFDS catalog dataset. Write NAME[=FILES][:WEIGHT]."
        ) from None
    configs = {c.name for c in builder_cls.BUILDER_CONFIGS or ()}
    if config and configs and config not in configs:
        raise ValueError(f"unknown source {name!r}: TFDS {dataset!r} has no config {config!r}")


def _parse_item(item: str) -> list[Source]:
    head, colon, tail = item.rpartition(":")
    weight = 1.0
    if colon and _NUMBER.fullmatch(tail.strip()):
        item, weight = head, float(tail)
    if weight <= 0:
        raise ValueError(f"sources: weight of {item!r} must be > 0, got {weight:g}")
    name, equals, file_list = (part.strip() for part in item.partition("="))
    files = tuple(f.strip() for f in file_list.split(";") if f.strip())
    if not name:
        raise ValueError(f"sources: {item!r} has no source name")
    if equals and not files:
        raise ValueError(f"sources: {name!r} has '=' but no files after it")
    if name in PRESETS:
        if files:
            raise ValueError(f"sources: preset {name!r} takes no files; list its parts instead")
        # The preset's parts share its weight in their own proportions.
        preset_total = math.fsum(w for _, w in PRESETS[name])
        return [Source(part, weight * w / preset_total) for part, w in PRESETS[name]]
    if name.split("/", 1)[0] in _LOCAL:
        local, _ = _split_local_name(name)
        if files and local.config_cls is None:
            raise ValueError(f"sources: {name!r} takes no files")
    else:
        _refuse_a_path(name)
        _check_catalog_name(name)
        if files:
            raise ValueError(
                f"sources: catalog dataset {name!r} takes no files; for local files use "
                f"one of {sorted(n for n in _LOCAL if n != 'demo')}"
            )
    return [Source(name, weight, files)]


_FILE_SUFFIXES = (".jsonl", ".json", ".gz", ".txt", ".bz2", ".xml", ".text")


def _refuse_a_path(name: str) -> None:
    """A file path given where a source name goes (`sources=/data/*.jsonl`) is named as such,
    with the local kinds that read files, instead of TFDS's grammar of dataset names."""
    looks_like_path = (
        name.startswith(("/", ".", "~")) or "*" in name or "://" in name
        or name.lower().endswith(_FILE_SUFFIXES)
    )  # fmt: skip
    if not looks_like_path:
        return
    try:
        found = bool(files.expand(name))
    except (ValueError, OSError):  # no match, or no such file
        found = False
    what = "a path" if found else "a path, and no such file exists"
    raise ValueError(
        f"sources: {name!r} is {what}, not a source name; name the kind of its files: "
        f"documents={name} (JSON Lines with a 'text' field) or raw_text={name} (plain text), "
        f"or another local kind of {sorted(n for n in _LOCAL if n != 'demo')}"
    )


def parse_sources(spec: str) -> list[Source]:
    """Parses a mixture spec into sources whose weights sum to 1.

    Args:
      spec: comma-separated `NAME[=FILES][:WEIGHT]` items (see the module docstring), e.g.
        `"wikipedia/20230601.en:0.5,books:0.5"`, `"demo"`, `"wiki_books"`.

    Raises:
      ValueError: empty spec or item, unknown name, weight <= 0 or not finite, files given
        to a source that takes none, or the same source twice.
    """
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"sources: empty spec {spec!r}; e.g. 'demo' or 'wiki_books'")
    sources: list[Source] = []
    for item in spec.split(","):
        if not item.strip():
            raise ValueError(f"sources: empty item in {spec!r} (stray comma?)")
        sources.extend(_parse_item(item.strip()))
    names = [s.name for s in sources]
    if duplicates := sorted({n for n in names if names.count(n) > 1}):
        raise ValueError(f"sources: {duplicates} listed more than once in {spec!r}")
    total = math.fsum(s.weight for s in sources)
    if not math.isfinite(total):
        raise ValueError(f"sources: weights in {spec!r} are too large")
    return [dataclasses.replace(s, weight=s.weight / total) for s in sources]


def _as_source(source: Source | str) -> Source:
    if isinstance(source, Source):
        return source
    parsed = parse_sources(source)
    if len(parsed) != 1:
        raise ValueError(f"source: {source!r} names {len(parsed)} sources; pass exactly one")
    return dataclasses.replace(parsed[0], weight=1.0)


def _resolve_data_dir(data_dir: str | os.PathLike | None) -> str | None:
    # TFDS reads $TFDS_DATA_DIR once, at import; reading it here honours later changes.
    if data_dir is not None:
        return os.fspath(data_dir)
    return os.environ.get("TFDS_DATA_DIR") or None


def _local_builder(
    source: Source,
    data_dir: str | None,
    files: tuple[str, ...],
    limits: LineLimits | None = None,
) -> LocalTextBuilder:
    local, config_name = _split_local_name(source.name)
    if local.config_cls is None:
        return local.builder(data_dir=data_dir)
    bounds = dataclasses.asdict(limits or DEFAULT_LINE_LIMITS)
    config = local.config_cls(name=config_name, files=files, **dict(local.config_fields), **bounds)
    return local.builder(config=config, data_dir=data_dir)


def build_source(
    source: Source | str,
    *,
    data_dir: str | os.PathLike | None = None,
    files: str | Sequence[str] | None = None,
    rebuild: bool = False,
    limits: LineLimits | None = None,
) -> tfds.core.DatasetBuilder:
    """Returns the dataset builder of `source`, preparing our local datasets if needed.

    Args:
      source: a `Source` (or a one-source spec such as `"books/austen"`).
      data_dir: TFDS data dir; None: `$TFDS_DATA_DIR`, else `~/tensorflow_datasets`.
      files: inputs of our builders (paths, globs, directories); overrides `source.files`.
        Not needed once the dataset is prepared; if given, they must be the files it was
        built from, unchanged since (size and modification time, or content for files up to
        64 MiB: see `builders.prepared`).
      rebuild: delete the prepared dataset (this version of it) and build it again from
        `files` (default: the files it was built from). Under the build lock in a local data
        dir; nothing may read the dataset meanwhile. Our local sources only.
      limits: the bounds of reading the input files when it is built (config.data.
        max_line_bytes / max_blank_lines; default `line_reading.DEFAULT_LINE_LIMITS`); not part of
        the dataset's identity (see `LocalTextConfig`).

    Returns:
      A `tfds.core.DatasetBuilder`. Our datasets are prepared (ArrayRecord in a local data dir,
      TFRecord in a `gs://` one: see `builders.base.file_format_for`); catalog datasets
      (`wikipedia/20230601.en`) are returned as `tfds.builder(name, data_dir=...)` gives them,
      prepared or not: this function never downloads.

    Raises:
      ValueError: unknown name, files for a source that takes none, no files for an unprepared
        local dataset, rebuild of a catalog dataset, or a prepared dataset built from other
        files or from files that changed since (the message says how to rebuild it).
    """
    source = _as_source(source)
    data_dir = _resolve_data_dir(data_dir)
    if not source.is_local:
        if files:
            raise ValueError(f"files: catalog dataset {source.name!r} takes no files")
        if rebuild:
            raise ValueError(f"rebuild: catalog dataset {source.name!r} is never built here")
        _check_catalog_name(source.name)
        hide_accelerators_from_tensorflow()  # catalog datasets are TFRecord: read by TF
        return tfds.builder(source.name, data_dir=data_dir)
    given = (files,) if isinstance(files, str) else tuple(files or source.files)
    builder = _local_builder(source, data_dir, given, limits)
    if rebuild:
        return _rebuild(source, builder, data_dir, given, limits)
    if builder.is_prepared():
        # Only files the caller named are compared: a name alone means "use what is there".
        check_inputs(builder, source.name, given, data_dir)
        return builder
    if not builder.config.files:
        raise ValueError(
            f"files: {source.name!r} is not prepared in {builder.data_dir} and has no input "
            f"files; pass build_source(..., files=...) or the spec '{source.name}=/path/...'"
        )
    with build_lock(builder):
        # Another process may have built it while we waited: look at the disk again.
        builder = _local_builder(source, data_dir, given, limits)
        if builder.is_prepared():
            check_inputs(builder, source.name, given, data_dir)
            return builder
        builder.download_and_prepare()
    logging.info("built %s at %s: %s", source.name, builder.data_dir, counters(builder))
    return builder


def _rebuild(
    source: Source,
    builder: LocalTextBuilder,
    data_dir: str | None,
    given: tuple[str, ...],
    limits: LineLimits | None,
) -> LocalTextBuilder:
    """`build_source(..., rebuild=True)`: delete the prepared version, build it again."""
    if not given and builder.is_prepared():
        given = recorded_files(builder)
        builder = _local_builder(source, data_dir, given, limits)
    if not builder.config.files:
        raise ValueError(
            f"files: cannot rebuild {source.name!r} in {builder.data_dir}: no input files "
            f"given or recorded; pass the spec '{source.name}=/path/...'"
        )
    # The inputs must exist before the old dataset goes (a typo must not cost the dataset).
    resolve_files(builder.config.files, builder.FILE_SUFFIXES)
    with build_lock(builder):
        delete_prepared(builder)
        # A new builder: the old one holds the deleted dataset's info and file format.
        builder = _local_builder(source, data_dir, given, limits)
        builder.download_and_prepare()
    logging.info("rebuilt %s at %s: %s", source.name, builder.data_dir, counters(builder))
    return builder


def build_identity(source: Source | str, data_dir: str | os.PathLike | None = None) -> str | None:
    """The build id of the prepared dataset of `source` (new with every build of ours; "" for
    catalog datasets and ours prepared before builds had one), or None where it is not
    prepared. Never builds. What is derived from a dataset (the tokenized cache) records it."""
    source = _as_source(source)
    if not source.is_local:
        return ""
    try:
        builder = _local_builder(source, _resolve_data_dir(data_dir), source.files)
    except DatasetInfoFileError as e:
        # Seen on object stores just after a deletion (TF's gs:// listing cache): unknown.
        logging.warning("%s: cannot read its dataset info (%s); taken as not prepared", source, e)
        return None
    if not builder.is_prepared():
        return None
    return str((builder.info.metadata or {}).get("build_id", ""))


def _prepared_builder(source: Source, data_dir: str | None) -> tfds.core.DatasetBuilder:
    builder = build_source(source, data_dir=data_dir)
    if not builder.is_prepared():  # only catalog datasets get here unprepared
        raise ValueError(
            f"source {source.name!r} is not prepared in {builder.data_dir}: build it with "
            f"`tfds build {source.name} --data_dir=...`, or point data_dir at a prepared copy "
            "(e.g. gs://tfds-data/datasets)"
        )
    return builder


def num_documents(
    source: Source | str, split: str = "train", data_dir: str | os.PathLike | None = None
) -> int:
    """Number of documents in `split` of `source` (prepares our datasets if needed)."""
    builder = _prepared_builder(_as_source(source), _resolve_data_dir(data_dir))
    if split not in builder.info.splits:
        raise ValueError(f"split: {split!r} not in {sorted(builder.info.splits)}")
    return builder.info.splits[split].num_examples


def iter_documents(
    source: Source | str,
    *,
    split: str = "train",
    data_dir: str | os.PathLike | None = None,
    shard_index: int = 0,
    shard_count: int = 1,
    start: int = 0,
) -> Iterator[dict[str, str]]:
    """Streams `{"title": str, "text": str}` documents of one shard of a split, in order.

    The order is the dataset's record order, the same on every run and for both file formats
    (ArrayRecord is read through `tfds.data_source`, TFRecord through `as_dataset` with one
    file at a time). `tfds.even_splits` cuts the split into `shard_count` contiguous,
    disjoint shards that together cover every document (sizes differ by at most one).

    Args:
      source: a `Source` or a one-source spec.
      split: `train`, `validation`, or any TFDS split string (`train[:1000]`).
      data_dir: TFDS data dir (None: `$TFDS_DATA_DIR`, else TFDS's default).
      shard_index: this reader's shard, usually `jax.process_index()`.
      shard_count: number of shards, usually `jax.process_count()`.
      start: documents of the shard to skip (resuming a pass); random access for ArrayRecord.

    Returns:
      An iterator of dicts with the `title` and `text` of one document, as Python `str`. The
      arguments are checked (and our datasets prepared) when called, not when iterated.
    """
    if not 0 <= shard_index < shard_count:
        raise ValueError(
            f"shard_index must be in [0, shard_count={shard_count}), got {shard_index}"
        )
    if start < 0:
        raise ValueError(f"start must be >= 0, got {start}")
    builder = _prepared_builder(_as_source(source), _resolve_data_dir(data_dir))
    base_split = re.split(r"[\[+]", split, maxsplit=1)[0]
    if base_split not in builder.info.splits:
        raise ValueError(f"split: {base_split!r} not in {sorted(builder.info.splits)}")
    shard = tfds.even_splits(split, n=shard_count)[shard_index]
    # Everything above runs at call time (errors surface here); reading starts on iteration.
    return _read_shard(builder, shard, start)


def _read_shard(
    builder: tfds.core.DatasetBuilder, shard: str, start: int
) -> Iterator[dict[str, str]]:
    if builder.info.splits[shard].num_examples == 0:
        return  # more shards than documents: ArrayRecord cannot open a slice of no file
    formats = {builder.info.file_format, *builder.info.alternative_file_formats}
    if tfds.core.FileFormat.ARRAY_RECORD in formats:
        records = builder.as_data_source(shard, file_format="array_record")
        for first in range(start, len(records), _READ_CHUNK):
            chunk = range(first, min(first + _READ_CHUNK, len(records)))
            for record in records.__getitems__(list(chunk)):
                yield {"title": files.text(record["title"]), "text": files.text(record["text"])}
        return
    read_config = tfds.ReadConfig(interleave_cycle_length=1)  # files in order: stable order
    dataset = builder.as_dataset(split=shard, shuffle_files=False, read_config=read_config)
    for record in tfds.as_numpy(dataset.skip(start)):
        yield {"title": files.text(record["title"]), "text": files.text(record["text"])}


def prepare_sources(
    spec: str | Sequence[Source],
    *,
    data_dir: str | os.PathLike | None = None,
    rebuild: bool = False,
    limits: LineLimits | None = None,
) -> list[dict[str, object]]:
    """Builds the local sources of a mixture (run once, on one process) and reports on each.

    Args:
      spec: a mixture spec (see `parse_sources`) or parsed sources.
      data_dir: TFDS data dir (None: `$TFDS_DATA_DIR`, else TFDS's default).
      rebuild: rebuild our local sources from their files (see `build_source`); catalog
        datasets are reported as they are.
      limits: the bounds of reading their files (see `build_source`).

    Returns:
      One dict per source: `source`, `weight`, `data_dir`, `prepared`, and once prepared
      `splits` ({split: documents}); for our builders also `counters` (see `counters`).
    """
    mixture = parse_sources(spec) if isinstance(spec, str) else list(spec)
    reports: list[dict[str, object]] = []
    for source in mixture:
        builder = build_source(
            source, data_dir=data_dir, rebuild=rebuild and source.is_local, limits=limits
        )
        report: dict[str, object] = {
            "source": source.name,
            "weight": source.weight,
            "data_dir": os.fspath(builder.data_dir),
            "prepared": builder.is_prepared(),
        }
        if builder.is_prepared():
            report["splits"] = {k: v.num_examples for k, v in builder.info.splits.items()}
        if source.is_local:
            report["counters"] = counters(builder)
        reports.append(report)
    return reports
