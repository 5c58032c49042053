"""Ahead-of-time memory plan of one pretraining step, per device, before booking a pod slice.

    python benchmarks/memory_plan.py --config=configs/pretrain.py:size=xxlarge --mesh=1,8,1 --json

Compiles the real train step (`pretrain.model_half.make_train_step`, LAMB, shardings from the
logical-axis rules) for abstract inputs on a mesh of that shape — with virtual CPU devices when
no accelerator is attached, so it runs on a laptop — and reads XLA's buffer assignment:
bytes per device for parameters, optimizer state, the batch, and temporaries (activations kept
for the backward pass plus scratch), for `remat_policy` none, dots (the pretraining default)
and full (or `--remat`). Nothing is allocated. Numbers from the CPU compiler are a close guide,
not a TPU guarantee: the TPU compiler fuses and schedules differently.
"""

from __future__ import annotations

import math
import os
import sys


def _mesh_from_argv(argv: list[str]) -> tuple[int, int, int]:
    for arg in argv:
        if arg.startswith("--mesh="):
            return tuple(int(x) for x in arg.split("=", 1)[1].split(","))  # type: ignore
    return (1, 8, 1)


# `configs/*.py` import `configs.common`: make the repo root importable from any cwd.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# The mesh needs that many devices; on CPU, create them before JAX initializes.
_MESH = _mesh_from_argv(sys.argv)
os.environ.setdefault("JAX_PLATFORMS", "cpu")
if os.environ["JAX_PLATFORMS"] == "cpu":
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "")
        + f" --xla_force_host_platform_device_count={math.prod(_MESH)}"
    )
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import json  # noqa: E402
import time  # noqa: E402
from typing import Any  # noqa: E402

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
from absl import app, flags  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from albert_jax.model.albert import AlbertForPreTraining  # noqa: E402
from albert_jax.model.config import model_config_from  # noqa: E402
from albert_jax.pretrain.model_half import (  # noqa: E402
    create_train_state,
    make_train_step,
    pretraining_batch_shapes,
)
from albert_jax.sharding import (  # noqa: E402
    LOGICAL_AXIS_RULES,
    batch_sharding,
    create_mesh,
    shard_bytes,
)

_CONFIG = config_flags.DEFINE_config_file("config", None, "Pretraining config (get_config).")
flags.DEFINE_string("mesh", "1,8,1", "data,fsdp,tensor mesh shape to plan for.")
_REMAT = flags.DEFINE_list("remat", ["none", "dots", "full"], "remat policies to compare.")
_JSON = flags.DEFINE_bool("json", False, "Print one JSON line.")

GiB = 2**30


def _abstract_batch(config: Any, sharding: jax.sharding.NamedSharding) -> dict[str, Any]:
    shapes = pretraining_batch_shapes(
        config.batch_size, config.seq_len, config.max_predictions_per_seq
    )
    return {k: jax.ShapeDtypeStruct(s, d, sharding=sharding) for k, (s, d) in shapes.items()}


def plan(config: Any, mesh_shape: tuple[int, int, int], remat: str) -> dict[str, Any]:
    """Compiles the step for `remat` and returns per-device bytes by category."""
    config = config.copy_and_resolve_references()
    config.model.remat_policy = remat
    model = AlbertForPreTraining(model_config_from(config))
    mesh = create_mesh(mesh_shape)
    with jax.set_mesh(mesh), nn.logical_axis_rules(LOGICAL_AXIS_RULES):
        tx, abstract, shardings, _ = create_train_state(config, model, mesh)
        state = jax.tree.map(
            lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings
        )
        batch = _abstract_batch(config, batch_sharding(mesh))
        step = jax.jit(
            make_train_step(config, model, tx),
            in_shardings=(shardings, batch_sharding(mesh)),
            out_shardings=(shardings, None),
            donate_argnums=0,
        )
        start = time.perf_counter()
        compiled = step.lower(state, batch).compile()
        seconds = time.perf_counter() - start
    stats = compiled.memory_analysis()
    params = shard_bytes(state.params)
    opt = shard_bytes(state.opt_state)
    temp = int(stats.temp_size_in_bytes)
    return {
        "remat": remat,
        "params_gib": round(params / GiB, 4),
        "opt_state_gib": round(opt / GiB, 4),
        "batch_gib": round(shard_bytes(batch) / GiB, 4),
        "temporaries_gib": round(temp / GiB, 4),
        # Donated state aliases its outputs, so arguments + temporaries is the peak estimate.
        "total_gib": round((stats.argument_size_in_bytes + temp) / GiB, 4),
        "compile_s": round(seconds, 1),
    }


def main(argv: list[str]) -> None:
    del argv
    if _CONFIG.value is None:
        raise app.UsageError("--config is required")
    mesh_shape = _MESH
    if math.prod(mesh_shape) != jax.device_count():
        raise app.UsageError(
            f"--mesh={flags.FLAGS.mesh} needs {math.prod(mesh_shape)} devices; "
            f"{jax.device_count()} are attached"
        )
    config = _CONFIG.value
    rows = [plan(config, mesh_shape, remat) for remat in _REMAT.value]
    result: dict[str, Any] = {
        "benchmark": "memory_plan",
        "size": config.size,
        "mesh": list(mesh_shape),
        "batch_size": config.batch_size,
        "per_device_batch": config.batch_size // (mesh_shape[0] * mesh_shape[1]),
        "seq_len": config.seq_len,
        "backend": jax.default_backend(),
        "plans": rows,
    }
    if len(rows) == 2 and rows[0]["temporaries_gib"] > 0:
        result["temporaries_ratio"] = round(
            rows[1]["temporaries_gib"] / rows[0]["temporaries_gib"], 3
        )
    if _JSON.value:
        print(json.dumps(result))
    else:
        print(json.dumps(result, indent=2))


if __name__ == "__main__":
    app.run(main)
