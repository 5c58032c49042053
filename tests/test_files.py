"""albert_jax.files: atomic writes publish all or nothing, on local disk and on gs:// (the local
Cloud Storage emulator of tests/gcs.py)."""

import os

import pytest
from etils import epath

from albert_jax import files


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
