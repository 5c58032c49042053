"""One run per workdir (#58 case 1): the lease, locally and on the gs:// emulator.

Two real pretraining processes on one workdir: the second is refused at once, naming the
first, and the first finishes with only its own checkpoints, metrics and config. The lease's
own rules (release, a dead holder, a stale or stolen lease, a missing bucket) are tested on
the lease with real processes holding it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from conftest import local_or_gcs_workdir
from test_train import REPO, small_overrides, tiny_command

from albert_jax import checkpointing, files, metrics_writer
from albert_jax.runtime import workdir_lease

# A process that takes the lease of argv[1], says so, and waits (to be killed).
HOLDER = textwrap.dedent(
    """
    import sys, time
    from albert_jax.runtime import workdir_lease
    lease = workdir_lease.acquire(sys.argv[1])
    print("held", flush=True)
    time.sleep(600)
    """
)


def _holder(workdir: str, env: dict | None = None) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, workdir],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    line = proc.stdout.readline()
    assert line.strip() == "held", proc.stderr.read()
    return proc


def _kill(proc: subprocess.Popen) -> None:
    proc.kill()
    proc.wait(timeout=30)


@pytest.fixture(params=["local", "gs"])
def workdir(request, tmp_path):
    if request.param == "local":
        return str(tmp_path / "run")
    gcs = request.getfixturevalue("gcs")
    return gcs.url(f"lease/{request.node.name}/{time.monotonic_ns()}")


def test_a_held_workdir_is_refused_naming_the_holder_then_released(workdir):
    holder = _holder(workdir)
    try:
        with pytest.raises(workdir_lease.WorkdirInUseError) as refused:
            workdir_lease.acquire(workdir)
        assert f"in use by pid {holder.pid} on " in str(refused.value)
        assert workdir in str(refused.value)
    finally:
        holder.terminate()
        holder.wait(timeout=30)
    # A process that ends lets the next run in: the kernel drops a lock; a gs:// lease of a
    # dead process on this host is taken over without waiting for it to go stale.
    lease = workdir_lease.acquire(workdir)
    lease.release()
    workdir_lease.acquire(workdir).release()  # released means free again


def test_a_killed_holder_does_not_block_the_next_run(workdir):
    _kill(_holder(workdir))
    workdir_lease.acquire(workdir).release()


def test_a_stale_gcs_lease_is_taken_over_and_its_old_holder_stops(gcs):
    workdir = gcs.url(f"lease/stale/{time.monotonic_ns()}")
    first = workdir_lease.acquire(workdir, renew_every_s=0.2, stale_after_s=1.0)
    first.check()
    # Alive and renewing: a second run is refused, and told when a dead one would go stale.
    with pytest.raises(workdir_lease.WorkdirInUseError, match="taken over automatically"):
        workdir_lease.acquire(workdir, stale_after_s=1.0)
    first._stop.set()  # its renewals stop (a run hung, or cut off from the bucket)
    first._thread.join()
    time.sleep(1.5)
    second = workdir_lease.acquire(workdir, renew_every_s=0.2, stale_after_s=1.0)
    # The first run's next renewal finds the lease rewritten by another run: it stops.
    first.renew()
    with pytest.raises(workdir_lease.WorkdirInUseError, match="was taken over by pid"):
        first.check()
    first.release()
    second.check()
    second.release()


def test_a_gcs_lease_taken_over_is_noticed_by_its_holder(gcs):
    workdir = gcs.url(f"lease/stolen/{time.monotonic_ns()}")
    first = workdir_lease.acquire(workdir, renew_every_s=0.2)
    lease_object = f"lease/stolen/{workdir.rsplit('/', 1)[1]}/{workdir_lease.LEASE_FILE}"
    gcs.delete(lease_object)  # what the refusal says to do about a dead run, done wrongly
    second = workdir_lease.acquire(workdir)
    deadline = time.monotonic() + 10
    while first._lost is None and time.monotonic() < deadline:
        time.sleep(0.1)
    with pytest.raises(workdir_lease.WorkdirInUseError, match="was taken over by pid"):
        first.check()
    first.release()  # must not delete the new holder's lease
    assert gcs.exists(lease_object)
    second.release()
    assert not gcs.exists(lease_object)


def _pretraining(corpus, workdir, env, **extra):
    overrides = small_overrides(corpus, num_train_steps=100_000, checkpoint_every_steps=4, **extra)
    args, run_env = tiny_command(workdir, overrides, 8, **env)
    return args, run_env


@pytest.mark.slow
@pytest.mark.parametrize("where", ["local", "gs"])
def test_two_runs_on_one_workdir(where, corpus, tmp_path, request):
    """The probe's case: the same command twice (seeds 0 and 1) on one workdir. The second
    exits at once naming the first; the first trains on, saves when stopped and keeps only
    its own checkpoints, metrics and config."""
    workdir, env = local_or_gcs_workdir(where, request, tmp_path, "lease/two_runs")
    env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    args, run_env = _pretraining(corpus, workdir, env, seed=0)
    first = subprocess.Popen(args, cwd=REPO, env=run_env, stderr=subprocess.PIPE, text=True)
    try:
        # Training has started when the first metrics line is there.
        deadline = time.monotonic() + 300
        while not metrics_writer.read_metrics(workdir):
            assert first.poll() is None, first.stderr.read()[-3000:]
            assert time.monotonic() < deadline, "the first run did not start training"
            time.sleep(0.5)
        args, run_env = _pretraining(corpus, workdir, env, seed=1)
        started = time.monotonic()
        second = subprocess.run(
            args, cwd=REPO, env=run_env, capture_output=True, text=True, timeout=120
        )
        assert second.returncode != 0
        assert f"is in use by pid {first.pid} on " in second.stderr, second.stderr[-3000:]
        assert time.monotonic() - started < 60  # refused at once, not after building anything
        assert first.poll() is None  # the first run goes on
    finally:
        first.send_signal(signal.SIGTERM)  # a preemption: it saves at a step boundary
        _, err = first.communicate(timeout=300)
    assert first.returncode == 0, err[-3000:]
    run_config = files.read_json(files.as_path(workdir) / "config.json")
    assert run_config["seed"] == 0
    steps = [r["step"] for r in metrics_writer.read_metrics(workdir)]
    assert steps == list(range(1, len(steps) + 1))  # one run's lines, in order, once each
    with checkpointing.Checkpointer(workdir, read_only=True) as ckpt:
        assert ckpt.latest_step() >= steps[-1] - 1
    if where == "local":  # released: a lock nobody holds; on gs:// the lease object is gone
        workdir_lease.acquire(workdir).release()
    else:
        lease_object = workdir.split("/", 3)[3] + "/" + workdir_lease.LEASE_FILE
        assert not request.getfixturevalue("gcs").exists(lease_object)


def test_a_missing_bucket_is_an_error_at_start_naming_it(gcs, corpus):
    """#58 case 8: this used to hang for ever (TF's recursive mkdir retrying)."""
    args, env = tiny_command("gs://no-such-bucket-albert/run", small_overrides(corpus), 1)
    proc = subprocess.run(
        args, cwd=REPO, env={**env, **gcs.env}, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode != 0
    assert "bucket gs://no-such-bucket-albert does not exist" in proc.stderr, proc.stderr[-3000:]
    assert not os.path.exists("gs:")


@pytest.mark.parametrize("where", ["local", "gs"])
def test_a_refused_run_leaves_the_workdir_as_found(where, corpus, tmp_path, request):
    """#66 case 6: a run refused before its first step (here a vocab_size its tokenizer does
    not have, refused after the compilation cache, the lease and the tokenizer were set up)
    used to leave run.lease, compilation_cache/ and tokenizer.model behind. A new workdir is
    gone again; one that held files holds just those."""
    workdir, env = local_or_gcs_workdir(where, request, tmp_path, "lease/refused")
    gcs = request.getfixturevalue("gcs") if where == "gs" else None

    def contents() -> set[str]:
        if gcs is not None:
            prefix = workdir.split("/", 3)[3] + "/"
            return {name[len(prefix) :] for name in gcs.list(prefix)}
        if not os.path.isdir(workdir):
            return set()
        return {
            os.path.relpath(os.path.join(d, n), workdir)
            for d, subdirs, names in os.walk(workdir) for n in (*subdirs, *names)
        }  # fmt: skip

    def refused_run() -> None:
        overrides = small_overrides(corpus, **{"model.vocab_size": 1200})
        args, run_env = tiny_command(workdir, overrides, 1, **env)
        proc = subprocess.run(args, cwd=REPO, env=run_env, capture_output=True, text=True)
        assert proc.returncode != 0
        last = proc.stderr.strip().splitlines()[-1]
        assert last.startswith("error: config.model.vocab_size=1200 but the tokenizer"), last

    refused_run()
    assert contents() == set()
    if where == "local":
        assert not os.path.exists(workdir)
    notes = files.as_path(workdir) / "notes.txt"
    if where == "local":
        notes.parent.mkdir(parents=True)
    notes.write_text("kept")
    refused_run()
    assert contents() == {"notes.txt"}
    assert notes.read_text() == "kept"
    # A lease taken after the removal is a real lock again.
    workdir_lease.acquire(workdir).release()


def _short_error(proc: subprocess.CompletedProcess) -> str:
    """The last line of a refused run's stderr, checked to be its only error output."""
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) <= 6, proc.stderr  # the run's header, then the error
    return lines[-1]


def test_gs_without_credentials_is_one_line_with_the_fix(gcs, corpus):
    """#66 case 8: a 38-line DefaultCredentialsError traceback. The emulator stands in for
    Cloud Storage; without STORAGE_EMULATOR_HOST the storage client looks for credentials, and
    this environment has none (an empty gcloud config, no metadata server)."""
    args, env = tiny_command(gcs.url("nocred/run"), small_overrides(corpus), 1)
    env = {**env, **gcs.env}
    env.pop("STORAGE_EMULATOR_HOST")
    proc = subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    last = _short_error(proc)
    assert last.startswith("error: no Google Cloud credentials to reach gs://"), last
    assert "gcloud auth application-default login" in last


def test_an_init_in_a_missing_bucket_is_one_line_naming_it(gcs, shared_data, tmp_path):
    """#66 case 8: fine-tuning from `init=` in a bucket that does not exist ended in a 51-line
    TensorFlow NotFoundError traceback."""
    from conftest import main_command

    tasks = os.path.join(shared_data, "tasks", "sentiment_rt")
    init = "gs://no-such-bucket-albert/pretrained"
    args, env = main_command(
        f"configs/finetune.py:task=sentiment_rt,init={init}", tmp_path / "run",
        {"data.train_files": f"{tasks}/train.jsonl.gz", "data.eval_files": f"{tasks}/dev.jsonl.gz"},
        1,
    )  # fmt: skip
    proc = subprocess.run(
        args, cwd=REPO, env={**env, **gcs.env}, capture_output=True, text=True, timeout=120
    )
    last = _short_error(proc)
    assert last.startswith("error: gs://no-such-bucket-albert/"), last
    assert "the bucket gs://no-such-bucket-albert does not exist" in last
    assert not (tmp_path / "run").exists()  # refused before its first step: nothing left
