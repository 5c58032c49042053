"""albert_jax: ALBERT in JAX/Flax.

Public names are imported lazily so that `import albert_jax.data` (used by input workers)
does not pull in Flax, and command-line tools start fast.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_LAZY = {
    "ModelConfig": "albert_jax.model.config",
    "AlbertModel": "albert_jax.model.albert",
    "AlbertForPreTraining": "albert_jax.model.albert",
    "load_pretrained": "albert_jax.pretrained",
    "Pretrained": "albert_jax.pretrained",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'albert_jax' has no attribute {name!r}")
