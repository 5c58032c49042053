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
import hashlib
import io
import json
import os
import re
import socket
import sys
import tempfile
import time
import uuid
import zlib
from collections.abc import Iterator, Sequence
from typing import Any, BinaryIO

from absl import logging
from etils import epath

PathLike = str | os.PathLike

GLOB_CHARS = "*?["
_STAGE_IN_MEMORY = 64 << 20  # bytes of a remote write kept in memory before spilling
_UPLOAD_CHUNK = 16 << 20
COPY_CHUNK = 16 << 20  # bytes per read of a streamed copy
# "BZh", the block size 1-9, then the first block's magic (pi in BCD) or an empty stream's.
_BZIP2_MAGIC = re.compile(rb"BZh[1-9](1AY&SY|\x17rE8P\x90)", re.DOTALL)


class UnreadableFileError(ValueError):
    """A file that cannot be read to its end: compressed data (gzip, bzip2) that is truncated or
    corrupt. The message names the file and the line reading stopped at; `path` and `line`
    (1-based: the line the bad data is on) hold them."""

    def __init__(self, path: str, line: int, message: str):
        super().__init__(f"{path}: line {line}: {message}")
        self.path, self.line, self.message = path, line, message

    def __reduce__(self):  # picklable (worker processes) despite the custom arguments
        return type(self), (self.path, self.line, self.message)


class UndecodableTextError(UnicodeDecodeError):
    """Invalid UTF-8 in a file read with `open_text`, naming the file and the line. Still a
    `UnicodeDecodeError` (so a `ValueError`): callers that catch those keep working."""

    def __init__(self, path: str, line: int, error: UnicodeDecodeError):
        super().__init__(error.encoding, error.object, error.start, error.end, error.reason)
        self.path, self.line = path, line

    def __str__(self) -> str:
        byte = self.object[self.start : self.start + 1].hex()
        return f"{self.path}: line {self.line}: invalid UTF-8 (byte 0x{byte}: {self.reason})"

    def __reduce__(self):
        error = UnicodeDecodeError(self.encoding, self.object, self.start, self.end, self.reason)
        return type(self), (self.path, self.line, error)


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


def run_directory(path: PathLike | None, flag: str = "--workdir") -> str:
    """`absolute(path)` of a directory a run or a sweep writes into. An empty path (an unset
    variable: `--workdir=$UNSET`) would be the working directory, `gs://` without a bucket no
    place at all, and a local file no directory: each is refused, naming `flag`.

    Raises:
      ValueError: an empty path, an object-store path without a bucket, a local file.
    """
    text = os.fspath(path or "").strip()
    if not text:
        raise ValueError(
            f"{flag} is empty (an unset variable?): give the directory the run writes into; "
            "nothing is written into the current directory"
        )
    scheme, sep, rest = text.partition("://")
    if sep and not is_local(text) and not rest.split("/", 1)[0]:
        raise ValueError(f"{flag}={text} names no bucket: write {scheme}://BUCKET/PATH")
    if is_local(text) and os.path.exists(text) and not os.path.isdir(text):
        raise ValueError(f"{flag}={text} is a file, not a directory: give a directory")
    return absolute(text)


def as_path(path: PathLike) -> epath.Path:
    """`epath.Path` of `absolute(path)`. A remote path loads TensorFlow (epath's client for
    object stores) first, through `process_setup`: without its C++ notices on the console."""
    if not is_local(path) and "tensorflow" not in sys.modules:
        from albert_jax.runtime.process_setup import hide_accelerators_from_tensorflow

        hide_accelerators_from_tensorflow()
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
    # Host and pid in the name: `sweep_temporaries` can tell a killed writer's leftover from
    # a file another process is writing right now.
    tmp = target.parent / f".{target.name}{_TMP_TAG}{_host()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        with tmp.open("wb") as f:
            yield f
        tmp.replace(target)  # a rename that overwrites: atomic on one filesystem
    finally:
        if tmp.exists():
            tmp.unlink()


_TMP_TAG = ".tmp-"
# A temporary file from another host is taken as abandoned only after this long (its
# writer's pid cannot be checked from here).
_FOREIGN_TMP_AGE_S = 24 * 3600


def _host() -> str:
    return re.sub(r"[^A-Za-z0-9.]", "_", socket.gethostname())


def sweep_temporaries(directory: PathLike) -> int:
    """Deletes the temporary files that `open_atomic` writers killed mid-write left in a local
    `directory` (`.NAME.tmp-HOST-PID-ID`): those of this host whose process is gone, and
    other hosts' once a day old. Returns how many it deleted (logged)."""
    folder = os.fspath(absolute(directory))
    if not is_local(folder) or not os.path.isdir(folder):
        return 0
    host, swept = _host(), 0
    for name in os.listdir(folder):
        if not name.startswith(".") or _TMP_TAG not in name:
            continue
        owner = name.rsplit(_TMP_TAG, 1)[1].rsplit("-", 2)
        path = os.path.join(folder, name)
        if len(owner) == 3 and owner[0] == host:
            abandoned = not pid_alive(owner[1])
        else:
            try:
                abandoned = time.time() - os.stat(path).st_mtime > _FOREIGN_TMP_AGE_S
            except FileNotFoundError:
                continue
        if abandoned:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
                swept += 1
    if swept:
        logging.warning("%s: deleted %d temporary files of killed writers", folder, swept)
    return swept


def pid_alive(pid: Any) -> bool:
    """Whether process `pid` of this host exists (True when that cannot be told: another
    user's process, or not a pid)."""
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except (PermissionError, ValueError, TypeError):
        return True
    return True


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


# What a decompressor raises on truncated or corrupt input: EOFError (the stream ends early),
# gzip.BadGzipFile / OSError (bad header, CRC, bzip2 "Invalid data stream"), zlib.error.
_DECOMPRESSION_ERRORS = (EOFError, OSError, zlib.error)


class _NamedDecompressedStream(io.BufferedIOBase):
    """A decompressing stream whose errors name the file and the line they stop at.

    The bare EOFError of a truncated `.gz` names nothing; counting the line breaks handed out
    so far says where the file breaks (the line after the last complete one).
    """

    def __init__(self, stream: BinaryIO, path: str, kind: str, stored: BinaryIO):
        super().__init__()
        self._stream, self._path, self._kind, self._stored = stream, path, kind, stored
        self._newlines = 0

    def stored_position(self) -> int:
        """Bytes of the compressed file read so far (the expansion bound of `read_lines`)."""
        return self._stored.tell()

    @property
    def name(self) -> str:
        return self._path

    def readable(self) -> bool:
        return True

    def _counted(self, data: bytes) -> bytes:
        self._newlines += data.count(b"\n")
        return data

    def _error(self, error: Exception) -> UnreadableFileError:
        return UnreadableFileError(
            self._path,
            self._newlines + 1,
            f"{self._kind} data is truncated or corrupt ({type(error).__name__}: {error}) after "
            f"{self._newlines} complete lines; download or write the file again",
        )

    def read(self, size: int | None = -1) -> bytes:
        # In pieces of one underlying read each: a failing read loses the data of its call,
        # so one big read would leave the line count short of where the data really stops.
        whole = size is None or size < 0
        parts: list[bytes] = []
        left = COPY_CHUNK if whole else size
        while left > 0 and (part := self.read1(left)):
            parts.append(part)
            left = COPY_CHUNK if whole else left - len(part)
        return b"".join(parts)

    def read1(self, size: int = -1) -> bytes:
        try:
            return self._counted(self._stream.read1(size))
        except _DECOMPRESSION_ERRORS as e:
            raise self._error(e) from e

    def readline(self, size: int | None = -1) -> bytes:
        try:
            return self._counted(self._stream.readline(size))
        except _DECOMPRESSION_ERRORS as e:
            raise self._error(e) from e

    def __iter__(self) -> Iterator[bytes]:
        # A generator over the stream's own lines: half the per-line cost of `readline`.
        try:
            for line in self._stream:
                self._newlines += line.endswith(b"\n")
                yield line
        except _DECOMPRESSION_ERRORS as e:
            raise self._error(e) from e

    def readinto(self, buffer) -> int:  # type: ignore[override]
        data = self.read(len(buffer))
        buffer[: len(data)] = data
        return len(data)


class _NamedText(io.TextIOWrapper):
    """UTF-8 text whose decoding errors name the file and the line (`UndecodableTextError`)."""

    def __init__(self, stream: BinaryIO, path: str):
        super().__init__(stream, encoding="utf-8")
        self._path = path
        self._lines = 0  # lines handed out so far

    def _error(self, error: UnicodeDecodeError) -> UndecodableTextError:
        # The text layer decodes the chunk after the lines handed out (the bytes it holds
        # back have no line break yet), so the bad byte's line is counted in that chunk.
        line = self._lines + 1 + error.object[: error.start].count(b"\n")
        return UndecodableTextError(self._path, line, error)

    def __next__(self) -> str:
        try:
            line = super().__next__()
        except UnicodeDecodeError as e:
            raise self._error(e) from e
        self._lines += 1
        return line

    def readline(self, size: int = -1) -> str:
        try:
            line = super().readline(size)
        except UnicodeDecodeError as e:
            raise self._error(e) from e
        self._lines += line.endswith("\n")
        return line

    def read(self, size: int | None = -1) -> str:
        try:
            text = super().read(size)
        except UnicodeDecodeError as e:
            raise self._error(e) from e
        self._lines += text.count("\n")
        return text


@contextlib.contextmanager
def open_binary(path: PathLike) -> Iterator[BinaryIO]:
    """Opens a file for streaming reads, decompressing gzip or bzip2 (multi-stream too) when it
    starts with their magic bytes (whatever its name says).

    Truncated or corrupt compressed data raises `UnreadableFileError` (a ValueError) naming
    the file and the line it stops at, when the bad part is read.
    """
    name = os.fspath(path)
    with as_path(path).open("rb") as raw:
        magic = raw.read(10)
        raw.seek(0)
        if magic[:2] == b"\x1f\x8b":
            with gzip.GzipFile(fileobj=raw, mode="rb") as f:
                yield _NamedDecompressedStream(f, name, "gzip", raw)  # type: ignore[misc]
        elif _BZIP2_MAGIC.fullmatch(magic):
            # BZ2File reads multi-stream files (the Wikipedia "multistream" dumps) to the end.
            with bz2.BZ2File(raw, mode="rb") as f:
                yield _NamedDecompressedStream(f, name, "bzip2", raw)  # type: ignore[misc]
        else:
            yield raw


@contextlib.contextmanager
def open_text(path: PathLike) -> Iterator[io.TextIOBase]:
    """Opens a UTF-8 text file for reading, decompressed like `open_binary`. Invalid UTF-8
    raises `UndecodableTextError` (a UnicodeDecodeError) naming the file and the line."""
    with open_binary(path) as stream:
        yield _NamedText(stream, os.fspath(path))


def stat(path: PathLike) -> tuple[int, int]:
    """(size in bytes, modification time in ns) of a file, local or remote. Remote times have
    whole seconds only (`epath` reports object stores' times in seconds)."""
    if is_local(path):
        result = os.stat(absolute(path))
        return result.st_size, result.st_mtime_ns
    remote = as_path(path).stat()
    return int(remote.length), int(remote.mtime) * 1_000_000_000


def sha256(path: PathLike) -> str:
    """Hex SHA-256 of a file's bytes as stored (not decompressed), streamed."""
    digest = hashlib.sha256()
    with as_path(path).open("rb") as f:
        while chunk := f.read(COPY_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


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
