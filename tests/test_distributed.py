"""Multi-host pretraining on localhost: two `python -m albert_jax.main` processes with 4 CPU
devices each under `jax.distributed` (a local coordinator on a free port), against one process
with 8 devices.

What must hold (issue #5): both layouts see the same global batches (the data is cut into 2
shards either way), so the per-step losses and the eval metrics agree to fp32 rounding; eval
runs the same number of steps on every process although process 1's validation shard is empty
(padding rows with weight 0); only process 0 writes metrics; and the Orbax checkpoint written
by the two processes (FSDP shards spread over both) restores in one process, exactly, and
training goes on from it on the same batches. The 2-process run is preempted on the way:
process 0 alone gets SIGTERM after step 2 (one host's notice), JAX's preemption service passes
it on, both processes agree on that step, save it and exit; a second 2-process job resumes it.
The 2-process jobs run as on a pod: their workdir is in Cloud Storage (a local emulator,
tests/gcs.py), the 1-process resume starts from a copy of their step-3 checkpoint there, and
nothing may be written to their local working directory.

The tiny model is that of test_train.py, the corpus conftest.py's `corpus` fixture (Austen as a
TFDS dataset, a 1000-piece tokenizer). Every run gets the XLA flags of every test process
(`conftest.xla_flags`: unoptimized CPU code, this model is far too small for it to matter), and
compiling takes most of the test's time (the two processes of the distributed run compile at the
same time on the same cores, and the compile cache cannot be shared with the 1-process runs).
"""

from __future__ import annotations

import dataclasses
import os
import socket
import subprocess
import time

import flax.linen as nn
import jax
import numpy as np
import pytest
from etils import epath
from test_train import (
    assert_trees_equal,
    losses_by_step,
    make_config,
    small_overrides,
    tiny_command,
)

from albert_jax import checkpointing, metrics_writer
from albert_jax.data import pipeline
from albert_jax.data.data_config import DataConfig, sources_from_spec
from albert_jax.data.tokenizer import Tokenizer
from albert_jax.model.albert import AlbertForPreTraining, init_params
from albert_jax.model.config import model_config_from
from albert_jax.pretrain import heldout as pretraining_eval
from albert_jax.pretrain import model_half
from albert_jax.pretrain.settings import validate_config
from albert_jax.runtime import checkpoint_dirs
from albert_jax.sharding import LOGICAL_AXIS_RULES, create_mesh

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS, RESUME_STEP = 5, 3  # checkpoints at 3 and 5; the 1-process resume runs steps 4 and 5
SIGTERM_AFTER = 2  # the 2-process run is preempted after this step, and restarted
MESH = {"mesh.data": 1, "mesh.fsdp": 4, "mesh.tensor": 2}  # fsdp spans both processes
EVAL_KEYS = (
    "eval_loss", "eval_mlm_loss", "eval_sop_loss", "eval_mlm_accuracy", "eval_sop_accuracy",
    "eval_mlm_majority_accuracy", "eval_sop_majority_accuracy",
)  # fmt: skip


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclasses.dataclass
class Run:
    """A finished `albert_jax.main` job: its workdir and each process's exit code and log."""

    workdir: str
    returncodes: list[int]
    logs: list[str]

    def check(self) -> None:
        """Fails with the tail of every process's log unless all of them exited 0."""
        if any(rc != 0 for rc in self.returncodes):
            tails = "\n".join(
                f"--- process {i} (exit {rc}):\n{log[-4000:]}"
                for i, (rc, log) in enumerate(zip(self.returncodes, self.logs, strict=True))
            )
            pytest.fail(f"run in {self.workdir} failed:\n{tails}")


def assert_preempted_together(run: Run, step: int) -> None:
    """Every process of `run` exited normally after saving `step` on a preemption notice.

    In the tests process 0 alone gets SIGTERM after `step`, and every process waits for JAX's
    preemption service to pass the notice on (`preemption.send_preemption_notice`), so they
    agree on `step` itself."""
    run.check()
    for log in run.logs:
        assert f"preempted: checkpoint of step {step} saved, exiting" in log


def assert_one_writer(workdir: str, steps: int, jobs: int) -> None:
    """Only process 0 wrote `workdir`'s metrics (of `jobs` jobs run there, one after another):
    each of steps 1..`steps` has one training line, and each job one TensorBoard event file.
    A second writer would repeat the lines and add an event file of its own."""
    records = metrics_writer.read_metrics(workdir)
    assert [r["step"] for r in records if "loss" in r] == list(range(1, steps + 1))
    events = [p.name for p in (epath.Path(workdir) / metrics_writer.TENSORBOARD_DIR).iterdir()]
    assert len([f for f in events if f.startswith("events.out.tfevents")]) == jobs, events


class Job:
    """`args` (a `python -m albert_jax.main` command line) as `processes` processes, started at
    once under one `jax.distributed` coordinator; `wait()` collects them. Their output goes to
    files (no pipe to fill)."""

    def __init__(self, workdir, args, env, log_dir, *, processes, cwd=REPO):
        coordinator = f"127.0.0.1:{free_port()}"
        self.workdir = str(workdir)
        name = os.path.basename(self.workdir)
        self.paths = [os.path.join(log_dir, f"{name}.{i}.log") for i in range(processes)]
        self.procs: list[subprocess.Popen] = []
        try:
            for i, path in enumerate(self.paths):
                distributed = [
                    f"--coordinator_address={coordinator}", f"--num_processes={processes}",
                    f"--process_id={i}",
                ] if processes > 1 else []  # fmt: skip
                with open(path, "w") as log:
                    self.procs.append(
                        subprocess.Popen(
                            args + distributed,
                            cwd=cwd,
                            env=env,
                            stdout=log,
                            stderr=subprocess.STDOUT,
                        )  # fmt: skip
                    )
        except BaseException:
            self.kill()
            raise

    def kill(self) -> None:
        """Kills the processes of this job that still run (only those)."""
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            p.wait()

    def wait(self, timeout: float = 280) -> Run:
        """Waits for every process; when one fails, the others get a few seconds to fail as
        well (a survivor waits for its peer in a collective) and are then killed, as are all of
        them after `timeout` seconds or if the test is interrupted."""
        try:
            deadline = time.monotonic() + timeout
            failed_at = None
            while any(p.poll() is None for p in self.procs):
                now = time.monotonic()
                if failed_at is None and any(p.poll() not in (None, 0) for p in self.procs):
                    failed_at = now
                if now > deadline or (failed_at is not None and now > failed_at + 10):
                    break
                time.sleep(0.2)
        finally:
            self.kill()
        logs = []
        for path in self.paths:
            with open(path, errors="replace") as f:
                logs.append(f.read())
        return Run(self.workdir, [p.returncode for p in self.procs], logs)


def pretrain_job(
    workdir, overrides, log_dir, *, processes, devices, jax_cache=None, cwd=None
) -> Job:
    """The tiny pretraining config with `overrides` as a `Job` of `devices` CPU devices per
    process (the tests' XLA flags, see the module docstring); run in `cwd` when given (the
    config file then by its absolute path), else in the repository."""
    args, env = tiny_command(
        workdir,
        overrides,
        devices,
        JAX_NUM_CPU_DEVICES=str(devices),
        TF_CPP_MIN_LOG_LEVEL="2",
    )
    if jax_cache:
        env["JAX_COMPILATION_CACHE_DIR"] = jax_cache
        env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    if cwd is None:
        return Job(workdir, args, env, log_dir, processes=processes)
    args = [a.replace("--config=configs/", f"--config={REPO}/configs/") for a in args]
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [REPO, env.get("PYTHONPATH")]))
    return Job(workdir, args, env, log_dir, processes=processes, cwd=cwd)


def _copy_tree(src: epath.Path, dst: epath.Path) -> None:
    """Copies a directory tree file by file (local or gs:// on either side)."""
    for child in src.iterdir():
        if child.is_dir():
            _copy_tree(child, dst / child.name)
        else:
            dst.mkdir(parents=True, exist_ok=True)
            (dst / child.name).write_bytes(child.read_bytes())


@pytest.fixture(scope="module")
def jobs(corpus, tmp_path_factory, gcs):
    """Jobs on the same config, one after the other: 2 processes × 4 devices (`dist`,
    preempted after step 2 and restarted: two jobs in one workdir), 1 process × 8 devices with
    the same 2 data shards (`single`), and 1 process × 8 devices resuming from the 2-process
    checkpoint of step 3 (`resumed`; another workdir, `config.resume_from`). Run side by side,
    they only slowed each other down on 2 cores.

    The 2-process jobs work as on a pod: their workdir, and the checkpoint `resumed` starts
    from, are in Cloud Storage (the local emulator of `gcs`), and they run in an empty local
    directory that must stay empty."""
    root = tmp_path_factory.mktemp("distributed")
    dist_workdir = gcs.url("test_distributed/dist")
    pod_cwd = root / "pod_cwd"  # the 2-process jobs' working directory
    pod_cwd.mkdir()
    base = small_overrides(
        corpus,
        num_train_steps=STEPS,
        checkpoint_every_steps=RESUME_STEP,
        eval_every_steps=STEPS,
        eval_batches=2,
        **MESH,
    )
    jax_cache = str(root / "jax_cache")  # shared by the two 1-process jobs (same programs)
    out = {"base": base}
    jobs: list[Job] = []
    try:
        preempted_logs = root / "preempted"  # the restart writes logs of the same names
        os.makedirs(preempted_logs)
        preempted = {**base, "debug.sigterm_after_step": SIGTERM_AFTER}
        jobs.append(pretrain_job(dist_workdir, preempted, preempted_logs, processes=2, devices=4,
                                 cwd=pod_cwd))  # fmt: skip
        out["preempted"] = jobs[-1].wait()
        if epath.Path(checkpoint_dirs.checkpoint_dir(dist_workdir)).is_dir():
            with checkpointing.Checkpointer(dist_workdir, read_only=True) as ckpt:
                out["preempted_steps"] = ckpt.all_steps()
        jobs.append(pretrain_job(dist_workdir, base, root, processes=2, devices=4, cwd=pod_cwd))
        out["dist"] = jobs[-1].wait()
        out["pod_cwd_files"] = sorted(os.listdir(pod_cwd))
        single_overrides = {**base, "data.num_shards": 2}
        jobs.append(pretrain_job(root / "single", single_overrides, root, processes=1, devices=8,
                                 jax_cache=jax_cache))  # fmt: skip
        out["single"] = jobs[-1].wait()
        # Multi-slice data parallelism on CPU hosts (#59): each process a group, the data
        # axis across the two (config.mesh.slices), fsdp / tensor none: the same batches.
        sliced = {**base, "mesh.data": 8, "mesh.fsdp": 1, "mesh.tensor": 1, "mesh.slices": 2}
        jobs.append(pretrain_job(root / "sliced", sliced, root, processes=2, devices=4))
        out["sliced"] = jobs[-1].wait()
        # The 2-process checkpoint of step 3 alone (the job's latest is the final step 5).
        source = gcs.url("test_distributed/dist_step3")
        saved = epath.Path(checkpoint_dirs.checkpoint_dir(dist_workdir)) / str(RESUME_STEP)
        if saved.is_dir():
            _copy_tree(saved, epath.Path(checkpoint_dirs.checkpoint_dir(source)) / str(RESUME_STEP))
        # No data.num_shards: the run takes the checkpoint's 2 shards, both read by one process.
        resumed_overrides = {**base, "resume_from": source}
        jobs.append(pretrain_job(root / "resumed", resumed_overrides, root, processes=1,
                                 devices=8, jax_cache=jax_cache))  # fmt: skip
        out["resumed"] = jobs[-1].wait()
    finally:
        for job in jobs:
            job.kill()
    return out


# ----------------------------------------------------------------------------------------------
# The jobs


@pytest.mark.timeout(900)
def test_two_processes_equal_one_process_step_by_step(jobs):
    dist, single = jobs["dist"], jobs["single"]
    dist.check()
    single.check()
    assert "process 1/2, 8 devices" in dist.logs[1]
    assert "data: 2 shards, 1 per process" in dist.logs[0]
    assert "data: 2 shards, 2 per process" in single.logs[0]
    losses_dist, losses_single = losses_by_step(dist.workdir), losses_by_step(single.workdir)
    assert sorted(losses_dist) == sorted(losses_single) == list(range(1, STEPS + 1))
    steps = sorted(losses_dist)
    np.testing.assert_allclose(
        [losses_dist[s] for s in steps], [losses_single[s] for s in steps], rtol=1e-5
    )
    assert len(set(losses_dist.values())) == STEPS  # the batches do change from step to step
    # Eval (step 5): process 1's validation shard is empty (Austen's validation split is one
    # chapter), so it ran its 2 steps on padding rows; the sums count real rows only.
    last_dist = metrics_writer.read_metrics(dist.workdir)[-1]
    last_single = metrics_writer.read_metrics(single.workdir)[-1]
    for key in EVAL_KEYS:
        np.testing.assert_allclose(last_dist[key], last_single[key], rtol=1e-5, err_msg=key)
    assert np.isfinite(last_dist["eval_loss"])


@pytest.mark.timeout(900)
def test_data_parallel_across_process_groups_trains_on_the_same_batches(jobs):
    """config.mesh.slices=2 without TPU slices: the data axis spans the two processes as it
    spans slices on a pod (the fallback of mesh_utils' process granules); step by step the
    losses are those of the one-process run on the same global batches."""
    sliced, single = jobs["sliced"], jobs["single"]
    sliced.check()
    assert "the data axis spans 2 process groups of (4, 1, 1)" in sliced.logs[0]
    losses, expected = losses_by_step(sliced.workdir), losses_by_step(single.workdir)
    assert sorted(losses) == sorted(expected) == list(range(1, STEPS + 1))
    np.testing.assert_allclose(
        [losses[s] for s in sorted(losses)], [expected[s] for s in sorted(losses)], rtol=1e-5
    )


@pytest.mark.timeout(900)
def test_preempted_processes_agree_on_a_step_save_it_and_exit(jobs):
    # Step 2 is not a periodic save: process 0's notice alone made both processes save it.
    assert_preempted_together(jobs["preempted"], SIGTERM_AFTER)
    assert jobs["preempted_steps"] == [SIGTERM_AFTER]
    assert f"resumed at step {SIGTERM_AFTER}" in jobs["dist"].logs[0]


@pytest.mark.timeout(900)
def test_only_process_zero_writes_metrics(jobs):
    dist = jobs["dist"]
    dist.check()
    assert_one_writer(dist.workdir, STEPS, jobs=2)  # the preempted job and its restart
    assert all("loss" in r for r in metrics_writer.read_metrics(dist.workdir))  # no other lines
    assert (epath.Path(dist.workdir) / metrics_writer.LEARNING_CURVE_FILE).is_file()
    assert dist.workdir.startswith("gs://")
    assert jobs["pod_cwd_files"] == []  # nothing of the job was written locally
    assert f"step {STEPS}/{STEPS} | loss" in dist.logs[0]
    assert "| loss" not in dist.logs[1]


@pytest.mark.timeout(900)
def test_two_process_checkpoint_restores_exactly_in_one_process(jobs, corpus):
    """The checkpoint of step 3, written by both processes (each its FSDP shards), restored in
    this 1-process test onto another mesh: the values Orbax stores, exactly, and the state the
    1-process job reached at step 3 (up to fp32 reduction order)."""
    jobs["dist"].check()
    jobs["single"].check()
    config = make_config(jobs["base"])
    model = AlbertForPreTraining(model_config_from(config))
    mesh = create_mesh((2, 2, 2))
    with jax.set_mesh(mesh), nn.logical_axis_rules(LOGICAL_AXIS_RULES):
        _, abstract, shardings, _ = model_half.create_train_state(config, model, mesh)
        targets = (
            checkpointing.abstract_like(abstract.params, shardings.params),
            checkpointing.abstract_like(abstract.opt_state, shardings.opt_state),
        )
        with checkpointing.Checkpointer(jobs["dist"].workdir, read_only=True) as ckpt:
            restored = ckpt.restore(RESUME_STEP, *targets)
            stored = ckpt.restore_numpy(RESUME_STEP, "params")
    for leaf, sharding in zip(
        jax.tree.leaves(restored.params), jax.tree.leaves(shardings.params), strict=True
    ):
        assert leaf.sharding == sharding
    assert_trees_equal(jax.device_get(restored.params), stored)
    with checkpointing.Checkpointer(jobs["single"].workdir, read_only=True) as ckpt:
        single = ckpt.restore_numpy(RESUME_STEP, "params")
    for (path, a), b in zip(
        jax.tree.leaves_with_path(stored), jax.tree.leaves(single), strict=True
    ):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7, err_msg=str(path))
    # The pipeline's own state: one per data shard, merged from both processes.
    data = restored.data
    assert (data["step"], data["num_shards"], sorted(data["shards"])) == (
        RESUME_STEP,
        2,
        ["0", "1"],
    )
    assert [s["step"] for s in data["shards"].values()] == [RESUME_STEP, RESUME_STEP]
    assert data["shards"]["0"]["fingerprint"] != data["shards"]["1"]["fingerprint"]


@pytest.mark.timeout(900)
def test_one_process_resumes_the_two_process_run(jobs):
    resumed, dist = jobs["resumed"], jobs["dist"]
    dist.check()
    resumed.check()
    log = resumed.logs[0]
    assert f"resumed at step {RESUME_STEP}" in log
    assert "data: 2 shards, 2 per process" in log  # the checkpoint's shard count, not 1
    assert "recomputing the input position" not in log  # the saved shard states were used
    expected = {s: v for s, v in losses_by_step(dist.workdir).items() if s > RESUME_STEP}
    got = losses_by_step(resumed.workdir)
    assert sorted(got) == sorted(expected) == list(range(RESUME_STEP + 1, STEPS + 1))
    np.testing.assert_allclose([got[s] for s in expected], list(expected.values()), rtol=1e-5)
    last, last_dist = (metrics_writer.read_metrics(w)[-1] for w in (resumed.workdir, dist.workdir))
    for key in EVAL_KEYS:
        np.testing.assert_allclose(last[key], last_dist[key], rtol=1e-5, err_msg=key)
    with (
        checkpointing.Checkpointer(resumed.workdir, read_only=True) as a,
        checkpointing.Checkpointer(dist.workdir, read_only=True) as b,
    ):
        assert a.latest_step() == b.latest_step() == STEPS
        params, params_dist = a.restore_numpy(STEPS), b.restore_numpy(STEPS)
    for (path, x), y in zip(
        jax.tree.leaves_with_path(params), jax.tree.leaves(params_dist), strict=True
    ):
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6, err_msg=str(path))


# ----------------------------------------------------------------------------------------------
# The pieces, in this process: data shards and padded evaluation


@pytest.fixture(scope="module")
def shard_setup(corpus, tmp_path_factory):
    tokenizer = Tokenizer(corpus["tokenizer"])
    sources = sources_from_spec(corpus["sources"], corpus["data_dir"])
    cfg = DataConfig(
        seq_len=32, max_predictions_per_seq=5, batch_size=16, seed=3,
        cache_dir=str(tmp_path_factory.mktemp("shard_cache")),
    )  # fmt: skip
    return cfg, tokenizer, sources


def _assert_same(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].tobytes() == b[k].tobytes(), k


def test_global_batch_does_not_depend_on_the_process_count(shard_setup):
    cfg, tokenizer, sources = shard_setup
    two_shards = dataclasses.replace(cfg, num_shards=2)
    one = pipeline.ShardedIterator(two_shards, tokenizer, sources)  # 1 process, 2 shards
    procs = [  # 2 processes, one shard each (num_shards 0 = one per process)
        pipeline.ShardedIterator(cfg, tokenizer, sources, process_index=p, process_count=2)
        for p in range(2)
    ]
    assert list(one.shards) == [0, 1] and [list(p.shards) for p in procs] == [[0], [1]]
    for _ in range(3):
        batch = next(one)
        parts = [next(p) for p in procs]
        assert parts[0]["input_ids"].shape == (8, 32)
        _assert_same(batch, {k: np.concatenate([p[k] for p in parts]) for k in batch})
    # The shard count, not the process count, decides: one shard gives other batches.
    single_shard = next(pipeline.ShardedIterator(cfg, tokenizer, sources))
    assert single_shard["input_ids"].tobytes() != batch["input_ids"].tobytes()

    # States move between layouts: the 2 processes' shard states merged (what a checkpoint
    # saves) position a 1-process iterator, and the 1-process state positions each process.
    merged = pipeline.merge_states(p.get_state() for p in procs)
    assert merged == one.get_state()
    fresh = pipeline.ShardedIterator(two_shards, tokenizer, sources)
    fresh.set_state(merged)
    assert fresh.get_state() == one.get_state() and fresh.step == 3
    _assert_same(next(fresh), next(one))
    expected = next(one)  # step 4
    for p in range(2):
        moved = pipeline.ShardedIterator(cfg, tokenizer, sources, process_index=p, process_count=2)
        moved.set_state(fresh.get_state())
        _assert_same(next(moved), {k: v[p * 8 : (p + 1) * 8] for k, v in expected.items()})
    with pytest.raises(ValueError, match="data shards"):
        procs[0].set_state(merged | {"num_shards": 4})


def test_shard_count_is_validated(shard_setup):
    cfg, tokenizer, sources = shard_setup
    with pytest.raises(ValueError, match="multiple of process_count=2"):
        pipeline.ShardedIterator(
            dataclasses.replace(cfg, num_shards=3), tokenizer, sources, process_count=2
        )
    with pytest.raises(ValueError, match="batch_size=16 must be a positive multiple"):
        pipeline.ShardedIterator(dataclasses.replace(cfg, num_shards=32), tokenizer, sources)
    config = make_config({"data.num_shards": 3})
    with pytest.raises(ValueError, match="batch_size=32 must be a positive multiple"):
        validate_config(config)


def test_empty_eval_shards_are_padding_that_eval_does_not_count(shard_setup, corpus):
    """2 shards of a one-document validation split: shard 1 holds nothing and yields padding
    rows; both shards yield `num_batches` batches, and whatever padding rows hold, the eval
    sums and the majority baselines count the real rows only."""
    cfg, tokenizer, sources = shard_setup
    evals = pipeline.EvalBatches(
        dataclasses.replace(cfg, num_shards=2), tokenizer, sources, split="validation",
        num_batches=2, process_index=0, process_count=1,
    )  # fmt: skip
    batches = list(evals)
    assert len(batches) == 2 and evals.stats()["padding_shards"] == 1
    b = 8  # rows per shard
    for batch in batches:
        assert batch["input_ids"].shape == (16, 32)
        np.testing.assert_array_equal(batch["example_weight"], [1.0] * b + [0.0] * b)
        assert batch["masked_lm_weights"][:b].sum() > 0
        assert not batch["masked_lm_weights"][b:].any()
        assert (batch["input_mask"][b:].sum(axis=1) == 1).all()  # a lone [CLS]

    config = make_config(small_overrides(corpus))
    model = AlbertForPreTraining(model_config_from(config))
    init = jax.jit(lambda rng: nn.meta.unbox(init_params(model, rng, batch_size=1, seq_len=8)))
    params = init(jax.random.key(0))["params"]
    sentence_order = config.objective != "none"
    eval_step = jax.jit(pretraining_eval.make_eval_step(model, sentence_order=sentence_order))
    padded = jax.device_get(eval_step(params, batches[0]))
    # The padding rows replaced by real-looking rows (the real ones, labels flipped): still
    # weight 0, so nothing changes.
    real = {k: v[:b] for k, v in batches[0].items()}
    disguised = {k: np.concatenate([v[:b], real[k]]) for k, v in batches[0].items()}
    disguised["sentence_order_label"][b:] = 1 - real["sentence_order_label"]
    disguised["masked_lm_weights"][b:] = 0
    disguised["example_weight"][b:] = 0
    same = jax.device_get(eval_step(params, disguised))
    assert padded["sequences"] == same["sequences"] == b
    assert padded["predictions"] == real["masked_lm_weights"].sum()
    for key in padded:
        np.testing.assert_allclose(same[key], padded[key], rtol=1e-6, err_msg=key)
    assert padded["sop_loss"] > 0 and padded["mlm_loss"] > 0
    baselines = pretraining_eval.majority_accuracies(batches, 1000)
    labels = np.concatenate([x["sentence_order_label"][:b] for x in batches])
    assert baselines["eval_sop_majority_accuracy"] == np.bincount(labels).max() / len(labels)
