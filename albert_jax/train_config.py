"""Pretraining config checks: every field known, every value sane, before anything compiles.

`validate_config(config)` returns the resolved model config, mesh shape and devices; a bad
config raises a ValueError naming the field (`config.batch_size=...`), so that no run spends
minutes compiling before it fails.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from absl import logging

from albert_jax import files, line_reading, optim, sharding
from albert_jax.config import ModelConfig, model_config_from

PyTree = Any

# Every field the loop reads; anything else in a config is a typo (see `validate_config`).
KNOWN_FIELDS: dict[str, tuple[str, ...]] = {
    "": (
        "size", "model", "objective", "data", "batch_size", "seq_len",
        "max_predictions_per_seq", "microbatches", "optimizer", "learning_rate",
        "warmup_steps", "num_train_steps", "lr_poly_power", "weight_decay", "grad_clip_norm",
        "b1", "b2", "eps", "mesh", "seed", "log_every_steps", "eval_every_steps",
        "eval_batches", "checkpoint_every_steps", "keep_checkpoints", "resume_from",
        "init_from", "resume_strict", "compilation_cache_dir", "debug",
    ),
    "data": (
        "sources", "data_dir", "cache_dir", "tokenizer", "short_seq_prob", "masked_lm_prob",
        "max_ngram", "num_workers", "eval_split", "tokenizer_max_sentences",
        "sop_single_segment", "num_shards", "max_line_bytes", "max_blank_lines",
    ),
    "mesh": ("data", "fsdp", "tensor", "auto", "slices"),
    "debug": (
        "sigterm_after_step",
        "sigkill_after_save_at_step",
        "sigkill_after_commit_at_step",
        "nan_at_step",
    ),
}  # fmt: skip
OBJECTIVES = ("sop", "nsp", "none")
RUN_CONFIG_FILE = "config.json"


def config_field(config: Any, dotted: str, default: Any = None) -> Any:
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


def _keys(node: Any) -> list[str]:
    return list(node.keys()) if hasattr(node, "keys") else []


@dataclasses.dataclass(frozen=True)
class RunLayout:
    """What `validate_config` derives: the model config and the mesh to build."""

    model_config: ModelConfig
    mesh_shape: tuple[int, int, int]
    devices: tuple[Any, ...]


def validate_config(
    config: Any, devices: Sequence[Any] | None = None, processes: int | None = None
) -> RunLayout:
    """Checks a pretraining config against itself and the devices (default: this job's;
    `albert_jax.plan` passes a TPU slice's and its host count); nothing is compiled.

    Raises:
      ValueError naming the field and the fix: unknown fields, bad model fields, seq_len >
      max_position_embeddings, max_predictions_per_seq > seq_len, a batch that does not split
      over the data-parallel devices, processes and microbatches, a mesh that does not fit the
      devices, bad optimizer or data fields.
    """
    if "task" in _keys(config):
        raise ValueError("config has a `task` field: that is a fine-tuning config (finetune.py)")
    for section, allowed in KNOWN_FIELDS.items():
        node = config if not section else config_field(config, section, {})
        unknown = sorted(set(_keys(node)) - set(allowed))
        if unknown:
            where = f"config.{section}." if section else "config."
            raise ValueError(
                f"unknown field(s) {[where + k for k in unknown]}; known fields of "
                f"{where.rstrip('.')}: {sorted(allowed)}"
            )
    model_config = model_config_from(config)
    objective = config_field(config, "objective")
    if objective not in OBJECTIVES:
        raise ValueError(f"config.objective={objective!r} must be one of {OBJECTIVES}")

    def positive(name: str, minimum: int = 1) -> int:
        value = config_field(config, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise ValueError(f"config.{name} must be an integer >= {minimum}, got {value!r}")
        return value

    for name in ("num_train_steps", "log_every_steps", "checkpoint_every_steps",
                 "keep_checkpoints", "eval_batches", "seq_len", "max_predictions_per_seq",
                 "batch_size", "microbatches"):  # fmt: skip
        positive(name)
    for name in ("warmup_steps", "eval_every_steps", "seed"):
        positive(name, minimum=0)
    seq_len, batch = config.seq_len, config.batch_size
    if seq_len > model_config.max_position_embeddings:
        raise ValueError(
            f"config.seq_len={seq_len} exceeds config.model.max_position_embeddings="
            f"{model_config.max_position_embeddings}: lower seq_len or raise "
            "max_position_embeddings"
        )
    if config.max_predictions_per_seq > seq_len:
        raise ValueError(
            f"config.max_predictions_per_seq={config.max_predictions_per_seq} exceeds "
            f"config.seq_len={seq_len}: lower it (the paper uses 20 at seq_len 512)"
        )
    processes = jax.process_count() if processes is None else processes
    micro = config.microbatches
    if batch % (processes * micro):
        raise ValueError(
            f"config.batch_size={batch} is not divisible by process_count×microbatches="
            f"{processes}×{micro}: use a multiple of {processes * micro}"
        )
    mesh_shape, devices = mesh_layout(config, model_config, devices)
    dp = mesh_shape[0] * mesh_shape[1]
    if batch % dp:
        raise ValueError(
            f"config.batch_size={batch} is not divisible by the data-parallel size "
            f"data×fsdp={mesh_shape[0]}×{mesh_shape[1]}={dp}: use a multiple of {dp} "
            "or change config.mesh"
        )
    if (batch // micro) % dp:
        raise ValueError(
            f"config.microbatches={micro}: each microbatch of {batch // micro} sequences must "
            f"split over the {dp} data-parallel devices; use fewer microbatches or a larger "
            "batch_size"
        )
    optim.make_optimizer(config)  # optimizer fields (names the bad one)
    from albert_jax.data.pipeline import DataConfig

    DataConfig.from_config(config).validate(processes)
    # The read bounds of building the sources (prepare.build_sources).
    line_reading.LineLimits.from_config(config_field(config, "data"), "config.data")
    if config_field(config, "data.masked_lm_prob") == 0:  # valid for an ablation, else a slip
        if objective == "none":
            raise ValueError(
                "config.data.masked_lm_prob=0 with config.objective='none': no token is masked "
                "and there is no sentence-order task, so nothing would be trained"
            )
        logging.warning(
            "config.data.masked_lm_prob=0: no token is masked, the MLM loss is 0 and only the "
            "sentence-order task trains"
        )
    return RunLayout(model_config, mesh_shape, devices)


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
    from albert_jax.model import AlbertForPreTraining, init_params

    model = AlbertForPreTraining(model_config)
    boxed = jax.eval_shape(lambda: init_params(model, jax.random.key(0))["params"])
    return sharding.param_axes(boxed)


def device_hbm_bytes(device: Any) -> float | None:
    """Memory one accelerator device may use (its runtime's `bytes_limit`); None on a CPU or
    where the runtime does not say."""
    if device.platform == "cpu":
        return None
    try:
        stats = device.memory_stats()
    except Exception:  # compile-only devices and some runtimes have none
        return None
    return float(stats["bytes_limit"]) if stats and "bytes_limit" in stats else None


def write_run_config(config: Any, workdir: str) -> None:
    """WORKDIR/config.json: the run's whole config (process 0; local or gs://)."""
    if jax.process_index() == 0:
        text = config.to_json_best_effort(indent=2, sort_keys=True) + "\n"
        files.write_atomic(files.as_path(workdir) / RUN_CONFIG_FILE, text)
