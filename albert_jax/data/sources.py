"""Document sources for pretraining: names -> TFDS datasets of `{"title", "text"}` documents,
built from local files or read from the TFDS catalog (the names and mixture specs:
`source_names`).

CONFIG names the prepared dataset (its folder `<data_dir>/<builder>/<CONFIG>/1.0.0`); it
defaults to `default` (`raw_text` for `raw_text`). A prepared local dataset remembers the
files it was built from and their fingerprints (size, modification time, content hash of
small files: `builders.prepared`): asking for the same name with other files, or with files
that changed since, raises a ValueError instead of silently reading stale data;
`build_source(..., rebuild=True)` (`python -m albert_jax.data.builders --rebuild`) builds it
again from the files as they are now.

The data dir is the `data_dir` argument, else `$TFDS_DATA_DIR` (read at call time), else
TFDS's default `~/tensorflow_datasets`; it may be local or `gs://`. Our builders write
ArrayRecord into a local data dir and TFRecord into a `gs://` one (ArrayRecord's writer opens
local files only); both read the same documents in the same order. With several hosts, build
once (e.g. process 0, or `python -m albert_jax.data.builders`) before the others read.
"""

from __future__ import annotations

__all__ = [  # the names of `source_names` are part of this module's interface
    "CATALOG_WIKIPEDIA", "DEFAULT_CONFIG", "LOCAL_SOURCES", "PRESETS", "Source", "build_identity",
    "build_source", "iter_documents", "num_documents", "parse_sources", "prepare_sources",
]  # fmt: skip

import dataclasses
import os
import re
from collections.abc import Iterator, Sequence

import tensorflow_datasets as tfds
from absl import logging
from tensorflow_datasets.core.dataset_info import DatasetInfoFileError

from albert_jax import files
from albert_jax.data.builders.base import LocalTextBuilder, counters
from albert_jax.data.builders.prepared import (
    build_lock,
    check_inputs,
    delete_prepared,
    recorded_files,
)
from albert_jax.data.builders.text_files import resolve_files
from albert_jax.data.line_reading import DEFAULT_LINE_LIMITS, LineLimits
from albert_jax.data.source_names import (
    CATALOG_WIKIPEDIA,
    DEFAULT_CONFIG,
    LOCAL_SOURCES,
    PRESETS,
    Source,
    _as_source,
    _check_catalog_name,
    _split_local_name,
    parse_sources,
)
from albert_jax.runtime.process_setup import hide_accelerators_from_tensorflow

_READ_CHUNK = 256  # documents fetched per random-access call


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
