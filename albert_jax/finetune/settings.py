"""Fine-tuning config checks and what they derive: every field known, every value sane, before
anything is read or compiled; the task model's config and the optimizer's settings.

A bad config raises a ValueError naming the field (`config.batch_size=...`).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import jax
from jax.sharding import Mesh

from albert_jax.data import line_reading
from albert_jax.model.config import RUNTIME_FIELDS, ModelConfig
from albert_jax.run_config import check_known_fields, keys_of
from albert_jax.tasks import registry
from albert_jax.tasks.registry import TaskSpec


def reference_config(task: str) -> Any:
    """The fields a fine-tuning config may have: those `configs/finetune.py` sets (the same
    for every task; a task without a preset there, e.g. wnli, is checked against the first)."""
    from configs import finetune  # here, not at the top: only the checks read the config file

    return finetune.get_config(f"task={task if task in finetune.TASKS else finetune.TASKS[0]}")


def validate_config(config: Any) -> TaskSpec:
    """Checks a fine-tuning config before anything is read or compiled.

    Raises ValueError naming the field: unknown fields (any that configs/finetune.py does not
    set, `reference_config`), an unknown task, bad sizes, non-positive steps or batch sizes.
    """
    spec = registry.get_task(config.task)
    check_known_fields(config, reference_config(config.task))
    model_fields = {f.name for f in dataclasses.fields(ModelConfig)}
    unknown = sorted(set(keys_of(config.model)) - model_fields)
    if unknown:
        raise ValueError(
            f"config.model has unknown fields {unknown}; known: {sorted(model_fields)}"
        )
    for name in ("init_run_seed", "init_dont_load"):
        if config.get(name) not in (None, "") and not config.init:
            raise ValueError(f"config.{name}={config[name]!r} needs a config.init to apply to")
    dont_load_patterns(config.get("init_dont_load", ""))  # each one a regular expression
    if config.init:
        # num_hidden_layers: an all-shared model runs at any depth (checked against the
        # checkpoint's config in `model_config`, once it is read).
        fixed = sorted(set(keys_of(config.model)) - set(RUNTIME_FIELDS) - {"num_hidden_layers"})
        if fixed:
            raise ValueError(
                f"config.model.{fixed[0]} cannot change a pretrained model (init={config.init!r});"
                f" only {RUNTIME_FIELDS} and num_hidden_layers (all-shared models) may be set"
            )
    for name in ("batch_size", "eval_batch_size", "max_seq_length", "log_every_steps", "num_seeds"):
        if int(config[name]) < 1:
            raise ValueError(f"config.{name} must be >= 1, got {config[name]}")
    if config.num_train_epochs <= 0 and config.num_train_steps < 0:
        raise ValueError(f"config.num_train_steps must be >= 0, got {config.num_train_steps}")
    if not 0.0 <= config.classifier_dropout < 1.0:
        raise ValueError(
            f"config.classifier_dropout must be in [0, 1), got {config.classifier_dropout}"
        )
    if not 0.0 <= config.warmup_fraction < 1.0:
        raise ValueError(f"config.warmup_fraction must be in [0, 1), got {config.warmup_fraction}")
    line_reading.LineLimits.from_config(
        config.data, "config.data"
    )  # max_line_bytes, max_blank_lines
    return spec


def dont_load_patterns(value: str) -> list[re.Pattern]:
    """`config.init_dont_load`'s comma-separated regular expressions ("classifier/.*,
    albert/pooler/.*"), each matched against a whole weight path (`merge_pretrained`).

    Raises:
      ValueError: naming the field and the expression that does not compile.
    """
    patterns = []
    for text in (t.strip() for t in value.split(",")):
        if not text:
            continue
        try:
            patterns.append(re.compile(text))
        except re.error as e:
            raise ValueError(
                f"config.init_dont_load: {text!r} is no regular expression ({e})"
            ) from e
    return patterns


def model_config(
    config: Any, pretrained_config: ModelConfig | None, vocab_size: int
) -> ModelConfig:
    """The task model's config: the checkpoint's (at `config.model.num_hidden_layers` when set,
    see `ModelConfig.with_depth`) with the runtime fields of `config.model`, else the `size`
    preset with `config.model`.

    Raises:
      ValueError: a depth the checkpoint's weights cannot run at, a max_seq_length beyond the
        model's positions, a tokenizer larger than the vocabulary.
    """
    model = config.model.to_dict() if hasattr(config.model, "to_dict") else config.model
    overrides = {k: v for k, v in model.items() if v is not None}  # None: not set
    if pretrained_config is not None:
        depth = overrides.pop("num_hidden_layers", pretrained_config.num_hidden_layers)
        model_config = pretrained_config.with_depth(depth).replace(**overrides)
    else:
        overrides.setdefault("vocab_size", vocab_size)
        model_config = ModelConfig.preset(config.size, **overrides)
    if config.max_seq_length > model_config.max_position_embeddings:
        raise ValueError(
            f"config.max_seq_length={config.max_seq_length} exceeds the model's "
            f"max_position_embeddings={model_config.max_position_embeddings}"
        )
    if model_config.vocab_size < vocab_size:
        raise ValueError(
            f"the tokenizer has {vocab_size} pieces but the model only {model_config.vocab_size} "
            "embeddings: use the checkpoint's tokenizer (unset config.data.tokenizer)"
        )
    return model_config


def check_batch(name: str, value: int, mesh: Mesh) -> None:
    check_batch_split(name, value, mesh.shape["data"] * mesh.shape["fsdp"], jax.process_count())


def check_batch_split(name: str, value: int, split: int, processes: int) -> None:
    """Raises ValueError naming `config.<name>` unless it splits over `split` data-parallel
    devices and `processes` processes."""
    if value % split or value % processes:
        raise ValueError(
            f"config.{name}={value} must be divisible by the {split} data-parallel devices and "
            f"the {processes} processes"
        )


def optimizer_config(config: Any, num_train_steps: int) -> dict[str, Any]:
    warmup = config.warmup_steps
    if config.warmup_fraction > 0:
        warmup = int(round(config.warmup_fraction * num_train_steps))
    warmup = min(int(warmup), num_train_steps)
    fields = ("optimizer", "learning_rate", "weight_decay", "grad_clip_norm", "b1", "b2", "eps",
              "lr_poly_power")  # fmt: skip
    return {
        **{k: config[k] for k in fields},
        "warmup_steps": warmup,
        "num_train_steps": max(num_train_steps, 1),
    }
