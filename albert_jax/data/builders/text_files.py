"""Finding and reading local (or gs://) input files for the document builders.

Paths go through `tf.io.gfile`, so the same patterns work on a laptop and on a TPU VM reading
from a bucket. Compressed inputs (`.gz`, `.bz2`) are decompressed while streaming.
"""

from __future__ import annotations

import bz2
import contextlib
import gzip
import os
from collections.abc import Iterable, Iterator, Sequence
from typing import BinaryIO

import tensorflow as tf

_GLOB_CHARS = frozenset("*?[")
COMPRESSION_SUFFIXES = (".gz", ".bz2")


def _walk(directory: str) -> Iterator[str]:
    for root, _, names in tf.io.gfile.walk(directory):
        for name in names:
            yield os.path.join(root, name)


def resolve_files(patterns: str | Sequence[str], suffixes: Sequence[str]) -> list[str]:
    """Expands file patterns to a sorted, de-duplicated list of files.

    Each pattern is a file, a glob (`/data/wiki/*.bz2`, `gs://bucket/books/*.txt`) or a
    directory; a directory contributes every file below it whose name ends with one of
    `suffixes`. Sorting makes the build independent of the file system's listing order.

    Raises:
      ValueError: `files` is empty, or a pattern matches no file.
    """
    if isinstance(patterns, str):
        patterns = [patterns]
    if not patterns:
        raise ValueError("files: no input files given; pass file paths, globs or directories")
    found: set[str] = set()
    for pattern in patterns:
        pattern = os.fspath(pattern)
        if any(c in _GLOB_CHARS for c in pattern):
            matches = [p for p in tf.io.gfile.glob(pattern) if not tf.io.gfile.isdir(p)]
        elif tf.io.gfile.isdir(pattern):
            matches = [p for p in _walk(pattern) if p.endswith(tuple(suffixes))]
        elif tf.io.gfile.exists(pattern):
            matches = [pattern]
        else:
            raise ValueError(f"files: {pattern!r} does not exist")
        if not matches:
            raise ValueError(
                f"files: {pattern!r} matches no file"
                + (f" ending with one of {list(suffixes)}" if tf.io.gfile.isdir(pattern) else "")
            )
        found.update(_absolute(p) for p in matches)
    return sorted(found)


def _absolute(path: str) -> str:
    return path if "://" in path else os.path.abspath(path)


@contextlib.contextmanager
def open_binary(path: str) -> Iterator[BinaryIO]:
    """Opens `path` for streaming reads, decompressing `.gz` / `.bz2` on the fly."""
    with tf.io.gfile.GFile(path, "rb") as raw:
        if path.endswith(".gz"):
            with gzip.GzipFile(fileobj=raw, mode="rb") as f:
                yield f  # type: ignore[misc]
        elif path.endswith(".bz2"):
            # BZ2File reads multi-stream files (the Wikipedia "multistream" dumps) to the end.
            with bz2.BZ2File(raw, mode="rb") as f:
                yield f  # type: ignore[misc]
        else:
            yield raw  # type: ignore[misc]


def stem(path: str) -> str:
    """File name without directory, compression and format suffixes: `a/emma.txt.gz` -> `emma`."""
    name = os.path.basename(path)
    for suffix in COMPRESSION_SUFFIXES:
        if name.endswith(suffix):
            name = name[: -len(suffix)]
    root, ext = os.path.splitext(name)
    return root if ext and root else name


def decode_utf8(data: bytes) -> tuple[str, bool]:
    """Decodes UTF-8, replacing invalid bytes with U+FFFD; returns (text, had_invalid_bytes).

    A leading byte-order mark is dropped: it is an encoding artefact, not text.
    """
    try:
        text, invalid = data.decode("utf-8"), False
    except UnicodeDecodeError:
        text, invalid = data.decode("utf-8", errors="replace"), True
    return text.removeprefix("\ufeff"), invalid


def read_lines(path: str) -> Iterable[bytes]:
    """Streams the raw lines of a (possibly compressed) file, without line terminators."""
    with open_binary(path) as f:
        for line in f:
            yield line.rstrip(b"\r\n")
