"""Batch pipeline: contract, determinism, resumption, processes, mixture, eval, counters."""

from __future__ import annotations

import functools
import itertools
import json
import os
import shutil
import subprocess
import sys

import ml_collections
import numpy as np
import pytest

from albert_jax import files
from albert_jax.data import cache, corpus, pipeline, sentences, shard
from albert_jax.data.data_config import DataConfig, DocumentSource, sources_from_spec
from albert_jax.data.shard import PretrainingIterator
from albert_jax.data.tokenizer import Tokenizer

KEYS_INT = ("input_ids", "segment_ids", "input_mask", "masked_lm_positions", "masked_lm_ids")


def jsonl_source(shared_data: str, name: str, num_docs: int, weight: float = 1.0):
    """The first `num_docs` documents of a corpus; every 10th is `validation`; shards are
    interleaved (document j belongs to shard j % shard_count)."""
    path = os.path.join(shared_data, "corpora", f"{name}.jsonl.gz")

    def documents(split: str, shard_index: int, shard_count: int):
        docs = corpus.iter_jsonl_documents(path)
        for j, doc in enumerate(itertools.islice(docs, num_docs)):
            if (j % 10 == 0) == (split == "validation") and j % shard_count == shard_index:
                yield doc

    return DocumentSource(f"{name}-{num_docs}", weight, documents)


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("albert_cache"))


@pytest.fixture(scope="module")
def sources(shared_data):
    # Small on purpose: epochs are short, so a few steps cross epoch boundaries.
    return [jsonl_source(shared_data, "austen", 12, 3.0), jsonl_source(shared_data, "brown", 8)]


def make(cfg_kwargs, tokenizer, sources, cache_dir, **kwargs) -> PretrainingIterator:
    base = dict(seq_len=128, max_predictions_per_seq=20, batch_size=16, seed=7)
    cfg = DataConfig(**{**base, **cfg_kwargs, "cache_dir": cache_dir})
    return PretrainingIterator(cfg, tokenizer, sources, **kwargs)


def take(it, n):
    return [next(it) for _ in range(n)]


def assert_same(batches_a, batches_b):
    assert len(batches_a) == len(batches_b)
    for a, b in zip(batches_a, batches_b, strict=True):
        assert a.keys() == b.keys()
        for k in a:
            assert a[k].dtype == b[k].dtype and a[k].tobytes() == b[k].tobytes(), k


def test_batch_contract(tokenizer, sources, cache_dir):
    batch = next(make({}, tokenizer, sources, cache_dir))
    B, S, P = 16, 128, 20
    for k in KEYS_INT:
        assert batch[k].dtype == np.int32
    assert batch["masked_lm_weights"].dtype == np.float32
    assert batch["sentence_order_label"].dtype == np.int32
    for k in ("input_ids", "segment_ids", "input_mask"):
        assert batch[k].shape == (B, S)
    for k in ("masked_lm_positions", "masked_lm_ids", "masked_lm_weights"):
        assert batch[k].shape == (B, P)
    assert batch["sentence_order_label"].shape == (B,)
    mask = batch["input_mask"].astype(bool)
    assert np.all(batch["input_ids"][:, 0] == tokenizer.cls_id)
    assert not batch["input_ids"][~mask].any() and not batch["segment_ids"][~mask].any()
    assert np.all(mask[:, :-1] >= mask[:, 1:])  # real tokens first
    assert set(np.unique(batch["sentence_order_label"])) <= {0, 1}
    real = batch["masked_lm_weights"] > 0
    rows = np.nonzero(real)[0]
    assert mask[rows, batch["masked_lm_positions"][real]].all()


def test_same_seed_same_batches(tokenizer, sources, cache_dir):
    a = take(make({}, tokenizer, sources, cache_dir), 3)
    b = take(make({}, tokenizer, sources, cache_dir), 3)
    assert_same(a, b)
    c = next(make({"seed": 8}, tokenizer, sources, cache_dir))
    assert not np.array_equal(a[0]["input_ids"], c["input_ids"])


def test_resume_equals_uninterrupted_run(tokenizer, sources, cache_dir):
    it = make({}, tokenizer, sources, cache_dir)
    first = take(it, 5)
    state = json.loads(json.dumps(it.get_state()))  # goes through a checkpoint as JSON
    assert state["step"] == 5
    rest = take(it, 25)
    assert max(it.get_state()["epoch"]) >= 1, "the run should cross an epoch boundary"

    restored = make({}, tokenizer, sources, cache_dir)
    restored.set_state(state)
    assert_same(take(restored, 25), rest)

    by_step = make({}, tokenizer, sources, cache_dir, start_step=5)
    assert by_step.get_state() == state  # counted from scratch: same cursors
    assert_same(take(by_step, 25), rest)
    assert first[0]["input_ids"].tobytes() != rest[0]["input_ids"].tobytes()


def test_epochs_redraw_instances_and_masks(tokenizer, sources, cache_dir):
    """Every visit is masked anew: the same instance never yields the same batch twice."""
    it = make({}, tokenizer, sources, cache_dir)
    seen = {next(it)["input_ids"].tobytes() for _ in range(40)}
    assert len(seen) == 40


def test_workers_do_not_change_batches(tokenizer, sources, cache_dir):
    serial = take(make({}, tokenizer, sources, cache_dir), 6)
    parallel_it = make({"num_workers": 2}, tokenizer, sources, cache_dir)
    try:
        assert_same(take(parallel_it, 6), serial)
        assert parallel_it.get_state()["step"] == 6  # state of what was consumed, not prefetched
    finally:
        parallel_it.close()


def test_shards_read_disjoint_documents(tokenizer, sources, cache_dir):
    its = [
        make({}, tokenizer, sources[:1], cache_dir, shard_index=p, num_shards=2) for p in range(2)
    ]
    corpora = [
        cache.load_tokenized(
            sources[0],
            tokenizer,
            split="train",
            shard_index=p,
            shard_count=2,
            cache_dir=cache_dir,
        )[0]
        for p in range(2)
    ]
    docs = [
        {corpus.document_tokens(d).tobytes() for d in range(corpus.num_documents)}
        for corpus in corpora
    ]
    assert docs[0] and docs[1] and not docs[0] & docs[1]
    for p, it in enumerate(its):
        batch = next(it)
        assert batch["input_ids"].shape == (8, 128)  # per-shard batch = global / 2
        ids = np.where(batch["input_mask"] > 0, batch["input_ids"], 0)
        real = batch["masked_lm_weights"] > 0  # undo the masking: original ids back in place
        ids[np.nonzero(real)[0], batch["masked_lm_positions"][real]] = batch["masked_lm_ids"][real]
        stream = [np.asarray(c.tokens) for c in corpora]
        for row in ids:
            window = row[1:31]  # 30 tokens of segment A: unique in practice
            if tokenizer.sep_id in window:
                continue
            found = [
                np.any(np.all(np.lib.stride_tricks.sliding_window_view(s, 30) == window, 1))
                for s in stream
            ]
            assert found[p] and not found[1 - p]


def test_mixture_follows_weights(tokenizer, sources, cache_dir):
    it = make({"batch_size": 32}, tokenizer, sources, cache_dir)
    take(it, 64)
    consumed = np.array(it.get_state()["consumed"])
    assert consumed.sum() == 64 * 32
    assert abs(consumed[0] / consumed.sum() - 0.75) < 0.04  # 3:1; 4 standard errors


@pytest.mark.parametrize("seq_len", [128, 512])
def test_sop_labels_are_balanced(tokenizer, sources, cache_dir, seq_len):
    """Over >= 10k training examples of real text, the SOP label is 1 for 50 +- 2 %.

    The reference's treatment of one-sentence chunks (`sop_single_segment="random_b"`: a B from
    another document, always label 1) leaves an excess of label 1 on the same data."""
    rates = {}
    for mode in ("split", "random_b"):
        it = make(
            {"seq_len": seq_len, "batch_size": 1024, "sop_single_segment": mode},
            tokenizer,
            sources,
            cache_dir,
        )
        labels = np.concatenate([next(it)["sentence_order_label"] for _ in range(10)])
        rates[mode] = labels.mean()
        stats = it.stats()
        assert len(labels) >= 10_000
        if mode == "split":  # one-sentence chunks exist here, and are cut instead
            assert stats["instances_split_sentence"] > 0.03 * stats["instances"]
            assert stats["instances_random_b"] == 0
        else:
            assert stats["instances_random_b"] > 0 and stats["instances_split_sentence"] == 0
    # 10240 fair coins: one standard error is 0.5 points.
    assert abs(rates["split"] - 0.5) <= 0.02, rates
    assert rates["random_b"] > 0.52, rates


def test_eval_batches_are_fixed(tokenizer, sources, cache_dir):
    cfg = DataConfig(
        seq_len=128, max_predictions_per_seq=20, batch_size=16, seed=7, cache_dir=cache_dir
    )
    evals = pipeline.make_eval_iterator(
        cfg, tokenizer, split="validation", num_batches=3, sources=sources
    )
    first, second = list(evals), list(evals)
    assert len(first) == len(evals) == 3
    assert_same(first, second)
    train = next(make({}, tokenizer, sources, cache_dir))
    assert first[0]["input_ids"].tobytes() != train["input_ids"].tobytes()
    assert evals.stats()["documents"] == 3  # austen-12: documents 0 and 10; brown-8: 0


def test_stats_count_bad_documents(tokenizer, shared_data, cache_dir):
    good = list(
        corpus.iter_jsonl_documents(os.path.join(shared_data, "corpora", "brown.jsonl.gz"))
    )[:3]
    bad = [
        {"title": "bytes", "text": b"Caf\xe9 au lait. Very good.\nYes."},
        {"title": "empty", "text": ""},
        {"title": "one", "text": "Only one sentence."},
        {"title": "long", "text": "x" * 100_000},
    ]
    src = DocumentSource("bad-docs", 1.0, lambda split, i, n: iter(good + bad))
    it = make({"seq_len": 64, "batch_size": 8}, tokenizer, [src], cache_dir)
    take(it, 3)
    stats = it.stats()
    assert stats["documents"] == 7 and stats["documents_empty"] == 1
    assert stats["documents_one_sentence"] == 1 and stats["non_utf8_replaced"] == 1
    assert stats["long_sentences_chunked"] == 1 and stats["instances_truncated"] > 0
    assert stats["batches"] == 3 and stats["epochs"] >= 1
    assert set(shard.COUNTERS) <= set(stats)


def test_config_from_configdict_and_errors(tokenizer, sources, cache_dir):
    c = ml_collections.ConfigDict()
    c.seq_len, c.max_predictions_per_seq, c.batch_size, c.seed = 64, 10, 32, 3
    c.objective = "nsp"
    c.data = ml_collections.ConfigDict()
    c.data.sources = "demo"
    c.data.data_dir = "/tmp/nowhere"
    c.data.short_seq_prob, c.data.masked_lm_prob, c.data.max_ngram = 0.2, 0.1, 2
    c.data.num_workers = 0
    cfg = DataConfig.from_config(c, cache_dir=cache_dir)
    assert (cfg.seq_len, cfg.max_predictions_per_seq, cfg.batch_size, cfg.seed) == (64, 10, 32, 3)
    assert (cfg.objective, cfg.sources, cfg.ngram, cfg.short_seq_prob) == ("nsp", "demo", 2, 0.2)
    assert cfg.masked_lm_prob == 0.1 and cfg.data_dir == "/tmp/nowhere"
    assert cfg.sop_single_segment == "split"  # the default when the config has no such field
    c.data.sop_single_segment = "random_b"
    assert DataConfig.from_config(c).sop_single_segment == "random_b"
    c.data.sop_single_segment = "drop"
    with pytest.raises(ValueError, match="sop_single_segment"):
        DataConfig.from_config(c)

    with pytest.raises(ValueError, match="batch_size=15 must be a positive multiple of the"):
        make({"batch_size": 15}, tokenizer, sources, cache_dir, num_shards=2, shard_index=0)
    with pytest.raises(ValueError, match="objective"):
        make({"objective": "mlm"}, tokenizer, sources, cache_dir)
    with pytest.raises(ValueError, match="weights"):
        make({}, tokenizer, [DocumentSource("w", 0.0, sources[0].documents)], cache_dir)
    it = make({}, tokenizer, sources, cache_dir)
    other = make({"seed": 99}, tokenizer, sources, cache_dir)
    with pytest.raises(ValueError, match="fingerprint"):
        other.set_state(it.get_state())
    reference = make({"sop_single_segment": "random_b"}, tokenizer, sources, cache_dir)
    with pytest.raises(ValueError, match="fingerprint"):  # other instances: another stream
        reference.set_state(it.get_state())
    # How batches are built (workers) is not part of the fingerprint.
    make({"num_workers": 3}, tokenizer, sources, cache_dir).set_state(it.get_state())


@pytest.fixture(scope="module")
def raw_text_file(tmp_path_factory, shared_data) -> str:
    """30 Austen chapters in the official format: a sentence per line, blank line between."""
    path = tmp_path_factory.mktemp("raw") / "corpus.txt"
    docs = corpus.iter_jsonl_documents(os.path.join(shared_data, "corpora", "austen.jsonl.gz"))
    with open(path, "w", encoding="utf-8") as f:
        for doc in itertools.islice(docs, 30):
            f.write("\n".join(sentences.split_sentences(doc["text"])) + "\n\n")
    return str(path)


@pytest.fixture(scope="module")
def tfds_dir(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("tfds"))


def test_official_raw_text_through_tfds(tokenizer, raw_text_file, tfds_dir):
    """End to end through albert_jax.data.sources: spec -> TFDS build -> cache -> batches."""
    c = ml_collections.ConfigDict()
    c.seq_len, c.max_predictions_per_seq, c.batch_size, c.seed, c.objective = 64, 10, 8, 0, "sop"
    c.data = ml_collections.ConfigDict()
    c.data.sources = f"raw_text={raw_text_file}"
    c.data.data_dir = tfds_dir
    it = pipeline.make_pretraining_iterator(c, tokenizer)
    batch = next(it)
    assert batch["input_ids"].shape == (8, 64)
    stats = it.stats()
    evals = pipeline.make_eval_iterator(c, tokenizer, split="validation", num_batches=2)
    held_out = evals.stats()["documents"]
    assert held_out >= 1 and stats["documents"] + held_out == 30
    assert_same(list(evals), list(evals))
    # The tokenized cache lives under the data dir, keyed by source, split, shard, tokenizer.
    caches = os.listdir(os.path.join(c.data.data_dir, "albert_jax_cache"))
    assert any(".train.0-of-1." in n for n in caches)
    assert any(".validation.0-of-1." in n for n in caches)


def test_tokenizer_cli_reads_sources(raw_text_file, tfds_dir, tmp_path):
    prefix = str(tmp_path / "cli_spm")
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "albert_jax.data.tokenizer",
            f"--source=raw_text={raw_text_file}",
            f"--data_dir={tfds_dir}",
            "--vocab_size=400",
            f"--output={prefix}.model",
            "--max_sentences=3000",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().endswith(prefix + ".model")
    cli = Tokenizer(prefix + ".model")
    assert cli.vocab_size == 400 and cli.mask_id == 4 and cli.encode("Emma smiled.")


# ---------------------------------------------------------------- where the tokenized cache lives


def test_cache_paths_do_not_depend_on_the_working_directory(tokenizer, tmp_path, monkeypatch):
    """The same data gives the same cache entry from any working directory: local paths are
    made absolute, gs:// paths kept as they are (they used to become ./gs:/bucket/...), and the
    default cache of a gs:// data dir is the local per-host one."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    for name in ("a", "b"):
        (tmp_path / name).mkdir()

    def where(cwd, data_dir: str, inputs: str, cache_dir: str | None = None) -> tuple[str, str]:
        monkeypatch.chdir(cwd)
        [source] = sources_from_spec(f"documents={inputs}", data_dir)
        directory = cache.cache_dir_for(cache_dir, data_dir)
        return directory, cache.cache_path(directory, source, "train", 0, 1, tokenizer)

    remote, corpus = "gs://bucket/tfds", "gs://bucket/corpus.jsonl"
    assert where(tmp_path / "a", remote, corpus) == where(tmp_path / "b", remote, corpus)
    directory, entry = where(tmp_path / "a", remote, corpus)
    assert directory == str(tmp_path / "home" / ".cache" / "albert_jax" / "albert_jax_cache")
    assert entry.startswith(directory + "/documents.") and "gs:" not in entry
    # An explicit gs:// cache dir is used as it is.
    directory, entry = where(tmp_path / "a", remote, corpus, "gs://bucket/cache")
    assert directory == "gs://bucket/cache" and entry.startswith("gs://bucket/cache/documents.")
    # Relative local paths name the same entry as the absolute ones; other files, another one.
    a = str(tmp_path / "a")
    relative = where(a, "tfds", "corpus.jsonl")
    assert relative == where(tmp_path / "b", f"{a}/tfds", f"{a}/corpus.jsonl")
    assert relative[0] == f"{a}/tfds/albert_jax_cache"
    assert where(tmp_path / "b", "tfds", "corpus.jsonl")[1] != relative[1]
    assert not os.listdir(tmp_path / "a") and not os.listdir(tmp_path / "b")


def _load_one_shard(source, tokenizer, cache_dir):
    """The whole train split of `source` as one cache entry: (corpus, stats, entry dir)."""
    return cache.load_tokenized(
        source, tokenizer, split="train", shard_index=0, shard_count=1, cache_dir=cache_dir
    )


def test_cache_entry_without_its_marker_is_rebuilt(tokenizer, sources, tmp_path):
    """`stats.json` is written last and commits an entry: a build that died before it (here:
    arrays overwritten with garbage, marker gone) is rebuilt, never read."""

    load = functools.partial(_load_one_shard, sources[1], tokenizer, tmp_path)
    corpus, stats, entry = load()
    tokens = np.array(corpus.tokens)
    del corpus
    files.write_atomic(os.path.join(entry, "tokens.npy"), b"half an array")
    os.remove(os.path.join(entry, cache.MARKER))
    again, stats_again, entry_again = load()
    assert (entry_again, stats_again) == (entry, stats) and stats["documents"] == 7
    np.testing.assert_array_equal(again.tokens, tokens)
    assert isinstance(again.tokens, np.memmap)  # local entries are memory-mapped
    assert sorted(os.listdir(entry)) == [  # no temporary files left behind
        "doc_starts.npy",
        "sentence_starts.npy",
        "stats.json",
        "tokens.npy",
    ]


def test_a_killed_writers_temporary_files_are_swept(tokenizer, sources, tmp_path):
    """#58: a build killed mid-write left `.tokens.npy.tmp-*` in the entry for ever. The next
    load deletes those of dead processes of this host (and, a day old, other hosts'), not a
    file a live process is writing."""
    import socket
    import subprocess
    import sys
    import time

    _, _, entry = _load_one_shard(sources[1], tokenizer, tmp_path)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    host = socket.gethostname()
    killed = os.path.join(entry, f".tokens.npy.tmp-{host}-{dead.pid}-0badf00d")
    writing = os.path.join(entry, f".tokens.npy.tmp-{host}-{os.getpid()}-1111aaaa")
    elsewhere = os.path.join(entry, ".tokens.npy.tmp-otherhost-1-2222bbbb")
    old = os.path.join(entry, ".tokens.npy.tmp-otherhost-1-3333cccc")
    for path in (killed, writing, elsewhere, old):
        with open(path, "wb") as f:
            f.write(b"\0" * 1000)
    week_ago = time.time() - 7 * 24 * 3600
    os.utime(old, (week_ago, week_ago))
    _load_one_shard(sources[1], tokenizer, tmp_path)
    left = {os.path.basename(p) for p in (writing, elsewhere)}
    assert {n for n in os.listdir(entry) if n.startswith(".")} == left


def test_demo_on_gs_feeds_the_pipeline(gcs, tokenizer, tmp_path, monkeypatch):
    """The demo built into a gs:// data dir (TFRecord: ArrayRecord's writer cannot write
    there) gives the batches a local (ArrayRecord) build gives, with the tokenized cache in a
    gs:// cache dir (read back through a local mirror) or in the default per-host cache; the
    working directory stays empty."""
    cwd, home = tmp_path / "cwd", tmp_path / "home"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    monkeypatch.setenv("HOME", str(home))
    prefix = f"pipeline-{tmp_path.name}"
    base = dict(seq_len=64, max_predictions_per_seq=5, batch_size=8, seed=3, sources="demo")

    def batches(**where) -> list[dict[str, np.ndarray]]:
        cfg = DataConfig(**base, **where)
        return list(pipeline.make_eval_iterator(cfg, tokenizer, split="validation", num_batches=2))

    on_gs = dict(data_dir=gcs.url(f"{prefix}/tfds"), cache_dir=gcs.url(f"{prefix}/cache"))
    remote = batches(**on_gs)
    objects = gcs.list(prefix)
    assert any(".tfrecord-" in n for n in objects)
    assert not any("array_record" in n for n in objects)
    [entry] = [n for n in objects if n.startswith(f"{prefix}/cache/") and n.endswith("stats.json")]
    assert ".validation.0-of-1." in entry
    mirror = home / ".cache" / "albert_jax" / "mirror"
    assert os.listdir(mirror)  # the builder's local copy, which the batches mapped
    per_host = batches(data_dir=gcs.url(f"{prefix}/tfds"))
    assert os.listdir(home / ".cache" / "albert_jax" / "albert_jax_cache")
    local = batches(data_dir=str(tmp_path / "tfds"), cache_dir=str(tmp_path / "cache"))
    assert_same(remote, per_host)
    assert_same(remote, local)
    # Another host reads the entry through a fresh mirror, without the documents: the entry
    # is downloaded, not rebuilt (a rebuild would need the deleted dataset).
    shutil.rmtree(mirror)
    assert gcs.delete(f"{prefix}/tfds/")
    assert_same(batches(**on_gs), remote)
    assert os.listdir(mirror) and not gcs.list(f"{prefix}/tfds/")
    assert os.listdir(cwd) == []


def test_committed_entry_with_a_cut_off_array_is_rebuilt(tokenizer, sources, tmp_path, caplog):
    """A committed entry whose tokens.npy was cut off failed with numpy's "mmap length is
    greater than file size", naming no file; it is now tokenized again, with a warning."""

    load = functools.partial(_load_one_shard, sources[1], tokenizer, tmp_path)
    corpus, stats, entry = load()
    tokens = np.array(corpus.tokens)
    del corpus
    path = os.path.join(entry, "tokens.npy")
    with open(path, "rb") as f:
        intact = f.read()
    with open(path, "wb") as f:
        f.write(intact[: len(intact) // 2])
    with pytest.raises(cache.DamagedEntryError, match=r"tokens.npy does not load"):
        cache.load_corpus(entry)
    again, stats_again, _ = load()
    np.testing.assert_array_equal(again.tokens, tokens)
    assert stats_again == stats
    assert any("tokens.npy does not load" in r.getMessage() for r in caplog.records)


def test_cache_write_that_runs_out_of_space_names_the_entry(tmp_path):
    """Out of space while writing the cache gave numpy's bare "N requested and M written".
    The space runs out for real: a subprocess whose file-size limit is 64 KiB."""
    script = f"""
import resource, signal
import numpy as np
from albert_jax.data import cache
from albert_jax.data.corpus import TokenizedCorpus
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write fails (EFBIG) instead of killing
resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 16, resource.RLIM_INFINITY))
corpus = TokenizedCorpus(np.zeros(1 << 20, np.int32), np.arange(3), np.arange(2))
cache.save_corpus({str(tmp_path / "entry")!r}, corpus, {{"documents": 1}})
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120, cwd=os.path.dirname(os.path.dirname(__file__)))  # fmt: skip
    assert done.returncode != 0
    assert f"tokenized cache entry {tmp_path / 'entry'}: writing tokens.npy failed" in done.stderr
    assert "is the disk full?" in done.stderr
    assert "[Errno None]" not in done.stderr  # numpy's error has no errno (#66 case 7)
    assert not (tmp_path / "entry" / cache.MARKER).exists()  # nothing committed
