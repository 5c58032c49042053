"""MetricsWriter and the learning curve on gs://: the JSONL (rewritten whole, object stores
cannot append), rewind, TensorBoard events and the PNG land in the bucket, not in the cwd."""

from __future__ import annotations

import os

from albert_jax.metrics_writer import MetricsWriter, plot_learning_curve, read_metrics


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
    assert any(".tfevents." in name for name in gcs.list(f"{prefix}/tensorboard/"))
    assert os.listdir(tmp_path) == []
