"""TFDS builders for local text: `documents`, `books`, `wikipedia_dump`, and the demo corpus.

Each builder writes `{"title": str, "text": str}` documents with `train` and `validation`
splits (ArrayRecord by default). Most users go through `albert_jax.data.sources`; the classes
can also be used directly:

    from albert_jax.data.builders import Books, BooksConfig
    builder = Books(config=BooksConfig(name="mine", files=("/data/books",)), data_dir=DIR)
    builder.download_and_prepare()

Names are imported lazily: worker processes that only clean wiki markup import
`builders.wikitext` without loading TensorFlow.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "Books": "albert_jax.data.builders.books",
    "BooksConfig": "albert_jax.data.builders.books",
    "Demo": "albert_jax.data.builders.demo",
    "Documents": "albert_jax.data.builders.documents",
    "DocumentsConfig": "albert_jax.data.builders.documents",
    "LocalTextBuilder": "albert_jax.data.builders.base",
    "LocalTextConfig": "albert_jax.data.builders.base",
    "WikipediaDump": "albert_jax.data.builders.wikipedia_dump",
    "WikipediaDumpConfig": "albert_jax.data.builders.wikipedia_dump",
    "clean_wikitext": "albert_jax.data.builders.wikitext",
    "counters": "albert_jax.data.builders.base",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'albert_jax.data.builders' has no attribute {name!r}")
