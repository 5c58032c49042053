"""What every run reads from its config, once, beyond its own checks: the loop's section
(`LoopSettings`), the mesh's (`MeshSettings`: `config.mesh` over the devices), the fields a
config may have, copies with fields set, and WORKDIR/config.json.

`pretrain.settings` and `finetune.settings` validate a config and return these frozen sections
with their own; the loop and the objectives read the sections, never the config again.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from absl import logging

from albert_jax import files, sharding
from albert_jax.model.config import ModelConfig
from albert_jax.runtime.preemption import DebugHooks

RUN_CONFIG_FILE = "config.json"


def config_field(config: Any, dotted: str, default: Any = None) -> Any:
    """`config.<dotted>` (`"mesh.auto"`), or `default` where a part is missing or it is None."""
    node = config
    for part in dotted.split("."):
        try:
            node = node[part]
        except (KeyError, TypeError, AttributeError):
            return default
    return default if node is None else node


def with_fields(config: Any, **fields: Any) -> Any:
    """A copy of `config` with dotted fields set (`**{"model.remat_policy": "full"}`)."""
    config = config.copy_and_resolve_references()
    with config.unlocked():
        for dotted, value in fields.items():
            node = config
            *parents, last = dotted.split(".")
            for part in parents:
                node = node[part]
            node[last] = value
    return config


def check_known_fields(config: Any, reference: Any, skip: Sequence[str] = ("model",)) -> None:
    """Refuses every field of `config` that `reference` does not have, section by section.

    `reference` is the config its file builds (`configs/pretrain.py`, `configs/finetune.py`):
    the config files are the list of the fields a run reads, so a field outside it is a typo
    or a field nothing reads. `lock_config` refuses those on the command line; this check
    covers configs built or unlocked in code. `skip` names sections checked elsewhere
    (`model`: against `ModelConfig`'s fields, of which the config files set only some).

    Raises:
      ValueError: naming the unknown fields (`config.data.tokeniser`) and the known fields of
        their section.
    """
    _check_section(config, reference, "config", {f"config.{name}" for name in skip})


def _check_section(node: Any, reference: Any, where: str, skip: set[str]) -> None:
    names, known = keys_of(node), keys_of(reference)
    unknown = sorted(set(names) - set(known))
    if unknown:
        raise ValueError(
            f"unknown field(s) {[f'{where}.{k}' for k in unknown]}; known fields of {where}: "
            f"{sorted(known)}"
        )
    for name in known:
        section = f"{where}.{name}"
        if name in names and section not in skip and hasattr(reference[name], "keys"):
            _check_section(node[name], reference[name], section, skip)


def keys_of(node: Any) -> list[str]:
    """The field names of a config section (none of a leaf value)."""
    return list(node.keys()) if hasattr(node, "keys") else []


@dataclasses.dataclass(frozen=True)
class LoopSettings:
    """What `loop.Loop` reads of a run's config (`loop_settings`)."""

    seed: int
    log_every_steps: int
    checkpoint_every_steps: int  # 0: only the final and preemption saves
    keep_checkpoints: int
    eval_every_steps: int  # 0: only as the objective's `final_eval` says
    resume_from: str  # another run's workdir to continue ("" none; pretraining only)
    init_from: str  # a checkpoint whose params start a fresh run ("" none; pretraining only)
    resume_strict: bool  # an unreadable latest checkpoint stops the run (else: the one before)
    compilation_cache_dir: str  # "" WORKDIR/compilation_cache, a path, or "none"
    tokenizer: str  # config.data.tokenizer, named when a resume finds another vocabulary
    debug: DebugHooks  # what the tests do to a run (config.debug.*)
    config_json: str  # the whole config: WORKDIR/config.json and every checkpoint's meta


def loop_settings(config: Any) -> LoopSettings:
    """The loop's section of a pretraining or fine-tuning config (fields a kind of run does
    not have read as their "none")."""
    debug = {f.name: int(config_field(config, f"debug.{f.name}", 0))
             for f in dataclasses.fields(DebugHooks)}  # fmt: skip
    return LoopSettings(
        seed=int(config.seed),
        log_every_steps=int(config.log_every_steps),
        checkpoint_every_steps=int(config.checkpoint_every_steps),
        keep_checkpoints=int(config.keep_checkpoints),
        eval_every_steps=int(config.eval_every_steps),
        resume_from=str(config_field(config, "resume_from", "")),
        init_from=str(config_field(config, "init_from", "")),
        resume_strict=bool(config_field(config, "resume_strict", False)),
        compilation_cache_dir=str(config_field(config, "compilation_cache_dir", "")),
        tokenizer=str(config_field(config, "data.tokenizer", "")),
        debug=DebugHooks(**debug),
        config_json=config.to_json_best_effort(indent=2, sort_keys=True),
    )


@dataclasses.dataclass(frozen=True)
class MeshSettings:
    """The mesh of a run (`mesh_layout`): its (data, fsdp, tensor) shape over `devices`, the
    number of slices it spans (0: as the devices say) and the dtype of the gradient
    reduction."""

    shape: tuple[int, int, int]
    devices: tuple[Any, ...]
    slices: int = 0
    gradient_reduction_dtype: str = "float32"

    def create(self) -> Any:
        """The `jax.sharding.Mesh`."""
        return sharding.create_mesh(self.shape, devices=self.devices, slices=self.slices)


def mesh_layout(
    config: Any,
    model_config: ModelConfig | None = None,
    devices: Sequence[Any] | None = None,
) -> MeshSettings:
    """The mesh of `config.mesh` over `devices` (default: every device of the job): the
    explicit (data, fsdp, tensor) sizes, or with `config.mesh.auto` the layout
    `sharding.choose_mesh_shape` picks for `model_config` and the batch (logged).

    Raises:
      ValueError: naming `config.mesh` and the device count when the shape does not cover
        every device (a smaller mesh would leave devices idle while the log and MFU count
        them all), or a parameter dimension and mesh axis that do not divide.
    """
    devices = tuple(jax.devices() if devices is None else devices)
    # Every field first: what follows is the layout's arithmetic, the config no longer read.
    mesh = config_field(config, "mesh", {})
    reduce_dtype = config_field(mesh, "gradient_reduction_dtype", "float32")
    slices, auto = int(config_field(mesh, "slices", 0)), bool(config_field(mesh, "auto", False))
    shape = tuple(int(config_field(mesh, axis, 1)) for axis in ("data", "fsdp", "tensor"))
    batch, micro = config_field(config, "batch_size", 1), config_field(config, "microbatches", 1)
    rows = int(batch) // int(micro)
    if reduce_dtype not in sharding.REDUCTION_DTYPES:
        raise ValueError(
            f"config.mesh.gradient_reduction_dtype={reduce_dtype!r} must be one of "
            f"{sharding.REDUCTION_DTYPES}"
        )
    if auto and model_config is None:
        raise ValueError("config.mesh.auto=True needs the model config to choose a layout")
    params = None if model_config is None else model_param_axes(model_config)
    if auto:
        assert model_config is not None and params is not None
        resolved, why = sharding.choose_mesh_shape(
            params,
            len(devices),
            rows,
            state_bytes_per_param=4 * jnp.dtype(model_config.param_dtype).itemsize,
            hbm_bytes=device_hbm_bytes(devices[0]),
        )
        logging.info("%s", why)
        return MeshSettings(resolved, devices, slices, reduce_dtype)
    try:
        resolved = sharding.resolve_mesh_shape(shape, len(devices))
    except ValueError as e:
        raise ValueError(
            f"config.mesh (data, fsdp, tensor)={shape} does not fit the {len(devices)} devices "
            f"of this job ({e}); every device must be in the mesh: set one axis to -1 to fill "
            "it, e.g. --config.mesh.data=-1, or --config.mesh.auto=True"
        ) from None
    problems = [] if params is None else sharding.unshardable(params, resolved)
    if problems:
        raise ValueError(
            f"config.mesh (data, fsdp, tensor)={resolved} cannot shard the model: "
            f"{problems[0]}" + (f" (and {len(problems) - 1} more)" if len(problems) > 1
                                else "") + "; choose sizes that divide it or set "
            "--config.mesh.auto=True"
        )  # fmt: skip
    return MeshSettings(resolved, devices, slices, reduce_dtype)  # type: ignore[arg-type]


def run_sections(
    config: Any, model_config: ModelConfig | None = None, devices: Sequence[Any] | None = None
) -> tuple[MeshSettings, LoopSettings]:
    """The sections every run has: its mesh (`mesh_layout`) and its loop's (`loop_settings`)."""
    loop = loop_settings(config)
    return mesh_layout(config, model_config, devices), loop


def model_param_axes(model_config: ModelConfig) -> sharding.ParamAxes:
    """(shape, logical axes) of every parameter of the pretraining model (abstract: nothing
    is allocated); what mesh layouts are checked against."""
    from albert_jax.model.albert import AlbertForPreTraining, init_params

    model = AlbertForPreTraining(model_config)
    boxed = jax.eval_shape(lambda: init_params(model, jax.random.key(0))["params"])
    return sharding.param_axes(boxed)


def device_hbm_bytes(device: Any) -> float | None:
    """Memory one accelerator device may use (its runtime's `bytes_limit`); for a TPU whose
    runtime does not say (the compile-only devices of `albert_jax.plan`), what the TPU compiler
    allows its generation (`tpu.slices`), so that a plan's auto mesh is the pod's. None on a
    CPU or where neither is known."""
    if device.platform == "cpu":
        return None
    try:
        stats = device.memory_stats()
    except Exception:  # compile-only devices and some runtimes have none
        stats = None
    if stats and "bytes_limit" in stats:
        return float(stats["bytes_limit"])
    if device.platform == "tpu":
        from albert_jax.tpu.slices import usable_hbm_bytes

        return usable_hbm_bytes(str(getattr(device, "device_kind", "")))
    return None


def write_run_config(config: Any, workdir: str) -> None:
    """WORKDIR/config.json: the run's whole config (a config, or its `config_json`; process 0;
    local or gs://)."""
    if jax.process_index() == 0:
        if not isinstance(config, str):
            config = config.to_json_best_effort(indent=2, sort_keys=True)
        files.write_atomic(files.as_path(workdir) / RUN_CONFIG_FILE, config + "\n")
