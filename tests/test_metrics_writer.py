"""MetricsWriter and the learning curve on gs://: the JSONL (rewritten whole, object stores
cannot append), rewind, TensorBoard events and the PNG land in the bucket, not in the cwd."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from albert_jax import files, metrics_writer
from albert_jax.metrics_writer import MetricsWriter, plot_learning_curve, read_metrics

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_metrics_on_gs(gcs, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    prefix = f"metrics-{tmp_path.name}"
    workdir = gcs.url(prefix)
    writer = MetricsWriter(workdir)
    for step in (1, 2, 3):
        eval_loss = float("nan") if step == 2 else 3.0  # NaN is written as null
        writer.write(step, {"loss": 4.0 - step, "mlm_accuracy": 0.1 * step, "eval_loss": eval_loss})
    assert writer.rewind(2) == 1  # step 3 was lost in a crash
    writer.close()
    records = read_metrics(workdir)
    assert [r["step"] for r in records] == [1, 2] and records[1]["eval_loss"] is None
    restarted = MetricsWriter(workdir)  # reads the bucket's file back, writes after it
    restarted.write(3, {"loss": 0.5})
    restarted.close()
    assert [r["loss"] for r in read_metrics(workdir)] == [3.0, 2.0, 0.5]
    assert plot_learning_curve(workdir) == f"{workdir}/learning_curve.png"
    assert gcs.read(f"{prefix}/learning_curve.png").startswith(b"\x89PNG")
    # Two writers in the same second, one event file each (an object rewritten whole by the
    # second would lose the first one's events).
    assert len([n for n in gcs.list(f"{prefix}/tensorboard/") if ".tfevents." in n]) == 2
    assert os.listdir(tmp_path) == []


def _scalars(path) -> list[tuple[int, str, float]]:
    """(step, tag, value) of every scalar in an event file, read by TensorBoard's own loader
    (which checks each record's CRCs)."""
    from tensorboard.backend.event_processing.event_file_loader import LegacyEventFileLoader

    return [
        (event.step, value.tag, value.simple_value)
        for event in LegacyEventFileLoader(str(path)).Load()
        for value in event.summary.value
    ]


def test_tensorboard_reads_the_events_locally_and_on_gs(gcs, tmp_path):
    for workdir in (str(tmp_path / "run"), gcs.url(f"events-{tmp_path.name}")):
        writer = MetricsWriter(workdir)
        writer.write(1, {"loss": 2.5, "note": "text is not a scalar"})
        writer.write(2, {"loss": 1.5, "eval_accuracy": 0.75})
        writer.close()
        folder = files.as_path(workdir) / "tensorboard"
        [name] = [p.name for p in folder.iterdir()]
        assert name.startswith("events.out.tfevents.")
        local = tmp_path / f"copy_{len(workdir)}"  # the loader reads local files
        local.write_bytes((folder / name).read_bytes())
        assert _scalars(local) == [(1, "loss", 2.5), (2, "loss", 1.5), (2, "eval_accuracy", 0.75)]


def test_writing_metrics_imports_no_tensorflow(tmp_path):
    """TensorFlow takes ~11 s to import; a fine-tuning run needs it for nothing else."""
    script = (
        "import sys\n"
        "from albert_jax.metrics_writer import MetricsWriter\n"
        f"writer = MetricsWriter({str(tmp_path)!r})\n"
        "writer.write(1, {'loss': 1.0})\n"
        "writer.close()\n"
        "assert 'tensorflow' not in sys.modules, 'tensorflow imported'\n"
    )
    env = {**os.environ, "PYTHONPATH": REPO}
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert len(os.listdir(tmp_path / "tensorboard")) == 1


def test_cut_off_last_line_is_dropped_and_the_run_resumes(tmp_path):
    """A crash in the middle of a write leaves half a line: the resume drops it (its record was
    lost with the crash) instead of failing on it."""
    writer = MetricsWriter(str(tmp_path))
    for step in (1, 2):
        writer.write(step, {"loss": 4.0 - step})
    writer.close()
    path = tmp_path / "metrics.jsonl"
    path.write_text(path.read_text() + '{"step": 3, "lo')
    resumed = MetricsWriter(str(tmp_path))
    assert resumed.rewind(2) == 0
    resumed.write(3, {"loss": 1.0})
    resumed.close()
    assert [r["step"] for r in read_metrics(str(tmp_path))] == [1, 2, 3]


def test_bad_line_inside_the_file_names_file_and_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 3.0}\nnot json\n{"step": 2, "loss": 2.0}\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl: line 2 is not a JSON record"):
        read_metrics(str(tmp_path))


def test_the_progress_line_takes_its_fields_from_the_objective():
    record = {"loss": 0.5, "accuracy": 0.75, "examples_per_sec": 120.0, "eval_f1": 0.8,
              "eval_exact_match": 0.7, "mlm_accuracy": 0.2}  # fmt: skip
    line = metrics_writer.progress_line(
        10, 20, record, 5.0, (("loss", "loss"), ("acc", "accuracy")),
        (("em", "eval_exact_match"), ("f1", "eval_f1")),
    )  # fmt: skip
    expected = "step 10/20 | loss 0.500 | acc 0.750 | 120 ex/s | ETA 5s | eval em 0.700 f1 0.800"
    assert line == expected
    # Pretraining's by default: its eval fields are the training ones as eval_<key>.
    line = metrics_writer.progress_line(3, 9, {"loss": 1.0, "eval_loss": 2.0}, None)
    assert line == "step 3/9 | loss 1.000 | eval loss 2.000"
