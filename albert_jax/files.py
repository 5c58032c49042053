"""The package's one file layer: every path it reads or writes goes through these helpers, so
local disks and object stores (`gs://`) behave alike. All access is `etils.epath` (which uses
`tf.io.gfile` when TensorFlow is importable, else gcsfs); Orbax and TFDS use their own clients.

Object stores have no rename and no append, but they write whole objects atomically: an atomic
write is a temporary file + rename on local disk and one upload remotely.
"""

from __future__ import annotations

import bz2
import contextlib
import gzip
import io
import json
import os
import re
import tempfile
import uuid
from collections.abc import Iterator, Sequence
from typing import Any, BinaryIO

from etils import epath

PathLike = str | os.PathLike

GLOB_CHARS = "*?["
_STAGE_IN_MEMORY = 64 << 20  # bytes of a remote write kept in memory before spilling
_UPLOAD_CHUNK = 16 << 20
COPY_CHUNK = 16 << 20  # bytes per read of a streamed copy
# "BZh", the block size 1-9, then the first block's magic (pi in BCD) or an empty stream's.
_BZIP2_MAGIC = re.compile(rb"BZh[1-9](1AY&SY|\x17rE8P\x90)", re.DOTALL)


class BadRecordError(ValueError):
    """A record that cannot become an example; `reason` is its short skip reason (counted by
    the readers' statistics), the message says what is wrong with it."""

    def __init__(self, reason: str, message: str = ""):
        super().__init__(message or reason)
        self.reason = reason


def is_local(path: PathLike) -> bool:
    """False for object-store paths (gs://, s3://, ...)."""
    return "://" not in os.fspath(path)


def absolute(path: PathLike) -> str:
    """An absolute local path (independent of the working directory later on); object-store
    paths unchanged."""
    path = os.fspath(path)
    return path if not is_local(path) else os.path.abspath(os.path.expanduser(path))


def as_path(path: PathLike) -> epath.Path:
    """`epath.Path` of `absolute(path)`."""
    return epath.Path(absolute(path))


def text(value: bytes | str | Any) -> str:
    """A TFDS / JSON text field as `str` (TFDS yields UTF-8 bytes)."""
    return value.decode("utf-8") if isinstance(value, bytes) else str(value)


def write_atomic(path: PathLike, data: bytes | str) -> None:
    """Replaces `path` with `data` so that readers see the old or the new content, never a
    part: temp file + rename locally, one upload remotely. Creates the parent directory."""
    with open_atomic(path) as f:
        f.write(data.encode("utf-8") if isinstance(data, str) else data)


@contextlib.contextmanager
def open_atomic(path: PathLike) -> Iterator[BinaryIO]:
    """A binary file to write `path` in pieces (e.g. `np.save`, a stream copy), published
    whole when the block ends without an exception: a temp file renamed over `path` locally,
    one upload on close remotely. Creates the parent directory."""
    target = as_path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    if not is_local(target):
        # Staged on this host (memory, then a local temp file) and uploaded only on success:
        # closing a remote file commits what was written, so an error midway would publish
        # a truncated object.
        with tempfile.SpooledTemporaryFile(max_size=_STAGE_IN_MEMORY) as staged:
            yield staged  # type: ignore[misc]
            staged.seek(0)
            with target.open("wb") as f:
                while chunk := staged.read(_UPLOAD_CHUNK):
                    f.write(chunk)
        return
    tmp = target.parent / f".{target.name}.tmp-{uuid.uuid4().hex}"
    try:
        with tmp.open("wb") as f:
            yield f
        tmp.replace(target)  # a rename that overwrites: atomic on one filesystem
    finally:
        if tmp.exists():
            tmp.unlink()


def write_json(path: PathLike, content: Any, *, indent: int | None = 1) -> str:
    """Writes `content` as JSON (sorted keys) atomically; returns the path."""
    write_atomic(path, json.dumps(content, indent=indent, sort_keys=True) + "\n")
    return os.fspath(path)


def read_json(path: PathLike) -> Any:
    """The JSON content of a file; a missing or malformed file raises ValueError naming it."""
    file = as_path(path)
    if not file.is_file():
        raise ValueError(f"{os.fspath(path)} does not exist")
    try:
        return json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{os.fspath(path)} is not valid JSON: {e}") from e


def copy(src: PathLike, dst: PathLike) -> None:
    """Copies one file (local or remote on either side; streamed, atomic like `write_atomic`);
    no-op onto itself."""
    if absolute(src) == absolute(dst):
        return
    with as_path(src).open("rb") as source, open_atomic(dst) as target:
        while chunk := source.read(COPY_CHUNK):
            target.write(chunk)


@contextlib.contextmanager
def open_binary(path: PathLike) -> Iterator[BinaryIO]:
    """Opens a file for streaming reads, decompressing gzip or bzip2 (multi-stream too) when it
    starts with their magic bytes (whatever its name says)."""
    with as_path(path).open("rb") as raw:
        magic = raw.read(10)
        raw.seek(0)
        if magic[:2] == b"\x1f\x8b":
            with gzip.GzipFile(fileobj=raw, mode="rb") as f:
                yield f  # type: ignore[misc]
        elif _BZIP2_MAGIC.fullmatch(magic):
            # BZ2File reads multi-stream files (the Wikipedia "multistream" dumps) to the end.
            with bz2.BZ2File(raw, mode="rb") as f:
                yield f  # type: ignore[misc]
        else:
            yield raw


@contextlib.contextmanager
def open_text(path: PathLike) -> Iterator[io.TextIOBase]:
    """Opens a UTF-8 text file for reading, decompressed like `open_binary`."""
    with open_binary(path) as stream:
        yield io.TextIOWrapper(stream, encoding="utf-8")


def expand(patterns: PathLike | Sequence[PathLike], what: str = "files") -> list[str]:
    """Files named by a path, a glob, a comma-separated list of them, or a sequence of them,
    local or remote; each glob's matches sorted.

    Raises:
      ValueError: naming `what` and the pattern when a pattern matches no file.
    """
    if isinstance(patterns, str | os.PathLike):
        items = [p for p in os.fspath(patterns).split(",") if p]
    else:
        items = [os.fspath(p) for p in patterns]
    files: list[str] = []
    for pattern in items:
        if any(c in pattern for c in GLOB_CHARS):
            matches = [str(p) for p in glob(pattern)]
        else:
            matches = [absolute(pattern)]
        if not matches or not all(as_path(m).is_file() for m in matches):
            raise ValueError(f"{what}: {pattern!r} names no readable file")
        files.extend(matches)
    if not files:
        raise ValueError(f"{what}: no path given")
    return files


def glob(pattern: PathLike) -> list[epath.Path]:
    """Sorted matches of a glob, local or remote (wildcards in any component but the first)."""
    pattern = absolute(pattern)
    wild = [i for i, c in enumerate(pattern) if c in GLOB_CHARS]
    if not wild:
        return [epath.Path(pattern)] if epath.Path(pattern).exists() else []
    root = pattern[: pattern.rfind("/", 0, wild[0]) + 1]  # absolute: there is a "/" before
    return sorted(epath.Path(root).glob(pattern[len(root) :]), key=str)
