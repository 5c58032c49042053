"""Every client the project uses really works against the local Cloud Storage emulator (the
session fixture `gcs`, tests/gcs.py): etils.epath, Orbax (tensorstore), tf.io.gfile,
TensorBoard's event writer, TFDS, gcsfs and array_record, plus the emulator defects that
tests/gcs_emulator.py works around, checked at the JSON API. Each test writes under its own
prefix of the shared bucket, runs with its cwd in an empty directory and checks that nothing
was written there: gs:// paths must not silently become local ones."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import urllib.error
import urllib.parse
import urllib.request

import numpy as np
import pytest
from gcs import assert_local_unchanged

# This helper's own requests go straight to 127.0.0.1, never through a proxy.
_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))


@pytest.fixture(autouse=True)
def empty_cwd(tmp_path, monkeypatch):
    """Run each test in an empty directory and assert it is still empty afterwards."""
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    yield str(cwd)
    assert_local_unchanged(str(cwd))


def _http(gcs, method, path, data=None, headers=None):
    """(status, headers, body) of one request to the emulator's JSON API."""
    request = urllib.request.Request(
        gcs.endpoint + path, data=data, method=method, headers=headers or {}
    )
    try:
        with _DIRECT.open(request, timeout=30) as response:
            return response.status, response.headers, response.read()
    except urllib.error.HTTPError as err:
        return err.code, err.headers, err.read()


def test_epath_round_trip(gcs):
    from etils import epath

    root = epath.Path(gcs.url("epath"))
    # The project's normal case: TF importable, so epath goes through tf.io.gfile.
    assert type(root._backend).__name__ == "_TfBackend"
    (root / "sub").mkdir(parents=True, exist_ok=True)
    (root / "sub" / "a.txt").write_text("alpha")
    (root / "sub" / "b.json").write_text(json.dumps({"b": 1}))
    assert (root / "sub" / "a.txt").read_text() == "alpha"
    assert sorted(p.name for p in root.glob("sub/*.txt")) == ["a.txt"]
    assert gcs.read("epath/sub/a.txt") == b"alpha"

    (root / "sub" / "a.txt").rename(root / "sub" / "c.txt")
    assert not (root / "sub" / "a.txt").exists()
    assert gcs.read("epath/sub/c.txt") == b"alpha"
    assert sorted(p.name for p in (root / "sub").iterdir()) == ["b.json", "c.txt"]

    root.rmtree()
    assert gcs.list("epath") == []


def test_orbax_checkpoint_manager(gcs):
    """Arrays saved through tensorstore, metadata through epath; `max_to_keep=1` deletes the
    old steps and nothing else; the kept step restores."""
    import jax
    import jax.numpy as jnp
    import orbax.checkpoint as ocp

    bystanders = ["orbax/a_before", "orbax/run_sibling", "orbax/run0", "zz_after_orbax"]
    for name in bystanders:
        gcs.write(name, name.encode())
    tree = {"w": jnp.arange(12.0).reshape(3, 4), "nested": {"b": jnp.arange(5, dtype=jnp.int32)}}
    options = ocp.CheckpointManagerOptions(max_to_keep=1)
    with ocp.CheckpointManager(gcs.url("orbax/run"), options=options) as manager:
        for step in range(3):
            state = jax.tree.map(lambda x, s=step: x + s, tree)
            manager.save(step, args=ocp.args.StandardSave(state))
            manager.wait_until_finished()
        assert manager.all_steps() == [2]
    names = gcs.list("")
    assert any(n.startswith("orbax/run/2/") for n in names)
    assert not [n for n in names if n.startswith(("orbax/run/0/", "orbax/run/1/"))]
    for name in bystanders:
        assert gcs.read(name) == name.encode(), f"{name} was deleted with the old checkpoint"

    with ocp.CheckpointManager(gcs.url("orbax/run")) as manager:
        restored = manager.restore(2, args=ocp.args.StandardRestore(tree))
    np.testing.assert_array_equal(restored["w"], np.asarray(tree["w"]) + 2)
    np.testing.assert_array_equal(restored["nested"]["b"], np.arange(5) + 2)
    gcs.delete("orbax/")
    gcs.delete("zz_after_orbax")


def test_tensorstore_delete_range(gcs):
    """tensorstore's delete_range lists with startOffset / endOffset and deletes what the
    listing returns: only the range may go (Orbax 0.12 cleans up with epath's rmtree, but
    tensorstore itself, OCDBT included, uses this)."""
    import tensorstore as ts

    inside = ["ts/run/a", "ts/run/b/c", "ts/run/z"]
    outside = ["ts/ru", "ts/run", "ts/run0", "ts/run_sibling", "ts/a_before", "zz_after_ts"]
    for name in inside + outside:
        gcs.write(name, name.encode())
    kvstore = ts.KvStore.open({"driver": "gcs", "bucket": gcs.bucket, "path": "ts/run/"}).result()
    assert sorted(kvstore.list().result()) == [b"a", b"b/c", b"z"]
    kvstore.delete_range(ts.KvStore.KeyRange()).result()  # all of ts/run/, nothing else
    assert gcs.list("ts/run/") == []
    for name in outside:
        assert gcs.read(name) == name.encode(), f"{name} was outside the deleted range"
    gcs.delete("ts/")
    gcs.delete("zz_after_ts")


def test_tf_gfile(gcs):
    """makedirs (empty `dir/` marker uploads), a 12 MB write (chunked uploads with
    Content-Length, Expect: 100-continue) read back whole and from a seek, glob."""
    import tensorflow as tf

    directory = gcs.url("gfile/a/b")
    tf.io.gfile.makedirs(directory)
    assert tf.io.gfile.isdir(directory)
    assert "gfile/a/b/" in gcs.list("gfile/")
    data = np.random.default_rng(0).integers(0, 256, 12 << 20, dtype=np.uint8).tobytes()
    with tf.io.gfile.GFile(directory + "/big.bin", "wb") as f:
        f.write(data)
    assert gcs.read("gfile/a/b/big.bin") == data  # what the server stored, not a cache
    with tf.io.gfile.GFile(directory + "/big.bin", "rb") as f:
        assert f.read() == data
        f.seek(7_000_003)
        assert f.read(1000) == data[7_000_003:7_001_003]
    with tf.io.gfile.GFile(directory + "/small.txt", "w") as f:
        f.write("x")
    assert sorted(tf.io.gfile.glob(gcs.url("gfile/*/b/*.bin"))) == [directory + "/big.bin"]
    assert sorted(tf.io.gfile.listdir(directory)) == ["big.bin", "small.txt"]
    tf.io.gfile.rmtree(gcs.url("gfile"))
    assert gcs.list("gfile") == []


def test_tensorboard_event_file_writer(gcs):
    import tensorflow as tf
    from tensorboard.compat.proto import event_pb2, summary_pb2
    from tensorboard.summary.writer.event_file_writer import EventFileWriter

    writer = EventFileWriter(gcs.url("tb/run"))
    for step in range(3):
        value = summary_pb2.Summary.Value(tag="loss", simple_value=1.0 / (step + 1))
        event = event_pb2.Event(step=step, summary=summary_pb2.Summary(value=[value]))
        writer.add_event(event)
    writer.close()
    [path] = tf.io.gfile.glob(gcs.url("tb/run/events.out.tfevents.*"))
    losses = [
        (event.step, value.simple_value)
        for record in tf.data.TFRecordDataset(path)
        for event in [event_pb2.Event.FromString(record.numpy())]
        for value in event.summary.value
    ]
    assert losses == [(0, 1.0), (1, 0.5), (2, pytest.approx(1 / 3))]
    gcs.delete("tb/")


def test_tfds_tfrecord_dataset(gcs):
    """A TFDS builder prepared into a gs:// data_dir (tfrecord: ArrayRecord's writer opens
    local files only) and read back with `as_dataset`."""
    import tensorflow_datasets as tfds

    class GcsClientsTiny(tfds.core.GeneratorBasedBuilder):
        VERSION = tfds.core.Version("1.0.0")

        def _info(self):
            features = tfds.features.FeaturesDict({"text": tfds.features.Text(), "n": np.int64})
            # Not dataset_info_from_configs: that looks for metadata files next to the
            # builder's package, and a test module is no package.
            return tfds.core.DatasetInfo(builder=self, features=features)

        def _split_generators(self, dl_manager):
            return {"train": self._generate_examples(7)}

        def _generate_examples(self, count):
            for i in range(count):
                yield i, {"text": f"document {i}", "n": i}

    builder = GcsClientsTiny(data_dir=gcs.url("tfds"), file_format="tfrecord")
    builder.download_and_prepare(
        download_config=tfds.download.DownloadConfig(try_download_gcs=False)
    )
    names = gcs.list("tfds/")
    assert any(".tfrecord-" in n for n in names), names
    assert any(n.endswith("/dataset_info.json") for n in names), names
    examples = sorted(
        (int(ex["n"]), ex["text"].decode()) for ex in tfds.as_numpy(builder.as_dataset("train"))
    )
    assert examples == [(i, f"document {i}") for i in range(7)]
    gcs.delete("tfds/")


def test_suffix_range_reads(gcs, tmp_path):
    """`Range: bytes=-N` at the API, then ArrayRecord (google-cloud-cpp) reading a gs:// file,
    which locates its footer with a suffix range."""
    data = bytes(range(256)) * 10
    gcs.write("ranges/blob", data)
    status, headers, body = _http(
        gcs, "GET", "/download/storage/v1/b/albert-test/o/ranges%2Fblob?alt=media",
        headers={"Range": "bytes=-100"},
    )  # fmt: skip
    assert (status, body) == (206, data[-100:])
    assert headers["Content-Range"] == f"bytes {len(data) - 100}-{len(data) - 1}/{len(data)}"
    status, _, body = _http(
        gcs, "GET", "/download/storage/v1/b/albert-test/o/ranges%2Fblob?alt=media",
        headers={"Range": "bytes=10-19"},
    )  # fmt: skip
    assert (status, body) == (206, data[10:20])

    from array_record.python.array_record_data_source import ArrayRecordDataSource
    from array_record.python.array_record_module import ArrayRecordWriter

    local = str(tmp_path / "records.array_record")
    writer = ArrayRecordWriter(local, "group_size:1")
    records = [f"record {i}".encode() * (i + 1) for i in range(20)]
    for record in records:
        writer.write(record)
    writer.close()
    with open(local, "rb") as f:
        gcs.write("ranges/records.array_record", f.read())
    source = ArrayRecordDataSource([gcs.url("ranges/records.array_record")])
    assert len(source) == 20
    assert source.__getitems__([0, 7, 19]) == [records[0], records[7], records[19]]
    gcs.delete("ranges/")


def test_gcsfs(gcs):
    import gcsfs

    fs = gcsfs.GCSFileSystem(skip_instance_cache=True)
    with fs.open(f"{gcs.bucket}/fsspec/x/one.txt", "wb") as f:
        f.write(b"one")
    fs.pipe(f"{gcs.bucket}/fsspec/x/two.txt", b"two")
    assert fs.cat(f"{gcs.bucket}/fsspec/x/one.txt") == b"one"
    assert sorted(fs.ls(f"{gcs.bucket}/fsspec/x")) == [
        f"{gcs.bucket}/fsspec/x/one.txt",
        f"{gcs.bucket}/fsspec/x/two.txt",
    ]
    fs.rm(f"{gcs.bucket}/fsspec", recursive=True)
    assert gcs.list("fsspec") == []


def test_emulator_api(gcs):
    """The workarounds at the JSON API: listing offsets and paging, empty uploads, `a` / `a/`
    / `a/x` as distinct objects, objects.move, getStorageLayout."""
    for name, data in [("api/a", b"file"), ("api/a/", b""), ("api/a/x", b"child")]:
        gcs.write(name, data)
    assert [gcs.read(n) for n in ("api/a", "api/a/", "api/a/x")] == [b"file", b"", b"child"]

    def names(**query):
        query = "&".join(f"{k}={urllib.parse.quote(str(v), safe='')}" for k, v in query.items())
        status, _, body = _http(gcs, "GET", f"/storage/v1/b/{gcs.bucket}/o?{query}")
        assert status == 200, body
        page = json.loads(body)
        return [i["name"] for i in page.get("items", [])], page.get("prefixes", []), page

    assert names(startOffset="api/a/", endOffset="api/a0")[0] == ["api/a/", "api/a/x"]
    assert names(prefix="api/", delimiter="/")[:2] == (["api/a"], ["api/a/"])
    first = names(prefix="api/", maxResults=2)
    assert first[0] == ["api/a", "api/a/"]
    assert names(prefix="api/", pageToken=first[2]["nextPageToken"])[0] == ["api/a/x"]

    obj = "/storage/v1/b/albert-test/o/"
    status, _, _ = _http(gcs, "POST", obj + "api%2Fa%2Fx/moveTo/o/api%2Fmoved", data=b"")
    assert status == 200
    assert gcs.read("api/moved") == b"child" and not gcs.exists("api/a/x")
    status, _, body = _http(gcs, "GET", "/storage/v1/b/albert-test/storageLayout")
    assert status == 200 and json.loads(body)["hierarchicalNamespace"] == {"enabled": False}
    gcs.delete("api/")


def test_subprocess_env(gcs, empty_cwd):
    """A child process given `gcs.subprocess_env()` reaches the same bucket (tensorstore:
    the lightest client to import)."""
    gcs.write("child/in", b"from the parent")
    script = (
        "import sys, tensorstore as ts\n"
        f"kv = ts.KvStore.open({{'driver': 'gcs', 'bucket': '{gcs.bucket}'}}).result()\n"
        "data = kv.read('child/in').result().value\n"
        "kv.write('child/out', data + b', and back').result()\n"
    )
    subprocess.run(
        [sys.executable, "-c", script], env=gcs.subprocess_env(), cwd=empty_cwd, check=True
    )
    assert gcs.read("child/out") == b"from the parent, and back"
    gcs.delete("child/")


def test_http_framing(gcs):
    """What libcurl (TF) sends: `Expect: 100-continue` gets its interim answer before the body
    is sent, and a chunked body wins over a (wrong) Content-Length."""
    port = int(gcs.endpoint.rsplit(":", 1)[1])
    upload = f"/upload/storage/v1/b/{gcs.bucket}/o?uploadType=media&name="
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        head = f"POST {upload}framing%2Fexpect HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        sock.sendall(f"{head}Content-Length: 5\r\nExpect: 100-continue\r\n\r\n".encode())
        sock.settimeout(3)  # libcurl would give up waiting after 1 s and send anyway
        assert sock.recv(25).startswith(b"HTTP/1.1 100 Continue\r\n")
        sock.sendall(b"hello")
        sock.settimeout(10)
        assert b"200 OK" in sock.recv(4096)
    assert gcs.read("framing/expect") == b"hello"

    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        head = f"POST {upload}framing%2Fchunked HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        framing = "Transfer-Encoding: chunked\r\nContent-Length: 3\r\nConnection: close\r\n"
        sock.sendall(f"{head}{framing}\r\n5\r\nhello\r\n7\r\n, world\r\n0\r\n\r\n".encode())
        assert b"200 OK" in sock.recv(4096)
    assert gcs.read("framing/chunked") == b"hello, world"
    gcs.delete("framing/")


def test_proxy_refuses_other_hosts(gcs):
    """Only the GCS host names are tunnelled: nothing can leave 127.0.0.1 through the proxy."""
    port = int(gcs.env["HTTPS_PROXY"].rsplit(":", 1)[1])
    for target in ("example.com:443", "storage.googleapis.com.evil.test:443"):
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.sendall(f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n\r\n".encode())
            assert sock.recv(100).startswith(b"HTTP/1.1 403"), target
    assert os.environ["TENSORSTORE_GCS_HTTP_URL"] == gcs.endpoint  # the fixture activated it
