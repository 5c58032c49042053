"""A restarted run does not compile again (#59): JAX's persistent compilation cache beside the
run, locally and in a gs:// workdir. Two starts of one run (SIGTERM after step 4, then the
restart) in subprocesses without the tests' session cache: the second reads its step from the
workdir's cache."""

from __future__ import annotations

import os
import re
import subprocess

import pytest
from conftest import local_or_gcs_workdir
from test_train import REPO, small_overrides, tiny_command

from albert_jax.runtime import compile_cache

COMPILATION = re.compile(r"compilation: (\d+) programs in ([\d.]+) s \((\d+) read from")


def _start(workdir: str, overrides: dict, env: dict) -> tuple[int, float, int]:
    args, run_env = tiny_command(workdir, overrides, 8, **env)
    # Not the tests' session cache (conftest): the run's own default place.
    run_env.pop("JAX_COMPILATION_CACHE_DIR", None)
    proc = subprocess.run(args, cwd=REPO, env=run_env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    programs, seconds, hits = COMPILATION.search(proc.stderr).groups()
    return int(programs), float(seconds), int(hits)


@pytest.mark.slow
@pytest.mark.parametrize("where", ["local", "gs"])
def test_a_restart_reads_its_step_from_the_persistent_cache(where, corpus, tmp_path, request):
    workdir, env = local_or_gcs_workdir(where, request, tmp_path, "compile_cache")
    overrides = small_overrides(corpus, num_train_steps=8, checkpoint_every_steps=4)
    first = _start(workdir, {**overrides, "debug.sigterm_after_step": 4}, env)
    second = _start(workdir, overrides, env)
    print(f"{where}: first start {first}, restart {second} (programs, seconds, cache hits)")
    assert first[2] == 0 and second[2] >= 1  # the restart's step came from the cache
    assert second[1] <= 0.2 * first[1], (first, second)
    if where == "gs":
        prefix = workdir.split("/", 3)[3] + f"/{compile_cache.CACHE_DIR}/"
        assert request.getfixturevalue("gcs").list(prefix), "no cache entry in the bucket"
    else:
        assert os.listdir(os.path.join(workdir, compile_cache.CACHE_DIR))


def test_the_cache_setting_is_followed(tmp_path):
    """ "none" turns it off; a path is used as given; "" keeps a place chosen before the run
    (the environment's, or an earlier run's in this process: JAX fixes it at the first
    compilation)."""
    import jax

    before = jax.config.jax_compilation_cache_dir
    min_time = jax.config.jax_persistent_cache_min_compile_time_secs
    try:
        assert compile_cache.use_for_run("", str(tmp_path)) == before  # the session's cache
        assert compile_cache.use_for_run(str(tmp_path / "c"), "w") == str(tmp_path / "c")
        assert jax.config.jax_compilation_cache_dir == str(tmp_path / "c")
        assert compile_cache.use_for_run("none", "w") is None
        assert not jax.config.jax_enable_compilation_cache
    finally:
        jax.config.update("jax_enable_compilation_cache", True)
        jax.config.update("jax_compilation_cache_dir", before)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", min_time)
