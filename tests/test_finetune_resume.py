"""Fine-tuning resume and topology-free checkpoint reads.

One straight 12-step fine-tuning run on sentiment_rt (tiny model, params sharded over a
(2, 2, 2) mesh of the 8 test devices, dropout on, periodic checkpoints) is compared with
  - the same run stopped by SIGTERM after step 6 and restarted in its workdir, and
  - a run that crashed after its periodic checkpoint of step 8: a workdir holding only what
    such a crash leaves (checkpoint 8 committed, metrics.jsonl with lines past step 8),
    restarted.
Both must end with the straight run's parameters and optimizer state bit for bit (batches are a
pure function of the step, dropout keys are folded with the step), with the same per-step
losses and the same predictions. `Checkpointer.restore_numpy` then reads that 8-device
checkpoint in a process with 3 devices.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys
import textwrap

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from conftest import xla_flags
from test_finetune import sentiment_tiny_config as _config
from test_finetune import sentiment_tiny_run, tiny_tokenizer_path

from albert_jax import checkpointing, metrics_writer
from albert_jax.finetune import train as finetune
from albert_jax.runtime import checkpoint_dirs

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 12  # sentiment_tiny_config's num_train_steps


@pytest.fixture(scope="module")
def resumed_runs(tmp_path_factory, shared_data):
    spm = tiny_tokenizer_path(tmp_path_factory, shared_data)
    root = tmp_path_factory.mktemp("resume")
    out = {"root": root, "spm": spm}
    out["straight"] = straight = sentiment_tiny_run(tmp_path_factory, shared_data)
    with open(os.path.join(straight, finetune.EVAL_RESULTS_FILE)) as f:
        out["straight_results"] = json.load(f)

    out["chain"] = chain = str(root / "chain")
    stop = _config(spm, shared_data, **{"debug.sigterm_after_step": 6})
    out["stopped"] = finetune.finetune_and_evaluate(stop, chain)
    out["stopped_files"] = sorted(os.listdir(chain))
    with checkpointing.Checkpointer(chain, read_only=True) as ckpt:
        out["stopped_steps"] = ckpt.all_steps()
    out["chain_results"] = finetune.finetune_and_evaluate(_config(spm, shared_data), chain)

    # A crash right after checkpoint 8 committed: the workdir keeps that checkpoint and every
    # metrics line written so far (steps 1..12 here, a superset of what it would have).
    out["crashed"] = crashed = str(root / "crashed")
    os.makedirs(os.path.join(crashed, checkpoint_dirs.CHECKPOINTS_DIR))
    for name in ("metrics.jsonl", "tokenizer.model", "config.json"):
        shutil.copy(os.path.join(straight, name), os.path.join(crashed, name))
    shutil.copytree(
        os.path.join(checkpoint_dirs.checkpoint_dir(straight), "8"),
        os.path.join(checkpoint_dirs.checkpoint_dir(crashed), "8"),
    )
    out["crashed_results"] = finetune.finetune_and_evaluate(_config(spm, shared_data), crashed)
    return out


def _final(workdir: str, step: int = STEPS):
    with checkpointing.Checkpointer(workdir, read_only=True) as ckpt:
        assert ckpt.latest_step() == step
        return ckpt.restore_numpy(step, "params"), ckpt.restore_numpy(step, "opt_state")


def _assert_trees_equal(a, b) -> None:
    leaves_a, leaves_b = jax.tree.leaves_with_path(a), jax.tree.leaves_with_path(b)
    assert [p for p, _ in leaves_a] == [p for p, _ in leaves_b]
    for (path, x), (_, y) in zip(leaves_a, leaves_b, strict=True):
        assert isinstance(x, np.ndarray) and isinstance(y, np.ndarray), path
        np.testing.assert_array_equal(x, y, err_msg=jax.tree_util.keystr(path))


def _losses(workdir: str) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in metrics_writer.read_metrics(workdir) if "loss" in r}


def _predictions(workdir: str) -> list[dict]:
    with open(os.path.join(workdir, "predictions.jsonl")) as f:
        return [json.loads(line) for line in f]


def test_sigterm_saves_and_the_restart_matches_the_straight_run(resumed_runs):
    stopped = resumed_runs["stopped"]
    assert stopped["preempted"] and stopped["step"] == 6 and stopped["checkpoint_step"] == 6
    assert resumed_runs["stopped_steps"] == [4, 6]  # the periodic save, then the SIGTERM one
    assert finetune.EVAL_RESULTS_FILE not in resumed_runs["stopped_files"]  # no evaluation yet

    straight, chain = resumed_runs["straight_results"], resumed_runs["chain_results"]
    assert not chain["preempted"] and chain["step"] == STEPS
    _assert_trees_equal(_final(resumed_runs["straight"])[0], _final(resumed_runs["chain"])[0])
    _assert_trees_equal(_final(resumed_runs["straight"])[1], _final(resumed_runs["chain"])[1])
    # Steps 1..6 logged by the first attempt, 7..12 by the restart: all the straight run's.
    assert _losses(resumed_runs["chain"]) == _losses(resumed_runs["straight"])
    assert sorted(_losses(resumed_runs["straight"])) == list(range(1, STEPS + 1))
    assert chain["accuracy"] == straight["accuracy"] and chain["num_examples"] == 128
    assert _predictions(resumed_runs["chain"]) == _predictions(resumed_runs["straight"])
    # The init report of the first start survives the restart (it lives in the checkpoint).
    assert chain["init"] == straight["init"] and chain["init"]["source"] == "scratch"


def test_restart_after_a_crash_continues_from_the_last_checkpoint(resumed_runs):
    crashed = resumed_runs["crashed_results"]
    assert crashed["step"] == STEPS
    _assert_trees_equal(_final(resumed_runs["straight"])[0], _final(resumed_runs["crashed"])[0])
    _assert_trees_equal(_final(resumed_runs["straight"])[1], _final(resumed_runs["crashed"])[1])
    # The metric lines past step 8 were dropped and written again, once each.
    records = [r for r in metrics_writer.read_metrics(resumed_runs["crashed"]) if "loss" in r]
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert _losses(resumed_runs["crashed"]) == _losses(resumed_runs["straight"])
    assert _predictions(resumed_runs["crashed"]) == _predictions(resumed_runs["straight"])


def test_resume_on_other_data_is_refused(resumed_runs, shared_data):
    # Another seed (data order) or other training data cannot continue this run's schedule.
    run_config = pathlib.Path(resumed_runs["chain"], "config.json")
    recorded = run_config.read_text()
    for override in ({"seed": 1}, {"data.max_train_examples": 160}):
        config = _config(resumed_runs["spm"], shared_data, **override)
        with pytest.raises(ValueError, match="cannot resume .* changed") as error:
            finetune.finetune_and_evaluate(config, resumed_runs["chain"])
        key = "seed" if "seed" in override else "train_fingerprint"
        assert key in str(error.value)
        # The refused start closed what it opened: no mesh is left set in this process.
        assert jax.sharding.get_abstract_mesh().empty
        # ... and kept the config of the run it refused to continue, which the error points to.
        assert run_config.read_text() == recorded


_RESTORE = textwrap.dedent(
    """
    import sys
    import jax
    import numpy as np
    sys.path.insert(0, {repo!r})
    from albert_jax import checkpointing

    assert jax.device_count() == {devices}, jax.devices()
    out = {{}}
    with checkpointing.Checkpointer({workdir!r}, read_only=True) as ckpt:
        for item in ("params", "opt_state"):
            tree = ckpt.restore_numpy({step}, item)
            for path, leaf in jax.tree.leaves_with_path(tree):
                assert type(leaf) is np.ndarray, (path, type(leaf))
                out[item + jax.tree_util.keystr(path)] = leaf
    np.savez({target!r}, **out)
    """
)


# One other device count: restore_numpy reads every leaf whole onto the host whatever the
# count (no sharding is rebuilt), so 1 device would run the same code. 3 is the harder case: 8
# shards do not divide over it, which a restore that rebuilt the saved sharding would fail on.
# (Each count costs a fresh Python process with JAX and Orbax imported.)
@pytest.mark.parametrize("devices", [3])
def test_restore_numpy_reads_an_8_device_checkpoint_anywhere(resumed_runs, tmp_path, devices):
    workdir = resumed_runs["straight"]
    # The checkpoint really is sharded over the 8 devices of this process...
    step_dir = os.path.join(checkpoint_dirs.checkpoint_dir(workdir), str(STEPS))
    with ocp.StandardCheckpointer() as reader:
        metadata = reader.metadata(os.path.join(step_dir, "params")).item_metadata.tree
        saved = reader.restore(os.path.join(step_dir, "params"))  # the saved shardings
    sharded = [x for x in jax.tree.leaves(saved) if not x.is_fully_replicated]
    assert sharded and all(len(x.sharding.device_set) == 8 for x in sharded)
    assert all(m.sharding is not None for m in jax.tree.leaves(metadata))

    # ...and a process with another device count reads it as host arrays.
    target = str(tmp_path / "restored.npz")
    script = _RESTORE.format(repo=REPO, devices=devices, workdir=workdir, step=STEPS, target=target)
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env["XLA_FLAGS"] = xla_flags(devices)
    env["JAX_NUM_CPU_DEVICES"] = str(devices)
    proc = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    restored = dict(np.load(target))

    expected = {}
    for item, tree in zip(("params", "opt_state"), _final(workdir), strict=True):
        for path, leaf in jax.tree.leaves_with_path(tree):
            expected[item + jax.tree_util.keystr(path)] = leaf
    assert restored.keys() == expected.keys()
    for key, value in expected.items():
        np.testing.assert_array_equal(restored[key], value, err_msg=key)
    # The reference itself holds the saved values, not something restore_numpy made up.
    for path, leaf in jax.tree.leaves_with_path(saved):
        key = "params" + jax.tree_util.keystr(path)
        np.testing.assert_array_equal(restored[key], np.asarray(leaf), err_msg=key)
