"""`python -m albert_jax.plan`: the step a TPU pod would run, compiled by the TPU compiler on
any machine, and whether it fits.

    python -m albert_jax.plan --config=configs/pretrain.py:size=xxlarge --tpu=v3-512 --json

It builds what the loop builds for that slice — the objective's model, loss and optimizer, the
state's shardings from the logical-axis rules, the mesh (`config.mesh`, explicit or auto), the
jitted step with the state donated (`train_state.jit_step`) — on abstract inputs
(`jax.ShapeDtypeStruct`s: nothing is allocated), over compile-only devices of the slice
(`tpu_slices`), and compiles it with libtpu. Per device (a TensorCore on v2 / v3, a chip
after): parameters, optimizer state, batch, temporaries and their total against the HBM the
compiler lets a device use, and the verdict: the compiler itself refuses a program that does
not fit (CompileTimeHbmOom, its message kept). Beside it: collectives by kind inside a slice
and across slices with their bytes a step (`hlo_collectives`; with several slices also what
crosses them against a device's share of one gradient copy, `cross_slice_over_gradient`: 1.0
is the least data parallelism can send), the model FLOPs a device and
the time they take at the chip's peak bf16 rate (a lower bound on the step, not a step time),
and the compile time.

`--max_batch` searches, for each remat policy, the largest global batch that fits.
The traced step takes the target's branches (`layers.target_platform()` reads the mesh), so
a CPU machine gets exactly the pod's program.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import math
import os
import re
import time
from typing import Any

import flax.linen as nn
import jax

from albert_jax import train_state
from albert_jax.model import flops as flops_lib
from albert_jax.run_config import with_fields
from albert_jax.sharding import LOGICAL_AXIS_RULES, batch_sharding, shard_bytes, slice_mesh
from albert_jax.tpu import collectives as hlo_collectives
from albert_jax.tpu import slices as tpu_slices

GiB = 2**30
# Least recomputation first: what `--max_batch` and the docs table walk through.
REMAT_ORDER = ("none", "dots", "dots_no_batch", "minimal", "save_attention_out", "full")
_OOM = re.compile(r"RESOURCE_EXHAUSTED|CompileTimeHbmOom|Ran out of memory", re.IGNORECASE)


@dataclasses.dataclass
class Target:
    """What the plan compiles for: `num_slices` slices of `spec`, their devices and hosts."""

    spec: tpu_slices.SliceSpec
    num_slices: int
    devices: list[Any]

    @property
    def processes(self) -> int:
        """Hosts of the job: 4 chips a host (one chip: one host), every slice alike."""
        return max(self.spec.chips // 4, 1) * self.num_slices


def make_target(tpu: str, num_slices: int = 1) -> Target:
    if num_slices < 1:
        raise ValueError(f"--num_slices={num_slices} must be >= 1")
    spec = tpu_slices.slice_spec(tpu)
    return Target(spec, num_slices, tpu_slices.target_devices(spec, num_slices))


# ----------------------------------------------------------------------------------------------
# The objective and batch of a config, as the loop would build them


def _pretraining(config: Any, target: Target) -> tuple[Any, Any, dict[str, Any], float]:
    """(objective, mesh, abstract batch spec {name: (shape, dtype)}, model FLOPs a step)."""
    from albert_jax.pretrain.model_half import PretrainingModel, pretraining_batch_shapes
    from albert_jax.pretrain.settings import validate_config

    settings = validate_config(config, devices=target.devices, processes=target.processes)
    mesh = slice_mesh(settings.mesh.shape, target.devices, target.num_slices)
    model = PretrainingModel.from_settings(settings, mesh)
    data = settings.data
    batch = pretraining_batch_shapes(data.batch_size, data.seq_len, data.max_predictions_per_seq)
    return model, mesh, batch, model.flops_per_step


def _fine_tuning(config: Any, target: Target) -> tuple[Any, Any, dict[str, Any], float]:
    """A fine-tuning config's task model from the config alone: the `size` preset with
    `config.model` (a checkpoint's config is not read), unpacked batches of `batch_size` rows a
    seed at `max_seq_length`, the schedule over `num_train_steps`."""
    from albert_jax.finetune import settings as finetune_config
    from albert_jax.finetune.task_model import TaskModel
    from albert_jax.model.config import ModelConfig
    from albert_jax.run_config import mesh_layout
    from albert_jax.tasks.kinds import get_kind

    task = finetune_config.validate_config(config)
    model_config = finetune_config.model_config(
        config, None, ModelConfig.preset(config.size).vocab_size
    )
    kind = get_kind(task.kind)
    rows = int(config.batch_size) * int(config.num_seeds)
    shapes = mesh_layout(config, model_config, target.devices).shape
    finetune_config.check_batch_split("batch_size", rows, shapes[0] * shapes[1], target.processes)
    mesh = slice_mesh(shapes, target.devices, target.num_slices)
    batch = kind.batch_shapes(rows, int(config.max_seq_length), task)
    model = kind.build_model(model_config, task, config)
    objective = TaskModel.for_plan(config, kind, model, batch, mesh)
    # Sequences of the batch: its rows, times the options of a multiple-choice row [B, C, S].
    *sequences, S = batch["input_ids"][0]
    flops = flops_lib.train_flops_per_step(model_config, math.prod(sequences), S, 0,
                                           last_layer_positions=S)  # fmt: skip
    return objective, mesh, batch, flops


def _refuse_absurd_batch(config: Any) -> None:
    """A step of 2^31 tokens or more is refused before XLA sees it (it aborted inside the
    compiler, SIGABRT and a C++ stack): XLA indexes a batch's positions with 32-bit integers,
    and no slice holds such a step anyway."""
    seq_field = "max_seq_length" if "task" in config else "seq_len"
    rows = int(config.batch_size) * int(config.get("num_seeds", 1) or 1)
    tokens = rows * int(config[seq_field])
    if tokens >= 2**31:
        raise ValueError(
            f"config.batch_size={config.batch_size} x config.{seq_field}={config[seq_field]} "
            f"is {tokens:,} tokens a step, over 2^31: no program of that size can be compiled; "
            "use a smaller batch_size"
        )


def _gib(n: float) -> float:
    return round(n / GiB, 4)


# ----------------------------------------------------------------------------------------------
# The plan


def plan(config: Any, target: Target) -> dict[str, Any]:
    """Compiles `config`'s training step for `target`; the report (see the module docstring).
    A config that cannot be laid out on the slice raises ValueError before compiling."""
    config = config.copy_and_resolve_references()
    _refuse_absurd_batch(config)
    build = _fine_tuning if "task" in config else _pretraining
    objective, mesh, batch_spec, model_flops = build(config, target)
    spec = target.spec
    with jax.set_mesh(mesh), nn.logical_axis_rules(LOGICAL_AXIS_RULES):
        layout = train_state.create_state(objective, mesh, int(config.seed), objective.num_seeds)
        state = jax.tree.map(
            lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
            layout.abstract,
            layout.shardings,
        )
        sharding = batch_sharding(mesh)
        batch = {k: jax.ShapeDtypeStruct(s, d, sharding=sharding) for k, (s, d) in
                 batch_spec.items()}  # fmt: skip
        step = train_state.jit_step(objective, layout, mesh, int(config.seed))
        start = time.perf_counter()
        error, compiled = None, None
        try:
            compiled = step.lower(state, batch).compile()
        except Exception as e:  # the compiler's verdict on memory; anything else is a bug
            if not _OOM.search(str(e)):
                raise
            error = str(e).strip().splitlines()[0] if str(e).strip() else repr(e)
        seconds = time.perf_counter() - start
    devices = target.num_slices * spec.num_devices
    flops_per_device = model_flops / devices
    peak_bound = flops_per_device / spec.peak_bf16_per_device
    report: dict[str, Any] = {
        "tpu": spec.name,
        "num_slices": target.num_slices,
        "topology": spec.topology_name,
        "devices": devices,
        "processes": target.processes,
        "model": config.get("size", ""),
        "global_batch": int(config.batch_size),
        "seq_len": int(config.get("seq_len", config.get("max_seq_length", 0))),
        "dtype": str(config.model.get("dtype") or "float32"),
        "remat_policy": str(config.model.get("remat_policy") or "none"),
        "mesh": dict(zip(mesh.axis_names, (int(n) for n in mesh.devices.shape), strict=True)),
        "mesh_auto": bool(config.mesh.get("auto", False)),
        "hbm_per_device_gib": round(spec.hbm_gib_per_device, 2),
        "usable_hbm_gib": spec.usable_hbm_gib,
        "params_gib": _gib(shard_bytes(state.params)),
        "opt_state_gib": _gib(shard_bytes(state.opt_state)),
        "batch_gib": _gib(shard_bytes(batch)),
        "flops_per_device": flops_per_device,
        "peak_bf16_per_device": spec.peak_bf16_per_device,
        # Model FLOPs at the chip's peak: no step can be faster (not a step-time estimate).
        "peak_bound_s": round(peak_bound, 6),
        "peak_bound_run_h": round(peak_bound * _steps(config) / 3600, 2),
        "compile_s": round(seconds, 1),
        "jax": jax.__version__,
        "libtpu": importlib.metadata.version("libtpu"),
    }
    if compiled is None:
        report.update(fits=False, compiler_accepted=False, error=error,
                      temporaries_gib=_temporaries_of(error), collectives=None)  # fmt: skip
        return report
    stats = compiled.memory_analysis()
    hlo = compiled.as_text()
    total = (stats.argument_size_in_bytes + stats.output_size_in_bytes
             - stats.alias_size_in_bytes + stats.temp_size_in_bytes)  # fmt: skip
    report.update(
        temporaries_gib=_gib(stats.temp_size_in_bytes),
        arguments_gib=_gib(stats.argument_size_in_bytes),
        outputs_not_aliased_gib=_gib(stats.output_size_in_bytes - stats.alias_size_in_bytes),
        code_gib=_gib(stats.generated_code_size_in_bytes),
        total_gib=_gib(total),
        peak_gib=_gib(stats.peak_memory_in_bytes),
        headroom_gib=round(spec.usable_hbm_gib - total / GiB, 4),
        compiler_accepted=True,
        # Conservative: the compiler can accept a program whose buffer total exceeds the
        # usable HBM (its own, undocumented peak estimate being lower); without hardware to
        # settle it, that is reported as not fitting, with `compiler_accepted` true.
        fits=total / GiB <= spec.usable_hbm_gib,
        collectives=hlo_collectives.summarize(hlo),
        compiler_flops_per_device=float((compiled.cost_analysis() or {}).get("flops", 0.0)),
    )
    # One gradient copy in the parameters' precision (float32): what a data-parallel device
    # must reduce at least once a step. Tensor parallelism splits it; FSDP reduce-scatters
    # the whole copy (the input of the reduce-scatter), so it does not.
    gradient = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state.params))
    by_axis = hlo_collectives.reductions_by_axis(
        hlo, tuple(mesh.devices.shape), tuple(mesh.axis_names)
    )
    # Sums over the batch axes are the gradients' (and the loss's scalars); over `tensor`
    # alone, tensor parallelism's partial activations, reported apart.
    reduced = sum(b for axes, b in by_axis.items() if axes not in ("tensor", "none"))
    copy = gradient / report["mesh"]["tensor"]
    report.update(
        gradient_reduction_bytes={"within_slice": round(reduced)},
        # Over 1.0: some gradient is reduced more than once a step (or in a wider dtype).
        gradient_reduction_over_params={"within_slice": round(reduced / copy, 3)},
        tensor_parallel_reduction_bytes=round(by_axis.get("tensor", 0)),
    )
    if target.num_slices > 1:
        # What data parallelism across slices must send at least: each device its share of
        # one gradient copy (the gradients reduce-scattered inside the slice first).
        share = gradient / spec.num_devices  # a slice's devices
        sent = sum(c["bytes"] for c in report["collectives"]["cross_slice"].values())
        report["gradient_reduction_bytes"]["cross_slice"] = round(sent)
        report["gradient_reduction_over_params"]["cross_slice"] = round(sent / share, 3)
        report.update(
            gradient_share_bytes=round(share),
            cross_slice_over_gradient=round(sent / share, 3),
        )
    return report


def options(config: Any, target: Target, report: dict[str, Any]) -> list[str]:
    """What would make a config that does not fit fit, cheapest first, each compiled: the
    least recomputation after the config's (`REMAT_ORDER`) that fits; for pretraining, the
    fewest `config.microbatches` (each pass 1/N of the batch) that fit at the config's remat;
    then a larger slice of the generation, or more slices (not compiled)."""
    config = config.copy_and_resolve_references()
    found = []
    current = str(config.model.get("remat_policy") or "none")
    later = REMAT_ORDER[REMAT_ORDER.index(current) + 1 :] if current in REMAT_ORDER else ()
    for remat in later:
        tried = plan(with_fields(config, **{"model.remat_policy": remat}), target)
        if tried["fits"]:
            found.append(f"--config.model.remat_policy={remat} ({tried['total_gib']:.2f} GiB "
                         "a device)")  # fmt: skip
            break
    if "task" not in config:  # fine-tuning has no gradient accumulation
        mesh = report["mesh"]
        rows = int(config.batch_size) // (mesh["data"] * mesh["fsdp"])
        now = int(config.get("microbatches", 1))
        for n in (2, 4, 8, 16, 32):
            if rows % (now * n):
                break
            tried = plan(with_fields(config, microbatches=now * n), target)
            if tried["fits"]:
                found.append(f"--config.microbatches={now * n} (the same update in {now * n} "
                             f"passes; {tried['total_gib']:.2f} GiB a device)")  # fmt: skip
                break
    spec = target.spec
    larger = [n for n in spec.generation.sizes if n > int(spec.name.rsplit("-", 1)[1])]
    slices = f"--num_slices={target.num_slices * 2}"
    found.append(f"a larger slice ({spec.generation.prefix}-{larger[0]}) or {slices}"
                 if larger else f"{slices}")  # fmt: skip
    return found


def _steps(config: Any) -> int:
    return int(config.get("num_train_steps", 0) or 0)


def _temporaries_of(error: str | None) -> float | None:
    """GiB of HLO temporaries a CompileTimeHbmOom message names (None if it names none)."""
    match = re.search(r"HLO temporaries \(([\d.]+)([KMGT])\)", error or "")
    if not match:
        return None
    scale = {"K": 2**-20, "M": 2**-10, "G": 1.0, "T": 1024.0}[match.group(2)]
    return round(float(match.group(1)) * scale, 4)


def max_batch(config: Any, target: Target, remat: str) -> dict[str, Any]:
    """The largest global batch that fits with `remat`, a multiple of the rows a step splits
    over (data × fsdp × microbatches of the config's mesh). Memory grows about linearly with
    the batch, so each next try is where the line through the last two measured totals (or the
    temporaries an OOM names) meets the usable HBM, kept strictly between the largest batch
    that fits and the smallest that does not: a few compiles, not a bisection's many.
    {"remat", "max_batch" (0: not even one row a device fits), "plan": the report at it}."""
    base = with_fields(config, **{"model.remat_policy": remat})
    _, mesh, _, _ = (_fine_tuning if "task" in base else _pretraining)(base, target)
    unit = int(mesh.shape["data"] * mesh.shape["fsdp"]) * int(base.get("microbatches", 1))
    usable = target.spec.usable_hbm_gib
    points: list[tuple[int, float]] = []  # (rows, GiB needed)
    lo, hi, best = 0, None, None
    rows = unit
    for _ in range(24):
        try:
            report = plan(with_fields(base, batch_size=rows), target)
        except ValueError:  # a batch the layout cannot split: treated as not fitting
            report = {"fits": False, "temporaries_gib": None}
        if report["fits"]:
            lo, best = rows, report
            points.append((rows, report["total_gib"]))
        else:
            hi = rows
            if report.get("temporaries_gib") is not None and best is not None:
                points.append((rows, report["temporaries_gib"] + best["arguments_gib"]))
        if lo == 0 or (hi is not None and hi - lo <= unit):
            break
        if len(points) >= 2 and points[-1][0] != points[-2][0]:
            (r0, m0), (r1, m1) = points[-2], points[-1]
            slope = (m1 - m0) / (r1 - r0)
            guess = r1 + (usable - m1) / slope if slope > 0 else 2 * lo
        else:
            guess = 2 * lo
        rows = int(guess) // unit * unit
        upper = hi - unit if hi is not None else max(rows, lo + unit)
        rows = min(max(rows, lo + unit), upper)
    return {"remat": remat, "max_batch": lo, "plan": best}


# ----------------------------------------------------------------------------------------------
# The command line

_FLAGS_DEFINED = False


def _define_flags() -> None:
    from absl import flags
    from ml_collections import config_flags

    global _FLAGS_DEFINED
    if _FLAGS_DEFINED:
        return
    _FLAGS_DEFINED = True
    config_flags.DEFINE_config_file(
        "config", None, "A pretraining or fine-tuning config file with its arg and overrides."
    )
    flags.DEFINE_string("tpu", None, f"Cloud TPU accelerator type: {tpu_slices.valid_forms()}.")
    flags.DEFINE_integer("num_slices", 1, "Slices joined by data parallelism (multi-slice).")
    flags.DEFINE_bool("json", False, "Print one JSON object.")
    flags.DEFINE_bool("max_batch", False, "Find the largest global batch that fits, per remat.")
    flags.DEFINE_list("remat", list(REMAT_ORDER), "Remat policies --max_batch tries.")
    flags.DEFINE_list(
        "microbatches",
        [],
        "Gradient accumulation passes --max_batch tries with each remat, e.g. 1,2,4 "
        "(pretraining; default: the config's config.microbatches).",
    )
    flags.DEFINE_bool(
        "options",
        True,
        "For a config that does not fit: compile what would "
        "(more remat, microbatches) and name it, with a larger slice.",
    )


def _print_human(report: dict[str, Any]) -> None:
    mesh = ", ".join(f"{k}={v}" for k, v in report["mesh"].items())
    print(f"{report['tpu']} x{report['num_slices']} ({report['devices']} devices, "
          f"{report['processes']} hosts) · {report['model']} batch {report['global_batch']} "
          f"x {report['seq_len']} · {report['dtype']} · remat {report['remat_policy']} · "
          f"mesh {mesh}")  # fmt: skip
    print(f"  per device: params {report['params_gib']:.3f} GiB, optimizer state "
          f"{report['opt_state_gib']:.3f}, batch {report['batch_gib']:.4f}, temporaries "
          f"{report['temporaries_gib']} GiB")  # fmt: skip
    if report["fits"]:
        print(f"  FITS: {report['total_gib']:.2f} GiB of {report['usable_hbm_gib']} usable "
              f"(headroom {report['headroom_gib']:.2f})")  # fmt: skip
        for where, kinds in report["collectives"].items():
            for kind, c in kinds.items():
                print(f"  {where:11s} {kind:15s} {c['count']:5d} a step "
                      f"{c['bytes'] / 2**20:10.1f} MiB")  # fmt: skip
        print(
            f"  gradient reduced within a slice: "
            f"{report['gradient_reduction_over_params']['within_slice']}x one copy a device "
            f"({report['gradient_reduction_bytes']['within_slice'] / 2**20:.1f} MiB a step)"
        )
        if "cross_slice_over_gradient" in report:
            print(
                f"  across slices: {report['cross_slice_over_gradient']}x a device's share "
                f"of one gradient copy ({report['gradient_share_bytes'] / 2**20:.1f} MiB)"
            )
    elif report["compiler_accepted"]:
        print(f"  DOES NOT FIT: {report['total_gib']:.2f} GiB of buffers against "
              f"{report['usable_hbm_gib']} usable, although the compiler accepted the program "
              f"(its peak estimate: {report['peak_gib']:.2f} GiB)")  # fmt: skip
    else:
        print(f"  DOES NOT FIT: {report['error']}")
    for i, option in enumerate(report.get("options", ()), 1):
        print(f"  option {i}: {option}")
    print(
        f"  model FLOPs a device {report['flops_per_device']:.3e}: at the peak bf16 rate "
        f">= {report['peak_bound_s']:.3f} s a step (a lower bound, not a step time), "
        f"{report['peak_bound_run_h']} h for the run; compiled in {report['compile_s']} s"
    )


def main() -> None:
    """The CLI (absl: `--help` lists the flags). Exit status 0: fits; 1: does not fit (the
    compiler's message printed); 2: a config or `--tpu` that cannot be planned (one line
    `error: ...` naming the field; `albert_jax.runtime.cli`)."""
    from albert_jax.runtime import cli

    environment_for_tpu_compile()
    _define_flags()
    # RuntimeError: no libtpu / another version than jax's, or a compile that failed on the
    # config (not for memory: that is the "does not fit" verdict).
    cli.run(_run, error_status=2, expected=(RuntimeError,))


def _run(argv: list[str]) -> int:
    import json

    from absl import flags

    if len(argv) > 1:
        raise ValueError(f"unexpected arguments: {argv[1:]}")
    FLAGS = flags.FLAGS
    if FLAGS.config is None or FLAGS.tpu is None:  # a usage error: status 2, not "no fit"
        raise ValueError("--config and --tpu are required, e.g. --tpu=v4-32")
    target = make_target(FLAGS.tpu, FLAGS.num_slices)
    if FLAGS.max_batch:
        config = FLAGS.config
        if "task" in config and FLAGS.microbatches:
            raise ValueError("--microbatches: fine-tuning has no gradient accumulation")
        counts = [int(m) for m in FLAGS.microbatches] or [int(config.get("microbatches", 1))]
        if "task" not in config:
            configs = {m: with_fields(config, microbatches=m) for m in counts}
        else:
            configs = {1: config}
        rows = [{**max_batch(configs[m], target, r), "microbatches": m}
                for r in FLAGS.remat for m in configs]  # fmt: skip
        out: dict[str, Any] = {"tpu": FLAGS.tpu, "num_slices": FLAGS.num_slices,
                               "max_batch": rows}  # fmt: skip
        fits = any(r["max_batch"] for r in rows)
    else:
        out = plan(FLAGS.config, target)
        fits = out["fits"]
        if not fits and FLAGS.options:
            out["options"] = options(FLAGS.config, target, out)
    if FLAGS.json:
        print(json.dumps(out))
    elif FLAGS.max_batch:
        for r in out["max_batch"]:
            print(f"remat {r['remat']:20s} microbatches {r['microbatches']:3d} "
                  f"max global batch {r['max_batch']}")  # fmt: skip
    else:
        _print_human(out)
    return 0 if fits else 1


def environment_for_tpu_compile() -> None:
    """JAX on the CPU for everything but the compile (also on a TPU VM, whose chips may be
    busy training); set before JAX starts a backend."""
    os.environ.setdefault("JAX_PLATFORMS", "cpu")


if __name__ == "__main__":
    main()
