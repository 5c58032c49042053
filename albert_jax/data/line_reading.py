"""Bounded line reading: the one line reader of the package's text inputs (task files,
corpora), so that a broken or hostile file (a small gzip that expands to one gigantic line, or
to millions of blank lines) costs bounded memory and seconds instead of exhausting the host.
Streams come from `files.open_binary` (decompressed, errors naming the file)."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Iterator
from typing import Any, BinaryIO

from absl import logging

from albert_jax.files import PathLike

# Bounds of `read_lines` (see `LineLimits`). A line is a record (a JSON document, a paragraph):
# real ones stay far below 64 MiB, and one that size costs a few hundred MB to parse. No real
# text has 100k blank lines in a row; reading them costs time and yields nothing.
DEFAULT_MAX_LINE_BYTES = 64 << 20
DEFAULT_MAX_BLANK_LINES = 100_000
# A file with 10k unparsable lines in a row is not the format it is read as; the rest of it
# is junk to be parsed line by line (docs/benchmarks.md, "Figures behind constants").
DEFAULT_MAX_BAD_LINES = 10_000
# Text compresses 3-10x; gzip's ceiling is ~1030x. A file that decompresses to over 200x its
# stored size (past `_EXPANSION_FLOOR`) is a bomb or generated filler, not a corpus.
DEFAULT_MAX_EXPANSION = 200
_EXPANSION_FLOOR = 1 << 20
# The skip reasons `read_lines` (and `BadRun`) report (readers count them under these names).
LINE_TOO_LONG = "line_too_long"
BLANK_RUN_TOO_LONG = "blank_run_too_long"
BAD_RUN_TOO_LONG = "bad_run_too_long"
EXPANSION_TOO_LARGE = "expansion_too_large"
# The counters the corpus readers keep of them (file-level tallies, as "bad_json_lines").
SKIP_COUNTERS = {
    LINE_TOO_LONG: "lines_too_long", BLANK_RUN_TOO_LONG: "blank_runs_too_long",
    BAD_RUN_TOO_LONG: "bad_runs_too_long", EXPANSION_TOO_LARGE: "expansions_too_large",
}  # fmt: skip
_LINE_CHUNK = 1 << 20  # bytes per read of `read_lines`
PROGRESS_BYTES = 256 << 20  # a long read logs a line every this many decompressed bytes


@dataclasses.dataclass(frozen=True)
class LineLimits:
    """Bounds of reading a text file line by line (`read_lines`), so that a broken or hostile
    file (a small gzip that expands to one gigantic line, or to millions of blank lines) costs
    bounded memory and seconds instead of exhausting the host.

    Attributes:
      max_line_bytes: the longest line kept (bytes, line break excluded); a longer one is
        skipped without ever being held whole. Whole-file documents (`read_at_most`) are
        bounded by it too: such a document is one record, as a JSON line is.
      max_blank_lines: the longest run of blank (empty or whitespace) lines; past it the rest
        of the file is not read.
      max_bad_lines: the longest run of lines its reader cannot parse (`BadRun`); past it the
        rest of the file is not read.
      max_expansion: the most bytes a compressed file may decompress to per stored byte (past
        the first MiB); past it the rest of the file is not read.
    """

    max_line_bytes: int = DEFAULT_MAX_LINE_BYTES
    max_blank_lines: int = DEFAULT_MAX_BLANK_LINES
    max_bad_lines: int = DEFAULT_MAX_BAD_LINES
    max_expansion: int = DEFAULT_MAX_EXPANSION

    def __post_init__(self):
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{field.name} must be an integer >= 1, got {value!r}")

    @classmethod
    def from_config(
        cls, section: Any, where: str = "config.data", default: LineLimits | None = None
    ) -> LineLimits:
        """The limits set in a config section (ConfigDict, mapping or None); a field it does
        not set (or sets to None) keeps `default`'s. A bad value raises ValueError naming
        `where.<field>`."""
        get = getattr(section, "get", None) or (lambda name: getattr(section, name, None))
        values = dataclasses.asdict(default or cls())
        values.update({name: value for name in values if (value := get(name)) is not None})
        try:
            return cls(**values)
        except ValueError as e:
            raise ValueError(f"{where}.{e}") from None


DEFAULT_LINE_LIMITS = LineLimits()


def read_lines(
    stream: BinaryIO,
    path: PathLike,
    limits: LineLimits = DEFAULT_LINE_LIMITS,
    on_skip: Callable[[str, int], None] | None = None,
) -> Iterator[tuple[int, bytes]]:
    """Yields (line number from 1, line without its b"\\n") of a binary stream, in bounded
    memory whatever the file holds (the one line reader of the package's text inputs).

    A line longer than `limits.max_line_bytes` is skipped, its bytes dropped as they are read;
    a run of more than `limits.max_blank_lines` blank lines ends the read (the lines of the
    run up to the limit are yielded). Each is logged as a warning naming `path` and the line,
    and reported to `on_skip(reason, line_number)` with reason `LINE_TOO_LONG` (the long line)
    or `BLANK_RUN_TOO_LONG` (the first line past the limit), for the caller to count. Every
    `PROGRESS_BYTES` of data read, a line logs the progress. A compressed stream (one with
    `stored_position`, `files.open_binary`'s) that expands past `limits.max_expansion` ends
    the read too (`EXPANSION_TOO_LARGE`).
    """
    path = os.fspath(path)
    stored = getattr(stream, "stored_position", None)
    cap, max_blank = limits.max_line_bytes, limits.max_blank_lines
    # Pieces of at most cap + 1 bytes: a line that ends in the piece it starts in is then
    # within the cap, so only a line spanning pieces is measured (per piece, not per line).
    size = min(_LINE_CHUNK, cap + 1)
    number = 0  # lines ended so far, kept or skipped
    head: list[bytes] = []  # the start of the line not ended yet
    head_bytes = 0
    dropping = False  # the line not ended yet is over the cap: its bytes are dropped
    blank = 0  # blank lines in a row
    done, report_at = 0, PROGRESS_BYTES

    def skip(reason: str, line: int) -> None:
        if reason == LINE_TOO_LONG:
            message = f"line {line} is longer than max_line_bytes={cap}; skipped"
        else:
            message = (
                f"more than max_blank_lines={max_blank} blank lines in a row (lines "
                f"{line - max_blank}-{line}); the rest of the file is not read"
            )
        if reason == EXPANSION_TOO_LARGE:
            message = (
                f"decompresses to over max_expansion={limits.max_expansion} times its stored "
                f"size ({done} bytes from {stored()}); the rest of the file is not read"
            )
        logging.warning("%s: %s", path, message)
        if on_skip is not None:
            on_skip(reason, line)

    # read1 hands out what the decompressor has (no joining of parts); not every stream has it.
    read = getattr(stream, "read1", stream.read)
    while data := read(size):
        done += len(data)
        if done >= report_at:
            logging.info("%s: %d MiB read, %d lines so far", path, done >> 20, number)
            report_at += PROGRESS_BYTES
        if stored and done > _EXPANSION_FLOOR and done > limits.max_expansion * stored():
            skip(EXPANSION_TOO_LARGE, number + 1)
            return
        lines = data.split(b"\n")
        tail = lines.pop()  # the start of a line that ends in a later piece (or b"")
        if lines and (dropping or head):
            if dropping:  # the end of the long line
                number, dropping, blank = number + 1, False, 0
                del lines[0]
            elif head_bytes + len(lines[0]) > cap:
                number, blank = number + 1, 0
                skip(LINE_TOO_LONG, number)
                del lines[0]
            else:
                head.append(lines[0])
                lines[0] = b"".join(head)
            head, head_bytes = [], 0
        for n, line in enumerate(lines, number + 1):
            # The per-line cost of the bounds: this test (isspace stops at the first non-space).
            if line and not line.isspace():
                blank = 0
            else:
                blank += 1
                if blank > max_blank:
                    skip(BLANK_RUN_TOO_LONG, n)
                    return
            yield n, line
        number += len(lines)
        if tail and not dropping:
            head.append(tail)
            head_bytes += len(tail)
            if head_bytes > cap:
                head, head_bytes, dropping = [], 0, True
                skip(LINE_TOO_LONG, number + 1)
    if head:  # the last line, without a line break (not empty: it has bytes)
        line = b"".join(head)
        if line.isspace() and blank >= max_blank:
            skip(BLANK_RUN_TOO_LONG, number + 1)
            return
        yield number + 1, line


class BadRun:
    """Consecutive lines of one file that its reader cannot parse (invalid JSON, not UTF-8):
    `bad(line)` after each such line, `good()` after a parsed one. Past
    `limits.max_bad_lines` in a row, `bad` logs a warning naming the file and the lines,
    reports `BAD_RUN_TOO_LONG` to `on_skip` and returns True: the caller stops reading the
    file, whose rest would cost seconds to skip line by line and yield nothing."""

    def __init__(
        self,
        path: PathLike,
        limits: LineLimits = DEFAULT_LINE_LIMITS,
        on_skip: Callable[[str, int], None] | None = None,
    ):
        self.path, self.limit, self.on_skip = os.fspath(path), limits.max_bad_lines, on_skip
        self.run = 0

    def good(self) -> None:
        self.run = 0

    def bad(self, line: int) -> bool:
        self.run += 1
        if self.run <= self.limit:
            return False
        logging.warning(
            "%s: more than max_bad_lines=%d unparsable lines in a row (lines %d-%d); the rest "
            "of the file is not read", self.path, self.limit, line - self.limit, line,
        )  # fmt: skip
        if self.on_skip is not None:
            self.on_skip(BAD_RUN_TOO_LONG, line)
        return True


def read_at_most(stream: BinaryIO, max_bytes: int) -> bytes | None:
    """The whole (decompressed) content of a stream, or None when it holds more than
    `max_bytes`: never more than max_bytes + 1 bytes are read, so a small file that expands to
    gigabytes costs no more memory than the cap."""
    data = stream.read(max_bytes + 1)
    return data if len(data) <= max_bytes else None
