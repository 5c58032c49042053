"""Pretraining's config, read once: every field known, every value sane, before anything
compiles, and returned as frozen typed sections (`PretrainingSettings`) that the run, the loop
and the objective's halves take instead of the config.

A bad config raises a ValueError naming the field (`config.batch_size=...`), so that no run
spends minutes compiling before it fails.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
from absl import logging

from albert_jax import optim
from albert_jax.data.instances import OBJECTIVES
from albert_jax.model.config import ModelConfig, model_config_from
from albert_jax.pretrain.prepare import PrepareSettings
from albert_jax.run_config import (
    LoopSettings,
    MeshSettings,
    check_known_fields,
    run_sections,
)


def reference_config() -> Any:
    """The fields a pretraining config may have: those `configs/pretrain.py` sets (the same
    for every size and arg)."""
    from configs import pretrain  # here, not at the top: only the checks read the config file

    return pretrain.get_config()


@dataclasses.dataclass(frozen=True)
class PretrainingSettings:
    """A pretraining config as `validate_config` read it: one frozen section per reader."""

    model_config: ModelConfig
    mesh: MeshSettings
    loop: LoopSettings
    optimizer: dict[str, Any]  # the checked fields of `optim.optimizer_values`
    data: Any  # the pipeline's `data.data_config.DataConfig` (masking included), validated
    prepare: PrepareSettings  # what `prepare` builds before the first step
    num_train_steps: int
    microbatches: int
    eval_split: str  # the held-out set's split and its number of batches
    eval_batches: int


def validate_config(
    config: Any, devices: Sequence[Any] | None = None, processes: int | None = None
) -> PretrainingSettings:
    """Checks a pretraining config against itself and the devices (default: this job's;
    `albert_jax.plan` passes a TPU slice's and its host count); nothing is compiled.

    Raises:
      ValueError naming the field and the fix: unknown fields, bad model fields, seq_len >
      max_position_embeddings, max_predictions_per_seq > seq_len, a batch that does not split
      over the data-parallel devices, processes and microbatches, a mesh that does not fit the
      devices, bad optimizer or data fields.

    Returns the config's sections (`PretrainingSettings`); nothing after this reads it.
    """
    if hasattr(config, "keys") and "task" in config:
        raise ValueError("config has a `task` field: that is a fine-tuning config (finetune.py)")
    check_known_fields(config, reference_config())
    model_config = model_config_from(config)
    objective = config.objective
    if objective not in OBJECTIVES:
        raise ValueError(f"config.objective={objective!r} must be one of {OBJECTIVES}")

    def positive(name: str, minimum: int = 1) -> int:
        value = config.get(name)
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
    mesh, loop = run_sections(config, model_config, devices)
    mesh_shape = mesh.shape
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
    optimizer = optim.optimizer_values(config)  # names the bad field
    from albert_jax.data.data_config import DataConfig

    data = DataConfig.from_config(config, process_count=processes)
    prepare = PrepareSettings.from_config(config)  # the read bounds of the input files too
    if data.masked_lm_prob == 0:  # valid for an ablation, else a slip
        if objective == "none":
            raise ValueError(
                "config.data.masked_lm_prob=0 with config.objective='none': no token is masked "
                "and there is no sentence-order task, so nothing would be trained"
            )
        logging.warning(
            "config.data.masked_lm_prob=0: no token is masked, so there is no MLM term (and no "
            "mlm_* metrics); only the sentence-order task trains"
        )
    return PretrainingSettings(
        model_config=model_config,
        mesh=mesh,
        loop=loop,
        optimizer=optimizer,
        data=data,
        prepare=prepare,
        num_train_steps=int(config.num_train_steps),
        microbatches=int(micro),
        eval_split=str(config.data.eval_split),
        eval_batches=int(config.eval_batches),
    )
