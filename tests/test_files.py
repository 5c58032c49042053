"""albert_jax.files: atomic writes publish all or nothing, on local disk and on gs:// (the local
Cloud Storage emulator of tests/gcs.py); unreadable files (truncated or corrupt compressed data,
invalid UTF-8) raise errors naming the file and the line; file fingerprints (stat, sha256);
bounded line reading (`read_lines`: long lines skipped, long blank runs end the read)."""

import bz2
import gzip
import hashlib
import io
import logging
import os
import pickle
import random
import time

import ml_collections
import pytest
from etils import epath

from albert_jax import files
from albert_jax.data import line_reading


def _interrupted_write(path: str) -> None:
    with pytest.raises(RuntimeError, match="disk full"), files.open_atomic(path) as f:
        f.write(b"half of the new content")
        raise RuntimeError("disk full")


def test_local_atomic_write_keeps_the_old_file_on_error(tmp_path):
    path = tmp_path / "eval_results.json"
    files.write_atomic(path, b"old")
    _interrupted_write(str(path))
    assert path.read_bytes() == b"old"
    assert os.listdir(tmp_path) == ["eval_results.json"]  # no temp file left behind
    files.write_atomic(path, "new")
    assert path.read_text() == "new"


def test_gcs_atomic_write_uploads_nothing_on_error(gcs, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    old, fresh = gcs.url("test_files/old.json"), gcs.url("test_files/fresh.json")
    files.write_atomic(old, b"old")
    _interrupted_write(old)
    _interrupted_write(fresh)
    assert epath.Path(old).read_bytes() == b"old"  # not replaced by the partial write
    assert not epath.Path(fresh).exists()  # nothing published
    big = os.urandom(3 << 20)  # several upload chunks
    files.write_atomic(fresh, big)
    assert gcs.read("test_files/fresh.json") == big
    assert os.listdir(tmp_path) == []


# ---------------------------------------------------------------- unreadable files are named


def _lines(n: int) -> bytes:
    return b"".join(b'{"text": "line %d of a corpus that compresses well"}\n' % i for i in range(n))


@pytest.mark.parametrize("compress", [gzip.compress, bz2.compress], ids=["gzip", "bzip2"])
def test_truncated_compressed_file_names_the_file_and_line(tmp_path, compress):
    data = _lines(60000)  # bzip2 blocks hold ~900 kB: several blocks, the cut in a late one
    whole = compress(data)
    path = tmp_path / "corpus.jsonl.gz"
    path.write_bytes(whole[: len(whole) * 3 // 4])  # a download cut short

    def read_lines():
        with files.open_binary(path) as f:
            return sum(1 for _ in f)

    def read_chunks():
        with files.open_binary(path) as f:
            while f.read(4096):
                pass

    def read_all():
        with files.open_binary(path) as f:
            f.read()

    def read_text():
        with files.open_text(path) as f:
            return list(f)

    lines = set()
    for read in (read_lines, read_chunks, read_all, read_text):
        with pytest.raises(files.UnreadableFileError, match=r"corpus\.jsonl\.gz: line \d+: ") as e:
            read()
        assert isinstance(e.value, ValueError) and "truncated or corrupt" in str(e.value)
        assert e.value.path == str(path)
        lines.add(e.value.line)
    # Every way of reading stops at the same line: the one after the last complete line.
    assert len(lines) == 1
    [line] = lines
    assert 1 < line <= 60000 and data.split(b"\n")[line - 2].endswith(b"}")
    path.write_bytes(whole)
    assert read_lines() == 60000  # intact files read as before


def test_corrupt_gzip_names_the_file(tmp_path):
    whole = bytearray(gzip.compress(_lines(200)))
    whole[len(whole) // 2] ^= 0xFF  # a flipped byte mid-stream
    path = tmp_path / "flipped.gz"
    path.write_bytes(bytes(whole))
    flipped = r"flipped\.gz: line \d+: gzip data"
    with pytest.raises(files.UnreadableFileError, match=flipped), files.open_binary(path) as f:
        f.read()


def test_invalid_utf8_in_text_names_the_file_and_line(tmp_path):
    path = tmp_path / "train.tsv"
    path.write_bytes(b"a\t1\nb\t0\ncaf\xe9\t1\nd\t0\n")
    named = r"train\.tsv: line 3: invalid UTF-8 \(byte 0xe9"
    with pytest.raises(UnicodeDecodeError, match=named), files.open_text(path) as f:
        list(f)
    with pytest.raises(files.UndecodableTextError) as e, files.open_text(path) as f:
        f.read()
    assert (e.value.path, e.value.line) == (str(path), 3)
    # Picklable (raised in worker processes too) with its message intact.
    assert str(pickle.loads(pickle.dumps(e.value))) == str(e.value)
    path.write_bytes("caf\u00e9\n".encode())
    with files.open_text(path) as f:
        assert f.read() == "caf\u00e9\n"


def test_stat_and_sha256_local_and_on_gcs(gcs, tmp_path):
    local = tmp_path / "a.txt"
    local.write_bytes(b"hello")
    remote = gcs.url("test_files/a.txt")
    files.write_atomic(remote, b"hello")
    digest = hashlib.sha256(b"hello").hexdigest()
    for path in (str(local), remote):
        size, mtime_ns = files.stat(path)
        assert size == 5 and abs(mtime_ns / 1e9 - time.time()) < 600
        assert files.sha256(path) == digest
    assert files.stat(local)[1] == os.stat(local).st_mtime_ns  # full resolution locally


# ---------------------------------------------------------------- bounded line reading


def _split_lines(data: bytes, limits: line_reading.LineLimits) -> tuple[list, list]:
    """What `read_lines` must give: a plain split, long lines skipped, a long blank run ending
    the read; (kept (number, line) pairs, skips (reason, number))."""
    pieces = data.split(b"\n")
    if pieces[-1] == b"":
        pieces.pop()
    kept, skips, blank = [], [], 0
    for number, line in enumerate(pieces, 1):
        if len(line) > limits.max_line_bytes:
            skips.append((line_reading.LINE_TOO_LONG, number))
            blank = 0
            continue
        blank = blank + 1 if not line or line.isspace() else 0
        if blank > limits.max_blank_lines:
            skips.append((line_reading.BLANK_RUN_TOO_LONG, number))
            break
        kept.append((number, line))
    return kept, skips


def test_read_lines_agrees_with_a_plain_split_at_any_piece_size(monkeypatch):
    # Pieces as small as one byte: every way a line can straddle pieces (the reader measures a
    # line only when it spans pieces, so that is where an off-by-one would hide).
    rng = random.Random(0)
    skips: list = []
    record = lambda *skip: skips.append(skip)  # noqa: E731
    for _ in range(3000):
        lines = [
            bytes(rng.choice(b"ab \r") for _ in range(rng.choice([0, 0, 1, 2, 5, 9, 20])))
            for _ in range(rng.randint(0, 30))
        ]
        data = b"\n".join(lines) + rng.choice([b"", b"\n"])
        limits = line_reading.LineLimits(rng.randint(1, 10), rng.randint(1, 4))
        monkeypatch.setattr(line_reading, "_LINE_CHUNK", rng.randint(1, 16))
        skips.clear()
        kept = list(line_reading.read_lines(io.BytesIO(data), "x", limits, record))
        assert (kept, skips) == _split_lines(data, limits), (data, limits, line_reading._LINE_CHUNK)


def test_read_lines_names_the_file_and_line_and_logs_progress(tmp_path, monkeypatch, caplog):
    path = tmp_path / "doc.txt.gz"
    path.write_bytes(gzip.compress(b"ok\n" + b"x" * 5000 + b"\nfine\n" + b"\n" * 10 + b"lost\n"))
    monkeypatch.setattr(line_reading, "PROGRESS_BYTES", 1000)
    caplog.set_level(logging.INFO)
    skips: list = []
    with files.open_binary(path) as f:
        limits = line_reading.LineLimits(max_line_bytes=100, max_blank_lines=3)
        kept = list(line_reading.read_lines(f, path, limits, lambda *s: skips.append(s)))
    assert kept == [(1, b"ok"), (3, b"fine"), (4, b""), (5, b""), (6, b"")]
    assert skips == [(line_reading.LINE_TOO_LONG, 2), (line_reading.BLANK_RUN_TOO_LONG, 7)]
    log = caplog.text
    assert f"{path}: line 2 is longer than max_line_bytes=100; skipped" in log
    assert f"{path}: more than max_blank_lines=3 blank lines in a row (lines 4-7)" in log
    assert f"{path}: 0 MiB read, 1 lines so far" in log  # progress while the long line goes


def test_read_at_most_never_reads_past_the_cap(tmp_path):
    path = tmp_path / "book.txt.gz"
    path.write_bytes(gzip.compress(b"a" * 1000))
    with files.open_binary(path) as f:
        assert line_reading.read_at_most(f, 1000) == b"a" * 1000
    with files.open_binary(path) as f:
        assert line_reading.read_at_most(f, 999) is None
        assert f.read() == b""  # one byte past the cap was read, not the whole file


def test_line_limits_from_a_config_name_the_field():
    assert line_reading.LineLimits.from_config(None) == line_reading.DEFAULT_LINE_LIMITS
    config = ml_collections.ConfigDict({"max_line_bytes": 10, "max_blank_lines": None})
    assert line_reading.LineLimits.from_config(config) == line_reading.LineLimits(10, 100_000)
    for bad in (0, -1, True, 2.5, "1"):
        with pytest.raises(ValueError, match=r"config\.data\.max_blank_lines must be an integer"):
            line_reading.LineLimits.from_config({"max_blank_lines": bad})
