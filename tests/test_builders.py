"""TFDS builders for local text, built for real into tmp data dirs from the shared corpora."""

from __future__ import annotations

import bz2
import functools
import gzip
import json
import logging
import os
import re
import subprocess
import sys
import textwrap
from collections import defaultdict

import pytest
import tensorflow_datasets as tfds

from albert_jax.data import sources
from albert_jax.data.builders import (
    Books,
    BooksConfig,
    Documents,
    DocumentsConfig,
    WikipediaDump,
    WikipediaDumpConfig,
    clean_wikitext,
    counters,
)
from albert_jax.data.builders.base import Tally, _title_hash, in_validation
from albert_jax.data.line_reading import LineLimits

WIKI_SAMPLE = "corpora/enwiki-sample-pages-articles.xml.bz2"


def _read_jsonl_gz(path: str) -> list[dict]:
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def _all_documents(builder: tfds.core.DatasetBuilder) -> dict[str, list[dict[str, str]]]:
    """Every split of a prepared builder, read back through random access."""
    out = {}
    for split in builder.info.splits:
        source = builder.as_data_source(split)
        out[split] = [
            {"title": r["title"].decode(), "text": r["text"].decode()}
            for r in (source[i] for i in range(len(source)))
        ]
    return out


# ---------------------------------------------------------------- wikipedia_dump


@pytest.fixture(scope="module")
def wiki(tmp_path_factory, shared_data):
    config = WikipediaDumpConfig(
        name="sample", files=(os.path.join(shared_data, WIKI_SAMPLE),), validation_fraction=0.05
    )
    builder = WikipediaDump(config=config, data_dir=str(tmp_path_factory.mktemp("tfds")))
    builder.download_and_prepare()
    return builder


def test_wikipedia_dump_keeps_exactly_the_articles(wiki):
    # The sample has 206 pages: 205 in ns 0 (99 of them redirects) and 1 in ns 4. Of the 106
    # articles, "List of anthropologists" is only a list and cleans to nothing.
    c = counters(wiki)
    assert c["pages"] == 206
    assert c["redirects"] == 99
    assert c["non_article_pages"] == 1
    assert c["empty_documents"] == 1
    articles = c["pages"] - c["redirects"] - c["non_article_pages"]
    assert articles == 106 == c["documents"] + c["empty_documents"]
    assert c["documents"] == 105
    assert c["decode_errors"] == 0 and c["files"] == 1
    docs = _all_documents(wiki)
    assert {k: len(v) for k, v in docs.items()} == {"train": 103, "validation": 2}
    titles = [d["title"] for split in docs.values() for d in split]
    assert len(set(titles)) == 105
    assert "List of anthropologists" not in titles and "AccessibleComputing" not in titles
    assert sorted(d["title"] for d in docs["validation"]) == ["Algae", "Animal Farm"]
    assert all(in_validation(d["title"], 0.05) for d in docs["validation"])
    assert not any(in_validation(d["title"], 0.05) for d in docs["train"])


def test_wikipedia_dump_text_is_clean_prose(wiki):
    docs = {d["title"]: d["text"] for split in _all_documents(wiki).values() for d in split}
    assert docs["Anarchism"].startswith(
        "Anarchism is a political philosophy that advocates self-governed societies based on "
        "voluntary institutions. These are often described as stateless societies, although"
    )
    actrius = docs["Actrius"]
    assert actrius.startswith(
        "Actresses (Catalan: Actrius) is a 1997 Catalan language Spanish drama film produced "
        "and directed by Ventura Pons"
    )
    assert "Synopsis" not in actrius  # heading dropped
    assert "as Glòria Marc" not in actrius  # the "Cast" list dropped
    assert "Catalan language film poster" not in actrius  # infobox dropped
    # {{convert|1300|mi|km}} is part of the sentence.
    assert (
        "At 1300 mi, Alabama has one of the longest navigable inland waterways" in (docs["Alabama"])
    )
    debris = ["{{", "}}", "[[", "]]", "<ref", "</", "'''", "''", "==", "{|", "|}", "thumb|"]
    debris += ["Category:", "File:", "Image:", "&nbsp;", "&amp;", "__TOC__", "http://"]
    for title, text in docs.items():
        for piece in debris:
            assert piece not in text, (title, piece)
        assert text == text.strip() and "\n\n" not in text


def test_wikipedia_dump_streams_through_as_dataset(wiki):
    by_index = _all_documents(wiki)["train"]
    streamed = [
        {"title": r["title"].decode(), "text": r["text"].decode()}
        for r in tfds.as_numpy(wiki.as_dataset("train"))
    ]
    assert streamed == by_index


def test_wikipedia_dump_bad_bytes_and_truncation_are_counted(tmp_path):
    page = (
        "<page><title>{title}</title><ns>0</ns><id>{id}</id><revision><text>{text}</text>"
        "</revision></page>"
    )
    head = '<mediawiki xmlns="http://www.mediawiki.org/xml/export-0.10/">'
    body = page.format(title="Good", id=1, text="'''Good''' is fine.").encode()
    body += page.format(title="Bad", id=2, text="caf\xe9 \ufffd ok").encode()
    body = body.replace("café".encode(), b"caf\xe9")  # a Latin-1 byte: invalid UTF-8
    truncated = page.format(title="Cut", id=3, text="never closed")[:-20].encode()
    path = tmp_path / "dump.xml"
    path.write_bytes(head.encode() + body + truncated)
    config = WikipediaDumpConfig(name="bad", files=(str(path),), validation_fraction=0)
    builder = WikipediaDump(config=config, data_dir=str(tmp_path / "tfds"))
    builder.download_and_prepare()
    c = counters(builder)
    # One invalid byte; the U+FFFD written in the dump itself is not an error.
    assert c["decode_errors"] == 1 and c["xml_errors"] == 1
    assert c["documents"] == 2 and c["pages"] == 2
    docs = {d["title"]: d["text"] for d in _all_documents(builder)["train"]}
    assert docs == {"Good": "Good is fine.", "Bad": "caf\ufffd \ufffd ok"}


def test_wikipedia_dump_parallel_cleaning_gives_identical_output(tmp_path, shared_data):
    files = [os.path.join(shared_data, WIKI_SAMPLE)]
    wanted = {"Actrius", "Alain Connes", "Algae"}.__contains__

    def read(workers: int) -> list[tuple[str, str, str]]:
        config = WikipediaDumpConfig(name=f"w{workers}", files=tuple(files), num_workers=workers)
        builder = WikipediaDump(config=config, data_dir=str(tmp_path))
        return list(builder._read_documents(files, wanted, Tally("train")))

    serial = read(1)
    assert [title for _, title, _ in serial] == ["Actrius", "Alain Connes", "Algae"]
    assert read(2) == serial  # two spawned cleaning processes: same records, same order


# ---------------------------------------------------------------- clean_wikitext


def test_clean_wikitext_strips_every_kind_of_markup():
    markup = """{{Infobox person|name=X|birth_date={{birth date|1900|1|1}}}}
'''Ada''' ''Lovelace''<ref>{{cite book|title=T}}</ref> was a [[mathematician]]
and [[writer|author]].<ref name="a"/>
She worked on the [[Analytical Engine]] <!-- hidden -->
with [http://example.org Charles Babbage] at http://bare.example.org.
[[File:Ada.jpg|thumb|A portrait of [[Ada]]]]
{| class="wikitable"
|-
! Year !! Event
|-
| 1843 || Notes
|}
She walked {{convert|5|km|mi}} daily (born {{lang|fr|Augusta}}&nbsp;Ada; {{IPA|/x/}}).

== Life ==
* a list item
# a numbered item
Her <small>notes</small> included <b>an</b> algorithm.__NOTOC__
[[Category:Mathematicians]]
[[de:Ada Lovelace]]

== References ==
{{reflist}}
Some text of the reference section.
"""
    assert clean_wikitext(markup) == (
        "Ada Lovelace was a mathematician and author. She worked on the Analytical Engine with "
        "Charles Babbage at.\n"
        "She walked 5 km daily (born Augusta Ada).\n"
        "Her notes included an algorithm."
    )


def test_clean_wikitext_of_markup_only_page_is_empty():
    assert clean_wikitext("{{Infobox|a=b}}\n* item\n[[Category:X]]\n== Heading ==\n") == ""


# ---------------------------------------------------------------- books


def _write_book(path, chapters: list[dict], gutenberg: bool) -> list[str]:
    """Writes chapters as a hard-wrapped book; returns the expected paragraphs."""
    lines, paragraphs = [], []
    if gutenberg:
        lines += ["The Project Gutenberg EBook of a novel", "", "Produced by a volunteer", ""]
        lines += ["*** START OF THE PROJECT GUTENBERG EBOOK A NOVEL ***", "", ""]
    for chapter in chapters:
        heading = chapter["title"].split(" ", 1)[1]  # "emma CHAPTER I" -> "CHAPTER I"
        lines += ["", heading, "", ""]
        paragraphs.append(heading)
        for paragraph in chapter["text"].split("\n"):
            wrapped = textwrap.wrap(paragraph, 70, break_long_words=False, break_on_hyphens=False)
            lines += [*wrapped, ""]
            paragraphs.append(" ".join(paragraph.split()))
    if gutenberg:
        lines += ["*** END OF THE PROJECT GUTENBERG EBOOK A NOVEL ***", "licence text"]
    path.write_text("\r\n".join(lines) if gutenberg else "\n".join(lines), encoding="utf-8")
    return [p for p in paragraphs if p]


def test_books_one_document_per_book(tmp_path, shared_data):
    by_book = defaultdict(list)
    for record in _read_jsonl_gz(os.path.join(shared_data, "corpora/austen.jsonl.gz")):
        by_book[record["title"].split(" ", 1)[0]].append(record)
    book_dir = tmp_path / "books"
    (book_dir / "more").mkdir(parents=True)
    expected = {}
    for i, (book, chapters) in enumerate(sorted(by_book.items())):
        path = (book_dir / "more" if i % 2 else book_dir) / f"{book}.txt"
        expected[book] = "\n".join(_write_book(path, chapters[:3], gutenberg=(book == "emma")))
    (book_dir / "broken.txt").write_bytes(b"A byte \xff that is not UTF-8.\n\nSecond paragraph.")
    (book_dir / "blank.txt").write_text("  \n\n \n")
    (book_dir / "notes.md").write_text("not a book")  # a directory contributes only .txt

    config = BooksConfig(name="austen", files=(str(book_dir),), validation_fraction=0.2)
    builder = Books(config=config, data_dir=str(tmp_path / "tfds"))
    builder.download_and_prepare()
    docs = _all_documents(builder)
    got = {d["title"]: d["text"] for split in docs.values() for d in split}
    assert got == {**expected, "broken": "A byte \ufffd that is not UTF-8.\nSecond paragraph."}
    assert counters(builder) == {
        "decode_errors": 1,
        "documents": 7,
        "empty_documents": 1,
        "files": 8,
        "gutenberg_boilerplate_removed": 1,
    }
    assert (
        {d["title"] for d in docs["validation"]}
        == {t for t in got if in_validation(t, 0.2)}
        != set()
    )


# ---------------------------------------------------------------- documents


def test_documents_jsonl_sotu(tmp_path, shared_data):
    path = os.path.join(shared_data, "corpora/sotu.jsonl.gz")
    builder = Documents(config=DocumentsConfig(name="sotu", files=(path,)), data_dir=str(tmp_path))
    builder.download_and_prepare()
    docs = _all_documents(builder)
    expected = {r["title"]: r["text"].strip() for r in _read_jsonl_gz(path)}
    got = {d["title"]: d["text"] for split in docs.values() for d in split}
    assert len(expected) == 233 and got == expected
    assert sum(len(v) for v in docs.values()) == 233  # titles are unique: no doc lost
    assert 0 < len(docs["validation"]) < 12
    assert counters(builder) == {"documents": 233, "files": 1}
    assert builder.info.metadata["files"] == [path]
    assert builder.data_dir.endswith(os.path.join("documents", "sotu", "1.0.0"))


def test_documents_official_raw_text_format(tmp_path):
    (tmp_path / "a.txt").write_text(
        "This is the first sentence.\nThis is the second one.\n\n"
        "  Another document starts here.  \n\n\n\nA third document.\nWith two lines.\n",
        encoding="utf-8",
    )
    (tmp_path / "b.txt").write_text("Last document, no final newline.", encoding="utf-8")
    config = DocumentsConfig(
        name="raw", files=(str(tmp_path / "*.txt"),), text_format="sentence_per_line"
    )
    builder = Documents(config=config, data_dir=str(tmp_path / "tfds"))
    builder.download_and_prepare()
    got = {d["title"]: d["text"] for split in _all_documents(builder).values() for d in split}
    assert got == {
        "a:0": "This is the first sentence.\nThis is the second one.",
        "a:1": "Another document starts here.",
        "a:2": "A third document.\nWith two lines.",
        "b:0": "Last document, no final newline.",
    }
    # 4 documents, none hashes below 1%: the smallest-hash one is held out.
    assert builder.info.splits["validation"].num_examples == 1
    assert builder.info.metadata["validation_fallback_title"] == min(got, key=_title_hash)


def test_documents_bad_input_is_counted(tmp_path):
    lines = [
        b'{"title": "ok", "text": "A fine record."}',
        b'{"title": "latin1", "text": "caf\xe9 au lait"}',  # invalid UTF-8
        b'{"title": "empty", "text": ""}',
        b'{"title": "blank", "text": "  \\n "}',
        b'{"title": "broken", "text": "no closing quote}',  # unparseable
        b"",  # blank lines are not records
        b'["a list", "not an object"]',
        b'{"title": "no text"}',
        b'{"text": "A record without title."}',
        b'{"title": "surrogate", "text": "lone \\ud800 surrogate"}',
    ]
    inputs = tmp_path / "in"
    inputs.mkdir()
    (inputs / "bad.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    (inputs / "doc.txt").write_bytes(b"Plain text\r\nwith \x80 a bad byte.\r\n")
    (inputs / "empty.txt").write_bytes(b"\n \n")
    config = DocumentsConfig(name="bad", files=(str(inputs),), validation_fraction=0)
    builder = Documents(config=config, data_dir=str(tmp_path / "tfds"))
    builder.download_and_prepare()
    assert counters(builder) == {
        "bad_json_lines": 1,
        "bad_records": 2,
        "decode_errors": 3,  # latin1, surrogate, doc.txt
        "documents": 5,
        "empty_documents": 3,  # empty, blank, empty.txt
        "files": 3,
        "untitled_records": 1,
    }
    assert set(builder.info.splits) == {"train"}
    got = {d["title"]: d["text"] for d in _all_documents(builder)["train"]}
    assert got == {
        "ok": "A fine record.",
        "latin1": "caf\ufffd au lait",
        "bad:9": "A record without title.",
        "surrogate": "lone \ufffd surrogate",
        "doc": "Plain text\nwith \ufffd a bad byte.",
    }


def _build_documents(tmp_path, name: str, data: bytes, text_format: str = "auto"):
    path = tmp_path / name
    path.write_bytes(data)
    config = DocumentsConfig(
        name=name.replace(".", "_"), files=(str(path),), validation_fraction=0,
        text_format=text_format,
    )  # fmt: skip
    builder = Documents(config=config, data_dir=str(tmp_path / "tfds"))
    builder.download_and_prepare()
    return builder


def test_input_that_is_not_utf8_text_is_an_error_naming_it(tmp_path, caplog):
    """#66 case 4: random bytes as raw text trained on `<unk>`s and a Latin-1 file kept every
    document with U+FFFD, with only an INFO counter to tell; a UTF-16 file (byte-order mark)
    ended in "split 'train' would be empty", nothing about its encoding."""
    import random

    noise = random.Random(0).randbytes(200_000)
    with pytest.raises(ValueError, match=r"split 'train': .* not UTF-8 .*noise\.txt"):
        _build_documents(tmp_path, "noise.txt", noise, "sentence_per_line")

    latin1 = (
        "".join(
            json.dumps(
                {"title": f"t{i}", "text": "Un caf\u00e9 noir, s'il vous pla\u00eet."},
                ensure_ascii=False,
            )
            + "\n"
            for i in range(20)
        )
        .encode("utf-8")
        .replace("é".encode(), b"\xe9")
        .replace("î".encode(), b"\xee")
    )
    with pytest.raises(ValueError, match=r"20 of 20 documents hold bytes that are "
                       r"not UTF-8 .*latin1\.jsonl.*iconv -f LATIN1 -t UTF-8"):  # fmt: skip
        _build_documents(tmp_path, "latin1.jsonl", latin1)

    utf16 = "A document in UTF-16.\n\nAnother one.\n".encode("utf-16")  # with its BOM
    for name, text_format in [("utf16.txt", "sentence_per_line"), ("utf16doc.txt", "auto")]:
        with pytest.raises(ValueError, match=rf"{name}: a UTF-16LE file .* iconv -f UTF-16LE"):
            _build_documents(tmp_path, name, utf16, text_format)

    # One bad record among twenty sound ones: kept, and said at WARNING.
    sound = latin1.decode("latin-1").encode("utf-8").splitlines(keepends=True)
    mixed = b"".join(sound[:19]) + latin1.splitlines(keepends=True)[19]
    with caplog.at_level(logging.WARNING):
        builder = _build_documents(tmp_path, "mixed.jsonl", mixed)
    assert counters(builder)["documents"] == 20
    assert "1 of 20 documents hold bytes that are not UTF-8" in caplog.text


def test_documents_all_empty_is_an_error(tmp_path):
    (tmp_path / "e.jsonl").write_text('{"title": "a", "text": " "}\n')
    config = DocumentsConfig(name="e", files=(str(tmp_path / "e.jsonl"),), validation_fraction=0)
    builder = Documents(config=config, data_dir=str(tmp_path / "tfds"))
    with pytest.raises(ValueError, match="split 'train' would be empty"):
        builder.download_and_prepare()


def test_config_errors_name_the_field(tmp_path):
    with pytest.raises(ValueError, match="text_format"):
        DocumentsConfig(name="x", files=("a",), text_format="xml")
    with pytest.raises(ValueError, match="validation_fraction"):
        BooksConfig(name="x", files=("a",), validation_fraction=1.0)
    with pytest.raises(ValueError, match="num_workers"):
        WikipediaDumpConfig(name="x", files=("a",), num_workers=-1)
    builder = Books(
        config=BooksConfig(name="x", files=(str(tmp_path / "missing"),)), data_dir=str(tmp_path)
    )
    with pytest.raises(ValueError, match="files: .*missing.* does not exist"):
        builder.download_and_prepare()


# ---------------------------------------------------------------- unreadable inputs are named


def _jsonl(n: int) -> bytes:
    return b"".join(
        json.dumps({"title": f"doc {i}", "text": f"Document number {i} says hello."}).encode()
        + b"\n"
        for i in range(n)
    )


def _sentences(n: int) -> bytes:
    return b"".join(b"Sentence %d of the corpus.\n%s" % (i, b"\n" * (i % 5 == 4)) for i in range(n))


def _wiki(n: int) -> bytes:
    page = "<page><title>P{0}</title><ns>0</ns><id>{0}</id><revision><text>Page {0} text.</text>"
    pages = "".join(page.format(i) + "</revision></page>\n" for i in range(n))
    return f'<mediawiki xmlns="http://www.mediawiki.org/xml/export-0.10/">\n{pages}</mediawiki>\n'.encode()


@pytest.mark.parametrize(
    "builder, config, name, content, compress",
    [
        (Documents, DocumentsConfig, "corpus.jsonl.gz", _jsonl, gzip.compress),
        (Documents, DocumentsConfig, "corpus.jsonl.bz2", _jsonl, bz2.compress),
        (
            Documents,
            functools.partial(DocumentsConfig, text_format="sentence_per_line"),
            "raw.txt.gz",
            _sentences,
            gzip.compress,
        ),
        (Documents, DocumentsConfig, "one_document.txt.gz", _sentences, gzip.compress),
        (Books, BooksConfig, "emma.txt.gz", _sentences, gzip.compress),
        (WikipediaDump, WikipediaDumpConfig, "dump.xml.bz2", _wiki, bz2.compress),
    ],
    ids=["jsonl.gz", "jsonl.bz2", "raw_text.gz", "document.gz", "books.gz", "wikipedia.bz2"],
)
def test_truncated_corpus_file_names_the_file_and_line(
    tmp_path, builder, config, name, content, compress
):
    """A corpus file cut short (an interrupted download or copy) stops the build with an error
    naming the file and the line the data stops at, instead of a bare EOFError."""
    whole = compress(content(3000))
    path = tmp_path / name
    path.write_bytes(whole[: len(whole) * 3 // 4])
    dataset = builder(
        config=config(name="cut", files=(str(path),), validation_fraction=0),
        data_dir=str(tmp_path / "tfds"),
    )
    pattern = re.escape(str(path)) + r": line \d+: (gzip|bzip2) data is truncated or corrupt"
    with pytest.raises(ValueError, match=pattern):
        dataset.download_and_prepare()
    assert not dataset.is_prepared()
    path.write_bytes(whole)  # the whole file builds
    dataset = builder(
        config=config(name="whole", files=(str(path),), validation_fraction=0),
        data_dir=str(tmp_path / "tfds"),
    )
    dataset.download_and_prepare()
    assert counters(dataset)["documents"] >= 1


# ---------------------------------------------------------------- bounded reading (#58 11)


def test_corpus_reading_is_bounded_and_counted(tmp_path):
    data_dir = str(tmp_path / "tfds")
    limits = LineLimits(max_line_bytes=100, max_blank_lines=5)
    # Raw text: a long line is skipped without ending its document; a long blank run ends the
    # file's read (the document after it is not read).
    raw = tmp_path / "raw.txt"
    raw.write_text(
        "A first sentence.\n" + "x" * 101 + "\nSecond sentence.\n\nDoc two.\n"
        + "\n" * 10 + "Never read.\n"
    )  # fmt: skip
    builder = sources.build_source("raw_text/b", data_dir=data_dir, files=str(raw), limits=limits)
    got = {d["title"]: d["text"] for split in _all_documents(builder).values() for d in split}
    assert got == {"raw:0": "A first sentence.\nSecond sentence.", "raw:1": "Doc two."}
    assert counters(builder) == {
        "blank_runs_too_long": 1,
        "documents": 2,
        "files": 1,
        "lines_too_long": 1,
    }
    # The bounds are not part of the dataset's identity: asked for with others (the defaults),
    # the prepared dataset is used as it is, not refused as built with another config.
    again = sources.build_source("raw_text/b", data_dir=data_dir, files=str(raw))
    assert again.info.metadata["build_id"] == builder.info.metadata["build_id"]

    # JSON Lines, whole-file documents and books: a line or a file over the cap is skipped.
    inputs = tmp_path / "in"
    inputs.mkdir()
    long_record = json.dumps({"title": "long", "text": "y" * 100})
    (inputs / "a.jsonl").write_text(f'{{"text": "One."}}\n{long_record}\n{{"text": "Two."}}\n')
    (inputs / "small.txt").write_text("A small document.")
    (inputs / "big.txt").write_text("z" * 101)
    bounds = {"max_line_bytes": 100, "max_blank_lines": 5, "validation_fraction": 0}
    config = DocumentsConfig(name="mixed", files=(str(inputs),), **bounds)
    builder = Documents(config=config, data_dir=data_dir)
    builder.download_and_prepare()
    assert sorted(d["title"] for d in _all_documents(builder)["train"]) == ["a:1", "a:3", "small"]
    assert counters(builder) == {
        "documents": 3,
        "documents_too_long": 1,
        "files": 3,
        "lines_too_long": 1,
        "untitled_records": 2,
    }
    builder = Books(config=BooksConfig(name="b", files=(str(inputs),), **bounds), data_dir=data_dir)
    builder.download_and_prepare()
    assert [d["title"] for d in _all_documents(builder)["train"]] == ["small"]
    assert counters(builder) == {"documents": 1, "documents_too_long": 1, "files": 2}
    with pytest.raises(ValueError, match="max_line_bytes must be an integer >= 1, got 0"):
        DocumentsConfig(name="c", files=(str(inputs),), max_line_bytes=0)


# Reads a corpus file as the `documents` builder does, in a fresh process: its peak memory is
# the reader's alone.
_READ_CORPUS_IN_A_PROCESS = """
import json, resource, sys
from albert_jax.data.builders import Documents, DocumentsConfig
from albert_jax.data.builders.base import Tally
# A high max_expansion: the file is ~1000x its stored size, and the long line is under test.
config = DocumentsConfig(name="x", files=(sys.argv[1],), max_expansion=10_000)
builder = Documents(config=config, data_dir=sys.argv[2])
tally = Tally("train")
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
titles = [title for _, title, _ in builder._read_documents([sys.argv[1]], lambda t: True, tally)]
grew = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
print(json.dumps({"titles": titles, "counts": tally.counts, "grew_mib": grew}))
"""


def test_a_gigabyte_corpus_line_is_skipped_in_bounded_memory(tmp_path):
    # ~1 MB of gzip that expands to one 1 GiB line: held whole before (GBs), now read past in
    # pieces of at most the 64 MiB cap.
    path = tmp_path / "corpus.jsonl.gz"
    member = gzip.compress(b"a" * (1 << 20), compresslevel=9)
    with open(path, "wb") as f:  # gzip members: the repeated one compressed once
        f.write(gzip.compress(b'{"title": "first", "text": "A document."}\n'))
        f.write(member * 1024)
        f.write(gzip.compress(b'\n{"title": "last", "text": "Another one."}\n'))
    assert path.stat().st_size < 2 << 20
    done = subprocess.run(
        [sys.executable, "-c", _READ_CORPUS_IN_A_PROCESS, str(path), str(tmp_path / "tfds")],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.splitlines()[-1])
    assert got["titles"] == ["first", "last"]
    assert got["counts"] == {"lines_too_long": 1}
    assert got["grew_mib"] < 256, got
    assert f"{path}: line 2 is longer than max_line_bytes=67108864; skipped" in done.stderr


def test_pretraining_config_sets_the_read_bounds(tmp_path):
    # config.data.max_line_bytes / max_blank_lines reach the build (prepare.build_sources, as
    # a training run calls it), and bad values fail the config check, naming the field.
    from albert_jax.pretrain import prepare
    from albert_jax.pretrain import settings as train_config
    from configs.pretrain import get_config

    raw = tmp_path / "raw.txt"
    raw.write_text("One.\n" + "x" * 101 + "\nTwo.\n\nThree.\n")
    config = get_config(f"size=tiny,data=raw_text/cfg={raw}")
    config.data.data_dir = str(tmp_path / "tfds")
    config.data.max_line_bytes = 100
    prepare.build_sources(train_config.validate_config(config).prepare)
    builder = sources.build_source("raw_text/cfg", data_dir=config.data.data_dir)
    assert counters(builder) == {"documents": 2, "files": 1, "lines_too_long": 1}
    config.data.max_blank_lines = 0
    with pytest.raises(ValueError, match=r"config\.data\.max_blank_lines must be an integer"):
        train_config.validate_config(config)
