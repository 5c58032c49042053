"""The tokenized cache: each source shard sentence-split and tokenized once, kept as arrays.

An entry is a directory `<cache_dir>/<source>[.<key hash>].<split>.<i>-of-<n>.<tokenizer
hash>.v<version>/` holding a `TokenizedCorpus` (`tokens.npy [T]`, `sentence_starts.npy
[n_sent+1]`, `doc_starts.npy [n_doc+1]`) and `stats.json` (the build counters). `stats.json` is
written last and is the entry's commit marker: entries without it are rebuilt, never read.
It also records the build id of the prepared dataset the entry was tokenized from
(`DocumentSource.build_identity`): an entry of an earlier build of a dataset (rebuilt since
under the same name, from changed files) is tokenized again, not read. Where the dataset is
not prepared (another host, or deleted since), the entry is used as it is.
Every file is written atomically (`files.open_atomic`), so processes building the same entry
at once (they write the same bytes) are safe on a local disk and on an object store alike,
which has no directory rename.

Where (`cache_dir_for`): `config.data.cache_dir` when set, local or `gs://`; else
`<data_dir>/albert_jax_cache` for a local data dir; else (a `gs://` data dir, or none) the
per-host cache `~/.cache/albert_jax/albert_jax_cache`: hosts tokenize their own shards, so a
local disk is the fast choice. Local paths are made absolute and `gs://` paths kept as they
are, so neither the directory nor the entry names depend on the working directory.

Reading: a local entry is memory-mapped (worker processes share its pages). A remote entry is
mirrored under `~/.cache/albert_jax/mirror/` (written beside it by the host that builds it,
downloaded once by any other) and memory-mapped from there: the batch workers and later runs
on a host map the same local pages instead of each downloading the arrays and holding a copy.
"""

from __future__ import annotations

import hashlib
import re
from collections import Counter
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

import numpy as np
from absl import logging
from etils import epath

from albert_jax import files
from albert_jax.data import workers
from albert_jax.data.corpus import TokenizedCorpus, concat_documents, tokenize_one

if TYPE_CHECKING:
    from albert_jax.data.data_config import DocumentSource
    from albert_jax.data.tokenizer import Tokenizer

CACHE_VERSION = 1
ARRAYS = ("tokens", "sentence_starts", "doc_starts")  # the fields of a TokenizedCorpus
MARKER = "stats.json"  # written last: an entry without it is incomplete
# In `stats.json`: the build id of the prepared dataset the entry was tokenized from.
BUILD_KEY = "dataset_build"
DEFAULT_NAME = "albert_jax_cache"


class EmptyShardError(ValueError):
    """A data shard holds no non-empty document (more shards than documents in a split)."""


def local_root() -> epath.Path:
    """The per-host cache root `~/.cache/albert_jax` (`$HOME` read at call time)."""
    return files.as_path("~/.cache/albert_jax")


def cache_dir_for(cache_dir: str | None, data_dir: str | None) -> str:
    """The tokenized cache directory of a run (see the module docstring): absolute, or `gs://`."""
    if cache_dir:
        return files.absolute(cache_dir)
    if data_dir and files.is_local(data_dir):
        return str(files.as_path(data_dir) / DEFAULT_NAME)
    return str(local_root() / DEFAULT_NAME)


def _hash(text: str, n: int) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:n]


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.=-]+", "_", name)


def cache_path(
    cache_dir: str,
    source: DocumentSource,
    split: str,
    shard_index: int,
    shard_count: int,
    tokenizer: Tokenizer,
) -> str:
    """`<cache_dir>/<source>[.<key hash>].<split>.<i>-of-<n>.<tokenizer hash>.v<version>`."""
    name = _safe(source.name)
    if source.cache_key:
        name += "." + _hash(source.cache_key, 8)
    key = f"{name}.{_safe(split)}.{shard_index}-of-{shard_count}.{tokenizer.fingerprint}"
    return str(files.as_path(cache_dir) / f"{key}.v{CACHE_VERSION}")


def save_corpus(entry: str | epath.Path, corpus: TokenizedCorpus, stats: dict) -> None:
    """Writes a cache entry: the arrays, then `stats.json` (the commit)."""
    entry = files.as_path(entry)
    for name in ARRAYS:
        try:
            with files.open_atomic(entry / f"{name}.npy") as f:
                np.save(f, getattr(corpus, name))
        except OSError as e:  # numpy's "N requested and M written" names no file
            message = (
                f"tokenized cache entry {entry}: writing {name}.npy failed ({e}); is the disk "
                "full? Free space, or put the cache on another disk with "
                "--config.data.cache_dir=..."
            )
            # numpy's error has no errno: OSError(None, m) would print "[Errno None] m".
            raise (OSError(e.errno, message) if e.errno is not None else OSError(message)) from e
    files.write_json(entry / MARKER, stats, indent=None)


class DamagedEntryError(ValueError):
    """A committed cache entry whose arrays do not load (cut off, overwritten); names the
    file. `load_tokenized` rebuilds such an entry."""


def load_corpus(entry: str | epath.Path) -> TokenizedCorpus:
    """The memory-mapped arrays of a local cache entry.

    Raises:
      DamagedEntryError: naming the array file that does not load (numpy's own error for a
        cut-off file, "mmap length is greater than file size", names none).
    """
    if not files.is_local(entry):
        raise ValueError(f"load_corpus: {entry} is not local; load_tokenized mirrors it first")
    entry = files.as_path(entry)
    arrays = []
    for name in ARRAYS:
        path = entry / f"{name}.npy"
        try:
            arrays.append(np.load(path, mmap_mode="r"))
        except (ValueError, OSError, EOFError) as e:
            raise DamagedEntryError(
                f"tokenized cache entry {entry}: {path.name} does not load ({e}); delete the "
                "entry to have it tokenized again"
            ) from e
    return TokenizedCorpus(*arrays)


def _mirror(entry: epath.Path) -> epath.Path:
    """Where a remote entry is mirrored in the per-host cache."""
    return local_root() / "mirror" / f"{entry.name}.{_hash(str(entry), 8)}"


def _download(entry: epath.Path, mirror: epath.Path) -> None:
    """Copies a remote entry to its mirror, the marker last (a partial copy is copied again)."""
    for name in (*(f"{a}.npy" for a in ARRAYS), MARKER):
        files.copy(entry / name, mirror / name)


class _TokenizeChunk:
    """Picklable worker: a list of documents -> (tokenized documents, counters)."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer

    def __call__(self, docs: list) -> tuple[list[list[list[int]]], Counter]:
        counters: Counter = Counter()
        return [tokenize_one(d, self.tokenizer, counters) for d in docs], counters


def _chunks(items: Iterable, size: int) -> Iterator[list]:
    chunk: list = []
    for item in items:
        chunk.append(item)
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def _build(
    source: DocumentSource,
    tokenizer: Tokenizer,
    split: str,
    shard_index: int,
    shard_count: int,
    num_workers: int,
) -> tuple[TokenizedCorpus, dict[str, int]]:
    """Reads, sentence-splits and tokenizes one source shard; returns (corpus, counters)."""
    counters: Counter = Counter()
    docs = source.documents(split, shard_index, shard_count)

    def tokenized() -> Iterator[list[list[int]]]:
        for encoded, c in workers.ordered_map(
            _TokenizeChunk(tokenizer), _chunks(docs, 64), num_workers=num_workers
        ):
            counters.update(c)
            yield from encoded

    corpus = concat_documents(tokenized(), tokenizer.vocab_size)
    if corpus.num_documents == 0:
        raise EmptyShardError(
            f"source {source.name!r} split {split!r} shard {shard_index}/{shard_count} "
            f"has no non-empty document ({dict(counters)}); use fewer data shards "
            "(config.data.num_shards, processes) or more data"
        )
    counters["tokens"] = len(corpus.tokens)
    return corpus, dict(counters)


def load_tokenized(
    source: DocumentSource,
    tokenizer: Tokenizer,
    *,
    split: str,
    shard_index: int,
    shard_count: int,
    cache_dir: str,
    num_workers: int = 0,
    _rebuilt: bool = False,
) -> tuple[TokenizedCorpus, dict[str, int], str]:
    """Tokenized corpus of one source shard, built once and then memory-mapped; a committed
    entry whose arrays do not load is built again (once, with a warning naming it).

    Returns (corpus, build counters, the local entry directory the corpus is mapped from: the
    entry itself, or the local mirror of a remote one).

    Raises:
      EmptyShardError: the shard holds no non-empty document.
    """
    entry = files.as_path(cache_path(cache_dir, source, split, shard_index, shard_count, tokenizer))
    local = entry if files.is_local(entry) else _mirror(entry)
    files.sweep_temporaries(local)  # arrays of writers killed mid-write
    build = source.build_identity() if source.build_identity is not None else None
    stats = _marker(entry)
    if stats is None or (build is not None and stats.get(BUILD_KEY, "") != build):
        if stats is not None:
            logging.info(
                "%s: tokenized from another build of %s; tokenizing again", entry, source.name
            )
            # Uncommitted first: no reader may pair the old marker with arrays being replaced.
            (entry / MARKER).unlink(missing_ok=True)
        corpus, stats = _build(source, tokenizer, split, shard_index, shard_count, num_workers)
        if build is None and source.build_identity is not None:
            build = source.build_identity()  # reading the documents prepared the dataset
        if build:
            stats[BUILD_KEY] = build
        save_corpus(entry, corpus, stats)
        if local != entry:  # the builder keeps a local copy instead of downloading it again
            save_corpus(local, corpus, stats)
    elif local != entry:
        mirrored = _marker(local)
        if mirrored is None or mirrored.get(BUILD_KEY, "") != stats.get(BUILD_KEY, ""):
            _download(entry, local)
    counters = files.read_json(local / MARKER)
    counters.pop(BUILD_KEY, None)
    try:
        corpus = load_corpus(local)
    except DamagedEntryError as e:
        if _rebuilt:
            raise
        # Committed but damaged (a disk error, a copy cut off): uncommit and build it again.
        logging.warning("%s; tokenizing it again", e)
        for damaged in {entry, local}:
            (damaged / MARKER).unlink(missing_ok=True)
        return load_tokenized(source, tokenizer, split=split, shard_index=shard_index,
                              shard_count=shard_count, cache_dir=cache_dir,
                              num_workers=num_workers, _rebuilt=True)  # fmt: skip
    return corpus, counters, str(local)


def _marker(entry: epath.Path) -> dict | None:
    """The committed `stats.json` of an entry, or None (no entry, or an incomplete one)."""
    return files.read_json(entry / MARKER) if (entry / MARKER).is_file() else None
