"""Named sources and mixtures: spec parsing, building, sharded deterministic reading; prepared
datasets refused when their inputs changed, rebuilt on request, and the tokenized cache
following a rebuild."""

from __future__ import annotations

import concurrent.futures
import gzip
import hashlib
import json
import logging
import math
import os
import re
import shutil
import subprocess
import sys
import time

import pytest
import tensorflow_datasets as tfds

from albert_jax import files
from albert_jax.data import cache, data_config, sources
from albert_jax.data.builders import Documents, DocumentsConfig, counters
from albert_jax.data.builders.base import file_format_for
from albert_jax.data.sources import (
    Source,
    build_source,
    iter_documents,
    num_documents,
    parse_sources,
    prepare_sources,
)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ---------------------------------------------------------------- parse_sources


def test_parse_sources_normalizes_weights():
    assert parse_sources("demo") == [Source("demo", 1.0)]
    assert parse_sources(" wikipedia/20230601.en:0.5 , books:1.5 ") == [
        Source("wikipedia/20230601.en", 0.25),
        Source("books", 0.75),
    ]
    # A TFDS version in the name is not a weight; a number after the last ':' is.
    assert parse_sources("wikipedia/20230601.en:1.0.0:3,demo:1e0") == [
        Source("wikipedia/20230601.en:1.0.0", 0.75),
        Source("demo", 0.25),
    ]
    assert parse_sources("books/mine=/data/a/*.txt;gs://bucket/b:2,raw_text=/x.txt") == [
        Source("books/mine", 2 / 3, ("/data/a/*.txt", "gs://bucket/b")),
        Source("raw_text", 1 / 3, ("/x.txt",)),
    ]
    assert parse_sources("wikipedia_dump=/d/enwiki.xml.bz2")[0].files == ("/d/enwiki.xml.bz2",)


def test_wiki_books_preset_is_proportional_to_corpus_size():
    wiki, books = parse_sources("wiki_books")
    assert (wiki.name, books.name) == ("wikipedia/20230601.en", "books")
    assert math.isclose(wiki.weight, 2500 / 3300) and math.isclose(books.weight, 800 / 3300)
    # A preset inside a mixture scales with its weight.
    mixed = {s.name: s.weight for s in parse_sources("wiki_books:3,demo:1")}
    assert math.isclose(mixed["books"], 0.75 * 800 / 3300) and math.isclose(mixed["demo"], 0.25)


@pytest.mark.parametrize(
    "spec, message",
    [
        ("", "empty spec"),
        ("   ", "empty spec"),
        ("demo,,books", "empty item"),
        ("demo,", "empty item"),
        ("demo:-0.5", "must be > 0"),
        ("demo:0", "must be > 0"),
        ("demo:1,books:-1", "must be > 0"),
        ("no_such_dataset_xyz", "unknown source 'no_such_dataset_xyz'"),
        ("demo:abc", "unknown source 'demo:abc'"),
        ("wikipedia/19990101.xx", "has no config '19990101.xx'"),
        ("demo,demo:2", "listed more than once"),
        ("wiki_books,books", "listed more than once"),
        ("demo=/x.txt", "takes no files"),
        ("wiki_books=/x", "takes no files"),
        ("wikipedia/20230601.en=/x", "takes no files"),
        ("books=", "no files after it"),
        ("books/bad name", "config name"),
        ("demo/other", "has no configs"),
        (":1", "no source name"),
    ],
)
def test_parse_sources_errors(spec, message):
    with pytest.raises(ValueError, match=message):
        parse_sources(spec)


def test_source_validates_weight_and_files():
    with pytest.raises(ValueError, match="weight"):
        Source("demo", -1.0)
    with pytest.raises(ValueError, match="weight"):
        Source("demo", float("nan"))
    assert Source("books", files="/a/b.txt").files == ("/a/b.txt",)
    assert Source("books").is_local and not Source("wikipedia/20230601.en").is_local


# ---------------------------------------------------------------- demo: build + read


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory):
    data_dir = str(tmp_path_factory.mktemp("tfds"))
    build_source(Source("demo"), data_dir=data_dir)
    return data_dir


def test_demo_builds_on_first_use_with_both_splits(demo_dir):
    builder = build_source("demo", data_dir=demo_dir)
    assert builder.is_prepared()
    assert builder.data_dir.startswith(os.path.join(demo_dir, "albert_demo", "default"))
    n_train = num_documents("demo", "train", demo_dir)
    n_valid = num_documents("demo", "validation", demo_dir)
    assert (n_train, n_valid) == (271, 19)
    assert counters(builder) == {"documents": 290, "files": 1}
    text_bytes = sum(len(d["text"]) for d in iter_documents("demo", data_dir=demo_dir))
    assert text_bytes > 4_000_000  # enough text for a tiny model to learn from
    demo_file = os.path.join(REPO, "albert_jax", "data", "demo", "demo.jsonl.gz")
    assert os.path.getsize(demo_file) < 5 * 2**20
    for name in ("ATTRIBUTION.md", "README.md"):
        assert os.path.isfile(os.path.join(os.path.dirname(demo_file), name))


def test_iter_documents_shards_are_disjoint_complete_and_stable(demo_dir):
    everything = list(iter_documents("demo", data_dir=demo_dir))
    assert len(everything) == 271
    assert all(isinstance(d["title"], str) and isinstance(d["text"], str) for d in everything)
    assert list(iter_documents("demo", data_dir=demo_dir)) == everything  # deterministic
    shards = [
        list(iter_documents("demo", data_dir=demo_dir, shard_index=i, shard_count=3))
        for i in range(3)
    ]
    assert [len(s) for s in shards] == [91, 90, 90]
    assert [d for shard in shards for d in shard] == everything  # contiguous, disjoint, complete
    resumed = list(iter_documents("demo", data_dir=demo_dir, shard_index=1, shard_count=3, start=7))
    assert resumed == shards[1][7:]
    validation = list(iter_documents("demo", split="validation", data_dir=demo_dir))
    assert len(validation) == 19
    assert not {d["title"] for d in validation} & {d["title"] for d in everything}


def test_iter_documents_argument_errors_are_raised_at_call_time(demo_dir):
    with pytest.raises(ValueError, match="shard_index"):
        iter_documents("demo", data_dir=demo_dir, shard_index=3, shard_count=3)
    with pytest.raises(ValueError, match="split: 'test'"):
        iter_documents("demo", split="test", data_dir=demo_dir)
    with pytest.raises(ValueError, match="start"):
        iter_documents("demo", data_dir=demo_dir, start=-1)


def test_concurrent_builds_of_one_source_build_it_once(tmp_path):
    data_dir = str(tmp_path)
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        builders = list(pool.map(lambda _: build_source("demo", data_dir=data_dir), range(3)))
    assert {b.data_dir for b in builders} == {builders[0].data_dir}
    assert all(b.info.splits.total_num_examples == 290 for b in builders)
    assert os.listdir(os.path.dirname(builders[0].data_dir)) == ["1.0.0"]  # no leftovers


def test_a_killed_builds_incomplete_folder_is_swept_by_the_next_build(tmp_path):
    """#58: TFDS builds into `incomplete.<id>_<version>` and renames it at the end; a build
    killed before that left the folder for ever. The next build (under the build lock, where
    no other build runs) deletes it."""
    data_dir = str(tmp_path)
    config_dir = tmp_path / "albert_demo" / "default"  # <data dir>/<name>/<config>
    leftover = config_dir / "incomplete.K1LLED_1.0.0"
    os.makedirs(leftover / "sub")
    (leftover / "sub" / "demo-train.array_record-00000-of-00001").write_bytes(b"half")
    builder = build_source("demo", data_dir=data_dir)
    assert os.path.dirname(builder.data_dir) == str(config_dir)
    assert sorted(os.listdir(config_dir)) == ["1.0.0"]


def test_tfds_data_dir_environment_variable_is_respected(tmp_path, monkeypatch):
    monkeypatch.setenv("TFDS_DATA_DIR", str(tmp_path))
    builder = build_source(Source("demo"))
    assert builder.data_dir.startswith(str(tmp_path))
    assert num_documents("demo", "validation") == 19


# ---------------------------------------------------------------- local files, stale data


def _write_jsonl(path, records):
    with gzip.open(path, "wt", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")


def test_documents_from_files_and_stale_inputs(tmp_path, shared_data):
    sotu = os.path.join(shared_data, "corpora", "sotu.jsonl.gz")
    data_dir = str(tmp_path / "tfds")
    (source,) = parse_sources(f"documents/sotu={sotu}")
    builder = build_source(source, data_dir=data_dir)
    assert builder.info.splits.total_num_examples == 233
    # Prepared: reading needs no files any more, and the same files are accepted again.
    assert (
        num_documents("documents/sotu", "train", data_dir)
        == builder.info.splits["train"].num_examples
    )
    build_source("documents/sotu", data_dir=data_dir, files=sotu)
    other = tmp_path / "other.jsonl.gz"
    _write_jsonl(other, [{"title": "t", "text": "x"}])
    with pytest.raises(ValueError, match="built from other files"):
        build_source("documents/sotu", data_dir=data_dir, files=str(other))
    # Same folder, other format: refused too.
    with pytest.raises(ValueError, match="was built with"):
        build_source("raw_text/sotu", data_dir=data_dir)


def test_local_source_without_files_is_an_error(tmp_path):
    with pytest.raises(ValueError, match="files: 'books' is not prepared"):
        build_source(Source("books"), data_dir=str(tmp_path))
    with pytest.raises(ValueError, match="files: .*does not exist"):
        build_source(Source("books"), data_dir=str(tmp_path), files=str(tmp_path / "none"))


def test_tfrecord_datasets_read_in_the_same_order(tmp_path, shared_data):
    sotu = os.path.join(shared_data, "corpora", "sotu.jsonl.gz")
    orders = {}
    for file_format in ("array_record", "tfrecord"):
        data_dir = str(tmp_path / file_format)
        config = DocumentsConfig(name="sotu", files=(sotu,))
        Documents(config=config, data_dir=data_dir, file_format=file_format).download_and_prepare()
        orders[file_format] = [
            list(iter_documents("documents/sotu", data_dir=data_dir, shard_index=i, shard_count=2))
            for i in range(2)
        ]
    assert orders["tfrecord"] == orders["array_record"]
    assert sum(len(shard) for shard in orders["tfrecord"]) == 230


def test_file_format_follows_the_data_dir(tmp_path):
    """ArrayRecord (random access) in a local data dir; TFRecord on an object store, where
    ArrayRecord's writer cannot write (it opens local files only)."""
    assert file_format_for("gs://bucket/tfds") == "tfrecord"
    assert file_format_for("s3://bucket/tfds") == "tfrecord"
    assert file_format_for(str(tmp_path)) == "array_record"
    assert file_format_for("relative/tfds") == "array_record"
    builder = Documents(config=DocumentsConfig(name="x", files=("x",)), data_dir=str(tmp_path))
    assert builder.info.file_format == tfds.core.FileFormat.ARRAY_RECORD


# ---------------------------------------------------------------- catalog datasets


def test_catalog_dataset_is_used_as_is_and_never_downloaded(tmp_path):
    builder = build_source("wikipedia/20230601.en", data_dir=str(tmp_path))
    assert builder.name == "wikipedia" and builder.builder_config.name == "20230601.en"
    assert not builder.is_prepared()
    assert os.listdir(tmp_path) in ([], ["wikipedia"])  # nothing was fetched
    with pytest.raises(ValueError, match="not prepared"):
        iter_documents("wikipedia/20230601.en", data_dir=str(tmp_path))
    with pytest.raises(ValueError, match="takes no files"):
        build_source("wikipedia/20230601.en", data_dir=str(tmp_path), files="/x")


# ---------------------------------------------------------------- prepare_sources


def test_prepare_sources_reports_every_source(demo_dir, tmp_path):
    demo, wiki = prepare_sources("demo:3,wikipedia/20230601.en:1", data_dir=demo_dir)
    assert demo["splits"] == {"train": 271, "validation": 19} and demo["weight"] == 0.75
    assert demo["counters"] == {"documents": 290, "files": 1} and demo["prepared"]
    assert wiki["source"] == sources.CATALOG_WIKIPEDIA and wiki["prepared"] is False
    assert "splits" not in wiki and "counters" not in wiki
    # `books` of wiki_books has no files and is not prepared: a clear error.
    with pytest.raises(ValueError, match="files: 'books' is not prepared"):
        prepare_sources("wiki_books", data_dir=str(tmp_path))


# ---------------------------------------------------------------- changed inputs, rebuild


def _write_documents(path, n: int, word: str = "text") -> None:
    path.write_text(
        "".join(
            json.dumps({"title": f"d{i}", "text": f"Document {i} {word}."}) + "\n" for i in range(n)
        )
    )


def _total(builder) -> int:
    return builder.info.splits.total_num_examples


def _builders_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "albert_jax.data.builders", *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )


def test_changed_corpus_is_refused_until_rebuilt(tmp_path):
    """The issue's repro: 5 documents built, the file rewritten with 60, built again. The
    stale dataset is refused (naming the dataset, the file, what changed and the fix) until
    `--rebuild` builds it from the file as it is now."""
    corpus, data_dir = tmp_path / "mut.jsonl", str(tmp_path / "D")
    spec = f"documents/mut={corpus}"
    _write_documents(corpus, 5)
    assert _total(build_source(spec, data_dir=data_dir)) == 5
    _write_documents(corpus, 60)
    with pytest.raises(ValueError) as refused:
        build_source(spec, data_dir=data_dir)
    message = str(refused.value)
    assert f"documents/mut at {data_dir}/documents/mut/1.0.0" in message
    assert f"{corpus}: size changed" in message and "--rebuild" in message
    assert "rebuild=True" in message
    # The same through the command line: an error, not a report of 5 documents.
    args = [f"--sources={spec}", f"--data_dir={data_dir}"]
    refused_cli = _builders_cli(*args)
    assert refused_cli.returncode != 0 and "size changed" in refused_cli.stderr
    assert '"documents": 5' not in refused_cli.stdout
    rebuilt = _builders_cli(*args, "--rebuild")
    assert rebuilt.returncode == 0, rebuilt.stderr[-3000:]
    [report] = [json.loads(line) for line in rebuilt.stdout.splitlines() if line.startswith("{")]
    assert report["counters"]["documents"] == 60
    assert _total(build_source(spec, data_dir=data_dir)) == 60  # accepted again
    assert (
        num_documents("documents/mut", "train", data_dir)
        + num_documents("documents/mut", "validation", data_dir)
        == 60
    )
    # rebuild=True in the library; without files it rebuilds from the recorded ones.
    _write_documents(corpus, 7)
    assert _total(build_source(spec, data_dir=data_dir, rebuild=True)) == 7
    _write_documents(corpus, 8)
    assert _total(build_source("documents/mut", data_dir=data_dir, rebuild=True)) == 8
    assert sorted(os.listdir(tmp_path / "D" / "documents")) == [".mut.lock", "mut"]
    with pytest.raises(ValueError, match="rebuild: catalog dataset"):
        build_source("wikipedia/20230601.en", data_dir=data_dir, rebuild=True)


def test_what_counts_as_changed(tmp_path, monkeypatch):
    """Same size and time: unchanged without reading. A new time on a small file: its content
    hash decides (a copy or `touch` still matches; an edit of the same size does not). A
    big file (not hashed): its size and time decide."""
    corpus, data_dir = tmp_path / "c.jsonl", str(tmp_path / "D")
    spec = f"documents/c={corpus}"
    _write_documents(corpus, 5)
    build_source(spec, data_dir=data_dir)
    copy = tmp_path / "copy.jsonl"
    shutil.copyfile(corpus, copy)
    os.replace(copy, corpus)  # same bytes, a new file and time
    os.utime(corpus, ns=(1, 1))
    build_source(spec, data_dir=data_dir)
    _write_documents(corpus, 5, word="TEXT")  # same size, other content
    with pytest.raises(ValueError, match=r"c\.jsonl: content changed \(same size, other sha256\)"):
        build_source(spec, data_dir=data_dir)
    from albert_jax.data.builders import prepared

    monkeypatch.setattr(prepared, "HASH_LIMIT", 10)  # every file is "big" now
    build_source(spec, data_dir=data_dir, rebuild=True)
    inputs = build_source(spec, data_dir=data_dir).info.metadata["inputs"]
    assert [sorted(i) for i in inputs] == [["mtime_ns", "path", "size"]]  # not hashed
    os.utime(corpus, ns=(2, 2))
    with pytest.raises(ValueError, match=r"c\.jsonl: modification time changed"):
        build_source(spec, data_dir=data_dir)
    # Other files than those it was built from: refused with the rebuild command too.
    (tmp_path / "d.jsonl").write_text('{"title": "x", "text": "y"}\n')
    with pytest.raises(ValueError, match=r"other files \(1 files, now 2; e\.g\. new: .*--rebuild"):
        build_source(f"documents/c={tmp_path}/*.jsonl", data_dir=data_dir)


def test_dataset_prepared_without_fingerprint_loads_with_a_warning(tmp_path, caplog):
    """Datasets prepared before fingerprints were recorded still load; a warning says that
    they cannot be checked."""
    corpus, data_dir = tmp_path / "old.jsonl", str(tmp_path / "D")
    _write_documents(corpus, 5)
    builder = build_source(f"documents/old={corpus}", data_dir=data_dir)
    metadata_file = os.path.join(builder.data_dir, "metadata.json")
    with open(metadata_file) as f:
        metadata = json.load(f)
    del metadata["inputs"], metadata["build_id"]  # as an older version wrote it
    with open(metadata_file, "w") as f:
        json.dump(metadata, f)
    _write_documents(corpus, 6)
    caplog.set_level(logging.WARNING)
    assert _total(build_source(f"documents/old={corpus}", data_dir=data_dir)) == 5
    assert "cannot be checked" in caplog.text and "documents/old" in caplog.text
    assert sources.build_identity(f"documents/old={corpus}", data_dir) == ""


def test_inputs_on_gcs_are_fingerprinted(gcs, tmp_path):
    """gs:// inputs: size and time from the object's metadata (whole seconds), content hash
    for small objects; a same-size rewrite is caught by the hash."""
    corpus, data_dir = gcs.url("test_sources/fingerprint/g.jsonl"), str(tmp_path / "D")
    spec = f"documents/g={corpus}"
    first = b'{"title": "a", "text": "First version."}\n{"title": "b", "text": "Kept."}\n'
    files.write_atomic(corpus, first)
    builder = build_source(spec, data_dir=data_dir)
    [record] = builder.info.metadata["inputs"]
    assert record["path"] == corpus and record["size"] == len(first)
    assert record["sha256"] == hashlib.sha256(first).hexdigest()
    time.sleep(1.1)  # object times have whole seconds
    files.write_atomic(corpus, first.replace(b"First", b"Other"))
    with pytest.raises(ValueError, match=r"g\.jsonl: content changed"):
        build_source(spec, data_dir=data_dir)
    rebuilt = build_source(spec, data_dir=data_dir, rebuild=True)
    texts = {
        d["text"]
        for split in ("train", "validation")
        for d in iter_documents("documents/g", split=split, data_dir=data_dir)
    }
    assert texts == {"Other version.", "Kept."}
    assert rebuilt.info.metadata["build_id"] != builder.info.metadata["build_id"]


def test_tokenized_cache_follows_a_rebuild(tokenizer, tmp_path):
    """The tokenized cache keys on the source's name and files: after a rebuild from changed
    files it holds the old build's tokens; the build id it records makes it tokenize again."""
    corpus, data_dir = tmp_path / "t.jsonl", str(tmp_path / "D")
    _write_documents(corpus, 5)
    spec = f"documents/t={corpus}"

    def tokenized() -> dict:
        [source] = data_config.sources_from_spec(spec, data_dir)
        _, stats, _ = cache.load_tokenized(
            source, tokenizer, split="train", shard_index=0, shard_count=1,
            cache_dir=str(tmp_path / "cache"),
        )  # fmt: skip
        return stats

    assert tokenized()["documents"] == 4  # 1 of 5 held out
    _write_documents(corpus, 60)
    build_source(spec, data_dir=data_dir, rebuild=True)
    assert tokenized()["documents"] == num_documents("documents/t", "train", data_dir) == 59
    assert tokenized()["documents"] == 59  # and read back, not rebuilt, from then on
    assert len(os.listdir(tmp_path / "cache")) == 1  # the one entry, replaced


def test_a_path_where_a_source_name_goes_is_named_as_one(shared_data):
    """`--config.data.sources=/data/*.jsonl` used to fail with TFDS's grammar of dataset names."""
    austen = os.path.join(shared_data, "corpora", "austen.jsonl.gz")
    for spec, what in ((austen, "is a path, not"), ("/nonexistent/*.jsonl", "no such file")):
        with pytest.raises(ValueError, match=re.escape(what)) as error:
            sources.parse_sources(spec)
        assert f"documents={spec}" in str(error.value) and f"raw_text={spec}" in str(error.value)
    assert sources.parse_sources(f"documents={austen}")[0].name == "documents"
