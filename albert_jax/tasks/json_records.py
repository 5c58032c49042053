"""JSON and JSON Lines task files, read record by record: ids, locations, typed fields and the
count of what is skipped (the file layer of the readers in `tasks/local.py` and of
`tasks/registry.py`).

A record's id is `<file stem>-<line index>` (dev.jsonl line 3: `dev-2`); when several files of
a set share a name, `file_names` names them by their folders too (`a/dev-2`, `b/dev-2`). A line
that is not UTF-8, not JSON or not an object is skipped and counted by reason with its
"file:line"; a field that is missing, mistyped or empty raises `BadRecordError`, which
`read_jsonl` counts the same way. Lines are bounded (`line_reading.LineLimits`).
"""

from __future__ import annotations

import collections
import json
import logging
import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from albert_jax import files
from albert_jax.data import line_reading
from albert_jax.files import BadRecordError
from albert_jax.tasks.records import ReadStats

log = logging.getLogger(__name__)

PathLike = str | os.PathLike

# Bounds of the task files' lines (config.data.max_line_bytes / max_blank_lines): a record, or a
# whole SQuAD JSON file (the official ones are one line of up to ~40 MB), is far below the cap.
LINE_LIMITS = line_reading.DEFAULT_LINE_LIMITS


def log_summary(path: PathLike, stats: ReadStats) -> None:
    if stats.skipped_total or stats.adjusted:
        log.warning(
            "%s: read %d, kept %d, skipped %d %s, adjusted %s, first skipped at %s",
            os.fspath(path),
            stats.read,
            stats.kept,
            stats.skipped_total,
            dict(stats.skipped),
            dict(stats.adjusted),
            stats.first_skipped,
        )


def file_name(path: PathLike) -> str:
    """dir/dev.jsonl.gz -> dev.jsonl.gz (a local or gs:// path)."""
    return os.fspath(path).rpartition("/")[2]


def _without_suffixes(name: str) -> str:
    """dev.jsonl.gz → dev, a/dev.jsonl → a/dev: the prefix of record ids."""
    for suffix in (".gz", ".jsonl", ".json"):
        name = name.removesuffix(suffix)
    return name


def file_names(paths: Sequence[PathLike]) -> list[str]:
    """What the records of each of a set's files call it (ids, bad-record locations): its file
    name; files whose names without suffixes are the same (x/a/dev.jsonl, x/b/dev.jsonl) with
    the fewest trailing folders that tell them apart (a/dev.jsonl, b/dev.jsonl). Two that differ
    in suffixes only (x/dev.jsonl, x/dev.jsonl.gz) keep their paths, and their ids collide."""
    parts = [os.fspath(p).split("/") for p in paths]
    by_stem: dict[str, list[int]] = collections.defaultdict(list)
    for i, p in enumerate(parts):
        by_stem[_without_suffixes(p[-1])].append(i)
    names = [p[-1] for p in parts]
    for group in (g for g in by_stem.values() if len(g) > 1):
        for i in group:
            folders, k = parts[i][:-1], 1
            while k < len(folders) and any(
                parts[j][-1 - k : -1] == folders[-k:] for j in group if j != i
            ):
                k += 1
            names[i] = "/".join(parts[i][-1 - k :])
    return names


def read_json(path: PathLike, limits: line_reading.LineLimits | None = None) -> Any:
    """The content of a whole JSON file (gzip'ed or not, local or gs://), e.g. SQuAD data or
    predictions. The one place that names the file when it cannot be parsed: a truncated file,
    bad JSON or bytes that are not UTF-8 raise one ValueError with the path, the line and column
    and the reason (the original error chained); so does a file of more than
    `limits.max_line_bytes` (default `LINE_LIMITS`) once decompressed, read no further."""
    max_bytes = (limits or LINE_LIMITS).max_line_bytes
    # Bytes first, decoded here: a decode error then has its offset in the file (a text stream
    # reports it within a buffer), so the message can give the line.
    with files.open_binary(path) as f:
        data = line_reading.read_at_most(f, max_bytes)
    if data is None:  # one JSON value: no part of it can be kept
        raise ValueError(
            f"{os.fspath(path)}: more than {max_bytes} bytes once decompressed; raise "
            "config.data.max_line_bytes if the file is really that large"
        )
    try:
        # utf-8-sig: a leading byte-order mark (editors on Windows write one) is not content.
        content = data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        column = e.start - (data.rfind(b"\n", 0, e.start) + 1) + 1
        raise ValueError(
            f"{os.fspath(path)}: not UTF-8 text at line {line} column {column} (byte "
            f"{e.start}: {e.object[e.start : e.end]!r}): {e.reason}"
        ) from e
    try:
        return json.loads(content)
    except json.JSONDecodeError as e:
        # The parser stopped at the end of the text, or in a string that the end cut off.
        ends_early = e.pos >= len(content.rstrip()) or e.msg.startswith("Unterminated string")
        truncated = " (the file ends early: truncated?)" if ends_early else ""
        raise ValueError(
            f"{os.fspath(path)}: not valid JSON at line {e.lineno} column {e.colno}: "
            f"{e.msg}{truncated}"
        ) from e


def jsonl_records(
    path: PathLike, stats: ReadStats, name: str | None, limits: line_reading.LineLimits
) -> Iterator[tuple[str, str, dict]]:
    """Yields (id, location, record) for every JSON object line; counts the lines that are not
    (`bad_utf8`, `invalid_json`, `not_an_object`), those longer than `limits.max_line_bytes`
    (`line_too_long`: skipped unread) and a run of blank lines past `limits.max_blank_lines`,
    of unparsable lines past `limits.max_bad_lines` or a compressed file expanding past
    `limits.max_expansion` (`blank_run_too_long`, `bad_run_too_long`, `expansion_too_large`:
    the rest of the file is not read), each with its "file:line". name:
    what ids and locations call the file (`file_names`; default: its file name).

    Raises:
      ValueError: naming the file when it has lines but none of them is UTF-8 (a binary file,
        or text in another encoding): skipping them all would only hide that.
    """
    base = name or file_name(path)
    stem = _without_suffixes(base)
    decoded, undecodable, first_undecodable = 0, 0, 0

    def skipped(reason: str, line_number: int) -> None:
        stats.read += (
            reason == line_reading.LINE_TOO_LONG
        )  # a record; the end of a blank run is not
        stats.skip(reason, f"{base}:{line_number}")

    # Lines are decoded one by one (not through a text stream) so that one undecodable byte
    # costs its line only, counted like any other bad record, instead of ending the read.
    bad_run = line_reading.BadRun(path, limits, skipped)
    with files.open_binary(path) as f:
        for line_number, raw in line_reading.read_lines(f, path, limits, skipped):
            where = f"{base}:{line_number}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError:
                stats.read += 1
                stats.skip("bad_utf8", where)
                undecodable += 1
                first_undecodable = first_undecodable or line_number
                if bad_run.bad(line_number):
                    break
                continue
            if line_number == 1:
                line = line.removeprefix("\ufeff")  # a byte-order mark is not content
            if not line.strip():
                continue  # blank lines (e.g. a trailing newline) hold no record
            decoded += 1
            stats.read += 1
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                stats.skip("invalid_json", where)
                if bad_run.bad(line_number):
                    break
                continue
            if not isinstance(record, dict):
                stats.skip("not_an_object", where)
                if bad_run.bad(line_number):
                    break
                continue
            bad_run.good()
            # Ids count lines from 0, as they always have (predictions files are keyed by them).
            yield f"{stem}-{line_number - 1}", where, record
    if undecodable and not decoded:
        raise ValueError(
            f"{os.fspath(path)}: none of its {undecodable} lines is UTF-8 text (the first at "
            f"line {first_undecodable}); is it a JSON Lines file?"
        )


def text_field(record: dict, name: str) -> str:
    if name not in record:
        raise BadRecordError(f"missing_field:{name}")
    value = record[name]
    if not isinstance(value, str):
        raise BadRecordError(f"bad_type:{name}")
    if not value.strip():
        raise BadRecordError(f"empty_text:{name}")
    return value


def int_field(record: dict, name: str) -> int:
    if name not in record:
        raise BadRecordError(f"missing_field:{name}")
    value = record[name]
    # bool is an int in Python; a JSON true/false label is a malformed record, not class 1/0.
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadRecordError(f"bad_type:{name}")
    return value


def float_field(record: dict, name: str) -> float:
    if name not in record:
        raise BadRecordError(f"missing_field:{name}")
    value = record[name]
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise BadRecordError(f"bad_type:{name}")
    if value != value or value in (float("inf"), float("-inf")):
        raise BadRecordError(f"not_finite:{name}")
    return float(value)


def read_jsonl(
    path: PathLike,
    parse: Callable[[str, dict], Any],
    stats: ReadStats | None,
    name: str | None = None,
    limits: line_reading.LineLimits | None = None,
) -> list:
    """Applies parse(id, record) to each line of a JSON Lines file; skips and counts bad ones.
    name: what ids and locations call the file (`file_names`; default: its file name);
    limits: the bounds of its lines (default `LINE_LIMITS`)."""
    file_stats = ReadStats()
    examples = []
    for example_id, where, record in jsonl_records(path, file_stats, name, limits or LINE_LIMITS):
        try:
            examples.append(parse(example_id, record))
        except BadRecordError as bad:
            file_stats.skip(bad.reason, where)
    file_stats.kept = len(examples)
    log_summary(path, file_stats)
    if stats is not None:
        stats.update(file_stats)
    return examples
