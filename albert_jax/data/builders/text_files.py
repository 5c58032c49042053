"""Finding and reading the input files of the document builders, local or `gs://`.

Paths go through `albert_jax.files` (etils `epath`), so the same patterns work on a laptop and
on a TPU VM reading from a bucket. Compressed inputs (gzip, bzip2) are decompressed while
streaming (`files.open_binary`, by their magic bytes); compressed data that is cut short or
corrupt raises `files.UnreadableFileError` naming the file and the line it stops at. Lines and
one-document files are read within `line_reading.LineLimits` (a builder config's `max_line_bytes`,
`max_blank_lines`), in bounded memory whatever a file expands to. A UTF-16 or UTF-32 file (by
its byte-order mark) is refused naming it: the readers read UTF-8.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

from absl import logging

from albert_jax import files
from albert_jax.data import line_reading

if TYPE_CHECKING:  # base imports this module: no cycle at run time
    from albert_jax.data.builders.base import Tally

COMPRESSION_SUFFIXES = (".gz", ".bz2")


def resolve_files(patterns: str | Sequence[str], suffixes: Sequence[str]) -> list[str]:
    """Expands file patterns to a sorted, de-duplicated list of files (absolute, or `gs://`).

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
        path = files.as_path(pattern)
        is_dir = False
        if any(c in files.GLOB_CHARS for c in pattern):
            matches = [str(p) for p in files.glob(pattern) if not p.is_dir()]
        elif path.is_dir():
            is_dir = True
            matches = [
                str(root / name)
                for root, _, names in path.walk()
                for name in names
                if name.endswith(tuple(suffixes))
            ]
        elif path.exists():
            matches = [str(path)]
        else:
            raise ValueError(f"files: {pattern!r} does not exist")
        if not matches:
            raise ValueError(
                f"files: {pattern!r} matches no file"
                + (f" ending with one of {list(suffixes)}" if is_dir else "")
            )
        found.update(matches)
    return sorted(found)


def stem(path: str) -> str:
    """File name without directory, compression and format suffixes: `a/emma.txt.gz` -> `emma`."""
    name = path.rpartition("/")[2]
    for suffix in COMPRESSION_SUFFIXES:
        if name.endswith(suffix):
            name = name[: -len(suffix)]
    root, dot, _ = name.rpartition(".")
    return root if dot and root.strip(".") else name


def decode_utf8(data: bytes) -> tuple[str, bool]:
    """Decodes UTF-8, replacing invalid bytes with U+FFFD; returns (text, had_invalid_bytes).

    A leading byte-order mark is dropped: it is an encoding artefact, not text.
    """
    try:
        text, invalid = data.decode("utf-8"), False
    except UnicodeDecodeError:
        text, invalid = data.decode("utf-8", errors="replace"), True
    return text.removeprefix("\ufeff"), invalid


# Byte-order marks of encodings that a UTF-8 reader turns into NUL-riddled text (UTF-32 LE's
# mark starts with UTF-16 LE's, so it is looked for first).
_OTHER_ENCODINGS = (
    (b"\xff\xfe\x00\x00", "UTF-32LE"), (b"\x00\x00\xfe\xff", "UTF-32BE"),
    (b"\xff\xfe", "UTF-16LE"), (b"\xfe\xff", "UTF-16BE"),
)  # fmt: skip


def refuse_other_encodings(path: str, head: bytes) -> None:
    """Raises ValueError when a file's first bytes (`head`) are the byte-order mark of UTF-16
    or UTF-32: its documents would be read as NUL-separated bytes, or not at all."""
    for mark, name in _OTHER_ENCODINGS:
        if head.startswith(mark):
            raise ValueError(
                f"{path}: a {name} file (it starts with that byte-order mark); corpora are "
                f"read as UTF-8: convert it first, e.g. iconv -f {name} -t UTF-8"
            )


def read_lines(
    path: str, limits: line_reading.LineLimits, tally: Tally
) -> Iterator[tuple[int, bytes]]:
    """Streams (line number from 1, raw line without its b"\\n"; a CRLF line keeps its b"\\r",
    which the callers strip with the other whitespace) of a (possibly compressed) file, bounded
    by `limits` (`line_reading.read_lines`): a skipped long line counts as the input counter
    `lines_too_long`, a run of blank lines that ends the read as `blank_runs_too_long`."""

    def on_skip(reason: str, _: int) -> None:
        tally.input(line_reading.SKIP_COUNTERS[reason])

    with files.open_binary(path) as f:
        for line_number, raw in line_reading.read_lines(f, path, limits, on_skip):
            if line_number == 1:
                refuse_other_encodings(path, raw)
            yield line_number, raw


def read_document(path: str, limits: line_reading.LineLimits, tally: Tally) -> bytes | None:
    """The whole content of a one-document file, or None (counted as the document counter
    `documents_too_long`, logged) when it is larger than `limits.max_line_bytes`: a document is
    one record, bounded like a JSON line, and a larger one is never read whole."""
    cap = limits.max_line_bytes
    with files.open_binary(path) as f:
        data = line_reading.read_at_most(f, cap)
    if data is not None:
        refuse_other_encodings(path, data[:4])
    if data is None:
        logging.warning("%s: more than max_line_bytes=%d bytes; skipped", path, cap)
        tally.document("documents_too_long")
    return data
