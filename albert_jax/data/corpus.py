"""The tokenized corpus: documents -> sentences -> one token stream (`TokenizedCorpus`), and
the readers of the document files the official tools take.

Follows the official ALBERT `create_pretraining_data.py`: each document is split into sentences
(`sentences.split_sentences`), normalized and tokenized; empty sentences and empty documents are
dropped (and counted). A `TokenizedCorpus` is one flat token array plus sentence and document
offsets: what the tokenized cache (`cache.py`) stores per source and data shard, and what the
instances (`instances.py`) and batches (`batches.py`) are cut from.

Readers: `iter_raw_text_documents` (one sentence per line, a blank line between documents) and
`iter_jsonl_documents` (`{"title", "text"}` records), local or `gs://`, gzip / bzip2 detected.
"""

from __future__ import annotations

import contextlib
import io
import json
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from albert_jax import files
from albert_jax.data import line_reading, sentences

if TYPE_CHECKING:
    from albert_jax.data.tokenizer import Tokenizer


@dataclass(frozen=True)
class TokenizedCorpus:
    """Documents as one token stream.

    tokens: [T] (uint16 or int32) all sentences back to back; sentence_starts: [n_sent+1] int64
    token offsets; doc_starts: [n_doc+1] int64 sentence offsets. Sentences and documents are
    never empty.
    """

    tokens: np.ndarray
    sentence_starts: np.ndarray
    doc_starts: np.ndarray

    @property
    def num_documents(self) -> int:
        return len(self.doc_starts) - 1

    @property
    def num_sentences(self) -> int:
        return len(self.sentence_starts) - 1

    def document_tokens(self, d: int) -> np.ndarray:
        """All tokens of document `d`, [n] in sentence order."""
        lo = self.sentence_starts[self.doc_starts[d]]
        hi = self.sentence_starts[self.doc_starts[d + 1]]
        return self.tokens[lo:hi]

    def document_of_token(self, token_index: np.ndarray) -> np.ndarray:
        """Document index of each global token offset."""
        sent = np.searchsorted(self.sentence_starts, token_index, side="right") - 1
        return np.searchsorted(self.doc_starts, sent, side="right") - 1


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= np.iinfo(np.uint16).max + 1 else np.dtype(np.int32)


def tokenize_document(
    text: str | bytes, tokenizer: Tokenizer, counters: Counter
) -> list[list[int]]:
    """One document -> its non-empty sentences as id lists (counters updated)."""
    sents = sentences.split_sentences(text, counters)
    encoded = [ids for ids in tokenizer.encode_batch(sents) if ids] if sents else []
    counters["sentences"] += len(encoded)
    counters["sentences_empty_dropped"] += len(sents) - len(encoded)
    return encoded


def concat_documents(docs: Iterable[list[list[int]]], vocab_size: int) -> TokenizedCorpus:
    """Tokenized documents (lists of sentences) -> `TokenizedCorpus`; empty docs dropped."""
    dtype = token_dtype(vocab_size)
    chunks: list[np.ndarray] = []
    sent_lens: list[int] = []
    doc_sizes: list[int] = []
    for doc in docs:
        if not doc:
            continue
        doc_sizes.append(len(doc))
        for s in doc:
            sent_lens.append(len(s))
        chunks.append(np.fromiter((t for s in doc for t in s), dtype=dtype))
    tokens = np.concatenate(chunks) if chunks else np.zeros(0, dtype)
    sentence_starts = np.zeros(len(sent_lens) + 1, np.int64)
    np.cumsum(sent_lens, out=sentence_starts[1:])
    doc_starts = np.zeros(len(doc_sizes) + 1, np.int64)
    np.cumsum(doc_sizes, out=doc_starts[1:])
    return TokenizedCorpus(tokens, sentence_starts, doc_starts)


def tokenize_documents(
    documents: Iterable[dict | str | bytes], tokenizer: Tokenizer, counters: Counter | None = None
) -> TokenizedCorpus:
    """Documents (`{"title", "text"}` dicts, or raw text) -> `TokenizedCorpus`.

    Counts in `counters`: documents, documents_empty, documents_one_sentence, sentences,
    sentences_empty_dropped, long_sentences_chunked, non_utf8_replaced.
    """
    counters = Counter() if counters is None else counters

    def gen() -> Iterator[list[list[int]]]:
        for doc in documents:
            yield tokenize_one(doc, tokenizer, counters)

    return concat_documents(gen(), tokenizer.vocab_size)


def tokenize_one(
    doc: dict | str | bytes, tokenizer: Tokenizer, counters: Counter
) -> list[list[int]]:
    """Tokenizes one document and counts what was dropped."""
    text = doc.get("text", "") if isinstance(doc, dict) else doc
    counters["documents"] += 1
    encoded = tokenize_document(text, tokenizer, counters)
    if not encoded:
        counters["documents_empty"] += 1
    elif len(encoded) == 1:
        counters["documents_one_sentence"] += 1
    return encoded


def iter_raw_text_documents(
    source: str | bytes | io.IOBase,
    *,
    limits: line_reading.LineLimits = line_reading.DEFAULT_LINE_LIMITS,
    counters: Counter | None = None,
) -> Iterator[dict]:
    """Reads the official raw format: one sentence per line, a blank line between documents.

    `source` is a path (local or `gs://`; gzip / bzip2 detected from the content), bytes, or a
    binary file object (left open). Bytes that are not UTF-8 are kept as bytes in "text" so
    that `tokenize_documents` replaces and counts them. Lines are read within `limits`
    (`line_reading.read_lines`); `counters` counts `lines_too_long` and `blank_runs_too_long`.
    """
    name = source if isinstance(source, str) else getattr(source, "name", "<bytes>")
    on_skip = (
        None if counters is None else lambda r, _: counters.update([line_reading.SKIP_COUNTERS[r]])
    )
    if isinstance(source, bytes):
        stream: Any = contextlib.nullcontext(io.BytesIO(source))
    elif isinstance(source, str):
        stream = files.open_binary(source)
    else:
        stream = contextlib.nullcontext(source)
    lines: list[bytes] = []

    def flush() -> dict:
        raw = b"\n".join(lines)
        try:
            text: str | bytes = raw.decode("utf-8")
        except UnicodeDecodeError:
            text = raw
        return {"title": "", "text": text}

    with stream as f:
        for _, line in line_reading.read_lines(f, str(name), limits, on_skip):
            line = line.rstrip(b"\r")
            if line.strip():
                lines.append(line)
            elif lines:
                yield flush()
                lines = []
        if lines:
            yield flush()


def iter_jsonl_documents(
    path: str,
    *,
    limits: line_reading.LineLimits = line_reading.DEFAULT_LINE_LIMITS,
    counters: Counter | None = None,
) -> Iterator[dict]:
    """`{"title", "text"}` records of a (gzip) JSON Lines file, local or `gs://`; lines are
    read within `limits`, counted in `counters` like `iter_raw_text_documents`'."""
    on_skip = (
        None if counters is None else lambda r, _: counters.update([line_reading.SKIP_COUNTERS[r]])
    )
    with files.open_binary(path) as raw:
        for _, line in line_reading.read_lines(raw, path, limits, on_skip):
            if line.strip():
                yield json.loads(line.decode("utf-8", errors="replace"))
