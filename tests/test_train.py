"""The pretraining loop end to end: bit-exact resume after SIGTERM / SIGKILL, mesh invariance,
divergence handling, config validation and a short run that learns.

Everything runs on real data (Austen from the shared corpora, built into a TFDS dataset in a tmp
dir), a real sentencepiece model and real Orbax checkpoints. Runs that must be killed go through
`python -m albert_jax.main` in a subprocess; they share a persistent compilation cache so that
only the first one pays for XLA compilation.
"""

import json
import math
import os
import re
import signal
import subprocess
import sys

import jax
import numpy as np
import pytest
from conftest import main_command

from albert_jax import checkpointing, metrics_writer
from albert_jax.loop import TrainingDivergedError
from albert_jax.pretrain import train
from albert_jax.run_config import with_fields
from albert_jax.runtime import checkpoint_dirs
from configs import pretrain

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# A model small enough to compile and step fast on 2 cores, still a real ALBERT (factorized
# embedding, shared layers, MLM + SOP heads).
SMALL_MODEL = dict(
    vocab_size=1000, embedding_size=16, hidden_size=32, num_hidden_layers=2,
    num_attention_heads=2, intermediate_size=64, max_position_embeddings=64,
)  # fmt: skip


def small_overrides(corpus, **extra):
    """Dotted overrides (as on the command line) of configs/pretrain.py:size=tiny."""
    overrides = {f"model.{k}": v for k, v in SMALL_MODEL.items()}
    overrides.update({
        "data.sources": corpus["sources"],
        "data.data_dir": corpus["data_dir"],
        "data.tokenizer": corpus["tokenizer"],
        "seq_len": 32,
        "max_predictions_per_seq": 5,
        "batch_size": 16,
        "num_train_steps": 8,
        "warmup_steps": 2,
        "learning_rate": 0.002,
        "log_every_steps": 1,
        "eval_every_steps": 0,
        "checkpoint_every_steps": 4,
    })  # fmt: skip
    overrides.update(extra)
    return overrides


def make_config(overrides):
    return with_fields(pretrain.get_config("size=tiny"), **overrides)


# `python -m albert_jax.main`, failing (status 1) if it imported TensorFlow: pretraining on
# prepared ArrayRecord data (a local data dir) reads through TFDS's data sources, never
# TensorFlow, whose import would cost each run ~6 s.
WITHOUT_TENSORFLOW = """
import runpy, sys
try:
    runpy.run_module("albert_jax.main", run_name="__main__", alter_sys=True)
except SystemExit as exit:
    status = exit.code
else:
    status = 0
if "tensorflow" in sys.modules:
    sys.exit("the run imported tensorflow")
sys.exit(status)
"""


def tiny_command(workdir, overrides, devices, without_tensorflow=False, **env):
    """`conftest.main_command` on the tiny pretraining config with `overrides`
    (`without_tensorflow`: failing if the run imports TensorFlow); `env` adds variables."""
    runner = ("-c", WITHOUT_TENSORFLOW) if without_tensorflow else ("-m", "albert_jax.main")
    return main_command(
        "configs/pretrain.py:size=tiny", workdir, overrides, devices, runner=runner, **env
    )


def run_tiny(workdir, overrides, timeout=600):
    """`python -m albert_jax.main` in a subprocess on 8 CPU devices, failing if it imports
    TensorFlow (the corpus fixture prepared the data); returns the process.

    It writes every program it compiles to the session's compilation cache (conftest.py's,
    inherited through the environment): the other subprocess runs of the same config, and
    in-process runs of it (the NaN run below, test_resume_safety's), load them from there."""
    cache = {"JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}
    args, env = tiny_command(workdir, overrides, 8, without_tensorflow=True, **cache)
    return subprocess.run(args, cwd=REPO, env=env, capture_output=True, timeout=timeout, text=True)


def final_state(workdir, step):
    with checkpointing.Checkpointer(workdir, read_only=True) as ckpt:
        assert ckpt.latest_step() == step
        return ckpt.restore_numpy(step, "params"), ckpt.restore_numpy(step, "opt_state")


def losses_by_step(workdir):
    return {r["step"]: r["loss"] for r in metrics_writer.read_metrics(workdir)}


def assert_trees_equal(a, b):
    leaves_a, leaves_b = jax.tree.leaves_with_path(a), jax.tree.leaves_with_path(b)
    assert [p for p, _ in leaves_a] == [p for p, _ in leaves_b]
    for (path, x), (_, y) in zip(leaves_a, leaves_b, strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=str(path))


# ----------------------------------------------------------------------------------------------
# Preemption and crashes: subprocess runs, compared with an uninterrupted run


@pytest.fixture(scope="module")
def interrupted_runs(corpus, tmp_path_factory):
    """An uninterrupted 8-step run, and the same run SIGTERMed after step 3, restarted, SIGKILLed
    right after starting the async save of step 6, and restarted again; plus a run in another
    workdir started from the SIGTERM checkpoint through config.resume_from (and SIGTERMed during
    its last step)."""
    root = tmp_path_factory.mktemp("runs")
    straight, chain = str(root / "straight"), str(root / "chain")
    base = small_overrides(corpus)
    out = {"straight": straight, "chain": chain}
    out["straight_proc"] = run_tiny(straight, base)
    out["sigterm_proc"] = run_tiny(chain, {**base, "debug.sigterm_after_step": 3})
    out["after_sigterm_steps"] = final_steps(chain)
    out["after_sigterm_losses"] = losses_by_step(chain)
    # A new workdir that starts from the chain's step 3 (config.resume_from: full state).
    out["other"] = other = str(root / "other")
    # SIGTERM again, during its last step: that step's save is the final one anyway.
    resume_from = {**base, "resume_from": chain, "debug.sigterm_after_step": 8}
    out["resume_from_proc"] = run_tiny(other, resume_from)
    killed = {**base, "checkpoint_every_steps": 2, "debug.sigkill_after_save_at_step": 6}
    out["sigkill_proc"] = run_tiny(chain, killed)
    out["after_sigkill_dirs"] = sorted(os.listdir(checkpoint_dirs.checkpoint_dir(chain)))
    out["after_sigkill_steps"] = final_steps(chain)
    out["resume_proc"] = run_tiny(chain, base)
    return out


def final_steps(workdir):
    with checkpointing.Checkpointer(workdir, read_only=True) as ckpt:
        return ckpt.all_steps()


def test_uninterrupted_run_writes_the_contract(interrupted_runs):
    proc, workdir = interrupted_runs["straight_proc"], interrupted_runs["straight"]
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert final_steps(workdir) == [4, 8]
    records = metrics_writer.read_metrics(workdir)
    assert [r["step"] for r in records] == list(range(1, 9))
    required = {"step", "loss", "mlm_loss", "sop_loss", "mlm_accuracy", "sop_accuracy",
                "learning_rate", "grad_norm", "examples_per_sec"}  # fmt: skip
    assert required <= set(records[-1])
    assert all(math.isfinite(r["loss"]) for r in records)
    for name in ("config.json", "tokenizer.model", "learning_curve.png"):
        assert os.path.isfile(os.path.join(workdir, name)), name
    assert any(f.startswith("events.out.tfevents") for f in os.listdir(f"{workdir}/tensorboard"))
    assert "step 8/8 | loss" in proc.stderr  # the human progress line
    with open(os.path.join(workdir, "config.json")) as f:
        assert json.load(f)["batch_size"] == 16


def test_sigterm_saves_at_the_step_boundary_and_exits_cleanly(interrupted_runs):
    proc = interrupted_runs["sigterm_proc"]
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "preempted" in proc.stderr
    # Step 3 is not a periodic checkpoint step (every 4): it was saved because of the signal.
    assert interrupted_runs["after_sigterm_steps"] == [3]
    assert sorted(interrupted_runs["after_sigterm_losses"]) == [1, 2, 3]


def test_sigkill_during_async_save_resumes_from_previous_checkpoint(interrupted_runs):
    proc = interrupted_runs["sigkill_proc"]
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-4000:]
    # The run restarted from 3 and saved 4 (committed); 6 was being written when it died.
    assert interrupted_runs["after_sigkill_steps"] == [3, 4]
    assert "6" not in interrupted_runs["after_sigkill_dirs"]
    resumed = interrupted_runs["resume_proc"]
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert "resumed at step 4" in resumed.stderr


def test_a_kill_right_after_a_commit_keeps_that_steps_metrics(corpus, tmp_path):
    """#58 case 3: the record of a checkpointed step (train and eval metrics) is written
    before its checkpoint commits; it used to follow the save (and the evaluation), so a
    crash in between lost it for good: the resume continues after that step."""
    workdir = str(tmp_path / "run")
    base = small_overrides(
        corpus, num_train_steps=4, checkpoint_every_steps=2, eval_every_steps=2, eval_batches=1
    )
    killed = run_tiny(workdir, {**base, "debug.sigkill_after_commit_at_step": 2})
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-4000:]
    assert final_steps(workdir) == [2]
    records = {r["step"]: r for r in metrics_writer.read_metrics(workdir)}
    assert sorted(records) == [1, 2] and "eval_loss" in records[2]
    resumed = run_tiny(workdir, base)
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    records = {r["step"]: r for r in metrics_writer.read_metrics(workdir)}
    assert sorted(records) == [1, 2, 3, 4]
    assert "eval_loss" in records[2] and "eval_loss" in records[4]


def test_resume_is_bit_exact(interrupted_runs):
    assert interrupted_runs["resume_proc"].returncode == 0
    straight, chain = interrupted_runs["straight"], interrupted_runs["chain"]
    params, opt_state = final_state(straight, 8)
    params_chain, opt_state_chain = final_state(chain, 8)
    assert_trees_equal(params, params_chain)
    assert_trees_equal(opt_state, opt_state_chain)
    # Per-step losses: the resumed runs saw exactly the batches of the uninterrupted one (the
    # metrics written past the last checkpoint before the SIGKILL were rewound).
    assert losses_by_step(chain) == losses_by_step(straight)
    assert sorted(losses_by_step(chain)) == list(range(1, 9))


def test_finished_run_restarted_returns_its_last_record_and_writes_nothing(
    interrupted_runs, corpus
):
    straight = interrupted_runs["straight"]
    before = {
        name: os.stat(os.path.join(straight, name)).st_mtime_ns
        for name in (metrics_writer.METRICS_FILE, metrics_writer.LEARNING_CURVE_FILE)
    }
    result = train.train_and_evaluate(make_config(small_overrides(corpus)), straight)
    last = metrics_writer.read_metrics(straight)[-1]
    assert result["step"] == 8 and not result["preempted"] and result["checkpoint_step"] == 8
    assert result["loss"] == last["loss"]  # the finished run's last record
    assert final_steps(straight) == [4, 8]  # nothing saved again
    for name, mtime in before.items():
        assert os.stat(os.path.join(straight, name)).st_mtime_ns == mtime, name


def test_resume_from_another_workdir_is_bit_exact(interrupted_runs):
    proc = interrupted_runs["resume_from_proc"]
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "resumed at step 3" in proc.stderr
    other, straight = interrupted_runs["other"], interrupted_runs["straight"]
    assert_trees_equal(final_state(other, 8)[0], final_state(straight, 8)[0])
    expected = {s: loss for s, loss in losses_by_step(straight).items() if s > 3}
    assert losses_by_step(other) == expected  # this workdir logs its own steps 4..8
    # The SIGTERM during step 8 did not turn the finished run into a preempted one.
    assert f"received signal {signal.SIGTERM.value}" in proc.stderr
    assert "preempted: checkpoint" not in proc.stderr and "stopped by preemption" not in proc.stderr
    assert os.path.isfile(os.path.join(other, "learning_curve.png"))


# ----------------------------------------------------------------------------------------------
# In-process runs


def test_same_loss_on_every_mesh(corpus, tmp_path):
    overrides = small_overrides(corpus, num_train_steps=2, checkpoint_every_steps=100)
    curves = {}
    # (8, 1, 1): data parallelism alone, parameters replicated; (2, 2, 2): the batch split over
    # data and fsdp, parameters sharded over fsdp and tensor, every axis a real one. A third
    # mesh such as (1, 4, 2) takes the same sharding code path with other axis sizes.
    for shape in ((8, 1, 1), (2, 2, 2)):
        config = make_config(
            {**overrides, "mesh.data": shape[0], "mesh.fsdp": shape[1], "mesh.tensor": shape[2]}
        )
        workdir = str(tmp_path / "x".join(map(str, shape)))
        train.train_and_evaluate(config, workdir)
        curves[shape] = [losses_by_step(workdir)[s] for s in (1, 2)]
    # The reference: one device, in a process that has only that one (every device of a job
    # is in its mesh, so a 1-device run needs a 1-device process).
    single = str(tmp_path / "1x1x1")
    args, env = tiny_command(single, overrides, 1)
    proc = subprocess.run(args, cwd=REPO, env=env, capture_output=True, timeout=600, text=True)
    assert proc.returncode == 0, proc.stderr[-4000:]
    reference = [losses_by_step(single)[s] for s in (1, 2)]
    for shape, curve in curves.items():
        np.testing.assert_allclose(curve, reference, rtol=2e-5, err_msg=str(shape))


def test_non_finite_loss_names_the_step_and_last_good_checkpoint(corpus, tmp_path):
    # NaN loss weights in the batch of step 3; checkpoints every 2 steps. In this process (what
    # the CLI prints is this exception's type and message): the train step is the program of the
    # subprocess runs above, loaded from the session's compilation cache.
    workdir = str(tmp_path / "nan")
    overrides = {**small_overrides(corpus), "checkpoint_every_steps": 2, "debug.nan_at_step": 3}
    with pytest.raises(TrainingDivergedError) as error:
        train.train_and_evaluate(make_config(overrides), workdir)
    message = str(error.value)
    assert message.startswith("non-finite loss, grad_norm"), message
    assert "at step 3 (loss=nan" in message
    assert f"last good checkpoint: {checkpoint_dirs.checkpoint_dir(workdir)}/2 (step 2)" in message
    params, _ = final_state(workdir, 2)  # the named checkpoint is committed and finite
    assert all(np.isfinite(x).all() for x in jax.tree.leaves(params))
    last = metrics_writer.read_metrics(workdir)[-1]
    assert (last["step"], last["loss"]) == (3, None)  # NaN is written as null


class CompileCounter:
    """Counts XLA backend compilations (real ones, via jax.monitoring) while `active`."""

    def __init__(self):
        self.active = False
        self.count = 0
        jax.monitoring.register_event_duration_secs_listener(self._on_event)

    def _on_event(self, event, duration, **kwargs):
        if self.active and "backend_compile" in event:
            self.count += 1


@pytest.fixture(scope="module")
def compile_counter():
    counter = CompileCounter()
    counter.active = True  # the counter must see a real compilation, or it proves nothing
    jax.jit(lambda x: x * 3 + 1)(np.arange(5.0)).block_until_ready()
    counter.active = False
    assert counter.count >= 1
    return counter


@pytest.mark.parametrize(
    "change, field",
    [
        ({"batch_size": 12}, "config.batch_size=12 is not divisible by the data-parallel"),
        ({"microbatches": 4}, "config.microbatches=4"),
        ({"model.vocab_size": 1200}, "config.model.vocab_size=1200 but the tokenizer"),
        ({"seq_len": 128}, "config.seq_len=128 exceeds config.model.max_position_embeddings"),
        ({"max_predictions_per_seq": 40}, "config.max_predictions_per_seq=40 exceeds"),
        ({"mesh.tensor": 3}, "config.mesh"),
        # A mesh smaller than the job: devices 3..7 would idle while counted in the log / MFU.
        ({"mesh.data": 3}, "config.mesh (data, fsdp, tensor)=(3, 1, 1) does not fit the 8 dev"),
        ({"objective": "mlm"}, "config.objective='mlm'"),
        ({"unknown_field": 1}, "config.unknown_field"),
        ({"data.tokeniser": "x"}, "config.data.tokeniser"),
        ({"model.hidden_sise": 8}, "hidden_sise"),
        # NaN passes every range check; found only after compiling, config.json held a bare NaN
        ({"learning_rate": float("nan")}, "learning_rate must be a finite number, got nan"),
        ({"model.initializer_range": float("inf")}, "initializer_range must be a finite number"),
    ],
)
def test_bad_config_fails_before_compilation(corpus, tmp_path, compile_counter, change, field):
    config = make_config(small_overrides(corpus))
    config.unlock()  # programmatic users are not protected by lock_config
    for dotted, value in change.items():
        node = config
        *parents, leaf = dotted.split(".")
        for part in parents:
            node = node[part]
        node[leaf] = value
    compile_counter.active, compile_counter.count = True, 0
    try:
        with pytest.raises(ValueError, match=re.escape(field)):
            train.train_and_evaluate(config, str(tmp_path / "run"))
    finally:
        compile_counter.active = False
    assert compile_counter.count == 0
    assert not os.path.exists(checkpoint_dirs.checkpoint_dir(str(tmp_path / "run")))


@pytest.mark.parametrize(
    "flag, expected",
    [
        ("--config.bogus=1", "error: config: unknown field 'bogus' in --config.bogus=1"),
        (
            "--config.lerning_rate=1",
            "error: config: unknown field 'lerning_rate' in --config.lerning_rate=1; did you mean "
            "'learning_rate'?",
        ),
        (
            "--config.model.hidden_sise=8",
            "error: config: unknown field 'hidden_sise' in --config.model.hidden_sise=8; "
            "did you mean 'hidden_size'?",
        ),
        (
            "--config.modl.hidden_size=8",
            "error: config: unknown field 'modl' in --config.modl.hidden_size=8; did you mean "
            "'model'?",
        ),
    ],
)
def test_cli_rejects_unknown_fields_in_one_line(tmp_path, flag, expected):
    args = [
        sys.executable, "-m", "albert_jax.main", "--config=configs/pretrain.py:size=tiny",
        f"--workdir={tmp_path}", flag,
    ]  # fmt: skip
    proc = subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert proc.stderr.strip().splitlines()[-1] == expected
    assert "Traceback" not in proc.stderr


def test_cli_rejects_unknown_config_arg_keys():
    with pytest.raises(ValueError, match="unknown config arg key 'sise'"):
        pretrain.get_config("sise=tiny")


def test_short_run_learns(corpus, tmp_path):
    """A shortened run, tokenizer trained on first use. In 120 steps a model learns the token
    distribution (eval MLM loss far below uniform, the most frequent token found) but not yet
    context: the 3x-most-frequent-token criterion needs the full demo run (7000 steps at seq 32,
    about 9 CPU-minutes, longer than this CI budget: 3.4x, numbers in docs/pretraining.md)."""
    overrides = small_overrides(
        corpus,
        **{
            "data.tokenizer": None,
            "data.tokenizer_max_sentences": 4000,
            "model.hidden_size": 64,
            "model.intermediate_size": 128,
            "model.embedding_size": 32,
            "seq_len": 64,
            "max_predictions_per_seq": 10,
            "batch_size": 32,
            "num_train_steps": 120,
            "warmup_steps": 10,
            "learning_rate": 0.02,
            "log_every_steps": 1,
            "eval_every_steps": 120,
            "eval_batches": 4,
            "checkpoint_every_steps": 1000,
            "mesh.data": 8,
            "mesh.fsdp": 1,
            "mesh.tensor": 1,
        },
    )
    workdir = str(tmp_path / "learn")
    result = train.train_and_evaluate(make_config(overrides), workdir)
    assert os.path.isfile(os.path.join(workdir, "tokenizer.model"))  # trained on first use
    assert os.path.isfile(os.path.join(workdir, "learning_curve.png"))
    records = metrics_writer.read_metrics(workdir)
    assert records[0]["step"] == 1
    first, last = (
        np.mean([r["loss"] for r in records[:5]]),
        np.mean([r["loss"] for r in records[-5:]]),
    )
    assert last < first - 1.0, (first, last)
    assert result["eval_mlm_loss"] < math.log(SMALL_MODEL["vocab_size"]) - 1.0  # uniform: log V
    assert result["eval_mlm_accuracy"] >= 0.9 * result["eval_mlm_majority_accuracy"], result


def test_resume_with_another_tokenizer_is_refused(corpus, tokenizer, tmp_path):
    """Resuming with `config.data.tokenizer=` another model trained on a new vocabulary and
    overwrote WORKDIR/tokenizer.model, the only copy of the one the checkpoints saw."""
    from albert_jax.pretrain import prepare

    workdir = tmp_path / "run"
    workdir.mkdir()
    with open(corpus["tokenizer"], "rb") as f:
        own = f.read()
    (workdir / "tokenizer.model").write_bytes(own)
    config = make_config(small_overrides(corpus))
    config.data.tokenizer = tokenizer.model_path  # another sentencepiece model
    with pytest.raises(ValueError, match=re.escape(
            f"config.data.tokenizer={tokenizer.model_path!r} is not this run's tokenizer "
            f"{workdir / 'tokenizer.model'}")):  # fmt: skip
        prepare.prepare_tokenizer(prepare.PrepareSettings.from_config(config), str(workdir))
    assert (workdir / "tokenizer.model").read_bytes() == own
    config.data.tokenizer = corpus["tokenizer"]  # the same model under another path: fine
    settings = prepare.PrepareSettings.from_config(config)
    assert prepare.prepare_tokenizer(settings, str(workdir)).vocab_size == 1000
