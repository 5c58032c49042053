"""What every run reads from its config beyond its own checks: dotted fields, copies with fields
set, the fields a config may have, the mesh layout (`config.mesh` over the devices), and
WORKDIR/config.json.

Pretraining (`train_config`), fine-tuning (`finetune_config`), the loop and `plan` share these.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from absl import logging

from albert_jax import files, sharding
from albert_jax.model.config import ModelConfig

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


def mesh_layout(
    config: Any,
    model_config: ModelConfig | None = None,
    devices: Sequence[Any] | None = None,
) -> tuple[tuple[int, int, int], tuple[Any, ...]]:
    """(mesh shape, devices) of `config.mesh` over `devices` (default: every device of the
    job): the explicit (data, fsdp, tensor) sizes, or with `config.mesh.auto` the layout
    `sharding.choose_mesh_shape` picks for `model_config` and the batch (logged).

    Raises:
      ValueError: naming `config.mesh` and the device count when the shape does not cover
        every device (a smaller mesh would leave devices idle while the log and MFU count
        them all), or a parameter dimension and mesh axis that do not divide.
    """
    devices = tuple(jax.devices() if devices is None else devices)
    reduce_dtype = config_field(config, "mesh.gradient_reduction_dtype", "float32")
    if reduce_dtype not in sharding.REDUCTION_DTYPES:
        raise ValueError(
            f"config.mesh.gradient_reduction_dtype={reduce_dtype!r} must be one of "
            f"{sharding.REDUCTION_DTYPES}"
        )
    if config_field(config, "mesh.auto", False):
        if model_config is None:
            raise ValueError("config.mesh.auto=True needs the model config to choose a layout")
        params = model_param_axes(model_config)
        resolved, why = sharding.choose_mesh_shape(
            params,
            len(devices),
            int(config.batch_size) // int(config_field(config, "microbatches", 1)),
            state_bytes_per_param=4 * jnp.dtype(model_config.param_dtype).itemsize,
            hbm_bytes=device_hbm_bytes(devices[0]),
        )
        logging.info("%s", why)
        return resolved, devices
    shape = tuple(
        int(config_field(config, f"mesh.{axis}", 1)) for axis in ("data", "fsdp", "tensor")
    )
    try:
        resolved = sharding.resolve_mesh_shape(shape, len(devices))
    except ValueError as e:
        raise ValueError(
            f"config.mesh (data, fsdp, tensor)={shape} does not fit the {len(devices)} devices "
            f"of this job ({e}); every device must be in the mesh: set one axis to -1 to fill "
            "it, e.g. --config.mesh.data=-1, or --config.mesh.auto=True"
        ) from None
    if model_config is not None:
        problems = sharding.unshardable(model_param_axes(model_config), resolved)
        if problems:
            raise ValueError(
                f"config.mesh (data, fsdp, tensor)={resolved} cannot shard the model: "
                f"{problems[0]}" + (f" (and {len(problems) - 1} more)" if len(problems) > 1
                                    else "") + "; choose sizes that divide it or set "
                "--config.mesh.auto=True"
            )  # fmt: skip
    return resolved, devices  # type: ignore[return-value]


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
    """WORKDIR/config.json: the run's whole config (process 0; local or gs://)."""
    if jax.process_index() == 0:
        text = config.to_json_best_effort(indent=2, sort_keys=True) + "\n"
        files.write_atomic(files.as_path(workdir) / RUN_CONFIG_FILE, text)
