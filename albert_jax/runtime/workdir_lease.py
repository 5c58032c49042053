"""One run per workdir: the lease a run holds on its workdir while it lives.

Two runs writing one workdir interleave their metrics, overwrite each other's checkpoints and
both report success. A run therefore takes WORKDIR/run.lease before it writes anything, and a
second run is refused at once with the holder named (host, pid, since when) and how to take
over from a dead one:

- Local disk: an exclusive `flock` on the file, held by the open descriptor. The kernel drops
  it when the process dies however it dies, so a dead run never blocks the next.
- Object stores (`gs://`): nothing can be locked, but an object can be created only if absent
  (a generation precondition). The holder rewrites the object every `RENEW_EVERY_S` seconds,
  each time on the generation it wrote last, so a lease taken over by another run is noticed
  at the next renewal (`check` then raises). A lease not renewed for `STALE_AFTER_S` seconds
  (by the bucket's clock) belongs to a dead run and is taken over, as is one whose holder is a
  dead process on this very host (a restart on the same VM need not wait).

Processes of one multi-host run share the lease: process 0 holds it and the others learn the
outcome from it (`hold`), so either all of them start or all of them stop with the error.
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import json
import os
import socket
import threading
import uuid
from collections.abc import Iterator
from typing import Any

from absl import logging

from albert_jax import files

LEASE_FILE = "run.lease"
RENEW_EVERY_S = 20.0
# A lease object not renewed for this long belongs to a run that died without releasing it
# (a renewal missed for a minute of network trouble must not let a second run in).
STALE_AFTER_S = 90.0


class WorkdirInUseError(RuntimeError):
    """Another run holds the workdir (or took it over from this one); names the holder."""


def _now_iso() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def _holder_record(run_id: str, since: str, processes: int) -> dict[str, Any]:
    """What a lease says about its run: enough to find it (host, pid) and judge it."""
    return {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "run": run_id,
        "since": since,
        "renewed": _now_iso(),
        "processes": processes,
    }


def describe(holder: dict[str, Any] | None) -> str:
    """`pid 123 on host-a since 2026-11-28T16:00:00+00:00 (last renewed ...)`."""
    if not holder:
        return "a run that has not written its details yet"
    text = f"pid {holder.get('pid')} on {holder.get('host')} since {holder.get('since')}"
    processes = int(holder.get("processes", 1) or 1)
    if processes > 1:
        text += f" ({processes} processes)"
    return text


def _parse(data: bytes) -> dict[str, Any] | None:
    try:
        holder = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        return None
    return holder if isinstance(holder, dict) else None


class _LocalLease:
    """An exclusive `flock` on WORKDIR/run.lease, which also records the holder."""

    def __init__(self, workdir: str, processes: int):
        self.path = os.path.join(workdir, LEASE_FILE)
        self.processes = processes
        self._fd: int | None = None
        self.started = False  # set once the run trains: then nothing it wrote is removed

    def acquire(self) -> None:
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _parse(os.pread(fd, 1 << 16, 0))
                os.close(fd)
                raise WorkdirInUseError(
                    f"workdir {os.path.dirname(self.path)} is in use by {describe(holder)}: "
                    "one run per workdir. Use another --workdir, or stop that run first (its "
                    f"lock on {self.path} goes with its process)"
                ) from None
            # A refused run removes the file it created while still holding the lock
            # (`remove`): a lock won on that unlinked file guards nothing.
            if _same_file(fd, self.path):
                break
            os.close(fd)
        record = _holder_record(uuid.uuid4().hex, _now_iso(), self.processes)
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(record) + "\n").encode("utf-8"), 0)
        self._fd = fd

    def check(self) -> None:
        """A lock held by our descriptor cannot be taken from us."""

    def remove(self) -> None:
        """Deletes the lease file, still locked (the next run creates its own), and releases."""
        if self._fd is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
        self.release()

    def release(self) -> None:
        if self._fd is not None:
            # The file stays (removing it would race with a run opening it to lock); the next
            # holder rewrites its content.
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None


def _same_file(fd: int, path: str) -> bool:
    """Whether the open descriptor `fd` is still the file at `path`."""
    try:
        on_disk = os.stat(path)
    except FileNotFoundError:
        return False
    held = os.fstat(fd)
    return (held.st_dev, held.st_ino) == (on_disk.st_dev, on_disk.st_ino)


# Deleting the lease object on the way out: retried for 20 s, not the client's default 120 s
# (a lease left behind is taken over once stale, or at once by a restart on this host).
def _release_retry() -> Any:
    from google.cloud.storage.retry import DEFAULT_RETRY

    return DEFAULT_RETRY.with_timeout(20.0)


class _ObjectLease:
    """WORKDIR/run.lease as a Cloud Storage object, created only if absent and renewed on
    the generation this run wrote (see the module docstring)."""

    def __init__(
        self,
        workdir: str,
        processes: int,
        renew_every_s: float = RENEW_EVERY_S,
        stale_after_s: float = STALE_AFTER_S,
    ):
        from google.cloud import storage

        if not workdir.startswith("gs://"):
            raise ValueError(f"workdir {workdir}: only local paths and gs:// can be leased")
        bucket, _, prefix = workdir[len("gs://") :].partition("/")
        self.url = f"{workdir.rstrip('/')}/{LEASE_FILE}"
        self.bucket_name = bucket
        self.name = f"{prefix.strip('/')}/{LEASE_FILE}" if prefix.strip("/") else LEASE_FILE
        self.processes = processes
        self.renew_every_s, self.stale_after_s = renew_every_s, stale_after_s
        # project=None: object calls need no project, and its lookup could fail on a laptop.
        self._blob = storage.Client(project=None).bucket(bucket).blob(self.name)
        self._record: dict[str, Any] = {}
        self._generation: int | None = None
        self._lost: str | None = None
        self.started = False  # set once the run trains: then nothing it wrote is removed
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _write(self, if_generation_match: int) -> None:
        from google.api_core import exceptions

        self._record["renewed"] = _now_iso()
        try:
            self._blob.upload_from_string(
                json.dumps(self._record) + "\n",
                content_type="application/json",
                if_generation_match=if_generation_match,
            )
        except exceptions.NotFound as e:  # the only 404 of an upload: no such bucket
            raise FileNotFoundError(
                f"bucket gs://{self.bucket_name} does not exist (or this account cannot see "
                f"it): cannot write the workdir lease {self.url}; create the bucket or fix "
                "--workdir"
            ) from e
        self._generation = int(self._blob.generation)

    def _holder(self) -> tuple[dict[str, Any] | None, int | None, float | None]:
        """(the lease's record, its generation, seconds since it was last written) or
        (None, None, None) when there is no lease object."""
        from google.api_core import exceptions

        try:
            data = self._blob.download_as_bytes()
        except exceptions.NotFound:
            return None, None, None
        self._blob.reload()
        age = None
        if self._blob.updated is not None:  # the bucket's clock: the same for every writer
            now = datetime.datetime.now(datetime.timezone.utc)
            age = (now - self._blob.updated).total_seconds()
        return _parse(data), int(self._blob.generation), age

    def acquire(self) -> None:
        from google.api_core import exceptions

        self._record = _holder_record(uuid.uuid4().hex, _now_iso(), self.processes)
        try:
            self._write(if_generation_match=0)
        except exceptions.PreconditionFailed:
            self._take_over()
        self._thread = threading.Thread(target=self._renew, name="workdir-lease", daemon=True)
        self._thread.start()

    def _take_over(self) -> None:
        """Takes a lease whose run is dead (stale, or a dead process on this host), on the
        generation read, so that of two runs taking it over at once one wins; else refuses."""
        from google.api_core import exceptions

        holder, generation, age = self._holder()
        if generation is None:  # released between our attempt and the read: try once more
            generation = 0
        else:
            here = bool(holder) and holder.get("host") == socket.gethostname()
            dead_here = here and not files.pid_alive(holder.get("pid"))
            stale = age is not None and age > self.stale_after_s
            if not (stale or dead_here):
                after = max(self.stale_after_s - (age or 0.0), 0.0)
                raise WorkdirInUseError(
                    f"workdir {self.url.rsplit('/', 1)[0]} is in use by {describe(holder)}, "
                    f"lease renewed {age or 0:.0f} s ago: one run per workdir. Use another "
                    f"--workdir. If that run is dead, its lease is taken over automatically "
                    f"once {self.stale_after_s:.0f} s old (in {after:.0f} s), or delete "
                    f"{self.url} after making sure it is"
                )
            why = "stale" if stale else "its process is gone"
            logging.warning("workdir lease %s: taking over from %s (%s)", self.url,
                            describe(holder), why)  # fmt: skip
        try:
            self._write(if_generation_match=generation)
        except exceptions.PreconditionFailed:
            holder, _, _ = self._holder()
            raise WorkdirInUseError(
                f"workdir {self.url.rsplit('/', 1)[0]} was just taken by {describe(holder)}: "
                "one run per workdir; use another --workdir"
            ) from None

    def renew(self) -> None:
        """Rewrites the lease on the generation this run wrote last; notes a lease that
        another run took over meanwhile (`check` then raises)."""
        from google.api_core import exceptions

        if self._lost is not None:
            return
        try:
            self._write(if_generation_match=self._generation or 0)
        except exceptions.PreconditionFailed:
            holder, _, _ = self._holder()
            self._lost = describe(holder)
            logging.error("workdir lease %s was taken over by %s", self.url, self._lost)

    def _renew(self) -> None:
        while not self._stop.wait(self.renew_every_s) and self._lost is None:
            try:
                self.renew()
            except Exception as e:  # a network error: the next renewal tries again
                logging.warning("workdir lease %s: renewal failed (%s)", self.url, e)

    def check(self) -> None:
        if self._lost is not None:
            raise WorkdirInUseError(
                f"workdir lease {self.url} was taken over by {self._lost} (this run's renewals "
                f"failed for over {self.stale_after_s:.0f} s); this run stops without writing "
                "more"
            )

    def release(self) -> None:
        from google.api_core import exceptions

        self._stop.set()
        if self._thread is not None:
            # A renewal stuck on a storage that stopped answering must not hold the way out
            # (`cli.bound_the_way_out`); the thread is a daemon.
            self._thread.join(timeout=10)
            self._thread = None
        if self._lost is None and self._generation is not None:
            with contextlib.suppress(exceptions.GoogleAPIError):
                # Only our own generation: a lease taken over meanwhile stays its holder's.
                self._blob.delete(
                    if_generation_match=self._generation, timeout=10, retry=_release_retry()
                )
            self._generation = None

    def remove(self) -> None:
        self.release()  # releasing deletes the object


Lease = _LocalLease | _ObjectLease


def acquire(workdir: str, processes: int = 1, **object_options: Any) -> Lease:
    """Takes the lease of `workdir` (local or gs://) for this process; raises
    `WorkdirInUseError` naming the holder, or FileNotFoundError for a bucket that does not
    exist. `object_options` (renew_every_s, stale_after_s) apply to gs:// leases."""
    workdir = files.absolute(workdir)
    lease: Lease = (
        _LocalLease(workdir, processes)
        if files.is_local(workdir)
        else _ObjectLease(workdir, processes, **object_options)
    )
    lease.acquire()
    return lease


@contextlib.contextmanager
def hold(workdir: str) -> Iterator[Lease | None]:
    """The run's lease on `workdir` for the block: process 0 takes it, and every process of a
    multi-host run learns whether it did (they all raise if not). Yields process 0's lease
    (`check()` it before writing checkpoints) and None on the others."""
    import jax
    import numpy as np
    from jax.experimental import multihost_utils

    processes, leader = jax.process_count(), jax.process_index() == 0
    lease, error, found = None, None, None
    if leader:
        # What a failure before the first step must leave (None: no workdir at all).
        found = _contents(workdir) if files.as_path(workdir).exists() else None
        try:
            lease = acquire(workdir, processes)
        except (WorkdirInUseError, FileNotFoundError) as e:
            error = e
    if processes > 1:
        failed = multihost_utils.process_allgather(np.int32(error is not None))
        if error is None and int(np.max(failed)):
            if lease is not None:
                lease.release()
            raise WorkdirInUseError(
                f"workdir {workdir}: process 0 could not take its lease (its error says why)"
            )
    if error is not None:
        raise error
    try:
        yield lease
    except BaseException:
        if lease is not None and not lease.started:
            _leave_as_found(workdir, found, lease)
        raise
    finally:
        if lease is not None:
            lease.release()


def _contents(workdir: str) -> set[str]:
    """The names `workdir` holds (one listing: a run's start must not walk its checkpoints)."""
    return {path.name for path in files.as_path(workdir).iterdir()}


def _leave_as_found(workdir: str, found: set[str] | None, lease: Lease) -> None:
    """After a run that failed before its first step (a refusal, a bad init, a compile
    error): deletes what it created in `workdir` (`found`: the names there before; None: the
    workdir itself is new), so that the next run meets the workdir it would have met. Nothing
    of a run that trained is touched; what cannot be deleted is logged, never raised over the
    error that ended the run."""
    root = files.as_path(workdir)
    try:
        created = _contents(workdir) - (found or set()) - {LEASE_FILE}
        for name in sorted(created):
            path = root / name
            if path.is_dir():
                path.rmtree()
            else:
                path.unlink(missing_ok=True)
        if found is None or LEASE_FILE not in found:
            lease.remove()
        if found is None and files.is_local(workdir) and not any(root.iterdir()):
            root.rmdir()
        if created:
            logging.info("%s: removed what the failed run created: %s", workdir,
                         ", ".join(sorted(created)))  # fmt: skip
    except Exception as e:  # noqa: BLE001 (the run's own error is the one to raise)
        logging.warning("%s: could not remove what the failed run created: %s", workdir, e)
