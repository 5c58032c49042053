"""The pretrained backbone of a fine-tuning run: the checkpoint's weights, merged into the task
model by path and shape, and the report of what was loaded, initialized or left unused."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import numpy as np

from albert_jax import checkpointing, trees


@dataclasses.dataclass
class InitReport:
    """Where the parameters came from: `loaded` / `missing` (initialized fresh) / `unexpected`
    (in the checkpoint, unused) parameter paths, "/"-joined under params."""

    path: str
    source: str
    loaded: list[str]
    missing: list[str]
    unexpected: list[str]

    def as_dict(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "source": self.source,
            "loaded": len(self.loaded),
            "missing": self.missing,
            "unexpected": self.unexpected,
        }


def merge_pretrained(
    fresh: Mapping[str, Any], checkpoint: Mapping[str, Any]
) -> tuple[dict[str, Any], list[str], list[str], list[str]]:
    """Takes every checkpoint array whose path and shape the task model has.

    Args:
      fresh: {path: array or ShapeDtypeStruct} of the task model (only shapes are read).
      checkpoint: {path: array} of what the checkpoint really holds.
    Returns:
      (merged {path: array}, loaded paths, missing paths, unexpected paths). A head weight of
      another shape (e.g. a classifier with other labels) is missing *and* unexpected.
    Raises:
      ValueError: a backbone (`albert/...`) weight has another shape than the model's.
    """
    merged, loaded, missing = {}, [], []
    for path, value in fresh.items():
        stored = checkpoint.get(path)
        if stored is not None and tuple(stored.shape) == tuple(value.shape):
            merged[path] = stored
            loaded.append(path)
            continue
        if stored is not None and path.startswith("albert/"):
            raise ValueError(
                f"checkpoint {path} has shape {tuple(stored.shape)}, the model {tuple(value.shape)}"
            )
        merged[path] = value
        missing.append(path)
    unexpected = sorted(p for p in checkpoint if p not in loaded)
    return merged, loaded, missing, unexpected


def load_checkpoint_weights(config: Any) -> tuple[Any, dict[str, np.ndarray]]:
    """(Pretrained, {path: array} of the weights the checkpoint really holds)."""
    from albert_jax.pretrained import load_pretrained

    pretrained = load_pretrained(config.init, seed=config.seed)
    flat = trees.flatten(pretrained.params["params"])
    # Parts load_pretrained had to initialize were not in the checkpoint.
    absent = tuple(part + "/" for part in pretrained.initialized)
    stored = {k: np.asarray(v) for k, v in flat.items() if not k.startswith(absent)}
    # Task-head weights of another fine-tuning run: `load_pretrained` keeps only the
    # pretraining model, so they are read from its checkpoint directly.
    stored.update(checkpointing.task_head_weights(config.init))
    return pretrained, stored
