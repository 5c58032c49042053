"""process_setup's host-memory setting, in fresh processes (it must run before JAX starts)."""

import json
import os
import subprocess
import sys

import pytest
from conftest import REPO

from albert_jax.runtime import process_setup

# A jitted function whose one temporary (the 5000 x 5000 float32 product, 100 MB, over glibc's
# 64 MiB arena heaps) outlives no call: XLA:CPU allocates it per call and frees it after.
# argv[1]: "keep" / "default" (the setting or not), or a config: `albert_jax.main.run()` on it,
# as `python -m albert_jax.main` runs it, stopped where its run would start JAX (what it set up
# by then stays), with the setting's calls recorded.
PROBE = """
import json, resource, sys
from albert_jax.runtime import process_setup
if sys.argv[1] in ("keep", "default"):
    kept = process_setup.keep_freed_host_memory() if sys.argv[1] == "keep" else False
else:
    from albert_jax import main
    calls, setting = [], process_setup.keep_freed_host_memory
    process_setup.keep_freed_host_memory = lambda: calls.append(setting()) or calls[-1]
    class Started(BaseException):  # not an error: albert_jax.runtime.cli would end the process
        pass
    def start():  # main's first step towards JAX
        raise Started
    main.initialize_distributed = start
    sys.argv = ["main", "--config=" + sys.argv[1], "--workdir=unused"]
    try:
        main.run()
    except Started:
        pass
    kept = any(calls)
import jax, jax.numpy as jnp
f = jax.jit(lambda x, w, v: jnp.sin(x @ w) @ v)
x, w, v = jnp.ones((5000, 8)), jnp.ones((8, 5000)), jnp.ones((5000, 1))
faults = []
for _ in range(12):
    start = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    f(x, w, v).block_until_ready()
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - start)
print(json.dumps({"kept": kept, "faults": faults}))
"""


def probe(mode: str) -> dict:
    env = {**os.environ, "PYTHONPATH": REPO, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""}  # 1 device
    out = subprocess.run(
        [sys.executable, "-c", PROBE, mode],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(process_setup.glibc() is None, reason="glibc's malloc only")
def test_freed_host_memory_serves_the_next_call():
    """Without the setting each call faults the 100 MB temporary in again (~24k pages); with
    it, most later calls reuse the heap's pages."""
    default, kept = probe("default"), probe("keep")
    assert not default["kept"] and kept["kept"]
    assert min(default["faults"][1:]) > 20_000, default
    # The heap grows over the first calls and, on a loaded machine, again now and then (by the
    # order of the frees), so: many later calls fault nothing (without the setting: none).
    assert sum(f < 2_000 for f in kept["faults"][1:]) >= 5, kept


@pytest.mark.skipif(process_setup.glibc() is None, reason="glibc's malloc only")
def test_main_keeps_freed_memory_for_fine_tuning_only():
    """`albert_jax.main` sets the process up after parsing its flags: a fine-tuning config
    gets the setting before JAX starts (its calls reuse the heap's pages), pretraining does
    not get it at all."""
    finetune = probe("configs/finetune.py:task=sentiment_rt,init=")
    assert finetune["kept"], finetune
    assert sum(f < 2_000 for f in finetune["faults"][1:]) >= 5, finetune
    pretrain = probe("configs/pretrain.py:size=tiny")
    assert not pretrain["kept"] and min(pretrain["faults"][1:]) > 20_000, pretrain


def test_cpu_only_follows_jax_platforms(monkeypatch):
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    assert process_setup.jax_has_cpu_only()
    monkeypatch.setenv("JAX_PLATFORMS", "tpu,cpu")
    assert not process_setup.jax_has_cpu_only()
    assert not process_setup.keep_freed_host_memory()  # an accelerator host: left as it is


def test_several_cpu_devices_are_left_as_they_are(monkeypatch):
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    assert process_setup.cpu_device_count() == 8
    assert not process_setup.keep_freed_host_memory()
    monkeypatch.setenv("JAX_NUM_CPU_DEVICES", "1")
    assert process_setup.cpu_device_count() == 1


def test_libtpu_without_a_tpu_chip_leaves_cpu_runs_on_the_cpu(monkeypatch):
    """The [tpu] extra on a CPU machine (for `albert_jax.plan`) changes nothing for its CPU
    runs: still CPU-only (the host-memory setting applies), and JAX is not sent to try a TPU."""
    import glob
    import importlib.util

    if importlib.util.find_spec("libtpu") is None or glob.glob("/dev/accel*"):
        pytest.skip("needs libtpu installed on a host without TPU chips")
    monkeypatch.delenv("JAX_PLATFORMS", raising=False)
    monkeypatch.delenv("TPU_LIBRARY_PATH", raising=False)
    assert not process_setup.tpu_runtime_usable()
    assert process_setup.jax_has_cpu_only()
    process_setup.skip_absent_tpu()
    assert os.environ["JAX_PLATFORMS"] == "cpu"
