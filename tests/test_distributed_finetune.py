"""Multi-host fine-tuning on localhost: `python -m albert_jax.main --config=configs/finetune.py`
as two processes with 4 CPU devices each under `jax.distributed`, against the same config run
in this process on 8 devices: sentiment_rt from scratch on the `tiny` preset, 12 steps, dropout
on, params sharded over a (data 2, fsdp 2, tensor 2) mesh, checkpoints every 4 steps.

Every process reads the whole global batch and puts only its own rows on its devices
(`finetune._put`); predictions come back to every process from both (`finetune._fetch`), and only
process 0 writes metrics, predictions and results. So the two layouts must agree step by step
(to fp32 rounding: the collectives now cross processes), predict the same labels, and the
checkpoint the two processes write together must hold the same parameters.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import pytest
from test_distributed import Job
from test_finetune import _override, task_files, tiny_tokenizer_path

from albert_jax import checkpointing, finetune, metrics_writer
from configs.finetune import get_config

STEPS = 12
TASK = "sentiment_rt"


def overrides(tokenizer: str, shared_data: str) -> dict[str, object]:
    """Config fields set on top of `configs/finetune.py:task=sentiment_rt`, all of them
    settable from the command line."""
    train, dev = task_files(shared_data, TASK)
    return {
        "size": "tiny", "data.tokenizer": tokenizer, "data.train_files": train,
        "data.eval_files": dev, "data.max_train_examples": 200, "data.max_eval_examples": 128,
        "model.hidden_dropout_prob": 0.1, "model.attention_probs_dropout_prob": 0.1,
        "num_train_steps": STEPS, "warmup_steps": 2, "learning_rate": 1e-3, "batch_size": 32,
        "eval_batch_size": 64, "max_seq_length": 32, "log_every_steps": 1,
        "checkpoint_every_steps": 4, "keep_checkpoints": 5,
        "mesh.data": 2, "mesh.fsdp": 2, "mesh.tensor": 2,
    }  # fmt: skip


def finetune_command(workdir, fields: dict[str, object], devices: int):
    """(argv, environment) of `python -m albert_jax.main` on `configs/finetune.py` with `fields`
    as command-line overrides, on `devices` CPU devices per process."""
    args = [
        sys.executable, "-m", "albert_jax.main", f"--config=configs/finetune.py:task={TASK}",
        f"--workdir={workdir}",
    ] + [f"--config.{k}={v}" for k, v in fields.items()]  # fmt: skip
    env = {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}",
        "JAX_NUM_CPU_DEVICES": str(devices),
        "TF_CPP_MIN_LOG_LEVEL": "2",
    }
    return args, env


@pytest.fixture(scope="module")
def runs(tmp_path_factory, shared_data):
    """The config run in this process on 8 devices, and as 2 processes × 4 devices."""
    fields = overrides(tiny_tokenizer_path(tmp_path_factory, shared_data), shared_data)
    root = tmp_path_factory.mktemp("distributed_finetune")
    config = get_config(f"task={TASK}")
    _override(config, fields)
    finetune.finetune_and_evaluate(config, str(root / "single"))
    args, env = finetune_command(root / "dist", fields, 4)
    job = Job(root / "dist", args, env, root, processes=2)
    try:
        dist = job.wait()
    finally:
        job.kill()
    return {"single": str(root / "single"), "dist": dist}


def _losses(workdir: str) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in metrics_writer.read_metrics(workdir) if "loss" in r}


def _read(workdir: str, name: str) -> str:
    with open(os.path.join(workdir, name)) as f:
        return f.read()


@pytest.mark.timeout(600)
def test_two_processes_train_and_predict_as_one(runs):
    dist, single = runs["dist"], runs["single"]
    dist.check()
    assert "process 1/2, 8 devices" in dist.logs[1]
    # Same losses at every step: each process fed its half of every global batch.
    got, expected = _losses(dist.workdir), _losses(single)
    assert sorted(got) == sorted(expected) == list(range(1, STEPS + 1))
    np.testing.assert_allclose([got[s] for s in expected], list(expected.values()), rtol=1e-5)
    assert len(set(got.values())) == STEPS  # the batches do change from step to step

    # The same 128 predictions, gathered from both processes in order.
    results = json.loads(_read(dist.workdir, finetune.EVAL_RESULTS_FILE))
    expected_results = json.loads(_read(single, finetune.EVAL_RESULTS_FILE))
    assert results["num_examples"] == 128 and results["step"] == STEPS
    assert results["accuracy"] == expected_results["accuracy"]
    assert _read(dist.workdir, "predictions.jsonl") == _read(single, "predictions.jsonl")
    assert "eval: accuracy" in dist.logs[0] and "eval: accuracy" in dist.logs[1]

    # The final checkpoint, written by both processes (each its parameter shards).
    with (
        checkpointing.Checkpointer(dist.workdir, read_only=True) as a,
        checkpointing.Checkpointer(single, read_only=True) as b,
    ):
        assert a.all_steps() == b.all_steps()
        params, params_single = a.restore_numpy(STEPS), b.restore_numpy(STEPS)
    for (path, x), (path_single, y) in zip(_leaves(params), _leaves(params_single), strict=True):
        assert path == path_single
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6, err_msg=path)


@pytest.mark.timeout(600)
def test_only_process_zero_writes(runs):
    dist = runs["dist"]
    dist.check()
    # A second writer would repeat every metrics line and add an event file of its own.
    records = metrics_writer.read_metrics(dist.workdir)
    assert [r["step"] for r in records if "loss" in r] == list(range(1, STEPS + 1))
    events = os.listdir(os.path.join(dist.workdir, metrics_writer.TENSORBOARD_DIR))
    assert len([f for f in events if f.startswith("events.out.tfevents")]) == 1, events
    results = json.loads(_read(dist.workdir, finetune.EVAL_RESULTS_FILE))
    assert results["prediction_files"] == [os.path.join(dist.workdir, "predictions.jsonl")]


def _leaves(tree, prefix: str = "") -> list[tuple[str, np.ndarray]]:
    """(path, array) of a nested dict of numpy arrays, sorted by path."""
    out = []
    for key, value in sorted(tree.items()):
        if isinstance(value, dict):
            out.extend(_leaves(value, f"{prefix}{key}/"))
        else:
            out.append((prefix + key, np.asarray(value)))
    return out
