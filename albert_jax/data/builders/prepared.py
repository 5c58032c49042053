"""A prepared dataset and the inputs it was built from: fingerprints, the staleness check,
the build lock.

A dataset our builders prepare records in its metadata (`metadata.json` beside
`dataset_info.json`):

- `files`: the resolved input files (sorted, absolute or `gs://`);
- `inputs`: a fingerprint of each file: `size`, `mtime_ns` (modification time; whole seconds
  on object stores), and for files up to `HASH_LIMIT` bytes their `sha256`;
- `build_id`: new for every build, so that what is derived from one build (the tokenized
  cache) is never taken for another build's.

`check_inputs` compares the files given now with that record. A file counts as unchanged when
its size and modification time are the recorded ones (nothing is read), or when a small
file's content hash is (a copy, a `touch`); only small files with a new time are read, so a
check of a big corpus costs one `stat` per file, and a build hashes small files only.
Datasets prepared before fingerprints were recorded cannot be checked: they load with a
warning.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shlex
import uuid
from collections.abc import Iterator, Sequence
from typing import Any

from absl import logging

from albert_jax import files
from albert_jax.data.builders.text_files import resolve_files

HASH_LIMIT = 64 << 20  # bytes: files up to this size are hashed (a copy still matches)
_warned_unchecked: set[str] = set()  # datasets already warned about (once per process)


def fingerprint(paths: Sequence[str]) -> list[dict[str, Any]]:
    """The fingerprint of each input file (see the module docstring), in the given order."""
    out = []
    for path in paths:
        size, mtime_ns = files.stat(path)
        record: dict[str, Any] = {"path": path, "size": size, "mtime_ns": mtime_ns}
        if size <= HASH_LIMIT:
            record["sha256"] = files.sha256(path)
        out.append(record)
    return out


def new_build_id() -> str:
    """A fresh identity for one build of a dataset."""
    return uuid.uuid4().hex


def changed_inputs(recorded: Sequence[dict[str, Any]], paths: Sequence[str]) -> list[str]:
    """What changed in each file of `paths` since `recorded` (its fingerprint) was taken:
    one "PATH: what changed" line per changed file; empty when nothing did."""
    by_path = {r["path"]: r for r in recorded}
    changes = []
    for path in paths:
        was = by_path.get(path)
        if was is None:
            changes.append(f"{path}: not an input of the build")
            continue
        size, mtime_ns = files.stat(path)
        if size != was["size"]:
            changes.append(f"{path}: size changed ({was['size']} -> {size} bytes)")
        elif mtime_ns == was["mtime_ns"]:
            continue  # same size and time: taken as unchanged without reading it
        elif "sha256" in was:
            # A new time on a small file: its content decides (a copy or `touch` is fine).
            if files.sha256(path) != was["sha256"]:
                changes.append(f"{path}: content changed (same size, other sha256)")
        else:
            changes.append(
                f"{path}: modification time changed (size unchanged; files over "
                f"{HASH_LIMIT >> 20} MiB are not hashed, so their time decides)"
            )
    return changes


def _rebuild_hint(source_name: str, patterns: Sequence[str], data_dir: str | None) -> str:
    spec = f"{source_name}={';'.join(patterns)}" if patterns else source_name
    command = f"python -m albert_jax.data.builders --sources={shlex.quote(spec)}"
    if data_dir:
        command += f" --data_dir={shlex.quote(data_dir)}"
    return (
        f"rebuild it from the files as they are now with `{command} --rebuild` (or "
        f"build_source(..., rebuild=True)), or pick another config name (e.g. "
        f"'{source_name.split('/')[0]}/mine') to keep both"
    )


def check_inputs(
    builder: Any,
    source_name: str,
    patterns: Sequence[str],
    data_dir: str | None,
) -> None:
    """Refuses a prepared dataset that was built from other inputs than `patterns` name now.

    Args:
      builder: a prepared `LocalTextBuilder`.
      source_name: the source's name, for the message (e.g. `documents/mut`).
      patterns: the input files given now (paths, globs, directories); empty: nothing to
        compare (the prepared dataset is used as it is).
      data_dir: the data dir as given (None: the default), for the rebuild command.

    Raises:
      ValueError: built with another config, from another list of files, or from files that
        changed since (naming the dataset, the first changed file, what changed, and the fix).
    """
    metadata = builder.info.metadata or {}
    where = f"{source_name} at {builder.data_dir}"
    recorded_config = metadata.get("config")
    if recorded_config is not None and recorded_config != builder._config_record():
        raise ValueError(
            f"source: {where} was built with {recorded_config}, not "
            f"{builder._config_record()}; pick another config name (e.g. 'documents/mine')."
        )
    if not patterns:
        return
    now = resolve_files(patterns, builder.FILE_SUFFIXES)
    then = list(metadata.get("files", []))
    if now != then:
        added, missing = sorted(set(now) - set(then)), sorted(set(then) - set(now))
        example = f"; e.g. new: {added[0]}" if added else f"; e.g. missing: {missing[0]}"
        raise ValueError(
            f"files: {where} was built from other files ({len(then)} files, now "
            f"{len(now)}{example if added or missing else ''}); "
            + _rebuild_hint(source_name, patterns, data_dir)
            + "."
        )
    if "inputs" not in metadata:
        if builder.data_dir not in _warned_unchecked:
            _warned_unchecked.add(builder.data_dir)
            logging.warning(
                "%s was prepared without a fingerprint of its inputs (by an older version): "
                "whether its files changed since cannot be checked. Rebuild it once "
                "(--rebuild) to have it checked from then on.",
                where,
            )
        return
    if changes := changed_inputs(metadata["inputs"], now):
        more = f" (and {len(changes) - 1} more changed files)" if len(changes) > 1 else ""
        raise ValueError(
            f"files: {where} is stale: an input changed since it was built: {changes[0]}"
            f"{more}; " + _rebuild_hint(source_name, patterns, data_dir) + "."
        )


def delete_prepared(builder: Any) -> None:
    """Deletes a prepared dataset's version folder (`<root>/<name>/<config>/<version>`)."""
    path = files.as_path(builder.data_dir)
    if path.exists():
        logging.info("deleting %s to rebuild it", path)
        path.rmtree()


@contextlib.contextmanager
def build_lock(builder: Any) -> Iterator[None]:
    """Serializes builds of one dataset by processes of one machine (local data dirs).

    Processes that start together (one per device on a host) would otherwise all generate the
    same dataset; with the lock, one builds and the others then read. Remote data dirs
    (gs://) have no such lock: prepare them beforehand (`prepare_sources`).
    """
    config_dir = files.as_path(builder.data_dir).parent  # <root>/<name>/<config>
    if not files.is_local(config_dir):
        yield
        return
    config_dir.parent.mkdir(parents=True, exist_ok=True)
    # A local path: epath opens it with the built-in `open`, a real file for `flock`.
    with (config_dir.parent / f".{config_dir.name}.lock").open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            _sweep_incomplete(config_dir)
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _sweep_incomplete(config_dir: Any) -> None:
    """Deletes the `incomplete.*` folders of builds killed before TFDS renamed them into
    place. Called under the build lock, where no build of this dataset is running."""
    for leftover in config_dir.glob("incomplete.*") if config_dir.exists() else ():
        logging.warning("deleting %s: a build of it was killed before it finished", leftover)
        leftover.rmtree()


def recorded_files(builder: Any) -> tuple[str, ...]:
    """The input files a prepared dataset was built from (empty if it has no record)."""
    return tuple(os.fspath(f) for f in (builder.info.metadata or {}).get("files", ()))
