"""What the analysis CLIs (`depth`, `layer_transitions`) share: a checkpoint, the held-out
pretraining batches it is measured on, and the device mesh that runs them.

The batches are those of the checkpoint's own run by default: a training step dir's `meta`
holds the run config (the loop saves it with every checkpoint), so `--init=WORKDIR` evaluates
on exactly the held-out set that run's `eval_*` metrics came from
(`pipeline.make_eval_iterator`, same sources, seed, sequence length and batch size). A
checkpoint without one (a model dir, an HF or TF1 dir) needs `--config=configs/pretrain.py:...`.
`--data`, `--data_dir` and `--batch_size` change the data of either.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
from collections.abc import Iterator, Mapping
from typing import Any

import flax.linen as nn
import jax
import ml_collections
import numpy as np
from absl import flags
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from albert_jax import files
from albert_jax.pretrain.heldout import majority_accuracies
from albert_jax.runtime import checkpoint_dirs
from albert_jax.sharding import LOGICAL_AXIS_RULES, batch_sharding, create_mesh, put_batch

Batch = dict[str, np.ndarray]


@dataclasses.dataclass
class Heldout:
    """A loaded checkpoint (`pretrained.Pretrained`), the pretraining config of its held-out
    data, that data's batches (host numpy, the batch contract of `albert_jax.data.pipeline` plus
    `example_weight [B]`) and the mesh they are sharded over (all local devices on the batch
    axis when they divide it, else one device)."""

    pretrained: Any
    config: ml_collections.ConfigDict
    batches: list[Batch]
    mesh: Mesh

    def params(self) -> Any:
        """The checkpoint's inner params tree, replicated over the mesh."""
        replicated = NamedSharding(self.mesh, PartitionSpec())
        return jax.device_put(self.pretrained.params, replicated)

    def placed_batches(self) -> list[dict[str, jax.Array]]:
        """The batches as global arrays [B, ...], rows split over the mesh's batch axes."""
        sharding = batch_sharding(self.mesh)
        return [put_batch(b, sharding, len(b["input_ids"])) for b in self.batches]

    def baselines(self) -> dict[str, float]:
        """Accuracy of the most frequent masked token / SOP label of the batches."""
        return majority_accuracies(self.batches, self.pretrained.config.vocab_size)

    @contextlib.contextmanager
    def context(self) -> Iterator[None]:
        """The mesh and logical-axis rules the model's sharding constraints read (as in the
        training loop)."""
        with jax.set_mesh(self.mesh), nn.logical_axis_rules(LOGICAL_AXIS_RULES):
            yield


def define_flags() -> None:
    """The flags both analysis CLIs take; defined only when one runs as a program, so that
    importing these modules adds no flag."""
    from ml_collections import config_flags

    config_flags.DEFINE_config_file(
        "config",
        None,
        "Pretraining config of the held-out data, e.g. configs/pretrain.py:size=tiny,data=demo "
        "(default: the run config stored in the --init checkpoint).",
        lock_config=True,
    )
    flags.DEFINE_string(
        "init", None, "Checkpoint: training workdir or step dir, model dir, HF or TF1 dir."
    )
    flags.DEFINE_string("data", None, "Held-out documents: a source spec (config.data.sources).")
    flags.DEFINE_string("data_dir", None, "TFDS data dir of the sources (config.data.data_dir).")
    flags.DEFINE_integer("batch_size", 0, "Sequences per held-out batch (0: the config's).")
    flags.DEFINE_integer("eval_batches", 4, "Held-out batches to measure on.")
    flags.DEFINE_string("out", ".", "Directory for the JSON and PNG outputs (local or gs://).")
    flags.DEFINE_bool("json", False, "Print the results as one JSON line on stdout.")
    flags.mark_flag_as_required("init")


def load_from_flags() -> Heldout:
    """`load` with the values of `define_flags`' flags."""
    FLAGS = flags.FLAGS
    return load(
        FLAGS.init,
        FLAGS.config,
        num_batches=FLAGS.eval_batches,
        data=FLAGS.data,
        data_dir=FLAGS.data_dir,
        batch_size=FLAGS.batch_size,
    )


def run_config_of(init: str) -> ml_collections.ConfigDict | None:
    """The pretraining run config stored with a training checkpoint (workdir or step dir), or
    None: another layout, or a fine-tuning checkpoint (its config has a `task`)."""
    from albert_jax.pretrained import detect_layout

    layout = detect_layout(init)
    if layout not in ("workdir", "step_dir"):
        return None
    step_dir = checkpoint_dirs.latest_step_dir(init) if layout == "workdir" else init
    meta = checkpoint_dirs.read_json_item(files.as_path(step_dir) / "meta")
    config = meta.get("config") if isinstance(meta, Mapping) else None
    if not isinstance(config, Mapping) or "task" in config:
        return None
    return ml_collections.ConfigDict(json.loads(json.dumps(config)))


def data_config(
    init: str,
    config: ml_collections.ConfigDict | None = None,
    *,
    data: str | None = None,
    data_dir: str | None = None,
    batch_size: int = 0,
) -> ml_collections.ConfigDict:
    """The pretraining config whose held-out split is measured: `config`, else the run config
    of `init`, with the data overrides applied.

    Raises:
      ValueError: no config given and `init` stores none; a non-positive batch size.
    """
    if config is None:
        config = run_config_of(init)
        if config is None:
            raise ValueError(
                f"--init={init!r} stores no pretraining run config (it is not a training workdir "
                "or step dir of a pretraining run): pass the held-out data's config, e.g. "
                "--config=configs/pretrain.py:size=tiny,data=demo"
            )
    else:
        config = ml_collections.ConfigDict(config.to_dict())  # a copy we may change
    if data:
        config.data.sources = data
    if data_dir:
        config.data.data_dir = data_dir
    if batch_size:
        if batch_size < 1:
            raise ValueError(f"--batch_size must be >= 1, got {batch_size}")
        config.batch_size = batch_size
    return config


def load(
    init: str,
    config: ml_collections.ConfigDict | None = None,
    *,
    num_batches: int = 4,
    data: str | None = None,
    data_dir: str | None = None,
    batch_size: int = 0,
) -> Heldout:
    """The checkpoint `init` and `num_batches` held-out batches of its pretraining data (see
    `data_config`); local TFDS sources are built if they are not yet.

    Raises:
      ValueError: a bad `num_batches`, no data config, no tokenizer, a vocabulary mismatch.
    """
    from albert_jax.data import pipeline
    from albert_jax.data.tokenizer import Tokenizer
    from albert_jax.pretrain.prepare import PrepareSettings, build_sources
    from albert_jax.pretrained import load_pretrained

    if num_batches < 1:
        raise ValueError(f"--eval_batches must be >= 1, got {num_batches}")
    config = data_config(init, config, data=data, data_dir=data_dir, batch_size=batch_size)
    pretrained = load_pretrained(init)
    tokenizer = pretrained.tokenizer
    if tokenizer is None:
        path = config.data.get("tokenizer")
        if not path:
            raise ValueError(f"{init} has no tokenizer: set config.data.tokenizer")
        tokenizer = Tokenizer(model_proto=files.as_path(path).read_bytes())
    if tokenizer.vocab_size > pretrained.config.vocab_size:
        raise ValueError(
            f"the tokenizer has {tokenizer.vocab_size} pieces, the model of {init} only "
            f"{pretrained.config.vocab_size} embeddings"
        )
    build_sources(PrepareSettings.from_config(config))
    batches = list(
        pipeline.make_eval_iterator(
            config, tokenizer, split=config.data.eval_split, num_batches=num_batches
        )
    )
    return Heldout(pretrained, config, batches, _mesh(int(config.batch_size)))


def _mesh(rows: int) -> Mesh:
    devices = jax.local_devices()
    n = len(devices) if rows % len(devices) == 0 else 1
    return create_mesh((n, 1, 1), devices[:n])


def unmasked(batch: Mapping[str, np.ndarray]) -> Batch:
    """The batch with its masked positions given back their original tokens (`masked_lm_ids`
    where `masked_lm_weights` > 0): plain text, as a model reads at fine-tuning time."""
    ids = np.array(batch["input_ids"])
    rows, slots = np.nonzero(np.asarray(batch["masked_lm_weights"]) > 0)
    ids[rows, batch["masked_lm_positions"][rows, slots]] = batch["masked_lm_ids"][rows, slots]
    return {**batch, "input_ids": ids}


def output_path(out_dir: str, name: str) -> str:
    """OUT_DIR/name, creating OUT_DIR."""
    root = files.as_path(out_dir)
    root.mkdir(parents=True, exist_ok=True)
    return str(root / name)
