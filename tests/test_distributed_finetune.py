"""Multi-host fine-tuning on localhost: `python -m albert_jax.main --config=configs/finetune.py`
as two processes with 4 CPU devices each under `jax.distributed`, against the same config run
in this process on 8 devices: sentiment_rt from scratch on the `tiny` preset, two seeds in one
program (`num_seeds=2`: a seed axis on the state, each seed its own head, dropout and data
order), 12 steps, dropout on, params sharded over a (data 2, fsdp 2, tensor 2) mesh,
checkpoints every 4 steps.

Every process reads the whole global batch and puts only its own rows on its devices
(`sharding.process_rows`); predictions come back to every process from both
(`sharding.fetch`), and only process 0 writes metrics, predictions and results. The 2-process
run is preempted on the way: process 0 alone gets SIGTERM after step 6 (one host's notice),
JAX's preemption service passes it on and makes both agree on that step to save, and a second
2-process job resumes from it.
The result must still match the 1-process run step by step, for each seed (to fp32 rounding:
the collectives now cross processes), predict the same labels, and the checkpoint the two
processes write together must hold the same parameters.
"""

from __future__ import annotations

import json
import os

import jax
import numpy as np
import pytest
from conftest import main_command
from test_distributed import Job, assert_one_writer, assert_preempted_together
from test_finetune import _override, task_files, tiny_tokenizer_path

from albert_jax import checkpointing, metrics_writer
from albert_jax.finetune import train as finetune
from configs.finetune import get_config

STEPS = 12
SEEDS = ("0", "1")  # config.seed 0, num_seeds 2
SIGTERM_AFTER = 6
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
        "mesh.data": 2, "mesh.fsdp": 2, "mesh.tensor": 2, "num_seeds": len(SEEDS),
        # Packed rows, split between the processes (auto would not pack 32-token rows).
        "pack_examples": True,
    }  # fmt: skip


def finetune_command(workdir, fields: dict[str, object], devices: int):
    """(argv, environment) of `python -m albert_jax.main` on `configs/finetune.py` with `fields`
    as command-line overrides, on `devices` CPU devices per process."""
    return main_command(
        f"configs/finetune.py:task={TASK}", workdir, fields, devices,
        JAX_NUM_CPU_DEVICES=str(devices), TF_CPP_MIN_LOG_LEVEL="2",
    )  # fmt: skip


@pytest.fixture(scope="module")
def jobs(tmp_path_factory, shared_data):
    """The config run in this process on 8 devices, and as 2 processes × 4 devices twice in one
    workdir: the first job is preempted (process 0 gets SIGTERM after step 6, as one host of a
    pod does before maintenance), the second resumes it and finishes."""
    fields = overrides(tiny_tokenizer_path(tmp_path_factory, shared_data), shared_data)
    root = tmp_path_factory.mktemp("distributed_finetune")
    config = get_config(f"task={TASK}")
    _override(config, fields)
    finetune.finetune_and_evaluate(config, str(root / "single"))
    out = {"single": str(root / "single")}
    for name, extra in (("preempted", {"debug.sigterm_after_step": SIGTERM_AFTER}), ("dist", {})):
        args, env = finetune_command(root / "dist", {**fields, **extra}, 4)
        logs = root / f"logs_{name}"  # the two jobs share the workdir and so the log names
        os.makedirs(logs)
        job = Job(root / "dist", args, env, logs, processes=2)
        try:
            out[name] = job.wait()
        finally:
            job.kill()
        if name == "preempted":
            with checkpointing.Checkpointer(str(root / "dist"), read_only=True) as ckpt:
                out["preempted_steps"] = ckpt.all_steps()
            out["preempted_results"] = os.path.exists(
                os.path.join(root / "dist", finetune.EVAL_RESULTS_FILE)
            )
    return out


def _losses(workdir: str, key: str) -> dict[int, float]:
    return {r["step"]: r[key] for r in metrics_writer.read_metrics(workdir) if key in r}


def _read(workdir: str, name: str) -> str:
    with open(os.path.join(workdir, name)) as f:
        return f.read()


@pytest.mark.timeout(600)
def test_two_processes_train_and_predict_as_one(jobs):
    dist, single = jobs["dist"], jobs["single"]
    dist.check()
    assert "process 1/2, 8 devices" in dist.logs[1]
    # Same losses at every step, each seed's and their mean: each process fed its half of
    # every global batch (of every seed).
    for key in ("loss", *(f"loss/seed_{s}" for s in SEEDS)):
        got, expected = _losses(dist.workdir, key), _losses(single, key)
        assert sorted(got) == sorted(expected) == list(range(1, STEPS + 1))
        np.testing.assert_allclose([got[s] for s in expected], list(expected.values()), rtol=1e-5)
        assert len(set(got.values())) == STEPS  # the batches do change from step to step
    assert _losses(single, "loss/seed_0") != _losses(single, "loss/seed_1")  # two jobs, not one

    # The same 128 predictions of each seed, gathered from both processes in order.
    results = json.loads(_read(dist.workdir, finetune.EVAL_RESULTS_FILE))
    expected_results = json.loads(_read(single, finetune.EVAL_RESULTS_FILE))
    assert results["num_seeds"] == len(SEEDS) and results["step"] == STEPS
    assert results["data"]["train"]["packed"]
    for seed in SEEDS:
        assert results["per_seed"][seed]["num_examples"] == 128
        assert results["per_seed"][seed] == expected_results["per_seed"][seed]
        predictions = os.path.join(f"seed_{seed}", "predictions.jsonl")
        assert _read(dist.workdir, predictions) == _read(single, predictions)
    assert results["median"] == expected_results["median"]
    assert "eval: accuracy" in dist.logs[0] and "eval: accuracy" in dist.logs[1]

    # The final checkpoint, written by both processes (each its parameter shards).
    with (
        checkpointing.Checkpointer(dist.workdir, read_only=True) as a,
        checkpointing.Checkpointer(single, read_only=True) as b,
    ):
        # The same periodic saves plus the preemption's; all kept (keep_checkpoints 5).
        assert a.all_steps() == sorted({*b.all_steps(), SIGTERM_AFTER}) == [4, 6, 8, 12]
        params, params_single = a.restore_numpy(STEPS), b.restore_numpy(STEPS)
    leaves, leaves_single = (jax.tree.leaves_with_path(p) for p in (params, params_single))
    assert [p for p, _ in leaves] == [p for p, _ in leaves_single]
    for (path, x), (_, y) in zip(leaves, leaves_single, strict=True):
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6, err_msg=jax.tree_util.keystr(path))


@pytest.mark.timeout(600)
def test_preempted_processes_agree_on_a_step_save_it_and_exit(jobs):
    # Step 6 is not a periodic save (4, 8, 12): process 0's notice made both processes save it.
    assert_preempted_together(jobs["preempted"], SIGTERM_AFTER)
    assert jobs["preempted_steps"] == [4, SIGTERM_AFTER]
    assert not jobs["preempted_results"]  # no evaluation yet
    assert f"resumed fine-tuning at step {SIGTERM_AFTER}" in jobs["dist"].logs[0]


@pytest.mark.timeout(600)
def test_only_process_zero_writes(jobs):
    dist = jobs["dist"]
    dist.check()
    assert_one_writer(dist.workdir, STEPS, jobs=2)  # the preempted job and its restart
    results = json.loads(_read(dist.workdir, finetune.EVAL_RESULTS_FILE))
    assert results["prediction_files"] == [
        os.path.join(dist.workdir, f"seed_{seed}", "predictions.jsonl") for seed in SEEDS
    ]
