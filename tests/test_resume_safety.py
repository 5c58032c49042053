"""Restarting a pretraining run on damaged or mismatched checkpoints, and saves that fail.

One 8-step run (checkpoints at steps 4 and 8) is copied for each case: a truncated params file
of the newest step (the run falls back to step 4 and trains to the same state an
uninterrupted run reaches), an emptied `data/metadata` with `resume_strict` (the run stops and
names the directory), a config of another model (one message naming the differing fields,
`config.json` kept), and a disk that refuses the writes of a save (the run stops at that
save, naming step and path; the earlier checkpoints restore). Also: the data position in the
formats older checkpoints hold resumes exactly, and a start builds and validates the data
settings once.
"""

from __future__ import annotations

import collections
import json
import os
import pathlib
import re
import shutil
import subprocess

import numpy as np
import pytest
from test_train import (
    REPO,
    assert_trees_equal,
    final_state,
    losses_by_step,
    make_config,
    small_overrides,
    tiny_command,
)

from albert_jax import checkpointing
from albert_jax.data.data_config import DataConfig
from albert_jax.pretrain import train
from albert_jax.runtime import checkpoint_dirs


@pytest.fixture(scope="module")
def trained(corpus, tmp_path_factory):
    """A finished 8-step run with checkpoints at steps 4 and 8."""
    workdir = str(tmp_path_factory.mktemp("resume") / "trained")
    train.train_and_evaluate(make_config(small_overrides(corpus)), workdir)
    assert sorted(os.listdir(checkpoint_dirs.checkpoint_dir(workdir))) == ["4", "8"]
    return workdir


def _copy(trained, tmp_path, name="run"):
    workdir = str(tmp_path / name)
    shutil.copytree(trained, workdir)
    return workdir


def _step_dir(workdir, step):
    return os.path.join(checkpoint_dirs.checkpoint_dir(workdir), str(step))


def _largest_file(directory):
    paths = [os.path.join(d, f) for d, _, names in os.walk(directory) for f in names]
    return max(paths, key=os.path.getsize)


def test_truncated_latest_checkpoint_falls_back_to_the_one_before(corpus, trained, tmp_path):
    workdir = _copy(trained, tmp_path)
    damaged = _largest_file(os.path.join(_step_dir(workdir, 8), "params"))
    with open(damaged, "r+b") as f:
        f.truncate(os.path.getsize(damaged) // 2)
    result = train.train_and_evaluate(make_config(small_overrides(corpus)), workdir)
    assert result["step"] == 8 and result["checkpoint_step"] == 8
    # Resumed from step 4: steps 5..8 trained again, to the state of the uninterrupted run.
    assert_trees_equal(final_state(workdir, 8)[0], final_state(trained, 8)[0])
    assert_trees_equal(final_state(workdir, 8)[1], final_state(trained, 8)[1])
    assert losses_by_step(workdir) == losses_by_step(trained)


def test_unreadable_latest_checkpoint_with_resume_strict_stops_naming_it(corpus, trained, tmp_path):
    workdir = _copy(trained, tmp_path)
    metadata = pathlib.Path(_step_dir(workdir, 8), "data", "metadata")
    metadata.write_bytes(b"")
    config = make_config({**small_overrides(corpus), "resume_strict": True})
    with pytest.raises(checkpointing.CheckpointError) as error:
        train.train_and_evaluate(config, workdir)
    message = str(error.value)
    assert _step_dir(workdir, 8) in message and "resume_strict" in message
    assert "JSONDecodeError" in message  # the reason, in the same line
    assert metadata.stat().st_size == 0  # nothing deleted: the user decides
    assert sorted(os.listdir(checkpoint_dirs.checkpoint_dir(workdir))) == ["4", "8"]


def test_resume_with_another_model_names_the_fields_and_keeps_config_json(
    corpus, trained, tmp_path
):
    workdir = _copy(trained, tmp_path)
    recorded = pathlib.Path(workdir, "config.json").read_text()
    config = make_config({**small_overrides(corpus), "model.hidden_size": 64})
    with pytest.raises(ValueError) as error:
        train.train_and_evaluate(config, workdir)
    message = str(error.value)
    assert message.startswith(f"cannot resume {workdir} at step 8: its model differs")
    assert "hidden_size: checkpoint 32, config 64" in message
    assert "intermediate_size" not in message  # only what differs
    assert pathlib.Path(workdir, "config.json").read_text() == recorded


def test_resume_with_another_tokenizer_once_the_workdirs_copy_is_gone_is_refused(
    corpus, shared_data, trained, tmp_path
):
    """#66 case 2: with WORKDIR/tokenizer.model deleted, a resume given another tokenizer of
    the same size trained on (its ids mean other pieces). The fingerprint saved with the
    checkpoints decides; the refused run leaves no tokenizer.model behind, so the run's own,
    put back or given, resumes."""
    import gzip

    from albert_jax.data import sentences
    from albert_jax.data.tokenizer import train_tokenizer

    texts = []
    with gzip.open(os.path.join(shared_data, "corpora", "brown.jsonl.gz"), "rt") as f:
        for line in f:
            texts.extend(sentences.split_sentences(json.loads(line)["text"]))
            if len(texts) > 6000:
                break
    other = train_tokenizer(texts, str(tmp_path / "brown"), vocab_size=1000, max_sentences=6000)
    workdir = _copy(trained, tmp_path)
    os.remove(os.path.join(workdir, checkpointing.TOKENIZER_FILE))
    overrides = small_overrides(corpus, num_train_steps=12)
    with pytest.raises(ValueError, match=re.escape(
            f"cannot resume {workdir} at step 8: its checkpoints were trained with another "
            "tokenizer")):  # fmt: skip
        train.train_and_evaluate(make_config({**overrides, "data.tokenizer": other}), workdir)
    assert not os.path.exists(os.path.join(workdir, checkpointing.TOKENIZER_FILE))
    result = train.train_and_evaluate(
        make_config({**overrides, "data.tokenizer": corpus["tokenizer"]}), workdir
    )
    assert result["step"] == 12


# Files up to this size can still be written once the "disk" refuses larger ones: config.json,
# metrics lines, TensorBoard events; not the arrays of a checkpoint.
_FILE_SIZE_KIB = 64


def test_failed_save_stops_the_run_naming_step_and_path(corpus, trained, tmp_path):
    workdir = _copy(trained, tmp_path)
    opt_state = os.path.join(_step_dir(workdir, 8), "opt_state")
    assert os.path.getsize(_largest_file(opt_state)) > _FILE_SIZE_KIB * 1024  # saves hit it
    # The workdir's own tokenizer: nothing large is copied at the start.
    tokenizer = os.path.join(workdir, checkpointing.TOKENIZER_FILE)
    overrides = small_overrides(corpus, num_train_steps=20, **{"data.tokenizer": tokenizer})
    args, env = tiny_command(workdir, overrides, 8, JAX_COMPILATION_CACHE_DIR="")
    # From its start the process cannot write a file larger than the limit: the write fails
    # with EFBIG (SIGXFSZ ignored), as a full disk fails with ENOSPC — a real error from the
    # OS inside Orbax's and TensorStore's writers, at the first save (step 12).
    limit = f'trap "" XFSZ; ulimit -f {_FILE_SIZE_KIB}; exec "$@"'
    proc = subprocess.run(
        ["bash", "-c", limit, "bash", *args], cwd=REPO, env=env, capture_output=True,
        text=True, timeout=600,
    )  # fmt: skip
    # Orbax's writer threads print tracebacks of their own meanwhile; the CLI's one-line error
    # still ends stderr (albert_jax.runtime.cli), and the process exits without waiting for them.
    assert proc.returncode == 1, proc.stderr[-5000:]
    error = proc.stderr.strip().splitlines()[-1]
    assert error.startswith("error: saving the checkpoint of "), proc.stderr[-5000:]
    assert f"step 12 to {_step_dir(workdir, 12)} failed (ValueError: " in error
    assert "File too large" in error, error  # the OS's reason, in the same message
    assert "Checkpoints intact: [4, 8]" in error
    # Stopped at the first step boundary after the background write failed (a few 15 ms steps
    # here), at the latest at the next save (16; its record is written before the save starts).
    assert 12 <= max(losses_by_step(workdir)) <= 16
    with checkpointing.Checkpointer(workdir, read_only=True) as checkpoints:
        assert checkpoints.all_steps() == [4, 8]
        params = checkpoints.restore_numpy(8, "params")
    assert_trees_equal(params, final_state(trained, 8)[0])
    assert np.isfinite(max(losses_by_step(workdir).values()))


# ----------------------------------------------------------------------------------------------
# The data position


def _old_format(state, key):
    """A data state of the current format (`ShardedIterator.get_state`, merged) written the way
    older checkpoints of this repo held it: a list of shard states under `states`, with their
    number under `num_shards` (since data shards) or `process_count` (before)."""
    shards = [state["shards"][str(i)] for i in range(state["num_shards"])]
    return {key: state["num_shards"], "states": shards}


@pytest.mark.parametrize("key", ["num_shards", "process_count"])
def test_data_states_of_older_formats_are_counted_and_resume_exactly(
    corpus, trained, tmp_path, key, caplog
):
    workdir = _copy(trained, tmp_path)
    shutil.rmtree(_step_dir(workdir, 8))  # resume from step 4
    metadata = pathlib.Path(_step_dir(workdir, 4), "data", "metadata")
    state = json.loads(metadata.read_text())
    assert (state["step"], state["num_shards"], list(state["shards"])) == (4, 1, ["0"])
    metadata.write_text(json.dumps(_old_format(state, key)))
    result = train.train_and_evaluate(make_config(small_overrides(corpus)), workdir)
    assert result["step"] == 8
    messages = [r.getMessage() for r in caplog.records]
    assert any("recomputing the input position of step 4" in m for m in messages), messages
    assert_trees_equal(final_state(workdir, 8)[0], final_state(trained, 8)[0])
    assert losses_by_step(workdir) == losses_by_step(trained)
    with checkpointing.Checkpointer(workdir, read_only=True) as checkpoints:
        saved = checkpoints.read_json(8, "data")  # in today's format
    assert (saved["step"], saved["num_shards"], list(saved["shards"])) == (8, 1, ["0"])


def _count_data_configs(monkeypatch):
    """Counts every `DataConfig` built and every validation of one (our own methods, wrapped)."""
    counts = collections.Counter()
    build, validate = DataConfig.__init__, DataConfig.validate

    def counted_build(self, *args, **kwargs):
        counts["built"] += 1
        build(self, *args, **kwargs)

    def counted_validate(self, *args, **kwargs):
        counts["validated"] += 1
        return validate(self, *args, **kwargs)

    monkeypatch.setattr(DataConfig, "__init__", counted_build)
    monkeypatch.setattr(DataConfig, "validate", counted_validate)
    return counts


def test_a_start_builds_and_validates_the_data_config_once(
    corpus, trained, tmp_path, monkeypatch, caplog
):
    """A fresh start and a resumed one (training stream, held-out set, saved position) each
    build `DataConfig` once and validate it once (`train_config.validate_config`)."""
    config = make_config({**small_overrides(corpus), "eval_every_steps": 8, "eval_batches": 1})
    counts = _count_data_configs(monkeypatch)
    result = train.train_and_evaluate(config, str(tmp_path / "fresh"))
    assert "eval_mlm_loss" in result and result["step"] == 8
    assert counts == {"built": 1, "validated": 1}
    counts.clear()
    resumed = _copy(trained, tmp_path)  # finished at step 8: start, restore, nothing to train
    assert train.train_and_evaluate(config, resumed)["step"] == 8
    assert counts == {"built": 1, "validated": 1}
    messages = [r.getMessage() for r in caplog.records]
    assert not any("recomputing the input position" in m for m in messages), messages
