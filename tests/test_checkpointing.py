"""Orbax checkpoint wrapper: sharded restore, policies, resume order, SIGKILL mid-save, SIGTERM."""

import os
import re
import signal
import subprocess
import sys
import textwrap

import flax.linen as nn
import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from albert_jax import checkpointing
from albert_jax.model.albert import AlbertForPreTraining, init_params
from albert_jax.model.config import ModelConfig
from albert_jax.runtime import checkpoint_dirs, preemption
from albert_jax.sharding import create_mesh

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _tree(seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    return {
        "dense": {"kernel": rng.normal(size=(8, 16)).astype(np.float32)},
        "bias": rng.normal(size=(16,)).astype(np.float32),
    }


def _save_simple(ckpt: checkpointing.Checkpointer, step: int, params, opt_state=None) -> None:
    ckpt.save(
        step,
        params=params,
        opt_state=opt_state if opt_state is not None else {"count": np.int32(step)},
        data={"process_count": 1, "states": [{"step": step}]},
        meta={"model_config": {}, "step": step},
        force=True,
    )


def test_restore_goes_straight_into_new_target_shardings(tmp_path):
    host = _tree()
    save_mesh = create_mesh((2, 2, 2))
    saved = {
        "dense": {
            "kernel": jax.device_put(
                host["dense"]["kernel"], NamedSharding(save_mesh, PartitionSpec("fsdp", "tensor"))
            )
        },
        "bias": jax.device_put(host["bias"], NamedSharding(save_mesh, PartitionSpec())),
    }
    opt_state = {"mu": jax.tree.map(lambda x: x * 2, saved), "count": np.int32(7)}
    with checkpointing.Checkpointer(str(tmp_path), every_steps=10) as ckpt:
        ckpt.save(
            3,
            params=saved,
            opt_state=opt_state,
            data={"process_count": 1, "states": [{"step": 3}]},
            meta={"model_config": {"hidden_size": 8}, "step": 3},
            force=True,
        )

    # Restore onto a different mesh and layout: every leaf must land in the target sharding.
    restore_mesh = create_mesh((8, 1, 1))
    kernel_sharding = NamedSharding(restore_mesh, PartitionSpec("data", None))
    bias_sharding = NamedSharding(restore_mesh, PartitionSpec("data"))
    param_shardings = {"dense": {"kernel": kernel_sharding}, "bias": bias_sharding}
    opt_shardings = {
        "mu": param_shardings,
        "count": NamedSharding(restore_mesh, PartitionSpec()),
    }
    with checkpointing.Checkpointer(str(tmp_path), read_only=True) as ckpt:
        assert ckpt.latest_step() == 3
        restored = ckpt.restore(
            3,
            checkpointing.abstract_like(saved, param_shardings),
            checkpointing.abstract_like(
                {"mu": saved, "count": jax.ShapeDtypeStruct((), np.int32)}, opt_shardings
            ),
        )
    assert restored.step == 3
    assert restored.meta == {"model_config": {"hidden_size": 8}, "step": 3}
    assert restored.data == {"process_count": 1, "states": [{"step": 3}]}
    assert restored.params["dense"]["kernel"].sharding == kernel_sharding
    assert restored.params["bias"].sharding == bias_sharding
    assert restored.opt_state["mu"]["dense"]["kernel"].sharding == kernel_sharding
    np.testing.assert_array_equal(
        np.asarray(restored.params["dense"]["kernel"]), host["dense"]["kernel"]
    )
    np.testing.assert_array_equal(np.asarray(restored.opt_state["mu"]["bias"]), 2 * host["bias"])
    assert int(restored.opt_state["count"]) == 7


def test_interval_policy_and_latest_n(tmp_path):
    with checkpointing.Checkpointer(str(tmp_path), every_steps=2, keep=2) as ckpt:
        assert [ckpt.should_save(s) for s in (1, 2, 3, 4)] == [False, True, False, True]
        for step in (2, 4, 6):
            _save_simple(ckpt, step, _tree(step))
        ckpt.wait()
        assert ckpt.all_steps() == [4, 6]
        # Saving a step that exists is a no-op, not an error (final step == periodic step).
        assert not ckpt.save(
            6, params=_tree(), opt_state={"count": np.int32(0)}, data={}, meta={}, force=True
        )
        np.testing.assert_array_equal(ckpt.restore_numpy(6)["bias"], _tree(6)["bias"])
        assert ckpt.read_json(6, "meta")["step"] == 6


def test_resume_order(tmp_path):
    own, other, empty = (str(tmp_path / d) for d in ("own", "other", "empty"))
    with checkpointing.Checkpointer(other) as ckpt:
        _save_simple(ckpt, 5, _tree())
    # Nothing here: resume_from (full state) wins over init_from (params only).
    plan = checkpointing.plan_resume(own, resume_from=other, init_from="/some/model")
    assert plan == checkpointing.ResumePlan("resume_from", os.path.abspath(other), 5)
    assert checkpointing.plan_resume(own, init_from="/some/model").kind == "init_from"
    assert checkpointing.plan_resume(own) == checkpointing.ResumePlan("scratch")
    # Once this run has its own checkpoint, it always resumes from it.
    with checkpointing.Checkpointer(own) as ckpt:
        _save_simple(ckpt, 2, _tree())
    plan = checkpointing.plan_resume(own, resume_from=other, init_from="/some/model")
    assert plan == checkpointing.ResumePlan("workdir", os.path.abspath(own), 2)
    # A resume_from without checkpoints is a config error, not a silent fresh start.
    os.makedirs(empty)
    with pytest.raises(ValueError, match="config.resume_from"):
        checkpointing.plan_resume(str(tmp_path / "fresh"), resume_from=empty)


_KILLED_DURING_SAVE = textwrap.dedent(
    """
    import os, signal, sys
    import numpy as np
    sys.path.insert(0, {repo!r})
    from albert_jax import checkpointing

    ckpt = checkpointing.Checkpointer({workdir!r}, every_steps=1)
    small = {{"w": np.full((4, 4), 1.0, np.float32)}}
    ckpt.save(1, params=small, opt_state={{"count": np.int32(1)}}, data={{"step": 1}},
              meta={{"step": 1}}, force=True)
    ckpt.wait()
    # ~128 MB: the background write takes far longer than the kill below.
    big = {{"w": np.ones((8192, 4096), np.float32)}}
    ckpt.save(2, params=big, opt_state={{"count": np.int32(2)}}, data={{"step": 2}},
              meta={{"step": 2}}, force=True)
    os.kill(os.getpid(), signal.SIGKILL)
    """
)


def test_sigkill_during_async_save_keeps_previous_checkpoint(tmp_path):
    workdir = str(tmp_path / "run")
    script = _KILLED_DURING_SAVE.format(repo=REPO, workdir=workdir)
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-3000:]

    directory = checkpoint_dirs.checkpoint_dir(workdir)
    leftovers = [d for d in os.listdir(directory) if d.startswith("2") and d != "2"]
    assert "2" not in os.listdir(directory)  # never committed
    assert leftovers, f"the kill should have caught step 2 mid-write: {os.listdir(directory)}"
    with checkpointing.Checkpointer(workdir, read_only=True) as ckpt:
        assert ckpt.latest_step() == 1
        np.testing.assert_array_equal(ckpt.restore_numpy(1)["w"], np.ones((4, 4), np.float32))
    # A restarted (writable) run cleans the half-written step up and can save it again.
    with checkpointing.Checkpointer(workdir, every_steps=1) as ckpt:
        assert ckpt.latest_step() == 1
        _save_simple(ckpt, 2, _tree())
        ckpt.wait()
        assert ckpt.all_steps() == [1, 2]
    assert sorted(os.listdir(directory)) == ["1", "2"]  # the leftover is gone


def test_sigterm_sets_a_flag_and_restores_the_previous_handler():
    previous = signal.getsignal(signal.SIGTERM)
    with preemption.PreemptionSignal() as flag:
        assert not flag.requested
        os.kill(os.getpid(), signal.SIGTERM)  # the process survives: only the flag is set
        assert flag.requested
    assert signal.getsignal(signal.SIGTERM) is previous


def test_layout_is_what_load_pretrained_reads(tmp_path):
    """The contract with albert_jax.pretrained: params / meta items, tokenizer next to them."""
    from albert_jax.pretrained import load_pretrained

    config = ModelConfig(
        vocab_size=64, embedding_size=8, hidden_size=16, num_hidden_layers=2,
        num_attention_heads=2, intermediate_size=32, max_position_embeddings=16,
    )  # fmt: skip
    init = jax.jit(lambda rng: init_params(AlbertForPreTraining(config), rng))  # eager is slow
    params = nn.meta.unbox(init(jax.random.key(0)))["params"]
    with checkpointing.Checkpointer(str(tmp_path)) as ckpt:
        ckpt.save(
            4,
            params=params,
            opt_state={"count": np.int32(4)},
            data={"process_count": 1, "states": []},
            meta={"model_config": config.to_dict(), "step": 4},
            force=True,
        )
    loaded = load_pretrained(str(tmp_path))
    assert loaded.config == config
    assert loaded.step == 4
    flat = jax.tree.leaves_with_path(params)
    loaded_flat = dict(jax.tree.leaves_with_path(loaded.params))
    for path, value in flat:
        np.testing.assert_array_equal(np.asarray(loaded_flat[path]), np.asarray(value))


def test_readers_and_run_seeds(tmp_path):
    """The readers that load_pretrained and fine-tuning inits use, one run of a checkpoint of
    several seeds, and their errors."""
    workdir = str(tmp_path / "run")
    saved = {
        s: {"albert": _tree(s), "classifier": {"kernel": _tree(s)["bias"][:4]}} for s in (3, 5)
    }
    with checkpointing.Checkpointer(workdir) as ckpt:
        for step, params in saved.items():
            _save_simple(ckpt, step, params)
    step_dir = checkpoint_dirs.latest_step_dir(workdir)
    assert step_dir == os.path.join(checkpoint_dirs.checkpoint_dir(workdir), "5")
    for path, step in (
        (step_dir, 5),
        (os.path.join(checkpoint_dirs.checkpoint_dir(workdir), "3"), 3),
    ):
        meta, params = checkpoint_dirs.read_step_dir(path)
        assert meta == {"model_config": {}, "step": step}
        jax.tree.map(np.testing.assert_array_equal, params, saved[step])
    with pytest.raises(ValueError, match="holds no run of seed 1: its meta records no run"):
        checkpoint_dirs.read_step_dir(step_dir, run_seed=1)

    # Seeds 4, 5, 6 in one program: every array [3, ...]; run_seed=5 is the middle one.
    seeds_dir = str(tmp_path / "seeds")
    runs = [_tree(s) for s in (4, 5, 6)]
    with checkpointing.Checkpointer(seeds_dir) as ckpt:
        ckpt.save(
            2, params=jax.tree.map(lambda *x: np.stack(x), *runs), opt_state={"count": 2},
            data={}, meta={"model_config": {}, "step": 2, "config": {"seed": 4, "num_seeds": 3}},
            force=True,
        )  # fmt: skip
    _, params = checkpoint_dirs.read_step_dir(
        checkpoint_dirs.latest_step_dir(seeds_dir), run_seed=5
    )
    jax.tree.map(np.testing.assert_array_equal, params, runs[1])
    with pytest.raises(ValueError, match=r"holds the runs of seeds \[4, 5, 6\] \(num_seeds=3\)"):
        checkpoint_dirs.read_step_dir(checkpoint_dirs.latest_step_dir(seeds_dir))
    with pytest.raises(ValueError, match=r"seeds \[4, 5, 6\] \(no run of seed 7\); pick one"):
        checkpoint_dirs.read_step_dir(checkpoint_dirs.latest_step_dir(seeds_dir), run_seed=7)

    missing = str(tmp_path / "missing")
    with pytest.raises(ValueError, match=re.escape(missing) + " is not a training step dir"):
        checkpoint_dirs.read_step_dir(missing)
    with pytest.raises(ValueError, match=re.escape(missing) + " is not an Orbax checkpoint item"):
        checkpoint_dirs.read_item_numpy(missing)
    with pytest.raises(ValueError, match=re.escape(missing) + " does not exist"):
        checkpoint_dirs.read_json_item(missing)
    with pytest.raises(ValueError, match=re.escape(f"{missing}/checkpoints holds no finished")):
        checkpoint_dirs.latest_step_dir(missing)


def test_saving_replicated_arrays_compiles_nothing(tmp_path, caplog):
    """Arrays replicated over the 8 test devices are written from their replica-0 shards:
    Orbax's replica-parallel default would first jit a slice per array and replica (seconds
    at each process's first save, see checkpointing.py)."""
    mesh = create_mesh((4, 2, 1))
    replicated = NamedSharding(mesh, PartitionSpec())
    fsdp = NamedSharding(mesh, PartitionSpec("fsdp"))
    params = {f"w{i}": jax.device_put(np.full((8, 6 + i), i, np.float32), replicated)
              for i in range(4)}  # fmt: skip
    params["sharded"] = jax.device_put(np.arange(16, dtype=np.float32).reshape(8, 2), fsdp)
    jax.block_until_ready(params)
    with (
        jax.log_compiles(),
        caplog.at_level("DEBUG"),
        checkpointing.Checkpointer(str(tmp_path), every_steps=1) as ckpt,
    ):
        _save_simple(ckpt, 1, params)
        ckpt.wait()
    compiled = [r.getMessage() for r in caplog.records if "XLA compilation" in r.getMessage()]
    assert not compiled, compiled[:3]
    with checkpointing.Checkpointer(str(tmp_path), read_only=True) as ckpt:
        restored = ckpt.restore_numpy(1)
    for name, value in params.items():
        np.testing.assert_array_equal(restored[name], np.asarray(value))


# A real TensorStore write refused by the OS: the process may not grow any file past 1 byte
# (SIGXFSZ ignored, so the write fails with EFBIG), as a full disk refuses with ENOSPC. Opening
# a zarr array on OCDBT fails at its first write, with TensorStore's JSON spec of the array
# appended to the message after the OS's reason.
_REFUSED_WRITE = """
import resource, signal, sys
import tensorstore as ts
from albert_jax.checkpointing import describe_error
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (1, 1))
metadata = {"shape": [2], "chunks": [2], "dtype": "<f4", "compressor": {"id": "zstd", "level": 1}}
kvstore = {"driver": "ocdbt", "base": "file://" + sys.argv[1]}
try:
    ts.open({"driver": "zarr", "kvstore": kvstore, "metadata": metadata, "create": True}).result()
except Exception as error:  # stdout is a pipe, which the file-size limit does not cover
    print(repr(str(error)))
    print(describe_error(error))
"""


def test_a_refused_write_is_summed_up_with_the_os_reason(tmp_path):
    # A deep directory (as a pytest tmp_path under a checkpoint's step dir is), so the summary
    # is cut to its start and end.
    directory = tmp_path / ("deep_directory_" * 8) / "checkpoints" / "12" / "opt_state"
    proc = subprocess.run(
        [sys.executable, "-c", _REFUSED_WRITE, str(directory)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    full, summary = proc.stdout.strip().splitlines()[-2:]
    assert "File too large" in full and "tensorstore_spec=" in full  # the payload follows
    assert len(summary) <= 400 and " ... " in summary, summary
    assert summary.startswith('ValueError: OUT_OF_RANGE: Error opening "zarr" driver')
    assert summary.endswith("File too large [os_error_code='27']"), summary


def test_importing_and_loading_leave_orbax_as_it_was(tmp_path):
    """`from albert_jax import load_pretrained` and a load keep Orbax's process-wide array
    handler (a user's own checkpoints still save replica-parallel); a training run's first
    Checkpointer sets it."""
    code = textwrap.dedent(
        f"""
        import jax, numpy as np, orbax.checkpoint as ocp
        from albert_jax import load_pretrained
        from albert_jax.checkpointing import Checkpointer
        from albert_jax.model.albert import AlbertForPreTraining, init_params
        from albert_jax.model.config import ModelConfig
        from albert_jax.pretrained import save_model_dir
        parallel = lambda: ocp.type_handlers.get_type_handler(jax.Array)._use_replica_parallel
        config = ModelConfig.preset("tiny")
        variables = init_params(AlbertForPreTraining(config), jax.random.key(0))
        save_model_dir({str(tmp_path / "m")!r}, jax.tree.map(np.asarray, variables), config)
        load_pretrained({str(tmp_path / "m")!r})
        print(parallel())
        Checkpointer({str(tmp_path / "run")!r})
        print(parallel())
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["True", "False"]
