"""`wikipedia_dump`: a local MediaWiki XML dump (`*-pages-articles*.xml.bz2`) -> articles.

For dumps the TFDS catalog does not hold (another date, a wiki of your own, a test sample).
The catalog's `wikipedia/<date>.<lang>` is used as is by `albert_jax.data.sources`.

- The XML is streamed (bz2/gz decompressed on the fly, parsed incrementally, each page
  dropped once read), so memory does not grow with the dump; multi-stream dumps and dumps
  split into several files work (pass all files; they are read in sorted order).
- Kept: pages in the article namespace (ns 0) that are not redirects. Skipped and counted:
  `non_article_pages` (talk, user, template, category... pages), `redirects`.
- Text: wiki markup stripped to prose by `clean_wikitext` (see wikitext.py); articles that
  are empty after cleaning (lists only, stubs made of templates) are skipped and counted
  (`empty_documents`).
- Invalid UTF-8 bytes are replaced by U+FFFD and counted (`decode_errors`: the number of
  replaced byte sequences); an XML error (e.g. an uncompressed dump cut short) ends that
  file's pages, is logged and counted (`xml_errors`) and the build continues with the next
  file. Compressed data that is cut short or corrupt stops the build with an error naming the
  file and the line (`files.UnreadableFileError`): that dump must be downloaded again.
- Cleaning runs in `num_workers` processes (0 = automatic: one process for inputs under
  64 MiB, else one per CPU up to 16). Output order is the same for any number of workers.

Only the documents of the split being generated are cleaned (the split is decided by the
title, which is known before the expensive markup parsing).
"""

from __future__ import annotations

import codecs
import dataclasses
import itertools
import multiprocessing
import os
import xml.etree.ElementTree as ET
from collections.abc import Callable, Iterable, Iterator

from absl import logging

from albert_jax.data.builders.base import LocalTextBuilder, LocalTextConfig, Tally
from albert_jax.data.builders.wikitext import clean_page
from albert_jax.files import as_path, open_binary

_ARTICLE_NAMESPACE = "0"
_CHUNK_BYTES = 1 << 20
_AUTO_PARALLEL_BYTES = 64 << 20
_MAX_AUTO_WORKERS = 16
_PAGES_PER_TASK = 8
_REPLACEMENT_UTF8 = "\ufffd".encode()


@dataclasses.dataclass
class WikipediaDumpConfig(LocalTextConfig):
    """`LocalTextConfig` plus `num_workers` (cleaning processes; 0 = automatic)."""

    num_workers: int = 0

    def __post_init__(self):
        super().__post_init__()
        if self.num_workers < 0:
            raise ValueError(f"num_workers must be >= 0 (0 = automatic), got {self.num_workers}")


@dataclasses.dataclass(frozen=True)
class Page:
    """One `<page>` of a dump."""

    title: str
    namespace: str
    is_redirect: bool
    page_id: str
    wikitext: str


def _local(tag: str) -> str:
    return tag.rpartition("}")[2]


def _child_text(element: ET.Element, path: str) -> str:
    child = element.find(path)
    return (child.text or "") if child is not None else ""


def iter_pages(path: str, tally: Tally) -> Iterator[Page]:
    """Streams the pages of one dump file; counts invalid UTF-8 and XML errors."""
    parser = ET.XMLPullParser(events=("start", "end"))
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    root: ET.Element | None = None
    tail = b""  # the last bytes of the previous chunk: U+FFFD written in the dump may straddle

    def pages_from(text: str) -> Iterator[Page]:
        nonlocal root
        parser.feed(text)
        for event, element in parser.read_events():
            if event == "start":
                root = element if root is None else root
                continue
            if _local(element.tag) != "page":
                continue
            yield Page(
                title=_child_text(element, "{*}title"),
                namespace=_child_text(element, "{*}ns").strip(),
                is_redirect=element.find("{*}redirect") is not None,
                page_id=_child_text(element, "{*}id").strip(),
                wikitext=_child_text(element, "{*}revision/{*}text"),
            )
            root.clear()  # drop the finished page (and everything before it) from memory

    try:
        with open_binary(path) as f:
            while chunk := f.read(_CHUNK_BYTES):
                text = decoder.decode(chunk)
                if "\ufffd" in text:
                    genuine = (tail + chunk).count(_REPLACEMENT_UTF8)
                    tally.input("decode_errors", text.count("\ufffd") - genuine)
                tail = chunk[-2:]
                yield from pages_from(text)
            rest = decoder.decode(b"", final=True)  # bytes of a sequence cut off by the end
            tally.input("decode_errors", rest.count("\ufffd"))
            yield from pages_from(rest)
            parser.close()
    except ET.ParseError as e:
        logging.warning("%s: XML error (%s); the pages after it are not read", path, e)
        tally.input("xml_errors")


def _is_redirect(page: Page) -> bool:
    # Some exports lack the <redirect/> element; the wikitext still starts with #REDIRECT.
    return page.is_redirect or page.wikitext.lstrip()[:9].upper() == "#REDIRECT"


def _batched(items: Iterable, n: int) -> Iterator[list]:
    iterator = iter(items)
    while batch := list(itertools.islice(iterator, n)):
        yield batch


class WikipediaDump(LocalTextBuilder, skip_registration=True):
    """Articles of local MediaWiki XML dumps (see the module docstring)."""

    name = "wikipedia_dump"
    DESCRIPTION = "Articles of local MediaWiki XML dumps, markup stripped to plain prose."
    FILE_SUFFIXES = (".xml", ".xml.bz2", ".xml.gz", ".bz2")
    DECODE_ERRORS_PER_DOCUMENT = False  # invalid bytes of the dump, counted as read

    def _workers(self, files: list[str]) -> int:
        requested = getattr(self.config, "num_workers", 0)
        if requested:
            return requested
        total = sum(as_path(f).stat().length for f in files)
        return 1 if total < _AUTO_PARALLEL_BYTES else min(os.cpu_count() or 1, _MAX_AUTO_WORKERS)

    def _read_documents(
        self, files: list[str], wants: Callable[[str], bool], tally: Tally
    ) -> Iterator[tuple[str, str, str]]:
        def wanted_pages() -> Iterator[tuple[str, str, str]]:
            for file_index, path in enumerate(files):
                for n, page in enumerate(iter_pages(path, tally)):
                    tally.input("pages")
                    if page.namespace != _ARTICLE_NAMESPACE:
                        tally.input("non_article_pages")
                    elif _is_redirect(page):
                        tally.input("redirects")
                    elif wants(page.title):
                        yield f"{file_index:06d}:{page.page_id or n}", page.title, page.wikitext

        workers = self._workers(files)
        if workers == 1:
            yield from map(clean_page, wanted_pages())
            return
        # "spawn": the parent holds TensorFlow threads, which must not be forked. Pages go in
        # bounded batches so that reading never runs ahead of cleaning by more than one batch.
        context = multiprocessing.get_context("spawn")
        with context.Pool(workers) as pool:
            for batch in _batched(wanted_pages(), workers * _PAGES_PER_TASK * 4):
                yield from pool.imap(clean_page, batch, chunksize=_PAGES_PER_TASK)
