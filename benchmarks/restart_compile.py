"""A restart's compile time against the first start's, with the persistent compilation cache.

`python benchmarks/restart_compile.py --size=xxlarge --batch=16 --seq_len=512 --json` prints
one JSON line. Two fresh processes, one after the other, compile the pretraining step of
`--size` as a run compiles it (`train_state.jit_step`: the state in its shardings and donated,
the batch split over the mesh) with one persistent cache directory (`compile_cache.use_for_run`,
what every run does by default, in a new temporary directory): the first start compiles and
writes the cache, the second is a restart that reads it. Reported: each start's seconds from
lowering to a loaded executable and the compile seconds and cache hits JAX counts
(`compile_cache.CompileClock`), and the restart's time over the first's.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def start(args: argparse.Namespace) -> dict[str, float]:
    """One start: compile the step with the cache at `args.cache_dir`."""
    import flax.linen as nn
    import jax

    from albert_jax import train_state
    from albert_jax.pretrain.model_half import PretrainingModel, pretraining_batch_shapes
    from albert_jax.pretrain.settings import validate_config
    from albert_jax.run_config import with_fields
    from albert_jax.runtime import compile_cache
    from albert_jax.sharding import LOGICAL_AXIS_RULES, batch_sharding, create_mesh
    from configs import pretrain

    config = with_fields(
        pretrain.get_config(f"size={args.size}"),
        batch_size=args.batch,
        seq_len=args.seq_len,
        **{
            "model.dtype": args.dtype,
            "model.max_position_embeddings": max(args.seq_len, 512),
            # data parallel over this host's devices (xxlarge's preset splits tensors 4 ways)
            "mesh.data": -1,
            "mesh.fsdp": 1,
            "mesh.tensor": 1,
        },
    )
    compile_cache.use_for_run(args.cache_dir, args.cache_dir)
    clock = compile_cache.CompileClock.get()
    layout = validate_config(config, devices=jax.devices(), processes=1)
    mesh = create_mesh(layout.mesh.shape)
    objective = PretrainingModel.from_settings(layout, mesh)
    shapes = pretraining_batch_shapes(args.batch, args.seq_len, config.max_predictions_per_seq)
    with jax.set_mesh(mesh), nn.logical_axis_rules(LOGICAL_AXIS_RULES):
        state_layout = train_state.create_state(objective, mesh, int(config.seed))
        state = jax.tree.map(
            lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
            state_layout.abstract,
            state_layout.shardings,
        )
        batch = {k: jax.ShapeDtypeStruct(s, d, sharding=batch_sharding(mesh))
                 for k, (s, d) in shapes.items()}  # fmt: skip
        step = train_state.jit_step(objective, state_layout, mesh, int(config.seed))
        began = time.perf_counter()
        step.lower(state, batch).compile()
        seconds = time.perf_counter() - began
    return {"seconds": round(seconds, 2), "compile_s": round(clock.seconds, 2),
            "cache_hits": clock.hits, "device": jax.devices()[0].device_kind}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="tiny")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq_len", type=int, default=128)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--cache_dir", default="", help="(a start's own flag: the cache)")
    args = parser.parse_args()
    if args.cache_dir:  # one start, in its own process
        print(json.dumps(start(args)))
        return
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [repo, os.environ.get(
        "PYTHONPATH")]))}  # fmt: skip
    starts = []
    with tempfile.TemporaryDirectory() as cache:
        for _ in range(2):
            command = [sys.executable, os.path.abspath(__file__), f"--size={args.size}",
                       f"--batch={args.batch}", f"--seq_len={args.seq_len}",
                       f"--dtype={args.dtype}", f"--cache_dir={cache}"]  # fmt: skip
            done = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
            if done.returncode:
                sys.exit(f"a start failed:\n{done.stderr[-3000:]}")
            starts.append(json.loads(done.stdout.strip().splitlines()[-1]))
    first, restart = starts
    result = {
        "benchmark": "restart_compile",
        "size": args.size,
        "batch": args.batch,
        "seq_len": args.seq_len,
        "dtype": args.dtype,
        "device": first["device"],
        "first_s": first["seconds"],
        "restart_s": restart["seconds"],
        "restart_over_first": round(restart["seconds"] / first["seconds"], 3),
        "restart_cache_hits": restart["cache_hits"],
        "first_compile_s": first["compile_s"],
        "restart_compile_s": restart["compile_s"],
    }
    print(json.dumps(result) if args.json else result)


if __name__ == "__main__":
    main()
