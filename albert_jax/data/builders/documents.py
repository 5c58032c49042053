"""`documents`: JSON Lines or plain-text files -> `{"title", "text"}` documents.

Input formats (`DocumentsConfig.text_format`):

- `jsonl`: one JSON object per line with a string `text` (and usually a string `title`);
  `.jsonl`, `.json`, `.ndjson`, optionally `.gz` / `.bz2`. Blank lines are ignored.
- `document_per_file`: each file is one document, title = file name without suffixes; the
  text is kept as written (line breaks normalized to "\\n", outer whitespace stripped).
- `sentence_per_line`: the official BERT/ALBERT `create_pretraining_data.py` input: one
  sentence per line, a blank line between documents. Sentences stay separated by "\\n";
  title = `<file name>:<document index in the file>`.
- `auto` (default): `jsonl` for the JSON suffixes above, `document_per_file` otherwise. The
  raw-text format cannot be told apart from a plain document by looking at it, so it is
  never guessed: ask for `sentence_per_line` (source name `raw_text`).

Bad input is repaired or skipped, and counted: invalid UTF-8 is decoded with U+FFFD
replacement (`decode_errors`, per document), unparseable JSON lines are skipped
(`bad_json_lines`), JSON values that are not an object with a string `text` are skipped
(`bad_records`), records without a string title get `<file name>:<line number>`
(`untitled_records`), empty documents are skipped (`empty_documents`). A compressed file that
is cut short or corrupt stops the build with an error naming the file and the line.

Reading is bounded (`LocalTextConfig.max_line_bytes`, `max_blank_lines`, `max_bad_lines`,
`max_expansion`): a longer line is skipped without being held whole (`lines_too_long`), a
longer document file is skipped unread (`documents_too_long`), and a longer run of blank lines
or of JSON lines that are no record, or a compressed file that expands too far, ends that
file's read (`blank_runs_too_long`, `bad_runs_too_long`, `expansions_too_large`); each is
logged with the file and the line.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Callable, Iterator

from albert_jax.data.builders.base import LocalTextBuilder, LocalTextConfig, Tally
from albert_jax.data.builders.text_files import (
    COMPRESSION_SUFFIXES,
    decode_utf8,
    read_document,
    read_lines,
    stem,
)
from albert_jax.data.line_reading import SKIP_COUNTERS, BadRun, LineLimits

TEXT_FORMATS = ("auto", "jsonl", "document_per_file", "sentence_per_line")
_JSON_SUFFIXES = (".jsonl", ".json", ".ndjson")
_TEXT_SUFFIXES = (".txt", ".text")
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def _plain_name(path: str) -> str:
    for suffix in COMPRESSION_SUFFIXES:
        path = path.removesuffix(suffix)
    return path


@dataclasses.dataclass
class DocumentsConfig(LocalTextConfig):
    """`LocalTextConfig` plus `text_format` (one of TEXT_FORMATS; see the module docstring)."""

    text_format: str = "auto"

    def __post_init__(self):
        super().__post_init__()
        if self.text_format not in TEXT_FORMATS:
            raise ValueError(f"text_format must be one of {TEXT_FORMATS}, got {self.text_format!r}")


class Documents(LocalTextBuilder, skip_registration=True):
    """Documents from JSON Lines or plain-text files (see the module docstring)."""

    name = "documents"
    DESCRIPTION = "Documents from local JSON Lines or plain-text files."
    FILE_SUFFIXES = tuple(
        s + c for s in _JSON_SUFFIXES + _TEXT_SUFFIXES for c in ("",) + COMPRESSION_SUFFIXES
    )

    def _format_of(self, path: str) -> str:
        text_format = getattr(self.config, "text_format", "auto")
        if text_format != "auto":
            return text_format
        return "jsonl" if _plain_name(path).endswith(_JSON_SUFFIXES) else "document_per_file"

    def _read_documents(
        self, files: list[str], wants: Callable[[str], bool], tally: Tally
    ) -> Iterator[tuple[str, str, str]]:
        readers = {
            "jsonl": _read_jsonl,
            "document_per_file": _read_document_file,
            "sentence_per_line": _read_sentence_per_line,
        }
        limits = self.config.line_limits
        for file_index, path in enumerate(files):
            read = readers[self._format_of(path)]
            for index, title, text in read(path, wants, tally, limits):
                yield f"{file_index:06d}:{index}", title, text


def _read_jsonl(
    path: str, wants: Callable[[str], bool], tally: Tally, limits: LineLimits
) -> Iterator[tuple[int, str, str]]:
    name = stem(path)
    bad_run = BadRun(path, limits, lambda reason, _: tally.input(SKIP_COUNTERS[reason]))
    for line_number, raw in read_lines(path, limits, tally):
        if not raw.strip():
            continue
        line, invalid = decode_utf8(raw)
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            tally.input("bad_json_lines")
            if bad_run.bad(line_number):
                return
            continue
        if not isinstance(record, dict) or not isinstance(record.get("text"), str):
            tally.input("bad_records")
            if bad_run.bad(line_number):
                return
            continue
        bad_run.good()
        title = record.get("title")
        if not isinstance(title, str) or not title.strip():
            tally.input("untitled_records")
            title = f"{name}:{line_number}"
        # JSON escapes can spell lone surrogates ("\\ud800"), which UTF-8 cannot encode.
        title, bad_title = _replace_surrogates(title)
        if not wants(title):
            continue
        text, bad_text = _replace_surrogates(record["text"])
        if invalid or bad_title or bad_text:
            tally.document("decode_errors")
        yield line_number, title, text


def _replace_surrogates(text: str) -> tuple[str, bool]:
    replaced, n = _LONE_SURROGATE.subn("\ufffd", text)
    return replaced, n > 0


def _read_document_file(
    path: str, wants: Callable[[str], bool], tally: Tally, limits: LineLimits
) -> Iterator[tuple[int, str, str]]:
    title = stem(path)
    if not wants(title):
        return
    if (data := read_document(path, limits, tally)) is None:
        return
    text, invalid = decode_utf8(data)
    if invalid:
        tally.document("decode_errors")
    yield 0, title, text.replace("\r\n", "\n").replace("\r", "\n")


def _read_sentence_per_line(
    path: str, wants: Callable[[str], bool], tally: Tally, limits: LineLimits
) -> Iterator[tuple[int, str, str]]:
    name = stem(path)
    sentences: list[str] = []
    invalid_lines = 0
    index = 0

    def document() -> tuple[int, str, str] | None:
        title = f"{name}:{index}"
        if not wants(title):
            return None
        if invalid_lines:
            tally.document("decode_errors")
        return index, title, "\n".join(sentences)

    for _, raw in read_lines(path, limits, tally):
        line, invalid = decode_utf8(raw)
        line = line.strip()
        if line:
            sentences.append(line)
            invalid_lines += invalid
            continue
        if sentences:  # a blank line closes the current document
            if (doc := document()) is not None:
                yield doc
            sentences, invalid_lines, index = [], 0, index + 1
    if sentences and (doc := document()) is not None:
        yield doc
