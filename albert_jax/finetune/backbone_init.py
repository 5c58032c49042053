"""The pretrained start of a fine-tuning run: `config.init` read once (any layout
`pretrained.read_checkpoint` reads; of a checkpoint of several seeds, the run of
`config.init_run_seed`), its weights merged into the task model by path and shape except those
of the don't-load list (`config.init_dont_load`), and the report of what was loaded,
initialized or left unused. The loop initializes whatever is not loaded
(`train_state.create_state`'s `initialize`), so nothing here draws a random number.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from albert_jax.pretrained import Checkpoint, read_checkpoint


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


def read_init(config: Any) -> Checkpoint | None:
    """The one read of `config.init` (None without one), the run of `config.init_run_seed`."""
    if not config.init:
        return None
    return read_checkpoint(config.init, run_seed=config.get("init_run_seed"))


def merge_pretrained(
    fresh: Mapping[str, Any],
    checkpoint: Mapping[str, np.ndarray],
    dont_load: Sequence[re.Pattern] = (),
) -> tuple[dict[str, np.ndarray], list[str], list[str]]:
    """The checkpoint arrays the task model takes: every one whose path and shape it has,
    unless the path fully matches a `dont_load` pattern.

    Args:
      fresh: {path: array or ShapeDtypeStruct} of the task model (only shapes are read), one
        seed's (no seed axis).
      checkpoint: {path: array} of what the checkpoint really holds (`Checkpoint.weights`).
      dont_load: weights initialized fresh even when the checkpoint has them (e.g. the task
        head of another fine-tuning run, `classifier/.*`).
    Returns:
      (loaded {path: array}, missing paths: initialized, unexpected paths: in the checkpoint
      and not loaded). A head weight of another shape (e.g. a classifier with other labels),
      or one not to load, is missing *and* unexpected.
    Raises:
      ValueError: a backbone (`albert/...`) weight to load has another shape than the model's.
    """
    loaded, missing = {}, []
    for path, value in fresh.items():
        stored = checkpoint.get(path)
        if stored is None or any(p.fullmatch(path) for p in dont_load):
            missing.append(path)
        elif tuple(stored.shape) == tuple(value.shape):
            loaded[path] = stored
        elif path.startswith("albert/"):
            raise ValueError(
                f"checkpoint {path} has shape {tuple(stored.shape)}, the model {tuple(value.shape)}"
            )
        else:
            missing.append(path)
    unexpected = sorted(p for p in checkpoint if p not in loaded)
    return loaded, missing, unexpected
