"""The server side of the tests' Cloud Storage emulator: run as `python tests/gcs_emulator.py`.

It is the real `gcp-storage-emulator` (PyPI) JSON API: its routes, request parsing and object
handlers, served from our own request handler, with the eight defects that real clients hit
worked around here (none of its installed files is changed):

1. listings ignore `startOffset` / `endOffset` (tensorstore's `delete_range`, Orbax's cleanup,
   would delete the whole bucket): `_list_objects` replaces `objects.ls` (offsets, prefixes,
   `includeTrailingDelimiter`, `matchGlob`, `maxResults` / `pageToken`).
2. empty media uploads crash (TF writes `dir/` markers so): `_Request.data` is `b""`, never None.
3. object names are mapped onto a directory tree, so `a/` and `a/x` collide: `_Storage` keeps
   contents in `_FlatStore`, a dict keyed by the full object name, in memory.
4. `Transfer-Encoding: chunked` plus `Content-Length` (TF's libcurl sends both) is read by
   Content-Length: `_Handler` reads the body itself, chunked first (RFC 9112 6.3).
5. `Expect: 100-continue` gets no interim answer (libcurl waits 1 s per upload): `_Handler`
   speaks HTTP/1.1, so http.server answers `100 Continue` (and connections are kept alive).
6. suffix ranges (`Range: bytes=-N`) return the whole object: `_download` rewrites them.
7. `buckets.getStorageLayout` and `objects.move` are missing (TF's rename uses them): added.
8. preconditions (`ifGenerationMatch`) are ignored, so a create-if-absent overwrites (the
   workdir lease relies on them): `_preconditioned` answers 412 on inserts and deletes whose
   precondition does not hold (0: the object must not exist).

Besides the plain HTTP port it listens with TLS on a second port, and runs an HTTPS proxy
that tunnels `CONNECT www.googleapis.com:443` (and the other GCS host names) there: TF has
those host names hard-coded. The proxy refuses every other destination, so nothing leaves
127.0.0.1. When ready it prints one JSON line with the ports; it exits when stdin closes (the
parent ended or died), so it never outlives the test session, and removes its directory.
"""

from __future__ import annotations

import argparse
import io
import json
import logging
import re
import select
import shutil
import socket
import socketserver
import ssl
import subprocess
import sys
import threading
import traceback
from functools import partial, partialmethod
from http import HTTPStatus
from http.server import ThreadingHTTPServer

from gcp_storage_emulator import server, settings
from gcp_storage_emulator.exceptions import NotFound
from gcp_storage_emulator.gcs_glob import gcs_glob_match
from gcp_storage_emulator.handlers import buckets, objects
from gcp_storage_emulator.storage import Storage

# Host names the proxy tunnels to the emulator (TF uses the first two; the rest are cheap).
GCS_HOSTS = ("www.googleapis.com", "storage.googleapis.com", "oauth2.googleapis.com")

# One request at a time touches the emulator's dicts: its handlers are not thread-safe.
_LOCK = threading.Lock()


class _FlatStore:
    """Object contents keyed by the full "bucket/name" string: no path normalization, so
    `a/`, `a` and `a/x` are three objects (the emulator's own store maps names onto a tree)."""

    def __init__(self) -> None:
        self._data: dict[str, bytes] = {}

    def makedirs(self, rel: str) -> None:
        """Directories do not exist in a flat store."""

    def write_bytes(self, rel: str, content: bytes) -> None:
        self._data[rel] = bytes(content)

    def read_bytes(self, rel: str) -> bytes:
        try:
            return self._data[rel]
        except KeyError as err:
            raise FileNotFoundError(rel) from err

    def exists_file(self, rel: str) -> bool:
        return rel in self._data

    def remove_file(self, rel: str) -> None:
        if self._data.pop(rel, None) is None:
            raise FileNotFoundError(rel)

    def remove_tree(self, rel: str) -> None:
        for key in [k for k in self._data if k == rel or k.startswith(rel + "/")]:
            del self._data[key]

    def listdir(self, rel: str = "") -> list[str]:
        prefix = rel + "/" if rel else ""
        return sorted({k[len(prefix) :].split("/")[0] for k in self._data if k.startswith(prefix)})


class _Storage(Storage):
    """The emulator's Storage (metadata, generations, resumable uploads), in memory, with
    contents in a `_FlatStore` and no JSON metadata file rewritten after every change."""

    def __init__(self) -> None:
        super().__init__(use_memory_fs=True, data_dir="/nonexistent")
        self._store = _FlatStore()

    def _object_path(self, bucket_name, file_name):
        # The stock version strips leading slashes; object names are kept exactly.
        return f"{bucket_name}/{file_name}"

    def _write_config_to_file(self):
        # Metadata lives in this process's dicts; serializing it all per write is O(n^2).
        pass


def _error(response, status: HTTPStatus, message: str) -> None:
    response.status = status
    response.json({"error": {"code": status.value, "message": message, "errors": []}})


def _list_objects(request, response, storage):
    """objects.list with the offsets, delimiter, glob and paging semantics of real GCS."""

    def arg(name, default=None):
        return request.query.get(name, [default])[0]

    if arg("softDeleted", "false").lower() in ("1", "true", "yes"):
        return objects.ls(request, response, storage)
    bucket = request.params["bucket_name"]
    if bucket not in storage.buckets:
        return _error(response, HTTPStatus.NOT_FOUND, f"bucket {bucket} not found")
    prefix, delimiter = arg("prefix", ""), arg("delimiter")
    start, end, glob = arg("startOffset"), arg("endOffset"), arg("matchGlob")
    trailing = arg("includeTrailingDelimiter", "false").lower() == "true"
    names = sorted(
        name
        for name in storage.objects.get(bucket, {})
        if name.startswith(prefix)
        and (not start or name >= start)
        and (not end or name < end)
        and (glob is None or gcs_glob_match(glob, name))
    )
    entries: list[tuple[str, str]] = []  # (name, "prefix" | "item"), in name order
    seen = set()
    for name in names:
        rest = name[len(prefix) :]
        cut = rest.find(delimiter) if delimiter else -1
        if cut >= 0:
            folder = prefix + rest[: cut + len(delimiter)]
            if folder not in seen:
                seen.add(folder)
                entries.append((folder, "prefix"))
            if not (trailing and folder == name):
                continue
        entries.append((name, "item"))
    token = arg("pageToken")
    if token:
        entries = [e for e in entries if e[0] > token]
    limit = max(1, int(arg("maxResults", "1000")))
    # Never split a name that is both a prefix and an item across pages.
    while limit < len(entries) and entries[limit][0] == entries[limit - 1][0]:
        limit += 1
    page, more = entries[:limit], len(entries) > limit
    body = {
        "kind": "storage#objects",
        "items": [storage.objects[bucket][n] for n, kind in page if kind == "item"],
        "prefixes": [n for n, kind in page if kind == "prefix"],
    }
    if more:
        body["nextPageToken"] = page[-1][0]
    response.json(body)


_RANGE = re.compile(r"^\s*bytes=(?P<start>\d*)-(?P<end>\d*)\s*$")


def _download(request, response, storage):
    """Media download: suffix ranges, 416 past the end, and the x-goog-* headers real GCS
    sends (generation and size), then the stock handler."""
    bucket, name = request.params["bucket_name"], request.params["object_id"]
    try:
        obj = storage.get_file_obj(bucket, name)
        size = len(storage.get_file(bucket, name, show_error=False))
    except NotFound:
        return _error(response, HTTPStatus.NOT_FOUND, f"no such object: {bucket}/{name}")
    match = _RANGE.match(request.get_header("Range") or "")
    if match:
        headers = request._request_handler.headers
        del headers["Range"]
        first, last = match["start"], match["end"]
        if not first and last:  # bytes=-N: the last N bytes (all of an empty object)
            if size > 0:
                headers["Range"] = f"bytes={max(0, size - int(last))}-"
        elif first and int(first) >= size > 0:
            response["Content-Range"] = f"bytes */{size}"
            return _error(response, HTTPStatus.REQUESTED_RANGE_NOT_SATISFIABLE, "bad range")
        elif first and size > 0:
            headers["Range"] = match.group(0).strip()
    response["x-goog-generation"] = str(obj.get("generation", "1"))
    response["x-goog-metageneration"] = str(obj.get("metageneration", "1"))
    response["x-goog-stored-content-length"] = str(size)
    objects.download(request, response, storage)


def _get(request, response, storage):
    """objects.get; `alt=media` goes to our download (the stock one calls its own)."""
    if request.query.get("alt", [""])[0] == "media":
        return _download(request, response, storage)
    return objects.get(request, response, storage)


def _storage_layout(request, response, storage):
    """buckets.getStorageLayout: a flat (non-hierarchical) bucket."""
    name = request.params["bucket_name"]
    if name not in storage.buckets:
        return _error(response, HTTPStatus.NOT_FOUND, f"bucket {name} not found")
    response.json(
        {
            "kind": "storage#storageLayout",
            "bucket": name,
            "location": "US",
            "locationType": "multi-region",
            "hierarchicalNamespace": {"enabled": False},
        }
    )


def _move(request, response, storage):
    """objects.move within a bucket: the stock copy, then delete the source."""
    bucket = request.params["bucket_name"]
    src, dst = request.params["object_id"], request.params["dest_object_id"]
    try:
        obj = objects._copy(request.base_url, storage, bucket, src, bucket, dst)
        storage.delete_file(bucket, src)
    except NotFound:
        return _error(response, HTTPStatus.NOT_FOUND, f"no such object: {bucket}/{src}")
    response.json(obj)


def _preconditioned(handler):
    """`handler` (objects.insert or objects.delete) behind the `ifGenerationMatch` check of
    real GCS: 412 Precondition Failed unless the object's generation is the one named (0: no
    such object). For resumable uploads the check is made when the upload starts."""

    def checked(request, response, storage, *args, **kwargs):
        wanted = request.query.get("ifGenerationMatch", [None])[0]
        if wanted is not None:
            bucket = request.params["bucket_name"]
            name = request.params.get("object_id") or request.query.get("name", [None])[0]
            data = request.data if isinstance(request.data, dict) else {}
            name = name or data.get("meta", {}).get("name") or data.get("name")
            current = storage.objects.get(bucket, {}).get(name)
            generation = str(current["generation"]) if current else "0"
            if generation != str(wanted):
                return _error(
                    response,
                    HTTPStatus.PRECONDITION_FAILED,
                    f"At least one of the pre-conditions you specified did not hold "
                    f"(generation {generation}, wanted {wanted})",
                )
        return handler(request, response, storage, *args, **kwargs)

    return checked


_API = re.escape(settings.API_ENDPOINT)
_BUCKET = r"(?P<bucket_name>[-.\w]+)"
_REPLACED = {
    objects.ls: _list_objects,
    objects.download: _download,
    objects.get: _get,
    objects.insert: _preconditioned(objects.insert),
    objects.delete: _preconditioned(objects.delete),
}
ROUTES = [
    (re.compile(rf"^{_API}/b/{_BUCKET}/storageLayout$"), {"GET": _storage_layout}),
    (
        re.compile(
            rf"^{_API}/b/{_BUCKET}/o/(?P<object_id>[^/]+)/moveTo/o/(?P<dest_object_id>[^/]+)$"
        ),
        {"POST": _move},
    ),
] + [
    (re.compile(regex), {method: _REPLACED.get(fn, fn) for method, fn in handlers.items()})
    for regex, handlers in server.HANDLERS
]


class _Request(server.Request):
    """The emulator's request; an empty body reads as b"" (not None), and requests that
    came through the TLS port get https:// upload URLs (so clients come back the same way)."""

    def __init__(self, request_handler, method):
        super().__init__(request_handler, method)
        if isinstance(request_handler.connection, ssl.SSLSocket):
            self._base_url = "https://" + (request_handler.headers.get("Host") or GCS_HOSTS[0])
            self._full_url = self._base_url + self._path

    @property
    def data(self):
        data = super().data
        return b"" if data is None else data


def _read_body(handler) -> bytes:
    """The request body, by chunked framing when present (it wins over Content-Length)."""
    if "chunked" in (handler.headers.get("Transfer-Encoding") or "").lower():
        parts = []
        while True:
            size = int(handler.rfile.readline().split(b";")[0].strip() or b"0", 16)
            if size == 0:
                while handler.rfile.readline().strip():  # trailer fields
                    pass
                return b"".join(parts)
            parts.append(handler.rfile.read(size))
            handler.rfile.readline()
    return handler.rfile.read(int(handler.headers.get("Content-Length") or 0))


class _Handler(server.RequestHandler):
    """Routes every request through `ROUTES` with the body already read."""

    protocol_version = "HTTP/1.1"  # keep-alive, and http.server answers Expect: 100-continue
    # Headers and body go out in two writes: with Nagle on, each answer waits for the
    # client's delayed ACK (40 ms).
    disable_nagle_algorithm = True
    timeout = 300  # idle keep-alive connections end eventually

    def log_request(self, code="-", size="-"):
        # Only shown with --trace; the Range header is what range bugs are about.
        self.log_message('"%s" %s range=%s', self.requestline, code, self.headers.get("Range"))

    def setup(self):
        if isinstance(self.request, ssl.SSLSocket):
            self.request.settimeout(self.timeout)
            self.request.do_handshake()
        super().setup()

    def _route(self, method):
        body = _read_body(self)
        del self.headers["Transfer-Encoding"]
        del self.headers["Content-Length"]
        self.headers["Content-Length"] = str(len(body))
        socket_file, self.rfile = self.rfile, io.BytesIO(body)
        try:
            method = self.headers.get("x-http-method-override") or method
            request, response = _Request(self, method), server.Response(self)
            handler = None
            for pattern, handlers in ROUTES:
                match = pattern.fullmatch(request.path)
                if match is not None:
                    request.set_match(match)
                    handler = handlers.get(method)
                    if handler is None and method == "POST" and request.query.get("uploadType"):
                        # uploads POSTed without the /upload prefix
                        handler = _REPLACED[objects.insert]
                    break
            if handler is None:
                _error(response, HTTPStatus.NOT_IMPLEMENTED, f"{method} {request.path}")
            else:
                try:
                    with _LOCK:
                        handler(request, response, self.storage)
                except Exception:
                    traceback.print_exc()
                    response = server.Response(self)
                    _error(response, HTTPStatus.INTERNAL_SERVER_ERROR, "emulator error")
            response.close()
        finally:
            self.rfile = socket_file

    # http.server dispatches on do_<METHOD>; all of them go through the same router.
    do_GET = partialmethod(_route, "GET")  # noqa: N815
    do_POST = partialmethod(_route, "POST")  # noqa: N815
    do_PUT = partialmethod(_route, "PUT")  # noqa: N815
    do_PATCH = partialmethod(_route, "PATCH")  # noqa: N815
    do_DELETE = partialmethod(_route, "DELETE")  # noqa: N815


class _Server(ThreadingHTTPServer):
    """A thread per connection (clients open many at once), optionally TLS."""

    daemon_threads = True
    request_queue_size = 128

    def __init__(self, storage, tls: ssl.SSLContext | None = None):
        self.tls = tls
        super().__init__(("127.0.0.1", 0), partial(_Handler, storage))

    def get_request(self):
        sock, addr = super().get_request()
        if self.tls is not None:  # the handshake runs in the connection's own thread
            sock = self.tls.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
        return sock, addr

    def handle_error(self, request, client_address):
        if not isinstance(sys.exc_info()[1], (ConnectionError, ssl.SSLError, TimeoutError)):
            super().handle_error(request, client_address)


class _Tunnel(socketserver.StreamRequestHandler):
    """`CONNECT <gcs host>:443` -> a byte pipe to the emulator's TLS port; others get 403."""

    rbufsize = 0  # the CONNECT head only: TLS bytes after it must stay in the socket
    disable_nagle_algorithm = True

    def handle(self):
        head = [self.rfile.readline(8192)]
        while head[-1] not in (b"\r\n", b"\n", b""):
            head.append(self.rfile.readline(8192))
        parts = head[0].split()
        host = parts[1].rsplit(b":", 1)[0].decode() if len(parts) == 3 else ""
        if parts[:1] != [b"CONNECT"] or host not in GCS_HOSTS:
            self.wfile.write(b"HTTP/1.1 403 Forbidden\r\nContent-Length: 0\r\n\r\n")
            return
        upstream = socket.create_connection(("127.0.0.1", self.server.tls_port))
        upstream.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, True)
        self.wfile.write(b"HTTP/1.1 200 Connection established\r\n\r\n")
        _pipe(self.connection, upstream)


def _pipe(a: socket.socket, b: socket.socket) -> None:
    """Copy bytes both ways until both sides have closed."""
    open_ends = {a: b, b: a}
    try:
        while open_ends:
            readable, _, _ = select.select(list(open_ends), [], [], 300)
            if not readable:
                return
            for src in readable:
                data = src.recv(1 << 16)
                if data:
                    open_ends[src].sendall(data)
                else:
                    open_ends[src].shutdown(socket.SHUT_WR)
                    del open_ends[src]
    except OSError:
        pass
    finally:
        b.close()


class _Proxy(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 128

    def __init__(self, tls_port: int):
        self.tls_port = tls_port
        super().__init__(("127.0.0.1", 0), _Tunnel)


def make_certificates(directory: str) -> tuple[str, str, str]:
    """A throwaway CA (`ca.pem`, what clients trust) and a certificate for the GCS host names
    signed by it, made with `openssl` (EC keys: milliseconds)."""
    ca, ca_key = f"{directory}/ca.pem", f"{directory}/ca.key"
    cert, key, csr = f"{directory}/server.pem", f"{directory}/server.key", f"{directory}/s.csr"
    ext = f"{directory}/server.ext"
    with open(ext, "w") as f:
        f.write("subjectAltName=" + ",".join(f"DNS:{h}" for h in GCS_HOSTS) + "\n")
        f.write("basicConstraints=critical,CA:FALSE\nextendedKeyUsage=serverAuth\n")
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    for cmd in (
        ["req", "-x509", *ec, "-keyout", ca_key, "-out", ca, "-days", "7"]
        + ["-subj", "/CN=albert_jax test CA"],
        ["req", "-new", *ec, "-keyout", key, "-out", csr, "-subj", f"/CN={GCS_HOSTS[0]}"],
        ["x509", "-req", "-in", csr, "-CA", ca, "-CAkey", ca_key, "-set_serial", "1"]
        + ["-days", "7", "-out", cert, "-extfile", ext],
    ):
        subprocess.run(["openssl", *cmd], check=True, capture_output=True)
    return ca, cert, key


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bucket", required=True)
    parser.add_argument("--dir", required=True, help="where the certificates go")
    parser.add_argument("--trace", action="store_true", help="log every request to stderr")
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.ERROR, stream=sys.stderr, format="%(asctime)s %(name)s %(message)s"
    )
    if args.trace:  # http.server's per-request lines go to this logger at INFO
        logging.getLogger(server.__name__).setLevel(logging.INFO)

    _, cert, key = make_certificates(args.dir)
    tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    tls.load_cert_chain(cert, key)
    storage = _Storage()
    buckets.create_bucket(args.bucket, storage)
    # Deletes are final here (no 7-day soft-delete copies kept in memory).
    storage.buckets[args.bucket]["softDeletePolicy"]["retentionDurationSeconds"] = "0"
    http, https = _Server(storage), _Server(storage, tls)
    proxy = _Proxy(https.server_address[1])
    for srv in (http, https, proxy):
        threading.Thread(target=srv.serve_forever, daemon=True).start()
    ports = {"http": http.server_address[1], "https": https.server_address[1]}
    print(json.dumps({**ports, "proxy": proxy.server_address[1]}), flush=True)
    sys.stdin.read()  # until the parent closes stdin or dies
    # Then exit (the server threads are daemons; the OS closes their sockets), removing the
    # certificates and log even when the parent could not.
    shutil.rmtree(args.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
