"""`books`: a directory of book `.txt` files -> one document per book (BookCorpus-style).

BookCorpus is not in the TFDS catalog (its distribution was withdrawn), so users bring their
own book files (Smashwords crawls, Project Gutenberg, ...). One document per *book*: chapter
headings differ too much between books ("CHAPTER XII.", "Chapter Twelve", "12", "Part II",
none at all) to split chapters reliably, and BERT's book documents were whole books too.
SOP pairs are consecutive segments, so a long document loses nothing.

Cleaning, per book:
- Project Gutenberg licence header and footer are removed when their standard markers
  ("*** START OF THE PROJECT GUTENBERG EBOOK ..." / "*** END OF ...") are present
  (counted as `gutenberg_boilerplate_removed`);
- hard-wrapped lines are joined: a paragraph (lines between blank lines) becomes one line,
  paragraphs are separated by "\\n" (the convention of every document source here).

Title = file name without suffixes (`austen/emma.txt` -> `emma`). Invalid UTF-8 is replaced and
counted (`decode_errors`), empty books are skipped (`empty_documents`); a compressed book cut
short stops the build with an error naming it. A book larger than `max_line_bytes` (64 MiB by
default; the longest real books are a few MB) is skipped unread and counted
(`documents_too_long`): a small gzip that expands to gigabytes costs no more memory than that.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator

from albert_jax.data.builders.base import LocalTextBuilder, LocalTextConfig, Tally
from albert_jax.data.builders.text_files import decode_utf8, read_document, stem

_GUTENBERG_START = re.compile(
    r"^\s*\*{3}\s*START OF (THE|THIS) PROJECT GUTENBERG E-?BOOK.*$", re.IGNORECASE | re.MULTILINE
)
_GUTENBERG_END = re.compile(
    r"^\s*(\*{3}\s*END OF (THE|THIS) PROJECT GUTENBERG E-?BOOK|End of (the )?Project Gutenberg)",
    re.IGNORECASE | re.MULTILINE,
)
_BLANK_LINES = re.compile(r"\n[ \t]*\n")


def strip_gutenberg_boilerplate(text: str) -> tuple[str, bool]:
    """Removes the Project Gutenberg header and footer; returns (text, anything_removed)."""
    removed = False
    if start := _GUTENBERG_START.search(text):
        text, removed = text[start.end() :], True
    if end := _GUTENBERG_END.search(text):
        text, removed = text[: end.start()], True
    return text, removed


def unwrap_paragraphs(text: str) -> str:
    """Joins hard-wrapped lines; returns paragraphs separated by "\\n"."""
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    paragraphs = (" ".join(block.split()) for block in _BLANK_LINES.split(text))
    return "\n".join(p for p in paragraphs if p)


BooksConfig = LocalTextConfig


class Books(LocalTextBuilder, skip_registration=True):
    """One document per book file (see the module docstring)."""

    name = "books"
    DESCRIPTION = "Books from local .txt files, one document per book (BookCorpus stand-in)."
    FILE_SUFFIXES = (".txt", ".txt.gz", ".txt.bz2")

    def _read_documents(
        self, files: list[str], wants: Callable[[str], bool], tally: Tally
    ) -> Iterator[tuple[str, str, str]]:
        limits = self.config.line_limits
        for file_index, path in enumerate(files):
            title = stem(path)
            if not wants(title):
                continue
            if (data := read_document(path, limits, tally)) is None:
                continue
            text, invalid = decode_utf8(data)
            if invalid:
                tally.document("decode_errors")
            text, removed = strip_gutenberg_boilerplate(text)
            if removed:
                tally.document("gutenberg_boilerplate_removed")
            yield f"{file_index:06d}", title, unwrap_paragraphs(text)
