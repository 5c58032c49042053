"""A local Cloud Storage for the tests: `start()` runs the real `gcp-storage-emulator` (wrapped
in tests/gcs_emulator.py, which lists the defects it works around) in a child process on
127.0.0.1 and returns an `Emulator`: the bucket, `url(path)` -> "gs://bucket/path", `env` (the
variables that point every client the project uses at it), object helpers and `stop()`.

How each client finds it (all through `env`; nothing is patched in-process):
- tensorstore (Orbax arrays): TENSORSTORE_GCS_HTTP_URL.
- gcsfs / google-cloud-storage: STORAGE_EMULATOR_HOST (+ GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false,
  else gcsfs waits on 60 s gRPC timeouts per bucket call).
- array_record (google-cloud-cpp): CLOUD_STORAGE_EMULATOR_ENDPOINT.
- tf.io.gfile (TFDS, TensorBoard, etils.epath when TF is importable): TF has the GCS host names
  hard-coded, so HTTPS_PROXY points at the emulator's proxy, which tunnels CONNECTs for those
  names (only those) to the emulator's TLS port; CURL_CA_BUNDLE trusts the throwaway CA made at
  start; NO_GCE_CHECK=true (and an empty CLOUDSDK_CONFIG) make TF's requests anonymous.
- Metadata-server probes (google-auth, tensorstore) go to a closed local port, never outside.

The server is a child process, not a thread of the tests: a client call that held the GIL
while waiting for it would deadlock, and its work does not compete with the tests for the GIL.
It exits when its stdin closes, so it cannot outlive a killed test session.

Set ALBERT_GCS_TRACE=1 to have every request logged to `Emulator.log_path`.

TF's GCS file system reads its environment once per process: call `activate()` (the session
fixture `gcs` in conftest does) before anything touches gs://. Child processes inherit it
from os.environ, or get `{**os.environ, **emulator.env}` explicitly.
"""

from __future__ import annotations

import json
import os
import select
import shutil
import subprocess
import sys
import tempfile
import urllib.error
import urllib.parse
import urllib.request

BUCKET = "albert-test"
_SERVER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gcs_emulator.py")
# Variables that would send a client to real Google credentials or another proxy.
_UNSET = ("GOOGLE_APPLICATION_CREDENTIALS", "ALL_PROXY", "all_proxy", "HTTP_PROXY", "http_proxy")
# A closed local port: metadata-server probes fail at once, without leaving the machine.
_NOWHERE = "127.0.0.1:9"
# Local requests from this helper never go through a proxy.
_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))


class Emulator:
    """A running emulator (see the module docstring). Use `start()` to make one."""

    def __init__(self, bucket: str, ports: dict, directory: str, proc: subprocess.Popen):
        self.bucket = bucket
        self.directory = directory  # certificates, log, empty gcloud config; not the objects
        self.endpoint = f"http://127.0.0.1:{ports['http']}"
        self.log_path = os.path.join(directory, "emulator.log")
        self._proc = proc
        self._saved: dict[str, str | None] | None = None
        proxy = f"http://127.0.0.1:{ports['proxy']}"
        local = "127.0.0.1,localhost"
        self.env = {
            "TENSORSTORE_GCS_HTTP_URL": self.endpoint,
            "STORAGE_EMULATOR_HOST": self.endpoint,
            "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",
            "CLOUD_STORAGE_EMULATOR_ENDPOINT": self.endpoint,
            "HTTPS_PROXY": proxy,
            "https_proxy": proxy,
            "NO_PROXY": local,
            "no_proxy": local,
            "CURL_CA_BUNDLE": os.path.join(directory, "ca.pem"),
            "NO_GCE_CHECK": "true",
            "CLOUDSDK_CONFIG": os.path.join(directory, "gcloud"),
            "GCE_METADATA_HOST": _NOWHERE,
            "GCE_METADATA_ROOT": _NOWHERE,
            "GCE_METADATA_IP": _NOWHERE,
        }

    # -- paths and environment ---------------------------------------------------------------

    def url(self, path: str = "") -> str:
        """ "gs://<bucket>/<path>"."""
        return f"gs://{self.bucket}/{path.lstrip('/')}"

    def subprocess_env(self, base: dict | None = None) -> dict:
        """A complete environment for a child process: `base` (default os.environ) with the
        emulator's variables set and real-credential / other-proxy variables removed."""
        env = {k: v for k, v in (os.environ if base is None else base).items() if k not in _UNSET}
        return {**env, **self.env}

    def activate(self) -> None:
        """Point this process (and the children it starts) at the emulator."""
        if self._saved is None:
            self._saved = {k: os.environ.get(k) for k in (*self.env, *_UNSET)}
        for key in _UNSET:
            os.environ.pop(key, None)
        os.environ.update(self.env)

    def deactivate(self) -> None:
        """Restore the variables `activate` changed."""
        for key, value in (self._saved or {}).items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        self._saved = None

    # -- objects (straight through the JSON API; no client library involved) -----------------

    def _call(self, method: str, path: str, data: bytes | None = None, **query) -> bytes:
        url = self.endpoint + path + ("?" + urllib.parse.urlencode(query) if query else "")
        request = urllib.request.Request(url, data=data, method=method)
        with _DIRECT.open(request, timeout=60) as response:
            return response.read()

    def _object(self, name: str) -> str:
        return f"/b/{self.bucket}/o/{urllib.parse.quote(name, safe='')}"

    def list(self, prefix: str = "") -> list[str]:
        """The names of all objects under `prefix` (a plain string prefix, no delimiter)."""
        names, token = [], None
        while True:
            query = {"prefix": prefix, **({"pageToken": token} if token else {})}
            page = json.loads(self._call("GET", f"/storage/v1/b/{self.bucket}/o", **query))
            names += [item["name"] for item in page.get("items", [])]
            token = page.get("nextPageToken")
            if not token:
                return names

    def read(self, name: str) -> bytes:
        """The contents of object `name`; FileNotFoundError when it does not exist."""
        try:
            return self._call("GET", "/download/storage/v1" + self._object(name), alt="media")
        except urllib.error.HTTPError as err:
            if err.code == 404:
                raise FileNotFoundError(self.url(name)) from err
            raise

    def exists(self, name: str) -> bool:
        try:
            self._call("GET", "/storage/v1" + self._object(name))
            return True
        except urllib.error.HTTPError as err:
            if err.code == 404:
                return False
            raise

    def write(self, name: str, data: bytes) -> None:
        """Create or replace object `name`."""
        path = f"/upload/storage/v1/b/{self.bucket}/o"
        self._call("POST", path, data=data, uploadType="media", name=name)

    def delete(self, prefix: str) -> int:
        """Delete every object under `prefix` (for tests sharing the session's bucket);
        returns how many."""
        names = self.list(prefix)
        for name in names:
            self._call("DELETE", "/storage/v1" + self._object(name))
        return len(names)

    # -- lifetime ------------------------------------------------------------------------------

    def stop(self) -> None:
        """End the emulator process, restore the environment, remove its directory."""
        self.deactivate()
        if self._proc.poll() is None:
            self._proc.stdin.close()  # the server exits when its stdin closes
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        shutil.rmtree(self.directory, ignore_errors=True)

    def __enter__(self) -> Emulator:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def start(bucket: str = BUCKET, timeout: float = 60.0) -> Emulator:
    """Start an emulator with one empty bucket; returns once it answers requests."""
    directory = tempfile.mkdtemp(prefix="albert_gcs_")
    os.makedirs(os.path.join(directory, "gcloud"))
    # The server itself talks to no one: give it an environment without proxies.
    env = {k: v for k, v in os.environ.items() if "proxy" not in k.lower()}
    with open(os.path.join(directory, "emulator.log"), "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, _SERVER, "--bucket", bucket, "--dir", directory]
            + (["--trace"] if os.environ.get("ALBERT_GCS_TRACE") else []),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=log,
            cwd=directory,
            env=env,
        )
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    line = proc.stdout.readline() if ready else b""
    if not line:
        proc.kill()
        with open(os.path.join(directory, "emulator.log"), errors="replace") as f:
            log_text = f.read()
        shutil.rmtree(directory, ignore_errors=True)
        raise RuntimeError(f"the GCS emulator did not start:\n{log_text}")
    return Emulator(bucket, json.loads(line), directory, proc)


def local_snapshot(directory: str) -> dict[str, tuple[int, int]]:
    """{relative path: (size, mtime_ns)} of every file and directory under `directory`."""
    snapshot = {}
    for root, dirs, files in os.walk(directory):
        for name in dirs + files:
            path = os.path.join(root, name)
            stat = os.lstat(path)
            snapshot[os.path.relpath(path, directory)] = (stat.st_size, stat.st_mtime_ns)
    return snapshot


def assert_local_unchanged(directory: str, before: dict | None = None) -> None:
    """Assert nothing under `directory` was created, changed or removed since `before` (a
    `local_snapshot`); with no `before`, assert `directory` is empty. Tests that write only to
    gs:// run with their cwd in an empty directory and check it with this."""
    after = local_snapshot(directory)
    before = {} if before is None else before
    added = sorted(set(after) - set(before))
    removed = sorted(set(before) - set(after))
    changed = sorted(p for p in set(after) & set(before) if after[p] != before[p])
    assert not (added or removed or changed), (
        f"local writes under {directory}: added {added[:20]}, removed {removed[:20]}, "
        f"changed {changed[:20]}"
    )
