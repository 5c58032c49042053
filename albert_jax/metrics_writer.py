"""Training metrics: WORKDIR/metrics.jsonl, TensorBoard event files, a progress line, a plot.

Only process 0 writes (`MetricsWriter(..., enabled=jax.process_index() == 0)`); the others
get a writer that does nothing, so the loop needs no `if process_index == 0` of its own.

metrics.jsonl holds one JSON object per log step (`step`, `loss`, `mlm_loss`, ...; `eval_*` at
eval steps). Non-finite values are written as null (JSON has no NaN). After a restart from step
k, `rewind(k)` drops the lines of steps > k, so the file reads like one uninterrupted run.
TensorBoard events are `tensorboard`'s protos in its record framing (`EventFile`, no clu and
no TensorFlow). The workdir may be a `gs://` path: files go through `albert_jax.files`, and
since object stores cannot append, the JSONL and the event file are then rewritten whole at each
log step (they stay small).
"""

from __future__ import annotations

import io
import itertools
import json
import math
import os
import socket
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from absl import logging

from albert_jax import files

METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"
LEARNING_CURVE_FILE = "learning_curve.png"
_EVENT_FILES = itertools.count()  # this process's event files: a name apiece, same second too


def _json_number(value: Any) -> Any:
    """A JSON-safe scalar: ints stay ints, floats become Python floats, NaN / inf become None."""
    if value is None or isinstance(value, (bool, str, int)):
        return value
    if hasattr(value, "dtype") and np.issubdtype(value.dtype, np.integer):
        return int(value)
    number = float(value)
    return number if math.isfinite(number) else None


def read_metrics(path: str) -> list[dict[str, Any]]:
    """The records of a metrics.jsonl file (a workdir is accepted too); [] if absent. A cut-off
    last line (a crash mid-write) is dropped with a warning; a bad line elsewhere raises a
    ValueError naming the file and line."""
    return _read_records(path)[0]


def _read_records(path: str) -> tuple[list[dict[str, Any]], int]:
    """(records, 1 if a cut-off last line was dropped else 0): see `read_metrics`."""
    file = files.as_path(path)
    if file.is_dir():
        file = file / METRICS_FILE
    if not file.exists():
        return [], 0
    lines = file.read_text().splitlines()
    last = max((i for i, line in enumerate(lines) if line.strip()), default=-1)
    records, dropped = [], 0
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as e:
            if i == last:  # a write cut off by a crash: that record is lost, the rest is not
                logging.warning("%s: dropped its cut-off last line %d (%s)", file, i + 1, e)
                dropped = 1
                continue
            raise ValueError(
                f"{file}: line {i + 1} is not a JSON record ({e}); fix or remove that line"
            ) from None
    return records, dropped


def _write_lines(path: str, records: Sequence[Mapping[str, Any]]) -> None:
    """Replaces `path` with these records, atomically (`files.write_atomic`)."""
    files.write_atomic(path, "".join(json.dumps(r) + "\n" for r in records))


class MetricsWriter:
    """Appends metrics of one run to JSONL and TensorBoard.

    Args:
      workdir: run directory; writes `metrics.jsonl` and `tensorboard/` there.
      enabled: False on processes other than 0 (every method becomes a no-op).
    """

    def __init__(self, workdir: str, *, enabled: bool = True):
        self.enabled = enabled
        self.path = str(files.as_path(workdir) / METRICS_FILE)
        self._tb: Any = None
        self._records: list[dict[str, Any]] | None = None  # kept only for remote workdirs
        if not enabled:
            return
        files.as_path(workdir).mkdir(parents=True, exist_ok=True)
        self._tb = EventFile(str(files.as_path(workdir) / TENSORBOARD_DIR))
        if not files.is_local(self.path):
            self._records = read_metrics(self.path)

    def rewind(self, step: int) -> int:
        """Drops records with step > `step` (they belong to work lost in a crash) and a cut-off
        last line; returns how many records were dropped. The file is replaced atomically."""
        if not self.enabled:
            return 0
        records, cut = (self._records, 0) if self._records is not None else _read_records(self.path)
        kept = [r for r in records if int(r.get("step", 0)) <= step]
        if self._records is not None:
            self._records = kept
        if len(kept) == len(records) and not cut:
            return 0
        _write_lines(self.path, kept)
        return len(records) - len(kept)

    def write(self, step: int, metrics: Mapping[str, Any]) -> None:
        """One record: {"step": step, **metrics} to JSONL (flushed) and scalars to TensorBoard."""
        if not self.enabled:
            return
        record = {"step": int(step), **{k: _json_number(v) for k, v in metrics.items()}}
        if self._records is None:  # a local file: append (and flush) one line
            with files.as_path(self.path).open("a", encoding="utf-8") as f:
                f.write(json.dumps(record) + "\n")
        else:  # object stores cannot append: rewrite (a few hundred lines at most)
            self._records.append(record)
            _write_lines(self.path, self._records)
        self._write_tensorboard(int(step), record)

    def _write_tensorboard(self, step: int, record: Mapping[str, Any]) -> None:
        from tensorboard.compat.proto import event_pb2, summary_pb2

        values = [
            summary_pb2.Summary.Value(tag=key, simple_value=float(value))
            for key, value in record.items()
            if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool)
        ]
        if values:
            summary = summary_pb2.Summary(value=values)
            self._tb.add_event(event_pb2.Event(wall_time=time.time(), step=step, summary=summary))
            self._tb.flush()

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
            self._tb = None


class EventFile:
    """A TensorBoard event file, `DIRECTORY/events.out.tfevents.<time>.<host>.<pid>.<n>`,
    written through `albert_jax.files` (local or gs://).

    `tensorboard`'s own `EventFileWriter` writes through `tf.io.gfile` whenever TensorFlow is
    installed, and so imports it (~11 s) in fine-tuning runs that otherwise never touch it. The
    records here are the same: `tensorboard`'s `RecordWriter` framing (length, masked CRC-32C,
    the serialized `Event`, masked CRC-32C), a `file_version` event first. A local file is
    appended to at each `flush`; an object is rewritten whole (a bucket cannot append).
    """

    def __init__(self, directory: str):
        from tensorboard.compat.proto import event_pb2
        from tensorboard.summary.writer.record_writer import RecordWriter

        folder = files.as_path(directory)
        folder.mkdir(parents=True, exist_ok=True)
        self.path = folder / (
            f"events.out.tfevents.{int(time.time()):010d}.{socket.gethostname()}."
            f"{os.getpid()}.{next(_EVENT_FILES)}"
        )
        self._pending = io.BytesIO()  # records not yet flushed
        self._records = RecordWriter(self._pending)
        self._written = b"" if not files.is_local(self.path) else None  # an object's bytes
        self.add_event(event_pb2.Event(wall_time=time.time(), file_version="brain.Event:2"))
        self.flush()

    def add_event(self, event: Any) -> None:
        self._records.write(event.SerializeToString())

    def flush(self) -> None:
        data = self._pending.getvalue()
        if not data:
            return
        self._pending.seek(0)
        self._pending.truncate()
        if self._written is None:
            with self.path.open("ab") as f:
                f.write(data)
        else:
            self._written += data
            self.path.write_bytes(self._written)

    def close(self) -> None:
        self.flush()


def format_duration(seconds: float) -> str:
    """3725 -> "1h02m", 252 -> "4m12s", 7 -> "7s"."""
    seconds = max(0, int(round(seconds)))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes:02d}m"
    if minutes:
        return f"{minutes}m{secs:02d}s"
    return f"{secs}s"


#: Pretraining's progress fields (label, metric key): `Objective.progress_fields` of its runs.
PRETRAINING_FIELDS = (("loss", "loss"), ("mlm_acc", "mlm_accuracy"), ("sop_acc", "sop_accuracy"))


def progress_line(
    step: int,
    total: int,
    metrics: Mapping[str, Any],
    eta_seconds: float | None,
    fields: Sequence[tuple[str, str]] = PRETRAINING_FIELDS,
    eval_fields: Sequence[tuple[str, str]] | None = None,
) -> str:
    """`step 250/1500 | loss 6.12 | mlm_acc 0.14 | sop_acc 0.71 | 812 ex/s | MFU 3.1% | ETA 4m12s`
    with the objective's `fields` (label, key) of the training metrics and `eval_fields` of the
    evaluation (default: `fields` with keys `eval_<key>`), appended after "eval". Parts whose
    value is missing are left out: a metric the run cannot measure is not shown as 0."""

    def number(key: str, fmt: str) -> str | None:
        value = metrics.get(key)
        if value is None or (isinstance(value, float) and not math.isfinite(value)):
            return None
        return fmt.format(value)

    parts = [f"step {step}/{total}"]
    parts += [f"{label} {text}" for label, key in fields if (text := number(key, "{:.3f}"))]
    if (rate := number("examples_per_sec", "{:.0f}")) is not None:
        parts.append(f"{rate} ex/s")
    if (mfu := metrics.get("mfu")) is not None and math.isfinite(mfu):
        parts.append(f"MFU {100 * mfu:.1f}%")
    if eta_seconds is not None:
        parts.append(f"ETA {format_duration(eta_seconds)}")
    if eval_fields is None:
        eval_fields = [(label, f"eval_{key}") for label, key in fields]
    evals = [f"{label} {text}" for label, key in eval_fields if (text := number(key, "{:.3f}"))]
    if evals:
        parts.append("eval " + " ".join(evals))
    return " | ".join(parts)


def _series(records: Sequence[Mapping[str, Any]], key: str) -> tuple[list[int], list[float]]:
    steps, values = [], []
    for r in records:
        if r.get(key) is not None:
            steps.append(int(r["step"]))
            values.append(float(r[key]))
    return steps, values


def plot_learning_curve(workdir: str, out_path: str | None = None) -> str | None:
    """Plots metrics.jsonl: train/eval loss (left), eval MLM and SOP accuracy with the
    most-frequent-token and majority-label baselines (right). Returns the PNG path, or None
    when there is nothing to plot."""
    records = read_metrics(workdir)
    if not records:
        return None
    import matplotlib

    matplotlib.use("Agg")  # no display on training machines
    import matplotlib.pyplot as plt

    out_path = out_path or str(files.as_path(workdir) / LEARNING_CURVE_FILE)
    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(11, 4))
    for key, label in (("loss", "train loss"), ("eval_loss", "eval loss")):
        steps, values = _series(records, key)
        if steps:
            ax_loss.plot(steps, values, marker="o" if key.startswith("eval") else None, label=label)
    ax_loss.set_xlabel("step")
    ax_loss.set_ylabel("MLM + SOP loss")
    ax_loss.legend()
    ax_loss.grid(alpha=0.3)
    for key, label in (
        ("mlm_accuracy", "train MLM acc"),
        ("eval_mlm_accuracy", "eval MLM acc"),
        ("eval_sop_accuracy", "eval SOP acc"),
    ):
        steps, values = _series(records, key)
        if steps:
            ax_acc.plot(steps, values, marker="o" if key.startswith("eval") else None, label=label)
    for key, label, style in (
        ("eval_mlm_majority_accuracy", "most frequent token", ":"),
        ("eval_sop_majority_accuracy", "SOP majority label", "--"),
    ):
        _, values = _series(records, key)
        if values:
            ax_acc.axhline(values[-1], linestyle=style, color="gray", label=label)
    ax_acc.set_xlabel("step")
    ax_acc.set_ylabel("accuracy")
    ax_acc.set_ylim(0, 1)
    ax_acc.legend(fontsize=8)
    ax_acc.grid(alpha=0.3)
    fig.suptitle(files.as_path(workdir).name)
    fig.tight_layout()
    write_figure(fig, out_path)
    logging.info("learning curve written to %s", out_path)
    return out_path


def write_figure(fig: Any, path: str, dpi: int = 100) -> None:
    """Writes a matplotlib figure as PNG to `path` (local or gs://) and closes it."""
    import matplotlib.pyplot as plt

    png = io.BytesIO()  # matplotlib writes local files only: render to memory, then upload
    fig.savefig(png, format="png", dpi=dpi)
    files.write_atomic(path, png.getvalue())
    plt.close(fig)
