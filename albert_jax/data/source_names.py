"""Document source names and mixture specs: `NAME[=FILES][:WEIGHT],...` -> `Source`s
(`parse_sources`); what `sources` builds and reads.

A *source* is a named TFDS dataset with a mixture weight. Names:

| name | dataset | inputs |
|---|---|---|
| `demo` | the corpus shipped in albert_jax/data/demo (builder `albert_demo`) | none |
| `documents[/CONFIG]` | our `documents` builder: JSONL, or one document per text file | files |
| `raw_text[/CONFIG]` | `documents`, official BERT/ALBERT raw-text format (note 1) | files |
| `books[/CONFIG]` | our `books` builder: one document per book `.txt` | files |
| `wikipedia_dump[/CONFIG]` | our `wikipedia_dump` builder: MediaWiki XML dumps | files |
| other, e.g. `wikipedia/20230601.en` | the TFDS catalog dataset, used as is (note 2) | none |

Notes: (1) one sentence per line, a blank line between documents; (2) never downloaded here.

Mixture specs (`parse_sources`): comma-separated `NAME[=FILES][:WEIGHT]`, FILES being
`;`-separated paths, globs or directories, e.g.

    "demo"
    "wikipedia/20230601.en:0.5,books:0.5"
    "books=/data/bookcorpus/*.txt:1,wikipedia_dump=/data/enwiki-latest-pages-articles.xml.bz2:3"

and presets: `wiki_books`, the paper's pretraining data (ALBERT §4.1 and BERT §3.1: English
Wikipedia + BookCorpus). Its weights are proportional to the corpus sizes BERT reports
(Wikipedia 2,500M words, BookCorpus 800M words), i.e. 0.758 / 0.242: the authors trained on
the two corpora concatenated, so each one's share of the training sequences was its share of
the words; drawing each example's source with these weights (as the pipeline does)
reproduces that. Wikipedia is the catalog's `wikipedia/20230601.en`; BookCorpus is not in the
catalog, so `books` must be built from your files first (`build_source(Source("books"),
files=...)`, or the spec `books=/path/*.txt` alongside).
"""

from __future__ import annotations

import dataclasses
import math
import os
import re

import tensorflow_datasets as tfds

from albert_jax import files
from albert_jax.data.builders.base import LocalTextBuilder
from albert_jax.data.builders.books import Books, BooksConfig
from albert_jax.data.builders.demo import Demo
from albert_jax.data.builders.documents import Documents, DocumentsConfig
from albert_jax.data.builders.wikipedia_dump import WikipediaDump, WikipediaDumpConfig

CATALOG_WIKIPEDIA = "wikipedia/20230601.en"
# BERT §3.1: "BooksCorpus (800M words) and English Wikipedia (2,500M words)".
PRESETS: dict[str, tuple[tuple[str, float], ...]] = {
    "wiki_books": ((CATALOG_WIKIPEDIA, 2500.0), ("books", 800.0)),
}
DEFAULT_CONFIG = "default"


@dataclasses.dataclass(frozen=True)
class _Local:
    """How one of our source names maps to a builder."""

    builder: type[LocalTextBuilder]
    config_cls: type | None  # None: the builder has its own fixed config (demo)
    default_config: str
    config_fields: tuple[tuple[str, str], ...] = ()


_LOCAL: dict[str, _Local] = {
    "demo": _Local(Demo, None, DEFAULT_CONFIG),
    "documents": _Local(Documents, DocumentsConfig, DEFAULT_CONFIG),
    "raw_text": _Local(
        Documents, DocumentsConfig, "raw_text", (("text_format", "sentence_per_line"),)
    ),
    "books": _Local(Books, BooksConfig, DEFAULT_CONFIG),
    "wikipedia_dump": _Local(WikipediaDump, WikipediaDumpConfig, DEFAULT_CONFIG),
}
LOCAL_SOURCES = tuple(_LOCAL)

_NUMBER = re.compile(r"[+-]?(\d+(\.\d*)?|\.\d+)([eE][+-]?\d+)?")
_CONFIG_NAME = re.compile(r"[A-Za-z0-9_.-]+")


@dataclasses.dataclass(frozen=True)
class Source:
    """One document source of a pretraining mixture.

    Attributes:
      name: `demo`, `documents[/CONFIG]`, `raw_text[/CONFIG]`, `books[/CONFIG]`,
        `wikipedia_dump[/CONFIG]`, or a TFDS catalog name such as `wikipedia/20230601.en`.
      weight: sampling weight (> 0); `parse_sources` normalizes a mixture's weights to sum 1.
      files: input paths / globs / directories for our builders (used when the dataset is not
        prepared yet); empty for `demo` and catalog datasets.
    """

    name: str
    weight: float = 1.0
    files: tuple[str, ...] = ()

    def __post_init__(self):
        if isinstance(self.files, str):
            object.__setattr__(self, "files", (self.files,))
        else:
            object.__setattr__(self, "files", tuple(os.fspath(f) for f in self.files))
        if not self.name or self.name != self.name.strip():
            raise ValueError(f"name: must be a non-empty name without spaces, got {self.name!r}")
        if not (math.isfinite(self.weight) and self.weight > 0):
            raise ValueError(
                f"weight of {self.name!r} must be a finite number > 0, got {self.weight}"
            )

    @property
    def is_local(self) -> bool:
        """True for our builders (built from local files), False for TFDS catalog datasets."""
        return self.name.split("/", 1)[0] in _LOCAL


def _split_local_name(name: str) -> tuple[_Local, str]:
    base, _, config = name.partition("/")
    local = _LOCAL[base]
    if not config:
        return local, local.default_config
    if local.config_cls is None:
        raise ValueError(f"source {name!r}: {base!r} has no configs; use {base!r}")
    if not _CONFIG_NAME.fullmatch(config):
        raise ValueError(
            f"source {name!r}: config name {config!r} may only use letters, digits, '_', '.', '-'"
        )
    return local, config


def _check_catalog_name(name: str) -> None:
    """Raises ValueError unless `name` is a TFDS catalog dataset (and config) name."""
    dataset, _, config = name.partition(":")[0].partition("/")
    try:
        builder_cls = tfds.builder_cls(dataset)
    except tfds.core.registered.DatasetNotFoundError:
        raise ValueError(
            f"unknown source {name!r}: not one of ours {sorted(_LOCAL)}, a preset "
            f"{sorted(PRESETS)}, or a TFDS catalog dataset. Write NAME[=FILES][:WEIGHT]."
        ) from None
    configs = {c.name for c in builder_cls.BUILDER_CONFIGS or ()}
    if config and configs and config not in configs:
        raise ValueError(f"unknown source {name!r}: TFDS {dataset!r} has no config {config!r}")


def _parse_item(item: str) -> list[Source]:
    head, colon, tail = item.rpartition(":")
    weight = 1.0
    if colon and _NUMBER.fullmatch(tail.strip()):
        item, weight = head, float(tail)
    if weight <= 0:
        raise ValueError(f"sources: weight of {item!r} must be > 0, got {weight:g}")
    name, equals, file_list = (part.strip() for part in item.partition("="))
    files = tuple(f.strip() for f in file_list.split(";") if f.strip())
    if not name:
        raise ValueError(f"sources: {item!r} has no source name")
    if equals and not files:
        raise ValueError(f"sources: {name!r} has '=' but no files after it")
    if name in PRESETS:
        if files:
            raise ValueError(f"sources: preset {name!r} takes no files; list its parts instead")
        # The preset's parts share its weight in their own proportions.
        preset_total = math.fsum(w for _, w in PRESETS[name])
        return [Source(part, weight * w / preset_total) for part, w in PRESETS[name]]
    if name.split("/", 1)[0] in _LOCAL:
        local, _ = _split_local_name(name)
        if files and local.config_cls is None:
            raise ValueError(f"sources: {name!r} takes no files")
    else:
        _refuse_a_path(name)
        _check_catalog_name(name)
        if files:
            raise ValueError(
                f"sources: catalog dataset {name!r} takes no files; for local files use "
                f"one of {sorted(n for n in _LOCAL if n != 'demo')}"
            )
    return [Source(name, weight, files)]


_FILE_SUFFIXES = (".jsonl", ".json", ".gz", ".txt", ".bz2", ".xml", ".text")


def _refuse_a_path(name: str) -> None:
    """A file path given where a source name goes (`sources=/data/*.jsonl`) is named as such,
    with the local kinds that read files, instead of TFDS's grammar of dataset names."""
    looks_like_path = (
        name.startswith(("/", ".", "~")) or "*" in name or "://" in name
        or name.lower().endswith(_FILE_SUFFIXES)
    )  # fmt: skip
    if not looks_like_path:
        return
    try:
        found = bool(files.expand(name))
    except (ValueError, OSError):  # no match, or no such file
        found = False
    what = "a path" if found else "a path, and no such file exists"
    raise ValueError(
        f"sources: {name!r} is {what}, not a source name; name the kind of its files: "
        f"documents={name} (JSON Lines with a 'text' field) or raw_text={name} (plain text), "
        f"or another local kind of {sorted(n for n in _LOCAL if n != 'demo')}"
    )


def parse_sources(spec: str) -> list[Source]:
    """Parses a mixture spec into sources whose weights sum to 1.

    Args:
      spec: comma-separated `NAME[=FILES][:WEIGHT]` items (see the module docstring), e.g.
        `"wikipedia/20230601.en:0.5,books:0.5"`, `"demo"`, `"wiki_books"`.

    Raises:
      ValueError: empty spec or item, unknown name, weight <= 0 or not finite, files given
        to a source that takes none, or the same source twice.
    """
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"sources: empty spec {spec!r}; e.g. 'demo' or 'wiki_books'")
    sources: list[Source] = []
    for item in spec.split(","):
        if not item.strip():
            raise ValueError(f"sources: empty item in {spec!r} (stray comma?)")
        sources.extend(_parse_item(item.strip()))
    names = [s.name for s in sources]
    if duplicates := sorted({n for n in names if names.count(n) > 1}):
        raise ValueError(f"sources: {duplicates} listed more than once in {spec!r}")
    total = math.fsum(s.weight for s in sources)
    if not math.isfinite(total):
        raise ValueError(f"sources: weights in {spec!r} are too large")
    return [dataclasses.replace(s, weight=s.weight / total) for s in sources]


def _as_source(source: Source | str) -> Source:
    if isinstance(source, Source):
        return source
    parsed = parse_sources(source)
    if len(parsed) != 1:
        raise ValueError(f"source: {source!r} names {len(parsed)} sources; pass exactly one")
    return dataclasses.replace(parsed[0], weight=1.0)
