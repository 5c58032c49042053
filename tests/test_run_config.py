"""The run helpers of albert_jax/run_config.py, and the known-fields check against the config
files' own fields (no list of names kept by hand)."""

import re

import pytest

from albert_jax.finetune import settings as finetune_config
from albert_jax.pretrain import settings as train_config
from albert_jax.run_config import check_known_fields, config_field, with_fields
from configs import finetune, pretrain, table5


def _set(config, dotted, value):
    """`config` (a copy, unlocked as code may) with the dotted field set, new or not."""
    config = config.copy_and_resolve_references()
    with config.unlocked():
        node = config
        *parents, leaf = dotted.split(".")
        for part in parents:
            node = node[part]
        node[leaf] = value
    return config


def test_every_config_file_passes_its_own_check():
    reference = train_config.reference_config()
    for size in pretrain.SIZES:
        check_known_fields(pretrain.get_config(f"size={size},objective=nsp"), reference)
    check_known_fields(table5.get_config("objective=none"), reference)
    for task in finetune.TASKS:
        check_known_fields(
            finetune.get_config(f"task={task}"), finetune_config.reference_config(task)
        )


@pytest.mark.parametrize(
    "dotted", ["lerning_rate", "data.tokeniser", "mesh.slice", "debug.nan_at_stp"]
)
def test_unknown_fields_are_named_with_the_known_ones(dotted):
    reference = train_config.reference_config()
    config = _set(pretrain.get_config("size=tiny"), dotted, 1)
    section, _, _ = dotted.rpartition(".")
    known = sorted((reference[section] if section else reference).keys())
    where = f"config.{section}" if section else "config"
    expected = f"unknown field(s) ['config.{dotted}']; known fields of {where}: {known}"
    with pytest.raises(ValueError, match=re.escape(expected)):
        check_known_fields(config, reference)


def test_sections_of_each_kind_of_run_are_their_own():
    # Pretraining's debug hooks are not fine-tuning's: each config is checked against its file.
    config = _set(finetune.get_config("task=rte"), "debug.nan_at_step", 1)
    with pytest.raises(ValueError, match=re.escape("['config.debug.nan_at_step']")):
        finetune_config.validate_config(config)
    config = _set(pretrain.get_config("size=tiny"), "num_seeds", 2)
    with pytest.raises(ValueError, match=re.escape("['config.num_seeds']")):
        train_config.validate_config(config)
    # A task without a preset in configs/finetune.py is checked against the same fields.
    config = finetune.get_config("task=rte")
    config.task = "wnli"
    finetune_config.validate_config(config)


def test_model_fields_are_checked_against_model_config():
    # config.model is skipped here: its fields are ModelConfig's, not only those the file sets.
    config = _set(finetune.get_config("task=rte"), "model.hidden_size", 64)
    check_known_fields(config, finetune_config.reference_config("rte"))
    config = _set(pretrain.get_config("size=tiny"), "model.hidden_sise", 8)
    with pytest.raises(ValueError, match="config.model has unknown fields \\['hidden_sise'\\]"):
        train_config.validate_config(config)


def test_config_field_and_with_fields():
    config = pretrain.get_config("size=tiny")
    assert config_field(config, "mesh.data") == -1
    assert config_field(config, "mesh.nothing", 7) == 7
    assert config_field(config, "data.tokenizer", "unset") == "unset"  # None reads as unset
    changed = with_fields(config, **{"model.remat_policy": "full", "batch_size": 8})
    assert (changed.model.remat_policy, changed.batch_size) == ("full", 8)
    assert (config.model.remat_policy, config.batch_size) == ("dots", 32)  # a copy
